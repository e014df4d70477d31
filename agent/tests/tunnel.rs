//! The agent against a fake tunnel server (a tonic `Tunnel` service on 127.0.0.1:0 that
//! sends a hello, then hands the test each stream) and small upstreams on 127.0.0.1:0.
//! Real sockets, real time: every wait polls for a condition with a deadline.

mod common;

use common::*;

// ---------------------------------------------------------------- tests

#[tokio::test]
async fn get_and_post_round_trip_byte_for_byte() {
    let mut tunnel = FakeTunnel::start(10_000, true).await;
    let upstream = hyper_upstream().await;
    let (_agent, _) = start_agent(config(&tunnel.url, &upstream, 1)).await;
    let mut conn = tunnel.next_conn().await;

    let mut get = head(1, "GET", "/hello?x=1&y=%20", true);
    get.headers = vec![
        relay_proto::header("x-custom", "v1"),
        relay_proto::header("connection", "x-private"),
        relay_proto::header("x-private", "secret-hop"),
        relay_proto::header("host", "evil.example"),
    ];
    let a = conn.call(get, vec![]).await;
    assert_eq!(a.status(), 200, "{a:?}");
    assert_eq!(a.body, pattern(200_000));
    assert!(
        a.chunks >= 4,
        "re-chunked to MAX_CHUNK: {} chunks",
        a.chunks
    );
    let authority = upstream.trim_start_matches("http://");
    assert_eq!(a.header("x-seen-host").as_deref(), Some(authority));
    assert_eq!(
        a.header("x-seen-target").as_deref(),
        Some("/hello?x=1&y=%20")
    );
    assert_eq!(a.header("x-seen-custom").as_deref(), Some("v1"));
    assert_eq!(
        a.header("x-seen-private").as_deref(),
        Some(""),
        "headers named by Connection are dropped"
    );
    assert_eq!(
        a.header("keep-alive"),
        None,
        "hop-by-hop response headers are dropped"
    );

    // 1 MiB upload, echoed back, streamed both ways.
    let upload = pattern(1 << 20);
    let chunks: Vec<Bytes> = upload
        .chunks(relay_proto::MAX_CHUNK)
        .map(Bytes::copy_from_slice)
        .collect();
    let a = conn.call(head(2, "POST", "/echo", false), chunks).await;
    assert_eq!(a.status(), 200, "{a:?}");
    assert_eq!(a.body.len(), upload.len());
    assert!(a.body == upload, "echo is byte for byte");

    // An empty response ends with the head.
    let a = conn.call(head(3, "GET", "/empty", true), vec![]).await;
    assert_eq!(a.status(), 204);
    assert!(a.head.as_ref().unwrap().end_of_stream);

    // Ping is answered with the same sequence number.
    conn.send(In::Ping(Ping { seq: 7 })).await;
    assert_eq!(
        conn.next().await,
        Some(Out::Pong(relay_proto::Pong { seq: 7 }))
    );
}

/// A small body inside the request head (`RequestHead.body`, which the agent announces
/// it reads) reaches the upstream whole, with its length; a head that carries a body but
/// not its end is a broken stream.
#[tokio::test]
async fn a_body_inside_the_request_head_reaches_the_upstream_whole() {
    let mut tunnel = FakeTunnel::start(10_000, true).await;
    let upstream = hyper_upstream().await;
    let (_agent, _) = start_agent(config(&tunnel.url, &upstream, 1)).await;
    let mut conn = tunnel.next_conn().await;
    assert!(
        conn.features.split(',').any(|f| f.trim() == "inline-body"),
        "features announced: {:?}",
        conn.features
    );

    let payload = pattern(40_000);
    let mut post = head(1, "POST", "/echo", true);
    post.headers = vec![relay_proto::header(
        "content-length",
        payload.len().to_string(),
    )];
    post.body = Bytes::from(payload.clone());
    let a = conn.call(post, vec![]).await;
    assert_eq!(a.status(), 200, "{a:?}");
    assert!(
        a.body == payload,
        "echo is byte for byte ({} bytes)",
        a.body.len()
    );

    // Without a Content-Length from the caller the upstream still gets the whole body.
    let mut post = head(2, "POST", "/echo", true);
    post.body = Bytes::from_static(b"no length given");
    let a = conn.call(post, vec![]).await;
    assert_eq!(a.status(), 200, "{a:?}");
    assert_eq!(a.body, b"no length given");

    // A body in a head that says more frames follow: the stream is broken, not guessed at.
    let mut bad = head(3, "POST", "/echo", false);
    bad.body = Bytes::from_static(b"half");
    conn.send(In::RequestHead(bad)).await;
    loop {
        match conn.next().await {
            None => break,
            Some(Out::Pong(_) | Out::GoingAway(_)) => {}
            Some(other) => panic!("expected the stream to end, got {other:?}"),
        }
    }
}

