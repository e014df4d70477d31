//! The HTTP front backends call: `ANY /relay/{tunnel_id}/{path}?{query}` with
//! `Authorization: Bearer <caller key>`, served as HTTP/1.1 and h2c on one listener.
//!
//! It owns the listener (connections, their limits, draining) and request validation
//! (head size, path, caller key, tunnel id, deadline, concurrency). It must not buffer
//! bodies (see `replay`, `response`) and must never log or forward the caller key.
//!
//! Each accepted request becomes a call (`call`), which routes it and answers; a refused
//! one ends there too, through the same `call::Outcome`.
//!
//! Concurrency: a caller holds at most `max_concurrent_calls` calls in flight, and with
//! `max_concurrent_calls_per_tunnel` at most that many to any one tunnel id, so one
//! tenant's slow calls cannot take every slot of a key several tenants share. Both answer
//! 429 `too_many_calls`; the slots are given back when the call ends (its body included).

use crate::call::{Accepted, Calls, Ids, Outcome};
use crate::config::{CallerConfig, Config, MIN_HEADER_BYTES};
use crate::error::{ErrorCode, Failure};
use crate::guard::CallGuard;
use crate::headers::{self, TIMEOUT_HEADER};
use crate::quota::TunnelQuota;
use crate::response::RelayBody;
use futures::StreamExt;
use http::{HeaderMap, Request, Response};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use relay_common::h2::H2Limits;
use relay_common::listen::{self, Conn, HeldBody, ListenerGuard};
use relay_common::secret::ct_eq;
use relay_common::tls::TlsServer;
use relay_common::trace::{CallTrace, TraceContext, TraceId, TRACEPARENT_HEADER};
use relay_common::tunnel_id::is_valid as valid_tunnel_id;
use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};
use zeroize::Zeroizing;

/// One configured caller and its concurrency slots.
struct Caller {
    config: CallerConfig,
    slots: Arc<Semaphore>,
    /// Calls in flight per tunnel id, when `max_concurrent_calls_per_tunnel` is set.
    per_tunnel: Option<Arc<TunnelQuota>>,
}

/// The request-handling half of the front, shared by all connections.
pub struct Front {
    callers: Vec<Caller>,
    max_request_body_bytes: Option<u64>,
    call_timeout: Duration,
    max_call_timeout: Duration,
    max_header_bytes: usize,
    /// What runs each accepted call.
    calls: Calls,
    next_call_id: AtomicU64,
}

impl Front {
    pub fn new(config: &Config, calls: Calls) -> Self {
        Front {
            callers: config
                .callers
                .iter()
                .map(|c| Caller {
                    config: c.clone(),
                    slots: Arc::new(Semaphore::new(c.max_concurrent_calls)),
                    per_tunnel: c.max_concurrent_calls_per_tunnel.map(|_| Arc::default()),
                })
                .collect(),
            max_request_body_bytes: config.max_request_body_bytes,
            call_timeout: config.call_timeout,
            max_call_timeout: config.max_call_timeout,
            max_header_bytes: config.max_header_bytes,
            calls,
            next_call_id: AtomicU64::new(1),
        }
    }

    /// The caller's name if the request carries a known key. Every key is compared, in
    /// constant time, so timing tells nothing about which one nearly matched; a key this
    /// connection's last accepted call presented is that caller again (see [`KeyMemo`]).
    fn authenticate(&self, headers: &HeaderMap, memo: &KeyMemo) -> Option<&Caller> {
        let mut values = headers.get_all(http::header::AUTHORIZATION).iter();
        let value = values.next()?;
        if values.next().is_some() {
            return None;
        }
        let value = value.as_bytes();
        let split = value.iter().position(|b| *b == b' ')?;
        let (scheme, rest) = value.split_at(split);
        if !scheme.eq_ignore_ascii_case(b"bearer") {
            return None;
        }
        let key = rest.trim_ascii();
        if let Some(i) = memo.recall(key) {
            return self.callers.get(i);
        }
        let mut found = None;
        for (i, caller) in self.callers.iter().enumerate() {
            let matches = caller.config.digest().is_some_and(|d| d.matches(key));
            if matches && found.is_none() {
                found = Some(i);
            }
        }
        let i = found?;
        memo.remember(key, i);
        self.callers.get(i)
    }

