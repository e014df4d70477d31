//! A hostile cloud side against the agent's request-head and frame limits, over real
//! sockets: the fake tunnel server sends over-count and oversized request heads and
//! oversized body chunks. Nothing is sized by a peer-supplied count, nothing panics, the
//! caller side gets a clear REFUSED (or the stream closes for frames no agent should
//! decode), and a fresh stream serves the next call.

mod common;

use common::*;

/// Hostile request heads: (what, headers, `limits.max_header_bytes`). Each has more than
/// the default `limits.max_headers` (256) headers and at most the protocol's
/// `MAX_HEAD_RECORDS` (more never get decoded: see `hostile_frames`); the byte limit is
/// raised where the count alone would otherwise pass it.
fn hostile_heads() -> Vec<(&'static str, Vec<bytes::Bytes>, usize)> {
    vec![
        (
            "257 small headers",
            vec![relay_proto::header("x-a", "1"); 257],
            64 * 1024,
        ),
        (
            "16384 empty-valued headers",
            vec![relay_proto::header("x-a", ""); relay_proto::MAX_HEAD_RECORDS],
            1024 * 1024,
        ),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_heads_over_max_headers_are_refused_and_the_stream_serves_on() {
    let upstream = hyper_upstream().await;
    for (what, headers, max_bytes) in hostile_heads() {
        let mut tunnel = FakeTunnel::start(10_000, true).await;
        let mut cfg = config(&tunnel.url, &upstream, 1);
        cfg.limits.max_header_bytes = max_bytes;
        let (_agent, _) = start_agent(cfg).await;
        let mut conn = tunnel.next_conn().await;
        let mut h = head(1, "GET", "/hello", true);
        h.headers = headers;
        let a = conn.call(h, vec![]).await;
        assert_eq!(
            a.error_kind(),
            Some(CallErrorKind::Refused),
            "{what}: {a:?}"
        );
        let msg = &a.error.as_ref().unwrap().message;
        assert!(
            msg.starts_with("refused (header_size)") && msg.contains("limits.max_headers (256)"),
            "{what}: {msg}"
        );
        let a = conn.call(head(2, "GET", "/hello", true), vec![]).await;
        assert_eq!(a.status(), 200, "{what}: the same stream serves on: {a:?}");
    }
}

/// A request head holding a header record that is not an encoded `Header` is answered with
/// a BAD_REQUEST call error naming the record (the filter refuses it before any rule or the
/// upstream sees the call), and the same stream serves the next call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_header_record_is_a_bad_request_and_the_stream_serves_on() {
    let upstream = hyper_upstream().await;
    let mut tunnel = FakeTunnel::start(10_000, true).await;
    let (_agent, _) = start_agent(config(&tunnel.url, &upstream, 1)).await;
    let mut conn = tunnel.next_conn().await;
    let mut h = head(1, "GET", "/hello", true);
    h.headers = vec![
        relay_proto::header("x-a", "1"),
        // A value that claims 4 bytes and has 2.
        bytes::Bytes::from_static(&[0x0a, 1, b'x', 0x12, 4, b'a', b'b']),
    ];
    let a = conn.call(h, vec![]).await;
    assert_eq!(a.error_kind(), Some(CallErrorKind::BadRequest), "{a:?}");
    let msg = &a.error.as_ref().unwrap().message;
    assert!(msg.contains("malformed header (entry 1"), "{msg}");
    let a = conn.call(head(2, "GET", "/hello", true), vec![]).await;
    assert_eq!(a.status(), 200, "the same stream serves on: {a:?}");
}

/// Frames no agent should take in: (what, frames after a bodyless or bodied head). Each
/// ends the stream (never a decoded 2 MiB head, never a body chunk over 64 KiB passed
/// upstream); the agent opens a new stream that serves.
fn hostile_frames() -> Vec<(&'static str, Vec<ServerFrame>)> {
    let huge = RequestHead {
        headers: vec![relay_proto::header("x-big", vec![b'a'; 2 * 1024 * 1024])],
        ..head(1, "GET", "/hello", true)
    };
    let chunk = BodyChunk {
        call_id: 1,
        data: vec![b'b'; relay_proto::MAX_CHUNK + 1].into(),
        end: true,
    };
    // Over the protocol's bound on a head's records: counted on the frame's bytes and
    // refused before decoding (`HeaderMap::with_capacity` panics from 24577 entries on: a
    // head was once sized by this count).
    let many = |n: usize| RequestHead {
        headers: vec![relay_proto::header("x-a", ""); n],
        ..head(1, "GET", "/hello", true)
    };
    vec![
        (
            "a 2 MiB request head (over max_frame_bytes)",
            vec![ServerFrame::of(In::RequestHead(huge))],
        ),
        (
            "24577 empty-valued headers (over MAX_HEAD_RECORDS)",
            vec![ServerFrame::of(In::RequestHead(many(24_577)))],
        ),
        (
            "a head of 1 MiB of empty records",
            vec![ServerFrame::of(In::RequestHead(many(500_000)))],
        ),
        (
            "a request body chunk over 64 KiB",
            vec![
                ServerFrame::of(In::RequestHead(head(1, "POST", "/echo", false))),
                ServerFrame::of(In::RequestBody(chunk)),
            ],
        ),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_frames_from_the_server_end_the_stream_and_a_new_one_serves() {
    let upstream = hyper_upstream().await;
    for (what, frames) in hostile_frames() {
        let mut tunnel = FakeTunnel::start(10_000, true).await;
        let (_agent, _) = start_agent(config(&tunnel.url, &upstream, 1)).await;
        let mut conn = tunnel.next_conn().await;
        for f in frames {
            // The agent may already have closed the stream on an earlier frame.
            let _ = conn.tx.send(Ok(f)).await;
        }
        // Whatever the agent said before it noticed, the stream ends without a complete
        // answer to the hostile call.
        loop {
            match conn.next().await {
                None => break,
                Some(Out::ResponseBody(b)) => assert!(!b.end, "{what}: answered in full"),
                Some(Out::CallError(e)) => panic!("{what}: decoded and answered: {e:?}"),
                Some(_) => {}
            }
        }
        let mut fresh = tunnel.next_conn().await;
        let a = fresh.call(head(7, "GET", "/hello", true), vec![]).await;
        assert_eq!(a.status(), 200, "{what}: a new stream serves: {a:?}");
    }
}

/// A server id that would forge log lines (a newline, an ANSI escape, a space) ends the
/// stream at its hello: the agent never serves on it, and a server with a printable id is
/// served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hello_whose_server_id_would_forge_log_lines_ends_the_stream() {
    let upstream = hyper_upstream().await;
    for server_id in ["ts-1\nINFO forged line", "ts\u{1b}[2J", "ts 1", ""] {
        let mut tunnel = FakeTunnel::start_as(server_id, 10_000, true).await;
        let (_agent, _) = start_agent(config(&tunnel.url, &upstream, 1)).await;
        let mut conn = tunnel.next_conn().await;
        // The agent may have ended the stream already.
        let _ = conn
            .tx
            .send(Ok(ServerFrame::of(In::RequestHead(head(
                1, "GET", "/hello", true,
            )))))
            .await;
        loop {
            match conn.next().await {
                None => break,
                Some(Out::ResponseHead(h)) => panic!("{server_id:?}: served a call: {h:?}"),
                Some(_) => {}
            }
        }
    }
    let mut tunnel = FakeTunnel::start_as("ts-1", 10_000, true).await;
    let (_agent, _) = start_agent(config(&tunnel.url, &upstream, 1)).await;
    let mut conn = tunnel.next_conn().await;
    let a = conn.call(head(1, "GET", "/hello", true), vec![]).await;
    assert_eq!(a.status(), 200, "{a:?}");
}

/// A metric's value from the agent's `/metrics` (0 when the series is missing).
async fn agent_metric(admin: SocketAddr, name: &str) -> f64 {
    let (status, text) = http_get(admin, "/metrics").await;
    assert_eq!(status, 200);
    text.lines()
        .find(|l| l.split_whitespace().next() == Some(name))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

/// A listener on an address inside the agent's network (127.0.0.2 stands for any internal
/// host) that counts the connections it gets.
async fn internal_host() -> (SocketAddr, Arc<AtomicU64>) {
    let listener = TcpListener::bind("127.0.0.2:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let accepted = Arc::new(AtomicU64::new(0));
    let count = accepted.clone();
    tokio::spawn(async move {
        while let Ok((sock, _)) = listener.accept().await {
            count.fetch_add(1, Ordering::SeqCst);
            drop(sock);
        }
    });
    (addr, accepted)
}

/// A tunnel server (or the dispatcher behind its fleet news) advertising a `direct_url` on a
/// host inside the customer's network cannot make the agent dial it: with direct growth on,
/// the agent fills through the endpoints it was given, counts and logs the refusal, and
/// never connects there. Listed in `direct_hosts`, the same host is dialed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_direct_url_outside_the_allowed_hosts_is_never_dialed() {
    let upstream = hyper_upstream().await;
    let (internal, accepted) = internal_host().await;
    let mut tunnel = FakeTunnel::start(10_000, true).await;
    *tunnel.direct_url.lock().unwrap() = format!("http://{internal}");
    let mut cfg = config(&tunnel.url, &upstream, 1);
    cfg.coverage = CoverageConfig {
        direct_growth: true,
        tick: Duration::from_millis(50),
        ..CoverageConfig::default()
    };
    let (_agent, admin) = start_agent(cfg.clone()).await;
    let _first = tunnel.next_conn().await;
    // Filling toward the reserve goes to the server's direct URL: refused, counted.
    let deadline = Instant::now() + WAIT;
    while agent_metric(admin, "relay_agent_direct_urls_refused_total").await < 1.0 {
        assert!(Instant::now() < deadline, "no direct open was refused");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The agent grows through its tunnel endpoint instead.
    let _second = tunnel.next_conn().await;
    assert_eq!(
        accepted.load(Ordering::SeqCst),
        0,
        "the agent dialed {internal}"
    );
    drop(_agent);

    // The same host, allowed by the customer's config, is dialed.
    let mut tunnel = FakeTunnel::start(10_000, true).await;
    *tunnel.direct_url.lock().unwrap() = format!("http://{internal}");
    cfg.tunnels = vec![tunnel.url.clone()];
    cfg.direct_hosts = vec!["127.0.0.2".into()];
    let (_agent, admin) = start_agent(cfg).await;
    let _first = tunnel.next_conn().await;
    eventually("the agent dials the allowed direct URL", || {
        accepted.load(Ordering::SeqCst) > 0
    })
    .await;
    assert_eq!(
        agent_metric(admin, "relay_agent_direct_urls_refused_total").await,
        0.0
    );
}
