//! One `Forward.Call`, from the hand-off by the handler (`crate::forward`) to its outcome,
//! owned by one task ([`Call::run`]): it takes the newest idle stream of the tunnel id (or
//! waits in its queue, with the queue handshake), puts the call on the stream, sends the
//! request head and pumps the request body to the agent, turns a caller leaving into a
//! `Cancel`, and ends with exactly one [`Outcome`]: counted, logged and answered here and
//! nowhere else. The stream's reader routes the agent's response frames to the caller and
//! hands this task the outcome when the agent ends the call or the stream dies.
//!
//! The call holds its stream as a [`Lease`] from the hub: the stream goes back (to the next
//! waiting call or the idle stack) when the task lets go of it. A caller that goes away
//! (the dispatcher drops the RPC) becomes a `Cancel` to the agent; the lease is kept until
//! the agent's terminal frame, so a stream is never reused while the previous call still
//! runs on it. The in-flight gauge is held by the task while its call is on a stream
//! ([`InFlight`]).
//!
//! The queue handshake (`CallHead.queue_handshake`): a call that has to wait in the queue
//! (for longer than `queue_handshake_after`, 0 by default) answers `Queued`. When a stream
//! frees, the call reserves it, answers `StreamReserved` and waits for the dispatcher's
//! `Proceed` before the agent sees anything. So if this server dies while calls wait in its
//! queue, the dispatcher knows those calls never reached an agent and retries them on
//! another server, instead of answering 502 for a call that might have run. The go-ahead is
//! its own unary RPC, `Forward.Proceed(reservation)`, not a frame on the call's request
//! stream: that stream keeps ending with the body (a bodiless call half-closes with its
//! head), so calls that never queue pay nothing. The cost for a queued call is two
//! messages, one small RPC and a dispatcher round trip during which the reserved stream
//! idles: ~4% of throughput in `bench/relay-bench.sh` at 64 connections, where a third of
//! the calls wait a moment for a stream. (A first version sent the go-ahead on the request
//! stream, which then had to stay open after every call's body: ~13%.)
//! `queue_handshake_after` lets an operator exempt short waits from it, leaving calls
//! queued for less than that as unprotected on a crash as calls in progress. Request body
//! frames stay in the call's stream (h2 flow control bounds them) until the head has gone
//! to the agent.
//!
//! A small body that is whole when its call goes on a stream (its one frame, with `end`,
//! came in with the head, as it does for the usual small POST) goes to the agent inside
//! the request head (`RequestHead.body`) when the agent announced `inline-body`: one frame
//! and one channel hand-off less for the agent and this server per call. An agent that did
//! not announce it gets a body from a head as a body frame of its own.

use crate::handle::{CallCredit, CallSlot};
use crate::hub::{AcquireError, Hub, InFlight, Lease};
use crate::outcome::Outcome;
use dashmap::DashMap;
use futures::{FutureExt, Stream, StreamExt};
use relay_common::trace::{CallTrace, KeyValue, SpanKind};
use relay_proto::{
    forward_request, forward_response, server_frame, BodyChunk, Cancel, ForwardRequest,
    ForwardResponse, Queued, RequestHead, ServerFrame, StreamReserved,
};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tonic::Status;
use tracing::debug;

/// How long a cancelled call may take to be acknowledged by the agent before its stream
/// is given up on.
const CANCEL_ACK: Duration = Duration::from_secs(10);

/// How long a reserved stream waits for the dispatcher's `Proceed` (or less: the call's
/// deadline) before it goes back to the pool.
const PROCEED_WAIT: Duration = Duration::from_secs(5);

/// The call's request frames after its head: a `Forward.Call` request stream, or the
/// co-located dispatcher's frames (`relay_dispatcher::colocated`). Its end is the dispatcher's
/// half-close.
pub trait Inbound: Stream<Item = Result<ForwardRequest, Status>> + Send + Unpin + 'static {}

impl<S: Stream<Item = Result<ForwardRequest, Status>> + Send + Unpin + 'static> Inbound for S {}

/// Where the call's response frames go: the `Forward.Call` response stream. It ends when
/// every sender is gone (the task's and the stream reader's copy in the call's slot); its
/// receiver going away is how the task hears that the caller left.
pub type ToCaller = mpsc::Sender<Result<ForwardResponse, Status>>;

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

    /// The dispatcher's `Proceed`: false when no call waits under that reservation.
    pub fn proceed(&self, id: u64) -> bool {
        match self.waiting.remove(&id) {
            Some((_, go)) => go.send(()).is_ok(),
            None => false,
        }
    }
}

