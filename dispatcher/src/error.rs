//! Errors per boundary: [`RunError`] for `run`, [`Failure`] for a call that ends in an
//! error response, [`Retry`] for what a failed forward attempt allows, and
//! [`RequestBodyError`] for a caller body that could not be read. Every call error is
//! mapped to an HTTP status and a JSON body exactly once, here; whether a failure may be
//! retried is decided once, where the failure is known, and carried as a [`Retry`].

use bytes::Bytes;
use http::{HeaderValue, Response, StatusCode};
use relay_common::config::ConfigError;
use relay_proto::{CallErrorKind, ForwardError, ForwardErrorKind};

/// Why `run` could not start or keep running.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("cannot register metrics: {0}")]
    Metrics(#[from] prometheus::Error),
    #[error("listener address: {0}")]
    Io(#[from] std::io::Error),
    #[error("registry listener failed: {0}")]
    Registry(#[source] tonic::transport::Error),
    #[error("[{section}]: {source}")]
    Tls {
        section: &'static str,
        #[source]
        source: relay_common::tls::TlsError,
    },
}

/// The error codes a caller can see, each with its HTTP status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorCode {
    Unauthorized,
    /// The caller key may not reach this tunnel id.
    Forbidden,
    /// The caller has `max_concurrent_calls` calls in flight.
    TooManyCalls,
    /// The request body is over `max_request_body_bytes`.
    BodyTooLarge,
    NotFound,
    BadRequest,
    HeadersTooLarge,
    TunnelUnavailable,
    NoCapacity,
    Refused,
    UpstreamUnreachable,
    UpstreamTimeout,
    UpstreamError,
    StreamLost,
    TunnelServerUnreachable,
    DeadlineExceeded,
    /// The response broke a limit or a rule of the relay: a head over
    /// `max_response_headers` / `max_response_header_bytes` (here or at the tunnel
    /// server), or a redirect into another tunnel id.
    BadResponse,
}

impl ErrorCode {
    /// Every code, for exporting each `outcome` label from the start.
    pub const ALL: [ErrorCode; 17] = [
        ErrorCode::Unauthorized,
        ErrorCode::Forbidden,
        ErrorCode::TooManyCalls,
        ErrorCode::BodyTooLarge,
        ErrorCode::NotFound,
        ErrorCode::BadRequest,
        ErrorCode::HeadersTooLarge,
        ErrorCode::TunnelUnavailable,
        ErrorCode::NoCapacity,
        ErrorCode::Refused,
        ErrorCode::UpstreamUnreachable,
        ErrorCode::UpstreamTimeout,
        ErrorCode::UpstreamError,
        ErrorCode::StreamLost,
        ErrorCode::TunnelServerUnreachable,
        ErrorCode::DeadlineExceeded,
        ErrorCode::BadResponse,
    ];

    /// The `error` field of the JSON body and the `outcome` metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::Unauthorized => "unauthorized",
            ErrorCode::Forbidden => "forbidden",
            ErrorCode::TooManyCalls => "too_many_calls",
            ErrorCode::BodyTooLarge => "body_too_large",
            ErrorCode::NotFound => "not_found",
            ErrorCode::BadRequest => "bad_request",
            ErrorCode::HeadersTooLarge => "headers_too_large",
            ErrorCode::TunnelUnavailable => "tunnel_unavailable",
            ErrorCode::NoCapacity => "no_capacity",
            ErrorCode::Refused => "refused",
            ErrorCode::UpstreamUnreachable => "upstream_unreachable",
            ErrorCode::UpstreamTimeout => "upstream_timeout",
            ErrorCode::UpstreamError => "upstream_error",
            ErrorCode::StreamLost => "stream_lost",
            ErrorCode::TunnelServerUnreachable => "tunnel_server_unreachable",
            ErrorCode::DeadlineExceeded => "deadline_exceeded",
            ErrorCode::BadResponse => "bad_response",
        }
    }

    pub fn status(self) -> StatusCode {
        match self {
            ErrorCode::Unauthorized => StatusCode::UNAUTHORIZED,
            ErrorCode::Forbidden => StatusCode::FORBIDDEN,
            ErrorCode::TooManyCalls => StatusCode::TOO_MANY_REQUESTS,
            ErrorCode::BodyTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            ErrorCode::NotFound => StatusCode::NOT_FOUND,
            ErrorCode::BadRequest => StatusCode::BAD_REQUEST,
            ErrorCode::HeadersTooLarge => StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            ErrorCode::TunnelUnavailable | ErrorCode::NoCapacity => StatusCode::SERVICE_UNAVAILABLE,
            ErrorCode::Refused => StatusCode::FORBIDDEN,
            ErrorCode::UpstreamUnreachable
            | ErrorCode::UpstreamError
            | ErrorCode::StreamLost
            | ErrorCode::TunnelServerUnreachable
            | ErrorCode::BadResponse => StatusCode::BAD_GATEWAY,
            ErrorCode::UpstreamTimeout | ErrorCode::DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
        }
    }
}

