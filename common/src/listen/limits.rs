//! What a listener is held to: [`ListenerLimits`] (a TOML section such as the tunnel
//! server's `[agent_limits]`, with its defaults and its validation) and the source
//! addresses they count by ([`SourceNet`] for `proxy_protocol`, [`source_key`]).

use serde::Deserialize;
use std::net::{IpAddr, Ipv6Addr};
use std::time::Duration;

/// An entry of `proxy_protocol`: an address (`10.0.0.5`) or a range (`10.0.0.0/24`).
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(try_from = "String")]
pub struct SourceNet {
    addr: IpAddr,
    len: u8,
}

impl TryFrom<String> for SourceNet {
    type Error = String;

    fn try_from(s: String) -> Result<Self, String> {
        s.parse()
    }
}

impl std::str::FromStr for SourceNet {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let (ip, len) = match s.split_once('/') {
            Some((ip, len)) => (ip, Some(len)),
            None => (s, None),
        };
        let addr: IpAddr = ip
            .trim()
            .parse()
            .map_err(|_| format!("{s:?} is not an address or an address range (10.0.0.0/24)"))?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let len = match len {
            None => max,
            Some(l) => l
                .trim()
                .parse::<u8>()
                .ok()
                .filter(|l| *l <= max)
                .ok_or_else(|| format!("{s:?}: prefix length must be 0 to {max}"))?,
        };
        Ok(SourceNet { addr, len })
    }
}

impl SourceNet {
    pub fn contains(&self, ip: IpAddr) -> bool {
        let ip = canonical(ip);
        match (self.addr, ip) {
            (IpAddr::V4(n), IpAddr::V4(a)) => {
                let mask = u32::MAX.checked_shl(32 - u32::from(self.len)).unwrap_or(0);
                u32::from(n) & mask == u32::from(a) & mask
            }
            (IpAddr::V6(n), IpAddr::V6(a)) => {
                let mask = u128::MAX
                    .checked_shl(128 - u32::from(self.len))
                    .unwrap_or(0);
                u128::from(n) & mask == u128::from(a) & mask
            }
            _ => false,
        }
    }
}

/// An IPv4-mapped IPv6 address as the IPv4 address it is.
pub(super) fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}

/// What per-source limits count a peer as: its IPv4 address, or its IPv6 /64 (one host
/// commonly holds a whole /64).
pub fn source_key(ip: IpAddr) -> IpAddr {
    match canonical(ip) {
        IpAddr::V6(v6) => {
            let s = v6.segments();
            IpAddr::V6(Ipv6Addr::new(s[0], s[1], s[2], s[3], 0, 0, 0, 0))
        }
        v4 => v4,
    }
}

/// Limits of one listener. A TOML section such as the tunnel server's `[agent_limits]`;
/// every key is optional. The defaults are the agent listener's.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ListenerLimits {
    /// Connections open at once; one more is closed at accept.
    pub max_connections: usize,
    /// Connections open at once from one source (IPv4 address or IPv6 /64), so one host
    /// cannot take `max_connections` from everyone else (0: no cap).
    pub max_connections_per_source: usize,
    /// TLS handshakes the server works on at once; more wait (within
    /// `handshake_timeout`).
    pub max_handshakes: usize,
    /// Longest from accept to a finished TLS handshake.
    #[serde(with = "humantime_serde")]
    pub handshake_timeout: Duration,
    /// Longest from the handshake (plain: the accept) to the bytes that tell the
    /// connection's protocol; also bounds the PROXY header from the accept (0: no bound).
    #[serde(with = "humantime_serde")]
    pub first_byte_timeout: Duration,
    /// A connection that holds no request or stream this long is closed (0: never). Only
    /// listeners whose server marks its requests apply it.
    #[serde(with = "humantime_serde")]
    pub idle_timeout: Duration,
    /// A connection with no authenticated stream this long after accept is closed
    /// (0: never). Only listeners that authenticate per stream apply it.
    #[serde(with = "humantime_serde")]
    pub auth_timeout: Duration,
    /// Refused authentications one source may cause per `auth_failure_window` before its
    /// connections are closed until the window ends (0: no budget).
    pub auth_failures: u32,
    #[serde(with = "humantime_serde")]
    pub auth_failure_window: Duration,
    /// Connections that carried an authenticated stream of one tunnel id; a stream of it
    /// on one more connection is refused (0: no cap). Only listeners that authenticate
    /// per stream apply it.
    pub max_connections_per_token: usize,
    /// Bytes of half-received gRPC messages held across all the listener's streams; a
    /// stream whose message would pass it is ended (0: no bound). Only gRPC listeners
    /// apply it.
    pub max_partial_frame_bytes: usize,
    /// Load balancer addresses or ranges whose connections start with a PROXY protocol
    /// header (v1 or v2) naming the real client; connections from them without one are
    /// closed. Empty: no peer's header is read.
    pub proxy_protocol: Vec<SourceNet>,
}

