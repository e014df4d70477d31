//! `Forward.Call`, `Forward.Carry`, `Forward.Proceed` and `Forward.Probe`, the
//! dispatcher-facing handlers.
//! `Call` reads the call head and hands the call to its own task (`crate::call`), which owns
//! it from there to its outcome; the handler returns the call's response stream at once.
//! `Proceed` is the dispatcher's go-ahead for a call holding a reserved stream (the queue
//! handshake, see `crate::call`).
//!
//! `Carry` is a carrier: one long-lived RPC on which the dispatcher sends calls one after
//! another, each framed as on `Call` (see `dispatch.proto`). One task per carrier
//! ([`carry`]) reads a call head, runs the call in place with the carrier's frames up to the
//! call's body end as its request ([`CallFrames`]), and takes the next head once the call
//! is answered and its body read. A call costs the same call task work as on `Call` but no
//! HTTP/2 stream, headers, trailers or task of its own (the per-call stream was 16-19 µs of
//! both ends' CPU per call in `cargo bench -p relay-dispatcher --bench forward_hop`). What
//! keeps a dispatcher's retries safe: the carrier ends cleanly only between calls (at
//! shutdown, or when the dispatcher retires it); a call that ends unanswered (its caller
//! left) or whose body cannot be read to its end ends the carrier.
//!
//! The same service serves the co-located dispatcher of this process without gRPC
//! ([`Colocated`], `relay_dispatcher::colocated::LocalServer`): the same accept path, call task
//! and counters, fed the dispatcher's frames directly.

use crate::call::{Call, Inbound, Reservations, ToCaller};
use crate::hub::Hub;
use crate::outcome::Outcome;
use futures::future::BoxFuture;
use futures::{Stream, StreamExt};
use relay_common::trace::CallTrace;
use relay_dispatcher::colocated::{LocalServer, RequestFrames, ResponseFrames};
use relay_proto::{
    forward_request, CallHead, ForwardRequest, ForwardResponse, ProceedReply, ProceedRequest,
    RequestHead,
};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status, Streaming};

/// Response frames buffered toward the dispatcher for one call (or one carrier): with the
/// carrier's HTTP/2 window, what a call whose caller stops reading keeps here (at most
/// 4 x 64 KiB beside the agent stream's window).
const CALL_BUFFER: usize = 4;

/// How long a carrier waits for the rest of a call's request body once the call is
/// answered (the agent answered before reading it all) before it ends instead.
const BODY_DRAIN: Duration = Duration::from_secs(5);

pub struct ForwardService {
    pub hub: Arc<Hub>,
    /// `relay_tunnel_calls_received_total`: every `Forward.Call` that reached this handler.
    /// Each one ends with exactly one `relay_tunnel_calls_total{outcome}`, so once quiet
    /// the two agree (the per-hop accounting check).
    pub received: prometheus::IntCounter,
    pub queue_timeout: Duration,
    /// `queue_handshake_after`: how long a call waits before it asks for the handshake.
    pub handshake_after: Duration,
    /// Reserved streams waiting for their `Forward.Proceed`, by reservation.
    pub reservations: Arc<Reservations>,
    pub tracker: tokio_util::task::TaskTracker,
    /// Cancelled when the server stops serving: idle carriers end.
    pub stop: CancellationToken,
}

/// The response stream of one `Forward.Call`. tonic drops it when the RPC is over (after
/// the last frame and the trailers) or when the dispatcher reset the call; the call's task
/// hears that as its sender closing.
pub type CallResponse = ReceiverStream<Result<ForwardResponse, Status>>;

impl ForwardService {
    /// A call refused before it began: still one outcome.
    fn refuse(&self, outcome: Outcome) -> Status {
        self.hub.metrics.call(&outcome);
        outcome.into_status()
    }

    /// One call: reads its head and hands it to its own task; the answer is the call's
    /// response stream, or the refusal of a call that could not begin.
    async fn accept(&self, mut inbound: impl Inbound) -> Result<CallResponse, Status> {
        self.received.inc();
        let first = match inbound.next().await.transpose() {
            Ok(m) => m,
            // The dispatcher's stream broke before the head.
            Err(status) => return Err(self.refuse(Outcome::BadRequest(status))),
        };
        let mut head = match first {
            Some(ForwardRequest {
                kind: Some(forward_request::Kind::Head(h)),
            }) => h,
            _ => {
                return Err(self.refuse(Outcome::BadRequest(Status::invalid_argument(
                    "the first forward frame must be a call head",
                ))))
            }
        };
        let Some(request) = head.request.take() else {
            return Err(self.refuse(Outcome::BadRequest(Status::invalid_argument(
                "call head without a request head",
            ))));
        };
        let (tx, rx) = mpsc::channel(CALL_BUFFER);
        let call = self.parts().call(head, request, tx, false);
        self.tracker.spawn(call.run(inbound));
        Ok(ReceiverStream::new(rx))
    }

