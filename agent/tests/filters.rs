//! Accept filters, request safety and limits, end to end: the agent against the fake
//! tunnel server and a recording upstream on 127.0.0.1:0. Each test shows the caller-visible
//! outcome (a `CallError` of kind REFUSED naming the reason, or the upstream's answer), what
//! the upstream did or did not see, and that the agent keeps serving the next call.

mod common;

use common::*;
use futures::FutureExt as _;

/// A hyper upstream that records every request it sees (`METHOD target host`, probes
/// excluded). `/hang` never answers, `/echo` streams the body back, `/redirect` answers
/// 302 with `Location: {redirect_to}`, anything else `200 ok`.
struct Recording {
    url: String,
    seen: Arc<Mutex<Vec<String>>>,
}

impl Recording {
    async fn start(redirect_to: &str) -> Recording {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let seen = Arc::new(Mutex::new(Vec::new()));
        let (log, location) = (seen.clone(), redirect_to.to_string());
        tokio::spawn(async move {
            while let Ok((sock, _)) = listener.accept().await {
                let (log, location) = (log.clone(), location.clone());
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(move |req: http::Request<Incoming>| {
                        let (log, location) = (log.clone(), location.clone());
                        async move {
                            let target = req.uri().to_string();
                            if target != "/__probe" {
                                let host = req
                                    .headers()
                                    .get("host")
                                    .map(|v| v.to_str().unwrap_or("?").to_string())
                                    .unwrap_or_default();
                                log.lock()
                                    .unwrap()
                                    .push(format!("{} {target} {host}", req.method()));
                            }
                            let resp = http::Response::builder();
                            let resp = match req.uri().path() {
                                "/hang" => std::future::pending().await,
                                "/echo" => resp.body(req.into_body().boxed()),
                                "/redirect" => resp
                                    .status(302)
                                    .header("location", location)
                                    .body(Full::new(Bytes::new()).map_err(|e| match e {}).boxed()),
                                _ => resp.body(
                                    Full::new(Bytes::from_static(b"ok"))
                                        .map_err(|e| match e {})
                                        .boxed(),
                                ),
                            };
                            Ok::<_, std::convert::Infallible>(resp.unwrap())
                        }
                    });
                    let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(sock), svc)
                        .await;
                });
            }
        });
        Recording { url, seen }
    }

    fn seen(&self) -> Vec<String> {
        self.seen.lock().unwrap().clone()
    }
}

fn filtered_config(tunnel: &str, upstream: &str, streams: u32) -> Config {
    let mut c = config(tunnel, upstream, streams);
    c.upstream_check.path = "/__probe".into();
    c
}

fn with_headers(mut h: RequestHead, headers: &[(&str, &str)]) -> RequestHead {
    h.headers = headers
        .iter()
        .map(|(n, v)| relay_proto::header(*n, v))
        .collect();
    h
}

/// Asserts a REFUSED CallError whose message names `reason`.
fn assert_refused(a: &Answer, reason: &str) {
    assert_eq!(a.error_kind(), Some(CallErrorKind::Refused), "{a:?}");
    let msg = &a.error.as_ref().unwrap().message;
    assert!(
        msg.starts_with(&format!("refused ({reason})")),
        "{reason}: {msg}"
    );
}

fn metric(agent: &AgentHandle, series: &str) -> u64 {
    let text = relay_common::admin::render_metrics(agent.registry());
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
        .unwrap_or_else(|| panic!("{series} not in\n{text}"))
}

