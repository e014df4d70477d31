//! relay agent: runs inside the customer network, opens outbound gRPC tunnel streams to
//! the tunnel servers and performs the calls they hand it against one upstream origin.
//!
//! Parts: `config` (typed settings), `coverage` (the sizing actor; `coverage::plan` is its
//! pure rules), `stream` (one tunnel stream), `call` (one call on a stream), `filter`
//! (the customer's accept filters, request safety checks and size limits; default deny),
//! `upstream` (the HTTP client to the origin), `liveness` (the paths to servers that prove
//! them alive), `admin` (`/systemcheck`, `/readyz`, `/metrics`, and the status page at
//! `/`), `metrics`, `error`. `check` is the preflight (`relay-agent check`).
//!
//! Start-up is build, then spawn: `start` builds every component from config (`Agent::build`;
//! nothing runs yet), then spawns them under one task tracker (`Agent::spawn`) and returns
//! a handle the end-to-end tests can observe; `Stop` holds the cancellation tree and the
//! order of stopping. `run` is `start` until a shutdown signal.

pub mod admin;
pub mod call;
pub mod check;
pub mod config;
pub mod coverage;
pub mod error;
pub mod filter;
pub mod liveness;
pub mod metrics;
pub mod stream;
pub mod upstream;

pub use config::Config;
pub use error::RunError;

use admin::{Activity, RuleReport, SystemCheck, UpstreamHealth};
use coverage::{ActorSettings, CoverageActor, CoverageView};
use relay_common::tls::Reload;
use std::future::Future;
use std::sync::Arc;
use stream::{Dialer, StreamContext, TunnelConnector};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// Runs the agent until `shutdown` resolves, then retires every stream, lets calls in
/// flight finish (bounded, 10 s) and returns. `admin` is the bound admin listener.
pub async fn run(
    config: Config,
    admin: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), RunError> {
    let agent = start(config, admin)?;
    shutdown.await;
    agent.shutdown().await;
    Ok(())
}

/// A running agent. Dropping it stops the agent (streams retire in the background);
/// `shutdown` does the same and waits for the end.
#[must_use = "dropping the handle stops the agent"]
pub struct AgentHandle {
    registry: prometheus::Registry,
    coverage_actions: prometheus::IntCounterVec,
    coverage: watch::Receiver<CoverageView>,
    upstream: watch::Receiver<UpstreamHealth>,
    activity: Activity,
    stop: Stop,
    tasks: TaskTracker,
}

impl AgentHandle {
    /// The agent's metric registry (what `/metrics` renders).
    pub fn registry(&self) -> &prometheus::Registry {
        &self.registry
    }

    /// `grpc_tunnel_coverage_actions_total` by action name (every action, 0 for those not
    /// taken yet), read from the counters themselves: no gather of the whole registry.
    pub fn coverage_actions(&self) -> Vec<(&'static str, u64)> {
        coverage::plan::ActionKind::ALL
            .iter()
            .map(|a| {
                let n = self
                    .coverage_actions
                    .get_metric_with_label_values(&[a.as_str()])
                    .map_or(0, |c| c.get());
                (a.as_str(), n)
            })
            .collect()
    }

    /// The coverage view published after every sizing tick.
    pub fn coverage(&self) -> watch::Receiver<CoverageView> {
        self.coverage.clone()
    }

    /// The last upstream reachability check.
    pub fn upstream_health(&self) -> watch::Receiver<UpstreamHealth> {
        self.upstream.clone()
    }

    /// What `/systemcheck` would answer now.
    pub fn systemcheck(&self) -> SystemCheck {
        SystemCheck::build(
            &self.coverage.borrow(),
            &self.upstream.borrow(),
            &self.activity,
        )
    }

    /// Stops the agent and waits until every stream is gone (bounded by the drain grace).
    pub async fn shutdown(self) {
        self.stop.begin();
        self.tasks.wait().await;
    }
}

impl Drop for AgentHandle {
    fn drop(&mut self) {
        self.stop.begin();
    }
}

