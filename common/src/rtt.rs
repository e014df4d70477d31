//! A smoothed round-trip time (EWMA) with the design's sample rules, shared by the tunnel
//! server (its leg to an agent's streams) and the dispatcher (its leg to a tunnel server).
//!
//! Pure arithmetic: no clock, no I/O. The caller times the round trip and feeds samples.

/// Smoothed round-trip time.
///
/// Sample rules (from the design): a sample is capped at 4x the current average, so one
/// stalled answer cannot blow the average up; a sample below a quarter of the average
/// replaces it, so a path that got much faster is believed at once.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Rtt {
    /// Microseconds; 0 while no sample was taken.
    avg_us: f64,
}

impl Rtt {
    /// Weight of a new sample.
    pub const ALPHA: f64 = 0.2;

    pub fn observe(&mut self, sample_us: f64) {
        let sample = sample_us.max(1.0);
        if self.avg_us <= 0.0 || sample < self.avg_us / 4.0 {
            self.avg_us = sample;
            return;
        }
        let sample = sample.min(self.avg_us * 4.0);
        self.avg_us += Self::ALPHA * (sample - self.avg_us);
    }

    /// One sample as a duration.
    pub fn observe_duration(&mut self, sample: std::time::Duration) {
        self.observe(sample.as_secs_f64() * 1e6);
    }

    /// The average in whole microseconds, 0 if unknown.
    pub fn micros(&self) -> u32 {
        self.avg_us.round().clamp(0.0, u32::MAX as f64) as u32
    }
}

#[cfg(test)]
mod tests {
    use super::Rtt;

    #[test]
    fn first_sample_sets_the_average_and_later_ones_smooth_it() {
        let mut r = Rtt::default();
        assert_eq!(r.micros(), 0, "unknown until the first sample");
        r.observe(1000.0);
        assert_eq!(r.micros(), 1000);
        r.observe(2000.0);
        assert_eq!(r.micros(), 1200);
    }

    #[test]
    fn a_sample_is_capped_at_four_times_the_average() {
        let mut r = Rtt::default();
        r.observe(1000.0);
        r.observe(1_000_000.0);
        // Capped at 4000: 1000 + 0.2 * 3000.
        assert_eq!(r.micros(), 1600);
    }

    #[test]
    fn a_sample_below_a_quarter_of_the_average_replaces_it() {
        let mut r = Rtt::default();
        r.observe(10_000.0);
        r.observe(2_000.0);
        assert_eq!(r.micros(), 2000);
        r.observe(600.0); // above 2000 / 4: smoothed, not replaced
        assert_eq!(r.micros(), 1720);
    }
}
