//! Callers and limits, end to end through the dispatcher front: unknown keys get 401, a key
//! reaching a tunnel id outside its `tunnels` gets 403 `forbidden`, a caller over its
//! `max_concurrent_calls` gets 429 `too_many_calls`; each limit (header size, body size,
//! caller concurrency, deadline, per-tunnel-id queue, streams per tunnel id) returns its
//! error while the relay keeps serving other calls. Hostile calls the agent refuses whatever
//! its rules say reach the caller as 403 `refused (<reason>)`, and client-identity headers
//! never reach the upstream.

use bytes::Bytes;
use http::Method;
use relay_agent::coverage::plan::CoverageConfig;
use relay_dispatcher::CallerConfig;
use relay_tests::client::Caller;
use relay_tests::stack::{Stack, CALLER_KEY};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::time::Instant;

fn fixed(streams: u32) -> CoverageConfig {
    CoverageConfig {
        enabled: false,
        fixed_streams: streams,
        ..CoverageConfig::default()
    }
}

fn callers() -> Vec<CallerConfig> {
    vec![
        CallerConfig::allow_all("dev", CALLER_KEY),
        CallerConfig {
            tunnels: vec!["acme-*".into(), "other".into()],
            ..CallerConfig::allow_all("acme-ci", "acme-key")
        },
        CallerConfig {
            max_concurrent_calls: 1,
            ..CallerConfig::allow_all("one-at-a-time", "single-key")
        },
    ]
}

async fn ok(stack: &Stack) {
    let a = stack.caller().get("/relay/demo/hello").await.unwrap();
    assert_eq!(a.status, 200, "the relay keeps serving: {}", a.text());
}

#[tokio::test]
async fn unknown_keys_get_401_and_keys_outside_their_tunnels_get_403() {
    let stack = Stack::builder()
        .servers(1)
        .dispatcher_config(|c| c.callers = callers())
        .start()
        .await
        .unwrap();
    stack.wait_routable(Duration::from_secs(20)).await.unwrap();

    let unknown = Caller::new(stack.http, Some("no-such-key"))
        .get("/relay/demo/hello")
        .await
        .unwrap();
    assert_eq!(unknown.status, 401);
    assert_eq!(unknown.json()["error"], "unauthorized");
    assert!(unknown.headers.contains_key("www-authenticate"));

    let acme = Caller::new(stack.http, Some("acme-key"));
    let forbidden = acme.get("/relay/demo/hello").await.unwrap();
    assert_eq!(forbidden.status, 403, "{}", forbidden.text());
    assert_eq!(forbidden.json()["error"], "forbidden");
    assert_eq!(forbidden.json()["tunnel_id"], "demo");
    assert!(!forbidden.text().contains("acme-key"));
    // Allowed by pattern: it passes the check and gets the routing answer.
    let allowed = acme.get("/relay/acme-scm/hello").await.unwrap();
    assert_eq!(allowed.status, 503, "{}", allowed.text());
    assert_eq!(allowed.json()["error"], "tunnel_unavailable");
    ok(&stack).await;
    stack.shutdown().await;
}

#[tokio::test]
async fn a_caller_over_its_concurrent_calls_gets_429_while_others_are_served() {
    let stack = Stack::builder()
        .servers(1)
        .coverage(fixed(4))
        .dispatcher_config(|c| c.callers = callers())
        .start()
        .await
        .unwrap();
    stack.wait_routable(Duration::from_secs(20)).await.unwrap();
    let single = Caller::new(stack.http, Some("single-key"));
    let slow = {
        let single = single.clone();
        tokio::spawn(async move { single.get("/relay/demo/slow/1500").await })
    };
    let single = &single;
    let refused = relay_tests::eventually(
        "a second call is refused",
        Duration::from_secs(5),
        || async move {
            let a = single.get("/relay/demo/hello").await.unwrap();
            if a.status == 429 {
                Ok(a)
            } else {
                Err(a.text())
            }
        },
    )
    .await;
    assert_eq!(refused.json()["error"], "too_many_calls");
    assert_eq!(refused.headers["retry-after"], "1");
    ok(&stack).await;
    assert_eq!(slow.await.unwrap().unwrap().status, 200);
    // The slot is free again once the call ended.
    assert_eq!(single.get("/relay/demo/hello").await.unwrap().status, 200);
    stack.shutdown().await;
}

