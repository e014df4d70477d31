//! relay's end-to-end harness: the whole stack on loopback (`stack`), the relay's binaries
//! as child processes (`procs`) and as a fleet for fault tests (`procfleet`, the one way
//! to start a fleet of them), a fake tunnel server for the dispatcher's tests
//! (`fake_server`) and the dispatcher alone with its client (`dispatcher`), a hand-driven
//! agent (`hostile`), a backend client (`client`), the tests' load generator with its call
//! ledger (`load`) and the per-hop accounting (`ledger`), the stream-placing load-balancer
//! fixture (`lb`), real HAProxy and Redis fixtures (`haproxy`, `redis`), two dispatchers
//! sharing one Redis (`shared_registry`), simulated upstreams (`upstream`), generated TLS
//! sets (`certs`), the deploy kit's TLS stack and Prometheus (`deploy`), and headless
//! Chromium for the status pages (`browser`). Tests wait for conditions with
//! [`eventually`] (or measure one with [`time_until`]), and watch a window with
//! [`holds_for`] where something must not happen; all three, and every fixture that waits,
//! run the one loop in [`poll`]. The `relay-fleet` binary (demo and load tester) is built
//! on it.

pub mod browser;
pub mod certs;
pub mod checks;
pub mod client;
pub mod deploy;
pub mod dispatcher;
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
pub mod poll;
pub mod procfleet;
pub mod procs;
pub mod promql;
pub mod redis;
pub mod shared_registry;
pub mod soak;
pub mod stack;
pub mod storm;
pub mod upstream;

/// Polls `check` every 20 ms until it holds (`true`, or `Ok` with the value it returns);
/// panics naming `what` and the last error if that takes longer than `within`. Tests wait
/// for conditions this way, never for a fixed sleep.
pub async fn eventually<C, F, Fut>(what: &str, within: std::time::Duration, check: F) -> C::Value
where
    C: poll::Check,
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = C>,
{
    poll::until(what, within, check)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
}

/// Watches `check` every 20 ms for the whole `window`; panics naming `what` the first time
/// it does not hold. For what must NOT happen: wait for the state with [`eventually`]
/// first, then watch a window in which it must not change.
pub async fn holds_for<F, Fut>(what: &str, window: std::time::Duration, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    // Polls for the condition to break; the window passing without that is the success.
    let broke = poll::until(what, window, || {
        let f = check();
        async move { !f.await }
    })
    .await;
    assert!(
        broke.is_err(),
        "no longer true within a {window:?} window: {what}"
    );
}

/// Polls `cond` every 20 ms until it holds; how long that took, or `None` at `within`.
/// For tests that measure a time against a stated bound rather than only wait.
pub async fn time_until<F, Fut>(within: std::time::Duration, cond: F) -> Option<std::time::Duration>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let took = poll::poll("", within, poll::EVERY, cond).await;
    took.ok().map(|((), took)| took)
}
