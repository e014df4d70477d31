//! Carriers: long-lived `Forward.Carry` RPCs to one tunnel server, each carrying calls one
//! at a time (the protocol is in `dispatch.proto`), so that a call costs no HTTP/2 stream,
//! headers or trailers of its own.
//!
//! Each tunnel server's [`Carriers`] keeps the idle ones. A call takes the most recently
//! used idle carrier (or opens one), hands it its request frames ([`Feed`]: the RPC's
//! request stream, which carries one call's [`AttemptStream`] after another and never ends
//! between calls) and reads the answer's frames from it ([`OnCarrier`], the call's
//! `ResponseFrames`). The carrier comes back once both ends of the call are done: the
//! answer's terminal frame read and the request sent to its end. Otherwise it is not
//! reused:
//! - the caller went away before the answer's end (the call's frames are dropped first):
//!   the request half closes and the RPC is reset, which the server takes as the call's
//!   cancel (as a reset `Forward.Call`);
//! - the answer ended before the request body was sent whole: the carrier is retired (its
//!   request half closed, its end read in the background, so neither side resets);
//! - the carrier broke or ended: dropped.
//!
//! What keeps a retry safe (`attempt`): a server ends a carrier cleanly only while no call
//! on it is unanswered, so a carrier that ends cleanly before any frame of its call's answer
//! never gave the call to an agent ([`not_taken`]). An idle carrier is checked before
//! reuse: one whose server ended it or whose connection broke while it idled is dropped, so
//! a call never goes onto a carrier that is already known dead.
//!
//! A server that lists `inline-body` in a carrier's response metadata
//! (`relay_proto::FORWARD_FEATURES`) reads a whole small request body inside the call head:
//! calls on that carrier may put it there ([`AttemptStream::inline_body`]), one frame
//! instead of two. A new carrier's first call goes out before the metadata comes back, so
//! it sends its body as frames; the knowledge lives with the carrier, never with the
//! server's address, so a server replaced by an older version is never sent a body it
//! would drop.
//!
//! A server that answers `Forward.Carry` with UNIMPLEMENTED (an older version) is marked
//! (`crate::pool`) and gets one `Forward.Call` per call from then on.
//!
//! Each connection to a server has its own [`Carriers`], and every carrier holds what it
//! was opened with ([`Held`]: its place among the connection's streams, see `pool`) from
//! its open until its RPC is over, idle or busy, so a connection never carries more
//! streams than its window covers.
//!
//! Bounds: at most [`MAX_IDLE`] idle carriers per connection (more are retired as they
//! come back), and a carrier idle for `carrier_idle_timeout` ([`IDLE_FOR`] by default) is
//! retired, by the pool's sweeper (a task that runs while the pool holds idle carriers) or
//! when a call next takes one. Busy carriers are bounded by the calls in flight, as
//! `Forward.Call` streams were.

use crate::colocated::ResponseFrames;
use crate::replay::AttemptStream;
use crate::response::RPC_END_WAIT;
use futures::{FutureExt, Stream, StreamExt};
use parking_lot::Mutex;
use relay_proto::forward_client::ForwardClient;
use relay_proto::forward_request::Kind as ReqKind;
use relay_proto::forward_response::Kind as RespKind;
use relay_proto::{ForwardRequest, ForwardResponse};
use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll, Waker};
use std::time::Duration;
use tokio::time::Instant;
use tonic::transport::Channel;
use tonic::{Status, Streaming};

/// Idle carriers kept per connection to a tunnel server.
pub const MAX_IDLE: usize = 256;

/// An idle carrier unused this long is retired (`carrier_idle_timeout`'s default).
pub const IDLE_FOR: Duration = Duration::from_secs(60);

/// The idle carriers of one connection to a tunnel server.
pub struct Carriers {
    idle: Mutex<Pool>,
    /// `carrier_idle_timeout`.
    idle_for: Duration,
}

#[derive(Default)]
struct Pool {
    /// Most recently used last.
    carriers: VecDeque<Idle>,
    /// A sweeper task runs (while `carriers` is not empty).
    sweeping: bool,
}

impl Default for Carriers {
    fn default() -> Self {
        Carriers::new(IDLE_FOR)
    }
}

struct Idle {
    carrier: Carrier,
    since: Instant,
}

/// One `Forward.Carry` RPC.
struct Carrier {
    feed: Arc<Mutex<Feed>>,
    responses: Streaming<ForwardResponse>,
    /// Its server reads a whole small request body inside the call head (it listed
    /// `inline-body` in the carrier's response metadata, `relay_proto::FORWARD_FEATURES`).
    inline_body: bool,
    /// The connection's stream this carrier is, given back when the RPC is over.
    permit: Held,
}

/// What a carrier holds for the life of its RPC (dropped when the RPC is over).
pub type Held = Box<dyn std::any::Any + Send + Sync>;