#[tokio::test]
async fn filters_refuse_a_path_and_a_method_and_allow_the_rest() {
    let mut tunnel = FakeTunnel::start(10_000, true).await;
    let upstream = Recording::start("").await;
    let mut cfg = filtered_config(&tunnel.url, &upstream.url, 1);
    let mut read = allow("/repos/**", &["GET", "HEAD"]);
    read.name = Some("scm-read".into());
    let mut trigger = allow("/repos/*/hooks", &["POST"]);
    trigger.headers.insert("x-api-version".into(), "2".into());
    cfg.allow = vec![read, trigger];
    let (agent, _) = start_agent(cfg).await;
    let mut conn = tunnel.next_conn().await;

    let a = conn
        .call(head(1, "GET", "/admin/users", true), vec![])
        .await;
    assert_refused(&a, "path");
    assert!(a.error.as_ref().unwrap().message.contains("/admin/users"));

    let a = conn.call(head(2, "DELETE", "/repos/x", true), vec![]).await;
    assert_refused(&a, "method");
    assert!(
        a.error.as_ref().unwrap().message.contains("\"scm-read\""),
        "names the rule: {a:?}"
    );

    let a = conn
        .call(
            with_headers(
                head(3, "POST", "/repos/x/hooks", true),
                &[("x-api-version", "1")],
            ),
            vec![],
        )
        .await;
    assert_refused(&a, "header");
    assert!(!a.error.as_ref().unwrap().message.contains(": 1"));

    // Allowed ones pass, on the same stream.
    let a = conn
        .call(head(4, "GET", "/repos/x/tree?ref=main", true), vec![])
        .await;
    assert_eq!(a.status(), 200, "{a:?}");
    let a = conn
        .call(
            with_headers(
                head(5, "POST", "/repos/x/hooks", true),
                &[("x-api-version", "2")],
            ),
            vec![],
        )
        .await;
    assert_eq!(a.status(), 200, "{a:?}");

    let authority = upstream.url.trim_start_matches("http://").to_string();
    assert_eq!(
        upstream.seen(),
        vec![
            format!("GET /repos/x/tree?ref=main {authority}"),
            format!("POST /repos/x/hooks {authority}"),
        ],
        "refused calls never reach the upstream"
    );
    assert_eq!(
        metric(&agent, "relay_agent_filter_refusals_total{reason=\"path\"}"),
        1
    );
    assert_eq!(
        metric(
            &agent,
            "relay_agent_filter_refusals_total{reason=\"method\"}"
        ),
        1
    );
    assert_eq!(
        metric(
            &agent,
            "relay_agent_filter_refusals_total{reason=\"header\"}"
        ),
        1
    );
    assert_eq!(
        metric(&agent, "relay_agent_calls_total{outcome=\"refused\"}"),
        3
    );
}

#[tokio::test]
async fn with_no_allow_rules_every_call_is_refused() {
    let mut tunnel = FakeTunnel::start(10_000, true).await;
    let upstream = Recording::start("").await;
    let mut cfg = filtered_config(&tunnel.url, &upstream.url, 1);
    cfg.allow.clear();
    let (_agent, _) = start_agent(cfg).await;
    let mut conn = tunnel.next_conn().await;
    for (i, target) in ["/", "/anything", "/a/b?c=d"].iter().enumerate() {
        let a = conn
            .call(head(i as u64 + 1, "GET", target, true), vec![])
            .await;
        assert_refused(&a, "path");
        assert!(a
            .error
            .as_ref()
            .unwrap()
            .message
            .contains("no [[allow]] rules"));
    }
    assert!(upstream.seen().is_empty());
}

