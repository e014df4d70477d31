//! One call carried by a tunnel stream: a `RequestHead` (plus request body chunks fed in
//! by the stream) becomes an `UpstreamRequest`; the upstream's answer becomes
//! `ResponseHead` and `ResponseBody` frames of at most `MAX_CHUNK` bytes, ending with
//! exactly one terminal frame (a body chunk with `end`, a head with `end_of_stream`, or a
//! `CallError`). Upstream errors map to wire error kinds here, once.
//!
//! Before the upstream is contacted, a call passes the agent's gates in this order: the
//! concurrency cap (`coverage.max_inflight` calls at once, a permit held for the call's
//! life), then `filter::Policy::prepare` (limits, request safety, accept filters). A
//! refused call gets a `CallError` of kind `REFUSED` whose message names the reason, a
//! log line (method, path without query, reason) and a count in
//! `relay_agent_filter_refusals_total{reason}`. The call deadline is the head's
//! `deadline_ms` (or `call_timeout` when 0), capped at `max_call_timeout`.
//!
//! It never reads the tunnel stream itself (the stream task owns that) and never sends a
//! frame after its terminal one. Dropping the future drops the upstream request: that is
//! how a Cancel is carried out.

use crate::error::UpstreamError;
use crate::filter::{log_path, short, Policy, Reason, Rejection};
use crate::metrics::{AgentMetrics, CallOutcome};
use crate::upstream::{RequestBody, Upstream, UpstreamRequest};
use bytes::Bytes;
use relay_common::trace::{
    CallTrace, KeyValue, SpanKind, TraceId, TRACEPARENT, TRACEPARENT_HEADER,
};
use relay_proto::agent_frame::Kind;
use relay_proto::{AgentFrame, BodyChunk, CallError, CallErrorKind, RequestHead, ResponseHead};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Semaphore;
use tokio::time::Instant;

/// What every call shares: the upstream client, the accept policy, the concurrency cap,
/// the deadlines and the metrics.
pub struct CallContext {
    upstream: Upstream,
    policy: Policy,
    metrics: AgentMetrics,
    inflight: Arc<Semaphore>,
    max_inflight: u32,
    call_timeout: Duration,
    max_call_timeout: Duration,
    /// `limits.max_headers`: headers a request head may carry.
    max_headers: usize,
}

impl CallContext {
    /// `max_inflight` calls may run at once; a call without a deadline gets
    /// `call_timeout`; no call gets more than `max_call_timeout`.
    pub fn new(
        upstream: Upstream,
        policy: Policy,
        metrics: AgentMetrics,
        max_inflight: u32,
        call_timeout: Duration,
        max_call_timeout: Duration,
    ) -> Self {
        CallContext {
            upstream,
            policy,
            metrics,
            inflight: Arc::new(Semaphore::new(max_inflight as usize)),
            max_inflight,
            call_timeout,
            max_call_timeout,
            max_headers: relay_proto::DEFAULT_MAX_HEADERS,
        }
    }

    /// Most headers a request head may carry (`limits.max_headers`).
    pub fn with_max_headers(mut self, max: usize) -> Self {
        self.max_headers = max;
        self
    }
}

/// A stream's outbound queue, shared by the stream and the call on it: not a tokio `mpsc`
/// channel, whose first block of slots (2.3 KB of agent frames) is allocated with it and
/// kept for the stream's life (`relay_common::outbox`).
pub(crate) type FrameTx = Arc<relay_common::outbox::Outbox<AgentFrame>>;

/// Where a call's frames go: the stream's outbound half, and the response-body credit the
/// server gave the call, on a stream that uses body credit (`ServerHello.response_credit`).
pub(crate) struct CallOut {
    pub tx: FrameTx,
    pub credit: Option<Arc<Semaphore>>,
}

impl CallOut {
    /// Sends a frame carrying `body` bytes of the response body, first waiting for that much
    /// credit; `Err` once the stream is gone.
    async fn send_body(&self, frame: AgentFrame, body: usize) -> Result<(), ()> {
        if let (Some(credit), true) = (&self.credit, body > 0) {
            match credit.acquire_many(body as u32).await {
                Ok(p) => p.forget(),
                Err(_) => return Err(()),
            }
        }
        self.tx.send(frame).await.map_err(drop)
    }
}

