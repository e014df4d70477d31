//! Body plumbing for one call, in both directions, without ever holding a whole body.
//!
//! - [`RequestBody`] turns the caller's body into `BodyChunk` frames of at most
//!   `MAX_CHUNK` bytes, pulled by the Forward.Call request stream only as fast as gRPC/HTTP2
//!   flow control lets it send (back-pressure). It hands the body to one forward attempt at
//!   a time and keeps the frames sent so far, up to a replay limit, so that a retry on
//!   another tunnel server can replay them and then go on pulling the rest from the caller;
//!   beyond the limit the call is no longer retryable and the kept frames are dropped.
//!
//! The replay limit ([`replay_limit`]) is what one forward RPC can carry before the tunnel
//! server reads any of it: its HTTP/2 stream window plus the few chunks hyper and tonic
//! hold while they wait for window. A call waiting in a tunnel server's queue has its body
//! unread there (see the tunnel server's `forward` module), so flow control stops the
//! dispatcher at that bound, and every queued call stays replayable whatever its body's
//! size: a 1 MiB or a 1 GiB POST queued on a server that dies is retried elsewhere with
//! its whole body, which is what "queued calls are safe to retry, POSTs included" promises
//! a caller. (An earlier limit of one chunk made any queued POST over 64 KiB a 502.) The
//! cost is memory the window already admits on the tunnel server's side: at most
//! `replay_limit` per call with a body, and at most the connection window per tunnel
//! server for calls that queue there, released when the response head arrives (a call is
//! never retried after it) or when the body outgrows the limit (then it has reached an
//! agent, which reads it).
//! - [`RelayBody`] is the caller's response body: either a small fixed body (error JSON) or
//!   the tunnel server's `BodyChunk` frames, polled one by one as the caller reads. Any
//!   failure after the head is a body error, so hyper aborts the response (HTTP/1: the
//!   connection closes before the end; h2: RST_STREAM) and the caller never mistakes a
//!   truncated body for a complete one. The body is bounded in time ([`BodyTimers`]): by
//!   the call's deadline (which covers the whole call, body included) and by
//!   `body_idle_timeout` between two frames, so a peer that trickles a byte now and then
//!   cannot hold the call and its caller's concurrency slots forever. Either cut counts
//!   as its own outcome (`deadline_exceeded`, `body_idle_timeout`). A body chunk over
//!   `MAX_CHUNK` from the tunnel server cuts the body too.
//! - [`CallGuard`] records each call's outcome and duration exactly once, whether it ends
//!   normally, with an error, or by the caller going away (dropped = `cancelled`).

use crate::colocated::ResponseFrames;
use crate::error::RequestBodyError;
use crate::metrics::{CallOutcome, Metrics};
use bytes::Bytes;
use futures::StreamExt;
use http_body::{Body, Frame, SizeHint};
use http_body_util::combinators::UnsyncBoxBody;
use parking_lot::{Mutex, MutexGuard};
use relay_proto::forward_request::Kind as ReqKind;
use relay_proto::forward_response::Kind as RespKind;
use relay_proto::{BodyChunk, CallHead, ForwardRequest, ForwardResponse, MAX_CHUNK};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll, Waker};
use tokio::time::Instant;

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The caller's request body, boxed.
pub type CallerBody = UnsyncBoxBody<Bytes, BoxError>;

/// Request body bytes a retry may replay when the tunnel servers' `Forward.Call` stream
/// window is `stream_window` bytes: the window (what the dispatcher can send before the
/// server reads anything) plus chunks held in flight beside it (one decoded ahead by the
/// server, one waiting for window in hyper, one in h2's send queue, one being encoded).
pub fn replay_limit(stream_window: u32) -> usize {
    stream_window as usize + 4 * MAX_CHUNK
}

struct Source {
    body: CallerBody,
    pending: Bytes,
}

impl Source {
    /// Next chunk of at most `MAX_CHUNK` bytes and whether it is the last one.
    fn poll_chunk(&mut self, cx: &mut Context<'_>) -> Poll<Result<(Bytes, bool), BoxError>> {
        loop {
            if !self.pending.is_empty() {
                let n = self.pending.len().min(MAX_CHUNK);
                let data = self.pending.split_to(n);
                let end = self.pending.is_empty() && self.body.is_end_stream();
                return Poll::Ready(Ok((data, end)));
            }
            match ready!(Pin::new(&mut self.body).poll_frame(cx)) {
                None => return Poll::Ready(Ok((Bytes::new(), true))),
                Some(Err(e)) => return Poll::Ready(Err(e)),
                // Request trailers have no place on the wire; they are dropped.
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        self.pending = data;
                    }
                }
            }
        }
    }
}

