//! One tunnel stream: dial (`Tunnel.Connect` with the bearer token on a cached per-endpoint
//! channel), wait for the `ServerHello`, then serve calls one at a time while answering
//! pings, honouring Cancel and Drain, watching the heartbeat, and retiring with the
//! GoingAway handshake when the actor says so.
//!
//! The stream task reports to the sizing actor through `StreamLink` events and never
//! decides sizing itself. It never panics on peer input: a frame that breaks the protocol
//! closes this stream only, with a log line. The call itself (upstream request, response
//! frames, terminal frame) is `call.rs`.
//!
//! Heartbeat: the silence rule (no frame for three `heartbeat_ms` periods) applies while
//! the stream is idle. The server pings idle streams; a busy stream is bounded by its
//! call's deadline and by HTTP/2 keepalive on the connection instead, so a long download
//! is not cut for lack of pings.

use crate::call::{call_error, run_call, CallContext};
use crate::coverage::{CloseReason, Connector, Landing, StreamEvent, StreamLink};
use crate::error::OpenError;
use crate::metrics::{AgentMetrics, CallOutcome, OpenResult};
use crate::upstream::RequestBody;
use bytes::Bytes;
use futures::future::BoxFuture;
use parking_lot::Mutex;
use relay_common::config::ConfigError;
use relay_common::grpc::{GrpcClient, PeerAddr};
use relay_common::hosts::{Host, HostRule};
use relay_common::Secret;
use relay_proto::agent_frame::Kind as Out;
use relay_proto::server_frame::Kind as In;
use relay_proto::tunnel_client::TunnelClient;
use relay_proto::{
    AgentFrame, CallErrorKind, GoingAway, Pong, RequestHead, ServerFrame, ServerHello,
};
use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::time::{Instant, Sleep};
use tokio_stream::wrappers::ReceiverStream;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::transport::{Channel, Endpoint};
use tonic::Streaming;
use tracing::{debug, info, warn, Instrument};

/// Frames buffered towards tonic per stream; beyond this HTTP/2 flow control pushes back.
const OUTBOUND_FRAMES: usize = 4;
/// Request body chunks buffered towards the upstream per call.
const BODY_CHUNKS: usize = 4;
/// How long a retired, idle stream waits for the server to close it before closing itself.
const RETIRE_LINGER: Duration = Duration::from_secs(10);

/// The tunnel endpoints and credentials, with the cached connections (`Channel`s) of each
/// endpoint: streams to an endpoint multiplex on its HTTP/2 connections, at most
/// `[tunnel_h2] max_concurrent_streams` a connection, so that every stream's window fits
/// in its connection's (`relay_common::h2`, Isolation) and a call whose upload the
/// upstream stops reading holds its own window only; a stream that finds every connection
/// full gets a new one. Direct URLs that servers advertise (placement-aware growth) get
/// connections of their own, dialed with the same TLS, token and limits.
pub struct Dialer {
    endpoints: Vec<Endpoint>,
    auth: MetadataValue<Ascii>,
    /// How tunnel servers are dialed: TLS for `https://` endpoints (`[tls]`, `None` dials
    /// plain h2c), `connect_timeout` and the `[tunnel_h2]` limits.
    client: GrpcClient,
    /// `max_frame_bytes`: the largest message sent to or decoded from a tunnel server.
    max_frame_bytes: usize,
    /// Hosts a server's `direct_url` may name (`direct_hosts`, or the hosts of `tunnels`).
    direct_hosts: Vec<HostRule>,
    /// Per endpoint URI: its connections, in the order they were opened.
    channels: Mutex<HashMap<String, Vec<Conn>>>,
    next_generation: std::sync::atomic::AtomicU64,
    /// Streams per connection (`[tunnel_h2] max_concurrent_streams`).
    per_connection: usize,
    /// Random per dialer: with a connection's generation, the name the agent gives each
    /// connection (`relay-agent-conn`), which servers prove alive (`crate::liveness`).
    instance: u64,
    /// The request-body credit a call gives its server (`relay-agent-credit`):
    /// `relay_proto::body_credit` of `[tunnel_h2] stream_window_bytes`.
    request_credit: u32,
    /// How each endpoint's opens went, by index into `endpoints` (see [`Dialer::pick`]).
    health: Mutex<Vec<EndpointHealth>>,
}

/// One tunnel endpoint's recent opens: an endpoint whose opens fail (a dial or hello that
/// times out, a refused connection) or whose path went silent is left out of new opens for
/// a pause that doubles with each failure in a row (0.25 s to 2 s), so that while one of
/// several endpoints is unreachable the opens go to the others instead of each waiting out
/// `connect_timeout` on it. Once the pause is over, the next open goes there (one at a
/// time: the probe), so an endpoint that answers again is found within a pause and an open;
/// a landing there clears it.
#[derive(Clone, Copy, Debug, Default)]
struct EndpointHealth {
    failures: u32,
    down_until: Option<Instant>,
    /// An open went there as the probe since the last failure, and has not ended.
    probing: bool,
}

/// First pause of an endpoint whose open failed.
const ENDPOINT_PAUSE_FIRST: Duration = Duration::from_millis(250);
/// Longest pause.
const ENDPOINT_PAUSE_MAX: Duration = Duration::from_secs(2);

/// One cached connection of an endpoint.
struct Conn {
    generation: u64,
    channel: Channel,
    /// Its remote address, once dialed.
    peer: PeerAddr,
    /// Streams open on it (each a [`ConnSlot`]).
    streams: Arc<std::sync::atomic::AtomicUsize>,
}

/// A stream's place on its connection, given back when the stream ends (dropped).
pub struct ConnSlot(Arc<std::sync::atomic::AtomicUsize>);

impl Drop for ConnSlot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }
}

/// A connection picked for a new stream: the endpoint, its channel, which connection it is
/// (to evict it), its name for the servers, its remote address, and the stream's place on
/// it.
pub(crate) struct Picked {
    pub endpoint: String,
    pub channel: Channel,
    pub id: ChannelId,
    pub name: String,
    /// The remote address of the connection, once it is dialed.
    pub peer: PeerAddr,
    pub slot: ConnSlot,
}

