//! `[front_limits]`: what the HTTP front spends on a connection beyond its calls.

use serde::Deserialize;
use std::time::Duration;

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
