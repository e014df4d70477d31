//! relay tunnel server: holds agents' outbound gRPC streams per tunnel id, hands each call
//! from a dispatcher to the newest idle stream of the call's tunnel id, queues calls
//! briefly when none is idle, and tells dispatchers where tunnel ids are.
//!
//! Three listeners, each bound by the caller (tests pass `127.0.0.1:0`): the agent-facing
//! `Tunnel.Connect` service, the dispatcher-facing `Forward.Call` service, and the admin
//! HTTP listener. `start` serves them and returns a [`TunnelServerHandle`] whose drop (or
//! `shutdown`) drains: dispatchers and agents are told, calls in flight finish within
//! `shutdown_grace`; `run` does the same until its shutdown future resolves.
//!
//! The co-located mode ([`Front`], `relay-tunnel-server --front-config dispatcher.toml`):
//! the server also runs a dispatcher, with its HTTP front, registry and admin listeners,
//! whose calls to this server skip gRPC and the network (`relay_dispatcher::colocated`), for
//! single-box and small deployments. The front routes like any dispatcher (this server
//! reports to it through `dispatchers`, as to any other; it can also route to other
//! servers reporting to it), preferring this server for tunnel ids whose streams it holds.
//! At shutdown the front drains first (calls in flight finish), then the server.
//!
//! Start-up reads as two steps: every component (listeners with their services, the admin
//! routes, the reload watch, liveness, pressure hints, the CPU sampler, one reporter per
//! dispatcher, the front) is built from the config, then spawned under one task tracker and
//! one cancellation tree; the order in which they stop is written once (module `start`).

pub mod call;
pub mod config;
pub mod forward;
pub mod handle;
pub mod hub;
pub mod liveness;
pub mod load;
pub mod metrics;
pub use relay_common::outbox;
pub mod outcome;
pub mod report;
pub mod slots;
mod start;
pub mod status;
pub mod stream;
pub mod tokens;

pub use config::Config;
pub use tokens::{SharedTokens, TokenStore};

use hub::Hub;
use relay_common::config::ConfigError;
use relay_common::tls::TlsError;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::task::{AbortHandle, JoinHandle};
use tokio_util::sync::CancellationToken;
use tracing::warn;

/// Default largest frame accepted from a peer (`max_frame_bytes`): a 64 KiB chunk plus
/// headroom for headers.
pub const MAX_FRAME_BYTES: usize = config::DEFAULT_MAX_FRAME_BYTES;

/// Shortest time between two rounds of pressure hints sent because calls started to wait.
pub const PRESSURE_GAP: Duration = Duration::from_millis(10);

pub struct Listeners {
    pub agent: TcpListener,
    pub forward: TcpListener,
    pub admin: TcpListener,
}

