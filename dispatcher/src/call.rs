//! One call, from the request the front accepted to its [`Outcome`], owned by
//! [`Calls::run`]: it routes the call, hands its body to the replay (`replay`), drives the
//! forward attempts over the servers the router picked (`forward` carries each one out;
//! which server is next and whether a failure is retried are decided by the pure
//! [`Attempts`] of `attempt`), checks the tunnel server's response head, and ends with one
//! [`Outcome`]: the metric, the single log line and the caller's answer all come from it,
//! in [`Outcome::end`] and nowhere else. A call whose head went to the caller goes on in
//! its response body (`response`), which records how the body ended.
//!
//! A call is followed through the dispatcher as: `front` (accept, validate) -> `call`
//! (route, attempts) -> `replay` / `forward` -> `carrier` / `pool` / `colocated` -> back
//! in `call` (head checks, outcome) -> `response` (the body, its outcome).
//!
//! What comes back from a tunnel server is a peer's word, checked here before it reaches
//! the caller:
//! - a response head over `max_response_headers` or `max_response_header_bytes` gets 502
//!   `bad_response` (checked on lengths only, before any header is parsed);
//! - a head that carries a body while the response goes on, or one over 64 KiB, gets 502
//!   `bad_response`;
//! - a `Location` that sends a redirect-following backend to another tunnel id on this
//!   front (`/relay/<other id>/...`, relative or absolute with this front's host; see
//!   `headers::redirect_into_other_tunnel`) gets 502 `bad_response` rather than being
//!   rewritten: a rewrite would have to guess where the upstream meant to send the caller,
//!   while a refusal tells the caller plainly, and the backend never resends its key and
//!   body into another tenant's tunnel;
//! - the body is bounded in time by the call's deadline and by `body_idle_timeout`
//!   between two frames (see `response`).
//!
//! No tracing span per call: the subscriber's formatting of a span's fields cost about 5%
//! of the dispatcher's CPU per relayed call, for lines that are rare. Each event of a call
//! names it instead (call_id, trace_id, tunnel_id, caller). The call's trace (W3C trace
//! context, `relay_common::trace`) is opened by the front, travels to the tunnel server in
//! the call head, and its span ends with the call's guard.

use crate::attempt::{Attempts, Next, RetryRules, Stop};
use crate::error::{ErrorCode, Failure, RequestBodyError, Retry};
use crate::forward::{Answer, CallPlan, Forwarder};
use crate::guard::CallGuard;
use crate::headers;
use crate::metrics::{CallOutcome, Metrics};
use crate::quota::TunnelPermit;
use crate::registry::Routes;
use crate::replay::{CallerBody, RequestBody};
use crate::response::{BodyTimers, RelayBody};
use crate::routing::Pick;
use http::{Response, StatusCode};
use http_body::Body;
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use relay_common::trace::{CallTrace, TraceId};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::OwnedSemaphorePermit;
use tokio::time::Instant;
use tracing::{debug, info, warn};

/// A request that passed the front's checks.
pub struct Accepted<'a> {
    pub caller: &'a str,
    pub tunnel_id: String,
    pub path_and_query: String,
    pub timeout: Duration,
    /// The caller's concurrency slot for this call (held until the call ends).
    pub permit: OwnedSemaphorePermit,
    /// The caller's slot for this tunnel id, with `max_concurrent_calls_per_tunnel`.
    pub tunnel_permit: Option<TunnelPermit>,
}

/// What every call shares: the routes, the forwarder and the rules of a call.
pub struct Calls {
    pub routes: Arc<Routes>,
    pub forwarder: Forwarder,
    pub rules: RetryRules,
    /// Request body bytes kept for a retry (`replay::replay_limit` of the forward stream
    /// window): enough that a call waiting in a queue stays replayable.
    pub replay_limit: usize,
    pub max_request_body_bytes: Option<u64>,
    /// `max_response_headers` / `max_response_header_bytes`.
    pub head_limits: relay_proto::HeadLimits,
    pub body_idle_timeout: Duration,
    /// Shared with every call's guard: one reference count per call, not a clone of every
    /// metric handle.
    pub metrics: Arc<Metrics>,
}

