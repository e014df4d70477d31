//! relay dispatcher: the HTTP front for backend services.
//!
//! A backend calls `ANY /relay/{tunnel_id}/{path}?{query}` with its caller key; the
//! dispatcher picks a tunnel server that holds streams of that tunnel id (learned from the
//! servers' `Registry.Report` streams), relays the call over `Forward.Call`, and streams the
//! response back. Three listeners: the HTTP front (HTTP/1.1 + h2c), the registry gRPC
//! listener, and the admin listener (`/metrics`, `/healthz`, `/readyz`, `/debug/routes`).
//!
//! Modules, in the order a call meets them: `front` (the HTTP listener and request
//! checks), `call` (one call from accept to outcome: routing, attempts, head checks, the
//! one log line and metric), `attempt` (pure: which server is tried next, retry rules, the
//! queue handshake), `replay` (the request body, replayable for a retry), `forward` (one
//! attempt's RPC and the hops to each tunnel server), `pool` and `carrier` (connections and
//! reused `Forward.Carry` RPCs), `colocated` (the tunnel server in this process),
//! `response` (the response body), `outcome` (each call's metrics, recorded once). Beside
//! them: `config` (settings, one file per section), `headers` (header rules), `quota` (a
//! caller's calls per tunnel id), `routing` (the pure routing decision: sticky / available,
//! spill share, load, latency tiers), `latency` (this dispatcher's measured leg to each
//! tunnel server), `registry` (the routing table as a pure state machine, leases, and the
//! shell, `Routes`, that carries its changes out to the plans, gauges, shared store and
//! forward channels), `shared` (the Redis-backed shared registry), `report` (the gRPC
//! service feeding the table), `status` (the admin status page), `metrics`, `error`.
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
pub mod headers;
pub mod latency;
pub mod metrics;
pub mod outcome;
pub mod pool;
pub mod quota;
pub mod registry;
pub mod replay;
pub mod report;
pub mod response;
pub mod routing;
pub mod shared;
pub mod status;

pub use config::{
    CallerConfig, Config, RegistryBackend, RegistryConfig, RoutingConfig, RoutingPolicy,
};
pub use error::RunError;

use forward::{Channels, Forwarder};
use registry::Routes;
use relay_common::admin::{self, Admin};
use relay_common::config::ConfigError;
use relay_common::listen::{self, ListenerGuard, ListenerLimits, ListenerMetrics};
use relay_common::tls::{self, TlsClient, TlsServer};
use shared::{SharedHealth, SharedStore};
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio::time::MissedTickBehavior;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

/// How long the registry listener may take to close its report streams at shutdown.
const REGISTRY_STOP_GRACE: Duration = Duration::from_secs(5);

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

