//! A fake tunnel server for the dispatcher's tests: a tonic `Forward` service on
//! 127.0.0.1:0 whose calls follow a typed script ([`Behaviour`]: echo, an error frame, a
//! hang, a queue then a loss, a TCP reset at a chosen point, ...), and the registry side of
//! a tunnel server ([`report_stream`]: the intro, tunnel-up and load frames a real server
//! reports), so a test can stage what a tunnel server does without running one.
//!
//! A fake models "the server died" as a gRPC status (`Status::unavailable`), which is not
//! what a crash looks like on the wire; [`FakeServer::start_resetting`] puts a fake behind a
//! TCP proxy that resets its connections (`SO_LINGER` 0: a real TCP RST) at a chosen point
//! of a call, so the error classification is also checked against what h2 and tonic make of
//! a real reset.

use relay_proto::forward_request::Kind as ReqKind;
use relay_proto::forward_response::Kind as RespKind;
use relay_proto::forward_server::{Forward, ForwardServer};
use relay_proto::registry_client::RegistryClient;
use relay_proto::server_report::Kind as ReportKind;
use relay_proto::{
    BodyChunk, CallErrorKind, ForwardError, ForwardErrorKind, ForwardRequest, ForwardResponse,
    RequestHead, ResponseHead, ServerIntro, ServerReport, TunnelUp, MAX_CHUNK,
};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tonic::{Status, Streaming};

/// What the fake does with a call.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Behaviour {
    /// Answers 200 with headers naming what arrived (`x-seen-method`, `x-seen-path`, two
    /// `set-cookie`, and hop-by-hop ones the dispatcher must drop) and streams the request
    /// body back.
    #[default]
    Echo,
    /// A `NO_CAPACITY` error frame (the server's queue is full).
    NoCapacity,
    /// An `UNKNOWN_TUNNEL` error frame (the server lost the tunnel id).
    UnknownTunnel,
    /// A `STREAM_LOST` error frame before any head (the agent vanished).
    StreamLost,
    /// The agent refused the call (a filter), message "filter says no".
    Refused,
    /// The agent could not reach its upstream.
    UpstreamUnreachable,
    /// The agent's upstream was too slow.
    UpstreamTimeout,
    /// Never answers; counts the dispatcher dropping the call ([`FakeServer::cancelled`]).
    Hang,
    /// `Queued`, then the server goes away (`UNAVAILABLE`).
    QueuedThenLost,
    /// `Queued`, a reservation, and after the dispatcher's `Proceed` the server goes away.
    ReservedThenLost,
    /// `Queued`, then nothing: the test resets the connection ([`FakeServer::reset`]).
    QueuedThenHang,
    /// `Queued`, a reservation, and after `Proceed` every connection is reset.
    ProceededThenReset,
    /// A response head and 1000 body bytes, then nothing: the test resets the connection.
    HeadThenHang,
    /// A response head and 1000 body bytes, then a `STREAM_LOST` error frame.
    HeadThenError,
    /// A 200 with a body of this many bytes in chunks of `MAX_CHUNK`.
    Big(usize),
    /// The call arrives, then every connection is reset before a response header leaves
    /// (as a real server dying right after handing the call to an agent).
    ResetBeforeHeaders,
    /// A whole 200 (`content-length: 100`, the body inside the head), then the RPC's end
    /// is held until [`FakeServer::release`]; a dispatcher that drops the RPC first is
    /// counted in [`FakeServer::cancelled`], one that reads it to its end in
    /// [`FakeServer::ended`].
    WholeHeadThenHeldEnd,
    /// A 200 with `content-length: 1000` and its body in one chunk that ends it, then the
    /// RPC's end held as in [`Behaviour::WholeHeadThenHeldEnd`].
    WholeBodyThenHeldEnd,
}

/// A call as the fake saw it.
#[derive(Debug, Clone)]
pub struct Seen {
    pub tunnel_id: String,
    pub head: RequestHead,
    pub chunk_sizes: Vec<usize>,
    pub body_len: usize,
    /// The request body ended (or, for the reservation behaviours, `Proceed` came).
    pub ended: bool,
}