/// How a call ended before its response body, decided once.
pub enum Outcome {
    /// The front refused the request before routing (logged at debug as "call rejected").
    Rejected {
        failure: Failure,
        /// The tunnel id to name in the error body, if one was readable.
        tunnel_id: Option<String>,
    },
    /// The call failed before a usable response head ("call failed").
    Failed {
        failure: Failure,
        /// The tunnel server that gave the last answer, if one was tried.
        server_id: Option<Arc<str>>,
    },
    /// The tunnel server's head came and was refused ("call failed", a warning: a peer
    /// broke a rule). Its RPC is read to its end if it ended with the head, or cancelled.
    Refused { failure: Failure, answer: Answer },
    /// The head goes to the caller; the body streams on with the call's request body (its
    /// failure cuts the response) and within `timers`.
    Answered {
        answer: Answer,
        status: StatusCode,
        headers: http::HeaderMap,
        request: RequestBody,
        timers: BodyTimers,
    },
}

/// The facts of a call its outcome is logged with.
pub struct Ids<'a> {
    pub call_id: u64,
    pub trace_id: TraceId,
    pub tunnel_id: Option<&'a str>,
    pub caller: &'a str,
    /// The request's path, for a rejected call's line.
    pub path: &'a str,
}

impl Outcome {
    /// Counts the outcome, logs its one line and answers the caller. An answered call's
    /// body streams on with `guard`, which records how it ends.
    pub fn end(self, mut guard: CallGuard, ids: Ids<'_>) -> Response<RelayBody> {
        let Ids {
            call_id,
            trace_id,
            tunnel_id,
            caller,
            path,
        } = ids;
        let (failure, server_id, refused) = match self {
            Outcome::Answered {
                mut answer,
                status,
                headers,
                request,
                timers,
            } => {
                debug!(call_id, %trace_id, tunnel_id = tunnel_id.map(tracing::field::display), server_id = %answer.server_id, status = status.as_u16(), "response head");
                guard.set_server(Some(answer.server_id));
                let body = if answer.head.end_of_stream {
                    guard.finish(CallOutcome::Ok);
                    // A small body may travel inside the head.
                    RelayBody::small(std::mem::take(&mut answer.head.body), answer.stream)
                } else {
                    RelayBody::stream(answer.stream, request, guard, call_id, timers)
                };
                let mut resp = Response::new(body);
                *resp.status_mut() = status;
                *resp.headers_mut() = headers;
                return resp;
            }
            Outcome::Rejected { failure, tunnel_id } => {
                debug!(call_id, %trace_id, code = failure.code.as_str(), path = %path, "call rejected");
                guard.finish(CallOutcome::Failed(failure.code));
                return failure.response(tunnel_id.as_deref());
            }
            Outcome::Failed { failure, server_id } => (failure, server_id, None),
            Outcome::Refused { failure, answer } => {
                (failure, Some(answer.server_id.clone()), Some(answer))
            }
        };
        macro_rules! failed {
            ($level:ident) => {
                $level!(call_id, %trace_id, tunnel_id = tunnel_id.map(tracing::field::display), caller, code = failure.code.as_str(), message = %failure.message,
                    server_id = server_id.as_deref().map(tracing::field::display), "call failed")
            };
        }
        match refused {
            None => failed!(info),
            Some(answer) => {
                failed!(warn);
                // A response that ended with its head has its RPC read to the end in the
                // background (see `response::finish_rpc`); one with a body to come is
                // cancelled, like a call whose caller went away, so the agent stops
                // sending it.
                if answer.head.end_of_stream {
                    let mut stream = answer.stream;
                    tokio::spawn(async move { crate::response::finish_rpc(&mut stream).await });
                }
            }
        }
        guard.set_server(server_id);
        guard.finish(CallOutcome::Failed(failure.code));
        failure.response(tunnel_id)
    }
}

