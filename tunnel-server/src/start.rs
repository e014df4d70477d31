//! Start-up as build, then spawn: [`Server::build`] makes every component of a tunnel
//! server from its config (listeners with their services, the admin routes, the reload
//! watch, liveness, pressure hints, the CPU sampler, one reporter per dispatcher, the
//! co-located front) and runs nothing; [`Server::spawn`] starts the front, spawns every
//! task under one [`TaskTracker`] and one cancellation tree ([`Stops`]), and returns the
//! handle. How the server stops, in order, is written once: [`Stopper`].

use crate::hub::{Hub, Limits};
use crate::metrics::ServerMetrics;
use crate::tokens::{self, SharedTokens, TokenStore};
use crate::{
    forward, liveness, load, report, status, stream, Config, Front, Listeners, RunError,
    TunnelServerHandle, PRESSURE_GAP,
};
use futures::{FutureExt, StreamExt};
use relay_common::h2io::H2Io;
use relay_common::listen::{self, ListenerGuard, ListenerLimits, ListenerMetrics};
use relay_common::tls::{self, TlsClient, TlsServer};
use relay_proto::{forward_server::ForwardServer, tunnel_server::TunnelServer, ServerIntro};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::time::MissedTickBehavior;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{info, warn};

/// The server's cancellation tree. Cancelling a token cancels the ones below it, so the
/// order in which the server's tasks stop is the order in which [`Stopper::run`] cancels
/// these, and `abort` stops everything by cancelling the root.
///
/// ```text
/// serving: the listeners, the reload watch, liveness, pressure hints, idle carriers
/// └── reports: the report streams to dispatchers and the CPU sampler feeding them
/// ```
#[derive(Clone)]
pub(crate) struct Stops {
    serving: CancellationToken,
    reports: CancellationToken,
}

impl Stops {
    fn new() -> Self {
        let serving = CancellationToken::new();
        let reports = serving.child_token();
        Stops { serving, reports }
    }
}

/// How long the last step of a stop waits for the server's tasks (the listeners, the calls'
/// and streams' own tasks) once every stream is closed and the listeners are told to stop.
const STOP_WAIT: Duration = Duration::from_secs(5);

/// The graceful stop, in order; the one place that order is written:
///
/// 1. the co-located front drains and stops, so its calls in flight finish here;
/// 2. draining is announced (reports, `/readyz`) and every agent stream is told to go
///    (`Drain`); the server waits until the agents have moved every stream away and no
///    call runs ([`Hub::settled`]), or `shutdown_grace`;
/// 3. `reports` is cancelled: dispatchers see the report streams end;
/// 4. every agent stream still open is closed;
/// 5. `serving` is cancelled: the listeners and the periodic tasks stop, and every task
///    of the server's tracker gets [`STOP_WAIT`] to end.
struct Stopper {
    server_id: String,
    /// The co-located front: stopped first, so its calls in flight finish here.
    front: Option<relay_dispatcher::DispatcherHandle>,
    hub: Arc<Hub>,
    grace: Duration,
    stops: Stops,
    tracker: TaskTracker,
}

impl Stopper {
    async fn run(mut self) {
        if let Some(front) = self.front.take() {
            if let Err(e) = front.shutdown().await {
                warn!(error = %e, "co-located front stopped with an error");
            }
        }
        info!(server_id = %self.server_id, "draining");
        self.hub
            .drain(self.grace.as_millis().min(u32::MAX as u128) as u32);
        // Agents move their streams away once covered elsewhere; busy streams leave after
        // their call.
        let _ = tokio::time::timeout(self.grace, self.hub.settled()).await;
        self.stops.reports.cancel();
        self.hub.close_all();
        self.stops.serving.cancel();
        self.tracker.close();
        let _ = tokio::time::timeout(STOP_WAIT, self.tracker.wait()).await;
        info!(server_id = %self.server_id, "stopped");
    }
}

/// A listener and the gRPC service it serves.
struct GrpcListener<S> {
    listener: TcpListener,
    tls: Option<TlsServer>,
    guard: Arc<ListenerGuard>,
    h2: relay_common::h2::H2Limits,
    service: S,
}

impl GrpcListener<TunnelServer<stream::TunnelService>> {
    /// Serves `Tunnel.Connect` until `stop`.
    async fn serve(self, stop: CancellationToken) {
        // An agent multiplexes up to its `max_streams` tunnel streams on one connection, a
        // load balancer those of many agents: `[agent_h2]` sizes for that. Half-received
        // messages across all agent streams are bounded
        // (`agent_limits.max_partial_frame_bytes`).
        let frames = self.guard.partial_frames_layer();
        let r = relay_common::grpc::server(&self.h2)
            .layer(frames)
            .add_service(self.service)
            .serve_with_incoming_shutdown(
                listen::incoming(self.listener, self.tls, self.guard, stop.clone())
                    .map(|conn| conn.map(H2Io::new)),
                stop.cancelled_owned(),
            )
            .await;
        if let Err(e) = r {
            warn!(error = %e, "agent listener stopped");
        }
    }
}