/// The request side of a carrier: the current call's frames, if any.
#[derive(Default)]
struct Feed {
    call: Option<AttemptStream>,
    /// The current call's request went out to its end (its head with `end_of_stream`, or
    /// its body chunk with `end`).
    sent_all: bool,
    /// The carrier's request half ends.
    closed: bool,
    /// The RPC's request pump, to wake for the next call or the close.
    waker: Option<Waker>,
}

/// The RPC's request stream: it ends only when the carrier is closed.
struct FeedStream(Arc<Mutex<Feed>>);

/// Whether `frame` is a call's last request frame.
fn ends_request(frame: &ForwardRequest) -> bool {
    match &frame.kind {
        Some(ReqKind::Head(h)) => h.request.as_ref().is_some_and(|r| r.end_of_stream),
        Some(ReqKind::Body(b)) => b.end,
        None => false,
    }
}

/// Whether `frame` is an answer's terminal frame.
fn ends_answer(frame: &ForwardResponse) -> bool {
    match &frame.kind {
        Some(RespKind::Head(h)) => h.end_of_stream,
        Some(RespKind::Body(b)) => b.end,
        Some(RespKind::Error(_)) => true,
        Some(RespKind::Queued(_) | RespKind::Reserved(_)) | None => false,
    }
}

impl Stream for FeedStream {
    type Item = ForwardRequest;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<ForwardRequest>> {
        let mut f = self.0.lock();
        if f.closed {
            return Poll::Ready(None);
        }
        if let Some(call) = f.call.as_mut() {
            match call.poll_next_unpin(cx) {
                Poll::Ready(Some(frame)) => {
                    if ends_request(&frame) {
                        f.sent_all = true;
                        f.call = None;
                    }
                    return Poll::Ready(Some(frame));
                }
                // The attempt handed the body to a later one: nothing more to send here
                // (its call failed, so the carrier is not reused).
                Poll::Ready(None) => f.call = None,
                Poll::Pending => {}
            }
        }
        if !f.waker.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
            f.waker = Some(cx.waker().clone());
        }
        Poll::Pending
    }
}

impl Feed {
    fn wake(&mut self) {
        if let Some(w) = self.waker.take() {
            w.wake();
        }
    }
}

impl Carrier {
    fn install(&self, call: AttemptStream) {
        let mut f = self.feed.lock();
        f.call = Some(call);
        f.sent_all = false;
        f.wake();
    }

    fn close(&self) {
        let mut f = self.feed.lock();
        f.closed = true;
        f.call = None;
        f.wake();
    }

    fn sent_all(&self) -> bool {
        self.feed.lock().sent_all
    }

    /// An idle carrier can take a call: nothing arrived on it (its server did not end it,
    /// its connection did not break).
    fn usable(&mut self) -> bool {
        self.responses.next().now_or_never().is_none()
    }

    /// Closes the request half and reads the server's end in the background, so neither
    /// side resets the RPC.
    fn retire(self) {
        self.close();
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let mut responses = self.responses;
        let permit = self.permit;
        runtime.spawn(async move {
            let end = async { while let Some(Ok(_)) = responses.next().await {} };
            let _ = tokio::time::timeout(RPC_END_WAIT, end).await;
            // The stream is over (or given up on): the connection may carry another.
            drop(permit);
        });
    }
}

/// The error a call's frames end with when its carrier ended cleanly before any frame of
/// the answer: the server never took the call.
#[derive(Debug, thiserror::Error)]
#[error("the tunnel server ended the carrier before taking the call")]
pub struct NotTaken;

/// Whether a call's response error is [`NotTaken`] (safe to retry anywhere).
pub fn not_taken(status: &Status) -> bool {
    std::error::Error::source(status).is_some_and(|e| e.is::<NotTaken>())
}

fn not_taken_status() -> Status {
    let mut status = Status::unavailable(NotTaken.to_string());
    status.set_source(Arc::new(NotTaken));
    status
}

impl Pool {
    /// Retires the carriers idle for `idle_for` or longer (the oldest are first).
    fn retire_stale(&mut self, idle_for: Duration) {
        let now = Instant::now();
        while self
            .carriers
            .front()
            .is_some_and(|i| now.duration_since(i.since) >= idle_for)
        {
            if let Some(stale) = self.carriers.pop_front() {
                stale.carrier.retire();
            }
        }
    }
}

impl Carriers {
    /// A pool whose carriers close after `idle_for` unused.
    pub fn new(idle_for: Duration) -> Self {
        Carriers {
            idle: Mutex::new(Pool::default()),
            idle_for,
        }
    }

    /// Idle carriers in the pool now.
    pub fn idle(&self) -> usize {
        self.idle.lock().carriers.len()
    }

    /// Starts the call in `request` on the most recently used idle carrier that is still
    /// usable (stale ones retired), if there is one; `request` is taken then.
    pub fn call_on_idle(
        self: &Arc<Self>,
        request: &mut Option<AttemptStream>,
    ) -> Option<ResponseFrames> {
        if request.is_none() {
            return None;
        }
        let carrier = self.take()?;
        let mut request = request.take()?;
        if carrier.inline_body {
            request.inline_body();
        }
        carrier.install(request);
        Some(OnCarrier::new(carrier, self.clone()).boxed())
    }

