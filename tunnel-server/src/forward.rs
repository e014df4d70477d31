//! `Forward.Call`: the dispatcher hands this server one call. The handler takes the
//! newest idle stream of the tunnel id (or waits in its queue), puts the call on it, sends
//! the request head and pumps the request body to the agent. The stream's reader relays
//! the agent's answer straight into the response stream and ends the call.
//!
//! A caller that goes away (the dispatcher drops the RPC) becomes a `Cancel` to the agent;
//! the stream stays busy until the agent's terminal frame, so a stream is never reused
//! while the previous call still runs on it.
//!
//! The queue handshake (`CallHead.queue_handshake`): a call that has to queue answers
//! `Queued` at once. When a stream frees, the call reserves it, answers `StreamReserved`
//! and waits for the dispatcher's `Proceed` before the agent sees anything. So if this
//! server dies while calls wait in its queue, the dispatcher knows those calls never
//! reached an agent and retries them on another server, instead of answering 502 for a
//! call that might have run. The cost is one dispatcher round trip, and only for calls
//! that queued anyway; a call that finds an idle stream goes straight to the agent.
//! Body chunks the dispatcher sent before it saw `Queued` are read and kept (at most
//! `RESERVED_BODY_LIMIT` bytes) while waiting for `Proceed`, then follow the head.

use crate::hub::{AcquireError, Hub};
use crate::stream::CallSlot;
use relay_proto::{
    forward_request, forward_response, server_frame, BodyChunk, Cancel, ForwardErrorKind,
    ForwardRequest, ForwardResponse, Queued, RequestHead, ServerFrame, StreamReserved,
};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};
use tracing::debug;

/// How long a cancelled call may take to be acknowledged by the agent before its stream
/// is given up on.
const CANCEL_ACK: Duration = Duration::from_secs(10);

/// How long a reserved stream waits for the dispatcher's `Proceed` (or less: the call's
/// deadline) before it goes back to the pool.
const PROCEED_WAIT: Duration = Duration::from_secs(5);

/// Request body bytes kept while a reserved stream waits for `Proceed`. A dispatcher that
/// speaks the handshake stops sending body once it sees `Queued`, so only what was in
/// flight arrives here; more is a protocol error.
const RESERVED_BODY_LIMIT: usize = 4 * 1024 * 1024;

pub struct ForwardService {
    pub hub: Arc<Hub>,
    /// `relay_tunnel_calls_received_total`: every `Forward.Call` that reached this handler.
    /// Each one ends with exactly one `relay_tunnel_calls_total{outcome}`, so once quiet
    /// the two agree (the per-hop accounting check).
    pub received: prometheus::IntCounter,
    pub queue_timeout: Duration,
    pub tracker: tokio_util::task::TaskTracker,
}

#[tonic::async_trait]
impl relay_proto::forward_server::Forward for ForwardService {
    type CallStream = ReceiverStream<Result<ForwardResponse, Status>>;

