//! Accepting connections with a bounded cost before the peer has proven who it is.
//!
//! Every listener of the relay accepts through [`incoming`], which holds each connection to
//! the limits of its [`ListenerGuard`]:
//! - **Connections**: at most `max_connections` open at once; one more is closed at accept.
//! - **TLS handshakes**: at most `max_handshakes` run at once past the ClientHello (the
//!   rest wait their turn, so a burst of reconnecting agents is served, not refused; a
//!   peer that connects and stays silent holds no slot), and each must finish within
//!   `handshake_timeout` of the accept, waiting included.
//! - **Authentication** (listeners whose protocol authenticates per stream, such as the
//!   tunnel server's agent listener): a connection that has not carried an authenticated
//!   stream within `auth_timeout` of its accept is closed, and each source address has a
//!   budget of `auth_failures` refused authentications per `auth_failure_window`; past
//!   it, the connection that failed is closed and the source's new connections are closed
//!   at accept until the window ends. The source is the TCP peer: behind a TCP load
//!   balancer every agent shares its address, so there set `auth_failures = 0` and limit
//!   at the load balancer instead (documented in README).
//! - **Logs**: refused connections, failed handshakes and refused authentications are
//!   logged at most [`LOG_BURST`] times per [`LOG_PERIOD`] per kind; the next line says how
//!   many were left out. Counters (`relay_listener_refused_total{listener, reason}`) count
//!   every one.
//!
//! The budget's bookkeeping ([`AuthBudget`]) is a plain table with `now` passed in; the
//! guard wraps it in a mutex and reads the clock.

use crate::tls::TlsServer;
use futures::Stream;
use parking_lot::Mutex;
use prometheus::{IntCounterVec, IntGaugeVec, Opts, Registry};
use serde::Deserialize;
use std::collections::HashMap;
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};
use tracing::{info, warn};

pub use crate::tls::MaybeTls;

/// Log lines of one kind allowed per [`LOG_PERIOD`].
pub const LOG_BURST: u64 = 10;
/// The period of [`LOG_BURST`].
pub const LOG_PERIOD: Duration = Duration::from_secs(10);
/// Source addresses the budget remembers; past it, expired entries are dropped and, if
/// none expired, the oldest window goes.
pub const MAX_TRACKED_SOURCES: usize = 65_536;

/// Limits of one listener before its peers authenticate. A TOML section such as the
/// tunnel server's `[agent_limits]`; every key is optional.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ListenerLimits {
    /// Connections open at once; one more is closed at accept.
    pub max_connections: usize,
    /// TLS handshakes running at once; more wait (within `handshake_timeout`).
    pub max_handshakes: usize,
    /// Longest from accept to a finished TLS handshake.
    #[serde(with = "humantime_serde")]
    pub handshake_timeout: Duration,
    /// A connection with no authenticated stream this long after accept is closed
    /// (0: never). Only listeners that authenticate per stream apply it.
    #[serde(with = "humantime_serde")]
    pub auth_timeout: Duration,
    /// Refused authentications one source address may cause per `auth_failure_window`
    /// before its connections are closed until the window ends (0: no budget).
    pub auth_failures: u32,
    #[serde(with = "humantime_serde")]
    pub auth_failure_window: Duration,
}

impl Default for ListenerLimits {
    fn default() -> Self {
        ListenerLimits {
            max_connections: 20_000,
            max_handshakes: 256,
            handshake_timeout: Duration::from_secs(10),
            auth_timeout: Duration::from_secs(10),
            auth_failures: 30,
            auth_failure_window: Duration::from_secs(60),
        }
    }
}

impl ListenerLimits {
    /// Limits of a listener whose peers authenticate by TLS or per request (no per-stream
    /// authentication to wait for): the same caps, no `auth_timeout` or budget.
    pub fn without_auth() -> Self {
        ListenerLimits {
            auth_timeout: Duration::ZERO,
            auth_failures: 0,
            ..ListenerLimits::default()
        }
    }

