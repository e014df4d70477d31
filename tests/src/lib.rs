//! relay's end-to-end harness: the whole stack on loopback (`stack`), the relay's binaries
//! as child processes (`procs`) and as a fleet for fault tests (`procfleet`), a fake tunnel
//! server for the dispatcher's tests (`fake_server`), a hand-driven agent (`hostile`), a
//! backend client (`client`), the tests' load generator with its call ledger (`load`) and
//! the per-hop accounting (`ledger`), the stream-placing load-balancer fixture (`lb`), real
//! HAProxy and Redis fixtures (`haproxy`, `redis`), simulated upstreams (`upstream`),
//! generated TLS sets (`certs`), and headless Chromium for the status pages (`browser`).
//! Tests wait for conditions with [`eventually`], [`eventually_ok`] or [`time_until`], and
//! watch a window with [`holds_for`] where something must not happen. The `relay-fleet`
//! binary (demo and load tester) is built on it.

pub mod browser;
pub mod certs;
pub mod checks;
pub mod client;
pub mod fake_server;
pub mod fault;
pub mod fleet;
pub mod haproxy;
pub mod hostile;
pub mod lb;
pub mod ledger;
pub mod load;
pub mod metrics;
pub mod otlp;
pub mod procfleet;
pub mod procs;
pub mod promql;
pub mod redis;
pub mod soak;
pub mod stack;
pub mod upstream;

/// Polls `check` every 20 ms until it holds; panics naming `what` if it does not within
/// `within`. Tests wait for conditions this way, never for a fixed sleep.
pub async fn eventually<F, Fut>(what: &str, within: std::time::Duration, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + within;
    while !check().await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "not true within {within:?}: {what}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// Polls `check` every 20 ms until it returns `Ok`, and returns its value; panics naming
/// `what` and the last error if that takes longer than `within`. [`eventually`] for checks
/// that can say what is still wrong.
pub async fn eventually_ok<T, F, Fut>(what: &str, within: std::time::Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, String>>,
{
    let deadline = tokio::time::Instant::now() + within;
    loop {
        match check().await {
            Ok(v) => return v,
            Err(e) if tokio::time::Instant::now() >= deadline => {
                panic!("not true within {within:?}: {what}: {e}")
            }
            Err(_) => tokio::time::sleep(std::time::Duration::from_millis(20)).await,
        }
    }
}

/// Watches `check` every 20 ms for the whole `window`; panics naming `what` the first time
/// it does not hold. For what must NOT happen: wait for the state with [`eventually`]
/// first, then watch a window in which it must not change.
pub async fn holds_for<F, Fut>(what: &str, window: std::time::Duration, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let end = tokio::time::Instant::now() + window;
    loop {
        assert!(
            check().await,
            "no longer true within a {window:?} window: {what}"
        );
        if tokio::time::Instant::now() >= end {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// Polls `cond` every 20 ms until it holds; how long that took, or `None` at `within`.
/// For tests that measure a time against a stated bound rather than only wait.
pub async fn time_until<F, Fut>(
    within: std::time::Duration,
    mut cond: F,
) -> Option<std::time::Duration>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let started = tokio::time::Instant::now();
    while started.elapsed() < within {
        if cond().await {
            return Some(started.elapsed());
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    None
}
