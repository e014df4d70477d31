//! The wall clock, read here and nowhere else (`clippy.toml` bans `SystemTime::now`
//! elsewhere). Durations, deadlines and ages use `tokio::time::Instant`, which paused-time
//! tests control; the wall clock is only for what leaves the process with a date on it:
//! the hello's clock for the agent's skew check, record expiries shared through Redis,
//! `/debug/routes` times, and notes written into token stores.

use std::time::{SystemTime, UNIX_EPOCH};

/// Now, by the wall clock.
#[allow(clippy::disallowed_methods)]
pub fn now() -> SystemTime {
    SystemTime::now()
}

/// Milliseconds since the Unix epoch (0 if the clock is set before it).
pub fn unix_ms() -> u64 {
    now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}