/// Why a server's `direct_url` is not dialed.
#[derive(Debug)]
enum DirectRefusal {
    /// Its host is not one `direct_hosts` allows (counted in
    /// `relay_agent_direct_urls_refused_total`).
    Host(String),
    /// Its scheme does not match the agent's `[tls]`, or it is no URL tonic can dial.
    Other(String),
}

impl DirectRefusal {
    fn into_message(self) -> String {
        match self {
            DirectRefusal::Host(m) | DirectRefusal::Other(m) => m,
        }
    }
}

/// Which cached connection a stream was opened on, so a stream that finds it dead can
/// have it replaced.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChannelId {
    endpoint: String,
    generation: u64,
}

impl std::fmt::Debug for Dialer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let uris: Vec<String> = self.endpoints.iter().map(|e| e.uri().to_string()).collect();
        f.debug_struct("Dialer")
            .field("endpoints", &uris)
            .finish_non_exhaustive()
    }
}

impl Dialer {
    /// The largest gRPC message a stream sends or decodes (`max_frame_bytes`).
    pub fn with_max_frame_bytes(mut self, max: usize) -> Self {
        self.max_frame_bytes = max;
        self
    }

    /// The hosts a server's advertised `direct_url` may name (`Config::direct_host_rules`);
    /// without, no direct URL is dialed.
    pub fn with_direct_hosts(mut self, rules: Vec<HostRule>) -> Self {
        self.direct_hosts = rules;
        self
    }