    fn parts(&self) -> Parts {
        Parts {
            hub: self.hub.clone(),
            received: self.received.clone(),
            queue_timeout: self.queue_timeout,
            handshake_after: self.handshake_after,
            reservations: self.reservations.clone(),
        }
    }

    /// `Forward.Proceed`.
    fn proceed_reservation(&self, id: u64) -> Result<(), Status> {
        if !self.reservations.proceed(id) {
            return Err(Status::not_found(format!(
                "no stream is reserved as {id} (the call ended or was never queued here)"
            )));
        }
        Ok(())
    }
}

/// What a call needs from the service, owned by a carrier's task.
struct Parts {
    hub: Arc<Hub>,
    received: prometheus::IntCounter,
    queue_timeout: Duration,
    handshake_after: Duration,
    reservations: Arc<Reservations>,
}

impl Parts {
    /// A call of `head`, whose request head the caller took out of it; `carrier`: it came
    /// on a carrier.
    fn call(
        &self,
        head: CallHead,
        request: RequestHead,
        to_caller: ToCaller,
        carrier: bool,
    ) -> Call {
        let mut request = request;
        // This server's span of the call: the dispatcher's span is its parent, and it is
        // the agent's; the agent gets it in the head it receives.
        let trace = CallTrace::from_head_or_header(
            request
                .trace
                .map(|t| (t.trace_id_high, t.trace_id_low, t.parent_id, t.flags)),
            None,
        );
        if request.trace.is_some() {
            let (trace_id_high, trace_id_low, parent_id, flags) = trace.to_head();
            request.trace = Some(relay_proto::TraceParent {
                trace_id_high,
                trace_id_low,
                parent_id,
                flags,
            });
        }
        Call {
            trace,
            carrier,
            hub: self.hub.clone(),
            tunnel_id: head.tunnel_id,
            handshake: head.queue_handshake,
            request,
            queue_timeout: self.queue_timeout,
            handshake_after: self.handshake_after,
            reservations: self.reservations.clone(),
            to_caller,
        }
    }

    /// A carrier's frame that cannot begin a call: counted as one refused call, and the
    /// status that ends the carrier.
    fn refuse(&self, why: &'static str) -> Status {
        self.received.inc();
        let outcome = Outcome::BadRequest(Status::invalid_argument(why));
        self.hub.metrics.call(&outcome);
        outcome.into_status()
    }
}

/// Counts a carrier in `relay_tunnel_forward_carriers` while its task runs.
struct Open(prometheus::IntGauge);

impl Drop for Open {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// One carrier: calls one at a time, each answered before the next head is read. Returns
/// (ending the RPC cleanly) only between calls; a call left unanswered ends it with an
/// error status.
async fn carry(
    parts: Parts,
    mut inbound: Streaming<ForwardRequest>,
    tx: ToCaller,
    stop: CancellationToken,
) {
    parts.hub.metrics.carriers.inc();
    let _open = Open(parts.hub.metrics.carriers.clone());
    // Made once, not per call: a wait made anew each time registers and drops a waiter
    // under a lock for every call the carrier carries.
    let reset = tx.closed();
    let stopped = stop.cancelled();
    tokio::pin!(reset, stopped);
    loop {
        let next = tokio::select! {
            biased;
            next = inbound.next() => next,
            // The dispatcher reset the carrier, or this server stops serving.
            _ = &mut reset => return,
            _ = &mut stopped => return,
        };
        let mut head = match next {
            // Retired by the dispatcher, or broken.
            None | Some(Err(_)) => return,
            Some(Ok(ForwardRequest {
                kind: Some(forward_request::Kind::Head(head)),
            })) => head,
            Some(Ok(_)) => {
                let status = parts.refuse("a carrier's next frame must be a call head");
                let _ = tx.send(Err(status)).await;
                return;
            }
        };
        let Some(request) = head.request.take() else {
            let status = parts.refuse("call head without a request head");
            let _ = tx.send(Err(status)).await;
            return;
        };
        parts.received.inc();
        let mut frames = CallFrames {
            carrier: &mut inbound,
            ended: request.end_of_stream,
        };
        let call = parts.call(head, request, tx.clone(), true);
        if !call.run_on(&mut frames).await {
            // Its caller left (the carrier went with it), or the answer could not be sent.
            let _ = tx.try_send(Err(Status::cancelled("the call ended without an answer")));
            return;
        }
        if !frames.ended && !drain_body(&mut inbound).await {
            return;
        }
    }
}

/// Reads the rest of an answered call's request body; false when it does not come to
/// its end (another frame, the carrier's end or break, or `BODY_DRAIN`).
async fn drain_body(inbound: &mut Streaming<ForwardRequest>) -> bool {
    let drain = async {
        loop {
            match inbound.next().await {
                Some(Ok(ForwardRequest {
                    kind: Some(forward_request::Kind::Body(chunk)),
                })) if !chunk.end => {}
                Some(Ok(ForwardRequest {
                    kind: Some(forward_request::Kind::Body(_)),
                })) => return true,
                _ => return false,
            }
        }
    };
    tokio::time::timeout(BODY_DRAIN, drain)
        .await
        .unwrap_or(false)
}

/// One call's request frames on a carrier: the carrier's frames up to the body chunk with
/// `end` (`ended` tells the carrier the body was read to its end). Anything else the
/// carrier brings while the call runs is the dispatcher cancelling it: the carrier's end
/// (the dispatcher half-closes a carrier to cancel its call, the caller went away) or a
/// frame after the body's end; both are an error here, which the call turns into a
/// `Cancel` to the agent. (On `Forward.Call` the RPC's end without an end flag ends the
/// body: there the dispatcher only half-closes after a whole body.)
struct CallFrames<'a> {
    carrier: &'a mut Streaming<ForwardRequest>,
    ended: bool,
}

