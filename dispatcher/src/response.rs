//! The response body: [`RelayBody`] is what the caller reads, either a small fixed body
//! (error JSON) or the tunnel server's `BodyChunk` frames, polled one by one as the caller
//! reads. Any failure after the head is a body error, so hyper aborts the response (HTTP/1:
//! the connection closes before the end; h2: RST_STREAM) and the caller never mistakes a
//! truncated body for a complete one. The body is bounded in time ([`BodyTimers`]): by the
//! call's deadline (which covers the whole call, body included) and by `body_idle_timeout`
//! between two frames, so a peer that trickles a byte now and then cannot hold the call and
//! its caller's concurrency slots forever. Either cut counts as its own outcome
//! (`deadline_exceeded`, `body_idle_timeout`). A body chunk over `MAX_CHUNK` from the
//! tunnel server cuts the body too.
//!
//! The call's outcome is recorded through its [`CallGuard`] (see `guard`) when the body
//! ends, is cut, or is dropped (the caller went away). It must not read the request body
//! beyond noticing that reading it failed (`replay`).

use crate::colocated::ResponseFrames;
use crate::guard::CallGuard;
use crate::metrics::CallOutcome;
use crate::replay::{BoxError, RequestBody};
use bytes::Bytes;
use futures::StreamExt;
use http_body::{Body, Frame, SizeHint};
use relay_proto::forward_response::Kind as RespKind;
use relay_proto::{ForwardResponse, MAX_CHUNK};
use std::future::Future;
use std::pin::Pin;
use std::task::{ready, Context, Poll};
use tokio::time::Instant;

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
        let trace_id = self.guard.trace_id();
        tracing::warn!(call_id = self.call_id, trace_id = trace_id.map(tracing::field::display), outcome = outcome.as_str(), reason = %why, "response aborted after its head");
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
