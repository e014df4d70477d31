//! Start-up as build, then spawn: [`Dispatcher::build`] turns the config into every
//! component (metrics, TLS, the routes, the forward channels, the shared store, the
//! registry listener, the admin listener, the HTTP front) without running anything;
//! [`Dispatcher::spawn`] runs each under one [`TaskTracker`] and one cancellation tree,
//! and hands back the [`DispatcherHandle`](crate::DispatcherHandle).
//!
//! The order of stopping is written once, in `StopOrder` and `supervise`: the HTTP
//! front drains first (calls in flight get `shutdown_grace`), then the registry listener
//! closes its report streams (within [`REGISTRY_STOP_GRACE`]), then everything else (the
//! shared store, the latency probes, the routing tick, the certificate reload, the admin
//! listener); the handle's stop resolves once every task has ended.

use crate::attempt::RetryRules;
use crate::call::Calls;
use crate::colocated::Local;
use crate::config::{Config, RegistryBackend};
use crate::error::RunError;
use crate::forward::{Channels, Forwarder};
use crate::front::Front;
use crate::metrics::Metrics;
use crate::registry::Routes;
use crate::report::ReportService;
use crate::shared::{self, SharedHealth, SharedStore};
use crate::{latency, replay, status, Listeners};
use relay_common::admin::{self, Admin};
use relay_common::config::ConfigError;
use relay_common::h2::H2Limits;
use relay_common::listen::{self, ListenerGuard, ListenerLimits, ListenerMetrics};
use relay_common::tls::{self, TlsClient, TlsServer};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio::time::MissedTickBehavior;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{info, warn};

/// How long the registry listener may take to close its report streams at shutdown.
pub const REGISTRY_STOP_GRACE: Duration = Duration::from_secs(5);

/// The dispatcher's cancellation tree, in its order of stopping: each phase's token is a
/// child of the next one's, so [`StopOrder::rest`] stops everything at once, and the
/// orderly stop ([`supervise`]) cancels `front`, then `registry`, then `rest`.
struct StopOrder {
    /// The HTTP front: stops accepting, then drains.
    front: CancellationToken,
    /// The registry listener and its report streams.
    registry: CancellationToken,
    /// The shared store, latency probes, routing tick, certificate reload, admin listener.
    rest: CancellationToken,
}

impl StopOrder {
    fn new() -> Self {
        let rest = CancellationToken::new();
        let registry = rest.child_token();
        let front = registry.child_token();
        StopOrder {
            front,
            registry,
            rest,
        }
    }
}

/// The registry listener: the `Registry.Report` service on its listener.
struct RegistryListener {
    listener: TcpListener,
    tls: Option<TlsServer>,
    guard: Arc<ListenerGuard>,
    h2: H2Limits,
    max_frame_bytes: usize,
    report: ReportService,
}

/// The HTTP front and what it serves with.
struct FrontListener {
    listener: TcpListener,
    tls: Option<TlsServer>,
    guard: Arc<ListenerGuard>,
    h2: H2Limits,
    front: Arc<Front>,
    grace: Duration,
}

/// Every component of a dispatcher, built from its config; nothing runs until
/// [`Dispatcher::spawn`].
pub struct Dispatcher {
    http_addr: SocketAddr,
    registry_addr: SocketAddr,
    admin_addr: SocketAddr,
    order: StopOrder,
    /// Certificates reloaded on SIGHUP and on change, every `reload_interval`.
    reloads: Vec<Arc<dyn tls::Reload>>,
    reload_interval: Duration,
    routes: Arc<Routes>,
    /// For the latency probes.
    channels: Channels,
    /// The routing tick's period.
    tick: Duration,
    /// With `[registry] backend = "redis"`.
    store: Option<SharedStore>,
    registry: RegistryListener,
    /// The registry listener serves (for `/readyz`).
    registry_up: Arc<AtomicBool>,
    admin: (TcpListener, Admin),
    front: FrontListener,
    /// Set once the dispatcher begins to stop (for `/readyz`).
    draining: Arc<AtomicBool>,
}

