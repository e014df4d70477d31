//! One call carried by a tunnel stream: a `RequestHead` (plus request body chunks fed in
//! by the stream) becomes an `UpstreamRequest`; the upstream's answer becomes
//! `ResponseHead` and `ResponseBody` frames of at most `MAX_CHUNK` bytes, ending with
//! exactly one terminal frame (a body chunk with `end`, a head with `end_of_stream`, or a
//! `CallError`). Upstream errors map to wire error kinds here, once.
//!
//! It never reads the tunnel stream itself (the stream task owns that) and never sends a
//! frame after its terminal one. Dropping the future drops the upstream request: that is
//! how a Cancel is carried out.

use crate::error::UpstreamError;
use crate::metrics::CallOutcome;
use crate::upstream::{Upstream, UpstreamRequest};
use bytes::Bytes;
use http::header::{HeaderMap, HeaderName, HeaderValue};
use http::Method;
use relay_proto::agent_frame::Kind;
use relay_proto::{
    AgentFrame, BodyChunk, CallError, CallErrorKind, Header, RequestHead, ResponseHead,
};
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::time::Instant;

/// Runs one call to its terminal frame and returns how it ended.
pub(crate) async fn run_call(
    upstream: Upstream,
    head: RequestHead,
    body: Option<mpsc::Receiver<Bytes>>,
    out: mpsc::Sender<AgentFrame>,
    default_timeout: Duration,
) -> CallOutcome {
    let call_id = head.call_id;
    let budget = if head.deadline_ms > 0 {
        Duration::from_millis(u64::from(head.deadline_ms))
    } else {
        default_timeout
    };
    let deadline = Instant::now() + budget;

    let request = match to_request(head, body) {
        Ok(r) => r,
        Err(e) => return fail(&out, call_id, &e).await,
    };
    let mut response = match upstream.send(request, deadline).await {
        Ok(r) => r,
        Err(e) => return fail(&out, call_id, &e).await,
    };

    let empty = response.is_empty();
    let head = ResponseHead {
        call_id,
        status: u32::from(response.status.as_u16()),
        headers: response
            .headers
            .iter()
            .map(|(n, v)| Header::new(n.as_str(), v.as_bytes()))
            .collect(),
        end_of_stream: empty,
    };
    if out
        .send(AgentFrame::of(Kind::ResponseHead(head)))
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
            let (data, end) = match response.next_chunk(relay_proto::MAX_CHUNK).await {
                Ok(Some(piece)) => piece,
                Ok(None) => (Bytes::new(), true),
                Err(e) => return Err(e),
            };
            let frame = AgentFrame::of(Kind::ResponseBody(BodyChunk {
                call_id,
                data: data.into(),
                end,
            }));
            if out.send(frame).await.is_err() {
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
        Ok(Err(e)) => fail(&out, call_id, &e).await,
        Err(_) => fail(&out, call_id, &UpstreamError::Timeout).await,
    }
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

async fn fail(out: &mpsc::Sender<AgentFrame>, call_id: u64, e: &UpstreamError) -> CallOutcome {
    let (kind, outcome) = classify(e);
    tracing::info!(call_id, kind = kind.as_str_name(), error = %e, "call failed");
    match out.send(call_error(call_id, kind, e.to_string())).await {
        Ok(()) => outcome,
        Err(_) => CallOutcome::StreamLost,
    }
}

fn to_request(
    head: RequestHead,
    body: Option<mpsc::Receiver<Bytes>>,
) -> Result<UpstreamRequest, UpstreamError> {
    let method = Method::from_bytes(head.method.as_bytes())
        .map_err(|_| UpstreamError::BadRequest(format!("invalid method {:?}", head.method)))?;
    let mut headers = HeaderMap::with_capacity(head.headers.len());
    for h in head.headers {
        let name = HeaderName::from_bytes(h.name.as_bytes())
            .map_err(|_| UpstreamError::BadRequest(format!("invalid header name {:?}", h.name)))?;
        let value = HeaderValue::from_bytes(&h.value)
            .map_err(|_| UpstreamError::BadRequest(format!("invalid value for header {name}")))?;
        headers.append(name, value);
    }
    Ok(UpstreamRequest {
        method,
        path_and_query: head.path_and_query,
        headers,
        body,
    })
}