impl GrpcListener<ForwardServer<forward::ForwardService>> {
    /// Serves `Forward.Call` until `stop`. A dispatcher sends all its calls to this server
    /// on one connection.
    async fn serve(self, stop: CancellationToken) {
        let r = relay_common::grpc::server(&self.h2)
            .add_service(self.service)
            .serve_with_incoming_shutdown(
                listen::incoming(self.listener, self.tls, self.guard, stop.clone())
                    .map(|conn| conn.map(H2Io::new)),
                stop.cancelled_owned(),
            )
            .await;
        if let Err(e) = r {
            warn!(error = %e, "forward listener stopped");
        }
    }
}

/// The co-located front, built: started first when the server spawns.
struct FrontParts {
    config: relay_dispatcher::Config,
    listeners: relay_dispatcher::Listeners,
    local: relay_dispatcher::colocated::Local,
}

impl FrontParts {
    /// The front with the in-process hop to this server; warns when no `dispatchers`
    /// entry names the front's registry port (the front would not hear of this server).
    fn new(
        front: Front,
        dispatchers: &[String],
        forward_url: &str,
        colocated: forward::Colocated,
    ) -> Result<Self, RunError> {
        let Front {
            config: c,
            listeners,
        } = front;
        let registry = listeners.registry.local_addr()?;
        if !dispatchers
            .iter()
            .any(|d| d.ends_with(&format!(":{}", registry.port())))
        {
            warn!(dispatchers = ?dispatchers, front_registry = %registry,
                "co-located front: no dispatchers entry names the front's registry port, so the front will not hear of this server's tunnels");
        }
        Ok(FrontParts {
            config: c,
            listeners,
            local: relay_dispatcher::colocated::Local {
                forward_url: forward_url.to_string(),
                server: Arc::new(colocated),
            },
        })
    }
}

/// Every component of a tunnel server, built from its config; nothing runs yet.
pub(crate) struct Server {
    server_id: String,
    agent_addr: SocketAddr,
    forward_addr: SocketAddr,
    admin_addr: SocketAddr,
    registry: prometheus::Registry,
    hub: Arc<Hub>,
    stops: Stops,
    /// Every task of the server: the long-lived ones spawned here and the calls' and
    /// streams' own (the services spawn those).
    tracker: TaskTracker,
    agent: GrpcListener<TunnelServer<stream::TunnelService>>,
    forward: GrpcListener<ForwardServer<forward::ForwardService>>,
    admin: (TcpListener, relay_common::admin::Admin),
    reloads: (tls::Reloads, Duration),
    liveness: Option<Arc<liveness::Conns>>,
    cpu: (load::CpuSource, Arc<std::sync::atomic::AtomicU32>),
    reporters: Vec<report::Reporter>,
    front: Option<FrontParts>,
    grace: Duration,
}