/// [`start`], with the tunnel server of this process when co-located (`colocated::Local`): calls
/// routed to its `forward_url` reach it without gRPC, and it comes first among the servers
/// holding a call's tunnel id.
pub async fn start_with(
    config: Config,
    listeners: Listeners,
    local: Option<colocated::Local>,
) -> Result<DispatcherHandle, RunError> {
    config.validate()?;
    let transport = config.transport()?;
    // The address the registry really listens on (a caller may bind another than
    // `registry_listen`).
    if config.registry_key_needed(listeners.registry.local_addr()?)? {
        tracing::warn!(
            registry = %listeners.registry.local_addr()?,
            "the registry listener has no [registry] server_key: any local process can report as a tunnel server; set one (the tunnel servers' dispatcher_key)"
        );
    }
    let prometheus = prometheus::Registry::new();
    let metrics = metrics::Metrics::register(&prometheus)?;
    let expiry = tls::CertExpiry::register(&prometheus)?;
    let listener_metrics = ListenerMetrics::register(&prometheus)?;
    let tls_err = |section| move |source| RunError::Tls { section, source };
    let front_tls = transport
        .front
        .map(|s| TlsServer::new("tls", s, tls::ALPN_HTTP))
        .transpose()
        .map_err(tls_err("tls"))?
        .map(|t| t.with_expiry(&expiry));
    let registry_tls = transport
        .registry
        .map(|s| TlsServer::new("registry_tls", s, tls::ALPN_H2))
        .transpose()
        .map_err(tls_err("registry_tls"))?
        .map(|t| t.with_expiry(&expiry));
    let forward_tls = transport
        .forward
        .map(|c| TlsClient::new("forward_tls", c, tls::ALPN_H2))
        .transpose()
        .map_err(tls_err("forward_tls"))?
        .map(|t| t.with_expiry(&expiry));
    let plain: Vec<&str> = [
        ("HTTP front ([tls])", front_tls.is_none()),
        ("registry listener ([registry_tls])", registry_tls.is_none()),
        (
            "forward calls to tunnel servers ([forward_tls])",
            forward_tls.is_none(),
        ),
    ]
    .into_iter()
    .filter_map(|(hop, plain)| plain.then_some(hop))
    .collect();
    tls::note_plain_text("dispatcher", &plain);
    // Shared registry (Redis), routing tick, certificate reload: background tasks; routing
    // never waits on them.
    let background_stop = CancellationToken::new();
    tls::Reloads::default()
        .with(front_tls.clone())
        .with(registry_tls.clone())
        .with(forward_tls.clone())
        .spawn(config.reload_interval, background_stop.clone());
    let channels = Channels::new(forward_tls, config.forward_h2()?)
        .with_local(local)
        .with_carrier_idle_timeout(config.carrier_idle_timeout)
        .with_max_frame_bytes(config.max_frame_bytes)
        .with_gauges(
            metrics.forward_connections.clone(),
            metrics.forward_servers_down.clone(),
        );

    let (http_addr, registry_addr, admin_addr) = (
        listeners.http.local_addr()?,
        listeners.registry.local_addr()?,
        listeners.admin.local_addr()?,
    );
    info!(http = %http_addr, registry = %registry_addr, admin = %admin_addr, callers = config.callers.len(),
        policy = ?config.routing.policy, registry_backend = ?config.registry.backend, "dispatcher starting");
    let dispatcher_id = format!("dispatcher@{registry_addr}");
    let shared = config.registry.backend == RegistryBackend::Redis;
    let routes = Arc::new(
        Routes::new(
            config.routing.clone(),
            config.registry.lease,
            dispatcher_id,
            shared,
            metrics.clone(),
        )
        .with_evict({
            let channels = channels.clone();
            move |url| channels.evict(url)
        }),
    );

    let health = match (&config.registry.url, shared) {
        (Some(url), true) => {
            let client = shared::client(url, &config.registry.redis_tls)?;
            let rules = shared::record::RecordRules::new(
                config
                    .registry
                    .record_key
                    .as_ref()
                    .map(|k| k.expose().as_bytes())
                    .unwrap_or_default(),
                config.registry.allowed_servers.clone(),
                !config.forward_tls.insecure,
                &config.registry.forward_hosts,
            )
            .map_err(|e| ConfigError::invalid("registry.forward_hosts", e))?;
            let health = Arc::new(SharedHealth::default());
            let store = SharedStore {
                routes: routes.clone(),
                client,
                key_prefix: config.registry.key_prefix.clone(),
                lease: config.registry.lease,
                refresh_interval: config.registry.refresh_interval,
                timeout: config.registry.redis_timeout,
                health: health.clone(),
                metrics: metrics.clone(),
                stop: background_stop.clone(),
                rules,
            };
            tokio::spawn(store.run());
            Some(health)
        }
        _ => None,
    };

    // This dispatcher's leg to each tunnel server, for the latency tiers.
    tokio::spawn(latency::run(
        routes.clone(),
        channels.clone(),
        background_stop.clone(),
    ));

    // Routing tick: expires leases and steps spill shares with no report arriving.
    {
        let (routes, stop) = (routes.clone(), background_stop.clone());
        let period = config.routing.step_interval.min(config.registry.lease / 4);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(period);
            tick.set_missed_tick_behavior(MissedTickBehavior::Skip);
            loop {
                tokio::select! {
                    biased;
                    _ = stop.cancelled() => return,
                    _ = tick.tick() => {}
                }
                routes.tick(tokio::time::Instant::now());
            }
        });
    }

    // Registry listener.
    let registry_stop = CancellationToken::new();
    let registry_up = Arc::new(AtomicBool::new(false));
    let report = report::ReportService {
        routes: routes.clone(),
        server_key: config.registry.server_key_digest().cloned(),
        allowed_servers: config.registry.allowed_servers.clone(),
        server_id_in_cert: config.registry.server_id_in_cert,
        metrics: metrics.clone(),
        stop: registry_stop.clone(),
    };
    let mut registry_task = {
        let stop = registry_stop.clone();
        let guard = ListenerGuard::new(
            "registry",
            ListenerLimits::without_auth(),
            listener_metrics.clone(),
        );
        let incoming = listen::incoming(listeners.registry, registry_tls, guard, stop.clone());
        let max_frame = config.max_frame_bytes;
        let up = registry_up.clone();
        let h2 = config.registry_h2()?;
        tokio::spawn(async move {
            up.store(true, Ordering::SeqCst);
            let result = relay_common::grpc::server(&h2)
                .add_service(
                    relay_proto::registry_server::RegistryServer::new(report)
                        .max_decoding_message_size(max_frame)
                        .max_encoding_message_size(max_frame),
                )
                .serve_with_incoming_shutdown(incoming, stop.cancelled_owned())
                .await;
            up.store(false, Ordering::SeqCst);
            result
        })
    };

    // Admin listener.
    let draining = Arc::new(AtomicBool::new(false));
    let admin_stop = CancellationToken::new();
    let admin = {
        let (routes_ready, routes_debug) = (routes.clone(), routes.clone());
        let (up, draining) = (registry_up.clone(), draining.clone());
        let (health_ready, health_debug) = (health.clone(), health.clone());
        let registry_status = |h: &Option<Arc<SharedHealth>>| match h {
            Some(h) => h.status(),
            None => (
                true,
                serde_json::json!({"backend": "memory", "state": "ok"}),
            ),
        };
        Admin::new(prometheus)
            .with_listener_metrics(listener_metrics.clone())
            .with_ready(move || {
                let counts = routes_ready.counts();
                let (registry_ok, registry) = registry_status(&health_ready);
                let ready =
                    up.load(Ordering::SeqCst) && !draining.load(Ordering::SeqCst) && registry_ok;
                (
                    ready,
                    serde_json::json!({
                        "tunnel_servers": counts.servers,
                        "tunnels": counts.tunnels,
                        "registry": registry,
                    }),
                )
            })
            .with_routes(move |path| {
                let snap = || {
                    let mut snap = routes_debug.snapshot();
                    snap["registry"] = registry_status(&health_debug).1;
                    snap
                };
                match path {
                    "/debug/routes" => Some(admin::json(http::StatusCode::OK, &snap())),
                    // The status page: the same document, as HTML.
                    "/" => Some(relay_common::html::response(status::page(&snap()))),
                    _ => None,
                }
            })
    };
    let admin_task = tokio::spawn(admin::serve(
        listeners.admin,
        admin,
        admin_stop.clone().cancelled_owned(),
    ));

    // HTTP front.
    let calls = call::Calls {
        routes: routes.clone(),
        forwarder: Forwarder {
            channels,
            metrics: metrics.clone(),
        },
        rules: attempt::RetryRules {
            policy: config.routing.policy,
            retry_idempotent: config.routing.retry_idempotent,
            max_attempts: config.routing.max_attempts as usize,
        },
        replay_limit: replay::replay_limit(config.forward_h2()?.stream_window_bytes),
        max_request_body_bytes: config.max_request_body_bytes,
        head_limits: config.response_head_limits(),
        body_idle_timeout: config.body_idle_timeout,
        metrics: Arc::new(metrics),
    };
    let front = Arc::new(front::Front::new(&config, calls));
    let front_stop = CancellationToken::new();
    let front_task = tokio::spawn(front::serve(
        listeners.http,
        front_tls,
        ListenerGuard::new(
            "front",
            config.front_limits.listener_limits(),
            listener_metrics.clone(),
        ),
        config.front_h2()?,
        front,
        front_stop.clone(),
        config.shutdown_grace,
    ));

    let stop = CancellationToken::new();
    let task = tokio::spawn({
        let stop = stop.clone();
        async move {
            let mut result = Ok(());
            let mut registry_done = false;
            tokio::select! {
                _ = stop.cancelled() => info!("dispatcher shutting down"),
                r = &mut registry_task => {
                    registry_done = true;
                    result = match r {
                        Ok(Ok(())) => Ok(()),
                        Ok(Err(e)) => Err(RunError::Registry(e)),
                        Err(join) => {
                            warn!(error = %join, "registry listener task failed");
                            Ok(())
                        }
                    };
                    warn!("registry listener stopped; shutting down");
                }
            }
            draining.store(true, Ordering::SeqCst);
            front_stop.cancel();
            if let Err(e) = front_task.await {
                warn!(error = %e, "HTTP front task failed");
            }
            registry_stop.cancel();
            if !registry_done {
                match tokio::time::timeout(REGISTRY_STOP_GRACE, &mut registry_task).await {
                    Ok(Ok(Err(e))) => result = Err(RunError::Registry(e)),
                    Ok(_) => {}
                    Err(_) => {
                        warn!("registry listener did not stop in time");
                        registry_task.abort();
                    }
                }
            }
            background_stop.cancel();
            admin_stop.cancel();
            let _ = admin_task.await;
            info!("dispatcher stopped");
            result
        }
    });
    Ok(DispatcherHandle {
        http_addr,
        registry_addr,
        admin_addr,
        stop,
        task: Some(task),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use relay_common::testing::until_refused;
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
