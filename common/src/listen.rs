//! Accepting connections with a bounded cost before the peer has proven who it is, and
//! while it holds nothing.
//!
//! Every listener of the relay accepts through [`incoming`], which holds each connection to
//! the limits of its [`ListenerGuard`]:
//! - **Connections**: at most `max_connections` open at once, and at most
//!   `max_connections_per_source` from one source (an IPv4 address, or an IPv6 /64); one
//!   more is closed at accept.
//! - **PROXY protocol**: a connection from an address in `proxy_protocol` (a TCP load
//!   balancer) must start with a PROXY v1 or v2 header ([`proxy`]) within
//!   `first_byte_timeout`; the client it names is the connection's source for every limit
//!   here, for logs and for what handlers see ([`ConnInfo::remote_addr`]). Other peers'
//!   bytes are never read as a header.
//! - **TLS handshakes**: at most `max_handshakes` hold a slot at once, and only while the
//!   server works on them: reading the ClientHello takes none, and a handshake waiting
//!   for the client's next flight gives its slot back ([`crate::socket`]); the rest wait their
//!   turn, so a burst of reconnecting agents is served, not refused. Each handshake must
//!   finish within `handshake_timeout` of the accept, waiting included.
//! - **First bytes**: after the handshake (on plain listeners, after the accept) a
//!   connection must send, within `first_byte_timeout`, enough bytes to tell its protocol
//!   (the 24-byte HTTP/2 preface, or the start of anything else, taken for HTTP/1). They
//!   are read here and replayed to the server, so hyper's protocol detection never waits.
//! - **Idle**: a connection that holds no request or stream ([`ConnInfo::hold`]) for
//!   `idle_timeout` is told so ([`ConnInfo::idle_notice`]: an HTTP server then closes it
//!   gracefully) and closed [`IDLE_GRACE`] later. Only servers that hold their requests
//!   may set it.
//! - **Authentication** (listeners whose protocol authenticates per stream, such as the
//!   tunnel server's agent listener): a connection that has not carried an authenticated
//!   stream within `auth_timeout` of its accept is closed; a connection counts toward
//!   `max_connections_per_token` of each tunnel id it authenticated (one more is refused
//!   its stream); and each source has a budget of `auth_failures` refused
//!   authentications per `auth_failure_window`; past it, the connection that failed is
//!   closed and the source's new connections are closed at accept until the window ends.
//! - **Partial frames** (gRPC listeners that install [`ListenerGuard::partial_frames_layer`]):
//!   half-received messages across all streams hold at most `max_partial_frame_bytes`
//!   ([`frames`]).
//! - **Logs**: refused connections, failed handshakes and refused authentications are
//!   logged at most [`LOG_BURST`] times per [`LOG_PERIOD`] per kind; the next line says how
//!   many were left out. Counters (`relay_listener_refused_total{listener, reason}`) count
//!   every one, and the per-source refusals are also counted by source
//!   (`relay_listener_source_refused_total`, the first [`MAX_NAMED_SOURCES`] sources by
//!   address, the rest as `other`).
//!
//! The budget's bookkeeping ([`AuthBudget`]) is a plain table with `now` passed in; the
//! guard wraps it in a mutex and reads the clock.

mod frames;
pub mod proxy;

pub use crate::socket::Socket;
pub use frames::{Charged, FrameBudget};

use crate::tls::TlsServer;
use futures::Stream;
use parking_lot::Mutex;
use prometheus::{IntCounterVec, IntGaugeVec, Opts, Registry};
use serde::Deserialize;
use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};
use tracing::{debug, info, warn};

pub use crate::tls::MaybeTls;

/// Log lines of one kind allowed per [`LOG_PERIOD`].
pub const LOG_BURST: u64 = 10;
/// The period of [`LOG_BURST`].
pub const LOG_PERIOD: Duration = Duration::from_secs(10);
/// Source addresses the budget remembers; past it, expired entries are dropped and, if
/// none expired, the oldest window goes.
pub const MAX_TRACKED_SOURCES: usize = 65_536;
/// Sources named in `relay_listener_source_refused_total`; later ones count as `other`.
pub const MAX_NAMED_SOURCES: usize = 64;
/// How long an idle connection that was told to close ([`ConnInfo::idle_notice`]) may take
/// to do so before its reads fail.
pub const IDLE_GRACE: Duration = Duration::from_secs(1);

/// An entry of `proxy_protocol`: an address (`10.0.0.5`) or a range (`10.0.0.0/24`).
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(try_from = "String")]
pub struct SourceNet {
    addr: IpAddr,
    len: u8,
}

impl TryFrom<String> for SourceNet {
    type Error = String;

    fn try_from(s: String) -> Result<Self, String> {
        s.parse()
    }
}

