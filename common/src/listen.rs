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
//! - **Admission** (listeners whose server sets a gate, [`ListenerGuard::with_admission`]:
//!   the tunnel server's agent listener): at most the gate's places of connections are
//!   opening at once (to their first authenticated stream); the rest wait, parked, their
//!   deadlines running from their admission ([`admission`]).
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
//!
//! Along its seams: `limits` (the settings and their validation), `guard` (the per-listener
//! state, a connection's opening: header, admission, handshake, first bytes, and the open
//! connection it holds: its deadlines and what a request learns of it; the guard opens a
//! connection and the connection gives its place back, so they share a module), `budget` and
//! `metrics` (the bookkeeping and the counters), [`proxy`] and `frames`; this file holds
//! the accept loop ([`incoming`]).

pub mod admission;
mod budget;
mod frames;
mod guard;
mod limits;
mod metrics;
pub mod proxy;

pub use crate::socket::Socket;
pub use crate::tls::MaybeTls;
pub use admission::Admission;
pub use budget::{AuthBudget, LogLimiter};
pub use frames::{Charged, FrameBudget};
pub use guard::{Conn, ConnInfo, Held, HeldBody};
pub use guard::{ListenerGuard, TokenCapError};
pub use limits::{source_key, ListenerLimits, SourceNet};
pub use metrics::ListenerMetrics;

use crate::tls::TlsServer;
use futures::Stream;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;
use tracing::warn;

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

/// Accepts connections on `listener` with Nagle off, held to `guard`'s limits. Each
/// connection's opening (PROXY header, TLS handshake, first bytes) runs in its own task,
/// so one slow client cannot stall the accept loop. The stream yields only connections
/// ready to serve. The accept loop is the stream's: it ends on `stop` or when the stream is
/// dropped (the server that served it ended), never left behind.
pub fn incoming(
    listener: TcpListener,
    tls: Option<TlsServer>,
    guard: Arc<ListenerGuard>,
    stop: CancellationToken,
) -> impl Stream<Item = std::io::Result<Conn>> + Send + 'static {
    let (tx, rx) = mpsc::channel::<std::io::Result<Conn>>(64);
    let accept = tokio::spawn(async move {
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
                // With an admission gate, the connection waits for its place here (nothing
                // read from it), and its deadlines run from its admission.
                let (opening, accepted) = match guard.admission.get() {
                    Some(gate) => (Some(gate.admit().await), Instant::now()),
                    None => (None, accepted),
                };
                if let Some(conn) = guard
                    .open(tcp, peer, slot, tls, permit, accepted, opening)
                    .await
                {
                    let _ = tx.send(Ok(conn)).await;
                }
            });
        }
    });
    let accept = AbortOnDropHandle::new(accept);
    let mut rx = rx;
    futures::stream::poll_fn(move |cx| {
        // The stream owns the accept loop: dropping it aborts the loop.
        let _owner = &accept;
        rx.poll_recv(cx)
    })
}

#[cfg(test)]
mod tests;
