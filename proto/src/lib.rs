//! The relay wire protocol, version 1: generated tonic/prost types for
//! `Tunnel.Connect` (agent <-> tunnel server), `Registry.Report` (tunnel server ->
//! dispatcher) and `Forward.Call` (dispatcher -> tunnel server).
//!
//! This crate holds the `.proto` files and their generated code, the protocol's constants
//! (chunk size, feature names, metadata keys, body credit) and constructors, and the
//! code every hop shares to read what a peer sent before trusting it: [`head`] (header
//! records read in place, head limits, the inline-body rule), [`bounds`] (repeated fields
//! counted on the encoded bytes before decoding) and [`codec`] (the prost codec with small
//! buffers that applies those bounds). It does no I/O, holds no state and reads no clock;
//! what a hop does with a refused frame is the hop's business.

#![allow(clippy::large_enum_variant)]

/// Wire protocol version carried in `ServerHello` and `ServerIntro`.
pub const PROTOCOL_VERSION: u32 = 1;

/// Largest body chunk any hop puts in one frame. Bodies larger than this stream as
/// several frames under gRPC/HTTP2 flow control.
pub const MAX_CHUNK: usize = 64 * 1024;

/// Whether a whole request body of `body_len` bytes may ride inside `head`
/// (`RequestHead.body`): the head with it stays within one body chunk's size, so its frame
/// fits any `max_frame_bytes` (at least two chunks, see [`check_max_frame_bytes`]).
pub fn body_fits_in_head(head: &RequestHead, body_len: usize) -> bool {
    body_len + prost::Message::encoded_len(head) <= MAX_CHUNK
}

/// Request metadata of `Tunnel.Connect` in which an agent lists the optional server frames
/// it understands ([`FEATURE_FLEET`], [`FEATURE_INLINE_BODY`]).
pub const AGENT_FEATURES: &str = "relay-agent-features";

/// Feature: `Fleet` frames (an agent that lists it gets the fleet's news).
pub const FEATURE_FLEET: &str = "fleet";

/// Feature: a whole small request body inside the call head (`RequestHead.body`), on the
/// tunnel server -> agent hop (listed by agents) and the dispatcher -> tunnel server hop
/// (listed by tunnel servers).
pub const FEATURE_INLINE_BODY: &str = "inline-body";

/// Request metadata of `Tunnel.Connect` naming the agent's connection the stream is on
/// (opaque, printable, at most [`MAX_AGENT_CONN`] bytes): a tunnel server that offers
/// liveness (`ServerHello.liveness_ms`) proves each named connection alive with one ping
/// per period on one of its idle streams.
pub const AGENT_CONN: &str = "relay-agent-conn";

/// Request metadata of `Tunnel.Connect` in which an agent asks for body credit and gives
/// the request-body credit the server may use (decimal bytes; see
/// `ServerHello.response_credit`).
pub const AGENT_CREDIT: &str = "relay-agent-credit";
/// Metadata on `Tunnel.Connect` naming the tunnel server (`server_id`) the agent wants the
/// stream on (`[coverage] steered_opens`): for the load balancer, which may route the open
/// to that server (HAProxy: `use-server ts-1 if { req.hdr(relay-server) -m str ts-1 }`).
/// Tunnel servers ignore it.
pub const AGENT_STEER: &str = "relay-server";

/// Body credit given back once this many bytes were passed on (or the sender may be
/// waiting): a credit of at least two chunks never waits on a grant held back.
pub const CREDIT_STEP: usize = MAX_CHUNK / 4;

/// The body credit a receiver with stream window `window` gives a sender: what fits in the
/// window beside a head and a frame's overhead, and at least two chunks (so that a grant
/// held back below [`CREDIT_STEP`] never stops a chunk).
pub fn body_credit(window: u32) -> u32 {
    let fit = (window as usize).saturating_sub(2 * MAX_CHUNK);
    fit.max(2 * MAX_CHUNK).min(u32::MAX as usize) as u32
}

/// Longest `relay-agent-conn` value a server accepts; a longer or unprintable one is
/// ignored (the stream is then proved alive by its own heartbeat only).
pub const MAX_AGENT_CONN: usize = 64;

/// The features named in a feature list (`AGENT_FEATURES`, `FORWARD_FEATURES`): comma
/// separated, surrounding spaces ignored, unknown names left to the reader to skip.
pub fn features(list: &str) -> impl Iterator<Item = &str> {
    list.split(',').map(str::trim)
}

/// Whether the feature list under `key` in `metadata` names `feature` (a peer's answer
/// that lists what it reads: [`FORWARD_FEATURES`], [`REGISTRY_FEATURES`]).
pub fn lists_feature(metadata: &tonic::metadata::MetadataMap, key: &str, feature: &str) -> bool {
    metadata
        .get(key)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|l| features(l).any(|f| f == feature))
}