#[tokio::test]
async fn steering_and_smuggling_attempts_are_refused_and_never_reach_the_upstream() {
    let mut tunnel = FakeTunnel::start(10_000, true).await;
    let upstream = Recording::start("").await;
    // Even with everything allowed.
    let (agent, _) = start_agent(filtered_config(&tunnel.url, &upstream.url, 1)).await;
    let mut conn = tunnel.next_conn().await;

    let attempts: Vec<(RequestHead, &str)> = vec![
        (
            head(1, "GET", "http://169.254.169.254/latest/meta-data", true),
            "target",
        ),
        (head(2, "GET", "//evil.example/x", true), "target"),
        (
            head(3, "CONNECT", "evil.example:443", true),
            "forbidden_method",
        ),
        (
            with_headers(
                head(4, "GET", "/x", true),
                &[("x-forwarded-host", "evil.example")],
            ),
            "override_header",
        ),
        (
            with_headers(head(5, "GET", "/x", true), &[("x-original-url", "/admin")]),
            "override_header",
        ),
        (
            with_headers(
                head(6, "POST", "/x", false),
                &[("content-length", "4"), ("content-length", "40")],
            ),
            "smuggling",
        ),
        (
            with_headers(
                head(7, "POST", "/x", false),
                &[("content-length", "4"), ("transfer-encoding", "chunked")],
            ),
            "smuggling",
        ),
        (
            with_headers(
                head(8, "POST", "/x", false),
                &[("transfer-encoding", "chunked, identity")],
            ),
            "smuggling",
        ),
        (
            with_headers(
                head(9, "GET", "/x", true),
                &[("x-a", "1\r\nHost: evil.example")],
            ),
            "injection",
        ),
        (head(10, "GET", "/x/../admin", true), "unsafe_path"),
        (head(11, "GET", "/x/%2e%2e/admin", true), "unsafe_path"),
        // `X_Forwarded_Host` is `HTTP_X_FORWARDED_HOST` to a CGI-style upstream.
        (
            with_headers(
                head(12, "GET", "/x", true),
                &[("X_Forwarded_Host", "evil.example")],
            ),
            "override_header",
        ),
    ];
    for (h, reason) in attempts {
        let has_body = !h.end_of_stream;
        let a = conn
            .call(
                h,
                if has_body {
                    vec![Bytes::from_static(b"body")]
                } else {
                    vec![]
                },
            )
            .await;
        assert_refused(&a, reason);
    }
    assert!(upstream.seen().is_empty(), "{:?}", upstream.seen());
    assert_eq!(
        metric(
            &agent,
            "relay_agent_filter_refusals_total{reason=\"smuggling\"}"
        ),
        3
    );

    // A Host header from the cloud side is never used: the upstream sees its own origin.
    let a = conn
        .call(
            with_headers(head(20, "GET", "/x", true), &[("host", "evil.example")]),
            vec![],
        )
        .await;
    assert_eq!(a.status(), 200, "{a:?}");
    let authority = upstream.url.trim_start_matches("http://").to_string();
    assert_eq!(upstream.seen(), vec![format!("GET /x {authority}")]);
}

#[tokio::test]
async fn a_cross_host_redirect_is_passed_back_and_never_followed() {
    let mut tunnel = FakeTunnel::start(10_000, true).await;
    let other = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let elsewhere = format!("http://{}/stolen", other.local_addr().unwrap());
    let upstream = Recording::start(&elsewhere).await;
    let (_agent, _) = start_agent(filtered_config(&tunnel.url, &upstream.url, 1)).await;
    let mut conn = tunnel.next_conn().await;

    let a = conn.call(head(1, "GET", "/redirect", true), vec![]).await;
    assert_eq!(a.status(), 302, "{a:?}");
    assert_eq!(a.header("location").as_deref(), Some(elsewhere.as_str()));
    // One more call on the same stream: the agent is done with the first one.
    let a = conn.call(head(2, "GET", "/x", true), vec![]).await;
    assert_eq!(a.status(), 200);
    assert!(
        other.accept().now_or_never().is_none(),
        "the other host was contacted"
    );
    assert_eq!(upstream.seen().len(), 2);
}