/// Sends a chunked POST of `n` bytes over raw HTTP/1.1; returns the status.
async fn chunked_post(stack: &Stack, n: usize) -> u16 {
    let mut s = tokio::net::TcpStream::connect(stack.http).await.unwrap();
    let head = format!(
        "POST /relay/demo/echo HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {CALLER_KEY}\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
    );
    s.write_all(head.as_bytes()).await.unwrap();
    let chunk = vec![b'a'; 1000];
    let mut sent = 0;
    while sent < n {
        let part = &chunk[..(n - sent).min(chunk.len())];
        let frame = [format!("{:x}\r\n", part.len()).as_bytes(), part, b"\r\n"].concat();
        if s.write_all(&frame).await.is_err() {
            break;
        }
        sent += part.len();
    }
    let _ = s.write_all(b"0\r\n\r\n").await;
    let mut buf = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut buf)).await;
    let text = String::from_utf8_lossy(&buf);
    text.split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0)
}

#[tokio::test]
async fn each_dispatcher_limit_returns_its_error_and_the_relay_keeps_serving() {
    let stack = Stack::builder()
        .servers(1)
        .coverage(fixed(2))
        // Response heads come 100 ms late, so a streamed body passes its limit first.
        .upstream_latency(Duration::from_millis(100))
        .dispatcher_config(|c| {
            c.max_header_bytes = 8 * 1024;
            c.max_request_body_bytes = Some(4096);
            c.call_timeout = Duration::from_millis(300);
            c.max_call_timeout = Duration::from_millis(300);
        })
        .start()
        .await
        .unwrap();
    stack.wait_routable(Duration::from_secs(20)).await.unwrap();
    let caller = stack.caller();

    // Header size: 431.
    let mut req = caller.request(Method::GET, "/relay/demo/hello", Bytes::new());
    req.headers_mut()
        .insert("x-big", "v".repeat(10 * 1024).parse().unwrap());
    let a = caller.call(req).await.unwrap();
    assert_eq!(a.status, 431, "{}", a.text());
    ok(&stack).await;

    // Body size, declared: 413 before anything is forwarded.
    let served = stack.upstream.served();
    let a = caller
        .call(caller.request(Method::POST, "/relay/demo/echo", vec![b'x'; 5000]))
        .await
        .unwrap();
    assert_eq!(a.status, 413, "{}", a.text());
    assert_eq!(a.json()["error"], "body_too_large");
    assert_eq!(
        stack.upstream.served(),
        served,
        "nothing reached the upstream"
    );
    // Body size, streamed (chunked): 413 too.
    assert_eq!(chunked_post(&stack, 20_000).await, 413);
    // Under the limit: relayed.
    let a = caller
        .call(caller.request(Method::POST, "/relay/demo/echo", vec![b'x'; 4000]))
        .await
        .unwrap();
    assert_eq!(a.status, 200);
    assert_eq!(a.body.len(), 4000);
    assert_eq!(chunked_post(&stack, 3000).await, 200);

    // Deadline: a caller asking for more than max_call_timeout is clamped to it.
    let mut req = caller.request(Method::GET, "/relay/demo/slow/3000", Bytes::new());
    req.headers_mut()
        .insert("x-relay-timeout-ms", "60000".parse().unwrap());
    let started = Instant::now();
    let a = caller.call(req).await.unwrap();
    assert_eq!(a.status, 504, "{}", a.text());
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "clamped to 300 ms"
    );
    ok(&stack).await;
    stack.shutdown().await;
}

