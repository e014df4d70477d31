//! relay tunnel server: holds agents' outbound gRPC streams per tunnel id, hands each call
//! from a dispatcher to the newest idle stream of the call's tunnel id, queues calls
//! briefly when none is idle, and tells dispatchers where tunnel ids are.
//!
//! Three listeners, each bound by the caller (tests pass `127.0.0.1:0`): the agent-facing
//! `Tunnel.Connect` service, the dispatcher-facing `Forward.Call` service, and the admin
//! HTTP listener. `run` serves them until its shutdown future resolves, then drains:
//! dispatchers and agents are told, calls in flight finish within `shutdown_grace`.

pub mod config;
pub mod forward;
pub mod hub;
pub mod metrics;
pub mod report;
pub mod stream;
pub mod tokens;

pub use config::Config;
pub use tokens::TokenStore;

use hub::{Hub, Limits};
use metrics::ServerMetrics;
use relay_common::config::ConfigError;
use relay_proto::{forward_server::ForwardServer, tunnel_server::TunnelServer, ServerIntro};
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio::time::{Instant, MissedTickBehavior};
use tokio_stream::wrappers::TcpListenerStream;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{info, warn};

/// Largest frame accepted from a peer: a 64 KiB chunk plus headroom for headers.
pub const MAX_FRAME_BYTES: usize = 1024 * 1024;

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
}

/// A running tunnel server. Dropping it does not stop it; call `shutdown` (graceful) or
/// `abort` (immediate, as a crash would).
pub struct TunnelServerHandle {
    pub server_id: String,
    pub agent_addr: SocketAddr,
    pub forward_addr: SocketAddr,
    pub admin_addr: SocketAddr,
    pub registry: prometheus::Registry,
    hub: Arc<Hub>,
    grace: Duration,
    stop_reports: CancellationToken,
    stop_serving: CancellationToken,
    tasks: Vec<JoinHandle<()>>,
    tracker: TaskTracker,
}

