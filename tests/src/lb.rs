//! Stream-placing load-balancer fixture: an HTTP/2 (h2c, prior knowledge) reverse proxy
//! on `127.0.0.1:0` in front of several backends (tunnel servers' agent-facing gRPC
//! listeners).
//!
//! It works like an L7 load balancer at the HTTP/2 *stream* level: each incoming request
//! (one gRPC stream such as `Tunnel.Connect`; an agent multiplexes many on one connection)
//! is placed on ONE backend chosen by a [`Policy`], and the request body, response head,
//! response body and trailers are proxied as streams in both directions. Nothing is
//! buffered beyond HTTP/2 flow-control windows, so bidi streams stay live for as long as
//! both ends want.
//!
//! The test owns placement: the policy can be swapped at runtime ([`LbHandle::set_policy`]),
//! explicit placements can be queued ([`LbHandle::set_next`]), backends can be marked down
//! or have their open streams reset. Each backend is reached through one shared HTTP/2
//! client connection (re-established by the client pool if it breaks), or with
//! [`LbBuilder::backend_connections`] through several, streams taking them in turn (a
//! server takes at most `max_concurrent_streams` streams a connection: a fleet of
//! thousands of agents needs more than one).
//!
//! This module must not panic on peer errors: a backend that refuses or resets yields a
//! `502`/`503` with `grpc-status: 14` (UNAVAILABLE) or a reset stream, never a crash.
//! Dropping the [`LbHandle`] stops the proxy and ends every stream it carries.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::fmt;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{header, HeaderValue, Request, Response, StatusCode, Uri, Version};
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use hyper::server::conn::http2;
use hyper::service::service_fn;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use parking_lot::{Mutex, MutexGuard};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};
use tokio_util::task::TaskTracker;
use tracing::debug;

/// Error type of proxied bodies.
type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A test-supplied placement function: stream number (0-based, counting every request
/// the load balancer received) -> backend index. It must not call back into the
/// [`LbHandle`].
pub type PlaceFn = Arc<dyn Fn(u64) -> usize + Send + Sync>;

/// How the load balancer picks a backend for each new stream.
///
/// `Uniform`, `RoundRobin`, `Weighted` and `Unfillable` skip backends marked down. An
/// explicit placement (`Scripted`, or an entry queued with [`LbHandle::set_next`]) on a
/// down or unknown backend is answered with `503` instead.
#[derive(Clone)]
pub enum Policy {
    /// Seeded uniform random choice over the backends that are up.
    Uniform,
    /// Round robin over the backends that are up.
    RoundRobin,
    /// The backend that is up with the fewest open streams, ties in round-robin order
    /// (HAProxy's `balance leastconn`, which counts each HTTP/2 stream it serves): a
    /// backend that restarted with none takes the new streams until it has caught up.
    LeastStreams,
    /// Seeded random choice weighted per backend index (zone skew, e.g. `[90, 5, 5]`).
    /// Missing entries weigh 0.
    Weighted(Vec<u32>),
    /// Uniform over the backends that are up except this index, which never gets a new
    /// stream (a server the load balancer will not fill).
    Unfillable(usize),
    /// The test decides each placement: see [`PlaceFn`] and [`Policy::scripted`].
    Scripted(PlaceFn),
}

impl Policy {
    /// A [`Policy::Scripted`] from a closure.
    pub fn scripted(f: impl Fn(u64) -> usize + Send + Sync + 'static) -> Self {
        Policy::Scripted(Arc::new(f))
    }
}

impl fmt::Debug for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Policy::Uniform => f.write_str("Uniform"),
            Policy::RoundRobin => f.write_str("RoundRobin"),
            Policy::LeastStreams => f.write_str("LeastStreams"),
            Policy::Weighted(w) => f.debug_tuple("Weighted").field(w).finish(),
            Policy::Unfillable(i) => f.debug_tuple("Unfillable").field(i).finish(),
            Policy::Scripted(_) => f.write_str("Scripted(..)"),
        }
    }
}

/// Entry point: `LoadBalancer::builder()`.
#[derive(Debug)]
pub struct LoadBalancer;

impl LoadBalancer {
    /// A builder with no backends, [`Policy::Uniform`] and seed 0.
    pub fn builder() -> LbBuilder {
        LbBuilder {
            backends: Vec::new(),
            policy: Policy::Uniform,
            seed: 0,
            max_concurrent_streams: 100_000,
            backend_connections: 1,
            names: Vec::new(),
        }
    }
}

