//! The socket under every gRPC (HTTP/2) connection the relay makes or accepts: writes of a
//! batch of frames go out in one system call, whatever the frames' sizes.
//!
//! h2 copies a DATA frame into its write buffer only when its payload is small; a larger
//! payload is chained after the buffer and written from where it lies, and h2 can hold
//! one such payload at a time: it flushes the socket before it takes the next frame.
//! The cut is 256 bytes on a socket that takes vectored writes and 1 KiB on one that does
//! not. A gRPC message of the relay is one DATA frame, so with TCP's vectored writes every
//! call whose head and body came to 256 bytes or more (a POST's head with its body inside,
//! a response head with a body of a few hundred bytes) cost its own `writev` on each hop,
//! while calls under it crossed in batches: `bench/relay-bench.sh` measured POSTs of 200
//! bytes at twice the dispatcher's and five times the tunnel server's `writev` calls per
//! call of GETs.
//!
//! [`H2Io`] says it takes no vectored writes, so h2 copies every frame under 1 KiB into its
//! buffer (one write per batch of calls), and it joins what h2 writes in turns into one
//! `writev`: a chunk of at most [`HOLD`] bytes is accepted without a system call and held;
//! the next write sends the held bytes and the new ones together, and a flush sends what is
//! held. So a large payload still goes out with its frame header in one `writev`, as with
//! vectored writes. Held bytes are always written before anything after them and before a
//! flush or shutdown completes, so the byte stream is exactly what h2 wrote.

use std::io::IoSlice;
use std::pin::Pin;
use std::task::{ready, Context, Poll};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// Largest write held back to go out with the next one: h2's write buffer (16 KiB).
pub const HOLD: usize = 16 * 1024;

/// Buffer kept between writes; a larger one is freed once written.
const KEEP: usize = 4 * 1024;

/// A socket for an HTTP/2 connection; see the module docs.
#[derive(Debug)]
pub struct H2Io<T> {
    io: T,
    /// Bytes accepted from the writer and not yet written to `io`.
    held: Vec<u8>,
}

impl<T> H2Io<T> {
    pub fn new(io: T) -> Self {
        H2Io {
            io,
            held: Vec::new(),
        }
    }

    pub fn get_ref(&self) -> &T {
        &self.io
    }
}

impl<T: AsyncWrite + Unpin> H2Io<T> {
    /// Writes the held bytes until none are left. A buffer grown past [`KEEP`] is freed
    /// then: an idle connection keeps no more than that.
    fn poll_write_held(&mut self, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        while !self.held.is_empty() {
            let n = ready!(Pin::new(&mut self.io).poll_write(cx, &self.held))?;
            if n == 0 {
                return Poll::Ready(Err(std::io::ErrorKind::WriteZero.into()));
            }
            self.held.drain(..n);
        }
        if self.held.capacity() > KEEP {
            self.held = Vec::new();
        }
        Poll::Ready(Ok(()))
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for H2Io<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for H2Io<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        if buf.is_empty() {
            return Poll::Ready(Ok(0));
        }
        if this.held.is_empty() && buf.len() <= HOLD {
            this.held.extend_from_slice(buf);
            return Poll::Ready(Ok(buf.len()));
        }
        // Held bytes first, with as much of `buf` as the socket takes in the same call.
        while !this.held.is_empty() {
            let bufs = [IoSlice::new(&this.held), IoSlice::new(buf)];
            let n = ready!(Pin::new(&mut this.io).poll_write_vectored(cx, &bufs))?;
            if n == 0 {
                return Poll::Ready(Err(std::io::ErrorKind::WriteZero.into()));
            }
            if n >= this.held.len() {
                let of_buf = n - this.held.len();
                this.held.clear();
                if of_buf > 0 {
                    return Poll::Ready(Ok(of_buf));
                }
            } else {
                this.held.drain(..n);
            }
        }
        Pin::new(&mut this.io).poll_write(cx, buf)
    }

    /// No: h2 then copies small frames into its buffer (see the module docs); this type
    /// joins the writes itself.
    fn is_write_vectored(&self) -> bool {
        false
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_write_held(cx))?;
        Pin::new(&mut this.io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_write_held(cx))?;
        Pin::new(&mut this.io).poll_shutdown(cx)
    }
}

impl<T: tonic::transport::server::Connected> tonic::transport::server::Connected for H2Io<T> {
    type ConnectInfo = T::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.io.connect_info()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;

    /// A socket that takes at most `max` bytes per call and records each call.
    struct Stingy {
        max: usize,
        out: Vec<u8>,
        calls: Vec<usize>,
    }

    impl AsyncWrite for Stingy {
        fn poll_write(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
            buf: &[u8],
        ) -> Poll<std::io::Result<usize>> {
            let n = buf.len().min(self.max);
            self.out.extend_from_slice(&buf[..n]);
            self.calls.push(n);
            Poll::Ready(Ok(n))
        }

        fn poll_write_vectored(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
            bufs: &[IoSlice<'_>],
        ) -> Poll<std::io::Result<usize>> {
            let mut n = 0;
            for b in bufs {
                let take = b.len().min(self.max - n);
                self.out.extend_from_slice(&b[..take]);
                n += take;
                if n == self.max {
                    break;
                }
            }
            self.calls.push(n);
            Poll::Ready(Ok(n))
        }

        fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
            Poll::Ready(Ok(()))
        }

        fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
            Poll::Ready(Ok(()))
        }
    }

    fn stingy(max: usize) -> H2Io<Stingy> {
        H2Io::new(Stingy {
            max,
            out: Vec::new(),
            calls: Vec::new(),
        })
    }

    #[tokio::test]
    async fn a_frame_header_and_its_payload_go_out_in_one_call() {
        let mut io = stingy(usize::MAX);
        io.write_all(b"frame header").await.unwrap();
        assert!(
            io.get_ref().calls.is_empty(),
            "held until the payload comes"
        );
        let payload = vec![7u8; 40_000];
        io.write_all(&payload).await.unwrap();
        io.flush().await.unwrap();
        assert_eq!(io.get_ref().calls, [12 + 40_000]);
        let mut want = b"frame header".to_vec();
        want.extend_from_slice(&payload);
        assert_eq!(io.get_ref().out, want);
    }

    #[tokio::test]
    async fn a_flush_writes_what_is_held_and_bytes_keep_their_order() {
        let mut io = stingy(usize::MAX);
        io.write_all(b"batch of small frames").await.unwrap();
        io.flush().await.unwrap();
        io.write_all(b"next").await.unwrap();
        io.shutdown().await.unwrap();
        assert_eq!(io.get_ref().out, b"batch of small framesnext");
        assert_eq!(io.get_ref().calls, [21, 4]);
    }

    /// A socket that takes a few bytes at a time: nothing is lost, doubled or reordered,
    /// whatever the sizes written.
    #[tokio::test]
    async fn partial_writes_lose_and_reorder_nothing() {
        for max in [1, 3, 7, 100, 5_000] {
            let mut io = stingy(max);
            let mut want = Vec::new();
            for (i, len) in [5usize, 300, HOLD, HOLD + 1, 1, 20_000, 2]
                .iter()
                .enumerate()
            {
                let chunk: Vec<u8> = (0..*len).map(|j| (i * 31 + j) as u8).collect();
                io.write_all(&chunk).await.unwrap();
                want.extend_from_slice(&chunk);
            }
            io.flush().await.unwrap();
            assert!(io.get_ref().out == want, "max {max}");
            assert!(io.held.is_empty());
        }
    }
}
