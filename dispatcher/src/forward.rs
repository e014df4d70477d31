//! One forward attempt's transport: the hops to each tunnel server and the RPC of one
//! attempt, up to the response head.
//!
//! It owns the per-server hops (the connections to each `forward_url`, see `pool`, on
//! which calls travel on reused carriers, `Forward.Carry`, see `carrier`, or as one
//! `Forward.Call` each to a server that does not know carriers; or the in-process tunnel
//! server of the co-located mode, see `colocated`). Both gRPC forms frame a call alike, so
//! everything below holds for either; a carrier the server ended before it took the call is
//! one more "never reached an agent".
//!
//! [`Forwarder::attempt`] sends one attempt's request (the head, then the body from
//! `replay`), reads the frames before the response head into the queue handshake
//! ([`attempt::Handshake`](crate::attempt::Handshake), which decides what each means) and
//! carries out its steps: count a queued call, send `Forward.Proceed`, read a refusing
//! server's RPC to its end. Which server an attempt goes to and whether a failed one is
//! retried are `call`'s, by the rules in `attempt`. It must not parse HTTP or choose error
//! bodies: it hands back a `ResponseHead` plus the response stream, or a [`Failure`] with
//! its [`Retry`].

use crate::attempt::{self, Event, Handshake, Step};
use crate::carrier;
use crate::colocated::{Local, LocalServer, ResponseFrames};
use crate::error::{Failure, Retry};
use crate::metrics::Metrics;
use crate::pool::{ConnId, Remote, RemoteParts};
use crate::replay::RequestBody;
use crate::routing::Target;
use futures::StreamExt;
use parking_lot::Mutex;
use relay_common::grpc::GrpcClient;
use relay_common::h2::H2Limits;
use relay_common::tls::TlsClient;
use relay_proto::forward_request::Kind as ReqKind;
use relay_proto::forward_response::Kind as RespKind;
use relay_proto::{CallHead, ForwardRequest, ForwardResponse, RequestHead, ResponseHead};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;
use tracing::debug;

/// The connections to each tunnel server `forward_url` (`pool`), over TLS (`https://`
/// URLs, with the `[forward_tls]` client config) or plain h2c (`http://`, only with
/// `[forward_tls] insecure = true`), with their idle carriers (`carrier`).
#[derive(Clone)]
pub struct Channels {
    inner: Arc<Mutex<HashMap<String, Arc<Remote>>>>,
    client: GrpcClient,
    /// Streams per connection: `[forward_h2] max_concurrent_streams`.
    per_connection: usize,
    /// The co-located tunnel server, reached without gRPC.
    local: Option<Local>,
    /// `carrier_idle_timeout`.
    carrier_idle_timeout: Duration,
    /// Largest gRPC message sent to or accepted from a tunnel server.
    max_frame_bytes: usize,
    /// `relay_dispatcher_forward_connections`.
    connections: prometheus::IntGauge,
    /// `relay_dispatcher_forward_servers_down`.
    down: prometheus::IntGauge,
}

/// How one attempt reaches its tunnel server.
pub enum Hop {
    Remote(Arc<Remote>),
    Local(Arc<dyn LocalServer>),
}

impl Default for Channels {
    fn default() -> Self {
        Channels::new(None, H2Limits::FORWARD)
    }
}

/// How long dialing a tunnel server may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

impl Channels {
    /// `tls`: the client config for tunnel servers; `None` dials plain h2c. `h2`: the
    /// connections' HTTP/2 limits (`[forward_h2]`); the stream window bounds what one call
    /// buffers while its caller reads slowly, `max_concurrent_streams` how many streams go
    /// on one connection.
    pub fn new(tls: Option<TlsClient>, h2: H2Limits) -> Self {
        Channels {
            inner: Arc::default(),
            client: GrpcClient::new(h2, CONNECT_TIMEOUT, tls).keepalive_while_idle(),
            per_connection: h2.max_concurrent_streams as usize,
            local: None,
            carrier_idle_timeout: carrier::IDLE_FOR,
            max_frame_bytes: relay_proto::DEFAULT_MAX_FRAME_BYTES,
            connections: prometheus::IntGauge::new(
                "relay_dispatcher_forward_connections",
                "HTTP/2 connections open to tunnel servers",
            )
            .expect("a valid metric"),
            down: prometheus::IntGauge::new(
                "relay_dispatcher_forward_servers_down",
                "Tunnel servers whose path is dead",
            )
            .expect("a valid metric"),
        }
    }

    /// Carriers unused for `idle` are closed.
    pub fn with_carrier_idle_timeout(mut self, idle: Duration) -> Self {
        self.carrier_idle_timeout = idle;
        self
    }