    /// Checks the values; the error names the key under `section`.
    pub fn validate(&self, section: &str) -> Result<(), crate::config::ConfigError> {
        use crate::config::ConfigError;
        if self.max_connections == 0 {
            return Err(ConfigError::invalid(
                format!("{section}.max_connections"),
                "must be at least 1",
            ));
        }
        if self.max_handshakes == 0 {
            return Err(ConfigError::invalid(
                format!("{section}.max_handshakes"),
                "must be at least 1",
            ));
        }
        if self.handshake_timeout < Duration::from_millis(100) {
            return Err(ConfigError::invalid(
                format!("{section}.handshake_timeout"),
                "must be at least 100ms",
            ));
        }
        if !self.auth_timeout.is_zero() && self.auth_timeout < Duration::from_millis(100) {
            return Err(ConfigError::invalid(
                format!("{section}.auth_timeout"),
                "must be 0 (off) or at least 100ms",
            ));
        }
        if self.auth_failures > 0 && self.auth_failure_window.is_zero() {
            return Err(ConfigError::invalid(
                format!("{section}.auth_failure_window"),
                "must be greater than zero when auth_failures is set",
            ));
        }
        Ok(())
    }
}

/// Per source address: refused authentications in the current window. Pure: `now` is
/// passed in.
#[derive(Debug)]
pub struct AuthBudget {
    allowed: u32,
    window: Duration,
    sources: HashMap<IpAddr, (Instant, u32)>,
}

impl AuthBudget {
    pub fn new(allowed: u32, window: Duration) -> Self {
        AuthBudget {
            allowed,
            window,
            sources: HashMap::new(),
        }
    }

    /// Records one refused authentication from `ip`; true when the source is now over its
    /// budget (and stays blocked until its window ends).
    pub fn failed(&mut self, ip: IpAddr, now: Instant) -> bool {
        if self.allowed == 0 {
            return false;
        }
        if !self.sources.contains_key(&ip) && self.sources.len() >= MAX_TRACKED_SOURCES {
            let window = self.window;
            self.sources
                .retain(|_, (start, _)| now.saturating_duration_since(*start) < window);
            if self.sources.len() >= MAX_TRACKED_SOURCES {
                if let Some(oldest) = self.sources.iter().min_by_key(|(_, (s, _))| *s) {
                    let oldest = *oldest.0;
                    self.sources.remove(&oldest);
                }
            }
        }
        let entry = self.sources.entry(ip).or_insert((now, 0));
        if now.saturating_duration_since(entry.0) >= self.window {
            *entry = (now, 0);
        }
        entry.1 = entry.1.saturating_add(1);
        entry.1 > self.allowed
    }

    /// Whether `ip` is over its budget in its current window.
    pub fn blocked(&self, ip: IpAddr, now: Instant) -> bool {
        self.allowed > 0
            && self.sources.get(&ip).is_some_and(|(start, n)| {
                *n > self.allowed && now.saturating_duration_since(*start) < self.window
            })
    }

    /// Source addresses remembered.
    pub fn len(&self) -> usize {
        self.sources.len()
    }

    pub fn is_empty(&self) -> bool {
        self.sources.is_empty()
    }
}

/// At most [`LOG_BURST`] lines per [`LOG_PERIOD`]; `allow` returns how many were left out
/// since the last line written, or `None` when this one is left out too.
#[derive(Debug)]
pub struct LogLimiter {
    state: Mutex<(Option<Instant>, u64)>,
    skipped: AtomicU64,
}

impl Default for LogLimiter {
    fn default() -> Self {
        LogLimiter {
            state: Mutex::new((None, 0)),
            skipped: AtomicU64::new(0),
        }
    }
}

impl LogLimiter {
    pub fn allow(&self) -> Option<u64> {
        self.allow_at(Instant::now())
    }