#[tokio::test]
async fn a_large_response_streams_in_bounded_chunks() {
    let mut tunnel = FakeTunnel::start(10_000, true).await;
    let upstream = hyper_upstream().await;
    let (_agent, _) = start_agent(config(&tunnel.url, &upstream, 1)).await;
    let mut conn = tunnel.next_conn().await;
    let n = 8 << 20;
    let a = conn
        .call(head(1, "GET", &format!("/big?n={n}"), true), vec![])
        .await;
    assert_eq!(a.status(), 200);
    assert_eq!(a.body.len(), n);
    assert!(a.body == pattern(n));
    assert!(a.chunks >= n / relay_proto::MAX_CHUNK);
}

#[tokio::test]
async fn unreachable_upstream_is_a_call_error_and_the_stream_serves_the_next_call() {
    let mut tunnel = FakeTunnel::start(10_000, true).await;
    let hole = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = hole.local_addr().unwrap();
    drop(hole);
    let (_agent, _) = start_agent(config(&tunnel.url, &format!("http://{addr}"), 1)).await;
    let mut conn = tunnel.next_conn().await;

    let a = conn.call(head(1, "GET", "/hello", true), vec![]).await;
    assert_eq!(
        a.error_kind(),
        Some(CallErrorKind::UpstreamUnreachable),
        "{a:?}"
    );
    assert!(a.head.is_none());

    // The upstream comes up on that address; the same stream carries the next call.
    let listener = TcpListener::bind(addr).await.unwrap();
    tokio::spawn(serve_upstream(listener));
    let a = conn.call(head(2, "GET", "/hello", true), vec![]).await;
    assert_eq!(a.status(), 200, "{a:?}");
    assert_eq!(a.body.len(), 200_000);
}

#[tokio::test]
async fn a_slow_upstream_past_the_deadline_is_an_upstream_timeout() {
    let mut tunnel = FakeTunnel::start(10_000, true).await;
    let mut upstream = raw_upstream().await;
    let (_agent, _) = start_agent(config(&tunnel.url, &upstream.url, 1)).await;
    let mut conn = tunnel.next_conn().await;

    let mut h = head(1, "GET", "/hang", true);
    h.deadline_ms = 300;
    let started = Instant::now();
    let a = conn.call(h, vec![]).await;
    assert_eq!(
        a.error_kind(),
        Some(CallErrorKind::UpstreamTimeout),
        "{a:?}"
    );
    assert!(started.elapsed() < Duration::from_secs(3));
    upstream.expect("closed").await;

    let a = conn.call(head(2, "GET", "/ok", true), vec![]).await;
    assert_eq!(a.status(), 200, "{a:?}");
}

#[tokio::test]
async fn cancel_drops_the_upstream_request_and_frees_the_stream() {
    let mut tunnel = FakeTunnel::start(10_000, true).await;
    let mut upstream = raw_upstream().await;
    let (_agent, _) = start_agent(config(&tunnel.url, &upstream.url, 1)).await;
    let mut conn = tunnel.next_conn().await;

    conn.send(In::RequestHead(head(1, "GET", "/hang", true)))
        .await;
    upstream.expect("hang").await;
    conn.send(In::Cancel(Cancel { call_id: 1 })).await;
    let a = conn.read_answer(1).await;
    assert_eq!(a.error_kind(), Some(CallErrorKind::Cancelled), "{a:?}");
    upstream.expect("closed").await;

    // A late Cancel for the finished call is ignored; the stream is idle and serves on.
    conn.send(In::Cancel(Cancel { call_id: 1 })).await;
    let a = conn.call(head(2, "GET", "/ok", true), vec![]).await;
    assert_eq!(a.status(), 200, "{a:?}");
    assert_eq!(a.body, b"ok");
}