impl Calls {
    /// Runs one accepted call up to its response head (the body streams on).
    #[allow(clippy::too_many_arguments)]
    pub async fn run(
        &self,
        call_id: u64,
        trace: CallTrace,
        start: Instant,
        mut guard: CallGuard,
        parts: http::request::Parts,
        body: Incoming,
        accepted: Accepted<'_>,
    ) -> Response<RelayBody> {
        guard.hold(accepted.permit);
        if let Some(permit) = accepted.tunnel_permit {
            guard.hold_tunnel(permit);
        }
        let deadline = start + accepted.timeout;
        let timers = BodyTimers {
            deadline,
            idle: self.body_idle_timeout,
        };
        let tunnel_id = accepted.tunnel_id;
        guard.set_tunnel(&tunnel_id);
        let trace_id = trace.trace_id;
        let ids = Ids {
            call_id,
            trace_id,
            tunnel_id: Some(&tunnel_id),
            caller: accepted.caller,
            path: parts.uri.path(),
        };
        let Some(pick) = self.routes.route(&tunnel_id) else {
            let failure = Failure::new(
                ErrorCode::TunnelUnavailable,
                "no tunnel server holds streams for this tunnel id",
            );
            let failed = Outcome::Failed {
                failure,
                server_id: None,
            };
            return failed.end(guard, ids);
        };
        let end_of_stream = body.is_end_stream();
        let caller_body: Option<CallerBody> =
            (!end_of_stream).then(|| match self.max_request_body_bytes {
                Some(max) => Limited::new(body, usize::try_from(max).unwrap_or(usize::MAX))
                    .map_err(Into::into)
                    .boxed_unsync(),
                None => body.map_err(Into::into).boxed_unsync(),
            });
        let request_body = RequestBody::new(caller_body, call_id, self.replay_limit);
        let plan = CallPlan {
            call_id,
            tunnel_id: tunnel_id.clone(),
            method: parts.method.as_str().to_string(),
            path_and_query: accepted.path_and_query,
            headers: headers::request_to_wire(&parts.headers),
            end_of_stream,
            deadline,
            trace: {
                let (trace_id_high, trace_id_low, parent_id, flags) = trace.to_head();
                relay_proto::TraceParent {
                    trace_id_high,
                    trace_id_low,
                    parent_id,
                    flags,
                }
            },
            trace_id,
        };
        let forwarded = tokio::select! {
            // The body's failure first: it resets the attempt's RPC (see `AttemptStream`),
            // and the caller hears why (413 for a body over the limit), not the reset.
            biased;
            why = request_body.failed() => Err((self.body_failure(why), None)),
            r = tokio::time::timeout_at(deadline, self.forward(&plan, &request_body, &pick)) => {
                r.unwrap_or_else(|_| Err((Failure::new(
                    ErrorCode::DeadlineExceeded,
                    format!("no response head within {} ms", accepted.timeout.as_millis()),
                ), None)))
            }
        };
        let outcome = match forwarded {
            Ok(answer) => match self.check(
                &answer,
                &parts,
                &tunnel_id,
                (call_id, trace_id),
                accepted.caller,
            ) {
                Ok((status, headers)) => Outcome::Answered {
                    answer,
                    status,
                    headers,
                    request: request_body,
                    timers,
                },
                Err(Checked::Unusable(failure)) => Outcome::Failed {
                    failure,
                    server_id: Some(answer.server_id),
                },
                Err(Checked::Refused(failure)) => Outcome::Refused { failure, answer },
            },
            Err((failure, server_id)) => Outcome::Failed { failure, server_id },
        };
        outcome.end(guard, ids)
    }