impl Server {
    /// Builds every component from the config: reads the TLS files, registers the
    /// metrics, wires the services to the hub. Spawns nothing.
    pub(crate) fn build(
        config: Config,
        tokens: TokenStore,
        listeners: Listeners,
        front: Option<Front>,
    ) -> Result<Self, RunError> {
        config.validate()?;
        if let Some(front) = &front {
            front.config.validate()?;
        }
        let (agent_h2, forward_h2, dispatcher_h2) = (
            config.agent_h2()?,
            config.forward_h2()?,
            config.dispatcher_h2()?,
        );
        let transport = config.transport()?;
        let registry = prometheus::Registry::new();
        let metrics = ServerMetrics::register(&registry)?;
        let expiry = tls::CertExpiry::register(&registry)?;
        let listener_metrics = ListenerMetrics::register(&registry)?;
        let agent_tls = hop_tls("agent_tls", transport.agent, &expiry)?;
        let forward_tls = hop_tls("forward_tls", transport.forward, &expiry)?;
        let dispatcher_tls = hop_tls("dispatcher_tls", transport.dispatchers, &expiry)?;
        note_plain_hops(
            &config,
            front.as_ref(),
            [&agent_tls, &forward_tls],
            &dispatcher_tls,
        )?;
        let agent_addr = listeners.agent.local_addr()?;
        let forward_addr = listeners.forward.local_addr()?;
        let admin_addr = listeners.admin.local_addr()?;
        let server_id = config.effective_server_id(agent_addr);
        let head_limits = config.response_head_limits();
        let hub = Arc::new(Hub::new(
            Limits {
                max_queue_per_tunnel: config.max_queue_per_tunnel,
                max_streams_per_token: config.max_streams_per_token,
                max_response_headers: head_limits.max_headers,
                max_response_header_bytes: head_limits.max_bytes,
            },
            metrics,
        ));
        let stops = Stops::new();
        let tracker = TaskTracker::new();
        let tokens = SharedTokens::new(tokens);

        let reloads = reloads(
            [&agent_tls, &forward_tls],
            &dispatcher_tls,
            config
                .token_store
                .as_ref()
                .map(|path| (path, &tokens, &hub)),
        );

        let liveness = (!config.liveness_interval.is_zero()).then(|| {
            Arc::new(liveness::Conns::new(
                liveness::Settings {
                    interval: config.liveness_interval,
                    timeout: config.liveness_timeout,
                },
                hub.metrics.silent_connections.clone(),
            ))
        });
        // New agent connections are admitted at a pace the server can serve
        // (`max_opens_in_progress`, `relay_common::listen::admission`).
        let agent_guard = ListenerGuard::new(
            "agent",
            config.agent_limits.clone(),
            listener_metrics.clone(),
        )
        .with_admission(Arc::new(listen::Admission::new(
            config.max_opens_in_progress,
            hub.metrics.opens_waiting.clone(),
            hub.metrics.open_wait.clone(),
        )));
        let tunnel = stream::TunnelService {
            liveness: liveness.clone(),
            response_credit: relay_proto::body_credit(agent_h2.stream_window_bytes),
            hub: hub.clone(),
            tokens,
            server_id: server_id.clone(),
            zone: config.zone.clone(),
            direct_url: config.direct_url.clone().unwrap_or_default(),
            heartbeat: config.heartbeat,
            heartbeat_misses: config.heartbeat_misses,
            tracker: tracker.clone(),
            listener: agent_guard.clone(),
        };
        let agent = GrpcListener {
            listener: listeners.agent,
            tls: agent_tls,
            guard: agent_guard,
            h2: agent_h2,
            service: TunnelServer::new(tunnel)
                .max_decoding_message_size(config.max_frame_bytes)
                .max_encoding_message_size(config.max_frame_bytes),
        };

        let received = prometheus::IntCounter::new(
            "relay_tunnel_calls_received_total",
            "Forward calls received from dispatchers; each ends with one relay_tunnel_calls_total outcome",
        )?;
        registry.register(Box::new(received.clone()))?;
        let forward_service = Arc::new(forward::ForwardService {
            hub: hub.clone(),
            received,
            queue_timeout: config.queue_timeout,
            handshake_after: config.queue_handshake_after,
            reservations: Default::default(),
            tracker: tracker.clone(),
            stop: stops.serving.clone(),
        });
        let colocated = forward::Colocated(forward_service.clone());
        let forward_url = config.forward_url.clone().unwrap_or_else(|| {
            let scheme = if forward_tls.is_some() {
                "https"
            } else {
                "http"
            };
            format!("{scheme}://{forward_addr}")
        });
        let forward = GrpcListener {
            listener: listeners.forward,
            tls: forward_tls,
            guard: ListenerGuard::new(
                "forward",
                ListenerLimits::without_auth(),
                listener_metrics.clone(),
            ),
            h2: forward_h2,
            service: ForwardServer::from_arc(forward_service)
                .max_decoding_message_size(config.max_frame_bytes)
                .max_encoding_message_size(config.max_frame_bytes),
        };

        let admin = admin(&registry, listener_metrics, &hub, &server_id, &config.zone);

        let front = front
            .map(|f| FrontParts::new(f, &config.dispatchers, &forward_url, colocated))
            .transpose()?;

        let intro = ServerIntro {
            server_id: server_id.clone(),
            zone: config.zone.clone(),
            forward_url,
            protocol_version: relay_proto::PROTOCOL_VERSION,
            instance_id: hub.instance_id.clone(),
            direct_url: config.direct_url.clone().unwrap_or_default(),
        };
        // The server's own CPU use, for the load reports.
        let cpu = Arc::new(std::sync::atomic::AtomicU32::new(0));
        let reporters = config
            .dispatchers
            .iter()
            .map(|d| report::Reporter {
                hub: hub.clone(),
                cpu: cpu.clone(),
                dispatcher: d.clone(),
                intro: intro.clone(),
                interval: config.report_interval,
                key: config.dispatcher_key.clone(),
                client: relay_common::grpc::GrpcClient::new(
                    dispatcher_h2,
                    report::CONNECT_TIMEOUT,
                    dispatcher_tls.clone(),
                ),
                max_frame_bytes: config.max_frame_bytes,
                stop: stops.reports.clone(),
            })
            .collect();

        Ok(Server {
            server_id,
            agent_addr,
            forward_addr,
            admin_addr,
            registry,
            hub,
            stops,
            tracker,
            agent,
            forward,
            admin: (listeners.admin, admin),
            reloads: (reloads, config.reload_interval),
            liveness,
            cpu: (config.cpu_source.clone(), cpu),
            reporters,
            front,
            grace: config.shutdown_grace,
        })
    }

