//! The dispatcher's typed configuration: TOML with `deny_unknown_fields`, every default
//! written once in `Default`, validated once at start by [`Config::validate`].
//!
//! This module only describes and checks settings; it must not open sockets or read files
//! (loading goes through `relay_common::config`).

use relay_common::config::ConfigError;
use relay_common::h2::{H2Limits, H2Settings};
use relay_common::tls::{ClientCerts, ClientTls, DialerTls, ListenerTls, ServerTls};
use relay_common::{KeyDigest, Secret};
use relay_proto::HeadLimits;
use serde::Deserialize;
use std::net::SocketAddr;
use std::time::Duration;

/// Dispatcher settings.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// HTTP front (HTTP/1.1 and h2c) that backends call: `ANY /relay/{tunnel_id}/{path}`.
    pub listen: SocketAddr,
    /// gRPC listener where tunnel servers open their `Registry.Report` streams.
    pub registry_listen: SocketAddr,
    /// Admin listener: `/metrics`, `/healthz`, `/readyz`, `/debug/routes`.
    pub admin_listen: SocketAddr,
    /// Worker threads of the process's runtime; unset: one per core (or
    /// `TOKIO_WORKER_THREADS`). Fewer than cores suits a machine shared with other busy
    /// processes (see `relay_common::runtime`).
    pub worker_threads: Option<usize>,
    /// Time a call may take until its response head when the caller names none.
    #[serde(with = "humantime_serde")]
    pub call_timeout: Duration,
    /// Upper bound for a caller's `x-relay-timeout-ms`; larger requests are clamped to it.
    #[serde(with = "humantime_serde")]
    pub max_call_timeout: Duration,
    /// On shutdown, how long calls in flight may run on before they are cut.
    #[serde(with = "humantime_serde")]
    pub shutdown_grace: Duration,
    /// Largest request head (request line plus headers) accepted; bigger ones get 431.
    pub max_header_bytes: usize,
    /// Largest request body of one call, in bytes; unset: no bound. A declared
    /// Content-Length above it gets 413 `body_too_large` before anything is forwarded; a
    /// streamed body that passes it is cut (413 if no response head went out yet).
    pub max_request_body_bytes: Option<u64>,
    /// Largest gRPC message on the registry listener and on `Forward.Call` to tunnel
    /// servers; a bigger frame ends that call or stream with RESOURCE_EXHAUSTED.
    pub max_frame_bytes: usize,
    /// Most headers a response head from a tunnel server may carry; a head with more is
    /// answered with 502 `bad_response` instead of being passed on.
    pub max_response_headers: usize,
    /// Largest response head from a tunnel server, counted as every header's name and
    /// value plus 4 bytes; a bigger one gets 502 `bad_response`.
    pub max_response_header_bytes: usize,
    /// Longest silence between two body frames of a response whose head went out; past it
    /// the body is cut (HTTP/1: the connection closes; h2: RST_STREAM) and the call counts
    /// as `body_idle_timeout`. The call's deadline bounds the whole response as well.
    #[serde(with = "humantime_serde")]
    pub body_idle_timeout: Duration,
    /// How long a carrier to a tunnel server (`Forward.Carry`, which calls reuse) may stay
    /// idle before it is closed.
    #[serde(with = "humantime_serde")]
    pub carrier_idle_timeout: Duration,
    /// `[tls]`: TLS of the HTTP front (ALPN h2 and http/1.1; `client_ca` for client
    /// certificates), or `insecure = true` for plain HTTP/1.1 and h2c.
    pub tls: ListenerTls,
    /// `[registry_tls]`: TLS of the registry listener; mutual TLS (`client_ca` required:
    /// only tunnel servers with a certificate from it may report), or `insecure = true`.
    pub registry_tls: ListenerTls,
    /// `[forward_tls]`: how `Forward.Call` dials tunnel servers' `https://` forward URLs
    /// (`ca`, plus `cert` and `key`: tunnel servers' forward listeners use mutual TLS), or
    /// `insecure = true` for `http://` forward URLs.
    pub forward_tls: DialerTls,
    /// How often certificate files are checked for changes (SIGHUP reloads at once).
    #[serde(with = "humantime_serde")]
    pub reload_interval: Duration,
    /// Backends allowed to call, each with its own key (`Authorization: Bearer <key>`).
    pub callers: Vec<CallerConfig>,
    /// How calls are routed among the tunnel servers holding a tunnel id.
    pub routing: RoutingConfig,
    /// Where the routing table lives and who may feed it.
    pub registry: RegistryConfig,
    /// `[front_h2]`: HTTP/2 limits of callers' connections to the front (see
    /// `relay_common::h2`; defaults `H2Limits::FRONT`).
    pub front_h2: H2Settings,
    /// `[forward_h2]`: HTTP/2 limits of the connections to tunnel servers (`Forward.Call`;
    /// defaults `H2Limits::FORWARD`).
    pub forward_h2: H2Settings,
    /// `[registry_h2]`: HTTP/2 limits of the registry listener (defaults
    /// `H2Limits::REGISTRY`).
    pub registry_h2: H2Settings,
    /// `[front_limits]`: what the HTTP front spends on a connection beyond its calls.
    pub front_limits: FrontLimits,
}

/// `[front_limits]`: the HTTP front's connection limits (see `relay_common::listen`).
/// Callers authenticate per request, so there is no time-to-authenticate or failure
/// budget here; the rest are the listener limits of every relay listener.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FrontLimits {
    /// Connections open at once; one more is closed at accept.
    pub max_connections: usize,
    /// Connections open at once from one source (IPv4 address, IPv6 /64); 0: no cap.
    pub max_connections_per_source: usize,
    /// TLS handshakes the front works on at once; more wait their turn.
    pub max_handshakes: usize,
    /// Longest from accept to a finished TLS handshake.
    #[serde(with = "humantime_serde")]
    pub handshake_timeout: Duration,
    /// Longest from the handshake (plain: the accept) to the bytes that tell HTTP/1 from
    /// HTTP/2; also bounds the PROXY header. 0: no bound.
    #[serde(with = "humantime_serde")]
    pub first_byte_timeout: Duration,
    /// A connection with no call in flight this long is closed (HTTP/2: GOAWAY); 0: never.
    #[serde(with = "humantime_serde")]
    pub idle_timeout: Duration,
    /// Load balancer addresses or ranges that put a PROXY protocol header (v1 or v2)
    /// before each connection.
    pub proxy_protocol: Vec<relay_common::listen::SourceNet>,
}

