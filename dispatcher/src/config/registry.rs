//! `[registry]`: where the routing table is kept (memory or Redis) and who may feed it,
//! and its checks.

use super::Config;
use relay_common::config::ConfigError;
use relay_common::{KeyDigest, Secret};
use serde::Deserialize;
use std::time::Duration;

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

impl Config {
    pub(super) fn validate_registry(&self) -> Result<(), ConfigError> {
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
