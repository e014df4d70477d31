//! The connections to one tunnel server ([`Remote`]): as many HTTP/2 connections as its
//! calls need, at most `[forward_h2] max_concurrent_streams` streams each, so that every
//! stream's window fits in its connection's window and a call whose caller stops reading
//! holds its own window and nothing another call needs (`relay_common::h2`, Isolation).
//!
//! Every stream this dispatcher opens to the server holds a [`Permit`] of its connection
//! for the stream's life: a carrier (idle or busy, until its RPC is over), a `Forward.Call`
//! (until its response stream is dropped) and a `Forward.Proceed`. A call first looks for
//! an idle carrier, connections in the order they were opened; else it takes a permit on
//! the first connection with a stream free, and when every connection is full it opens
//! another. Calls so gather on the first connections (frames of many calls go out in one
//! write, `relay_common::h2io`); a later connection that carries nothing any more is closed
//! when the next call looks. A connection that broke is forgotten ([`Remote::forget`]):
//! its calls end with it, the next ones dial afresh.
//!
//! A server whose path went dead (its connection went silent past the keep-alive, or a
//! dial failed) is **down**: calls to it fail at once, as never having reached it, and go
//! to the next server the router picked, instead of each waiting on a new dial into the
//! same silence. A probe (`Forward.Proceed` for no reservation, which a live server
//! answers NOT_FOUND) goes out in the background with a growing pause (0.25 s to 5 s), and
//! the first answer brings the server back.
//!
//! This module must not decide retries or parse answers (`attempt` and `forward` do); it
//! places streams on connections.

use crate::carrier::Carriers;
use crate::colocated::ResponseFrames;
use crate::replay::AttemptStream;
use futures::StreamExt;
use parking_lot::Mutex;
use relay_common::grpc::GrpcClient;
use relay_proto::forward_client::ForwardClient;
use relay_proto::ProceedRequest;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;
use tokio::time::Instant;
use tonic::transport::{Channel, Endpoint};
use tonic::Status;
use tracing::{info, warn};

/// First pause before probing a server that went down.
const PROBE_FIRST: Duration = Duration::from_millis(250);
/// Longest pause between probes.
const PROBE_MAX: Duration = Duration::from_secs(5);
/// How long a probe may take: a dead path leaves it unanswered.
const PROBE_TIMEOUT: Duration = Duration::from_secs(3);

/// One HTTP/2 connection to a tunnel server, with the carriers on it.
pub struct Conn {
    id: u64,
    channel: Channel,
    carriers: Arc<Carriers>,
    /// Streams this dispatcher has open on it (each a [`Permit`]).
    streams: AtomicUsize,
    /// `relay_dispatcher_forward_connections`, while the connection is in the pool.
    gauge: prometheus::IntGauge,
}

impl Drop for Conn {
    fn drop(&mut self) {
        self.gauge.dec();
    }
}

/// Probes a down server until it answers (or is gone), with a growing pause.
async fn probe(remote: Weak<Remote>) {
    let mut pause = PROBE_FIRST;
    let started = Instant::now();
    loop {
        tokio::time::sleep(pause).await;
        let Some(r) = remote.upgrade() else { return };
        let answered = match tokio::time::timeout(PROBE_TIMEOUT, r.proceed(u64::MAX)).await {
            // Any status of the server's own is an answer (NOT_FOUND: no such reservation).
            Ok(Ok(())) => true,
            Ok(Err((status, conn))) => {
                let own = std::error::Error::source(&status).is_none();
                if !own {
                    r.forget(conn);
                }
                own
            }
            Err(_) => {
                // Unanswered: that connection is as dead as the last one.
                r.conns.lock().clear();
                false
            }
        };
        if answered {
            *r.down.lock() = None;
            r.down_gauge.dec();
            info!(url = %r.url, down_ms = started.elapsed().as_millis() as u64, "tunnel server answers again");
            return;
        }
        pause = (pause * 2).min(PROBE_MAX);
    }
}

/// One stream of a connection, given back when dropped.
pub struct Permit(Arc<Conn>);

