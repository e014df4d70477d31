//! The dispatcher's Prometheus metrics, registered on an explicit `Registry` passed in at
//! start (never the global one).
//!
//! Labels carry outcomes, server ids and tunnel ids (public names) only: never a caller
//! key, token or tunnel secret.

mod routing;

pub use routing::{RoutingFigures, RoutingRows, RoutingSeries, ServerRow, TunnelRow};

use crate::error::ErrorCode;
use prometheus::{Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, Opts, Registry};

/// How a call ended: the `outcome` label of `relay_dispatcher_calls_total` and
/// `relay_dispatcher_calls_by_server_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallOutcome {
    /// The whole response reached the caller.
    Ok,
    /// The response was cut after its head (the stream or the server died mid-body).
    Aborted,
    /// The caller went away before the call ended.
    Cancelled,
    /// The response body stalled past `body_idle_timeout` and was cut.
    BodyIdleTimeout,
    /// The call failed with the error the caller was answered with (before the head), or
    /// whose bound cut the body (`deadline_exceeded`).
    Failed(ErrorCode),
}

impl CallOutcome {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            CallOutcome::Ok => "ok",
            CallOutcome::Aborted => "aborted",
            CallOutcome::Cancelled => "cancelled",
            CallOutcome::BodyIdleTimeout => "body_idle_timeout",
            CallOutcome::Failed(code) => code.as_str(),
        }
    }

    /// Every outcome, for exporting each label value at zero from the start.
    pub fn all() -> impl Iterator<Item = CallOutcome> {
        [
            CallOutcome::Ok,
            CallOutcome::Aborted,
            CallOutcome::Cancelled,
            CallOutcome::BodyIdleTimeout,
        ]
        .into_iter()
        .chain(ErrorCode::ALL.iter().copied().map(CallOutcome::Failed))
    }
}