    pub fn new(
        endpoints: &[String],
        token: &Secret,
        connect_timeout: Duration,
        h2: relay_common::h2::H2Limits,
        tls: Option<relay_common::tls::TlsClient>,
    ) -> Result<Self, ConfigError> {
        if endpoints.is_empty() {
            return Err(ConfigError::invalid(
                "tunnels",
                "at least one tunnel endpoint is required",
            ));
        }
        // Bounded receive windows (uploads from the server): enough for throughput, small
        // enough that buffered request bodies stay bounded across many streams. PINGs also
        // on idle connections, so a dead server is found before the next open needs it.
        let client = GrpcClient::new(h2, connect_timeout, tls).keepalive_while_idle();
        let endpoints = endpoints
            .iter()
            .map(|url| {
                client
                    .endpoint(url)
                    .map_err(|e| ConfigError::invalid("tunnels", format!("{url:?}: {e}")))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let n_endpoints = endpoints.len();
        let mut auth: MetadataValue<Ascii> = format!("Bearer {}", token.expose())
            .parse()
            .map_err(|_| ConfigError::invalid("token", "must be printable ASCII"))?;
        auth.set_sensitive(true);
        Ok(Dialer {
            endpoints,
            auth,
            client,
            max_frame_bytes: relay_proto::DEFAULT_MAX_FRAME_BYTES,
            direct_hosts: Vec::new(),
            channels: Mutex::new(HashMap::new()),
            next_generation: std::sync::atomic::AtomicU64::new(1),
            per_connection: h2.max_concurrent_streams.max(1) as usize,
            instance: rand::random(),
            request_credit: relay_proto::body_credit(h2.stream_window_bytes),
            health: Mutex::new(vec![EndpointHealth::default(); n_endpoints]),
        })
    }

    /// A connection to an endpoint: one whose pause after failed opens is over, as its
    /// probe, if one is due (see [`EndpointHealth`]); else a random one among those not
    /// paused; when every one is paused, the one whose pause ends first.
    pub(crate) fn pick(&self) -> Picked {
        let i = if self.endpoints.len() == 1 {
            0
        } else {
            let now = Instant::now();
            let mut health = self.health.lock();
            let over = |h: &EndpointHealth| h.down_until.is_none_or(|u| now >= u);
            let probe = (0..health.len())
                .find(|&i| health[i].failures > 0 && !health[i].probing && over(&health[i]));
            match probe {
                Some(i) => {
                    health[i].probing = true;
                    i
                }
                None => {
                    let up: Vec<usize> = (0..health.len())
                        .filter(|&i| health[i].failures == 0 && over(&health[i]))
                        .collect();
                    match up.len() {
                        0 => (0..health.len())
                            .min_by_key(|&i| health[i].down_until)
                            .unwrap_or(0),
                        n => up[rand::random::<usize>() % n],
                    }
                }
            }
        };
        let endpoint = self.endpoints[i].clone();
        self.channel(endpoint)
    }

    /// An open on `endpoint` (one of `tunnels`) failed to reach its server, or a path
    /// through it went silent: it is paused (see [`EndpointHealth`]). Returns whether
    /// another endpoint is not paused, so the open can go there instead.
    pub(crate) fn endpoint_failed(&self, endpoint: &str) -> bool {
        let Some(i) = self.endpoint_index(endpoint) else {
            return false;
        };
        let now = Instant::now();
        let mut health = self.health.lock();
        let h = &mut health[i];
        h.failures = h.failures.saturating_add(1);
        h.probing = false;
        let pause = ENDPOINT_PAUSE_FIRST
            .saturating_mul(1 << h.failures.saturating_sub(1).min(8))
            .min(ENDPOINT_PAUSE_MAX);
        h.down_until = Some(now + pause);
        if h.failures == 1 {
            warn!(%endpoint, pause_ms = pause.as_millis() as u64, "tunnel endpoint unreachable; opening streams through the others meanwhile");
        }
        health
            .iter()
            .enumerate()
            .any(|(j, h)| j != i && h.failures == 0)
    }

    /// A stream landed through `endpoint`: it is not paused any more.
    pub(crate) fn endpoint_ok(&self, endpoint: &str) {
        let Some(i) = self.endpoint_index(endpoint) else {
            return;
        };
        let mut health = self.health.lock();
        if health[i].failures > 0 {
            info!(%endpoint, "tunnel endpoint reachable again");
        }
        health[i] = EndpointHealth::default();
    }

    fn endpoint_index(&self, endpoint: &str) -> Option<usize> {
        self.endpoints.iter().position(|e| *e.uri() == *endpoint)
    }

    /// A channel straight to a server's advertised `direct_url`. Refused when its host is
    /// not one `direct_hosts` allows (a tunnel server or dispatcher must not steer the
    /// agent to hosts inside its network), and when its scheme does not match how the
    /// agent dials its tunnels: with `[tls]` the token only ever goes over TLS verified
    /// against the agent's trust.
    fn pick_direct(&self, url: &str) -> Result<Picked, DirectRefusal> {
        let shown = server_text(url);
        let host = Host::of_url(url)
            .ok_or_else(|| DirectRefusal::Host(format!("direct url {shown} names no host")))?;
        if !self.direct_hosts.iter().any(|r| r.allows(&host)) {
            return Err(DirectRefusal::Host(format!(
                "direct url {shown} names host {}, which direct_hosts does not allow (default: the hosts of tunnels); not dialed",
                server_text(&host.to_string())
            )));
        }
        let url = shown.as_str();
        let https = url.starts_with("https://");
        if https != self.client.is_tls() {
            return Err(DirectRefusal::Other(format!(
                "direct url {url} is {} but the agent dials its tunnels {}",
                if https { "https" } else { "plain http" },
                if self.client.is_tls() {
                    "with TLS"
                } else {
                    "without TLS"
                },
            )));
        }
        let e = self
            .client
            .endpoint(url)
            .map_err(|e| DirectRefusal::Other(format!("direct url {url}: {e}")))?;
        Ok(self.channel(e))
    }

    /// The first connection of `endpoint` with a stream free (connections after the first
    /// that carry nothing are closed on the way), or a new one when all are full.
    fn channel(&self, endpoint: Endpoint) -> Picked {
        use std::sync::atomic::Ordering::Relaxed;
        let key = endpoint.uri().to_string();
        let mut channels = self.channels.lock();
        let conns = channels.entry(key.clone()).or_default();
        let mut i = 1;
        while i < conns.len() {
            if conns[i].streams.load(Relaxed) == 0 {
                conns.remove(i);
            } else {
                i += 1;
            }
        }
        let free = conns
            .iter()
            .position(|c| c.streams.load(Relaxed) < self.per_connection);
        let conn = match free {
            Some(i) => &conns[i],
            None => {
                let peer = PeerAddr::default();
                conns.push(Conn {
                    generation: self.next_generation.fetch_add(1, Relaxed),
                    channel: self.client.lazy_observed(endpoint, peer.clone()),
                    peer,
                    streams: Arc::default(),
                });
                conns.last().expect("just pushed")
            }
        };
        // Only taken under the dialer's lock, so the check and the take are one step.
        conn.streams.fetch_add(1, Relaxed);
        Picked {
            endpoint: key.clone(),
            channel: conn.channel.clone(),
            name: format!("{:016x}-{}", self.instance, conn.generation),
            id: ChannelId {
                endpoint: key,
                generation: conn.generation,
            },
            peer: conn.peer.clone(),
            slot: ConnSlot(conn.streams.clone()),
        }
    }

    /// Forgets the cached connection `id`, so the next open to that endpoint dials a new
    /// connection. Used when a stream on it went silent (missed heartbeats) or an open on
    /// it got no hello: a connection that a NAT or load balancer dropped silently, or a
    /// frozen server, would otherwise take every new stream until HTTP/2 keepalive notices.
    /// Streams still on the old connection keep it until they end.
    pub fn evict(&self, id: ChannelId) {
        let mut channels = self.channels.lock();
        if let Some(conns) = channels.get_mut(&id.endpoint) {
            conns.retain(|c| c.generation != id.generation);
            if conns.is_empty() {
                channels.remove(&id.endpoint);
            }
        }
    }

    /// Connections cached for `endpoint` now (each carrying streams or dialing).
    pub fn connections(&self, endpoint: &str) -> usize {
        self.channels.lock().get(endpoint).map_or(0, Vec::len)
    }
}

/// What this agent lists in `relay_proto::AGENT_FEATURES` (`relay_proto::FEATURE_FLEET`,
/// `relay_proto::FEATURE_INLINE_BODY`).
const FEATURES: &str = "fleet,inline-body";

/// Everything a stream task needs, shared by all of them.
pub struct StreamContext {
    pub dialer: Dialer,
    /// Upstream client, accept policy, limits and deadlines for the calls.
    pub calls: Arc<CallContext>,
    pub metrics: AgentMetrics,
    /// Bound on dial + hello.
    pub connect_timeout: Duration,
    /// Turns to open a stream (`max_opening`): an open holds one from dial to hello.
    pub opens: Arc<tokio::sync::Semaphore>,
    /// The paths to servers that prove them alive (`crate::liveness`).
    pub paths: crate::liveness::Paths,
}

/// The real `Connector`: each open is a stream task running `run_stream`.
#[derive(Clone)]
pub struct TunnelConnector(pub Arc<StreamContext>);

impl Connector for TunnelConnector {
    fn open(&self, link: StreamLink) -> BoxFuture<'static, ()> {
        Box::pin(run_stream(self.0.clone(), link))
    }
}

/// One stream task, from dial to close. Reports `Landed` then `Closed`, or `OpenFailed`.
pub async fn run_stream(ctx: Arc<StreamContext>, link: StreamLink) {
    let span = tracing::info_span!("tunnel_stream", stream = link.id);
    async move {
        let mut link = link;
        // A retire signal during the open is not acted on until the hello: the server may
        // already count this stream as idle and hand it a call, so it retires with the
        // GoingAway handshake like any other (bounded by connect_timeout).
        // Wait for a turn (`max_opening`), so a big growth step goes out in waves.
        let turn = ctx.opens.clone().acquire_owned().await;
        // Through one of `tunnels` (not a server's direct URL): its health is tracked.
        let through = link.target.is_none();
        let picked = match &link.target {
            Some(url) => ctx.dialer.pick_direct(url).map_err(|refusal| {
                if let DirectRefusal::Host(_) = &refusal {
                    ctx.metrics.direct_urls_refused.inc();
                }
                OpenError::Other(refusal.into_message())
            }),
            None => Ok(ctx.dialer.pick()),
        };
        let Picked {
            endpoint,
            channel,
            id: channel_id,
            name: conn_name,
            peer,
            slot: _slot,
        } = match picked {
            Ok(p) => p,
            Err(e) => {
                drop(turn);
                return open_failed(&ctx, &link, e);
            }
        };
        let endpoint_key = endpoint.clone();
        let opened = tokio::time::timeout(
            ctx.connect_timeout,
            open(&ctx.dialer, endpoint, channel, Some(&conn_name)),
        )
        .await;
        drop(turn);
        // An open that did not reach a server pauses its endpoint; with another endpoint
        // open, that is no reason to hold back every open (`OpenError::Endpoint`).
        let unreached = |e: String| {
            if through && ctx.dialer.endpoint_failed(&endpoint_key) {
                OpenError::Endpoint(e)
            } else {
                OpenError::Other(e)
            }
        };
        let (out, inbound, hello) = match opened {
            Ok(Ok(x)) => x,
            Ok(Err(OpenError::Other(e))) => return open_failed(&ctx, &link, unreached(e)),
            Ok(Err(e)) => {
                // A server answered (refused the token, or at its cap): reachable.
                if through {
                    ctx.dialer.endpoint_ok(&endpoint_key);
                }
                return open_failed(&ctx, &link, e);
            }
            Err(_) => {
                // The connection may be dead without knowing it: dial afresh next time.
                ctx.dialer.evict(channel_id);
                let e = unreached("timed out waiting for the server hello".into());
                return open_failed(&ctx, &link, e);
            }
        };
        if through {
            ctx.dialer.endpoint_ok(&endpoint_key);
        }
        ctx.metrics.stream_opened(OpenResult::Landed);
        let landing = Landing {
            server_id: hello.server_id,
            instance_id: hello.instance_id,
            direct_url: hello.direct_url,
            zone: hello.zone,
            server_stream_id: hello.stream_id,
            heartbeat: Duration::from_millis(u64::from(hello.heartbeat_ms)),
            tunnel_id: hello.tunnel_id,
        };
        // A server that pings this connection for liveness: the stream joins its path.
        let path = (hello.liveness_ms > 0).then(|| {
            ctx.paths.join(
                channel_id.generation,
                &landing.server_id,
                &landing.instance_id,
                Duration::from_millis(u64::from(hello.liveness_ms)),
            )
        });
        debug!(server_id = %landing.server_id, server_stream = landing.server_stream_id, "landed");
        let credit = (hello.response_credit > 0).then_some(Credit {
            response: hello.response_credit,
            request: ctx.dialer.request_credit,
        });
        // The connection the hello came on: its remote address is what `$tunnel_peer`
        // stands for in the calls this stream serves.
        let tunnel_peer = peer.get().map(|a| a.ip());
        let session = Session::new(
            ctx.clone(),
            &link,
            out,
            inbound,
            Terms {
                heartbeat: landing.heartbeat,
                path,
                credit,
            },
            run_call,
        )
        .with_tunnel_peer(tunnel_peer);
        link.emit(StreamEvent::Landed(landing.clone()));
        let reason = session.run(&mut link).await;
        if matches!(reason, CloseReason::HeartbeatMissed | CloseReason::Silent) {
            ctx.dialer.evict(channel_id);
            if through {
                ctx.dialer.endpoint_failed(&endpoint_key);
            }
        }
        match &reason {
            CloseReason::Malformed(_) => {
                warn!(server_id = %landing.server_id, %reason, "closing tunnel stream")
            }
            CloseReason::ServerClosed | CloseReason::Retired => {
                debug!(server_id = %landing.server_id, %reason, "tunnel stream closed")
            }
            _ => info!(server_id = %landing.server_id, %reason, "tunnel stream closed"),
        }
        link.emit(StreamEvent::Closed(reason));
    }
    .instrument(span)
    .await
}

fn open_failed(ctx: &StreamContext, link: &StreamLink, e: OpenError) {
    let result = match e {
        OpenError::Unauthenticated(_) => OpenResult::Unauthenticated,
        OpenError::Exhausted(..) => OpenResult::Exhausted,
        OpenError::Other(_) | OpenError::Endpoint(_) => OpenResult::Error,
    };
    ctx.metrics.stream_opened(result);
    debug!(error = %e, "tunnel stream open failed");
    link.emit(StreamEvent::OpenFailed(e));
}

/// A tunnel server's words (a status message) as they may enter a log line, an error or
/// `relay-agent check`'s table: control characters (newlines, ANSI escapes) escaped and
/// cut to `MAX_PEER_MESSAGE` characters, so a server cannot forge log lines.
pub(crate) fn server_text(message: &str) -> String {
    relay_proto::escape_message(message, relay_proto::MAX_PEER_MESSAGE)
}

fn status_to_open_error(s: &tonic::Status) -> OpenError {
    let message = server_text(s.message());
    match s.code() {
        tonic::Code::Unauthenticated => OpenError::Unauthenticated(message),
        tonic::Code::ResourceExhausted => {
            let md = s.metadata();
            // Names that reach log lines and plans: only printable ones.
            let name = |k: &str| {
                md.get(k)
                    .and_then(|v| v.to_str().ok())
                    .filter(|v| relay_common::server_id::is_valid(v))
                    .map(str::to_string)
            };
            let refused = name("relay-server-id").map(|server_id| crate::error::Refused {
                server_id,
                instance_id: name("relay-instance-id").unwrap_or_default(),
                cap: md
                    .get("relay-max-streams")
                    .and_then(|v| v.to_str().ok())
                    .and_then(|c| c.parse().ok()),
            });
            OpenError::Exhausted(message, refused)
        }
        code => OpenError::Other(format!("{code:?}: {message}")),
    }
}

/// Opens `Tunnel.Connect` on `channel` with the dialer's token and waits for the hello.
/// Also used by `relay-agent check` (`crate::check`), which then retires the stream at once.
pub(crate) async fn open(
    dialer: &Dialer,
    endpoint: String,
    channel: Channel,
    conn_name: Option<&str>,
) -> Result<
    (
        mpsc::Sender<AgentFrame>,
        Streaming<ServerFrame>,
        ServerHello,
    ),
    OpenError,
> {
    let (tx, rx) = mpsc::channel(OUTBOUND_FRAMES);
    let mut request = tonic::Request::new(ReceiverStream::new(rx));
    request
        .metadata_mut()
        .insert("authorization", dialer.auth.clone());
    // Fleet news: this agent understands `Fleet` frames; and request heads that carry a
    // small body whole (`RequestHead.body`).
    request.metadata_mut().insert(
        relay_proto::AGENT_FEATURES,
        tonic::metadata::MetadataValue::from_static(FEATURES),
    );
    // The connection's name, so a server can prove it alive end to end (`crate::liveness`).
    if let Some(v) = conn_name.and_then(|n| MetadataValue::try_from(n).ok()) {
        request.metadata_mut().insert(relay_proto::AGENT_CONN, v);
    }
    // Body credit both ways (`ServerHello.response_credit`), with this request credit.
    request
        .metadata_mut()
        .insert(relay_proto::AGENT_CREDIT, dialer.request_credit.into());
    // A server's frame over the limit ends the stream before it is decoded: a hostile
    // server cannot make the agent allocate for a huge head.
    let response = TunnelClient::new(channel)
        .max_decoding_message_size(dialer.max_frame_bytes)
        .max_encoding_message_size(dialer.max_frame_bytes)
        .connect(request)
        .await
        .map_err(|s| {
            let e = status_to_open_error(&s);
            debug!(%endpoint, error = %e, "connect refused");
            e
        })?;
    let mut inbound = response.into_inner();
    match inbound.message().await {
        Ok(Some(ServerFrame {
            kind: Some(In::Hello(hello)),
        })) => {
            if hello.protocol_version != relay_proto::PROTOCOL_VERSION {
                return Err(OpenError::Other(format!(
                    "server speaks protocol version {}, this agent speaks {}",
                    hello.protocol_version,
                    relay_proto::PROTOCOL_VERSION
                )));
            }
            // The hello's names reach log lines and metric labels: only printable ones.
            let names = [
                ("server_id", &hello.server_id, false),
                ("zone", &hello.zone, true),
                ("instance_id", &hello.instance_id, true),
            ];
            for (field, value, may_be_empty) in names {
                let allowed =
                    relay_common::server_id::is_valid(value) || (may_be_empty && value.is_empty());
                if !allowed {
                    return Err(OpenError::Other(format!(
                        "ServerHello.{field} is not {}",
                        relay_common::server_id::RULE
                    )));
                }
            }
            Ok((tx, inbound, hello))
        }
        Ok(Some(_)) => Err(OpenError::Other(
            "first frame from the server was not a ServerHello".into(),
        )),
        Ok(None) => Err(OpenError::Other(
            "server ended the stream before its hello".into(),
        )),
        Err(s) => Err(status_to_open_error(&s)),
    }
}

/// The call in flight on a stream.
struct ActiveCall {
    id: u64,
    /// Feeds the upstream request body; `None` once the body ended or is no longer read.
    body: Option<mpsc::Sender<Bytes>>,
    started: Instant,
    /// The response-body credit the server gave the call (with body credit).
    credit: Option<Arc<tokio::sync::Semaphore>>,
}

/// What a stream's hello agreed: the server's heartbeat (zero: none announced), the
/// stream's place on its path when the server proves paths alive, and body credit.
struct Terms {
    heartbeat: Duration,
    path: Option<crate::liveness::PathSlot>,
    credit: Option<Credit>,
}

/// Body credit both ways on a stream that uses it (`ServerHello.response_credit`).
#[derive(Clone, Copy, Debug)]
struct Credit {
    /// Response-body bytes a call may send beyond what the server gave back.
    response: u32,
    /// Request-body bytes the server may send a call beyond what this agent gave back.
    request: u32,
}

/// How a stream starts a call (`run_call`; named here so the session can keep the call's
/// future in a slot of its own type).
type StartCall<F> = fn(
    Arc<CallContext>,
    RequestHead,
    RequestBody,
    Option<std::net::IpAddr>,
    crate::call::CallOut,
) -> F;

/// The future of the call in flight, in one allocation the stream keeps from its first call
/// to its end. A call's future is about 2.6 KiB: boxing each one was an allocation past
/// glibc's per-thread cache (with a consolidation of its free lists) and a free per call.
struct CallFutureBox<F>(Option<Pin<Box<Option<F>>>>);

impl<F: Future<Output = CallOutcome>> CallFutureBox<F> {
    fn is_none(&self) -> bool {
        self.0.as_ref().is_none_or(|f| f.is_none())
    }

