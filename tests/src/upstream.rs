//! Simulated upstream origin (the customer's HTTP service behind the agent), for tests,
//! the fleet load tester and the local demo. Serves HTTP/1.1 and h2c (prior knowledge)
//! on a listener the caller bound.
//!
//! Routes:
//! - `GET /hello` -> `200 "hello from upstream\n"`
//! - `ANY /echo` (and `/echo/...`) -> `200`, request echoed: headers `x-echo-method`, `x-echo-path`
//!   (path and query), `x-echo-headers` (request headers as a JSON object, repeated
//!   names joined with `", "`), and the request body streamed back as it arrives
//! - `GET /bytes/{n}` -> `n` bytes, byte `i` = [`pattern_byte`]`(i)`, streamed in
//!   [`BYTES_CHUNK`] chunks without ever holding `n` bytes
//! - `GET /slow/{ms}` -> waits `ms`, then `200 "slow\n"`
//! - `GET /status/{code}` -> that status (200..=599), empty body
//! - `GET /delay-body/{ms}` -> head immediately, body `"delayed body\n"` after `ms`
//! - `GET /trickle/{n}/{ms}` -> `n` chunks of 1 KiB of the [`pattern_byte`] pattern, one
//!   every `ms`: a long answer whose bytes keep coming
//! - `ANY /stall-body/{ms}` -> reads nothing of the request body for `ms`, then reads it
//!   all and answers `200 "read {n} bytes\n"`: an upstream that stops reading a body
//!   (`crate::fault::StalledUpload`)
//! - anything else -> `404` (`405` for a wrong method on a known path)
//!
//! Every request first waits the configured [`Latency`]. [`UpstreamStats`] counts
//! requests in flight, served (last body frame handed to the connection) and cancelled
//! (the client went away before the response was complete).
//!
//! This module must not panic on any input and must not buffer whole bodies.

use std::convert::Infallible;
use std::fmt;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{header, HeaderMap, HeaderValue, Method, Request, Response, StatusCode};
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Sleep;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::debug;

/// Chunk size of `/bytes/{n}` bodies.
pub const BYTES_CHUNK: usize = 64 * 1024;

/// How long [`serve`] lets open connections finish after its shutdown future completes.
pub const DRAIN_GRACE: Duration = Duration::from_secs(5);

/// Byte `i` of a `/bytes/{n}` body.
pub fn pattern_byte(i: u64) -> u8 {
    (i % 251) as u8
}

/// The pattern, long enough that any chunk is one slice of it.
static PATTERN: LazyLock<Bytes> =
    LazyLock::new(|| (0..(BYTES_CHUNK as u64 + 251)).map(pattern_byte).collect());

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Delay added before every response head.
#[derive(Clone, Default)]
pub enum Latency {
    /// No added delay.
    #[default]
    None,
    /// The same delay for every request.
    Fixed(Duration),
    /// A delay drawn per request (a distribution for the load tester).
    Sampled(Arc<dyn Fn() -> Duration + Send + Sync>),
}

impl Latency {
    fn sample(&self) -> Duration {
        match self {
            Latency::None => Duration::ZERO,
            Latency::Fixed(d) => *d,
            Latency::Sampled(f) => f(),
        }
    }
}

impl fmt::Debug for Latency {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Latency::None => f.write_str("None"),
            Latency::Fixed(d) => f.debug_tuple("Fixed").field(d).finish(),
            Latency::Sampled(_) => f.write_str("Sampled(..)"),
        }
    }
}

/// Behaviour of the simulated upstream.
#[derive(Clone, Debug, Default)]
pub struct UpstreamConfig {
    /// Delay before every response head, to simulate a real service's response time.
    pub latency: Latency,
}

/// Request counters, shared between the server and whoever watches it.
#[derive(Clone, Debug, Default)]
pub struct UpstreamStats(Arc<Counters>);

#[derive(Debug, Default)]
struct Counters {
    served: AtomicU64,
    body_bytes: AtomicU64,
    in_flight: AtomicU64,
    cancelled: AtomicU64,
}

impl UpstreamStats {
    /// Requests whose response was sent completely.
    pub fn served(&self) -> u64 {
        self.0.served.load(Ordering::Relaxed)
    }

    /// Requests received and not yet completed or cancelled.
    pub fn in_flight(&self) -> u64 {
        self.0.in_flight.load(Ordering::Relaxed)
    }