#[derive(Clone, Default)]
struct FakeState {
    /// The behaviour of every call from now on.
    behaviour: Arc<Mutex<Behaviour>>,
    seen: Arc<Mutex<Vec<Seen>>>,
    cancelled: Arc<AtomicUsize>,
    /// RPCs of the held-end behaviours that ended after [`FakeServer::release`].
    ended: Arc<AtomicUsize>,
    /// Set by [`FakeServer::release`]: held RPCs end.
    release: Arc<tokio::sync::watch::Sender<bool>>,
    /// Fired by `Forward.Proceed`.
    proceeded: Arc<tokio::sync::Notify>,
    /// `Forward.Carry` RPCs refused as unknown.
    carry_refused: Arc<AtomicUsize>,
    /// Set by [`FakeServer::start_carrying_one_call`]: carriers answer their first call,
    /// then end cleanly as the next head arrives.
    carry_one: bool,
    /// Set by [`FakeServer::start_carrying_echo`]: carriers say they read a body inside
    /// the call head (`inline-body`) and echo each call's request body whole.
    carry_echo: bool,
    /// Carriers opened on a carrying fake.
    carriers: Arc<AtomicUsize>,
    /// [`Behaviour::Echo`] calls whose request stream was reset before a body chunk with
    /// `end`.
    bodies_reset: Arc<AtomicUsize>,
    /// [`Behaviour::Echo`] calls whose request stream ended cleanly before a body chunk
    /// with `end`: a cut body a server taking the RPC's end as the body's end would pass
    /// on as whole.
    bodies_cut: Arc<AtomicUsize>,
    /// Resets every TCP connection through the fake's proxy (see
    /// [`FakeServer::start_resetting`]).
    reset: Option<Arc<tokio::sync::Notify>>,
}

struct FakeForward(FakeState);

/// The values of header `name` in `head`, in order.
pub fn header<'a>(head: &'a RequestHead, name: &str) -> Vec<&'a [u8]> {
    head.headers
        .iter()
        .map(|r| relay_proto::parse_header(r).expect("a dispatcher's header record"))
        .filter(|(n, _)| *n == name.as_bytes())
        .map(|(_, v)| v)
        .collect()
}

/// The reservation number the fake hands out and expects back in `Proceed`.
const RESERVATION: u64 = 42;

/// The server's `Queued` answer (the call waits for a stream).
fn queued() -> ForwardResponse {
    ForwardResponse::of(RespKind::Queued(relay_proto::Queued {}))
}

/// The server's `StreamReserved` answer (a stream waits for the dispatcher's `Proceed`).
fn reserved() -> ForwardResponse {
    ForwardResponse::of(RespKind::Reserved(relay_proto::StreamReserved {
        reservation: RESERVATION,
    }))
}

fn error_frame(kind: ForwardErrorKind, call_error: CallErrorKind, msg: &str) -> ForwardResponse {
    ForwardResponse::of(RespKind::Error(ForwardError {
        kind: kind as i32,
        message: msg.into(),
        call_error: call_error as i32,
    }))
}

fn body_frame(data: impl Into<bytes::Bytes>, end: bool) -> ForwardResponse {
    ForwardResponse::of(RespKind::Body(BodyChunk {
        call_id: 0,
        data: data.into(),
        end,
    }))
}

type Out = mpsc::Sender<Result<ForwardResponse, Status>>;

