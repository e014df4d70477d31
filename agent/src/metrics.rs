//! The agent's Prometheus metrics, registered on an explicit `Registry` passed down from
//! `run` (never a global).
//!
//! This module only defines and updates series; it decides nothing. Besides the
//! Prometheus series it keeps [`RecentCalls`], the calls of the last minutes by outcome
//! that `/systemcheck` and the status page show.
//!
//! The per-server coverage series ([`ServerTable`]) are built from a small table when
//! `/metrics` is scraped: held as Prometheus series they would be 8 per tunnel server, each
//! with its own label strings, map entry and atomic (about 37 KB for an agent on 10 servers,
//! its largest memory item), where the table keeps about 100 bytes per server.

use crate::coverage::plan::{ActionKind, State};
use crate::filter::Reason;
use parking_lot::Mutex;
use prometheus::{
    Gauge, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, Opts, Registry,
};
use serde::Serialize;
use std::collections::BTreeMap;
use std::sync::Arc;
use tokio::time::Instant;

mod servers;

pub use servers::{Rows, ServerTable};

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
    /// `grpc_tunnel_server_streams{server_id,state=idle|busy}`,
    /// `grpc_tunnel_coverage_state{server_id,state}` (1 for the current state, 0 otherwise)
    /// and `grpc_tunnel_server_short_seconds{server_id}` (how long each server has been
    /// short without a break, 0 when covered, as `/systemcheck` shows it): the sizing tick
    /// writes their table after every plan.
    pub servers: ServerTable,
    /// `grpc_tunnel_coverage_actions_total{action}`.
    pub coverage_actions: IntCounterVec,
    /// `grpc_tunnel_coverage_grace_seconds`: `coverage.grace`, so an alert can compare
    /// `grpc_tunnel_server_short_seconds` with the grace this agent runs with.
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
    /// `relay_agent_open_window`: stream opens this agent lets be in progress at once now
    /// (`crate::stream::window`: up to `max_opening`, narrowed while hellos time out).
    pub open_window: IntGauge,
    /// `relay_agent_open_stalls_total`: opens still waiting for their hello past the open
    /// window's retransmission timeout (`crate::stream::window`).
    pub open_stalls: IntCounter,
    /// Calls of the last [`RECENT_MINUTES`] minutes by outcome (`/systemcheck`).
    pub recent_calls: RecentCalls,
}

impl AgentMetrics {
    pub fn register(registry: &Registry) -> Result<Self, prometheus::Error> {
        let servers = ServerTable::new()?;
        let coverage_actions = IntCounterVec::new(
            Opts::new(
                "grpc_tunnel_coverage_actions_total",
                "Coverage actions taken by the sizing tick",
            ),
            &["action"],
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
        let open_window = IntGauge::new(
            "relay_agent_open_window",
            "Stream opens the agent lets be in progress at once: up to max_opening, halved when an open times out waiting for its hello, grown again as opens land",
        )?;
        registry.register(Box::new(open_window.clone()))?;
        let open_stalls = IntCounter::new(
            "relay_agent_open_stalls_total",
            "Stream opens still waiting for their hello past the open window's retransmission timeout: each stops holding a place in the window and is no longer counted toward growth, so the agent opens another",
        )?;
        registry.register(Box::new(open_stalls.clone()))?;
        registry.register(Box::new(servers.clone()))?;
        registry.register(Box::new(coverage_actions.clone()))?;
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
            servers,
            coverage_actions,
            coverage_grace,
            streams_live,
            calls_received,
            calls,
            call_duration,
            stream_opens,
            filter_refusals,
            direct_urls_refused,
            open_window,
            open_stalls,
            recent_calls: RecentCalls::new(Instant::now()),
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
        self.recent_calls.record(Instant::now(), outcome);
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
}

/// Minutes of calls [`RecentCalls`] keeps.
pub const RECENT_MINUTES: usize = 10;

/// Calls that ended in one minute, by outcome (every outcome, zeros included).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct MinuteCalls {
    /// 0 is the minute under way (minutes count from the agent's start).
    pub minutes_ago: u32,
    pub calls: BTreeMap<&'static str, u64>,
}

/// Calls ended per minute by outcome over the last [`RECENT_MINUTES`] minutes: a ring of
/// per-minute counters, bounded whatever the traffic. Cheap to clone (shared).
#[derive(Clone)]
pub struct RecentCalls {
    epoch: Instant,
    /// Slot `m % RECENT_MINUTES` holds minute `m` (since `epoch`) and its counts per
    /// outcome (indexed as `CallOutcome::ALL`); a slot holding an older minute is stale.
    ring: Arc<Mutex<[MinuteSlot; RECENT_MINUTES]>>,
}

/// One minute of [`RecentCalls`]: which minute, and its counts per outcome.
type MinuteSlot = (Option<u64>, [u64; CallOutcome::ALL.len()]);

impl RecentCalls {
    pub fn new(epoch: Instant) -> Self {
        RecentCalls {
            epoch,
            ring: Arc::new(Mutex::new(
                [(None, [0; CallOutcome::ALL.len()]); RECENT_MINUTES],
            )),
        }
    }