/// Configures and starts a load balancer.
#[derive(Debug)]
pub struct LbBuilder {
    backends: Vec<SocketAddr>,
    policy: Policy,
    seed: u64,
    max_concurrent_streams: u32,
    backend_connections: usize,
    names: Vec<String>,
}

impl LbBuilder {
    /// Names the backends in order (a tunnel server's `server_id`): a stream whose request
    /// names one in the `relay-server` header (`relay_proto::AGENT_STEER`) goes to it when
    /// it is up, whatever the policy, as HAProxy's `use-server` rules on that header do.
    /// Other streams, and one naming a backend that is down or unknown, are placed by the
    /// policy.
    pub fn route_by_name(mut self, names: Vec<String>) -> Self {
        self.names = names;
        self
    }

    /// HTTP/2 connections to each backend (default 1, at least 1); new streams take them
    /// in turn.
    pub fn backend_connections(mut self, n: usize) -> Self {
        self.backend_connections = n.max(1);
        self
    }

    /// Adds a backend; its index is the number of backends added before it.
    pub fn backend(mut self, addr: SocketAddr) -> Self {
        self.backends.push(addr);
        self
    }

    /// Adds several backends in order.
    pub fn backends(mut self, addrs: impl IntoIterator<Item = SocketAddr>) -> Self {
        self.backends.extend(addrs);
        self
    }

    /// The initial placement policy.
    pub fn policy(mut self, policy: Policy) -> Self {
        self.policy = policy;
        self
    }

    /// Seed of the random policies, so a run's placements are reproducible.
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS advertised to clients (default 100000, so
    /// an agent's whole stream pool fits on one connection).
    pub fn max_concurrent_streams(mut self, max: u32) -> Self {
        self.max_concurrent_streams = max;
        self
    }

    /// Binds `127.0.0.1:0` and starts proxying.
    pub async fn spawn(self) -> std::io::Result<LbHandle> {
        let listener = TcpListener::bind(("127.0.0.1", 0)).await?;
        self.spawn_on(listener)
    }

    /// Starts proxying on an already-bound listener.
    pub fn spawn_on(self, listener: TcpListener) -> std::io::Result<LbHandle> {
        let addr = listener.local_addr()?;
        let cancel = CancellationToken::new();
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        // One client (pool) per connection: a pool keeps one HTTP/2 connection a backend.
        let clients = (0..self.backend_connections)
            .map(|_| {
                Client::builder(TokioExecutor::new())
                    .http2_only(true)
                    .pool_idle_timeout(None)
                    .build(connector.clone())
            })
            .collect();
        let backends = self
            .backends
            .into_iter()
            .map(|addr| Backend {
                addr: Mutex::new(addr),
                down: AtomicBool::new(false),
                placed: AtomicU64::new(0),
                open: Arc::new(AtomicU64::new(0)),
                reset: Mutex::new(cancel.child_token()),
            })
            .collect();
        let state = Arc::new(ProxyState {
            names: self.names,
            backends,
            placement: Mutex::new(Placement {
                policy: self.policy,
                queue: VecDeque::new(),
                rng: StdRng::seed_from_u64(self.seed),
                next_rr: 0,
                next_stream: 0,
            }),
            rejected: AtomicU64::new(0),
            clients,
            next_client: AtomicU64::new(0),
            cancel: cancel.clone(),
        });
        let tracker = TaskTracker::new();
        tracker.spawn(accept_loop(
            listener,
            state.clone(),
            tracker.clone(),
            self.max_concurrent_streams,
        ));
        Ok(LbHandle {
            addr,
            state,
            tracker,
        })
    }
}

/// A running load balancer. Dropping it stops the proxy and ends every stream.
#[derive(Debug)]
pub struct LbHandle {
    /// Where clients (agents) connect: `http://{addr}`.
    pub addr: SocketAddr,
    state: Arc<ProxyState>,
    tracker: TaskTracker,
}

impl LbHandle {
    /// `http://{addr}`, for clients.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Number of backends.
    pub fn backend_count(&self) -> usize {
        self.state.backends.len()
    }

    /// Replaces the placement policy; applies to streams arriving from now on.
    pub fn set_policy(&self, policy: Policy) {
        self.state.placement().policy = policy;
    }

