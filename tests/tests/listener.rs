//! Every listener bounds what a connection costs beyond the work it brings. The tunnel
//! server's agent listener (the one facing the internet): a source that keeps presenting
//! wrong tokens is cut off for the failure window, a connection that never authenticates
//! is closed, one whose streams all ended is closed after `idle_timeout`, and a tunnel id
//! at its connection cap is refused one more, while the real agent's streams keep serving
//! calls. The dispatcher's HTTP front: connections that never send a byte are closed at
//! `first_byte_timeout`, keep-alive connections holding no call at `idle_timeout`, and one
//! source cannot open more than its cap, while a real caller is served.

use relay_common::listen::ListenerLimits;
use relay_tests::metrics::value;
use relay_tests::procs::{metric, scrape};
use relay_tests::stack::{Stack, CALLER_KEY, TOKEN, TUNNEL_ID};
use relay_tests::time_until;
use std::net::SocketAddr;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// `Tunnel.Connect` on a new connection with `token`: the hello's tunnel id, or the
/// refusal. The stream closes again at once.
async fn open(url: &str, token: &str) -> Result<String, tonic::Status> {
    relay_tests::hostile::open(url, token)
        .await
        .map(|o| o.tunnel_id)
}

fn refused(registry: &prometheus::Registry, reason: &str) -> f64 {
    value(
        registry,
        "relay_listener_refused_total",
        &[("listener", "agent"), ("reason", reason)],
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_source_presenting_wrong_tokens_is_cut_off_for_the_window_and_then_served_again() {
    let window = Duration::from_secs(3);
    let stack = Stack::builder()
        .servers(1)
        .tunnel_config(|c| {
            c.agent_limits = ListenerLimits {
                auth_failures: 3,
                auth_failure_window: window,
                ..ListenerLimits::default()
            }
        })
        .start()
        .await
        .unwrap();
    stack.wait_routable(Duration::from_secs(20)).await.unwrap();
    let server = stack.servers[0].as_ref().unwrap();
    let url = format!("http://{}", server.agent_addr);

    for _ in 0..3 {
        let e = open(&url, "wrong-token").await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unauthenticated, "{e}");
    }
    assert_eq!(
        open(&url, TOKEN).await.unwrap(),
        "demo",
        "within the budget"
    );
    // The fourth wrong token puts the source over its budget: from now on even the right
    // token is refused from this address, at accept.
    let _ = open(&url, "wrong-token").await;
    let blocked = open(&url, TOKEN).await;
    assert!(blocked.is_err(), "a source over its budget opened a stream");
    assert_eq!(refused(&server.registry, "auth_budget"), 1.0);
    assert!(refused(&server.registry, "source_blocked") >= 1.0);
    // The agent's streams, opened before, keep serving.
    let a = stack.caller().get("/relay/demo/hello").await.unwrap();
    assert_eq!(a.status, 200, "{}", a.text());
    // After the window the source is served again.
    let back = time_until(window * 3, || async { open(&url, TOKEN).await.is_ok() }).await;
    assert!(back.is_some(), "the source was never served again");
    assert!(back.unwrap() <= window + Duration::from_secs(2), "{back:?}");
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_that_never_authenticates_is_closed_and_the_agent_keeps_serving() {
    let timeout = Duration::from_millis(500);
    let stack = Stack::builder()
        .servers(1)
        .tunnel_config(|c| {
            c.agent_limits = ListenerLimits {
                auth_timeout: timeout,
                ..ListenerLimits::default()
            }
        })
        .start()
        .await
        .unwrap();
    stack.wait_routable(Duration::from_secs(20)).await.unwrap();
    let server = stack.servers[0].as_ref().unwrap();
    // A peer that connects and sends the HTTP/2 preface, then nothing.
    let mut idle = tokio::net::TcpStream::connect(server.agent_addr)
        .await
        .unwrap();
    tokio::io::AsyncWriteExt::write_all(&mut idle, b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        .await
        .unwrap();
    // The server's settings frame may come first; then the close.
    let mut buf = [0u8; 4096];
    let closed = loop {
        match tokio::time::timeout(Duration::from_secs(10), idle.read(&mut buf)).await {
            Err(_) => break None,
            Ok(Ok(0)) | Ok(Err(_)) => break Some(()),
            Ok(Ok(_)) => continue,
        }
    };
    assert!(
        closed.is_some(),
        "an unauthenticated connection stayed open"
    );
    assert!(refused(&server.registry, "auth_timeout") >= 1.0);
    // The agent's own connection authenticated long ago and is untouched.
    for _ in 0..20 {
        let a = stack.caller().get("/relay/demo/hello").await.unwrap();
        assert_eq!(a.status, 200, "{}", a.text());
    }
    stack.shutdown().await;
}

/// Whether the peer closes `s` within `within` (a read ends or fails).
async fn closed_within(s: &mut TcpStream, within: Duration) -> bool {
    let mut buf = [0u8; 4096];
    let closed = async {
        while let Ok(n) = s.read(&mut buf).await {
            if n == 0 {
                break;
            }
        }
    };
    tokio::time::timeout(within, closed).await.is_ok()
}

/// A connection to `addr` from the loopback address `from`.
async fn connect_from(from: [u8; 4], addr: SocketAddr) -> TcpStream {
    let s = tokio::net::TcpSocket::new_v4().unwrap();
    s.bind(SocketAddr::from((from, 0))).unwrap();
    s.connect(addr).await.unwrap()
}

/// The dispatcher's `relay_listener_refused_total{listener="front", reason}`.
async fn front_refused(stack: &Stack, reason: &str) -> f64 {
    let text = scrape(stack.dispatcher_admin).await.unwrap();
    metric(
        &text,
        "relay_listener_refused_total",
        &[("listener", "front"), ("reason", reason)],
    )
}

/// One HTTP/1.1 keep-alive call on `s`: the status line.
async fn http1_get(s: &mut TcpStream, path: &str) -> String {
    let req = format!(
        "GET /relay/{TUNNEL_ID}{path} HTTP/1.1\r\nHost: relay\r\nAuthorization: Bearer {CALLER_KEY}\r\n\r\n"
    );
    s.write_all(req.as_bytes()).await.unwrap();
    // Head, then a body of Content-Length bytes.
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let n = tokio::time::timeout(Duration::from_secs(20), s.read(&mut buf))
            .await
            .expect("an answer")
            .unwrap();
        assert!(n > 0, "closed before the answer");
        got.extend_from_slice(&buf[..n]);
        if let Some(end) = got.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&got[..end]).to_string();
            let len: usize = head
                .lines()
                .find_map(|l| {
                    l.to_ascii_lowercase()
                        .strip_prefix("content-length:")
                        .map(|v| v.trim().parse().unwrap())
                })
                .expect("a content-length");
            if got.len() >= end + 4 + len {
                return head.lines().next().unwrap().to_string();
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_front_connections_are_closed_at_their_timeout_while_a_real_caller_is_served() {
    let first_byte = Duration::from_secs(1);
    let stack = Stack::builder()
        .servers(1)
        .dispatcher_config(move |c| c.front_limits.first_byte_timeout = first_byte)
        .start()
        .await
        .unwrap();
    stack.wait_routable(Duration::from_secs(20)).await.unwrap();
    let before = front_refused(&stack, "first_byte_timeout").await;
    // Connections that never send a byte, and one that stops inside the HTTP/2 preface.
    let mut silent = Vec::new();
    for _ in 0..100 {
        silent.push(TcpStream::connect(stack.http).await.unwrap());
    }
    let mut stalled = TcpStream::connect(stack.http).await.unwrap();
    stalled.write_all(b"PRI * HTTP/2.0\r\n").await.unwrap();
    // A real caller is served meanwhile.
    let caller = stack.caller();
    for _ in 0..20 {
        let a = caller
            .get(&format!("/relay/{TUNNEL_ID}/hello"))
            .await
            .unwrap();
        assert_eq!(a.status, 200, "{}", a.text());
    }
    // Every silent one is closed at its timeout (a generous bound above it).
    let bound = first_byte + Duration::from_secs(5);
    for mut s in silent {
        assert!(
            closed_within(&mut s, bound).await,
            "a silent connection stayed open"
        );
    }
    assert!(closed_within(&mut stalled, bound).await);
    assert_eq!(
        front_refused(&stack, "first_byte_timeout").await - before,
        101.0
    );
    let a = caller
        .get(&format!("/relay/{TUNNEL_ID}/hello"))
        .await
        .unwrap();
    assert_eq!(a.status, 200);
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_front_connection_holding_no_call_is_closed_after_idle_timeout_and_a_long_call_is_not_cut(
) {
    let idle = Duration::from_millis(500);
    let stack = Stack::builder()
        .servers(1)
        .dispatcher_config(move |c| c.front_limits.idle_timeout = idle)
        .start()
        .await
        .unwrap();
    stack.wait_routable(Duration::from_secs(20)).await.unwrap();
    let mut s = TcpStream::connect(stack.http).await.unwrap();
    // A call that takes four idle timeouts: the connection holds it, and is not idle.
    let status = http1_get(&mut s, &format!("/slow/{}", idle.as_millis() * 4)).await;
    assert!(status.contains(" 200 "), "{status}");
    // A second call on the same keep-alive connection.
    let status = http1_get(&mut s, "/hello").await;
    assert!(status.contains(" 200 "), "{status}");
    // Then it holds nothing, and is closed after its idle timeout.
    let bound = idle + relay_common::listen::IDLE_GRACE + Duration::from_secs(5);
    assert!(
        closed_within(&mut s, bound).await,
        "an idle keep-alive connection stayed open"
    );
    assert!(front_refused(&stack, "idle_timeout").await >= 1.0);
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_source_at_its_front_connection_cap_is_refused_while_another_source_is_served() {
    let cap = 8;
    let stack = Stack::builder()
        .servers(1)
        .dispatcher_config(move |c| c.front_limits.max_connections_per_source = cap)
        .start()
        .await
        .unwrap();
    stack.wait_routable(Duration::from_secs(20)).await.unwrap();
    let mut held = Vec::new();
    for _ in 0..cap {
        held.push(connect_from([127, 0, 0, 2], stack.http).await);
    }
    let mut extra = connect_from([127, 0, 0, 2], stack.http).await;
    assert!(closed_within(&mut extra, Duration::from_secs(5)).await);
    assert_eq!(front_refused(&stack, "source_connections").await, 1.0);
    let text = scrape(stack.dispatcher_admin).await.unwrap();
    assert_eq!(
        metric(
            &text,
            "relay_listener_source_refused_total",
            &[
                ("listener", "front"),
                ("reason", "source_connections"),
                ("source", "127.0.0.2")
            ]
        ),
        1.0,
        "{text}"
    );
    // The caller, from 127.0.0.1, is served while 127.0.0.2 holds its cap.
    let a = stack
        .caller()
        .get(&format!("/relay/{TUNNEL_ID}/hello"))
        .await
        .unwrap();
    assert_eq!(a.status, 200, "{}", a.text());
    // And one of 127.0.0.2's own connections is served too.
    let status = http1_get(&mut held[0], "/hello").await;
    assert!(status.contains(" 200 "), "{status}");
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_connection_whose_streams_all_ended_is_closed_after_idle_timeout() {
    let idle = Duration::from_millis(500);
    let stack = Stack::builder()
        .servers(1)
        .tunnel_config(move |c| {
            c.agent_limits = ListenerLimits {
                idle_timeout: idle,
                ..ListenerLimits::default()
            }
        })
        .start()
        .await
        .unwrap();
    stack.wait_routable(Duration::from_secs(20)).await.unwrap();
    let server = stack.servers[0].as_ref().unwrap();
    let url = format!("http://{}", server.agent_addr);
    let open_conns =
        |r: &prometheus::Registry| value(r, "relay_listener_connections", &[("listener", "agent")]);
    let before = open_conns(&server.registry);
    // An authenticated stream on a connection of its own, which then ends: the connection
    // stays open on the client's side, holding no stream.
    let channel = relay_tests::hostile::dial_from(&url, [127, 0, 0, 1].into())
        .await
        .unwrap();
    let opened = relay_tests::hostile::connect_on(channel.clone(), TOKEN)
        .await
        .unwrap();
    assert_eq!(opened.tunnel_id, "demo");
    assert_eq!(open_conns(&server.registry), before + 1.0);
    drop(opened);
    // The server closes it after idle_timeout (plus the grace), while the real agent's
    // connection, which holds its streams, stays.
    let closed = time_until(idle * 4 + Duration::from_secs(10), || async {
        refused(&server.registry, "idle_timeout") >= 1.0 && open_conns(&server.registry) == before
    })
    .await;
    assert!(closed.is_some(), "the idle agent connection stayed open");
    for _ in 0..20 {
        let a = stack.caller().get("/relay/demo/hello").await.unwrap();
        assert_eq!(a.status, 200, "{}", a.text());
    }
    drop(channel);
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tunnel_id_at_its_connection_cap_is_refused_another_connection_while_its_agent_serves() {
    let stack = Stack::builder()
        .servers(1)
        .tunnel_config(|c| {
            c.agent_limits = ListenerLimits {
                // The agent's own connection (through the load balancer fixture) is the one.
                max_connections_per_token: 1,
                ..ListenerLimits::default()
            }
        })
        .start()
        .await
        .unwrap();
    stack.wait_routable(Duration::from_secs(20)).await.unwrap();
    let server = stack.servers[0].as_ref().unwrap();
    let url = format!("http://{}", server.agent_addr);
    let e = open(&url, TOKEN).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::ResourceExhausted, "{e}");
    assert!(e.message().contains("max_connections_per_token"), "{e}");
    assert_eq!(refused(&server.registry, "token_connections"), 1.0);
    for _ in 0..20 {
        let a = stack.caller().get("/relay/demo/hello").await.unwrap();
        assert_eq!(a.status, 200, "{}", a.text());
    }
    stack.shutdown().await;
}

type RawBody = http_body_util::combinators::BoxBody<bytes::Bytes, std::convert::Infallible>;

/// A `Tunnel.Connect` by hand on `client`: its request body is whatever the test sends
/// on the returned sender (gRPC framing included), so it can stop mid-message.
async fn raw_connect(
    client: &mut hyper::client::conn::http2::SendRequest<RawBody>,
    addr: SocketAddr,
) -> (
    tokio::sync::mpsc::Sender<bytes::Bytes>,
    hyper::Response<hyper::body::Incoming>,
) {
    use futures::StreamExt;
    use http_body_util::BodyExt;
    let (tx, rx) = tokio::sync::mpsc::channel::<bytes::Bytes>(4);
    let body = BodyExt::boxed(http_body_util::StreamBody::new(
        tokio_stream::wrappers::ReceiverStream::new(rx)
            .map(|b| Ok::<_, std::convert::Infallible>(http_body::Frame::data(b))),
    ));
    let req = hyper::Request::post(format!("http://{addr}/relay.v1.Tunnel/Connect"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .header("authorization", format!("Bearer {TOKEN}"))
        .body(body)
        .unwrap();
    let res = client.send_request(req).await.unwrap();
    (tx, res)
}

/// The 5-byte gRPC message header of an uncompressed message of `len` bytes.
fn message_header(len: u32) -> bytes::Bytes {
    let mut h = vec![0u8];
    h.extend_from_slice(&len.to_be_bytes());
    h.into()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn half_received_agent_messages_are_bounded_across_streams_while_the_agent_serves() {
    let bound = 256 << 10;
    let stack = Stack::builder()
        .servers(1)
        .tunnel_config(move |c| {
            c.agent_limits = ListenerLimits {
                max_partial_frame_bytes: bound,
                ..ListenerLimits::default()
            }
        })
        .start()
        .await
        .unwrap();
    stack.wait_routable(Duration::from_secs(20)).await.unwrap();
    let server = stack.servers[0].as_ref().unwrap();
    let addr = server.agent_addr;
    let tcp = TcpStream::connect(addr).await.unwrap();
    let (mut client, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(tcp),
    )
    .await
    .unwrap();
    tokio::spawn(conn);
    // Stream A starts a message of three quarters of the bound and sends 1 KiB of it.
    let (a_tx, a_res) = raw_connect(&mut client, addr).await;
    assert_eq!(a_res.status(), 200);
    a_tx.send(message_header(bound as u32 / 4 * 3))
        .await
        .unwrap();
    a_tx.send(vec![0u8; 1024].into()).await.unwrap();
    let held = |r: &prometheus::Registry| {
        value(
            r,
            "relay_listener_partial_frame_bytes",
            &[("listener", "agent")],
        )
    };
    // A's message holds its place before B comes: each stream's body is read by its own
    // task, and a B read first would take its place and leave A the one past the bound.
    relay_tests::eventually(
        "A's half-received message counted",
        Duration::from_secs(10),
        || async { held(&server.registry) >= (bound / 4 * 3) as f64 },
    )
    .await;
    // Stream B starts one of half the bound: together past it, so B is ended.
    let (b_tx, b_res) = raw_connect(&mut client, addr).await;
    b_tx.send(message_header(bound as u32 / 2)).await.unwrap();
    let b_end = tokio::time::timeout(Duration::from_secs(10), async {
        use http_body_util::BodyExt;
        let mut body = b_res.into_body();
        while let Some(f) = body.frame().await {
            if f.is_err() {
                break;
            }
        }
    })
    .await;
    assert!(b_end.is_ok(), "the stream past the bound was not ended");
    assert_eq!(refused(&server.registry, "partial_frames"), 1.0);
    // The agent's own streams keep serving meanwhile.
    for _ in 0..20 {
        let a = stack.caller().get("/relay/demo/hello").await.unwrap();
        assert_eq!(a.status, 200, "{}", a.text());
    }
    assert_eq!(held(&server.registry), (bound / 4 * 3) as f64);
    // A's message gives its place back when A ends: a new stream's message of half the
    // bound is then taken.
    drop(a_tx);
    drop(a_res);
    let (c_tx, c_res) = raw_connect(&mut client, addr).await;
    assert_eq!(c_res.status(), 200);
    relay_tests::eventually(
        "A's half-received message released",
        Duration::from_secs(10),
        || async { held(&server.registry) == 0.0 },
    )
    .await;
    c_tx.send(message_header(bound as u32 / 2)).await.unwrap();
    relay_tests::holds_for("no further refusal", Duration::from_millis(500), || async {
        refused(&server.registry, "partial_frames") == 1.0
    })
    .await;
    drop(c_tx);
    stack.shutdown().await;
}