impl Default for FrontLimits {
    fn default() -> Self {
        FrontLimits {
            max_connections: 20_000,
            max_connections_per_source: 1_024,
            max_handshakes: 256,
            handshake_timeout: Duration::from_secs(10),
            first_byte_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(60),
            proxy_protocol: Vec::new(),
        }
    }
}

impl FrontLimits {
    /// As the limits of the front's listener.
    pub fn listener_limits(&self) -> relay_common::listen::ListenerLimits {
        relay_common::listen::ListenerLimits {
            max_connections: self.max_connections,
            max_connections_per_source: self.max_connections_per_source,
            max_handshakes: self.max_handshakes,
            handshake_timeout: self.handshake_timeout,
            first_byte_timeout: self.first_byte_timeout,
            idle_timeout: self.idle_timeout,
            proxy_protocol: self.proxy_protocol.clone(),
            ..relay_common::listen::ListenerLimits::without_auth()
        }
    }
}

/// How a server is chosen for a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RoutingPolicy {
    /// The seed behaviour: the most recently announced healthy server. For comparison runs.
    Sticky,
    /// Sticky while the chosen server has idle streams; spills a share of calls to servers
    /// holding idle streams while it is saturated; prefers the lowest latency tier.
    Available,
}

/// `[routing]`: the server choice for each call.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RoutingConfig {
    /// `"available"` (default) or `"sticky"`.
    pub policy: RoutingPolicy,
    /// Retry idempotent methods (GET, HEAD, OPTIONS, PUT, DELETE) on another server when
    /// the call was lost after it may have reached an agent, as long as no response head
    /// went to the caller. Off by default: an upstream may not be as idempotent as its verb.
    pub retry_idempotent: bool,
    /// Servers one call may try (first attempt included).
    pub max_attempts: u32,
    /// Spill share added per routing step while the chosen server is saturated and another
    /// holds idle streams.
    pub spill_step: f64,
    /// Spill share removed per routing step once the chosen server has idle streams again.
    pub spill_decay: f64,
    /// Largest share of a tunnel id's new calls spilled away from its chosen server.
    pub spill_max: f64,
    /// Shortest time between two spill steps of one tunnel id (steps happen when reports
    /// arrive or on the routing tick, at most this often).
    #[serde(with = "humantime_serde")]
    pub step_interval: Duration,
    /// Group servers into latency tiers by the RTT they report and prefer the lowest tier
    /// with capacity. Off: every server counts as tier 0 (one zone, or RTTs that are noise).
    pub latency_tiers: bool,
    /// Latency tiers: how far past its group's bound a member may drift before it leaves
    /// the group, and how far inside a bound a server grouped elsewhere must come to join
    /// (fraction).
    pub tier_hysteresis: f64,
    /// Weigh the servers' own load (the smoothed CPU use they report): spill a share of a
    /// tunnel id's calls away from a home much busier than a peer, and give no new home to
    /// a server above `load_high_water`. Off: routing ignores the load (comparison runs).
    pub load_aware: bool,
    /// How much busier (CPU use, fraction) a home must be than a peer with idle streams
    /// for a share of its calls to spill there.
    pub load_margin: f64,
    /// CPU use (fraction) below which a home never spills for load, however idle a peer:
    /// it answers without waiting on its CPU, and moving calls would only split the
    /// batches its connections carry.
    pub load_floor: f64,
    /// CPU use (fraction) at or above which a server is given no new home while another
    /// with capacity is below it.
    pub load_high_water: f64,
}

impl Default for RoutingConfig {
    fn default() -> Self {
        RoutingConfig {
            policy: RoutingPolicy::Available,
            retry_idempotent: false,
            max_attempts: 3,
            spill_step: 0.05,
            spill_decay: 0.025,
            spill_max: 0.5,
            step_interval: Duration::from_millis(250),
            latency_tiers: true,
            tier_hysteresis: 0.2,
            load_aware: true,
            load_margin: 0.25,
            load_floor: 0.5,
            load_high_water: 0.9,
        }
    }
}

/// Where the routing table is kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RegistryBackend {
    /// Embedded: this dispatcher knows only the servers that report to it.
    Memory,
    /// Shared through Redis: every dispatcher routes every tunnel id.
    Redis,
}