#[tokio::test]
async fn header_and_body_limits_refuse_the_call_and_the_stream_serves_the_next() {
    let mut tunnel = FakeTunnel::start(10_000, true).await;
    let upstream = Recording::start("").await;
    let mut cfg = filtered_config(&tunnel.url, &upstream.url, 1);
    cfg.limits.max_header_bytes = 1024;
    cfg.limits.max_body_bytes = Some(1000);
    let (agent, _) = start_agent(cfg).await;
    let mut conn = tunnel.next_conn().await;

    let big = "v".repeat(2000);
    let a = conn
        .call(
            with_headers(head(1, "GET", "/x", true), &[("x-big", &big)]),
            vec![],
        )
        .await;
    assert_refused(&a, "header_size");
    assert!(a
        .error
        .as_ref()
        .unwrap()
        .message
        .contains("limits.max_header_bytes (1024)"));

    // A declared length over the limit is refused before the upstream is contacted.
    let a = conn
        .call(
            with_headers(
                head(2, "POST", "/echo", false),
                &[("content-length", "3000")],
            ),
            vec![Bytes::from(vec![b'a'; 1000]); 3],
        )
        .await;
    assert_refused(&a, "body_size");

    // A body inside the head (no length) over the limit: refused alike, upstream untouched.
    let mut inline = head(20, "POST", "/echo", true);
    inline.body = Bytes::from(vec![b'a'; 1500]);
    let a = conn.call(inline, vec![]).await;
    assert_refused(&a, "body_size");
    // Its length must be the one the head declares.
    let mut inline = head(21, "POST", "/echo", true);
    inline.headers = vec![relay_proto::header("content-length", "10")];
    inline.body = Bytes::from(vec![b'a'; 12]);
    let a = conn.call(inline, vec![]).await;
    assert_refused(&a, "smuggling");
    assert!(upstream.seen().is_empty(), "{:?}", upstream.seen());

    // A streamed body (no length) is cut when it passes the limit.
    let a = conn
        .call(
            head(3, "POST", "/echo", false),
            vec![Bytes::from(vec![b'a'; 800]); 3],
        )
        .await;
    assert_eq!(a.error_kind(), Some(CallErrorKind::Refused), "{a:?}");
    assert!(
        a.error
            .as_ref()
            .unwrap()
            .message
            .contains("limits.max_body_bytes (1000 bytes)"),
        "{a:?}"
    );

    // Within the limits, the same stream serves on.
    let a = conn
        .call(
            head(4, "POST", "/echo", false),
            vec![Bytes::from(vec![b'b'; 900])],
        )
        .await;
    assert_eq!(a.status(), 200, "{a:?}");
    assert_eq!(a.body, vec![b'b'; 900]);
    assert_eq!(
        metric(
            &agent,
            "relay_agent_filter_refusals_total{reason=\"body_size\"}"
        ),
        3,
        "the declared length, the body inside the head, the streamed body"
    );
    assert_eq!(
        metric(
            &agent,
            "relay_agent_filter_refusals_total{reason=\"header_size\"}"
        ),
        1
    );
}

#[tokio::test]
async fn the_concurrency_cap_refuses_extra_calls_until_one_ends() {
    let mut tunnel = FakeTunnel::start(10_000, true).await;
    let upstream = Recording::start("").await;
    let mut cfg = filtered_config(&tunnel.url, &upstream.url, 2);
    cfg.coverage.max_inflight = 1;
    let (_agent, _) = start_agent(cfg).await;
    let mut first = tunnel.next_conn().await;
    let mut second = tunnel.next_conn().await;

    first
        .send(In::RequestHead(head(1, "GET", "/hang", true)))
        .await;
    let seen = upstream.seen.clone();
    eventually("the first call reaches the upstream", || {
        seen.lock()
            .unwrap()
            .iter()
            .any(|s| s.starts_with("GET /hang"))
    })
    .await;
    let a = second.call(head(2, "GET", "/x", true), vec![]).await;
    assert_refused(&a, "concurrency");
    assert!(a
        .error
        .as_ref()
        .unwrap()
        .message
        .contains("coverage.max_inflight"));

    first.send(In::Cancel(Cancel { call_id: 1 })).await;
    let a = first.read_answer(1).await;
    assert_eq!(a.error_kind(), Some(CallErrorKind::Cancelled));
    let a = second.call(head(3, "GET", "/x", true), vec![]).await;
    assert_eq!(a.status(), 200, "{a:?}");
}

#[tokio::test]
async fn a_deadline_past_the_maximum_is_capped_and_says_so() {
    let mut tunnel = FakeTunnel::start(10_000, true).await;
    let upstream = Recording::start("").await;
    let mut cfg = filtered_config(&tunnel.url, &upstream.url, 1);
    cfg.call_timeout = Duration::from_millis(200);
    cfg.max_call_timeout = Duration::from_millis(300);
    let (_agent, _) = start_agent(cfg).await;
    let mut conn = tunnel.next_conn().await;

    let mut h = head(1, "GET", "/hang", true);
    h.deadline_ms = 60_000;
    let started = Instant::now();
    let a = conn.call(h, vec![]).await;
    assert_eq!(
        a.error_kind(),
        Some(CallErrorKind::UpstreamTimeout),
        "{a:?}"
    );
    assert!(
        a.error
            .as_ref()
            .unwrap()
            .message
            .contains("max_call_timeout"),
        "{a:?}"
    );
    assert!(started.elapsed() < Duration::from_secs(5));

    let a = conn.call(head(2, "GET", "/x", true), vec![]).await;
    assert_eq!(a.status(), 200, "{a:?}");
}

