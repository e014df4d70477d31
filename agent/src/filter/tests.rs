//! Pure tests of the accept policy: rule matching, request safety, limits, a committed
//! corpus of tricky heads (table test), and property tests that arbitrary heads never
//! panic and, when allowed, always build an upstream request for the configured origin.

use super::*;
use crate::upstream::{Upstream, UpstreamRequest};
use proptest::prelude::*;
use relay_proto::Header;
use std::time::Duration;

const LIMITS: SizeLimits = SizeLimits {
    max_header_bytes: 4096,
    max_body_bytes: Some(1000),
};

fn rule(methods: &[&str], path: &str) -> AllowRule {
    AllowRule {
        name: None,
        methods: methods.iter().map(|m| m.to_string()).collect(),
        path: path.into(),
        ..AllowRule::default()
    }
}

/// The policy the corpus runs against.
fn policy() -> Policy {
    let mut with_header = rule(&["POST"], "/api/v4/projects/*/pipeline");
    with_header.name = Some("trigger".into());
    with_header
        .headers
        .insert("x-api-version".into(), "2*".into());
    let mut with_query = rule(&["GET"], "/reports/*.csv");
    with_query.query.insert("ref".into(), "main".into());
    Policy::new(
        &[
            rule(&["GET", "head"], "/api/**"),
            with_header,
            with_query,
            rule(&["*"], "/public/*/index.html"),
            rule(&["GET"], "/"),
        ],
        LIMITS,
    )
    .unwrap()
}

fn head(method: &str, target: &str, headers: &[(&str, &str)]) -> RequestHead {
    RequestHead {
        call_id: 1,
        method: method.into(),
        path_and_query: target.into(),
        headers: headers.iter().map(|(n, v)| Header::new(*n, *v)).collect(),
        deadline_ms: 0,
        end_of_stream: true,
    }
}

fn outcome(p: &Policy, h: &RequestHead) -> Result<(), Option<Reason>> {
    p.prepare(h).map(|_| ()).map_err(|r| r.reason())
}

