//! Waiting for a condition: the harness's one poll loop, [`poll`], and the forms tests
//! and fixtures call it by. Nothing in the harness waits a fixed time for a condition, and
//! nothing writes its own deadline loop: a fixture that can fail returns [`until`]'s
//! [`TimedOut`], a test panics with it through [`crate::eventually`] or
//! [`crate::eventually_ok`], a test that measures takes [`crate::time_until`]'s duration,
//! and a window in which something must not happen is watched with [`crate::holds_for`].

use std::fmt;
use std::future::Future;
use std::time::Duration;

use tokio::time::Instant;

/// How often a condition is checked unless the caller says otherwise.
pub const EVERY: Duration = Duration::from_millis(20);

/// A condition that did not hold in time: what was awaited, for how long, and the last
/// thing the check saw (its last error; empty when the check has nothing to say).
#[derive(Clone, Debug)]
pub struct TimedOut {
    pub what: String,
    pub within: Duration,
    pub last: String,
}

impl fmt::Display for TimedOut {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "not true within {:?}: {}", self.within, self.what)?;
        if !self.last.is_empty() {
            write!(f, ": {}", self.last)?;
        }
        Ok(())
    }
}

impl std::error::Error for TimedOut {}

/// The one poll loop: runs `check` every `every` until it returns `Ok`, and returns its
/// value with how long that took; once `within` has passed, the [`TimedOut`] naming
/// `what` and the check's last error. The check runs at least once.
pub async fn poll<T, E, F, Fut>(
    what: impl fmt::Display,
    within: Duration,
    every: Duration,
    mut check: F,
) -> Result<(T, Duration), TimedOut>
where
    E: fmt::Display,
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, E>>,
{
    let started = Instant::now();
    loop {
        match check().await {
            Ok(v) => return Ok((v, started.elapsed())),
            Err(e) if started.elapsed() >= within => {
                return Err(TimedOut {
                    what: what.to_string(),
                    within,
                    last: e.to_string(),
                })
            }
            Err(_) => tokio::time::sleep(every).await,
        }
    }
}

/// [`poll`] every [`EVERY`], for the value alone: the form fixtures return errors with.
pub async fn until<T, E, F, Fut>(
    what: impl fmt::Display,
    within: Duration,
    check: F,
) -> Result<T, TimedOut>
where
    E: fmt::Display,
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, E>>,
{
    poll(what, within, EVERY, check).await.map(|(v, _)| v)
}

/// A check's answer for a condition that has nothing to say but "not yet".
pub fn holds(yes: bool) -> Result<(), &'static str> {
    if yes {
        Ok(())
    } else {
        Err("")
    }
}