impl FakeState {
    /// A carrier of [`FakeServer::start_carrying_echo`]: records each call (its head with
    /// any body inside it, then its body frames) and answers a whole 200 echoing the body.
    fn carry_echo(
        &self,
        mut inbound: Streaming<ForwardRequest>,
    ) -> tonic::Response<ReceiverStream<Result<ForwardResponse, Status>>> {
        self.carriers.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::channel(4);
        let seen = self.seen.clone();
        tokio::spawn(async move {
            while let Ok(Some(ForwardRequest {
                kind: Some(ReqKind::Head(call)),
            })) = inbound.message().await
            {
                let head = call.request.unwrap_or_default();
                let mut body = head.body.to_vec();
                let mut record = Seen {
                    tunnel_id: call.tunnel_id,
                    head: head.clone(),
                    chunk_sizes: vec![],
                    body_len: body.len(),
                    ended: head.end_of_stream,
                };
                while !record.ended {
                    let Ok(Some(ForwardRequest {
                        kind: Some(ReqKind::Body(chunk)),
                    })) = inbound.message().await
                    else {
                        return;
                    };
                    record.chunk_sizes.push(chunk.data.len());
                    record.body_len += chunk.data.len();
                    record.ended = chunk.end;
                    body.extend_from_slice(&chunk.data);
                }
                seen.lock().unwrap().push(record);
                let answer = ResponseHead {
                    call_id: head.call_id,
                    status: 200,
                    end_of_stream: true,
                    body: body.into(),
                    ..Default::default()
                };
                if tx
                    .send(Ok(ForwardResponse::of(RespKind::Head(answer))))
                    .await
                    .is_err()
                {
                    return;
                }
            }
        });
        let mut response = tonic::Response::new(ReceiverStream::new(rx));
        response.metadata_mut().insert(
            relay_proto::FORWARD_FEATURES,
            tonic::metadata::MetadataValue::from_static("inline-body"),
        );
        response
    }

    fn behaviour(&self) -> Behaviour {
        *self.behaviour.lock().unwrap()
    }

    /// The server's host dies: every connection to it is reset (TCP RST), as the
    /// dispatcher sees a crashed machine or a killed process with unread data.
    fn reset_connections(&self) {
        self.reset
            .as_ref()
            .expect("a resetting fake (FakeServer::start_resetting)")
            .notify_waiters();
    }

