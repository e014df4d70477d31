//! The relay wire protocol, version 1: generated tonic/prost types for
//! `Tunnel.Connect` (agent <-> tunnel server), `Registry.Report` (tunnel server ->
//! dispatcher) and `Forward.Call` (dispatcher -> tunnel server).
//!
//! This crate holds the `.proto` files and their generated code plus small constructors;
//! nothing heavy and no I/O.

#![allow(clippy::large_enum_variant)]

use bytes::Bytes;

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

/// Bytes of a head's headers as the limits count them: every name and value plus 4 (the
/// `: ` and CRLF they take on HTTP/1), so an empty header still costs 4 bytes. `Err` names
/// the first header record that does not parse.
pub fn head_bytes(headers: &[Bytes]) -> Result<usize, MalformedHeader> {
    headers
        .iter()
        .enumerate()
        .try_fold(0usize, |sum, (i, record)| {
            let (name, value) = parse_header(record).map_err(|e| e.at(i))?;
            Ok(sum.saturating_add(name.len() + value.len() + 4))
        })
}

/// Why a head from a peer is refused, when it breaks `max_headers` or `max_bytes` or holds a
/// header record that does not parse. The check reads only lengths: it allocates nothing,
/// whatever the head holds.
pub fn check_head(headers: &[Bytes], max_headers: usize, max_bytes: usize) -> Option<HeadProblem> {
    if headers.len() > max_headers {
        return Some(HeadProblem::OverLimit(format!(
            "{} headers, over the limit of {max_headers}",
            headers.len()
        )));
    }
    match head_bytes(headers) {
        Err(e) => Some(HeadProblem::Malformed(e)),
        Ok(bytes) => (bytes > max_bytes).then(|| {
            HeadProblem::OverLimit(format!(
                "{bytes} bytes of headers, over the limit of {max_bytes}"
            ))
        }),
    }
}

/// What is wrong with a head a peer sent ([`check_head`]); `Display` words it for a log
/// line and a caller's error ("the response head has ...").
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HeadProblem {
    /// Over `max_headers` or `max_bytes`: how far.
    OverLimit(String),
    /// A header record that is not an encoded `Header`.
    Malformed(MalformedHeader),
}

impl std::fmt::Display for HeadProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            HeadProblem::OverLimit(why) => f.write_str(why),
            HeadProblem::Malformed(e) => e.fmt(f),
        }
    }
}

/// A header record (an entry of a head's `headers`) that is not an encoded `Header`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MalformedHeader {
    /// The record's place in its head, when known.
    pub index: Option<usize>,
}

impl MalformedHeader {
    fn at(self, index: usize) -> Self {
        MalformedHeader { index: Some(index) }
    }
}

impl std::fmt::Display for MalformedHeader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.index {
            Some(i) => write!(f, "a malformed header (entry {i} of the head's list)"),
            None => f.write_str("a malformed header"),
        }
    }
}

impl std::error::Error for MalformedHeader {}

/// The name and value of one header record, as slices of it.
///
/// A record is a protobuf `Header` message, read as prost reads one: fields in any order,
/// the last of a repeated field wins, unknown fields (groups included) skipped, a field
/// absent is empty. What prost would refuse (a truncated field, a name or value that is not
/// length-delimited, field number 0, an unmatched group end, groups nested past prost's
/// recursion limit) is [`MalformedHeader`].
#[inline]
pub fn parse_header(record: &[u8]) -> Result<(&[u8], &[u8]), MalformedHeader> {
    match ordinary(record) {
        Some(parsed) => Ok(parsed),
        None => parse_any(record),
    }
}

/// The record every encoder writes for a header whose name (not empty) and value are each
/// shorter than 128 bytes: field 1, then field 2 (left out when the value is empty), each
/// with a one-byte length, and nothing after.
#[inline(always)]
fn ordinary(record: &[u8]) -> Option<(&[u8], &[u8])> {
    let [0x0a, n, rest @ ..] = record else {
        return None;
    };
    let n = usize::from(*n);
    if n >= 0x80 || n > rest.len() {
        return None;
    }
    let (name, rest) = rest.split_at(n);
    match rest {
        [] => Some((name, &[])),
        [0x12, v, value @ ..] if *v < 0x80 && usize::from(*v) == value.len() => Some((name, value)),
        _ => None,
    }
}

/// [`parse_header`] of any record.
fn parse_any(record: &[u8]) -> Result<(&[u8], &[u8]), MalformedHeader> {
    let (mut name, mut value): (&[u8], &[u8]) = (&[], &[]);
    let mut rest = record;
    while !rest.is_empty() {
        let (field, wire_type) = field_key(&mut rest)?;
        if field == 1 || field == 2 {
            if wire_type != 2 {
                return Err(MALFORMED);
            }
            let bytes = length_delimited(&mut rest)?;
            if field == 1 {
                name = bytes;
            } else {
                value = bytes;
            }
        } else {
            skip_field(&mut rest, field, wire_type, 0)?;
        }
    }
    Ok((name, value))
}

