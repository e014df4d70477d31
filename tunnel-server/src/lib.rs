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

pub mod call;
pub mod config;
pub mod forward;
pub mod handle;
pub mod hub;
pub mod liveness;
pub mod load;
pub mod metrics;
pub mod outcome;
pub mod report;
pub mod slots;
pub mod status;
pub mod stream;
pub mod tokens;

pub use config::Config;
pub use tokens::{SharedTokens, TokenStore};

use futures::StreamExt;
use hub::{Hub, Limits};
use metrics::ServerMetrics;
use relay_common::config::ConfigError;
use relay_common::h2io::H2Io;
use relay_common::listen::{self, ListenerGuard, ListenerLimits, ListenerMetrics};
use relay_common::tls::{self, TlsClient, TlsError, TlsServer};
use relay_proto::{forward_server::ForwardServer, tunnel_server::TunnelServer, ServerIntro};
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::task::{AbortHandle, JoinHandle};
use tokio::time::{Instant, MissedTickBehavior};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{info, warn};

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
pub struct TunnelServerHandle {
    pub server_id: String,
    pub agent_addr: SocketAddr,
    pub forward_addr: SocketAddr,
    pub admin_addr: SocketAddr,
    /// The co-located front's HTTP address, when running one.
    pub front_addr: Option<SocketAddr>,
    pub registry: prometheus::Registry,
    hub: Arc<Hub>,
    /// Cancelled to begin the graceful stop (by `shutdown` or on drop).
    stop: CancellationToken,
    /// Runs the graceful stop once `stop` is cancelled.
    stopper: Option<JoinHandle<()>>,
    /// The server's tasks, for `abort`.
    tasks: Vec<AbortHandle>,
}

/// What the graceful stop needs; owned by the stopper task.
struct Stopper {
    server_id: String,
    /// The co-located front: stopped first, so its calls in flight finish here.
    front: Option<relay_dispatcher::DispatcherHandle>,
    hub: Arc<Hub>,
    grace: Duration,
    stop_reports: CancellationToken,
    stop_serving: CancellationToken,
    tasks: Vec<JoinHandle<()>>,
    tracker: TaskTracker,
}

