//! Typed configuration of the tunnel server, parsed from TOML once at start and
//! validated with errors that name the key.

use relay_common::config::ConfigError;
use relay_common::h2::{H2Limits, H2Settings};
use relay_common::listen::ListenerLimits;
use relay_common::tls::{ClientCerts, ClientTls, DialerTls, ListenerTls, ServerTls};
use relay_common::Secret;
use relay_proto::HeadLimits;
use serde::Deserialize;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// Stable identity of this server; agents group their streams by it and the
    /// dispatcher routes by it. Defaults to `<host name>-<agent listen address>`, so two
    /// replicas never share one (two live servers with one id are refused by the
    /// dispatcher).
    pub server_id: String,
    /// Zone label sent to agents in ServerHello and to dispatchers.
    pub zone: String,
    /// Agent-facing gRPC listener (`Tunnel.Connect`).
    pub agent_listen: SocketAddr,
    /// Dispatcher-facing gRPC listener (`Forward.Call`).
    pub forward_listen: SocketAddr,
    /// Admin HTTP listener (`/metrics`, `/healthz`, `/readyz`).
    pub admin_listen: SocketAddr,
    /// Worker threads of the process's runtime; unset: one per core (or
    /// `TOKIO_WORKER_THREADS`). Fewer than cores suits a machine shared with other busy
    /// processes (see `relay_common::runtime`).
    pub worker_threads: Option<usize>,
    /// URL dispatchers use to reach `forward_listen`; defaults to `http://<forward_listen>`.
    pub forward_url: Option<String>,
    /// Agent-facing URL that reaches this server directly, bypassing the load balancer
    /// (e.g. `https://ts-1.relay.example:8443`). Advertised in ServerHello and the fleet
    /// news; agents with `coverage.direct_growth` open a short server's missing streams
    /// straight to it. Off (none) by default.
    pub direct_url: Option<String>,
    /// Registry endpoints of the dispatchers this server reports to.
    pub dispatchers: Vec<String>,
    /// Shared secret sent to dispatchers (`authorization: Bearer`) on the report stream;
    /// must match the dispatcher's `[registry] server_key`. Never logged.
    pub dispatcher_key: Option<Secret>,
    /// TOML file of `[[tokens]] tunnel_id = "...", sha256 = "<hex>"` entries.
    pub token_store: Option<PathBuf>,
    /// Period of pings on every stream; a stream silent for `heartbeat * heartbeat_misses`
    /// is dropped.
    #[serde(with = "humantime_serde")]
    pub heartbeat: Duration,
    pub heartbeat_misses: u32,
    /// How often an agent connection from which nothing came for that long gets a liveness
    /// ping on one of its idle streams (`crate::liveness`; the agent names its connection);
    /// 0 turns liveness pings off.
    #[serde(with = "humantime_serde")]
    pub liveness_interval: Duration,
    /// How long a liveness ping may go unanswered before every stream of that agent
    /// connection is closed and the calls on them end as `stream_lost`.
    #[serde(with = "humantime_serde")]
    pub liveness_timeout: Duration,
    /// Longest a call waits for an idle stream (its own deadline may be shorter).
    #[serde(with = "humantime_serde")]
    pub queue_timeout: Duration,
    /// Calls that may wait per tunnel id; more get "no capacity" at once.
    pub max_queue_per_tunnel: usize,
    /// A call of a dispatcher that asks for the queue handshake and has waited longer than
    /// this in the queue (0: any call that queues) is told `Queued`, and reaches the agent
    /// only after the dispatcher's `Proceed`: if this server dies meanwhile, the dispatcher
    /// retries it elsewhere. Shorter waits skip the handshake (and its round trip) and are
    /// lost on a crash like calls in progress.
    #[serde(with = "humantime_serde")]
    pub queue_handshake_after: Duration,
    /// Streams one tunnel id may hold on this server; more are refused with
    /// RESOURCE_EXHAUSTED.
    pub max_streams_per_token: usize,
    /// Agent connections opening at once (from the accept to their first authenticated
    /// stream, at most 1 s each); more wait their turn, first come first served, parked
    /// (`relay_tunnel_opens_waiting`). Keeps a storm of opens (a fleet of agents
    /// reconnecting) from delaying everything else (see `relay_common::listen::admission`).
    pub max_opens_in_progress: usize,
    /// Period of the load report to dispatchers.
    #[serde(with = "humantime_serde")]
    pub report_interval: Duration,
    /// On shutdown, how long calls in flight may take to finish.
    #[serde(with = "humantime_serde")]
    pub shutdown_grace: Duration,
    /// Largest gRPC message accepted or sent on the agent and forward listeners (and the
    /// report stream). A bigger frame ends that stream with RESOURCE_EXHAUSTED; other
    /// streams keep serving. Must hold a 64 KiB body chunk plus its head.
    pub max_frame_bytes: usize,
    /// Most headers an agent's response head may carry; a head with more ends the call
    /// with a 502 `bad_response` at the dispatcher and closes the agent's stream with
    /// RESOURCE_EXHAUSTED.
    pub max_response_headers: usize,
    /// Largest agent response head, counted as every header's name and value plus 4
    /// bytes; a bigger one is refused like `max_response_headers`.
    pub max_response_header_bytes: usize,
    /// `[agent_tls]`: TLS of the agent listener (`cert`, `key`; `client_ca` with
    /// `client_cert_optional` to accept agent certificates too), or `insecure = true`.
    pub agent_tls: ListenerTls,
    /// `[forward_tls]`: TLS of the forward listener; mutual TLS (`client_ca` required: only
    /// dispatchers with a certificate from it may call), or `insecure = true`.
    pub forward_tls: ListenerTls,
    /// `[dispatcher_tls]`: how the report streams dial `dispatchers` (`https://` URLs with
    /// `ca`, `cert`, `key`: the dispatcher's registry uses mutual TLS), or `insecure = true`
    /// for `http://` URLs. Not needed when `dispatchers` is empty.
    pub dispatcher_tls: DialerTls,
    /// `[agent_h2]`: HTTP/2 limits of the agent listener (see `relay_common::h2`; defaults
    /// `H2Limits::TUNNEL`).
    pub agent_h2: H2Settings,
    /// `[forward_h2]`: HTTP/2 limits of the forward listener (defaults `H2Limits::FORWARD`).
    pub forward_h2: H2Settings,
    /// `[dispatcher_h2]`: HTTP/2 limits of the report streams to dispatchers (defaults
    /// `H2Limits::REGISTRY`).
    pub dispatcher_h2: H2Settings,
    /// How often certificate and token store files are checked for changes (SIGHUP
    /// reloads at once).
    #[serde(with = "humantime_serde")]
    pub reload_interval: Duration,
    /// `[agent_limits]`: what the agent listener (the one facing the internet) spends on a
    /// peer beyond its streams: connections in all, per source and per tunnel id, TLS
    /// handshakes, time to the first bytes and to a first authenticated stream,
    /// connections holding no stream, a per-source budget of refused tokens, half-received
    /// messages, and the load balancers whose PROXY headers name the source (see
    /// `relay_common::listen`).
    pub agent_limits: ListenerLimits,
    /// The co-located mode: a dispatcher config file (as `relay-dispatcher --config`
    /// reads) whose HTTP front, registry and admin listeners this server also serves;
    /// calls for tunnel ids whose streams this server holds skip a process and a network
    /// hop. List the front's registry in `dispatchers` so it hears of this server. Off
    /// (none) by default.
    pub front_config: Option<PathBuf>,
    /// Not a config key: whose CPU time is this server's load (`crate::load`). The whole
    /// process, unless a program that embeds several servers in one process says which
    /// threads belong to which.
    #[serde(skip)]
    pub cpu_source: crate::load::CpuSource,
}