pub(crate) const MALFORMED: MalformedHeader = MalformedHeader { index: None };

/// Groups nested deeper than this are refused, as prost refuses messages nested past its
/// recursion limit.
const MAX_GROUP_DEPTH: u32 = 100;

/// A varint: one byte read in place (every key of a `Header` and any length below 128),
/// anything longer by prost.
#[inline]
fn varint(rest: &mut &[u8]) -> Result<u64, MalformedHeader> {
    match rest.split_first() {
        Some((&byte, tail)) if byte < 0x80 => {
            *rest = tail;
            Ok(u64::from(byte))
        }
        _ => prost::encoding::decode_varint(rest).map_err(|_| MALFORMED),
    }
}

/// A field's number and wire type.
#[inline]
pub(crate) fn field_key(rest: &mut &[u8]) -> Result<(u64, u64), MalformedHeader> {
    let key = varint(rest)?;
    let (field, wire_type) = (key >> 3, key & 7);
    if field == 0 || field > u64::from(u32::MAX >> 3) {
        return Err(MALFORMED);
    }
    Ok((field, wire_type))
}

/// A length-delimited field's bytes.
#[inline]
pub(crate) fn length_delimited<'a>(rest: &mut &'a [u8]) -> Result<&'a [u8], MalformedHeader> {
    let len = usize::try_from(varint(rest)?).map_err(|_| MALFORMED)?;
    if len > rest.len() {
        return Err(MALFORMED);
    }
    let (bytes, tail) = rest.split_at(len);
    *rest = tail;
    Ok(bytes)
}

/// Skips the value of a field this reader does not know.
pub(crate) fn skip_field(
    rest: &mut &[u8],
    field: u64,
    wire_type: u64,
    depth: u32,
) -> Result<(), MalformedHeader> {
    let fixed = |rest: &mut &[u8], n: usize| {
        *rest = rest.get(n..).ok_or(MALFORMED)?;
        Ok(())
    };
    match wire_type {
        0 => varint(rest).map(drop),
        1 => fixed(rest, 8),
        2 => length_delimited(rest).map(drop),
        3 if depth < MAX_GROUP_DEPTH => loop {
            let (inner, inner_type) = field_key(rest)?;
            if inner_type == 4 {
                return if inner == field {
                    Ok(())
                } else {
                    Err(MALFORMED)
                };
            }
            skip_field(rest, inner, inner_type, depth + 1)?;
        },
        5 => fixed(rest, 4),
        _ => Err(MALFORMED),
    }
}

/// One header record: `name` and `value` encoded as a `Header`, in a buffer of its own
/// (the call path builds its heads with [`wire_headers`], one buffer for all).
pub fn header(name: impl AsRef<[u8]>, value: impl AsRef<[u8]>) -> Bytes {
    let (name, value) = (name.as_ref(), value.as_ref());
    let mut buf = bytes::BytesMut::with_capacity(record_len(name.len(), value.len()));
    put_record(&mut buf, name, value);
    buf.freeze()
}

/// Bytes of one encoded field of `len` bytes (proto3 leaves an empty one out).
fn field_len(len: usize) -> usize {
    if len == 0 {
        0
    } else {
        1 + prost::encoding::encoded_len_varint(len as u64) + len
    }
}

/// Bytes of the record of a header with a name and value of these lengths.
fn record_len(name: usize, value: usize) -> usize {
    field_len(name) + field_len(value)
}

