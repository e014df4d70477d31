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

/// Removes every hop-by-hop header from `headers`.
pub fn strip(headers: &mut HeaderMap) {
    let named = connection_named(headers);
    let gone: Vec<HeaderName> = headers
        .keys()
        .filter(|n| drops(n, &named))
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
}
