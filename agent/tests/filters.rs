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
    h.headers = headers.iter().map(|(n, v)| Header::new(*n, *v)).collect();
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
        (head(3, "CONNECT", "evil.example:443", true), "target"),
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
        2
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