    fn start(&mut self, call: F) {
        match &mut self.0 {
            Some(slot) => slot.set(Some(call)),
            None => self.0 = Some(Box::pin(Some(call))),
        }
    }

    /// Drops the call's future (and with it the upstream request); the slot stays.
    fn clear(&mut self) {
        if let Some(slot) = &mut self.0 {
            slot.set(None);
        }
    }

    /// The call's outcome; pends forever while no call is in flight.
    async fn outcome(&mut self) -> CallOutcome {
        match self.0.as_mut().and_then(|slot| slot.as_mut().as_pin_mut()) {
            Some(call) => call.await,
            None => std::future::pending().await,
        }
    }
}

/// A landed stream serving calls.
struct Session<F> {
    ctx: Arc<StreamContext>,
    out: mpsc::Sender<AgentFrame>,
    inbound: Streaming<ServerFrame>,
    /// Silence after which an idle stream counts as dead (`None`: no heartbeat announced).
    silence: Option<Duration>,
    /// The stream's place on its path, when the server proves paths alive.
    path: Option<crate::liveness::PathSlot>,
    dead: Pin<Box<Sleep>>,
    linger: Pin<Box<Sleep>>,
    call: Option<ActiveCall>,
    start_call: StartCall<F>,
    call_fut: CallFutureBox<F>,
    /// The remote address of this stream's connection, handed to its calls.
    tunnel_peer: Option<std::net::IpAddr>,
    /// Request body chunks (and their end flags) waiting for room in the body channel.
    /// Without body credit at most one waits, and while it does no further frame is read:
    /// the server is pushed back by flow control. With body credit every frame is read (a
    /// server's credit frame must never wait behind a body the upstream reads slowly), and
    /// the server sends no more than the credit this agent gave back.
    pending: std::collections::VecDeque<(Bytes, bool)>,
    /// Body credit on this stream, if the server offered it.
    credit: Option<Credit>,
    /// Request-body bytes of the call in flight received and not yet given back.
    request_unacked: u32,
    /// Of those, bytes handed to the upstream and not yet given back.
    request_passed: u32,
    last_ended: Option<u64>,
    retire_seen: bool,
    going_away_sent: bool,
    draining: bool,
    events: mpsc::UnboundedSender<(crate::coverage::plan::StreamId, StreamEvent)>,
}

impl<F: Future<Output = CallOutcome>> Session<F> {
    fn new(
        ctx: Arc<StreamContext>,
        link: &StreamLink,
        out: mpsc::Sender<AgentFrame>,
        inbound: Streaming<ServerFrame>,
        terms: Terms,
        start_call: StartCall<F>,
    ) -> Self {
        let Terms {
            heartbeat,
            path,
            credit,
        } = terms;
        let silence = (!heartbeat.is_zero()).then(|| heartbeat.saturating_mul(3));
        let far = Instant::now() + Duration::from_secs(86_400 * 365);
        let dead_at = silence.map_or(far, |s| Instant::now() + s);
        Session {
            ctx,
            out,
            inbound,
            silence,
            path,
            dead: Box::pin(tokio::time::sleep_until(dead_at)),
            linger: Box::pin(tokio::time::sleep_until(far)),
            call: None,
            start_call,
            call_fut: CallFutureBox(None),
            tunnel_peer: None,
            pending: Default::default(),
            credit,
            request_unacked: 0,
            request_passed: 0,
            last_ended: None,
            retire_seen: false,
            going_away_sent: false,
            draining: false,
            events: link.events_sender(),
        }
    }

