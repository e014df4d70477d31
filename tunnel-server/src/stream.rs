//! One agent stream's life on the server: the `Tunnel.Connect` handler that authenticates
//! and registers it, and the reader loop that owns it until it ends. The reader answers
//! heartbeats, handles `GoingAway`, checks each call frame against the protocol (a frame
//! that breaks it closes the stream) and routes it to the call that owns it: a frame of the
//! response straight to the call's caller, the frame that ends the call (or the stream's
//! end) to the call's task (`crate::call`) as an [`Outcome`]. It never counts, logs or
//! answers a call's outcome, and never gives a stream back to the hub: the call's lease
//! does.
//!
//! RTT: the reader times each heartbeat ping to its pong and feeds the hub's per tunnel id
//! EWMA ([`crate::hub::Rtt`]). Only pings sent and answered while the stream carries no
//! call count: a busy stream's pong can wait behind body chunks, which is queueing, not
//! network. A first ping goes out right after the hello so the figure is known within a
//! round trip of the stream opening rather than a heartbeat later.

use crate::handle::{AgentFeatures, EndStatus, OutFrame, StreamCredit, StreamHandle};
use crate::hub::{AddError, Hub};
use crate::outbox::OutboxRx;
use crate::outcome::Outcome;
use relay_proto::{
    agent_frame, forward_response, server_frame, AgentFrame, ForwardResponse, Ping, ServerFrame,
    ServerHello,
};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::time::{Instant, MissedTickBehavior};
use tokio_stream::Stream;
use tonic::{Request, Response, Status, Streaming};
use tracing::{debug, info, warn};

/// Frames buffered toward one agent stream (64 KiB chunks at most each): room for the
/// hello, fleet and first ping of a new stream, and what a call whose upload the upstream
/// stops reading keeps here beside the forward stream's window (at most 8 x 64 KiB).
const OUT_BUFFER: usize = 8;

/// What the Connect handler needs.
pub struct TunnelService {
    pub hub: Arc<Hub>,
    pub tokens: crate::tokens::SharedTokens,
    pub server_id: String,
    pub zone: String,
    /// `direct_url`, advertised in the hello (empty: none).
    pub direct_url: String,
    pub heartbeat: Duration,
    pub heartbeat_misses: u32,
    pub tracker: tokio_util::task::TaskTracker,
    /// The agent listener's guard: a refused token counts against its source's budget, an
    /// accepted one frees its connection from `auth_timeout`.
    pub listener: Arc<relay_common::listen::ListenerGuard>,
    /// Liveness of the agents' named connections (`crate::liveness`); `None`: off.
    pub liveness: Option<Arc<crate::liveness::Conns>>,
    /// The response-body credit offered to an agent that asks for body credit
    /// (`relay_proto::body_credit` of `[agent_h2] stream_window_bytes`).
    pub response_credit: u32,
}

/// Metadata on a RESOURCE_EXHAUSTED open refusal, so the agent learns which server
/// refused (no hello names it) and, at the cap, how many streams it takes.
pub const REFUSED_SERVER_ID: &str = "relay-server-id";
pub const REFUSED_INSTANCE_ID: &str = "relay-instance-id";
pub const REFUSED_CAP: &str = "relay-max-streams";

impl TunnelService {
    /// RESOURCE_EXHAUSTED naming this server, with its per-token cap when that is why.
    fn refusal(&self, message: String, cap: Option<usize>) -> Status {
        let mut md = tonic::metadata::MetadataMap::new();
        if let Ok(v) = self.server_id.parse() {
            md.insert(REFUSED_SERVER_ID, v);
        }
        if let Ok(v) = self.hub.instance_id.parse() {
            md.insert(REFUSED_INSTANCE_ID, v);
        }
        if let Some(cap) = cap {
            md.insert(REFUSED_CAP, cap.into());
        }
        Status::with_metadata(tonic::Code::ResourceExhausted, message, md)
    }
}

#[tonic::async_trait]
impl relay_proto::tunnel_server::Tunnel for TunnelService {
    type ConnectStream = Outbound;

