//! Typed configuration of the tunnel server, parsed from TOML once at start and
//! validated with errors that name the key.

use relay_common::config::ConfigError;
use relay_common::Secret;
use serde::Deserialize;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// Stable identity of this server; agents group their streams by it and the
    /// dispatcher routes by it. Defaults to `tunnel-<agent_listen port>`.
    pub server_id: String,
    /// Zone label sent to agents in ServerHello and to dispatchers.
    pub zone: String,
    /// Agent-facing gRPC listener (`Tunnel.Connect`).
    pub agent_listen: SocketAddr,
    /// Dispatcher-facing gRPC listener (`Forward.Call`).
    pub forward_listen: SocketAddr,
    /// Admin HTTP listener (`/metrics`, `/healthz`, `/readyz`).
    pub admin_listen: SocketAddr,
    /// URL dispatchers use to reach `forward_listen`; defaults to `http://<forward_listen>`.
    pub forward_url: Option<String>,
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
    /// Longest a call waits for an idle stream (its own deadline may be shorter).
    #[serde(with = "humantime_serde")]
    pub queue_timeout: Duration,
    /// Calls that may wait per tunnel id; more get "no capacity" at once.
    pub max_queue_per_tunnel: usize,
    /// Streams one tunnel id may hold on this server; more are refused with
    /// RESOURCE_EXHAUSTED.
    pub max_streams_per_token: usize,
    /// Period of the load report to dispatchers.
    #[serde(with = "humantime_serde")]
    pub report_interval: Duration,
    /// On shutdown, how long calls in flight may take to finish.
    #[serde(with = "humantime_serde")]
    pub shutdown_grace: Duration,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            server_id: String::new(),
            zone: "local".into(),
            agent_listen: ([127, 0, 0, 1], 8441).into(),
            forward_listen: ([127, 0, 0, 1], 8451).into(),
            admin_listen: ([127, 0, 0, 1], 9441).into(),
            forward_url: None,
            dispatchers: vec!["http://127.0.0.1:8460".into()],
            dispatcher_key: None,
            token_store: None,
            heartbeat: Duration::from_secs(10),
            heartbeat_misses: 3,
            queue_timeout: Duration::from_secs(5),
            max_queue_per_tunnel: 1024,
            max_streams_per_token: 1024,
            report_interval: Duration::from_secs(1),
            shutdown_grace: Duration::from_secs(30),
        }
    }
}

impl Config {
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.heartbeat < Duration::from_millis(10) {
            return Err(ConfigError::invalid("heartbeat", "must be at least 10ms"));
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
        Ok(())
    }

    /// The server id, or the default derived from the agent listener's port.
    pub fn effective_server_id(&self, agent_addr: SocketAddr) -> String {
        if self.server_id.is_empty() {
            format!("tunnel-{}", agent_addr.port())
        } else {
            self.server_id.clone()
        }
    }
}
