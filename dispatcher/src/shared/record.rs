//! Sealing and checking the records of the shared registry.
//!
//! Every record a dispatcher writes to Redis is sealed with an HMAC-SHA256 under
//! `[registry] record_key`, which every dispatcher sharing the key prefix holds. The value
//! stored at `<prefix>:server:<server_id>` is `v1.<hex mac>.<body>`, where `<body>` is the
//! JSON `{"expires_unix_ms": .., "record": {..}}` and the MAC covers a fixed label, the
//! Redis key the value is stored under and the body. So a record written by anyone without
//! the key, edited, moved to another server's key or replayed after its expiry does not
//! open. A sealed record is then checked field by field ([`RecordRules::open`]): the server
//! id (syntax, the key it was read from, `allowed_servers`), every tunnel id, the
//! `forward_url` (the scheme `[forward_tls]` dials, a host allowed by `forward_hosts`), the
//! other strings' sizes, and the number of tunnel ids.
//!
//! Expiry is wall-clock time (`SystemTime`): the dispatchers' clocks must agree to well
//! within the lease, or the reader refuses fresh records as `expired` (counted, so it
//! shows).
//!
//! This module does no I/O and keeps no state.

use crate::registry::ServerRecord;
use relay_common::hosts::{Host, HostRule};
use ring::hmac;
use serde::{Deserialize, Serialize};
use std::net::IpAddr;

/// Largest record value read (bytes); a bigger one is refused, read no further.
pub const MAX_RECORD_BYTES: usize = 4 << 20;
/// Most record bytes read in one refresh; the records after them are refused.
pub const MAX_READ_BYTES: usize = 128 << 20;
/// Most tunnel ids in one record (its tunnel list and its load figures each).
pub const MAX_TUNNELS_PER_RECORD: usize = 100_000;
/// Most server ids read from the set `<prefix>:servers` (first by name); the rest are
/// refused.
pub const MAX_SHARED_SERVERS: usize = 1024;
/// Longest server id, zone, instance id or dispatcher name in a record.
const MAX_NAME_BYTES: usize = 256;
/// Longest URL in a record.
const MAX_URL_BYTES: usize = 2048;

/// What the MAC covers before the Redis key and the body (a version and a purpose, so a
/// MAC made under the same key for anything else never opens a record).
const LABEL: &[u8] = b"relay-registry-record-v1\n";
const PREFIX: &str = "v1.";

/// Why a record read from Redis was refused: the `reason` label of
/// `relay_dispatcher_registry_records_refused_total`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// Not a sealed record at all (written by something else than a dispatcher).
    #[error("not a sealed record")]
    Unsealed,
    /// The seal does not verify: another key, an edited record, or a record moved to
    /// another server's key.
    #[error(
        "seal does not verify (another record_key, an edited record, or another server's record)"
    )]
    BadSeal,
    /// Sealed, but past its expiry: a replayed old record.
    #[error("expired {0} ms ago")]
    Expired(u64),
    /// Sealed, but not a record this dispatcher understands.
    #[error("malformed: {0}")]
    Malformed(String),
    #[error("server id: {0}")]
    ServerId(String),
    #[error("tunnel id {0:?} is not valid")]
    TunnelId(String),
    #[error("forward_url: {0}")]
    ForwardUrl(String),
    #[error("too large: {0}")]
    TooLarge(String),
    #[error("more than {MAX_SHARED_SERVERS} servers listed")]
    TooManyServers,
}

/// Every `reason` label value, exported at zero from the start.
pub const REFUSAL_REASONS: [&str; 9] = [
    "unsealed",
    "bad_seal",
    "expired",
    "malformed",
    "server_id",
    "tunnel_id",
    "forward_url",
    "too_large",
    "too_many_servers",
];