    fn with_tunnel_peer(mut self, peer: Option<std::net::IpAddr>) -> Self {
        self.tunnel_peer = peer;
        self
    }

    fn emit(&self, id: crate::coverage::plan::StreamId, ev: StreamEvent) {
        let _ = self.events.send((id, ev));
    }

    async fn run(mut self, link: &mut StreamLink) -> CloseReason {
        let id = link.id;
        // Made once, not per frame (a wait made anew registers a waiter for every frame).
        let silenced = self
            .path
            .as_ref()
            .map(|slot| slot.path().token())
            .unwrap_or_default()
            .cancelled_owned();
        tokio::pin!(silenced);
        loop {
            let idle = self.call_fut.is_none();
            if let Some(slot) = self.path.as_mut() {
                slot.set_idle(idle);
            }
            let step = tokio::select! {
                // The call finishing comes first: its terminal frame is queued and the
                // stream is free again. Then the actor's retire signal, then request body
                // room, then the server's frames, then the timers.
                biased;
                outcome = self.call_fut.outcome() => self.call_done(id, outcome).await,
                _ = &mut link.retire, if !self.retire_seen => {
                    self.retire_seen = true;
                    self.going_away().await
                }
                delivered = feed_body(self.call.as_ref(), &mut self.pending) => {
                    self.body_room(delivered).await
                }
                frame = self.inbound.message(), if self.credit.is_some() || self.pending.is_empty() => self.on_frame(id, frame).await,
                // The path to the server went silent (`crate::liveness`): every stream on it
                // ends, like the streams of a broken connection.
                _ = &mut silenced => Err(CloseReason::Silent),
                _ = &mut self.dead, if idle && self.silence.is_some() => Err(CloseReason::HeartbeatMissed),
                _ = &mut self.linger, if idle && self.going_away_sent => Err(CloseReason::Retired),
            };
            if let Err(reason) = step {
                if let Some(call) = self.call.take() {
                    self.call_fut.clear();
                    self.ctx.metrics.call_ended(
                        CallOutcome::StreamLost,
                        call.started.elapsed().as_secs_f64(),
                    );
                    self.emit(id, StreamEvent::CallEnded(None));
                }
                return reason;
            }
        }
    }

