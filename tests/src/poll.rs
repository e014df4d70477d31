//! Waiting for a condition: the harness's one poll loop, [`poll`]. Nothing in the harness
//! waits a fixed time for a condition, and nothing writes its own deadline loop: a fixture
//! that can fail returns [`until`]'s [`TimedOut`], a test panics with it through
//! [`crate::eventually`], a test that measures takes [`crate::time_until`]'s duration, and
//! a window in which something must not happen is watched with [`crate::holds_for`].
//!
//! A check answers a [`Check`]: a `bool` (holds or not yet), or a `Result` whose `Ok` is
//! the value waited for and whose `Err` says what is still wrong (the last one is in the
//! failure message).

use std::fmt;
use std::future::Future;
use std::time::Duration;

use tokio::time::Instant;

/// How often a condition is checked unless the caller says otherwise.
pub const EVERY: Duration = Duration::from_millis(20);

/// What a check answers: the value waited for, or what is still wrong.
pub trait Check {
    type Value;
    fn settle(self) -> Result<Self::Value, String>;
}

impl Check for bool {
    type Value = ();
    fn settle(self) -> Result<(), String> {
        if self {
            Ok(())
        } else {
            Err(String::new())
        }
    }
}

impl<T, E: fmt::Display> Check for Result<T, E> {
    type Value = T;
    fn settle(self) -> Result<T, String> {
        self.map_err(|e| e.to_string())
    }
}

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

/// The one poll loop: runs `check` every `every` until it settles, and returns its value
/// with how long that took; once `within` has passed, the [`TimedOut`] naming `what` and
/// the check's last error. The check runs at least once.
pub async fn poll<C, F, Fut>(
    what: impl fmt::Display,
    within: Duration,
    every: Duration,
    mut check: F,
) -> Result<(C::Value, Duration), TimedOut>
where
    C: Check,
    F: FnMut() -> Fut,
    Fut: Future<Output = C>,
{
    let started = Instant::now();
    loop {
        match check().await.settle() {
            Ok(v) => return Ok((v, started.elapsed())),
            Err(last) if started.elapsed() >= within => {
                return Err(TimedOut {
                    what: what.to_string(),
                    within,
                    last,
                })
            }
            Err(_) => tokio::time::sleep(every).await,
        }
    }
}

/// [`poll`] every [`EVERY`], for the value alone: the form fixtures return errors with.
pub async fn until<C, F, Fut>(
    what: impl fmt::Display,
    within: Duration,
    check: F,
) -> Result<C::Value, TimedOut>
where
    C: Check,
    F: FnMut() -> Fut,
    Fut: Future<Output = C>,
{
    poll(what, within, EVERY, check).await.map(|(v, _)| v)
}