/// Runs one call to its terminal frame and returns how it ended.
///
/// `tunnel_peer` is the remote address of the tunnel connection the call came on (what
/// `$tunnel_peer` stands for in a rule's `set_headers`).
pub(crate) async fn run_call(
    ctx: Arc<CallContext>,
    head: RequestHead,
    body: RequestBody,
    tunnel_peer: Option<std::net::IpAddr>,
    call_out: CallOut,
) -> CallOutcome {
    // This agent's span of the call: the tunnel server's span is its parent (or the
    // caller's `traceparent`, from a peer that does not fill the head's field).
    let trace = CallTrace::from_head_or_header(
        head.trace
            .map(|t| (t.trace_id_high, t.trace_id_low, t.parent_id, t.flags)),
        head.trace
            .is_none()
            .then(|| traceparent_record(&head.headers, ctx.max_headers))
            .flatten(),
    );
    let call_id = head.call_id;
    tracing::debug!(call_id, trace_id = %trace.trace_id, method = ?short(&head.method), "call started");
    let outcome = serve_call(&ctx, head, body, tunnel_peer, &call_out, &trace).await;
    trace.end(
        "relay.agent.call",
        SpanKind::Client,
        (outcome != CallOutcome::Ok).then(|| outcome.as_str()),
        || {
            vec![
                KeyValue::new("relay.outcome", outcome.as_str()),
                KeyValue::new("relay.call_id", call_id as i64),
            ]
        },
    );
    outcome
}

/// The value of a `traceparent` header among a head's first `max` header records.
fn traceparent_record(headers: &[Bytes], max: usize) -> Option<&[u8]> {
    headers
        .iter()
        .take(max)
        .filter_map(|record| relay_proto::parse_header(record).ok())
        .find(|(name, _)| name.eq_ignore_ascii_case(TRACEPARENT.as_bytes()))
        .map(|(_, value)| value)
}