    /// Checks everything that can be checked before routing. On error, the tunnel id to
    /// name in the error body, if one was readable.
    fn accept<'a>(
        &'a self,
        parts: &http::request::Parts,
        memo: &KeyMemo,
        trace_id: TraceId,
    ) -> Result<Accepted<'a>, (Failure, Option<String>)> {
        if headers::head_size(&parts.method, &parts.uri, &parts.headers) > self.max_header_bytes {
            let f = Failure::new(
                ErrorCode::HeadersTooLarge,
                format!("request head over {} bytes", self.max_header_bytes),
            );
            return Err((f, None));
        }
        let Some(rest) = parts.uri.path().strip_prefix("/relay/") else {
            return Err((
                Failure::new(ErrorCode::NotFound, "calls go to /relay/{tunnel_id}/{path}"),
                None,
            ));
        };
        // `/relay/{id}` without a trailing slash is the upstream's root.
        let (tunnel_id, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, "/"),
        };
        let named = valid_tunnel_id(tunnel_id).then(|| tunnel_id.to_string());
        let Some(caller) = self.authenticate(&parts.headers, memo) else {
            let why = if parts.headers.contains_key(http::header::AUTHORIZATION) {
                "unknown caller key"
            } else {
                "missing caller key: send Authorization: Bearer <key>"
            };
            return Err((Failure::new(ErrorCode::Unauthorized, why), named));
        };
        let Some(tunnel_id) = named else {
            let f = Failure::new(
                ErrorCode::BadRequest,
                "tunnel id must be 1 to 128 characters of [A-Za-z0-9._-]",
            );
            return Err((f, None));
        };
        if !caller.config.may_reach(&tunnel_id) {
            let f = Failure::new(
                ErrorCode::Forbidden,
                "this caller key may not reach this tunnel id",
            );
            info!(caller = %caller.config.name, %trace_id, %tunnel_id, "call forbidden: tunnel id not in the caller's tunnels");
            return Err((f, Some(tunnel_id)));
        }
        if let Some(max) = self.max_request_body_bytes {
            let declared = parts
                .headers
                .get(http::header::CONTENT_LENGTH)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.trim().parse::<u64>().ok());
            if declared.is_some_and(|n| n > max) {
                return Err((Failure::body_too_large(max), Some(tunnel_id)));
            }
        }
        let timeout = match parts.headers.get(TIMEOUT_HEADER) {
            None => self.call_timeout,
            Some(v) => match v
                .to_str()
                .ok()
                .and_then(|s| s.trim().parse::<u64>().ok())
                .filter(|ms| *ms > 0)
            {
                Some(ms) => Duration::from_millis(ms).min(self.max_call_timeout),
                None => {
                    let f = Failure::new(
                        ErrorCode::BadRequest,
                        format!("{TIMEOUT_HEADER} must be a positive integer"),
                    );
                    return Err((f, Some(tunnel_id)));
                }
            },
        };
        let path_and_query = match parts.uri.query() {
            Some(q) => format!("{path}?{q}"),
            None => path.to_string(),
        };
        // Last, so a refused request never holds a slot.
        let Ok(permit) = caller.slots.clone().try_acquire_owned() else {
            let f = Failure::new(
                ErrorCode::TooManyCalls,
                format!(
                    "this caller has {} calls in flight, its max_concurrent_calls",
                    caller.config.max_concurrent_calls
                ),
            );
            info!(caller = %caller.config.name, %trace_id, %tunnel_id, "call refused: caller at max_concurrent_calls");
            return Err((f, Some(tunnel_id)));
        };
        let tunnel_permit = match (
            &caller.per_tunnel,
            caller.config.max_concurrent_calls_per_tunnel,
        ) {
            (Some(slots), Some(max)) => match slots.try_take(&tunnel_id, max) {
                Some(slot) => Some(slot),
                None => {
                    let f = Failure::new(
                        ErrorCode::TooManyCalls,
                        format!(
                            "this caller has {max} calls in flight to this tunnel id, its max_concurrent_calls_per_tunnel"
                        ),
                    );
                    info!(caller = %caller.config.name, %trace_id, %tunnel_id, "call refused: caller at max_concurrent_calls_per_tunnel");
                    return Err((f, Some(tunnel_id)));
                }
            },
            _ => None,
        };
        Ok(Accepted {
            caller: &caller.config.name,
            tunnel_id,
            path_and_query,
            timeout,
            permit,
            tunnel_permit,
        })
    }

    /// Handles one caller request end to end (up to the response head; the body streams on).
    /// `memo` is the caller key memo of the connection the request came on.
    pub async fn handle(&self, req: Request<Incoming>, memo: &KeyMemo) -> Response<RelayBody> {
        let start = Instant::now();
        let call_id = self.next_call_id.fetch_add(1, Ordering::Relaxed);
        let mut guard = CallGuard::new(self.calls.metrics.clone());
        let (parts, body) = req.into_parts();
        // The backend's trace (W3C `traceparent`), or one started here.
        let trace = CallTrace::begin(
            parts
                .headers
                .get(TRACEPARENT_HEADER)
                .and_then(|v| TraceContext::from_traceparent(v.as_bytes())),
        );
        guard.set_trace(trace);
        match self.accept(&parts, memo, trace.trace_id) {
            Ok(accepted) => {
                self.calls
                    .run(call_id, trace, start, guard, parts, body, accepted)
                    .await
            }
            Err((failure, tunnel_id)) => {
                let ids = Ids {
                    call_id,
                    trace_id: trace.trace_id,
                    tunnel_id: None,
                    caller: "",
                    path: parts.uri.path(),
                };
                Outcome::Rejected { failure, tunnel_id }.end(guard, ids)
            }
        }
    }
}

