//! The one set of hop-by-hop header rules, applied wherever a message crosses a relay hop
//! (the dispatcher's front, the agent before its filters and its upstream): the headers of
//! RFC 9110 7.6.1 (`connection`, `keep-alive`, `te`, `trailer`, `transfer-encoding`,
//! `upgrade`), every `proxy-*` header (`proxy-connection`, `proxy-authorization`, ...: they
//! describe a hop, never the message) and every header a `Connection` value names.
//!
//! `Connection` values are read as bytes, so a value holding one non-ASCII byte cannot hide
//! the names listed beside it.

use http::header::{HeaderMap, HeaderName, CONNECTION};

/// Whether `name` (lowercase, as `HeaderName` keeps it) is hop-by-hop by itself.
pub fn is_hop_by_hop(name: &str) -> bool {
    matches!(
        name,
        "connection" | "keep-alive" | "te" | "trailer" | "transfer-encoding" | "upgrade"
    ) || name.starts_with("proxy-")
}

/// The header names listed in `headers`' `Connection` values.
pub fn connection_named(headers: &HeaderMap) -> Vec<HeaderName> {
    headers
        .get_all(CONNECTION)
        .iter()
        .flat_map(|v| v.as_bytes().split(|b| *b == b','))
        .filter_map(|n| HeaderName::from_bytes(n.trim_ascii()).ok())
        .collect()
}

/// Whether `name` leaves a message at a hop, given the `Connection`-named headers.
pub fn drops(name: &HeaderName, named: &[HeaderName]) -> bool {
    is_hop_by_hop(name.as_str()) || named.contains(name)
}

/// Whether a `Connection` value among `connection` lists `name` (compared as bytes,
/// ignoring ASCII case, as `HeaderName` would read the token).
fn listed(connection: &http::header::GetAll<'_, http::HeaderValue>, name: &HeaderName) -> bool {
    connection.iter().any(|v| {
        v.as_bytes().split(|b| *b == b',').any(|t| {
            t.trim_ascii()
                .eq_ignore_ascii_case(name.as_str().as_bytes())
        })
    })
}

/// Removes every hop-by-hop header from `headers`. It runs on every message at every hop,
/// so a message with none costs one look at each name and no allocation, and the names to
/// remove of one with a few (the usual `Connection: keep-alive`) are listed on the stack.
pub fn strip(headers: &mut HeaderMap) {
    // `Connection` is hop-by-hop itself: with no such header nothing is named.
    if !headers.keys().any(|n| is_hop_by_hop(n.as_str())) {
        return;
    }
    let connection = headers.get_all(CONNECTION);
    // The usual values name no header left to look for: `close`, and `keep-alive`, which
    // is hop-by-hop by itself.
    let names_others = connection.iter().any(|v| {
        v.as_bytes().split(|b| *b == b',').any(|t| {
            let t = t.trim_ascii();
            !t.eq_ignore_ascii_case(b"close") && !t.eq_ignore_ascii_case(b"keep-alive")
        })
    });
    let gone: smallvec::SmallVec<[HeaderName; 4]> = headers
        .keys()
        .filter(|n| is_hop_by_hop(n.as_str()) || (names_others && listed(&connection, n)))
        .cloned()
        .collect();
    for n in gone {
        headers.remove(n);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    #[test]
    fn hop_by_hop_proxy_and_connection_named_headers_go_the_rest_stays() {
        let mut h = HeaderMap::new();
        h.insert("connection", HeaderValue::from_static("close, X-Private"));
        h.insert("x-private", HeaderValue::from_static("1"));
        h.insert("transfer-encoding", HeaderValue::from_static("chunked"));
        h.insert("te", HeaderValue::from_static("trailers"));
        h.insert("proxy-authorization", HeaderValue::from_static("Basic x"));
        h.insert("proxy-anything", HeaderValue::from_static("1"));
        h.insert("proxy", HeaderValue::from_static("http://evil"));
        h.insert("content-type", HeaderValue::from_static("text/plain"));
        strip(&mut h);
        let mut left: Vec<&str> = h.keys().map(|k| k.as_str()).collect();
        left.sort_unstable();
        // `Proxy` (no dash) is not hop-by-hop; the agent strips it as a spoofing header.
        assert_eq!(left, ["content-type", "proxy"]);
    }

    #[test]
    fn a_non_ascii_byte_in_connection_hides_no_name() {
        let mut h = HeaderMap::new();
        h.insert(
            "connection",
            HeaderValue::from_bytes(b"x-private, \xff").unwrap(),
        );
        h.insert("x-private", HeaderValue::from_static("1"));
        strip(&mut h);
        assert!(h.is_empty(), "{h:?}");
    }

    #[test]
    fn names_in_every_connection_value_go_in_any_case_and_spacing() {
        let mut h = HeaderMap::new();
        h.append("connection", HeaderValue::from_static("Keep-Alive ,  X-A"));
        h.append("connection", HeaderValue::from_static("x-B"));
        for name in ["keep-alive", "x-a", "x-b", "x-c"] {
            h.append(name, HeaderValue::from_static("1"));
        }
        h.append("x-c", HeaderValue::from_static("2"));
        strip(&mut h);
        let left: Vec<(&str, &[u8])> = h.iter().map(|(n, v)| (n.as_str(), v.as_bytes())).collect();
        assert_eq!(left, [("x-c", &b"1"[..]), ("x-c", &b"2"[..])]);
    }

    #[test]
    fn a_message_without_hop_headers_is_left_as_it_was() {
        let mut h = HeaderMap::new();
        h.append("content-type", HeaderValue::from_static("text/plain"));
        h.append("x-keep", HeaderValue::from_static("a"));
        h.append("x-keep", HeaderValue::from_static("b"));
        let before = h.clone();
        strip(&mut h);
        assert_eq!(h, before);
    }
}