#[tokio::test]
async fn queue_and_stream_limits_of_a_tunnel_id_return_their_errors_and_serve_on() {
    let stack = Stack::builder()
        .servers(1)
        .coverage(fixed(4))
        .tunnel_config(|c| {
            c.max_streams_per_token = 2;
            c.max_queue_per_tunnel = 1;
            c.queue_timeout = Duration::from_millis(300);
        })
        .start()
        .await
        .unwrap();
    stack.wait_routable(Duration::from_secs(20)).await.unwrap();
    // Streams per tunnel id: the agent asks for 4, the server holds 2.
    let hub = stack.servers[0].as_ref().unwrap().hub().clone();
    let streams = || hub.load().iter().map(|t| t.idle + t.busy).sum::<u32>();
    relay_tests::eventually(
        "the server holds 2 streams",
        Duration::from_secs(10),
        || async { streams() == 2 },
    )
    .await;
    // A window in which the agent keeps asking for 4: the server never holds a third.
    relay_tests::holds_for(
        "max_streams_per_token holds: 2 streams",
        Duration::from_millis(500),
        || async { streams() == 2 },
    )
    .await;

    // Queue: two slow calls take both streams, one waits in the queue, the next is
    // refused at once with 503 no_capacity.
    let caller = stack.caller();
    let mut slow = Vec::new();
    for _ in 0..3 {
        let c = caller.clone();
        slow.push(tokio::spawn(
            async move { c.get("/relay/demo/slow/1000").await },
        ));
    }
    let c = &caller;
    let refused = relay_tests::eventually(
        "a call past the queue is refused",
        Duration::from_secs(5),
        || async move {
            let a = c.get("/relay/demo/hello").await.unwrap();
            if a.status == 503 {
                Ok(a)
            } else {
                Err(format!("{} {}", a.status, a.text()))
            }
        },
    )
    .await;
    assert_eq!(refused.json()["error"], "no_capacity");
    assert!(refused.headers.contains_key("retry-after"));
    let mut statuses: Vec<u16> = Vec::new();
    for t in slow {
        statuses.push(t.await.unwrap().unwrap().status.as_u16());
    }
    assert_eq!(
        statuses.iter().filter(|s| **s == 200).count(),
        2,
        "the calls holding streams finish: {statuses:?}"
    );
    ok(&stack).await;
    stack.shutdown().await;
}

/// Calls a hostile or careless cloud side may send, refused by the agent even though the
/// harness's agent allows every method on every path: (method, path under
/// `/relay/demo`, body, reason in the caller's 403).
const AGENT_REFUSES: &[(&str, &str, &[u8], &str)] = &[
    ("TRACE", "/echo", b"", "forbidden_method"),
    (
        "GET",
        "/echo",
        b"GET /smuggled HTTP/1.1\r\nhost: x\r\n\r\n",
        "body",
    ),
    ("HEAD", "/echo", b"x", "body"),
    ("OPTIONS", "/echo", b"x", "body"),
    ("GET", "/echo/%252e%252e/admin", b"", "unsafe_path"),
    ("GET", "/echo/%c0%ae%c0%ae/admin", b"", "unsafe_path"),
    ("GET", "/echo/caf%C3%A9", b"", "unsafe_path"),
    ("GET", "/echo/a%0d%0ax", b"", "unsafe_path"),
    ("GET", "/echo/secret.txt;.json", b"", "path"),
];

/// Headers naming the client, its scheme or a proxy: the upstream never sees them.
const SPOOFING: &[(&str, &str)] = &[
    ("x-forwarded-for", "6.6.6.6"),
    ("x-real-ip", "6.6.6.6"),
    ("true-client-ip", "6.6.6.6"),
    ("forwarded", "for=6.6.6.6"),
    ("x-forwarded-proto", "https"),
    ("x-forwarded-prefix", "/admin"),
    ("x-original-uri", "/admin"),
    ("proxy", "http://6.6.6.6:3128"),
    ("x_forwarded_for", "6.6.6.6"),
    ("x_real_ip", "6.6.6.6"),
];