    async fn send(&mut self, frame: AgentFrame) -> Result<(), CloseReason> {
        self.out.send(frame).await.map_err(|_| CloseReason::Lost)
    }

    /// Sends GoingAway once; the server closes the stream when no call is in flight.
    async fn going_away(&mut self) -> Result<(), CloseReason> {
        if self.going_away_sent {
            return Ok(());
        }
        self.going_away_sent = true;
        if self.call_fut.is_none() {
            self.linger.as_mut().reset(Instant::now() + RETIRE_LINGER);
        }
        self.send(AgentFrame::of(Out::GoingAway(GoingAway {})))
            .await
    }

    async fn call_done(&mut self, id: u64, outcome: CallOutcome) -> Result<(), CloseReason> {
        self.call_fut.clear();
        self.clear_body();
        let mut took = None;
        if let Some(call) = self.call.take() {
            let elapsed = call.started.elapsed();
            self.ctx.metrics.call_ended(outcome, elapsed.as_secs_f64());
            self.last_ended = Some(call.id);
            took = (outcome == CallOutcome::Ok).then_some(elapsed);
        }
        self.emit(id, StreamEvent::CallEnded(took));
        if outcome == CallOutcome::StreamLost {
            return Err(CloseReason::Lost);
        }
        self.idle_again();
        Ok(())
    }

    fn idle_again(&mut self) {
        let now = Instant::now();
        if let Some(s) = self.silence {
            self.dead.as_mut().reset(now + s);
        }
        if self.going_away_sent {
            self.linger.as_mut().reset(now + RETIRE_LINGER);
        }
    }

