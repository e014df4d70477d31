//! `Forward.Call` and `Forward.Proceed`, the dispatcher-facing handlers. `Call` reads the
//! call head and hands the call to its own task (`crate::call`), which owns it from there
//! to its outcome; the handler returns the call's response stream at once. `Proceed` is the
//! dispatcher's go-ahead for a call holding a reserved stream (the queue handshake, see
//! `crate::call`).
//!
//! The same service serves the co-located dispatcher of this process without gRPC
//! ([`Colocated`], `relay_dispatcher::hop::LocalServer`): the same accept path, call task
//! and counters, fed the dispatcher's frames directly.

use crate::call::{Call, Inbound, Reservations};
use crate::hub::Hub;
use crate::outcome::Outcome;
use futures::future::BoxFuture;
use futures::StreamExt;
use relay_dispatcher::hop::{LocalServer, RequestFrames, ResponseFrames};
use relay_proto::{forward_request, ForwardRequest, ForwardResponse, ProceedReply, ProceedRequest};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

/// Response frames buffered toward the dispatcher for one call.
const CALL_BUFFER: usize = 16;

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
        let head = match first {
            Some(ForwardRequest {
                kind: Some(forward_request::Kind::Head(h)),
            }) => h,
            _ => {
                return Err(self.refuse(Outcome::BadRequest(Status::invalid_argument(
                    "the first forward frame must be a call head",
                ))))
            }
        };
        let Some(request) = head.request else {
            return Err(self.refuse(Outcome::BadRequest(Status::invalid_argument(
                "call head without a request head",
            ))));
        };
        let (tx, rx) = mpsc::channel(CALL_BUFFER);
        let call = Call {
            hub: self.hub.clone(),
            tunnel_id: head.tunnel_id,
            handshake: head.queue_handshake,
            request,
            queue_timeout: self.queue_timeout,
            handshake_after: self.handshake_after,
            reservations: self.reservations.clone(),
            to_caller: tx,
        };
        self.tracker.spawn(call.run(inbound));
        Ok(ReceiverStream::new(rx))
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

    async fn call(
        &self,
        request: Request<Streaming<ForwardRequest>>,
    ) -> Result<Response<Self::CallStream>, Status> {
        self.accept(request.into_inner()).await.map(Response::new)
    }
}