/// The committed corpus: (method, target, headers, has body, expected outcome).
/// `Err(None)` is a bad request; `Err(Some(reason))` a refusal.
#[allow(clippy::type_complexity)]
const CORPUS: &[(
    &str,
    &str,
    &[(&str, &str)],
    bool,
    Result<(), Option<Reason>>,
)] = &[
    // Allowed.
    ("GET", "/api", &[], false, Ok(())),
    ("GET", "/api/", &[], false, Ok(())),
    (
        "GET",
        "/api/v4/projects/group%2Fproject/repository",
        &[],
        false,
        Ok(()),
    ),
    ("head", "/api/x", &[], false, Ok(())),
    (
        "GET",
        "/api/x?a=1&b=%20",
        &[("host", "evil.example")],
        false,
        Ok(()),
    ),
    (
        "POST",
        "/api/v4/projects/7/pipeline",
        &[("x-api-version", "2.1"), ("content-length", "3")],
        true,
        Ok(()),
    ),
    (
        "POST",
        "/api/v4/projects/7/pipeline",
        &[("x-api-version", "2"), ("transfer-encoding", "chunked")],
        true,
        Ok(()),
    ),
    ("GET", "/reports/q1.csv?ref=main", &[], false, Ok(())),
    (
        "GET",
        "/reports/q1.csv?x=1&ref=main#frag",
        &[],
        false,
        Ok(()),
    ),
    ("DELETE", "/public/site/index.html", &[], false, Ok(())),
    ("GET", "/", &[], false, Ok(())),
    ("GET", "/api/a;b/c", &[], false, Ok(())),
    // Accept filters.
    ("GET", "/admin", &[], false, Err(Some(Reason::Path))),
    ("GET", "/apiary", &[], false, Err(Some(Reason::Path))),
    ("GET", "/API/x", &[], false, Err(Some(Reason::Path))),
    ("DELETE", "/api/x", &[], false, Err(Some(Reason::Method))),
    (
        "POST",
        "/api/v4/projects/7/pipeline",
        &[],
        false,
        Err(Some(Reason::Header)),
    ),
    (
        "POST",
        "/api/v4/projects/7/pipeline",
        &[("x-api-version", "2"), ("x-api-version", "3")],
        false,
        Err(Some(Reason::Header)),
    ),
    // `*` never spans an encoded '/': only the GET rule `/api/**` matches this path.
    (
        "POST",
        "/api/v4/projects/a%2Fb/pipeline",
        &[("x-api-version", "2")],
        false,
        Err(Some(Reason::Method)),
    ),
    (
        "GET",
        "/reports/q1.csv",
        &[],
        false,
        Err(Some(Reason::Query)),
    ),
    (
        "GET",
        "/reports/q1.csv?ref=main&ref=dev",
        &[],
        false,
        Err(Some(Reason::Query)),
    ),
    (
        "GET",
        "/reports/q1.csv?ref=dev",
        &[],
        false,
        Err(Some(Reason::Query)),
    ),
    (
        "GET",
        "/public//index.html",
        &[],
        false,
        Err(Some(Reason::UnsafePath)),
    ),
    (
        "GET",
        "/public/a/b/index.html",
        &[],
        false,
        Err(Some(Reason::Path)),
    ),
    // Target forms.
    (
        "GET",
        "http://evil.example/api/x",
        &[],
        false,
        Err(Some(Reason::Target)),
    ),
    (
        "GET",
        "//evil.example/api/x",
        &[],
        false,
        Err(Some(Reason::Target)),
    ),
    (
        "CONNECT",
        "evil.example:443",
        &[],
        false,
        Err(Some(Reason::Target)),
    ),
    ("OPTIONS", "*", &[], false, Err(Some(Reason::Target))),
    ("GET", "", &[], false, Err(Some(Reason::Target))),
    ("GET", "api/x", &[], false, Err(Some(Reason::Target))),
    ("GET", "/api/x y", &[], false, Err(None)),
    // Traversal.
    (
        "GET",
        "/api/../admin",
        &[],
        false,
        Err(Some(Reason::UnsafePath)),
    ),
    (
        "GET",
        "/api/%2e%2e/admin",
        &[],
        false,
        Err(Some(Reason::UnsafePath)),
    ),
    (
        "GET",
        "/api/%2E./admin",
        &[],
        false,
        Err(Some(Reason::UnsafePath)),
    ),
    (
        "GET",
        "/api/..;/admin",
        &[],
        false,
        Err(Some(Reason::UnsafePath)),
    ),
    (
        "GET",
        "/api/a%2f..%2fadmin",
        &[],
        false,
        Err(Some(Reason::UnsafePath)),
    ),
    (
        "GET",
        "/api/a%5c..%5cadmin",
        &[],
        false,
        Err(Some(Reason::UnsafePath)),
    ),
    ("GET", "/api/./x", &[], false, Err(Some(Reason::UnsafePath))),
    (
        "GET",
        "/api/x%00",
        &[],
        false,
        Err(Some(Reason::UnsafePath)),
    ),
    ("GET", "/api/%zz", &[], false, Err(Some(Reason::UnsafePath))),
    ("GET", "/api/%2", &[], false, Err(Some(Reason::UnsafePath))),
    // Injection.
    (
        "GET",
        "/api/x\r\nHost: evil",
        &[],
        false,
        Err(Some(Reason::Injection)),
    ),
    (
        "GET\r\n",
        "/api/x",
        &[],
        false,
        Err(Some(Reason::Injection)),
    ),
    (
        "GET",
        "/api/x",
        &[("x-a", "1\r\nx-b: 2")],
        false,
        Err(Some(Reason::Injection)),
    ),
    (
        "GET",
        "/api/x",
        &[("x-a\n", "1")],
        false,
        Err(Some(Reason::Injection)),
    ),
    (
        "GET",
        "/api/x",
        &[("x-a", "1\0")],
        false,
        Err(Some(Reason::Injection)),
    ),
    ("GET", "/api/x", &[("x a", "1")], false, Err(None)),
    ("GET", "/api/x", &[("x-a", "\u{7}")], false, Err(None)),
    ("G ET", "/api/x", &[], false, Err(None)),
    ("", "/api/x", &[], false, Err(None)),
    // Host, URL and method overrides.
    (
        "GET",
        "/api/x",
        &[("x-forwarded-host", "evil.example")],
        false,
        Err(Some(Reason::OverrideHeader)),
    ),
    (
        "GET",
        "/api/x",
        &[("X-Original-URL", "/admin")],
        false,
        Err(Some(Reason::OverrideHeader)),
    ),
    (
        "GET",
        "/api/x",
        &[("x-http-method-override", "DELETE")],
        false,
        Err(Some(Reason::OverrideHeader)),
    ),
    (
        "GET",
        "/api/x",
        &[("forwarded", "for=1.2.3.4;Host=evil.example")],
        false,
        Err(Some(Reason::OverrideHeader)),
    ),
    (
        "GET",
        "/api/x",
        &[("forwarded", "for=1.2.3.4")],
        false,
        Ok(()),
    ),
    // Smuggling.
    (
        "GET",
        "/api/x",
        &[("content-length", "3"), ("content-length", "3")],
        true,
        Err(Some(Reason::Smuggling)),
    ),
    (
        "GET",
        "/api/x",
        &[("content-length", "3"), ("Content-Length", "4")],
        true,
        Err(Some(Reason::Smuggling)),
    ),
    (
        "GET",
        "/api/x",
        &[("content-length", "3"), ("transfer-encoding", "chunked")],
        true,
        Err(Some(Reason::Smuggling)),
    ),
    (
        "GET",
        "/api/x",
        &[("transfer-encoding", "gzip, chunked")],
        true,
        Err(Some(Reason::Smuggling)),
    ),
    (
        "GET",
        "/api/x",
        &[
            ("transfer-encoding", "chunked"),
            ("transfer-encoding", "chunked"),
        ],
        true,
        Err(Some(Reason::Smuggling)),
    ),
    (
        "GET",
        "/api/x",
        &[("transfer-encoding", "identity")],
        true,
        Err(Some(Reason::Smuggling)),
    ),
    (
        "GET",
        "/api/x",
        &[("content-length", "+3")],
        true,
        Err(Some(Reason::Smuggling)),
    ),
    (
        "GET",
        "/api/x",
        &[("content-length", " 3")],
        true,
        Err(Some(Reason::Smuggling)),
    ),
    (
        "GET",
        "/api/x",
        &[("content-length", "3,3")],
        true,
        Err(Some(Reason::Smuggling)),
    ),
    (
        "GET",
        "/api/x",
        &[("content-length", "")],
        true,
        Err(Some(Reason::Smuggling)),
    ),
    (
        "GET",
        "/api/x",
        &[("content-length", "99999999999999999999999")],
        true,
        Err(Some(Reason::Smuggling)),
    ),
    (
        "GET",
        "/api/x",
        &[("content-length", "5")],
        false,
        Err(Some(Reason::Smuggling)),
    ),
    ("GET", "/api/x", &[("content-length", "0")], false, Ok(())),
    // Limits.
    (
        "GET",
        "/api/x",
        &[("content-length", "1001")],
        true,
        Err(Some(Reason::BodySize)),
    ),
    ("GET", "/api/x", &[("content-length", "1000")], true, Ok(())),
];