    async fn call(
        &self,
        request: Request<Streaming<ForwardRequest>>,
    ) -> Result<Response<Self::CallStream>, Status> {
        self.received.inc();
        let mut inbound = request.into_inner();
        let first = match inbound.message().await {
            Ok(m) => m,
            Err(status) => {
                // The dispatcher's stream broke before the head: still one outcome.
                self.hub.metrics.call("bad_request");
                return Err(status);
            }
        };
        let head = match first {
            Some(ForwardRequest {
                kind: Some(forward_request::Kind::Head(h)),
            }) => h,
            _ => {
                self.hub.metrics.call("bad_request");
                return Err(Status::invalid_argument(
                    "the first forward frame must be a call head",
                ));
            }
        };
        let Some(request) = head.request else {
            self.hub.metrics.call("bad_request");
            return Err(Status::invalid_argument("call head without a request head"));
        };
        let (tx, rx) = mpsc::channel(16);
        let call = Call {
            hub: self.hub.clone(),
            tunnel_id: head.tunnel_id,
            handshake: head.queue_handshake,
            request,
            queue_timeout: self.queue_timeout,
            to_caller: tx,
        };
        self.tracker.spawn(call.run(inbound));
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

struct Call {
    hub: Arc<Hub>,
    tunnel_id: String,
    /// The dispatcher speaks the queue handshake.
    handshake: bool,
    request: RequestHead,
    queue_timeout: Duration,
    to_caller: mpsc::Sender<Result<ForwardResponse, Status>>,
}

impl Call {
    async fn run(self, mut inbound: Streaming<ForwardRequest>) {
        let hub = &self.hub;
        let now = Instant::now();
        let mut wait = self.queue_timeout;
        if self.request.deadline_ms > 0 {
            // Give up queueing a little before the caller's deadline, so the caller hears
            // "no capacity" rather than a bare timeout.
            let deadline = Duration::from_millis(self.request.deadline_ms as u64);
            let margin =
                (deadline / 10).clamp(Duration::from_millis(5), Duration::from_millis(250));
            wait = wait.min(deadline.saturating_sub(margin));
        }
        // Whether the call joined the queue; until the dispatcher's Proceed it must not
        // reach an agent (the queue handshake).
        let queued = AtomicBool::new(false);
        let mut proceeded = !self.handshake;
        let mut early_body = Vec::new();
        let (stream, call_id, mut done) = loop {
            let gone = self.to_caller.clone();
            let on_queue = || {
                if !proceeded {
                    queued.store(true, Ordering::Relaxed);
                    // The channel is empty before the call's first answer: this fits.
                    let queued = ForwardResponse::of(forward_response::Kind::Queued(Queued {}));
                    let _ = self.to_caller.try_send(Ok(queued));
                }
            };
            let stream = match hub
                .acquire(
                    &self.tunnel_id,
                    now + wait,
                    async move { gone.closed().await },
                    on_queue,
                )
                .await
            {
                Ok(s) => s,
                Err(e) => {
                    let (kind, outcome, msg) = match e {
                        AcquireError::UnknownTunnel => (
                            ForwardErrorKind::UnknownTunnel,
                            "unknown_tunnel",
                            format!("no stream of tunnel id {} on this server", self.tunnel_id),
                        ),
                        AcquireError::NoCapacity(why) => {
                            (ForwardErrorKind::NoCapacity, "no_capacity", why.to_string())
                        }
                        AcquireError::Cancelled => {
                            hub.metrics.call("cancelled");
                            return;
                        }
                    };
                    hub.metrics.call(outcome);
                    let _ = self
                        .to_caller
                        .send(Ok(ForwardResponse::error(kind, msg)))
                        .await;
                    return;
                }
            };
            if !proceeded && queued.load(Ordering::Relaxed) {
                match self.await_proceed(&mut inbound, &mut early_body).await {
                    Ok(()) => proceeded = true,
                    Err((outcome, error)) => {
                        hub.release(stream);
                        hub.metrics.call(outcome);
                        if let Some((kind, msg)) = error {
                            let _ = self
                                .to_caller
                                .send(Ok(ForwardResponse::error(kind, msg)))
                                .await;
                        }
                        return;
                    }
                }
            }
            let call_id = hub.next_call_id();
            let (done_tx, done) = oneshot::channel();
            hub.metrics.in_flight.inc();
            let slot = CallSlot {
                call_id,
                to_caller: self.to_caller.clone(),
                done: Some(done_tx),
                head_seen: false,
                started: now,
            };
            match stream.begin_call(slot) {
                Ok(()) => break (stream, call_id, done),
                Err(_) => {
                    // The stream died between acquire and now; no agent saw the call:
                    // give the stream back (the hub closes it) and take another.
                    hub.metrics.in_flight.dec();
                    hub.release(stream);
                }
            }
        };
        let mut head = self.request;
        head.call_id = call_id;
        if head.deadline_ms > 0 {
            let left = Duration::from_millis(head.deadline_ms as u64).saturating_sub(now.elapsed());
            head.deadline_ms = left.as_millis().max(1) as u32;
        }
        let mut body_open = !head.end_of_stream;
        debug!(tunnel_id = %self.tunnel_id, call_id, stream_id = stream.id, "call on stream");
        // If the stream died, its reader reports STREAM_LOST through the slot.
        let _ = stream
            .send(ServerFrame::of(server_frame::Kind::RequestHead(head)))
            .await;
        for mut chunk in early_body {
            body_open = !chunk.end;
            chunk.call_id = call_id;
            let _ = stream
                .send(ServerFrame::of(server_frame::Kind::RequestBody(chunk)))
                .await;
        }
        loop {
            tokio::select! {
                // Order: the call's end first, then the caller leaving, then more body.
                biased;
                _ = &mut done => return,
                _ = self.to_caller.closed() => {
                    stream.try_send(ServerFrame::of(server_frame::Kind::Cancel(Cancel { call_id })));
                    break;
                }
                msg = inbound.message(), if body_open => match msg {
                    Ok(Some(ForwardRequest { kind: Some(forward_request::Kind::Body(mut chunk)) })) => {
                        if chunk.data.len() > relay_proto::MAX_CHUNK {
                            stream.try_send(ServerFrame::of(server_frame::Kind::Cancel(Cancel { call_id })));
                            break;
                        }
                        body_open = !chunk.end;
                        chunk.call_id = call_id;
                        let _ = stream.send(ServerFrame::of(server_frame::Kind::RequestBody(chunk))).await;
                    }
                    Ok(None) => {
                        // The dispatcher ended its half without an end flag: end the body.
                        body_open = false;
                        let end = BodyChunk { call_id, data: Default::default(), end: true };
                        let _ = stream.send(ServerFrame::of(server_frame::Kind::RequestBody(end))).await;
                    }
                    Ok(Some(_)) | Err(_) => {
                        // A malformed frame or a broken caller stream: cancel the call.
                        stream.try_send(ServerFrame::of(server_frame::Kind::Cancel(Cancel { call_id })));
                        break;
                    }
                },
            }
        }
        // Cancelled: the stream stays busy until the agent acknowledges.
        if tokio::time::timeout(CANCEL_ACK, done).await.is_err() {
            stream.close();
        }
    }

    /// The queued call holds a reserved stream: answer `StreamReserved` and wait for the
    /// dispatcher's `Proceed`, keeping the body chunks that arrive first in `early_body`.
    /// On failure: the call's outcome label and the error to answer, if any (none when the
    /// dispatcher is gone). No agent has seen the call either way.
    async fn await_proceed(
        &self,
        inbound: &mut Streaming<ForwardRequest>,
        early_body: &mut Vec<BodyChunk>,
    ) -> Result<(), (&'static str, Option<(ForwardErrorKind, String)>)> {
        let reserved = ForwardResponse::of(forward_response::Kind::Reserved(StreamReserved {}));
        if self.to_caller.send(Ok(reserved)).await.is_err() {
            return Err(("cancelled", None));
        }
        let mut wait = PROCEED_WAIT;
        if self.request.deadline_ms > 0 {
            wait = wait.min(Duration::from_millis(self.request.deadline_ms as u64));
        }
        let until = Instant::now() + wait;
        let bad = |msg: &str| {
            Err((
                "bad_request",
                Some((ForwardErrorKind::BadRequest, msg.to_string())),
            ))
        };
        let mut kept = 0usize;
        loop {
            let msg = tokio::select! {
                biased;
                _ = self.to_caller.closed() => return Err(("cancelled", None)),
                _ = tokio::time::sleep_until(until) => {
                    return bad("the dispatcher did not answer StreamReserved with Proceed in time");
                }
                msg = inbound.message() => msg,
            };
            match msg {
                Ok(Some(ForwardRequest {
                    kind: Some(forward_request::Kind::Proceed(_)),
                })) => return Ok(()),
                Ok(Some(ForwardRequest {
                    kind: Some(forward_request::Kind::Body(chunk)),
                })) => {
                    let open = early_body.last().is_none_or(|c: &BodyChunk| !c.end);
                    if self.request.end_of_stream || !open {
                        return bad("a body chunk after the end of the request body");
                    }
                    kept += chunk.data.len();
                    if chunk.data.len() > relay_proto::MAX_CHUNK || kept > RESERVED_BODY_LIMIT {
                        return bad("too much request body before Proceed");
                    }
                    early_body.push(chunk);
                }
                Ok(Some(_)) => return bad("expected Proceed or a body chunk"),
                Ok(None) | Err(_) => return Err(("cancelled", None)),
            }
        }
    }
}
