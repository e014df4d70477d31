//! Liveness of the paths to tunnel servers, across load balancers.
//!
//! A path is one of the agent's connections ([`crate::stream::Dialer`]) to one tunnel
//! server instance: directly, or through a load balancer that spreads one connection's
//! streams over several servers. HTTP/2 PINGs prove the connection alive, but behind an L7
//! balancer they are answered by the balancer, so a server that went silent behind it
//! (or a path inside the balancer) would hold the calls on it until their deadlines. A
//! server that offers liveness (`ServerHello.liveness_ms`) pings one idle stream of each
//! agent connection (the agent names it in `relay-agent-conn`) every period whenever
//! every period; so while the path is alive, no frame-less gap on it lasts much over one
//! period while one of its streams is idle. A path with an idle stream for three and a
//! half periods and no frame for as long is silent ([`silent`]): 2.6 s with the servers'
//! default period of 750 ms, about when the server's own verdict on the same silence (a
//! ping unanswered for its 2 s timeout) comes, and two and a half periods of slack for a
//! server slow to send its ping. Every stream on a silent path
//! ends (the calls on them are lost, as on a broken connection), the connection is not
//! used for new streams, and the coverage actor treats that server as lost until a stream
//! lands there again.
//!
//! Cost: one watcher task per path and an atomic store per frame; the server's pings are
//! one per connection and period, whatever the number of streams. This module must not
//! open or close streams itself: it says when a path went silent.

use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;
use tokio::time::{Instant, MissedTickBehavior};
use tokio_util::sync::CancellationToken;
use tracing::warn;

/// How long a path may stay silent with an idle stream: three and a half of the server's
/// liveness periods (`ServerHello.liveness_ms`).
pub fn window(period: Duration) -> Duration {
    period.saturating_mul(7) / 2
}

/// Whether a path is silent: it has had an idle stream since `idle_since_ms` and heard its
/// last frame at `last_seen_ms`, both at least `window_ms` before `now_ms`.
pub fn silent(idle_since_ms: Option<u64>, last_seen_ms: u64, now_ms: u64, window_ms: u64) -> bool {
    idle_since_ms.is_some_and(|since| now_ms.saturating_sub(since) >= window_ms)
        && now_ms.saturating_sub(last_seen_ms) >= window_ms
}

/// The paths of this agent, by connection and server instance.
pub struct Paths {
    epoch: Instant,
    map: Mutex<HashMap<(u64, String), Weak<Path>>>,
}

impl Default for Paths {
    fn default() -> Self {
        Paths {
            epoch: Instant::now(),
            map: Mutex::default(),
        }
    }
}

/// One path: its streams' idleness and when it last heard a frame.
pub struct Path {
    epoch: Instant,
    window: Duration,
    last_seen_ms: AtomicU64,
    idle: Mutex<Idle>,
    silent: CancellationToken,
}

#[derive(Default)]
struct Idle {
    streams: usize,
    /// Since when at least one stream has been idle.
    since_ms: Option<u64>,
}

impl Paths {
    /// A stream landed on connection `generation` at server `instance_id` (`server_id`,
    /// for the log) whose hello offered liveness pings every `period`: its place on the
    /// path, which starts idle. The first stream of a path starts its watcher.
    pub fn join(
        &self,
        generation: u64,
        server_id: &str,
        instance_id: &str,
        period: Duration,
    ) -> PathSlot {
        let key = (generation, instance_id.to_string());
        let mut map = self.map.lock();
        map.retain(|_, p| p.strong_count() > 0);
        let path = match map.get(&key).and_then(Weak::upgrade) {
            Some(p) => p,
            None => {
                let p = Arc::new(Path {
                    epoch: self.epoch,
                    window: window(period),
                    last_seen_ms: AtomicU64::new(0),
                    idle: Mutex::default(),
                    silent: CancellationToken::new(),
                });
                p.seen();
                map.insert(key, Arc::downgrade(&p));
                // Owned by the path (it holds a `Weak`): it ends within a tick of the
                // path's last stream, and the streams end before the agent does.
                if let Ok(rt) = tokio::runtime::Handle::try_current() {
                    rt.spawn(watch(Arc::downgrade(&p), server_id.to_string()));
                }
                p
            }
        };
        drop(map);
        let mut slot = PathSlot { path, idle: false };
        slot.set_idle(true);
        slot
    }
}

impl Paths {
    /// Whether any path of connection `generation` heard a frame at or after `since`: the
    /// connection carries the servers' frames, whatever one open on it waits for.
    pub fn heard_since(&self, generation: u64, since: Instant) -> bool {
        let since_ms = since.saturating_duration_since(self.epoch).as_millis() as u64;
        self.map
            .lock()
            .iter()
            .filter(|((g, _), _)| *g == generation)
            .filter_map(|(_, p)| p.upgrade())
            .any(|p| p.last_seen_ms.load(Ordering::Relaxed) >= since_ms)
    }
}