#[test]
fn corpus_of_tricky_heads() {
    let p = policy();
    for (i, (method, target, headers, body, expected)) in CORPUS.iter().enumerate() {
        let mut h = head(method, target, headers);
        h.end_of_stream = !body;
        let got = outcome(&p, &h);
        assert_eq!(
            &got,
            expected,
            "case {i}: {method} {target:?} {headers:?}: {:?}",
            p.prepare(&h).err()
        );
    }
}

#[test]
fn a_large_head_is_refused_with_the_limit_named() {
    let p = policy();
    let big = "v".repeat(5000);
    let err = p
        .prepare(&head("GET", "/api/x", &[("x-big", &big)]))
        .unwrap_err();
    assert_eq!(err.reason(), Some(Reason::HeaderSize));
    assert!(
        err.message().contains("limits.max_header_bytes (4096)"),
        "{err:?}"
    );
}

#[test]
fn no_rules_refuses_everything() {
    let p = Policy::new(&[], LIMITS).unwrap();
    let err = p.prepare(&head("GET", "/", &[])).unwrap_err();
    assert_eq!(err.reason(), Some(Reason::Path));
    assert!(err.message().contains("no [[allow]] rules"), "{err:?}");
}

#[test]
fn refusals_name_the_rule_and_never_echo_values() {
    let p = policy();
    let err = p
        .prepare(&head("DELETE", "/api/x?token=s3cret", &[]))
        .unwrap_err();
    assert_eq!(
        err.message(),
        "method DELETE is not allowed on /api/x (rule \"allow[0]\" allows GET, HEAD)"
    );
    let err = p
        .prepare(&head(
            "POST",
            "/api/v4/projects/7/pipeline",
            &[("x-api-version", "s3cret")],
        ))
        .unwrap_err();
    assert_eq!(err.reason(), Some(Reason::Header));
    assert!(err.message().contains("x-api-version"), "{err:?}");
    assert!(err.message().contains("\"trigger\""), "{err:?}");
    assert!(!err.message().contains("s3cret"), "{err:?}");
    let err = p
        .prepare(&head("GET", "/reports/a.csv?ref=s3cret", &[]))
        .unwrap_err();
    assert!(!err.message().contains("s3cret"), "{err:?}");
}

