//! The TCP socket under every accepted connection, and the gate that makes a TLS handshake
//! hold one of the listener's `max_handshakes` slots only while the server works on it.
//!
//! A handshake costs the server CPU in turns (the ClientHello: key exchange and signature;
//! the client's second flight: its certificate and Finished) and between them waits for
//! the client, who may never answer. [`Socket::arm`] hands the slot taken for the first
//! turn to the socket; from then on a read or write that has to wait for the peer gives the
//! slot back, and a read takes one again (waiting its turn) only once the peer's bytes are
//! there, before they are handed to rustls. [`Socket::disarm`] ends this when the
//! handshake is over. A peer that stalls mid-handshake so holds no slot, only its
//! connection, until `handshake_timeout`.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::PollSemaphore;

/// An accepted TCP connection (see the module docs).
#[derive(Debug)]
pub struct Socket {
    tcp: TcpStream,
    gate: Option<Gate>,
}

#[derive(Debug)]
struct Gate {
    slots: PollSemaphore,
    slot: Option<OwnedSemaphorePermit>,
}

impl Socket {
    pub fn new(tcp: TcpStream) -> Self {
        Socket { tcp, gate: None }
    }

    pub fn tcp(&self) -> &TcpStream {
        &self.tcp
    }

    /// From now on the socket holds a slot of `slots` only while the peer's bytes are being
    /// worked on; `slot` is the one taken for the work done so far.
    pub fn arm(&mut self, slots: Arc<Semaphore>, slot: Option<OwnedSemaphorePermit>) {
        self.gate = Some(Gate {
            slots: PollSemaphore::new(slots),
            slot,
        });
    }

    /// Gives the slot back and stops gating (the handshake is over).
    pub fn disarm(&mut self) {
        self.gate = None;
    }

    /// Whether the socket holds a handshake slot now.
    pub fn holds_slot(&self) -> bool {
        self.gate.as_ref().is_some_and(|g| g.slot.is_some())
    }
}

impl AsyncRead for Socket {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let Some(gate) = &mut this.gate else {
            return Pin::new(&mut this.tcp).poll_read(cx, buf);
        };
        if gate.slot.is_none() {
            // Waiting for the peer costs no slot: take one once its bytes are here.
            ready!(this.tcp.poll_read_ready(cx))?;
            match ready!(gate.slots.poll_acquire(cx)) {
                Some(p) => gate.slot = Some(p),
                None => return Poll::Ready(Err(std::io::ErrorKind::BrokenPipe.into())),
            }
        }
        let r = Pin::new(&mut this.tcp).poll_read(cx, buf);
        if r.is_pending() {
            gate.slot = None;
        }
        r
    }
}

impl AsyncWrite for Socket {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.tcp).poll_write(cx, buf);
        if r.is_pending() {
            // The peer does not read: that is waiting too.
            if let Some(g) = &mut this.gate {
                g.slot = None;
            }
        }
        r
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.tcp).poll_write_vectored(cx, bufs);
        if r.is_pending() {
            if let Some(g) = &mut this.gate {
                g.slot = None;
            }
        }
        r
    }

    fn is_write_vectored(&self) -> bool {
        self.tcp.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().tcp).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().tcp).poll_shutdown(cx)
    }
}