#[tokio::test]
async fn the_agent_refuses_hostile_calls_with_403_and_strips_spoofing_headers() {
    let stack = Stack::builder().servers(1).start().await.unwrap();
    stack.wait_routable(Duration::from_secs(20)).await.unwrap();
    let caller = stack.caller();
    let served = stack.upstream.served();
    for (method, path, body, reason) in AGENT_REFUSES {
        let req = caller.request(
            Method::from_bytes(method.as_bytes()).unwrap(),
            &format!("/relay/demo{path}"),
            Bytes::from_static(body),
        );
        let a = caller.call(req).await.unwrap();
        assert_eq!(a.status, 403, "{method} {path}: {}", a.text());
        if *method != "HEAD" {
            assert_eq!(a.json()["error"], "refused", "{method} {path}");
            let message = a.json()["message"].as_str().unwrap_or_default().to_string();
            assert!(
                message.starts_with(&format!("agent: refused ({reason})")),
                "{method} {path}: {message}"
            );
        }
    }
    assert_eq!(
        stack.upstream.served(),
        served,
        "nothing reached the upstream"
    );

    let mut req = caller.request(Method::GET, "/relay/demo/echo", Bytes::new());
    for (name, value) in SPOOFING {
        req.headers_mut().insert(*name, value.parse().unwrap());
    }
    req.headers_mut().insert("x-keep", "1".parse().unwrap());
    let a = caller.call(req).await.unwrap();
    assert_eq!(a.status, 200, "{}", a.text());
    let seen: serde_json::Value =
        serde_json::from_str(a.headers["x-echo-headers"].to_str().unwrap()).unwrap();
    assert_eq!(seen["x-keep"], "1", "{seen}");
    for (name, _) in SPOOFING {
        assert!(
            seen.get(*name).is_none(),
            "{name} reached the upstream: {seen}"
        );
    }
    ok(&stack).await;
    stack.shutdown().await;
}

/// The client-identity family a caller could send to pass for another client, as curl
/// sends them through the relay: frameworks trust the scheme, port and prefix ones, IP
/// allow-lists the address ones.
const FAMILY: &[&str] = &[
    "X-Forwarded-For: 6.6.6.6",
    "X-Forwarded-Port: 443",
    "X-Forwarded-Ssl: on",
    "X-Forwarded-Scheme: https",
    "X-Forwarded-Protocol: https",
    "X-Forwarded-By: 6.6.6.6",
    "X-Client-IP: 6.6.6.6",
    "Client-IP: 6.6.6.6",
    "X-Cluster-Client-IP: 6.6.6.6",
    "CF-Connecting-IP: 6.6.6.6",
    "Fastly-Client-IP: 6.6.6.6",
    "True-Client-IP: 6.6.6.6",
    "X-Real-IP: 6.6.6.6",
    "X-Original-Forwarded-For: 6.6.6.6",
    "Forwarded: for=6.6.6.6",
];

