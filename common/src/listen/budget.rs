//! The listener's bookkeeping with `now` passed in: the per-source budget of refused
//! authentications ([`AuthBudget`]) and the rate limit of its log lines ([`LogLimiter`]).

use super::{LOG_BURST, LOG_PERIOD, MAX_TRACKED_SOURCES};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tokio::time::Instant;

/// Per source address: refused authentications in the current window. Pure: `now` is
/// passed in.
#[derive(Debug)]
pub struct AuthBudget {
    allowed: u32,
    window: Duration,
    sources: HashMap<IpAddr, (Instant, u32)>,
}

impl AuthBudget {
    pub fn new(allowed: u32, window: Duration) -> Self {
        AuthBudget {
            allowed,
            window,
            sources: HashMap::new(),
        }
    }

    /// Records one refused authentication from `ip`; true when the source is now over its
    /// budget (and stays blocked until its window ends).
    pub fn failed(&mut self, ip: IpAddr, now: Instant) -> bool {
        if self.allowed == 0 {
            return false;
        }
        if !self.sources.contains_key(&ip) && self.sources.len() >= MAX_TRACKED_SOURCES {
            let window = self.window;
            self.sources
                .retain(|_, (start, _)| now.saturating_duration_since(*start) < window);
            if self.sources.len() >= MAX_TRACKED_SOURCES {
                if let Some(oldest) = self.sources.iter().min_by_key(|(_, (s, _))| *s) {
                    let oldest = *oldest.0;
                    self.sources.remove(&oldest);
                }
            }
        }
        let entry = self.sources.entry(ip).or_insert((now, 0));
        if now.saturating_duration_since(entry.0) >= self.window {
            *entry = (now, 0);
        }
        entry.1 = entry.1.saturating_add(1);
        entry.1 > self.allowed
    }

    /// Whether `ip` is over its budget in its current window.
    pub fn blocked(&self, ip: IpAddr, now: Instant) -> bool {
        self.allowed > 0
            && self.sources.get(&ip).is_some_and(|(start, n)| {
                *n > self.allowed && now.saturating_duration_since(*start) < self.window
            })
    }

    /// Source addresses remembered.
    pub fn len(&self) -> usize {
        self.sources.len()
    }

    pub fn is_empty(&self) -> bool {
        self.sources.is_empty()
    }
}

/// At most [`LOG_BURST`] lines per [`LOG_PERIOD`]; `allow` returns how many were left out
/// since the last line written, or `None` when this one is left out too.
#[derive(Debug)]
pub struct LogLimiter {
    state: Mutex<(Option<Instant>, u64)>,
    skipped: AtomicU64,
}

impl Default for LogLimiter {
    fn default() -> Self {
        LogLimiter {
            state: Mutex::new((None, 0)),
            skipped: AtomicU64::new(0),
        }
    }
}

impl LogLimiter {
    pub fn allow(&self) -> Option<u64> {
        self.allow_at(Instant::now())
    }

    pub fn allow_at(&self, now: Instant) -> Option<u64> {
        let mut st = self.state.lock();
        let (start, n) = &mut *st;
        if start.is_none_or(|s| now.saturating_duration_since(s) >= LOG_PERIOD) {
            *start = Some(now);
            *n = 0;
        }
        if *n < LOG_BURST {
            *n += 1;
            Some(self.skipped.swap(0, Ordering::Relaxed))
        } else {
            self.skipped.fetch_add(1, Ordering::Relaxed);
            None
        }
    }
}