    /// Requests whose client went away before the response was complete.
    pub fn cancelled(&self) -> u64 {
        self.0.cancelled.load(Ordering::Relaxed)
    }

    /// Response body bytes handed to the connections so far: what stopped moving once
    /// every download is held up somewhere on the way to its caller.
    pub fn body_bytes(&self) -> u64 {
        self.0.body_bytes.load(Ordering::Relaxed)
    }
}

/// Entry point: `Upstream::builder()`.
#[derive(Debug)]
pub struct Upstream;

impl Upstream {
    /// A builder with no latency.
    pub fn builder() -> UpstreamBuilder {
        UpstreamBuilder {
            config: UpstreamConfig::default(),
        }
    }
}

/// Configures and starts an upstream.
#[derive(Debug)]
pub struct UpstreamBuilder {
    config: UpstreamConfig,
}

impl UpstreamBuilder {
    /// A fixed delay before every response head.
    pub fn latency(mut self, latency: Duration) -> Self {
        self.config.latency = Latency::Fixed(latency);
        self
    }

    /// A delay drawn per request from `f`.
    pub fn latency_fn(mut self, f: impl Fn() -> Duration + Send + Sync + 'static) -> Self {
        self.config.latency = Latency::Sampled(Arc::new(f));
        self
    }

    /// Binds `127.0.0.1:0` and starts serving.
    pub async fn spawn(self) -> std::io::Result<UpstreamHandle> {
        let listener = TcpListener::bind(("127.0.0.1", 0)).await?;
        self.spawn_on(listener)
    }

    /// Starts serving on an already-bound listener.
    pub fn spawn_on(self, listener: TcpListener) -> std::io::Result<UpstreamHandle> {
        let addr = listener.local_addr()?;
        let stats = UpstreamStats::default();
        let cancel = CancellationToken::new();
        let task = tokio::spawn(run(
            listener,
            self.config,
            stats.clone(),
            cancel.clone().cancelled_owned(),
            Duration::ZERO,
        ));
        Ok(UpstreamHandle {
            addr,
            stats,
            cancel,
            task: Some(task),
        })
    }
}