    fn minute(&self, now: Instant) -> u64 {
        now.saturating_duration_since(self.epoch).as_secs() / 60
    }

    /// Counts one call that ended at `now` with `outcome`.
    pub fn record(&self, now: Instant, outcome: CallOutcome) {
        let minute = self.minute(now);
        let mut ring = self.ring.lock();
        let slot = &mut ring[(minute % RECENT_MINUTES as u64) as usize];
        if slot.0 != Some(minute) {
            *slot = (Some(minute), [0; CallOutcome::ALL.len()]);
        }
        slot.1[outcome as usize] += 1;
    }

    /// The last [`RECENT_MINUTES`] minutes as of `now`, the minute under way first (minutes
    /// before the agent started are left out).
    pub fn minutes(&self, now: Instant) -> Vec<MinuteCalls> {
        let minute = self.minute(now);
        let ring = self.ring.lock();
        (0..RECENT_MINUTES as u64)
            .take_while(|ago| *ago <= minute)
            .map(|ago| {
                let m = minute - ago;
                let slot = &ring[(m % RECENT_MINUTES as u64) as usize];
                let counts = if slot.0 == Some(m) {
                    slot.1
                } else {
                    [0; CallOutcome::ALL.len()]
                };
                MinuteCalls {
                    minutes_ago: ago as u32,
                    calls: CallOutcome::ALL
                        .iter()
                        .map(|o| (o.as_str(), counts[*o as usize]))
                        .collect(),
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod recent_tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn recent_calls_count_per_minute_and_forget_after_ten() {
        let t0 = Instant::now();
        let r = RecentCalls::new(t0);
        let at = |s: u64| t0 + Duration::from_secs(s);
        r.record(at(1), CallOutcome::Ok);
        r.record(at(59), CallOutcome::Ok);
        r.record(at(61), CallOutcome::Refused);
        let m = r.minutes(at(70));
        assert_eq!(m.len(), 2);
        assert_eq!(
            (m[0].minutes_ago, m[0].calls["refused"], m[0].calls["ok"]),
            (0, 1, 0)
        );
        assert_eq!((m[1].minutes_ago, m[1].calls["ok"]), (1, 2));
        assert_eq!(m[1].calls.len(), CallOutcome::ALL.len());
        // Ten minutes later minute 0 has left the window, and its slot is reused afresh.
        r.record(at(600 + 5), CallOutcome::StreamLost);
        let m = r.minutes(at(600 + 5));
        assert_eq!(m.len(), RECENT_MINUTES);
        assert_eq!(m[0].calls["stream_lost"], 1);
        assert_eq!(m[0].calls["ok"], 0);
        assert_eq!(m[9].minutes_ago, 9);
        assert_eq!(m[9].calls["refused"], 1);
        let total: u64 = m.iter().flat_map(|x| x.calls.values()).sum();
        assert_eq!(total, 2);
    }

    #[test]
    fn outcomes_index_the_counters_in_their_listed_order() {
        for (i, o) in CallOutcome::ALL.iter().enumerate() {
            assert_eq!(*o as usize, i, "{}", o.as_str());
        }
    }
}
