//! The HTTP front backends call: `ANY /relay/{tunnel_id}/{path}?{query}` with
//! `Authorization: Bearer <caller key>`, served as HTTP/1.1 and h2c on one listener.
//!
//! It owns request validation (head size, path, caller key, tunnel id, deadline), the
//! choice of servers to try, and turning the tunnel server's answer (or a [`Failure`]) into
//! the caller's response. It must not buffer bodies (see `replay`, `response`) and must never log or
//! forward the caller key.
//!
//! What comes back from a tunnel server is a peer's word, checked before it reaches the
//! caller:
//! - a response head over `max_response_headers` or `max_response_header_bytes` gets 502
//!   `bad_response` (checked on lengths only, before any header is parsed);
//! - a `Location` that sends a redirect-following backend to another tunnel id on this
//!   front (`/relay/<other id>/...`, relative or absolute with this front's host; see
//!   `headers::redirect_into_other_tunnel`) gets 502 `bad_response` rather than being
//!   rewritten: a rewrite would have to guess where the upstream meant to send the caller,
//!   while a refusal tells the caller plainly, and the backend never resends its key and
//!   body into another tenant's tunnel;
//! - the body is bounded in time by the call's deadline and by `body_idle_timeout`
//!   between two frames (see `response`).
//!
//! Concurrency: a caller holds at most `max_concurrent_calls` calls in flight, and with
//! `max_concurrent_calls_per_tunnel` at most that many to any one tunnel id, so one
//! tenant's slow calls cannot take every slot of a key several tenants share. Both answer
//! 429 `too_many_calls`; the slots are given back when the call ends (its body included).

use crate::config::{CallerConfig, Config, MIN_HEADER_BYTES};
use crate::error::{ErrorCode, Failure, RequestBodyError};
use crate::forward::{CallPlan, Forwarder};
use crate::headers::{self, TIMEOUT_HEADER};
use crate::metrics::{CallOutcome, Metrics};
use crate::outcome::CallGuard;
use crate::quota::{TunnelPermit, TunnelQuota};
use crate::registry::Routes;
use crate::replay::{CallerBody, RequestBody};
use crate::response::{BodyTimers, RelayBody};
use futures::StreamExt;
use http::{HeaderMap, Request, Response, StatusCode};
use http_body::Body;
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use relay_common::h2::H2Limits;
use relay_common::listen::{self, Conn, HeldBody, ListenerGuard};
use relay_common::tls::TlsServer;
use relay_common::tunnel_id::is_valid as valid_tunnel_id;
use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

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
    /// `max_response_headers` / `max_response_header_bytes`.
    head_limits: relay_proto::HeadLimits,
    body_idle_timeout: Duration,
    routes: Arc<Routes>,
    forwarder: Forwarder,
    /// Shared with every call's guard: one reference count per call, not a clone of every
    /// metric handle.
    metrics: Arc<Metrics>,
    next_call_id: AtomicU64,
}

/// A request that passed validation.
struct Accepted<'a> {
    caller: &'a str,
    tunnel_id: String,
    path_and_query: String,
    timeout: Duration,
    /// The caller's concurrency slot for this call (moved into the call's guard).
    permit: Option<OwnedSemaphorePermit>,
    /// The caller's slot for this tunnel id, with `max_concurrent_calls_per_tunnel`.
    tunnel_slot: Option<TunnelPermit>,
}

