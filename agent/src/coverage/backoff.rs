//! The open backoff gate.

use super::*;

/// The gate in front of opens after consecutive failed opens: jittered exponential delay,
/// one step (and one log line) per batch of failures, cleared by a landing.
pub(super) struct Backoff {
    initial: Duration,
    max: Duration,
    step: u32,
    until: Option<Instant>,
    step_started: Option<Instant>,
}

impl Backoff {
    pub(super) fn new(initial: Duration, max: Duration) -> Self {
        Backoff {
            initial,
            max,
            step: 0,
            until: None,
            step_started: None,
        }
    }

    pub(super) fn allows(&self, now: Instant) -> bool {
        self.until.is_none_or(|u| now >= u)
    }

    pub(super) fn failed(&mut self, now: Instant, open_started: Instant, err: &OpenError) {
        // Opens started before the current step belong to the batch that caused it.
        if self.step_started.is_some_and(|s| open_started < s) {
            return;
        }
        self.step = self.step.saturating_add(1);
        let exp = self.step.saturating_sub(1).min(20);
        let base = self.initial.saturating_mul(1 << exp).min(self.max);
        // Equal jitter: half fixed, half random, so failed agents do not retry in step.
        let half = base / 2;
        let jitter = half.mul_f64(rand::random::<f64>());
        let delay = half + jitter;
        self.until = Some(now + delay);
        self.step_started = Some(now);
        warn!(attempt = self.step, delay_ms = delay.as_millis() as u64, reason = %err, "tunnel stream open failed; backing off");
    }

    pub(super) fn reset(&mut self) {
        if self.step > 0 {
            info!(
                after_attempts = self.step,
                "tunnel stream landed; open backoff cleared"
            );
        }
        self.step = 0;
        self.until = None;
        self.step_started = None;
    }
}