    async fn serve_call(
        &self,
        tunnel_id: String,
        head: RequestHead,
        mut inbound: Streaming<ForwardRequest>,
        tx: Out,
    ) {
        let behaviour = self.behaviour();
        let index = {
            let mut seen = self.seen.lock().unwrap();
            seen.push(Seen {
                tunnel_id,
                head: head.clone(),
                chunk_sizes: vec![],
                body_len: 0,
                ended: false,
            });
            seen.len() - 1
        };
        let send = |f: ForwardResponse| {
            let tx = tx.clone();
            async move { tx.send(Ok(f)).await.is_ok() }
        };
        let response_head = |headers: Vec<bytes::Bytes>, end_of_stream: bool| {
            ForwardResponse::of(RespKind::Head(ResponseHead {
                call_id: head.call_id,
                status: 200,
                headers,
                end_of_stream,
                ..Default::default()
            }))
        };
        match behaviour {
            Behaviour::NoCapacity => {
                send(error_frame(
                    ForwardErrorKind::NoCapacity,
                    CallErrorKind::Unspecified,
                    "queue full",
                ))
                .await;
            }
            Behaviour::UnknownTunnel => {
                send(error_frame(
                    ForwardErrorKind::UnknownTunnel,
                    CallErrorKind::Unspecified,
                    "gone",
                ))
                .await;
            }
            Behaviour::StreamLost => {
                send(error_frame(
                    ForwardErrorKind::StreamLost,
                    CallErrorKind::Unspecified,
                    "agent vanished",
                ))
                .await;
            }
            Behaviour::Refused => {
                send(error_frame(
                    ForwardErrorKind::Agent,
                    CallErrorKind::Refused,
                    "filter says no",
                ))
                .await;
            }
            Behaviour::UpstreamUnreachable => {
                send(error_frame(
                    ForwardErrorKind::Agent,
                    CallErrorKind::UpstreamUnreachable,
                    "connect refused",
                ))
                .await;
            }
            Behaviour::UpstreamTimeout => {
                send(error_frame(
                    ForwardErrorKind::Agent,
                    CallErrorKind::UpstreamTimeout,
                    "slow",
                ))
                .await;
            }
            Behaviour::Hang => {
                // Never answer; count the dispatcher dropping the call.
                loop {
                    tokio::select! {
                        _ = tx.closed() => break,
                        m = inbound.message() => if !matches!(m, Ok(Some(_))) { break },
                    }
                }
                tx.closed().await;
                self.cancelled.fetch_add(1, Ordering::SeqCst);
            }
            Behaviour::QueuedThenLost => {
                // The call waits in the queue, then the server dies.
                send(queued()).await;
                let _ = tx.send(Err(Status::unavailable("server went away"))).await;
            }
            Behaviour::ReservedThenLost => {
                // A stream is reserved; the server dies after the dispatcher's Proceed.
                send(queued()).await;
                send(reserved()).await;
                self.proceeded.notified().await;
                self.seen.lock().unwrap()[index].ended = true;
                let _ = tx.send(Err(Status::unavailable("server went away"))).await;
            }
            Behaviour::QueuedThenHang => {
                // The test resets the connection once the dispatcher heard `Queued`.
                send(queued()).await;
                tx.closed().await;
            }
            Behaviour::ProceededThenReset => {
                send(queued()).await;
                send(reserved()).await;
                self.proceeded.notified().await;
                self.seen.lock().unwrap()[index].ended = true;
                self.reset_connections();
                tx.closed().await;
            }
            Behaviour::HeadThenHang => {
                // The test resets the connection once the caller has the head.
                send(response_head(vec![], false)).await;
                send(body_frame(vec![1; 1000], false)).await;
                tx.closed().await;
            }
            Behaviour::HeadThenError => {
                send(response_head(vec![], false)).await;
                send(body_frame(vec![1; 1000], false)).await;
                send(error_frame(
                    ForwardErrorKind::StreamLost,
                    CallErrorKind::Unspecified,
                    "cut",
                ))
                .await;
            }
            Behaviour::Big(total) => {
                send(response_head(
                    vec![relay_proto::header(
                        "content-type",
                        "application/octet-stream",
                    )],
                    false,
                ))
                .await;
                let chunk = vec![0x5a_u8; MAX_CHUNK];
                let mut left = total;
                while left > 0 {
                    let n = left.min(MAX_CHUNK);
                    left -= n;
                    if !send(body_frame(chunk[..n].to_vec(), left == 0)).await {
                        return;
                    }
                }
            }
            Behaviour::WholeHeadThenHeldEnd | Behaviour::WholeBodyThenHeldEnd => {
                let inline = behaviour == Behaviour::WholeHeadThenHeldEnd;
                let len = if inline { 100 } else { 1000 };
                send(ForwardResponse::of(RespKind::Head(ResponseHead {
                    call_id: head.call_id,
                    status: 200,
                    headers: vec![relay_proto::header("content-length", len.to_string())],
                    end_of_stream: inline,
                    body: if inline {
                        vec![7; len].into()
                    } else {
                        bytes::Bytes::new()
                    },
                })))
                .await;
                if !inline {
                    send(body_frame(vec![7; len], true)).await;
                }
                let mut release = self.release.subscribe();
                tokio::select! {
                    _ = tx.closed() => {
                        self.cancelled.fetch_add(1, Ordering::SeqCst);
                    }
                    _ = release.wait_for(|r| *r) => {
                        self.ended.fetch_add(1, Ordering::SeqCst);
                    }
                }
            }
            Behaviour::Echo | Behaviour::ResetBeforeHeaders => {
                // Echo: report what arrived in headers, stream the request body back.
                let headers = vec![
                    relay_proto::header("x-seen-method", head.method.clone()),
                    relay_proto::header("x-seen-path", head.path_and_query.clone()),
                    relay_proto::header("set-cookie", "a=1"),
                    relay_proto::header("set-cookie", "b=2"),
                    relay_proto::header("keep-alive", "timeout=5"),
                    relay_proto::header("connection", "x-internal"),
                    relay_proto::header("x-internal", "secret-ish"),
                ];
                send(response_head(headers, false)).await;
                if head.end_of_stream {
                    send(body_frame(vec![], true)).await;
                    return;
                }
                loop {
                    match inbound.message().await {
                        Ok(Some(ForwardRequest {
                            kind: Some(ReqKind::Body(chunk)),
                        })) => {
                            {
                                let mut seen = self.seen.lock().unwrap();
                                seen[index].chunk_sizes.push(chunk.data.len());
                                seen[index].body_len += chunk.data.len();
                                seen[index].ended = chunk.end;
                            }
                            let end = chunk.end;
                            if !send(body_frame(chunk.data, end)).await || end {
                                return;
                            }
                        }
                        Ok(None) => {
                            self.bodies_cut.fetch_add(1, Ordering::SeqCst);
                            return;
                        }
                        Err(_) => {
                            self.bodies_reset.fetch_add(1, Ordering::SeqCst);
                            return;
                        }
                        _ => return,
                    }
                }
            }
        }
    }
}