/// What a failed forward attempt allows: decided once, where the failure is known, and
/// read by `attempt::RetryRules::allows`, which adds the configuration (policy,
/// `retry_idempotent`) and the next server's idle streams.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Retry {
    /// No agent saw the call.
    Safe,
    /// The server had no idle stream before its queue gave up; no agent saw the call.
    NoCapacity,
    /// The call may have reached an agent; only idempotent methods may be retried.
    MaybeStarted,
    /// Final (the agent answered, or the request is bad).
    Never,
}

impl Retry {
    /// A tunnel server's `ForwardError` kind: UNKNOWN_TUNNEL and DRAINING never reach an
    /// agent; NO_CAPACITY neither, but is saturation; STREAM_LOST may have; the rest is
    /// final.
    pub fn of_forward_error(kind: ForwardErrorKind) -> Retry {
        match kind {
            ForwardErrorKind::UnknownTunnel | ForwardErrorKind::Draining => Retry::Safe,
            ForwardErrorKind::NoCapacity => Retry::NoCapacity,
            ForwardErrorKind::StreamLost => Retry::MaybeStarted,
            ForwardErrorKind::BadRequest
            | ForwardErrorKind::Agent
            | ForwardErrorKind::BadResponse
            | ForwardErrorKind::Unspecified => Retry::Never,
        }
    }

    /// `Forward.Call` failed before any response header.
    ///
    /// A status the server sent (no transport error behind it) came before the server
    /// handed the call to an agent: [`Retry::of_call_status`].
    ///
    /// A transport failure is read from the error chain, never from the status code (tonic
    /// gives the same UNAVAILABLE/UNKNOWN/INTERNAL to "never connected" and "connection reset
    /// after the request went out"). The request provably never reached the server when:
    /// the connection could not be made (`tonic::ConnectError`); hyper never sent it (a
    /// request cancelled or refused by a closed connection: `is_canceled`, `is_closed`); the
    /// server refused the stream (h2 REFUSED_STREAM); or the server's graceful GOAWAY
    /// (NO_ERROR) left it unprocessed. Any other loss is [`Retry::MaybeStarted`]: a tunnel
    /// server hands a call to an agent as soon as it arrives, before its response header is
    /// on the wire, so a server dying then may leave the call running on the agent. (The
    /// one narrow remainder: a server killed while it drains after its GOAWAY fails its
    /// last calls with the same GOAWAY error.)
    pub fn of_call_error(status: &tonic::Status) -> Retry {
        let Some(source) = std::error::Error::source(status) else {
            return Retry::of_call_status(status.code());
        };
        let mut next: Option<&(dyn std::error::Error + 'static)> = Some(source);
        while let Some(e) = next {
            if e.is::<tonic::ConnectError>() {
                return Retry::Safe;
            }
            if let Some(e) = e.downcast_ref::<hyper::Error>() {
                if e.is_canceled() || e.is_closed() {
                    return Retry::Safe;
                }
            }
            if let Some(e) = e.downcast_ref::<h2::Error>() {
                if e.reason() == Some(h2::Reason::REFUSED_STREAM)
                    || (e.is_go_away() && e.is_remote() && e.reason() == Some(h2::Reason::NO_ERROR))
                {
                    return Retry::Safe;
                }
            }
            next = e.source();
        }
        Retry::MaybeStarted
    }

    /// Whether a call's transport error is its connection's (a socket error, or the
    /// connection ending, gracefully or not) rather than one stream's reset: that
    /// connection must not carry the next call (see `forward::Forwarder`).
    pub fn connection_lost(status: &tonic::Status) -> bool {
        let mut next = std::error::Error::source(status);
        while let Some(e) = next {
            if e.is::<std::io::Error>() {
                return true;
            }
            if let Some(e) = e.downcast_ref::<h2::Error>() {
                if e.is_io() || e.is_go_away() {
                    return true;
                }
            }
            next = e.source();
        }
        false
    }

    /// Why a call's transport error says the path to its server may be dead, if it does: a
    /// dial that failed, a connection that went silent past its keep-alive, or a
    /// connection that broke (the streams of a connection the keep-alive closed see a
    /// broken pipe). A server that closed a connection gracefully (GOAWAY: it is draining
    /// or restarting) is not: the next call dials it again.
    pub fn path_dead(status: &tonic::Status) -> Option<String> {
        let mut next = std::error::Error::source(status);
        while let Some(e) = next {
            if e.is::<tonic::ConnectError>() {
                return Some(format!("dial failed: {e}"));
            }
            if let Some(h) = e.downcast_ref::<hyper::Error>() {
                if h.is_timeout() {
                    return Some("its connection went silent past the keep-alive".into());
                }
            }
            if let Some(h) = e.downcast_ref::<h2::Error>() {
                if h.is_go_away() {
                    return None;
                }
                if h.is_io() {
                    return Some(format!("its connection broke: {h}"));
                }
            }
            if e.is::<std::io::Error>() {
                return Some(format!("its connection broke: {e}"));
            }
            next = e.source();
        }
        None
    }

    /// A status the tunnel server itself answered `Forward.Call` with, before any response
    /// header: UNAVAILABLE, UNKNOWN and CANCELLED mean it did not take the call (it is
    /// stopping, or refused the RPC); any other status is its final word.
    pub fn of_call_status(code: tonic::Code) -> Retry {
        match code {
            tonic::Code::Unavailable | tonic::Code::Unknown | tonic::Code::Cancelled => Retry::Safe,
            _ => Retry::Never,
        }
    }
}

/// Why reading the caller's request body failed. Read from the body's error type (never
/// from its message): `http_body_util::Limited` reports its limit as a
/// [`http_body_util::LengthLimitError`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestBodyError {
    /// The body passed `max_request_body_bytes`.
    #[error("reading the request body failed: length limit exceeded")]
    TooLarge,
    /// The caller's connection broke or sent a malformed body.
    #[error("reading the request body failed: {0}")]
    Read(String),
}