/// A running upstream. Dropping it stops the server and drops its connections.
#[derive(Debug)]
pub struct UpstreamHandle {
    /// Where it listens: `http://{addr}`.
    pub addr: SocketAddr,
    stats: UpstreamStats,
    cancel: CancellationToken,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl UpstreamHandle {
    /// `http://{addr}`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The live counters (cloneable, outlive the handle).
    pub fn stats(&self) -> UpstreamStats {
        self.stats.clone()
    }

    /// Requests whose response was sent completely.
    pub fn served(&self) -> u64 {
        self.stats.served()
    }

    /// Requests received and not yet completed or cancelled.
    pub fn in_flight(&self) -> u64 {
        self.stats.in_flight()
    }

    /// Requests whose client went away before the response was complete.
    pub fn cancelled(&self) -> u64 {
        self.stats.cancelled()
    }

    /// Stops the server and waits until it has closed its listener and connections.
    pub async fn shutdown(mut self) {
        self.cancel.cancel();
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

impl Drop for UpstreamHandle {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

/// Serves until `shutdown` completes, then lets open connections finish for up to
/// [`DRAIN_GRACE`]. For the demo binary.
pub async fn serve(
    listener: TcpListener,
    config: UpstreamConfig,
    shutdown: impl Future<Output = ()> + Send,
) {
    serve_with_stats(listener, config, UpstreamStats::default(), shutdown).await;
}

/// [`serve`], counting into `stats`.
pub async fn serve_with_stats(
    listener: TcpListener,
    config: UpstreamConfig,
    stats: UpstreamStats,
    shutdown: impl Future<Output = ()> + Send,
) {
    run(listener, config, stats, shutdown, DRAIN_GRACE).await;
}

async fn run(
    listener: TcpListener,
    config: UpstreamConfig,
    stats: UpstreamStats,
    shutdown: impl Future<Output = ()> + Send,
    grace: Duration,
) {
    let state = Arc::new(State { config, stats });
    let drain = CancellationToken::new();
    let stop = CancellationToken::new();
    let tracker = TaskTracker::new();
    let builder = auto::Builder::new(TokioExecutor::new());
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        // biased: once shutdown is asked, accept nothing more.
        let accepted = tokio::select! {
            biased;
            _ = &mut shutdown => break,
            r = listener.accept() => r,
        };
        match accepted {
            Ok((stream, peer)) => {
                tracker.spawn(serve_conn(
                    stream,
                    peer,
                    state.clone(),
                    builder.clone(),
                    drain.clone(),
                    stop.clone(),
                ));
            }
            Err(e) => {
                debug!(error = %e, "upstream accept failed");
                // Back off so a persistent error (EMFILE) does not spin.
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    }
    drop(listener);
    tracker.close();
    drain.cancel();
    if tokio::time::timeout(grace, tracker.wait()).await.is_err() {
        stop.cancel();
        tracker.wait().await;
    }
}

async fn serve_conn(
    stream: TcpStream,
    peer: SocketAddr,
    state: Arc<State>,
    builder: auto::Builder<TokioExecutor>,
    drain: CancellationToken,
    stop: CancellationToken,
) {
    let _ = stream.set_nodelay(true);
    let svc = service_fn(move |req| handle(state.clone(), req));
    let conn = builder.serve_connection(TokioIo::new(stream), svc);
    let mut conn = std::pin::pin!(conn);
    let mut draining = false;
    loop {
        // biased: a hard stop wins over draining, which wins over progress.
        tokio::select! {
            biased;
            _ = stop.cancelled() => return,
            _ = drain.cancelled(), if !draining => {
                draining = true;
                conn.as_mut().graceful_shutdown();
            }
            r = conn.as_mut() => {
                if let Err(e) = r {
                    debug!(%peer, error = %e, "upstream connection ended");
                }
                return;
            }
        }
    }
}

struct State {
    config: UpstreamConfig,
    stats: UpstreamStats,
}

async fn handle(state: Arc<State>, req: Request<Incoming>) -> Result<Response<UpBody>, Infallible> {
    let guard = RequestGuard::new(state.stats.clone());
    let latency = state.config.latency.sample();
    if !latency.is_zero() {
        tokio::time::sleep(latency).await;
    }
    let head_only = req.method() == Method::HEAD;
    let (status, headers, kind) = route(req).await;
    let body = UpBody::new(kind, guard, head_only);
    let mut res = Response::new(body);
    *res.status_mut() = status;
    *res.headers_mut() = headers;
    Ok(res)
}

/// Status, headers and body of one request.
async fn route(req: Request<Incoming>) -> (StatusCode, HeaderMap, Kind) {
    let path = req.uri().path().to_owned();
    let segments: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    let is_get = matches!(*req.method(), Method::GET | Method::HEAD);
    let text = |status: StatusCode, s: &'static str| {
        let mut h = HeaderMap::new();
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain; charset=utf-8"),
        );
        (status, h, Kind::full(Bytes::from_static(s.as_bytes())))
    };
    let ms_arg = |s: &str| s.parse::<u64>().ok().map(Duration::from_millis);
    match segments.as_slice() {
        ["echo", ..] => echo(req),
        ["stall-body", ms] => match ms_arg(ms) {
            Some(d) => {
                tokio::time::sleep(d).await;
                let mut body = req.into_body();
                let mut n = 0u64;
                while let Some(frame) = body.frame().await {
                    match frame {
                        Ok(f) => n += f.data_ref().map_or(0, |d| d.len() as u64),
                        Err(_) => return text(StatusCode::BAD_REQUEST, "request body broke\n"),
                    }
                }
                let mut h = HeaderMap::new();
                h.insert(
                    header::CONTENT_TYPE,
                    HeaderValue::from_static("text/plain; charset=utf-8"),
                );
                (
                    StatusCode::OK,
                    h,
                    Kind::full(format!("read {n} bytes\n").into()),
                )
            }
            None => text(StatusCode::BAD_REQUEST, "bad milliseconds\n"),
        },
        [known, ..]
            if !is_get
                && matches!(
                    *known,
                    "hello" | "bytes" | "slow" | "status" | "delay-body" | "trickle"
                ) =>
        {
            text(StatusCode::METHOD_NOT_ALLOWED, "method not allowed\n")
        }
        ["hello"] => text(StatusCode::OK, "hello from upstream\n"),
        ["bytes", n] => match n.parse::<u64>() {
            Ok(n) => {
                let mut h = HeaderMap::new();
                h.insert(
                    header::CONTENT_TYPE,
                    HeaderValue::from_static("application/octet-stream"),
                );
                (StatusCode::OK, h, Kind::Pattern { pos: 0, len: n })
            }
            Err(_) => text(StatusCode::BAD_REQUEST, "bad byte count\n"),
        },
        ["slow", ms] => match ms_arg(ms) {
            Some(d) => {
                tokio::time::sleep(d).await;
                text(StatusCode::OK, "slow\n")
            }
            None => text(StatusCode::BAD_REQUEST, "bad milliseconds\n"),
        },
        ["status", code] => match code.parse::<u16>().ok().filter(|c| (200..=599).contains(c)) {
            Some(code) => match StatusCode::from_u16(code) {
                Ok(status) => (status, HeaderMap::new(), Kind::Full(None)),
                Err(_) => text(StatusCode::BAD_REQUEST, "bad status\n"),
            },
            None => text(StatusCode::BAD_REQUEST, "bad status\n"),
        },
        ["trickle", n, ms] => match (n.parse::<u64>(), ms_arg(ms)) {
            (Ok(n), Some(every)) => {
                let mut h = HeaderMap::new();
                h.insert(
                    header::CONTENT_TYPE,
                    HeaderValue::from_static("application/octet-stream"),
                );
                let kind = Kind::Trickle {
                    left: n,
                    every,
                    sleep: Box::pin(tokio::time::sleep(every)),
                };
                (StatusCode::OK, h, kind)
            }
            _ => text(StatusCode::BAD_REQUEST, "bad chunk count or milliseconds\n"),
        },
        ["delay-body", ms] => match ms_arg(ms) {
            Some(d) => {
                let (status, h, _) = text(StatusCode::OK, "");
                let kind = Kind::Delayed {
                    sleep: Box::pin(tokio::time::sleep(d)),
                    then: Some(Bytes::from_static(b"delayed body\n")),
                };
                (status, h, kind)
            }
            None => text(StatusCode::BAD_REQUEST, "bad milliseconds\n"),
        },
        _ => text(StatusCode::NOT_FOUND, "not found\n"),
    }
}

fn echo(req: Request<Incoming>) -> (StatusCode, HeaderMap, Kind) {
    let (parts, body) = req.into_parts();
    let mut h = HeaderMap::new();
    let mut put = |name: &'static str, value: &str| {
        if let Ok(v) = HeaderValue::from_str(value) {
            h.insert(name, v);
        }
    };
    put("x-echo-method", parts.method.as_str());
    put(
        "x-echo-path",
        parts.uri.path_and_query().map_or("/", |pq| pq.as_str()),
    );
    let mut map = serde_json::Map::new();
    for (name, value) in &parts.headers {
        let value = String::from_utf8_lossy(value.as_bytes());
        match map.get_mut(name.as_str()) {
            Some(serde_json::Value::String(prev)) => {
                prev.push_str(", ");
                prev.push_str(&value);
            }
            _ => {
                map.insert(name.as_str().to_owned(), value.into_owned().into());
            }
        }
    }
    put(
        "x-echo-headers",
        &serde_json::Value::Object(map).to_string(),
    );
    if let Some(ct) = parts.headers.get(header::CONTENT_TYPE) {
        h.insert(header::CONTENT_TYPE, ct.clone());
    }
    (StatusCode::OK, h, Kind::Echo(body))
}

/// Counts one request: in flight from arrival until completed or dropped.
struct RequestGuard {
    stats: UpstreamStats,
    done: bool,
}

impl RequestGuard {
    fn new(stats: UpstreamStats) -> Self {
        stats.0.in_flight.fetch_add(1, Ordering::Relaxed);
        RequestGuard { stats, done: false }
    }

    fn complete(&mut self) {
        if !self.done {
            self.done = true;
            self.stats.0.served.fetch_add(1, Ordering::Relaxed);
            self.stats.0.in_flight.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

impl Drop for RequestGuard {
    fn drop(&mut self) {
        if !self.done {
            self.stats.0.cancelled.fetch_add(1, Ordering::Relaxed);
            self.stats.0.in_flight.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

/// What a response body produces.
enum Kind {
    /// At most one chunk.
    Full(Option<Bytes>),
    /// The request body, frame by frame.
    Echo(Incoming),
    /// `/bytes/{n}`: bytes `pos..len` of the pattern still to send.
    Pattern { pos: u64, len: u64 },
    /// One chunk after a delay.
    Delayed {
        sleep: Pin<Box<Sleep>>,
        then: Option<Bytes>,
    },
    /// `left` chunks of [`TRICKLE_CHUNK`] bytes, one every `every`.
    Trickle {
        left: u64,
        every: Duration,
        sleep: Pin<Box<Sleep>>,
    },
}

/// Chunk size of `/trickle/{n}/{ms}` bodies.
pub const TRICKLE_CHUNK: usize = 1024;

impl Kind {
    fn full(b: Bytes) -> Self {
        Kind::Full((!b.is_empty()).then_some(b))
    }

    fn is_end(&self) -> bool {
        match self {
            Kind::Full(b) => b.is_none(),
            Kind::Echo(body) => body.is_end_stream(),
            Kind::Pattern { pos, len } => pos >= len,
            Kind::Delayed { then, .. } => then.is_none(),
            Kind::Trickle { left, .. } => *left == 0,
        }
    }

    fn poll(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self {
            Kind::Full(b) => Poll::Ready(b.take().map(|b| Ok(Frame::data(b)))),
            Kind::Echo(body) => Pin::new(body)
                .poll_frame(cx)
                .map(|f| f.map(|r| r.map_err(Into::into))),
            Kind::Pattern { pos, len } => {
                if *pos >= *len {
                    return Poll::Ready(None);
                }
                // Both fit in usize: `start` < 251 and `n` <= BYTES_CHUNK.
                let start = (*pos % 251) as usize;
                let n = (*len - *pos).min(BYTES_CHUNK as u64) as usize;
                *pos += n as u64;
                Poll::Ready(Some(Ok(Frame::data(PATTERN.slice(start..start + n)))))
            }
            Kind::Delayed { sleep, then } => {
                if then.is_none() {
                    return Poll::Ready(None);
                }
                match sleep.as_mut().poll(cx) {
                    Poll::Ready(()) => Poll::Ready(then.take().map(|b| Ok(Frame::data(b)))),
                    Poll::Pending => Poll::Pending,
                }
            }
            Kind::Trickle { left, every, sleep } => {
                if *left == 0 {
                    return Poll::Ready(None);
                }
                match sleep.as_mut().poll(cx) {
                    Poll::Ready(()) => {
                        *left -= 1;
                        let next = tokio::time::Instant::now() + *every;
                        sleep.as_mut().reset(next);
                        Poll::Ready(Some(Ok(Frame::data(PATTERN.slice(0..TRICKLE_CHUNK)))))
                    }
                    Poll::Pending => Poll::Pending,
                }
            }
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            Kind::Full(b) => SizeHint::with_exact(b.as_ref().map_or(0, |b| b.len() as u64)),
            Kind::Echo(body) => body.size_hint(),
            Kind::Pattern { pos, len } => SizeHint::with_exact(len.saturating_sub(*pos)),
            Kind::Delayed { then, .. } => {
                SizeHint::with_exact(then.as_ref().map_or(0, |b| b.len() as u64))
            }
            Kind::Trickle { left, .. } => SizeHint::with_exact(left * TRICKLE_CHUNK as u64),
        }
    }
}

/// Response body of the upstream; completes its request's accounting when the last
/// frame is handed out, and counts a cancellation if dropped before that.
pub struct UpBody {
    kind: Kind,
    guard: RequestGuard,
}

impl UpBody {
    fn new(kind: Kind, mut guard: RequestGuard, head_only: bool) -> Self {
        // An empty body (or a HEAD answer) may never be polled: it is complete already.
        if head_only || kind.is_end() {
            guard.complete();
        }
        UpBody { kind, guard }
    }
}

impl fmt::Debug for UpBody {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UpBody").finish_non_exhaustive()
    }
}

impl Body for UpBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        let polled = this.kind.poll(cx);
        if let Poll::Ready(Some(Ok(frame))) = &polled {
            let n = frame.data_ref().map_or(0, |d| d.len() as u64);
            this.guard
                .stats
                .0
                .body_bytes
                .fetch_add(n, Ordering::Relaxed);
        }
        match &polled {
            Poll::Ready(None) => this.guard.complete(),
            Poll::Ready(Some(Ok(_))) if this.kind.is_end() => this.guard.complete(),
            _ => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.kind.is_end()
    }

    fn size_hint(&self) -> SizeHint {
        self.kind.size_hint()
    }
}