impl Stopper {
    /// Announce draining, send Drain to agents, let calls in flight finish within the
    /// grace period, then close every stream and stop serving.
    async fn run(mut self) {
        if let Some(front) = self.front.take() {
            if let Err(e) = front.shutdown().await {
                warn!(error = %e, "co-located front stopped with an error");
            }
        }
        info!(server_id = %self.server_id, "draining");
        self.hub
            .drain(self.grace.as_millis().min(u32::MAX as u128) as u32);
        // Wait until the agents have moved every stream away (they do once covered
        // elsewhere; busy streams leave after their call) and nothing runs, or the grace.
        let deadline = Instant::now() + self.grace;
        while (!self.hub.is_empty() || self.hub.metrics.in_flight.get() > 0)
            && Instant::now() < deadline
        {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        self.stop_reports.cancel();
        self.hub.close_all();
        self.stop_serving.cancel();
        self.tracker.close();
        let _ = tokio::time::timeout(Duration::from_secs(5), self.tracker.wait()).await;
        for t in self.tasks {
            let _ = tokio::time::timeout(Duration::from_secs(5), t).await;
        }
        info!(server_id = %self.server_id, "stopped");
    }
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

/// [`start`], also serving the co-located mode's dispatcher front when `front` is given.
pub async fn start_with_front(
    config: Config,
    tokens: TokenStore,
    listeners: Listeners,
    front: Option<Front>,
) -> Result<TunnelServerHandle, RunError> {
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
    let agent_guard = ListenerGuard::new(
        "agent",
        config.agent_limits.clone(),
        listener_metrics.clone(),
    );
    let forward_guard = ListenerGuard::new(
        "forward",
        ListenerLimits::without_auth(),
        listener_metrics.clone(),
    );
    let tls_err = |section| move |source| RunError::Tls { section, source };
    let agent_tls = transport
        .agent
        .map(|s| TlsServer::new("agent_tls", s, tls::ALPN_H2))
        .transpose()
        .map_err(tls_err("agent_tls"))?
        .map(|t| t.with_expiry(&expiry));
    let forward_tls = transport
        .forward
        .map(|s| TlsServer::new("forward_tls", s, tls::ALPN_H2))
        .transpose()
        .map_err(tls_err("forward_tls"))?
        .map(|t| t.with_expiry(&expiry));
    let forward_is_tls = forward_tls.is_some();
    let dispatcher_tls = transport
        .dispatchers
        .map(|c| TlsClient::new("dispatcher_tls", c, tls::ALPN_H2))
        .transpose()
        .map_err(tls_err("dispatcher_tls"))?
        .map(|t| t.with_expiry(&expiry));
    // The co-located front's plain hops go in this server's one warning line (the
    // process's only one, see `tls::note_plain_text`).
    let front_plain = match &front {
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
    let tracker = TaskTracker::new();
    let stop_serving = CancellationToken::new();
    let stop_reports = CancellationToken::new();
    let mut tasks = Vec::new();

    let tokens = SharedTokens::new(tokens);
    let mut reloads = tls::Reloads::default()
        .with(agent_tls.clone())
        .with(forward_tls.clone())
        .with(dispatcher_tls.clone());
    if let Some(path) = &config.token_store {
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
    tasks.push(reloads.spawn(config.reload_interval, stop_serving.clone()));

    let liveness = (!config.liveness_interval.is_zero()).then(|| {
        Arc::new(liveness::Conns::new(
            liveness::Settings {
                interval: config.liveness_interval,
                timeout: config.liveness_timeout,
            },
            hub.metrics.silent_connections.clone(),
        ))
    });
    if let Some(conns) = &liveness {
        tasks.push(tokio::spawn(liveness::run(
            conns.clone(),
            stop_serving.clone(),
        )));
    }
    let tunnel = stream::TunnelService {
        liveness,
        response_credit: relay_proto::body_credit(agent_h2.stream_window_bytes),
        hub: hub.clone(),
        tokens: tokens.clone(),
        server_id: server_id.clone(),
        zone: config.zone.clone(),
        direct_url: config.direct_url.clone().unwrap_or_default(),
        heartbeat: config.heartbeat,
        heartbeat_misses: config.heartbeat_misses,
        tracker: tracker.clone(),
        listener: agent_guard.clone(),
    };
    let tunnel = TunnelServer::new(tunnel)
        .max_decoding_message_size(config.max_frame_bytes)
        .max_encoding_message_size(config.max_frame_bytes);
    let stop = stop_serving.clone();
    tasks.push(tokio::spawn(async move {
        // An agent multiplexes up to its `max_streams` tunnel streams on one connection,
        // a load balancer those of many agents: `[agent_h2]` sizes for that.
        // Half-received messages across all agent streams are bounded
        // (`agent_limits.max_partial_frame_bytes`).
        let frames = agent_guard.partial_frames_layer();
        let r = relay_common::grpc::server(&agent_h2)
            .layer(frames)
            .add_service(tunnel)
            .serve_with_incoming_shutdown(
                listen::incoming(listeners.agent, agent_tls, agent_guard, stop.clone())
                    .map(|conn| conn.map(H2Io::new)),
                stop.cancelled_owned(),
            )
            .await;
        if let Err(e) = r {
            warn!(error = %e, "agent listener stopped");
        }
    }));

    let received = prometheus::IntCounter::new(
        "relay_tunnel_calls_received_total",
        "Forward calls received from dispatchers; each ends with one relay_tunnel_calls_total outcome",
    )?;
    registry.register(Box::new(received.clone()))?;
    let forward = Arc::new(forward::ForwardService {
        hub: hub.clone(),
        received,
        queue_timeout: config.queue_timeout,
        handshake_after: config.queue_handshake_after,
        reservations: Default::default(),
        tracker: tracker.clone(),
        stop: stop_serving.clone(),
    });
    let colocated = forward::Colocated(forward.clone());
    let forward = ForwardServer::from_arc(forward)
        .max_decoding_message_size(config.max_frame_bytes)
        .max_encoding_message_size(config.max_frame_bytes);
    let stop = stop_serving.clone();
    tasks.push(tokio::spawn(async move {
        // A dispatcher sends all its calls to this server on one connection.
        let r = relay_common::grpc::server(&forward_h2)
            .add_service(forward)
            .serve_with_incoming_shutdown(
                listen::incoming(
                    listeners.forward,
                    forward_tls.clone(),
                    forward_guard,
                    stop.clone(),
                )
                .map(|conn| conn.map(H2Io::new)),
                stop.cancelled_owned(),
            )
            .await;
        if let Err(e) = r {
            warn!(error = %e, "forward listener stopped");
        }
    }));

    let ready_hub = hub.clone();
    let status_hub = hub.clone();
    let (status_id, status_zone) = (server_id.clone(), config.zone.clone());
    let admin = relay_common::admin::Admin::new(registry.clone())
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
        });
    tasks.push(tokio::spawn(relay_common::admin::serve(
        listeners.admin,
        admin,
        stop_serving.clone().cancelled_owned(),
    )));

    // Pressure hints: at once when a call starts to wait (at most one round per
    // PRESSURE_GAP, so a burst's thousand queued calls cost a few rounds), and on a short
    // period for the changes in between (a queue that drains).
    let pressure_hub = hub.clone();
    let stop = stop_serving.clone();
    tasks.push(tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_millis(100));
        tick.set_missed_tick_behavior(MissedTickBehavior::Skip);
        let mut queued = pressure_hub.queued_calls.subscribe();
        loop {
            tokio::select! {
                biased;
                _ = stop.cancelled() => return,
                Ok(()) = queued.changed() => {
                    queued.borrow_and_update();
                    pressure_hub.send_pressure();
                    tokio::time::sleep(PRESSURE_GAP).await;
                }
                _ = tick.tick() => pressure_hub.send_pressure(),
            }
        }
    }));

    let forward_url = config.forward_url.clone().unwrap_or_else(|| {
        let scheme = if forward_is_tls { "https" } else { "http" };
        format!("{scheme}://{forward_addr}")
    });
    let (front, front_addr) = match front {
        Some(Front {
            config: c,
            listeners,
        }) => {
            let registry = listeners.registry.local_addr()?;
            if !config
                .dispatchers
                .iter()
                .any(|d| d.ends_with(&format!(":{}", registry.port())))
            {
                warn!(dispatchers = ?config.dispatchers, front_registry = %registry,
                    "co-located front: no dispatchers entry names the front's registry port, so the front will not hear of this server's tunnels");
            }
            let local = relay_dispatcher::colocated::Local {
                forward_url: forward_url.clone(),
                server: Arc::new(colocated),
            };
            let handle = relay_dispatcher::start_with(c, listeners, Some(local))
                .await
                .map_err(|e| RunError::Front(Box::new(e)))?;
            let addr = handle.http_addr;
            (Some(handle), Some(addr))
        }
        None => (None, None),
    };
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
    tasks.push(tokio::spawn(load::run(
        config.cpu_source.clone(),
        cpu.clone(),
        stop_reports.clone(),
    )));
    for d in &config.dispatchers {
        let reporter = report::Reporter {
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
            stop: stop_reports.clone(),
        };
        tasks.push(tokio::spawn(reporter.run()));
    }
    info!(%server_id, instance_id = %hub.instance_id, agent = %agent_addr, forward = %forward_addr, admin = %admin_addr, "tunnel server listening");
    let stop = CancellationToken::new();
    let abort_handles = tasks.iter().map(JoinHandle::abort_handle).collect();
    let stopper = Stopper {
        server_id: server_id.clone(),
        front,
        hub: hub.clone(),
        grace: config.shutdown_grace,
        stop_reports,
        stop_serving,
        tasks,
        tracker,
    };
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
        tasks: abort_handles,
    })
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
        self.hub.close_all();
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