/// `[registry]`: the table of tunnel servers and who may feed it.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RegistryConfig {
    /// `"memory"` (default) or `"redis"`.
    pub backend: RegistryBackend,
    /// Redis URL when `backend = "redis"`: `redis://host:port/db`, or `rediss://` for TLS
    /// (`[registry.redis_tls]`); `user:password@` before the host is sent with `AUTH`.
    pub url: Option<Secret>,
    /// Prefix of every Redis key, so several fleets can share one Redis.
    pub key_prefix: String,
    /// A server's entry expires when it has not reported for this long (3x the servers'
    /// report interval by default), so a dead or hung server drops out in bounded time.
    #[serde(with = "humantime_serde")]
    pub lease: Duration,
    /// How often the shared table is read back from Redis.
    #[serde(with = "humantime_serde")]
    pub refresh_interval: Duration,
    /// Bound on one Redis round trip (connect or command); past it Redis counts as down.
    #[serde(with = "humantime_serde")]
    pub redis_timeout: Duration,
    /// Shared secret tunnel servers must present (`authorization: Bearer`) on their report
    /// stream; only its SHA-256 is kept. Unset (and `server_key_sha256` unset): any server
    /// may report (fine on a private network only).
    #[serde(deserialize_with = "KeyDigest::deserialize_clear")]
    pub server_key: Option<KeyDigest>,
    /// `server_key` given as its hex SHA-256 instead, so the config holds no key in clear.
    #[serde(deserialize_with = "KeyDigest::deserialize_hex")]
    pub server_key_sha256: Option<KeyDigest>,
    /// Server ids allowed to report; empty allows any id. Also applies to records read
    /// from Redis.
    pub allowed_servers: Vec<String>,
    /// A report stream's `server_id` must be one of the names (DNS or URI SANs) of the
    /// client certificate it came with (`[registry_tls]` mutual TLS), so one server's
    /// certificate cannot report as another.
    pub server_id_in_cert: bool,
    /// Key of the HMAC-SHA256 that seals every record written to Redis; every dispatcher
    /// sharing the Redis key prefix must use the same one. Required with `backend =
    /// "redis"` (at least [`MIN_RECORD_KEY_BYTES`] bytes): a record whose seal does not
    /// verify (written by someone without the key, moved to another server's key, or
    /// replayed after its expiry) is refused, so write access to Redis alone cannot steer
    /// calls.
    pub record_key: Option<Secret>,
    /// Hosts a `forward_url` in a record read from Redis may name: `"private"` (IP
    /// addresses in loopback, private, link-local, shared (100.64/10) and unique-local
    /// ranges), an address range (`"10.1.0.0/16"`, `"fd00::/8"`), an address, or a host
    /// name pattern where `*` matches any run of characters (`"*.relay.internal"`). Default
    /// `["private"]`. The scheme must be the one `[forward_tls]` dials (`https`, or `http`
    /// with `insecure = true`).
    pub forward_hosts: Vec<String>,
    /// `[registry.redis_tls]`: trust and client certificate for `rediss://` URLs.
    pub redis_tls: RedisTls,
}

impl RegistryConfig {
    /// The digest a report stream's key is checked against, if one is required.
    pub fn server_key_digest(&self) -> Option<&KeyDigest> {
        self.server_key.as_ref().or(self.server_key_sha256.as_ref())
    }
}

/// Smallest `registry.record_key` accepted, in bytes.
pub const MIN_RECORD_KEY_BYTES: usize = 32;

/// `[registry.redis_tls]`: TLS to Redis, used with a `rediss://` URL.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct RedisTls {
    /// PEM bundle of CAs trusted to sign Redis's certificate; unset: the system's trust
    /// store (a managed Redis with a public certificate).
    pub ca: Option<std::path::PathBuf>,
    /// PEM client certificate chain, for a Redis with `tls-auth-clients yes`.
    pub cert: Option<std::path::PathBuf>,
    /// PEM private key of `cert`.
    pub key: Option<std::path::PathBuf>,
}

impl RedisTls {
    fn is_set(&self) -> bool {
        self.ca.is_some() || self.cert.is_some() || self.key.is_some()
    }
}

impl Default for RegistryConfig {
    fn default() -> Self {
        RegistryConfig {
            backend: RegistryBackend::Memory,
            url: None,
            key_prefix: "relay".into(),
            lease: Duration::from_secs(3),
            refresh_interval: Duration::from_millis(500),
            redis_timeout: Duration::from_secs(1),
            server_key: None,
            server_key_sha256: None,
            allowed_servers: Vec::new(),
            server_id_in_cert: false,
            record_key: None,
            forward_hosts: vec!["private".into()],
            redis_tls: RedisTls::default(),
        }
    }
}

/// One backend allowed to call the dispatcher.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CallerConfig {
    /// Readable name, used in logs (never the key).
    pub name: String,
    /// The caller's bearer key (`Authorization: Bearer <key>`). Only its SHA-256 is kept;
    /// a presented key is hashed and compared in constant time, and never logged.
    #[serde(default, deserialize_with = "KeyDigest::deserialize_clear")]
    pub key: Option<KeyDigest>,
    /// The key given as its hex SHA-256 (`printf '%s' "$KEY" | sha256sum`) instead of
    /// `key`, so the config file holds no caller key in clear. Exactly one of the two.
    #[serde(default, deserialize_with = "KeyDigest::deserialize_hex")]
    pub key_sha256: Option<KeyDigest>,
    /// Tunnel ids this caller may reach: exact ids or patterns where `*` matches any run of
    /// characters (`"acme-*"`); `["*"]` allows every tunnel id. Required: there is no
    /// implicit "all". Another tunnel id gets 403 `forbidden`.
    pub tunnels: Vec<String>,
    /// Calls of this caller in flight at once; one more gets 429 `too_many_calls`.
    #[serde(default = "default_max_concurrent_calls")]
    pub max_concurrent_calls: usize,
    /// Calls of this caller in flight at once to any one tunnel id; one more gets 429
    /// `too_many_calls`. Unset: only `max_concurrent_calls` applies. Set it on a key that
    /// several tenants (tunnel ids) share, so one tenant's slow calls cannot take every
    /// slot of the key.
    #[serde(default)]
    pub max_concurrent_calls_per_tunnel: Option<usize>,
}

/// Default of `callers[].max_concurrent_calls`.
pub const DEFAULT_MAX_CONCURRENT_CALLS: usize = 256;

fn default_max_concurrent_calls() -> usize {
    DEFAULT_MAX_CONCURRENT_CALLS
}

impl CallerConfig {
    /// A caller that may reach every tunnel id, with the default concurrency bound.
    pub fn allow_all(name: impl Into<String>, key: &str) -> Self {
        CallerConfig {
            name: name.into(),
            key: Some(KeyDigest::of(key.as_bytes())),
            key_sha256: None,
            tunnels: vec!["*".into()],
            max_concurrent_calls: DEFAULT_MAX_CONCURRENT_CALLS,
            max_concurrent_calls_per_tunnel: None,
        }
    }

