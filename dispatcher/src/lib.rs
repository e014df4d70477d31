//! relay dispatcher: the HTTP front for backend services.
//!
//! A backend calls `ANY /relay/{tunnel_id}/{path}?{query}` with its caller key; the
//! dispatcher picks a tunnel server that holds streams of that tunnel id (learned from the
//! servers' `Registry.Report` streams), relays the call over `Forward.Call`, and streams the
//! response back. Three listeners: the HTTP front (HTTP/1.1 + h2c), the registry gRPC
//! listener, and the admin listener (`/metrics`, `/healthz`, `/readyz`, `/debug/routes`).
//!
//! Modules, in the order a call meets them: `front` (the HTTP listener and request checks),
//! `call` (one call from accept to outcome: routing, attempts, head checks, the one log
//! line and metric), `attempt` (pure: which server is tried next, retry rules, the queue
//! handshake), `replay` (the request body, replayable for a retry), `forward` (one
//! attempt's RPC and the hops to each tunnel server), `pool` and `carrier` (connections and
//! reused `Forward.Carry` RPCs), `colocated` (the tunnel server in this process),
//! `response` (the response body), `guard` (each call's metrics, recorded once, and its
//! slots). Beside them: `config` (settings, one file per section), `headers` (header
//! rules), `quota` (a caller's calls per tunnel id), `routing` (the pure routing decision:
//! sticky / available, spill share, load, latency tiers), `latency` (this dispatcher's
//! measured leg to each tunnel server), `registry` (the routing table as a pure state
//! machine, leases, and the shell, `Routes`, that carries its changes out to the plans,
//! shared store and forward channels), `shared` (the Redis-backed shared registry),
//! `report` (the gRPC service feeding the table), `status` (the admin status page),
//! `start` (every component built from the config, then spawned and stopped in order),
//! `metrics` (with the routing series read from the registry at scrape time), `error`.
//!
//! The crate never buffers a whole body, never logs or forwards a caller key, and takes
//! already-bound listeners so tests and the one-process demo can run it on `127.0.0.1:0`.
//! `start` returns a [`DispatcherHandle`] whose drop (or `shutdown`) drains and stops every
//! task, as the agent's and the tunnel server's handles do; `run` serves until a shutdown
//! future resolves.

pub mod attempt;
pub mod call;
pub mod carrier;
pub mod colocated;
pub mod config;
pub mod error;
pub mod forward;
pub mod front;
pub mod guard;
pub mod headers;
pub mod latency;
pub mod metrics;
pub mod pool;
pub mod quota;
pub mod registry;
pub mod replay;
pub mod report;
pub mod response;
pub mod routing;
pub mod shared;
pub mod start;
pub mod status;

pub use config::{
    CallerConfig, Config, RegistryBackend, RegistryConfig, RoutingConfig, RoutingPolicy,
};
pub use error::RunError;

use std::future::Future;
use std::net::SocketAddr;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::warn;

/// The dispatcher's three listeners, bound by the caller.
pub struct Listeners {
    /// HTTP front for backends.
    pub http: TcpListener,
    /// gRPC `Registry.Report` listener for tunnel servers.
    pub registry: TcpListener,
    /// Admin listener.
    pub admin: TcpListener,
}

/// Runs the dispatcher until `shutdown` resolves, then drains: the HTTP front stops
/// accepting and calls in flight get up to `shutdown_grace` to finish; then the registry and
/// admin listeners stop. Returns early (with the error) if the registry listener fails.
pub async fn run(
    config: Config,
    listeners: Listeners,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), RunError> {
    let mut dispatcher = start(config, listeners).await?;
    tokio::select! {
        r = dispatcher.stopped() => return r,
        _ = shutdown => {}
    }
    dispatcher.shutdown().await
}

/// A running dispatcher, shaped like the agent's and the tunnel server's handles.
/// Dropping it stops the dispatcher: it drains in the background as `shutdown` does.
#[must_use = "dropping the handle stops the dispatcher"]
pub struct DispatcherHandle {
    /// The HTTP front's address.
    pub http_addr: SocketAddr,
    /// The registry listener's address.
    pub registry_addr: SocketAddr,
    /// The admin listener's address.
    pub admin_addr: SocketAddr,
    /// Cancelled to begin the graceful stop (by `shutdown` or on drop).
    stop: CancellationToken,
    /// Serves until `stop`, then drains; ends with the run's result.
    task: Option<JoinHandle<Result<(), RunError>>>,
}