impl Refusal {
    /// The metric label.
    pub fn reason(&self) -> &'static str {
        match self {
            Refusal::Unsealed => "unsealed",
            Refusal::BadSeal => "bad_seal",
            Refusal::Expired(_) => "expired",
            Refusal::Malformed(_) => "malformed",
            Refusal::ServerId(_) => "server_id",
            Refusal::TunnelId(_) => "tunnel_id",
            Refusal::ForwardUrl(_) => "forward_url",
            Refusal::TooLarge(_) => "too_large",
            Refusal::TooManyServers => "too_many_servers",
        }
    }
}

pub use relay_common::server_id::is_valid as valid_server_id;

#[derive(Serialize)]
struct BodyRef<'a> {
    expires_unix_ms: u64,
    record: &'a ServerRecord,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Body {
    expires_unix_ms: u64,
    record: ServerRecord,
}

/// The key and the checks of shared records. See the module docs.
pub struct RecordRules {
    key: hmac::Key,
    allowed_servers: Vec<String>,
    /// `https` when `[forward_tls]` dials TLS, else `http`.
    forward_scheme: &'static str,
    forward_hosts: Vec<HostRule>,
}

impl RecordRules {
    /// `forward_tls`: whether `[forward_tls]` dials TLS. `forward_hosts` were checked by
    /// config validation; an entry that does not parse is an error here too.
    pub fn new(
        key: &[u8],
        allowed_servers: Vec<String>,
        forward_tls: bool,
        forward_hosts: &[String],
    ) -> Result<RecordRules, String> {
        Ok(RecordRules {
            key: hmac::Key::new(hmac::HMAC_SHA256, key),
            allowed_servers,
            forward_scheme: if forward_tls { "https" } else { "http" },
            forward_hosts: forward_hosts
                .iter()
                .map(|h| HostRule::parse(h))
                .collect::<Result<_, _>>()?,
        })
    }

    /// What the MAC covers.
    fn message(redis_key: &str, body: &str) -> Vec<u8> {
        [LABEL, redis_key.as_bytes(), b"\n", body.as_bytes()].concat()
    }

    /// The value to store at `redis_key` for `record`, valid until `expires_unix_ms`.
    pub fn seal(&self, redis_key: &str, record: &ServerRecord, expires_unix_ms: u64) -> String {
        let body = serde_json::to_string(&BodyRef {
            expires_unix_ms,
            record,
        })
        .unwrap_or_default();
        let tag = hmac::sign(&self.key, &Self::message(redis_key, &body));
        format!("{PREFIX}{}.{body}", hex::encode(tag.as_ref()))
    }

    /// Whether a server id listed in the set may be read at all.
    pub fn check_server_id(&self, id: &str) -> Result<(), Refusal> {
        if !valid_server_id(id) {
            return Err(Refusal::ServerId(format!(
                "{id:?} is not 1 to {MAX_NAME_BYTES} bytes of printable ASCII"
            )));
        }
        if !self.allowed_servers.is_empty() && !self.allowed_servers.iter().any(|a| a == id) {
            return Err(Refusal::ServerId(format!(
                "{id:?} is not in registry.allowed_servers"
            )));
        }
        Ok(())
    }

    /// Opens and checks the value read from `redis_key`, listed as `server_id`, at wall
    /// time `now_unix_ms`.
    pub fn open(
        &self,
        redis_key: &str,
        server_id: &str,
        value: &str,
        now_unix_ms: u64,
    ) -> Result<ServerRecord, Refusal> {
        self.check_server_id(server_id)?;
        if value.len() > MAX_RECORD_BYTES {
            return Err(Refusal::TooLarge(format!(
                "{} bytes (at most {MAX_RECORD_BYTES})",
                value.len()
            )));
        }
        let (mac, body) = value
            .strip_prefix(PREFIX)
            .and_then(|rest| rest.split_once('.'))
            .ok_or(Refusal::Unsealed)?;
        let mac = hex::decode(mac).map_err(|_| Refusal::BadSeal)?;
        // Constant time.
        hmac::verify(&self.key, &Self::message(redis_key, body), &mac)
            .map_err(|_| Refusal::BadSeal)?;
        let body: Body =
            serde_json::from_str(body).map_err(|e| Refusal::Malformed(e.to_string()))?;
        if body.expires_unix_ms <= now_unix_ms {
            return Err(Refusal::Expired(now_unix_ms - body.expires_unix_ms));
        }
        let r = body.record;
        if r.info.server_id != server_id {
            return Err(Refusal::ServerId(format!(
                "the record names {:?}, listed as {server_id:?}",
                r.info.server_id
            )));
        }
        self.check_fields(&r)?;
        Ok(r)
    }

