//! Error enums, one per boundary: starting the agent (`RunError`), talking to the
//! upstream (`UpstreamError`), opening a tunnel stream (`OpenError`).
//!
//! Mapping to wire codes (`CallErrorKind`) happens once, in `call.rs`.

use relay_common::config::ConfigError;

/// Why `run` could not start or keep running.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("metrics registry: {0}")]
    Metrics(#[from] prometheus::Error),
    #[error("[tls]: {source}")]
    Tls {
        #[source]
        source: relay_common::tls::TlsError,
    },
}

/// Why a call against the upstream failed.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    /// The request could not be turned into a valid upstream request.
    #[error("bad request: {0}")]
    BadRequest(String),
    /// Connect refused, DNS, reset before a response head.
    #[error("upstream unreachable: {0}")]
    Unreachable(String),
    /// No response head (or no end of body) before the call's deadline.
    #[error("upstream timed out")]
    Timeout,
    /// The response body broke off after the head.
    #[error("upstream aborted the response: {0}")]
    Aborted(String),
    /// The request body went past `limits.max_body_bytes`; the request was aborted.
    #[error("request body exceeds the agent's limits.max_body_bytes ({0} bytes)")]
    BodyTooLarge(u64),
}

/// The server behind a RESOURCE_EXHAUSTED refusal (from the refusal's metadata).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refused {
    pub server_id: String,
    pub instance_id: String,
    /// Its per-token stream cap, when the cap is why.
    pub cap: Option<u32>,
}

/// Why a tunnel stream could not be opened (no ServerHello).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OpenError {
    /// The server refused the token (`UNAUTHENTICATED`).
    #[error("token refused by the tunnel server: {0}")]
    Unauthenticated(String),
    /// The server holds as many streams of this token as it will, or is draining
    /// (`RESOURCE_EXHAUSTED`); which server, when it said so.
    #[error("tunnel server stream cap reached: {0}")]
    Exhausted(String, Option<Refused>),
    /// Anything else: connect failure, timeout, a first frame that is not a hello.
    #[error("{0}")]
    Other(String),
    /// An open through one of several tunnel endpoints did not reach a server, and another
    /// endpoint is open: the opens go there, nothing to back off from.
    #[error("{0}")]
    Endpoint(String),
    /// The hello did not come within `connect_timeout`, while other opens landed on the
    /// same connection: the servers are busy, the path is alive. The open window narrows
    /// (`crate::stream::window`); no backoff step, no endpoint pause.
    #[error("{0} (other streams landed on the connection meanwhile: the servers are busy)")]
    Busy(String),
}