struct Shared {
    /// `None` once the body is fully read (or there was none).
    source: Option<Source>,
    /// Frames handed out so far, while they fit in `replay_limit`.
    replay: Vec<ForwardRequest>,
    replay_bytes: usize,
    /// Bytes `replay` may hold (see [`replay_limit`]).
    replay_limit: usize,
    replayable: bool,
    /// The attempt allowed to pull; streams of older attempts end.
    owner: u32,
    /// How many of `replay` the owner has sent.
    cursor: usize,
    /// Set when reading the caller's body failed; the call must be aborted.
    failed: Option<RequestBodyError>,
    /// Who to wake when `failed` is set (the call driver or the response body).
    watcher: Option<Waker>,
}

/// The caller's request body, shared by the forward attempts of one call.
#[derive(Clone)]
pub struct RequestBody {
    shared: Arc<Mutex<Shared>>,
    call_id: u64,
}

impl RequestBody {
    /// `body` is `None` when the request has none (no body frames will be sent).
    /// `replay_limit`: body bytes kept for a retry (see [`replay_limit`]).
    pub fn new(body: Option<CallerBody>, call_id: u64, replay_limit: usize) -> Self {
        let shared = Shared {
            source: body.map(|body| Source {
                body,
                pending: Bytes::new(),
            }),
            replay: Vec::new(),
            replay_bytes: 0,
            replay_limit,
            replayable: true,
            owner: 0,
            cursor: 0,
            failed: None,
            watcher: None,
        };
        RequestBody {
            shared: Arc::new(Mutex::new(shared)),
            call_id,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Shared> {
        self.shared.lock()
    }

    /// The request stream of forward attempt `attempt`: `head`, then the body frames.
    /// Hands the body over from any earlier attempt.
    pub fn attempt(&self, attempt: u32, head: ForwardRequest) -> AttemptStream {
        let mut s = self.lock();
        s.owner = attempt;
        s.cursor = 0;
        drop(s);
        AttemptStream {
            abandoned: false,
            body: self.clone(),
            attempt,
            head: Some(head),
            inline: false,
            next: None,
        }
    }

    /// Whether a new attempt can still send the whole body.
    pub fn replayable(&self) -> bool {
        self.lock().replayable
    }

    /// Drops the frames kept for a retry (those the current attempt has yet to replay
    /// stay until it sent them): the call has its answer and is never retried.
    pub fn settle(&self) {
        let mut s = self.lock();
        s.replayable = false;
        let sent = s.cursor;
        s.replay.drain(..sent);
        s.cursor = 0;
    }

    /// Ready with the reason once reading the caller's body failed.
    pub fn poll_failed(&self, cx: &mut Context<'_>) -> Poll<RequestBodyError> {
        let mut s = self.lock();
        match &s.failed {
            Some(why) => Poll::Ready(why.clone()),
            None => {
                s.watcher = Some(cx.waker().clone());
                Poll::Pending
            }
        }
    }

    /// Resolves once reading the caller's body failed.
    pub async fn failed(&self) -> RequestBodyError {
        std::future::poll_fn(|cx| self.poll_failed(cx)).await
    }
}

/// The `Forward.Call` request stream of one attempt.
///
/// When the caller's body breaks off, it yields [`ForwardRequest::abandon`] once and then
/// nothing: the RPC (a `Forward.Call`, or the carrier carrying the call) is reset, which
/// the tunnel server takes as the caller gone. It never ends cleanly there: a server ends
/// a `Forward.Call`'s body at the RPC's end, so a clean end would pass a cut body on as
/// whole; and left pending, the RPC would stay open (hyper does not reset a request half
/// when the response is dropped) with its agent stream and upstream request held until
/// the tunnel server ends the call on its own.
///
/// A server that reads a body inside the call head (see [`AttemptStream::inline_body`])
/// gets a whole small body there: when the body's first frame is at hand as the head goes
/// out and is its last, it rides in `RequestHead.body` and the stream ends with the head.
/// The frame still counts as sent (a retry replays it), so nothing else changes.
pub struct AttemptStream {
    body: RequestBody,
    attempt: u32,
    head: Option<ForwardRequest>,
    abandoned: bool,
    /// The server reads a whole small body inside the head.
    inline: bool,
    /// A frame pulled while the head went out, sent next.
    next: Option<ForwardRequest>,
}

impl AttemptStream {
    /// Lets this attempt carry a whole small body inside its head: for a server that said
    /// it reads one there (`relay-forward-features: inline-body`, see `carrier`).
    pub fn inline_body(&mut self) {
        self.inline = true;
    }

    /// Puts the body inside `head` when its one frame is at hand and small enough that
    /// the head with it stays within one body chunk's size; otherwise keeps what it pulled
    /// for the next poll.
    fn fold_body(&mut self, head: &mut ForwardRequest, cx: &mut Context<'_>) {
        let Some(ReqKind::Head(CallHead {
            request: Some(request),
            ..
        })) = head.kind.as_mut()
        else {
            return;
        };
        if request.end_of_stream {
            return;
        }
        match self.pull(cx) {
            Poll::Ready(Some(ForwardRequest {
                kind: Some(ReqKind::Body(chunk)),
            })) if chunk.end && relay_proto::body_fits_in_head(request, chunk.data.len()) => {
                request.body = chunk.data;
                request.end_of_stream = true;
            }
            Poll::Ready(Some(frame)) => self.next = Some(frame),
            Poll::Ready(None) | Poll::Pending => {}
        }
    }
}

impl futures::Stream for AttemptStream {
    type Item = ForwardRequest;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<ForwardRequest>> {
        let this = self.get_mut();
        if let Some(mut head) = this.head.take() {
            if this.inline {
                this.fold_body(&mut head, cx);
            }
            return Poll::Ready(Some(head));
        }
        if let Some(frame) = this.next.take() {
            return Poll::Ready(Some(frame));
        }
        this.pull(cx)
    }
}

impl AttemptStream {
    /// The next body frame: replayed ones first, then the caller's.
    fn pull(&mut self, cx: &mut Context<'_>) -> Poll<Option<ForwardRequest>> {
        let call_id = self.body.call_id;
        let mut s = self.body.lock();
        if s.owner != self.attempt {
            return Poll::Ready(None);
        }
        if let Some(frame) = s.replay.get(s.cursor) {
            let frame = frame.clone();
            s.cursor += 1;
            return Poll::Ready(Some(frame));
        }
        if s.failed.is_some() {
            // The driver aborts the whole call; never send a fake end.
            drop(s);
            return self.abandon();
        }
        let Some(source) = s.source.as_mut() else {
            return Poll::Ready(None);
        };
        match ready!(source.poll_chunk(cx)) {
            Ok((data, end)) => {
                if end {
                    s.source = None;
                }
                let len = data.len();
                let frame = ForwardRequest::of(ReqKind::Body(BodyChunk { call_id, data, end }));
                if s.replayable {
                    if s.replay_bytes + len <= s.replay_limit {
                        s.replay_bytes += len;
                        s.replay.push(frame.clone());
                        s.cursor += 1;
                    } else {
                        // The owner has sent every kept frame (it replays before it
                        // pulls): none is needed any more.
                        s.replayable = false;
                        s.replay = Vec::new();
                        s.cursor = 0;
                    }
                }
                Poll::Ready(Some(frame))
            }
            Err(e) => {
                s.failed = Some(RequestBodyError::of(&*e));
                s.source = None;
                if let Some(w) = s.watcher.take() {
                    w.wake();
                }
                drop(s);
                self.abandon()
            }
        }
    }

    /// The RPC's reset, once; then nothing more.
    fn abandon(&mut self) -> Poll<Option<ForwardRequest>> {
        if std::mem::replace(&mut self.abandoned, true) {
            Poll::Pending
        } else {
            Poll::Ready(Some(ForwardRequest::abandon()))
        }
    }
}

/// The time bounds of a response body after its head: the call's deadline, and the
/// longest silence between two frames (`body_idle_timeout`).
#[derive(Debug, Clone, Copy)]
pub struct BodyTimers {
    pub deadline: Instant,
    pub idle: std::time::Duration,
}

impl BodyTimers {
    /// When the body is cut if no frame comes before, counting from `now`.
    fn next(&self, now: Instant) -> Instant {
        (now + self.idle).min(self.deadline)
    }
}

/// Records one call's outcome and duration once; dropping it unrecorded means the caller
/// went away (`cancelled`).
pub struct CallGuard {
    metrics: Arc<Metrics>,
    start: Instant,
    recorded: bool,
    /// The tunnel server that answered (or the last one tried).
    server_id: Option<Arc<str>>,
    /// The caller's concurrency slot, given back when the call ends.
    permit: Option<tokio::sync::OwnedSemaphorePermit>,
    /// The caller's slot for the call's tunnel id, given back when the call ends.
    tunnel_slot: Option<crate::quota::TunnelPermit>,
}

impl CallGuard {
    pub fn new(metrics: Arc<Metrics>) -> Self {
        metrics.calls_in_flight.inc();
        CallGuard {
            metrics,
            start: Instant::now(),
            recorded: false,
            server_id: None,
            permit: None,
            tunnel_slot: None,
        }
    }

    /// Holds the caller's slot for the call's tunnel id until the call ends.
    pub fn hold_tunnel(&mut self, slot: crate::quota::TunnelPermit) {
        self.tunnel_slot = Some(slot);
    }

    /// Holds the caller's concurrency slot until the call ends.
    pub fn hold(&mut self, permit: tokio::sync::OwnedSemaphorePermit) {
        self.permit = Some(permit);
    }

    /// The server the call went to, for the per-server outcome counter.
    pub fn set_server(&mut self, server_id: Option<Arc<str>>) {
        self.server_id = server_id;
    }

    pub fn finish(&mut self, outcome: CallOutcome) {
        if self.recorded {
            return;
        }
        self.recorded = true;
        self.permit = None;
        self.tunnel_slot = None;
        self.metrics.calls_in_flight.dec();
        let outcome = outcome.as_str();
        self.metrics.calls.with_label_values(&[outcome]).inc();
        let server = self.server_id.as_deref().unwrap_or("none");
        self.metrics
            .calls_by_server
            .with_label_values(&[server, outcome])
            .inc();
        self.metrics
            .call_duration
            .observe(self.start.elapsed().as_secs_f64());
    }
}

impl Drop for CallGuard {
    fn drop(&mut self) {
        self.finish(CallOutcome::Cancelled);
    }
}

/// The body was cut short after the response head.
#[derive(Debug, thiserror::Error)]
#[error("relay response aborted: {0}")]
pub struct BodyAborted(pub String);

struct Streamed {
    stream: ResponseFrames,
    request: RequestBody,
    guard: CallGuard,
    call_id: u64,
    /// The body's last chunk was seen; what is left is the RPC's end (its trailers).
    ended: bool,
    done: bool,
    timers: BodyTimers,
    /// Fires at `timers.next` after the last frame: the body is cut.
    timer: Pin<Box<tokio::time::Sleep>>,
}

/// A body that came whole inside the response head; the RPC's end still has to be read.
struct Small {
    data: Option<Bytes>,
    len: u64,
    stream: Option<ResponseFrames>,
    /// Bound on waiting for the RPC's end after the body (`RPC_END_WAIT`), armed at the
    /// first wait: hyper seldom polls a body whose length it knows past its bytes (the
    /// end is then read on drop, see [`end_rpc_in_background`]).
    end_wait: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl Drop for Small {
    fn drop(&mut self) {
        // The answer is whole (it came with its head): the RPC is read to its end rather
        // than cancelled, even if the caller left before reading it.
        if let Some(stream) = self.stream.take() {
            end_rpc_in_background(stream);
        }
    }
}

impl Drop for Streamed {
    fn drop(&mut self) {
        // After the body's last chunk only the RPC's end is left to read; before it, the
        // caller went away and dropping the RPC cancels the call (the agent stops).
        if self.ended && !self.done {
            let stream = std::mem::replace(&mut self.stream, Box::pin(futures::stream::empty()));
            end_rpc_in_background(stream);
        }
    }
}

enum Inner {
    Full(Option<Bytes>),
    Small(Box<Small>),
    Stream(Box<Streamed>),
}

/// The response body the caller reads.
pub struct RelayBody(Inner);

impl From<Bytes> for RelayBody {
    fn from(b: Bytes) -> Self {
        RelayBody(Inner::Full(if b.is_empty() { None } else { Some(b) }))
    }
}

impl RelayBody {
    pub fn empty() -> Self {
        RelayBody(Inner::Full(None))
    }

    /// The tunnel server's body frames after its `ResponseHead`, bounded by `timers`.
    pub fn stream(
        stream: ResponseFrames,
        request: RequestBody,
        guard: CallGuard,
        call_id: u64,
        timers: BodyTimers,
    ) -> Self {
        RelayBody(Inner::Stream(Box::new(Streamed {
            stream,
            request,
            guard,
            call_id,
            ended: false,
            done: false,
            timers,
            timer: Box::pin(tokio::time::sleep_until(timers.next(Instant::now()))),
        })))
    }

    /// A whole body that came inside the response head, with the RPC it came on: the
    /// caller gets the bytes at once, and the body ends once the RPC has ended too.
    pub fn small(data: Bytes, stream: ResponseFrames) -> Self {
        let len = data.len() as u64;
        RelayBody(Inner::Small(Box::new(Small {
            data: (!data.is_empty()).then_some(data),
            len,
            stream: Some(stream),
            end_wait: None,
        })))
    }
}

/// Reads a `Forward.Call` response to its end (the trailers), discarding what is left.
///
/// Every RPC of this hop must end this way, never by dropping it early: a dropped RPC is a
/// RST_STREAM(CANCEL), and the server's frames already on the wire (its trailers at least)
/// then arrive on a stream h2 may have forgotten, which h2 answers with resets of its own
/// and counts towards its connection-killing guard (see `relay_common::h2`). Only a call
/// whose caller went away is cancelled.
pub fn poll_rpc_end(stream: &mut ResponseFrames, cx: &mut Context<'_>) -> Poll<()> {
    loop {
        match ready!(stream.poll_next_unpin(cx)) {
            Some(Ok(_)) => {}
            Some(Err(_)) | None => return Poll::Ready(()),
        }
    }
}

/// [`poll_rpc_end`] as a future, bounded: a server that never ends the RPC is cut.
pub async fn finish_rpc(stream: &mut ResponseFrames) {
    let end = std::future::poll_fn(|cx| poll_rpc_end(stream, cx));
    let _ = tokio::time::timeout(RPC_END_WAIT, end).await;
}

/// Reads the end of the RPC of an answer the caller already has whole, once the response
/// body is dropped: at once if the server's end is already here (the usual case, it
/// travels with the last frame), otherwise in a task of its own.
///
/// hyper drops a response body as soon as it has written the bytes its length announced
/// (`Content-Length`, or the exact size of a body that came inside its head) without
/// polling it for its end, so the body cannot wait for the trailers itself. Dropping the
/// RPC there instead would reset it (RST_STREAM(CANCEL)) whenever the trailers were a
/// packet behind, and the client keeps every stream it reset in its slab for
/// `reset_stream_duration` (up to `reset_stream_memory` of them): under load that was
/// thousands of finished calls' streams per connection, megabytes of memory that never
/// came back, and a reset per call for the server to process.
fn end_rpc_in_background(mut stream: ResponseFrames) {
    let mut cx = Context::from_waker(futures::task::noop_waker_ref());
    if poll_rpc_end(&mut stream, &mut cx).is_ready() {
        return;
    }
    // No runtime (the process is stopping): the RPC goes with the connection.
    if let Ok(runtime) = tokio::runtime::Handle::try_current() {
        runtime.spawn(async move { finish_rpc(&mut stream).await });
    }
}

/// How long a finished call waits for its RPC's end before cancelling it.
pub const RPC_END_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

impl Streamed {
    fn abort(&mut self, why: String) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        self.abort_as(CallOutcome::Aborted, why)
    }

    fn abort_as(
        &mut self,
        outcome: CallOutcome,
        why: String,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        self.done = true;
        tracing::warn!(call_id = self.call_id, outcome = outcome.as_str(), reason = %why, "response aborted after its head");
        self.guard.finish(outcome);
        Poll::Ready(Some(Err(Box::new(BodyAborted(why)))))
    }

    /// The body's time is up (the timer fired): cut it, naming which bound it passed.
    fn time_up(&mut self) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if Instant::now() >= self.timers.deadline {
            self.abort_as(
                CallOutcome::Failed(crate::error::ErrorCode::DeadlineExceeded),
                "the call's deadline passed before the response body's end".into(),
            )
        } else {
            self.abort_as(
                CallOutcome::BodyIdleTimeout,
                format!(
                    "no response body frame for {} ms (body_idle_timeout)",
                    self.timers.idle.as_millis()
                ),
            )
        }
    }

    /// A frame arrived: the idle bound starts again.
    fn progress(&mut self) {
        let next = self.timers.next(Instant::now());
        self.timer.as_mut().reset(next);
    }
}

impl Body for RelayBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let st = match &mut self.get_mut().0 {
            Inner::Full(b) => return Poll::Ready(b.take().map(|b| Ok(Frame::data(b)))),
            Inner::Small(small) => {
                if let Some(data) = small.data.take() {
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
                if let Some(stream) = small.stream.as_mut() {
                    if poll_rpc_end(stream, cx).is_pending()
                        && small
                            .end_wait
                            .get_or_insert_with(|| Box::pin(tokio::time::sleep(RPC_END_WAIT)))
                            .as_mut()
                            .poll(cx)
                            .is_pending()
                    {
                        return Poll::Pending;
                    }
                    small.stream = None;
                }
                return Poll::Ready(None);
            }
            Inner::Stream(st) => st,
        };
        if st.done {
            return Poll::Ready(None);
        }
        if st.ended {
            // The body is whole; a server that never ends the RPC only loses its trailers.
            if poll_rpc_end(&mut st.stream, cx).is_pending()
                && st.timer.as_mut().poll(cx).is_pending()
            {
                return Poll::Pending;
            }
            st.done = true;
            return Poll::Ready(None);
        }
        if let Poll::Ready(why) = st.request.poll_failed(cx) {
            return st.abort(why.to_string());
        }
        loop {
            let next = match st.stream.poll_next_unpin(cx) {
                Poll::Ready(next) => next,
                Poll::Pending => {
                    ready!(st.timer.as_mut().poll(cx));
                    return st.time_up();
                }
            };
            st.progress();
            let kind = match next {
                Some(Ok(ForwardResponse { kind: Some(kind) })) => kind,
                Some(Ok(ForwardResponse { kind: None })) => {
                    return st.abort("tunnel server sent an empty frame".into())
                }
                Some(Err(status)) => {
                    return st.abort(format!(
                        "tunnel server call failed: {}",
                        relay_proto::escape_message(
                            status.message(),
                            relay_proto::MAX_PEER_MESSAGE
                        )
                    ))
                }
                None => {
                    return st.abort("tunnel server ended the call before the body's end".into())
                }
            };
            match kind {
                RespKind::Body(chunk) => {
                    if chunk.data.len() > MAX_CHUNK {
                        return st.abort(format!(
                            "tunnel server sent a body chunk of {} bytes, over {MAX_CHUNK}",
                            chunk.data.len()
                        ));
                    }
                    if chunk.end {
                        st.ended = true;
                        st.guard.finish(CallOutcome::Ok);
                    }
                    if !chunk.data.is_empty() {
                        return Poll::Ready(Some(Ok(Frame::data(chunk.data))));
                    }
                    if chunk.end {
                        if poll_rpc_end(&mut st.stream, cx).is_pending()
                            && st.timer.as_mut().poll(cx).is_pending()
                        {
                            return Poll::Pending;
                        }
                        st.done = true;
                        return Poll::Ready(None);
                    }
                }
                RespKind::Error(e) => {
                    let (failure, _) = crate::error::Failure::from_forward_error(&e);
                    return st.abort(format!("{}: {}", failure.code.as_str(), failure.message));
                }
                RespKind::Head(_) => {
                    return st.abort("tunnel server sent a second response head".into())
                }
                RespKind::Queued(_) | RespKind::Reserved(_) => {
                    return st
                        .abort("tunnel server sent a queue notice after the response head".into())
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.0 {
            Inner::Full(b) => b.is_none(),
            Inner::Small(small) => small.data.is_none() && small.stream.is_none(),
            Inner::Stream(st) => st.done,
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.0 {
            Inner::Full(Some(b)) => SizeHint::with_exact(b.len() as u64),
            Inner::Full(None) => SizeHint::with_exact(0),
            Inner::Small(small) => SizeHint::with_exact(small.len),
            Inner::Stream(_) => SizeHint::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::{FutureExt, StreamExt};
    use http_body_util::{BodyExt, StreamBody};

    fn caller_body(chunks: Vec<Result<Bytes, BoxError>>) -> CallerBody {
        StreamBody::new(futures::stream::iter(
            chunks.into_iter().map(|c| c.map(Frame::data)),
        ))
        .boxed_unsync()
    }

    fn head() -> ForwardRequest {
        ForwardRequest::of(ReqKind::Head(Default::default()))
    }

    fn chunks(frames: Vec<ForwardRequest>) -> Vec<(usize, bool)> {
        frames
            .into_iter()
            .skip(1)
            .map(|f| match f.kind {
                Some(ReqKind::Body(c)) => (c.data.len(), c.end),
                other => panic!("unexpected {other:?}"),
            })
            .collect()
    }

    fn post_head() -> ForwardRequest {
        ForwardRequest::of(ReqKind::Head(CallHead {
            tunnel_id: "demo".into(),
            request: Some(relay_proto::RequestHead {
                method: "POST".into(),
                path_and_query: "/upload".into(),
                ..Default::default()
            }),
            queue_handshake: true,
        }))
    }

    fn whole(data: &'static [u8]) -> CallerBody {
        http_body_util::Full::new(Bytes::from_static(data))
            .map_err(|e| match e {})
            .boxed_unsync()
    }

    /// The request head of a head frame: (its body, end_of_stream).
    fn head_body(frame: &ForwardRequest) -> (Bytes, bool) {
        match &frame.kind {
            Some(ReqKind::Head(CallHead {
                request: Some(r), ..
            })) => (r.body.clone(), r.end_of_stream),
            other => panic!("expected a call head, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn a_whole_small_body_rides_inside_the_head_only_where_the_server_reads_it() {
        let body = RequestBody::new(Some(whole(b"payload")), 1, 1 << 20);
        let mut first = body.attempt(0, post_head());
        first.inline_body();
        let frames: Vec<_> = first.collect().await;
        assert_eq!(frames.len(), 1, "the head alone: {frames:?}");
        assert_eq!(
            head_body(&frames[0]),
            (Bytes::from_static(b"payload"), true)
        );
        // A retry on a server that does not read it there replays it as a frame.
        assert!(body.replayable());
        let frames: Vec<_> = body.attempt(1, post_head()).collect().await;
        assert_eq!(head_body(&frames[0]), (Bytes::new(), false));
        assert_eq!(chunks(frames), [(7, true)]);
        // And a retry on one that does gets it inside the head again.
        let mut third = body.attempt(2, post_head());
        third.inline_body();
        let frames: Vec<_> = third.collect().await;
        assert_eq!(frames.len(), 1);
        assert_eq!(
            head_body(&frames[0]),
            (Bytes::from_static(b"payload"), true)
        );
    }

    #[tokio::test]
    async fn a_body_of_several_frames_or_too_big_for_the_head_goes_as_frames() {
        let parts = caller_body(vec![
            Ok(Bytes::from_static(b"ab")),
            Ok(Bytes::from_static(b"cd")),
        ]);
        let mut attempt = RequestBody::new(Some(parts), 1, 1 << 20).attempt(0, post_head());
        attempt.inline_body();
        let frames: Vec<_> = attempt.collect().await;
        assert_eq!(head_body(&frames[0]), (Bytes::new(), false));
        assert_eq!(chunks(frames), [(2, false), (2, false), (0, true)]);

        static FULL: [u8; MAX_CHUNK] = [3; MAX_CHUNK];
        let mut attempt = RequestBody::new(Some(whole(&FULL)), 1, 1 << 20).attempt(0, post_head());
        attempt.inline_body();
        let frames: Vec<_> = attempt.collect().await;
        assert_eq!(head_body(&frames[0]), (Bytes::new(), false));
        assert_eq!(chunks(frames), [(MAX_CHUNK, true)]);
    }

    #[tokio::test]
    async fn large_frames_are_split_and_the_last_chunk_ends_the_body() {
        let big = Bytes::from(vec![7u8; MAX_CHUNK * 2 + 10]);
        let body = RequestBody::new(
            Some(caller_body(vec![Ok(big), Ok(Bytes::from_static(b"xy"))])),
            1,
            MAX_CHUNK,
        );
        let frames: Vec<_> = body.attempt(0, head()).collect().await;
        assert_eq!(
            chunks(frames),
            [
                (MAX_CHUNK, false),
                (MAX_CHUNK, false),
                (10, false),
                (2, false),
                (0, true)
            ]
        );
        assert!(!body.replayable(), "more than one chunk was sent");
    }

    #[tokio::test]
    async fn a_retry_replays_what_the_first_attempt_sent() {
        let body = RequestBody::new(
            Some(caller_body(vec![
                Ok(Bytes::from_static(b"ab")),
                Ok(Bytes::from_static(b"cd")),
            ])),
            1,
            MAX_CHUNK,
        );
        let mut first = body.attempt(0, head());
        assert!(first.next().await.is_some());
        assert!(first.next().await.is_some(), "first chunk");
        assert!(body.replayable());
        let second: Vec<_> = body.attempt(1, head()).collect().await;
        assert_eq!(chunks(second), [(2, false), (2, false), (0, true)]);
        assert!(first.next().await.is_none(), "a superseded attempt ends");
    }

    #[tokio::test]
    async fn a_body_within_the_replay_limit_is_replayed_whole_then_the_rest_is_pulled() {
        let limit = replay_limit(1024 * 1024);
        let chunk = Bytes::from(vec![1u8; MAX_CHUNK]);
        // 20 chunks before the first attempt dies (more than a 1 MiB window), 4 after.
        let body = RequestBody::new(
            Some(caller_body((0..24).map(|_| Ok(chunk.clone())).collect())),
            1,
            limit,
        );
        let mut first = body.attempt(0, head());
        for _ in 0..21 {
            assert!(first.next().await.is_some());
        }
        assert!(body.replayable(), "20 chunks fit in {limit} bytes");
        let second: Vec<_> = body.attempt(1, head()).collect().await;
        let sizes = chunks(second);
        assert_eq!(sizes.len(), 25, "{sizes:?}");
        assert!(sizes[..24].iter().all(|&c| c == (MAX_CHUNK, false)));
        assert_eq!(sizes[24], (0, true));
    }

    #[tokio::test]
    async fn settling_keeps_the_frames_a_retry_has_yet_to_send() {
        let body = RequestBody::new(
            Some(caller_body(vec![
                Ok(Bytes::from_static(b"ab")),
                Ok(Bytes::from_static(b"cd")),
                Ok(Bytes::from_static(b"ef")),
            ])),
            1,
            MAX_CHUNK,
        );
        let mut first = body.attempt(0, head());
        for _ in 0..3 {
            assert!(first.next().await.is_some());
        }
        let mut second = body.attempt(1, head());
        assert!(second.next().await.is_some(), "head");
        assert!(second.next().await.is_some(), "replayed ab");
        // The answer's head arrives while "cd" is still to be replayed.
        body.settle();
        assert!(!body.replayable());
        let rest: Vec<_> = second.collect().await;
        let data: Vec<Vec<u8>> = rest
            .into_iter()
            .map(|f| match f.kind {
                Some(ReqKind::Body(c)) => c.data.to_vec(),
                other => panic!("unexpected {other:?}"),
            })
            .collect();
        assert_eq!(data, [b"cd".to_vec(), b"ef".to_vec(), Vec::new()]);
    }

    #[tokio::test]
    async fn a_failing_caller_body_is_reported_and_abandons_the_rpc_never_ended() {
        let body = RequestBody::new(Some(caller_body(vec![Err("boom".into())])), 1, MAX_CHUNK);
        let mut s = body.attempt(0, head());
        assert!(s.next().await.is_some());
        let abandon = s.next().await.expect("the abandon frame, not the end");
        assert!(
            abandon.kind.is_none(),
            "a frame that resets the RPC: {abandon:?}"
        );
        assert!(
            s.next().now_or_never().is_none(),
            "the stream must not end after a body error"
        );
        assert_eq!(body.failed().await, RequestBodyError::Read("boom".into()));
    }
}
