//! The agent against a fake tunnel server (a tonic `Tunnel` service on 127.0.0.1:0 that
//! sends a hello, then hands the test each stream) and small upstreams on 127.0.0.1:0.
//! Real sockets, real time: every wait polls for a condition with a deadline.

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use relay_agent::coverage::plan::CoverageConfig;
use relay_agent::{AgentHandle, Config};
use relay_common::Secret;
use relay_proto::agent_frame::Kind as Out;
use relay_proto::server_frame::Kind as In;
use relay_proto::tunnel_server::{Tunnel, TunnelServer};
use relay_proto::{
    AgentFrame, BodyChunk, CallError, CallErrorKind, Cancel, Drain, Header, Ping, RequestHead,
    ResponseHead, ServerFrame, ServerHello,
};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot};
use tokio::time::{timeout, Instant};
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tonic::{Request, Response, Status, Streaming};

const TOKEN: &str = "good-token";
const WAIT: Duration = Duration::from_secs(10);

// ---------------------------------------------------------------- fake tunnel server

struct Conn {
    tx: mpsc::Sender<Result<ServerFrame, Status>>,
    rx: Streaming<AgentFrame>,
}

impl Conn {
    async fn send(&self, kind: In) {
        self.tx
            .send(Ok(ServerFrame::of(kind)))
            .await
            .expect("stream open");
    }

    /// The next frame from the agent; `None` when the agent ended the stream.
    async fn next(&mut self) -> Option<Out> {
        match timeout(WAIT, self.rx.message())
            .await
            .expect("agent answered in time")
        {
            Ok(Some(f)) => Some(f.kind.expect("agent frames carry a kind")),
            Ok(None) | Err(_) => None,
        }
    }

    /// Runs one call: head, body chunks (sent concurrently), then frames until the terminal one.
    async fn call(&mut self, head: RequestHead, body: Vec<Bytes>) -> Answer {
        let call_id = head.call_id;
        self.send(In::RequestHead(head)).await;
        if !body.is_empty() {
            let tx = self.tx.clone();
            tokio::spawn(async move {
                let n = body.len();
                for (i, data) in body.into_iter().enumerate() {
                    let chunk = BodyChunk {
                        call_id,
                        data: data.to_vec(),
                        end: i + 1 == n,
                    };
                    if tx
                        .send(Ok(ServerFrame::of(In::RequestBody(chunk))))
                        .await
                        .is_err()
                    {
                        return;
                    }
                }
            });
        }
        self.read_answer(call_id).await
    }

    async fn read_answer(&mut self, call_id: u64) -> Answer {
        let mut a = Answer::default();
        loop {
            match self.next().await.expect("stream stays open during a call") {
                Out::ResponseHead(h) => {
                    assert_eq!(h.call_id, call_id);
                    assert!(a.head.is_none(), "one head per call");
                    let end = h.end_of_stream;
                    a.head = Some(h);
                    if end {
                        return a;
                    }
                }
                Out::ResponseBody(b) => {
                    assert_eq!(b.call_id, call_id);
                    assert!(a.head.is_some(), "body after head");
                    assert!(
                        b.data.len() <= relay_proto::MAX_CHUNK,
                        "chunk of {} bytes",
                        b.data.len()
                    );
                    a.chunks += 1;
                    a.body.extend_from_slice(&b.data);
                    if b.end {
                        return a;
                    }
                }
                Out::CallError(e) => {
                    assert_eq!(e.call_id, call_id);
                    a.error = Some(e);
                    return a;
                }
                Out::Pong(_) | Out::GoingAway(_) => {}
            }
        }
    }
}

#[derive(Default, Debug)]
struct Answer {
    head: Option<ResponseHead>,
    body: Vec<u8>,
    chunks: usize,
    error: Option<CallError>,
}

impl Answer {
    fn status(&self) -> u32 {
        self.head.as_ref().map_or(0, |h| h.status)
    }
    fn header(&self, name: &str) -> Option<String> {
        let h = self.head.as_ref()?;
        h.headers
            .iter()
            .find(|x| x.name == name)
            .map(|x| String::from_utf8_lossy(&x.value).into_owned())
    }
    fn error_kind(&self) -> Option<CallErrorKind> {
        self.error
            .as_ref()
            .map(|e| CallErrorKind::try_from(e.kind).unwrap_or(CallErrorKind::Unspecified))
    }
}

#[derive(Clone)]
struct Svc {
    conns: mpsc::UnboundedSender<Conn>,
    accept: Arc<AtomicBool>,
    rejections: Arc<Mutex<Vec<Instant>>>,
    heartbeat_ms: u32,
    next_stream: Arc<AtomicU64>,
}