    /// The most recently used idle carrier that is still usable; stale ones retired.
    fn take(&self) -> Option<Carrier> {
        let mut pool = self.idle.lock();
        pool.retire_stale(self.idle_for);
        while let Some(mut i) = pool.carriers.pop_back() {
            if i.carrier.usable() {
                return Some(i.carrier);
            }
        }
        None
    }

    fn put(self: &Arc<Self>, carrier: Carrier) {
        let mut pool = self.idle.lock();
        if pool.carriers.len() >= MAX_IDLE {
            drop(pool);
            carrier.retire();
            return;
        }
        pool.carriers.push_back(Idle {
            carrier,
            since: Instant::now(),
        });
        if !pool.sweeping {
            pool.sweeping = self.sweep();
        }
    }

    /// Starts the sweeper: every half `idle_for` it retires the stale carriers, and it
    /// ends once none is left (the next `put` starts another) or the pool is gone. False
    /// without a runtime.
    fn sweep(self: &Arc<Self>) -> bool {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return false;
        };
        let pool = Arc::downgrade(self);
        let every = self.idle_for / 2;
        runtime.spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            tick.tick().await;
            loop {
                tick.tick().await;
                let Some(carriers) = pool.upgrade() else {
                    return;
                };
                let mut pool = carriers.idle.lock();
                pool.retire_stale(carriers.idle_for);
                if pool.carriers.is_empty() {
                    pool.sweeping = false;
                    return;
                }
            }
        });
        true
    }

    /// Starts a call on a new carrier opened through `client`, holding `permit` (the
    /// connection's stream) for the RPC's life; counted in `opened`. The call's request
    /// frames go out as the RPC's flow control allows, and the answer's frames come back as
    /// the returned stream. Errors are opening a carrier's (as opening a `Forward.Call`).
    pub async fn open(
        self: &Arc<Self>,
        mut client: ForwardClient<Channel>,
        request: AttemptStream,
        permit: Held,
        opened: &prometheus::IntCounter,
    ) -> Result<ResponseFrames, Status> {
        let feed = Arc::new(Mutex::new(Feed {
            call: Some(request),
            ..Feed::default()
        }));
        // A new carrier's first call goes out before the server's metadata is in: it
        // sends its body as frames, and the calls after it learn what the server reads.
        let r = client.carry(FeedStream(feed.clone())).await?;
        let inline_body = relay_proto::lists_feature(
            r.metadata(),
            relay_proto::FORWARD_FEATURES,
            relay_proto::FEATURE_INLINE_BODY,
        );
        opened.inc();
        let carrier = Carrier {
            feed,
            responses: r.into_inner(),
            inline_body,
            permit,
        };
        Ok(OnCarrier::new(carrier, self.clone()).boxed())
    }
}

/// Where a call on a carrier stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// No frame of the answer yet.
    Waiting,
    /// Some frames, not the terminal one.
    Answering,
    /// The terminal frame came: the call is over on the server.
    Answered,
    /// The carrier broke or ended.
    Broken,
}

/// One call's answer frames on its carrier, up to the terminal frame; gives the carrier
/// back (or retires or drops it, see the module docs) when dropped.
struct OnCarrier {
    carrier: Option<Carrier>,
    pool: Arc<Carriers>,
    state: State,
}

impl OnCarrier {
    fn new(carrier: Carrier, pool: Arc<Carriers>) -> Self {
        OnCarrier {
            carrier: Some(carrier),
            pool,
            state: State::Waiting,
        }
    }
}

impl Stream for OnCarrier {
    type Item = Result<ForwardResponse, Status>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        if matches!(this.state, State::Answered | State::Broken) {
            return Poll::Ready(None);
        }
        let Some(carrier) = this.carrier.as_mut() else {
            return Poll::Ready(None);
        };
        match ready!(carrier.responses.poll_next_unpin(cx)) {
            Some(Ok(frame)) => {
                this.state = if ends_answer(&frame) {
                    State::Answered
                } else {
                    State::Answering
                };
                Poll::Ready(Some(Ok(frame)))
            }
            Some(Err(status)) => {
                this.state = State::Broken;
                Poll::Ready(Some(Err(status)))
            }
            None => {
                let before = std::mem::replace(&mut this.state, State::Broken);
                if before == State::Waiting {
                    Poll::Ready(Some(Err(not_taken_status())))
                } else {
                    Poll::Ready(None)
                }
            }
        }
    }
}

impl Drop for OnCarrier {
    fn drop(&mut self) {
        let Some(carrier) = self.carrier.take() else {
            return;
        };
        match self.state {
            State::Answered if carrier.sent_all() => self.pool.put(carrier),
            State::Answered => carrier.retire(),
            State::Broken => drop(carrier),
            // The caller went away mid-call: the request half closes and the RPC is reset
            // (both halves dropped), which cancels the call on the server.
            State::Waiting | State::Answering => carrier.close(),
        }
    }
}