impl Front {
    pub fn new(
        config: &Config,
        routes: Arc<Routes>,
        forwarder: Forwarder,
        metrics: Metrics,
    ) -> Self {
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
            head_limits: config.response_head_limits(),
            body_idle_timeout: config.body_idle_timeout,
            routes,
            forwarder,
            metrics: Arc::new(metrics),
            next_call_id: AtomicU64::new(1),
        }
    }

    /// The caller's name if the request carries a known key. Every key is compared, in
    /// constant time, so timing tells nothing about which one nearly matched.
    fn authenticate(&self, headers: &HeaderMap) -> Option<&Caller> {
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
        let mut found = None;
        for caller in &self.callers {
            let matches = caller.config.digest().is_some_and(|d| d.matches(key));
            if matches && found.is_none() {
                found = Some(caller);
            }
        }
        found
    }

    /// Checks everything that can be checked before routing. On error, the tunnel id to
    /// name in the error body, if one was readable.
    fn accept<'a>(
        &'a self,
        parts: &http::request::Parts,
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
        let Some(caller) = self.authenticate(&parts.headers) else {
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
            info!(caller = %caller.config.name, %tunnel_id, "call forbidden: tunnel id not in the caller's tunnels");
            return Err((f, Some(tunnel_id)));
        }
        if let Some(max) = self.max_request_body_bytes {
            let declared = parts
                .headers
                .get(http::header::CONTENT_LENGTH)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.trim().parse::<u64>().ok());
            if declared.is_some_and(|n| n > max) {
                return Err((body_too_large(max), Some(tunnel_id)));
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
            info!(caller = %caller.config.name, %tunnel_id, "call refused: caller at max_concurrent_calls");
            return Err((f, Some(tunnel_id)));
        };
        let tunnel_slot = match (
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
                    info!(caller = %caller.config.name, %tunnel_id, "call refused: caller at max_concurrent_calls_per_tunnel");
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
            permit: Some(permit),
            tunnel_slot,
        })
    }

    /// Reading the caller's body failed: over `max_request_body_bytes`, or broken.
    fn body_failure(&self, why: RequestBodyError) -> Failure {
        match (why, self.max_request_body_bytes) {
            (RequestBodyError::TooLarge, Some(max)) => body_too_large(max),
            (why, _) => Failure::new(ErrorCode::BadRequest, why.to_string()),
        }
    }

    fn fail(
        &self,
        mut guard: CallGuard,
        failure: &Failure,
        tunnel_id: Option<&str>,
    ) -> Response<RelayBody> {
        guard.finish(CallOutcome::Failed(failure.code));
        failure.response(tunnel_id)
    }

    /// Handles one caller request end to end (up to the response head; the body streams on).
    pub async fn handle(&self, req: Request<Incoming>) -> Response<RelayBody> {
        let start = Instant::now();
        let call_id = self.next_call_id.fetch_add(1, Ordering::Relaxed);
        let mut guard = CallGuard::new(self.metrics.clone());
        let (parts, body) = req.into_parts();
        let mut accepted = match self.accept(&parts) {
            Ok(a) => a,
            Err((failure, tunnel_id)) => {
                debug!(call_id, code = failure.code.as_str(), path = %parts.uri.path(), "call rejected");
                return self.fail(guard, &failure, tunnel_id.as_deref());
            }
        };
        if let Some(permit) = accepted.permit.take() {
            guard.hold(permit);
        }
        if let Some(slot) = accepted.tunnel_slot.take() {
            guard.hold_tunnel(slot);
        }
        // No span per call: the subscriber's formatting of a span's fields cost about 5% of
        // the dispatcher's CPU per relayed call, for lines that are rare. Each event of a
        // call names it instead (call_id, tunnel_id, caller).
        self.relay(call_id, start, guard, parts, body, accepted)
            .await
    }

    async fn relay(
        &self,
        call_id: u64,
        start: Instant,
        mut guard: CallGuard,
        parts: http::request::Parts,
        body: Incoming,
        accepted: Accepted<'_>,
    ) -> Response<RelayBody> {
        let tunnel_id = accepted.tunnel_id;
        let caller = accepted.caller;
        let Some(pick) = self.routes.route(&tunnel_id) else {
            let f = Failure::new(
                ErrorCode::TunnelUnavailable,
                "no tunnel server holds streams for this tunnel id",
            );
            info!(call_id, %tunnel_id, caller, code = f.code.as_str(), "call failed");
            return self.fail(guard, &f, Some(&tunnel_id));
        };
        if pick.spilled {
            self.metrics.spills.with_label_values(&[&tunnel_id]).inc();
        }
        let end_of_stream = body.is_end_stream();
        let caller_body: Option<CallerBody> =
            (!end_of_stream).then(|| match self.max_request_body_bytes {
                Some(max) => Limited::new(body, usize::try_from(max).unwrap_or(usize::MAX))
                    .map_err(Into::into)
                    .boxed_unsync(),
                None => body.map_err(Into::into).boxed_unsync(),
            });
        let request_body = RequestBody::new(caller_body, call_id, self.forwarder.replay_limit);
        let plan = CallPlan {
            call_id,
            tunnel_id: tunnel_id.clone(),
            method: parts.method.as_str().to_string(),
            path_and_query: accepted.path_and_query,
            headers: headers::request_to_wire(&parts.headers),
            end_of_stream,
            deadline: start + accepted.timeout,
        };
        let forwarded = tokio::select! {
            // The body's failure first: it resets the attempt's RPC (see `AttemptStream`),
            // and the caller hears why (413 for a body over the limit), not the reset.
            biased;
            why = request_body.failed() => Err((self.body_failure(why), None)),
            r = tokio::time::timeout_at(plan.deadline, self.forwarder.forward(&plan, &request_body, &pick)) => {
                r.unwrap_or_else(|_| Err((Failure::new(
                    ErrorCode::DeadlineExceeded,
                    format!("no response head within {} ms", accepted.timeout.as_millis()),
                ), None)))
            }
        };
        let mut answer = match forwarded {
            Ok(a) => a,
            Err((f, server)) => {
                info!(call_id, %tunnel_id, caller, code = f.code.as_str(), message = %f.message, server_id = ?server, "call failed");
                guard.set_server(server);
                return self.fail(guard, &f, Some(&tunnel_id));
            }
        };
        guard.set_server(Some(answer.server_id.clone()));
        let status = match u16::try_from(answer.head.status)
            .ok()
            .and_then(|s| StatusCode::from_u16(s).ok())
        {
            Some(s) if s.as_u16() >= 200 => s,
            _ => {
                let f = Failure::new(
                    ErrorCode::UpstreamError,
                    format!("agent answered with unusable status {}", answer.head.status),
                );
                info!(call_id, %tunnel_id, caller, code = f.code.as_str(), message = %f.message, "call failed");
                return self.fail(guard, &f, Some(&tunnel_id));
            }
        };
        if let Some(problem) = self.head_limits.check(&answer.head.headers) {
            let limits = match problem {
                relay_proto::HeadProblem::OverLimit(_) => {
                    " (max_response_headers / max_response_header_bytes)"
                }
                relay_proto::HeadProblem::Malformed(_) => "",
            };
            let f = Failure::new(
                ErrorCode::BadResponse,
                format!("the response head has {problem}{limits}"),
            );
            warn!(call_id, %tunnel_id, caller, code = f.code.as_str(), message = %f.message, server_id = %answer.server_id, "call failed");
            return self.fail_after_head(guard, answer, &f, &tunnel_id);
        }
        if answer.head.body.len() > relay_proto::MAX_CHUNK
            || (!answer.head.end_of_stream && !answer.head.body.is_empty())
        {
            let f = Failure::new(
                ErrorCode::BadResponse,
                "the response head carries a body over 64 KiB or before the response's end",
            );
            warn!(call_id, %tunnel_id, caller, code = f.code.as_str(), message = %f.message, server_id = %answer.server_id, "call failed");
            return self.fail_after_head(guard, answer, &f, &tunnel_id);
        }
        let (headers, invalid) = headers::response_from_wire(&answer.head.headers);
        if invalid > 0 {
            warn!(call_id, %tunnel_id, caller, invalid, server_id = %answer.server_id, "dropped invalid response headers");
        }
        let host = parts.uri.authority().map(|a| a.as_str()).or_else(|| {
            parts
                .headers
                .get(http::header::HOST)
                .and_then(|h| h.to_str().ok())
        });
        let other = headers
            .get_all(http::header::LOCATION)
            .iter()
            .find_map(|l| {
                headers::redirect_into_other_tunnel(
                    l.as_bytes(),
                    parts.uri.path(),
                    host,
                    &tunnel_id,
                )
            });
        if let Some(other) = other {
            let f = Failure::new(
                ErrorCode::BadResponse,
                format!(
                    "the upstream redirected into tunnel id {:?}, another tunnel on this relay; refused so that the caller's key and body never go there",
                    relay_proto::escape_message(&other, 128)
                ),
            );
            warn!(call_id, %tunnel_id, caller, code = f.code.as_str(), message = %f.message, server_id = %answer.server_id, "call failed");
            return self.fail_after_head(guard, answer, &f, &tunnel_id);
        }
        debug!(call_id, %tunnel_id, server_id = %answer.server_id, status = status.as_u16(), "response head");
        let body = if answer.head.end_of_stream {
            guard.finish(CallOutcome::Ok);
            // A small body may travel inside the head.
            RelayBody::small(std::mem::take(&mut answer.head.body), answer.stream)
        } else {
            RelayBody::stream(
                answer.stream,
                request_body,
                guard,
                call_id,
                BodyTimers {
                    deadline: plan.deadline,
                    idle: self.body_idle_timeout,
                },
            )
        };
        let mut resp = Response::new(body);
        *resp.status_mut() = status;
        *resp.headers_mut() = headers;
        resp
    }
}

