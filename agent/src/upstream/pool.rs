//! The keep-alive HTTP/1.1 connections to the agent's one upstream origin: dialing (every
//! address the host resolves to, in turn, within the connect timeout, `TCP_NODELAY`), the
//! idle connections, most recently used first, and their expiry after `IDLE_TIMEOUT`.
//!
//! A connection is lent for one exchange (`Pool::send`) and comes back through
//! `Pool::put` only once its response body has ended and its request body went out whole,
//! so a connection in the pool carries nothing of an earlier call. One that closed while it
//! waited is skipped at checkout; a request that a reused connection could not take (it
//! closed between the checkout and the send: hyper hands such a request back untouched)
//! goes out once more on a new connection. A request written to a connection that then
//! fails is never sent again: the upstream may have acted on it.
//!
//! Why not hyper-util's pooled client, which the agent used before: that pool serves any
//! number of hosts, so each checkout and each return hashes the (scheme, authority) key
//! with SipHash into a shared map, every request's URI is cloned and rewritten twice, and
//! every response spawns a task that waits for its connection to be ready before it goes
//! back. An agent has one origin; its pool is a stack. Measured with callgrind on the
//! benchmark's GETs, the hyper-util path cost the agent about 8,400 instructions per call
//! (`Client::send_request` and below), a seventh of its total (`bench/`, docs/benchmarks.md).
//!
//! Must not: look at requests or responses (the caller builds and reads them), or follow
//! anything but the configured origin (it dials only `authority`).

use super::ReqBody;
use http::uri::Authority;
use hyper::body::Incoming;
use hyper::client::conn::http1::{self, SendRequest};
use hyper_util::rt::TokioIo;
use parking_lot::Mutex;
use std::collections::VecDeque;
use std::sync::{Arc, Weak};
use std::time::Duration;
use tokio::net::TcpStream;
use tokio::time::Instant;

/// How long a connection may wait unused in the pool before it is closed.
pub(super) const IDLE_TIMEOUT: Duration = Duration::from_secs(90);

/// The connections to one origin. Cheap to clone.
#[derive(Clone)]
pub(super) struct Pool {
    origin: Arc<OriginPool>,
}

/// What every clone of a `Pool` shares: the origin's address, how to dial it, and its
/// idle connections.
struct OriginPool {
    /// The origin's host (an IPv6 address without its brackets) and port (80 if unset).
    host: String,
    port: u16,
    connect_timeout: Duration,
    /// At most this many connections wait in the pool (`max_upstream_connections`).
    max_idle: usize,
    idle: Mutex<Idle>,
}

#[derive(Default)]
struct Idle {
    /// Oldest first: checkouts take from the back, expiry from the front.
    conns: VecDeque<(SendRequest<ReqBody>, Instant)>,
    /// Whether the task that closes expired connections runs.
    reaping: bool,
}

impl Pool {
    pub(super) fn new(
        authority: &Authority,
        connect_timeout: Duration,
        max_idle: Option<usize>,
    ) -> Self {
        // `Authority::host` keeps an IPv6 address's brackets; the resolver wants it bare.
        let host = authority.host();
        let host = host
            .strip_prefix('[')
            .and_then(|h| h.strip_suffix(']'))
            .unwrap_or(host);
        Pool {
            origin: Arc::new(OriginPool {
                host: host.to_string(),
                port: authority.port_u16().unwrap_or(80),
                connect_timeout,
                max_idle: max_idle.unwrap_or(usize::MAX),
                idle: Mutex::new(Idle::default()),
            }),
        }
    }

    /// Sends `request` on an idle connection, or a new one, and waits for the response
    /// head. The connection comes back with the response; hand it to `put` once the
    /// exchange has ended cleanly, or drop it.
    pub(super) async fn send(
        &self,
        mut request: http::Request<ReqBody>,
    ) -> Result<(http::Response<Incoming>, SendRequest<ReqBody>), SendError> {
        while let Some(mut conn) = self.take_idle() {
            // Ready once the connection finished its last exchange; an error if it closed.
            if conn.ready().await.is_err() {
                continue;
            }
            match conn.try_send_request(request).await {
                Ok(response) => return Ok((response, conn)),
                Err(mut e) => match e.take_message() {
                    // It closed before taking the request: try the next one.
                    Some(back) => request = back,
                    None => return Err(SendError::Http(e.into_error())),
                },
            }
        }
        let mut conn = self.connect().await?;
        let response = conn.send_request(request).await?;
        Ok((response, conn))
    }

