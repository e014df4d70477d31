//! Dialing: the tunnel endpoints and their cached HTTP/2 connections (`Dialer`), the pause
//! of an endpoint that failed, and the direct URLs servers advertise.

use super::*;

/// The tunnel endpoints and credentials, with the cached connections (`Channel`s) of each
/// endpoint: streams to an endpoint multiplex on its HTTP/2 connections, at most
/// `[tunnel_h2] max_concurrent_streams` a connection, so that every stream's window fits
/// in its connection's (`relay_common::h2`, Isolation) and a call whose upload the
/// upstream stops reading holds its own window only; a stream that finds every connection
/// full gets a new one. Direct URLs that servers advertise (placement-aware growth) get
/// connections of their own, dialed with the same TLS, token and limits.
pub struct Dialer {
    endpoints: Vec<Endpoint>,
    pub(super) auth: MetadataValue<Ascii>,
    /// How tunnel servers are dialed: TLS for `https://` endpoints (`[tls]`, `None` dials
    /// plain h2c), `connect_timeout` and the `[tunnel_h2]` limits.
    client: GrpcClient,
    /// `max_frame_bytes`: the largest message sent to or decoded from a tunnel server.
    pub(super) max_frame_bytes: usize,
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
    pub(super) request_credit: u32,
    /// How each endpoint's opens went, by index into `endpoints` (see [`Dialer::pick`]).
    health: Mutex<Vec<EndpointHealth>>,
    /// What [`Conn::landed`] counts from.
    epoch: Instant,
}

/// One tunnel endpoint's recent opens: an endpoint whose opens fail (a dial or hello that
/// times out, a refused connection) or whose path went silent is left out of new opens for
/// a pause that doubles with each failure in a row (0.25 s to 2 s), so that while one of
/// several endpoints is unreachable the opens go to the others instead of each waiting out
/// `connect_timeout` on it. Once the pause is over, the next open goes there (one at a
/// time: the probe), so an endpoint that answers again is found within a pause and an open;
/// a landing there clears it.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct EndpointHealth {
    failures: u32,
    down_until: Option<Instant>,
    /// An open went there as the probe since the last failure, and has not ended.
    probing: bool,
}

/// First pause of an endpoint whose open failed.
pub(super) const ENDPOINT_PAUSE_FIRST: Duration = Duration::from_millis(250);
/// Longest pause.
pub(super) const ENDPOINT_PAUSE_MAX: Duration = Duration::from_secs(2);

/// One cached connection of an endpoint.
pub(super) struct Conn {
    generation: u64,
    channel: Channel,
    /// Its remote address, once dialed.
    peer: PeerAddr,
    /// Streams open on it (each a [`ConnSlot`]).
    streams: Arc<std::sync::atomic::AtomicUsize>,
    /// When a stream last landed on it: milliseconds since the dialer's epoch, plus one
    /// (0: none yet). Says whether a hello that timed out on it was slow or lost.
    landed: Arc<std::sync::atomic::AtomicU64>,
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
    /// The connection's last landing ([`Dialer::landed`], [`Dialer::landed_since`]).
    pub landed: Arc<std::sync::atomic::AtomicU64>,
}

/// Why a server's `direct_url` is not dialed.
#[derive(Debug)]
pub(super) enum DirectRefusal {
    /// Its host is not one `direct_hosts` allows (counted in
    /// `relay_agent_direct_urls_refused_total`).
    Host(String),
    /// Its scheme does not match the agent's `[tls]`, or it is no URL tonic can dial.
    Other(String),
}

impl DirectRefusal {
    pub(super) fn into_message(self) -> String {
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
    pub(super) generation: u64,
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
            epoch: Instant::now(),
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

    pub(super) fn endpoint_index(&self, endpoint: &str) -> Option<usize> {
        self.endpoints.iter().position(|e| *e.uri() == *endpoint)
    }

    /// A channel straight to a server's advertised `direct_url`. Refused when its host is
    /// not one `direct_hosts` allows (a tunnel server or dispatcher must not steer the
    /// agent to hosts inside its network), and when its scheme does not match how the
    /// agent dials its tunnels: with `[tls]` the token only ever goes over TLS verified
    /// against the agent's trust.
    pub(super) fn pick_direct(&self, url: &str) -> Result<Picked, DirectRefusal> {
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
    pub(super) fn channel(&self, endpoint: Endpoint) -> Picked {
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
                    landed: Arc::default(),
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
            landed: conn.landed.clone(),
        }
    }

    /// A stream landed on the connection whose mark `landed` is.
    pub(crate) fn landed(&self, landed: &std::sync::atomic::AtomicU64) {
        let ms = self.epoch.elapsed().as_millis() as u64;
        landed.fetch_max(ms + 1, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether a stream landed on that connection at or after `since`: the connection
    /// carries hellos, so an open on it that got none in time met busy servers, not a dead
    /// path.
    pub(crate) fn landed_since(
        &self,
        landed: &std::sync::atomic::AtomicU64,
        since: Instant,
    ) -> bool {
        let at = landed.load(std::sync::atomic::Ordering::Relaxed);
        let since_ms = since.saturating_duration_since(self.epoch).as_millis() as u64;
        at > since_ms
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