impl Dispatcher {
    /// Validates `config` and builds every component on `listeners`, with the co-located
    /// tunnel server if there is one.
    pub fn build(
        config: &Config,
        listeners: Listeners,
        local: Option<Local>,
    ) -> Result<Self, RunError> {
        config.validate()?;
        let transport = config.transport()?;
        let (http_addr, registry_addr, admin_addr) = (
            listeners.http.local_addr()?,
            listeners.registry.local_addr()?,
            listeners.admin.local_addr()?,
        );
        // The address the registry really listens on (a caller may bind another than
        // `registry_listen`).
        if config.registry_key_needed(registry_addr)? {
            warn!(
                registry = %registry_addr,
                "the registry listener has no [registry] server_key: any local process can report as a tunnel server; set one (the tunnel servers' dispatcher_key)"
            );
        }
        let order = StopOrder::new();
        let prometheus = prometheus::Registry::new();
        let metrics = Metrics::register(&prometheus)?;
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
        let reloads = {
            let mut items: Vec<Arc<dyn tls::Reload>> = Vec::new();
            if let Some(t) = &front_tls {
                items.push(Arc::new(t.clone()));
            }
            if let Some(t) = &registry_tls {
                items.push(Arc::new(t.clone()));
            }
            if let Some(t) = &forward_tls {
                items.push(Arc::new(t.clone()));
            }
            items
        };
        let channels = Channels::new(forward_tls, config.forward_h2()?)
            .with_local(local)
            .with_carrier_idle_timeout(config.carrier_idle_timeout)
            .with_max_frame_bytes(config.max_frame_bytes)
            .with_gauges(
                metrics.forward_connections.clone(),
                metrics.forward_servers_down.clone(),
            );

        info!(http = %http_addr, registry = %registry_addr, admin = %admin_addr, callers = config.callers.len(),
            policy = ?config.routing.policy, registry_backend = ?config.registry.backend, "dispatcher starting");
        let shared = config.registry.backend == RegistryBackend::Redis;
        let routes = Arc::new(
            Routes::new(
                config.routing.clone(),
                config.registry.lease,
                format!("dispatcher@{registry_addr}"),
                shared,
                metrics.clone(),
            )
            .with_evict({
                let channels = channels.clone();
                move |url| channels.evict(url)
            }),
        );

        // Shared registry (Redis): routing never waits on it.
        let (store, health) = match (&config.registry.url, shared) {
            (Some(url), true) => {
                let health = Arc::new(SharedHealth::default());
                let store = SharedStore {
                    routes: routes.clone(),
                    client: shared::client(url, &config.registry.redis_tls)?,
                    key_prefix: config.registry.key_prefix.clone(),
                    lease: config.registry.lease,
                    refresh_interval: config.registry.refresh_interval,
                    timeout: config.registry.redis_timeout,
                    health: health.clone(),
                    metrics: metrics.clone(),
                    stop: order.rest.clone(),
                    rules: shared::record::RecordRules::new(
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
                    .map_err(|e| ConfigError::invalid("registry.forward_hosts", e))?,
                };
                (Some(store), Some(health))
            }
            _ => (None, None),
        };

        let registry = RegistryListener {
            listener: listeners.registry,
            tls: registry_tls,
            guard: ListenerGuard::new(
                "registry",
                ListenerLimits::without_auth(),
                listener_metrics.clone(),
            ),
            h2: config.registry_h2()?,
            max_frame_bytes: config.max_frame_bytes,
            report: ReportService {
                routes: routes.clone(),
                server_key: config.registry.server_key_digest().cloned(),
                allowed_servers: config.registry.allowed_servers.clone(),
                server_id_in_cert: config.registry.server_id_in_cert,
                metrics: metrics.clone(),
                stop: order.registry.clone(),
            },
        };
        let registry_up = Arc::new(AtomicBool::new(false));
        let draining = Arc::new(AtomicBool::new(false));
        let admin = admin_service(
            prometheus,
            listener_metrics.clone(),
            routes.clone(),
            health,
            registry_up.clone(),
            draining.clone(),
        );

        let calls = Calls {
            routes: routes.clone(),
            forwarder: Forwarder {
                channels: channels.clone(),
                metrics: metrics.clone(),
            },
            rules: RetryRules {
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
        let front = FrontListener {
            listener: listeners.http,
            tls: front_tls,
            guard: ListenerGuard::new(
                "front",
                config.front_limits.listener_limits(),
                listener_metrics,
            ),
            h2: config.front_h2()?,
            front: Arc::new(Front::new(config, calls)),
            grace: config.shutdown_grace,
        };
        Ok(Dispatcher {
            http_addr,
            registry_addr,
            admin_addr,
            order,
            reloads,
            reload_interval: config.reload_interval,
            routes,
            channels,
            // Expires leases and steps spill shares with no report arriving.
            tick: config.routing.step_interval.min(config.registry.lease / 4),
            store,
            registry,
            registry_up,
            admin: (listeners.admin, admin),
            front,
            draining,
        })
    }

    /// Runs every component under one task tracker; the handle stops them in order.
    pub fn spawn(self) -> crate::DispatcherHandle {
        let Dispatcher {
            http_addr,
            registry_addr,
            admin_addr,
            order,
            reloads,
            reload_interval,
            routes,
            channels,
            tick,
            store,
            registry,
            registry_up,
            admin,
            front,
            draining,
        } = self;
        let tracker = TaskTracker::new();
        tracker.spawn(tls::watch(reloads, reload_interval, order.rest.clone()));
        if let Some(store) = store {
            tracker.spawn(store.run());
        }
        // This dispatcher's leg to each tunnel server, for the latency tiers.
        tracker.spawn(latency::run(routes.clone(), channels, order.rest.clone()));
        // The registry listener (the report streams) and the routing tick (which judges
        // their leases) on a thread of their own, so the call load cannot delay a report
        // past its lease (`relay_common::runtime::ControlRuntime`). Without a thread (the
        // OS refused one) they run here.
        let control = match relay_common::runtime::ControlRuntime::start() {
            Ok(c) => Some(c),
            Err(e) => {
                warn!(error = %e, "no thread for the registry: it shares the call path's runtime");
                None
            }
        };
        let on = control
            .as_ref()
            .map_or_else(tokio::runtime::Handle::current, |c| c.handle().clone());
        tracker.spawn_on(routing_tick(routes, tick, order.rest.clone()), &on);
        let registry_task = tracker.spawn_on(
            serve_registry(registry, registry_up, order.registry.clone()),
            &on,
        );
        // The thread lives until the last step of the stop (the registry has stopped).
        let rest = order.rest.clone();
        tracker.spawn(async move {
            rest.cancelled().await;
            drop(control);
        });
        let (admin_listener, admin) = admin;
        tracker.spawn(admin::serve(
            admin_listener,
            admin,
            order.rest.clone().cancelled_owned(),
        ));
        let front_task = tracker.spawn(crate::front::serve(
            front.listener,
            front.tls,
            front.guard,
            front.h2,
            front.front,
            order.front.clone(),
            front.grace,
        ));
        tracker.close();

        let stop = CancellationToken::new();
        let task = tokio::spawn(supervise(
            stop.clone(),
            order,
            tracker,
            front_task,
            registry_task,
            draining,
        ));
        crate::DispatcherHandle {
            http_addr,
            registry_addr,
            admin_addr,
            stop,
            task: Some(task),
        }
    }
}

/// The admin listener's service: `/metrics`, `/readyz` (the registry listener serves, the
/// dispatcher is not draining, the shared registry is reachable), `/debug/routes` and the
/// status page.
fn admin_service(
    prometheus: prometheus::Registry,
    listener_metrics: ListenerMetrics,
    routes: Arc<Routes>,
    health: Option<Arc<SharedHealth>>,
    up: Arc<AtomicBool>,
    draining: Arc<AtomicBool>,
) -> Admin {
    let registry_status = |h: &Option<Arc<SharedHealth>>| match h {
        Some(h) => h.status(),
        None => (
            true,
            serde_json::json!({"backend": "memory", "state": "ok"}),
        ),
    };
    let (routes_ready, health_ready) = (routes.clone(), health.clone());
    Admin::new(prometheus)
        .with_listener_metrics(listener_metrics)
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
                let mut snap = routes.snapshot();
                snap["registry"] = registry_status(&health).1;
                snap
            };
            match path {
                "/debug/routes" => Some(admin::json(http::StatusCode::OK, &snap())),
                // The status page: the same document, as HTML.
                "/" => Some(relay_common::html::response(status::page(&snap()))),
                _ => None,
            }
        })
}