    /// The oldest pending chunk (`Some((len, end))`) went to the upstream, or the upstream
    /// stopped reading the body (`None`: it answered already, or failed).
    async fn body_room(&mut self, delivered: Option<(usize, bool)>) -> Result<(), CloseReason> {
        match delivered {
            Some((len, end)) => {
                if end {
                    if let Some(call) = self.call.as_mut() {
                        call.body = None;
                    }
                }
                self.passed_upstream(len).await
            }
            None => {
                if let Some(call) = self.call.as_mut() {
                    call.body = None;
                }
                self.pending.clear();
                Ok(())
            }
        }
    }

    /// Forgets the request body of the call that ended.
    fn clear_body(&mut self) {
        self.pending.clear();
        self.request_unacked = 0;
        self.request_passed = 0;
    }

    /// With body credit: `len` request-body bytes went to the upstream; once a step's worth
    /// did, they are given back to the server.
    async fn passed_upstream(&mut self, len: usize) -> Result<(), CloseReason> {
        if self.credit.is_none() {
            return Ok(());
        }
        let Some(call_id) = self.call.as_ref().map(|c| c.id) else {
            return Ok(());
        };
        self.request_passed = self.request_passed.saturating_add(len as u32);
        if (self.request_passed as usize) < relay_proto::CREDIT_STEP {
            return Ok(());
        }
        let bytes = std::mem::take(&mut self.request_passed);
        self.request_unacked = self.request_unacked.saturating_sub(bytes);
        self.send(AgentFrame::of(Out::Credit(relay_proto::Credit {
            call_id,
            bytes,
        })))
        .await
    }

