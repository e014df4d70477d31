//! The listener counters of one process ([`ListenerMetrics`]) and the refusal reasons
//! they count.

use prometheus::{IntCounterVec, IntGaugeVec, Opts, Registry};

/// The listener counters of one process (every listener adds its `listener` label).
#[derive(Clone)]
pub struct ListenerMetrics {
    pub(super) refused: IntCounterVec,
    pub(super) by_source: IntCounterVec,
    pub(super) open: IntGaugeVec,
    pub(super) partial: IntGaugeVec,
}

impl ListenerMetrics {
    pub fn register(registry: &Registry) -> prometheus::Result<Self> {
        let m = Self::detached()?;
        registry.register(Box::new(m.refused.clone()))?;
        registry.register(Box::new(m.by_source.clone()))?;
        registry.register(Box::new(m.open.clone()))?;
        registry.register(Box::new(m.partial.clone()))?;
        Ok(m)
    }

    /// Counters in no registry (for a listener whose process registered its own).
    pub fn detached() -> prometheus::Result<Self> {
        let refused = IntCounterVec::new(
            Opts::new(
                "relay_listener_refused_total",
                "Connections (or, for token_connections and partial_frames, streams) closed \
                 before or instead of serving: reason max_connections, source_connections, \
                 source_blocked, proxy_header, handshake_failed, handshake_timeout, \
                 first_byte_timeout, idle_timeout, auth_timeout, auth_budget, \
                 token_connections, partial_frames",
            ),
            &["listener", "reason"],
        )?;
        let by_source = IntCounterVec::new(
            Opts::new(
                "relay_listener_source_refused_total",
                "Connections closed for their source (reason source_connections, \
                 source_blocked, auth_budget), by source: the real client behind a PROXY \
                 protocol load balancer; the first 64 sources by address, later ones as other",
            ),
            &["listener", "reason", "source"],
        )?;
        let open = IntGaugeVec::new(
            Opts::new(
                "relay_listener_connections",
                "Connections open per listener",
            ),
            &["listener"],
        )?;
        let partial = IntGaugeVec::new(
            Opts::new(
                "relay_listener_partial_frame_bytes",
                "Bytes of half-received gRPC messages the listener holds across its streams \
                 (bounded by max_partial_frame_bytes)",
            ),
            &["listener"],
        )?;
        Ok(ListenerMetrics {
            refused,
            by_source,
            open,
            partial,
        })
    }
}

pub(super) const REASONS: [&str; 12] = [
    "max_connections",
    "source_connections",
    "source_blocked",
    "proxy_header",
    "handshake_failed",
    "handshake_timeout",
    "first_byte_timeout",
    "idle_timeout",
    "auth_timeout",
    "auth_budget",
    "token_connections",
    "partial_frames",
];
