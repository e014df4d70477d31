//! The open window: how many of this agent's stream opens may be in progress at once,
//! from the dial to the `ServerHello`.
//!
//! `max_opening` is its ceiling. Below it the window adapts the way TCP's congestion
//! window does, with the hello as the acknowledgement:
//! - it starts at [`INITIAL`] and grows by one for every open that lands within half of
//!   `connect_timeout` (so it doubles every round of opens while the servers keep up, and
//!   a lone agent covering ten servers is at 32 after three rounds of a few milliseconds);
//! - an open that times out waiting for its hello halves it (never below one), once per
//!   round: opens that started before the last cut were sent into the same queue and do
//!   not cut again. After a cut it grows by one per window of landings;
//! - an open still waiting for its hello after the retransmission timeout
//!   ([`OpenTurn::during`]: the smoothed landing time plus four times its variation, as
//!   TCP's RFC 6298 reckons it, from [`MIN_RTO`] up to half of `connect_timeout`) is
//!   presumed lost: it gives up its place and cuts the window as a timeout does, and the
//!   timeout doubles for the next expiry until an open lands. The open itself goes on,
//!   and lands or fails as before.
//!
//! Why: a hello that does not come within `connect_timeout` while other opens land says
//! the servers (or the balancer in front of them) are busy, not gone. An agent that kept
//! `max_opening` opens outstanding then asked again for every one that timed out, and a
//! fleet of agents opening their streams at once (a start, a restart of the servers)
//! offered the servers more opens the longer they took: on two cores, 3,000 agents
//! through a stream-placing balancer never came up. With the window each agent keeps at
//! most as many opens outstanding as its last ones could be served, so the opens the
//! servers receive fall back to what they serve, and every open that waits does so here,
//! where it costs nothing, rather than in a server's queue where it times out.
//!
//! Why the timeout frees places: opens do not all meet the same fate. Behind a balancer
//! that still places opens on a server that just died (until its health checks mark it
//! down, seconds), a third of the opens wait there for the balancer's connect retries
//! while the rest land in milliseconds. Holding a place each, they filled the window and
//! growth on the live servers waited behind them (a growth step took 4 s instead of a
//! fraction of one). An open that takes many times the landings' usual time is not
//! telling the window about the servers that answer; after the timeout it stops counting,
//! and since each expiry also cuts the window, and the timeout doubles per expiry, a
//! storm of slow opens still gets at most about twice the window outstanding.
//!
//! This module decides nothing else: where an open goes and what a failure means to the
//! coverage actor are `stream`'s and `coverage`'s.

use parking_lot::Mutex;
use prometheus::IntGauge;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Notify;
use tokio::time::Instant;

/// The window of a fresh agent.
pub const INITIAL: usize = 4;

/// The least retransmission timeout (Linux TCP's): below it a landing's time is mostly
/// scheduling, not the servers.
pub const MIN_RTO: Duration = Duration::from_millis(200);

/// The retransmission timeout before the first landing (RFC 6298's 1 s, at most half of
/// `connect_timeout`).
pub const INITIAL_RTO: Duration = Duration::from_secs(1);

/// The window and the opens in progress.
pub struct OpenWindow {
    max: usize,
    /// A landing slower than this does not grow the window (half of `connect_timeout`).
    slow: Duration,
    state: Mutex<State>,
    freed: Notify,
    /// `relay_agent_open_window`: the window now.
    gauge: IntGauge,
}

struct State {
    /// The window (at least 1).
    limit: usize,
    /// Below this the window doubles every round (slow start); a cut sets it to the new
    /// window.
    threshold: usize,
    /// Quick landings since the window last grew, above the threshold.
    acked: usize,
    in_progress: usize,
    /// When the window was last cut.
    cut_at: Option<Instant>,
    /// Smoothed landing time and its mean deviation (RFC 6298), from every landing; none
    /// before the first.
    srtt: Option<Duration>,
    rttvar: Duration,
    /// Expiries since the last landing: each doubles the timeout.
    backoff: u32,
}

/// One open's place in the window, held from before the dial until its hello or failure;
/// dropping it without a verdict frees the place and changes nothing else.
pub struct OpenTurn {
    window: Arc<OpenWindow>,
    started: Instant,
    /// Still holds its place (false once the timeout passed: [`OpenTurn::during`]).
    counted: bool,
}