/// Every header of the family is stripped on its way to the upstream, unless the rule
/// that allows the call keeps it (`pass_headers`) or writes its own (`set_headers`: here
/// `X-Forwarded-For` from the address of the agent's tunnel connection). curl is the
/// backend; the simulated upstream echoes what it got.
#[tokio::test]
async fn curl_cannot_pass_for_another_client_and_the_agent_writes_its_own_forwarded_for() {
    let stack = Stack::builder()
        .servers(1)
        .agent_config(|c| {
            c.allow = vec![
                relay_agent::config::AllowRule {
                    name: Some("internal".into()),
                    methods: vec!["GET".into()],
                    path: "/echo/internal".into(),
                    pass_headers: vec!["x-forwarded-proto".into()],
                    set_headers: [
                        ("X-Forwarded-For".to_string(), "$tunnel_peer".to_string()),
                        ("X-Forwarded-Port".to_string(), "8443".to_string()),
                    ]
                    .into(),
                    ..Default::default()
                },
                relay_agent::config::AllowRule {
                    name: Some("all".into()),
                    methods: vec!["*".into()],
                    path: "/**".into(),
                    ..Default::default()
                },
            ]
        })
        .start()
        .await
        .unwrap();
    stack.wait_routable(Duration::from_secs(20)).await.unwrap();
    let auth = format!("Authorization: Bearer {CALLER_KEY}");
    let curl = |path: &str, extra: &[&str]| {
        let mut args = vec!["-H".to_string(), auth.clone()];
        for h in FAMILY.iter().chain(extra) {
            args.extend(["-H".to_string(), h.to_string()]);
        }
        args.push(format!("http://{}/relay/demo{path}", stack.http));
        async move {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            let a = relay_tests::client::curl(&args).await.unwrap();
            assert_eq!(a.status, 200, "{}", a.text());
            let seen: serde_json::Value =
                serde_json::from_str(a.headers["x-echo-headers"].to_str().unwrap()).unwrap();
            seen
        }
    };

    let seen = curl("/echo/other", &["X-Keep: 1", "X-Forwarded-Proto: https"]).await;
    assert_eq!(seen["x-keep"], "1", "{seen}");
    for header in FAMILY.iter().chain(&["X-Forwarded-Proto: https"]) {
        let name = header.split(':').next().unwrap().to_ascii_lowercase();
        assert!(
            seen.get(&name).is_none(),
            "{name} reached the upstream: {seen}"
        );
    }

    let seen = curl("/echo/internal", &["X-Forwarded-Proto: https"]).await;
    // Kept by `pass_headers`.
    assert_eq!(seen["x-forwarded-proto"], "https", "{seen}");
    // Written by the agent: the address of its tunnel connection, never the caller's.
    assert_eq!(seen["x-forwarded-for"], "127.0.0.1", "{seen}");
    assert_eq!(seen["x-forwarded-port"], "8443", "{seen}");
    for header in FAMILY {
        let name = header.split(':').next().unwrap().to_ascii_lowercase();
        if name != "x-forwarded-for" && name != "x-forwarded-port" {
            assert!(
                seen.get(&name).is_none(),
                "{name} reached the upstream: {seen}"
            );
        }
    }
    ok(&stack).await;
    stack.shutdown().await;
}

/// A method in any letter case is matched and sent upstream in upper case: `get` is allowed
/// by a rule for GET and the upstream runs GET, never a method the rules did not name.
#[tokio::test]
async fn a_lower_case_method_reaches_the_upstream_in_upper_case() {
    let stack = Stack::builder()
        .servers(1)
        .agent_config(|c| {
            c.allow = vec![relay_agent::config::AllowRule {
                methods: vec!["GET".into()],
                path: "/**".into(),
                ..Default::default()
            }]
        })
        .start()
        .await
        .unwrap();
    stack.wait_routable(Duration::from_secs(20)).await.unwrap();
    let auth = format!("Authorization: Bearer {CALLER_KEY}");
    let url = format!("http://{}/relay/demo/echo", stack.http);
    let a = relay_tests::client::curl(&["-X", "get", "-H", &auth, &url])
        .await
        .unwrap();
    assert_eq!(a.status, 200, "{}", a.text());
    assert_eq!(a.headers["x-echo-method"], "GET");
    let a = relay_tests::client::curl(&["-X", "delete", "-H", &auth, &url])
        .await
        .unwrap();
    assert_eq!(a.status, 403, "{}", a.text());
    assert!(a.text().contains("refused (method)"), "{}", a.text());
    stack.shutdown().await;
}
