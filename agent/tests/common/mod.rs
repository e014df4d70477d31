//! Shared fixtures of the agent's integration tests: a fake tunnel server (a tonic
//! `Tunnel` service on 127.0.0.1:0 that sends a hello, then hands the test each stream),
//! small upstreams on 127.0.0.1:0, and helpers. Real sockets, real time: every wait polls
//! for a condition with a deadline.
#![allow(dead_code, unused_imports)]

pub use bytes::Bytes;
pub use http_body_util::{BodyExt, Full};
pub use hyper::body::Incoming;
pub use hyper_util::rt::{TokioExecutor, TokioIo};
pub use relay_agent::coverage::plan::CoverageConfig;
pub use relay_agent::{AgentHandle, Config};
pub use relay_common::Secret;
pub use relay_proto::agent_frame::Kind as Out;
pub use relay_proto::server_frame::Kind as In;
pub use relay_proto::tunnel_server::{Tunnel, TunnelServer};
pub use relay_proto::{
    AgentFrame, BodyChunk, CallError, CallErrorKind, Cancel, Drain, Header, Ping, RequestHead,
    ResponseHead, ServerFrame, ServerHello,
};
pub use std::net::SocketAddr;
pub use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
pub use std::sync::{Arc, Mutex};
pub use std::time::Duration;
pub use tokio::io::{AsyncReadExt, AsyncWriteExt};
pub use tokio::net::TcpListener;
pub use tokio::sync::{mpsc, oneshot};
pub use tokio::time::{timeout, Instant};
pub use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
pub use tonic::{Request, Response, Status, Streaming};

pub const TOKEN: &str = "good-token";
pub const WAIT: Duration = Duration::from_secs(10);

// ---------------------------------------------------------------- fake tunnel server

pub struct Conn {
    pub tx: mpsc::Sender<Result<ServerFrame, Status>>,
    pub rx: Streaming<AgentFrame>,
    /// The agent's `relay-agent-features` metadata ("" when absent).
    pub features: String,
}

impl Conn {
    pub async fn send(&self, kind: In) {
        self.tx
            .send(Ok(ServerFrame::of(kind)))
            .await
            .expect("stream open");
    }

    /// The next frame from the agent; `None` when the agent ended the stream.
    pub async fn next(&mut self) -> Option<Out> {
        match timeout(WAIT, self.rx.message())
            .await
            .expect("agent answered in time")
        {
            Ok(Some(f)) => Some(f.kind.expect("agent frames carry a kind")),
            Ok(None) | Err(_) => None,
        }
    }