#[test]
fn prepared_requests_drop_host_and_transfer_encoding() {
    let p = policy();
    let ok = p
        .prepare(&head(
            "POST",
            "/api/v4/projects/1/pipeline",
            &[
                ("host", "evil.example"),
                ("x-api-version", "2"),
                ("transfer-encoding", "chunked"),
            ],
        ))
        .unwrap();
    assert!(!ok.headers.contains_key("host"));
    assert!(!ok.headers.contains_key("transfer-encoding"));
    assert_eq!(ok.rule, "trigger");
}

#[test]
fn path_patterns() {
    let cases: &[(&str, &str, bool)] = &[
        ("/**", "/", true),
        ("/**", "/a/b/c", true),
        ("/a/**", "/a", true),
        ("/a/**", "/ab", false),
        ("/a/**/z", "/a/z", true),
        ("/a/**/z", "/a/b/c/z", true),
        ("/a/**/z", "/a/b/c/y", false),
        ("/a/*", "/a/b", true),
        ("/a/*", "/a/", false),
        ("/a/*", "/a/b/c", false),
        ("/a/*/c", "/a/b/c", true),
        ("/a/b", "/a/b/", false),
        ("/a/b/", "/a/b/", true),
        ("/f/*.json", "/f/x.json", true),
        ("/f/*.json", "/f/x.json/y", false),
        ("/f/v*", "/f/v1", true),
        ("/f/a%20b", "/f/a%20b", true),
        ("/f/a b", "/f/a%20b", true),
        ("/f/x", "/f/%78", true),
        ("/**/**/**/**/x", "/a/b/c/d/e/f/g/h/i/x", true),
    ];
    for (pattern, path, want) in cases {
        let segs = compile_path(pattern).unwrap();
        let got = match path_segments(path) {
            Ok(s) => match_path(&segs, &s),
            Err(_) => false,
        };
        assert_eq!(got, *want, "{pattern} vs {path}");
    }
}

#[test]
fn bad_rules_name_their_key() {
    let cases: Vec<(AllowRule, &str)> = vec![
        (rule(&[], "/a"), "allow[0].methods"),
        (rule(&["GE T"], "/a"), "allow[0].methods"),
        (rule(&["GET"], "a"), "allow[0].path"),
        (rule(&["GET"], "/a//b"), "allow[0].path"),
        (rule(&["GET"], "/a/**b"), "allow[0].path"),
        (rule(&["GET"], "/a/../b"), "allow[0].path"),
        (rule(&["GET"], "/a?x=1"), "allow[0].path"),
        (
            AllowRule {
                headers: [("host".to_string(), "x".to_string())].into(),
                ..rule(&["GET"], "/a")
            },
            "allow[0].headers",
        ),
        (
            AllowRule {
                headers: [("bad name".to_string(), "x".to_string())].into(),
                ..rule(&["GET"], "/a")
            },
            "allow[0].headers",
        ),
    ];
    for (r, key) in cases {
        let err = Policy::new(std::slice::from_ref(&r), LIMITS)
            .unwrap_err()
            .to_string();
        assert!(err.contains(key), "{r:?}: {err}");
    }
}

#[test]
fn glob_matches_are_linear_on_pathological_input() {
    // Would take ages with naive backtracking.
    let p = "*a*a*a*a*a*a*a*a*b".as_bytes();
    let s = vec![b'a'; 10_000];
    assert!(!glob(p, &s));
    assert!(glob(b"2*", b"2.1"));
    assert!(glob(b"*", b""));
    assert!(!glob(b"main", b"main2"));
}

// ---------------------------------------------------------------- property tests

/// Pieces that tend to break parsers, mixed with arbitrary text.
fn tricky() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("/".to_string()),
        Just("//".to_string()),
        Just("..".to_string()),
        Just("%2e".to_string()),
        Just("%2F".to_string()),
        Just("%".to_string()),
        Just("\r\n".to_string()),
        Just("\0".to_string()),
        Just("?".to_string()),
        Just("#".to_string()),
        Just("*".to_string()),
        Just("http://evil".to_string()),
        Just("api".to_string()),
        Just(";".to_string()),
        Just("\\".to_string()),
        "[ -~]{0,6}",
        "\\PC{0,3}",
    ]
}

