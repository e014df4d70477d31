//! `Forward.Call`: the dispatcher hands this server one call. The handler takes the
//! newest idle stream of the tunnel id (or waits in its queue), puts the call on it, sends
//! the request head and pumps the request body to the agent. The stream's reader relays
//! the agent's answer straight into the response stream and ends the call.
//!
//! A caller that goes away (the dispatcher drops the RPC) becomes a `Cancel` to the agent;
//! the stream stays busy until the agent's terminal frame, so a stream is never reused
//! while the previous call still runs on it.
//!
//! The queue handshake (`CallHead.queue_handshake`): a call that has to wait in the queue
//! (for longer than `queue_handshake_after`, 0 by default) answers `Queued`. When a stream frees, the call reserves
//! it, answers `StreamReserved` and waits for the dispatcher's `Proceed` before the agent
//! sees anything. So if this server dies while calls wait in its queue, the dispatcher
//! knows those calls never reached an agent and retries them on another server, instead
//! of answering 502 for a call that might have run. The go-ahead is its own unary RPC,
//! `Forward.Proceed(reservation)`, not a frame on the call's request stream: that stream
//! keeps ending with the body (a bodiless call half-closes with its head), so calls that
//! never queue pay nothing. The cost for a queued call is two messages, one small RPC and a
//! dispatcher round trip during which the reserved stream idles: ~4% of throughput in
//! `bench/relay-bench.sh` at 64 connections, where a third of the calls wait a moment for
//! a stream. (A first version sent the go-ahead on the request stream, which then had to
//! stay open after every call's body: ~13%.) `queue_handshake_after` lets an operator
//! exempt short waits from it, leaving calls queued for less than that as unprotected on
//! a crash as calls in progress. Request body frames stay in the call's stream (h2 flow
//! control bounds them) until the head has gone to the agent.

use crate::hub::{AcquireError, Hub};
use crate::stream::CallSlot;
use dashmap::DashMap;
use relay_proto::{
    forward_request, forward_response, server_frame, BodyChunk, Cancel, ForwardErrorKind,
    ForwardRequest, ForwardResponse, ProceedReply, ProceedRequest, Queued, RequestHead,
    ServerFrame, StreamReserved,
};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::{CancellationToken, DropGuard};
use tonic::{Request, Response, Status, Streaming};
use tracing::debug;

/// How long a cancelled call may take to be acknowledged by the agent before its stream
/// is given up on.
const CANCEL_ACK: Duration = Duration::from_secs(10);

/// How long a reserved stream waits for the dispatcher's `Proceed` (or less: the call's
/// deadline) before it goes back to the pool.
const PROCEED_WAIT: Duration = Duration::from_secs(5);

pub struct ForwardService {
    pub hub: Arc<Hub>,
    /// `relay_tunnel_calls_received_total`: every `Forward.Call` that reached this handler.
    /// Each one ends with exactly one `relay_tunnel_calls_total{outcome}`, so once quiet
    /// the two agree (the per-hop accounting check).
    pub received: prometheus::IntCounter,
    pub queue_timeout: Duration,
    /// `queue_handshake_after`: how long a call waits before it asks for the handshake.
    pub handshake_after: Duration,
    /// Reserved streams waiting for their `Forward.Proceed`, by reservation.
    pub reservations: Arc<Reservations>,
    pub tracker: tokio_util::task::TaskTracker,
}

/// Calls holding a reserved stream, waiting for the dispatcher's go-ahead; shared by the
/// `Proceed` handler and every call as `Arc<Reservations>`.
pub struct Reservations {
    waiting: DashMap<u64, oneshot::Sender<()>>,
    next: AtomicU64,
}

impl Default for Reservations {
    /// Numbers start at a random point, so a reservation of an earlier process of this
    /// server (before a restart on the same address) does not name a new one.
    fn default() -> Self {
        Reservations {
            waiting: DashMap::new(),
            next: AtomicU64::new(rand::random::<u64>() >> 1),
        }
    }
}

impl Reservations {
    /// A new reservation, the receiver its `Proceed` fires, and the guard that removes it.
    fn open(self: &Arc<Self>) -> (u64, oneshot::Receiver<()>, Reservation) {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        self.waiting.insert(id, tx);
        (id, rx, Reservation(id, self.clone()))
    }
}

/// Removes its reservation when the wait ends, however it ends.
struct Reservation(u64, Arc<Reservations>);

impl Drop for Reservation {
    fn drop(&mut self) {
        self.1.waiting.remove(&self.0);
    }
}

#[tonic::async_trait]
impl relay_proto::forward_server::Forward for ForwardService {
    type CallStream = CallResponse;

    async fn proceed(
        &self,
        request: Request<ProceedRequest>,
    ) -> Result<Response<ProceedReply>, Status> {
        let id = request.into_inner().reservation;
        let sent = match self.reservations.waiting.remove(&id) {
            Some((_, go)) => go.send(()).is_ok(),
            None => false,
        };
        if !sent {
            return Err(Status::not_found(format!(
                "no stream is reserved as {id} (the call ended or was never queued here)"
            )));
        }
        Ok(Response::new(ProceedReply {}))
    }

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
        let gone = CancellationToken::new();
        let call = Call {
            hub: self.hub.clone(),
            tunnel_id: head.tunnel_id,
            handshake: head.queue_handshake,
            request,
            queue_timeout: self.queue_timeout,
            handshake_after: self.handshake_after,
            reservations: self.reservations.clone(),
            to_caller: tx,
            gone: gone.clone(),
        };
        self.tracker.spawn(call.run(inbound));
        Ok(Response::new(CallResponse {
            frames: ReceiverStream::new(rx),
            _gone: gone.drop_guard(),
        }))
    }
}