    fn check_fields(&self, r: &ServerRecord) -> Result<(), Refusal> {
        let name_ok =
            |s: &str| s.len() <= MAX_NAME_BYTES && !s.bytes().any(|b| b.is_ascii_control());
        for (what, s) in [
            ("zone", &r.info.zone),
            ("instance_id", &r.info.instance_id),
            ("dispatcher", &r.dispatcher),
        ] {
            if !name_ok(s) {
                return Err(Refusal::Malformed(format!(
                    "{what} is longer than {MAX_NAME_BYTES} bytes or holds control characters"
                )));
            }
        }
        let tunnels_in_load = r.load.as_ref().map(|l| l.tunnels.len()).unwrap_or(0);
        if r.tunnels.len() > MAX_TUNNELS_PER_RECORD || tunnels_in_load > MAX_TUNNELS_PER_RECORD {
            return Err(Refusal::TooLarge(format!(
                "more than {MAX_TUNNELS_PER_RECORD} tunnel ids"
            )));
        }
        let load_ids = r.load.iter().flat_map(|l| l.tunnels.keys());
        if let Some(bad) = r
            .tunnels
            .iter()
            .chain(load_ids)
            .find(|t| !relay_common::tunnel_id::is_valid(t))
        {
            return Err(Refusal::TunnelId(
                bad.chars().take(MAX_NAME_BYTES).collect(),
            ));
        }
        self.check_forward_url(&r.info.forward_url)?;
        let direct = &r.info.direct_url;
        let direct_ok = direct.is_empty()
            || (direct.len() <= MAX_URL_BYTES
                && direct.parse::<http::Uri>().ok().is_some_and(|u| {
                    matches!(u.scheme_str(), Some("http" | "https")) && u.host().is_some()
                }));
        if !direct_ok {
            return Err(Refusal::Malformed(
                "direct_url is not an http(s) URL with a host".into(),
            ));
        }
        Ok(())
    }

    fn check_forward_url(&self, url: &str) -> Result<(), Refusal> {
        if url.len() > MAX_URL_BYTES {
            return Err(Refusal::ForwardUrl(format!(
                "longer than {MAX_URL_BYTES} bytes"
            )));
        }
        let uri: http::Uri = url
            .parse()
            .map_err(|_| Refusal::ForwardUrl(format!("{url:?} is not a URL")))?;
        if uri.scheme_str() != Some(self.forward_scheme) {
            return Err(Refusal::ForwardUrl(format!(
                "{url:?}: the scheme must be {}:// (as [forward_tls] dials)",
                self.forward_scheme
            )));
        }
        let Some(host) = uri.host() else {
            return Err(Refusal::ForwardUrl(format!("{url:?} has no host")));
        };
        let bare = host.trim_start_matches('[').trim_end_matches(']');
        let host = match bare.parse::<IpAddr>() {
            Ok(ip) => Host::Ip(ip),
            Err(_) => Host::Name(bare.to_ascii_lowercase()),
        };
        if !self.forward_hosts.iter().any(|r| r.allows(&host)) {
            return Err(Refusal::ForwardUrl(format!(
                "{url:?}: the host is not allowed by registry.forward_hosts"
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