impl Default for ListenerLimits {
    fn default() -> Self {
        ListenerLimits {
            max_connections: 20_000,
            max_connections_per_source: 4_096,
            max_handshakes: 256,
            handshake_timeout: Duration::from_secs(10),
            first_byte_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(60),
            auth_timeout: Duration::from_secs(10),
            auth_failures: 30,
            auth_failure_window: Duration::from_secs(60),
            max_connections_per_token: 64,
            max_partial_frame_bytes: 64 << 20,
            proxy_protocol: Vec::new(),
        }
    }
}

impl ListenerLimits {
    /// Limits of a listener whose peers are the relay's own processes, authenticated by
    /// TLS or per request (the forward and registry listeners): the same connection,
    /// handshake and first-byte bounds; no per-source or per-token cap, idle timeout,
    /// `auth_timeout` or budget.
    pub fn without_auth() -> Self {
        ListenerLimits {
            max_connections_per_source: 0,
            idle_timeout: Duration::ZERO,
            auth_timeout: Duration::ZERO,
            auth_failures: 0,
            max_connections_per_token: 0,
            max_partial_frame_bytes: 0,
            ..ListenerLimits::default()
        }
    }

    /// The admin listener's (every binary's `admin_listen`): a few operators and
    /// Prometheus, so few connections, and idle ones closed.
    pub fn admin() -> Self {
        ListenerLimits {
            max_connections: 256,
            idle_timeout: Duration::from_secs(120),
            ..ListenerLimits::without_auth()
        }
    }

    /// Checks the values; the error names the key under `section`.
    pub fn validate(&self, section: &str) -> Result<(), crate::config::ConfigError> {
        use crate::config::ConfigError;
        let key = |k: &str| format!("{section}.{k}");
        if self.max_connections == 0 {
            return Err(ConfigError::invalid(
                key("max_connections"),
                "must be at least 1",
            ));
        }
        if self.max_handshakes == 0 {
            return Err(ConfigError::invalid(
                key("max_handshakes"),
                "must be at least 1",
            ));
        }
        if self.handshake_timeout < Duration::from_millis(100) {
            return Err(ConfigError::invalid(
                key("handshake_timeout"),
                "must be at least 100ms",
            ));
        }
        for (k, v) in [
            ("first_byte_timeout", self.first_byte_timeout),
            ("idle_timeout", self.idle_timeout),
            ("auth_timeout", self.auth_timeout),
        ] {
            if !v.is_zero() && v < Duration::from_millis(100) {
                return Err(ConfigError::invalid(
                    key(k),
                    "must be 0 (off) or at least 100ms",
                ));
            }
        }
        if self.auth_failures > 0 && self.auth_failure_window.is_zero() {
            return Err(ConfigError::invalid(
                key("auth_failure_window"),
                "must be greater than zero when auth_failures is set",
            ));
        }
        if self.max_partial_frame_bytes > 0 && self.max_partial_frame_bytes < 64 << 10 {
            return Err(ConfigError::invalid(
                key("max_partial_frame_bytes"),
                "must be 0 (no bound) or at least 65536 (one body chunk)",
            ));
        }
        if !self.proxy_protocol.is_empty() && self.first_byte_timeout.is_zero() {
            return Err(ConfigError::invalid(
                key("first_byte_timeout"),
                "must be set when proxy_protocol is: it bounds the wait for the header",
            ));
        }
        Ok(())
    }
}
