//! A hostile agent: a token holder that speaks `Tunnel.Connect` by hand, so a test can send
//! a tunnel server whatever frames it likes (over-count or oversized response heads,
//! trickled bodies, error messages with control characters) and watch what the relay does.
//!
//! It answers heartbeats (so its stream stays confirmed and routable), acknowledges a
//! `Cancel` like any agent (a CallError CANCELLED, after which frames the test still sends
//! for that call are dropped), and hands the test every `RequestHead` it is given;
//! everything else the test sends itself. [`call_via`] and [`stream_answer`] send a call
//! through the front until the hostile agent is handed it.

use crate::client::{Answer, Caller};
use bytes::Bytes;
use http::Method;
use http_body_util::BodyExt;
use relay_proto::agent_frame::Kind as Out;
use relay_proto::server_frame::Kind as In;
use relay_proto::tunnel_client::TunnelClient;
use relay_proto::{AgentFrame, CallError, CallErrorKind, Pong, RequestHead, ServerFrame};
use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_stream::wrappers::UnboundedReceiverStream;

/// How a hostile agent's stream ended: `Some(Ok(()))` when the server closed it with OK,
/// `Some(Err(status))` with an error status, `None` while it is open.
pub type Ended = Option<Result<(), tonic::Status>>;

/// The outbound half: the frames, and the calls the server cancelled. One lock covers
/// both, so no frame of a call goes out after its CANCELLED acknowledgement.
struct Outbound {
    frames: mpsc::UnboundedSender<AgentFrame>,
    cancelled: HashSet<u64>,
}

/// Sends frames on a hostile agent's stream.
#[derive(Clone)]
pub struct Sender(Arc<Mutex<Outbound>>);

impl Sender {
    /// Sends one frame; an error once the stream is gone or its call was cancelled.
    pub async fn send(&self, kind: Out) -> anyhow::Result<()> {
        let call_id = match &kind {
            Out::ResponseHead(h) => Some(h.call_id),
            Out::ResponseBody(b) => Some(b.call_id),
            Out::CallError(e) => Some(e.call_id),
            _ => None,
        };
        let out = self.0.lock().unwrap();
        if call_id.is_some_and(|id| out.cancelled.contains(&id)) {
            anyhow::bail!("the call was cancelled");
        }
        out.frames
            .send(AgentFrame::of(kind))
            .map_err(|_| anyhow::anyhow!("the stream is closed"))
    }

    fn cancel(&self, call_id: u64) {
        let mut out = self.0.lock().unwrap();
        if out.cancelled.insert(call_id) {
            let ack = Out::CallError(CallError {
                call_id,
                kind: CallErrorKind::Cancelled as i32,
                message: "cancelled".into(),
            });
            let _ = out.frames.send(AgentFrame::of(ack));
        }
    }
}

pub struct HostileAgent {
    out: Sender,
    calls: mpsc::UnboundedReceiver<RequestHead>,
    ended: watch::Receiver<Ended>,
    /// The stream's reader; dropping the agent stops it, which ends the stream.
    reader: tokio::task::JoinHandle<()>,
    /// The tunnel id the server's hello named.
    pub tunnel_id: String,
}

impl Drop for HostileAgent {
    fn drop(&mut self) {
        self.reader.abort();
    }
}

impl HostileAgent {
    /// Opens one stream to the tunnel server at `url` (`http://host:port`) with `token`.
    pub async fn open(url: &str, token: &str) -> anyhow::Result<Self> {
        let channel = tonic::transport::Endpoint::from_shared(url.to_string())?
            .connect()
            .await?;
        // No limit on what this agent sends: the server's limits are under test.
        let mut client = TunnelClient::new(channel)
            .max_encoding_message_size(usize::MAX)
            .max_decoding_message_size(64 * 1024 * 1024);
        let (frames, rx) = mpsc::unbounded_channel();
        let out = Sender(Arc::new(Mutex::new(Outbound {
            frames,
            cancelled: HashSet::new(),
        })));
        let mut req = tonic::Request::new(UnboundedReceiverStream::new(rx));
        req.metadata_mut()
            .insert("authorization", format!("Bearer {token}").parse()?);
        let mut inbound = client.connect(req).await?.into_inner();
        let tunnel_id = match inbound.message().await? {
            Some(ServerFrame {
                kind: Some(In::Hello(h)),
            }) => h.tunnel_id,
            other => anyhow::bail!("no hello: {other:?}"),
        };
        let (calls_tx, calls) = mpsc::unbounded_channel();
        let (ended_tx, ended) = watch::channel(None);
        let pongs = out.clone();
        let reader = tokio::spawn(async move {
            let end = loop {
                match inbound.message().await {
                    Ok(Some(ServerFrame { kind: Some(kind) })) => match kind {
                        In::Ping(p) => {
                            let _ = pongs.send(Out::Pong(Pong { seq: p.seq })).await;
                        }
                        In::Cancel(c) => pongs.cancel(c.call_id),
                        In::RequestHead(head) => {
                            let _ = calls_tx.send(head);
                        }
                        _ => {}
                    },
                    Ok(Some(_)) => {}
                    Ok(None) => break Ok(()),
                    Err(status) => break Err(status),
                }
            };
            let _ = ended_tx.send(Some(end));
        });
        Ok(HostileAgent {
            out,
            calls,
            ended,
            reader,
            tunnel_id,
        })
    }

