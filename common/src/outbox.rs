//! A stream's outbound queue: the frames waiting for a tunnel stream's RPC to send them.
//! On the tunnel server: hello, pings, fleet news, a call's head and body, the closing
//! status, toward the agent. On the agent: pongs, credit and a call's answer, toward the
//! server. Bounded, many senders by reference (the [`Outbox`] sits in the server stream's
//! handle; the agent shares it in an `Arc` between the stream and its call), one receiver
//! (the RPC's body, [`OutboxRx`]).
//!
//! Why not a tokio `mpsc` channel: both ends hold one queue per tunnel stream and most
//! streams are idle, and a tokio channel costs a kilobyte or more each however little it
//! holds: the channel's state keeps two cache-line-padded fields (256 bytes), and its first
//! block of 32 slots is allocated when it is made (32 agent frames of 72 bytes: 2.3 KB per
//! agent stream). This queue is one small allocation (the state behind a mutex, and a
//! `VecDeque` that is empty until the first frame and grows to at most the bound), about
//! 200 bytes for an idle stream. The work per frame is the same as the channel's or less:
//! one uncontended lock to send, one to receive (the channel's receive also locks, to give
//! the permit back), no allocation once the deque has grown, and waiting senders are woken
//! through a `Notify` only when a receive frees room in a full queue.

use futures::Stream;
use parking_lot::Mutex;
use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use tokio::sync::Notify;

/// Why [`Outbox::try_send`] did not queue a frame; the frame comes back.
#[derive(Debug, PartialEq, Eq)]
pub enum TrySendError<T> {
    /// The queue holds its bound.
    Full(T),
    /// The receiver is gone.
    Closed(T),
}

/// The sending half (not `Clone`: the one sender is the stream's handle, shared by
/// reference). Dropping it ends the receiver once the queue is empty.
pub struct Outbox<T> {
    shared: Arc<Shared<T>>,
}

/// The receiving half: a `Stream` of the queued frames, ending once the sender is dropped
/// and the queue is empty, or at once when the sender cut it ([`Outbox::cut`]). Dropping
/// it closes the queue: sends fail from then on.
pub struct OutboxRx<T> {
    shared: Arc<Shared<T>>,
}

struct Shared<T> {
    state: Mutex<State<T>>,
    /// Senders waiting for room.
    room: Notify,
}

struct State<T> {
    queue: VecDeque<T>,
    bound: usize,
    rx_waker: Option<Waker>,
    /// The sender was dropped.
    tx_gone: bool,
    /// The receiver was dropped.
    rx_gone: bool,
    /// The sender ended the stream: the receiver ends without what is still queued.
    cut: bool,
}

/// A queue of at most `bound` items (at least 1).
pub fn outbox<T>(bound: usize) -> (Outbox<T>, OutboxRx<T>) {
    let shared = Arc::new(Shared {
        state: Mutex::new(State {
            queue: VecDeque::new(),
            bound: bound.max(1),
            rx_waker: None,
            tx_gone: false,
            rx_gone: false,
            cut: false,
        }),
        room: Notify::new(),
    });
    (
        Outbox {
            shared: shared.clone(),
        },
        OutboxRx { shared },
    )
}

impl<T> Outbox<T> {
    /// Queues `item` if there is room.
    pub fn try_send(&self, item: T) -> Result<(), TrySendError<T>> {
        let waker = {
            let mut s = self.shared.state.lock();
            if s.rx_gone {
                return Err(TrySendError::Closed(item));
            }
            if s.queue.len() >= s.bound {
                return Err(TrySendError::Full(item));
            }
            s.queue.push_back(item);
            s.rx_waker.take()
        };
        if let Some(w) = waker {
            w.wake();
        }
        Ok(())
    }

    /// Queues `item`, waiting for room; gives it back when the receiver is gone.
    pub async fn send(&self, mut item: T) -> Result<(), T> {
        loop {
            let room = self.shared.room.notified();
            tokio::pin!(room);
            // Registered before the check: a receive between the check and the wait wakes
            // this sender.
            room.as_mut().enable();
            match self.try_send(item) {
                Ok(()) => return Ok(()),
                Err(TrySendError::Closed(back)) => return Err(back),
                Err(TrySendError::Full(back)) => item = back,
            }
            room.await;
        }
    }

    /// The receiver is gone.
    pub fn is_closed(&self) -> bool {
        self.shared.state.lock().rx_gone
    }

    /// Ends the receiver now: its next poll ends the stream, whatever is still queued.
    pub fn cut(&self) {
        self.end_with(|s| s.cut = true);
    }

    /// Marks an end in the state and wakes the receiver (outside the lock) to read it.
    fn end_with(&self, mark: impl FnOnce(&mut State<T>)) {
        let waker = {
            let mut s = self.shared.state.lock();
            mark(&mut s);
            s.rx_waker.take()
        };
        if let Some(w) = waker {
            w.wake();
        }
    }
}

impl<T> Drop for Outbox<T> {
    fn drop(&mut self) {
        self.end_with(|s| s.tx_gone = true);
    }
}

