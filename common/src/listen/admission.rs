//! Admission of new connections: at most `max` connections of a listener are opening at
//! once; the rest wait their turn, first come first served, counted while they wait (a
//! gauge) and when they get in (a histogram of the wait). A listener has it when its server
//! asks ([`crate::listen::ListenerGuard::with_admission`]; the tunnel server's agent
//! listener, `max_opens_in_progress`).
//!
//! A connection is opening from its admission (right after the accept's checks: the
//! connection caps) until it has carried its first authenticated stream, or for
//! [`OPENING_HOLD`] at most: its TLS handshake, its HTTP/2 setup and its first stream open
//! (the token lookup, the hub registration, the hello). A waiting connection is a parked
//! socket: nothing is read from it, and its deadlines (`handshake_timeout`,
//! `first_byte_timeout`, `auth_timeout`) run from its admission, not from the accept.
//!
//! Why: on a server with one worker thread (the examples' `worker_threads = 1`), every
//! connection and stream open that is ready to run takes its turn before anything else
//! gets one. When thousands of agent connections and their tens of thousands of streams
//! opened at once (`relay-fleet storm`, docs/operations.md), every task of the process
//! waited behind them: load reports went out up to 10 s late, and connections whose first
//! stream the server had not reached within `auth_timeout` of their accept were closed,
//! so their agents opened again: a fifth of 45,000 streams failed. With a bounded number
//! opening, a waiting connection costs no turn and no deadline; on three servers 704 of
//! the 45,000 failed, and on one server all of 20,000 got in within 5.3 s. (A gate on the
//! `Tunnel.Connect` handler alone did not help: measured, no open ever waited there; the
//! cost is in the connections' HTTP/2 work before the handler runs.)
//! The control plane also runs on a thread of its own
//! (`crate::runtime::ControlRuntime`), so whatever the data plane does, the reports keep
//! their deadline.
//!
//! The semaphore is tokio's (fair: FIFO). The hold cap keeps connections that never
//! authenticate (a slow or hostile peer) from holding the gate shut for `auth_timeout`.

use prometheus::{Histogram, IntGauge};
use std::sync::Arc;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

/// Longest a connection holds its place while opening.
pub const OPENING_HOLD: std::time::Duration = std::time::Duration::from_secs(1);
/// The most places a gate may have (tokio's semaphore holds fewer permits than
/// `usize::MAX`; past this the gate would admit a storm whole anyway).
pub const MAX_PLACES: usize = 1 << 20;

/// The admission gate of one listener.
pub struct Admission {
    slots: Arc<Semaphore>,
    waiting: IntGauge,
    wait: Histogram,
}

/// A place held by an opening connection; dropping it admits the next one.
#[derive(Debug)]
pub struct Slot(#[allow(dead_code)] OwnedSemaphorePermit);

/// Counts one open as waiting for as long as it lives (also when the open is dropped
/// while it waits).
struct Waiting<'a>(&'a IntGauge);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.dec();
    }
}

impl Admission {
    /// `max`: connections opening at once (at least 1, at most [`MAX_PLACES`]).
    pub fn new(max: usize, waiting: IntGauge, wait: Histogram) -> Self {
        Admission {
            slots: Arc::new(Semaphore::new(max.clamp(1, MAX_PLACES))),
            waiting,
            wait,
        }
    }

    /// Waits for a slot (at once when one is free) and counts the wait.
    pub async fn admit(&self) -> Slot {
        if let Ok(p) = self.slots.clone().try_acquire_owned() {
            self.wait.observe(0.0);
            return Slot(p);
        }
        let since = Instant::now();
        self.waiting.inc();
        let _waiting = Waiting(&self.waiting);
        let p = self
            .slots
            .clone()
            .acquire_owned()
            .await
            .expect("the admission semaphore is never closed");
        self.wait.observe(since.elapsed().as_secs_f64());
        Slot(p)
    }

    /// Slots free now.
    pub fn free(&self) -> usize {
        self.slots.available_permits()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus::HistogramOpts;
    use std::time::Duration;

    fn gate(max: usize) -> Admission {
        Admission::new(
            max,
            IntGauge::new("waiting", "w").unwrap(),
            Histogram::with_opts(HistogramOpts::new("wait", "w").buckets(vec![0.001, 1.0]))
                .unwrap(),
        )
    }

    #[tokio::test(start_paused = true)]
    async fn up_to_max_get_in_at_once_the_rest_wait_counted_in_order() {
        let g = Arc::new(gate(2));
        let a = g.admit().await;
        let b = g.admit().await;
        assert_eq!(g.free(), 0);
        assert_eq!(g.waiting.get(), 0);
        assert_eq!(g.wait.get_sample_count(), 2);
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        for i in 0..3 {
            let (g, tx) = (g.clone(), tx.clone());
            tokio::spawn(async move {
                let slot = g.admit().await;
                tx.send(i).unwrap();
                // Held a moment, then the next one gets in.
                tokio::time::sleep(Duration::from_millis(10)).await;
                drop(slot);
            });
            tokio::task::yield_now().await;
        }
        assert_eq!(g.waiting.get(), 3);
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert!(
            rx.try_recv().is_err(),
            "nothing gets in while both slots are held"
        );
        drop(a);
        assert_eq!(rx.recv().await, Some(0));
        assert_eq!(g.waiting.get(), 2);
        drop(b);
        assert_eq!(rx.recv().await, Some(1));
        assert_eq!(rx.recv().await, Some(2));
        assert_eq!(g.waiting.get(), 0);
        assert_eq!(g.wait.get_sample_count(), 5);
        // The three that waited waited about 2 s: above the lowest bucket.
        assert!(
            g.wait.get_sample_sum() >= 6.0,
            "{}",
            g.wait.get_sample_sum()
        );
    }

    #[tokio::test(start_paused = true)]
    async fn an_open_given_up_while_waiting_leaves_the_gauge_and_takes_no_slot() {
        let g = Arc::new(gate(1));
        let held = g.admit().await;
        let waiter = tokio::spawn({
            let g = g.clone();
            async move {
                let _ = g.admit().await;
            }
        });
        tokio::task::yield_now().await;
        assert_eq!(g.waiting.get(), 1);
        waiter.abort();
        let _ = waiter.await;
        assert_eq!(g.waiting.get(), 0);
        drop(held);
        assert_eq!(g.free(), 1);
        // Given up: its wait was never counted as an admission.
        assert_eq!(g.wait.get_sample_count(), 1);
    }
}