/// The transport of each hop, checked: `None` is plain text (`insecure = true`).
#[derive(Clone, Debug)]
pub struct Transport {
    pub agent: Option<ServerTls>,
    pub forward: Option<ServerTls>,
    pub dispatchers: Option<ClientTls>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            server_id: String::new(),
            zone: "local".into(),
            agent_listen: ([127, 0, 0, 1], 8441).into(),
            forward_listen: ([127, 0, 0, 1], 8451).into(),
            admin_listen: ([127, 0, 0, 1], 9441).into(),
            worker_threads: None,
            forward_url: None,
            direct_url: None,
            dispatchers: vec!["http://127.0.0.1:8460".into()],
            dispatcher_key: None,
            token_store: None,
            heartbeat: Duration::from_secs(10),
            heartbeat_misses: 3,
            liveness_interval: Duration::from_millis(750),
            liveness_timeout: Duration::from_secs(2),
            queue_timeout: Duration::from_secs(5),
            max_queue_per_tunnel: 1024,
            queue_handshake_after: Duration::ZERO,
            max_streams_per_token: 1024,
            max_opens_in_progress: DEFAULT_MAX_OPENS_IN_PROGRESS,
            report_interval: Duration::from_secs(1),
            shutdown_grace: Duration::from_secs(30),
            max_frame_bytes: DEFAULT_MAX_FRAME_BYTES,
            max_response_headers: HeadLimits::DEFAULT.max_headers,
            max_response_header_bytes: HeadLimits::DEFAULT.max_bytes,
            agent_tls: ListenerTls::default(),
            forward_tls: ListenerTls::default(),
            dispatcher_tls: DialerTls::default(),
            agent_h2: H2Settings::default(),
            forward_h2: H2Settings::default(),
            dispatcher_h2: H2Settings::default(),
            reload_interval: Duration::from_secs(5),
            agent_limits: ListenerLimits::default(),
            front_config: None,
            cpu_source: crate::load::CpuSource::Process,
        }
    }
}