// ------------------------------------------------- a hostile cloud side (security round 2)

/// One request head as a naive upstream read it off one connection.
#[derive(Clone, Debug)]
struct RawSeen {
    /// Which accepted connection (0, 1, ...) carried it.
    conn: usize,
    /// Request line and headers, as sent (hyper sends lowercase header names).
    head: String,
}

/// A naive HTTP/1.1 upstream that records every request head it reads (probes excluded)
/// and answers `200 ok`, keeping the connection open. Like many real servers it reads a
/// body only where it expects one: a `Content-Length` on GET, HEAD or OPTIONS is ignored,
/// so body bytes there are read as the next request on the connection. It also records
/// which connections the agent closed.
struct Naive {
    url: String,
    seen: Arc<Mutex<Vec<RawSeen>>>,
    closed: Arc<Mutex<Vec<usize>>>,
}

impl Naive {
    async fn start() -> Naive {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let seen = Arc::new(Mutex::new(Vec::new()));
        let closed = Arc::new(Mutex::new(Vec::new()));
        let (log, ends) = (seen.clone(), closed.clone());
        tokio::spawn(async move {
            let mut next = 0;
            while let Ok((mut sock, _)) = listener.accept().await {
                let conn = next;
                next += 1;
                let (log, ends) = (log.clone(), ends.clone());
                tokio::spawn(async move {
                    let mut buf = Vec::new();
                    let mut tmp = [0u8; 4096];
                    loop {
                        while let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                            let head = String::from_utf8_lossy(&buf[..end]).to_string();
                            buf.drain(..end + 4);
                            let method = head.split(' ').next().unwrap_or("").to_string();
                            let length = head
                                .lines()
                                .find_map(|l| {
                                    let (n, v) = l.split_once(':')?;
                                    n.eq_ignore_ascii_case("content-length")
                                        .then(|| v.trim().parse::<usize>().ok())?
                                })
                                .unwrap_or(0);
                            let reads_body = !matches!(method.as_str(), "GET" | "HEAD" | "OPTIONS");
                            if reads_body {
                                while buf.len() < length {
                                    let n = sock.read(&mut tmp).await.unwrap_or(0);
                                    if n == 0 {
                                        break;
                                    }
                                    buf.extend_from_slice(&tmp[..n]);
                                }
                                buf.drain(..length.min(buf.len()));
                            }
                            if !head.contains(" /__probe ") {
                                log.lock().unwrap().push(RawSeen { conn, head });
                            }
                            let ok = sock
                                .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                                .await;
                            if ok.is_err() {
                                break;
                            }
                        }
                        let n = sock.read(&mut tmp).await.unwrap_or(0);
                        if n == 0 {
                            break;
                        }
                        buf.extend_from_slice(&tmp[..n]);
                    }
                    ends.lock().unwrap().push(conn);
                });
            }
        });
        Naive { url, seen, closed }
    }

    fn seen(&self) -> Vec<RawSeen> {
        self.seen.lock().unwrap().clone()
    }

    /// Lowercase header names of the one recorded request whose line starts with `line`.
    fn header_names(&self, line: &str) -> Vec<String> {
        let seen = self.seen();
        let found: Vec<&RawSeen> = seen.iter().filter(|s| s.head.starts_with(line)).collect();
        assert_eq!(found.len(), 1, "one {line:?} in {seen:?}");
        found[0]
            .head
            .lines()
            .skip(1)
            .filter_map(|l| {
                l.split_once(':')
                    .map(|(n, _)| n.trim().to_ascii_lowercase())
            })
            .collect()
    }
}