/// Every `reason` of `relay_dispatcher_reports_refused_total`.
pub const REFUSAL_REASONS: [&str; 4] = [
    "unauthenticated",
    "bad_intro",
    "unknown_server",
    "duplicate_server_id",
];

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
    /// Forward attempts a tunnel server put in its queue (the queue handshake's `Queued`).
    pub queued: IntCounter,
    /// Carriers (`Forward.Carry`) opened to tunnel servers; calls reuse idle ones.
    pub carriers_opened: IntCounter,
    /// HTTP/2 connections open to tunnel servers (`crate::pool`: one more when every
    /// connection to a server carries `[forward_h2] max_concurrent_streams` streams).
    pub forward_connections: IntGauge,
    /// Tunnel servers whose path went dead (`crate::pool`): calls skip them until one
    /// answers a probe.
    pub forward_servers_down: IntGauge,
    /// Tunnel servers with an open report stream.
    pub tunnel_servers: IntGauge,
    /// Tunnel ids held by at least one tunnel server.
    pub tunnels: IntGauge,
    /// Calls currently in flight.
    pub calls_in_flight: IntGauge,
    /// Calls by the server that answered them (the last one tried) and outcome.
    pub calls_by_server: IntCounterVec,
    /// The routing series (per tunnel id: spill share, spills, each server's RTT and
    /// tier; per server: load, calls in flight, forward RTT), built at scrape time from
    /// the registry ([`routing`]).
    pub routing_series: RoutingSeries,
    /// Tunnel server entries dropped because their lease ran out.
    pub lease_expiries: IntCounter,
    /// Time between two frames of one tunnel server's report stream, as handled here (a
    /// gap past `registry.lease` drops the server).
    pub report_gap: Histogram,
    /// Report streams refused, by reason.
    pub reports_refused: IntCounterVec,
    /// Load reports handled, `whole` or `partial` (only the tunnel ids whose figures
    /// changed, `LoadReport.partial`).
    pub load_reports: IntCounterVec,
    /// Tunnel ids' figures the load reports carried.
    pub load_report_tunnels: IntCounter,
    /// 1 while the shared registry (Redis) is unreachable and routing runs on the last
    /// known table.
    pub registry_degraded: IntGauge,
    /// Records read from the shared registry and refused (seal, expiry, content), by
    /// reason; counted once per refused record value.
    pub registry_records_refused: IntCounterVec,
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
        let queued = IntCounter::new(
            "relay_dispatcher_queued_total",
            "Forward attempts a tunnel server queued because no stream of the tunnel id was idle",
        )?;
        let carriers_opened = IntCounter::new(
            "relay_dispatcher_forward_carriers_opened_total",
            "Carriers (Forward.Carry RPCs, each carrying calls one at a time) opened to tunnel servers",
        )?;
        let forward_connections = IntGauge::new(
            "relay_dispatcher_forward_connections",
            "HTTP/2 connections open to tunnel servers (another opens when every connection to a server carries forward_h2.max_concurrent_streams streams)",
        )?;
        let forward_servers_down = IntGauge::new(
            "relay_dispatcher_forward_servers_down",
            "Tunnel servers whose path went dead (a failed dial, or a connection silent past its keep-alive): calls go to other servers until a probe is answered",
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
        let calls_by_server = IntCounterVec::new(
            Opts::new(
                "relay_dispatcher_calls_by_server_total",
                "Calls by the tunnel server that answered them (the last one tried) and outcome",
            ),
            &["server_id", "outcome"],
        )?;
        let lease_expiries = IntCounter::new(
            "relay_dispatcher_lease_expiries_total",
            "Tunnel server entries dropped because the server stopped reporting within its lease",
        )?;
        let report_gap = Histogram::with_opts(
            HistogramOpts::new(
                "relay_dispatcher_report_gap_seconds",
                "Time between two frames of a tunnel server's report stream as handled here; past registry.lease the server is dropped",
            )
            .buckets(vec![
                0.005, 0.025, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 3.0, 5.0, 10.0,
            ]),
        )?;
        let reports_refused = IntCounterVec::new(
            Opts::new(
                "relay_dispatcher_reports_refused_total",
                "Report streams refused, by reason",
            ),
            &["reason"],
        )?;
        let registry_degraded = IntGauge::new(
            "relay_dispatcher_registry_degraded",
            "1 while the shared registry is unreachable and routing runs on the last known table",
        )?;
        registry.register(Box::new(calls_by_server.clone()))?;
        let routing_series = RoutingSeries::new()?;
        registry.register(Box::new(routing_series.clone()))?;
        registry.register(Box::new(lease_expiries.clone()))?;
        registry.register(Box::new(report_gap.clone()))?;
        registry.register(Box::new(reports_refused.clone()))?;
        let load_reports = IntCounterVec::new(
            Opts::new(
                "relay_dispatcher_load_reports_total",
                "Load reports handled from tunnel servers: whole, or partial (only the tunnel ids whose figures changed)",
            ),
            &["kind"],
        )?;
        registry.register(Box::new(load_reports.clone()))?;
        for kind in ["whole", "partial"] {
            load_reports.with_label_values(&[kind]);
        }
        let load_report_tunnels = IntCounter::new(
            "relay_dispatcher_load_report_tunnels_total",
            "Tunnel ids' figures carried by the load reports from tunnel servers",
        )?;
        registry.register(Box::new(load_report_tunnels.clone()))?;
        registry.register(Box::new(registry_degraded.clone()))?;
        let registry_records_refused = IntCounterVec::new(
            Opts::new(
                "relay_dispatcher_registry_records_refused_total",
                "Records read from the shared registry (Redis) and refused, by reason (once per record value)",
            ),
            &["reason"],
        )?;
        registry.register(Box::new(registry_records_refused.clone()))?;
        registry.register(Box::new(calls.clone()))?;
        registry.register(Box::new(call_duration.clone()))?;
        registry.register(Box::new(routing_decisions.clone()))?;
        registry.register(Box::new(retries.clone()))?;
        registry.register(Box::new(queued.clone()))?;
        registry.register(Box::new(carriers_opened.clone()))?;
        registry.register(Box::new(forward_connections.clone()))?;
        registry.register(Box::new(forward_servers_down.clone()))?;
        registry.register(Box::new(tunnel_servers.clone()))?;
        registry.register(Box::new(tunnels.clone()))?;
        registry.register(Box::new(calls_in_flight.clone()))?;
        // Export every fixed label value from the start: a counter that first appears
        // already above zero loses that first step in `rate()`, so an alert on
        // `no_capacity` or `stream_lost` would miss the first burst.
        for o in CallOutcome::all() {
            calls.with_label_values(&[o.as_str()]);
        }
        for r in REFUSAL_REASONS {
            reports_refused.with_label_values(&[r]);
        }
        Ok(Metrics {
            calls,
            call_duration,
            routing_decisions,
            retries,
            queued,
            carriers_opened,
            forward_connections,
            forward_servers_down,
            tunnel_servers,
            tunnels,
            calls_in_flight,
            calls_by_server,
            routing_series,
            lease_expiries,
            report_gap,
            reports_refused,
            load_reports,
            load_report_tunnels,
            registry_degraded,
            registry_records_refused,
        })
    }
}