    /// The largest gRPC message sent to or accepted from a tunnel server.
    pub fn with_max_frame_bytes(mut self, max: usize) -> Self {
        self.max_frame_bytes = max;
        self
    }

    /// Counts the open connections in `connections` and the servers down in `down`.
    pub fn with_gauges(
        mut self,
        connections: prometheus::IntGauge,
        down: prometheus::IntGauge,
    ) -> Self {
        self.connections = connections;
        self.down = down;
        self
    }

    /// Calls to `local.forward_url` go to the tunnel server in this process.
    pub fn with_local(mut self, local: Option<Local>) -> Self {
        self.local = local;
        self
    }

    /// Whether `forward_url` is the co-located tunnel server's.
    pub fn is_local(&self, forward_url: &str) -> bool {
        self.local
            .as_ref()
            .is_some_and(|l| l.forward_url == forward_url)
    }

    pub fn get(&self, forward_url: &str) -> Result<Hop, String> {
        if let Some(local) = self.local.as_ref().filter(|l| l.forward_url == forward_url) {
            return Ok(Hop::Local(local.server.clone()));
        }
        let https = forward_url.starts_with("https://");
        match (self.client.is_tls(), https) {
            (true, false) => {
                return Err(format!(
                    "forward_url {forward_url} is plain text but this dispatcher dials tunnel servers over TLS ([forward_tls])"
                ))
            }
            (false, true) => {
                return Err(format!(
                    "forward_url {forward_url} is https:// but [forward_tls] says insecure = true"
                ))
            }
            _ => {}
        }
        let mut map = self.inner.lock();
        if let Some(remote) = map.get(forward_url) {
            return Ok(Hop::Remote(remote.clone()));
        }
        let endpoint = self
            .client
            .endpoint(forward_url)
            .map_err(|e| e.to_string())?;
        let remote = Arc::new(Remote::new(RemoteParts {
            endpoint,
            client: self.client.clone(),
            per_connection: self.per_connection,
            carrier_idle_timeout: self.carrier_idle_timeout,
            max_frame_bytes: self.max_frame_bytes,
            gauge: self.connections.clone(),
            url: forward_url.to_string(),
            down_gauge: self.down.clone(),
        }));
        map.insert(forward_url.to_string(), remote.clone());
        Ok(Hop::Remote(remote))
    }

    /// Drops the connections (and their idle carriers) of a server that left.
    pub fn evict(&self, forward_url: &str) {
        self.inner.lock().remove(forward_url);
    }
}

/// The parts of a caller's request that go into the `RequestHead`.
pub struct CallPlan {
    pub call_id: u64,
    pub tunnel_id: String,
    pub method: String,
    pub path_and_query: String,
    /// Header records (`relay_proto::wire_headers`).
    pub headers: Vec<bytes::Bytes>,
    pub end_of_stream: bool,
    pub deadline: Instant,
    /// The trace context the tunnel server receives (the dispatcher's span as its parent).
    pub trace: relay_proto::TraceParent,
    /// The call's trace id, for its log lines.
    pub trace_id: relay_common::trace::TraceId,
}

/// The tunnel server's answer: its response head and the stream carrying the body.
pub struct Answer {
    pub head: ResponseHead,
    pub stream: ResponseFrames,
    pub server_id: Arc<str>,
}

/// One attempt's transport, shared by every call.
pub struct Forwarder {
    pub channels: Channels,
    /// `carriers_opened` and `queued`.
    pub metrics: Metrics,
}

impl Forwarder {
    /// The co-located tunnel server's place among `servers`, if it is there.
    pub fn local_among(&self, servers: &[Target]) -> Option<usize> {
        self.channels.local.as_ref()?;
        servers
            .iter()
            .position(|t| self.channels.is_local(&t.forward_url))
    }

    /// A call whose connection broke leaves that connection behind: the next call to the
    /// server goes on another one, or dials again. A broken connection is not torn down at
    /// once (its other streams are still failing), and a call put on it meanwhile fails
    /// after it left, as `stream_lost`, where a new dial fails before anything left (a
    /// refused connection, safe to retry elsewhere) or reaches the server's new process. So
    /// a caller whose call was lost with its server's connection never loses a second one
    /// there.
    /// A dead path (a dial that failed, a connection silent past its keep-alive) also
    /// marks the server down (`pool`): the next calls go to other servers at once.
    fn forget_broken(&self, hop: &Hop, conn: Option<ConnId>, status: &tonic::Status) {
        let Hop::Remote(remote) = hop else { return };
        if let Some(conn) = conn {
            if Retry::connection_lost(status) {
                remote.forget(conn);
            }
        }
        if let Some(why) = Retry::path_dead(status) {
            remote.mark_down(why);
        }
    }

