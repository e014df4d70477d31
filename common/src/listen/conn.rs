//! An accepted connection held to its listener's limits ([`Conn`]), what a request learns
//! about it ([`ConnInfo`]), and the marks that keep it from being idle ([`Held`],
//! [`HeldBody`]).

use super::guard::{ListenerGuard, SourceSlot};
use super::{MaybeTls, IDLE_GRACE};
use parking_lot::Mutex;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::OwnedSemaphorePermit;
use tokio::time::Instant;
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};
use tracing::{debug, info};

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