pub use relay_proto::DEFAULT_MAX_FRAME_BYTES;

/// The default of `max_opens_in_progress`.
pub const DEFAULT_MAX_OPENS_IN_PROGRESS: usize = 64;

impl Config {
    /// Plain text on every hop (`insecure = true` on each TLS section): tests and the
    /// local example.
    pub fn insecure(mut self) -> Self {
        self.agent_tls = ListenerTls::insecure();
        self.forward_tls = ListenerTls::insecure();
        self.dispatcher_tls = DialerTls::insecure();
        self
    }

    /// Checks the TLS sections and the URL schemes they govern.
    pub fn transport(&self) -> Result<Transport, ConfigError> {
        let agent = self.agent_tls.resolve("agent_tls", ClientCerts::Optional)?;
        let forward = self
            .forward_tls
            .resolve("forward_tls", ClientCerts::Required)?;
        // A dispatcher's certificate is its whole authentication here.
        self.forward_tls.require_pinned("forward_tls", None)?;
        let dispatchers = if self.dispatchers.is_empty() {
            None
        } else {
            for (i, d) in self.dispatchers.iter().enumerate() {
                self.dispatcher_tls
                    .check_url("dispatcher_tls", &format!("dispatchers[{i}]"), d)?;
            }
            self.dispatcher_tls
                .resolve("dispatcher_tls", ClientCerts::Required)?
        };
        if let Some(u) = &self.direct_url {
            let https = u.starts_with("https://");
            if https != agent.is_some() {
                return Err(ConfigError::invalid(
                    "direct_url",
                    if https {
                        "is https:// but [agent_tls] says insecure = true"
                    } else {
                        "is plain http:// but the agent listener serves TLS ([agent_tls]); use https://"
                    },
                ));
            }
        }
        if let Some(u) = &self.forward_url {
            let https = u.starts_with("https://");
            if https != forward.is_some() {
                return Err(ConfigError::invalid(
                    "forward_url",
                    if https {
                        "is https:// but [forward_tls] says insecure = true"
                    } else {
                        "is plain http:// but the forward listener serves TLS ([forward_tls]); use https://"
                    },
                ));
            }
        }
        Ok(Transport {
            agent,
            forward,
            dispatchers,
        })
    }

