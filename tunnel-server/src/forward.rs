//! `Forward.Call`: the dispatcher hands this server one call. The handler takes the
//! newest idle stream of the tunnel id (or waits in its queue), puts the call on it, sends
//! the request head and pumps the request body to the agent. The stream's reader relays
//! the agent's answer straight into the response stream and ends the call.
//!
//! A caller that goes away (the dispatcher drops the RPC) becomes a `Cancel` to the agent;
//! the stream stays busy until the agent's terminal frame, so a stream is never reused
//! while the previous call still runs on it.

use crate::hub::{AcquireError, Hub};
use crate::stream::CallSlot;
use relay_proto::{
    forward_request, server_frame, BodyChunk, Cancel, ForwardErrorKind, ForwardRequest,
    ForwardResponse, RequestHead, ServerFrame,
};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};
use tracing::debug;

/// How long a cancelled call may take to be acknowledged by the agent before its stream
/// is given up on.
const CANCEL_ACK: Duration = Duration::from_secs(10);

pub struct ForwardService {
    pub hub: Arc<Hub>,
    /// `relay_tunnel_calls_received_total`: every `Forward.Call` that reached this handler.
    /// Each one ends with exactly one `relay_tunnel_calls_total{outcome}`, so once quiet
    /// the two agree (the per-hop accounting check).
    pub received: prometheus::IntCounter,
    pub queue_timeout: Duration,
    pub tracker: tokio_util::task::TaskTracker,
}

#[tonic::async_trait]
impl relay_proto::forward_server::Forward for ForwardService {
    type CallStream = ReceiverStream<Result<ForwardResponse, Status>>;

    async fn call(
        &self,
        request: Request<Streaming<ForwardRequest>>,
    ) -> Result<Response<Self::CallStream>, Status> {
        self.received.inc();
        let mut inbound = request.into_inner();
        let first = match inbound.message().await {
            Ok(m) => m,
            Err(status) => {
                // The dispatcher's stream broke before the head: still one outcome.
                self.hub.metrics.call("bad_request");
                return Err(status);
            }
        };
        let head = match first {
            Some(ForwardRequest {
                kind: Some(forward_request::Kind::Head(h)),
            }) => h,
            _ => {
                self.hub.metrics.call("bad_request");
                return Err(Status::invalid_argument(
                    "the first forward frame must be a call head",
                ));
            }
        };
        let Some(request) = head.request else {
            self.hub.metrics.call("bad_request");
            return Err(Status::invalid_argument("call head without a request head"));
        };
        let (tx, rx) = mpsc::channel(16);
        let call = Call {
            hub: self.hub.clone(),
            tunnel_id: head.tunnel_id,
            request,
            queue_timeout: self.queue_timeout,
            to_caller: tx,
        };
        self.tracker.spawn(call.run(inbound));
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

struct Call {
    hub: Arc<Hub>,
    tunnel_id: String,
    request: RequestHead,
    queue_timeout: Duration,
    to_caller: mpsc::Sender<Result<ForwardResponse, Status>>,
}

impl Call {
    async fn run(self, mut inbound: Streaming<ForwardRequest>) {
        let hub = &self.hub;
        let now = Instant::now();
        let mut wait = self.queue_timeout;
        if self.request.deadline_ms > 0 {
            // Give up queueing a little before the caller's deadline, so the caller hears
            // "no capacity" rather than a bare timeout.
            let deadline = Duration::from_millis(self.request.deadline_ms as u64);
            let margin =
                (deadline / 10).clamp(Duration::from_millis(5), Duration::from_millis(250));
            wait = wait.min(deadline.saturating_sub(margin));
        }
        let (stream, call_id, mut done) = loop {
            let gone = self.to_caller.clone();
            let stream = match hub
                .acquire(
                    &self.tunnel_id,
                    now + wait,
                    async move { gone.closed().await },
                )
                .await
            {
                Ok(s) => s,
                Err(e) => {
                    let (kind, outcome, msg) = match e {
                        AcquireError::UnknownTunnel => (
                            ForwardErrorKind::UnknownTunnel,
                            "unknown_tunnel",
                            format!("no stream of tunnel id {} on this server", self.tunnel_id),
                        ),
                        AcquireError::NoCapacity(why) => {
                            (ForwardErrorKind::NoCapacity, "no_capacity", why.to_string())
                        }
                        AcquireError::Cancelled => {
                            hub.metrics.call("cancelled");
                            return;
                        }
                    };
                    hub.metrics.call(outcome);
                    let _ = self
                        .to_caller
                        .send(Ok(ForwardResponse::error(kind, msg)))
                        .await;
                    return;
                }
            };
            let call_id = hub.next_call_id();
            let (done_tx, done) = oneshot::channel();
            hub.metrics.in_flight.inc();
            let slot = CallSlot {
                call_id,
                to_caller: self.to_caller.clone(),
                done: Some(done_tx),
                head_seen: false,
                started: now,
            };
            match stream.begin_call(slot) {
                Ok(()) => break (stream, call_id, done),
                Err(_) => {
                    // The stream died between acquire and now; no agent saw the call:
                    // give the stream back (the hub closes it) and take another.
                    hub.metrics.in_flight.dec();
                    hub.release(stream);
                }
            }
        };
        let mut head = self.request;
        head.call_id = call_id;
        if head.deadline_ms > 0 {
            let left = Duration::from_millis(head.deadline_ms as u64).saturating_sub(now.elapsed());
            head.deadline_ms = left.as_millis().max(1) as u32;
        }
        let mut body_open = !head.end_of_stream;
        debug!(tunnel_id = %self.tunnel_id, call_id, stream_id = stream.id, "call on stream");
        // If the stream died, its reader reports STREAM_LOST through the slot.
        let _ = stream
            .send(ServerFrame::of(server_frame::Kind::RequestHead(head)))
            .await;
        loop {
            tokio::select! {
                // Order: the call's end first, then the caller leaving, then more body.
                biased;
                _ = &mut done => return,
                _ = self.to_caller.closed() => {
                    stream.try_send(ServerFrame::of(server_frame::Kind::Cancel(Cancel { call_id })));
                    break;
                }
                msg = inbound.message(), if body_open => match msg {
                    Ok(Some(ForwardRequest { kind: Some(forward_request::Kind::Body(mut chunk)) })) => {
                        if chunk.data.len() > relay_proto::MAX_CHUNK {
                            stream.try_send(ServerFrame::of(server_frame::Kind::Cancel(Cancel { call_id })));
                            break;
                        }
                        body_open = !chunk.end;
                        chunk.call_id = call_id;
                        let _ = stream.send(ServerFrame::of(server_frame::Kind::RequestBody(chunk))).await;
                    }
                    Ok(None) => {
                        // The dispatcher ended its half without an end flag: end the body.
                        body_open = false;
                        let end = BodyChunk { call_id, data: Default::default(), end: true };
                        let _ = stream.send(ServerFrame::of(server_frame::Kind::RequestBody(end))).await;
                    }
                    Ok(Some(_)) | Err(_) => {
                        // A malformed frame or a broken caller stream: cancel the call.
                        stream.try_send(ServerFrame::of(server_frame::Kind::Cancel(Cancel { call_id })));
                        break;
                    }
                },
            }
        }
        // Cancelled: the stream stays busy until the agent acknowledges.
        if tokio::time::timeout(CANCEL_ACK, done).await.is_err() {
            stream.close();
        }
    }
}