    async fn connect(
        &self,
        request: Request<Streaming<AgentFrame>>,
    ) -> Result<Response<Outbound>, Status> {
        let metrics = &self.hub.metrics;
        let token = request
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim);
        let conn = relay_common::listen::ConnInfo::of(&request);
        let Some((token_hash, tunnel_id)) = token.and_then(|t| self.tokens.lookup(t)) else {
            metrics.opens.with_label_values(&["unauthenticated"]).inc();
            self.listener
                .auth_failed(conn, "agent stream refused: missing or unknown token");
            return Err(Status::unauthenticated("missing or unknown tunnel token"));
        };
        if let Err(e) = self.listener.authenticate(conn, tunnel_id.as_str()) {
            metrics.opens.with_label_values(&["exhausted"]).inc();
            return Err(Status::resource_exhausted(e.to_string()));
        }
        let tunnel_id: Arc<str> = Arc::from(tunnel_id.as_str());
        let features = request
            .metadata()
            .get(relay_proto::AGENT_FEATURES)
            .and_then(|v| v.to_str().ok())
            .map(AgentFeatures::parse)
            .unwrap_or_default();
        // Body credit, when the agent asks for it with a credit of at least two chunks.
        let credit = request
            .metadata()
            .get(relay_proto::AGENT_CREDIT)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u32>().ok())
            .filter(|&c| c as usize >= 2 * relay_proto::MAX_CHUNK)
            .map(|request| StreamCredit {
                request,
                response: self.response_credit,
            });
        let (out, out_rx) = crate::outbox::outbox(OUT_BUFFER);
        let handle = Arc::new(
            StreamHandle::new(
                self.hub.next_stream_id(),
                tunnel_id.clone(),
                token_hash,
                features,
                out,
            )
            .with_credit(credit),
        );
        // The agent's connection, proved alive end to end when the agent names it.
        let conn_name = request
            .metadata()
            .get(relay_proto::AGENT_CONN)
            .and_then(|v| v.to_str().ok());
        let membership = match (&self.liveness, conn_name) {
            (Some(conns), Some(name)) => {
                conns
                    .join(token_hash, name, handle.clone())
                    .map(|conn| ConnMembership {
                        conns: conns.clone(),
                        conn,
                        stream: handle.clone(),
                    })
            }
            _ => None,
        };
        let liveness_ms = membership.as_ref().map_or(0, |m| {
            m.conns
                .settings()
                .interval
                .as_millis()
                .min(u32::MAX as u128) as u32
        });
        let hello = ServerHello {
            server_id: self.server_id.clone(),
            zone: self.zone.clone(),
            stream_id: handle.id,
            heartbeat_ms: self.heartbeat.as_millis().min(u32::MAX as u128) as u32,
            tunnel_id: tunnel_id.to_string(),
            protocol_version: relay_proto::PROTOCOL_VERSION,
            instance_id: self.hub.instance_id.clone(),
            direct_url: self.direct_url.clone(),
            unix_time_ms: relay_common::wall::unix_ms(),
            liveness_ms,
            response_credit: credit.map_or(0, |c| c.response),
        };
        // The hello goes first, then the fleet; the stream takes calls once the agent
        // confirms it (see `Hub::confirm`).
        handle.try_send(ServerFrame::of(server_frame::Kind::Hello(hello)));
        if features.fleet {
            if let Some(fleet) = self.hub.fleet_frame() {
                handle.try_send(fleet);
            }
        }
        match self.hub.add_stream(&tunnel_id, handle.clone()) {
            Ok(()) => {}
            Err(AddError::Exhausted) => {
                metrics.opens.with_label_values(&["exhausted"]).inc();
                let cap = self.hub.limits.max_streams_per_token;
                return Err(self.refusal(
                    format!(
                        "tunnel id {tunnel_id} holds the most streams this server allows ({cap})"
                    ),
                    Some(cap),
                ));
            }
            Err(AddError::Draining) => {
                metrics.opens.with_label_values(&["draining"]).inc();
                // Placement news for the agent (open elsewhere), not a failure to back off from.
                return Err(self.refusal(
                    "tunnel server is draining: open the stream on another server".into(),
                    None,
                ));
            }
        }
        // A reload may have removed the token since the lookup and swept the hub before
        // this stream was in it: check again now that it is (see `crate::tokens`).
        if !self.tokens.contains(&token_hash, &tunnel_id) {
            self.hub.remove_stream(&handle);
            metrics.opens.with_label_values(&["unauthenticated"]).inc();
            warn!(peer = ?request.remote_addr(), "agent stream refused: token revoked while the stream opened");
            return Err(Status::unauthenticated("token revoked"));
        }
        metrics.opens.with_label_values(&["accepted"]).inc();
        debug!(tunnel_id = %tunnel_id, stream_id = handle.id, "agent stream accepted");
        let reader = Reader {
            hub: self.hub.clone(),
            handle: handle.clone(),
            heartbeat: self.heartbeat,
            misses: self.heartbeat_misses,
            conn: membership,
        };
        // The stream holds its connection (not idle, see `agent_limits.idle_timeout`) until
        // its reader ends.
        let held = conn.map(relay_common::listen::ConnInfo::hold);
        let inbound = request.into_inner();
        // The reader's future is spawned as it is, not inside an `async` block that owns its
        // arguments: such a block keeps them beside the future they were moved into, and
        // the task lives as long as the stream.
        self.tracker.spawn(reader.run(inbound, held));
        Ok(Response::new(Outbound {
            frames: out_rx,
            end: Some(handle.end_status()),
        }))
    }
}

