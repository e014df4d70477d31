//! A bound on the gRPC messages a listener holds half-received, across all its streams
//! (`max_partial_frame_bytes`).
//!
//! tonic reserves a message's declared length when its 5-byte header arrives and keeps
//! the bytes until the last one is there, so a peer that starts a message of up to
//! `max_frame_bytes` and sends the rest slowly (or never) holds that much per stream, and
//! streams are many. [`FrameBudget::wrap`] sits between hyper's body and tonic's decoder:
//! it reads the message framing as the bytes pass, charges each message's declared length
//! to the listener's budget from its header until its last byte passed (tonic decodes it
//! then), and ends the stream with RESOURCE_EXHAUSTED when the budget cannot take it. A
//! stream that ends gives its charge back. It must not copy, hold or reorder bytes.

use bytes::{Buf, Bytes};
use http_body::{Body, Frame, SizeHint};
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{ready, Context, Poll};

/// The bytes of half-received messages one listener may hold.
pub struct FrameBudget {
    max: usize,
    used: AtomicUsize,
    /// Shows `used` (`relay_listener_partial_frame_bytes`).
    gauge: prometheus::IntGauge,
    /// Called (with the stream's charge and the message's length) when a stream is ended
    /// for lack of budget: the listener counts and logs it.
    on_refuse: Box<dyn Fn(usize) + Send + Sync>,
}

impl std::fmt::Debug for FrameBudget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FrameBudget")
            .field("max", &self.max)
            .field("used", &self.used())
            .finish()
    }
}

impl FrameBudget {
    pub fn new(
        max: usize,
        gauge: prometheus::IntGauge,
        on_refuse: impl Fn(usize) + Send + Sync + 'static,
    ) -> Arc<Self> {
        Arc::new(FrameBudget {
            max,
            used: AtomicUsize::new(0),
            gauge,
            on_refuse: Box::new(on_refuse),
        })
    }

    /// Bytes charged now.
    pub fn used(&self) -> usize {
        self.used.load(Ordering::Relaxed)
    }

    fn charge(&self, n: usize) -> bool {
        let mut cur = self.used.load(Ordering::Relaxed);
        loop {
            let Some(next) = cur.checked_add(n).filter(|v| *v <= self.max) else {
                return false;
            };
            match self
                .used
                .compare_exchange_weak(cur, next, Ordering::AcqRel, Ordering::Relaxed)
            {
                Ok(_) => {
                    self.gauge.add(n as i64);
                    return true;
                }
                Err(now) => cur = now,
            }
        }
    }

    fn release(&self, n: usize) {
        if n > 0 {
            self.used.fetch_sub(n, Ordering::AcqRel);
            self.gauge.sub(n as i64);
        }
    }

    /// `body`, with its half-received messages charged to this budget.
    pub fn wrap<B>(self: &Arc<Self>, body: B) -> Charged<B> {
        Charged {
            body,
            budget: self.clone(),
            header: [0; 5],
            have: 0,
            remaining: 0,
            charged: 0,
            failed: false,
        }
    }
}

/// A request body whose half-received gRPC messages count against a [`FrameBudget`].
#[derive(Debug)]
pub struct Charged<B> {
    body: B,
    budget: Arc<FrameBudget>,
    /// The message header being read, and how much of it arrived.
    header: [u8; 5],
    have: usize,
    /// Bytes of the current message still to come after its header.
    remaining: usize,
    /// What the current message holds of the budget.
    charged: usize,
    failed: bool,
}

impl<B> Charged<B> {
    /// Walks `data` through the framing; false when a message cannot be charged.
    fn track(&mut self, mut data: &[u8]) -> bool {
        while !data.is_empty() {
            if self.remaining > 0 {
                let n = self.remaining.min(data.len());
                self.remaining -= n;
                data = &data[n..];
                if self.remaining == 0 {
                    self.budget.release(std::mem::take(&mut self.charged));
                }
                continue;
            }
            let n = (5 - self.have).min(data.len());
            self.header[self.have..self.have + n].copy_from_slice(&data[..n]);
            self.have += n;
            data = &data[n..];
            if self.have == 5 {
                self.have = 0;
                let len = u32::from_be_bytes([
                    self.header[1],
                    self.header[2],
                    self.header[3],
                    self.header[4],
                ]) as usize;
                if len == 0 {
                    continue;
                }
                if !self.budget.charge(len) {
                    (self.budget.on_refuse)(len);
                    return false;
                }
                self.charged = len;
                self.remaining = len;
            }
        }
        true
    }
}

