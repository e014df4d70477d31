//! The request replay: [`RequestBody`] turns the caller's body into `BodyChunk` frames of
//! at most `MAX_CHUNK` bytes, pulled by the Forward.Call request stream only as fast as
//! gRPC/HTTP2 flow control lets it send (back-pressure). It hands the body to one forward
//! attempt at a time and keeps the frames sent so far, up to a replay limit, so that a
//! retry on another tunnel server can replay them and then go on pulling the rest from the
//! caller; beyond the limit the call is no longer retryable and the kept frames are
//! dropped.
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
//!
//! It must not read the response: that is `response`.

use crate::error::RequestBodyError;
use bytes::Bytes;
use http_body::Body;
use http_body_util::combinators::UnsyncBoxBody;
use parking_lot::{Mutex, MutexGuard};
use relay_proto::forward_request::Kind as ReqKind;
use relay_proto::{BodyChunk, CallHead, ForwardRequest, MAX_CHUNK};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll, Waker};

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

struct ReplayState {
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
    shared: Arc<Mutex<ReplayState>>,
    call_id: u64,
}

impl RequestBody {
    /// `body` is `None` when the request has none (no body frames will be sent).
    /// `replay_limit`: body bytes kept for a retry (see [`replay_limit`]).
    pub fn new(body: Option<CallerBody>, call_id: u64, replay_limit: usize) -> Self {
        let shared = ReplayState {
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

    fn lock(&self) -> MutexGuard<'_, ReplayState> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use futures::{FutureExt, StreamExt};
    use http_body::Frame;
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