/// Validates `config`, then starts the agent on the current tokio runtime: the sizing
/// actor (which opens the first streams at once), the upstream check and the admin
/// listener on `admin`. Like `relay_dispatcher::start` and `relay_tunnel_server::start`
/// it returns a handle whose drop stops the agent; unlike them it needs nothing awaited
/// (the listener is bound already), so it is synchronous, which lets a harness start it
/// on a runtime of its own (`Runtime::enter`).
pub fn start(config: Config, admin: TcpListener) -> Result<AgentHandle, RunError> {
    let agent = Agent::build(&config, admin)?;
    let handle = agent.spawn();
    tracing::info!(tunnels = ?config.tunnels, upstream = %config.upstream, allow_rules = config.allow.len(), coverage = config.coverage.enabled, "agent started");
    Ok(handle)
}

/// The agent's components, built from config; nothing runs until `spawn`.
struct Agent {
    registry: prometheus::Registry,
    coverage_actions: prometheus::IntCounterVec,
    activity: Activity,
    /// The sizing actor: it owns every tunnel stream and their calls.
    actor: CoverageActor,
    coverage: watch::Receiver<CoverageView>,
    /// The upstream reachability check: what it checks, and where it publishes.
    upstream: upstream::Upstream,
    upstream_check: config::UpstreamCheckConfig,
    health_tx: watch::Sender<UpstreamHealth>,
    health: watch::Receiver<UpstreamHealth>,
    /// The admin listener and what it serves.
    admin_listener: TcpListener,
    admin: relay_common::admin::Admin,
    /// What is reloaded on SIGHUP or when its files change (the tunnel TLS), and how often
    /// the files are checked.
    reloads: Vec<Arc<dyn Reload>>,
    reload_interval: std::time::Duration,
}

impl Agent {
    fn build(config: &Config, admin: TcpListener) -> Result<Agent, RunError> {
        config.validate()?;
        let registry = prometheus::Registry::new();
        let metrics = metrics::AgentMetrics::register(&registry)?;
        let coverage_actions = metrics.coverage_actions.clone();
        let expiry = relay_common::tls::CertExpiry::register(&registry)?;
        let upstream = upstream::Upstream::new(
            &config.upstream,
            config.connect_timeout,
            config.max_upstream_connections,
        )?;
        let tls = config
            .tls
            .resolve("tls", relay_common::tls::ClientCerts::Optional)?
            .map(|c| {
                relay_common::tls::TlsClient::new("tls", c, relay_common::tls::ALPN_H2)
                    .map(|t| t.with_expiry(&expiry))
                    .map_err(|source| RunError::Tls { source })
            })
            .transpose()?;
        if tls.is_none() {
            relay_common::tls::note_plain_text("agent", &["tunnel streams ([tls])"]);
        }
        let dialer = Dialer::new(
            &config.tunnels,
            &config.token,
            config.connect_timeout,
            config.tunnel_h2()?,
            tls.clone(),
        )?
        .with_max_frame_bytes(config.max_frame_bytes)
        .with_direct_hosts(config.direct_host_rules()?);
        let policy = config.policy()?;
        if policy.rule_count() == 0 {
            tracing::warn!(
                "no [[allow]] rules: every call is refused (accept filters are default deny)"
            );
        }
        let activity = Activity {
            calls: metrics.recent_calls.clone(),
            rules: Arc::new(RuleReport::of(&config.allow)),
        };
        let calls = call::CallContext::new(
            upstream.clone(),
            policy,
            metrics.clone(),
            config.coverage.max_inflight,
            config.call_timeout,
            config.max_call_timeout,
        )
        .with_max_headers(config.limits.max_headers);
        let ctx = StreamContext {
            dialer,
            calls: Arc::new(calls),
            metrics: metrics.clone(),
            connect_timeout: config.connect_timeout,
            opens: stream::OpenWindow::new(
                config.max_opening,
                config.connect_timeout,
                metrics.open_window.clone(),
            ),
            paths: Default::default(),
        };
        let planner = coverage::plan::Planner::new(config.coverage.clone());
        let (actor, coverage) = CoverageActor::new(
            Box::new(planner),
            Arc::new(TunnelConnector(Arc::new(ctx))),
            metrics,
            ActorSettings::from_config(config),
        );
        let (health_tx, health_rx) = watch::channel(UpstreamHealth::unchecked(format!(
            "{}{}",
            upstream.origin(),
            config.upstream_check.path
        )));
        let admin_routes = admin::admin(
            registry.clone(),
            coverage.clone(),
            health_rx.clone(),
            activity.clone(),
        );
        let reloads = tls
            .into_iter()
            .map(|t| Arc::new(t) as Arc<dyn Reload>)
            .collect();
        Ok(Agent {
            registry,
            coverage_actions,
            activity,
            actor,
            coverage,
            upstream,
            upstream_check: config.upstream_check.clone(),
            health_tx,
            health: health_rx,
            admin_listener: admin,
            admin: admin_routes,
            reloads,
            reload_interval: config.reload_interval,
        })
    }

