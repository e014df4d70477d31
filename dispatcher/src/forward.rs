//! Forwarding one call to a tunnel server over `Forward.Call`, with at most one retry on
//! another server while no agent can have taken the call.
//!
//! It owns the per-server gRPC channels (one lazily connected `Channel` per `forward_url`;
//! calls multiplex over it) and the attempt logic up to the response head. It must not
//! parse HTTP or choose error bodies: it hands back a `ResponseHead` plus the response
//! stream, or a [`Failure`].
//!
//! Retry rule: an attempt may be retried when the tunnel server could not be reached (the
//! RPC failed before any response) or answered `UNKNOWN_TUNNEL` / `DRAINING` (both mean no
//! agent saw the call), and the request body sent so far can be replayed (see `body`).
//! `NO_CAPACITY` goes back to the caller: another server is unlikely to do better within
//! the same deadline and retrying would double the queueing.

use crate::body::RequestBody;
use crate::error::{ErrorCode, Failure};
use crate::metrics::Metrics;
use crate::registry::Route;
use relay_proto::forward_client::ForwardClient;
use relay_proto::forward_request::Kind as ReqKind;
use relay_proto::forward_response::Kind as RespKind;
use relay_proto::{CallHead, ForwardRequest, ForwardResponse, Header, RequestHead, ResponseHead};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;
use tonic::codec::Streaming;
use tonic::transport::{Channel, Endpoint};
use tracing::{debug, info};

/// Largest response frame accepted from a tunnel server (a body chunk plus slack).
const MAX_RESPONSE_FRAME: usize = 4 * 1024 * 1024;
/// How many servers one call may try.
const MAX_ATTEMPTS: usize = 2;

/// One lazily connected channel per tunnel server `forward_url`.
#[derive(Clone, Default)]
pub struct Channels {
    inner: Arc<Mutex<HashMap<String, Channel>>>,
}

impl Channels {
    pub fn get(&self, forward_url: &str) -> Result<Channel, tonic::transport::Error> {
        let mut map = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(ch) = map.get(forward_url) {
            return Ok(ch.clone());
        }
        let channel = Endpoint::from_shared(forward_url.to_string())?
            .connect_timeout(Duration::from_secs(5))
            .tcp_nodelay(true)
            .http2_keep_alive_interval(Duration::from_secs(20))
            .keep_alive_timeout(Duration::from_secs(10))
            // Per-call receive window: bounds what one call buffers while the caller reads slowly.
            .initial_stream_window_size(1024 * 1024)
            .initial_connection_window_size(8 * 1024 * 1024)
            .connect_lazy();
        map.insert(forward_url.to_string(), channel.clone());
        Ok(channel)
    }

    /// Drops the cached channel of a server that left.
    pub fn evict(&self, forward_url: &str) {
        self.inner
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(forward_url);
    }
}

/// The parts of a caller's request that go into the `RequestHead`.
pub struct CallPlan {
    pub call_id: u64,
    pub tunnel_id: String,
    pub method: String,
    pub path_and_query: String,
    pub headers: Vec<Header>,
    pub end_of_stream: bool,
    pub deadline: Instant,
}

/// The tunnel server's answer: its response head and the stream carrying the body.
pub struct Answer {
    pub head: ResponseHead,
    pub stream: Streaming<ForwardResponse>,
    pub server_id: String,
}

pub struct Forwarder {
    pub channels: Channels,
    pub metrics: Metrics,
}

impl Forwarder {
    /// Forwards the call to the first candidate, retrying once on the next one when allowed.
    /// The caller bounds this with the call's deadline.
    pub async fn forward(
        &self,
        plan: &CallPlan,
        body: &RequestBody,
        candidates: &[Route],
    ) -> Result<Answer, Failure> {
        let mut last = Failure::new(
            ErrorCode::TunnelUnavailable,
            "no tunnel server holds streams for this tunnel id",
        );
        for (attempt, route) in candidates.iter().take(MAX_ATTEMPTS).enumerate() {
            if attempt > 0 {
                if !body.replayable() {
                    debug!(
                        call_id = plan.call_id,
                        "not retrying: request body already sent beyond replay"
                    );
                    break;
                }
                self.metrics.retries.inc();
                info!(call_id = plan.call_id, server_id = %route.server_id, reason = %last.message, "retrying on another tunnel server");
            }
            self.metrics
                .routing_decisions
                .with_label_values(&[route.server_id.as_str()])
                .inc();
            match self.attempt(plan, body, route, attempt as u32).await {
                Ok(answer) => return Ok(answer),
                Err((failure, retryable)) => {
                    debug!(call_id = plan.call_id, server_id = %route.server_id, code = failure.code.as_str(), retryable, "forward attempt failed");
                    last = failure;
                    if !retryable {
                        break;
                    }
                }
            }
        }
        Err(last)
    }

    async fn attempt(
        &self,
        plan: &CallPlan,
        body: &RequestBody,
        route: &Route,
        attempt: u32,
    ) -> Result<Answer, (Failure, bool)> {
        let unreachable = |why: String| {
            Failure::new(
                ErrorCode::TunnelServerUnreachable,
                format!("tunnel server {}: {why}", route.server_id),
            )
        };
        let channel = self
            .channels
            .get(&route.forward_url)
            .map_err(|e| (unreachable(e.to_string()), true))?;
        let remaining = plan.deadline.saturating_duration_since(Instant::now());
        let head = ForwardRequest::of(ReqKind::Head(CallHead {
            tunnel_id: plan.tunnel_id.clone(),
            request: Some(RequestHead {
                call_id: plan.call_id,
                method: plan.method.clone(),
                path_and_query: plan.path_and_query.clone(),
                headers: plan.headers.clone(),
                // At least 1 ms: 0 would mean "no deadline" on the wire.
                deadline_ms: u32::try_from(remaining.as_millis())
                    .unwrap_or(u32::MAX)
                    .max(1),
                end_of_stream: plan.end_of_stream,
            }),
        }));
        let mut client = ForwardClient::new(channel).max_decoding_message_size(MAX_RESPONSE_FRAME);
        let response = match client.call(body.attempt(attempt, head)).await {
            Ok(r) => r,
            Err(status) => {
                // Failing before any response header means the server never handed the call
                // to an agent: connection refused/reset, or the server rejected the RPC.
                let retryable = matches!(
                    status.code(),
                    tonic::Code::Unavailable | tonic::Code::Unknown
                );
                return Err((unreachable(status.message().to_string()), retryable));
            }
        };
        let mut stream = response.into_inner();
        match stream.message().await {
            Ok(Some(ForwardResponse {
                kind: Some(RespKind::Head(head)),
            })) => Ok(Answer {
                head,
                stream,
                server_id: route.server_id.clone(),
            }),
            Ok(Some(ForwardResponse {
                kind: Some(RespKind::Error(e)),
            })) => Err(Failure::from_forward_error(&e)),
            Ok(Some(_)) => Err((
                Failure::new(
                    ErrorCode::StreamLost,
                    "tunnel server sent a body before the response head",
                ),
                false,
            )),
            Ok(None) => Err((
                Failure::new(
                    ErrorCode::StreamLost,
                    "tunnel server ended the call without a response",
                ),
                false,
            )),
            Err(status) => Err((unreachable(status.message().to_string()), false)),
        }
    }
}