#[tokio::test]
async fn a_refused_token_is_retried_with_backoff_until_the_server_accepts() {
    let mut tunnel = FakeTunnel::start(10_000, false).await;
    let upstream = hyper_upstream().await;
    let mut cfg = config(&tunnel.url, &upstream, 1);
    cfg.coverage.tick = Duration::from_millis(50);
    cfg.backoff_initial = Duration::from_millis(200);
    cfg.backoff_max = Duration::from_secs(1);
    let (agent, _) = start_agent(cfg).await;

    let rejections = tunnel.rejections.clone();
    eventually("five refused opens", || {
        rejections.lock().unwrap().len() >= 5
    })
    .await;
    let times = rejections.lock().unwrap().clone();
    // Every tick (50 ms) would give 5 attempts in 0.2 s; the backoff spaces them by at
    // least half of 0.2 + 0.4 + 0.8 + 1.0 s.
    let spread = times[4] - times[0];
    assert!(
        spread >= Duration::from_millis(1200),
        "attempts too close: {spread:?}"
    );
    let opens = relay_common::admin::render_metrics(agent.registry());
    assert!(
        opens.contains("relay_agent_stream_opens_total{result=\"unauthenticated\"}"),
        "{opens}"
    );

    tunnel.accept.store(true, Ordering::SeqCst);
    let mut conn = tunnel.next_conn().await;
    let a = conn.call(head(1, "GET", "/hello", true), vec![]).await;
    assert_eq!(a.status(), 200);
}

#[tokio::test]
async fn a_malformed_frame_closes_only_that_stream() {
    let mut tunnel = FakeTunnel::start(10_000, true).await;
    let upstream = hyper_upstream().await;
    let (_agent, _) = start_agent(config(&tunnel.url, &upstream, 2)).await;
    let mut newer = tunnel.next_conn().await;
    let mut good = tunnel.next_conn().await;

    // A frame of a kind this agent does not know (from a newer server) is skipped: the
    // stream keeps serving.
    newer.tx.send(Ok(ServerFrame { kind: None })).await.unwrap();
    let a = newer.call(head(1, "GET", "/hello", true), vec![]).await;
    assert_eq!(
        a.status(),
        200,
        "the stream still serves after an unknown frame"
    );

    let a = good.call(head(2, "GET", "/hello", true), vec![]).await;
    assert_eq!(a.status(), 200);

    // A body chunk for a call that is not in flight breaks the protocol: the agent closes
    // that stream only.
    let mut replacement = newer;
    let stray = BodyChunk {
        call_id: 99,
        data: bytes::Bytes::from_static(b"x"),
        end: true,
    };
    replacement.send(In::RequestBody(stray)).await;
    assert_eq!(replacement.next().await, None);

    // So is a second RequestHead while a call is in flight.
    let mut third = tunnel.next_conn().await;
    third
        .send(In::RequestHead(head(5, "POST", "/echo", false)))
        .await;
    third
        .send(In::RequestHead(head(6, "GET", "/hello", true)))
        .await;
    loop {
        match third.next().await {
            None => break,
            Some(
                Out::CallError(_) | Out::ResponseHead(_) | Out::ResponseBody(_) | Out::Pong(_),
            ) => {}
            Some(other) => panic!("unexpected {other:?}"),
        }
    }

    let a = good.call(head(2, "GET", "/hello", true), vec![]).await;
    assert_eq!(a.status(), 200, "the other stream is untouched");
}