impl OpenWindow {
    /// `max`: `max_opening` (at least 1); `connect_timeout` bounds an open.
    pub fn new(max: usize, connect_timeout: Duration, gauge: IntGauge) -> Arc<Self> {
        let max = max.max(1);
        let limit = INITIAL.min(max);
        gauge.set(limit as i64);
        Arc::new(OpenWindow {
            max,
            slow: connect_timeout / 2,
            state: Mutex::new(State {
                limit,
                threshold: max,
                acked: 0,
                in_progress: 0,
                cut_at: None,
                srtt: None,
                rttvar: Duration::ZERO,
                backoff: 0,
            }),
            freed: Notify::new(),
            gauge,
        })
    }

    /// Waits for a place in the window.
    pub async fn turn(self: &Arc<Self>) -> OpenTurn {
        loop {
            let freed = self.freed.notified();
            tokio::pin!(freed);
            // Registered before the check, so a place freed in between is not missed.
            freed.as_mut().enable();
            {
                let mut s = self.state.lock();
                if s.in_progress < s.places() {
                    s.in_progress += 1;
                    return OpenTurn {
                        window: self.clone(),
                        started: Instant::now(),
                        counted: true,
                    };
                }
            }
            freed.await;
        }
    }

    /// The window now (whole places).
    pub fn limit(&self) -> usize {
        self.state.lock().places()
    }

    /// Opens in progress now.
    pub fn in_progress(&self) -> usize {
        self.state.lock().in_progress
    }

    /// The retransmission timeout now.
    pub fn rto(&self) -> Duration {
        self.state.lock().rto(self.slow)
    }

    fn landed(&self, took: Duration) {
        let mut s = self.state.lock();
        s.sample(took);
        if took > self.slow {
            return;
        }
        if s.limit < s.threshold {
            s.limit += 1;
        } else {
            s.acked += 1;
            if s.acked >= s.limit {
                s.acked = 0;
                s.limit += 1;
            }
        }
        s.limit = s.limit.min(self.max);
        self.gauge.set(s.places() as i64);
    }

    fn timed_out(&self, started: Instant) {
        let mut s = self.state.lock();
        self.cut(&mut s, started);
    }

    /// An open passed the timeout: it frees its place and cuts the window, and the next
    /// timeout is twice as long (both once per round).
    fn expired(&self, started: Instant) {
        {
            let mut s = self.state.lock();
            s.in_progress -= 1;
            if self.cut(&mut s, started) {
                s.backoff = (s.backoff + 1).min(16);
            }
        }
        self.freed.notify_waiters();
    }

    /// Halves the window unless the open started before the last cut (the same round);
    /// whether it did.
    fn cut(&self, s: &mut State, started: Instant) -> bool {
        if s.cut_at.is_some_and(|at| started < at) {
            return false;
        }
        s.limit = (s.limit / 2).max(1);
        s.threshold = s.limit;
        s.acked = 0;
        s.cut_at = Some(Instant::now());
        self.gauge.set(s.places() as i64);
        true
    }
}

impl State {
    fn places(&self) -> usize {
        self.limit.max(1)
    }

    /// RFC 6298 section 2: the first sample sets the mean and half of it as the
    /// deviation; later ones move them by 1/8 and 1/4.
    fn sample(&mut self, took: Duration) {
        self.backoff = 0;
        match self.srtt {
            None => {
                self.srtt = Some(took);
                self.rttvar = took / 2;
            }
            Some(srtt) => {
                let err = srtt.abs_diff(took);
                self.rttvar = self.rttvar * 3 / 4 + err / 4;
                self.srtt = Some(srtt * 7 / 8 + took / 8);
            }
        }
    }

    fn rto(&self, ceiling: Duration) -> Duration {
        let base = match self.srtt {
            None => INITIAL_RTO,
            Some(srtt) => (srtt + 4 * self.rttvar).max(MIN_RTO),
        };
        base.saturating_mul(1 << self.backoff).min(ceiling)
    }
}