impl RequestBodyError {
    pub fn of(e: &(dyn std::error::Error + 'static)) -> Self {
        if e.is::<http_body_util::LengthLimitError>() {
            RequestBodyError::TooLarge
        } else {
            RequestBodyError::Read(e.to_string())
        }
    }
}

/// A call that ends with an error response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    pub code: ErrorCode,
    pub message: String,
}

impl Failure {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Failure {
            code,
            message: message.into(),
        }
    }

    /// A request body over `max_request_body_bytes` (`max`): declared, or read.
    pub fn body_too_large(max: u64) -> Self {
        Failure::new(
            ErrorCode::BodyTooLarge,
            format!("request body over {max} bytes (max_request_body_bytes)"),
        )
    }

    /// Maps a tunnel server's `ForwardError` to the caller's answer and what it allows
    /// ([`Retry::of_forward_error`]). The peer's message is escaped and cut
    /// ([`relay_proto::escape_message`]) before it reaches a log line or the caller.
    pub fn from_forward_error(e: &ForwardError) -> (Self, Retry) {
        let kind = ForwardErrorKind::try_from(e.kind).unwrap_or(ForwardErrorKind::Unspecified);
        (
            Self::of_forward_error(kind, e),
            Retry::of_forward_error(kind),
        )
    }

    fn of_forward_error(kind: ForwardErrorKind, e: &ForwardError) -> Self {
        let msg = if e.message.is_empty() {
            "no detail".to_string()
        } else {
            relay_proto::escape_message(&e.message, relay_proto::MAX_PEER_MESSAGE)
        };
        match kind {
            ForwardErrorKind::UnknownTunnel => Failure::new(
                ErrorCode::TunnelUnavailable,
                format!("tunnel server holds no stream: {msg}"),
            ),
            ForwardErrorKind::Draining => Failure::new(
                ErrorCode::TunnelUnavailable,
                format!("tunnel server is draining: {msg}"),
            ),
            ForwardErrorKind::NoCapacity => Failure::new(
                ErrorCode::NoCapacity,
                format!("no idle tunnel stream: {msg}"),
            ),
            ForwardErrorKind::StreamLost => {
                Failure::new(ErrorCode::StreamLost, format!("tunnel stream lost: {msg}"))
            }
            ForwardErrorKind::BadRequest => Failure::new(
                ErrorCode::BadRequest,
                format!("tunnel server refused the request: {msg}"),
            ),
            ForwardErrorKind::Agent => {
                let code = match CallErrorKind::try_from(e.call_error)
                    .unwrap_or(CallErrorKind::Unspecified)
                {
                    CallErrorKind::Refused => ErrorCode::Refused,
                    CallErrorKind::UpstreamUnreachable => ErrorCode::UpstreamUnreachable,
                    CallErrorKind::UpstreamTimeout => ErrorCode::UpstreamTimeout,
                    CallErrorKind::BadRequest => ErrorCode::BadRequest,
                    _ => ErrorCode::UpstreamError,
                };
                Failure::new(code, format!("agent: {msg}"))
            }
            ForwardErrorKind::BadResponse => {
                Failure::new(ErrorCode::BadResponse, format!("tunnel server: {msg}"))
            }
            ForwardErrorKind::Unspecified => Failure::new(
                ErrorCode::UpstreamError,
                format!("tunnel server error: {msg}"),
            ),
        }
    }

    /// The JSON error response.
    pub fn response<B: From<Bytes>>(&self, tunnel_id: Option<&str>) -> Response<B> {
        let body = serde_json::json!({
            "error": self.code.as_str(),
            "message": self.message,
            "tunnel_id": tunnel_id,
        });
        let mut resp = Response::new(B::from(Bytes::from(body.to_string())));
        *resp.status_mut() = self.code.status();
        let h = resp.headers_mut();
        h.insert(
            http::header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        match self.code {
            ErrorCode::Unauthorized => {
                h.insert(
                    http::header::WWW_AUTHENTICATE,
                    HeaderValue::from_static("Bearer"),
                );
            }
            ErrorCode::TunnelUnavailable | ErrorCode::NoCapacity | ErrorCode::TooManyCalls => {
                h.insert(http::header::RETRY_AFTER, HeaderValue::from_static("1"));
            }
            _ => {}
        }
        resp
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn agent(kind: CallErrorKind) -> ForwardError {
        ForwardError {
            kind: ForwardErrorKind::Agent as i32,
            message: "m".into(),
            call_error: kind as i32,
        }
    }

    #[test]
    fn forward_errors_map_to_documented_statuses() {
        let cases = [
            (agent(CallErrorKind::Refused), 403, "refused"),
            (
                agent(CallErrorKind::UpstreamUnreachable),
                502,
                "upstream_unreachable",
            ),
            (
                agent(CallErrorKind::UpstreamTimeout),
                504,
                "upstream_timeout",
            ),
            (agent(CallErrorKind::BadRequest), 400, "bad_request"),
            (agent(CallErrorKind::UpstreamAborted), 502, "upstream_error"),
        ];
        for (e, status, code) in cases {
            let (f, retry) = Failure::from_forward_error(&e);
            assert_eq!(
                (f.code.status().as_u16(), f.code.as_str(), retry),
                (status, code, Retry::Never)
            );
            assert!(f.message.contains('m'));
        }
        let e = |k: ForwardErrorKind| ForwardError {
            kind: k as i32,
            message: String::new(),
            call_error: 0,
        };
        assert_eq!(
            Failure::from_forward_error(&e(ForwardErrorKind::NoCapacity))
                .0
                .code,
            ErrorCode::NoCapacity
        );
        let bad = ForwardError {
            kind: ForwardErrorKind::BadResponse as i32,
            message: "head of 9999 headers".into(),
            call_error: 0,
        };
        let (f, retry) = Failure::from_forward_error(&bad);
        assert_eq!(
            (f.code.status().as_u16(), f.code.as_str(), retry),
            (502, "bad_response", Retry::Never)
        );
        let hostile = agent(CallErrorKind::UpstreamUnreachable);
        let hostile = ForwardError {
            message: format!("a\nb\x1b[31m{}", "x".repeat(5000)),
            ..hostile
        };
        let msg = Failure::from_forward_error(&hostile).0.message;
        assert!(msg.starts_with("agent: a\\nb\\u{1b}[31m"), "{msg}");
        assert!(msg.chars().count() < 600 && !msg.chars().any(char::is_control));
        let odd = ForwardError {
            kind: 99,
            message: String::new(),
            call_error: 0,
        };
        assert_eq!(
            Failure::from_forward_error(&odd).0.code,
            ErrorCode::UpstreamError
        );
    }

    /// The retry table: which tunnel server answers may go to another server, and the
    /// answer the caller gets when they do not.
    #[test]
    fn retry_table_of_forward_errors() {
        use ForwardErrorKind as K;
        let cases = [
            (K::UnknownTunnel, Retry::Safe, 503, "tunnel_unavailable"),
            (K::Draining, Retry::Safe, 503, "tunnel_unavailable"),
            (K::NoCapacity, Retry::NoCapacity, 503, "no_capacity"),
            (K::StreamLost, Retry::MaybeStarted, 502, "stream_lost"),
            (K::BadRequest, Retry::Never, 400, "bad_request"),
            (K::Agent, Retry::Never, 502, "upstream_error"),
            (K::BadResponse, Retry::Never, 502, "bad_response"),
            (K::Unspecified, Retry::Never, 502, "upstream_error"),
        ];
        for (kind, retry, status, code) in cases {
            let e = ForwardError {
                kind: kind as i32,
                message: String::new(),
                call_error: 0,
            };
            let (f, r) = Failure::from_forward_error(&e);
            assert_eq!(
                (r, f.code.status().as_u16(), f.code.as_str()),
                (retry, status, code),
                "{kind:?}"
            );
        }
    }

    #[test]
    fn retry_table_of_call_statuses() {
        use tonic::Code;
        for code in [Code::Unavailable, Code::Unknown, Code::Cancelled] {
            assert_eq!(Retry::of_call_status(code), Retry::Safe, "{code:?}");
        }
        for code in [
            Code::InvalidArgument,
            Code::Unauthenticated,
            Code::PermissionDenied,
            Code::ResourceExhausted,
            Code::Internal,
            Code::DeadlineExceeded,
        ] {
            assert_eq!(Retry::of_call_status(code), Retry::Never, "{code:?}");
        }
    }

    #[test]
    fn a_transport_failure_is_read_from_the_error_chain_not_the_code() {
        use tonic::{ConnectError, Status};
        let io = |kind| Box::new(std::io::Error::from(kind));
        // Never connected: safe, whatever the code says.
        let refused = Status::from_error(Box::new(ConnectError(io(
            std::io::ErrorKind::ConnectionRefused,
        ))));
        assert_eq!(Retry::of_call_error(&refused), Retry::Safe);
        // A connection that was up and broke: the request may have gone out.
        let reset = Status::from_error(io(std::io::ErrorKind::ConnectionReset));
        assert_eq!(Retry::of_call_error(&reset), Retry::MaybeStarted);
        let eof = Status::from_error(io(std::io::ErrorKind::BrokenPipe));
        assert_eq!(Retry::of_call_error(&eof), Retry::MaybeStarted);
        // The server refused the stream: never processed.
        let refused_stream =
            Status::from_error(Box::new(h2::Error::from(h2::Reason::REFUSED_STREAM)));
        assert_eq!(Retry::of_call_error(&refused_stream), Retry::Safe);
        // A reset for another reason: the server had the request.
        let internal = Status::from_error(Box::new(h2::Error::from(h2::Reason::INTERNAL_ERROR)));
        assert_eq!(Retry::of_call_error(&internal), Retry::MaybeStarted);
        // Statuses the server sent itself keep the code table.
        assert_eq!(
            Retry::of_call_error(&Status::unavailable("draining")),
            Retry::Safe
        );
        // The connection's loss, not one stream's: the connection is not used again.
        for lost in [&refused, &reset, &eof] {
            assert!(Retry::connection_lost(lost), "{lost:?}");
        }
        for stream_only in [&refused_stream, &internal, &Status::unavailable("draining")] {
            assert!(!Retry::connection_lost(stream_only), "{stream_only:?}");
        }
        assert_eq!(
            Retry::of_call_error(&Status::unauthenticated("no")),
            Retry::Never
        );
    }

    #[tokio::test]
    async fn a_body_over_its_limit_is_told_by_type_not_message() {
        use http_body_util::{BodyExt, Full, Limited};
        let over = Limited::new(Full::new(Bytes::from_static(b"abc")), 2)
            .collect()
            .await
            .expect_err("over the limit");
        assert_eq!(RequestBodyError::of(&*over), RequestBodyError::TooLarge);
        let lookalike = std::io::Error::other("length limit exceeded");
        assert!(matches!(
            RequestBodyError::of(&lookalike),
            RequestBodyError::Read(m) if m == "length limit exceeded"
        ));
    }
}