    /// Replaces the queue of explicit placements: the next streams go to these backend
    /// indexes in order, ahead of the policy, which applies again once the queue is empty.
    pub fn set_next(&self, placements: Vec<usize>) {
        self.state.placement().queue = placements.into();
    }

    /// Streams placed per backend index so far (including ones whose backend then
    /// failed to answer).
    pub fn placements(&self) -> Vec<u64> {
        self.state
            .backends
            .iter()
            .map(|b| b.placed.load(Ordering::Relaxed))
            .collect()
    }

    /// Streams currently open per backend index (placed, response not yet finished).
    pub fn open_streams(&self) -> Vec<u64> {
        self.state
            .backends
            .iter()
            .map(|b| b.open.load(Ordering::Relaxed))
            .collect()
    }

    /// Streams refused with `503` because no backend could take them.
    pub fn rejected(&self) -> u64 {
        self.state.rejected.load(Ordering::Relaxed)
    }

    /// Marks a backend down (`true`) or up. Down backends get no new streams from the
    /// random policies; explicit placements on them get `503`. Open streams are untouched.
    ///
    /// # Panics
    /// If `idx` is not a backend index (a test bug).
    pub fn set_backend_down(&self, idx: usize, down: bool) {
        self.state.backend(idx).down.store(down, Ordering::Relaxed);
    }

    /// Points backend `idx` at a new address (a restarted server); applies to new streams.
    ///
    /// # Panics
    /// If `idx` is not a backend index (a test bug).
    pub fn set_backend_addr(&self, idx: usize, addr: SocketAddr) {
        *self.state.backend(idx).addr.lock() = addr;
    }

    /// Resets every stream currently open on backend `idx` (clients see the stream fail),
    /// as a load balancer losing its connection to that server would. New streams are
    /// placed as usual.
    ///
    /// # Panics
    /// If `idx` is not a backend index (a test bug).
    pub fn reset_backend(&self, idx: usize) {
        let fresh = self.state.cancel.child_token();
        let old = std::mem::replace(&mut *self.state.backend(idx).reset.lock(), fresh);
        old.cancel();
    }

    /// Stops accepting, ends every stream and waits (up to 5 s) for the proxy's tasks.
    pub async fn shutdown(self) {
        self.state.cancel.cancel();
        self.tracker.close();
        let _ = tokio::time::timeout(Duration::from_secs(5), self.tracker.wait()).await;
    }
}

impl Drop for LbHandle {
    fn drop(&mut self) {
        self.state.cancel.cancel();
    }
}

struct ProxyState {
    /// `LbBuilder::route_by_name`: backend names in index order.
    names: Vec<String>,
    backends: Vec<Backend>,
    placement: Mutex<Placement>,
    rejected: AtomicU64,
    clients: Vec<Client<HttpConnector, Incoming>>,
    /// Which client the next stream takes.
    next_client: AtomicU64,
    /// Stops the whole proxy; parent of every backend's reset token.
    cancel: CancellationToken,
}

impl fmt::Debug for ProxyState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProxyState")
            .field("backends", &self.backends.len())
            .finish_non_exhaustive()
    }
}

struct Backend {
    addr: Mutex<SocketAddr>,
    down: AtomicBool,
    placed: AtomicU64,
    open: Arc<AtomicU64>,
    /// Cancelled by `reset_backend`; replaced with a fresh child of `ProxyState::cancel`.
    reset: Mutex<CancellationToken>,
}

struct Placement {
    policy: Policy,
    queue: VecDeque<usize>,
    rng: StdRng,
    next_rr: usize,
    next_stream: u64,
}

/// Why a stream got no backend.
#[derive(Debug)]
enum Reject {
    NoBackendUp,
    Down(usize),
    Unknown(usize),
}

impl fmt::Display for Reject {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Reject::NoBackendUp => f.write_str("no backend available"),
            Reject::Down(i) => write!(f, "backend {i} is down"),
            Reject::Unknown(i) => write!(f, "no backend {i}"),
        }
    }
}

impl ProxyState {
    /// The client (connection) the next stream takes.
    fn client(&self) -> &Client<HttpConnector, Incoming> {
        let n = self.next_client.fetch_add(1, Ordering::Relaxed) as usize;
        &self.clients[n % self.clients.len()]
    }