/// The RPC's response: the frames queued for the agent until the stream's outbound queue
/// ends (cut when the stream closes, or its handle gone), then the status a close left, if
/// any (after a revocation, UNAUTHENTICATED). A plain struct, not a boxed chain of stream
/// adapters: the RPC holds it for the stream's whole life.
pub struct Outbound {
    frames: OutboxRx<OutFrame>,
    end: Option<EndStatus>,
}

impl Stream for Outbound {
    type Item = Result<ServerFrame, Status>;

    fn poll_next(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        match std::task::ready!(Pin::new(&mut self.frames).poll_next(cx)) {
            Some(frame) => std::task::Poll::Ready(Some(frame.map(|f| *f))),
            None => std::task::Poll::Ready(self.end.take().and_then(|e| e.get()).map(Err)),
        }
    }
}

/// A wait of the reader's (see [`Reader::on_frame`]).
type Wait<'a> = Pin<Box<dyn std::future::Future<Output = ()> + Send + 'a>>;

/// What the reader does after one event (see [`Reader::run`]).
enum Step<'a> {
    /// Reads on.
    Go,
    /// Waits first (a caller that is not reading, a full outbound queue).
    Wait(Wait<'a>),
    /// The stream ends.
    End(End),
}

/// The reader's heartbeat: when the agent was last heard, and the pings.
struct Beat {
    last_seen: Instant,
    seq: u64,
    /// The ping whose pong would be an RTT sample: (seq, sent at).
    timed: Option<(u64, Instant)>,
    /// The agent's first frame came (see [`Reader::on_message`]).
    confirmed: bool,
}

struct Reader {
    hub: Arc<Hub>,
    handle: Arc<StreamHandle>,
    heartbeat: Duration,
    misses: u32,
    /// The agent connection the stream is on, when the agent named it.
    conn: Option<ConnMembership>,
}

/// A stream's place on its named agent connection (`crate::liveness`); leaves it when
/// dropped, so a stream refused after joining leaves as surely as one that ends.
struct ConnMembership {
    conns: Arc<crate::liveness::Conns>,
    conn: Arc<crate::liveness::AgentConn>,
    stream: Arc<StreamHandle>,
}

impl Drop for ConnMembership {
    fn drop(&mut self) {
        self.conns.leave(&self.conn, &self.stream);
    }
}

/// Why a stream ended: the `reason` of `relay_tunnel_stream_closes_total`, and how the
/// call on it ends.
enum End {
    /// The agent ended its half, or its stream broke.
    AgentClosed,
    /// The server closed it (retired, shut down, given up on, its token revoked, or its
    /// agent's connection silent).
    Closed { revoked: bool, silent: bool },
    /// It missed `heartbeat_misses` heartbeats.
    Heartbeat,
    /// The agent broke the protocol; the status tells it why. `call`: how the call on the
    /// stream ends when the broken frame named it (else stream lost).
    Protocol {
        status: Status,
        call: Option<Outcome>,
    },
}

impl End {
    fn as_str(&self) -> &'static str {
        match self {
            End::AgentClosed => "agent_closed",
            End::Closed { revoked: true, .. } => "revoked",
            End::Closed { silent: true, .. } => "silent",
            End::Closed { .. } => "retired",
            End::Heartbeat => "heartbeat",
            End::Protocol { .. } => "protocol_error",
        }
    }

    /// How the call still on the stream ends.
    fn call_outcome(&mut self) -> Outcome {
        let why = match self {
            End::Protocol { call, .. } if call.is_some() => {
                return call.take().expect("checked");
            }
            End::Heartbeat => "the agent stream carrying the call stopped answering heartbeats",
            End::Closed { revoked: true, .. } => {
                "the agent stream carrying the call was closed: its token was revoked"
            }
            End::Closed { silent: true, .. } => {
                "the agent's connection carrying the call stopped answering liveness pings"
            }
            _ => "the agent stream carrying the call ended before the call did",
        };
        Outcome::StreamLost(why)
    }
}