    /// Spawns every component under one task tracker; `Stop` says in which order they end.
    fn spawn(self) -> AgentHandle {
        let stop = Stop::new();
        let tasks = TaskTracker::new();
        // Certificates: new connections use the reloaded ones, established streams keep
        // theirs. (The SIGHUP handler is installed here, before anything serves.)
        let reload = tasks.spawn(relay_common::tls::watch(
            self.reloads,
            self.reload_interval,
            stop.all.clone(),
        ));
        let checker = tasks.spawn(admin::check_upstream(
            self.upstream,
            self.upstream_check,
            self.health_tx,
            stop.streams.clone(),
        ));
        let admin = tasks.spawn(relay_common::admin::serve(
            self.admin_listener,
            self.admin,
            stop.all.clone().cancelled_owned(),
        ));
        let actor = self.actor;
        let streams = stop.streams.clone();
        tasks.spawn(stop.clone().in_order(
            async move { actor.run(streams.cancelled_owned()).await },
            [checker, admin, reload],
        ));
        tasks.close();
        AgentHandle {
            registry: self.registry,
            coverage_actions: self.coverage_actions,
            coverage: self.coverage,
            upstream: self.health,
            activity: self.activity,
            stop,
            tasks,
        }
    }
}

/// The agent's cancellation tree and the order it stops in, written once (`in_order`):
/// first the streams (the actor retires every stream and waits for calls in flight,
/// bounded by the drain grace; the upstream check stops with them), then the rest, which
/// outlives them (the admin listener answers until the streams are gone; certificate
/// reloads).
#[derive(Clone)]
struct Stop {
    /// Everything; cancelled once the streams are gone.
    all: CancellationToken,
    /// The streams and the upstream check: what a stop cancels first (a child of `all`).
    streams: CancellationToken,
}

impl Stop {
    fn new() -> Stop {
        let all = CancellationToken::new();
        let streams = all.child_token();
        Stop { all, streams }
    }

    /// Starts the stop; `in_order` carries it through.
    fn begin(&self) {
        self.streams.cancel();
    }

    /// Runs `actor` (which returns once `streams` is cancelled and its streams are gone),
    /// then stops everything else and waits for `rest`.
    async fn in_order(
        self,
        actor: impl Future<Output = ()>,
        rest: impl IntoIterator<Item = JoinHandle<()>>,
    ) {
        actor.await;
        self.all.cancel();
        for task in rest {
            let _ = task.await;
        }
        tracing::info!("agent stopped");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;
    use tokio::net::TcpStream;

    #[tokio::test]
    async fn dropping_the_handle_stops_the_agent() {
        // No tunnel server listens there: the agent keeps trying to open streams.
        let config = Config {
            tunnels: vec!["http://127.0.0.1:9".into()],
            token: relay_common::Secret::new("t"),
            upstream: "http://127.0.0.1:9".into(),
            ..Config::default().insecure()
        };
        let admin = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = admin.local_addr().unwrap();
        let agent = start(config, admin).unwrap();
        TcpStream::connect(addr).await.expect("admin serving");
        drop(agent);
        relay_common::testing::until_refused(&[addr], Duration::from_secs(10)).await;
    }
}