    /// Takes back a connection whose exchange ended cleanly (response body read to its
    /// end, request body sent whole).
    pub(super) fn put(&self, conn: SendRequest<ReqBody>) {
        if conn.is_closed() {
            return;
        }
        let now = Instant::now();
        let start_reaper = {
            let mut idle = self.origin.idle.lock();
            expire(&mut idle.conns, now);
            if idle.conns.len() >= self.origin.max_idle {
                return;
            }
            idle.conns.push_back((conn, now));
            !std::mem::replace(&mut idle.reaping, true)
        };
        if start_reaper {
            // The reaper is owned by the pool (it holds a `Weak`) and ends with it.
            // Outside a runtime (a response dropped on a plain thread) checkouts and returns
            // still expire connections; the next return in a runtime starts the task.
            match tokio::runtime::Handle::try_current() {
                Ok(rt) => drop(rt.spawn(reap(Arc::downgrade(&self.origin)))),
                Err(_) => self.origin.idle.lock().reaping = false,
            }
        }
    }

    /// How many connections wait in the pool (for tests).
    #[cfg(test)]
    pub(super) fn idle_len(&self) -> usize {
        self.origin.idle.lock().conns.len()
    }

    fn take_idle(&self) -> Option<SendRequest<ReqBody>> {
        let mut idle = self.origin.idle.lock();
        expire(&mut idle.conns, Instant::now());
        while let Some((conn, _)) = idle.conns.pop_back() {
            if !conn.is_closed() {
                return Some(conn);
            }
        }
        None
    }

    /// A new connection, its driver spawned.
    async fn connect(&self) -> Result<SendRequest<ReqBody>, SendError> {
        let tcp = self.dial().await.map_err(|e| {
            SendError::Connect(format!("{}:{}", self.origin.host, self.origin.port), e)
        })?;
        let (conn, driver) = http1::handshake(TokioIo::new(tcp)).await?;
        tokio::spawn(async move {
            if let Err(e) = driver.await {
                tracing::debug!(error = %e, "upstream connection ended");
            }
        });
        Ok(conn)
    }

    /// The TCP connection: each resolved address in turn, all within the connect timeout.
    async fn dial(&self) -> std::io::Result<TcpStream> {
        let origin = &self.origin;
        let attempt = async {
            let mut last = None;
            for addr in tokio::net::lookup_host((origin.host.as_str(), origin.port)).await? {
                match TcpStream::connect(addr).await {
                    Ok(tcp) => {
                        tcp.set_nodelay(true)?;
                        return Ok(tcp);
                    }
                    Err(e) => last = Some(e),
                }
            }
            Err(last
                .unwrap_or_else(|| std::io::Error::new(std::io::ErrorKind::NotFound, "no address")))
        };
        match tokio::time::timeout(origin.connect_timeout, attempt).await {
            Ok(r) => r,
            Err(_) => Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("connect timed out after {:?}", origin.connect_timeout),
            )),
        }
    }
}

/// Closes the connections that waited longer than `IDLE_TIMEOUT`, every third of it, for
/// as long as the pool lives.
async fn reap(pool: Weak<OriginPool>) {
    loop {
        tokio::time::sleep(IDLE_TIMEOUT / 3).await;
        let Some(origin) = pool.upgrade() else {
            return;
        };
        let mut idle = origin.idle.lock();
        expire(&mut idle.conns, Instant::now());
        idle.conns.retain(|(c, _)| !c.is_closed());
    }
}

fn expire(conns: &mut VecDeque<(SendRequest<ReqBody>, Instant)>, now: Instant) {
    while conns
        .front()
        .is_some_and(|(_, since)| now.saturating_duration_since(*since) >= IDLE_TIMEOUT)
    {
        conns.pop_front();
    }
}

/// Why an exchange could not begin or complete.
#[derive(Debug, thiserror::Error)]
pub(super) enum SendError {
    /// No TCP connection to the origin (resolution, refusal, timeout).
    #[error("connect to {0}: {1}")]
    Connect(String, #[source] std::io::Error),
    /// The connection failed during the exchange (or its HTTP/1.1 handshake).
    #[error(transparent)]
    Http(#[from] hyper::Error),
}