impl std::str::FromStr for SourceNet {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let (ip, len) = match s.split_once('/') {
            Some((ip, len)) => (ip, Some(len)),
            None => (s, None),
        };
        let addr: IpAddr = ip
            .trim()
            .parse()
            .map_err(|_| format!("{s:?} is not an address or an address range (10.0.0.0/24)"))?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let len = match len {
            None => max,
            Some(l) => l
                .trim()
                .parse::<u8>()
                .ok()
                .filter(|l| *l <= max)
                .ok_or_else(|| format!("{s:?}: prefix length must be 0 to {max}"))?,
        };
        Ok(SourceNet { addr, len })
    }
}

impl SourceNet {
    pub fn contains(&self, ip: IpAddr) -> bool {
        let ip = canonical(ip);
        match (self.addr, ip) {
            (IpAddr::V4(n), IpAddr::V4(a)) => {
                let mask = u32::MAX.checked_shl(32 - u32::from(self.len)).unwrap_or(0);
                u32::from(n) & mask == u32::from(a) & mask
            }
            (IpAddr::V6(n), IpAddr::V6(a)) => {
                let mask = u128::MAX
                    .checked_shl(128 - u32::from(self.len))
                    .unwrap_or(0);
                u128::from(n) & mask == u128::from(a) & mask
            }
            _ => false,
        }
    }
}

/// An IPv4-mapped IPv6 address as the IPv4 address it is.
fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}

/// What per-source limits count a peer as: its IPv4 address, or its IPv6 /64 (one host
/// commonly holds a whole /64).
pub fn source_key(ip: IpAddr) -> IpAddr {
    match canonical(ip) {
        IpAddr::V6(v6) => {
            let s = v6.segments();
            IpAddr::V6(Ipv6Addr::new(s[0], s[1], s[2], s[3], 0, 0, 0, 0))
        }
        v4 => v4,
    }
}

/// Limits of one listener. A TOML section such as the tunnel server's `[agent_limits]`;
/// every key is optional. The defaults are the agent listener's.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ListenerLimits {
    /// Connections open at once; one more is closed at accept.
    pub max_connections: usize,
    /// Connections open at once from one source (IPv4 address or IPv6 /64), so one host
    /// cannot take `max_connections` from everyone else (0: no cap).
    pub max_connections_per_source: usize,
    /// TLS handshakes the server works on at once; more wait (within
    /// `handshake_timeout`).
    pub max_handshakes: usize,
    /// Longest from accept to a finished TLS handshake.
    #[serde(with = "humantime_serde")]
    pub handshake_timeout: Duration,
    /// Longest from the handshake (plain: the accept) to the bytes that tell the
    /// connection's protocol; also bounds the PROXY header from the accept (0: no bound).
    #[serde(with = "humantime_serde")]
    pub first_byte_timeout: Duration,
    /// A connection that holds no request or stream this long is closed (0: never). Only
    /// listeners whose server marks its requests apply it.
    #[serde(with = "humantime_serde")]
    pub idle_timeout: Duration,
    /// A connection with no authenticated stream this long after accept is closed
    /// (0: never). Only listeners that authenticate per stream apply it.
    #[serde(with = "humantime_serde")]
    pub auth_timeout: Duration,
    /// Refused authentications one source may cause per `auth_failure_window` before its
    /// connections are closed until the window ends (0: no budget).
    pub auth_failures: u32,
    #[serde(with = "humantime_serde")]
    pub auth_failure_window: Duration,
    /// Connections that carried an authenticated stream of one tunnel id; a stream of it
    /// on one more connection is refused (0: no cap). Only listeners that authenticate
    /// per stream apply it.
    pub max_connections_per_token: usize,
    /// Bytes of half-received gRPC messages held across all the listener's streams; a
    /// stream whose message would pass it is ended (0: no bound). Only gRPC listeners
    /// apply it.
    pub max_partial_frame_bytes: usize,
    /// Load balancer addresses or ranges whose connections start with a PROXY protocol
    /// header (v1 or v2) naming the real client; connections from them without one are
    /// closed. Empty: no peer's header is read.
    pub proxy_protocol: Vec<SourceNet>,
}

impl Default for ListenerLimits {
    fn default() -> Self {
        ListenerLimits {
            max_connections: 20_000,
            max_connections_per_source: 4_096,
            max_handshakes: 256,
            handshake_timeout: Duration::from_secs(10),
            first_byte_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(60),
            auth_timeout: Duration::from_secs(10),
            auth_failures: 30,
            auth_failure_window: Duration::from_secs(60),
            max_connections_per_token: 64,
            max_partial_frame_bytes: 64 << 20,
            proxy_protocol: Vec::new(),
        }
    }
}