#[tonic::async_trait]
impl Tunnel for Svc {
    type ConnectStream = ReceiverStream<Result<ServerFrame, Status>>;

    async fn connect(
        &self,
        req: Request<Streaming<AgentFrame>>,
    ) -> Result<Response<Self::ConnectStream>, Status> {
        let auth = req
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("");
        if auth != format!("Bearer {TOKEN}") || !self.accept.load(Ordering::SeqCst) {
            self.rejections.lock().unwrap().push(Instant::now());
            return Err(Status::unauthenticated("unknown token"));
        }
        let (tx, rx) = mpsc::channel(16);
        let hello = ServerHello {
            server_id: "ts-1".into(),
            zone: "zone-a".into(),
            stream_id: self.next_stream.fetch_add(1, Ordering::SeqCst),
            heartbeat_ms: self.heartbeat_ms,
            tunnel_id: "demo".into(),
            protocol_version: relay_proto::PROTOCOL_VERSION,
        };
        tx.send(Ok(ServerFrame::of(In::Hello(hello))))
            .await
            .map_err(|_| Status::internal("closed"))?;
        let _ = self.conns.send(Conn {
            tx,
            rx: req.into_inner(),
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

struct FakeTunnel {
    url: String,
    conns: mpsc::UnboundedReceiver<Conn>,
    accept: Arc<AtomicBool>,
    rejections: Arc<Mutex<Vec<Instant>>>,
    _stop: oneshot::Sender<()>,
}

impl FakeTunnel {
    async fn start(heartbeat_ms: u32, accept: bool) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let (conns_tx, conns) = mpsc::unbounded_channel();
        let accept = Arc::new(AtomicBool::new(accept));
        let rejections = Arc::new(Mutex::new(Vec::new()));
        let svc = Svc {
            conns: conns_tx,
            accept: accept.clone(),
            rejections: rejections.clone(),
            heartbeat_ms,
            next_stream: Arc::new(AtomicU64::new(1)),
        };
        let (stop, stopped) = oneshot::channel::<()>();
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(TunnelServer::new(svc))
                .serve_with_incoming_shutdown(TcpListenerStream::new(listener), async {
                    let _ = stopped.await;
                }),
        );
        FakeTunnel {
            url,
            conns,
            accept,
            rejections,
            _stop: stop,
        }
    }

    async fn next_conn(&mut self) -> Conn {
        timeout(WAIT, self.conns.recv())
            .await
            .expect("agent opened a stream in time")
            .expect("server running")
    }
}

// ---------------------------------------------------------------- upstreams

/// A hyper upstream: `/hello` (200 KB with the Host and headers it saw), `/echo` (streams
/// the request body back), `/empty` (204), `/big?n=` (n bytes).
async fn serve_upstream(listener: TcpListener) {
    loop {
        let Ok((sock, _)) = listener.accept().await else {
            return;
        };
        tokio::spawn(async move {
            let svc = hyper::service::service_fn(|req: http::Request<Incoming>| async move {
                let seen = |name: &str| {
                    req.headers()
                        .get(name)
                        .map(|v| v.to_str().unwrap_or("?").to_string())
                        .unwrap_or_default()
                };
                let mut resp = http::Response::builder()
                    .header("x-seen-host", seen("host"))
                    .header("x-seen-custom", seen("x-custom"))
                    .header("x-seen-private", seen("x-private"))
                    .header("x-seen-target", req.uri().to_string())
                    .header("keep-alive", "timeout=5");
                let body = match req.uri().path() {
                    "/hello" => Full::new(Bytes::from(pattern(200_000)))
                        .map_err(|e| match e {})
                        .boxed(),
                    "/echo" => req.into_body().boxed(),
                    "/empty" => {
                        resp = resp.status(204);
                        Full::new(Bytes::new()).map_err(|e| match e {}).boxed()
                    }
                    "/big" => {
                        let n: usize = req
                            .uri()
                            .query()
                            .and_then(|q| q.strip_prefix("n="))
                            .and_then(|n| n.parse().ok())
                            .unwrap_or(0);
                        Full::new(Bytes::from(pattern(n)))
                            .map_err(|e| match e {})
                            .boxed()
                    }
                    _ => {
                        resp = resp.status(404);
                        Full::new(Bytes::new()).map_err(|e| match e {}).boxed()
                    }
                };
                Ok::<_, std::convert::Infallible>(resp.body(body).unwrap())
            });
            let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(sock), svc)
                .await;
        });
    }
}

async fn hyper_upstream() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(serve_upstream(listener));
    url
}

/// A raw upstream: a request for `/hang` is never answered (the test hears when it arrives
/// and when the agent drops the connection); anything else gets `200 ok`.
struct RawUpstream {
    url: String,
    events: mpsc::UnboundedReceiver<&'static str>,
}

