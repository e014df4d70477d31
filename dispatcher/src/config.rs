//! The dispatcher's typed configuration: TOML with `deny_unknown_fields`, every default
//! written once in `Default`, validated once at start by [`Config::validate`].
//!
//! This module only describes and checks settings; it must not open sockets or read files
//! (loading goes through `relay_common::config`).

use relay_common::config::ConfigError;
use relay_common::Secret;
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
    /// Backends allowed to call, each with its own key (`Authorization: Bearer <key>`).
    pub callers: Vec<CallerConfig>,
}

/// One backend allowed to call the dispatcher.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CallerConfig {
    /// Readable name, used in logs (never the key).
    pub name: String,
    /// The caller's bearer key; compared in constant time and never logged.
    pub key: Secret,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            registry_listen: SocketAddr::from(([127, 0, 0, 1], 8460)),
            admin_listen: SocketAddr::from(([127, 0, 0, 1], 9080)),
            call_timeout: Duration::from_secs(30),
            max_call_timeout: Duration::from_secs(300),
            shutdown_grace: Duration::from_secs(10),
            max_header_bytes: 64 * 1024,
            callers: Vec::new(),
        }
    }
}

/// Smallest `max_header_bytes` accepted: hyper's HTTP/1 read buffer cannot be smaller.
pub const MIN_HEADER_BYTES: usize = 8 * 1024;

impl Config {
    /// Checks the settings once at start; the error names the offending key.
    pub fn validate(&self) -> Result<(), ConfigError> {
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
        for (i, c) in self.callers.iter().enumerate() {
            if c.name.trim().is_empty() {
                return Err(ConfigError::invalid(
                    format!("callers[{i}].name"),
                    "must not be empty",
                ));
            }
            if c.key.is_empty() {
                return Err(ConfigError::invalid(
                    format!("callers[{i}].key"),
                    "must not be empty",
                ));
            }
            if self.callers[..i].iter().any(|o| o.name == c.name) {
                return Err(ConfigError::invalid(
                    format!("callers[{i}].name"),
                    "duplicate caller name",
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
            "#,
            Path::new("d.toml"),
        )
        .unwrap();
        assert_eq!(cfg.call_timeout, Duration::from_secs(5));
        assert_eq!(cfg.max_call_timeout, Duration::from_secs(60));
        assert_eq!(cfg.registry_listen, Config::default().registry_listen);
        assert_eq!(format!("{:?}", cfg.callers[0].key), "***");
        cfg.validate().unwrap();
    }

    #[test]
    fn unknown_key_and_bad_values_are_named() {
        let err = relay_common::config::parse::<Config>("listn = \"x\"", Path::new("d.toml"))
            .unwrap_err();
        assert!(err.to_string().contains("listn"), "{err}");
        let cfg = Config {
            max_call_timeout: Duration::from_secs(1),
            ..Config::default()
        };
        assert!(cfg
            .validate()
            .unwrap_err()
            .to_string()
            .contains("max_call_timeout"));
        let cfg = Config::default();
        assert!(cfg.validate().unwrap_err().to_string().contains("callers"));
    }
}
