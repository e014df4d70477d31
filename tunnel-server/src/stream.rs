//! One agent stream on the server: its handle (shared with the hub), the `Tunnel.Connect`
//! handler that authenticates and registers it, and the reader loop that owns the stream's
//! life: it routes the agent's frames to the call on the stream, ends the call on its
//! terminal frame and puts the stream back, answers heartbeats, and handles `GoingAway`.
//!
//! The reader is the only place a call on a stream ends, so a call gets exactly one
//! outcome: the agent's terminal frame, or `STREAM_LOST` when the stream dies first.
//!
//! RTT: the reader times each heartbeat ping to its pong and feeds the hub's per tunnel id
//! EWMA ([`crate::hub::Rtt`]). Only pings sent and answered while the stream carries no
//! call count: a busy stream's pong can wait behind body chunks, which is queueing, not
//! network. A first ping goes out right after the hello so the figure is known within a
//! round trip of the stream opening rather than a heartbeat later.

use crate::hub::{AddError, Hub};
use futures::StreamExt;
use parking_lot::Mutex;
use relay_proto::{
    agent_frame, forward_response, server_frame, AgentFrame, CallErrorKind, ForwardError,
    ForwardErrorKind, ForwardResponse, Ping, ServerFrame, ServerHello,
};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};
use tokio::time::{Instant, MissedTickBehavior};
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::Stream;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status, Streaming};
use tracing::{debug, info, warn};

/// Frames buffered toward one agent stream (64 KiB chunks at most each).
const OUT_BUFFER: usize = 16;

pub type OutFrame = Result<ServerFrame, Status>;

pub struct StreamHandle {
    pub id: u64,
    pub tunnel_id: Arc<str>,
    /// SHA-256 of the token that opened the stream: a reloaded token store that no longer
    /// holds it closes the stream (see [`Hub::revoke`]).
    pub token_hash: [u8; 32],
    /// Status the RPC ends with once `close` fires (set by [`StreamHandle::revoke`]).
    end_status: Arc<Mutex<Option<Status>>>,
    out: mpsc::Sender<OutFrame>,
    /// The call on this stream, if any.
    call: Mutex<Option<CallSlot>>,
    /// The agent sent GoingAway (or the stream is closing): hand it no new call.
    retiring: AtomicBool,
    /// The reader has ended: a call put on the stream now would never end. Set and read
    /// only while holding `call`.
    ended: AtomicBool,
    close: CancellationToken,
    /// The agent asked for fleet news (`relay-agent-features: fleet`); older agents
    /// would take an unknown frame for a broken stream.
    pub wants_fleet: bool,
}

/// Request metadata in which an agent lists the optional server frames it understands.
pub const AGENT_FEATURES: &str = "relay-agent-features";

/// Where the agent's frames for the current call go.
pub struct CallSlot {
    pub call_id: u64,
    /// The dispatcher's response stream for this call.
    pub to_caller: mpsc::Sender<Result<ForwardResponse, Status>>,
    /// Fired when the call ends on this stream (terminal frame or stream lost).
    pub done: Option<oneshot::Sender<()>>,
    pub head_seen: bool,
    pub started: Instant,
}

impl StreamHandle {
    pub fn is_usable(&self) -> bool {
        !self.retiring.load(Ordering::SeqCst) && !self.close.is_cancelled() && !self.out.is_closed()
    }

    /// Ends the stream: the outbound half finishes with OK and the reader stops.
    pub fn close(&self) {
        self.retiring.store(true, Ordering::SeqCst);
        self.close.cancel();
    }

    /// Ends the stream because its token was removed from the store: the agent sees
    /// UNAUTHENTICATED "token revoked".
    pub fn revoke(&self) {
        *self.end_status.lock() = Some(Status::unauthenticated("token revoked"));
        self.close();
    }

    fn revoked(&self) -> bool {
        self.end_status.lock().is_some()
    }

    /// Queues a frame if there is room; control frames only.
    pub fn try_send(&self, frame: ServerFrame) -> bool {
        self.out.try_send(Ok(frame)).is_ok()
    }

    /// Sends a frame, waiting for room (flow control).
    pub async fn send(&self, frame: ServerFrame) -> Result<(), ()> {
        tokio::select! {
            r = self.out.send(Ok(frame)) => r.map_err(|_| ()),
            _ = self.close.cancelled() => Err(()),
        }
    }

    /// Puts a call on the stream. The stream must have come from `Hub::acquire`. Hands the
    /// slot back if the stream's reader ended meanwhile (the stream died between acquire
    /// and now): nobody would end the call, so the caller must take another stream.
    pub fn begin_call(&self, slot: CallSlot) -> Result<(), CallSlot> {
        let mut call = self.call.lock();
        if self.ended.load(Ordering::SeqCst) {
            return Err(slot);
        }
        *call = Some(slot);
        Ok(())
    }