    /// The agent listener's HTTP/2 limits (validated by [`Config::validate`]).
    pub fn agent_h2(&self) -> Result<H2Limits, ConfigError> {
        self.agent_h2.resolve(H2Limits::TUNNEL, "agent_h2")
    }

    /// The forward listener's HTTP/2 limits.
    pub fn forward_h2(&self) -> Result<H2Limits, ConfigError> {
        self.forward_h2.resolve(H2Limits::FORWARD, "forward_h2")
    }

    /// The report streams' HTTP/2 limits.
    pub fn dispatcher_h2(&self) -> Result<H2Limits, ConfigError> {
        self.dispatcher_h2
            .resolve(H2Limits::REGISTRY, "dispatcher_h2")
    }

    /// `max_response_headers` and `max_response_header_bytes` as one value.
    pub fn response_head_limits(&self) -> HeadLimits {
        HeadLimits::new(self.max_response_headers, self.max_response_header_bytes)
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        relay_common::runtime::check(self.worker_threads)?;
        self.transport()?;
        self.agent_h2()?;
        self.forward_h2()?;
        self.dispatcher_h2()?;
        self.agent_limits.validate("agent_limits")?;
        for (key, value) in [("server_id", &self.server_id), ("zone", &self.zone)] {
            if !value.is_empty() && !relay_common::server_id::is_valid(value) {
                return Err(ConfigError::invalid(
                    key,
                    format!(
                        "{value:?} is not {} (dispatchers refuse it)",
                        relay_common::server_id::RULE
                    ),
                ));
            }
        }
        relay_proto::check_max_frame_bytes(self.max_frame_bytes)
            .map_err(|m| ConfigError::invalid("max_frame_bytes", m))?;
        self.response_head_limits()
            .validate()
            .map_err(|e| ConfigError::invalid(e.key, e.message))?;
        if self.reload_interval < Duration::from_millis(10) {
            return Err(ConfigError::invalid(
                "reload_interval",
                "must be at least 10ms",
            ));
        }
        if self.heartbeat < Duration::from_millis(10) {
            return Err(ConfigError::invalid("heartbeat", "must be at least 10ms"));
        }
        if !self.liveness_interval.is_zero() {
            if self.liveness_interval < Duration::from_millis(100) {
                return Err(ConfigError::invalid(
                    "liveness_interval",
                    "must be 0s (off) or at least 100ms",
                ));
            }
            if self.liveness_timeout < Duration::from_millis(100) {
                return Err(ConfigError::invalid(
                    "liveness_timeout",
                    "must be at least 100ms",
                ));
            }
        }
        if self.heartbeat_misses == 0 {
            return Err(ConfigError::invalid(
                "heartbeat_misses",
                "must be at least 1",
            ));
        }
        if self.max_streams_per_token == 0 {
            return Err(ConfigError::invalid(
                "max_streams_per_token",
                "must be at least 1",
            ));
        }
        if !(1..=relay_common::listen::admission::MAX_PLACES).contains(&self.max_opens_in_progress)
        {
            return Err(ConfigError::invalid(
                "max_opens_in_progress",
                format!(
                    "must be 1 to {}, got {}",
                    relay_common::listen::admission::MAX_PLACES,
                    self.max_opens_in_progress
                ),
            ));
        }
        if self.report_interval < Duration::from_millis(10) {
            return Err(ConfigError::invalid(
                "report_interval",
                "must be at least 10ms",
            ));
        }
        for (i, d) in self.dispatchers.iter().enumerate() {
            if !(d.starts_with("http://") || d.starts_with("https://")) {
                return Err(ConfigError::invalid(
                    format!("dispatchers[{i}]"),
                    format!("`{d}` is not an http:// or https:// URL"),
                ));
            }
        }
        if let Some(u) = &self.forward_url {
            if !(u.starts_with("http://") || u.starts_with("https://")) {
                return Err(ConfigError::invalid(
                    "forward_url",
                    "must be an http:// or https:// URL",
                ));
            }
        }
        if let Some(u) = &self.direct_url {
            let ok = u
                .parse::<tonic::codegen::http::Uri>()
                .ok()
                .is_some_and(|u| {
                    matches!(u.scheme_str(), Some("http" | "https")) && u.host().is_some()
                });
            if !ok {
                return Err(ConfigError::invalid(
                    "direct_url",
                    format!("`{u}` is not an http:// or https:// URL with a host"),
                ));
            }
        }
        Ok(())
    }