    /// Runs one call: head, body chunks (sent concurrently), then frames until the terminal one.
    pub async fn call(&mut self, head: RequestHead, body: Vec<Bytes>) -> Answer {
        let call_id = head.call_id;
        self.send(In::RequestHead(head)).await;
        if !body.is_empty() {
            let tx = self.tx.clone();
            tokio::spawn(async move {
                let n = body.len();
                for (i, data) in body.into_iter().enumerate() {
                    let chunk = BodyChunk {
                        call_id,
                        data: bytes::Bytes::copy_from_slice(&data),
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

    pub async fn read_answer(&mut self, call_id: u64) -> Answer {
        let mut a = Answer::default();
        loop {
            match self.next().await.expect("stream stays open during a call") {
                Out::ResponseHead(h) => {
                    assert_eq!(h.call_id, call_id);
                    assert!(a.head.is_none(), "one head per call");
                    let end = h.end_of_stream;
                    // A small body may travel inside the head.
                    a.body.extend_from_slice(&h.body);
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
                // The fake server offers no body credit: an agent never sends it any.
                Out::Credit(c) => panic!("credit on a stream without body credit: {c:?}"),
                Out::Pong(_) | Out::GoingAway(_) => {}
            }
        }
    }
}

#[derive(Default, Debug)]
pub struct Answer {
    pub head: Option<ResponseHead>,
    pub body: Vec<u8>,
    pub chunks: usize,
    pub error: Option<CallError>,
}

impl Answer {
    pub fn status(&self) -> u32 {
        self.head.as_ref().map_or(0, |h| h.status)
    }
    pub fn header(&self, name: &str) -> Option<String> {
        let h = self.head.as_ref()?;
        h.headers
            .iter()
            .map(|r| relay_proto::parse_header(r).expect("the agent's header record"))
            .find(|(n, _)| *n == name.as_bytes())
            .map(|(_, v)| String::from_utf8_lossy(v).into_owned())
    }
    pub fn error_kind(&self) -> Option<CallErrorKind> {
        self.error
            .as_ref()
            .map(|e| CallErrorKind::try_from(e.kind).unwrap_or(CallErrorKind::Unspecified))
    }
}

/// The sending half of a fake server's stream to the agent.
pub type FrameSender = mpsc::Sender<Result<ServerFrame, Status>>;

#[derive(Clone)]
pub struct Svc {
    pub conns: mpsc::UnboundedSender<Conn>,
    pub accept: Arc<AtomicBool>,
    pub rejections: Arc<Mutex<Vec<Instant>>>,
    pub heartbeat_ms: u32,
    pub next_stream: Arc<AtomicU64>,
    /// The `server_id` of every hello.
    pub server_id: String,
    /// The message of the UNAUTHENTICATED status a refused open gets.
    pub refusal: Arc<Mutex<String>>,
    /// The `direct_url` every hello advertises ("" for none).
    pub direct_url: Arc<Mutex<String>>,
    /// When above 1, only every n-th open gets its hello; the others are held open without
    /// one (a busy server), in `held`.
    pub hello_every: Arc<AtomicU64>,
    pub held: Arc<Mutex<Vec<FrameSender>>>,
    /// The agent connections streams were opened on (their remote addresses).
    pub peers: Arc<Mutex<std::collections::BTreeSet<SocketAddr>>>,
    pub opens: Arc<AtomicU64>,
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
            let message = self.refusal.lock().unwrap().clone();
            return Err(Status::unauthenticated(message));
        }
        let features = req
            .metadata()
            .get("relay-agent-features")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string();
        if let Some(peer) = req.remote_addr() {
            self.peers.lock().unwrap().insert(peer);
        }
        let (tx, rx) = mpsc::channel(16);
        let n = self.opens.fetch_add(1, Ordering::SeqCst);
        let every = self.hello_every.load(Ordering::SeqCst);
        if every > 1 && !n.is_multiple_of(every) {
            self.held.lock().unwrap().push(tx);
            return Ok(Response::new(ReceiverStream::new(rx)));
        }
        let hello = ServerHello {
            server_id: self.server_id.clone(),
            zone: "zone-a".into(),
            stream_id: self.next_stream.fetch_add(1, Ordering::SeqCst),
            heartbeat_ms: self.heartbeat_ms,
            tunnel_id: "demo".into(),
            protocol_version: relay_proto::PROTOCOL_VERSION,
            instance_id: "fake-1".into(),
            direct_url: self.direct_url.lock().unwrap().clone(),
            unix_time_ms: 0,
            liveness_ms: 0,
            response_credit: 0,
        };
        tx.send(Ok(ServerFrame::of(In::Hello(hello))))
            .await
            .map_err(|_| Status::internal("closed"))?;
        let _ = self.conns.send(Conn {
            tx,
            rx: req.into_inner(),
            features,
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

pub struct FakeTunnel {
    pub url: String,
    pub conns: mpsc::UnboundedReceiver<Conn>,
    pub accept: Arc<AtomicBool>,
    pub rejections: Arc<Mutex<Vec<Instant>>>,
    /// The message of the UNAUTHENTICATED status a refused open gets.
    pub refusal: Arc<Mutex<String>>,
    /// The `direct_url` every hello advertises ("" for none).
    pub direct_url: Arc<Mutex<String>>,
    /// See [`Svc::hello_every`].
    pub hello_every: Arc<AtomicU64>,
    /// The agent connections streams were opened on.
    pub peers: Arc<Mutex<std::collections::BTreeSet<SocketAddr>>>,
    /// Opens received.
    pub opens: Arc<AtomicU64>,
    pub _stop: oneshot::Sender<()>,
}

impl FakeTunnel {
    pub async fn start(heartbeat_ms: u32, accept: bool) -> Self {
        Self::start_as("ts-1", heartbeat_ms, accept).await
    }

    /// A fake server whose hellos carry `server_id`.
    pub async fn start_as(server_id: &str, heartbeat_ms: u32, accept: bool) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let (conns_tx, conns) = mpsc::unbounded_channel();
        let accept = Arc::new(AtomicBool::new(accept));
        let rejections = Arc::new(Mutex::new(Vec::new()));
        let refusal = Arc::new(Mutex::new("unknown token".to_string()));
        let direct_url = Arc::new(Mutex::new(String::new()));
        let hello_every = Arc::new(AtomicU64::new(1));
        let peers = Arc::new(Mutex::new(std::collections::BTreeSet::new()));
        let opens = Arc::new(AtomicU64::new(0));
        let svc = Svc {
            conns: conns_tx,
            accept: accept.clone(),
            rejections: rejections.clone(),
            heartbeat_ms,
            next_stream: Arc::new(AtomicU64::new(1)),
            server_id: server_id.to_string(),
            refusal: refusal.clone(),
            direct_url: direct_url.clone(),
            hello_every: hello_every.clone(),
            held: Arc::default(),
            peers: peers.clone(),
            opens: opens.clone(),
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
            refusal,
            direct_url,
            hello_every,
            peers,
            opens,
            _stop: stop,
        }
    }

    pub async fn next_conn(&mut self) -> Conn {
        timeout(WAIT, self.conns.recv())
            .await
            .expect("agent opened a stream in time")
            .expect("server running")
    }
}

// ---------------------------------------------------------------- upstreams

/// A hyper upstream: `/hello` (200 KB with the Host and headers it saw), `/echo` (streams
/// the request body back), `/empty` (204), `/big?n=` (n bytes).
pub async fn serve_upstream(listener: TcpListener) {
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

pub async fn hyper_upstream() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(serve_upstream(listener));
    url
}

/// A raw upstream: a request for `/hang` is never answered (the test hears when it arrives
/// and when the agent drops the connection); anything else gets `200 ok`.
pub struct RawUpstream {
    pub url: String,
    pub events: mpsc::UnboundedReceiver<&'static str>,
}

pub async fn raw_upstream() -> RawUpstream {
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
    pub async fn expect(&mut self, what: &str) {
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

pub fn pattern(n: usize) -> Vec<u8> {
    (0..n).map(|i| (i % 251) as u8).collect()
}

pub fn config(tunnel: &str, upstream: &str, streams: u32) -> Config {
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
        // Accept filters are default deny: these tests exercise the tunnel, so allow all.
        allow: vec![allow("/**", &["*"])],
        ..Config::default().insecure()
    }
}

/// An `[[allow]]` rule for `path` and `methods`.
pub fn allow(path: &str, methods: &[&str]) -> relay_agent::config::AllowRule {
    relay_agent::config::AllowRule {
        name: None,
        methods: methods.iter().map(|m| m.to_string()).collect(),
        path: path.into(),
        ..Default::default()
    }
}

pub async fn start_agent(config: Config) -> (AgentHandle, SocketAddr) {
    let admin = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = admin.local_addr().unwrap();
    (relay_agent::start(config, admin).unwrap(), addr)
}

pub fn head(call_id: u64, method: &str, target: &str, end_of_stream: bool) -> RequestHead {
    RequestHead {
        call_id,
        method: method.into(),
        path_and_query: target.into(),
        headers: vec![],
        deadline_ms: 10_000,
        end_of_stream,
        ..Default::default()
    }
}

pub async fn eventually<F: FnMut() -> bool>(what: &str, mut f: F) {
    let deadline = Instant::now() + WAIT;
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

pub async fn http_get(addr: SocketAddr, path: &str) -> (u16, String) {
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
