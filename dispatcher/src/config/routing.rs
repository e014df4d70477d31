//! `[routing]`: how a server is chosen for each call, and its checks.

use relay_common::config::ConfigError;
use serde::Deserialize;
use std::time::Duration;

/// How a server is chosen for a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RoutingPolicy {
    /// The seed behaviour: the most recently announced healthy server. For comparison runs.
    Sticky,
    /// Sticky while the chosen server has idle streams; spills a share of calls to servers
    /// holding idle streams while it is saturated; prefers the lowest latency tier.
    Available,
}

/// `[routing]`: the server choice for each call.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RoutingConfig {
    /// `"available"` (default) or `"sticky"`.
    pub policy: RoutingPolicy,
    /// Retry idempotent methods (GET, HEAD, OPTIONS, PUT, DELETE) on another server when
    /// the call was lost after it may have reached an agent, as long as no response head
    /// went to the caller. Off by default: an upstream may not be as idempotent as its verb.
    pub retry_idempotent: bool,
    /// Servers one call may try (first attempt included).
    pub max_attempts: u32,
    /// Spill share added per routing step while the chosen server is saturated and another
    /// holds idle streams.
    pub spill_step: f64,
    /// Spill share removed per routing step once the chosen server has idle streams again.
    pub spill_decay: f64,
    /// Largest share of a tunnel id's new calls spilled away from its chosen server.
    pub spill_max: f64,
    /// Shortest time between two spill steps of one tunnel id (steps happen when reports
    /// arrive or on the routing tick, at most this often).
    #[serde(with = "humantime_serde")]
    pub step_interval: Duration,
    /// Group servers into latency tiers by the RTT they report and prefer the lowest tier
    /// with capacity. Off: every server counts as tier 0 (one zone, or RTTs that are noise).
    pub latency_tiers: bool,
    /// Latency tiers: how far past its group's bound a member may drift before it leaves
    /// the group, and how far inside a bound a server grouped elsewhere must come to join
    /// (fraction).
    pub tier_hysteresis: f64,
    /// Weigh the servers' own load (the smoothed CPU use they report): spill a share of a
    /// tunnel id's calls away from a home much busier than a peer, and give no new home to
    /// a server above `load_high_water`. Off: routing ignores the load (comparison runs).
    pub load_aware: bool,
    /// How much busier (CPU use, fraction) a home must be than a peer with idle streams
    /// for a share of its calls to spill there.
    pub load_margin: f64,
    /// CPU use (fraction) below which a home never spills for load, however idle a peer:
    /// it answers without waiting on its CPU, and moving calls would only split the
    /// batches its connections carry.
    pub load_floor: f64,
    /// CPU use (fraction) at or above which a server is given no new home while another
    /// with capacity is below it.
    pub load_high_water: f64,
}

impl Default for RoutingConfig {
    fn default() -> Self {
        RoutingConfig {
            policy: RoutingPolicy::Available,
            retry_idempotent: false,
            max_attempts: 3,
            spill_step: 0.05,
            spill_decay: 0.025,
            spill_max: 0.5,
            step_interval: Duration::from_millis(250),
            latency_tiers: true,
            tier_hysteresis: 0.2,
            load_aware: true,
            load_margin: 0.25,
            load_floor: 0.5,
            load_high_water: 0.9,
        }
    }
}

impl RoutingConfig {
    /// Checks every `[routing]` key; the error names it.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let r = self;
        let share = |v: f64| v.is_finite() && (0.0..=1.0).contains(&v);
        if !share(r.spill_max) || r.spill_max >= 1.0 {
            return Err(ConfigError::invalid(
                "routing.spill_max",
                "must be in [0, 1): the chosen server keeps some calls",
            ));
        }
        if !share(r.spill_step) || r.spill_step == 0.0 {
            return Err(ConfigError::invalid(
                "routing.spill_step",
                "must be in (0, 1]",
            ));
        }
        if !share(r.spill_decay) || r.spill_decay == 0.0 {
            return Err(ConfigError::invalid(
                "routing.spill_decay",
                "must be in (0, 1]",
            ));
        }
        if !(r.tier_hysteresis.is_finite() && (0.0..1.0).contains(&r.tier_hysteresis)) {
            return Err(ConfigError::invalid(
                "routing.tier_hysteresis",
                "must be in [0, 1)",
            ));
        }
        if !(r.load_margin.is_finite() && r.load_margin > 0.0 && r.load_margin < 1.0) {
            return Err(ConfigError::invalid(
                "routing.load_margin",
                "must be in (0, 1)",
            ));
        }
        if !(r.load_floor.is_finite() && (0.0..1.0).contains(&r.load_floor)) {
            return Err(ConfigError::invalid(
                "routing.load_floor",
                "must be in [0, 1)",
            ));
        }
        if !(r.load_high_water.is_finite() && r.load_high_water > 0.0 && r.load_high_water <= 1.0) {
            return Err(ConfigError::invalid(
                "routing.load_high_water",
                "must be in (0, 1]",
            ));
        }
        if r.max_attempts == 0 || r.max_attempts > 10 {
            return Err(ConfigError::invalid(
                "routing.max_attempts",
                "must be 1 to 10",
            ));
        }
        if r.step_interval < Duration::from_millis(10) {
            return Err(ConfigError::invalid(
                "routing.step_interval",
                "must be at least 10ms",
            ));
        }
        Ok(())
    }
}