#[tokio::test]
async fn drain_finishes_the_call_then_sends_going_away() {
    let mut tunnel = FakeTunnel::start(10_000, true).await;
    let upstream = hyper_upstream().await;
    let (_agent, _) = start_agent(config(&tunnel.url, &upstream, 1)).await;
    let mut conn = tunnel.next_conn().await;

    conn.send(In::RequestHead(head(1, "GET", "/hello", true)))
        .await;
    conn.send(In::Drain(Drain { grace_ms: 5_000 })).await;
    let a = conn.read_answer(1).await;
    assert_eq!(a.status(), 200);
    assert_eq!(a.body.len(), 200_000);
    assert_eq!(
        conn.next().await,
        Some(Out::GoingAway(relay_proto::GoingAway {}))
    );
    // A head that crossed the GoingAway is still served.
    let a = conn.call(head(2, "GET", "/empty", true), vec![]).await;
    assert_eq!(a.status(), 204);
    // The server then ends the stream; the agent opens a replacement.
    drop(conn);
    let mut next = tunnel.next_conn().await;
    let a = next.call(head(3, "GET", "/empty", true), vec![]).await;
    assert_eq!(a.status(), 204);
}

#[tokio::test]
async fn a_silent_server_stream_is_closed_after_three_heartbeats() {
    let mut tunnel = FakeTunnel::start(100, true).await;
    let upstream = hyper_upstream().await;
    let (_agent, _) = start_agent(config(&tunnel.url, &upstream, 1)).await;
    let mut conn = tunnel.next_conn().await;
    // Pings keep it alive past three periods...
    for seq in 0..6 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        conn.send(In::Ping(Ping { seq })).await;
        assert_eq!(
            conn.next().await,
            Some(Out::Pong(relay_proto::Pong { seq }))
        );
    }
    // ...silence ends it, and the agent replaces it.
    let started = Instant::now();
    assert_eq!(conn.next().await, None);
    assert!(started.elapsed() < Duration::from_secs(3));
    let _replacement = tunnel.next_conn().await;
}

#[tokio::test]
async fn systemcheck_reports_servers_and_upstream() {
    let mut tunnel = FakeTunnel::start(10_000, true).await;
    let upstream = hyper_upstream().await;
    let (agent, admin) = start_agent(config(&tunnel.url, &upstream, 2)).await;
    let _a = tunnel.next_conn().await;
    let _b = tunnel.next_conn().await;
    eventually("systemcheck ok with both streams", || {
        let c = agent.systemcheck();
        c.ok && c.servers.len() == 1 && c.servers[0].streams == 2
    })
    .await;
    let (status, body) = http_get(admin, "/systemcheck").await;
    assert_eq!(status, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["ok"], true);
    assert_eq!(v["servers"][0]["server_id"], "ts-1");
    assert_eq!(v["servers"][0]["zone"], "zone-a");
    assert_eq!(v["servers"][0]["streams"], 2);
    assert_eq!(v["servers"][0]["idle"], 2);
    assert!(v["servers"][0]["state"].is_string());
    assert_eq!(v["upstream"]["reachable"], true);
    assert_eq!(v["upstream"]["status"], 404);
    assert_eq!(v["streams_total"], 2);
    let (status, _) = http_get(admin, "/readyz").await;
    assert_eq!(status, 200);
    let (_, metrics) = http_get(admin, "/metrics").await;
    assert!(
        metrics.contains("grpc_tunnel_server_streams{server_id=\"ts-1\",state=\"idle\"} 2"),
        "{metrics}"
    );
}

#[tokio::test]
async fn systemcheck_is_503_while_the_upstream_is_down() {
    let mut tunnel = FakeTunnel::start(10_000, true).await;
    let hole = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = hole.local_addr().unwrap();
    drop(hole);
    let (agent, admin) = start_agent(config(&tunnel.url, &format!("http://{addr}"), 1)).await;
    let _conn = tunnel.next_conn().await;
    let health = agent.upstream_health();
    eventually("a failed upstream check and a live stream", || {
        health.borrow().error.as_deref() != Some("not checked yet")
            && agent.systemcheck().servers.len() == 1
    })
    .await;
    let (status, body) = http_get(admin, "/systemcheck").await;
    assert_eq!(status, 503, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["ok"], false);
    assert_eq!(
        v["problems"],
        serde_json::json!([format!(
            "upstream http://{addr}/ unreachable: {}",
            v["upstream"]["error"].as_str().unwrap_or_default()
        )]),
        "{body}"
    );
    assert_eq!(http_get(admin, "/readyz").await.0, 503);
    assert_eq!(v["upstream"]["reachable"], false);
    assert!(v["upstream"]["error"]
        .as_str()
        .is_some_and(|e| !e.is_empty()));
}