#[tonic::async_trait]
impl Forward for FakeForward {
    type CallStream = ReceiverStream<Result<ForwardResponse, Status>>;

    async fn proceed(
        &self,
        request: tonic::Request<relay_proto::ProceedRequest>,
    ) -> Result<tonic::Response<relay_proto::ProceedReply>, Status> {
        if request.into_inner().reservation != RESERVATION {
            return Err(Status::not_found("no such reservation"));
        }
        self.0.proceeded.notify_one();
        Ok(tonic::Response::new(relay_proto::ProceedReply {}))
    }

    /// A server of the protocol before the dispatcher's probe: the answer is timed alike.
    async fn probe(
        &self,
        _request: tonic::Request<relay_proto::ProbeRequest>,
    ) -> Result<tonic::Response<relay_proto::ProbeReply>, Status> {
        Err(Status::unimplemented("Forward.Probe"))
    }

    type CarryStream = ReceiverStream<Result<ForwardResponse, Status>>;

    /// A server of the protocol before carriers: the dispatcher falls back to one
    /// `Forward.Call` per call, which every behaviour above scripts.
    async fn carry(
        &self,
        request: tonic::Request<Streaming<ForwardRequest>>,
    ) -> Result<tonic::Response<Self::CarryStream>, Status> {
        if self.0.carry_echo {
            return Ok(self.0.carry_echo(request.into_inner()));
        }
        if !self.0.carry_one {
            self.0.carry_refused.fetch_add(1, Ordering::Relaxed);
            return Err(Status::unimplemented("Forward.Carry"));
        }
        self.0.carriers.fetch_add(1, Ordering::Relaxed);
        let mut inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(4);
        tokio::spawn(async move {
            // The first call (bodiless): a whole 200 with the path it asked for.
            let Ok(Some(ForwardRequest {
                kind: Some(ReqKind::Head(head)),
            })) = inbound.message().await
            else {
                return;
            };
            let path = head.request.map(|r| r.path_and_query).unwrap_or_default();
            let answer = ResponseHead {
                status: 200,
                end_of_stream: true,
                body: path.into_bytes().into(),
                ..Default::default()
            };
            if tx
                .send(Ok(ForwardResponse::of(RespKind::Head(answer))))
                .await
                .is_err()
            {
                return;
            }
            // The next head meets a server that ends the carrier between calls (as one
            // stopping does): an OK end, the head never taken.
            let _ = inbound.message().await;
            drop(tx);
            // Keep reading so the end is not a reset.
            while let Ok(Some(_)) = inbound.message().await {}
        });
        Ok(tonic::Response::new(ReceiverStream::new(rx)))
    }

    async fn call(
        &self,
        request: tonic::Request<Streaming<ForwardRequest>>,
    ) -> Result<tonic::Response<Self::CallStream>, Status> {
        let mut inbound = request.into_inner();
        let first = inbound
            .message()
            .await?
            .ok_or_else(|| Status::invalid_argument("no head"))?;
        let Some(ReqKind::Head(call_head)) = first.kind else {
            return Err(Status::invalid_argument("head first"));
        };
        let head = call_head
            .request
            .ok_or_else(|| Status::invalid_argument("no request"))?;
        if self.0.behaviour() == Behaviour::ResetBeforeHeaders {
            // The call arrived; the host dies before the response headers leave.
            self.0.seen.lock().unwrap().push(Seen {
                tunnel_id: call_head.tunnel_id.clone(),
                head: head.clone(),
                chunk_sizes: vec![],
                body_len: 0,
                ended: false,
            });
            self.0.reset_connections();
            // Nothing more leaves this server; the handler ends with its connection.
            std::future::pending::<()>().await;
        }
        let (tx, rx) = mpsc::channel(4);
        let state = self.0.clone();
        tokio::spawn(async move {
            state
                .serve_call(call_head.tunnel_id, head, inbound, tx)
                .await
        });
        Ok(tonic::Response::new(ReceiverStream::new(rx)))
    }
}

