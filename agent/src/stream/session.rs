//! A landed stream serving calls (`Session`): frames in and out, the call in flight and its
//! future, request-body credit and buffering, heartbeat silence and the retire linger.

use super::*;
use relay_common::outbox::TrySendError;

/// How long a stream whose outbound half broke waits for its inbound half to say why.
const LOST_REASON_WAIT: Duration = Duration::from_millis(200);

/// The call in flight on a stream.
pub(super) struct ActiveCall {
    id: u64,
    /// The trace the head named, for the stream's log lines about the call.
    trace_id: Option<relay_common::trace::TraceId>,
    /// Feeds the upstream request body; `None` once the body ended or is no longer read.
    body: Option<mpsc::Sender<Bytes>>,
    started: Instant,
    /// The response-body credit the server gave the call (with body credit).
    credit: Option<Arc<tokio::sync::Semaphore>>,
}

/// What a stream's hello agreed: the server's heartbeat (zero: none announced), the
/// stream's place on its path when the server proves paths alive, and body credit.
pub(super) struct Terms {
    pub(super) heartbeat: Duration,
    pub(super) path: Option<crate::liveness::PathSlot>,
    pub(super) credit: Option<Credit>,
}

/// Body credit both ways on a stream that uses it (`ServerHello.response_credit`).
#[derive(Clone, Copy, Debug)]
pub(super) struct Credit {
    /// Response-body bytes a call may send beyond what the server gave back.
    pub(super) response: u32,
    /// Request-body bytes the server may send a call beyond what this agent gave back.
    pub(super) request: u32,
}

/// How a stream starts a call (`run_call`; named here so the session can keep the call's
/// future in a slot of its own type).
pub(super) type StartCall<F> = fn(
    Arc<CallContext>,
    RequestHead,
    RequestBody,
    Option<std::net::IpAddr>,
    crate::call::CallOut,
) -> F;

/// The future of the call in flight, in one allocation the stream keeps from its first call
/// to its end. A call's future is about 2.6 KiB: boxing each one was an allocation past
/// glibc's per-thread cache (with a consolidation of its free lists) and a free per call.
pub(super) struct CallFutureBox<F>(Option<Pin<Box<Option<F>>>>);

impl<F: Future<Output = CallOutcome>> CallFutureBox<F> {
    pub(super) fn is_none(&self) -> bool {
        self.0.as_ref().is_none_or(|f| f.is_none())
    }

    pub(super) fn start(&mut self, call: F) {
        match &mut self.0 {
            Some(slot) => slot.set(Some(call)),
            None => self.0 = Some(Box::pin(Some(call))),
        }
    }

    /// Drops the call's future (and with it the upstream request); the slot stays.
    pub(super) fn clear(&mut self) {
        if let Some(slot) = &mut self.0 {
            slot.set(None);
        }
    }

    /// The call's outcome; pends forever while no call is in flight.
    pub(super) async fn outcome(&mut self) -> CallOutcome {
        match self.0.as_mut().and_then(|slot| slot.as_mut().as_pin_mut()) {
            Some(call) => call.await,
            None => std::future::pending().await,
        }
    }
}

/// A landed stream serving calls.
pub(super) struct Session<F> {
    ctx: Arc<StreamContext>,
    out: FrameTx,
    inbound: Streaming<ServerFrame>,
    /// Silence after which an idle stream counts as dead (`None`: no heartbeat announced).
    silence: Option<Duration>,
    /// The stream's place on its path, when the server proves paths alive.
    path: Option<crate::liveness::PathSlot>,
    dead: Pin<Box<Sleep>>,
    linger: Pin<Box<Sleep>>,
    call: Option<ActiveCall>,
    start_call: StartCall<F>,
    call_fut: CallFutureBox<F>,
    /// The remote address of this stream's connection, handed to its calls.
    tunnel_peer: Option<std::net::IpAddr>,
    /// Request body chunks (and their end flags) waiting for room in the body channel.
    /// Without body credit at most one waits, and while it does no further frame is read:
    /// the server is pushed back by flow control. With body credit every frame is read (a
    /// server's credit frame must never wait behind a body the upstream reads slowly), and
    /// the server sends no more than the credit this agent gave back.
    pending: std::collections::VecDeque<(Bytes, bool)>,
    /// Body credit on this stream, if the server offered it.
    credit: Option<Credit>,
    /// Request-body bytes of the call in flight received and not yet given back.
    request_unacked: u32,
    /// Of those, bytes handed to the upstream and not yet given back.
    request_passed: u32,
    last_ended: Option<u64>,
    retire_seen: bool,
    going_away_sent: bool,
    draining: bool,
    events: mpsc::UnboundedSender<(crate::coverage::plan::StreamId, StreamEvent)>,
}