    /// Forwards the call to the picked servers in order, retrying while the rules of
    /// `attempt` allow. On failure, the last one and the server that gave it, if any was
    /// tried. The caller bounds this with the call's deadline.
    async fn forward(
        &self,
        plan: &CallPlan,
        body: &RequestBody,
        pick: &Pick,
    ) -> Result<Answer, (Failure, Option<Arc<str>>)> {
        let mut last = Failure::new(
            ErrorCode::TunnelUnavailable,
            "no tunnel server holds streams for this tunnel id",
        );
        let mut last_server = None;
        let local = self.forwarder.local_among(&pick.servers);
        let mut attempts = Attempts::new(&pick.servers, local, self.rules, &plan.method);
        loop {
            let target = match attempts.next(body.replayable()) {
                Next::First(target) => target,
                Next::Retry(target) => {
                    self.metrics.retries.inc();
                    info!(call_id = plan.call_id, trace_id = %plan.trace_id, tunnel_id = %plan.tunnel_id, server_id = %target.server_id, reason = %last.message, "retrying on another tunnel server");
                    target
                }
                Next::Stop(Stop::NotReplayable) => {
                    debug!(
                        call_id = plan.call_id, trace_id = %plan.trace_id, tunnel_id = %plan.tunnel_id,
                        "not retrying: request body already sent beyond replay"
                    );
                    break;
                }
                Next::Stop(Stop::Exhausted | Stop::Final) => break,
            };
            self.metrics
                .routing_decisions
                .with_label_values(&[&*target.server_id])
                .inc();
            last_server = Some(target.server_id.clone());
            match self
                .forwarder
                .attempt(plan, body, target, attempts.current())
                .await
            {
                Ok(answer) => return Ok(answer),
                Err((failure, retry)) => {
                    if retry == Retry::NoCapacity {
                        self.routes
                            .note_no_capacity(&plan.tunnel_id, &target.server_id);
                    }
                    let may = attempts.failed(retry);
                    debug!(call_id = plan.call_id, trace_id = %plan.trace_id, tunnel_id = %plan.tunnel_id, server_id = %target.server_id, code = failure.code.as_str(), ?retry, may, "forward attempt failed");
                    last = failure;
                }
            }
        }
        Err((last, last_server))
    }

    /// Reading the caller's body failed: over `max_request_body_bytes`, or broken.
    fn body_failure(&self, why: RequestBodyError) -> Failure {
        match (why, self.max_request_body_bytes) {
            (RequestBodyError::TooLarge, Some(max)) => Failure::body_too_large(max),
            (why, _) => Failure::new(ErrorCode::BadRequest, why.to_string()),
        }
    }

    /// Checks the tunnel server's response head (see the module docs): the status and
    /// headers the caller gets, or why the call fails.
    fn check(
        &self,
        answer: &Answer,
        parts: &http::request::Parts,
        tunnel_id: &str,
        (call_id, trace_id): (u64, TraceId),
        caller: &str,
    ) -> Result<(StatusCode, http::HeaderMap), Checked> {
        let head = &answer.head;
        let status = match u16::try_from(head.status)
            .ok()
            .and_then(|s| StatusCode::from_u16(s).ok())
        {
            Some(s) if s.as_u16() >= 200 => s,
            _ => {
                return Err(Checked::Unusable(Failure::new(
                    ErrorCode::UpstreamError,
                    format!("agent answered with unusable status {}", head.status),
                )))
            }
        };
        if let Some(problem) = self.head_limits.check(&head.headers) {
            let limits = match problem {
                relay_proto::HeadProblem::OverLimit(_) => {
                    " (max_response_headers / max_response_header_bytes)"
                }
                relay_proto::HeadProblem::Malformed(_) => "",
            };
            return Err(Checked::Refused(Failure::new(
                ErrorCode::BadResponse,
                format!("the response head has {problem}{limits}"),
            )));
        }
        if relay_proto::check_inline_body(head.body.len(), head.end_of_stream).is_err() {
            return Err(Checked::Refused(Failure::new(
                ErrorCode::BadResponse,
                "the response head carries a body over 64 KiB or before the response's end",
            )));
        }
        let (headers, invalid) = headers::response_from_wire(&head.headers);
        if invalid > 0 {
            warn!(call_id, %trace_id, %tunnel_id, caller, invalid, server_id = %answer.server_id, "dropped invalid response headers");
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
                headers::redirect_into_other_tunnel(l.as_bytes(), parts.uri.path(), host, tunnel_id)
            });
        if let Some(other) = other {
            return Err(Checked::Refused(Failure::new(
                ErrorCode::BadResponse,
                format!(
                    "the upstream redirected into tunnel id {:?}, another tunnel on this relay; refused so that the caller's key and body never go there",
                    relay_proto::escape_message(&other, 128)
                ),
            )));
        }
        Ok((status, headers))
    }
}

/// Why a response head does not go to the caller.
enum Checked {
    /// Its status is not one to answer with (the agent's word, passed on as a failure).
    Unusable(Failure),
    /// It broke a limit or a rule of the relay (a peer's fault, logged as a warning).
    Refused(Failure),
}
