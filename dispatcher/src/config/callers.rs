//! `[[callers]]`: the backends allowed to call the dispatcher, each with its key, the
//! tunnel ids it may reach and its concurrency bounds.

use relay_common::KeyDigest;
use serde::Deserialize;

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
