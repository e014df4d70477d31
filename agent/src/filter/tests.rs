//! Pure tests of the accept policy: rule matching, request safety, limits, a committed
//! corpus of tricky heads (table test), and property tests that arbitrary heads never
//! panic and, when allowed, always build an upstream request for the configured origin.

use super::*;
use crate::upstream::{RequestBody, Upstream, UpstreamRequest};
use proptest::prelude::*;
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
        headers: headers
            .iter()
            .map(|(n, v)| relay_proto::header(*n, v))
            .collect(),
        deadline_ms: 0,
        end_of_stream: true,
        ..Default::default()
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
    // A `;` segment is matched literally, never by a wildcard.
    ("GET", "/api/a;b/c", &[], false, Err(Some(Reason::Path))),
    ("GET", "/api;x", &[], false, Err(Some(Reason::Path))),
    (
        "GET",
        "/reports/secret.txt;.csv?ref=main",
        &[],
        false,
        Err(Some(Reason::Path)),
    ),
    // A literal percent sign is fine; an escape left after decoding once is not.
    ("GET", "/api/100%25", &[], false, Ok(())),
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
        Err(Some(Reason::ForbiddenMethod)),
    ),
    // CONNECT and TRACE are refused even where a rule allows "*".
    (
        "TRACE",
        "/public/site/index.html",
        &[],
        false,
        Err(Some(Reason::ForbiddenMethod)),
    ),
    (
        "connect",
        "/public/site/index.html",
        &[],
        false,
        Err(Some(Reason::ForbiddenMethod)),
    ),
    (
        "Trace",
        "/public/site/index.html",
        &[],
        false,
        Err(Some(Reason::ForbiddenMethod)),
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
    // Double encoding, overlong UTF-8, non-ASCII, control characters.
    (
        "GET",
        "/api/%252e%252e/admin",
        &[],
        false,
        Err(Some(Reason::UnsafePath)),
    ),
    (
        "GET",
        "/api/a%252fb",
        &[],
        false,
        Err(Some(Reason::UnsafePath)),
    ),
    (
        "GET",
        "/api/%c0%ae%c0%ae/admin",
        &[],
        false,
        Err(Some(Reason::UnsafePath)),
    ),
    (
        "GET",
        "/api/%c0%af",
        &[],
        false,
        Err(Some(Reason::UnsafePath)),
    ),
    (
        "GET",
        "/api/%e0%80%ae%e0%80%ae",
        &[],
        false,
        Err(Some(Reason::UnsafePath)),
    ),
    (
        "GET",
        "/api/caf%C3%A9",
        &[],
        false,
        Err(Some(Reason::UnsafePath)),
    ),
    (
        "GET",
        "/api/a%0d%0aX:1",
        &[],
        false,
        Err(Some(Reason::UnsafePath)),
    ),
    (
        "GET",
        "/api/a%09",
        &[],
        false,
        Err(Some(Reason::UnsafePath)),
    ),
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
    // `_` spellings are the same variable to a CGI-style upstream.
    (
        "GET",
        "/api/x",
        &[("X_Forwarded_Host", "evil.example")],
        false,
        Err(Some(Reason::OverrideHeader)),
    ),
    (
        "GET",
        "/api/x",
        &[("x_original_url", "/admin")],
        false,
        Err(Some(Reason::OverrideHeader)),
    ),
    // Spoofing headers are stripped, not refused.
    (
        "GET",
        "/api/x",
        &[("x-forwarded-for", "1.2.3.4"), ("X_Real_IP", "1.2.3.4")],
        false,
        Ok(()),
    ),
    // Headers named in Connection are gone before the rules match.
    (
        "POST",
        "/api/v4/projects/7/pipeline",
        &[("x-api-version", "2"), ("connection", "x-api-version")],
        false,
        Err(Some(Reason::Header)),
    ),
    (
        "POST",
        "/api/v4/projects/7/pipeline",
        &[
            ("x-api-version", "2"),
            ("connection", "close, X-Api-Version"),
        ],
        false,
        Err(Some(Reason::Header)),
    ),
    (
        "POST",
        "/api/v4/projects/7/pipeline",
        &[
            ("x-api-version", "2"),
            ("connection", "x-api-version, \u{e9}"),
        ],
        false,
        Err(Some(Reason::Header)),
    ),
    (
        "POST",
        "/api/v4/projects/7/pipeline",
        &[("x-api-version", "2"), ("connection", "close")],
        false,
        Ok(()),
    ),
    (
        "POST",
        "/api/v4/projects/7/pipeline",
        &[
            ("x-api-version", "2"),
            ("content-length", "3"),
            ("connection", "content-length"),
        ],
        true,
        Err(Some(Reason::Smuggling)),
    ),
    // A body on GET, HEAD or OPTIONS needs a rule's `body_methods`.
    (
        "GET",
        "/api/x",
        &[("content-length", "3")],
        true,
        Err(Some(Reason::Body)),
    ),
    (
        "head",
        "/api/x",
        &[("transfer-encoding", "chunked")],
        true,
        Err(Some(Reason::Body)),
    ),
    ("GET", "/api/x", &[], true, Err(Some(Reason::Body))),
    (
        "OPTIONS",
        "/public/site/index.html",
        &[],
        true,
        Err(Some(Reason::Body)),
    ),
    ("GET", "/api/x", &[("content-length", "0")], true, Ok(())),
    (
        "DELETE",
        "/public/site/index.html",
        &[("content-length", "3")],
        true,
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
    (
        "PUT",
        "/public/site/index.html",
        &[("content-length", "1000")],
        true,
        Ok(()),
    ),
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
        // `;` is literal text that no wildcard matches.
        ("/f/*.json", "/f/secret.txt;.json", false),
        ("/f/*", "/f/a;b", false),
        ("/f/**", "/f/a;b/c", false),
        ("/f/**", "/f/a;b", false),
        ("/**/x", "/a;b/x", false),
        ("/f/a;b", "/f/a;b", true),
        ("/f/a;b/**", "/f/a;b/c/d", true),
        ("/f/*/c", "/f/a;b/c", false),
    ];
    // Paths longer than the reach sets kept on the stack (31 segments) match alike.
    let deep = format!("/a{}/z", "/b".repeat(40));
    let deep_semicolon = format!("/a{}/c;d/z", "/b".repeat(40));
    let long: &[(&str, &str, bool)] = &[
        ("/a/**/z", &deep, true),
        ("/a/**/y", &deep, false),
        ("/**", &deep, true),
        ("/a/**/*/z", &deep, true),
        ("/a/**/z", &deep_semicolon, false),
    ];
    for (pattern, path, want) in cases.iter().chain(long) {
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
        (rule(&["GET", "TRACE"], "/a"), "allow[0].methods"),
        (rule(&["connect"], "/a"), "allow[0].methods"),
        (
            AllowRule {
                pass_headers: vec!["x-forwarded-host".into()],
                ..rule(&["GET"], "/a")
            },
            "allow[0].pass_headers",
        ),
        (
            AllowRule {
                pass_headers: vec!["x_forwarded_for".into()],
                ..rule(&["GET"], "/a")
            },
            "allow[0].pass_headers",
        ),
        (
            AllowRule {
                body_methods: vec!["POST".into()],
                ..rule(&["POST"], "/a")
            },
            "allow[0].body_methods",
        ),
        (
            AllowRule {
                body_methods: vec!["GET".into()],
                ..rule(&["HEAD"], "/a")
            },
            "allow[0].body_methods",
        ),
        (
            AllowRule {
                headers: [("x-forwarded-for".to_string(), "*".to_string())].into(),
                ..rule(&["GET"], "/a")
            },
            "allow[0].headers",
        ),
        (
            AllowRule {
                headers: [("x_forwarded_for".to_string(), "*".to_string())].into(),
                pass_headers: vec!["x-forwarded-for".into()],
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
    let err = Policy::new(
        &[AllowRule {
            pass_headers: vec!["X-Forwarded-Host".into()],
            ..rule(&["GET"], "/a")
        }],
        LIMITS,
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("override_header"), "{err}");
}

/// Every spoofing header in both spellings, plus one the upstream should get.
const SPOOFING: &[(&str, &str)] = &[
    ("X-Forwarded-For", "6.6.6.6"),
    ("X-Real-IP", "6.6.6.6"),
    ("True-Client-IP", "6.6.6.6"),
    ("Forwarded", "for=6.6.6.6"),
    ("X-Forwarded-Proto", "https"),
    ("X-Forwarded-Prefix", "/admin"),
    ("X-Original-URI", "/admin"),
    ("Proxy", "http://6.6.6.6:3128"),
    ("X_Forwarded_For", "6.6.6.6"),
    ("X_REAL_IP", "6.6.6.6"),
    ("true_client_ip", "6.6.6.6"),
    ("X_Forwarded_Proto", "https"),
    ("X_Forwarded_Prefix", "/admin"),
    ("X_Original_URI", "/admin"),
    // The rest of the family: scheme, port and prefix headers frameworks build URLs from,
    // and the client-address headers of proxies, CDNs and clouds.
    ("X-Forwarded-Port", "443"),
    ("X-Forwarded-Ssl", "on"),
    ("X-Forwarded-Scheme", "https"),
    ("X-Forwarded-Protocol", "https"),
    ("X-Forwarded-By", "6.6.6.6"),
    ("X-Forwarded", "for=6.6.6.6"),
    ("X-Client-IP", "6.6.6.6"),
    ("Client-IP", "6.6.6.6"),
    ("X-Cluster-Client-IP", "6.6.6.6"),
    ("CF-Connecting-IP", "6.6.6.6"),
    ("Fastly-Client-IP", "6.6.6.6"),
    ("X-Original-Forwarded-For", "6.6.6.6"),
    ("X-Originating-IP", "6.6.6.6"),
    ("X-Remote-Addr", "6.6.6.6"),
    ("X-Envoy-External-Address", "6.6.6.6"),
    ("X-ARR-ClientIP", "6.6.6.6"),
    ("X_Client_IP", "6.6.6.6"),
    ("Fastly_Client_IP", "6.6.6.6"),
    ("x-keep", "1"),
    (
        "x-forwarded-not-really",
        "kept? no: every x-forwarded-* is of the family",
    ),
    ("x-client-ipv4-hint", "1"),
];

#[test]
fn spoofing_headers_are_stripped_unless_the_rule_passes_them() {
    let mut internal = rule(&["GET"], "/internal/**");
    internal.pass_headers = vec!["x-forwarded-for".into(), "Proxy".into()];
    internal
        .headers
        .insert("x-forwarded-for".into(), "10.*".into());
    let p = Policy::new(&[internal, rule(&["GET"], "/**")], LIMITS).unwrap();
    let names = |target: &str, extra: &[(&str, &str)]| {
        let mut headers = SPOOFING.to_vec();
        headers.extend_from_slice(extra);
        let ok = p.prepare(&head("GET", target, &headers)).unwrap();
        let mut names: Vec<String> = ok.headers.keys().map(|k| k.to_string()).collect();
        names.sort();
        (ok.rule, names)
    };
    let kept = vec!["x-client-ipv4-hint".to_string(), "x-keep".to_string()];
    assert_eq!(names("/other", &[]), ("allow[1]".to_string(), kept.clone()));
    // The rule requires x-forwarded-for 10.*: the 6.6.6.6 one fails it, so the call
    // falls to the other rule, which strips it.
    assert_eq!(names("/internal/a", &[]), ("allow[1]".to_string(), kept));
    let p2 = Policy::new(
        &[AllowRule {
            pass_headers: vec!["x-forwarded-for".into(), "proxy".into()],
            ..rule(&["GET"], "/internal/**")
        }],
        LIMITS,
    )
    .unwrap();
    let ok = p2.prepare(&head("GET", "/internal/a", SPOOFING)).unwrap();
    let mut kept: Vec<&str> = ok.headers.keys().map(|k| k.as_str()).collect();
    kept.sort();
    assert_eq!(
        kept,
        vec!["proxy", "x-client-ipv4-hint", "x-forwarded-for", "x-keep"]
    );
}

#[test]
fn the_family_is_one_list_of_patterns() {
    for name in [
        "x-forwarded-for",
        "x-forwarded-port",
        "x-forwarded-anything",
        "x-forwarded",
        "forwarded",
        "client-ip",
        "true-client-ip",
        "x-cluster-client-ip",
        "fastly-client-ip",
        "fly-client-ip",
        "cf-connecting-ip",
        "x-real-ip",
        "x-original-forwarded-for",
        "proxy",
    ] {
        assert!(is_spoofing(name), "{name}");
    }
    for name in [
        "x-forwardedfor",
        "forwarded-for",
        "client-ipx",
        "x-client-ip-hint",
        "x-request-id",
        "proxy-status",
        "x-proxy",
    ] {
        assert!(!is_spoofing(name), "{name}");
    }
}

#[test]
fn a_rule_sets_its_own_client_identity_headers_over_the_callers() {
    let set = AllowRule {
        set_headers: [
            ("X-Forwarded-For".to_string(), "$tunnel_peer".to_string()),
            ("x-forwarded-proto".to_string(), "https".to_string()),
            (
                "forwarded".to_string(),
                "for=\"$tunnel_peer\";proto=https".to_string(),
            ),
        ]
        .into(),
        pass_headers: vec!["x-real-ip".into()],
        ..rule(&["GET"], "/**")
    };
    let p = Policy::new(&[set], LIMITS).unwrap();
    let peer = "10.1.2.3".parse().ok();
    let ok = p.prepare_call(&head("GET", "/a", SPOOFING), peer).unwrap();
    let h = &ok.headers;
    assert_eq!(h.get_all("x-forwarded-for").iter().count(), 1);
    assert_eq!(h["x-forwarded-for"], "10.1.2.3");
    assert_eq!(h["x-forwarded-proto"], "https");
    assert_eq!(h["forwarded"], "for=\"10.1.2.3\";proto=https");
    assert_eq!(h["x-real-ip"], "6.6.6.6");
    assert!(h.get("x-forwarded-port").is_none());
    // An IPv4 peer reached over IPv6 is written as IPv4.
    let mapped = "::ffff:10.1.2.3".parse().ok();
    let ok = p.prepare_call(&head("GET", "/a", &[]), mapped).unwrap();
    assert_eq!(ok.headers["x-forwarded-for"], "10.1.2.3");
    // Without a known peer, the headers that need it are left out, the others written.
    let ok = p.prepare(&head("GET", "/a", SPOOFING)).unwrap();
    assert!(ok.headers.get("x-forwarded-for").is_none());
    assert!(ok.headers.get("forwarded").is_none());
    assert_eq!(ok.headers["x-forwarded-proto"], "https");
}

#[test]
fn set_and_pass_headers_name_only_the_family_and_their_errors_name_the_key() {
    let bad = |r: AllowRule, key: &str, says: &str| {
        let err = Policy::new(std::slice::from_ref(&r), LIMITS)
            .unwrap_err()
            .to_string();
        assert!(err.contains(key) && err.contains(says), "{r:?}: {err}");
    };
    let set = |name: &str, value: &str| AllowRule {
        set_headers: [(name.to_string(), value.to_string())].into(),
        ..rule(&["GET"], "/a")
    };
    bad(
        set("x-request-id", "1"),
        "allow[0].set_headers",
        "not a client-identity header",
    );
    bad(
        set("host", "x"),
        "allow[0].set_headers",
        "not a client-identity header",
    );
    bad(
        set("x-forwarded-host", "x"),
        "allow[0].set_headers",
        "override_header",
    );
    bad(
        set("x_forwarded_for", "x"),
        "allow[0].set_headers",
        "'-' spelling",
    );
    bad(
        set("x-forwarded-for", "$remote_addr"),
        "allow[0].set_headers",
        "$tunnel_peer",
    );
    bad(
        set("x-forwarded-for", "a\u{7f}"),
        "allow[0].set_headers",
        "not a valid header value",
    );
    bad(
        AllowRule {
            pass_headers: vec!["x-forwarded-for".into()],
            ..set("x-forwarded-for", "$tunnel_peer")
        },
        "allow[0].set_headers",
        "not both",
    );
    bad(
        AllowRule {
            pass_headers: vec!["x-request-id".into()],
            ..rule(&["GET"], "/a")
        },
        "allow[0].pass_headers",
        "not a client-identity header",
    );
    for name in ["cf-connecting-ip", "X-Forwarded-Port", "fastly-client-ip"] {
        let r = AllowRule {
            pass_headers: vec![name.into()],
            ..rule(&["GET"], "/a")
        };
        assert!(Policy::new(&[r], LIMITS).is_ok(), "{name}");
    }
}

#[test]
fn a_method_is_matched_and_sent_in_upper_case() {
    let p = Policy::new(&[rule(&["GET", "PoSt"], "/**")], LIMITS).unwrap();
    for (sent, want) in [
        ("get", "GET"),
        ("Get", "GET"),
        ("post", "POST"),
        ("GET", "GET"),
    ] {
        let ok = p.prepare(&head(sent, "/a", &[])).unwrap();
        assert_eq!(ok.method.as_str(), want, "{sent}");
    }
    assert_eq!(
        outcome(&p, &head("delete", "/a", &[])),
        Err(Some(Reason::Method))
    );
    let any = Policy::new(&[rule(&["*"], "/**")], LIMITS).unwrap();
    let ok = any.prepare(&head("purge", "/a", &[])).unwrap();
    assert_eq!(ok.method.as_str(), "PURGE");
}

#[test]
fn query_names_match_exactly_unless_the_rule_ignores_their_case() {
    let mut exact = rule(&["GET"], "/search");
    exact.query.insert("ref".into(), "main".into());
    let folded = AllowRule {
        query_ignore_case: true,
        ..exact.clone()
    };
    let exact = Policy::new(&[exact], LIMITS).unwrap();
    let folded = Policy::new(&[folded], LIMITS).unwrap();
    type Outcome = Result<(), Option<Reason>>;
    // (target, with exact names, with query_ignore_case)
    let cases: &[(&str, Outcome, Outcome)] = &[
        ("/search?ref=main", Ok(()), Ok(())),
        // Another spelling of the name: the exact rule does not look at it.
        (
            "/search?ref=main&REF=evil",
            Ok(()),
            Err(Some(Reason::Query)),
        ),
        ("/search?Ref=main", Err(Some(Reason::Query)), Ok(())),
        (
            "/search?R%45F=evil&ref=main",
            Ok(()),
            Err(Some(Reason::Query)),
        ),
        (
            "/search?REF=main&rEf=main",
            Err(Some(Reason::Query)),
            Ok(()),
        ),
    ];
    for (target, want_exact, want_folded) in cases {
        assert_eq!(
            &outcome(&exact, &head("GET", target, &[])),
            want_exact,
            "{target}"
        );
        assert_eq!(
            &outcome(&folded, &head("GET", target, &[])),
            want_folded,
            "{target}"
        );
    }
}

#[test]
fn utf8_paths_pass_only_where_a_rule_allows_them_and_never_overlong_or_lookalikes() {
    let docs = AllowRule {
        utf8_paths: true,
        ..rule(&["GET"], "/docs/**")
    };
    let p = Policy::new(&[docs, rule(&["GET"], "/**")], LIMITS).unwrap();
    let cases: &[(&str, Result<(), Option<Reason>>)] = &[
        ("/docs/caf%C3%A9", Ok(())),
        ("/docs/%E6%97%A5%E6%9C%AC/readme", Ok(())),
        ("/other/caf%C3%A9", Err(Some(Reason::UnsafePath))),
        // Overlong and broken UTF-8.
        ("/docs/%c0%ae%c0%ae/admin", Err(Some(Reason::UnsafePath))),
        ("/docs/%e0%80%ae", Err(Some(Reason::UnsafePath))),
        ("/docs/%C3", Err(Some(Reason::UnsafePath))),
        ("/docs/%ff", Err(Some(Reason::UnsafePath))),
        // Fullwidth '.' and '/' and friends, which NFKC folds into the ASCII ones.
        (
            "/docs/%EF%BC%8E%EF%BC%8E/admin",
            Err(Some(Reason::UnsafePath)),
        ),
        ("/docs/a%EF%BC%8Fb", Err(Some(Reason::UnsafePath))),
        ("/docs/a%E2%88%95b", Err(Some(Reason::UnsafePath))),
    ];
    for (target, want) in cases {
        assert_eq!(&outcome(&p, &head("GET", target, &[])), want, "{target}");
    }
    let err = p
        .prepare(&head("GET", "/other/caf%C3%A9", &[]))
        .unwrap_err();
    assert!(err.message().contains("utf8_paths"), "{err:?}");
}

#[test]
fn only_an_allowed_body_on_a_bodiless_method_closes_the_connection() {
    let mut search = rule(&["GET", "POST"], "/search");
    search.body_methods = vec!["GET".into()];
    let p = Policy::new(&[search], LIMITS).unwrap();
    let call = |method: &str, eos: bool, headers: &[(&str, &str)]| {
        let mut h = head(method, "/search", headers);
        h.end_of_stream = eos;
        p.prepare(&h).map(|ok| ok.close_connection)
    };
    assert_eq!(call("GET", false, &[("content-length", "3")]), Ok(true));
    assert_eq!(call("GET", false, &[]), Ok(true));
    assert_eq!(call("GET", true, &[]), Ok(false));
    assert_eq!(call("GET", true, &[("content-length", "0")]), Ok(false));
    assert_eq!(call("POST", false, &[("content-length", "3")]), Ok(false));
    let err = p
        .prepare(&head("HEAD", "/search", &[("content-length", "3")]))
        .map(|_| ());
    assert!(err.is_err());
}

#[test]
fn the_new_rule_keys_parse_from_toml_with_their_defaults() {
    #[derive(serde::Deserialize)]
    struct File {
        allow: Vec<AllowRule>,
    }
    let text = r#"
        [[allow]]
        methods = ["GET"]
        path = "/search"
        pass_headers = ["X-Forwarded-For"]
        body_methods = ["GET"]
        utf8_paths = true
        [[allow]]
        methods = ["GET"]
        path = "/**"
    "#;
    let f: File = relay_common::config::parse(text, std::path::Path::new("agent.toml")).unwrap();
    assert_eq!(f.allow[0].pass_headers, vec!["X-Forwarded-For".to_string()]);
    assert_eq!(f.allow[0].body_methods, vec!["GET".to_string()]);
    assert!(f.allow[0].utf8_paths);
    assert!(f.allow[1].pass_headers.is_empty());
    assert!(f.allow[1].body_methods.is_empty());
    assert!(!f.allow[1].utf8_paths);
    let p = Policy::new(&f.allow, LIMITS).unwrap();
    let mut h = head("GET", "/search", &[("x-forwarded-for", "10.0.0.1")]);
    h.end_of_stream = false;
    let ok = p.prepare(&h).unwrap();
    assert!(ok.close_connection);
    assert!(ok.headers.contains_key("x-forwarded-for"));
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
        Just("%25".to_string()),
        Just("%c0%ae".to_string()),
        Just("%C3%A9".to_string()),
        Just("%0a".to_string()),
        "[ -~]{0,6}",
        "\\PC{0,3}",
    ]
}

fn target() -> impl Strategy<Value = String> {
    prop::collection::vec(tricky(), 0..8).prop_map(|v| v.concat())
}

fn header() -> impl Strategy<Value = bytes::Bytes> {
    let name = prop_oneof![
        Just("content-length".to_string()),
        Just("transfer-encoding".to_string()),
        Just("host".to_string()),
        Just("x-forwarded-host".to_string()),
        Just("connection".to_string()),
        Just("x-api-version".to_string()),
        Just("Content-Length".to_string()),
        Just("x-forwarded-for".to_string()),
        Just("X_Forwarded_For".to_string()),
        Just("proxy".to_string()),
        Just("keep-alive".to_string()),
        "[a-zA-Z0-9 :\r\n-]{0,12}",
    ];
    let value = prop_oneof![
        Just(b"chunked".to_vec()),
        Just(b"0".to_vec()),
        Just(b"12".to_vec()),
        Just(b"2".to_vec()),
        Just(b"x-api-version".to_vec()),
        Just(b"close, content-length".to_vec()),
        prop::collection::vec(any::<u8>(), 0..12),
    ];
    prop_oneof![
        9 => (name, value).prop_map(|(name, value)| relay_proto::header(name, value)),
        // Now and then a record that may not be a `Header` at all.
        1 => prop::collection::vec(any::<u8>(), 0..8).prop_map(bytes::Bytes::from),
    ]
}

fn request_head() -> impl Strategy<Value = RequestHead> {
    let method = prop_oneof![
        Just("GET".to_string()),
        Just("POST".to_string()),
        Just("get".to_string()),
        Just("CONNECT".to_string()),
        Just("TRACE".to_string()),
        Just("HEAD".to_string()),
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
                ..Default::default()
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
                for name in ok.headers.keys() {
                    let n = name.as_str();
                    prop_assert!(!relay_common::hop::is_hop_by_hop(n), "{n}");
                    prop_assert!(spoofing(n).is_none(), "{n}");
                }
                prop_assert!(!ok.method.as_str().eq_ignore_ascii_case("TRACE"));
                prop_assert!(!ok.method.as_str().eq_ignore_ascii_case("CONNECT"));
                prop_assert!(path.is_ascii(), "{path}");
                let up = upstream();
                let req = UpstreamRequest {
                    method: ok.method,
                    path_and_query: ok.path_and_query.as_str().to_string(),
                    headers: ok.headers,
                    body: RequestBody::None,
                    body_limit: None,
                    close_connection: false,
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
            // An allowed head's records all parse.
            let names: Vec<&[u8]> = h.headers.iter().map(|r| relay_proto::parse_header(r).unwrap().0).collect();
            let lengths = names.iter().filter(|n| n.eq_ignore_ascii_case(b"content-length")).count();
            let encodings = names.iter().filter(|n| n.eq_ignore_ascii_case(b"transfer-encoding")).count();
            prop_assert!(lengths + encodings <= 1);
            prop_assert!(ok.content_length.is_none_or(|n| n <= 1000));
            let bodiless = ["GET", "HEAD", "OPTIONS"].iter().any(|m| h.method.eq_ignore_ascii_case(m));
            prop_assert!(!bodiless || h.end_of_stream || ok.content_length == Some(0), "{h:?}");
            prop_assert!(!ok.close_connection);
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