    /// The digest a presented key is checked against (`key` or `key_sha256`; `validate`
    /// requires exactly one).
    pub fn digest(&self) -> Option<&KeyDigest> {
        self.key.as_ref().or(self.key_sha256.as_ref())
    }

    /// Whether this caller may reach `tunnel_id`.
    pub fn may_reach(&self, tunnel_id: &str) -> bool {
        self.tunnels.iter().any(|p| pattern_matches(p, tunnel_id))
    }
}

/// `*` matches any run of characters (none included); everything else is literal
/// (`relay_common::glob`).
pub fn pattern_matches(pattern: &str, id: &str) -> bool {
    relay_common::glob::matches_str(pattern, id)
}

/// The transport of each hop, checked: `None` is plain text (`insecure = true`).
#[derive(Clone, Debug)]
pub struct Transport {
    pub front: Option<ServerTls>,
    pub registry: Option<ServerTls>,
    pub forward: Option<ClientTls>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            registry_listen: SocketAddr::from(([127, 0, 0, 1], 8460)),
            admin_listen: SocketAddr::from(([127, 0, 0, 1], 9080)),
            worker_threads: None,
            call_timeout: Duration::from_secs(30),
            max_call_timeout: Duration::from_secs(300),
            shutdown_grace: Duration::from_secs(10),
            max_header_bytes: 64 * 1024,
            max_request_body_bytes: None,
            max_frame_bytes: DEFAULT_MAX_FRAME_BYTES,
            max_response_headers: HeadLimits::DEFAULT.max_headers,
            max_response_header_bytes: HeadLimits::DEFAULT.max_bytes,
            body_idle_timeout: Duration::from_secs(60),
            carrier_idle_timeout: crate::carrier::IDLE_FOR,
            tls: ListenerTls::default(),
            registry_tls: ListenerTls::default(),
            forward_tls: DialerTls::default(),
            reload_interval: Duration::from_secs(5),
            callers: Vec::new(),
            routing: RoutingConfig::default(),
            registry: RegistryConfig::default(),
            front_h2: H2Settings::default(),
            front_limits: FrontLimits::default(),
            forward_h2: H2Settings::default(),
            registry_h2: H2Settings::default(),
        }
    }
}

/// Smallest `max_header_bytes` accepted: hyper's HTTP/1 read buffer cannot be smaller.
pub const MIN_HEADER_BYTES: usize = 8 * 1024;

pub use relay_proto::DEFAULT_MAX_FRAME_BYTES;

impl Config {
    /// Plain text on every hop (`insecure = true` on each TLS section): tests and the
    /// local example.
    pub fn insecure(mut self) -> Self {
        self.tls = ListenerTls::insecure();
        self.registry_tls = ListenerTls::insecure();
        self.forward_tls = DialerTls::insecure();
        self
    }

    /// Whether the registry listener on `addr` may run without `[registry] server_key`:
    /// `Err` naming the key when `addr` is not a loopback address (anyone who can reach it
    /// could report any `forward_url` and tunnel ids and so steer calls), `Ok(true)` when it
    /// runs without one on loopback (worth a warning), `Ok(false)` with a key.
    pub fn registry_key_needed(&self, addr: SocketAddr) -> Result<bool, ConfigError> {
        if self.registry.server_key_digest().is_some() {
            return Ok(false);
        }
        if addr.ip().is_loopback() {
            return Ok(true);
        }
        Err(ConfigError::invalid(
            "registry.server_key",
            format!(
                "is required when the registry listens on a non-loopback address ({addr}): without it anyone who reaches the listener can report any forward_url and tunnel ids; set the same secret as the tunnel servers' dispatcher_key"
            ),
        ))
    }

    /// Checks the TLS sections.
    pub fn transport(&self) -> Result<Transport, ConfigError> {
        let registry = self
            .registry_tls
            .resolve("registry_tls", ClientCerts::Required)?;
        // A tunnel server's certificate authenticates its reports: pin which ones.
        self.registry_tls.require_pinned(
            "registry_tls",
            Some((
                "registry.server_id_in_cert",
                self.registry.server_id_in_cert,
            )),
        )?;
        Ok(Transport {
            front: self.tls.resolve("tls", ClientCerts::Optional)?,
            registry,
            forward: self
                .forward_tls
                .resolve("forward_tls", ClientCerts::Required)?,
        })
    }

    /// Checks the settings once at start; the error names the offending key.
    /// The front's HTTP/2 limits (validated by [`Config::validate`]).
    pub fn front_h2(&self) -> Result<H2Limits, ConfigError> {
        self.front_h2.resolve(H2Limits::FRONT, "front_h2")
    }

    /// The HTTP/2 limits of connections to tunnel servers.
    pub fn forward_h2(&self) -> Result<H2Limits, ConfigError> {
        self.forward_h2.resolve(H2Limits::FORWARD, "forward_h2")
    }

    /// The registry listener's HTTP/2 limits.
    pub fn registry_h2(&self) -> Result<H2Limits, ConfigError> {
        self.registry_h2.resolve(H2Limits::REGISTRY, "registry_h2")
    }