impl OpenTurn {
    /// Runs the open `fut`, giving up this place if it is still pending after the
    /// retransmission timeout, and then calling `stalled` (the open goes on: the module
    /// docs say why).
    pub async fn during<F: Future>(&mut self, fut: F, stalled: impl FnOnce()) -> F::Output {
        tokio::pin!(fut);
        if self.counted {
            let rto = self.window.rto();
            let deadline = self.started + rto;
            tokio::select! {
                biased;
                out = &mut fut => return out,
                () = tokio::time::sleep_until(deadline) => {
                    self.counted = false;
                    self.window.expired(self.started);
                    stalled();
                }
            }
        }
        fut.await
    }

    /// The open got its hello: the window grows when it came quickly.
    pub fn landed(self) {
        self.window.landed(self.started.elapsed());
    }

    /// The open timed out waiting for its hello: the window narrows.
    pub fn timed_out(self) {
        self.window.timed_out(self.started);
    }
}

impl Drop for OpenTurn {
    fn drop(&mut self) {
        if !self.counted {
            return;
        }
        self.window.state.lock().in_progress -= 1;
        // Every waiter looks again: the window may have grown by more than this place.
        self.window.freed.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TIMEOUT: Duration = Duration::from_secs(5);

    fn window(max: usize) -> Arc<OpenWindow> {
        OpenWindow::new(max, TIMEOUT, IntGauge::new("w", "w").unwrap())
    }

    /// Takes every place free now.
    fn take_all(w: &Arc<OpenWindow>) -> Vec<OpenTurn> {
        let mut turns = Vec::new();
        loop {
            let fut = w.turn();
            tokio::pin!(fut);
            let waker = futures::task::noop_waker();
            let mut cx = std::task::Context::from_waker(&waker);
            match fut.as_mut().poll(&mut cx) {
                std::task::Poll::Ready(t) => turns.push(t),
                std::task::Poll::Pending => return turns,
            }
        }
    }

    #[tokio::test(start_paused = true)]
    async fn the_window_doubles_per_round_of_quick_landings_up_to_max_opening() {
        let w = window(64);
        let mut rounds = Vec::new();
        for _ in 0..6 {
            let turns = take_all(&w);
            rounds.push(turns.len());
            for t in turns {
                t.landed();
            }
        }
        assert_eq!(rounds, [4, 8, 16, 32, 64, 64]);
        assert_eq!(w.gauge.get(), 64);
    }

    #[tokio::test(start_paused = true)]
    async fn a_round_of_timeouts_halves_the_window_once_and_it_never_closes() {
        let w = window(64);
        for _ in 0..3 {
            for t in take_all(&w) {
                t.landed();
            }
        }
        let round = take_all(&w);
        assert_eq!(round.len(), 32);
        tokio::time::advance(TIMEOUT).await;
        // Every open of the round timed out: one cut, not 32.
        for t in round {
            t.timed_out();
        }
        assert_eq!(w.limit(), 16);
        // Each later round of timeouts halves it again, down to one open at a time.
        for want in [8, 4, 2, 1, 1] {
            let round = take_all(&w);
            tokio::time::advance(TIMEOUT).await;
            for t in round {
                t.timed_out();
            }
            assert_eq!(w.limit(), want);
        }
        assert_eq!(take_all(&w).len(), 1, "a window of one still opens");
    }

    #[tokio::test(start_paused = true)]
    async fn after_a_cut_it_grows_by_one_per_window_of_landings() {
        let w = window(64);
        for t in take_all(&w) {
            t.landed();
        }
        // 8 now; a timeout cuts it to 4.
        let round = take_all(&w);
        assert_eq!(round.len(), 8);
        let mut round = round.into_iter();
        round.next().unwrap().timed_out();
        drop(round);
        assert_eq!(w.limit(), 4);
        for want in [5, 6, 7] {
            for t in take_all(&w) {
                t.landed();
            }
            assert_eq!(w.limit(), want);
        }
    }

    #[tokio::test(start_paused = true)]
    async fn slow_landings_hold_the_window_and_a_dropped_turn_frees_its_place() {
        let w = window(64);
        let round = take_all(&w);
        assert_eq!(round.len(), 4);
        assert_eq!(w.in_progress(), 4);
        tokio::time::advance(TIMEOUT / 2 + Duration::from_millis(1)).await;
        for t in round {
            t.landed();
        }
        assert_eq!(w.limit(), 4);
        assert_eq!(w.in_progress(), 0);
        let round = take_all(&w);
        drop(round);
        assert_eq!(w.limit(), 4);
        assert_eq!(take_all(&w).len(), 4);
    }

    #[tokio::test(start_paused = true)]
    async fn a_waiting_open_gets_the_place_an_ending_one_frees() {
        let w = window(1);
        let first = w.turn().await;
        let w2 = w.clone();
        let waiting = tokio::spawn(async move { w2.turn().await.started });
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished());
        drop(first);
        let started = tokio::time::timeout(Duration::from_secs(1), waiting)
            .await
            .expect("the waiting open got the place")
            .unwrap();
        assert!(started <= Instant::now());
    }