async fn serve_call(
    ctx: &Arc<CallContext>,
    head: RequestHead,
    body: RequestBody,
    tunnel_peer: Option<std::net::IpAddr>,
    call_out: &CallOut,
    trace: &CallTrace,
) -> CallOutcome {
    let out = &call_out.tx;
    let call_id = head.call_id;
    let trace_id = trace.trace_id;
    let Ok(_permit) = ctx.inflight.clone().try_acquire_owned() else {
        let refusal = Rejection::Refused {
            reason: Reason::Concurrency,
            message: format!(
                "the agent is already carrying its limit of {} concurrent calls (coverage.max_inflight)",
                ctx.max_inflight
            ),
        };
        return reject(ctx, out, &head, refusal, trace_id).await;
    };
    let asked = if head.deadline_ms > 0 {
        Duration::from_millis(u64::from(head.deadline_ms))
    } else {
        ctx.call_timeout
    };
    let capped = asked > ctx.max_call_timeout;
    let deadline = Instant::now() + asked.min(ctx.max_call_timeout);

    // Before anything reads the headers: nothing is sized by a count over the limit.
    if head.headers.len() > ctx.max_headers {
        let refusal = Rejection::Refused {
            reason: Reason::HeaderSize,
            message: format!(
                "request head of {} headers exceeds the agent's limits.max_headers ({})",
                head.headers.len(),
                ctx.max_headers
            ),
        };
        return reject(ctx, out, &head, refusal, trace_id).await;
    }
    let prepared = match ctx.policy.prepare_call(&head, tunnel_peer) {
        Ok(p) => p,
        Err(r) => return reject(ctx, out, &head, r, trace_id).await,
    };
    tracing::debug!(call_id, %trace_id, rule = %prepared.rule, "call allowed");
    let mut headers = prepared.headers;
    // The upstream sees the trace with this agent's span as its parent.
    if let Ok(value) = http::HeaderValue::from_bytes(&trace.traceparent()) {
        headers.insert(TRACEPARENT_HEADER, value);
    }
    let request = UpstreamRequest {
        method: prepared.method,
        path_and_query: prepared.path_and_query.as_str().to_owned(),
        headers,
        body,
        body_limit: ctx.policy.limits().max_body_bytes,
        close_connection: prepared.close_connection,
    };
    let mut response = match ctx.upstream.send(request, deadline).await {
        Ok(r) => r,
        Err(e) => return fail(ctx, out, call_id, trace_id, &e, capped).await,
    };

    let mut empty = response.is_empty();
    // A small body of known length travels inside the head: one frame per hop instead of
    // two for the most common answer.
    let mut first = None;
    let mut whole = Bytes::new();
    if !empty
        && response
            .exact_len()
            .is_some_and(|n| n <= relay_proto::MAX_CHUNK as u64)
    {
        match tokio::time::timeout_at(deadline, response.next_chunk(relay_proto::MAX_CHUNK)).await {
            Ok(Ok(Some((data, true)))) => {
                whole = data;
                empty = true;
            }
            Ok(Ok(Some((data, false)))) => first = Some(data),
            Ok(Ok(None)) => empty = true,
            Ok(Err(e)) => return fail(ctx, out, call_id, trace_id, &e, capped).await,
            Err(_) => {
                return fail(ctx, out, call_id, trace_id, &UpstreamError::Timeout, capped).await
            }
        }
    }
    let head = ResponseHead {
        call_id,
        status: u32::from(response.status.as_u16()),
        headers: wire_headers(&response.headers),
        end_of_stream: empty,
        body: whole,
    };
    // A body inside the head ends the call: the server takes it whole, without credit.
    if call_out
        .send_body(AgentFrame::of(Kind::ResponseHead(head)), 0)
        .await
        .is_err()
    {
        return CallOutcome::StreamLost;
    }
    if empty {
        return CallOutcome::Ok;
    }

    // The whole call stays bounded by the deadline, body included.
    let streamed = tokio::time::timeout_at(deadline, async {
        loop {
            let next = match first.take() {
                Some(data) => Ok(Some((data, false))),
                None => response.next_chunk(relay_proto::MAX_CHUNK).await,
            };
            let (data, end) = match next {
                Ok(Some(piece)) => piece,
                Ok(None) => (Bytes::new(), true),
                Err(e) => return Err(e),
            };
            let n = data.len();
            let frame = AgentFrame::of(Kind::ResponseBody(BodyChunk { call_id, data, end }));
            // The last chunk ends the call: it needs no credit (the server takes it whole).
            let credit = if end { 0 } else { n };
            if call_out.send_body(frame, credit).await.is_err() {
                return Ok(false);
            }
            if end {
                return Ok(true);
            }
        }
    })
    .await;
    match streamed {
        Ok(Ok(true)) => CallOutcome::Ok,
        Ok(Ok(false)) => CallOutcome::StreamLost,
        Ok(Err(e)) => fail(ctx, out, call_id, trace_id, &e, capped).await,
        Err(_) => fail(ctx, out, call_id, trace_id, &UpstreamError::Timeout, capped).await,
    }
}

/// The upstream's response headers as a head's header records, slices of one buffer (see
/// [`relay_proto::wire_headers`]).
fn wire_headers(map: &http::HeaderMap) -> Vec<bytes::Bytes> {
    relay_proto::wire_headers(|| {
        map.iter()
            .map(|(n, v)| (n.as_str().as_bytes(), v.as_bytes()))
    })
}

/// The wire kind and metric outcome of an upstream error.
pub(crate) fn classify(e: &UpstreamError) -> (CallErrorKind, CallOutcome) {
    match e {
        UpstreamError::BadRequest(_) => (CallErrorKind::BadRequest, CallOutcome::BadRequest),
        UpstreamError::Unreachable(_) => (
            CallErrorKind::UpstreamUnreachable,
            CallOutcome::UpstreamUnreachable,
        ),
        UpstreamError::Timeout => (CallErrorKind::UpstreamTimeout, CallOutcome::UpstreamTimeout),
        UpstreamError::Aborted(_) => (CallErrorKind::UpstreamAborted, CallOutcome::UpstreamAborted),
        UpstreamError::BodyTooLarge(_) => (CallErrorKind::Refused, CallOutcome::Refused),
    }
}

