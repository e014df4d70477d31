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

/// The features named in a feature list (`AGENT_FEATURES`, `FORWARD_FEATURES`): comma
/// separated, surrounding spaces ignored, unknown names left to the reader to skip.
pub fn features(list: &str) -> impl Iterator<Item = &str> {
    list.split(',').map(str::trim)
}

/// Response metadata of `Forward.Carry` in which a tunnel server lists what it reads beyond
/// the first version of the protocol: `inline-body`, a whole small request body inside the
/// call head (`RequestHead.body`). A dispatcher puts a body there only on a carrier whose
/// server listed it; older servers would drop it.
pub const FORWARD_FEATURES: &str = "relay-forward-features";

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

/// Longest peer-supplied error message kept, in characters, after [`escape_message`].
pub const MAX_PEER_MESSAGE: usize = 512;

/// Bytes of a head's headers as the limits count them: every name and value plus 4 (the
/// `: ` and CRLF they take on HTTP/1), so an empty header still costs 4 bytes.
pub fn head_bytes(headers: &[Header]) -> usize {
    headers
        .iter()
        .map(|h| h.name.len() + h.value.len() + 4)
        .fold(0, usize::saturating_add)
}

/// Why a head from a peer is refused, when it breaks `max_headers` or `max_bytes`. The
/// check reads only lengths: it allocates nothing, whatever the head holds.
pub fn check_head(headers: &[Header], max_headers: usize, max_bytes: usize) -> Option<String> {
    if headers.len() > max_headers {
        return Some(format!(
            "{} headers, over the limit of {max_headers}",
            headers.len()
        ));
    }
    let bytes = head_bytes(headers);
    (bytes > max_bytes).then(|| format!("{bytes} bytes of headers, over the limit of {max_bytes}"))
}

/// The limits the tunnel server and the dispatcher put on a response head their peer sends
/// (config keys `max_response_headers` and `max_response_header_bytes` in both), with
/// their defaults and their validation written once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeadLimits {
    /// `max_response_headers`: most headers in one head.
    pub max_headers: usize,
    /// `max_response_header_bytes`: most bytes in one head, as [`head_bytes`] counts them.
    pub max_bytes: usize,
}

/// A [`HeadLimits`] value out of range: the config key it came from and why.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InvalidHeadLimit {
    pub key: &'static str,
    pub message: &'static str,
}

impl std::fmt::Display for InvalidHeadLimit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "config key `{}`: {}", self.key, self.message)
    }
}

impl std::error::Error for InvalidHeadLimit {}

impl HeadLimits {
    pub const DEFAULT: HeadLimits = HeadLimits {
        max_headers: DEFAULT_MAX_HEADERS,
        max_bytes: DEFAULT_MAX_HEAD_BYTES,
    };

    pub const fn new(max_headers: usize, max_bytes: usize) -> Self {
        HeadLimits {
            max_headers,
            max_bytes,
        }
    }

    /// Fewest bytes `max_response_header_bytes` may allow: room for an ordinary head.
    pub const MIN_BYTES: usize = 1024;

    /// Checks the values once, at start; the error names the key.
    pub fn validate(&self) -> Result<(), InvalidHeadLimit> {
        if self.max_headers == 0 {
            return Err(InvalidHeadLimit {
                key: "max_response_headers",
                message: "must be at least 1",
            });
        }
        if self.max_bytes < Self::MIN_BYTES {
            return Err(InvalidHeadLimit {
                key: "max_response_header_bytes",
                message: "must be at least 1024",
            });
        }
        Ok(())
    }

    /// Why `headers` break these limits, if they do ([`check_head`]).
    pub fn check(&self, headers: &[Header]) -> Option<String> {
        check_head(headers, self.max_headers, self.max_bytes)
    }
}

impl Default for HeadLimits {
    fn default() -> Self {
        Self::DEFAULT
    }
}

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

pub mod codec;

pub mod v1 {
    #![allow(missing_docs)]
    tonic::include_proto!("relay.v1");
}

pub use v1::*;