    fn take_call(&self) -> Option<CallSlot> {
        self.call.lock().take()
    }

    /// The reader's last word: no call may begin from now on; returns the one in flight.
    fn end_and_take_call(&self) -> Option<CallSlot> {
        let mut call = self.call.lock();
        self.ended.store(true, Ordering::SeqCst);
        call.take()
    }
}

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
}

type ConnectStream = Pin<Box<dyn Stream<Item = OutFrame> + Send + 'static>>;

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
    type ConnectStream = ConnectStream;

    async fn connect(
        &self,
        request: Request<Streaming<AgentFrame>>,
    ) -> Result<Response<ConnectStream>, Status> {
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
        self.listener.authenticated(conn);
        let tunnel_id: Arc<str> = Arc::from(tunnel_id.as_str());
        let wants_fleet = request
            .metadata()
            .get(AGENT_FEATURES)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.split(',').any(|f| f.trim() == "fleet"));
        let (out, out_rx) = mpsc::channel(OUT_BUFFER);
        let handle = Arc::new(StreamHandle {
            id: self.hub.next_stream_id(),
            tunnel_id: tunnel_id.clone(),
            token_hash,
            end_status: Arc::default(),
            out,
            call: Mutex::new(None),
            retiring: AtomicBool::new(false),
            ended: AtomicBool::new(false),
            close: CancellationToken::new(),
            wants_fleet,
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
        };
        // The hello goes first, then the fleet; the stream takes calls once the agent
        // confirms it (see `Hub::confirm`).
        let _ = handle
            .out
            .try_send(Ok(ServerFrame::of(server_frame::Kind::Hello(hello))));
        if wants_fleet {
            if let Some(fleet) = self.hub.fleet_frame() {
                let _ = handle.out.try_send(Ok(fleet));
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
            self.hub.remove_stream(&handle, false);
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
            last_words: Mutex::new(None),
        };
        self.tracker.spawn(reader.run(request.into_inner()));
        // After a close, the RPC ends with the status a revocation left, if any.
        let end_status = handle.end_status.clone();
        let stream = ReceiverStream::new(out_rx)
            .take_until(handle.close.clone().cancelled_owned())
            .chain(
                futures::stream::once(async move { end_status.lock().clone() })
                    .filter_map(|s| std::future::ready(s.map(Err))),
            );
        Ok(Response::new(Box::pin(stream)))
    }
}

