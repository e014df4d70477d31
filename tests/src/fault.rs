//! Peers that misbehave, at the byte level, for the isolation tests and `relay-fleet`:
//!
//! - [`Forwarder`]: a TCP forwarder the test owns, placed on a path (agent -> tunnel
//!   server, dispatcher -> tunnel server, anything -> anything). It passes bytes, delays
//!   them, goes **silent** (stops reading and writing on every connection, open or new,
//!   while the sockets stay open: a partition, a NAT or load balancer that lost the flow;
//!   TCP's own buffers fill and the senders block, as over a dead path), heals (bytes
//!   held back flow again, as after retransmits), and resets every open connection (a
//!   real TCP RST, `SO_LINGER` 0).
//! - [`StalledDownload`]: a caller that sends a request through the front, reads the
//!   response head, then reads nothing more while keeping its connection open (a backend
//!   paused in GC, a slow client). Its socket's receive buffer is small, so what the relay
//!   sends it piles up in the relay's buffers and windows, not in the kernel.
//! - [`StalledUpload`]: a caller that sends a request body as fast as the relay takes it,
//!   to an upstream route that does not read it (`/stall-body/{ms}` of
//!   [`crate::upstream`]): the body stops wherever the relay's flow control stops it.
//! - [`SilentConnection`]: a connection that never sends a byte.
//!
//! Dropping any of them closes its sockets and stops its tasks. This module must not
//! decide what a test asserts.

use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

/// What a [`Forwarder`] does with the bytes of its connections.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Bytes flow both ways as they come.
    Pass,
    /// Each read is written on after this delay (in order).
    Delay(Duration),
    /// Nothing is read or written; new connections are accepted and hear nothing.
    Silent,
}

/// A TCP forwarder in front of `target`; see the module docs.
pub struct Forwarder {
    addr: SocketAddr,
    mode: watch::Sender<Mode>,
    /// Bumped by [`Forwarder::reset_open_connections`]: connections born before reset.
    generation: Arc<watch::Sender<u64>>,
    open: Arc<AtomicUsize>,
    accepted: Arc<AtomicU64>,
    forwarded: Arc<AtomicU64>,
    stop: CancellationToken,
}

impl Forwarder {
    /// Listens on `127.0.0.1:0` and forwards every connection to `target`.
    pub async fn start(target: SocketAddr) -> io::Result<Forwarder> {
        let listener = TcpListener::bind(("127.0.0.1", 0)).await?;
        Ok(Forwarder::on(listener, target))
    }

    /// Forwards the connections `listener` accepts to `target`.
    pub fn on(listener: TcpListener, target: SocketAddr) -> Forwarder {
        let addr = listener
            .local_addr()
            .expect("a bound listener has an address");
        let (mode, _) = watch::channel(Mode::Pass);
        let (generation, _) = watch::channel(0u64);
        let f = Forwarder {
            addr,
            mode,
            generation: Arc::new(generation),
            open: Arc::default(),
            accepted: Arc::default(),
            forwarded: Arc::default(),
            stop: CancellationToken::new(),
        };
        let ctx = ConnCtx {
            mode: f.mode.subscribe(),
            generation: f.generation.clone(),
            open: f.open.clone(),
            forwarded: f.forwarded.clone(),
            stop: f.stop.clone(),
        };
        let accepted = f.accepted.clone();
        let stop = f.stop.clone();
        tokio::spawn(async move {
            loop {
                let (client, _) = tokio::select! {
                    _ = stop.cancelled() => return,
                    r = listener.accept() => match r {
                        Ok(c) => c,
                        Err(_) => {
                            tokio::time::sleep(Duration::from_millis(5)).await;
                            continue;
                        }
                    },
                };
                accepted.fetch_add(1, Ordering::Relaxed);
                tokio::spawn(ctx.clone().run(client, target));
            }
        });
        f
    }

    /// Where the forwarder listens.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://{addr}`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Switches every connection, open or new, to `mode`.
    pub fn set(&self, mode: Mode) {
        self.mode.send_replace(mode);
    }

    /// Stops every byte, both ways, with the sockets left open (a silent partition).
    pub fn silence(&self) {
        self.set(Mode::Silent);
    }

    /// Lets bytes flow again; what was held back goes first.
    pub fn heal(&self) {
        self.set(Mode::Pass);
    }

    /// Resets (TCP RST) every connection open now; later ones pass.
    pub fn reset_open_connections(&self) {
        self.generation.send_modify(|g| *g += 1);
    }

    /// Connections open through the forwarder now.
    pub fn open_connections(&self) -> usize {
        self.open.load(Ordering::Relaxed)
    }