impl Reader {
    /// Reads the stream until it ends; `held` (the connection's hold, see
    /// `agent_limits.idle_timeout`) is let go with it.
    ///
    /// The task lives as long as the stream, so what it keeps across its waits is what an
    /// idle stream costs. Each frame is read into a [`Step`] by plain functions, in a
    /// block that ends before the step's wait: a frame, a status or an [`End`] still in
    /// scope at an `.await` would keep a slot in the task beside the wait even once moved
    /// out (the future was 1,136 bytes with the frame handling inline and its arguments
    /// kept twice, 600 without either).
    // Not an `async fn`: see the first comment in the body.
    #[allow(clippy::manual_async_fn)]
    fn run(
        self,
        mut inbound: Streaming<AgentFrame>,
        held: Option<relay_common::listen::Held>,
    ) -> impl std::future::Future<Output = ()> + Send {
        // An `async` block over the arguments rather than an `async fn`: an `async fn`
        // keeps each argument twice in its future, as it came and as moved into its body
        // (the reader and its request stream: 304 bytes more per stream).
        async move {
            let _held = held;
            let mut ping = tokio::time::interval(self.heartbeat);
            ping.set_missed_tick_behavior(MissedTickBehavior::Skip);
            ping.tick().await;
            let mut beat = Beat {
                last_seen: Instant::now(),
                seq: 0,
                timed: None,
                confirmed: false,
            };
            self.send_ping(&mut beat);
            // Made once, not per frame: a wait made anew each time registers and drops a
            // waiter under a lock for every frame the agent sends.
            let closed = self.handle.closed();
            tokio::pin!(closed);
            let mut end = loop {
                let wait = {
                    let step = tokio::select! {
                        // Order: a close wins over more frames; frames win over the heartbeat.
                        biased;
                        _ = &mut closed => Step::End(End::Closed { revoked: false, silent: false }),
                        msg = inbound.message() => self.on_message(msg, &mut beat),
                        _ = ping.tick() => self.on_beat(&mut beat),
                    };
                    match step {
                        Step::Go => None,
                        Step::Wait(wait) => Some(wait),
                        Step::End(end) => break end,
                    }
                };
                if let Some(wait) = wait {
                    wait.await;
                }
            };
            let ending = self.handle.end();
            if let End::Closed { revoked, silent } = &mut end {
                *revoked = ending.revoked;
                *silent = ending.silent;
            }
            match &end {
                End::Protocol { status, .. } => {
                    warn!(tunnel_id = %self.handle.tunnel_id, stream_id = self.handle.id, %status, "closing agent stream on a protocol error");
                    self.handle.try_send_status(status.clone());
                }
                End::Heartbeat => {
                    info!(tunnel_id = %self.handle.tunnel_id, stream_id = self.handle.id, silence_ms = self.silence().as_millis() as u64, "dropping a silent agent stream");
                }
                _ => {}
            }
            self.hub
                .metrics
                .closes
                .with_label_values(&[end.as_str()])
                .inc();
            if let Some(slot) = ending.call {
                let _ = slot.done.send(end.call_outcome());
            }
            self.hub.remove_stream(&self.handle);
            // A protocol error ends the RPC through the error status queued above; cutting the
            // outbound half now could drop that status before the agent sees it.
            if !matches!(end, End::Protocol { .. }) {
                self.handle.cut();
            }
        }
    }

    /// How long a stream may stay silent: `heartbeat_misses` heartbeats.
    fn silence(&self) -> Duration {
        self.heartbeat * self.misses
    }

