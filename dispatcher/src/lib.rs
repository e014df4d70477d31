//! relay dispatcher: the HTTP front for backend services.
//!
//! A backend calls `ANY /relay/{tunnel_id}/{path}?{query}` with its caller key; the
//! dispatcher picks a tunnel server that holds streams of that tunnel id (learned from the
//! servers' `Registry.Report` streams), relays the call over `Forward.Call`, and streams the
//! response back. Three listeners: the HTTP front (HTTP/1.1 + h2c), the registry gRPC
//! listener, and the admin listener (`/metrics`, `/healthz`, `/readyz`, `/debug/routes`).
//!
//! Modules: `config` (settings), `front` (HTTP), `forward` (calls to tunnel servers and
//! retries), `body` (streaming bodies both ways), `headers` (header rules), `routing` (the
//! pure routing decision: sticky / available, spill share, latency tiers), `registry` (the
//! routing table as a pure state machine, leases, and the shell that carries its changes
//! out to the plans, gauges, shared store and forward channels), `shared` (the Redis-backed shared registry), `report` (the
//! gRPC service feeding the table), `metrics`, `error`.
//!
//! The crate never buffers a whole body, never logs or forwards a caller key, and takes
//! already-bound listeners so tests and the one-process demo can run it on `127.0.0.1:0`.

pub mod body;
pub mod config;
pub mod error;
pub mod forward;
pub mod front;
pub mod headers;
pub mod metrics;
pub mod registry;
pub mod report;
pub mod routing;
pub mod shared;

pub use config::{
    CallerConfig, Config, RegistryBackend, RegistryConfig, RoutingConfig, RoutingPolicy,
};
pub use error::RunError;

use forward::{Channels, Forwarder};
use registry::Registry;
use relay_common::admin::{self, Admin};
use relay_common::config::ConfigError;
use relay_common::listen::{self, ListenerGuard, ListenerLimits, ListenerMetrics};
use relay_common::tls::{self, TlsClient, TlsServer};
use shared::{SharedHealth, SharedStore};
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
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
/// admin listeners stop.
pub async fn run(
    config: Config,
    listeners: Listeners,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), RunError> {
    config.validate()?;
    let transport = config.transport()?;
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
    let channels = Channels::new(forward_tls, config.forward_h2()?);

    let addrs = (
        listeners.http.local_addr().ok(),
        listeners.registry.local_addr().ok(),
        listeners.admin.local_addr().ok(),
    );
    info!(http = ?addrs.0, registry = ?addrs.1, admin = ?addrs.2, callers = config.callers.len(),
        policy = ?config.routing.policy, registry_backend = ?config.registry.backend, "dispatcher starting");
    let dispatcher_id = match addrs.1 {
        Some(a) => format!("dispatcher@{a}"),
        None => "dispatcher".to_string(),
    };
    let shared = config.registry.backend == RegistryBackend::Redis;
    let routes = Arc::new(
        Registry::new(
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
                registry: routes.clone(),
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
                (path == "/debug/routes").then(|| {
                    let mut snap = routes_debug.snapshot();
                    snap["registry"] = registry_status(&health_debug).1;
                    admin::json(http::StatusCode::OK, &snap)
                })
            })
    };
    let admin_task = tokio::spawn(admin::serve(
        listeners.admin,
        admin,
        admin_stop.clone().cancelled_owned(),
    ));

    // HTTP front.
    let front = Arc::new(front::Front::new(
        &config,
        routes.clone(),
        Forwarder {
            channels,
            metrics: metrics.clone(),
            registry: routes.clone(),
            rules: forward::RetryRules {
                policy: config.routing.policy,
                retry_idempotent: config.routing.retry_idempotent,
            },
            max_attempts: config.routing.max_attempts as usize,
            max_frame_bytes: config.max_frame_bytes,
            replay_limit: body::replay_limit(config.forward_h2()?.stream_window_bytes),
        },
        metrics,
    ));
    let front_stop = CancellationToken::new();
    let front_task = tokio::spawn(front::serve(
        listeners.http,
        front_tls,
        ListenerGuard::new("front", ListenerLimits::without_auth(), listener_metrics),
        config.front_h2()?,
        front,
        front_stop.clone(),
        config.shutdown_grace,
    ));

    let mut result = Ok(());
    let mut registry_done = false;
    tokio::pin!(shutdown);
    tokio::select! {
        _ = &mut shutdown => info!("dispatcher shutting down"),
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