    /// Connections accepted so far.
    pub fn accepted(&self) -> u64 {
        self.accepted.load(Ordering::Relaxed)
    }

    /// Bytes written on, both ways, so far.
    pub fn forwarded_bytes(&self) -> u64 {
        self.forwarded.load(Ordering::Relaxed)
    }
}

impl Drop for Forwarder {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

#[derive(Clone)]
struct ConnCtx {
    mode: watch::Receiver<Mode>,
    generation: Arc<watch::Sender<u64>>,
    open: Arc<AtomicUsize>,
    forwarded: Arc<AtomicU64>,
    stop: CancellationToken,
}

/// Counts a connection as open while it lives.
struct OpenGuard(Arc<AtomicUsize>);

impl Drop for OpenGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl ConnCtx {
    async fn run(self, client: TcpStream, target: SocketAddr) {
        self.open.fetch_add(1, Ordering::Relaxed);
        let _open = OpenGuard(self.open.clone());
        let _ = client.set_nodelay(true);
        // A silent path: the connection is accepted and hears nothing, the dial included.
        if !self.flowing().await {
            return;
        }
        let server = tokio::select! {
            _ = self.stop.cancelled() => return,
            r = TcpStream::connect(target) => match r {
                Ok(s) => s,
                Err(_) => return,
            },
        };
        let _ = server.set_nodelay(true);
        let generation = *self.generation.borrow();
        let (cr, cw) = client.into_split();
        let (sr, sw) = server.into_split();
        let mut pumps = JoinSet::new();
        pumps.spawn(self.clone().pump(cr, sw, generation));
        pumps.spawn(self.clone().pump(sr, cw, generation));
        tokio::select! {
            _ = self.stop.cancelled() => {}
            _ = async { while pumps.join_next().await.is_some() {} } => {}
        }
    }

    /// Waits while the path is silent; false when the forwarder stops meanwhile.
    async fn flowing(&self) -> bool {
        let mut mode = self.mode.clone();
        tokio::select! {
            _ = self.stop.cancelled() => false,
            r = mode.wait_for(|m| *m != Mode::Silent) => r.is_ok(),
        }
    }

    /// Resolves when the connections born in `generation` are to be reset.
    async fn reset(&self, generation: u64) {
        let mut g = self.generation.subscribe();
        if g.wait_for(|now| *now != generation).await.is_err() {
            std::future::pending::<()>().await;
        }
    }

    /// Copies `from` to `to` while the path flows. On a reset both sockets close with RST
    /// (each pump sets a zero linger on the socket it reads and lets go of its halves).
    async fn pump(self, mut from: OwnedReadHalf, mut to: OwnedWriteHalf, generation: u64) {
        let mut buf = vec![0u8; 64 * 1024];
        let reset = self.reset(generation);
        tokio::pin!(reset);
        loop {
            // Read only while flowing: a silent path leaves the bytes in the sender's
            // socket buffers (the sender blocks, as over a dead path).
            let n = tokio::select! {
                biased;
                _ = &mut reset => break,
                flowing = self.flowing() => {
                    if !flowing {
                        return;
                    }
                    tokio::select! {
                        r = from.read(&mut buf) => match r {
                            Ok(0) | Err(_) => {
                                // The reading side ended: pass the end on.
                                let _ = to.shutdown().await;
                                return;
                            }
                            Ok(n) => n,
                        },
                        // Stop reading as soon as the path goes silent.
                        _ = silent(self.mode.clone()) => continue,
                        _ = &mut reset => break,
                    }
                }
            };
            let delay = match *self.mode.borrow() {
                Mode::Delay(d) => d,
                _ => Duration::ZERO,
            };
            let write = async {
                if !delay.is_zero() {
                    tokio::time::sleep(delay).await;
                }
                // Bytes already read wait for the path to come back.
                if !self.flowing().await {
                    return Err(io::ErrorKind::BrokenPipe.into());
                }
                to.write_all(&buf[..n]).await
            };
            tokio::select! {
                _ = &mut reset => break,
                r = write => {
                    if r.is_err() {
                        return;
                    }
                }
            }
            self.forwarded.fetch_add(n as u64, Ordering::Relaxed);
        }
        // Reset: no FIN first; the socket closes with RST once both pumps let go.
        let _ = from.as_ref().set_zero_linger();
        to.forget();
    }
}

/// Resolves when the mode becomes silent.
async fn silent(mut mode: watch::Receiver<Mode>) {
    if mode.wait_for(|m| *m == Mode::Silent).await.is_err() {
        // The forwarder is gone: its stop token ends the pumps.
        std::future::pending::<()>().await;
    }
}

/// Receive buffer of a stalled caller's socket: small, so the relay's bytes stay in the
/// relay (its windows and buffers) rather than in this test's kernel buffers.
const STALLED_RCVBUF: u32 = 4 * 1024;

/// A caller that read its response head and then stopped reading; see the module docs.
pub struct StalledDownload {
    /// The response status.
    pub status: u16,
    /// Bytes of body that came with the head (before the caller stopped reading).
    pub body_seen: usize,
    _stream: TcpStream,
}

impl StalledDownload {
    /// Sends `GET path` to `front` with `Authorization: Bearer key` (HTTP/1.1) and the call
    /// deadline `deadline` (`x-relay-timeout-ms`), reads the response head and stops
    /// reading. Fails if the head does not come within `within`.
    pub async fn start(
        front: SocketAddr,
        key: &str,
        path: &str,
        deadline: Duration,
        within: Duration,
    ) -> io::Result<StalledDownload> {
        let sock = TcpSocket::new_v4()?;
        sock.set_recv_buffer_size(STALLED_RCVBUF)?;
        let mut stream = sock.connect(front).await?;
        stream.set_nodelay(true)?;
        let ms = deadline.as_millis();
        let req = format!(
            "GET {path} HTTP/1.1\r\nhost: {front}\r\nauthorization: Bearer {key}\r\nx-relay-timeout-ms: {ms}\r\n\r\n"
        );
        stream.write_all(req.as_bytes()).await?;
        let (status, body_seen) = tokio::time::timeout(within, read_head(&mut stream))
            .await
            .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "no response head"))??;
        Ok(StalledDownload {
            status,
            body_seen,
            _stream: stream,
        })
    }
}

