//! The dispatcher's Prometheus metrics, registered on an explicit `Registry` passed in at
//! start (never the global one).
//!
//! Labels carry outcomes and server ids only: never a caller key, token or tunnel secret.

use prometheus::{Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, Opts, Registry};

/// Handles to every dispatcher metric; cheap to clone.
#[derive(Clone)]
pub struct Metrics {
    /// Calls by outcome: `ok`, an error code (`no_capacity`, ...), `aborted`, `cancelled`.
    pub calls: IntCounterVec,
    /// Time from the request head to the end of the response (or the error).
    pub call_duration: Histogram,
    /// Calls forwarded to each tunnel server (one per attempt).
    pub routing_decisions: IntCounterVec,
    /// Calls retried on another tunnel server before reaching any agent.
    pub retries: IntCounter,
    /// Tunnel servers with an open report stream.
    pub tunnel_servers: IntGauge,
    /// Tunnel ids held by at least one tunnel server.
    pub tunnels: IntGauge,
    /// Calls currently in flight.
    pub calls_in_flight: IntGauge,
}

impl Metrics {
    /// Creates the metrics and registers them on `registry`.
    pub fn register(registry: &Registry) -> Result<Self, prometheus::Error> {
        let calls = IntCounterVec::new(
            Opts::new(
                "relay_dispatcher_calls_total",
                "Calls handled by the HTTP front, by outcome",
            ),
            &["outcome"],
        )?;
        let call_duration = Histogram::with_opts(
            HistogramOpts::new(
                "relay_dispatcher_call_duration_seconds",
                "Time from the request head to the end of the response body or the error",
            )
            .buckets(vec![
                0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
                300.0,
            ]),
        )?;
        let routing_decisions = IntCounterVec::new(
            Opts::new(
                "relay_dispatcher_routing_decisions_total",
                "Forward attempts sent to each tunnel server",
            ),
            &["server_id"],
        )?;
        let retries = IntCounter::new(
            "relay_dispatcher_retries_total",
            "Calls retried on another tunnel server before any agent took them",
        )?;
        let tunnel_servers = IntGauge::new(
            "relay_dispatcher_tunnel_servers",
            "Tunnel servers with an open report stream",
        )?;
        let tunnels = IntGauge::new(
            "relay_dispatcher_tunnels",
            "Tunnel ids held by at least one tunnel server",
        )?;
        let calls_in_flight = IntGauge::new(
            "relay_dispatcher_calls_in_flight",
            "Calls currently in flight",
        )?;
        registry.register(Box::new(calls.clone()))?;
        registry.register(Box::new(call_duration.clone()))?;
        registry.register(Box::new(routing_decisions.clone()))?;
        registry.register(Box::new(retries.clone()))?;
        registry.register(Box::new(tunnel_servers.clone()))?;
        registry.register(Box::new(tunnels.clone()))?;
        registry.register(Box::new(calls_in_flight.clone()))?;
        Ok(Metrics {
            calls,
            call_duration,
            routing_decisions,
            retries,
            tunnel_servers,
            tunnels,
            calls_in_flight,
        })
    }
}