/// Removes its reservation when the wait ends, however it ends.
struct Reservation(u64, Arc<Reservations>);

impl Drop for Reservation {
    fn drop(&mut self) {
        self.1.waiting.remove(&self.0);
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

/// One call, handed over by the `Forward.Call` handler.
pub struct Call {
    pub hub: Arc<Hub>,
    pub tunnel_id: String,
    /// The dispatcher speaks the queue handshake.
    pub handshake: bool,
    pub request: RequestHead,
    pub queue_timeout: Duration,
    pub handshake_after: Duration,
    pub reservations: Arc<Reservations>,
    pub to_caller: ToCaller,
    /// The call came on a carrier (`Forward.Carry`): its request frames are watched until
    /// the call ends, not only until its body's end.
    pub carrier: bool,
    /// This server's span of the call (its trace id is on the call's log lines).
    pub trace: CallTrace,
}

/// What the call holds while it runs on a stream; dropped (stream given back, gauge down)
/// once its outcome is known.
struct OnStream {
    call_id: u64,
    _in_flight: InFlight,
    _lease: Lease,
}

impl Call {
    /// Serves the call to its outcome, then counts, logs and answers it.
    pub async fn run(self, mut inbound: impl Inbound) {
        self.run_on(&mut inbound).await;
    }

    /// [`Call::run`] reading the request frames from a borrowed stream: a carrier's frames
    /// go on after the call (`crate::forward`). True when the caller got its answer.
    pub async fn run_on<I>(mut self, inbound: &mut I) -> bool
    where
        I: Stream<Item = Result<ForwardRequest, Status>> + Send + Unpin,
    {
        let started = Instant::now();
        let (outcome, on_stream) = self.serve(inbound, started).await;
        // 0: the call never reached a stream.
        let call_id = on_stream.as_ref().map_or(0, |s| s.call_id);
        // Counted, then the stream goes back and the call leaves the gauge, all before the
        // caller hears the answer: a caller that saw its answer sees the server at rest.
        self.hub.metrics.call(&outcome);
        let outcome_name = outcome.as_str();
        drop(on_stream);
        outcome.log(
            &self.tunnel_id,
            call_id,
            self.trace.trace_id,
            started.elapsed(),
        );
        self.trace.end(
            "relay.tunnel_server.call",
            SpanKind::Server,
            (!matches!(outcome_name, "ok")).then_some(outcome_name),
            || {
                vec![
                    KeyValue::new("relay.outcome", outcome_name),
                    KeyValue::new("relay.tunnel_id", self.tunnel_id.clone()),
                    KeyValue::new("relay.call_id", call_id as i64),
                ]
            },
        );
        match outcome.into_answer() {
            Some(last) => self.to_caller.send(Ok(last)).await.is_ok(),
            None => false,
        }
    }

    /// Runs the call until it has an outcome; returns it with the stream it held, if any.
    async fn serve<I>(&mut self, inbound: &mut I, started: Instant) -> (Outcome, Option<OnStream>)
    where
        I: Stream<Item = Result<ForwardRequest, Status>> + Send + Unpin,
    {
        let hub = self.hub.clone();
        if relay_proto::check_inline_body(self.request.body.len(), self.request.end_of_stream)
            .is_err()
        {
            let why =
                "a request head's body must be the whole body (end_of_stream) of at most 64 KiB";
            return (Outcome::BadRequest(Status::invalid_argument(why)), None);
        }
        let mut handshake = if self.handshake {
            Handshake::Possible
        } else {
            Handshake::Clear
        };
        let (lease, call_id, mut done, request_credit) = loop {
            let lease = match self.acquire(started, &mut handshake).await {
                Ok(lease) => lease,
                Err(outcome) => return (outcome, None),
            };
            if handshake == Handshake::Queued {
                let call_deadline = (self.request.deadline_ms > 0)
                    .then(|| started + Duration::from_millis(self.request.deadline_ms as u64));
                // On failure the lease drops here: the stream goes back unused.
                match self.await_proceed(call_deadline).await {
                    Ok(()) => handshake = Handshake::Clear,
                    Err(outcome) => return (outcome, None),
                }
            }
            let call_id = hub.next_call_id();
            let (done_tx, done) = oneshot::channel();
            let credit = lease.stream().credit.map(|c| CallCredit::new(c.request));
            let request_credit = credit.as_ref().map(|c| c.request.clone());
            let slot = CallSlot {
                call_id,
                trace_id: self.trace.trace_id,
                to_caller: self.to_caller.clone(),
                done: done_tx,
                head_seen: false,
                credit,
            };
            // A stream closed between acquire and now saw no call: drop its lease (the hub
            // closes it) and take another.
            if lease.begin_call(slot).is_ok() {
                break (lease, call_id, done, request_credit);
            }
        };
        let on_stream = OnStream {
            call_id,
            _in_flight: hub.call_in_flight(),
            _lease: lease,
        };
        let stream = on_stream._lease.stream().clone();
        let mut head = std::mem::take(&mut self.request);
        head.call_id = call_id;
        if head.deadline_ms > 0 {
            let left =
                Duration::from_millis(head.deadline_ms as u64).saturating_sub(started.elapsed());
            head.deadline_ms = left.as_millis().max(1) as u32;
        }
        let mut body_open = !head.end_of_stream;
        // A frame read ahead of the loop below, which takes it first.
        let mut ahead = None;
        let mut split = None;
        if stream.inline_body {
            // The body's first frame has usually come in with the head: a whole small body
            // goes to the agent inside the head, one frame instead of two. Small: the head
            // with it stays within one body chunk's size, so it fits any `max_frame_bytes`
            // (at least two chunks).
            if body_open {
                match inbound.next().now_or_never() {
                    Some(Some(Ok(ForwardRequest {
                        kind: Some(forward_request::Kind::Body(chunk)),
                    }))) if chunk.end
                        && relay_proto::body_fits_in_head(&head, chunk.data.len()) =>
                    {
                        head.body = chunk.data;
                        head.end_of_stream = true;
                        body_open = false;
                    }
                    Some(msg) => ahead = Some(msg),
                    None => {}
                }
            }
        } else if !head.body.is_empty() {
            // An agent that does not read a body inside the head gets it as its own frame.
            head.end_of_stream = false;
            let data = std::mem::take(&mut head.body);
            split = Some(BodyChunk {
                call_id,
                data,
                end: true,
            });
        }
        debug!(tunnel_id = %self.tunnel_id, call_id, trace_id = %self.trace.trace_id, stream_id = stream.id, "call on stream");
        // A body in the head counts against the request credit (at least two chunks, so it
        // is there at once).
        take_credit(&request_credit, head.body.len()).await;
        // If the stream died, its reader ends the call as stream lost.
        let _ = stream
            .send(ServerFrame::of(server_frame::Kind::RequestHead(head)))
            .await;
        if let Some(chunk) = split {
            take_credit(&request_credit, chunk.data.len()).await;
            let _ = stream
                .send(ServerFrame::of(server_frame::Kind::RequestBody(chunk)))
                .await;
        }
        if !body_open {
            // No body frame follows: the agent reads this stream freely from here on.
            stream.request_sent_whole();
        }
        let cancel = || ServerFrame::of(server_frame::Kind::Cancel(Cancel { call_id }));
        let gone = self.to_caller.closed();
        tokio::pin!(gone);
        loop {
            tokio::select! {
                // Order: the call's end first, then the caller leaving, then more body.
                biased;
                ended = &mut done => return (ended_with(ended), Some(on_stream)),
                _ = &mut gone => {
                    stream.try_send(cancel());
                    break;
                }
                // A carrier's frames are watched to the call's end: the dispatcher closing
                // the carrier mid-call is the caller leaving (see `crate::forward`).
                msg = next_frame(inbound, &mut ahead), if body_open || self.carrier => match msg.transpose() {
                    Ok(Some(ForwardRequest { kind: Some(forward_request::Kind::Body(mut chunk)) })) if body_open => {
                        if chunk.data.len() > relay_proto::MAX_CHUNK {
                            stream.try_send(cancel());
                            break;
                        }
                        body_open = !chunk.end;
                        chunk.call_id = call_id;
                        // With body credit, no more of the body than the agent gave credit
                        // for goes out (a call that left the stream gets none: its end is
                        // next). The caller leaving still cancels meanwhile.
                        let taken = tokio::select! {
                            biased;
                            _ = &mut gone => {
                                stream.try_send(cancel());
                                break;
                            }
                            taken = take_credit(&request_credit, chunk.data.len()) => taken,
                        };
                        if taken {
                            let _ = stream.send(ServerFrame::of(server_frame::Kind::RequestBody(chunk))).await;
                        }
                    }
                    Ok(None) if body_open => {
                        // The dispatcher ended its half without an end flag: end the body.
                        body_open = false;
                        let end = BodyChunk { call_id, data: Default::default(), end: true };
                        let _ = stream.send(ServerFrame::of(server_frame::Kind::RequestBody(end))).await;
                    }
                    Ok(_) | Err(_) => {
                        // A malformed frame or a broken caller stream: cancel the call.
                        stream.try_send(cancel());
                        break;
                    }
                },
            }
        }
        // Cancelled: the stream stays leased until the agent acknowledges; an agent that
        // does not loses the stream, and the call ends as stream lost.
        let ended = match tokio::time::timeout(CANCEL_ACK, &mut done).await {
            Ok(ended) => ended,
            Err(_) => {
                stream.close();
                done.await
            }
        };
        (ended_with(ended), Some(on_stream))
    }

    /// Takes a stream of the tunnel id, waiting in the queue with the handshake's `Queued`
    /// notice when it lasts.
    async fn acquire(&self, started: Instant, handshake: &mut Handshake) -> Result<Lease, Outcome> {
        let mut wait = self.queue_timeout;
        if self.request.deadline_ms > 0 {
            // Give up queueing a little before the caller's deadline, so the caller hears
            // "no capacity" rather than a bare timeout.
            let deadline = Duration::from_millis(self.request.deadline_ms as u64);
            let margin =
                (deadline / 10).clamp(Duration::from_millis(5), Duration::from_millis(250));
            wait = wait.min(deadline.saturating_sub(margin));
        }
        let acquire = self
            .hub
            .acquire(&self.tunnel_id, started + wait, self.to_caller.closed());
        tokio::pin!(acquire);
        // Fires only while `acquire` waits in the queue (it returns at once otherwise).
        let notice = tokio::time::sleep(self.handshake_after);
        tokio::pin!(notice);
        let acquired = loop {
            tokio::select! {
                biased;
                r = &mut acquire => break r,
                _ = &mut notice, if *handshake == Handshake::Possible => {
                    *handshake = Handshake::Queued;
                    // Nothing was answered yet: the channel has room.
                    let notice = ForwardResponse::of(forward_response::Kind::Queued(Queued {}));
                    let _ = self.to_caller.try_send(Ok(notice));
                }
            }
        };
        acquired.map_err(|e| match e {
            AcquireError::UnknownTunnel => Outcome::UnknownTunnel(self.tunnel_id.clone()),
            AcquireError::NoCapacity(why) => Outcome::NoCapacity(why),
            AcquireError::Cancelled => Outcome::Cancelled(None),
        })
    }

    /// The queued call holds a reserved stream: answer `StreamReserved` and wait for the
    /// dispatcher's `Forward.Proceed`, at most `PROCEED_WAIT` and not past the call's
    /// deadline. No agent has seen the call either way.
    async fn await_proceed(&self, call_deadline: Option<Instant>) -> Result<(), Outcome> {
        let (reservation, go, _guard) = self.reservations.open();
        let reserved = ForwardResponse::of(forward_response::Kind::Reserved(StreamReserved {
            reservation,
        }));
        if self.to_caller.send(Ok(reserved)).await.is_err() {
            return Err(Outcome::Cancelled(None));
        }
        let mut until = Instant::now() + PROCEED_WAIT;
        if let Some(d) = call_deadline {
            until = until.min(d);
        }
        tokio::select! {
            biased;
            _ = self.to_caller.closed() => Err(Outcome::Cancelled(None)),
            r = go => r.map_err(|_| Outcome::Cancelled(None)),
            _ = tokio::time::sleep_until(until) => Err(Outcome::BadRequest(Status::invalid_argument(
                "the dispatcher did not answer StreamReserved with Proceed in time",
            ))),
        }
    }
}

/// The outcome the stream's reader sent; a slot dropped without one (its stream's reader
/// is gone) is a lost stream.
fn ended_with(ended: Result<Outcome, oneshot::error::RecvError>) -> Outcome {
    ended.unwrap_or(Outcome::StreamLost(
        "the agent stream carrying the call ended before the call did",
    ))
}

/// The call's next request frame: the one read ahead, if any, then the stream's.
async fn next_frame<I>(
    inbound: &mut I,
    ahead: &mut Option<Option<Result<ForwardRequest, Status>>>,
) -> Option<Result<ForwardRequest, Status>>
where
    I: Stream<Item = Result<ForwardRequest, Status>> + Unpin,
{
    match ahead.take() {
        Some(msg) => msg,
        None => inbound.next().await,
    }
}

/// Takes `n` bytes of a call's request credit (nothing to take when the stream has no
/// credit); false when the call left the stream meanwhile (its credit is closed then).
async fn take_credit(credit: &Option<Arc<tokio::sync::Semaphore>>, n: usize) -> bool {
    match credit {
        Some(s) if n > 0 => match s.acquire_many(n as u32).await {
            Ok(p) => {
                p.forget();
                true
            }
            Err(_) => false,
        },
        _ => true,
    }
}