fn target() -> impl Strategy<Value = String> {
    prop::collection::vec(tricky(), 0..8).prop_map(|v| v.concat())
}

fn header() -> impl Strategy<Value = Header> {
    let name = prop_oneof![
        Just("content-length".to_string()),
        Just("transfer-encoding".to_string()),
        Just("host".to_string()),
        Just("x-forwarded-host".to_string()),
        Just("connection".to_string()),
        Just("x-api-version".to_string()),
        Just("Content-Length".to_string()),
        "[a-zA-Z0-9 :\r\n-]{0,12}",
    ];
    let value = prop_oneof![
        Just(b"chunked".to_vec()),
        Just(b"0".to_vec()),
        Just(b"12".to_vec()),
        Just(b"2".to_vec()),
        prop::collection::vec(any::<u8>(), 0..12),
    ];
    (name, value).prop_map(|(name, value)| Header { name, value })
}

fn request_head() -> impl Strategy<Value = RequestHead> {
    let method = prop_oneof![
        Just("GET".to_string()),
        Just("POST".to_string()),
        Just("get".to_string()),
        Just("CONNECT".to_string()),
        "[ -~\r\n]{0,8}",
    ];
    let target = prop_oneof![
        target(),
        target().prop_map(|t| format!("/api/{t}")),
        target().prop_map(|t| format!("/{t}")),
    ];
    (
        method,
        target,
        prop::collection::vec(header(), 0..6),
        any::<bool>(),
    )
        .prop_map(
            |(method, path_and_query, headers, end_of_stream)| RequestHead {
                call_id: 1,
                method,
                path_and_query,
                headers,
                deadline_ms: 0,
                end_of_stream,
            },
        )
}

fn upstream() -> Upstream {
    Upstream::new("http://10.1.2.3:8080", Duration::from_secs(1), None).unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Never panics; an allowed head always becomes a request for the configured origin,
    /// with one framing header at most and nothing that could steer the upstream.
    #[test]
    fn arbitrary_heads_are_allowed_safely_or_rejected(h in request_head()) {
        let p = policy();
        match p.prepare(&h) {
            Err(r) => prop_assert!(!r.message().is_empty()),
            Ok(ok) => {
                let path = ok.path_and_query.path().to_string();
                prop_assert!(path.starts_with('/') && !path.starts_with("//"), "{path}");
                prop_assert!(!path.split('/').any(|s| s == ".." || s == "."), "{path}");
                prop_assert!(ok.headers.get_all("content-length").iter().count() <= 1);
                prop_assert!(!ok.headers.contains_key("x-forwarded-host"));
                let up = upstream();
                let req = UpstreamRequest {
                    method: ok.method,
                    path_and_query: ok.path_and_query.as_str().to_string(),
                    headers: ok.headers,
                    body: None,
                    body_limit: None,
                };
                let built = up.build_for_test(req);
                prop_assert!(built.is_ok(), "{:?}", built.err());
                let (authority, host, te) = built.unwrap();
                prop_assert_eq!(authority, "10.1.2.3:8080");
                prop_assert_eq!(host, "10.1.2.3:8080");
                prop_assert!(!te);
            }
        }
    }

    /// Allow-everything still never lets a traversal, another host or a smuggling
    /// attempt through.
    #[test]
    fn allow_all_still_refuses_unsafe_requests(h in request_head()) {
        let p = Policy::new(&[rule(&["*"], "/**")], LIMITS).unwrap();
        if let Ok(ok) = p.prepare(&h) {
            prop_assert!(h.path_and_query.starts_with('/') && !h.path_and_query.starts_with("//"));
            prop_assert!(!h.path_and_query.contains(['\r', '\n', '\0']));
            let lengths = h.headers.iter().filter(|x| x.name.eq_ignore_ascii_case("content-length")).count();
            let encodings = h.headers.iter().filter(|x| x.name.eq_ignore_ascii_case("transfer-encoding")).count();
            prop_assert!(lengths + encodings <= 1);
            prop_assert!(ok.content_length.is_none_or(|n| n <= 1000));
        }
    }

    /// Rules compiled from arbitrary patterns either fail with a key or match without
    /// panicking.
    #[test]
    fn arbitrary_patterns_compile_or_fail_cleanly(pattern in target(), path in target()) {
        if let Ok(p) = Policy::new(&[rule(&["GET"], &pattern)], LIMITS) {
            let _ = p.prepare(&head("GET", &path, &[]));
        }
    }
}