struct Reader {
    hub: Arc<Hub>,
    handle: Arc<StreamHandle>,
    heartbeat: Duration,
    misses: u32,
    /// How the call on the stream ends when the stream closes on a protocol error that
    /// named it (instead of STREAM_LOST), with its outcome label.
    last_words: Mutex<Option<(ForwardResponse, &'static str)>>,
}

/// Why a stream ended, for the log and the metric.
enum End {
    AgentClosed,
    Closed,
    Heartbeat,
    Protocol(Status),
}

impl Reader {
    async fn run(self, mut inbound: Streaming<AgentFrame>) {
        let mut ping = tokio::time::interval(self.heartbeat);
        ping.set_missed_tick_behavior(MissedTickBehavior::Skip);
        ping.tick().await;
        let mut last_seen = Instant::now();
        let mut seq = 0u64;
        // The ping whose pong would be an RTT sample: (seq, sent at).
        let mut timed: Option<(u64, Instant)> = None;
        self.send_ping(&mut seq, &mut timed);
        let silence = self.heartbeat * self.misses;
        let mut confirmed = false;
        let end = loop {
            tokio::select! {
                // Order: a close wins over more frames; frames win over the heartbeat.
                biased;
                _ = self.handle.close.cancelled() => break End::Closed,
                msg = inbound.message() => match msg {
                    Ok(Some(frame)) => {
                        last_seen = Instant::now();
                        if let Some(agent_frame::Kind::Pong(pong)) = &frame.kind {
                            self.on_pong(pong.seq, &mut timed, last_seen);
                        }
                        // The agent's first frame (the pong to the first ping) confirms
                        // it has the hello: only now may the stream take calls.
                        if !confirmed {
                            confirmed = true;
                            if matches!(frame.kind, Some(agent_frame::Kind::GoingAway(_))) {
                                // Retired before it took any call: nothing to wait for.
                                self.handle.close();
                            } else {
                                self.hub.confirm(self.handle.clone());
                            }
                        }
                        if let Err(status) = self.on_frame(frame).await {
                            break End::Protocol(status);
                        }
                    }
                    Ok(None) => break End::AgentClosed,
                    // A frame over max_frame_bytes: tell the agent why its stream ends.
                    Err(status) if status.code() == tonic::Code::OutOfRange => {
                        break End::Protocol(Status::resource_exhausted(format!(
                            "agent frame over max_frame_bytes: {}",
                            status.message()
                        )));
                    }
                    Err(status) => {
                        debug!(stream_id = self.handle.id, %status, "agent stream error");
                        break End::AgentClosed;
                    }
                },
                _ = ping.tick() => {
                    if last_seen.elapsed() > silence {
                        break End::Heartbeat;
                    }
                    self.send_ping(&mut seq, &mut timed);
                }
            }
        };
        let reason = match &end {
            End::AgentClosed => "agent_closed",
            End::Closed if self.handle.revoked() => "revoked",
            End::Closed => "retired",
            End::Heartbeat => "heartbeat",
            End::Protocol(_) => "protocol_error",
        };
        match &end {
            End::Protocol(status) => {
                warn!(tunnel_id = %self.handle.tunnel_id, stream_id = self.handle.id, %status, "closing agent stream on a protocol error");
                let _ = self.handle.out.try_send(Err(status.clone()));
            }
            End::Heartbeat => {
                info!(tunnel_id = %self.handle.tunnel_id, stream_id = self.handle.id, silence_ms = silence.as_millis() as u64, "dropping a silent agent stream");
            }
            _ => {}
        }
        self.hub.metrics.closes.with_label_values(&[reason]).inc();
        self.handle.retiring.store(true, Ordering::SeqCst);
        let slot = self.handle.end_and_take_call();
        let was_busy = slot.is_some();
        if let Some(slot) = slot {
            let msg = match &end {
                End::Heartbeat => "the agent stream carrying the call stopped answering heartbeats",
                End::Closed if self.handle.revoked() => {
                    "the agent stream carrying the call was closed: its token was revoked"
                }
                _ => "the agent stream carrying the call ended before the call did",
            };
            let (last, outcome) = self.last_words.lock().take().unwrap_or_else(|| {
                (
                    ForwardResponse::error(ForwardErrorKind::StreamLost, msg),
                    "stream_lost",
                )
            });
            self.finish(slot, Some(last), outcome).await;
        }
        self.hub.remove_stream(&self.handle, was_busy);
        // A protocol error ends the RPC through the error status queued above; cutting the
        // outbound half now could drop that status before the agent sees it.
        if !matches!(end, End::Protocol(_)) {
            self.handle.close.cancel();
        }
    }

    fn idle(&self) -> bool {
        self.handle.call.lock().is_none()
    }

    /// Sends the next heartbeat ping; times it when the stream is idle.
    fn send_ping(&self, seq: &mut u64, timed: &mut Option<(u64, Instant)>) {
        *seq += 1;
        let sent = self
            .handle
            .try_send(ServerFrame::of(server_frame::Kind::Ping(Ping {
                seq: *seq,
            })));
        *timed = (sent && self.idle()).then(|| (*seq, Instant::now()));
    }

    /// A pong arrived: one RTT sample if it answers the timed ping and no call came
    /// onto the stream meanwhile.
    fn on_pong(&self, seq: u64, timed: &mut Option<(u64, Instant)>, now: Instant) {
        match *timed {
            Some((s, sent)) if s == seq => {
                *timed = None;
                if self.idle() {
                    self.hub
                        .observe_rtt(&self.handle.tunnel_id, now.saturating_duration_since(sent));
                }
            }
            _ => {}
        }
    }