/// Reads up to the end of an HTTP/1.1 response head, a little at a time; the status and
/// how many body bytes came after the head in the last read.
async fn read_head(stream: &mut TcpStream) -> io::Result<(u16, usize)> {
    let mut head = Vec::with_capacity(1024);
    let mut buf = [0u8; 512];
    loop {
        let n = stream.read(&mut buf).await?;
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "the connection closed before the response head",
            ));
        }
        head.extend_from_slice(&buf[..n]);
        if let Some(end) = head.windows(4).position(|w| w == b"\r\n\r\n") {
            let status = std::str::from_utf8(&head[..end])
                .ok()
                .and_then(|h| h.split(' ').nth(1))
                .and_then(|s| s.parse().ok())
                .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "bad status line"))?;
            return Ok((status, head.len() - end - 4));
        }
        if head.len() > 64 * 1024 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "response head over 64 KiB",
            ));
        }
    }
}

/// A caller whose request body stopped where the relay stopped taking it; see the module
/// docs.
pub struct StalledUpload {
    sent: Arc<AtomicU64>,
    stop: CancellationToken,
}

impl StalledUpload {
    /// Sends `POST path` to `front` with a body of `len` bytes and the call deadline
    /// `deadline`, as fast as the connection takes it, in the background. Fails if the
    /// connection cannot be made.
    pub async fn start(
        front: SocketAddr,
        key: &str,
        path: &str,
        len: u64,
        deadline: Duration,
    ) -> io::Result<StalledUpload> {
        let mut stream = TcpStream::connect(front).await?;
        stream.set_nodelay(true)?;
        let ms = deadline.as_millis();
        let req = format!(
            "POST {path} HTTP/1.1\r\nhost: {front}\r\nauthorization: Bearer {key}\r\nx-relay-timeout-ms: {ms}\r\ncontent-type: application/octet-stream\r\ncontent-length: {len}\r\n\r\n"
        );
        stream.write_all(req.as_bytes()).await?;
        let sent = Arc::new(AtomicU64::new(0));
        let stop = CancellationToken::new();
        let (s, st) = (sent.clone(), stop.clone());
        tokio::spawn(async move {
            let chunk = vec![b'u'; 64 * 1024];
            let mut left = len;
            while left > 0 {
                let n = left.min(chunk.len() as u64) as usize;
                tokio::select! {
                    _ = st.cancelled() => return,
                    r = stream.write_all(&chunk[..n]) => if r.is_err() { return },
                }
                left -= n as u64;
                s.fetch_add(n as u64, Ordering::Relaxed);
            }
            // Keep the connection until dropped.
            st.cancelled().await;
        });
        Ok(StalledUpload { sent, stop })
    }

    /// Body bytes the relay has taken so far.
    pub fn sent(&self) -> u64 {
        self.sent.load(Ordering::Relaxed)
    }