impl Drop for Permit {
    fn drop(&mut self) {
        self.0.streams.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Which connection a call went on, so that a call that found it broken can have it
/// forgotten.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConnId(u64);

/// A tunnel server over gRPC: its connections (see the module docs).
pub struct Remote {
    endpoint: Endpoint,
    client: GrpcClient,
    /// Streams per connection: `[forward_h2] max_concurrent_streams`.
    per_connection: usize,
    /// `carrier_idle_timeout`.
    carrier_idle_timeout: Duration,
    /// Largest gRPC message sent to or accepted from the server.
    max_frame_bytes: usize,
    /// In the order they were opened.
    conns: Mutex<Vec<Arc<Conn>>>,
    next_id: AtomicU64,
    /// False once the server answered `Forward.Carry` with UNIMPLEMENTED (an older
    /// version): then every call is a `Forward.Call`.
    carries: AtomicBool,
    gauge: prometheus::IntGauge,
    /// Why the server is down, while it is (see the module docs).
    down: parking_lot::Mutex<Option<String>>,
    /// `relay_dispatcher_forward_servers_down`.
    down_gauge: prometheus::IntGauge,
    /// For the logs and the calls' errors.
    url: String,
}

/// What [`Remote::new`] takes.
pub struct RemoteParts {
    pub endpoint: Endpoint,
    pub client: GrpcClient,
    pub per_connection: usize,
    pub carrier_idle_timeout: Duration,
    pub max_frame_bytes: usize,
    /// `relay_dispatcher_forward_connections`.
    pub gauge: prometheus::IntGauge,
    /// The server's `forward_url`, for logs and errors.
    pub url: String,
    /// `relay_dispatcher_forward_servers_down`.
    pub down_gauge: prometheus::IntGauge,
}

impl Remote {
    pub fn new(p: RemoteParts) -> Self {
        Remote {
            endpoint: p.endpoint,
            client: p.client,
            per_connection: p.per_connection.max(1),
            carrier_idle_timeout: p.carrier_idle_timeout,
            max_frame_bytes: p.max_frame_bytes,
            conns: Mutex::default(),
            next_id: AtomicU64::new(0),
            carries: AtomicBool::new(true),
            gauge: p.gauge,
            down: parking_lot::Mutex::new(None),
            down_gauge: p.down_gauge,
            url: p.url,
        }
    }

    /// Why the server is down, if it is.
    pub fn down(&self) -> Option<String> {
        self.down.lock().clone()
    }

    /// The path to the server went dead (`why`): calls fail at once until a probe
    /// answers. Starts the prober unless one runs.
    pub fn mark_down(self: &Arc<Self>, why: String) {
        {
            let mut down = self.down.lock();
            if down.is_some() {
                return;
            }
            warn!(url = %self.url, reason = %why, "tunnel server unreachable: calls go to other servers until it answers a probe");
            *down = Some(why);
            self.down_gauge.inc();
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        rt.spawn(probe(Arc::downgrade(self)));
    }

    /// Connections open (or being dialled) now.
    pub fn connections(&self) -> usize {
        self.conns.lock().len()
    }

    fn client(&self, channel: &Channel) -> ForwardClient<Channel> {
        ForwardClient::new(channel.clone())
            .max_decoding_message_size(self.max_frame_bytes)
            .max_encoding_message_size(self.max_frame_bytes)
    }

    /// A stream on the first connection with one free, opening a connection when all are
    /// full. Connections after the first that carry nothing are closed on the way.
    fn permit(&self) -> Permit {
        let mut conns = self.conns.lock();
        let mut i = 1;
        while i < conns.len() {
            let c = &conns[i];
            if c.streams.load(Ordering::Relaxed) == 0 && c.carriers.idle() == 0 {
                conns.remove(i);
            } else {
                i += 1;
            }
        }
        for c in conns.iter() {
            // Only taken under the pool's lock, so the check and the take are one step.
            if c.streams.load(Ordering::Relaxed) < self.per_connection {
                c.streams.fetch_add(1, Ordering::Relaxed);
                return Permit(c.clone());
            }
        }
        let conn = Arc::new(Conn {
            id: self.next_id.fetch_add(1, Ordering::Relaxed),
            channel: self.client.lazy(self.endpoint.clone()),
            carriers: Arc::new(Carriers::new(self.carrier_idle_timeout)),
            streams: AtomicUsize::new(1),
            gauge: self.gauge.clone(),
        });
        self.gauge.inc();
        conns.push(conn.clone());
        Permit(conn)
    }

    /// Starts a call: on an idle carrier, on a new carrier, or as a `Forward.Call` to a
    /// server without carriers; `replay` gives the request again from its start for a
    /// server found not to know carriers. Returns the answer's frames and the connection
    /// they come on.
    pub async fn call(
        &self,
        request: AttemptStream,
        replay: impl FnOnce() -> Option<AttemptStream>,
        opened: &prometheus::IntCounter,
    ) -> Result<(ResponseFrames, ConnId), (Status, Option<ConnId>)> {
        if let Some(why) = self.down() {
            // No transport error behind it: the call never left (safe to retry).
            return Err((
                Status::unavailable(format!("unreachable ({why}); probing it")),
                None,
            ));
        }
        if !self.carries.load(Ordering::Relaxed) {
            return self.forward_call(request).await;
        }
        let mut request = Some(request);
        let conns: Vec<Arc<Conn>> = self.conns.lock().clone();
        for c in &conns {
            if let Some(frames) = c.carriers.call_on_idle(&mut request) {
                return Ok((frames, ConnId(c.id)));
            }
        }
        let Some(request) = request else {
            return Err((Status::internal("the call went on no carrier"), None));
        };
        let permit = self.permit();
        let conn = permit.0.clone();
        let id = ConnId(conn.id);
        match conn
            .carriers
            .open(
                self.client(&conn.channel),
                request,
                Box::new(permit),
                opened,
            )
            .await
        {
            Ok(frames) => Ok((frames, id)),
            // A server without carriers (no transport error behind the status): this call
            // and the next ones go as `Forward.Call`, the request replayed from its start.
            Err(status)
                if status.code() == tonic::Code::Unimplemented
                    && std::error::Error::source(&status).is_none() =>
            {
                self.carries.store(false, Ordering::Relaxed);
                match replay() {
                    Some(request) => self.forward_call(request).await,
                    None => Err((status, Some(id))),
                }
            }
            Err(status) => Err((status, Some(id))),
        }
    }

    /// One `Forward.Call`; its stream holds its permit until dropped.
    async fn forward_call(
        &self,
        request: AttemptStream,
    ) -> Result<(ResponseFrames, ConnId), (Status, Option<ConnId>)> {
        let permit = self.permit();
        let id = ConnId(permit.0.id);
        match self.client(&permit.0.channel).call(request).await {
            Ok(r) => {
                let frames = r.into_inner().map(move |frame| {
                    let _stream = &permit;
                    frame
                });
                Ok((frames.boxed(), id))
            }
            Err(status) => Err((status, Some(id))),
        }
    }

    /// `Forward.Proceed` for a call's reserved stream.
    pub async fn proceed(&self, reservation: u64) -> Result<(), (Status, ConnId)> {
        let permit = self.permit();
        let id = ConnId(permit.0.id);
        let r = self
            .client(&permit.0.channel)
            .proceed(ProceedRequest { reservation })
            .await;
        drop(permit);
        r.map(drop).map_err(|s| (s, id))
    }

    /// One round trip to the server (`Forward.Probe`) on the connection its calls use first;
    /// `None` when it could not be timed (no answer within `timeout`, no connection, or the
    /// server is down).
    pub async fn round_trip(&self, timeout: Duration) -> Option<Duration> {
        if self.down().is_some() {
            return None;
        }
        let permit = self.permit();
        let mut client = self.client(&permit.0.channel);
        let started = Instant::now();
        let answer =
            tokio::time::timeout(timeout, client.probe(relay_proto::ProbeRequest {})).await;
        drop(permit);
        match answer {
            // An error status is an answer too (a server without the RPC); a transport
            // error (no connection) is not.
            Ok(Ok(_)) => Some(started.elapsed()),
            Ok(Err(status)) if std::error::Error::source(&status).is_none() => {
                Some(started.elapsed())
            }
            _ => None,
        }
    }

    /// Forgets connection `id` (its connection broke): its streams end with it, and the
    /// next call dials afresh rather than going onto a connection known dead.
    pub fn forget(&self, id: ConnId) {
        self.conns.lock().retain(|c| c.id != id.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use relay_common::h2::H2Limits;

    fn remote(per_connection: usize) -> Remote {
        let client = GrpcClient::new(H2Limits::FORWARD, Duration::from_secs(1), None);
        Remote::new(RemoteParts {
            endpoint: client.endpoint("http://127.0.0.1:9").unwrap(),
            client,
            per_connection,
            carrier_idle_timeout: Duration::from_secs(60),
            max_frame_bytes: 1 << 20,
            gauge: prometheus::IntGauge::new("c", "c").unwrap(),
            url: "http://127.0.0.1:9".into(),
            down_gauge: prometheus::IntGauge::new("d", "d").unwrap(),
        })
    }

    #[tokio::test]
    async fn a_connection_carries_at_most_its_streams_and_a_full_pool_opens_another() {
        let r = remote(3);
        let held: Vec<Permit> = (0..7).map(|_| r.permit()).collect();
        assert_eq!(r.connections(), 3, "7 streams at 3 a connection");
        let per_conn: Vec<usize> = r
            .conns
            .lock()
            .iter()
            .map(|c| c.streams.load(Ordering::Relaxed))
            .collect();
        assert_eq!(per_conn, vec![3, 3, 1]);
        assert_eq!(r.gauge.get(), 3);
        drop(held);
        // The next stream goes on the first connection; the empty later ones are closed.
        let p = r.permit();
        assert_eq!(r.connections(), 1);
        assert_eq!(p.0.id, 0);
        assert_eq!(r.gauge.get(), 1);
    }

    #[tokio::test]
    async fn a_freed_stream_on_an_earlier_connection_is_taken_first() {
        let r = remote(2);
        let mut held: Vec<Permit> = (0..4).map(|_| r.permit()).collect();
        assert_eq!(r.connections(), 2);
        held.remove(0);
        let p = r.permit();
        assert_eq!(p.0.id, 0, "the first connection had a stream free");
        assert_eq!(r.connections(), 2);
    }

    #[tokio::test]
    async fn a_forgotten_connection_is_not_used_again() {
        let r = remote(8);
        let p = r.permit();
        let id = ConnId(p.0.id);
        r.forget(id);
        let q = r.permit();
        assert_ne!(q.0.id, p.0.id);
        drop(p);
        assert_eq!(r.connections(), 1);
    }
}