/// Response metadata of `Forward.Carry` in which a tunnel server lists what it reads beyond
/// the first version of the protocol: `inline-body`, a whole small request body inside the
/// call head (`RequestHead.body`). A dispatcher puts a body there only on a carrier whose
/// server listed it; older servers would drop it.
pub const FORWARD_FEATURES: &str = "relay-forward-features";

/// Response metadata of `Registry.Watch` in which a dispatcher lists what it reads on the
/// report stream beyond the first version of the protocol: [`FEATURE_PARTIAL_LOAD`]. A
/// tunnel server uses a feature only on the report stream to a dispatcher that listed it.
pub const REGISTRY_FEATURES: &str = "relay-registry-features";

/// Feature: load reports that carry only the tunnel ids whose figures changed
/// (`LoadReport.partial`).
pub const FEATURE_PARTIAL_LOAD: &str = "partial-load";

/// Why a `max_frame_bytes` setting is refused: below two body chunks, a frame could not
/// carry a chunk plus its head. Every component's config checks it with this.
pub fn check_max_frame_bytes(max_frame_bytes: usize) -> Result<(), String> {
    let min = 2 * MAX_CHUNK;
    if max_frame_bytes < min {
        return Err(format!("must be at least {min} (two body chunks)"));
    }
    Ok(())
}

/// Default largest gRPC message any hop accepts (`max_frame_bytes`): a body chunk plus
/// generous room for heads.
pub const DEFAULT_MAX_FRAME_BYTES: usize = 1024 * 1024;

/// Default largest number of headers in one head a peer sends (`max_response_headers` at
/// the tunnel server and the dispatcher, `limits.max_headers` at the agent).
pub const DEFAULT_MAX_HEADERS: usize = 256;

/// Default largest head a peer sends, in bytes as [`head_bytes`] counts them
/// (`max_response_header_bytes` at the tunnel server and the dispatcher).
pub const DEFAULT_MAX_HEAD_BYTES: usize = 64 * 1024;

/// Most header records one head may carry on any hop, whatever a config allows: a frame
/// holding more is refused as it is decoded, before any record is allocated (see
/// [`bounds`]). Each hop's own limit (`max_response_headers`, `limits.max_headers`) is at
/// most this and is checked after decoding.
pub const MAX_HEAD_RECORDS: usize = 16 * 1024;

/// Most members one `Fleet` frame may list: a tunnel server sends at most this many, an
/// agent refuses a frame with more as it is decoded (see [`bounds`]).
pub const MAX_FLEET_MEMBERS: usize = 4096;

/// Longest peer-supplied error message kept, in characters, after [`escape_message`].
pub const MAX_PEER_MESSAGE: usize = 512;

/// A peer-supplied message made safe for a log line and a caller's JSON: control
/// characters (newlines, ESC of ANSI sequences, DEL, C1) are written as escapes (`\n`,
/// `\u{1b}`) and the result is cut to `max` characters, ending in `…` when cut.
pub fn escape_message(msg: &str, max: usize) -> String {
    let mut out = String::with_capacity(msg.len().min(max));
    let mut count = 0usize;
    for c in msg.chars() {
        let piece: std::borrow::Cow<'_, str> = match c {
            '\n' => "\\n".into(),
            '\r' => "\\r".into(),
            '\t' => "\\t".into(),
            c if c.is_control() => format!("\\u{{{:x}}}", c as u32).into(),
            // Bidirectional overrides can reorder what a reader of the log sees.
            '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}' => {
                format!("\\u{{{:x}}}", c as u32).into()
            }
            c => c.to_string().into(),
        };
        let n = piece.chars().count();
        if count + n > max {
            out.push('…');
            return out;
        }
        count += n;
        out.push_str(&piece);
    }
    out
}

pub mod bounds;
pub mod codec;
pub mod head;

pub use head::*;

pub mod v1 {
    #![allow(missing_docs)]
    tonic::include_proto!("relay.v1");
}

pub use v1::*;

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_feature_list_is_comma_separated_and_spaces_around_names_do_not_count() {
        let got: Vec<&str> = features(" fleet ,inline-body,, later ").collect();
        assert_eq!(got, ["fleet", "inline-body", "", "later"]);
    }

    #[test]
    fn messages_lose_their_control_characters_and_are_cut() {
        let cases = [
            ("plain", "plain"),
            ("two\nlines", "two\\nlines"),
            ("\x1b[31mred\x1b[0m", "\\u{1b}[31mred\\u{1b}[0m"),
            ("nul\0 del\x7f", "nul\\u{0} del\\u{7f}"),
            ("cr\r tab\t", "cr\\r tab\\t"),
            ("rtl\u{202e}x", "rtl\\u{202e}x"),
            ("ünïcode", "ünïcode"),
        ];
        for (input, want) in cases {
            assert_eq!(escape_message(input, 100), want, "{input:?}");
        }
        let long = "a".repeat(1000);
        let cut = escape_message(&long, 10);
        assert_eq!(cut, format!("{}…", "a".repeat(10)));
        // An escape is never split.
        assert_eq!(escape_message("aaaa\n", 5), "aaaa…");
    }
}