impl Path {
    fn now_ms(&self) -> u64 {
        Instant::now()
            .saturating_duration_since(self.epoch)
            .as_millis() as u64
    }

    /// A frame came on one of the path's streams.
    pub fn seen(&self) {
        self.last_seen_ms
            .fetch_max(self.now_ms(), Ordering::Relaxed);
    }

    /// Fires once the path is found silent.
    pub fn silenced(&self) -> tokio_util::sync::WaitForCancellationFuture<'_> {
        self.silent.cancelled()
    }

    /// Cancelled once the path is found silent.
    pub fn token(&self) -> CancellationToken {
        self.silent.clone()
    }

    fn is_silent(&self, now_ms: u64) -> bool {
        let since = self.idle.lock().since_ms;
        silent(
            since,
            self.last_seen_ms.load(Ordering::Relaxed),
            now_ms,
            self.window.as_millis() as u64,
        )
    }
}

/// A stream's place on its path: counts it idle or busy, and leaves when dropped.
pub struct PathSlot {
    path: Arc<Path>,
    idle: bool,
}

impl PathSlot {
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The stream is idle (no call) or busy.
    pub fn set_idle(&mut self, idle: bool) {
        if idle == self.idle {
            return;
        }
        self.idle = idle;
        let now = self.path.now_ms();
        let mut st = self.path.idle.lock();
        if idle {
            st.streams += 1;
            if st.streams == 1 {
                st.since_ms = Some(now);
            }
        } else {
            st.streams = st.streams.saturating_sub(1);
            if st.streams == 0 {
                st.since_ms = None;
            }
        }
    }
}

impl Drop for PathSlot {
    fn drop(&mut self) {
        self.set_idle(false);
    }
}

/// Checks the path 25 times a window until it is silent or has no stream left.
async fn watch(path: Weak<Path>, server_id: String) {
    let every = match path.upgrade() {
        Some(p) => (p.window / 25).max(Duration::from_millis(10)),
        None => return,
    };
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(MissedTickBehavior::Skip);
    loop {
        tick.tick().await;
        let Some(p) = path.upgrade() else { return };
        let now = p.now_ms();
        if p.is_silent(now) {
            warn!(
                %server_id,
                silence_ms = now.saturating_sub(p.last_seen_ms.load(Ordering::Relaxed)),
                "tunnel server stopped answering on this connection; closing its streams there"
            );
            p.silent.cancel();
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_path_is_silent_only_with_an_idle_stream_and_no_frame_for_the_window() {
        // Idle since 0, last frame at 0: silent at the window, not before.
        assert!(!silent(Some(0), 0, 2_999, 3_000));
        assert!(silent(Some(0), 0, 3_000, 3_000));
        // A frame later moves it on.
        assert!(!silent(Some(0), 1_000, 3_500, 3_000));
        // Every stream busy: a silence proves nothing (a busy stream's answer can wait
        // behind its call's body).
        assert!(!silent(None, 0, 60_000, 3_000));
        // Idle only lately: the server may not have pinged that stream yet.
        assert!(!silent(Some(2_000), 0, 4_000, 3_000));
    }

    #[tokio::test(start_paused = true)]
    async fn a_silent_path_is_found_within_its_window_and_a_heard_one_is_not() {
        let paths = Paths::default();
        let period = Duration::from_secs(1);
        let heard = paths.join(1, "ts-1", "a", period);
        let quiet = paths.join(2, "ts-2", "b", period);
        let started = Instant::now();
        let heard_path = heard.path.clone();
        // The heard path gets a frame every period (the server's pings).
        let pinger = tokio::spawn(async move {
            loop {
                tokio::time::sleep(period).await;
                heard_path.seen();
            }
        });
        quiet.path().silenced().await;
        let took = started.elapsed();
        let w = window(period);
        assert!(took >= w && took <= w + w / 20, "found after {took:?}");
        assert!(!heard.path().silent.is_cancelled());
        pinger.abort();
    }

    #[tokio::test(start_paused = true)]
    async fn a_path_whose_streams_are_all_busy_is_not_found_silent() {
        let paths = Paths::default();
        let mut busy = paths.join(1, "ts-1", "a", Duration::from_secs(1));
        busy.set_idle(false);
        tokio::time::sleep(Duration::from_secs(30)).await;
        assert!(!busy.path().silent.is_cancelled());
        // Idle again: the window (3.5 s) counts from then.
        busy.set_idle(true);
        tokio::time::sleep(Duration::from_millis(3_400)).await;
        assert!(!busy.path().silent.is_cancelled());
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(busy.path().silent.is_cancelled());
    }
}