    /// Attempt number `attempt` (from 0) of the call `plan` on `route`: its answer's head
    /// and stream, or its failure and what that allows.
    pub async fn attempt(
        &self,
        plan: &CallPlan,
        body: &RequestBody,
        route: &Target,
        attempt: u32,
    ) -> Result<Answer, (Failure, Retry)> {
        let mut handshake = Handshake::new(&route.server_id);
        let hop = self
            .channels
            .get(&route.forward_url)
            .map_err(|e| (handshake.unreachable(e), Retry::Safe))?;
        let deadline_ms = attempt::deadline_ms(plan.deadline, Instant::now());
        let head = || {
            ForwardRequest::of(ReqKind::Head(CallHead {
                tunnel_id: plan.tunnel_id.clone(),
                request: Some(RequestHead {
                    call_id: plan.call_id,
                    method: plan.method.clone(),
                    path_and_query: plan.path_and_query.clone(),
                    headers: plan.headers.clone(),
                    deadline_ms,
                    end_of_stream: plan.end_of_stream,
                    // A small whole body may be put here by the attempt's stream, for a
                    // server that reads it here (`replay::AttemptStream`).
                    body: Default::default(),
                    trace: Some(plan.trace),
                }),
                queue_handshake: true,
            }))
        };
        let request = body.attempt(attempt, head());
        let called = match &hop {
            Hop::Remote(remote) => {
                // A server without carriers: this call and the next ones go as
                // `Forward.Call`, the request replayed from its start.
                let replay = || body.replayable().then(|| body.attempt(attempt, head()));
                remote
                    .call(request, replay, &self.metrics.carriers_opened)
                    .await
                    .map(|(frames, conn)| (frames, Some(conn)))
            }
            Hop::Local(server) => {
                // The tunnel server in this process reads a body inside the head.
                let mut request = request;
                request.inline_body();
                server
                    .call(request.boxed())
                    .await
                    .map(|frames| (frames, None))
                    .map_err(|status| (status, None))
            }
        };
        let (mut stream, conn) = match called {
            Ok(called) => called,
            Err((status, conn)) => {
                self.forget_broken(&hop, conn, &status);
                let why =
                    relay_proto::escape_message(status.message(), relay_proto::MAX_PEER_MESSAGE);
                // The co-located server's statuses carry no transport error: its own word.
                return Err(handshake.open_failed(why, Retry::of_call_error(&status)));
            }
        };
        loop {
            let mut answer = None;
            let event = match stream.next().await.transpose() {
                Ok(Some(ForwardResponse { kind: Some(kind) })) => match kind {
                    RespKind::Head(head) => {
                        answer = Some(head);
                        Event::Head
                    }
                    RespKind::Error(e) => {
                        let (failure, retry) = Failure::from_forward_error(&e);
                        Event::Error(failure, retry)
                    }
                    RespKind::Queued(_) => Event::Queued,
                    RespKind::Reserved(r) => Event::Reserved(r.reservation),
                    RespKind::Body(_) => Event::Body,
                },
                Ok(Some(ForwardResponse { kind: None })) => Event::Empty,
                Ok(None) => Event::Ended,
                Err(status) if carrier::not_taken(&status) => {
                    Event::NotTaken(status.message().to_string())
                }
                Err(status) => {
                    self.forget_broken(&hop, conn, &status);
                    Event::Broke(relay_proto::escape_message(
                        status.message(),
                        relay_proto::MAX_PEER_MESSAGE,
                    ))
                }
            };
            match handshake.on(event) {
                Step::Queued => self.metrics.queued.inc(),
                Step::Proceed(reservation) => {
                    let proceeded = match &hop {
                        Hop::Remote(remote) => {
                            remote.proceed(reservation).await.map_err(|(s, _)| s)
                        }
                        Hop::Local(server) => server.proceed(reservation),
                    };
                    if let Err(status) = proceeded {
                        // The call's own stream tells how it ended.
                        debug!(call_id = plan.call_id, trace_id = %plan.trace_id, tunnel_id = %plan.tunnel_id, server_id = %route.server_id, %status, "proceed failed");
                    }
                }
                Step::Answered => {
                    if let Some(head) = answer {
                        // Never retried from here: the frames kept for a retry can go.
                        body.settle();
                        return Ok(Answer {
                            head,
                            stream,
                            server_id: route.server_id.clone(),
                        });
                    }
                }
                Step::Refused(failure, retry) => {
                    // The server ends the RPC right after its error: read that end rather
                    // than resetting a stream the server is still closing.
                    crate::response::finish_rpc(&mut stream).await;
                    return Err((failure, retry));
                }
                Step::Failed(failure, retry) => return Err((failure, retry)),
            }
        }
    }
}