/// A running fake tunnel server; its `Forward` service is at `url`.
pub struct FakeServer {
    pub url: String,
    state: FakeState,
}

async fn bind() -> TcpListener {
    TcpListener::bind("127.0.0.1:0").await.unwrap()
}

impl FakeServer {
    /// A fake whose calls behave as `behaviour` (until [`FakeServer::set`]).
    pub async fn start(behaviour: Behaviour) -> FakeServer {
        Self::start_with(FakeState {
            behaviour: Arc::new(Mutex::new(behaviour)),
            ..Default::default()
        })
        .await
    }

    async fn start_with(state: FakeState) -> FakeServer {
        let listener = bind().await;
        let url = format!("http://{}", listener.local_addr().unwrap());
        let svc = ForwardServer::new(FakeForward(state.clone()));
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(svc)
                .serve_with_incoming(TcpListenerStream::new(listener)),
        );
        FakeServer { url, state }
    }

    /// A fake whose URL is a TCP proxy in front of it. When a call's behaviour (or
    /// [`FakeServer::reset`]) resets the connections, the proxy sets `SO_LINGER` 0 on every
    /// dispatcher-facing socket and closes it: the dispatcher gets a real TCP RST mid-call,
    /// not a gRPC status.
    pub async fn start_resetting(behaviour: Behaviour) -> FakeServer {
        let reset = Arc::new(tokio::sync::Notify::new());
        let mut fake = Self::start_with(FakeState {
            behaviour: Arc::new(Mutex::new(behaviour)),
            reset: Some(reset.clone()),
            ..Default::default()
        })
        .await;
        let target: SocketAddr = fake.url.trim_start_matches("http://").parse().unwrap();
        let proxy = bind().await;
        fake.url = format!("http://{}", proxy.local_addr().unwrap());
        tokio::spawn(async move {
            while let Ok((mut client, _)) = proxy.accept().await {
                let reset = reset.clone();
                tokio::spawn(async move {
                    let Ok(mut server) = tokio::net::TcpStream::connect(target).await else {
                        return;
                    };
                    let reset = reset.notified();
                    let reset = tokio::select! {
                        // The reset first: nothing the server writes after it reaches the
                        // dispatcher.
                        biased;
                        _ = reset => true,
                        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => false,
                    };
                    if reset {
                        client.set_zero_linger().unwrap();
                    }
                });
            }
        });
        fake
    }

    /// A fake that speaks `Forward.Carry` only: each carrier answers its first call with a
    /// whole 200 whose body is the call's path, then ends cleanly when the next head
    /// arrives, without taking it (a server ending a carrier between calls, racing the
    /// dispatcher's next call).
    pub async fn start_carrying_one_call() -> FakeServer {
        Self::start_with(FakeState {
            carry_one: true,
            ..Default::default()
        })
        .await
    }

    /// A fake that speaks `Forward.Carry` only, as a server that reads a whole small
    /// request body inside the call head (it lists `inline-body` in each carrier's
    /// response metadata): every call gets a whole 200 echoing its request body.
    pub async fn start_carrying_echo() -> FakeServer {
        Self::start_with(FakeState {
            carry_echo: true,
            ..Default::default()
        })
        .await
    }

    /// Carriers opened on a carrying fake.
    pub fn carriers(&self) -> usize {
        self.state.carriers.load(Ordering::SeqCst)
    }

    /// Every call from now on behaves as `behaviour`.
    pub fn set(&self, behaviour: Behaviour) {
        *self.state.behaviour.lock().unwrap() = behaviour;
    }

    /// Resets every connection through a resetting fake's proxy now.
    pub fn reset(&self) {
        self.state.reset_connections();
    }

    /// Every call that reached the fake, in order.
    pub fn seen(&self) -> Vec<Seen> {
        self.state.seen.lock().unwrap().clone()
    }

    /// Calls of [`Behaviour::Hang`] the dispatcher dropped, and calls of the held-end
    /// behaviours it dropped before their RPC's end.
    pub fn cancelled(&self) -> usize {
        self.state.cancelled.load(Ordering::SeqCst)
    }

    /// Ends every RPC held by [`Behaviour::WholeHeadThenHeldEnd`] or
    /// [`Behaviour::WholeBodyThenHeldEnd`], now and from now on.
    pub fn release(&self) {
        self.state.release.send_replace(true);
    }

    /// Held RPCs that ended after [`FakeServer::release`] with the dispatcher still reading.
    pub fn ended(&self) -> usize {
        self.state.ended.load(Ordering::SeqCst)
    }

    /// `Forward.Carry` RPCs the fake refused as an older server does (UNIMPLEMENTED).
    pub fn carry_refused(&self) -> usize {
        self.state.carry_refused.load(Ordering::SeqCst)
    }

    /// Echoed calls whose request stream was reset before its body's end.
    pub fn bodies_reset(&self) -> usize {
        self.state.bodies_reset.load(Ordering::SeqCst)
    }

    /// Echoed calls whose request stream ended cleanly before its body's end.
    pub fn bodies_cut(&self) -> usize {
        self.state.bodies_cut.load(Ordering::SeqCst)
    }
}