#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("listener address: {0}")]
    Io(#[from] std::io::Error),
    #[error("metrics: {0}")]
    Metrics(#[from] prometheus::Error),
    #[error("co-located front: {0}")]
    Front(Box<relay_dispatcher::RunError>),
    #[error("[{section}]: {source}")]
    Tls {
        section: &'static str,
        #[source]
        source: TlsError,
    },
}

/// The co-located mode's dispatcher: its config and its three listeners.
pub struct Front {
    pub config: relay_dispatcher::Config,
    pub listeners: relay_dispatcher::Listeners,
}

/// A running tunnel server, shaped like the agent's and the dispatcher's handles. Dropping
/// it stops the server: it drains in the background as `shutdown` does (dispatchers and
/// agents are told, calls in flight get `shutdown_grace`), then its listeners close.
/// `shutdown` does the same and waits for the end; `abort` stops at once, as a crash
/// would.
#[must_use = "dropping the handle stops the server"]
pub struct TunnelServerHandle {
    pub server_id: String,
    pub agent_addr: SocketAddr,
    pub forward_addr: SocketAddr,
    pub admin_addr: SocketAddr,
    /// The co-located front's HTTP address, when running one.
    pub front_addr: Option<SocketAddr>,
    pub registry: prometheus::Registry,
    pub(crate) hub: Arc<Hub>,
    /// Cancelled to begin the graceful stop (by `shutdown` or on drop).
    pub(crate) stop: CancellationToken,
    /// Runs the graceful stop once `stop` is cancelled.
    pub(crate) stopper: Option<JoinHandle<()>>,
    /// The root of the server's cancellation tree, for `abort`.
    pub(crate) serving: CancellationToken,
    /// The server's long-lived tasks, for `abort`.
    pub(crate) tasks: Vec<AbortHandle>,
}

/// Loads the token store, serves until `shutdown` resolves, then drains and stops.
pub async fn run(
    config: Config,
    listeners: Listeners,
    front: Option<Front>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), RunError> {
    let tokens = match &config.token_store {
        Some(path) => TokenStore::load(path)?,
        None => {
            warn!("no token_store configured: every agent stream will be refused");
            TokenStore::default()
        }
    };
    let server = start_with_front(config, tokens, listeners, front).await?;
    shutdown.await;
    server.shutdown().await;
    Ok(())
}

/// Starts serving on the given listeners and returns a handle.
pub async fn start(
    config: Config,
    tokens: TokenStore,
    listeners: Listeners,
) -> Result<TunnelServerHandle, RunError> {
    start_with_front(config, tokens, listeners, None).await
}

/// [`start`], also serving the co-located mode's dispatcher front when `front` is given:
/// every component is built from the config first (nothing runs yet, so a config error
/// leaves nothing behind), then spawned (`start`).
pub async fn start_with_front(
    config: Config,
    tokens: TokenStore,
    listeners: Listeners,
    front: Option<Front>,
) -> Result<TunnelServerHandle, RunError> {
    start::Server::build(config, tokens, listeners, front)?
        .spawn()
        .await
}

impl TunnelServerHandle {
    pub fn hub(&self) -> &Arc<Hub> {
        &self.hub
    }

    /// Graceful stop: announce draining, send Drain to agents, let calls in flight finish
    /// within the grace period, then close every stream and stop serving.
    pub async fn shutdown(mut self) {
        self.stop.cancel();
        if let Some(stopper) = self.stopper.take() {
            let _ = stopper.await;
        }
    }

    /// Immediate stop, as a crash would: no drain, no goodbye.
    pub fn abort(mut self) {
        if let Some(stopper) = self.stopper.take() {
            stopper.abort();
        }
        self.hub.fail_all();
        self.serving.cancel();
        for t in &self.tasks {
            t.abort();
        }
    }
}

impl Drop for TunnelServerHandle {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use relay_common::testing::until_refused;
    use tokio::net::TcpStream;

    async fn start_plain() -> TunnelServerHandle {
        let bind = || TcpListener::bind("127.0.0.1:0");
        let listeners = Listeners {
            agent: bind().await.unwrap(),
            forward: bind().await.unwrap(),
            admin: bind().await.unwrap(),
        };
        let cfg = Config {
            server_id: "ts-handle".into(),
            dispatchers: vec![],
            ..Config::default()
        }
        .insecure();
        start(cfg, TokenStore::default(), listeners).await.unwrap()
    }

    #[tokio::test]
    async fn a_front_that_cannot_start_leaves_nothing_of_the_server_running() {
        let bind = || TcpListener::bind("127.0.0.1:0");
        let listeners = Listeners {
            agent: bind().await.unwrap(),
            forward: bind().await.unwrap(),
            admin: bind().await.unwrap(),
        };
        let addrs = [
            listeners.agent.local_addr().unwrap(),
            listeners.forward.local_addr().unwrap(),
            listeners.admin.local_addr().unwrap(),
        ];
        // The front's certificate files do not exist: its config checks out, its start
        // fails reading them.
        let missing = std::path::PathBuf::from("/nonexistent/relay-front");
        let mut front_config = relay_dispatcher::Config::default().insecure();
        front_config.callers = vec![relay_dispatcher::CallerConfig::allow_all(
            "test",
            "test-caller-key",
        )];
        front_config.tls = relay_common::tls::ListenerTls::tls(relay_common::tls::ServerTls {
            cert: missing.join("cert.pem"),
            key: missing.join("key.pem"),
            client_ca: None,
            client_cert_optional: false,
            client_names: Vec::new(),
        });
        let front = Front {
            config: front_config,
            listeners: relay_dispatcher::Listeners {
                http: bind().await.unwrap(),
                registry: bind().await.unwrap(),
                admin: bind().await.unwrap(),
            },
        };
        let cfg = Config {
            server_id: "ts-front".into(),
            dispatchers: vec![],
            ..Config::default()
        }
        .insecure();
        let started = start_with_front(cfg, TokenStore::default(), listeners, Some(front)).await;
        let err = started.err().expect("the front started");
        assert!(matches!(err, RunError::Front(_)), "{err}");
        until_refused(&addrs, Duration::from_secs(10)).await;
    }

    #[tokio::test]
    async fn dropping_the_handle_stops_the_server() {
        let server = start_plain().await;
        let addrs = [server.agent_addr, server.forward_addr, server.admin_addr];
        for addr in &addrs {
            TcpStream::connect(addr).await.expect("serving");
        }
        drop(server);
        until_refused(&addrs, Duration::from_secs(10)).await;
    }

    #[tokio::test]
    async fn shutdown_and_abort_stop_the_server() {
        let server = start_plain().await;
        let addrs = [server.agent_addr, server.forward_addr, server.admin_addr];
        server.shutdown().await;
        until_refused(&addrs, Duration::from_secs(10)).await;
        let server = start_plain().await;
        let addrs = [server.agent_addr, server.forward_addr, server.admin_addr];
        server.abort();
        until_refused(&addrs, Duration::from_secs(10)).await;
    }
}
