//! One listener's limits, counters and budget ([`ListenerGuard`]), and the opening of an
//! accepted connection under them: the PROXY header, the source's admission, the TLS
//! handshake and the first bytes.

use super::budget::{AuthBudget, LogLimiter};
use super::conn::{ms_since, Conn, ConnInfo, ConnState, IdleTimer};
use super::limits::canonical;
use super::metrics::{ListenerMetrics, REASONS};
use super::{proxy, source_key, FrameBudget, ListenerLimits, MaybeTls, Socket, MAX_NAMED_SOURCES};
use crate::tls::TlsServer;
use parking_lot::Mutex;
use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use tokio::io::{AsyncRead, AsyncReadExt};
use tokio::net::TcpStream;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
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
