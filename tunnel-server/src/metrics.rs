//! The tunnel server's Prometheus metrics, registered on an explicit registry. It owns
//! the metric names, help texts and label sets; what each label means is decided where it
//! is emitted (call outcomes in `crate::outcome`, stream close reasons in
//! `crate::stream`).

use crate::outcome::Outcome;
use prometheus::{
    exponential_buckets, Histogram, HistogramOpts, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry,
};

/// Every `outcome` of `relay_tunnel_calls_total`.
pub const CALL_OUTCOMES: [&str; 8] = Outcome::LABELS;

/// Every `result` of `relay_tunnel_stream_opens_total`.
pub const OPEN_RESULTS: [&str; 4] = ["accepted", "unauthenticated", "exhausted", "draining"];

#[derive(Clone)]
pub struct ServerMetrics {
    /// Streams held per tunnel id.
    pub streams: IntGaugeVec,
    /// Calls waiting for an idle stream, per tunnel id.
    pub queued: IntGaugeVec,
    /// Time calls waited for an idle stream (0 when one was idle).
    pub queue_wait: Histogram,
    /// Calls by outcome ([`Outcome::as_str`]): ok, agent_error, cancelled, stream_lost,
    /// no_capacity, unknown_tunnel, bad_request, bad_response. Every label is exported
    /// from the start.
    pub calls: IntCounterVec,
    /// Calls holding a stream now.
    pub in_flight: IntGauge,
    /// Dispatchers' `Forward.Carry` RPCs open now (busy or idle).
    pub carriers: IntGauge,
    /// Stream opens by result: accepted, unauthenticated, exhausted, draining.
    pub opens: IntCounterVec,
    /// Streams closed by reason: agent_closed (the agent ended its stream, or it broke),
    /// retired (closed by the server: retired, shut down or given up on), revoked (its
    /// token left the store), heartbeat (silent too long), silent (its agent connection
    /// stopped answering liveness pings), protocol_error.
    pub closes: IntCounterVec,
    /// Agent connections whose streams were all closed because a liveness ping went
    /// unanswered (`crate::liveness`).
    pub silent_connections: prometheus::IntCounter,
    /// How late each periodic load report went out after its tick was due: the delay of
    /// the control plane (`crate::report`).
    pub report_lateness: Histogram,
    /// Agent connections waiting for their turn to open now
    /// (`relay_common::listen::admission`, `max_opens_in_progress`).
    pub opens_waiting: IntGauge,
    /// Time agent connections waited for their turn to open (0 when there was room).
    pub open_wait: Histogram,
}

/// Buckets of the control plane's delays: fine below a second, up to well past a lease.
pub const CONTROL_BUCKETS: [f64; 13] = [
    0.005, 0.025, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 3.0, 5.0, 10.0,
];

impl ServerMetrics {
    pub fn register(registry: &Registry) -> prometheus::Result<Self> {
        let m = ServerMetrics {
            streams: IntGaugeVec::new(
                Opts::new("relay_tunnel_streams", "Agent streams held per tunnel id"),
                &["tunnel_id"],
            )?,
            queued: IntGaugeVec::new(
                Opts::new(
                    "relay_tunnel_calls_queued",
                    "Calls waiting for an idle stream per tunnel id",
                ),
                &["tunnel_id"],
            )?,
            queue_wait: Histogram::with_opts(
                HistogramOpts::new(
                    "relay_tunnel_queue_wait_seconds",
                    "Time a call waited for an idle stream of its tunnel id",
                )
                .buckets(exponential_buckets(0.0001, 3.0, 12)?),
            )?,
            calls: IntCounterVec::new(
                Opts::new(
                    "relay_tunnel_calls_total",
                    "Calls handled by this tunnel server, by outcome",
                ),
                &["outcome"],
            )?,
            in_flight: IntGauge::new(
                "relay_tunnel_calls_in_flight",
                "Calls holding an agent stream now",
            )?,
            carriers: IntGauge::new(
                "relay_tunnel_forward_carriers",
                "Forward.Carry RPCs from dispatchers open now, each carrying calls one at a time",
            )?,
            opens: IntCounterVec::new(
                Opts::new(
                    "relay_tunnel_stream_opens_total",
                    "Agent stream opens, by result",
                ),
                &["result"],
            )?,
            closes: IntCounterVec::new(
                Opts::new(
                    "relay_tunnel_stream_closes_total",
                    "Agent streams closed, by reason",
                ),
                &["reason"],
            )?,
            silent_connections: prometheus::IntCounter::new(
                "relay_tunnel_silent_connections_total",
                "Agent connections closed because a liveness ping went unanswered past liveness_timeout",
            )?,
            report_lateness: Histogram::with_opts(
                HistogramOpts::new(
                    "relay_tunnel_report_lateness_seconds",
                    "How late each periodic load report to a dispatcher went out after it was due",
                )
                .buckets(CONTROL_BUCKETS.to_vec()),
            )?,
            opens_waiting: IntGauge::new(
                "relay_tunnel_opens_waiting",
                "Agent connections waiting for their turn to open (max_opens_in_progress)",
            )?,
            open_wait: Histogram::with_opts(
                HistogramOpts::new(
                    "relay_tunnel_open_wait_seconds",
                    "Time agent connections waited for their turn to open (max_opens_in_progress)",
                )
                .buckets(CONTROL_BUCKETS.to_vec()),
            )?,
        };
        registry.register(Box::new(m.streams.clone()))?;
        registry.register(Box::new(m.queued.clone()))?;
        registry.register(Box::new(m.queue_wait.clone()))?;
        registry.register(Box::new(m.calls.clone()))?;
        registry.register(Box::new(m.in_flight.clone()))?;
        registry.register(Box::new(m.carriers.clone()))?;
        registry.register(Box::new(m.opens.clone()))?;
        registry.register(Box::new(m.closes.clone()))?;
        registry.register(Box::new(m.silent_connections.clone()))?;
        registry.register(Box::new(m.report_lateness.clone()))?;
        registry.register(Box::new(m.opens_waiting.clone()))?;
        registry.register(Box::new(m.open_wait.clone()))?;
        // Export every fixed label value from the start: a counter that first appears
        // already above zero loses that first step in `rate()`, so an alert on refused
        // tokens would miss the first burst.
        for o in CALL_OUTCOMES {
            m.calls.with_label_values(&[o]);
        }
        for r in OPEN_RESULTS {
            m.opens.with_label_values(&[r]);
        }
        Ok(m)
    }

    /// Counts one call's outcome.
    pub fn call(&self, outcome: &Outcome) {
        self.calls.with_label_values(&[outcome.as_str()]).inc();
    }
}