impl<T> Stream for OutboxRx<T> {
    type Item = T;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<T>> {
        let mut s = self.shared.state.lock();
        if s.cut {
            return Poll::Ready(None);
        }
        let was_full = s.queue.len() >= s.bound;
        if let Some(item) = s.queue.pop_front() {
            drop(s);
            if was_full {
                // Every sender waiting for room checked a full queue after registering its
                // wait, so this pop, the first since, wakes them all; those that find no
                // room wait again.
                self.shared.room.notify_waiters();
            }
            return Poll::Ready(Some(item));
        }
        if s.tx_gone {
            return Poll::Ready(None);
        }
        match &s.rx_waker {
            Some(w) if w.will_wake(cx.waker()) => {}
            _ => s.rx_waker = Some(cx.waker().clone()),
        }
        Poll::Pending
    }
}

impl<T> Drop for OutboxRx<T> {
    fn drop(&mut self) {
        let queued = {
            let mut s = self.shared.state.lock();
            s.rx_gone = true;
            std::mem::take(&mut s.queue)
        };
        // Dropped outside the lock; every waiting sender learns the queue is closed.
        drop(queued);
        self.shared.room.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::StreamExt;
    use std::time::Duration;

    #[tokio::test]
    async fn items_come_out_in_order_and_the_bound_holds() {
        let (tx, mut rx) = outbox(2);
        tx.try_send(1).unwrap();
        tx.try_send(2).unwrap();
        assert_eq!(tx.try_send(3), Err(TrySendError::Full(3)));
        assert_eq!(rx.next().await, Some(1));
        tx.try_send(3).unwrap();
        assert_eq!(rx.next().await, Some(2));
        assert_eq!(rx.next().await, Some(3));
        drop(tx);
        assert_eq!(
            rx.next().await,
            None,
            "the sender is gone and nothing is queued"
        );
    }

    #[tokio::test]
    async fn what_was_queued_is_still_received_after_the_sender_is_dropped() {
        let (tx, mut rx) = outbox(4);
        tx.try_send("a").unwrap();
        drop(tx);
        assert_eq!(rx.next().await, Some("a"));
        assert_eq!(rx.next().await, None);
    }

    #[tokio::test]
    async fn a_cut_queue_ends_at_once_without_what_is_queued() {
        let (tx, mut rx) = outbox(4);
        tx.try_send(1).unwrap();
        tx.cut();
        assert_eq!(rx.next().await, None);
    }

    #[tokio::test]
    async fn a_waiting_sender_goes_on_when_the_receiver_takes_an_item() {
        let (tx, mut rx) = outbox(1);
        tx.try_send(1).unwrap();
        let tx = Arc::new(tx);
        let sender = {
            let tx = tx.clone();
            tokio::spawn(async move { tx.send(2).await })
        };
        tokio::task::yield_now().await;
        assert!(!sender.is_finished(), "the queue is full: the sender waits");
        assert_eq!(rx.next().await, Some(1));
        assert_eq!(
            tokio::time::timeout(Duration::from_secs(5), sender)
                .await
                .expect("the sender was woken")
                .unwrap(),
            Ok(())
        );
        assert_eq!(rx.next().await, Some(2));
    }

    #[tokio::test]
    async fn several_waiting_senders_each_get_a_place_in_turn() {
        let (tx, mut rx) = outbox(1);
        tx.try_send(0).unwrap();
        let tx = Arc::new(tx);
        let senders: Vec<_> = (1..=3)
            .map(|i| {
                let tx = tx.clone();
                tokio::spawn(async move { tx.send(i).await })
            })
            .collect();
        let mut got = Vec::new();
        for _ in 0..4 {
            let item = tokio::time::timeout(Duration::from_secs(5), rx.next())
                .await
                .expect("no sender stays stuck");
            got.push(item.unwrap());
        }
        got.sort();
        assert_eq!(got, [0, 1, 2, 3]);
        for s in senders {
            assert_eq!(s.await.unwrap(), Ok(()));
        }
    }

    #[tokio::test]
    async fn a_dropped_receiver_fails_sends_and_wakes_waiting_senders() {
        let (tx, rx) = outbox(1);
        tx.try_send(1).unwrap();
        let tx = Arc::new(tx);
        let sender = {
            let tx = tx.clone();
            tokio::spawn(async move { tx.send(2).await })
        };
        tokio::task::yield_now().await;
        assert!(!tx.is_closed());
        drop(rx);
        assert!(tx.is_closed());
        assert_eq!(
            tokio::time::timeout(Duration::from_secs(5), sender)
                .await
                .expect("the sender was woken")
                .unwrap(),
            Err(2)
        );
        assert_eq!(tx.try_send(3), Err(TrySendError::Closed(3)));
    }

    #[test]
    fn an_idle_queue_is_one_small_allocation() {
        // The state behind the Arc: what an idle stream's queue costs beside its deque's
        // few slots. A tokio mpsc channel is a kilobyte or more.
        let size = std::mem::size_of::<Shared<Box<u8>>>();
        assert!(size <= 160, "Shared is {size} bytes");
    }
}
