//! One listener's limits, counters and budget ([`ListenerGuard`]), the opening of an
//! accepted connection under them (the PROXY header, the source's admission, the TLS
//! handshake and the first bytes), and the connection they hold ([`Conn`]): what a request
//! learns about it ([`ConnInfo`]) and the marks that keep it from being idle ([`Held`],
//! [`HeldBody`]). The guard opens connections and each connection gives its place back to
//! the guard, so the two live in one module.

use super::budget::{AuthBudget, LogLimiter};
use super::limits::canonical;
use super::metrics::{ListenerMetrics, REASONS};
use super::{
    proxy, source_key, FrameBudget, ListenerLimits, MaybeTls, Socket, IDLE_GRACE, MAX_NAMED_SOURCES,
};
use crate::tls::TlsServer;
use parking_lot::Mutex;
use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};
use tracing::{debug, info, warn};

/// A tunnel id's connections were at `max_connections_per_token`.
#[derive(Debug, thiserror::Error)]
#[error("tunnel id {tunnel_id} has {max} connections open to this server (its max_connections_per_token)")]
pub struct TokenCapError {
    pub tunnel_id: String,
    pub max: usize,
}

/// The limits, counters and budget of one listener.
pub struct ListenerGuard {
    pub(super) name: &'static str,
    pub(super) limits: ListenerLimits,
    pub(super) connections: Arc<Semaphore>,
    pub(super) handshakes: Arc<Semaphore>,
    pub(super) budget: Mutex<AuthBudget>,
    /// Connections open per source key (entries at zero are removed).
    pub(super) sources: Mutex<HashMap<IpAddr, usize>>,
    /// Connections per tunnel id that authenticated on them.
    pub(super) tokens: Mutex<HashMap<Arc<str>, usize>>,
    /// Sources with their own `source` label.
    pub(super) named: Mutex<HashSet<IpAddr>>,
    pub(super) frames: Option<Arc<FrameBudget>>,
    pub(super) metrics: ListenerMetrics,
    pub(super) refused_logs: LogLimiter,
    pub(super) handshake_logs: LogLimiter,
    pub(super) auth_logs: LogLimiter,
    /// Base of the connections' idle stamps.
    pub(super) epoch: Instant,
    /// Connections opening at once, when the server set a gate ([`super::admission`]).
    pub(super) admission: std::sync::OnceLock<Arc<super::Admission>>,
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
            admission: std::sync::OnceLock::new(),
        })
    }

    /// Holds new connections to `gate`: at most its places are opening at once, the rest
    /// wait (see [`super::admission`]). Set once, before the listener serves; a second
    /// gate is ignored.
    pub fn with_admission(self: Arc<Self>, gate: Arc<super::Admission>) -> Arc<Self> {
        let _ = self.admission.set(gate);
        self
    }

    pub fn limits(&self) -> &ListenerLimits {
        &self.limits
    }

    pub(super) fn refuse(&self, reason: &'static str) {
        self.metrics
            .refused
            .with_label_values(&[self.name, reason])
            .inc();
    }

    /// [`Self::refuse`], also counted by source.
    pub(super) fn refuse_source(&self, reason: &'static str, ip: IpAddr) {
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

    pub(super) fn source_blocked(&self, peer: SocketAddr) -> bool {
        self.limits.auth_failures > 0
            && self
                .budget
                .lock()
                .blocked(source_key(peer.ip()), Instant::now())
    }

    pub(super) fn trusts(&self, ip: IpAddr) -> bool {
        self.limits.proxy_protocol.iter().any(|n| n.contains(ip))
    }

    /// The source's checks at admission: not over its failure budget, under its
    /// connection cap. `None` when refused (counted and logged).
    pub(super) fn admit(
        self: &Arc<Self>,
        peer: SocketAddr,
        via: Option<SocketAddr>,
    ) -> Option<SourceSlot> {
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

    pub(super) fn release_token(&self, key: &Arc<str>) {
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
    pub(super) async fn open(
        self: Arc<Self>,
        mut tcp: TcpStream,
        lb: SocketAddr,
        slot: Option<SourceSlot>,
        tls: Option<TlsServer>,
        permit: OwnedSemaphorePermit,
        accepted: Instant,
        opening: Option<super::admission::Slot>,
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
            opening: opening.map(|slot| {
                let hold = accepted + super::admission::OPENING_HOLD;
                (slot, Box::pin(tokio::time::sleep_until(hold)))
            }),
        })
    }

    /// The TLS handshake, holding a handshake slot only while this server works on it
    /// (see [`crate::socket`]).
    pub(super) async fn handshake(
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

/// The HTTP/2 client preface: 24 bytes.
pub(super) const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Reads until the bytes tell the protocol: the whole HTTP/2 preface, or a byte where it
/// differs (anything else, HTTP/1 for the front). Reads no further.
pub(super) async fn first_bytes<R: AsyncRead + Unpin>(io: &mut R) -> std::io::Result<Vec<u8>> {
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
pub(super) struct SourceSlot(pub(super) Option<(Arc<ListenerGuard>, IpAddr)>);

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

// ---------------------------------------------------------------------------------------
// The connection a guard holds

pub(super) fn ms_since(epoch: Instant, t: Instant) -> u64 {
    t.saturating_duration_since(epoch).as_millis() as u64
}

#[derive(Debug)]
pub(super) struct ConnState {
    pub(super) authenticated: AtomicBool,
    /// Cancelled to close the connection (its source went over the budget).
    pub(super) close: CancellationToken,
    /// Cancelled when the connection has been idle for `idle_timeout`.
    pub(super) idle: CancellationToken,
    /// Requests or streams in flight ([`Held`]).
    pub(super) active: AtomicUsize,
    /// When the last one ended (or the accept), in ms since `epoch`.
    pub(super) idle_since_ms: AtomicU64,
    pub(super) epoch: Instant,
    /// Tunnel ids whose `max_connections_per_token` this connection counts toward.
    pub(super) tokens: Mutex<Vec<Arc<str>>>,
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
    pub(super) state: Arc<ConnState>,
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
pub(super) struct IdleTimer {
    pub(super) sleep: Pin<Box<tokio::time::Sleep>>,
    /// Set once the connection was told it is idle: its reads fail then.
    pub(super) grace_until: Option<Instant>,
}

/// An accepted connection held to its listener's limits: counts toward
/// `max_connections` (and its source's and tunnel ids' caps) while open, replays the
/// bytes read to tell its protocol, and reads fail once it must close (no authenticated
/// stream within `auth_timeout`, idle for `idle_timeout`, or its source went over the
/// failure budget).
pub struct Conn {
    pub(super) io: MaybeTls,
    /// The first bytes, read to tell the protocol, replayed before the socket's.
    pub(super) prefix: Vec<u8>,
    pub(super) replayed: usize,
    pub(super) info: ConnInfo,
    pub(super) auth_deadline: Option<Pin<Box<tokio::time::Sleep>>>,
    pub(super) idle: Option<IdleTimer>,
    pub(super) closed: Pin<Box<WaitForCancellationFutureOwned>>,
    pub(super) guard: Arc<ListenerGuard>,
    pub(super) _source: SourceSlot,
    pub(super) _permit: OwnedSemaphorePermit,
    /// Its place at the admission gate while it opens: given back once it carried an
    /// authenticated stream, or when the hold ends ([`super::admission::OPENING_HOLD`]).
    pub(super) opening: Option<(super::admission::Slot, Pin<Box<tokio::time::Sleep>>)>,
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

    pub(super) fn must_close(&mut self, cx: &mut Context<'_>) -> Option<std::io::Error> {
        if let Some((_, hold)) = &mut self.opening {
            if self.info.state.authenticated.load(Ordering::Acquire)
                || hold.as_mut().poll(cx).is_ready()
            {
                self.opening = None;
            }
        }
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
    pub(super) fn poll_idle(&mut self, cx: &mut Context<'_>) -> Option<std::io::Error> {
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
