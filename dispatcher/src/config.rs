//! The dispatcher's typed configuration: TOML with `deny_unknown_fields`, every default
//! written once in `Default`, validated once at start by [`Config::validate`].
//!
//! This module only describes and checks settings; it must not open sockets or read files
//! (loading goes through `relay_common::config`). The top-level keys and the TLS and HTTP/2
//! sections are here; each larger section has its own file: `front` (`[front_limits]`),
//! `callers` (`[[callers]]`), `routing` (`[routing]`), `registry` (`[registry]`).

mod callers;
mod front;
mod registry;
mod routing;

pub use callers::{pattern_matches, CallerConfig, DEFAULT_MAX_CONCURRENT_CALLS};
pub use front::FrontLimits;
pub use registry::{RedisTls, RegistryBackend, RegistryConfig, MIN_RECORD_KEY_BYTES};
pub use routing::{RoutingConfig, RoutingPolicy};

use relay_common::config::ConfigError;
use relay_common::h2::{H2Limits, H2Settings};
use relay_common::tls::{ClientCerts, ClientTls, DialerTls, ListenerTls, ServerTls};
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

    /// Checks the settings once at start; the error names the offending key.
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
        self.routing.validate()?;
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

#[cfg(test)]
mod tests;