    /// The next call the server hands this agent, waiting up to `within`.
    pub async fn next_call(&mut self, within: Duration) -> anyhow::Result<RequestHead> {
        match tokio::time::timeout(within, self.calls.recv()).await {
            Ok(Some(head)) => Ok(head),
            Ok(None) => anyhow::bail!("the stream ended before a call came"),
            Err(_) => anyhow::bail!("no call within {within:?}"),
        }
    }

    /// Sends one frame; an error once the stream is gone.
    pub async fn send(&self, kind: Out) -> anyhow::Result<()> {
        self.sender().send(kind).await
    }

    /// A handle that sends frames on this stream, for a task of its own.
    pub fn sender(&self) -> Sender {
        self.out.clone()
    }

    /// How the stream ended, waiting up to `within` for it to end.
    pub async fn ended(&mut self, within: Duration) -> anyhow::Result<Result<(), tonic::Status>> {
        let end = tokio::time::timeout(within, self.ended.wait_for(|e| e.is_some()))
            .await
            .map_err(|_| anyhow::anyhow!("the stream did not end within {within:?}"))?
            .map_err(|_| anyhow::anyhow!("the reader went away"))?;
        Ok(end.clone().expect("waited for Some"))
    }
}

/// A stream opened by hand with [`open`]: the tunnel id its hello named. Dropping it
/// closes the stream.
pub struct Opened {
    pub tunnel_id: String,
    pub inbound: tonic::Streaming<ServerFrame>,
    _out: mpsc::Sender<AgentFrame>,
}

/// `Tunnel.Connect` on a new connection with `token`, up to the hello; the refusal's
/// status otherwise (a connection closed before an answer shows as UNAVAILABLE or an
/// error from the transport).
pub async fn open(url: &str, token: &str) -> Result<Opened, tonic::Status> {
    connect(dial(url).await?, token, false).await
}

/// `n` streams of `Tunnel.Connect` with `token` on one new connection (one agent's
/// multiplexed streams), each up to its hello and confirmed as an agent confirms it (a
/// first frame after the hello: the stream takes calls from then on); the first refusal
/// otherwise. The streams answer no later ping.
pub async fn open_many(url: &str, token: &str, n: usize) -> Result<Vec<Opened>, tonic::Status> {
    let channel = dial(url).await?;
    futures::future::try_join_all((0..n).map(|_| connect(channel.clone(), token, true))).await
}

/// [`open`] on a connection from the local address `from` (127.0.0.2, 127.0.0.3, ... are
/// distinct client sources on loopback).
pub async fn open_from(
    url: &str,
    from: std::net::IpAddr,
    token: &str,
) -> Result<Opened, tonic::Status> {
    connect(dial_from(url, from).await?, token, false).await
}

/// A new connection to the tunnel server at `url`, from the local address `from`.
pub async fn dial_from(
    url: &str,
    from: std::net::IpAddr,
) -> Result<tonic::transport::Channel, tonic::Status> {
    let connector = tower::service_fn(move |uri: http::Uri| async move {
        let host = uri.host().unwrap_or("127.0.0.1").to_string();
        let port = uri.port_u16().unwrap_or(80);
        let to = tokio::net::lookup_host((host.as_str(), port))
            .await?
            .next()
            .ok_or_else(|| std::io::Error::other("no address"))?;
        let socket = if from.is_ipv4() {
            tokio::net::TcpSocket::new_v4()?
        } else {
            tokio::net::TcpSocket::new_v6()?
        };
        socket.bind(std::net::SocketAddr::new(from, 0))?;
        let tcp = socket.connect(to).await?;
        Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(tcp))
    });
    tonic::transport::Endpoint::from_shared(url.to_string())
        .map_err(|e| tonic::Status::invalid_argument(e.to_string()))?
        .connect_with_connector(connector)
        .await
        .map_err(|e| tonic::Status::unavailable(e.to_string()))
}

/// A new connection to the tunnel server at `url`.
async fn dial(url: &str) -> Result<tonic::transport::Channel, tonic::Status> {
    tonic::transport::Endpoint::from_shared(url.to_string())
        .map_err(|e| tonic::Status::invalid_argument(e.to_string()))?
        .connect()
        .await
        .map_err(|e| tonic::Status::unavailable(e.to_string()))
}

/// One `Tunnel.Connect` with `token` on `channel` (say from [`dial_from`]), up to the
/// hello.
pub async fn connect_on(
    channel: tonic::transport::Channel,
    token: &str,
) -> Result<Opened, tonic::Status> {
    connect(channel, token, false).await
}