    fn placement(&self) -> MutexGuard<'_, Placement> {
        self.placement.lock()
    }

    fn backend(&self, idx: usize) -> &Backend {
        match self.backends.get(idx) {
            Some(b) => b,
            None => panic!(
                "load balancer has {} backends, no index {idx}",
                self.backends.len()
            ),
        }
    }

    /// The backend `req` names (`LbBuilder::route_by_name`), when it is up.
    fn named(&self, req: &Request<Incoming>) -> Option<usize> {
        if self.names.is_empty() {
            return None;
        }
        let name = req.headers().get(relay_proto::AGENT_STEER)?.to_str().ok()?;
        let idx = self.names.iter().position(|n| n == name)?;
        let up = self
            .backends
            .get(idx)
            .is_some_and(|b| !b.down.load(Ordering::Relaxed));
        up.then_some(idx)
    }

    /// Picks the backend for the next stream.
    fn place(&self) -> Result<usize, Reject> {
        let up: Vec<bool> = self
            .backends
            .iter()
            .map(|b| !b.down.load(Ordering::Relaxed))
            .collect();
        let open: Vec<u64> = self
            .backends
            .iter()
            .map(|b| b.open.load(Ordering::Relaxed))
            .collect();
        let explicit = {
            let mut st = self.placement();
            let stream_no = st.next_stream;
            st.next_stream += 1;
            if let Some(idx) = st.queue.pop_front() {
                Ok(idx)
            } else if let Policy::Scripted(f) = &st.policy {
                // Called outside the lock below: the closure is test code.
                Err((f.clone(), stream_no))
            } else {
                let st = &mut *st;
                return choose(&st.policy, &up, &open, &mut st.rng, &mut st.next_rr)
                    .ok_or(Reject::NoBackendUp);
            }
        };
        let idx = explicit.unwrap_or_else(|(f, stream_no)| f(stream_no));
        match up.get(idx) {
            Some(true) => Ok(idx),
            Some(false) => Err(Reject::Down(idx)),
            None => Err(Reject::Unknown(idx)),
        }
    }
}

/// The policies but `Scripted` (handled by the caller), given which backends are up and
/// how many streams each has open. `None`: no eligible backend.
fn choose(
    policy: &Policy,
    up: &[bool],
    open: &[u64],
    rng: &mut StdRng,
    next_rr: &mut usize,
) -> Option<usize> {
    let uniform_except = |rng: &mut StdRng, except: Option<usize>| {
        let eligible: Vec<usize> = (0..up.len())
            .filter(|&i| up[i] && Some(i) != except)
            .collect();
        if eligible.is_empty() {
            None
        } else {
            Some(eligible[rng.gen_range(0..eligible.len())])
        }
    };
    match policy {
        Policy::Uniform => uniform_except(rng, None),
        Policy::Unfillable(except) => uniform_except(rng, Some(*except)),
        Policy::RoundRobin => {
            let n = up.len();
            (0..n)
                .map(|k| (*next_rr + k) % n)
                .find(|&i| up[i])
                .inspect(|&i| *next_rr = (i + 1) % n)
        }
        Policy::LeastStreams => {
            let n = up.len();
            // The first of the fewest from the rotation's start: ties take turns.
            (0..n)
                .map(|k| (*next_rr + k) % n)
                .filter(|&i| up[i])
                .min_by_key(|&i| open.get(i).copied().unwrap_or(0))
                .inspect(|&i| *next_rr = (i + 1) % n)
        }
        Policy::Weighted(weights) => {
            let weight = |i: usize| {
                if up[i] {
                    u64::from(weights.get(i).copied().unwrap_or(0))
                } else {
                    0
                }
            };
            let total: u64 = (0..up.len()).map(weight).sum();
            if total == 0 {
                return None;
            }
            let mut r = rng.gen_range(0..total);
            (0..up.len()).find(|&i| {
                let w = weight(i);
                if r < w {
                    true
                } else {
                    r -= w;
                    false
                }
            })
        }
        Policy::Scripted(_) => None,
    }
}