#[tokio::test]
async fn a_header_named_in_connection_is_stripped_before_the_rules_match() {
    let mut tunnel = FakeTunnel::start(10_000, true).await;
    let upstream = Naive::start().await;
    let mut cfg = filtered_config(&tunnel.url, &upstream.url, 1);
    let mut v4 = allow("/v4/**", &["GET"]);
    v4.headers.insert("x-api-version".into(), "4".into());
    cfg.allow = vec![v4];
    let (_agent, _) = start_agent(cfg).await;
    let mut conn = tunnel.next_conn().await;

    // The rule asks for x-api-version: 4; the upstream would never see it.
    for (i, connection) in ["x-api-version", "keep-alive, X-API-Version"]
        .iter()
        .enumerate()
    {
        let a = conn
            .call(
                with_headers(
                    head(i as u64 + 1, "GET", "/v4/projects", true),
                    &[("x-api-version", "4"), ("connection", connection)],
                ),
                vec![],
            )
            .await;
        assert_refused(&a, "header");
    }
    let a = conn
        .call(
            with_headers(
                head(3, "GET", "/v4/projects", true),
                &[("x-api-version", "4")],
            ),
            vec![],
        )
        .await;
    assert_eq!(a.status(), 200, "{a:?}");
    assert!(upstream
        .header_names("GET /v4/projects ")
        .contains(&"x-api-version".to_string()));
}

/// Headers that tell an upstream who the client is, how it connected or which proxy to
/// use: (name as the cloud side spells it, value). All are stripped by default.
const SPOOFING: &[(&str, &str)] = &[
    ("X-Forwarded-For", "6.6.6.6"),
    ("X-Real-IP", "6.6.6.6"),
    ("True-Client-IP", "6.6.6.6"),
    ("Forwarded", "for=6.6.6.6;proto=https"),
    ("X-Forwarded-Proto", "https"),
    ("X-Forwarded-Prefix", "/admin"),
    ("X-Original-URI", "/admin"),
    ("Proxy", "http://6.6.6.6:3128"),
    // Underscore spellings: CGI-style upstreams read them as the same HTTP_* variable.
    ("X_Forwarded_For", "6.6.6.6"),
    ("x_real_ip", "6.6.6.6"),
    ("True_Client_IP", "6.6.6.6"),
    ("X_FORWARDED_PROTO", "https"),
    ("X_Forwarded_Prefix", "/admin"),
    ("X_Original_URI", "/admin"),
];

#[tokio::test]
async fn spoofing_headers_are_stripped_before_the_upstream() {
    let mut tunnel = FakeTunnel::start(10_000, true).await;
    let upstream = Naive::start().await;
    let (_agent, _) = start_agent(filtered_config(&tunnel.url, &upstream.url, 1)).await;
    let mut conn = tunnel.next_conn().await;

    let mut headers = SPOOFING.to_vec();
    headers.push(("x-keep", "1"));
    let a = conn
        .call(with_headers(head(1, "GET", "/x", true), &headers), vec![])
        .await;
    assert_eq!(a.status(), 200, "{a:?}");
    let names = upstream.header_names("GET /x ");
    assert!(names.contains(&"x-keep".to_string()), "{names:?}");
    for (name, _) in SPOOFING {
        assert!(
            !names.contains(&name.to_ascii_lowercase()),
            "{name} reached the upstream: {names:?}"
        );
    }
    assert!(
        !upstream.seen()[0].head.contains("6.6.6.6"),
        "{:?}",
        upstream.seen()
    );
}

/// Paths that servers read differently from the agent: (allowed-by-rules-looking target,
/// reason). The rules allow `GET /files/*.json` and `GET /pub/**`.
const PATH_TRICKS: &[(&str, &str)] = &[
    // Double encoding: a server (or a proxy in front of it) that decodes twice sees `..`.
    ("/pub/%252e%252e/admin", "unsafe_path"),
    ("/pub/%252E%252E%252Fadmin", "unsafe_path"),
    ("/pub/a%252fb", "unsafe_path"),
    // Overlong UTF-8 for '.' and '/', and any non-ASCII byte.
    ("/pub/%c0%ae%c0%ae/admin", "unsafe_path"),
    ("/pub/%c0%af", "unsafe_path"),
    ("/pub/%e0%80%ae", "unsafe_path"),
    ("/pub/caf%c3%a9", "unsafe_path"),
    // Where a rule sets utf8_paths: still no overlong form and no fullwidth '.'.
    ("/docs/%c0%ae%c0%ae/admin", "unsafe_path"),
    ("/docs/%ef%bc%8e%ef%bc%8e/admin", "unsafe_path"),
    // Control characters decoded from the path.
    ("/pub/a%0d%0aSet-Cookie:x", "unsafe_path"),
    ("/pub/a%7f", "unsafe_path"),
    // `;` parameters: Tomcat-style servers drop them (`/files/secret.txt`), so a
    // wildcard never matches across one.
    ("/files/secret.txt;.json", "path"),
    ("/files/secret.txt;x=.json", "path"),
    ("/pub/a;jsessionid=1/b", "path"),
];