impl<F: Future<Output = CallOutcome>> Session<F> {
    pub(super) fn new(
        ctx: Arc<StreamContext>,
        link: &StreamLink,
        out: FrameTx,
        inbound: Streaming<ServerFrame>,
        terms: Terms,
        start_call: StartCall<F>,
    ) -> Self {
        let Terms {
            heartbeat,
            path,
            credit,
        } = terms;
        let silence = (!heartbeat.is_zero()).then(|| heartbeat.saturating_mul(3));
        let far = Instant::now() + Duration::from_secs(86_400 * 365);
        let dead_at = silence.map_or(far, |s| Instant::now() + s);
        Session {
            ctx,
            out,
            inbound,
            silence,
            path,
            dead: Box::pin(tokio::time::sleep_until(dead_at)),
            linger: Box::pin(tokio::time::sleep_until(far)),
            call: None,
            start_call,
            call_fut: CallFutureBox(None),
            tunnel_peer: None,
            pending: Default::default(),
            credit,
            request_unacked: 0,
            request_passed: 0,
            last_ended: None,
            retire_seen: false,
            going_away_sent: false,
            draining: false,
            events: link.events_sender(),
        }
    }

    pub(super) fn with_tunnel_peer(mut self, peer: Option<std::net::IpAddr>) -> Self {
        self.tunnel_peer = peer;
        self
    }

    pub(super) fn emit(&self, id: crate::coverage::plan::StreamId, ev: StreamEvent) {
        let _ = self.events.send((id, ev));
    }