    pub fn allow_at(&self, now: Instant) -> Option<u64> {
        let mut st = self.state.lock();
        let (start, n) = &mut *st;
        if start.is_none_or(|s| now.saturating_duration_since(s) >= LOG_PERIOD) {
            *start = Some(now);
            *n = 0;
        }
        if *n < LOG_BURST {
            *n += 1;
            Some(self.skipped.swap(0, Ordering::Relaxed))
        } else {
            self.skipped.fetch_add(1, Ordering::Relaxed);
            None
        }
    }
}

/// The listener counters of one process (every listener adds its `listener` label).
#[derive(Clone)]
pub struct ListenerMetrics {
    refused: IntCounterVec,
    open: IntGaugeVec,
}

impl ListenerMetrics {
    pub fn register(registry: &Registry) -> prometheus::Result<Self> {
        let refused = IntCounterVec::new(
            Opts::new(
                "relay_listener_refused_total",
                "Connections closed before or instead of serving: reason max_connections, \
                 source_blocked, handshake_failed, handshake_timeout, auth_timeout, auth_budget",
            ),
            &["listener", "reason"],
        )?;
        let open = IntGaugeVec::new(
            Opts::new(
                "relay_listener_connections",
                "Connections open per listener",
            ),
            &["listener"],
        )?;
        registry.register(Box::new(refused.clone()))?;
        registry.register(Box::new(open.clone()))?;
        Ok(ListenerMetrics { refused, open })
    }
}

/// The limits, counters and budget of one listener.
pub struct ListenerGuard {
    name: &'static str,
    limits: ListenerLimits,
    connections: Arc<Semaphore>,
    handshakes: Arc<Semaphore>,
    budget: Mutex<AuthBudget>,
    metrics: ListenerMetrics,
    refused_logs: LogLimiter,
    handshake_logs: LogLimiter,
    auth_logs: LogLimiter,
}

impl ListenerGuard {
    pub fn new(name: &'static str, limits: ListenerLimits, metrics: ListenerMetrics) -> Arc<Self> {
        // Touch the series so dashboards see zeros, not gaps.
        for reason in REASONS {
            metrics.refused.with_label_values(&[name, reason]);
        }
        metrics.open.with_label_values(&[name]).set(0);
        Arc::new(ListenerGuard {
            name,
            connections: Arc::new(Semaphore::new(limits.max_connections)),
            handshakes: Arc::new(Semaphore::new(limits.max_handshakes)),
            budget: Mutex::new(AuthBudget::new(
                limits.auth_failures,
                limits.auth_failure_window,
            )),
            limits,
            metrics,
            refused_logs: LogLimiter::default(),
            handshake_logs: LogLimiter::default(),
            auth_logs: LogLimiter::default(),
        })
    }

    fn refuse(&self, reason: &'static str) {
        self.metrics
            .refused
            .with_label_values(&[self.name, reason])
            .inc();
    }

    /// A stream on `conn` proved its identity: the connection is no longer subject to
    /// `auth_timeout`.
    pub fn authenticated(&self, conn: Option<&ConnInfo>) {
        if let Some(c) = conn {
            c.state.authenticated.store(true, Ordering::Release);
        }
    }

    /// A stream on `conn` was refused for its credentials: counts against the source's
    /// budget, logs (rate-limited) and closes the connection once the source is over it.
    pub fn auth_failed(&self, conn: Option<&ConnInfo>, what: &str) {
        let Some(c) = conn else {
            return;
        };
        let over = c
            .remote_addr
            .is_some_and(|a| self.budget.lock().failed(a.ip(), Instant::now()));
        if let Some(skipped) = self.auth_logs.allow() {
            warn!(
                listener = self.name,
                peer = ?c.remote_addr,
                skipped,
                over_budget = over,
                "{what}"
            );
        }
        if over {
            self.refuse("auth_budget");
            c.state.close.cancel();
        }
    }

    fn source_blocked(&self, peer: SocketAddr) -> bool {
        self.limits.auth_failures > 0 && self.budget.lock().blocked(peer.ip(), Instant::now())
    }
}

const REASONS: [&str; 6] = [
    "max_connections",
    "source_blocked",
    "handshake_failed",
    "handshake_timeout",
    "auth_timeout",
    "auth_budget",
];

