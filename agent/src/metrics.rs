//! The agent's Prometheus metrics, registered on an explicit `Registry` passed down from
//! `run` (never a global).
//!
//! This module only defines and updates series; it decides nothing.

use crate::coverage::plan::{ActionKind, State};
use crate::filter::Reason;
use prometheus::{
    Gauge, GaugeVec, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, IntGaugeVec,
    Opts, Registry,
};

/// How a call ended, as counted in `relay_agent_calls_total{outcome}`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CallOutcome {
    Ok,
    Refused,
    UpstreamUnreachable,
    UpstreamTimeout,
    Cancelled,
    BadRequest,
    UpstreamAborted,
    /// The tunnel stream went away before the call could be answered (not a terminal frame).
    StreamLost,
}

impl CallOutcome {
    pub const ALL: [CallOutcome; 8] = [
        CallOutcome::Ok,
        CallOutcome::Refused,
        CallOutcome::UpstreamUnreachable,
        CallOutcome::UpstreamTimeout,
        CallOutcome::Cancelled,
        CallOutcome::BadRequest,
        CallOutcome::UpstreamAborted,
        CallOutcome::StreamLost,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            CallOutcome::Ok => "ok",
            CallOutcome::Refused => "refused",
            CallOutcome::UpstreamUnreachable => "upstream_unreachable",
            CallOutcome::UpstreamTimeout => "upstream_timeout",
            CallOutcome::Cancelled => "cancelled",
            CallOutcome::BadRequest => "bad_request",
            CallOutcome::UpstreamAborted => "upstream_aborted",
            CallOutcome::StreamLost => "stream_lost",
        }
    }
}

/// Result of one stream open, as counted in `relay_agent_stream_opens_total{result}`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OpenResult {
    Landed,
    Unauthenticated,
    Exhausted,
    Error,
}

impl OpenResult {
    pub const ALL: [OpenResult; 4] = [
        OpenResult::Landed,
        OpenResult::Unauthenticated,
        OpenResult::Exhausted,
        OpenResult::Error,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            OpenResult::Landed => "landed",
            OpenResult::Unauthenticated => "unauthenticated",
            OpenResult::Exhausted => "exhausted",
            OpenResult::Error => "error",
        }
    }
}

/// Every agent metric. Cheap to clone (the prometheus handles are shared).
#[derive(Clone)]
pub struct AgentMetrics {
    /// `grpc_tunnel_server_streams{server_id,state=idle|busy}`.
    pub server_streams: IntGaugeVec,
    /// `grpc_tunnel_coverage_state{server_id,state}`: 1 for the current state, 0 otherwise.
    pub coverage_state: IntGaugeVec,
    /// `grpc_tunnel_coverage_actions_total{action}`.
    pub coverage_actions: IntCounterVec,
    /// `grpc_tunnel_server_short_seconds{server_id}`: how long each server has been short
    /// without a break (0 when covered), as `/systemcheck` shows it.
    pub server_short: GaugeVec,
    /// `grpc_tunnel_coverage_grace_seconds`: `coverage.grace`, so an alert can compare
    /// `server_short` with the grace this agent runs with.
    pub coverage_grace: Gauge,
    /// `relay_agent_streams_live`: live (non-retiring) streams across servers; 0 means no
    /// call can reach this agent.
    pub streams_live: IntGauge,
    /// `relay_agent_calls_received_total`: every RequestHead that started a call. Each
    /// ends with exactly one `relay_agent_calls_total{outcome}`, so once quiet the two
    /// agree (the per-hop accounting check).
    pub calls_received: IntCounter,
    /// `relay_agent_calls_total{outcome}`.
    pub calls: IntCounterVec,
    /// `relay_agent_call_duration_seconds`.
    pub call_duration: Histogram,
    /// `relay_agent_stream_opens_total{result}`.
    pub stream_opens: IntCounterVec,
    /// `relay_agent_filter_refusals_total{reason}`.
    pub filter_refusals: IntCounterVec,
    /// `relay_agent_direct_urls_refused_total`: direct URLs of tunnel servers not dialed
    /// because `direct_hosts` does not allow their host.
    pub direct_urls_refused: IntCounter,
}