    /// Waits until the body stops moving: no byte taken for `quiet`. Fails after `within`.
    pub async fn wait_stalled(&self, quiet: Duration, within: Duration) -> io::Result<u64> {
        let mut last = self.sent();
        let mut since = tokio::time::Instant::now();
        let stalled = crate::poll::until("the upload stalls", within, || {
            let now = self.sent();
            if now != last {
                last = now;
                since = tokio::time::Instant::now();
            }
            let quiet_now = since.elapsed() >= quiet;
            async move {
                if quiet_now {
                    Ok(now)
                } else {
                    Err(format!("the upload kept moving ({now} bytes taken)"))
                }
            }
        });
        stalled
            .await
            .map_err(|e| io::Error::new(io::ErrorKind::TimedOut, e.last))
    }
}

impl Drop for StalledUpload {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// A connection that never sends a byte. `closed` tells whether the peer closed it.
pub struct SilentConnection {
    stream: TcpStream,
}

impl SilentConnection {
    pub async fn open(addr: SocketAddr) -> io::Result<SilentConnection> {
        Ok(SilentConnection {
            stream: TcpStream::connect(addr).await?,
        })
    }

    /// Whether the peer has closed the connection (EOF or reset), without blocking.
    pub fn closed(&self) -> bool {
        let mut buf = [0u8; 1];
        match self.stream.try_read(&mut buf) {
            Ok(0) => true,
            Ok(_) => false,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => false,
            Err(_) => true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An echo server: every connection gets back what it sends.
    async fn echo() -> SocketAddr {
        let l = TcpListener::bind(("127.0.0.1", 0)).await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = l.accept().await {
                tokio::spawn(async move {
                    let (mut r, mut w) = s.split();
                    let _ = tokio::io::copy(&mut r, &mut w).await;
                });
            }
        });
        addr
    }

    async fn round_trip(c: &mut TcpStream, msg: &[u8]) -> io::Result<Vec<u8>> {
        c.write_all(msg).await?;
        let mut back = vec![0u8; msg.len()];
        c.read_exact(&mut back).await?;
        Ok(back)
    }

    #[tokio::test]
    async fn a_silent_path_holds_bytes_with_the_connection_open_and_a_heal_delivers_them() {
        let f = Forwarder::start(echo().await).await.unwrap();
        let mut c = TcpStream::connect(f.addr()).await.unwrap();
        assert_eq!(round_trip(&mut c, b"before").await.unwrap(), b"before");
        f.silence();
        c.write_all(b"during").await.unwrap();
        let mut buf = [0u8; 6];
        let read = tokio::time::timeout(Duration::from_millis(300), c.read(&mut buf)).await;
        assert!(read.is_err(), "a byte crossed the silent path: {read:?}");
        assert_eq!(f.open_connections(), 1, "the connection stays open");
        f.heal();
        c.read_exact(&mut buf).await.unwrap();
        assert_eq!(&buf, b"during");
    }

    #[tokio::test]
    async fn a_connection_made_while_silent_hears_nothing_until_the_heal() {
        let f = Forwarder::start(echo().await).await.unwrap();
        f.silence();
        let mut c = TcpStream::connect(f.addr()).await.unwrap();
        c.write_all(b"hello").await.unwrap();
        let mut buf = [0u8; 5];
        let read = tokio::time::timeout(Duration::from_millis(300), c.read(&mut buf)).await;
        assert!(read.is_err(), "a byte crossed the silent path: {read:?}");
        f.heal();
        c.read_exact(&mut buf).await.unwrap();
        assert_eq!(&buf, b"hello");
    }

    #[tokio::test]
    async fn a_reset_ends_open_connections_with_rst_and_later_ones_pass() {
        let f = Forwarder::start(echo().await).await.unwrap();
        let mut c = TcpStream::connect(f.addr()).await.unwrap();
        assert_eq!(round_trip(&mut c, b"x").await.unwrap(), b"x");
        f.reset_open_connections();
        let mut buf = [0u8; 1];
        let r = tokio::time::timeout(Duration::from_secs(5), c.read(&mut buf))
            .await
            .expect("the reset arrives");
        assert!(
            matches!(&r, Err(e) if e.kind() == io::ErrorKind::ConnectionReset),
            "{r:?}"
        );
        let mut d = TcpStream::connect(f.addr()).await.unwrap();
        assert_eq!(round_trip(&mut d, b"y").await.unwrap(), b"y");
    }

    #[tokio::test]
    async fn a_delayed_path_passes_bytes_after_the_delay() {
        let f = Forwarder::start(echo().await).await.unwrap();
        f.set(Mode::Delay(Duration::from_millis(200)));
        let mut c = TcpStream::connect(f.addr()).await.unwrap();
        let t = tokio::time::Instant::now();
        assert_eq!(round_trip(&mut c, b"slow").await.unwrap(), b"slow");
        // Delayed both ways.
        assert!(
            t.elapsed() >= Duration::from_millis(400),
            "{:?}",
            t.elapsed()
        );
    }
}