/// The routing tick: expires leases and steps spill shares with no report arriving, every
/// `period`, until `stop`.
async fn routing_tick(routes: Arc<Routes>, period: Duration, stop: CancellationToken) {
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
}

/// Serves `Registry.Report` until `stop`; `up` says whether it serves.
async fn serve_registry(
    registry: RegistryListener,
    up: Arc<AtomicBool>,
    stop: CancellationToken,
) -> Result<(), tonic::transport::Error> {
    let RegistryListener {
        listener,
        tls,
        guard,
        h2,
        max_frame_bytes,
        report,
    } = registry;
    let incoming = listen::incoming(listener, tls, guard, stop.clone());
    up.store(true, Ordering::SeqCst);
    let result = relay_common::grpc::server(&h2)
        .add_service(
            relay_proto::registry_server::RegistryServer::new(report)
                .max_decoding_message_size(max_frame_bytes)
                .max_encoding_message_size(max_frame_bytes),
        )
        .serve_with_incoming_shutdown(incoming, stop.cancelled_owned())
        .await;
    up.store(false, Ordering::SeqCst);
    result
}

/// Waits for `stop` (or the registry listener's end), then stops the dispatcher in
/// [`StopOrder`]: the front drains, the registry listener closes (within
/// [`REGISTRY_STOP_GRACE`]), the rest stops, and every task of `tracker` has ended.
async fn supervise(
    stop: CancellationToken,
    order: StopOrder,
    tracker: TaskTracker,
    front: JoinHandle<()>,
    mut registry: JoinHandle<Result<(), tonic::transport::Error>>,
    draining: Arc<AtomicBool>,
) -> Result<(), RunError> {
    let mut result = Ok(());
    let mut registry_done = false;
    tokio::select! {
        _ = stop.cancelled() => info!("dispatcher shutting down"),
        r = &mut registry => {
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
    order.front.cancel();
    if let Err(e) = front.await {
        warn!(error = %e, "HTTP front task failed");
    }
    order.registry.cancel();
    if !registry_done {
        match tokio::time::timeout(REGISTRY_STOP_GRACE, &mut registry).await {
            Ok(Ok(Err(e))) => result = Err(RunError::Registry(e)),
            Ok(_) => {}
            Err(_) => {
                warn!("registry listener did not stop in time");
                registry.abort();
            }
        }
    }
    order.rest.cancel();
    tracker.wait().await;
    info!("dispatcher stopped");
    result
}