#[tokio::test]
async fn systemcheck_and_readyz_are_503_once_every_tunnel_server_is_gone() {
    let mut tunnel = FakeTunnel::start(10_000, true).await;
    let upstream = hyper_upstream().await;
    let (agent, admin) = start_agent(config(&tunnel.url, &upstream, 2)).await;
    let a = tunnel.next_conn().await;
    let b = tunnel.next_conn().await;
    eventually("systemcheck ok with both streams", || {
        agent.systemcheck().ok
    })
    .await;
    assert_eq!(http_get(admin, "/readyz").await.0, 200);
    // Every tunnel server goes: the streams end and no new one is accepted.
    tunnel.accept.store(false, Ordering::SeqCst);
    drop((a, b));
    eventually("no live stream", || agent.systemcheck().servers.is_empty()).await;
    let (status, body) = http_get(admin, "/systemcheck").await;
    assert_eq!(status, 503, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["ok"], false);
    assert!(
        v["problems"][0]
            .as_str()
            .is_some_and(|p| p.contains("no live tunnel stream")),
        "{body}"
    );
    let (status, body) = http_get(admin, "/readyz").await;
    assert_eq!(status, 503, "no call can be served: {body}");
}

#[tokio::test]
async fn systemcheck_is_503_when_a_server_carrying_calls_stays_short_past_grace() {
    let mut tunnel = FakeTunnel::start(10_000, true).await;
    let upstream = hyper_upstream().await;
    let mut cfg = config(&tunnel.url, &upstream, 1);
    // One stream at most: with a call on it the server stays short of busy + reserve.
    cfg.coverage = CoverageConfig {
        max_streams: 1,
        fixed_streams: 1,
        grace: Duration::from_secs(1),
        tick: Duration::from_millis(200),
        ..CoverageConfig::default()
    };
    let (agent, admin) = start_agent(cfg).await;
    let conn = tunnel.next_conn().await;
    eventually("systemcheck ok at rest", || agent.systemcheck().ok).await;
    // A call that does not end: /echo with a body that never finishes.
    conn.send(In::RequestHead(head(1, "POST", "/echo", false)))
        .await;
    eventually("short past grace", || !agent.systemcheck().ok).await;
    let (status, body) = http_get(admin, "/systemcheck").await;
    assert_eq!(status, 503, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    let problem = v["problems"][0].as_str().unwrap_or_default().to_string();
    assert!(
        problem.contains("server ts-1 carries 1 calls") && problem.contains("grace 1s"),
        "{body}"
    );
    assert_eq!(v["servers"][0]["busy"], 1);
    // The server still serves (its calls queue): ready.
    assert_eq!(http_get(admin, "/readyz").await.0, 200);
}

#[tokio::test]
async fn shutdown_sends_going_away_and_returns() {
    let mut tunnel = FakeTunnel::start(10_000, true).await;
    let upstream = hyper_upstream().await;
    let (agent, _) = start_agent(config(&tunnel.url, &upstream, 1)).await;
    let mut conn = tunnel.next_conn().await;
    let stopping = tokio::spawn(agent.shutdown());
    assert_eq!(
        conn.next().await,
        Some(Out::GoingAway(relay_proto::GoingAway {}))
    );
    // The server closes the retired stream; the agent then finishes promptly.
    drop(conn);
    timeout(Duration::from_secs(5), stopping)
        .await
        .expect("shutdown finished")
        .unwrap();
}

#[tokio::test]
async fn a_small_answer_of_known_length_travels_inside_the_head() {
    let mut tunnel = FakeTunnel::start(10_000, true).await;
    let upstream = hyper_upstream().await;
    let (_agent, _) = start_agent(config(&tunnel.url, &upstream, 1)).await;
    let mut conn = tunnel.next_conn().await;
    let a = conn.call(head(1, "GET", "/big?n=1000", true), vec![]).await;
    assert_eq!(a.status(), 200, "{a:?}");
    assert_eq!(a.body, pattern(1000));
    assert_eq!(a.chunks, 0, "one frame: the head carries the body");
    assert!(a.head.as_ref().is_some_and(|h| h.end_of_stream));
}
