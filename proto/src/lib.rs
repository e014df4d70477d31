//! The relay wire protocol, version 1: generated tonic/prost types for
//! `Tunnel.Connect` (agent <-> tunnel server), `Registry.Report` (tunnel server ->
//! dispatcher) and `Forward.Call` (dispatcher -> tunnel server).
//!
//! This crate holds the `.proto` files and their generated code plus small constructors;
//! nothing heavy and no I/O.

#![allow(clippy::large_enum_variant)]

/// Wire protocol version carried in `ServerHello` and `ServerIntro`.
pub const PROTOCOL_VERSION: u32 = 1;

/// Largest body chunk any hop puts in one frame. Bodies larger than this stream as
/// several frames under gRPC/HTTP2 flow control.
pub const MAX_CHUNK: usize = 64 * 1024;

/// Default largest gRPC message any hop accepts (`max_frame_bytes`): a body chunk plus
/// generous room for heads.
pub const DEFAULT_MAX_FRAME_BYTES: usize = 1024 * 1024;

pub mod v1 {
    #![allow(missing_docs)]
    tonic::include_proto!("relay.v1");
}

pub use v1::*;

impl Header {
    pub fn new(name: impl Into<String>, value: impl Into<Vec<u8>>) -> Self {
        Header {
            name: name.into(),
            value: value.into(),
        }
    }
}

impl ServerFrame {
    pub fn of(kind: server_frame::Kind) -> Self {
        ServerFrame { kind: Some(kind) }
    }
}

impl AgentFrame {
    pub fn of(kind: agent_frame::Kind) -> Self {
        AgentFrame { kind: Some(kind) }
    }
}

impl ForwardRequest {
    pub fn of(kind: forward_request::Kind) -> Self {
        ForwardRequest { kind: Some(kind) }
    }
}

impl ForwardResponse {
    pub fn of(kind: forward_response::Kind) -> Self {
        ForwardResponse { kind: Some(kind) }
    }

    pub fn error(kind: ForwardErrorKind, message: impl Into<String>) -> Self {
        Self::of(forward_response::Kind::Error(ForwardError {
            kind: kind as i32,
            message: message.into(),
            call_error: CallErrorKind::Unspecified as i32,
        }))
    }
}

impl ServerReport {
    pub fn of(kind: server_report::Kind) -> Self {
        ServerReport { kind: Some(kind) }
    }
}
