//! Header translation between HTTP and a head's list of `Header` records, in both
//! directions.
//!
//! Hop-by-hop headers (`relay_common::hop`: RFC 9110 7.6.1, `proxy-*` and every header
//! named in `Connection`) never cross the dispatcher. The caller's `authorization` and the dispatcher's own
//! `x-relay-timeout-ms` are dropped from requests: the caller key must never reach the
//! customer's upstream. Everything else is kept byte for byte, repeated headers included.
//!
//! No I/O here.

use bytes::Bytes;
use http::header::{HeaderMap, HeaderName, HeaderValue};

/// Header a caller uses to set its call's deadline, in milliseconds.
pub const TIMEOUT_HEADER: &str = "x-relay-timeout-ms";

fn keep(name: &HeaderName, named: &[HeaderName], request: bool) -> bool {
    if relay_common::hop::drops(name, named) {
        return false;
    }
    let n = name.as_str();
    !(request && (n == "authorization" || n == TIMEOUT_HEADER))
}

/// The caller's request headers as they go to the tunnel server.
pub fn request_to_wire(headers: &HeaderMap) -> Vec<Bytes> {
    let tokens = relay_common::hop::connection_named(headers);
    relay_proto::wire_headers(|| {
        headers
            .iter()
            .filter(|(name, _)| keep(name, &tokens, true))
            .map(|(name, value)| (name.as_str().as_bytes(), value.as_bytes()))
    })
}

/// The agent's response headers as they go to the caller. Headers that are not valid HTTP
/// (or records that are not a `Header`) are skipped and counted in the returned number, and
/// so are those past what a `HeaderMap` can hold.
///
/// The caller checks the head against `max_response_headers` first; even so the map is
/// sized by the peer's count only up to 64 (`HeaderMap::with_capacity` panics past 32768
/// entries), and `try_append` never panics.
pub fn response_from_wire(wire: &[Bytes]) -> (HeaderMap, usize) {
    // The names listed in the response's valid `Connection` values (`HeaderName` parsing
    // folds case, as `eq_ignore_ascii_case` does here).
    let tokens: Vec<HeaderName> = wire
        .iter()
        .filter_map(|record| relay_proto::parse_header(record).ok())
        .filter(|(name, value)| {
            name.eq_ignore_ascii_case(http::header::CONNECTION.as_str().as_bytes())
                && HeaderValue::from_bytes(value).is_ok()
        })
        .flat_map(|(_, value)| value.split(|b| *b == b','))
        .filter_map(|n| HeaderName::from_bytes(n.trim_ascii()).ok())
        .collect();
    // One map, sized once (a head is checked against `max_response_headers` before; the
    // bound keeps a huge head from reserving up front); values share the frame's bytes.
    let mut out = HeaderMap::with_capacity(wire.len().min(64));
    let mut invalid = 0;
    for record in wire {
        let Ok((name, value)) = relay_proto::parse_header(record) else {
            invalid += 1;
            continue;
        };
        match (
            HeaderName::from_bytes(name),
            HeaderValue::from_maybe_shared(record.slice_ref(value)),
        ) {
            (Ok(name), Ok(value)) => {
                if keep(&name, &tokens, false) && out.try_append(name, value).is_err() {
                    invalid += 1;
                }
            }
            _ => invalid += 1,
        }
    }
    (out, invalid)
}

/// The tunnel id a response's `Location` sends its follower to on this front, when that is
/// not `tunnel_id`: a backend that follows redirects would resend its caller key and body
/// into another tenant's tunnel, so the front refuses such a response (502
/// `bad_response`).
///
/// `location` is resolved against the request (`request_path` on `request_host`) by the
/// `url` crate, the WHATWG URL parser that reqwest, browsers and Node's fetch follow: tabs
/// and newlines dropped, `\` read as `/`, dot segments removed (`%2e` counts as a dot),
/// relative, scheme-relative and absolute references alike. The hosts are compared after
/// WHATWG host parsing, as a client that connects would see them: percent-decoded and
/// IDNA-mapped names (`%72elay.example`, fullwidth letters), IPv4 in any form
/// (`2130706433`, `0x7f.1`, `0177.0.0.1`), IPv4-mapped IPv6 (`[::ffff:127.0.0.1]`) as the
/// IPv4 address it reaches, a trailing dot ignored; ports are ignored. The front cannot
/// know which scheme its caller used (TLS may end at a load balancer before it), so the
/// location is resolved against both `http` and `https` and refused when either reading
/// leads into another tunnel (`https:/relay/other/x` is relative under `https`). The tunnel
/// id segment is percent-decoded. Locations on other hosts, other schemes and paths outside
/// `/relay/` pass unchanged.
pub fn redirect_into_other_tunnel(
    location: &[u8],
    request_path: &str,
    request_host: Option<&str>,
    tunnel_id: &str,
) -> Option<String> {
    let location = String::from_utf8_lossy(location);
    // The front's own host as a client parses it. A request without one (HTTP/1.0 without
    // `Host`) still resolves relative references against a name no real host has.
    let host = request_host.unwrap_or("relay-front.invalid");
    ["https", "http"].into_iter().find_map(|scheme| {
        let base = url::Url::parse(&format!("{scheme}://{host}/"))
            .ok()?
            .join(request_path)
            .ok()?;
        let target = base.join(&location).ok()?;
        if !matches!(target.scheme(), "http" | "https") || !same_host(&base, &target) {
            return None;
        }
        let mut segments = target.path_segments()?;
        if segments.next() != Some("relay") {
            return None;
        }
        let id = percent_encoding::percent_decode_str(segments.next()?)
            .decode_utf8_lossy()
            .into_owned();
        (id != tunnel_id).then_some(id)
    })
}