/// Loads the token store, serves until `shutdown` resolves, then drains and stops.
pub async fn run(
    config: Config,
    listeners: Listeners,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), RunError> {
    let tokens = match &config.token_store {
        Some(path) => TokenStore::load(path)?,
        None => {
            warn!("no token_store configured: every agent stream will be refused");
            TokenStore::default()
        }
    };
    let server = start(config, tokens, listeners).await?;
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
    config.validate()?;
    let agent_addr = listeners.agent.local_addr()?;
    let forward_addr = listeners.forward.local_addr()?;
    let admin_addr = listeners.admin.local_addr()?;
    let server_id = config.effective_server_id(agent_addr);
    let registry = prometheus::Registry::new();
    let metrics = ServerMetrics::register(&registry)?;
    let hub = Arc::new(Hub::new(
        Limits {
            max_queue_per_tunnel: config.max_queue_per_tunnel,
            max_streams_per_token: config.max_streams_per_token,
        },
        metrics,
    ));
    let tracker = TaskTracker::new();
    let stop_serving = CancellationToken::new();
    let stop_reports = CancellationToken::new();
    let mut tasks = Vec::new();

    let tunnel = stream::TunnelService {
        hub: hub.clone(),
        tokens: Arc::new(tokens),
        server_id: server_id.clone(),
        zone: config.zone.clone(),
        heartbeat: config.heartbeat,
        heartbeat_misses: config.heartbeat_misses,
        tracker: tracker.clone(),
    };
    let tunnel = TunnelServer::new(tunnel)
        .max_decoding_message_size(MAX_FRAME_BYTES)
        .max_encoding_message_size(MAX_FRAME_BYTES);
    let stop = stop_serving.clone();
    tasks.push(tokio::spawn(async move {
        let r = grpc_server()
            .add_service(tunnel)
            .serve_with_incoming_shutdown(incoming(listeners.agent), stop.cancelled_owned())
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
    let forward = forward::ForwardService {
        hub: hub.clone(),
        received,
        queue_timeout: config.queue_timeout,
        tracker: tracker.clone(),
    };
    let forward = ForwardServer::new(forward)
        .max_decoding_message_size(MAX_FRAME_BYTES)
        .max_encoding_message_size(MAX_FRAME_BYTES);
    let stop = stop_serving.clone();
    tasks.push(tokio::spawn(async move {
        let r = grpc_server()
            .add_service(forward)
            .serve_with_incoming_shutdown(incoming(listeners.forward), stop.cancelled_owned())
            .await;
        if let Err(e) = r {
            warn!(error = %e, "forward listener stopped");
        }
    }));

    let ready_hub = hub.clone();
    let admin = relay_common::admin::Admin::new(registry.clone()).with_ready(move || {
        let draining = ready_hub.is_draining();
        (
            !draining,
            serde_json::json!({ "draining": draining, "tunnels": ready_hub.tunnel_ids().len() }),
        )
    });
    tasks.push(tokio::spawn(relay_common::admin::serve(
        listeners.admin,
        admin,
        stop_serving.clone().cancelled_owned(),
    )));

    // Pressure hints: a short period so the agent's tick sees queued calls at once.
    let pressure_hub = hub.clone();
    let stop = stop_serving.clone();
    tasks.push(tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_millis(100));
        tick.set_missed_tick_behavior(MissedTickBehavior::Skip);
        loop {
            tokio::select! {
                biased;
                _ = stop.cancelled() => return,
                _ = tick.tick() => pressure_hub.send_pressure(),
            }
        }
    }));

    let forward_url = config
        .forward_url
        .clone()
        .unwrap_or_else(|| format!("http://{forward_addr}"));
    let intro = ServerIntro {
        server_id: server_id.clone(),
        zone: config.zone.clone(),
        forward_url,
        protocol_version: relay_proto::PROTOCOL_VERSION,
    };
    for d in &config.dispatchers {
        let reporter = report::Reporter {
            hub: hub.clone(),
            dispatcher: d.clone(),
            intro: intro.clone(),
            interval: config.report_interval,
            key: config.dispatcher_key.clone(),
            stop: stop_reports.clone(),
        };
        tasks.push(tokio::spawn(reporter.run()));
    }
    info!(%server_id, agent = %agent_addr, forward = %forward_addr, admin = %admin_addr, "tunnel server listening");
    Ok(TunnelServerHandle {
        server_id,
        agent_addr,
        forward_addr,
        admin_addr,
        registry,
        hub,
        grace: config.shutdown_grace,
        stop_reports,
        stop_serving,
        tasks,
        tracker,
    })
}

/// Accepted connections with Nagle off: `Server::tcp_nodelay` only applies to sockets
/// tonic binds itself, and a relayed call is many small frames.
fn incoming(
    listener: TcpListener,
) -> impl futures::Stream<Item = std::io::Result<tokio::net::TcpStream>> + Send + 'static {
    use futures::StreamExt;
    TcpListenerStream::new(listener).map(|conn| {
        if let Ok(c) = &conn {
            let _ = c.set_nodelay(true);
        }
        conn
    })
}

fn grpc_server() -> tonic::transport::Server {
    tonic::transport::Server::builder()
        .tcp_nodelay(true)
        .http2_keepalive_interval(Some(Duration::from_secs(20)))
        .http2_keepalive_timeout(Some(Duration::from_secs(10)))
        // An agent multiplexes up to `max_streams` tunnel streams on one connection.
        .max_concurrent_streams(Some(8192))
        .initial_stream_window_size(Some(256 * 1024))
        .initial_connection_window_size(Some(8 * 1024 * 1024))
}

impl TunnelServerHandle {
    pub fn hub(&self) -> &Arc<Hub> {
        &self.hub
    }

    /// Graceful stop: announce draining, send Drain to agents, let calls in flight finish
    /// within the grace period, then close every stream and stop serving.
    pub async fn shutdown(self) {
        info!(server_id = %self.server_id, "draining");
        self.hub
            .drain(self.grace.as_millis().min(u32::MAX as u128) as u32);
        let deadline = Instant::now() + self.grace;
        while self.hub.metrics.in_flight.get() > 0 && Instant::now() < deadline {
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

    /// Immediate stop, as a crash would: no drain, no goodbye.
    pub fn abort(self) {
        self.hub.close_all();
        for t in &self.tasks {
            t.abort();
        }
    }
}