impl Header {
    /// A header with a copy of `name` (the call path builds its heads with
    /// [`wire_headers`], without a copy per name).
    pub fn new(name: impl AsRef<[u8]>, value: impl Into<bytes::Bytes>) -> Self {
        Header {
            name: bytes::Bytes::copy_from_slice(name.as_ref()),
            value: value.into(),
        }
    }

    /// The name as text, for messages (a name that is not UTF-8 shows replacement
    /// characters).
    pub fn name_str(&self) -> std::borrow::Cow<'_, str> {
        String::from_utf8_lossy(&self.name)
    }
}

/// Headers as wire headers, in order, every name and value a slice of one buffer holding
/// them all: one allocation for the whole head (and one when the buffer is first shared)
/// instead of a copy per name and per value, and a second allocation for each when the
/// frame's encoding clones it.
/// `headers` yields the same pairs each time it is called (it is walked three times).
pub fn wire_headers<'a, F, I>(headers: F) -> Vec<Header>
where
    F: Fn() -> I,
    I: Iterator<Item = (&'a [u8], &'a [u8])>,
{
    let (count, total) = headers().fold((0, 0), |(c, t), (n, v)| (c + 1, t + n.len() + v.len()));
    let mut buf = bytes::BytesMut::with_capacity(total);
    for (n, v) in headers() {
        buf.extend_from_slice(n);
        buf.extend_from_slice(v);
    }
    let mut buf = buf.freeze();
    let mut out = Vec::with_capacity(count);
    for (n, v) in headers() {
        let name = buf.split_to(n.len());
        let value = buf.split_to(v.len());
        out.push(Header { name, value });
    }
    out
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_feature_list_is_comma_separated_and_spaces_around_names_do_not_count() {
        let got: Vec<&str> = features(" fleet ,inline-body,, later ").collect();
        assert_eq!(got, ["fleet", "inline-body", "", "later"]);
    }

    #[test]
    fn wire_headers_keep_every_name_and_value_in_order() {
        let pairs: [(&[u8], &[u8]); 4] = [
            (b"set-cookie", b"a=1"),
            (b"x-empty", b""),
            (b"set-cookie", b"b=2"),
            (b"etag", b"\"abc\""),
        ];
        let wire = wire_headers(|| pairs.iter().copied());
        let got: Vec<(&[u8], &[u8])> = wire.iter().map(|h| (&h.name[..], &h.value[..])).collect();
        assert_eq!(got, pairs);
        assert!(wire_headers(std::iter::empty).is_empty());
    }

    #[test]
    fn heads_over_a_limit_are_named_without_allocating_for_them() {
        let empty = vec![Header::new("", ""); 24_577];
        let why = check_head(&empty, 256, 64 * 1024).unwrap();
        assert!(why.contains("24577 headers"), "{why}");
        let big = vec![Header::new("x-big", vec![b'a'; 70_000])];
        let why = check_head(&big, 256, 64 * 1024).unwrap();
        assert!(why.contains("70009 bytes"), "{why}");
        assert_eq!(check_head(&[Header::new("a", "b")], 1, 6), None);
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

    #[test]
    fn head_limits_are_validated_naming_the_key() {
        let limits = HeadLimits::new;
        assert_eq!(HeadLimits::DEFAULT.validate(), Ok(()));
        assert_eq!(limits(1, 1024).validate(), Ok(()));
        assert_eq!(
            limits(0, 64 * 1024).validate().map_err(|e| e.key),
            Err("max_response_headers")
        );
        assert_eq!(
            limits(1, 1023).validate().map_err(|e| e.key),
            Err("max_response_header_bytes")
        );
        let head = |n: usize| -> Vec<Header> {
            (0..n)
                .map(|i| Header {
                    name: format!("h{i}").into(),
                    value: vec![b'v'; 100].into(),
                })
                .collect()
        };
        assert_eq!(limits(2, 1024).check(&head(2)), None);
        assert!(limits(1, 1024)
            .check(&head(2))
            .unwrap()
            .contains("2 headers"));
        assert!(limits(20, 1024)
            .check(&head(10))
            .unwrap()
            .contains("bytes of headers"));
    }
}