    /// What one read of the agent's half brought: a frame, its end, or a broken frame.
    fn on_message(&self, msg: Result<Option<AgentFrame>, Status>, beat: &mut Beat) -> Step<'_> {
        match msg {
            Ok(Some(frame)) => {
                beat.last_seen = Instant::now();
                if let Some(m) = &self.conn {
                    m.conn.seen();
                }
                if let Some(agent_frame::Kind::Pong(pong)) = &frame.kind {
                    self.on_pong(pong.seq, beat);
                }
                // The agent's first frame (the pong to the first ping) confirms it has
                // the hello: only now may the stream take calls.
                if !beat.confirmed {
                    beat.confirmed = true;
                    if matches!(frame.kind, Some(agent_frame::Kind::GoingAway(_))) {
                        // Retired before it took any call: nothing to wait for.
                        self.handle.close();
                    } else {
                        self.hub.confirm(self.handle.clone());
                    }
                }
                match self.on_frame(frame) {
                    Ok(None) => Step::Go,
                    Ok(Some(wait)) => Step::Wait(wait),
                    Err(end) => Step::End(end),
                }
            }
            Ok(None) => Step::End(End::AgentClosed),
            // A frame over max_frame_bytes: tell the agent why its stream ends.
            Err(status) if status.code() == tonic::Code::OutOfRange => Step::End(End::Protocol {
                status: Status::resource_exhausted(format!(
                    "agent frame over max_frame_bytes: {}",
                    status.message()
                )),
                call: None,
            }),
            // A frame over one of the protocol's bounds (a response head of more than
            // `MAX_HEAD_RECORDS` records), refused by the codec before it was decoded: the
            // head of this stream's call, which gets 502 like any head over
            // `max_response_headers`.
            Err(status) if status.code() == tonic::Code::ResourceExhausted => {
                let why = format!("the agent's frame has {}", status.message());
                warn!(tunnel_id = %self.handle.tunnel_id, stream_id = self.handle.id, reason = %why, "agent frame refused");
                Step::End(End::Protocol {
                    status: Status::resource_exhausted(why.clone()),
                    call: Some(Outcome::BadResponse(format!(
                        "{why} (above any max_response_headers)"
                    ))),
                })
            }
            Err(status) => {
                debug!(stream_id = self.handle.id, %status, "agent stream error");
                Step::End(End::AgentClosed)
            }
        }
    }

    /// A heartbeat: the stream ends when the agent was silent too long, else it is pinged.
    fn on_beat(&self, beat: &mut Beat) -> Step<'_> {
        if beat.last_seen.elapsed() > self.silence() {
            return Step::End(End::Heartbeat);
        }
        self.send_ping(beat);
        Step::Go
    }

    /// Sends the next heartbeat ping; times it when the stream is idle.
    fn send_ping(&self, beat: &mut Beat) {
        beat.seq += 1;
        let sent = self
            .handle
            .try_send(ServerFrame::of(server_frame::Kind::Ping(Ping {
                seq: beat.seq,
            })));
        beat.timed = (sent && self.handle.is_idle()).then(|| (beat.seq, Instant::now()));
    }

    /// A pong arrived: one RTT sample if it answers the timed ping and no call came
    /// onto the stream meanwhile.
    fn on_pong(&self, seq: u64, beat: &mut Beat) {
        match beat.timed {
            Some((s, sent)) if s == seq => {
                beat.timed = None;
                if self.handle.is_idle() {
                    self.hub.observe_rtt(
                        &self.handle.tunnel_id,
                        beat.last_seen.saturating_duration_since(sent),
                    );
                }
            }
            _ => {}
        }
    }

    /// With body credit: whether `n` more response-body bytes of the call stay within the
    /// credit this server gave (they are counted then). True on a stream without credit.
    fn response_credit_allows(&self, call_id: u64, n: u32) -> bool {
        let Some(limit) = self.handle.credit.map(|c| c.response) else {
            return true;
        };
        self.handle
            .call_credit(call_id, |c| {
                let after = c.response_unacked.saturating_add(n);
                let ok = after <= limit;
                if ok {
                    c.response_unacked = after;
                }
                ok
            })
            .unwrap_or(true)
    }

    /// With body credit: `n` response-body bytes of the call went on to the caller; once a
    /// step's worth did, they are given back to the agent. The wait, if the grant finds the
    /// stream's outbound queue full.
    fn passed_on(&self, call_id: u64, n: u32) -> Option<Wait<'_>> {
        let grant = self
            .handle
            .call_credit(call_id, |c| {
                c.response_passed = c.response_passed.saturating_add(n);
                if (c.response_passed as usize) < relay_proto::CREDIT_STEP {
                    return None;
                }
                let g = std::mem::take(&mut c.response_passed);
                c.response_unacked = c.response_unacked.saturating_sub(g);
                Some(g)
            })
            .flatten()?;
        let credit = relay_proto::Credit {
            call_id,
            bytes: grant,
        };
        let send = self
            .handle
            .send(ServerFrame::of(server_frame::Kind::Credit(credit)));
        Some(Box::pin(async move {
            let _ = send.await;
        }))
    }

    /// Hands a frame of the answer to the caller, then (`passed`: with body credit, the
    /// call and the body bytes) counts what went on. Returns the wait when the caller's
    /// queue is full, marking the stream meanwhile (its agent frames then wait here, not on
    /// the path).
    fn to_caller(
        &self,
        to_caller: mpsc::Sender<Result<ForwardResponse, Status>>,
        frame: ForwardResponse,
        passed: Option<(u64, u32)>,
    ) -> Option<Wait<'_>> {
        match to_caller.try_send(Ok(frame)) {
            Ok(()) | Err(mpsc::error::TrySendError::Closed(_)) => {
                passed.and_then(|(call_id, n)| self.passed_on(call_id, n))
            }
            Err(mpsc::error::TrySendError::Full(frame)) => Some(Box::pin(async move {
                self.handle.reader_waits(true);
                let _ = to_caller.send(frame).await;
                self.handle.reader_waits(false);
                if let Some(wait) = passed.and_then(|(call_id, n)| self.passed_on(call_id, n)) {
                    wait.await;
                }
            })),
        }
    }

    /// Handles one agent frame; `Err` ends the stream. Takes no wait itself: what must
    /// wait (a caller that is not reading, a full outbound queue) comes back as a boxed
    /// future for the reader to await. The reader's task lives as long as the stream, and
    /// an `async` handler would make every idle stream's task as large as the handler's
    /// largest wait.
    fn on_frame(&self, frame: AgentFrame) -> Result<Option<Wait<'_>>, End> {
        use agent_frame::Kind;
        let protocol = |status| End::Protocol { status, call: None };
        let Some(kind) = frame.kind else {
            return Err(protocol(Status::invalid_argument(
                "agent frame without a kind",
            )));
        };
        match kind {
            Kind::Pong(_) => Ok(None),
            Kind::Credit(c) => {
                // Credit for a call that already left the stream is moot.
                self.handle
                    .call_credit(c.call_id, |credit| credit.give_back_request(c.bytes));
                Ok(None)
            }
            Kind::GoingAway(_) => {
                if self.handle.going_away() {
                    self.hub.retire(&self.handle);
                }
                Ok(None)
            }
            Kind::ResponseHead(head) => {
                let call_id = head.call_id;
                let end = head.end_of_stream;
                let mut trace_id = None;
                let to_caller = self
                    .handle
                    .route(call_id, |slot| {
                        if slot.head_seen {
                            return Err(Status::invalid_argument(format!(
                                "second response head for call {call_id}"
                            )));
                        }
                        slot.head_seen = true;
                        trace_id = Some(slot.trace_id);
                        Ok(())
                    })
                    .map_err(protocol)?;
                if relay_proto::check_inline_body(head.body.len(), end).is_err() {
                    return Err(protocol(Status::invalid_argument(
                        "a response head carries a body only when it ends the response, and at most 64 KiB",
                    )));
                }
                let limits = &self.hub.limits;
                if let Some(why) = relay_proto::check_head(
                    &head.headers,
                    limits.max_response_headers,
                    limits.max_response_header_bytes,
                ) {
                    return Err(self.refuse_response(call_id, trace_id, why));
                }
                let frame = ForwardResponse::of(forward_response::Kind::Head(head));
                if end {
                    self.handle.end_call(Outcome::Ok(frame));
                    Ok(None)
                } else {
                    Ok(self.to_caller(to_caller, frame, None))
                }
            }
            Kind::ResponseBody(chunk) => {
                let call_id = chunk.call_id;
                let end = chunk.end;
                let to_caller = self
                    .handle
                    .route(call_id, |slot| {
                        if !slot.head_seen {
                            return Err(Status::invalid_argument(format!(
                                "response body before head for call {call_id}"
                            )));
                        }
                        Ok(())
                    })
                    .map_err(protocol)?;
                if chunk.data.len() > relay_proto::MAX_CHUNK {
                    return Err(protocol(Status::invalid_argument(
                        "response body chunk larger than 64 KiB",
                    )));
                }
                let n = chunk.data.len() as u32;
                if !end && !self.response_credit_allows(call_id, n) {
                    return Err(protocol(Status::invalid_argument(format!(
                        "response body of call {call_id} beyond the server's credit"
                    ))));
                }
                let frame = ForwardResponse::of(forward_response::Kind::Body(chunk));
                if end {
                    self.handle.end_call(Outcome::Ok(frame));
                    Ok(None)
                } else {
                    Ok(self.to_caller(to_caller, frame, Some((call_id, n))))
                }
            }
            Kind::CallError(err) => {
                self.handle
                    .route(err.call_id, |_| Ok(()))
                    .map_err(protocol)?;
                self.handle.end_call(Outcome::of_call_error(err));
                Ok(None)
            }
        }
    }

    /// The agent's response head broke `max_response_headers` or
    /// `max_response_header_bytes` (RESOURCE_EXHAUSTED), or holds a header record that is
    /// not an encoded `Header` (INVALID_ARGUMENT): the stream closes with the returned end,
    /// and the call on it ends (in the reader's last word, like any call on a closing
    /// stream) with BAD_RESPONSE, the caller's 502. A peer that sends such heads takes no
    /// further call on that stream. The records themselves pass on to the dispatcher as
    /// they came, without being decoded and encoded again.
    fn refuse_response(
        &self,
        call_id: u64,
        trace_id: Option<relay_common::trace::TraceId>,
        problem: relay_proto::HeadProblem,
    ) -> End {
        let why = format!("the agent's response head has {problem}");
        warn!(tunnel_id = %self.handle.tunnel_id, stream_id = self.handle.id, call_id, trace_id = trace_id.map(tracing::field::display), reason = %why, "response head refused");
        let (status, caller_reads) = match problem {
            relay_proto::HeadProblem::OverLimit(_) => (
                Status::resource_exhausted(why.clone()),
                format!(
                    "{why} (the tunnel server's max_response_headers / max_response_header_bytes)"
                ),
            ),
            relay_proto::HeadProblem::Malformed(_) => (Status::invalid_argument(why.clone()), why),
        };
        End::Protocol {
            status,
            call: Some(Outcome::BadResponse(caller_reads)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use relay_proto::codec::RelayCodec;
    use tonic::codec::Codec;

    fn hub() -> Arc<Hub> {
        let metrics =
            crate::metrics::ServerMetrics::register(&prometheus::Registry::new()).unwrap();
        Arc::new(Hub::new(
            crate::hub::Limits {
                max_queue_per_tunnel: 8,
                max_streams_per_token: 8,
                max_response_headers: 16,
                max_response_header_bytes: 4096,
            },
            metrics,
        ))
    }

    fn inbound() -> Streaming<AgentFrame> {
        let mut codec = RelayCodec::<ServerFrame, AgentFrame>::default();
        Streaming::new_request(codec.decoder(), tonic::body::Body::empty(), None, None)
    }

    /// What an idle stream's reader task and response hold stays small (see docs/
    /// load-testing.md, `relay-fleet idle`, for the whole cost per stream). Sizes as a
    /// debug build lays them out (a release build's are the same or smaller). The bounds
    /// catch a change that makes every idle stream's task carry a handler's or a send's
    /// future again (the reader was 1,624 bytes when its frame handler was `async`), a
    /// frame or an end kept in scope across its waits, or its arguments twice (1,136
    /// bytes with both; 600 without).
    #[tokio::test]
    async fn an_idle_streams_reader_and_response_stay_small() {
        let (out, rx) = crate::outbox::outbox(OUT_BUFFER);
        let handle = Arc::new(StreamHandle::new(
            1,
            "t".into(),
            [0; 32],
            AgentFeatures::default(),
            out,
        ));
        let reader = Reader {
            hub: hub(),
            handle: handle.clone(),
            heartbeat: Duration::from_secs(10),
            misses: 3,
            conn: None,
        };
        let send = std::mem::size_of_val(&handle.send(ServerFrame::default()));
        assert!(send <= 64, "a send's future is {send} bytes");
        let run = std::mem::size_of_val(&reader.run(inbound(), None));
        assert!(run <= 640, "the reader's future is {run} bytes");
        let outbound = std::mem::size_of_val(&Outbound {
            frames: rx,
            end: Some(handle.end_status()),
        });
        assert!(outbound <= 32, "the response stream is {outbound} bytes");
        // Frames wait in the outbound queue boxed: a full queue of an idle stream is small.
        assert_eq!(std::mem::size_of::<OutFrame>(), 16);
    }
}