impl AgentMetrics {
    pub fn register(registry: &Registry) -> Result<Self, prometheus::Error> {
        let server_streams = IntGaugeVec::new(
            Opts::new(
                "grpc_tunnel_server_streams",
                "Live tunnel streams of this agent per tunnel server, idle or busy",
            ),
            &["server_id", "state"],
        )?;
        let coverage_state = IntGaugeVec::new(
            Opts::new(
                "grpc_tunnel_coverage_state",
                "Coverage state of each tunnel server as the last sizing tick judged it (1 = current state)",
            ),
            &["server_id", "state"],
        )?;
        let coverage_actions = IntCounterVec::new(
            Opts::new(
                "grpc_tunnel_coverage_actions_total",
                "Coverage actions taken by the sizing tick",
            ),
            &["action"],
        )?;
        let server_short = GaugeVec::new(
            Opts::new(
                "grpc_tunnel_server_short_seconds",
                "How long each tunnel server has been short of busy + reserve without a break (0 when covered)",
            ),
            &["server_id"],
        )?;
        let coverage_grace = Gauge::new(
            "grpc_tunnel_coverage_grace_seconds",
            "coverage.grace: how long a server carrying calls may stay short before /systemcheck fails",
        )?;
        let streams_live = IntGauge::new(
            "relay_agent_streams_live",
            "Live (non-retiring) tunnel streams across servers; 0 means no call can reach this agent",
        )?;
        let calls = IntCounterVec::new(
            Opts::new(
                "relay_agent_calls_total",
                "Calls the agent carried, by outcome",
            ),
            &["outcome"],
        )?;
        let calls_received = IntCounter::new(
            "relay_agent_calls_received_total",
            "Calls handed to the agent by tunnel servers; each ends with one relay_agent_calls_total outcome",
        )?;
        let call_duration = Histogram::with_opts(
            HistogramOpts::new(
                "relay_agent_call_duration_seconds",
                "Time from a RequestHead to the call's terminal frame",
            )
            .buckets(vec![
                0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
            ]),
        )?;
        let stream_opens = IntCounterVec::new(
            Opts::new(
                "relay_agent_stream_opens_total",
                "Tunnel stream opens, by result",
            ),
            &["result"],
        )?;
        let filter_refusals = IntCounterVec::new(
            Opts::new(
                "relay_agent_filter_refusals_total",
                "Calls the agent refused before reaching the upstream (accept filters, request safety, limits), by reason",
            ),
            &["reason"],
        )?;
        let direct_urls_refused = IntCounter::new(
            "relay_agent_direct_urls_refused_total",
            "Direct URLs advertised by tunnel servers that the agent did not dial because direct_hosts does not allow their host",
        )?;
        registry.register(Box::new(direct_urls_refused.clone()))?;
        registry.register(Box::new(server_streams.clone()))?;
        registry.register(Box::new(coverage_state.clone()))?;
        registry.register(Box::new(coverage_actions.clone()))?;
        registry.register(Box::new(server_short.clone()))?;
        registry.register(Box::new(coverage_grace.clone()))?;
        registry.register(Box::new(streams_live.clone()))?;
        registry.register(Box::new(calls_received.clone()))?;
        registry.register(Box::new(calls.clone()))?;
        registry.register(Box::new(call_duration.clone()))?;
        registry.register(Box::new(stream_opens.clone()))?;
        registry.register(Box::new(filter_refusals.clone()))?;
        // Export every fixed label value from the start so rates work from zero.
        for a in ActionKind::ALL {
            coverage_actions.with_label_values(&[a.as_str()]);
        }
        for o in CallOutcome::ALL {
            calls.with_label_values(&[o.as_str()]);
        }
        for r in OpenResult::ALL {
            stream_opens.with_label_values(&[r.as_str()]);
        }
        for r in Reason::ALL {
            filter_refusals.with_label_values(&[r.as_str()]);
        }
        Ok(AgentMetrics {
            server_streams,
            coverage_state,
            coverage_actions,
            server_short,
            coverage_grace,
            streams_live,
            calls_received,
            calls,
            call_duration,
            stream_opens,
            filter_refusals,
            direct_urls_refused,
        })
    }

    /// Counts one refused call.
    pub fn refused(&self, reason: Reason) {
        self.filter_refusals
            .with_label_values(&[reason.as_str()])
            .inc();
    }

    pub fn call_ended(&self, outcome: CallOutcome, seconds: f64) {
        self.calls.with_label_values(&[outcome.as_str()]).inc();
        self.call_duration.observe(seconds);
    }

    pub fn stream_opened(&self, result: OpenResult) {
        self.stream_opens
            .with_label_values(&[result.as_str()])
            .inc();
    }

    pub fn action(&self, kind: ActionKind, count: u32) {
        self.coverage_actions
            .with_label_values(&[kind.as_str()])
            .inc_by(u64::from(count));
    }

    /// Sets a server's stream gauges and coverage state.
    pub fn set_server(&self, server_id: &str, idle: u32, busy: u32, state: Option<State>) {
        self.server_streams
            .with_label_values(&[server_id, "idle"])
            .set(i64::from(idle));
        self.server_streams
            .with_label_values(&[server_id, "busy"])
            .set(i64::from(busy));
        if let Some(state) = state {
            for s in State::ALL {
                self.coverage_state
                    .with_label_values(&[server_id, s.as_str()])
                    .set(i64::from(s == state));
            }
        }
    }

    /// Sets how long a server has been short (0 when covered).
    pub fn set_short(&self, server_id: &str, short: std::time::Duration) {
        self.server_short
            .with_label_values(&[server_id])
            .set(short.as_secs_f64());
    }

    /// Drops the short-for series of a server the sizing tick no longer plans for.
    pub fn remove_short(&self, server_id: &str) {
        let _ = self.server_short.remove_label_values(&[server_id]);
    }

    /// Drops every series of a server that holds no streams any more.
    pub fn remove_server(&self, server_id: &str) {
        for st in ["idle", "busy"] {
            let _ = self.server_streams.remove_label_values(&[server_id, st]);
        }
        for s in State::ALL {
            let _ = self
                .coverage_state
                .remove_label_values(&[server_id, s.as_str()]);
        }
    }
}