    /// Starts the co-located front, then spawns every task of the server under its
    /// tracker and its cancellation tree, and returns the handle that stops them.
    pub(crate) async fn spawn(self) -> Result<TunnelServerHandle, RunError> {
        let Server {
            server_id,
            agent_addr,
            forward_addr,
            admin_addr,
            registry,
            hub,
            stops,
            tracker,
            agent,
            forward,
            admin,
            reloads,
            liveness,
            cpu,
            reporters,
            front,
            grace,
        } = self;
        // The control plane (the report streams) on a thread of its own: no storm of agent opens delays a report past its lease
        // (`relay_common::runtime::ControlRuntime`).
        let control = relay_common::runtime::ControlRuntime::start()?;
        // The front first: it is the one step that can fail, and nothing of this server
        // runs yet then. Its calls to this server take the in-process hop, which needs no
        // listener.
        let front = match front {
            Some(f) => Some(
                relay_dispatcher::start_with(f.config, f.listeners, Some(f.local))
                    .await
                    .map_err(|e| RunError::Front(Box::new(e)))?,
            ),
            None => None,
        };
        let front_addr = front.as_ref().map(|f| f.http_addr);

        let serving = &stops.serving;
        let mut tasks = Vec::new();
        let mut spawn = |task| tasks.push(tracker.spawn(task).abort_handle());
        spawn(reloads.0.run(reloads.1, serving.clone()).boxed());
        if let Some(conns) = liveness {
            spawn(liveness::run(conns, serving.clone()).boxed());
        }
        spawn(agent.serve(serving.clone()).boxed());
        spawn(forward.serve(serving.clone()).boxed());
        spawn(
            relay_common::admin::serve(admin.0, admin.1, serving.clone().cancelled_owned()).boxed(),
        );
        spawn(pressure(hub.clone(), serving.clone()).boxed());
        // The CPU sampler measures the runtime it runs on (`crate::load`): this one.
        spawn(load::run(cpu.0, cpu.1, stops.reports.clone()).boxed());
        let mut reports = Vec::new();
        for reporter in reporters {
            reports.push(tracker.spawn_on(reporter.run(), control.handle()));
        }
        tasks.extend(reports.iter().map(|r| r.abort_handle()));
        // The thread lives until the server stops serving and its report streams, told to
        // end before that, have ended.
        let reports_stopped = serving.clone();
        tasks.push(
            tracker
                .spawn(async move {
                    reports_stopped.cancelled().await;
                    let _ =
                        tokio::time::timeout(STOP_WAIT, futures::future::join_all(reports)).await;
                    drop(control);
                })
                .abort_handle(),
        );
        info!(%server_id, instance_id = %hub.instance_id, agent = %agent_addr, forward = %forward_addr, admin = %admin_addr, "tunnel server listening");

        let stop = CancellationToken::new();
        let stopper = Stopper {
            server_id: server_id.clone(),
            front,
            hub: hub.clone(),
            grace,
            stops: stops.clone(),
            tracker,
        };
        // The stopper is the handle's own task: `shutdown` awaits it, `abort` aborts it.
        let stopper = tokio::spawn({
            let stop = stop.clone();
            async move {
                stop.cancelled().await;
                stopper.run().await;
            }
        });
        Ok(TunnelServerHandle {
            server_id,
            agent_addr,
            forward_addr,
            admin_addr,
            front_addr,
            registry,
            hub,
            stop,
            stopper: Some(stopper),
            serving: stops.serving,
            tasks,
        })
    }
}