/// The caller key a connection's last accepted call presented, and that caller.
///
/// A backend sends the same key on every call of a keep-alive connection, and checking it
/// (its SHA-256 against every configured key's) was a twelfth of the dispatcher's
/// instructions per call. So each connection remembers the key of its last accepted call,
/// and a call presenting the same bytes (compared in constant time) is that caller again,
/// without the hashing; any other key is checked in full and, if accepted, remembered in
/// its place. The memo is the connection's own and holds only what that connection sent,
/// so whether a call hits it tells the client nothing it did not know. The callers are
/// fixed for the process's life, so a remembered caller never goes stale. The key is
/// wiped from memory when replaced and when the connection ends.
#[derive(Default)]
pub struct KeyMemo(parking_lot::Mutex<Option<(Zeroizing<Vec<u8>>, usize)>>);

impl KeyMemo {
    /// The caller index remembered for `key`, if `key` is the remembered key.
    fn recall(&self, key: &[u8]) -> Option<usize> {
        let memo = self.0.lock();
        let (known, caller) = memo.as_ref()?;
        ct_eq(known, key).then_some(*caller)
    }

    /// Remembers `key` as caller `caller`'s.
    fn remember(&self, key: &[u8], caller: usize) {
        *self.0.lock() = Some((Zeroizing::new(key.to_vec()), caller));
    }
}

/// Serves the front on `listener` until `stop` is cancelled, then lets calls in flight finish
/// for up to `grace` and cuts the rest.
/// With `tls`, every connection is TLS (handshakes run concurrently, so a slow client
/// cannot stall the accept loop); without, plain HTTP/1.1 and h2c. `guard` holds
/// connections to `[front_limits]`: a connection that holds no call for `idle_timeout`
/// (each call holds its connection until its response body is done) is closed
/// gracefully (HTTP/2: GOAWAY), as every connection is at shutdown.
pub async fn serve(
    listener: TcpListener,
    tls: Option<TlsServer>,
    guard: Arc<ListenerGuard>,
    h2: H2Limits,
    front: Arc<Front>,
    stop: CancellationToken,
    grace: Duration,
) {
    let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(Duration::from_secs(30))
        .max_buf_size(front.max_header_bytes.max(MIN_HEADER_BYTES));
    let mut http2 = builder.http2();
    http2.timer(TokioTimer::new());
    h2.hyper_server(&mut http2);
    // The head bound is `max_header_bytes`, checked per request with a clear 431.
    http2.max_header_list_size(
        u32::try_from(front.max_header_bytes)
            .unwrap_or(u32::MAX)
            .max(h2.max_header_list_bytes),
    );
    // Cancelled when the front stops: every connection closes gracefully.
    let draining = CancellationToken::new();
    let mut conns = JoinSet::new();
    // Accept errors are logged and backed off inside `incoming`.
    let mut incoming = Box::pin(listen::incoming(listener, tls, guard, stop.child_token()));
    loop {
        tokio::select! {
            // Stop first so a flood of connections cannot delay shutdown; then reap finished
            // connection tasks so the set stays small.
            biased;
            _ = stop.cancelled() => break,
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
            accepted = incoming.next() => {
                let stream: Conn = match accepted {
                    Some(Ok(s)) => s,
                    Some(Err(e)) => {
                        warn!(error = %e, "accept failed");
                        continue;
                    }
                    None => break,
                };
                let info = stream.info().clone();
                let peer = info.remote_addr;
                let idle = info.idle_notice();
                let front = front.clone();
                let memo = Arc::new(KeyMemo::default());
                let svc = hyper::service::service_fn(move |req| {
                    let front = front.clone();
                    let memo = memo.clone();
                    let held = info.hold();
                    async move {
                        let resp = front.handle(req, &memo).await;
                        Ok::<_, Infallible>(resp.map(|b| HeldBody::new(b, Some(held))))
                    }
                });
                let conn = builder.serve_connection(TokioIo::new(stream), svc).into_owned();
                let draining = draining.clone();
                conns.spawn(async move {
                    tokio::pin!(conn);
                    let r = tokio::select! {
                        r = conn.as_mut() => Some(r),
                        _ = idle => None,
                        _ = draining.cancelled() => None,
                    };
                    let r = match r {
                        Some(r) => r,
                        None => {
                            conn.as_mut().graceful_shutdown();
                            conn.await
                        }
                    };
                    if let Err(e) = r {
                        debug!(?peer, error = %e, "caller connection ended with an error");
                    }
                });
            }
        }
    }
    drop(incoming);
    info!(
        connections = conns.len(),
        calls_in_flight = front.calls.metrics.calls_in_flight.get(),
        "HTTP front draining"
    );
    draining.cancel();
    let drained = async { while conns.join_next().await.is_some() {} };
    if tokio::time::timeout(grace, drained).await.is_err() {
        warn!(
            calls_in_flight = front.calls.metrics.calls_in_flight.get(),
            "shutdown grace over; cutting the remaining calls"
        );
    }
    conns.shutdown().await;
}
