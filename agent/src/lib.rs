//! relay agent: runs inside the customer network, opens outbound gRPC tunnel streams to
//! the tunnel servers and performs the calls they hand it against one upstream origin.
//!
//! Parts: `config` (typed settings), `coverage` (the sizing actor; `coverage::plan` is its
//! pure rules), `stream` (one tunnel stream), `call` (one call on a stream), `filter`
//! (the customer's accept filters, request safety checks and size limits; default deny),
//! `upstream` (the HTTP client to the origin), `admin` (`/systemcheck`, `/readyz`,
//! `/metrics`, and the status page at `/`), `metrics`. `run` wires them together; `spawn` does the same and returns a
//! handle the end-to-end tests can observe. `check` is the preflight (`relay-agent check`).

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
use std::future::Future;
use std::sync::Arc;
use stream::{Dialer, StreamContext, TunnelConnector};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

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
pub struct AgentHandle {
    registry: prometheus::Registry,
    coverage: watch::Receiver<CoverageView>,
    upstream: watch::Receiver<UpstreamHealth>,
    activity: Activity,
    stop: CancellationToken,
    task: Option<JoinHandle<()>>,
}

impl AgentHandle {
    /// The agent's metric registry (what `/metrics` renders).
    pub fn registry(&self) -> &prometheus::Registry {
        &self.registry
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
    pub async fn shutdown(mut self) {
        self.stop.cancel();
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

impl Drop for AgentHandle {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// Validates `config`, then starts the agent on the current tokio runtime: the sizing
/// actor (which opens the first streams at once), the upstream check and the admin
/// listener on `admin`. Like `relay_dispatcher::start` and `relay_tunnel_server::start`
/// it returns a handle whose drop stops the agent; unlike them it needs nothing awaited
/// (the listener is bound already), so it is synchronous, which lets a harness start it
/// on a runtime of its own (`Runtime::enter`).
pub fn start(config: Config, admin: TcpListener) -> Result<AgentHandle, RunError> {
    config.validate()?;
    let registry = prometheus::Registry::new();
    let metrics = metrics::AgentMetrics::register(&registry)?;
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
    let rules = policy.rule_count();
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
        opens: Arc::new(tokio::sync::Semaphore::new(config.max_opening)),
        paths: Default::default(),
    };
    let planner = coverage::plan::Planner::new(config.coverage.clone());
    let (actor, coverage_rx) = CoverageActor::new(
        Box::new(planner),
        Arc::new(TunnelConnector(Arc::new(ctx))),
        metrics,
        ActorSettings::from_config(&config),
    );
    let (health_tx, health_rx) = watch::channel(UpstreamHealth::unchecked(format!(
        "{}{}",
        upstream.origin(),
        config.upstream_check.path
    )));
    let admin_routes = admin::admin(
        registry.clone(),
        coverage_rx.clone(),
        health_rx.clone(),
        activity.clone(),
    );

    let stop = CancellationToken::new();
    let stop_admin = CancellationToken::new();
    // Certificates: reloaded on SIGHUP or when their files change; new connections use
    // the new ones, established streams keep theirs.
    relay_common::tls::Reloads::default()
        .with(tls)
        .spawn(config.reload_interval, stop_admin.clone());
    let checker = tokio::spawn(admin::check_upstream(
        upstream,
        config.upstream_check.clone(),
        health_tx,
        stop.clone(),
    ));
    let admin_task = tokio::spawn(relay_common::admin::serve(
        admin,
        admin_routes,
        stop_admin.clone().cancelled_owned(),
    ));
    tracing::info!(tunnels = ?config.tunnels, upstream = %config.upstream, allow_rules = rules, coverage = config.coverage.enabled, "agent started");
    let actor_stop = stop.clone();
    let task = tokio::spawn(async move {
        actor.run(actor_stop.cancelled_owned()).await;
        // The admin listener answers until the streams are gone.
        stop_admin.cancel();
        let _ = checker.await;
        let _ = admin_task.await;
        tracing::info!("agent stopped");
    });
    Ok(AgentHandle {
        registry,
        coverage: coverage_rx,
        upstream: health_rx,
        activity,
        stop,
        task: Some(task),
    })
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