    /// Serves the stream until it ends, and says why.
    ///
    /// The task lives as long as the stream, so what its future keeps across its waits is
    /// what a stream costs the agent. Each event is handled by a plain function that
    /// returns the one frame it answers with, if any, in a block that ends before that
    /// frame's send: the event and its handler's state are not kept beside the send, nor a
    /// handler's own sends beside each other. And this is an `async` block over the
    /// session, not an `async fn` that keeps its arguments twice (the future was 2,496
    /// bytes with the handlers `async` and the session kept twice, 920 without).
    // Not an `async fn`: see above.
    #[allow(clippy::manual_async_fn)]
    pub(super) fn run<'a>(
        mut self,
        link: &'a mut StreamLink,
    ) -> impl Future<Output = CloseReason> + Send + 'a
    where
        F: Send + 'a,
    {
        async move {
            let id = link.id;
            // Made once, not per frame (a wait made anew registers a waiter for every
            // frame).
            let silenced = self
                .path
                .as_ref()
                .map(|slot| slot.path().token())
                .unwrap_or_default()
                .cancelled_owned();
            tokio::pin!(silenced);
            let reason = loop {
                let idle = self.call_fut.is_none();
                if let Some(slot) = self.path.as_mut() {
                    slot.set_idle(idle);
                }
                let reply = {
                    let step = tokio::select! {
                        // The call finishing comes first: its terminal frame is queued and
                        // the stream is free again. Then the actor's retire signal, then
                        // request body room, then the server's frames, then the timers.
                        biased;
                        outcome = self.call_fut.outcome() => self.call_done(id, outcome).map(|()| None),
                        _ = &mut link.retire, if !self.retire_seen => {
                            self.retire_seen = true;
                            Ok(self.going_away())
                        }
                        delivered = feed_body(self.call.as_ref(), &mut self.pending) => {
                            Ok(self.body_room(delivered))
                        }
                        frame = self.inbound.message(), if self.credit.is_some() || self.pending.is_empty() => self.on_frame(id, frame),
                        // The path to the server went silent (`crate::liveness`): every
                        // stream on it ends, like the streams of a broken connection.
                        _ = &mut silenced => Err(CloseReason::Silent),
                        _ = &mut self.dead, if idle && self.silence.is_some() => Err(CloseReason::HeartbeatMissed),
                        _ = &mut self.linger, if idle && self.going_away_sent => Err(CloseReason::Retired),
                    };
                    match step {
                        Ok(reply) => reply,
                        Err(reason) => break reason,
                    }
                };
                if let Some(frame) = reply {
                    if let Err(reason) = self.send(frame).await {
                        break reason;
                    }
                }
            };
            let reason = match reason {
                CloseReason::Lost => self.why_lost().await,
                other => other,
            };
            if let Some(call) = self.call.take() {
                self.call_fut.clear();
                self.ctx.metrics.call_ended(
                    CallOutcome::StreamLost,
                    call.started.elapsed().as_secs_f64(),
                );
                self.emit(id, StreamEvent::CallEnded(None));
            }
            reason
        }
    }

    /// The outbound half broke. The inbound half says why when it ends within a moment:
    /// the server closed the stream (cleanly, or with a status), which is no news about
    /// the path; only a stream whose inbound half says nothing lost its connection. (Every
    /// stream that a server ended while the agent was sending, a pong or a `GoingAway`,
    /// was counted as a lost path before, and its server reconnected to as lost.)
    async fn why_lost(&mut self) -> CloseReason {
        let inbound = &mut self.inbound;
        let read = async move {
            loop {
                match inbound.message().await {
                    // Frames the server sent before its end go with the stream.
                    Ok(Some(_)) => continue,
                    Ok(None) => return CloseReason::ServerClosed,
                    Err(s) => {
                        return CloseReason::Status(format!(
                            "{:?}: {}",
                            s.code(),
                            server_text(s.message())
                        ))
                    }
                }
            }
        };
        tokio::time::timeout(LOST_REASON_WAIT, read)
            .await
            .unwrap_or(CloseReason::Lost)
    }

    /// Queues a frame for the server; waits for room only when the queue is full, in a
    /// box made then (the wait holds the frame: kept in the task, it would size every
    /// stream's task for its whole life).
    async fn send(&mut self, frame: AgentFrame) -> Result<(), CloseReason> {
        match self.out.try_send(frame) {
            Ok(()) => Ok(()),
            Err(TrySendError::Full(frame)) => Box::pin(self.out.send(frame))
                .await
                .map_err(|_| CloseReason::Lost),
            Err(TrySendError::Closed(_)) => Err(CloseReason::Lost),
        }
    }

    /// GoingAway, once (the frame to send); the server closes the stream when no call is
    /// in flight.
    fn going_away(&mut self) -> Option<AgentFrame> {
        if self.going_away_sent {
            return None;
        }
        self.going_away_sent = true;
        if self.call_fut.is_none() {
            self.linger.as_mut().reset(Instant::now() + RETIRE_LINGER);
        }
        Some(AgentFrame::of(Out::GoingAway(GoingAway {})))
    }

    fn call_done(&mut self, id: u64, outcome: CallOutcome) -> Result<(), CloseReason> {
        self.call_fut.clear();
        self.clear_body();
        let mut took = None;
        if let Some(call) = self.call.take() {
            let elapsed = call.started.elapsed();
            self.ctx.metrics.call_ended(outcome, elapsed.as_secs_f64());
            self.last_ended = Some(call.id);
            took = (outcome == CallOutcome::Ok).then_some(elapsed);
        }
        self.emit(id, StreamEvent::CallEnded(took));
        if outcome == CallOutcome::StreamLost {
            return Err(CloseReason::Lost);
        }
        self.idle_again();
        Ok(())
    }

    fn idle_again(&mut self) {
        let now = Instant::now();
        if let Some(s) = self.silence {
            self.dead.as_mut().reset(now + s);
        }
        if self.going_away_sent {
            self.linger.as_mut().reset(now + RETIRE_LINGER);
        }
    }

    /// The oldest pending chunk (`Some((len, end))`) went to the upstream, or the upstream
    /// stopped reading the body (`None`: it answered already, or failed). The credit frame
    /// to send, if a step's worth passed.
    fn body_room(&mut self, delivered: Option<(usize, bool)>) -> Option<AgentFrame> {
        match delivered {
            Some((len, end)) => {
                if end {
                    if let Some(call) = self.call.as_mut() {
                        call.body = None;
                    }
                }
                self.passed_upstream(len)
            }
            None => {
                if let Some(call) = self.call.as_mut() {
                    call.body = None;
                }
                self.pending.clear();
                None
            }
        }
    }

    /// Forgets the request body of the call that ended.
    fn clear_body(&mut self) {
        self.pending.clear();
        self.request_unacked = 0;
        self.request_passed = 0;
    }

    /// With body credit: `len` request-body bytes went to the upstream; once a step's worth
    /// did, they are given back to the server (the credit frame to send).
    fn passed_upstream(&mut self, len: usize) -> Option<AgentFrame> {
        self.credit?;
        let call_id = self.call.as_ref().map(|c| c.id)?;
        self.request_passed = self.request_passed.saturating_add(len as u32);
        if (self.request_passed as usize) < relay_proto::CREDIT_STEP {
            return None;
        }
        let bytes = std::mem::take(&mut self.request_passed);
        self.request_unacked = self.request_unacked.saturating_sub(bytes);
        Some(AgentFrame::of(Out::Credit(relay_proto::Credit {
            call_id,
            bytes,
        })))
    }

    /// One frame from the server, or the end of its half; the frame to answer with, if
    /// any (a pong, a credit grant, a cancelled call's error).
    fn on_frame(
        &mut self,
        id: u64,
        frame: Result<Option<ServerFrame>, tonic::Status>,
    ) -> Result<Option<AgentFrame>, CloseReason> {
        let frame = match frame {
            Ok(Some(f)) => f,
            Ok(None) => return Err(CloseReason::ServerClosed),
            Err(s) => {
                return Err(CloseReason::Status(format!(
                    "{:?}: {}",
                    s.code(),
                    server_text(s.message())
                )))
            }
        };
        if let Some(slot) = &self.path {
            slot.path().seen();
        }
        if let Some(s) = self.silence {
            self.dead.as_mut().reset(Instant::now() + s);
        }
        let Some(kind) = frame.kind else {
            // A frame kind this agent does not know (a newer server): skip it. Frames that
            // matter to a call are all known kinds, so nothing of a call is lost.
            debug!("skipping a server frame of an unknown kind");
            return Ok(None);
        };
        match kind {
            In::Hello(_) => return Err(CloseReason::Malformed("second ServerHello".into())),
            In::RequestHead(head) => {
                if let Some(call) = &self.call {
                    return Err(CloseReason::Malformed(format!(
                        "RequestHead for call {} while call {} is in flight",
                        head.call_id, call.id
                    )));
                }
                if let Err(problem) =
                    relay_proto::check_inline_body(head.body.len(), head.end_of_stream)
                {
                    return Err(CloseReason::Malformed(format!(
                        "RequestHead for call {}: {problem}",
                        head.call_id
                    )));
                }
                // A head that crossed our GoingAway on the wire is still served.
                let (body_tx, body) = if !head.body.is_empty() {
                    // The head keeps it too: the accept filter checks it against the head.
                    (None, RequestBody::Whole(head.body.clone()))
                } else if head.end_of_stream {
                    (None, RequestBody::None)
                } else {
                    let (tx, rx) = mpsc::channel(BODY_CHUNKS);
                    (Some(tx), RequestBody::Streamed(rx))
                };
                self.ctx.metrics.calls_received.inc();
                let credit = self
                    .credit
                    .map(|c| Arc::new(tokio::sync::Semaphore::new(c.response as usize)));
                self.clear_body();
                // A body inside the head counts against the request credit like any other,
                // and goes to the upstream with the head.
                self.request_unacked = head.body.len() as u32;
                self.call = Some(ActiveCall {
                    id: head.call_id,
                    trace_id: head.trace.and_then(|t| {
                        relay_common::trace::TraceContext::from_head(
                            t.trace_id_high,
                            t.trace_id_low,
                            t.parent_id,
                            t.flags,
                        )
                        .map(|cx| cx.trace_id)
                    }),
                    body: body_tx,
                    started: Instant::now(),
                    credit: credit.clone(),
                });
                self.emit(id, StreamEvent::CallStarted);
                let call_out = crate::call::CallOut {
                    tx: self.out.clone(),
                    credit,
                };
                self.call_fut.start((self.start_call)(
                    self.ctx.calls.clone(),
                    head,
                    body,
                    self.tunnel_peer,
                    call_out,
                ));
            }
            In::RequestBody(chunk) if chunk.data.len() > relay_proto::MAX_CHUNK => {
                return Err(CloseReason::Malformed(format!(
                    "request body chunk of {} bytes, over {}",
                    chunk.data.len(),
                    relay_proto::MAX_CHUNK
                )))
            }
            In::RequestBody(chunk) => match self.call.as_mut() {
                Some(call) if call.id == chunk.call_id => {
                    let Some(tx) = &call.body else {
                        return Ok(None);
                    };
                    let data = chunk.data;
                    let len = data.len();
                    if let Some(c) = self.credit {
                        // The server sends no more than the credit it was given back.
                        let after = self.request_unacked.saturating_add(len as u32);
                        if !chunk.end && after > c.request {
                            return Err(CloseReason::Malformed(format!(
                                "request body of call {} beyond the agent's credit ({} bytes)",
                                chunk.call_id, c.request
                            )));
                        }
                        self.request_unacked = after;
                    }
                    if !self.pending.is_empty() {
                        // Behind the chunks already waiting, in order.
                        self.pending.push_back((data, chunk.end));
                        return Ok(None);
                    }
                    if !data.is_empty() {
                        match tx.try_send(data) {
                            Ok(()) => {}
                            Err(mpsc::error::TrySendError::Full(data)) => {
                                self.pending.push_back((data, chunk.end));
                                return Ok(None);
                            }
                            Err(mpsc::error::TrySendError::Closed(_)) => {
                                call.body = None;
                                return Ok(None);
                            }
                        }
                    }
                    if chunk.end {
                        call.body = None;
                    }
                    return Ok(self.passed_upstream(len));
                }
                // The call ended before its body did (the upstream answered early): drop.
                _ if self.last_ended == Some(chunk.call_id) => {}
                _ => {
                    return Err(CloseReason::Malformed(format!(
                        "request body for call {}, which is not the call in flight",
                        chunk.call_id
                    )))
                }
            },
            In::Credit(c) => {
                if let (Some(call), Some(limit)) = (&self.call, self.credit.map(|c| c.response)) {
                    if let (true, Some(sem)) = (call.id == c.call_id, &call.credit) {
                        // More than the server could owe is capped.
                        let room = (limit as usize).saturating_sub(sem.available_permits());
                        let add = (c.bytes as usize).min(room);
                        if add > 0 {
                            sem.add_permits(add);
                        }
                    }
                }
            }
            In::Cancel(cancel) => {
                if self.call.as_ref().is_some_and(|c| c.id == cancel.call_id) {
                    // Dropping the call future drops the upstream request.
                    self.call_fut.clear();
                    self.clear_body();
                    let mut trace_id = None;
                    if let Some(call) = self.call.take() {
                        self.ctx.metrics.call_ended(
                            CallOutcome::Cancelled,
                            call.started.elapsed().as_secs_f64(),
                        );
                        self.last_ended = Some(call.id);
                        trace_id = call.trace_id;
                    }
                    debug!(
                        call_id = cancel.call_id,
                        trace_id = trace_id.map(tracing::field::display),
                        "call cancelled by the server"
                    );
                    self.emit(id, StreamEvent::CallEnded(None));
                    self.idle_again();
                    return Ok(Some(call_error(
                        cancel.call_id,
                        CallErrorKind::Cancelled,
                        "cancelled by the caller",
                    )));
                }
            }
            In::Ping(ping) => return Ok(Some(AgentFrame::of(Out::Pong(Pong { seq: ping.seq })))),
            In::Drain(_) => {
                // The sizing actor decides when this stream goes (make before break:
                // once another server is covered); until then it keeps serving.
                if !self.draining {
                    self.draining = true;
                    self.emit(id, StreamEvent::Drained);
                }
            }
            In::Pressure(p) => self.emit(id, StreamEvent::Pressure(p.queued)),
            In::Fleet(fleet) => {
                // Members reach plans and log lines by their names: only printable ones.
                let members = fleet
                    .members
                    .into_iter()
                    .filter(|m| {
                        relay_common::server_id::is_valid(&m.server_id)
                            && (m.instance_id.is_empty()
                                || relay_common::server_id::is_valid(&m.instance_id))
                    })
                    .collect();
                self.emit(id, StreamEvent::Fleet(members))
            }
        }
        Ok(None)
    }
}

/// Waits for room in the body channel and hands it the oldest pending chunk: `Some((len,
/// end))` once delivered, `None` if the upstream stopped reading. Pends forever when nothing
/// waits. The chunk is taken only together with the room, so losing the race to another
/// branch of the stream's `select!` loses no data.
async fn feed_body(
    call: Option<&ActiveCall>,
    pending: &mut std::collections::VecDeque<(Bytes, bool)>,
) -> Option<(usize, bool)> {
    if pending.is_empty() {
        return std::future::pending().await;
    }
    let tx = call.and_then(|c| c.body.as_ref())?;
    let permit = tx.reserve().await.ok()?;
    let (data, end) = pending.pop_front()?;
    let len = data.len();
    if !data.is_empty() {
        permit.send(data);
    }
    Some((len, end))
}
