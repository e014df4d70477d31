//! A call's guard: [`CallGuard`] records each call's outcome and duration exactly once,
//! whether it ends normally, with an error, or by the caller going away (dropped =
//! `cancelled`), and holds the caller's slots until then. How the call ended is decided by
//! `call` (up to the response head) and `response` (the body).

use crate::metrics::{CallOutcome, Metrics};
use relay_common::trace::{CallTrace, KeyValue, SpanKind, TraceId};
use std::sync::Arc;
use tokio::time::Instant;

/// Records one call's outcome and duration once; dropping it unrecorded means the caller
/// went away (`cancelled`).
pub struct CallGuard {
    metrics: Arc<Metrics>,
    start: Instant,
    recorded: bool,
    /// The tunnel server that answered (or the last one tried).
    server_id: Option<Arc<str>>,
    /// The caller's concurrency slot, given back when the call ends.
    permit: Option<tokio::sync::OwnedSemaphorePermit>,
    /// The caller's slot for the call's tunnel id, given back when the call ends.
    tunnel_slot: Option<crate::quota::TunnelPermit>,
    /// The call's span in this process, ended with the call's outcome.
    trace: Option<CallTrace>,
    /// The call's tunnel id, kept only for an exported span's attributes.
    traced_tunnel: Option<String>,
}

impl CallGuard {
    pub fn new(metrics: Arc<Metrics>) -> Self {
        metrics.calls_in_flight.inc();
        CallGuard {
            metrics,
            start: Instant::now(),
            recorded: false,
            server_id: None,
            permit: None,
            tunnel_slot: None,
            trace: None,
            traced_tunnel: None,
        }
    }

    /// The call's span in this process: ended, and exported if export is on, when the
    /// call's outcome is recorded.
    pub fn set_trace(&mut self, trace: CallTrace) {
        self.trace = Some(trace);
    }

    /// The call's trace id, for its log lines.
    pub fn trace_id(&self) -> Option<TraceId> {
        self.trace.map(|t| t.trace_id)
    }

    /// The call's tunnel id, for its exported span (kept only when the span is exported).
    pub fn set_tunnel(&mut self, tunnel_id: &str) {
        if self.trace.is_some_and(|t| t.exported()) {
            self.traced_tunnel = Some(tunnel_id.to_string());
        }
    }

    /// Holds the caller's slot for the call's tunnel id until the call ends.
    pub fn hold_tunnel(&mut self, slot: crate::quota::TunnelPermit) {
        self.tunnel_slot = Some(slot);
    }

    /// Holds the caller's concurrency slot until the call ends.
    pub fn hold(&mut self, permit: tokio::sync::OwnedSemaphorePermit) {
        self.permit = Some(permit);
    }

    /// The server the call went to, for the per-server outcome counter.
    pub fn set_server(&mut self, server_id: Option<Arc<str>>) {
        self.server_id = server_id;
    }

    pub fn finish(&mut self, outcome: CallOutcome) {
        if self.recorded {
            return;
        }
        self.recorded = true;
        self.permit = None;
        self.tunnel_slot = None;
        self.metrics.calls_in_flight.dec();
        let outcome = outcome.as_str();
        self.metrics.calls.with_label_values(&[outcome]).inc();
        let server = self.server_id.as_deref().unwrap_or("none");
        self.metrics
            .calls_by_server
            .with_label_values(&[server, outcome])
            .inc();
        self.metrics
            .call_duration
            .observe(self.start.elapsed().as_secs_f64());
        if let Some(trace) = self.trace.take() {
            let error = (outcome != "ok").then_some(outcome);
            trace.end("relay.dispatcher.call", SpanKind::Server, error, || {
                let mut attributes = vec![
                    KeyValue::new("relay.outcome", outcome),
                    KeyValue::new("relay.server_id", server.to_string()),
                ];
                if let Some(tunnel) = self.traced_tunnel.take() {
                    attributes.push(KeyValue::new("relay.tunnel_id", tunnel));
                }
                attributes
            });
        }
    }
}

impl Drop for CallGuard {
    fn drop(&mut self) {
        self.finish(CallOutcome::Cancelled);
    }
}