/// The response stream of one `Forward.Call`. tonic drops it when the RPC is over: after
/// the last frame and the trailers, or when the dispatcher reset the call. Dropping it
/// fires the call's `gone` token, which is how the call task hears that its caller left
/// without holding a sender of its own: the last sender is the one the stream's reader
/// uses, so the RPC ends (trailers) the moment the reader drops it after the last frame.
pub struct CallResponse {
    frames: ReceiverStream<Result<ForwardResponse, Status>>,
    _gone: DropGuard,
}

impl futures::Stream for CallResponse {
    type Item = Result<ForwardResponse, Status>;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        std::pin::Pin::new(&mut self.frames).poll_next(cx)
    }
}

/// Where a call stands in the queue handshake.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Handshake {
    /// The dispatcher asked for it; nothing said yet.
    Possible,
    /// The dispatcher heard `Queued`: the call must not reach an agent before `Proceed`.
    Queued,
    /// Not asked for, or `Proceed` came: the call goes to the agent when it has a stream.
    Clear,
}

struct Call {
    hub: Arc<Hub>,
    tunnel_id: String,
    /// The dispatcher speaks the queue handshake.
    handshake: bool,
    request: RequestHead,
    queue_timeout: Duration,
    handshake_after: Duration,
    reservations: Arc<Reservations>,
    /// Towards the dispatcher until the call is on a stream; then the stream's reader
    /// holds the only sender.
    to_caller: mpsc::Sender<Result<ForwardResponse, Status>>,
    /// Fires when the dispatcher is gone (or the RPC is over).
    gone: CancellationToken,
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
        let mut handshake = if self.handshake {
            Handshake::Possible
        } else {
            Handshake::Clear
        };
        let (stream, call_id, mut done) = loop {
            let acquire = hub.acquire(
                &self.tunnel_id,
                now + wait,
                self.gone.clone().cancelled_owned(),
            );
            tokio::pin!(acquire);
            // Fires only while `acquire` waits in the queue (it returns at once otherwise).
            let notice = tokio::time::sleep(self.handshake_after);
            tokio::pin!(notice);
            let acquired = loop {
                tokio::select! {
                    biased;
                    r = &mut acquire => break r,
                    _ = &mut notice, if handshake == Handshake::Possible => {
                        handshake = Handshake::Queued;
                        // Nothing was answered yet: the channel has room.
                        let notice = ForwardResponse::of(forward_response::Kind::Queued(Queued {}));
                        let _ = self.to_caller.try_send(Ok(notice));
                    }
                }
            };
            let stream = match acquired {
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
            if handshake == Handshake::Queued {
                let call_deadline = (self.request.deadline_ms > 0)
                    .then(|| now + Duration::from_millis(self.request.deadline_ms as u64));
                match self.await_proceed(call_deadline).await {
                    Ok(()) => handshake = Handshake::Clear,
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
        let Call {
            request: mut head,
            to_caller,
            gone,
            tunnel_id,
            ..
        } = self;
        // From here the slot's sender is the only one (see `CallResponse`).
        drop(to_caller);
        head.call_id = call_id;
        if head.deadline_ms > 0 {
            let left = Duration::from_millis(head.deadline_ms as u64).saturating_sub(now.elapsed());
            head.deadline_ms = left.as_millis().max(1) as u32;
        }
        let mut body_open = !head.end_of_stream;
        debug!(%tunnel_id, call_id, stream_id = stream.id, "call on stream");
        // If the stream died, its reader reports STREAM_LOST through the slot.
        let _ = stream
            .send(ServerFrame::of(server_frame::Kind::RequestHead(head)))
            .await;
        loop {
            tokio::select! {
                // Order: the call's end first, then the caller leaving, then more body.
                biased;
                _ = &mut done => return,
                _ = gone.cancelled() => {
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
    /// dispatcher's `Forward.Proceed`, at most `PROCEED_WAIT` and not past the call's
    /// deadline. On failure: the call's outcome label and the error to answer, if any (none
    /// when the dispatcher is gone). No agent has seen the call either way.
    async fn await_proceed(
        &self,
        call_deadline: Option<Instant>,
    ) -> Result<(), (&'static str, Option<(ForwardErrorKind, String)>)> {
        let (reservation, go, _guard) = self.reservations.open();
        let reserved = ForwardResponse::of(forward_response::Kind::Reserved(StreamReserved {
            reservation,
        }));
        if self.to_caller.send(Ok(reserved)).await.is_err() {
            return Err(("cancelled", None));
        }
        let mut until = Instant::now() + PROCEED_WAIT;
        if let Some(d) = call_deadline {
            until = until.min(d);
        }
        tokio::select! {
            biased;
            _ = self.gone.cancelled() => Err(("cancelled", None)),
            r = go => match r {
                Ok(()) => Ok(()),
                Err(_) => Err(("cancelled", None)),
            },
            _ = tokio::time::sleep_until(until) => Err((
                "bad_request",
                Some((
                    ForwardErrorKind::BadRequest,
                    "the dispatcher did not answer StreamReserved with Proceed in time".into(),
                )),
            )),
        }
    }
}