    /// The server id, or the default: the host name and the agent listener's address
    /// (`ts-pod-7-8441` when listening on every address, `ts-pod-7-10.0.0.5-8441` on one),
    /// unique across replicas on different hosts and on one host.
    pub fn effective_server_id(&self, agent_addr: SocketAddr) -> String {
        if !self.server_id.is_empty() {
            return self.server_id.clone();
        }
        let host = host_name();
        if agent_addr.ip().is_unspecified() {
            format!("{host}-{}", agent_addr.port())
        } else {
            format!("{host}-{}-{}", agent_addr.ip(), agent_addr.port())
        }
    }
}

/// This machine's host name (the kernel's), or `tunnel` when it cannot be read.
fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "tunnel".to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    #[test]
    fn a_server_id_or_zone_a_dispatcher_would_refuse_is_a_config_error_naming_the_key() {
        for (server_id, zone, key) in [("ts 1", "eu", "server_id"), ("ts-1", "eu\nwest", "zone")] {
            let c = Config {
                server_id: server_id.into(),
                zone: zone.into(),
                ..Config::default()
            }
            .insecure();
            let err = c.validate().unwrap_err().to_string();
            assert!(err.contains(key), "{err}");
        }
        let ok = Config {
            server_id: "ts-1".into(),
            zone: "eu-west".into(),
            ..Config::default()
        }
        .insecure();
        let err = ok
            .validate()
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(!err.contains("server_id") && !err.contains("zone"), "{err}");
    }

    #[test]
    fn max_opens_in_progress_out_of_range_is_refused_naming_the_key() {
        for bad in [0, relay_common::listen::admission::MAX_PLACES + 1] {
            let c = Config {
                max_opens_in_progress: bad,
                ..Config::default()
            }
            .insecure();
            let err = c.validate().unwrap_err().to_string();
            assert!(err.contains("max_opens_in_progress"), "{err}");
        }
        let ok = Config {
            max_opens_in_progress: 1,
            ..Config::default()
        }
        .insecure();
        let err = ok
            .validate()
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(!err.contains("max_opens_in_progress"), "{err}");
    }

    #[test]
    fn default_server_ids_of_replicas_on_one_port_differ() {
        let c = Config::default();
        let a = c.effective_server_id("127.0.0.1:8441".parse().unwrap());
        let b = c.effective_server_id("127.0.0.2:8441".parse().unwrap());
        assert_ne!(a, b, "two replicas on one port number must not share an id");
        assert!(a.starts_with(&host_name()), "{a}");
        let any = c.effective_server_id("0.0.0.0:8441".parse().unwrap());
        assert_eq!(any, format!("{}-8441", host_name()));
        let named = Config {
            server_id: "ts-1".into(),
            ..Config::default()
        };
        assert_eq!(
            named.effective_server_id("0.0.0.0:1".parse().unwrap()),
            "ts-1"
        );
    }

    #[test]
    fn example_configs_are_valid() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples");
        for (file, tls) in [
            ("local/tunnel-server-1.toml", false),
            ("local/tunnel-server-2.toml", false),
            ("colocated/tunnel-server.toml", false),
            ("tls/tunnel-server-1.toml", true),
            ("tls/tunnel-server-2.toml", true),
        ] {
            let c: Config = relay_common::config::load(Some(&root.join(file)))
                .unwrap_or_else(|e| panic!("{file}: {e}"));
            c.validate().unwrap_or_else(|e| panic!("{file}: {e}"));
            let t = c.transport().unwrap();
            assert_eq!(
                (
                    t.agent.is_some(),
                    t.forward.is_some(),
                    t.dispatchers.is_some()
                ),
                (tls, tls, tls),
                "{file}"
            );
            if let Some(front) = &c.front_config {
                // Relative to the repository root, where the examples run.
                let front = root.join("..").join(front);
                let d: relay_dispatcher::Config = relay_common::config::load(Some(&front))
                    .unwrap_or_else(|e| panic!("{file}'s front_config: {e}"));
                d.validate()
                    .unwrap_or_else(|e| panic!("{file}'s front_config: {e}"));
            }
        }
    }

    #[test]
    fn response_head_limits_have_defaults_and_are_checked() {
        let c: Config = relay_common::config::parse(
            "max_response_headers = 64\n[agent_tls]\ninsecure = true\n[forward_tls]\ninsecure = true\n[dispatcher_tls]\ninsecure = true\n",
            Path::new("t.toml"),
        )
        .unwrap();
        assert_eq!(
            (c.max_response_headers, c.max_response_header_bytes),
            (64, 64 * 1024)
        );
        c.validate().unwrap();
        let mut bad = c.clone();
        bad.max_response_headers = 0;
        let err = bad.validate().unwrap_err().to_string();
        assert!(err.contains("`max_response_headers`"), "{err}");
        let mut bad = c;
        bad.max_response_header_bytes = 100;
        let err = bad.validate().unwrap_err().to_string();
        assert!(err.contains("`max_response_header_bytes`"), "{err}");
    }

    #[test]
    fn every_hop_needs_tls_or_an_explicit_insecure() {
        let err = Config::default().validate().unwrap_err().to_string();
        assert!(
            err.contains("`agent_tls`") && err.contains("insecure = true"),
            "{err}"
        );
        let mut c = Config::default().insecure();
        c.validate().unwrap();
        c.forward_tls = ListenerTls {
            cert: Some("s.pem".into()),
            key: Some("s.key".into()),
            ..Default::default()
        };
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("`forward_tls.client_ca`"), "{err}");
        c.forward_tls.client_ca = Some("ca.pem".into());
        // Mutual TLS pins the dispatchers' certificates by name.
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("`forward_tls.client_names`"), "{err}");
        c.forward_tls.client_names = vec!["dispatcher".into()];
        c.forward_url = Some("http://ts-1:8451".into());
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("`forward_url`"), "{err}");
        c.forward_url = None;
        // The direct URL's scheme follows the agent listener (plain text here).
        c.direct_url = Some("https://ts-1:8441".into());
        let err = c.transport().unwrap_err().to_string();
        assert!(
            err.contains("`direct_url`") && err.contains("insecure"),
            "{err}"
        );
        c.direct_url = Some("http://ts-1:8441".into());
        c.transport().unwrap();
        c.direct_url = None;
        c.dispatchers = vec!["https://d:8460".into()];
        let err = c.validate().unwrap_err().to_string();
        assert!(
            err.contains("`dispatchers[0]`") && err.contains("insecure"),
            "{err}"
        );
        c.dispatcher_tls = DialerTls {
            ca: Some("ca.pem".into()),
            ..Default::default()
        };
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("`dispatcher_tls.cert`"), "{err}");
        c.dispatchers = vec![];
        c.validate().unwrap();
    }
}