impl DispatcherHandle {
    /// Stops the dispatcher (the HTTP front drains within `shutdown_grace`, then the
    /// registry and admin listeners stop) and waits for the end.
    pub async fn shutdown(mut self) -> Result<(), RunError> {
        self.stop.cancel();
        self.stopped().await
    }

    /// Resolves when the dispatcher has stopped: after `shutdown` or drop, or on its own
    /// when the registry listener fails (with that error). Resolves at once once it did.
    pub async fn stopped(&mut self) -> Result<(), RunError> {
        let Some(task) = self.task.as_mut() else {
            return Ok(());
        };
        let r = task.await;
        self.task = None;
        match r {
            Ok(r) => r,
            Err(join) => {
                warn!(error = %join, "dispatcher task failed");
                Ok(())
            }
        }
    }
}

impl Drop for DispatcherHandle {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// Validates `config` and starts the dispatcher on the given listeners (bound by the
/// caller; tests pass `127.0.0.1:0`). It serves until the handle's `shutdown` or drop.
pub async fn start(config: Config, listeners: Listeners) -> Result<DispatcherHandle, RunError> {
    start_with(config, listeners, None).await
}

/// [`start`], with the tunnel server of this process when co-located (`colocated::Local`):
/// calls routed to its `forward_url` reach it without gRPC, and it comes first among the
/// servers holding a call's tunnel id. Builds every component from `config`, then spawns
/// them (`start`).
pub async fn start_with(
    config: Config,
    listeners: Listeners,
    local: Option<colocated::Local>,
) -> Result<DispatcherHandle, RunError> {
    Ok(start::Dispatcher::build(&config, listeners, local)?.spawn())
}

#[cfg(test)]
mod tests {
    use super::*;
    use relay_common::testing::until_refused;
    use std::time::Duration;
    use tokio::net::TcpStream;

    async fn start_plain() -> DispatcherHandle {
        let bind = || TcpListener::bind("127.0.0.1:0");
        let listeners = Listeners {
            http: bind().await.unwrap(),
            registry: bind().await.unwrap(),
            admin: bind().await.unwrap(),
        };
        let config = Config {
            callers: vec![CallerConfig::allow_all("ci", "k")],
            shutdown_grace: Duration::from_secs(2),
            ..Config::default().insecure()
        };
        start(config, listeners).await.unwrap()
    }

    fn addrs(d: &DispatcherHandle) -> [SocketAddr; 3] {
        [d.http_addr, d.registry_addr, d.admin_addr]
    }

    #[tokio::test]
    async fn dropping_the_handle_stops_the_dispatcher() {
        let dispatcher = start_plain().await;
        let addrs = addrs(&dispatcher);
        for addr in &addrs {
            TcpStream::connect(addr).await.expect("serving");
        }
        drop(dispatcher);
        until_refused(&addrs, Duration::from_secs(10)).await;
    }

    #[tokio::test]
    async fn shutdown_stops_the_dispatcher_and_run_ends_with_its_future() {
        let dispatcher = start_plain().await;
        let addrs = addrs(&dispatcher);
        dispatcher.shutdown().await.unwrap();
        until_refused(&addrs, Duration::from_secs(10)).await;

        let bind = || TcpListener::bind("127.0.0.1:0");
        let listeners = Listeners {
            http: bind().await.unwrap(),
            registry: bind().await.unwrap(),
            admin: bind().await.unwrap(),
        };
        let http = listeners.http.local_addr().unwrap();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let config = Config {
            callers: vec![CallerConfig::allow_all("ci", "k")],
            ..Config::default().insecure()
        };
        let run = tokio::spawn(run(config, listeners, async move {
            let _ = rx.await;
        }));
        TcpStream::connect(http).await.expect("serving");
        drop(tx);
        tokio::time::timeout(Duration::from_secs(10), run)
            .await
            .expect("run ends after its shutdown future")
            .unwrap()
            .unwrap();
        until_refused(&[http], Duration::from_secs(10)).await;
    }
}