/// Appends one header record, as prost encodes a `Header`.
fn put_record(buf: &mut bytes::BytesMut, name: &[u8], value: &[u8]) {
    use bytes::BufMut;
    for (key, bytes) in [(0x0a_u8, name), (0x12, value)] {
        if !bytes.is_empty() {
            buf.put_u8(key);
            prost::encoding::encode_varint(bytes.len() as u64, buf);
            buf.put_slice(bytes);
        }
    }
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
        if self.max_headers > MAX_HEAD_RECORDS {
            return Err(InvalidHeadLimit {
                key: "max_response_headers",
                message: "must be at most 16384 (the protocol's bound on a head's headers)",
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
    pub fn check(&self, headers: &[Bytes]) -> Option<HeadProblem> {
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

pub mod bounds;
pub mod codec;

pub mod v1 {
    #![allow(missing_docs)]
    tonic::include_proto!("relay.v1");
}

pub use v1::*;

impl Header {
    /// A header with a copy of `name` (for tests and reading; a head's list holds records,
    /// see [`header`] and [`Header::parse`]).
    pub fn new(name: impl AsRef<[u8]>, value: impl Into<Bytes>) -> Self {
        Header {
            name: Bytes::copy_from_slice(name.as_ref()),
            value: value.into(),
        }
    }

    /// The header a record holds, its name and value slices of the record (no copy).
    pub fn parse(record: &Bytes) -> Result<Self, MalformedHeader> {
        let (name, value) = parse_header(record)?;
        Ok(Header {
            name: record.slice_ref(name),
            value: record.slice_ref(value),
        })
    }

    /// The name as text, for messages (a name that is not UTF-8 shows replacement
    /// characters).
    pub fn name_str(&self) -> std::borrow::Cow<'_, str> {
        String::from_utf8_lossy(&self.name)
    }
}

/// Headers as a head's records, in order, every record a slice of one buffer holding them
/// all: one allocation for the whole head (and one when the buffer is first shared)
/// instead of one per header, and a frame's encoding copies each record whole.
/// `headers` yields the same pairs each time it is called (it is walked three times).
pub fn wire_headers<'a, F, I>(headers: F) -> Vec<Bytes>
where
    F: Fn() -> I,
    I: Iterator<Item = (&'a [u8], &'a [u8])>,
{
    let (count, total) = headers().fold((0, 0), |(c, t), (n, v)| {
        (c + 1, t + record_len(n.len(), v.len()))
    });
    let mut buf = bytes::BytesMut::with_capacity(total);
    for (n, v) in headers() {
        put_record(&mut buf, n, v);
    }
    let mut buf = buf.freeze();
    let mut out = Vec::with_capacity(count);
    for (n, v) in headers() {
        out.push(buf.split_to(record_len(n.len(), v.len())));
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
        let pairs: [(&[u8], &[u8]); 5] = [
            (b"set-cookie", b"a=1"),
            (b"x-empty", b""),
            (b"set-cookie", b"b=2"),
            (b"etag", b"\"abc\""),
            (b"x-long", &[b'v'; 300]),
        ];
        let wire = wire_headers(|| pairs.iter().copied());
        let got: Vec<(&[u8], &[u8])> = wire.iter().map(|r| parse_header(r).unwrap()).collect();
        assert_eq!(got, pairs);
        assert!(wire_headers(std::iter::empty).is_empty());
    }

    #[test]
    fn a_header_record_is_what_prost_writes_and_reads_for_a_header() {
        use prost::Message;
        let cases = [
            Header::new("content-type", "text/plain"),
            Header::new("x-empty", ""),
            Header::new("", "no name"),
            Header::new("", ""),
            Header::new("x-long", vec![b'v'; 70_000]),
        ];
        for h in cases {
            let record = header(&h.name, &h.value);
            assert_eq!(record, Bytes::from(h.encode_to_vec()), "{h:?}");
            assert_eq!(Header::parse(&record).unwrap(), h);
            assert_eq!(
                Header::decode(record.clone()).unwrap(),
                Header::parse(&record).unwrap()
            );
        }
        // A list of records is a `repeated Header` on the wire: a head encoded with records
        // decodes as one written with messages, and the other way round.
        #[derive(Clone, PartialEq, prost::Message)]
        struct TypedHead {
            #[prost(uint64, tag = "1")]
            call_id: u64,
            #[prost(message, repeated, tag = "3")]
            headers: Vec<Header>,
        }
        let typed = TypedHead {
            call_id: 7,
            headers: vec![Header::new("a", "1"), Header::new("b", "")],
        };
        let raw = ResponseHead::decode(typed.encode_to_vec().as_slice()).unwrap();
        assert_eq!(raw.headers, vec![header("a", "1"), header("b", "")]);
        assert_eq!(
            TypedHead::decode(raw.encode_to_vec().as_slice()).unwrap(),
            typed
        );
    }

    #[test]
    fn a_record_is_read_as_prost_reads_a_header_and_refused_where_prost_refuses() {
        use prost::Message;
        // Fields out of order, a repeated field (the last wins), unknown fields of every
        // wire type skipped.
        let odd: &[u8] = &[
            0x12, 1, b'v', // value = "v"
            0x0a, 1, b'x', // name = "x"
            0x0a, 2, b'n', b'm', // name = "nm" (wins)
            0x18, 0x96, 0x01, // field 3, varint
            0x21, 1, 2, 3, 4, 5, 6, 7, 8, // field 4, fixed64
            0x2a, 2, 0, 0, // field 5, length-delimited
            0x35, 1, 2, 3, 4, // field 6, fixed32
            0x3b, 0x08, 1, 0x3c, // field 7, a group holding a varint
        ];
        assert_eq!(parse_header(odd), Ok((&b"nm"[..], &b"v"[..])));
        let typed = Header::decode(odd).unwrap();
        assert_eq!((&typed.name[..], &typed.value[..]), (&b"nm"[..], &b"v"[..]));
        let bad: [&[u8]; 8] = [
            &[0x0a, 5, b'a'],                // name longer than the record
            &[0x0a],                         // a key without its field
            &[0x08, 1],                      // name as a varint
            &[0x15, 1, 2, 3, 4],             // value as fixed32
            &[0x02, 0],                      // field number 0
            &[0x1c],                         // a group's end without its start
            &[0x21, 1, 2],                   // fixed64 cut short
            &[0x0a, 0xff, 0xff, 0xff, 0xff], // a length cut short
        ];
        for record in bad {
            assert_eq!(
                parse_header(record),
                Err(MalformedHeader { index: None }),
                "{record:?}"
            );
            assert!(Header::decode(record).is_err(), "prost reads {record:?}");
        }
        let head = [header("a", "1"), Bytes::from_static(&[0x0a, 5, b'a'])];
        assert_eq!(
            check_head(&head, 10, 1024),
            Some(HeadProblem::Malformed(MalformedHeader { index: Some(1) }))
        );
        assert_eq!(
            check_head(&head, 10, 1024).unwrap().to_string(),
            "a malformed header (entry 1 of the head's list)"
        );
    }

    #[test]
    fn a_record_reads_as_prost_reads_it_whatever_its_bytes() {
        use prost::Message;
        // Short random records over bytes that make keys of every wire type for fields 0-3,
        // lengths, and varint continuations: both readers agree on each.
        const BYTES: [u8; 16] = [
            0x00, 0x01, 0x02, 0x03, 0x04, 0x08, 0x0a, 0x0b, 0x0c, 0x12, 0x13, 0x14, 0x15, 0x19,
            0x1a, 0x80,
        ];
        let mut seed = 0x9e37_79b9_7f4a_7c15_u64;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let (mut ok, mut refused) = (0, 0);
        for i in 0..300_000 {
            let len = (next() % 12) as usize;
            let mut record: Vec<u8> = (0..len).map(|_| BYTES[(next() % 16) as usize]).collect();
            if i % 3 == 0 {
                // Near the ordinary shape (name, then value, one-byte lengths), with lengths
                // that may not match and random bytes after.
                let (n, v) = ((next() % 6) as usize, (next() % 6) as usize);
                let mut near = vec![0x0a, (next() % 6) as u8];
                near.extend(std::iter::repeat_n(b'n', n));
                near.extend([0x12, (next() % 6) as u8]);
                near.extend(std::iter::repeat_n(b'v', v));
                near.extend_from_slice(&record[..len % 3]);
                record = near;
            }
            match (parse_header(&record), Header::decode(record.as_slice())) {
                (Ok((name, value)), Ok(h)) => {
                    assert_eq!((name, value), (&h.name[..], &h.value[..]), "{record:?}");
                    ok += 1;
                }
                (Err(_), Err(_)) => refused += 1,
                (mine, prost) => panic!("{record:?}: {mine:?} but prost {prost:?}"),
            }
        }
        // Both outcomes were exercised.
        assert!(ok > 1000 && refused > 1000, "{ok} read, {refused} refused");
    }

    #[test]
    fn heads_over_a_limit_are_named_without_allocating_for_them() {
        let empty = vec![header("", ""); 24_577];
        let why = check_head(&empty, 256, 64 * 1024).unwrap().to_string();
        assert!(why.contains("24577 headers"), "{why}");
        let big = vec![header("x-big", vec![b'a'; 70_000])];
        let why = check_head(&big, 256, 64 * 1024).unwrap().to_string();
        assert!(why.contains("70009 bytes"), "{why}");
        assert_eq!(check_head(&[header("a", "b")], 1, 6), None);
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
        assert_eq!(limits(MAX_HEAD_RECORDS, 1024).validate(), Ok(()));
        assert_eq!(
            limits(MAX_HEAD_RECORDS + 1, 1024)
                .validate()
                .map_err(|e| e.key),
            Err("max_response_headers")
        );
        let head = |n: usize| -> Vec<Bytes> {
            (0..n)
                .map(|i| header(format!("h{i}"), [b'v'; 100]))
                .collect()
        };
        assert_eq!(limits(2, 1024).check(&head(2)), None);
        assert!(limits(1, 1024)
            .check(&head(2))
            .unwrap()
            .to_string()
            .contains("2 headers"));
        assert!(limits(20, 1024)
            .check(&head(10))
            .unwrap()
            .to_string()
            .contains("bytes of headers"));
    }
}