impl Front {
    /// The tunnel server's answer is refused after its head arrived: the caller gets
    /// `failure`. A response that ended with its head has its RPC read to the end in the
    /// background (see `response::poll_rpc_end`); one with a body to come is cancelled, like a
    /// call whose caller went away, so the agent stops sending it.
    fn fail_after_head(
        &self,
        guard: CallGuard,
        answer: crate::forward::Answer,
        failure: &Failure,
        tunnel_id: &str,
    ) -> Response<RelayBody> {
        if answer.head.end_of_stream {
            let mut stream = answer.stream;
            tokio::spawn(async move { crate::response::finish_rpc(&mut stream).await });
        }
        self.fail(guard, failure, Some(tunnel_id))
    }
}

fn body_too_large(max: u64) -> Failure {
    Failure::new(
        ErrorCode::BodyTooLarge,
        format!("request body over {max} bytes (max_request_body_bytes)"),
    )
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
                let svc = hyper::service::service_fn(move |req| {
                    let front = front.clone();
                    let held = info.hold();
                    async move {
                        let resp = front.handle(req).await;
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
        calls_in_flight = front.metrics.calls_in_flight.get(),
        "HTTP front draining"
    );
    draining.cancel();
    let drained = async { while conns.join_next().await.is_some() {} };
    if tokio::time::timeout(grace, drained).await.is_err() {
        warn!(
            calls_in_flight = front.metrics.calls_in_flight.get(),
            "shutdown grace over; cutting the remaining calls"
        );
    }
    conns.shutdown().await;
}