impl<B> Drop for Charged<B> {
    fn drop(&mut self) {
        self.budget.release(std::mem::take(&mut self.charged));
    }
}

impl<B> Body for Charged<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<tower::BoxError>,
{
    type Data = Bytes;
    type Error = tower::BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = self.get_mut();
        if this.failed {
            return Poll::Ready(None);
        }
        let frame = match ready!(Pin::new(&mut this.body).poll_frame(cx)) {
            None => return Poll::Ready(None),
            Some(Err(e)) => return Poll::Ready(Some(Err(e.into()))),
            Some(Ok(f)) => f,
        };
        if let Some(data) = frame.data_ref() {
            if !this.track(data.chunk()) {
                this.failed = true;
                this.budget.release(std::mem::take(&mut this.charged));
                let status = tonic::Status::resource_exhausted(
                    "the listener holds its max_partial_frame_bytes of half-received messages: \
                     send each message whole, or retry",
                );
                return Poll::Ready(Some(Err(Box::new(status))));
            }
        }
        Poll::Ready(Some(Ok(frame)))
    }

    fn is_end_stream(&self) -> bool {
        self.failed || self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::{BodyExt, StreamBody};

    fn msg_header(len: u32) -> Vec<u8> {
        let mut h = vec![0u8];
        h.extend_from_slice(&len.to_be_bytes());
        h
    }

    type Chunks =
        StreamBody<futures::channel::mpsc::UnboundedReceiver<Result<Frame<Bytes>, std::io::Error>>>;

    fn stream() -> (
        futures::channel::mpsc::UnboundedSender<Result<Frame<Bytes>, std::io::Error>>,
        Chunks,
    ) {
        let (tx, rx) = futures::channel::mpsc::unbounded();
        (tx, StreamBody::new(rx))
    }

    fn send(
        tx: &futures::channel::mpsc::UnboundedSender<Result<Frame<Bytes>, std::io::Error>>,
        b: &[u8],
    ) {
        tx.unbounded_send(Ok(Frame::data(Bytes::copy_from_slice(b))))
            .unwrap();
    }

    #[tokio::test]
    async fn half_received_messages_are_charged_until_their_last_byte_and_bounded_across_streams() {
        let refused = Arc::new(AtomicUsize::new(0));
        let r = refused.clone();
        let gauge = prometheus::IntGauge::new("g", "g").unwrap();
        let budget = FrameBudget::new(1000, gauge.clone(), move |_| {
            r.fetch_add(1, Ordering::Relaxed);
        });
        let (tx_a, a) = stream();
        let (tx_b, b) = stream();
        let (tx_c, c) = stream();
        let (mut a, mut b, mut c) = (budget.wrap(a), budget.wrap(b), budget.wrap(c));

        // A: a 600-byte message, header and 100 bytes so far.
        let mut first = msg_header(600);
        first.extend_from_slice(&[7; 100]);
        send(&tx_a, &first);
        assert!(a.frame().await.unwrap().is_ok());
        assert_eq!(
            budget.used(),
            600,
            "the declared length is held from the header"
        );
        // B: a 300-byte message fits beside it.
        send(&tx_b, &msg_header(300));
        assert!(b.frame().await.unwrap().is_ok());
        assert_eq!(budget.used(), 900);
        // C: a 200-byte message does not: that stream ends with RESOURCE_EXHAUSTED.
        send(&tx_c, &msg_header(200));
        let e = c.frame().await.unwrap().unwrap_err();
        let status = tonic::Status::from_error(e);
        assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status}");
        assert!(c.frame().await.is_none(), "the refused stream ends");
        assert_eq!(refused.load(Ordering::Relaxed), 1);
        assert_eq!(budget.used(), 900);

        // A's message completes (its last byte, then the next message's header in one
        // chunk): its charge goes, the next one's comes.
        let mut rest = vec![7; 500];
        rest.extend_from_slice(&msg_header(50));
        send(&tx_a, &rest);
        assert!(a.frame().await.unwrap().is_ok());
        assert_eq!(budget.used(), 350);
        // Empty messages cost nothing; B ending half-received gives its charge back.
        send(&tx_c, &msg_header(0));
        drop(b);
        drop(tx_b);
        assert_eq!(budget.used(), 50);
        drop(a);
        assert_eq!(budget.used(), 0);
        assert_eq!(gauge.get(), 0);
    }
}
