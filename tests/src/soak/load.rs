//! The soak's calls, made by [`crate::load`]'s closed loop: each caller holds one
//! HTTP/1.1 keep-alive connection to the dispatcher's front and makes one call after
//! another on it; every answer is checked against what the simulated upstream sends.
//! Base calls come from a budget (`--calls`); burst calls (`GET /slow/{ms}`) run until
//! their burst ends.
//!
//! This module must not decide whether a run passed.

use super::CallMethod;
use crate::load::{keep_alive_request, Call, CallId, Expect, Ledger, Plan};
use bytes::Bytes;
use http::{HeaderValue, Method};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Where and how the callers call.
#[derive(Debug)]
pub(crate) struct Target {
    pub addr: SocketAddr,
    /// The `Host` header (the dispatcher URL's authority).
    pub host: String,
    pub auth: HeaderValue,
    pub tunnel_id: String,
    /// Tunnel server ids of the run (empty in external mode), to name the server an
    /// error message blames.
    pub servers: Vec<String>,
    /// The client's deadline for one whole call (head and body).
    pub timeout: Duration,
    pub method: CallMethod,
}

/// What one caller asks for.
#[derive(Clone, Copy, Debug)]
pub(crate) enum CallKind {
    /// The run's calls (`--method`): GET `/bytes/{n}` or POST `/echo/soak`.
    Base,
    /// Burst calls: GET `/slow/{ms}`.
    Slow(u64),
}

/// The calls of one kind, written in the run's ledger.
#[derive(Debug)]
pub(crate) struct Calls {
    pub target: Arc<Target>,
    pub ledger: Arc<Ledger>,
    kind: CallKind,
    /// Calls to make in all (`None`: until stopped).
    budget: Option<u64>,
    claimed: AtomicU64,
}

impl Calls {
    pub fn new(
        target: Arc<Target>,
        ledger: Arc<Ledger>,
        kind: CallKind,
        budget: Option<u64>,
    ) -> Self {
        Calls {
            target,
            ledger,
            kind,
            budget,
            claimed: AtomicU64::new(0),
        }
    }

    /// Takes one call from the budget; false once it is spent.
    fn claim(&self) -> bool {
        match self.budget {
            None => true,
            Some(b) => self.claimed.fetch_add(1, Ordering::Relaxed) < b,
        }
    }
}

impl Plan for Calls {
    type Tag = ();

    fn next(&self, id: CallId) -> Option<(Call, ())> {
        if !self.claim() {
            return None;
        }
        let (caller, seq) = (id.worker, id.seq);
        let t = &self.target.tunnel_id;
        let (method, path, body, expect) = match (self.kind, self.target.method) {
            (CallKind::Base, CallMethod::Get) => {
                // Lengths vary per call so an answer meant for another call shows.
                let n = 16 + (seq.wrapping_mul(7).wrapping_add(caller as u64)) % 128;
                (
                    Method::GET,
                    format!("/relay/{t}/bytes/{n}"),
                    Bytes::new(),
                    Expect::Pattern(n),
                )
            }
            (CallKind::Base, CallMethod::Post) => {
                let marker = Bytes::from(format!("soak {caller} {seq}"));
                (
                    Method::POST,
                    format!("/relay/{t}/echo/soak"),
                    marker.clone(),
                    Expect::Exact(marker),
                )
            }
            (CallKind::Slow(ms), _) => (
                Method::GET,
                format!("/relay/{t}/slow/{ms}"),
                Bytes::new(),
                Expect::Exact(Bytes::from_static(b"slow\n")),
            ),
        };
        let req = keep_alive_request(method, &path, &self.target.host, &self.target.auth, body);
        let mut call = Call::new(req, expect);
        call.timeout = Some(self.target.timeout);
        call.burst = matches!(self.kind, CallKind::Slow(_));
        Some((call, ()))
    }

    fn ledger(&self) -> &Ledger {
        &self.ledger
    }
}
