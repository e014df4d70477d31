//! The co-located seam: calls from this dispatcher straight into a tunnel server running
//! in this process, and the frame streams every hop to a tunnel server carries
//! ([`RequestFrames`], [`ResponseFrames`]; the gRPC hops are `pool` and `carrier`).
//!
//! The co-located mode (`relay-tunnel-server --front-config dispatcher.toml`) runs a
//! dispatcher inside a tunnel server process. That server is a [`LocalServer`]: the
//! dispatcher hands it a call's request frames as a stream and reads the response frames
//! back from a stream, with no HTTP/2 stream, no encoding and no socket between the two
//! (one process and one network hop less per call). Everything on either side of the
//! seam is the same code as over gRPC: the dispatcher's front (auth, routing, retries,
//! errors, body limits and timers) and the tunnel server's call task (queue, handshake,
//! outcome), so a call gets the same answers either way. A refusal is the same
//! `tonic::Status` the gRPC handler would have returned, and the end of the response
//! stream is the end of the RPC.

use futures::future::BoxFuture;
use futures::Stream;
use relay_proto::{ForwardRequest, ForwardResponse};
use std::pin::Pin;
use std::sync::Arc;
use tonic::Status;

/// A call's request frames, head first, as the dispatcher produces them.
pub type RequestFrames = Pin<Box<dyn Stream<Item = ForwardRequest> + Send>>;

/// A call's response frames from the tunnel server; the stream's end is the call's end.
pub type ResponseFrames = Pin<Box<dyn Stream<Item = Result<ForwardResponse, Status>> + Send>>;

/// A tunnel server in this process, serving `Forward.Call` and `Forward.Proceed` without
/// gRPC in between.
pub trait LocalServer: Send + Sync + 'static {
    /// `Forward.Call`: the server reads the head from `request` and answers with the
    /// response frames, or refuses the call as its gRPC handler would.
    fn call(&self, request: RequestFrames) -> BoxFuture<'static, Result<ResponseFrames, Status>>;

    /// `Forward.Proceed`: the go-ahead for the call waiting on `reservation`.
    fn proceed(&self, reservation: u64) -> Result<(), Status>;
}

/// The tunnel server in this process and the `forward_url` it reports to the registry:
/// calls routed to that URL take the in-process hop.
#[derive(Clone)]
pub struct Local {
    pub forward_url: String,
    pub server: Arc<dyn LocalServer>,
}

impl std::fmt::Debug for Local {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Local")
            .field("forward_url", &self.forward_url)
            .finish_non_exhaustive()
    }
}