/// A CallError frame.
pub(crate) fn call_error(
    call_id: u64,
    kind: CallErrorKind,
    message: impl Into<String>,
) -> AgentFrame {
    AgentFrame::of(Kind::CallError(CallError {
        call_id,
        kind: kind as i32,
        message: message.into(),
    }))
}

async fn fail(
    ctx: &CallContext,
    out: &FrameTx,
    call_id: u64,
    trace_id: TraceId,
    e: &UpstreamError,
    capped: bool,
) -> CallOutcome {
    let (kind, outcome) = classify(e);
    let message = match e {
        UpstreamError::Timeout if capped => format!(
            "{e}: the call's deadline was capped at the agent's max_call_timeout ({}s)",
            ctx.max_call_timeout.as_secs_f64()
        ),
        _ => e.to_string(),
    };
    if let UpstreamError::BodyTooLarge(_) = e {
        ctx.metrics.refused(Reason::BodySize);
        tracing::warn!(call_id, %trace_id, reason = Reason::BodySize.as_str(), detail = %message, "call refused");
    } else {
        tracing::info!(call_id, %trace_id, kind = kind.as_str_name(), error = %message, "call failed");
    }
    match out.send(call_error(call_id, kind, message)).await {
        Ok(()) => outcome,
        Err(_) => CallOutcome::StreamLost,
    }
}

/// Answers a call the agent will not make: counted, logged (method and path without the
/// query, escaped), and a CallError naming the reason.
async fn reject(
    ctx: &CallContext,
    out: &FrameTx,
    head: &RequestHead,
    rejection: Rejection,
    trace_id: TraceId,
) -> CallOutcome {
    let call_id = head.call_id;
    let method = short(&head.method);
    let path = log_path(&head.path_and_query);
    let (kind, outcome) = match rejection.reason() {
        Some(reason) => {
            ctx.metrics.refused(reason);
            tracing::warn!(call_id, %trace_id, method = ?method, path = ?path, reason = reason.as_str(), detail = %rejection.message(), "call refused");
            (CallErrorKind::Refused, CallOutcome::Refused)
        }
        None => {
            tracing::info!(call_id, %trace_id, method = ?method, path = ?path, detail = %rejection.message(), "bad request");
            (CallErrorKind::BadRequest, CallOutcome::BadRequest)
        }
    };
    let message = match rejection.reason() {
        Some(reason) => format!("refused ({}): {}", reason.as_str(), rejection.message()),
        None => rejection.message().to_string(),
    };
    match out.send(call_error(call_id, kind, message)).await {
        Ok(()) => outcome,
        Err(_) => CallOutcome::StreamLost,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every header reaches the wire with its own value, repeated names in order, empty
    /// values included.
    #[test]
    fn wire_headers_keep_every_value_in_order() {
        let mut map = http::HeaderMap::new();
        map.append("set-cookie", "a=1".parse().unwrap());
        map.append("content-type", "text/plain".parse().unwrap());
        map.append("set-cookie", "b=22".parse().unwrap());
        map.append("x-empty", "".parse().unwrap());
        map.append("etag", "\"abc\"".parse().unwrap());
        let wire: Vec<(String, Vec<u8>)> = wire_headers(&map)
            .iter()
            .map(|r| relay_proto::Header::parse(r).unwrap())
            .map(|h| (h.name_str().into_owned(), h.value.to_vec()))
            .collect();
        let want: Vec<(String, Vec<u8>)> = map
            .iter()
            .map(|(n, v)| (n.to_string(), v.as_bytes().to_vec()))
            .collect();
        assert_eq!(wire, want);
        assert_eq!(wire.len(), 5);
        assert!(wire.contains(&("x-empty".to_string(), vec![])));
        assert!(wire_headers(&http::HeaderMap::new()).is_empty());
    }
}