async fn raw_upstream() -> RawUpstream {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (tx, events) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        loop {
            let Ok((mut sock, _)) = listener.accept().await else {
                return;
            };
            let tx = tx.clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut tmp = [0u8; 4096];
                loop {
                    let n = sock.read(&mut tmp).await.unwrap_or(0);
                    if n == 0 {
                        let _ = tx.send("closed");
                        return;
                    }
                    buf.extend_from_slice(&tmp[..n]);
                    while let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                        let head = String::from_utf8_lossy(&buf[..end]).to_string();
                        buf.drain(..end + 4);
                        if head.contains(" /hang ") {
                            let _ = tx.send("hang");
                        } else {
                            let _ = tx.send("answered");
                            let _ = sock
                                .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                                .await;
                        }
                    }
                }
            });
        }
    });
    RawUpstream { url, events }
}

impl RawUpstream {
    async fn expect(&mut self, what: &str) {
        let deadline = Instant::now() + WAIT;
        loop {
            let ev = tokio::time::timeout_at(deadline, self.events.recv())
                .await
                .expect("upstream event in time");
            if ev == Some(what) {
                return;
            }
        }
    }
}

// ---------------------------------------------------------------- helpers

fn pattern(n: usize) -> Vec<u8> {
    (0..n).map(|i| (i % 251) as u8).collect()
}

fn config(tunnel: &str, upstream: &str, streams: u32) -> Config {
    Config {
        tunnels: vec![tunnel.to_string()],
        token: Secret::new(TOKEN),
        upstream: upstream.to_string(),
        connect_timeout: Duration::from_secs(2),
        backoff_initial: Duration::from_millis(50),
        backoff_max: Duration::from_millis(500),
        upstream_check: relay_agent::config::UpstreamCheckConfig {
            interval: Duration::from_millis(200),
            ..Default::default()
        },
        coverage: CoverageConfig {
            enabled: false,
            fixed_streams: streams,
            ..CoverageConfig::default()
        },
        ..Config::default()
    }
}

async fn start_agent(config: Config) -> (AgentHandle, SocketAddr) {
    let admin = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = admin.local_addr().unwrap();
    (relay_agent::spawn(config, admin).unwrap(), addr)
}

fn head(call_id: u64, method: &str, target: &str, end_of_stream: bool) -> RequestHead {
    RequestHead {
        call_id,
        method: method.into(),
        path_and_query: target.into(),
        headers: vec![],
        deadline_ms: 10_000,
        end_of_stream,
    }
}

async fn eventually<F: FnMut() -> bool>(what: &str, mut f: F) {
    let deadline = Instant::now() + WAIT;
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn http_get(addr: SocketAddr, path: &str) -> (u16, String) {
    let client = hyper_util::client::legacy::Client::builder(TokioExecutor::new())
        .build_http::<http_body_util::Empty<Bytes>>();
    let resp = client
        .get(format!("http://{addr}{path}").parse().unwrap())
        .await
        .unwrap();
    let status = resp.status().as_u16();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8_lossy(&body).into_owned())
}

// ---------------------------------------------------------------- tests

#[tokio::test]
async fn get_and_post_round_trip_byte_for_byte() {
    let mut tunnel = FakeTunnel::start(10_000, true).await;
    let upstream = hyper_upstream().await;
    let (_agent, _) = start_agent(config(&tunnel.url, &upstream, 1)).await;
    let mut conn = tunnel.next_conn().await;

    let mut get = head(1, "GET", "/hello?x=1&y=%20", true);
    get.headers = vec![
        Header::new("x-custom", "v1"),
        Header::new("connection", "x-private"),
        Header::new("x-private", "secret-hop"),
        Header::new("host", "evil.example"),
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
    let mut bad = tunnel.next_conn().await;
    let mut good = tunnel.next_conn().await;

    bad.tx.send(Ok(ServerFrame { kind: None })).await.unwrap();
    assert_eq!(
        bad.next().await,
        None,
        "the agent closes the stream that broke the protocol"
    );

    let a = good.call(head(1, "GET", "/hello", true), vec![]).await;
    assert_eq!(a.status(), 200);

    // A body chunk for a call that is not in flight is malformed too.
    let mut replacement = tunnel.next_conn().await;
    let stray = BodyChunk {
        call_id: 99,
        data: b"x".to_vec(),
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
    eventually("a failed upstream check", || {
        health.borrow().error.as_deref() != Some("not checked yet")
    })
    .await;
    let (status, body) = http_get(admin, "/systemcheck").await;
    assert_eq!(status, 503, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["ok"], false);
    assert_eq!(v["upstream"]["reachable"], false);
    assert!(v["upstream"]["error"]
        .as_str()
        .is_some_and(|e| !e.is_empty()));
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