#[tokio::test]
async fn path_tricks_are_refused_and_never_reach_the_upstream() {
    let mut tunnel = FakeTunnel::start(10_000, true).await;
    let upstream = Naive::start().await;
    let mut cfg = filtered_config(&tunnel.url, &upstream.url, 1);
    let mut docs = allow("/docs/**", &["GET"]);
    docs.utf8_paths = true;
    cfg.allow = vec![
        allow("/files/*.json", &["GET"]),
        allow("/pub/**", &["GET"]),
        docs,
    ];
    let (_agent, _) = start_agent(cfg).await;
    let mut conn = tunnel.next_conn().await;

    for (i, (target, reason)) in PATH_TRICKS.iter().enumerate() {
        let a = conn
            .call(head(i as u64 + 1, "GET", target, true), vec![])
            .await;
        assert_eq!(
            a.error_kind(),
            Some(CallErrorKind::Refused),
            "{target}: {a:?}"
        );
        assert_refused(&a, reason);
    }
    assert!(upstream.seen().is_empty(), "{:?}", upstream.seen());
    let a = conn
        .call(head(100, "GET", "/files/report.json", true), vec![])
        .await;
    assert_eq!(a.status(), 200, "{a:?}");
    let a = conn
        .call(head(101, "GET", "/docs/caf%c3%a9", true), vec![])
        .await;
    assert_eq!(a.status(), 200, "{a:?}");
}

#[tokio::test]
async fn connect_and_trace_are_refused_whatever_the_rules_say() {
    let mut tunnel = FakeTunnel::start(10_000, true).await;
    let upstream = Naive::start().await;
    // `filtered_config` allows any method on any path.
    let (_agent, _) = start_agent(filtered_config(&tunnel.url, &upstream.url, 1)).await;
    let mut conn = tunnel.next_conn().await;
    let attempts = [
        ("TRACE", "/x"),
        ("trace", "/x"),
        ("CONNECT", "/x"),
        ("Connect", "/x"),
        ("CONNECT", "evil.example:443"),
    ];
    for (i, (method, target)) in attempts.iter().enumerate() {
        let a = conn
            .call(head(i as u64 + 1, method, target, true), vec![])
            .await;
        assert_refused(&a, "forbidden_method");
        assert!(
            a.error.as_ref().unwrap().message.contains("always refused"),
            "{a:?}"
        );
    }
    assert!(upstream.seen().is_empty(), "{:?}", upstream.seen());
}

/// A second request hidden in the body of a method whose body the naive upstream ignores.
const SMUGGLED: &[u8] = b"GET /smuggled HTTP/1.1\r\nhost: x\r\n\r\n";

#[tokio::test]
async fn a_body_on_get_head_or_options_is_refused_by_default() {
    let mut tunnel = FakeTunnel::start(10_000, true).await;
    let upstream = Naive::start().await;
    let (agent, _) = start_agent(filtered_config(&tunnel.url, &upstream.url, 1)).await;
    let mut conn = tunnel.next_conn().await;
    let length = SMUGGLED.len().to_string();
    let attempts = [
        with_headers(
            head(1, "GET", "/x", false),
            &[("content-length", length.as_str())],
        ),
        with_headers(
            head(2, "HEAD", "/x", false),
            &[("content-length", length.as_str())],
        ),
        with_headers(
            head(3, "OPTIONS", "/x", false),
            &[("transfer-encoding", "chunked")],
        ),
        // No framing header at all, but body frames follow the head.
        head(4, "GET", "/x", false),
    ];
    for h in attempts {
        let a = conn.call(h, vec![Bytes::from_static(SMUGGLED)]).await;
        assert_refused(&a, "body");
        assert!(
            a.error.as_ref().unwrap().message.contains("body_methods"),
            "names the key that allows it: {a:?}"
        );
    }
    assert!(upstream.seen().is_empty(), "{:?}", upstream.seen());
    assert_eq!(
        metric(&agent, "relay_agent_filter_refusals_total{reason=\"body\"}"),
        4
    );
    // Bodiless ones pass, and so does an empty declared body.
    let a = conn.call(head(5, "GET", "/x", true), vec![]).await;
    assert_eq!(a.status(), 200, "{a:?}");
    let a = conn
        .call(
            with_headers(head(6, "GET", "/y", true), &[("content-length", "0")]),
            vec![],
        )
        .await;
    assert_eq!(a.status(), 200, "{a:?}");
    assert!(upstream
        .seen()
        .iter()
        .all(|s| !s.head.contains("/smuggled")));
}