    /// `max_response_headers` and `max_response_header_bytes` as one value.
    pub fn response_head_limits(&self) -> HeadLimits {
        HeadLimits::new(self.max_response_headers, self.max_response_header_bytes)
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        relay_common::runtime::check(self.worker_threads)?;
        self.front_h2()?;
        self.front_limits
            .listener_limits()
            .validate("front_limits")?;
        self.forward_h2()?;
        self.registry_h2()?;
        if self.call_timeout.is_zero() {
            return Err(ConfigError::invalid(
                "call_timeout",
                "must be greater than zero",
            ));
        }
        if self.max_call_timeout < self.call_timeout {
            return Err(ConfigError::invalid(
                "max_call_timeout",
                "must be at least call_timeout",
            ));
        }
        if self.max_call_timeout > Duration::from_millis(u64::from(u32::MAX)) {
            return Err(ConfigError::invalid(
                "max_call_timeout",
                "must fit in u32 milliseconds",
            ));
        }
        if self.max_header_bytes < MIN_HEADER_BYTES {
            return Err(ConfigError::invalid(
                "max_header_bytes",
                format!("must be at least {MIN_HEADER_BYTES}"),
            ));
        }
        if self.callers.is_empty() {
            return Err(ConfigError::invalid(
                "callers",
                "at least one caller key is needed (config [[callers]] or --caller-key / RELAY_CALLER_KEY)",
            ));
        }
        self.transport()?;
        relay_proto::check_max_frame_bytes(self.max_frame_bytes)
            .map_err(|m| ConfigError::invalid("max_frame_bytes", m))?;
        self.response_head_limits()
            .validate()
            .map_err(|e| ConfigError::invalid(e.key, e.message))?;
        if self.body_idle_timeout < Duration::from_millis(10) {
            return Err(ConfigError::invalid(
                "body_idle_timeout",
                "must be at least 10ms",
            ));
        }
        if self.carrier_idle_timeout < Duration::from_millis(10) {
            return Err(ConfigError::invalid(
                "carrier_idle_timeout",
                "must be at least 10ms",
            ));
        }
        for (i, c) in self.callers.iter().enumerate() {
            if c.max_concurrent_calls_per_tunnel == Some(0) {
                return Err(ConfigError::invalid(
                    format!("callers[{i}].max_concurrent_calls_per_tunnel"),
                    "must be at least 1 when set",
                ));
            }
        }
        if self.max_request_body_bytes == Some(0) {
            return Err(ConfigError::invalid(
                "max_request_body_bytes",
                "must be at least 1 when set",
            ));
        }
        if self.reload_interval < Duration::from_millis(10) {
            return Err(ConfigError::invalid(
                "reload_interval",
                "must be at least 10ms",
            ));
        }
        self.validate_routing()?;
        self.validate_registry()?;
        for (i, c) in self.callers.iter().enumerate() {
            if c.name.trim().is_empty() {
                return Err(ConfigError::invalid(
                    format!("callers[{i}].name"),
                    "must not be empty",
                ));
            }
            if c.key.is_some() == c.key_sha256.is_some() {
                return Err(ConfigError::invalid(
                    format!("callers[{i}].key"),
                    "set exactly one of key and key_sha256",
                ));
            }
            if self.callers[..i].iter().any(|o| o.name == c.name) {
                return Err(ConfigError::invalid(
                    format!("callers[{i}].name"),
                    "duplicate caller name",
                ));
            }
            if c.tunnels.is_empty() {
                return Err(ConfigError::invalid(
                    format!("callers[{i}].tunnels"),
                    "must list the tunnel ids this caller may reach (patterns allowed; [\"*\"] for all)",
                ));
            }
            for (j, p) in c.tunnels.iter().enumerate() {
                let ok = !p.is_empty()
                    && p.len() <= 128
                    && p.bytes().all(|b| {
                        b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-' | b'*')
                    });
                if !ok {
                    return Err(ConfigError::invalid(
                        format!("callers[{i}].tunnels[{j}]"),
                        "must be a tunnel id or a pattern of [A-Za-z0-9._-] and `*`",
                    ));
                }
            }
            if c.max_concurrent_calls == 0 {
                return Err(ConfigError::invalid(
                    format!("callers[{i}].max_concurrent_calls"),
                    "must be at least 1",
                ));
            }
        }
        Ok(())
    }
}

impl Config {
    fn validate_routing(&self) -> Result<(), ConfigError> {
        self.routing.validate()
    }
}

impl RoutingConfig {
    /// Checks every `[routing]` key; the error names it.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let r = self;
        let share = |v: f64| v.is_finite() && (0.0..=1.0).contains(&v);
        if !share(r.spill_max) || r.spill_max >= 1.0 {
            return Err(ConfigError::invalid(
                "routing.spill_max",
                "must be in [0, 1): the chosen server keeps some calls",
            ));
        }
        if !share(r.spill_step) || r.spill_step == 0.0 {
            return Err(ConfigError::invalid(
                "routing.spill_step",
                "must be in (0, 1]",
            ));
        }
        if !share(r.spill_decay) || r.spill_decay == 0.0 {
            return Err(ConfigError::invalid(
                "routing.spill_decay",
                "must be in (0, 1]",
            ));
        }
        if !(r.tier_hysteresis.is_finite() && (0.0..1.0).contains(&r.tier_hysteresis)) {
            return Err(ConfigError::invalid(
                "routing.tier_hysteresis",
                "must be in [0, 1)",
            ));
        }
        if !(r.load_margin.is_finite() && r.load_margin > 0.0 && r.load_margin < 1.0) {
            return Err(ConfigError::invalid(
                "routing.load_margin",
                "must be in (0, 1)",
            ));
        }
        if !(r.load_floor.is_finite() && (0.0..1.0).contains(&r.load_floor)) {
            return Err(ConfigError::invalid(
                "routing.load_floor",
                "must be in [0, 1)",
            ));
        }
        if !(r.load_high_water.is_finite() && r.load_high_water > 0.0 && r.load_high_water <= 1.0) {
            return Err(ConfigError::invalid(
                "routing.load_high_water",
                "must be in (0, 1]",
            ));
        }
        if r.max_attempts == 0 || r.max_attempts > 10 {
            return Err(ConfigError::invalid(
                "routing.max_attempts",
                "must be 1 to 10",
            ));
        }
        if r.step_interval < Duration::from_millis(10) {
            return Err(ConfigError::invalid(
                "routing.step_interval",
                "must be at least 10ms",
            ));
        }
        Ok(())
    }
}