impl Stream for CallFrames<'_> {
    type Item = Result<ForwardRequest, Status>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        let cancelled = || Status::cancelled("the dispatcher cancelled the call on its carrier");
        match ready!(this.carrier.poll_next_unpin(cx)) {
            Some(Ok(ForwardRequest {
                kind: Some(forward_request::Kind::Body(chunk)),
            })) if !this.ended => {
                this.ended = chunk.end;
                Poll::Ready(Some(Ok(ForwardRequest::of(forward_request::Kind::Body(
                    chunk,
                )))))
            }
            Some(Err(status)) => Poll::Ready(Some(Err(status))),
            Some(Ok(_)) | None => Poll::Ready(Some(Err(cancelled()))),
        }
    }
}

/// The forward service as the co-located dispatcher's in-process tunnel server.
pub struct Colocated(pub Arc<ForwardService>);

impl LocalServer for Colocated {
    fn call(&self, request: RequestFrames) -> BoxFuture<'static, Result<ResponseFrames, Status>> {
        let service = self.0.clone();
        Box::pin(async move {
            let calls = service.accept(request.map(Ok)).await?;
            Ok(calls.boxed())
        })
    }

    fn proceed(&self, reservation: u64) -> Result<(), Status> {
        self.0.proceed_reservation(reservation)
    }
}

#[tonic::async_trait]
impl relay_proto::forward_server::Forward for ForwardService {
    type CallStream = CallResponse;

    async fn proceed(
        &self,
        request: Request<ProceedRequest>,
    ) -> Result<Response<ProceedReply>, Status> {
        self.proceed_reservation(request.into_inner().reservation)?;
        Ok(Response::new(ProceedReply {}))
    }

    /// The dispatcher times this answer to measure its leg to this server.
    async fn probe(
        &self,
        _request: Request<relay_proto::ProbeRequest>,
    ) -> Result<Response<relay_proto::ProbeReply>, Status> {
        Ok(Response::new(relay_proto::ProbeReply {}))
    }

    async fn call(
        &self,
        request: Request<Streaming<ForwardRequest>>,
    ) -> Result<Response<Self::CallStream>, Status> {
        self.accept(request.into_inner()).await.map(Response::new)
    }

    type CarryStream = CallResponse;

    async fn carry(
        &self,
        request: Request<Streaming<ForwardRequest>>,
    ) -> Result<Response<Self::CarryStream>, Status> {
        let (tx, rx) = mpsc::channel(CALL_BUFFER);
        self.tracker.spawn(carry(
            self.parts(),
            request.into_inner(),
            tx,
            self.stop.clone(),
        ));
        let mut response = Response::new(ReceiverStream::new(rx));
        // This server reads a whole small request body inside the call head.
        response.metadata_mut().insert(
            relay_proto::FORWARD_FEATURES,
            tonic::metadata::MetadataValue::from_static(relay_proto::FEATURE_INLINE_BODY),
        );
        Ok(response)
    }
}