async fn accept_loop(
    listener: TcpListener,
    state: Arc<ProxyState>,
    tracker: TaskTracker,
    max_concurrent_streams: u32,
) {
    let mut builder = http2::Builder::new(TrackedExecutor(tracker.clone()));
    // Agents cancel opens the servers were slow to answer, and retire streams: a stand-in
    // for a load balancer must not end their connections for it (h2's guards would after
    // 20 resets of streams not yet accepted).
    builder
        .max_concurrent_streams(max_concurrent_streams)
        .max_pending_accept_reset_streams(1 << 20)
        .max_local_error_reset_streams(None);
    loop {
        // biased: once stopped, accept nothing more.
        let accepted = tokio::select! {
            biased;
            _ = state.cancel.cancelled() => return,
            r = listener.accept() => r,
        };
        match accepted {
            Ok((stream, peer)) => {
                tracker.spawn(serve_conn(stream, peer, state.clone(), builder.clone()));
            }
            Err(e) => {
                debug!(error = %e, "load balancer accept failed");
                // Back off so a persistent error (EMFILE) does not spin.
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    }
}

async fn serve_conn(
    stream: TcpStream,
    peer: SocketAddr,
    state: Arc<ProxyState>,
    builder: http2::Builder<TrackedExecutor>,
) {
    let _ = stream.set_nodelay(true);
    let cancel = state.cancel.clone();
    let svc = service_fn(move |req| proxy(state.clone(), req));
    let conn = builder.serve_connection(TokioIo::new(stream), svc);
    tokio::select! {
        biased;
        _ = cancel.cancelled() => {}
        r = conn => if let Err(e) = r {
            debug!(%peer, error = %e, "load balancer client connection ended");
        },
    }
}

/// Places one stream and proxies it.
async fn proxy(
    state: Arc<ProxyState>,
    mut req: Request<Incoming>,
) -> Result<Response<ProxyBody>, Infallible> {
    let placed = match state.named(&req) {
        Some(idx) => Ok(idx),
        None => state.place(),
    };
    let idx = match placed {
        Ok(idx) => idx,
        Err(reject) => {
            state.rejected.fetch_add(1, Ordering::Relaxed);
            debug!(reason = %reject, "load balancer refused stream");
            return Ok(unavailable(
                StatusCode::SERVICE_UNAVAILABLE,
                &reject.to_string(),
            ));
        }
    };
    let backend = &state.backends[idx];
    backend.placed.fetch_add(1, Ordering::Relaxed);
    let open = OpenGuard::new(backend.open.clone());
    let addr = *backend.addr.lock();
    let reset = backend.reset.lock().clone();

    let path = req
        .uri()
        .path_and_query()
        .map_or("/", |pq| pq.as_str())
        .to_owned();
    let uri: Uri = match format!("http://{addr}{path}").parse() {
        Ok(uri) => uri,
        Err(_) => return Ok(unavailable(StatusCode::BAD_REQUEST, "bad request path")),
    };
    *req.uri_mut() = uri;
    *req.version_mut() = Version::HTTP_2;
    req.headers_mut().remove(header::HOST);

    let res = tokio::select! {
        biased;
        _ = reset.cancelled() => {
            return Ok(unavailable(StatusCode::SERVICE_UNAVAILABLE, "backend reset by load balancer"));
        }
        res = state.client().request(req) => res,
    };
    match res {
        Ok(res) => Ok(res.map(|body| ProxyBody::stream(body, reset, open))),
        Err(e) => {
            debug!(backend = idx, %addr, error = %e, "load balancer backend request failed");
            Ok(unavailable(StatusCode::BAD_GATEWAY, "backend unavailable"))
        }
    }
}

/// A trailers-only gRPC UNAVAILABLE answer with a matching HTTP status, so both gRPC
/// and plain HTTP clients see the failure.
fn unavailable(status: StatusCode, message: &str) -> Response<ProxyBody> {
    let mut res = Response::new(ProxyBody::empty());
    *res.status_mut() = status;
    let h = res.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/grpc"),
    );
    h.insert("grpc-status", HeaderValue::from_static("14"));
    if let Ok(v) = HeaderValue::from_str(message) {
        h.insert("grpc-message", v);
    }
    res
}

/// Counts a stream as open on its backend until the response body is dropped.
struct OpenGuard(Arc<AtomicU64>);

impl OpenGuard {
    fn new(counter: Arc<AtomicU64>) -> Self {
        counter.fetch_add(1, Ordering::Relaxed);
        OpenGuard(counter)
    }
}

impl Drop for OpenGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Response body sent to the client: the backend's body frames (data and trailers) as
/// they come, failing the stream if the backend is reset or the proxy stops.
pub struct ProxyBody {
    inner: Option<Streaming>,
}

struct Streaming {
    body: Incoming,
    reset: Pin<Box<WaitForCancellationFutureOwned>>,
    _open: OpenGuard,
}

impl ProxyBody {
    fn empty() -> Self {
        ProxyBody { inner: None }
    }

    fn stream(body: Incoming, reset: CancellationToken, open: OpenGuard) -> Self {
        ProxyBody {
            inner: Some(Streaming {
                body,
                reset: Box::pin(reset.cancelled_owned()),
                _open: open,
            }),
        }
    }
}

impl fmt::Debug for ProxyBody {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProxyBody")
            .field("streaming", &self.inner.is_some())
            .finish()
    }
}