    #[tokio::test(start_paused = true)]
    async fn the_timeout_follows_the_landings_within_its_bounds() {
        let w = window(64);
        assert_eq!(w.rto(), INITIAL_RTO, "before any landing");
        // Landings of 10 ms: the timeout settles at its floor.
        for _ in 0..4 {
            let round = take_all(&w);
            tokio::time::advance(Duration::from_millis(10)).await;
            for t in round {
                t.landed();
            }
        }
        assert_eq!(w.rto(), MIN_RTO);
        // Landings of 2 s (slow: the window does not grow) raise it to theirs, and
        // slower ones to its ceiling, half of connect_timeout.
        let limit = w.limit();
        let mut rtos = Vec::new();
        for took in [2, 2, 2, 4] {
            let round = take_all(&w);
            tokio::time::advance(Duration::from_secs(took)).await;
            for t in round {
                t.landed();
            }
            rtos.push(w.rto());
        }
        assert_eq!(w.limit(), limit);
        assert!(
            rtos[2] >= Duration::from_secs(2) && rtos[2] < TIMEOUT / 2,
            "{rtos:?}"
        );
        assert_eq!(rtos[3], TIMEOUT / 2);
    }

    #[tokio::test(start_paused = true)]
    async fn an_open_past_the_timeout_frees_its_place_and_goes_on() {
        let w = window(64);
        let round = take_all(&w);
        tokio::time::advance(Duration::from_millis(5)).await;
        for t in round {
            t.landed();
        }
        // A round of 8: two are placed where no hello comes, six land at once.
        let mut round = take_all(&w);
        assert_eq!(round.len(), 8);
        let mut stuck: Vec<_> = round.drain(..2).collect();
        for t in round {
            t.landed();
        }
        assert_eq!(w.limit(), 14);
        let stalls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let (hello_tx, hello_rx) = tokio::sync::oneshot::channel::<()>();
        let mut first = stuck.remove(0);
        let mut second = stuck.remove(0);
        let n = stalls.clone();
        let first = tokio::spawn(async move {
            let got = first
                .during(hello_rx, || {
                    n.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                })
                .await;
            (first, got.is_ok())
        });
        let n = stalls.clone();
        let second = tokio::spawn(async move {
            second
                .during(std::future::pending::<()>(), || {
                    n.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                })
                .await
        });
        tokio::task::yield_now().await;
        assert_eq!(w.in_progress(), 2);
        // Past the timeout both give up their places and the window is cut once.
        tokio::time::advance(w.rto() + Duration::from_millis(1)).await;
        tokio::task::yield_now().await;
        assert_eq!(stalls.load(std::sync::atomic::Ordering::SeqCst), 2);
        assert_eq!(w.in_progress(), 0);
        assert_eq!(w.limit(), 7);
        assert_eq!(take_all(&w).len(), 7, "the places are free for other opens");
        // The next timeout is twice as long (once for the round), until an open lands.
        assert_eq!(w.rto(), 2 * MIN_RTO);
        // The first still gets its hello: it lands, late, and the timeout is back.
        hello_tx.send(()).unwrap();
        let (turn, landed) = first.await.unwrap();
        assert!(landed);
        turn.landed();
        assert!(w.rto() < 2 * MIN_RTO, "{:?}", w.rto());
        assert_eq!(w.in_progress(), 0, "a stalled turn frees its place once");
        second.abort();
    }
}
