//! How a `Forward.Call` ended: the one vocabulary from which the call's metric label
//! (`relay_tunnel_calls_total{outcome}`, [`Outcome::as_str`]), its log line and its answer
//! to the dispatcher ([`Outcome::into_answer`], [`Outcome::into_status`]) all come.
//!
//! Owns the mapping only: it decides nothing, counts nothing and sends nothing. The call
//! task (`crate::call`) records and answers an outcome; the stream reader
//! (`crate::stream`) builds one when the agent's frame or the stream's end closes the
//! call, and routes it to the call task.

use relay_common::trace::TraceId;
use relay_proto::{
    forward_response, CallError, CallErrorKind, ForwardError, ForwardErrorKind, ForwardResponse,
};
use std::time::Duration;
use tonic::Status;

/// How one call ended. Each call ends with exactly one.
#[derive(Debug)]
pub enum Outcome {
    /// The agent's response ended: its last frame (a head or a body chunk with the end
    /// flag), passed on as is.
    Ok(ForwardResponse),
    /// The agent answered the call with a `CallError` (refused by a filter, upstream
    /// unreachable or timed out, ...), passed on.
    AgentError(CallError),
    /// The caller went away (nothing to answer), or the agent confirmed a `Cancel` with a
    /// cancelled `CallError` (passed on to a caller still there).
    Cancelled(Option<CallError>),
    /// The stream carrying the call ended before the call did: why, for the caller.
    StreamLost(&'static str),
    /// No stream of the tunnel id freed before the call's wait ended, or its queue was full.
    NoCapacity(&'static str),
    /// No stream of the tunnel id on this server: the tunnel id.
    UnknownTunnel(String),
    /// The dispatcher's call was malformed, or it did not answer `StreamReserved` with
    /// `Proceed` in time.
    BadRequest(Status),
    /// The agent's response head broke `max_response_headers` or
    /// `max_response_header_bytes`, or holds a malformed header record: why, as the caller
    /// reads it.
    BadResponse(String),
}

impl Outcome {
    /// Every label of [`Outcome::as_str`], in the order the metric exports them.
    pub const LABELS: [&'static str; 8] = [
        "ok",
        "agent_error",
        "cancelled",
        "stream_lost",
        "no_capacity",
        "unknown_tunnel",
        "bad_request",
        "bad_response",
    ];

    /// The `outcome` label of `relay_tunnel_calls_total`.
    pub fn as_str(&self) -> &'static str {
        match self {
            Outcome::Ok(_) => "ok",
            Outcome::AgentError(_) => "agent_error",
            Outcome::Cancelled(_) => "cancelled",
            Outcome::StreamLost(_) => "stream_lost",
            Outcome::NoCapacity(_) => "no_capacity",
            Outcome::UnknownTunnel(_) => "unknown_tunnel",
            Outcome::BadRequest(_) => "bad_request",
            Outcome::BadResponse(_) => "bad_response",
        }
    }

    /// The agent's `CallError` for a call: a cancelled one confirms a `Cancel`.
    pub fn of_call_error(error: CallError) -> Self {
        if error.kind == CallErrorKind::Cancelled as i32 {
            Outcome::Cancelled(Some(error))
        } else {
            Outcome::AgentError(error)
        }
    }

    /// The last frame of the call's response stream, if the caller gets one.
    pub fn into_answer(self) -> Option<ForwardResponse> {
        fn error(kind: ForwardErrorKind, message: impl Into<String>) -> ForwardResponse {
            ForwardResponse::error(kind, message)
        }
        match self {
            Outcome::Ok(last) => Some(last),
            Outcome::AgentError(e) | Outcome::Cancelled(Some(e)) => Some(agent_error(e)),
            Outcome::Cancelled(None) => None,
            Outcome::StreamLost(why) => Some(error(ForwardErrorKind::StreamLost, why)),
            Outcome::NoCapacity(why) => Some(error(ForwardErrorKind::NoCapacity, why)),
            Outcome::UnknownTunnel(tunnel_id) => Some(error(
                ForwardErrorKind::UnknownTunnel,
                format!("no stream of tunnel id {tunnel_id} on this server"),
            )),
            Outcome::BadRequest(status) => Some(error(
                ForwardErrorKind::BadRequest,
                status.message().to_string(),
            )),
            Outcome::BadResponse(why) => Some(error(ForwardErrorKind::BadResponse, why)),
        }
    }

    /// The gRPC status that ends a call refused before it has a response stream (the
    /// handler's answer when the dispatcher's first frame is not a usable call head).
    pub fn into_status(self) -> Status {
        match self {
            Outcome::BadRequest(status) => status,
            other => Status::internal(format!("call ended as {} before it began", other.as_str())),
        }
    }

    /// The call's one log line.
    pub fn log(&self, tunnel_id: &str, call_id: u64, trace_id: TraceId, elapsed: Duration) {
        tracing::debug!(
            %tunnel_id,
            call_id,
            %trace_id,
            outcome = self.as_str(),
            elapsed_ms = elapsed.as_millis() as u64,
            "call ended"
        );
    }
}

/// The agent's `CallError` as the dispatcher sees it. The agent's words go into the
/// dispatcher's logs and the caller's JSON: escaped and cut here, once.
fn agent_error(e: CallError) -> ForwardResponse {
    ForwardResponse::of(forward_response::Kind::Error(ForwardError {
        kind: ForwardErrorKind::Agent as i32,
        message: relay_proto::escape_message(&e.message, relay_proto::MAX_PEER_MESSAGE),
        call_error: e.kind,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One outcome of each kind; the match makes a new variant fail to compile here
    /// until it is listed.
    fn one_of_each() -> Vec<Outcome> {
        let all = vec![
            Outcome::Ok(ForwardResponse::default()),
            Outcome::AgentError(CallError::default()),
            Outcome::Cancelled(None),
            Outcome::StreamLost("lost"),
            Outcome::NoCapacity("full"),
            Outcome::UnknownTunnel("t".into()),
            Outcome::BadRequest(Status::invalid_argument("bad")),
            Outcome::BadResponse("big".into()),
        ];
        for o in &all {
            match o {
                Outcome::Ok(_)
                | Outcome::AgentError(_)
                | Outcome::Cancelled(_)
                | Outcome::StreamLost(_)
                | Outcome::NoCapacity(_)
                | Outcome::UnknownTunnel(_)
                | Outcome::BadRequest(_)
                | Outcome::BadResponse(_) => {}
            }
        }
        all
    }

    #[test]
    fn the_labels_are_exactly_the_outcomes() {
        let labels: Vec<_> = one_of_each().iter().map(Outcome::as_str).collect();
        assert_eq!(labels, Outcome::LABELS);
    }

    #[test]
    fn a_cancelled_call_error_is_a_cancel_and_others_are_agent_errors() {
        let cancelled = CallError {
            kind: CallErrorKind::Cancelled as i32,
            ..Default::default()
        };
        assert_eq!(Outcome::of_call_error(cancelled).as_str(), "cancelled");
        let refused = CallError {
            kind: CallErrorKind::Refused as i32,
            message: "no\nway".into(),
            ..Default::default()
        };
        let o = Outcome::of_call_error(refused);
        assert_eq!(o.as_str(), "agent_error");
        let Some(forward_response::Kind::Error(e)) = o.into_answer().unwrap().kind else {
            panic!("an error frame");
        };
        assert_eq!(e.kind, ForwardErrorKind::Agent as i32);
        assert_eq!(e.call_error, CallErrorKind::Refused as i32);
        assert!(!e.message.contains('\n'), "escaped: {:?}", e.message);
    }

    #[test]
    fn a_caller_that_left_gets_no_answer() {
        assert!(Outcome::Cancelled(None).into_answer().is_none());
    }
}