#[derive(Debug)]
struct ConnState {
    authenticated: AtomicBool,
    close: CancellationToken,
}

/// What a request learns about its connection (tonic puts it in the request's
/// extensions): the peer, and the handle [`ListenerGuard`] uses to mark it authenticated
/// or close it.
#[derive(Clone, Debug)]
pub struct ConnInfo {
    pub remote_addr: Option<SocketAddr>,
    pub local_addr: Option<SocketAddr>,
    /// The names (DNS and URI SANs) of the peer's verified client certificate; empty
    /// without one.
    pub peer_names: Arc<[String]>,
    state: Arc<ConnState>,
}

impl ConnInfo {
    /// The connection info of a tonic request accepted through [`incoming`].
    pub fn of<T>(request: &tonic::Request<T>) -> Option<&ConnInfo> {
        request.extensions().get::<ConnInfo>()
    }

    /// The peer of a tonic request accepted through [`incoming`], as text for logs.
    pub fn peer<T>(request: &tonic::Request<T>) -> String {
        Self::of(request)
            .and_then(|c| c.remote_addr)
            .map_or_else(|| "unknown".into(), |a| a.to_string())
    }
}

/// An accepted connection held to its listener's limits: counts toward
/// `max_connections` while open, and reads fail once it must close (no authenticated
/// stream within `auth_timeout`, or its source went over the failure budget).
pub struct Conn {
    io: MaybeTls,
    info: ConnInfo,
    auth_deadline: Option<Pin<Box<tokio::time::Sleep>>>,
    closed: Pin<Box<WaitForCancellationFutureOwned>>,
    guard: Arc<ListenerGuard>,
    _permit: OwnedSemaphorePermit,
}

impl Conn {
    /// Whether the peer presented a client certificate that verified.
    pub fn has_client_cert(&self) -> bool {
        self.io.has_client_cert()
    }

    /// The peer and local addresses.
    pub fn info(&self) -> &ConnInfo {
        &self.info
    }

    /// The TLS session, if any (for the peer's certificate).
    pub fn io(&self) -> &MaybeTls {
        &self.io
    }

    fn must_close(&mut self, cx: &mut Context<'_>) -> Option<std::io::Error> {
        if self.closed.as_mut().poll(cx).is_ready() {
            return Some(std::io::Error::new(
                std::io::ErrorKind::PermissionDenied,
                "connection closed: its source is over the authentication failure budget",
            ));
        }
        if let Some(deadline) = &mut self.auth_deadline {
            if self.info.state.authenticated.load(Ordering::Acquire) {
                self.auth_deadline = None;
            } else if deadline.as_mut().poll(cx).is_ready() {
                self.auth_deadline = None;
                self.info.state.close.cancel();
                self.guard.refuse("auth_timeout");
                if let Some(skipped) = self.guard.refused_logs.allow() {
                    info!(listener = self.guard.name, peer = ?self.info.remote_addr, skipped,
                        "connection closed: no authenticated stream within auth_timeout");
                }
                return Some(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "no authenticated stream within auth_timeout",
                ));
            }
        }
        None
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        self.guard
            .metrics
            .open
            .with_label_values(&[self.guard.name])
            .dec();
    }
}

impl AsyncRead for Conn {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        if let Some(e) = this.must_close(cx) {
            return Poll::Ready(Err(e));
        }
        Pin::new(&mut this.io).poll_read(cx, buf)
    }
}

impl AsyncWrite for Conn {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

impl tonic::transport::server::Connected for Conn {
    type ConnectInfo = ConnInfo;

