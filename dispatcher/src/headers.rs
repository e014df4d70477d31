//! Header translation between HTTP and the wire's `Header` list, in both directions.
//!
//! Hop-by-hop headers (RFC 9110 7.6.1: `connection`, `keep-alive`, `proxy-*`, `te`,
//! `trailer`, `transfer-encoding`, `upgrade` and every header named in `Connection`) never
//! cross the dispatcher. The caller's `authorization` and the dispatcher's own
//! `x-relay-timeout-ms` are dropped from requests: the caller key must never reach the
//! customer's upstream. Everything else is kept byte for byte, repeated headers included.
//!
//! No I/O here.

use http::header::{HeaderMap, HeaderName, HeaderValue};
use relay_proto::Header;

/// Header a caller uses to set its call's deadline, in milliseconds.
pub const TIMEOUT_HEADER: &str = "x-relay-timeout-ms";

fn is_hop_by_hop(name: &str) -> bool {
    matches!(
        name,
        "connection" | "keep-alive" | "te" | "trailer" | "transfer-encoding" | "upgrade"
    ) || name.starts_with("proxy-")
}

/// Lowercased names listed in the `Connection` headers.
fn connection_tokens(headers: &HeaderMap) -> Vec<String> {
    headers
        .get_all(http::header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|t| t.trim().to_ascii_lowercase())
        .filter(|t| !t.is_empty())
        .collect()
}

fn keep(name: &HeaderName, tokens: &[String], request: bool) -> bool {
    let n = name.as_str();
    if is_hop_by_hop(n) || tokens.iter().any(|t| t == n) {
        return false;
    }
    !(request && (n == "authorization" || n == TIMEOUT_HEADER))
}

/// The caller's request headers as they go to the tunnel server.
pub fn request_to_wire(headers: &HeaderMap) -> Vec<Header> {
    let tokens = connection_tokens(headers);
    headers
        .iter()
        .filter(|(name, _)| keep(name, &tokens, true))
        .map(|(name, value)| Header::new(name.as_str(), value.as_bytes()))
        .collect()
}

/// The agent's response headers as they go to the caller. Headers that are not valid HTTP
/// are skipped and counted in the returned number.
pub fn response_from_wire(wire: &[Header]) -> (HeaderMap, usize) {
    let mut map = HeaderMap::with_capacity(wire.len());
    let mut invalid = 0;
    for h in wire {
        match (
            HeaderName::from_bytes(h.name.as_bytes()),
            HeaderValue::from_bytes(&h.value),
        ) {
            (Ok(name), Ok(value)) => {
                map.append(name, value);
            }
            _ => invalid += 1,
        }
    }
    let tokens = connection_tokens(&map);
    let mut out = HeaderMap::with_capacity(map.len());
    let mut last: Option<HeaderName> = None;
    for (name, value) in map {
        // `HeaderMap`'s owning iterator yields the name only for the first of repeated values.
        if let Some(name) = name {
            last = Some(name);
        }
        if let Some(name) = &last {
            if keep(name, &tokens, false) {
                out.append(name.clone(), value);
            }
        }
    }
    (out, invalid)
}

/// Bytes of a request head as counted against `max_header_bytes`.
pub fn head_size(method: &http::Method, uri: &http::Uri, headers: &HeaderMap) -> usize {
    let line = method.as_str().len() + uri.to_string().len() + 12;
    line + headers
        .iter()
        .map(|(n, v)| n.as_str().len() + v.len() + 4)
        .sum::<usize>()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut m = HeaderMap::new();
        for (n, v) in pairs {
            m.append(
                HeaderName::from_bytes(n.as_bytes()).unwrap(),
                HeaderValue::from_str(v).unwrap(),
            );
        }
        m
    }

    #[test]
    fn request_drops_hop_by_hop_credentials_and_connection_named_headers() {
        let h = map(&[
            ("authorization", "Bearer k"),
            ("connection", "keep-alive, X-Private"),
            ("x-private", "1"),
            ("keep-alive", "timeout=5"),
            ("proxy-authorization", "p"),
            ("te", "trailers"),
            ("x-relay-timeout-ms", "10"),
            ("accept", "a"),
            ("accept", "b"),
            ("x-bin", "v"),
        ]);
        let out: Vec<(String, Vec<u8>)> = request_to_wire(&h)
            .into_iter()
            .map(|h| (h.name, h.value))
            .collect();
        assert_eq!(
            out,
            vec![
                ("accept".to_string(), b"a".to_vec()),
                ("accept".to_string(), b"b".to_vec()),
                ("x-bin".to_string(), b"v".to_vec())
            ]
        );
    }

    #[test]
    fn response_keeps_repeated_headers_and_skips_invalid_ones() {
        let wire = vec![
            Header::new("set-cookie", "a=1"),
            Header::new("transfer-encoding", "chunked"),
            Header::new("set-cookie", "b=2"),
            Header::new("bad name", "x"),
            Header::new("x-ok", vec![0xff_u8]),
        ];
        let (h, invalid) = response_from_wire(&wire);
        assert_eq!(invalid, 1);
        let cookies: Vec<_> = h.get_all("set-cookie").iter().collect();
        assert_eq!(cookies, ["a=1", "b=2"]);
        assert!(h.get("transfer-encoding").is_none());
        assert_eq!(h.get("x-ok").unwrap().as_bytes(), [0xff]);
    }
}