impl ListenerLimits {
    /// Limits of a listener whose peers are the relay's own processes, authenticated by
    /// TLS or per request (the forward and registry listeners): the same connection,
    /// handshake and first-byte bounds; no per-source or per-token cap, idle timeout,
    /// `auth_timeout` or budget.
    pub fn without_auth() -> Self {
        ListenerLimits {
            max_connections_per_source: 0,
            idle_timeout: Duration::ZERO,
            auth_timeout: Duration::ZERO,
            auth_failures: 0,
            max_connections_per_token: 0,
            max_partial_frame_bytes: 0,
            ..ListenerLimits::default()
        }
    }

    /// The admin listener's (every binary's `admin_listen`): a few operators and
    /// Prometheus, so few connections, and idle ones closed.
    pub fn admin() -> Self {
        ListenerLimits {
            max_connections: 256,
            idle_timeout: Duration::from_secs(120),
            ..ListenerLimits::without_auth()
        }
    }

    /// Checks the values; the error names the key under `section`.
    pub fn validate(&self, section: &str) -> Result<(), crate::config::ConfigError> {
        use crate::config::ConfigError;
        let key = |k: &str| format!("{section}.{k}");
        if self.max_connections == 0 {
            return Err(ConfigError::invalid(
                key("max_connections"),
                "must be at least 1",
            ));
        }
        if self.max_handshakes == 0 {
            return Err(ConfigError::invalid(
                key("max_handshakes"),
                "must be at least 1",
            ));
        }
        if self.handshake_timeout < Duration::from_millis(100) {
            return Err(ConfigError::invalid(
                key("handshake_timeout"),
                "must be at least 100ms",
            ));
        }
        for (k, v) in [
            ("first_byte_timeout", self.first_byte_timeout),
            ("idle_timeout", self.idle_timeout),
            ("auth_timeout", self.auth_timeout),
        ] {
            if !v.is_zero() && v < Duration::from_millis(100) {
                return Err(ConfigError::invalid(
                    key(k),
                    "must be 0 (off) or at least 100ms",
                ));
            }
        }
        if self.auth_failures > 0 && self.auth_failure_window.is_zero() {
            return Err(ConfigError::invalid(
                key("auth_failure_window"),
                "must be greater than zero when auth_failures is set",
            ));
        }
        if self.max_partial_frame_bytes > 0 && self.max_partial_frame_bytes < 64 << 10 {
            return Err(ConfigError::invalid(
                key("max_partial_frame_bytes"),
                "must be 0 (no bound) or at least 65536 (one body chunk)",
            ));
        }
        if !self.proxy_protocol.is_empty() && self.first_byte_timeout.is_zero() {
            return Err(ConfigError::invalid(
                key("first_byte_timeout"),
                "must be set when proxy_protocol is: it bounds the wait for the header",
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
    by_source: IntCounterVec,
    open: IntGaugeVec,
    partial: IntGaugeVec,
}

impl ListenerMetrics {
    pub fn register(registry: &Registry) -> prometheus::Result<Self> {
        let m = Self::detached()?;
        registry.register(Box::new(m.refused.clone()))?;
        registry.register(Box::new(m.by_source.clone()))?;
        registry.register(Box::new(m.open.clone()))?;
        registry.register(Box::new(m.partial.clone()))?;
        Ok(m)
    }

    /// Counters in no registry (for a listener whose process registered its own).
    pub fn detached() -> prometheus::Result<Self> {
        let refused = IntCounterVec::new(
            Opts::new(
                "relay_listener_refused_total",
                "Connections (or, for token_connections and partial_frames, streams) closed \
                 before or instead of serving: reason max_connections, source_connections, \
                 source_blocked, proxy_header, handshake_failed, handshake_timeout, \
                 first_byte_timeout, idle_timeout, auth_timeout, auth_budget, \
                 token_connections, partial_frames",
            ),
            &["listener", "reason"],
        )?;
        let by_source = IntCounterVec::new(
            Opts::new(
                "relay_listener_source_refused_total",
                "Connections closed for their source (reason source_connections, \
                 source_blocked, auth_budget), by source: the real client behind a PROXY \
                 protocol load balancer; the first 64 sources by address, later ones as other",
            ),
            &["listener", "reason", "source"],
        )?;
        let open = IntGaugeVec::new(
            Opts::new(
                "relay_listener_connections",
                "Connections open per listener",
            ),
            &["listener"],
        )?;
        let partial = IntGaugeVec::new(
            Opts::new(
                "relay_listener_partial_frame_bytes",
                "Bytes of half-received gRPC messages the listener holds across its streams \
                 (bounded by max_partial_frame_bytes)",
            ),
            &["listener"],
        )?;
        Ok(ListenerMetrics {
            refused,
            by_source,
            open,
            partial,
        })
    }
}

/// A tunnel id's connections were at `max_connections_per_token`.
#[derive(Debug, thiserror::Error)]
#[error("tunnel id {tunnel_id} has {max} connections open to this server (its max_connections_per_token)")]
pub struct TokenCapError {
    pub tunnel_id: String,
    pub max: usize,
}

/// The limits, counters and budget of one listener.
pub struct ListenerGuard {
    name: &'static str,
    limits: ListenerLimits,
    connections: Arc<Semaphore>,
    handshakes: Arc<Semaphore>,
    budget: Mutex<AuthBudget>,
    /// Connections open per source key (entries at zero are removed).
    sources: Mutex<HashMap<IpAddr, usize>>,
    /// Connections per tunnel id that authenticated on them.
    tokens: Mutex<HashMap<Arc<str>, usize>>,
    /// Sources with their own `source` label.
    named: Mutex<HashSet<IpAddr>>,
    frames: Option<Arc<FrameBudget>>,
    metrics: ListenerMetrics,
    refused_logs: LogLimiter,
    handshake_logs: LogLimiter,
    auth_logs: LogLimiter,
    /// Base of the connections' idle stamps.
    epoch: Instant,
}

impl ListenerGuard {
    pub fn new(name: &'static str, limits: ListenerLimits, metrics: ListenerMetrics) -> Arc<Self> {
        // Touch the series so dashboards see zeros, not gaps.
        for reason in REASONS {
            metrics.refused.with_label_values(&[name, reason]);
        }
        metrics.open.with_label_values(&[name]).set(0);
        let frames = (limits.max_partial_frame_bytes > 0).then(|| {
            let refused = metrics
                .refused
                .with_label_values(&[name, "partial_frames"]);
            let logs = LogLimiter::default();
            let max = limits.max_partial_frame_bytes;
            let gauge = metrics.partial.with_label_values(&[name]);
            FrameBudget::new(max, gauge, move |len| {
                refused.inc();
                if let Some(skipped) = logs.allow() {
                    warn!(listener = name, message_bytes = len, max_partial_frame_bytes = max, skipped,
                        "stream ended: its message would pass the listener's bound on half-received messages");
                }
            })
        });
        Arc::new(ListenerGuard {
            name,
            connections: Arc::new(Semaphore::new(limits.max_connections)),
            handshakes: Arc::new(Semaphore::new(limits.max_handshakes)),
            budget: Mutex::new(AuthBudget::new(
                limits.auth_failures,
                limits.auth_failure_window,
            )),
            sources: Mutex::new(HashMap::new()),
            tokens: Mutex::new(HashMap::new()),
            named: Mutex::new(HashSet::new()),
            frames,
            limits,
            metrics,
            refused_logs: LogLimiter::default(),
            handshake_logs: LogLimiter::default(),
            auth_logs: LogLimiter::default(),
            epoch: Instant::now(),
        })
    }

    pub fn limits(&self) -> &ListenerLimits {
        &self.limits
    }

    fn refuse(&self, reason: &'static str) {
        self.metrics
            .refused
            .with_label_values(&[self.name, reason])
            .inc();
    }

    /// [`Self::refuse`], also counted by source.
    fn refuse_source(&self, reason: &'static str, ip: IpAddr) {
        self.refuse(reason);
        let ip = canonical(ip);
        let label = {
            let mut named = self.named.lock();
            if named.contains(&ip) || named.len() < MAX_NAMED_SOURCES {
                named.insert(ip);
                ip.to_string()
            } else {
                "other".to_string()
            }
        };
        self.metrics
            .by_source
            .with_label_values(&[self.name, reason, &label])
            .inc();
    }

    /// The budget of half-received gRPC messages, when `max_partial_frame_bytes` is set.
    pub fn frame_budget(&self) -> Option<&Arc<FrameBudget>> {
        self.frames.as_ref()
    }

    /// A tonic server layer that charges every request body's half-received messages to
    /// [`Self::frame_budget`] (a pass-through without one).
    pub fn partial_frames_layer(
        &self,
    ) -> tower::util::MapRequestLayer<
        impl Fn(http::Request<tonic::body::Body>) -> http::Request<tonic::body::Body>
            + Clone
            + Send
            + Sync
            + 'static,
    > {
        let budget = self.frames.clone();
        tower::util::MapRequestLayer::new(
            move |req: http::Request<tonic::body::Body>| match &budget {
                Some(b) => req.map(|body| tonic::body::Body::new(b.wrap(body))),
                None => req,
            },
        )
    }

    /// A stream on `conn` proved its identity: the connection is no longer subject to
    /// `auth_timeout`. (Without a tunnel id: no per-token cap.)
    pub fn authenticated(&self, conn: Option<&ConnInfo>) {
        if let Some(c) = conn {
            c.state.authenticated.store(true, Ordering::Release);
        }
    }

    /// A stream of `tunnel_id` on `conn` proved its identity: the connection counts toward
    /// the tunnel id's `max_connections_per_token` (refused when one more would pass it)
    /// and is no longer subject to `auth_timeout`.
    pub fn authenticate(
        &self,
        conn: Option<&ConnInfo>,
        tunnel_id: &str,
    ) -> Result<(), TokenCapError> {
        let Some(c) = conn else {
            return Ok(());
        };
        let max = self.limits.max_connections_per_token;
        if max > 0 {
            let mut mine = c.state.tokens.lock();
            if !mine.iter().any(|t| &**t == tunnel_id) {
                let key: Arc<str> = Arc::from(tunnel_id);
                let mut all = self.tokens.lock();
                let n = all.entry(key.clone()).or_insert(0);
                if *n >= max {
                    drop(all);
                    self.refuse("token_connections");
                    if let Some(skipped) = self.refused_logs.allow() {
                        warn!(listener = self.name, peer = ?c.remote_addr, %tunnel_id, max, skipped,
                            "agent stream refused: its tunnel id is at max_connections_per_token");
                    }
                    return Err(TokenCapError {
                        tunnel_id: tunnel_id.to_string(),
                        max,
                    });
                }
                *n += 1;
                mine.push(key);
            }
        }
        c.state.authenticated.store(true, Ordering::Release);
        Ok(())
    }

    /// A stream on `conn` was refused for its credentials: counts against the source's
    /// budget, logs (rate-limited) and closes the connection once the source is over it.
    pub fn auth_failed(&self, conn: Option<&ConnInfo>, what: &str) {
        let Some(c) = conn else {
            return;
        };
        let over = c.remote_addr.is_some_and(|a| {
            self.budget
                .lock()
                .failed(source_key(a.ip()), Instant::now())
        });
        if let Some(skipped) = self.auth_logs.allow() {
            warn!(
                listener = self.name,
                peer = ?c.remote_addr,
                via = ?c.proxied_by,
                skipped,
                over_budget = over,
                "{what}"
            );
        }
        if over {
            if let Some(a) = c.remote_addr {
                self.refuse_source("auth_budget", a.ip());
            }
            c.state.close.cancel();
        }
    }

    fn source_blocked(&self, peer: SocketAddr) -> bool {
        self.limits.auth_failures > 0
            && self
                .budget
                .lock()
                .blocked(source_key(peer.ip()), Instant::now())
    }

    fn trusts(&self, ip: IpAddr) -> bool {
        self.limits.proxy_protocol.iter().any(|n| n.contains(ip))
    }

    /// The source's checks at admission: not over its failure budget, under its
    /// connection cap. `None` when refused (counted and logged).
    fn admit(self: &Arc<Self>, peer: SocketAddr, via: Option<SocketAddr>) -> Option<SourceSlot> {
        if self.source_blocked(peer) {
            self.refuse_source("source_blocked", peer.ip());
            if let Some(skipped) = self.refused_logs.allow() {
                info!(listener = self.name, %peer, ?via, skipped,
                    "connection closed: source over the authentication failure budget");
            }
            return None;
        }
        let max = self.limits.max_connections_per_source;
        if max == 0 {
            return Some(SourceSlot(None));
        }
        let key = source_key(peer.ip());
        {
            let mut sources = self.sources.lock();
            let n = sources.entry(key).or_insert(0);
            if *n < max {
                *n += 1;
                return Some(SourceSlot(Some((self.clone(), key))));
            }
        }
        self.refuse_source("source_connections", peer.ip());
        if let Some(skipped) = self.refused_logs.allow() {
            warn!(listener = self.name, %peer, ?via, skipped, max,
                "connection closed: its source has max_connections_per_source open");
        }
        None
    }

    fn release_token(&self, key: &Arc<str>) {
        let mut all = self.tokens.lock();
        if let Some(n) = all.get_mut(key) {
            *n -= 1;
            if *n == 0 {
                all.remove(key);
            }
        }
    }

    /// Takes the connection from accept to ready to serve: the PROXY header (from a
    /// trusted load balancer), the source's admission, the TLS handshake and the first
    /// bytes. `None` when it was refused or gave up (counted and logged).
    #[allow(clippy::too_many_arguments)]
    async fn open(
        self: Arc<Self>,
        mut tcp: TcpStream,
        lb: SocketAddr,
        slot: Option<SourceSlot>,
        tls: Option<TlsServer>,
        permit: OwnedSemaphorePermit,
        accepted: Instant,
    ) -> Option<Conn> {
        let (peer, via, slot) = match slot {
            Some(slot) => (lb, None, slot),
            None => {
                // Validation requires `first_byte_timeout` with `proxy_protocol`; the
                // handshake's bound stands in if a caller built limits without it.
                let limit = match self.limits.first_byte_timeout {
                    d if d.is_zero() => self.limits.handshake_timeout,
                    d => d,
                };
                let header = tokio::time::timeout_at(accepted + limit, proxy::read(&mut tcp)).await;
                let peer = match header {
                    Ok(Ok(peer)) => peer.unwrap_or(lb),
                    Ok(Err(e)) => {
                        self.refuse("proxy_header");
                        if let Some(skipped) = self.refused_logs.allow() {
                            warn!(listener = self.name, load_balancer = %lb, skipped, error = %e,
                                "connection closed: bad PROXY protocol header");
                        }
                        return None;
                    }
                    Err(_) => {
                        self.refuse("proxy_header");
                        if let Some(skipped) = self.refused_logs.allow() {
                            warn!(listener = self.name, load_balancer = %lb, skipped,
                                "connection closed: no PROXY protocol header within first_byte_timeout");
                        }
                        return None;
                    }
                };
                let slot = self.admit(peer, Some(lb))?;
                (peer, Some(lb), slot)
            }
        };
        let mut io = match tls {
            None => MaybeTls::Plain(tcp),
            Some(tls) => {
                let limit = self.limits.handshake_timeout;
                match tokio::time::timeout_at(accepted + limit, self.handshake(tcp, &tls)).await {
                    Ok(Ok(s)) => MaybeTls::Tls(Box::new(s)),
                    Ok(Err(e)) => {
                        self.refuse("handshake_failed");
                        if let Some(skipped) = self.handshake_logs.allow() {
                            info!(listener = self.name, %peer, ?via, skipped, error = %e, "tls handshake refused");
                        }
                        return None;
                    }
                    Err(_) => {
                        self.refuse("handshake_timeout");
                        if let Some(skipped) = self.handshake_logs.allow() {
                            info!(listener = self.name, %peer, ?via, skipped, "tls handshake timed out");
                        }
                        return None;
                    }
                }
            }
        };
        let first = self.limits.first_byte_timeout;
        let prefix = if first.is_zero() {
            Vec::new()
        } else {
            // `auth_timeout` runs from the accept, so it may end the wait first.
            let mut deadline = (Instant::now() + first, "first_byte_timeout");
            let auth = self.limits.auth_timeout;
            if !auth.is_zero() && accepted + auth < deadline.0 {
                deadline = (accepted + auth, "auth_timeout");
            }
            match tokio::time::timeout_at(deadline.0, first_bytes(&mut io)).await {
                Ok(Ok(p)) => p,
                Ok(Err(e)) => {
                    debug!(listener = self.name, %peer, error = %e, "connection ended before its first request");
                    return None;
                }
                Err(_) => {
                    self.refuse(deadline.1);
                    if let Some(skipped) = self.refused_logs.allow() {
                        info!(listener = self.name, %peer, ?via, skipped, timeout = deadline.1,
                            "connection closed: nothing that tells its protocol in time");
                    }
                    return None;
                }
            }
        };
        self.metrics.open.with_label_values(&[self.name]).inc();
        let state = Arc::new(ConnState {
            authenticated: AtomicBool::new(false),
            close: CancellationToken::new(),
            idle: CancellationToken::new(),
            active: AtomicUsize::new(0),
            idle_since_ms: AtomicU64::new(ms_since(self.epoch, accepted)),
            epoch: self.epoch,
            tokens: Mutex::new(Vec::new()),
        });
        let info = ConnInfo {
            remote_addr: Some(peer),
            local_addr: io.local_addr(),
            proxied_by: via,
            peer_names: io.client_cert_names().into(),
            state: state.clone(),
        };
        let auth_deadline = (!self.limits.auth_timeout.is_zero()).then(|| {
            Box::pin(tokio::time::sleep_until(
                accepted + self.limits.auth_timeout,
            ))
        });
        let idle = (!self.limits.idle_timeout.is_zero()).then(|| IdleTimer {
            sleep: Box::pin(tokio::time::sleep_until(
                accepted + self.limits.idle_timeout,
            )),
            grace_until: None,
        });
        Some(Conn {
            io,
            prefix,
            replayed: 0,
            info,
            auth_deadline,
            idle,
            closed: Box::pin(state.close.clone().cancelled_owned()),
            guard: self,
            _source: slot,
            _permit: permit,
        })
    }

    /// The TLS handshake, holding a handshake slot only while this server works on it
    /// (see [`crate::socket`]).
    async fn handshake(
        &self,
        tcp: TcpStream,
        tls: &TlsServer,
    ) -> std::io::Result<tokio_rustls::server::TlsStream<Socket>> {
        // Reading the ClientHello costs nothing; a slot is taken only for the work after
        // it, so peers that connect and stay silent hold no slot (only a connection,
        // until the timeout).
        let start = tokio_rustls::LazyConfigAcceptor::new(
            rustls::server::Acceptor::default(),
            Socket::new(tcp),
        )
        .await?;
        let turn = self.handshakes.clone().acquire_owned().await.ok();
        // The ClientHello is processed (key exchange, signature) in this call.
        let mut accept = start.into_stream(tls.config());
        match accept.get_mut() {
            Some(s) => s.arm(self.handshakes.clone(), turn),
            None => drop(turn),
        }
        let mut s = accept.await?;
        s.get_mut().0.disarm();
        Ok(s)
    }
}

fn ms_since(epoch: Instant, t: Instant) -> u64 {
    t.saturating_duration_since(epoch).as_millis() as u64
}

/// The HTTP/2 client preface: 24 bytes.
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Reads until the bytes tell the protocol: the whole HTTP/2 preface, or a byte where it
/// differs (anything else, HTTP/1 for the front). Reads no further.
async fn first_bytes<R: AsyncRead + Unpin>(io: &mut R) -> std::io::Result<Vec<u8>> {
    let mut buf = vec![0u8; H2_PREFACE.len()];
    let mut have = 0;
    loop {
        let n = io.read(&mut buf[have..]).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        have += n;
        if have == H2_PREFACE.len() || !H2_PREFACE.starts_with(&buf[..have]) {
            buf.truncate(have);
            return Ok(buf);
        }
    }
}

/// One connection's place in its source's count.
struct SourceSlot(Option<(Arc<ListenerGuard>, IpAddr)>);

impl Drop for SourceSlot {
    fn drop(&mut self) {
        if let Some((guard, key)) = self.0.take() {
            let mut sources = guard.sources.lock();
            if let Some(n) = sources.get_mut(&key) {
                *n -= 1;
                if *n == 0 {
                    sources.remove(&key);
                }
            }
        }
    }
}

const REASONS: [&str; 12] = [
    "max_connections",
    "source_connections",
    "source_blocked",
    "proxy_header",
    "handshake_failed",
    "handshake_timeout",
    "first_byte_timeout",
    "idle_timeout",
    "auth_timeout",
    "auth_budget",
    "token_connections",
    "partial_frames",
];

#[derive(Debug)]
struct ConnState {
    authenticated: AtomicBool,
    /// Cancelled to close the connection (its source went over the budget).
    close: CancellationToken,
    /// Cancelled when the connection has been idle for `idle_timeout`.
    idle: CancellationToken,
    /// Requests or streams in flight ([`Held`]).
    active: AtomicUsize,
    /// When the last one ended (or the accept), in ms since `epoch`.
    idle_since_ms: AtomicU64,
    epoch: Instant,
    /// Tunnel ids whose `max_connections_per_token` this connection counts toward.
    tokens: Mutex<Vec<Arc<str>>>,
}

/// A request or stream in flight on a connection: while one is held, the connection is
/// not idle. Dropping it ends it.
#[derive(Debug)]
pub struct Held(Arc<ConnState>);

impl Drop for Held {
    fn drop(&mut self) {
        if self.0.active.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0
                .idle_since_ms
                .store(ms_since(self.0.epoch, Instant::now()), Ordering::Release);
        }
    }
}

/// A response body that holds its connection's [`Held`] until it is dropped (sent or
/// abandoned).
#[derive(Debug)]
pub struct HeldBody<B> {
    body: B,
    _held: Option<Held>,
}

impl<B> HeldBody<B> {
    pub fn new(body: B, held: Option<Held>) -> Self {
        HeldBody { body, _held: held }
    }
}

impl<B: http_body::Body + Unpin> http_body::Body for HeldBody<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<B::Data>, B::Error>>> {
        Pin::new(&mut self.get_mut().body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

/// What a request learns about its connection (tonic puts it in the request's
/// extensions): the peer, and the handle [`ListenerGuard`] uses to mark it authenticated
/// or close it.
#[derive(Clone, Debug)]
pub struct ConnInfo {
    /// The client: the TCP peer, or the one a trusted load balancer's PROXY header named.
    pub remote_addr: Option<SocketAddr>,
    pub local_addr: Option<SocketAddr>,
    /// The load balancer whose PROXY header named `remote_addr`, if any.
    pub proxied_by: Option<SocketAddr>,
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

    /// Marks a request or stream in flight until the returned value is dropped: the
    /// connection is not idle meanwhile.
    pub fn hold(&self) -> Held {
        self.state.active.fetch_add(1, Ordering::AcqRel);
        Held(self.state.clone())
    }

    /// Resolves once the connection has held nothing for `idle_timeout`: the server
    /// should close it now (gracefully); its reads fail [`IDLE_GRACE`] later.
    pub fn idle_notice(&self) -> WaitForCancellationFutureOwned {
        self.state.idle.clone().cancelled_owned()
    }
}

/// The idle deadline of a connection.
struct IdleTimer {
    sleep: Pin<Box<tokio::time::Sleep>>,
    /// Set once the connection was told it is idle: its reads fail then.
    grace_until: Option<Instant>,
}

/// An accepted connection held to its listener's limits: counts toward
/// `max_connections` (and its source's and tunnel ids' caps) while open, replays the
/// bytes read to tell its protocol, and reads fail once it must close (no authenticated
/// stream within `auth_timeout`, idle for `idle_timeout`, or its source went over the
/// failure budget).
pub struct Conn {
    io: MaybeTls,
    /// The first bytes, read to tell the protocol, replayed before the socket's.
    prefix: Vec<u8>,
    replayed: usize,
    info: ConnInfo,
    auth_deadline: Option<Pin<Box<tokio::time::Sleep>>>,
    idle: Option<IdleTimer>,
    closed: Pin<Box<WaitForCancellationFutureOwned>>,
    guard: Arc<ListenerGuard>,
    _source: SourceSlot,
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
        self.poll_idle(cx)
    }

    /// The idle deadline: re-armed while requests are held and from when the last one
    /// ended; once it passes, the server is told and reads fail [`IDLE_GRACE`] later.
    fn poll_idle(&mut self, cx: &mut Context<'_>) -> Option<std::io::Error> {
        let idle = self.idle.as_mut()?;
        let state = &self.info.state;
        let timeout = self.guard.limits.idle_timeout;
        while idle.sleep.as_mut().poll(cx).is_ready() {
            let now = Instant::now();
            if state.active.load(Ordering::Acquire) > 0 {
                idle.grace_until = None;
                idle.sleep.as_mut().reset(now + timeout);
                continue;
            }
            if let Some(until) = idle.grace_until {
                if now >= until {
                    return Some(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        "connection closed: idle for idle_timeout",
                    ));
                }
                idle.sleep.as_mut().reset(until);
                continue;
            }
            let since =
                state.epoch + Duration::from_millis(state.idle_since_ms.load(Ordering::Acquire));
            let due = since + timeout;
            if now < due {
                idle.sleep.as_mut().reset(due);
                continue;
            }
            if !state.idle.is_cancelled() {
                state.idle.cancel();
                self.guard.refuse("idle_timeout");
                if let Some(skipped) = self.guard.refused_logs.allow() {
                    debug!(listener = self.guard.name, peer = ?self.info.remote_addr, skipped,
                        "closing a connection idle for idle_timeout");
                }
            }
            idle.grace_until = Some(now + IDLE_GRACE);
            idle.sleep.as_mut().reset(now + IDLE_GRACE);
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
        let tokens = std::mem::take(&mut *self.info.state.tokens.lock());
        for t in &tokens {
            self.guard.release_token(t);
        }
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
        if this.replayed < this.prefix.len() {
            let rest = &this.prefix[this.replayed..];
            let n = rest.len().min(buf.remaining());
            buf.put_slice(&rest[..n]);
            this.replayed += n;
            if this.replayed == this.prefix.len() {
                this.prefix = Vec::new();
                this.replayed = 0;
            }
            return Poll::Ready(Ok(()));
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

/// Accepts connections on `listener` with Nagle off, held to `guard`'s limits. Each
/// connection's opening (PROXY header, TLS handshake, first bytes) runs in its own task,
/// so one slow client cannot stall the accept loop. The stream yields only connections
/// ready to serve.
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
            // A direct peer is checked at once, so a blocked or capped source costs no
            // task; a load balancer's connection once its header names the client.
            let slot = if guard.trusts(peer.ip()) {
                None
            } else {
                match guard.admit(peer, None) {
                    Some(s) => Some(s),
                    None => continue,
                }
            };
            let Ok(permit) = guard.connections.clone().try_acquire_owned() else {
                guard.refuse("max_connections");
                if let Some(skipped) = guard.refused_logs.allow() {
                    warn!(listener = guard.name, %peer, skipped, max = guard.limits.max_connections,
                        "connection closed: max_connections open");
                }
                continue;
            };
            let _ = tcp.set_nodelay(true);
            let (guard, tls, tx) = (guard.clone(), tls.clone(), tx.clone());
            tokio::spawn(async move {
                if let Some(conn) = guard.open(tcp, peer, slot, tls, permit, accepted).await {
                    let _ = tx.send(Ok(conn)).await;
                }
            });
        }
    });
    let mut rx = rx;
    futures::stream::poll_fn(move |cx| rx.poll_recv(cx))
}

#[cfg(test)]
mod tests;