    async fn on_frame(&self, frame: AgentFrame) -> Result<(), Status> {
        use agent_frame::Kind;
        let Some(kind) = frame.kind else {
            return Err(Status::invalid_argument("agent frame without a kind"));
        };
        match kind {
            Kind::Pong(_) => Ok(()),
            Kind::GoingAway(_) => {
                self.handle.retiring.store(true, Ordering::SeqCst);
                if self.handle.call.lock().is_none() {
                    self.hub.retire(&self.handle);
                }
                Ok(())
            }
            Kind::ResponseHead(head) => {
                let call_id = head.call_id;
                let end = head.end_of_stream;
                let to_caller = self.expect_call(call_id, |slot| {
                    if slot.head_seen {
                        return Err(Status::invalid_argument(format!(
                            "second response head for call {call_id}"
                        )));
                    }
                    slot.head_seen = true;
                    Ok(())
                })?;
                if head.body.len() > relay_proto::MAX_CHUNK || (!end && !head.body.is_empty()) {
                    return Err(Status::invalid_argument(
                        "a response head carries a body only when it ends the response, and at most 64 KiB",
                    ));
                }
                let limits = &self.hub.limits;
                if let Some(why) = relay_proto::check_head(
                    &head.headers,
                    limits.max_response_headers,
                    limits.max_response_header_bytes,
                ) {
                    return Err(self.refuse_response(call_id, why).await);
                }
                let frame = ForwardResponse::of(forward_response::Kind::Head(head));
                if end {
                    self.end_call(frame, "ok").await;
                } else {
                    let _ = to_caller.send(Ok(frame)).await;
                }
                Ok(())
            }
            Kind::ResponseBody(chunk) => {
                let call_id = chunk.call_id;
                let end = chunk.end;
                let to_caller = self.expect_call(call_id, |slot| {
                    if !slot.head_seen {
                        return Err(Status::invalid_argument(format!(
                            "response body before head for call {call_id}"
                        )));
                    }
                    Ok(())
                })?;
                if chunk.data.len() > relay_proto::MAX_CHUNK {
                    return Err(Status::invalid_argument(
                        "response body chunk larger than 64 KiB",
                    ));
                }
                let frame = ForwardResponse::of(forward_response::Kind::Body(chunk));
                if end {
                    self.end_call(frame, "ok").await;
                } else {
                    let _ = to_caller.send(Ok(frame)).await;
                }
                Ok(())
            }
            Kind::CallError(err) => {
                self.expect_call(err.call_id, |_| Ok(()))?;
                let outcome = if err.kind == CallErrorKind::Cancelled as i32 {
                    "cancelled"
                } else {
                    "agent_error"
                };
                // The agent's words go into the dispatcher's logs and the caller's JSON:
                // escaped and cut here, once.
                let frame = ForwardResponse::of(forward_response::Kind::Error(ForwardError {
                    kind: ForwardErrorKind::Agent as i32,
                    message: relay_proto::escape_message(
                        &err.message,
                        relay_proto::MAX_PEER_MESSAGE,
                    ),
                    call_error: err.kind,
                }));
                self.end_call(frame, outcome).await;
                Ok(())
            }
        }
    }

    /// The agent's response head broke `max_response_headers` or
    /// `max_response_header_bytes`: the returned status closes the agent's stream, and the
    /// call on it ends (in the reader's last word, like any call on a closing stream) with
    /// BAD_RESPONSE, the caller's 502. A peer that sends such heads takes no further call
    /// on that stream.
    async fn refuse_response(&self, call_id: u64, why: String) -> Status {
        let why = format!("the agent's response head has {why}");
        warn!(tunnel_id = %self.handle.tunnel_id, stream_id = self.handle.id, call_id, reason = %why, "response head refused");
        let error = ForwardResponse::error(
            ForwardErrorKind::BadResponse,
            format!("{why} (the tunnel server's max_response_headers / max_response_header_bytes)"),
        );
        *self.last_words.lock() = Some((error, "bad_response"));
        Status::resource_exhausted(why)
    }

    /// The sender toward the caller of the call on this stream, after checking the frame
    /// belongs to it.
    fn expect_call(
        &self,
        call_id: u64,
        check: impl FnOnce(&mut CallSlot) -> Result<(), Status>,
    ) -> Result<mpsc::Sender<Result<ForwardResponse, Status>>, Status> {
        let mut guard = self.handle.call.lock();
        match guard.as_mut() {
            Some(slot) if slot.call_id == call_id => {
                check(slot)?;
                Ok(slot.to_caller.clone())
            }
            Some(slot) => Err(Status::invalid_argument(format!(
                "frame for call {call_id} while call {} is on this stream",
                slot.call_id
            ))),
            None => Err(Status::invalid_argument(format!(
                "frame for call {call_id} with no call on this stream"
            ))),
        }
    }

    /// The call on this stream ended with `last`: tell its task, pass the frame on and
    /// put the stream back.
    async fn end_call(&self, last: ForwardResponse, outcome: &'static str) {
        if let Some(slot) = self.handle.take_call() {
            self.finish(slot, Some(last), outcome).await;
        }
        self.hub.release(self.handle.clone());
    }

    async fn finish(
        &self,
        mut slot: CallSlot,
        last: Option<ForwardResponse>,
        outcome: &'static str,
    ) {
        // The call task hears of the end before the caller can, so a caller that leaves
        // right after the last frame is not taken for a cancel.
        if let Some(done) = slot.done.take() {
            let _ = done.send(());
        }
        if let Some(frame) = last {
            let _ = slot.to_caller.send(Ok(frame)).await;
        }
        self.hub.metrics.call(outcome);
        self.hub.metrics.in_flight.dec();
        debug!(
            call_id = slot.call_id,
            outcome,
            elapsed_ms = slot.started.elapsed().as_millis() as u64,
            "call ended"
        );
    }
}
