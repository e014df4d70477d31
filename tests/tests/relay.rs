//! The relay end to end on real sockets: a backend's call enters the dispatcher, crosses a
//! tunnel server and one of the agent's streams, reaches the upstream, and the answer
//! streams back. Bad input gets the documented status and JSON reason.

use bytes::Bytes;
use http::Method;
use relay_agent::coverage::plan::CoverageConfig;
use relay_tests::checks;
use relay_tests::client::Caller;
use relay_tests::eventually;
use relay_tests::stack::{Stack, TUNNEL_ID};
use std::time::Duration;
use tokio::time::Instant;

const READY: Duration = Duration::from_secs(20);

fn fixed_pool(n: u32) -> CoverageConfig {
    CoverageConfig {
        enabled: false,
        fixed_streams: n,
        ..CoverageConfig::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn get_and_post_round_trip_byte_for_byte() {
    let stack = Stack::builder().start().await.unwrap();
    stack.wait_routable(READY).await.unwrap();
    let caller = stack.caller();

    let mut req = caller.request(
        Method::GET,
        &format!("/relay/{TUNNEL_ID}/echo/a%20b?x=1&y=%C3%A9&x=2"),
        Bytes::new(),
    );
    req.headers_mut().append("x-custom", "one".parse().unwrap());
    req.headers_mut().append("x-custom", "two".parse().unwrap());
    let a = caller.call(req).await.unwrap();
    assert_eq!(a.status, 200, "{}", a.text());
    assert_eq!(a.headers["x-echo-method"], "GET");
    assert_eq!(a.headers["x-echo-path"], "/echo/a%20b?x=1&y=%C3%A9&x=2");
    let seen = a.headers["x-echo-headers"].to_str().unwrap().to_string();
    assert!(
        seen.contains("one") && seen.contains("two"),
        "repeated header lost: {seen}"
    );
    assert!(
        !seen.to_ascii_lowercase().contains("dev-caller-key"),
        "the caller key reached the upstream: {seen}"
    );

    let body: Vec<u8> = (0..=255u8).cycle().take(10_000).collect();
    let mut req = caller.request(
        Method::POST,
        &format!("/relay/{TUNNEL_ID}/echo"),
        body.clone(),
    );
    req.headers_mut()
        .insert("content-type", "application/octet-stream".parse().unwrap());
    let a = caller.call(req).await.unwrap();
    assert_eq!(a.status, 200);
    assert_eq!(a.headers["x-echo-method"], "POST");
    assert_eq!(&a.body[..], &body[..]);
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_1_mib_request_body_and_a_64_mib_streamed_response_pass() {
    let stack = Stack::builder().start().await.unwrap();
    stack.wait_routable(READY).await.unwrap();
    checks::large_bodies_pass_byte_for_byte(&stack).await;
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_concurrent_calls_against_a_slow_upstream_all_complete() {
    let stack = Stack::builder().start().await.unwrap();
    stack.wait_routable(READY).await.unwrap();
    let caller = stack.caller();
    let calls = (0..200).map(|i| {
        let caller = caller.clone();
        tokio::spawn(async move {
            let mut req = caller.request(
                Method::GET,
                &format!("/relay/{TUNNEL_ID}/slow/200?i={i}"),
                Bytes::new(),
            );
            req.headers_mut()
                .insert("x-relay-timeout-ms", "30000".parse().unwrap());
            caller.call(req).await
        })
    });
    let answers = futures::future::join_all(calls).await;
    let mut ok = 0;
    for a in answers {
        let a = a.unwrap().unwrap();
        assert_eq!(a.status, 200, "{}", a.text());
        ok += 1;
    }
    assert_eq!(ok, 200);
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_or_wrong_caller_key_gets_401_with_a_json_reason() {
    let stack = Stack::builder().start().await.unwrap();
    stack.wait_routable(READY).await.unwrap();
    for key in [None, Some("not-the-key")] {
        let a = Caller::new(stack.http, key)
            .get(&format!("/relay/{TUNNEL_ID}/hello"))
            .await
            .unwrap();
        assert_eq!(a.status, 401);
        assert_eq!(a.json()["error"], "unauthorized", "{}", a.text());
        assert!(a.json()["message"].as_str().is_some_and(|m| !m.is_empty()));
        assert!(
            !a.text().contains("not-the-key"),
            "the key is echoed: {}",
            a.text()
        );
    }
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_tunnel_id_gets_503_with_retry_after() {
    let stack = Stack::builder().start().await.unwrap();
    stack.wait_routable(READY).await.unwrap();
    let a = stack
        .caller()
        .get("/relay/nobody-here/hello")
        .await
        .unwrap();
    assert_eq!(a.status, 503);
    assert_eq!(a.json()["error"], "tunnel_unavailable", "{}", a.text());
    assert_eq!(a.json()["tunnel_id"], "nobody-here");
    assert!(a.headers.contains_key("retry-after"));
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_stream_free_before_the_deadline_gets_503_no_capacity() {
    let stack = Stack::builder()
        .servers(1)
        .coverage(fixed_pool(1))
        .start()
        .await
        .unwrap();
    stack.wait_routable(READY).await.unwrap();
    let caller = stack.caller();
    // The agent's only stream is held by a slow call.
    let holder = {
        let caller = caller.clone();
        tokio::spawn(async move { caller.get(&format!("/relay/{TUNNEL_ID}/slow/3000")).await })
    };
    eventually("the slow call holds the stream", READY, || async {
        stack.upstream.in_flight() == 1
    })
    .await;
    let mut req = caller.request(
        Method::GET,
        &format!("/relay/{TUNNEL_ID}/hello"),
        Bytes::new(),
    );
    // The server gives up queueing a tenth of the deadline before it (at most 250 ms), so
    // the caller hears 503 rather than the dispatcher's own 504: 1 s leaves that answer
    // 100 ms to arrive on a busy machine (300 ms left 30 ms, and lost that race there).
    req.headers_mut()
        .insert("x-relay-timeout-ms", "1000".parse().unwrap());
    let started = Instant::now();
    let a = caller.call(req).await.unwrap();
    assert_eq!(a.status, 503, "{}", a.text());
    assert_eq!(a.json()["error"], "no_capacity", "{}", a.text());
    assert!(a.headers.contains_key("retry-after"));
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "the queued call outlived its deadline"
    );
    assert_eq!(holder.await.unwrap().unwrap().status, 200);
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_upstream_gets_502_and_the_stream_serves_the_next_call() {
    // A port with nothing listening.
    let dead = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let dead_url = format!("http://{}", dead.local_addr().unwrap());
    drop(dead);
    let stack = Stack::builder()
        .servers(1)
        .coverage(fixed_pool(1))
        .agent_config(move |c| c.upstream = dead_url)
        .start()
        .await
        .unwrap();
    let caller = &stack.caller();
    let a = relay_tests::eventually("a 502", READY, || async move {
        let a = caller
            .get(&format!("/relay/{TUNNEL_ID}/hello"))
            .await
            .unwrap();
        if a.status == 502 {
            Ok(a)
        } else {
            Err(format!("{} {}", a.status, a.text()))
        }
    })
    .await;
    assert_eq!(a.json()["error"], "upstream_unreachable", "{}", a.text());
    // The same single stream answers again: it went back to idle.
    let b = caller
        .get(&format!("/relay/{TUNNEL_ID}/hello"))
        .await
        .unwrap();
    assert_eq!(b.status, 502, "{}", b.text());
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn too_slow_upstream_gets_504_with_a_json_reason() {
    let stack = Stack::builder()
        .servers(1)
        .coverage(fixed_pool(2))
        .start()
        .await
        .unwrap();
    stack.wait_routable(READY).await.unwrap();
    let caller = stack.caller();
    let mut req = caller.request(
        Method::GET,
        &format!("/relay/{TUNNEL_ID}/slow/5000"),
        Bytes::new(),
    );
    req.headers_mut()
        .insert("x-relay-timeout-ms", "400".parse().unwrap());
    let a = caller.call(req).await.unwrap();
    assert_eq!(a.status, 504, "{}", a.text());
    let code = a.json()["error"].as_str().unwrap_or_default().to_string();
    assert!(
        code == "upstream_timeout" || code == "deadline_exceeded",
        "{}",
        a.text()
    );
    // Streams are reusable afterwards.
    let b = caller
        .get(&format!("/relay/{TUNNEL_ID}/hello"))
        .await
        .unwrap();
    assert_eq!(b.status, 200);
    stack.shutdown().await;
}

/// A caller that leaves mid-call, and one whose upload breaks off, each cancel the
/// upstream request (a cut upload never ends as if whole), and the agent's only stream
/// serves the next call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_leaving_mid_call_or_mid_upload_cancels_the_upstream_and_frees_the_stream() {
    let stack = Stack::builder()
        .servers(1)
        .coverage(fixed_pool(1))
        .start()
        .await
        .unwrap();
    stack.wait_routable(READY).await.unwrap();
    checks::a_caller_leaving_cancels_the_upstream(&stack).await;
    checks::a_caller_whose_upload_breaks_off_cancels_the_upstream(&stack).await;
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_agent_token_is_refused_and_retried_with_backoff() {
    let stack = Stack::builder()
        .servers(1)
        .coverage(fixed_pool(2))
        .agent_config(|c| c.token = relay_common::Secret::new("not-a-known-token"))
        .start()
        .await
        .unwrap();
    let server = stack.servers[0].as_ref().unwrap();
    let refused = || {
        let text = relay_common::admin::render_metrics(&server.registry);
        text.lines()
            .find(|l| l.starts_with("relay_tunnel_stream_opens_total{result=\"unauthenticated\"}"))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    eventually("the server refused the agent", READY, || async {
        refused() >= 2.0
    })
    .await;
    // Backoff: a window of one second in which the agent retries only a handful of times.
    let before = refused();
    relay_tests::holds_for(
        "the agent backs off: at most 20 refused opens in 1 s",
        Duration::from_secs(1),
        || async { refused() - before <= 20.0 },
    )
    .await;
    let a = stack
        .caller()
        .get(&format!("/relay/{TUNNEL_ID}/hello"))
        .await
        .unwrap();
    assert_eq!(a.status, 503);
    stack.shutdown().await;
}

/// Calls reach the tunnel server on carriers (`Forward.Carry`), reused call after call:
/// 300 calls one at a time and 400 eight at a time (GETs, and POSTs whose body is sent
/// whole) open at most as many carriers as calls ran at once, every call gets its own
/// answer, and the server holds exactly the carriers the dispatcher opened.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_reuse_carriers_to_the_tunnel_server_one_call_at_a_time_each() {
    let stack = Stack::builder()
        .servers(1)
        .coverage(fixed_pool(8))
        .start()
        .await
        .unwrap();
    stack.wait_routable(READY).await.unwrap();
    let caller = stack.caller();
    let call = |i: usize| {
        let caller = caller.clone();
        async move {
            let path = format!("/relay/{TUNNEL_ID}/echo/{i}");
            let body = if i.is_multiple_of(2) {
                Bytes::new()
            } else {
                Bytes::from(format!("body of call {i}").repeat(i % 7 + 1))
            };
            let method = if body.is_empty() {
                Method::GET
            } else {
                Method::POST
            };
            let a = caller
                .call(caller.request(method, &path, body.clone()))
                .await
                .unwrap();
            assert_eq!(a.status, 200, "call {i}: {}", a.text());
            assert_eq!(a.headers["x-echo-path"], format!("/echo/{i}"), "call {i}");
            assert_eq!(&a.body[..], &body[..], "call {i}");
        }
    };
    for i in 0..300 {
        call(i).await;
    }
    let metrics = || async {
        relay_tests::procs::scrape(stack.dispatcher_admin)
            .await
            .unwrap()
    };
    let after_serial = relay_tests::procs::metric(
        &metrics().await,
        "relay_dispatcher_forward_carriers_opened_total",
        &[],
    );
    // The routing probe of `wait_routable` may have opened one too.
    assert!(
        (1.0..=2.0).contains(&after_serial),
        "300 calls one at a time opened {after_serial} carriers"
    );
    for batch in 0..50 {
        futures::future::join_all((0..8).map(|j| call(1000 + batch * 8 + j))).await;
    }
    let opened = relay_tests::procs::metric(
        &metrics().await,
        "relay_dispatcher_forward_carriers_opened_total",
        &[],
    );
    assert!(
        (1.0..=after_serial + 8.0).contains(&opened),
        "400 calls 8 at a time opened {opened} carriers in all"
    );
    let server = stack.servers[0].as_ref().unwrap().registry.clone();
    eventually(
        "the server holds the carriers the dispatcher opened",
        READY,
        || {
            let server = server.clone();
            async move {
                relay_tests::metrics::value(&server, "relay_tunnel_forward_carriers", &[]) == opened
            }
        },
    )
    .await;
    // No call met a carrier its server had ended (that call would have been retried).
    let retries =
        relay_tests::procs::metric(&metrics().await, "relay_dispatcher_retries_total", &[]);
    assert_eq!(retries, 0.0);
    stack.shutdown().await;
}

/// Idle carriers close after `carrier_idle_timeout` with no call to trigger it (both ends
/// let them go), and the next call opens a new one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_carriers_close_after_the_idle_timeout() {
    let stack = Stack::builder()
        .servers(1)
        .coverage(fixed_pool(4))
        .dispatcher_config(|c| c.carrier_idle_timeout = Duration::from_millis(300))
        .start()
        .await
        .unwrap();
    stack.wait_routable(READY).await.unwrap();
    let caller = stack.caller();
    let paths: Vec<String> = (0..4)
        .map(|i| format!("/relay/{TUNNEL_ID}/slow/50?i={i}"))
        .collect();
    for a in futures::future::join_all(paths.iter().map(|p| caller.get(p))).await {
        assert_eq!(a.unwrap().status, 200);
    }
    let server = stack.servers[0].as_ref().unwrap().registry.clone();
    let carriers = || relay_tests::metrics::value(&server, "relay_tunnel_forward_carriers", &[]);
    assert!(carriers() >= 1.0, "the calls came on carriers");
    eventually("every idle carrier closed", READY, || async {
        carriers() == 0.0
    })
    .await;
    let a = caller
        .get(&format!("/relay/{TUNNEL_ID}/hello"))
        .await
        .unwrap();
    assert_eq!(a.status, 200);
    assert_eq!(carriers(), 1.0, "the next call opened a carrier");
    stack.shutdown().await;
}