    async fn on_frame(
        &mut self,
        id: u64,
        frame: Result<Option<ServerFrame>, tonic::Status>,
    ) -> Result<(), CloseReason> {
        let frame = match frame {
            Ok(Some(f)) => f,
            Ok(None) => return Err(CloseReason::ServerClosed),
            Err(s) => {
                return Err(CloseReason::Status(format!(
                    "{:?}: {}",
                    s.code(),
                    server_text(s.message())
                )))
            }
        };
        if let Some(slot) = &self.path {
            slot.path().seen();
        }
        if let Some(s) = self.silence {
            self.dead.as_mut().reset(Instant::now() + s);
        }
        let Some(kind) = frame.kind else {
            // A frame kind this agent does not know (a newer server): skip it. Frames that
            // matter to a call are all known kinds, so nothing of a call is lost.
            debug!("skipping a server frame of an unknown kind");
            return Ok(());
        };
        match kind {
            In::Hello(_) => return Err(CloseReason::Malformed("second ServerHello".into())),
            In::RequestHead(head) => {
                if let Some(call) = &self.call {
                    return Err(CloseReason::Malformed(format!(
                        "RequestHead for call {} while call {} is in flight",
                        head.call_id, call.id
                    )));
                }
                if !head.body.is_empty() && !head.end_of_stream {
                    return Err(CloseReason::Malformed(format!(
                        "RequestHead for call {} carries a body but not its end",
                        head.call_id
                    )));
                }
                if head.body.len() > relay_proto::MAX_CHUNK {
                    return Err(CloseReason::Malformed(format!(
                        "RequestHead for call {} carries a body of {} bytes, over {}",
                        head.call_id,
                        head.body.len(),
                        relay_proto::MAX_CHUNK
                    )));
                }
                // A head that crossed our GoingAway on the wire is still served.
                debug!(call_id = head.call_id, method = ?head.method, "call started");
                let (body_tx, body) = if !head.body.is_empty() {
                    // The head keeps it too: the accept filter checks it against the head.
                    (None, RequestBody::Whole(head.body.clone()))
                } else if head.end_of_stream {
                    (None, RequestBody::None)
                } else {
                    let (tx, rx) = mpsc::channel(BODY_CHUNKS);
                    (Some(tx), RequestBody::Streamed(rx))
                };
                self.ctx.metrics.calls_received.inc();
                let credit = self
                    .credit
                    .map(|c| Arc::new(tokio::sync::Semaphore::new(c.response as usize)));
                self.clear_body();
                // A body inside the head counts against the request credit like any other,
                // and goes to the upstream with the head.
                self.request_unacked = head.body.len() as u32;
                self.call = Some(ActiveCall {
                    id: head.call_id,
                    body: body_tx,
                    started: Instant::now(),
                    credit: credit.clone(),
                });
                self.emit(id, StreamEvent::CallStarted);
                let call_out = crate::call::CallOut {
                    tx: self.out.clone(),
                    credit,
                };
                self.call_fut.start((self.start_call)(
                    self.ctx.calls.clone(),
                    head,
                    body,
                    self.tunnel_peer,
                    call_out,
                ));
            }
            In::RequestBody(chunk) if chunk.data.len() > relay_proto::MAX_CHUNK => {
                return Err(CloseReason::Malformed(format!(
                    "request body chunk of {} bytes, over {}",
                    chunk.data.len(),
                    relay_proto::MAX_CHUNK
                )))
            }
            In::RequestBody(chunk) => match self.call.as_mut() {
                Some(call) if call.id == chunk.call_id => {
                    let Some(tx) = &call.body else { return Ok(()) };
                    let data = chunk.data;
                    let len = data.len();
                    if let Some(c) = self.credit {
                        // The server sends no more than the credit it was given back.
                        let after = self.request_unacked.saturating_add(len as u32);
                        if !chunk.end && after > c.request {
                            return Err(CloseReason::Malformed(format!(
                                "request body of call {} beyond the agent's credit ({} bytes)",
                                chunk.call_id, c.request
                            )));
                        }
                        self.request_unacked = after;
                    }
                    if !self.pending.is_empty() {
                        // Behind the chunks already waiting, in order.
                        self.pending.push_back((data, chunk.end));
                        return Ok(());
                    }
                    if !data.is_empty() {
                        match tx.try_send(data) {
                            Ok(()) => {}
                            Err(mpsc::error::TrySendError::Full(data)) => {
                                self.pending.push_back((data, chunk.end));
                                return Ok(());
                            }
                            Err(mpsc::error::TrySendError::Closed(_)) => {
                                call.body = None;
                                return Ok(());
                            }
                        }
                    }
                    if chunk.end {
                        call.body = None;
                    }
                    self.passed_upstream(len).await?;
                }
                // The call ended before its body did (the upstream answered early): drop.
                _ if self.last_ended == Some(chunk.call_id) => {}
                _ => {
                    return Err(CloseReason::Malformed(format!(
                        "request body for call {}, which is not the call in flight",
                        chunk.call_id
                    )))
                }
            },
            In::Credit(c) => {
                if let (Some(call), Some(limit)) = (&self.call, self.credit.map(|c| c.response)) {
                    if let (true, Some(sem)) = (call.id == c.call_id, &call.credit) {
                        // More than the server could owe is capped.
                        let room = (limit as usize).saturating_sub(sem.available_permits());
                        let add = (c.bytes as usize).min(room);
                        if add > 0 {
                            sem.add_permits(add);
                        }
                    }
                }
            }
            In::Cancel(cancel) => {
                if self.call.as_ref().is_some_and(|c| c.id == cancel.call_id) {
                    // Dropping the call future drops the upstream request.
                    self.call_fut.clear();
                    self.clear_body();
                    if let Some(call) = self.call.take() {
                        self.ctx.metrics.call_ended(
                            CallOutcome::Cancelled,
                            call.started.elapsed().as_secs_f64(),
                        );
                        self.last_ended = Some(call.id);
                    }
                    debug!(call_id = cancel.call_id, "call cancelled by the server");
                    self.emit(id, StreamEvent::CallEnded(None));
                    self.send(call_error(
                        cancel.call_id,
                        CallErrorKind::Cancelled,
                        "cancelled by the caller",
                    ))
                    .await?;
                    self.idle_again();
                }
            }
            In::Ping(ping) => {
                self.send(AgentFrame::of(Out::Pong(Pong { seq: ping.seq })))
                    .await?
            }
            In::Drain(_) => {
                // The sizing actor decides when this stream goes (make before break:
                // once another server is covered); until then it keeps serving.
                if !self.draining {
                    self.draining = true;
                    self.emit(id, StreamEvent::Drained);
                }
            }
            In::Pressure(p) => self.emit(id, StreamEvent::Pressure(p.queued)),
            In::Fleet(fleet) => {
                // Members reach plans and log lines by their names: only printable ones.
                let members = fleet
                    .members
                    .into_iter()
                    .filter(|m| {
                        relay_common::server_id::is_valid(&m.server_id)
                            && (m.instance_id.is_empty()
                                || relay_common::server_id::is_valid(&m.instance_id))
                    })
                    .collect();
                self.emit(id, StreamEvent::Fleet(members))
            }
        }
        Ok(())
    }
}

/// Waits for room in the body channel and hands it the oldest pending chunk: `Some((len,
/// end))` once delivered, `None` if the upstream stopped reading. Pends forever when nothing
/// waits. The chunk is taken only together with the room, so losing the race to another
/// branch of the stream's `select!` loses no data.
async fn feed_body(
    call: Option<&ActiveCall>,
    pending: &mut std::collections::VecDeque<(Bytes, bool)>,
) -> Option<(usize, bool)> {
    if pending.is_empty() {
        return std::future::pending().await;
    }
    let tx = call.and_then(|c| c.body.as_ref())?;
    let permit = tx.reserve().await.ok()?;
    let (data, end) = pending.pop_front()?;
    let len = data.len();
    if !data.is_empty() {
        permit.send(data);
    }
    Some((len, end))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dialer(urls: &[&str]) -> Dialer {
        let urls: Vec<String> = urls.iter().map(|u| u.to_string()).collect();
        Dialer::new(
            &urls,
            &Secret::new("t"),
            Duration::from_secs(1),
            relay_common::h2::H2Limits::TUNNEL,
            None,
        )
        .unwrap()
    }

    fn picks(d: &Dialer, n: usize) -> std::collections::BTreeSet<String> {
        (0..n).map(|_| d.pick().endpoint).collect()
    }

    #[tokio::test(start_paused = true)]
    async fn an_unreachable_endpoint_is_left_out_of_opens_for_a_growing_pause() {
        let (a, b) = ("http://127.0.0.1:1/", "http://127.0.0.1:2/");
        let d = dialer(&[a, b]);
        assert_eq!(picks(&d, 50).len(), 2, "both endpoints take opens");
        assert!(d.endpoint_failed(a), "the other endpoint is open");
        assert_eq!(picks(&d, 50), [b.to_string()].into(), "paused 250 ms");
        tokio::time::advance(ENDPOINT_PAUSE_FIRST).await;
        assert!(picks(&d, 50).contains(a), "tried again after its pause");
        assert!(d.endpoint_failed(a));
        tokio::time::advance(ENDPOINT_PAUSE_FIRST).await;
        assert_eq!(
            picks(&d, 50),
            [b.to_string()].into(),
            "a second failure: 500 ms"
        );
        tokio::time::advance(ENDPOINT_PAUSE_FIRST).await;
        d.endpoint_ok(a);
        assert_eq!(picks(&d, 50).len(), 2, "a landing clears the pause");
    }

    #[tokio::test(start_paused = true)]
    async fn with_every_endpoint_paused_the_one_paused_first_ends_first() {
        let (a, b) = ("http://127.0.0.1:1/", "http://127.0.0.1:2/");
        let d = dialer(&[a, b]);
        assert!(d.endpoint_failed(b));
        tokio::time::advance(Duration::from_millis(10)).await;
        assert!(!d.endpoint_failed(a), "no endpoint is open");
        assert_eq!(picks(&d, 20), [b.to_string()].into());
        // One endpoint alone is never paused away.
        let single = dialer(&[a]);
        assert!(!single.endpoint_failed(a));
        assert_eq!(picks(&single, 5), [a.to_string()].into());
    }

    #[test]
    fn the_agent_lists_the_features_it_reads() {
        let listed: Vec<&str> = relay_proto::features(super::FEATURES).collect();
        assert_eq!(
            listed,
            [relay_proto::FEATURE_FLEET, relay_proto::FEATURE_INLINE_BODY]
        );
    }
}