impl Config {
    fn validate_registry(&self) -> Result<(), ConfigError> {
        let r = &self.registry;
        if r.lease < Duration::from_millis(100) {
            return Err(ConfigError::invalid(
                "registry.lease",
                "must be at least 100ms",
            ));
        }
        if r.refresh_interval < Duration::from_millis(10) || r.refresh_interval > r.lease {
            return Err(ConfigError::invalid(
                "registry.refresh_interval",
                "must be at least 10ms and at most registry.lease",
            ));
        }
        if r.redis_timeout.is_zero() {
            return Err(ConfigError::invalid(
                "registry.redis_timeout",
                "must be greater than zero",
            ));
        }
        if r.key_prefix.is_empty() {
            return Err(ConfigError::invalid(
                "registry.key_prefix",
                "must not be empty",
            ));
        }
        if r.server_id_in_cert && self.registry_tls.insecure {
            return Err(ConfigError::invalid(
                "registry.server_id_in_cert",
                "needs mutual TLS on [registry_tls]",
            ));
        }
        if r.server_key.is_some() && r.server_key_sha256.is_some() {
            return Err(ConfigError::invalid(
                "registry.server_key",
                "set at most one of server_key and server_key_sha256",
            ));
        }
        self.registry_key_needed(self.registry_listen)?;
        if r.backend == RegistryBackend::Redis {
            let Some(url) = &r.url else {
                return Err(ConfigError::invalid(
                    "registry.url",
                    "is required with backend = \"redis\"",
                ));
            };
            let tls = url.expose().starts_with("rediss://");
            if !(url.expose().starts_with("redis://") || tls) {
                return Err(ConfigError::invalid(
                    "registry.url",
                    "must be a redis:// or rediss:// URL",
                ));
            }
            if !tls && r.redis_tls.is_set() {
                return Err(ConfigError::invalid(
                    "registry.redis_tls",
                    "is set but registry.url is plain redis://: use rediss:// for TLS",
                ));
            }
            if r.redis_tls.cert.is_some() != r.redis_tls.key.is_some() {
                return Err(ConfigError::invalid(
                    "registry.redis_tls.cert",
                    "cert and key must be given together",
                ));
            }
            match &r.record_key {
                None => {
                    return Err(ConfigError::invalid(
                        "registry.record_key",
                        format!(
                            "is required with backend = \"redis\": a secret of at least \
                             {MIN_RECORD_KEY_BYTES} bytes shared by every dispatcher of the \
                             fleet, which seals the records in Redis"
                        ),
                    ))
                }
                Some(k) if k.expose().len() < MIN_RECORD_KEY_BYTES => {
                    return Err(ConfigError::invalid(
                        "registry.record_key",
                        format!(
                            "must be at least {MIN_RECORD_KEY_BYTES} bytes (e.g. `openssl rand \
                             -hex 32`)"
                        ),
                    ))
                }
                Some(_) => {}
            }
        }
        if r.forward_hosts.is_empty() {
            return Err(ConfigError::invalid(
                "registry.forward_hosts",
                "must list at least one entry (default [\"private\"])",
            ));
        }
        for (i, h) in r.forward_hosts.iter().enumerate() {
            if let Err(why) = relay_common::hosts::HostRule::parse(h) {
                return Err(ConfigError::invalid(
                    format!("registry.forward_hosts[{i}]"),
                    why,
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    #[test]
    fn parses_a_full_file_with_durations() {
        let cfg: Config = relay_common::config::parse(
            r#"
            listen = "127.0.0.1:1"
            call_timeout = "5s"
            max_call_timeout = "1m"
            [[callers]]
            name = "ci"
            key = "k"
            tunnels = ["*"]
            [tls]
            insecure = true
            [registry_tls]
            insecure = true
            [forward_tls]
            insecure = true
            "#,
            Path::new("d.toml"),
        )
        .unwrap();
        assert_eq!(cfg.call_timeout, Duration::from_secs(5));
        assert_eq!(cfg.max_call_timeout, Duration::from_secs(60));
        assert_eq!(cfg.registry_listen, Config::default().registry_listen);
        assert_eq!(format!("{:?}", cfg.callers[0].key), "Some(***)");
        cfg.validate().unwrap();
    }

    #[test]
    fn caller_and_server_keys_are_kept_as_digests_given_in_clear_or_as_sha256() {
        let parse = |callers: &str| {
            relay_common::config::parse::<Config>(
                &format!(
                    "{callers}\n[tls]\ninsecure = true\n[registry_tls]\ninsecure = true\n\
                     [forward_tls]\ninsecure = true\n"
                ),
                Path::new("d.toml"),
            )
        };
        let digest = relay_common::secret::sha256_hex(b"k2");
        let cfg = parse(&format!(
            "[[callers]]\nname = \"a\"\nkey = \"k1\"\ntunnels = [\"*\"]\n\
             [[callers]]\nname = \"b\"\nkey_sha256 = \"{digest}\"\ntunnels = [\"*\"]\n\
             [registry]\nserver_key_sha256 = \"{digest}\"\n"
        ))
        .unwrap();
        cfg.validate().unwrap();
        assert!(cfg.callers[0].digest().unwrap().matches(b"k1"));
        assert!(cfg.callers[1].digest().unwrap().matches(b"k2"));
        assert!(!cfg.callers[1].digest().unwrap().matches(digest.as_bytes()));
        assert!(cfg.registry.server_key_digest().unwrap().matches(b"k2"));

        let both = parse(&format!(
            "[[callers]]\nname = \"a\"\nkey = \"k1\"\nkey_sha256 = \"{digest}\"\ntunnels = [\"*\"]\n"
        ))
        .unwrap();
        let err = both.validate().unwrap_err().to_string();
        assert!(err.contains("callers[0].key"), "{err}");
        let neither = parse("[[callers]]\nname = \"a\"\ntunnels = [\"*\"]\n").unwrap();
        let err = neither.validate().unwrap_err().to_string();
        assert!(err.contains("exactly one of key and key_sha256"), "{err}");
        for bad in [
            "[[callers]]\nname = \"a\"\nkey = \"\"\ntunnels = [\"*\"]\n",
            "[[callers]]\nname = \"a\"\nkey_sha256 = \"abc\"\ntunnels = [\"*\"]\n",
        ] {
            let err = parse(bad).unwrap_err().to_string();
            assert!(err.contains("key"), "{err}");
        }
    }

    #[test]
    fn unknown_key_and_bad_values_are_named() {
        let err = relay_common::config::parse::<Config>("listn = \"x\"", Path::new("d.toml"))
            .unwrap_err();
        assert!(err.to_string().contains("listn"), "{err}");
        let cfg = Config {
            max_call_timeout: Duration::from_secs(1),
            ..Config::default()
        }
        .insecure();
        assert!(cfg
            .validate()
            .unwrap_err()
            .to_string()
            .contains("max_call_timeout"));
        let cfg = Config::default().insecure();
        assert!(cfg.validate().unwrap_err().to_string().contains("callers"));
    }

    #[test]
    fn peer_limits_parse_with_their_defaults_and_are_checked() {
        let cfg: Config = relay_common::config::parse(
            r#"
            body_idle_timeout = "2s"
            max_response_headers = 100
            [[callers]]
            name = "shared"
            key = "k"
            tunnels = ["*"]
            max_concurrent_calls_per_tunnel = 8
            "#,
            Path::new("d.toml"),
        )
        .unwrap();
        assert_eq!(cfg.body_idle_timeout, Duration::from_secs(2));
        assert_eq!(cfg.max_response_headers, 100);
        assert_eq!(cfg.max_response_header_bytes, 64 * 1024);
        assert_eq!(cfg.callers[0].max_concurrent_calls_per_tunnel, Some(8));
        let d = Config::default();
        assert_eq!(
            (d.max_response_headers, d.body_idle_timeout),
            (256, Duration::from_secs(60))
        );
        let bad = |f: &dyn Fn(&mut Config)| {
            let mut c = cfg.clone().insecure();
            f(&mut c);
            c.validate().unwrap_err().to_string()
        };
        assert!(bad(&|c| c.max_response_headers = 0).contains("max_response_headers"));
        assert!(bad(&|c| c.max_response_header_bytes = 10).contains("max_response_header_bytes"));
        assert!(bad(&|c| c.body_idle_timeout = Duration::ZERO).contains("body_idle_timeout"));
        assert!(bad(&|c| c.carrier_idle_timeout = Duration::from_millis(1))
            .contains("carrier_idle_timeout"));
        let e = bad(&|c| c.callers[0].max_concurrent_calls_per_tunnel = Some(0));
        assert!(
            e.contains("callers[0].max_concurrent_calls_per_tunnel"),
            "{e}"
        );
    }

    #[test]
    fn front_limits_parse_with_their_defaults_and_bad_values_name_the_key() {
        let cfg: Config = relay_common::config::parse(
            r#"
            [front_limits]
            idle_timeout = "30s"
            proxy_protocol = ["10.0.0.5", "192.168.0.0/16"]
            [[callers]]
            name = "a"
            key = "k"
            tunnels = ["*"]
            "#,
            Path::new("d.toml"),
        )
        .unwrap();
        let l = cfg.front_limits.listener_limits();
        assert_eq!(l.idle_timeout, Duration::from_secs(30));
        assert_eq!(l.first_byte_timeout, Duration::from_secs(10));
        assert_eq!(l.max_connections_per_source, 1024);
        assert_eq!((l.auth_timeout, l.auth_failures), (Duration::ZERO, 0));
        assert!(l.proxy_protocol[1].contains("192.168.7.1".parse().unwrap()));
        assert!(!l.proxy_protocol[0].contains("10.0.0.6".parse().unwrap()));
        let err = relay_common::config::parse::<Config>(
            "[front_limits]\nproxy_protocol = [\"10.0.0.0/40\"]",
            Path::new("d.toml"),
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("proxy_protocol") && err.contains("prefix length"),
            "{err}"
        );
        let mut c = cfg.clone().insecure();
        c.front_limits.first_byte_timeout = Duration::from_millis(5);
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("front_limits.first_byte_timeout"), "{err}");
    }

    #[test]
    fn routing_and_registry_sections_parse_and_are_checked() {
        let cfg: Config = relay_common::config::parse(
            r#"
            [[callers]]
            name = "ci"
            key = "k"
            tunnels = ["acme-*", "demo"]
            max_concurrent_calls = 8
            [tls]
            insecure = true
            [registry_tls]
            insecure = true
            [forward_tls]
            insecure = true
            [routing]
            policy = "sticky"
            retry_idempotent = true
            [registry]
            backend = "redis"
            url = "redis://127.0.0.1:6379"
            lease = "5s"
            server_key = "sk"
            allowed_servers = ["ts-1"]
            record_key = "0123456789abcdef0123456789abcdef"
            forward_hosts = ["private", "*.relay.internal", "10.0.0.0/8"]
            "#,
            Path::new("d.toml"),
        )
        .unwrap();
        assert_eq!(cfg.routing.policy, RoutingPolicy::Sticky);
        assert!(cfg.routing.retry_idempotent);
        assert_eq!(cfg.registry.backend, RegistryBackend::Redis);
        assert_eq!(cfg.registry.lease, Duration::from_secs(5));
        assert_eq!(format!("{:?}", cfg.registry.server_key), "Some(***)");
        cfg.validate().unwrap();
        let mut bad = cfg.clone();
        bad.registry.url = None;
        assert!(bad
            .validate()
            .unwrap_err()
            .to_string()
            .contains("registry.url"));
        let mut bad = cfg.clone();
        bad.registry.record_key = None;
        let err = bad.validate().unwrap_err().to_string();
        assert!(
            err.contains("`registry.record_key`") && err.contains("required"),
            "{err}"
        );
        bad.registry.record_key = Some(Secret::new("short"));
        let err = bad.validate().unwrap_err().to_string();
        assert!(
            err.contains("`registry.record_key`") && err.contains("at least 32 bytes"),
            "{err}"
        );
        let mut bad = cfg.clone();
        bad.registry.forward_hosts = vec!["private".into(), "10.0.0.0/40".into()];
        let err = bad.validate().unwrap_err().to_string();
        assert!(err.contains("`registry.forward_hosts[1]`"), "{err}");
        bad.registry.forward_hosts = vec![];
        let err = bad.validate().unwrap_err().to_string();
        assert!(err.contains("`registry.forward_hosts`"), "{err}");
        let mut bad = cfg.clone();
        bad.registry.redis_tls.ca = Some("ca.pem".into());
        let err = bad.validate().unwrap_err().to_string();
        assert!(
            err.contains("`registry.redis_tls`") && err.contains("rediss://"),
            "{err}"
        );
        bad.registry.url = Some(Secret::new("rediss://relay:pw@127.0.0.1:6380"));
        bad.validate().unwrap();
        bad.registry.redis_tls.cert = Some("c.pem".into());
        let err = bad.validate().unwrap_err().to_string();
        assert!(err.contains("`registry.redis_tls.cert`"), "{err}");
        let mut bad = cfg.clone();
        bad.routing.spill_max = 1.0;
        assert!(bad
            .validate()
            .unwrap_err()
            .to_string()
            .contains("spill_max"));
        let err = relay_common::config::parse::<Config>(
            "[routing]\npolicy = \"random\"",
            Path::new("d.toml"),
        )
        .unwrap_err();
        assert!(
            err.to_string().contains("random") || err.to_string().contains("policy"),
            "{err}"
        );
    }

    #[test]
    fn every_hop_needs_tls_or_an_explicit_insecure() {
        let base = || {
            let mut c = Config::default().insecure();
            c.callers = vec![CallerConfig::allow_all("ci", "k")];
            c
        };
        base().validate().unwrap();
        let mut c = base();
        c.registry_tls = ListenerTls::default();
        let err = c.validate().unwrap_err().to_string();
        assert!(
            err.contains("`registry_tls`") && err.contains("insecure = true"),
            "{err}"
        );
        let mut c = base();
        c.registry_tls = ListenerTls {
            cert: Some("s.pem".into()),
            key: Some("s.key".into()),
            ..Default::default()
        };
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("`registry_tls.client_ca`"), "{err}");
        // Mutual TLS pins the tunnel servers' certificates: by name, or by their server id.
        c.registry_tls.client_ca = Some("ca.pem".into());
        let err = c.validate().unwrap_err().to_string();
        assert!(
            err.contains("`registry_tls.client_names`")
                && err.contains("registry.server_id_in_cert"),
            "{err}"
        );
        c.registry.server_id_in_cert = true;
        c.validate().unwrap();
        c.registry.server_id_in_cert = false;
        c.registry_tls.client_names = vec!["tunnel-server".into()];
        c.validate().unwrap();
        let mut c = base();
        c.forward_tls = DialerTls {
            ca: Some("ca.pem".into()),
            ..Default::default()
        };
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("`forward_tls.cert`"), "{err}");
        let mut c = base();
        c.tls = ListenerTls {
            cert: Some("s.pem".into()),
            key: Some("s.key".into()),
            ..Default::default()
        };
        c.validate().unwrap();
        c.tls.insecure = true;
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("`tls.insecure`"), "{err}");
    }

    #[test]
    fn a_registry_off_loopback_needs_a_server_key() {
        let mut c = Config {
            callers: vec![CallerConfig::allow_all("c", "k")],
            registry_listen: "0.0.0.0:8460".parse().unwrap(),
            ..Config::default().insecure()
        };
        let err = c.validate().unwrap_err().to_string();
        assert!(
            err.contains("`registry.server_key`") && err.contains("0.0.0.0:8460"),
            "{err}"
        );
        c.registry_listen = "10.0.0.5:8460".parse().unwrap();
        assert!(c.validate().is_err());
        // On loopback it runs, with a warning.
        c.registry_listen = "127.0.0.1:8460".parse().unwrap();
        c.validate().unwrap();
        assert!(c.registry_key_needed(c.registry_listen).unwrap());
        assert!(c
            .registry_key_needed("[::1]:8460".parse().unwrap())
            .unwrap());
        // A key (in clear or as its SHA-256) is all it takes.
        c.registry_listen = "0.0.0.0:8460".parse().unwrap();
        c.registry.server_key = Some(KeyDigest::of(b"secret"));
        c.validate().unwrap();
        assert!(!c.registry_key_needed(c.registry_listen).unwrap());
    }

    #[test]
    fn callers_name_their_tunnels_explicitly() {
        let err = relay_common::config::parse::<Config>(
            "[[callers]]\nname = \"a\"\nkey = \"k\"\n",
            Path::new("d.toml"),
        )
        .unwrap_err();
        assert!(err.to_string().contains("tunnels"), "{err}");
        let mut c = Config::default().insecure();
        c.callers = vec![CallerConfig {
            tunnels: vec![],
            ..CallerConfig::allow_all("a", "k")
        }];
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("`callers[0].tunnels`"), "{err}");
        c.callers[0].tunnels = vec!["acme/x".into()];
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("`callers[0].tunnels[0]`"), "{err}");
    }

    #[test]
    fn example_configs_are_valid() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples");
        for (file, tls) in [
            ("local/dispatcher.toml", false),
            ("tls/dispatcher.toml", true),
        ] {
            let c: Config = relay_common::config::load(Some(&root.join(file)))
                .unwrap_or_else(|e| panic!("{file}: {e}"));
            c.validate().unwrap_or_else(|e| panic!("{file}: {e}"));
            let t = c.transport().unwrap();
            assert_eq!(
                (t.front.is_some(), t.registry.is_some(), t.forward.is_some()),
                (tls, tls, tls),
                "{file}"
            );
        }
    }
}