/// Whether two parsed URLs name one host, ports ignored: the `url` crate has already
/// lowercased, percent-decoded and IDNA-mapped names and read IPv4 in every form; an
/// IPv4-mapped IPv6 address is the IPv4 address it reaches, and a name's trailing dot is
/// the same name.
fn same_host(a: &url::Url, b: &url::Url) -> bool {
    use std::net::IpAddr;
    use url::Host;
    fn canonical(h: Host<&str>) -> Host<String> {
        match h {
            Host::Domain(d) => Host::Domain(d.trim_end_matches('.').to_string()),
            Host::Ipv4(v4) => Host::Ipv4(v4),
            Host::Ipv6(v6) => match IpAddr::V6(v6).to_canonical() {
                IpAddr::V4(v4) => Host::Ipv4(v4),
                IpAddr::V6(v6) => Host::Ipv6(v6),
            },
        }
    }
    match (a.host(), b.host()) {
        (Some(a), Some(b)) => canonical(a) == canonical(b),
        _ => false,
    }
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
            .iter()
            .map(|r| relay_proto::Header::parse(r).unwrap())
            .map(|h| (h.name_str().into_owned(), h.value.to_vec()))
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

    /// Hostile `Location` values a tunnel's upstream may answer a call to
    /// `/relay/demo/app/page` on `relay.example:8443` with, and the other tunnel id each
    /// one leads a redirect-following backend into (`None`: it stays in `demo` or leaves
    /// this front).
    const REDIRECTS: &[(&str, Option<&str>)] = &[
        ("/relay/other/x", Some("other")),
        ("/relay/other", Some("other")),
        ("https://relay.example:8443/relay/other/x", Some("other")),
        ("http://RELAY.EXAMPLE/relay/other/x?q=1", Some("other")),
        ("//relay.example/relay/other/x", Some("other")),
        ("https://user@relay.example/relay/other/", Some("other")),
        ("../../other/x", Some("other")),
        ("../../../relay/other/x", Some("other")),
        ("/relay/demo/../other/x", Some("other")),
        ("/relay/demo/%2e%2e/other/x", Some("other")),
        ("/relay/demo/%2E%2E/other/x", Some("other")),
        ("\\relay\\other\\x", Some("other")),
        ("/rel\tay/other/x", Some("other")),
        ("/relay/%6fther/x", Some("other")),
        ("https:/relay/other/x", Some("other")),
        ("  /relay/other/x  ", Some("other")),
        ("/relay/demo/next", None),
        ("next", None),
        ("../other-page", None),
        ("/login", None),
        ("https://elsewhere.example/relay/other/x", None),
        ("//elsewhere.example/relay/other/x", None),
        ("mailto:x@relay.example", None),
        ("/relayother/x", None),
        ("", None),
        // Host spellings a WHATWG parser (reqwest, browsers, Node's fetch) reads as this
        // front: percent-encoded, IDNA-mapped, a trailing dot, the scheme's slashes left out.
        ("https://%72elay.example/relay/other/x", Some("other")),
        ("https://relay%2Eexample:8443/relay/other/x", Some("other")),
        ("https://RELAY.EXAMPLE.:8443/relay/other/x", Some("other")),
        (
            "https://\u{ff52}\u{ff45}lay.example/relay/other/x",
            Some("other"),
        ),
        ("https://relay\u{3002}example/relay/other/x", Some("other")),
        ("http:relay.example/relay/other/x", Some("other")),
        ("https:\\\\relay.example\\relay\\other", Some("other")),
        (
            "https://relay.example:8443@relay.example/relay/other/x",
            Some("other"),
        ),
        (
            "https://relay.example\\@elsewhere.example/relay/other/x",
            None,
        ),
        ("https://relay.example.evil/relay/other/x", None),
        (
            "https://relay.example@elsewhere.example/relay/other/x",
            None,
        ),
        ("https://xn--relay-.example/relay/other/x", None),
    ];

    /// The same for a front reached at `127.0.0.1:8443`: an address has many spellings.
    const REDIRECTS_BY_ADDRESS: &[(&str, Option<&str>)] = &[
        ("https://127.0.0.1:8443/relay/other/x", Some("other")),
        ("https://2130706433:8443/relay/other/x", Some("other")),
        (
            "https://[::ffff:127.0.0.1]:8443/relay/other/x",
            Some("other"),
        ),
        ("https://[::ffff:7f00:1]/relay/other/x", Some("other")),
        (
            "https://[0:0:0:0:0:ffff:127.0.0.1]/relay/other/x",
            Some("other"),
        ),
        ("https://0x7f.1/relay/other/x", Some("other")),
        ("https://0x7f000001/relay/other/x", Some("other")),
        ("https://0177.0.0.1/relay/other/x", Some("other")),
        ("https://127.1/relay/other/x", Some("other")),
        ("https://127.0.1/relay/other/x", Some("other")),
        ("https://127.0.0.1./relay/other/x", Some("other")),
        ("https://%31%32%37.0.0.1/relay/other/x", Some("other")),
        (
            "http://\u{ff11}\u{ff12}\u{ff17}.0.0.1/relay/other/x",
            Some("other"),
        ),
        ("https://127.0.0.1:8443/relay/demo/x", None),
        ("https://127.0.0.2/relay/other/x", None),
        ("https://[::1]/relay/other/x", None),
        ("https://[::127.0.0.1]/relay/other/x", None),
        ("https://localhost.example/relay/other/x", None),
    ];

    #[test]
    fn redirects_into_another_tunnel_id_on_this_front_are_found() {
        let tables = [
            ("relay.example:8443", REDIRECTS),
            ("127.0.0.1:8443", REDIRECTS_BY_ADDRESS),
            // The front's own host given in another spelling reads the same.
            ("2130706433:8443", REDIRECTS_BY_ADDRESS),
        ];
        for (host, table) in tables {
            for (location, want) in table {
                let got = redirect_into_other_tunnel(
                    location.as_bytes(),
                    "/relay/demo/app/page",
                    Some(host),
                    "demo",
                );
                assert_eq!(got.as_deref(), *want, "Location: {location:?} on {host}");
            }
        }
    }

    #[test]
    fn without_a_request_host_only_references_to_this_front_are_found() {
        let got = |location: &str| {
            redirect_into_other_tunnel(location.as_bytes(), "/relay/demo/a", None, "demo")
        };
        assert_eq!(got("../other/x").as_deref(), Some("other"));
        assert_eq!(got("/relay/other/x").as_deref(), Some("other"));
        assert_eq!(got("https://relay.example/relay/other/x"), None);
    }

    #[test]
    fn response_past_what_a_header_map_holds_is_cut_not_a_panic() {
        let wire: Vec<Bytes> = (0..40_000)
            .map(|i| relay_proto::header(format!("x-{i}"), ""))
            .collect();
        let (h, invalid) = response_from_wire(&wire);
        assert_eq!(h.len() + invalid, 40_000);
        assert!(invalid > 0);
    }

    #[test]
    fn response_drops_what_its_connection_values_name_whatever_the_case() {
        let wire = vec![
            relay_proto::header("Connection", "X-Private, close"),
            relay_proto::header("x-private", "1"),
            relay_proto::header("connection", vec![b'x', 0x7f]),
            relay_proto::header("x", "kept: its naming value is not valid HTTP"),
            relay_proto::header("content-type", "text/plain"),
        ];
        let (h, invalid) = response_from_wire(&wire);
        assert_eq!(invalid, 1);
        let mut left: Vec<&str> = h.keys().map(|k| k.as_str()).collect();
        left.sort_unstable();
        assert_eq!(left, ["content-type", "x"]);
    }

    #[test]
    fn response_keeps_repeated_headers_and_skips_invalid_ones() {
        let wire = vec![
            relay_proto::header("set-cookie", "a=1"),
            relay_proto::header("transfer-encoding", "chunked"),
            relay_proto::header("set-cookie", "b=2"),
            relay_proto::header("bad name", "x"),
            relay_proto::header("x-ok", vec![0xff_u8]),
            // Not a `Header`: its name runs past its end.
            Bytes::from_static(&[0x0a, 9, b'x']),
        ];
        let (h, invalid) = response_from_wire(&wire);
        assert_eq!(invalid, 2);
        let cookies: Vec<_> = h.get_all("set-cookie").iter().collect();
        assert_eq!(cookies, ["a=1", "b=2"]);
        assert!(h.get("transfer-encoding").is_none());
        assert_eq!(h.get("x-ok").unwrap().as_bytes(), [0xff]);
    }
}