/// One `Tunnel.Connect` on `channel`, up to the hello; with `confirm`, then a first frame.
async fn connect(
    channel: tonic::transport::Channel,
    token: &str,
    confirm: bool,
) -> Result<Opened, tonic::Status> {
    let (tx, rx) = mpsc::channel(4);
    let mut req = tonic::Request::new(tokio_stream::wrappers::ReceiverStream::new(rx));
    req.metadata_mut()
        .insert("authorization", format!("Bearer {token}").parse().unwrap());
    let mut inbound = TunnelClient::new(channel).connect(req).await?.into_inner();
    let tunnel_id = match inbound.message().await? {
        Some(ServerFrame {
            kind: Some(In::Hello(h)),
        }) => h.tunnel_id,
        other => return Err(tonic::Status::internal(format!("no hello: {other:?}"))),
    };
    if confirm {
        tx.send(AgentFrame::of(Out::Pong(Pong { seq: 0 })))
            .await
            .map_err(|_| tonic::Status::unavailable("the stream closed"))?;
    }
    Ok(Opened {
        tunnel_id,
        inbound,
        _out: tx,
    })
}

// ---------------------------------------------------------------------------------------
// Calls through the front to a hostile agent

/// How long a call through the front to a hostile agent may take at each step.
const WAIT: Duration = Duration::from_secs(20);

/// Sends `req` through the front until the hostile agent is handed the call (calls sent
/// while its stream is not yet routable get 503 and are sent again). Returns the caller's
/// pending answer and the head the agent got.
pub async fn call_via(
    caller: &Caller,
    agent: &mut HostileAgent,
    method: Method,
    path: &str,
    timeout_ms: Option<u64>,
) -> (JoinHandle<anyhow::Result<Answer>>, RequestHead) {
    let agent = &tokio::sync::Mutex::new(agent);
    let (method, timeout_ms) = (&method, &timeout_ms);
    crate::eventually("the hostile agent's stream is routable", WAIT, || async move {
        let mut req = caller.request(method.clone(), path, Bytes::new());
        if let Some(ms) = timeout_ms {
            req.headers_mut()
                .insert("x-relay-timeout-ms", ms.to_string().parse().unwrap());
        }
        let c = caller.clone();
        let mut answer = tokio::spawn(async move { c.call(req).await });
        let mut agent = agent.lock().await;
        tokio::select! {
            head = agent.next_call(WAIT) => Ok((answer, head.expect("the agent gets the call"))),
            a = &mut answer => {
                let a = a.unwrap().unwrap();
                assert_eq!(a.status, 503, "before the stream is routable: {}", a.text());
                Err(format!("{} {}", a.status, a.text()))
            }
        }
    })
    .await
}

/// The caller's answer to a call [`call_via`] sent, within the wait.
pub async fn answered(answer: JoinHandle<anyhow::Result<Answer>>) -> Answer {
    tokio::time::timeout(WAIT, answer)
        .await
        .expect("the caller is answered in time")
        .unwrap()
        .expect("the caller gets an HTTP answer (no dispatcher task panicked)")
}

/// Sends a GET of `path` (call deadline `timeout_ms`) through the front until `agent` is
/// handed it, lets `feed` answer it, and reads the streamed answer: the status, and how the body ended (`Err` with the error when
/// it was cut).
pub async fn stream_answer(
    caller: &Caller,
    agent: &mut HostileAgent,
    path: &str,
    timeout_ms: u64,
    feed: impl FnOnce(u64) -> JoinHandle<()>,
) -> (u16, Result<Bytes, String>, Duration) {
    let agent = &tokio::sync::Mutex::new(agent);
    let (sent, call) = crate::eventually("routable", WAIT, || async move {
        let mut req = caller.request(Method::GET, path, Bytes::new());
        req.headers_mut().insert(
            "x-relay-timeout-ms",
            timeout_ms.to_string().parse().unwrap(),
        );
        let c = caller.clone();
        let mut sent = tokio::spawn(async move { c.send(req).await });
        let mut agent = agent.lock().await;
        tokio::select! {
            head = agent.next_call(WAIT) => Ok((sent, head.unwrap())),
            r = &mut sent => {
                let resp = r.unwrap().unwrap();
                assert_eq!(resp.status(), 503);
                Err(format!("never routable: {}", resp.status()))
            }
        }
    })
    .await;
    let started = Instant::now();
    let feeder = feed(call.call_id);
    let resp = sent.await.unwrap().unwrap();
    let status = resp.status().as_u16();
    let body = tokio::time::timeout(WAIT, resp.into_body().collect())
        .await
        .expect("the body ends (complete or cut) in time")
        .map(|b| b.to_bytes())
        .map_err(|e| e.to_string());
    let took = started.elapsed();
    feeder.abort();
    (status, body, took)
}