// ---------------------------------------------------------------------------------------
// The registry side: a tunnel server's report stream

/// A tunnel server's report stream; dropping `tx` ends it.
pub struct Announcer {
    pub tx: mpsc::Sender<ServerReport>,
    pub result: tokio::task::JoinHandle<Result<tonic::Response<relay_proto::ReportAck>, Status>>,
}

/// A report stream to the registry at `registry` that sends `first`.
pub async fn report_stream(registry: SocketAddr, first: Vec<ServerReport>) -> Announcer {
    report_stream_with_key(registry, None, first).await
}

/// A report stream carrying `authorization: Bearer <key>` when `key` is set.
pub async fn report_stream_with_key(
    registry: SocketAddr,
    key: Option<&str>,
    first: Vec<ServerReport>,
) -> Announcer {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{registry}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let (tx, rx) = mpsc::channel(16);
    for f in first {
        tx.send(f).await.unwrap();
    }
    let mut request = tonic::Request::new(ReceiverStream::new(rx));
    if let Some(k) = key {
        request
            .metadata_mut()
            .insert("authorization", format!("Bearer {k}").parse().unwrap());
    }
    let result = tokio::spawn(async move { RegistryClient::new(channel).report(request).await });
    Announcer { tx, result }
}

/// The first frame of a report stream: server `server_id` in zone `zone-a`, forwarding at
/// `forward_url`.
pub fn intro(server_id: &str, forward_url: &str) -> ServerReport {
    ServerReport {
        kind: Some(ReportKind::Intro(ServerIntro {
            server_id: server_id.into(),
            zone: "zone-a".into(),
            forward_url: forward_url.into(),
            protocol_version: relay_proto::PROTOCOL_VERSION,
            instance_id: "fake".into(),
            direct_url: String::new(),
        })),
    }
}

/// The server holds streams of `tunnel_id`.
pub fn up(tunnel_id: &str) -> ServerReport {
    ServerReport {
        kind: Some(ReportKind::TunnelUp(TunnelUp {
            tunnel_id: tunnel_id.into(),
        })),
    }
}

/// A load report: `idle`, `busy` streams and `queued` calls of `tunnel_id`.
pub fn load_frame(tunnel_id: &str, idle: u32, busy: u32, queued: u32) -> ServerReport {
    ServerReport {
        kind: Some(ReportKind::Load(relay_proto::LoadReport {
            cpu_permille: 0,
            tunnels: vec![relay_proto::TunnelLoad {
                tunnel_id: tunnel_id.into(),
                idle,
                busy,
                queued,
                rtt_us: 0,
            }],
            calls_in_flight: busy,
            draining: false,
            partial: false,
        })),
    }
}