impl Body for ProxyBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        let Some(s) = this.inner.as_mut() else {
            return Poll::Ready(None);
        };
        if s.reset.as_mut().poll(cx).is_ready() {
            // Dropping the backend body resets the backend stream too.
            this.inner = None;
            return Poll::Ready(Some(Err("stream reset by load balancer".into())));
        }
        match Pin::new(&mut s.body).poll_frame(cx) {
            Poll::Ready(None) => {
                this.inner = None;
                Poll::Ready(None)
            }
            Poll::Ready(Some(r)) => Poll::Ready(Some(r.map_err(Into::into))),
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.as_ref().is_none_or(|s| s.body.is_end_stream())
    }

    fn size_hint(&self) -> SizeHint {
        self.inner
            .as_ref()
            .map_or_else(|| SizeHint::with_exact(0), |s| s.body.size_hint())
    }
}

/// Runs hyper's per-stream tasks on the proxy's tracker so `shutdown` can wait for them.
#[derive(Clone)]
struct TrackedExecutor(TaskTracker);

impl<F> hyper::rt::Executor<F> for TrackedExecutor
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    fn execute(&self, fut: F) {
        self.0.spawn(fut);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_robin_skips_down_backends() {
        let mut rng = StdRng::seed_from_u64(1);
        let mut rr = 0;
        let up = [true, false, true];
        let picks: Vec<_> = (0..4)
            .map(|_| choose(&Policy::RoundRobin, &up, &[0; 3], &mut rng, &mut rr))
            .collect();
        assert_eq!(picks, vec![Some(0), Some(2), Some(0), Some(2)]);
    }

    #[test]
    fn weighted_with_all_eligible_weight_down_has_no_choice() {
        let mut rng = StdRng::seed_from_u64(1);
        let mut rr = 0;
        let pick = choose(
            &Policy::Weighted(vec![0, 7]),
            &[true, false],
            &[0, 0],
            &mut rng,
            &mut rr,
        );
        assert_eq!(pick, None);
    }

    #[test]
    fn unfillable_alone_has_no_choice() {
        let mut rng = StdRng::seed_from_u64(1);
        let mut rr = 0;
        let pick = choose(&Policy::Unfillable(0), &[true], &[0], &mut rng, &mut rr);
        assert_eq!(pick, None);
    }

    #[test]
    fn least_streams_fills_the_emptiest_backend_that_is_up_and_ties_take_turns() {
        let mut rng = StdRng::seed_from_u64(1);
        let mut rr = 0;
        let up = [true, true, false, true];
        // A backend back from a restart holds nothing: every new stream goes there until
        // it has caught up with the others.
        let mut open = [40, 0, 0, 40];
        let mut picks = Vec::new();
        for _ in 0..82 {
            let i = choose(&Policy::LeastStreams, &up, &open, &mut rng, &mut rr).unwrap();
            open[i] += 1;
            picks.push(i);
        }
        assert!(picks[..40].iter().all(|&i| i == 1), "{picks:?}");
        assert!(!picks.contains(&2), "a backend that is down gets nothing");
        // Level: the next streams take turns over the three.
        assert_eq!(open, [54, 54, 0, 54]);
        let level: Vec<usize> = picks[40..43].to_vec();
        let mut sorted = level.clone();
        sorted.sort();
        assert_eq!(sorted, vec![0, 1, 3], "{level:?}");
        assert_eq!(
            choose(
                &Policy::LeastStreams,
                &[false, false],
                &[0, 0],
                &mut rng,
                &mut rr
            ),
            None
        );
    }
}