    fn connect_info(&self) -> ConnInfo {
        self.info.clone()
    }
}

/// Accepts connections on `listener` with Nagle off, held to `guard`'s limits, running
/// TLS handshakes (when `tls` is set) concurrently so one slow client cannot stall the
/// accept loop. The stream yields only connections ready to serve.
pub fn incoming(
    listener: TcpListener,
    tls: Option<TlsServer>,
    guard: Arc<ListenerGuard>,
    stop: CancellationToken,
) -> impl Stream<Item = std::io::Result<Conn>> + Send + 'static {
    let (tx, rx) = mpsc::channel::<std::io::Result<Conn>>(64);
    tokio::spawn(async move {
        loop {
            let (tcp, peer): (TcpStream, SocketAddr) = tokio::select! {
                biased;
                _ = stop.cancelled() => return,
                _ = tx.closed() => return,
                r = listener.accept() => match r {
                    Ok(c) => c,
                    Err(e) => {
                        warn!(error = %e, "accept failed");
                        // Out of file descriptors or similar: give the process a moment.
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                },
            };
            let accepted = Instant::now();
            if guard.source_blocked(peer) {
                guard.refuse("source_blocked");
                if let Some(skipped) = guard.refused_logs.allow() {
                    info!(listener = guard.name, %peer, skipped, "connection closed: source over the authentication failure budget");
                }
                continue;
            }
            let Ok(permit) = guard.connections.clone().try_acquire_owned() else {
                guard.refuse("max_connections");
                if let Some(skipped) = guard.refused_logs.allow() {
                    warn!(listener = guard.name, %peer, skipped, max = guard.limits.max_connections,
                        "connection closed: max_connections open");
                }
                continue;
            };
            let _ = tcp.set_nodelay(true);
            let hs = guard.clone();
            let guard = guard.clone();
            let wrap = move |io: MaybeTls| {
                guard.metrics.open.with_label_values(&[guard.name]).inc();
                let state = Arc::new(ConnState {
                    authenticated: AtomicBool::new(false),
                    close: CancellationToken::new(),
                });
                let info = ConnInfo {
                    remote_addr: Some(peer),
                    local_addr: io.local_addr(),
                    peer_names: io.client_cert_names().into(),
                    state: state.clone(),
                };
                let auth_deadline = (!guard.limits.auth_timeout.is_zero()).then(|| {
                    Box::pin(tokio::time::sleep_until(
                        accepted + guard.limits.auth_timeout,
                    ))
                });
                Conn {
                    io,
                    info,
                    auth_deadline,
                    closed: Box::pin(state.close.clone().cancelled_owned()),
                    guard,
                    _permit: permit,
                }
            };
            match &tls {
                None => {
                    if tx.send(Ok(wrap(MaybeTls::Plain(tcp)))).await.is_err() {
                        return;
                    }
                }
                Some(tls) => {
                    let config = tls.config();
                    let tx = tx.clone();
                    tokio::spawn(async move {
                        let limit = hs.limits.handshake_timeout;
                        let handshake = async {
                            // Reading the ClientHello costs nothing; a handshake slot is
                            // taken only for the work after it, so peers that connect and
                            // stay silent hold no slot (only a connection, until the
                            // timeout).
                            let start = tokio_rustls::LazyConfigAcceptor::new(
                                rustls::server::Acceptor::default(),
                                tcp,
                            )
                            .await?;
                            let _turn = hs.handshakes.clone().acquire_owned().await;
                            start.into_stream(config).await
                        };
                        match tokio::time::timeout_at(accepted + limit, handshake).await {
                            Ok(Ok(s)) => {
                                let _ = tx.send(Ok(wrap(MaybeTls::Tls(Box::new(s))))).await;
                            }
                            Ok(Err(e)) => {
                                hs.refuse("handshake_failed");
                                if let Some(skipped) = hs.handshake_logs.allow() {
                                    info!(listener = hs.name, %peer, skipped, error = %e, "tls handshake refused");
                                }
                            }
                            Err(_) => {
                                hs.refuse("handshake_timeout");
                                if let Some(skipped) = hs.handshake_logs.allow() {
                                    info!(listener = hs.name, %peer, skipped, "tls handshake timed out");
                                }
                            }
                        }
                    });
                }
            }
        }
    });
    let mut rx = rx;
    futures::stream::poll_fn(move |cx| rx.poll_recv(cx))
}

#[cfg(test)]
mod tests;
