//! The remote address of the connection a client dialed, recorded by the connector that
//! dialed it (see `GrpcClient::lazy_observed`): what the peer is to the side that dialed,
//! the load balancer's address when there is one. A leaf: no I/O of its own.

use parking_lot::Mutex;
use std::net::SocketAddr;
use std::sync::Arc;

/// The remote address of the connection a channel last dialed; a channel holds one
/// connection at a time, so it names the current one. Cheap to clone (shared).
#[derive(Clone, Debug, Default)]
pub struct PeerAddr(Arc<Mutex<Option<SocketAddr>>>);

impl PeerAddr {
    /// The address, once a connection was made.
    pub fn get(&self) -> Option<SocketAddr> {
        *self.0.lock()
    }

    /// Records the address of a new connection.
    pub(crate) fn set(&self, addr: Option<SocketAddr>) {
        *self.0.lock() = addr;
    }
}