/// What the server reloads from its files: its certificates and its token store, whose
/// reload closes the streams of removed tokens.
fn reloads(
    [agent_tls, forward_tls]: [&Option<TlsServer>; 2],
    dispatcher_tls: &Option<TlsClient>,
    token_store: Option<(&std::path::PathBuf, &SharedTokens, &Arc<Hub>)>,
) -> tls::Reloads {
    let mut reloads = tls::Reloads::default()
        .with(agent_tls.clone())
        .with(forward_tls.clone())
        .with(dispatcher_tls.clone());
    if let Some((path, tokens, hub)) = token_store {
        let (revoke_hub, store) = (hub.clone(), tokens.clone());
        reloads.push(tokens::TokenReloader {
            path: path.clone(),
            tokens: tokens.clone(),
            on_change: Box::new(move || {
                let closed = revoke_hub.revoke(|hash, id| store.contains(hash, id));
                if closed > 0 {
                    warn!(
                        streams = closed,
                        "token store reloaded: closed the streams of removed tokens"
                    );
                }
            }),
        });
    }
    reloads
}

/// One hop's TLS, built from its resolved settings (`None`: plain text), its certificates'
/// expiry exported.
fn hop_tls<E: tls::TlsEnd>(
    section: &'static str,
    settings: Option<E>,
    expiry: &tls::CertExpiry,
) -> Result<Option<tls::Tls<E>>, RunError> {
    settings
        .map(|s| tls::Tls::new(section, s, tls::ALPN_H2).map(|t| t.with_expiry(expiry)))
        .transpose()
        .map_err(|source| RunError::Tls { section, source })
}

/// Says which hops of this process run plain text, in one warning line (the co-located
/// front's plain hops included: the process's only line, see `tls::note_plain_text`).
fn note_plain_hops(
    config: &Config,
    front: Option<&Front>,
    [agent_tls, forward_tls]: [&Option<TlsServer>; 2],
    dispatcher_tls: &Option<TlsClient>,
) -> Result<(), RunError> {
    let front_plain = match front {
        Some(f) => {
            let t = f.config.transport()?;
            [t.front.is_none(), t.registry.is_none(), t.forward.is_none()]
        }
        None => [false; 3],
    };
    let plain: Vec<&str> = [
        (
            "co-located HTTP front (front_config's [tls])",
            front_plain[0],
        ),
        (
            "co-located registry listener (front_config's [registry_tls])",
            front_plain[1],
        ),
        (
            "co-located forward calls to other servers (front_config's [forward_tls])",
            front_plain[2],
        ),
        ("agent listener ([agent_tls])", agent_tls.is_none()),
        ("forward listener ([forward_tls])", forward_tls.is_none()),
        (
            "report streams to dispatchers ([dispatcher_tls])",
            dispatcher_tls.is_none() && !config.dispatchers.is_empty(),
        ),
    ]
    .into_iter()
    .filter_map(|(hop, plain)| plain.then_some(hop))
    .collect();
    tls::note_plain_text("tunnel server", &plain);
    Ok(())
}

/// The admin listener's routes: `/readyz` (not while draining), the status page at `/`
/// and `/debug/tunnels`.
fn admin(
    registry: &prometheus::Registry,
    listener_metrics: ListenerMetrics,
    hub: &Arc<Hub>,
    server_id: &str,
    zone: &str,
) -> relay_common::admin::Admin {
    let ready_hub = hub.clone();
    let status_hub = hub.clone();
    let (status_id, status_zone) = (server_id.to_string(), zone.to_string());
    relay_common::admin::Admin::new(registry.clone())
        .with_listener_metrics(listener_metrics)
        .with_ready(move || {
            let draining = ready_hub.is_draining();
            (
                !draining,
                serde_json::json!({ "draining": draining, "tunnels": ready_hub.tunnel_ids().len() }),
            )
        })
        .with_routes(move |path| {
            let status = || status::Status::of(&status_hub, &status_id, &status_zone);
            match path {
                "/" => Some(relay_common::html::response(status::page(&status()))),
                "/debug/tunnels" => Some(relay_common::admin::json(
                    http::StatusCode::OK,
                    &serde_json::to_value(status()).unwrap_or_default(),
                )),
                _ => None,
            }
        })
}

/// Pressure hints: at once when a call starts to wait (at most one round per
/// [`PRESSURE_GAP`], so a burst's thousand queued calls cost a few rounds), and on a short
/// period for the changes in between (a queue that drains).
async fn pressure(hub: Arc<Hub>, stop: CancellationToken) {
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    tick.set_missed_tick_behavior(MissedTickBehavior::Skip);
    let mut queued = hub.queued_calls.subscribe();
    loop {
        tokio::select! {
            biased;
            _ = stop.cancelled() => return,
            Ok(()) = queued.changed() => {
                queued.borrow_and_update();
                hub.send_pressure();
                tokio::time::sleep(PRESSURE_GAP).await;
            }
            _ = tick.tick() => hub.send_pressure(),
        }
    }
}