#[tokio::test]
async fn a_rule_may_pass_a_named_spoofing_header_and_only_that_one() {
    let mut tunnel = FakeTunnel::start(10_000, true).await;
    let upstream = Naive::start().await;
    let mut cfg = filtered_config(&tunnel.url, &upstream.url, 1);
    let mut internal = allow("/internal/**", &["GET"]);
    internal.pass_headers = vec!["X-Forwarded-For".into()];
    cfg.allow = vec![internal, allow("/**", &["GET"])];
    let (_agent, _) = start_agent(cfg).await;
    let mut conn = tunnel.next_conn().await;

    for (i, target) in ["/internal/a", "/other"].iter().enumerate() {
        let a = conn
            .call(
                with_headers(head(i as u64 + 1, "GET", target, true), SPOOFING),
                vec![],
            )
            .await;
        assert_eq!(a.status(), 200, "{a:?}");
    }
    // The rule that passes it: X-Forwarded-For only, never its `_` spelling.
    let names = upstream.header_names("GET /internal/a ");
    assert!(names.contains(&"x-forwarded-for".to_string()), "{names:?}");
    for (name, _) in &SPOOFING[1..] {
        assert!(
            !names.contains(&name.to_ascii_lowercase()),
            "{name}: {names:?}"
        );
    }
    // Another rule: none.
    let names = upstream.header_names("GET /other ");
    for (name, _) in SPOOFING {
        assert!(
            !names.contains(&name.to_ascii_lowercase()),
            "{name}: {names:?}"
        );
    }
}

#[tokio::test]
async fn an_allowed_body_on_get_closes_the_upstream_connection_after_the_call() {
    let mut tunnel = FakeTunnel::start(10_000, true).await;
    let upstream = Naive::start().await;
    let mut cfg = filtered_config(&tunnel.url, &upstream.url, 1);
    let mut search = allow("/search", &["GET"]);
    search.body_methods = vec!["get".into()];
    cfg.allow = vec![search, allow("/**", &["GET"])];
    let (_agent, _) = start_agent(cfg).await;
    let mut conn = tunnel.next_conn().await;

    // Another rule does not allow a body on GET.
    let length = SMUGGLED.len().to_string();
    let a = conn
        .call(
            with_headers(
                head(1, "GET", "/other", false),
                &[("content-length", length.as_str())],
            ),
            vec![Bytes::from_static(SMUGGLED)],
        )
        .await;
    assert_refused(&a, "body");

    let a = conn
        .call(
            with_headers(
                head(2, "GET", "/search", false),
                &[("content-length", length.as_str())],
            ),
            vec![Bytes::from_static(SMUGGLED)],
        )
        .await;
    assert_eq!(a.status(), 200, "{a:?}");
    let searched = upstream
        .seen()
        .into_iter()
        .find(|s| s.head.starts_with("GET /search "))
        .expect("the upstream saw the search");
    assert!(
        searched.head.contains("connection: close"),
        "{}",
        searched.head
    );
    let closed = upstream.closed.clone();
    eventually(
        "the agent closes the connection that carried the body",
        || closed.lock().unwrap().contains(&searched.conn),
    )
    .await;
    // The next call goes out on another connection.
    let a = conn.call(head(3, "GET", "/next", true), vec![]).await;
    assert_eq!(a.status(), 200, "{a:?}");
    let next = upstream
        .seen()
        .into_iter()
        .find(|s| s.head.starts_with("GET /next "))
        .unwrap();
    assert_ne!(next.conn, searched.conn, "{:?}", upstream.seen());
}
