//! Heads on the wire: the header records of a head (`RequestHead.headers`,
//! `ResponseHead.headers`) and the rules every hop applies to a head a peer sent.
//!
//! A head's headers travel as a list of encoded `Header` records, which the call path
//! builds in one buffer ([`wire_headers`]) and reads in place ([`parse_header`], a small
//! reader of the protobuf wire format that agrees with prost on every record, tested
//! against it). The limits a hop puts on a peer's head ([`check_head`], [`HeadLimits`])
//! read only lengths, and the inline-body rule ([`check_inline_body`]) is written here
//! once for every hop. No I/O, and nothing here allocates for what a peer sent.

use crate::{Header, DEFAULT_MAX_HEADERS, DEFAULT_MAX_HEAD_BYTES, MAX_CHUNK, MAX_HEAD_RECORDS};
use bytes::Bytes;

/// What breaks the inline-body rule in a head ([`check_inline_body`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InlineBodyProblem {
    /// The head carries a body but does not end its message (`end_of_stream` unset).
    NotTheEnd,
    /// The body is over [`MAX_CHUNK`] bytes (its length).
    TooLarge(usize),
}

impl std::fmt::Display for InlineBodyProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            InlineBodyProblem::NotTheEnd => f.write_str("the head carries a body but not its end"),
            InlineBodyProblem::TooLarge(len) => {
                write!(
                    f,
                    "the head carries a body of {len} bytes, over {MAX_CHUNK}"
                )
            }
        }
    }
}

/// The inline-body rule, the same on every hop and in both directions
/// (`RequestHead.body`, `ResponseHead.body`): **a head carries a body only when it ends
/// the message (`end_of_stream`), and at most [`MAX_CHUNK`] (64 KiB) of it.** A sender
/// puts a whole small body in the head to save a frame; a body that goes on, or one
/// larger than a chunk, streams as body chunks instead. A head without a body passes,
/// whether it ends the message or not. `body_len` is the head's `body` length,
/// `end_of_stream` its flag; `Err` says which half of the rule the head broke (when both,
/// [`InlineBodyProblem::NotTheEnd`]). Receivers check it on every head a peer sends;
/// a sender of a request head also keeps the head with its body within one chunk
/// ([`crate::body_fits_in_head`]), so the frame fits any `max_frame_bytes`.
pub fn check_inline_body(body_len: usize, end_of_stream: bool) -> Result<(), InlineBodyProblem> {
    if body_len > 0 && !end_of_stream {
        return Err(InlineBodyProblem::NotTheEnd);
    }
    if body_len > MAX_CHUNK {
        return Err(InlineBodyProblem::TooLarge(body_len));
    }
    Ok(())
}

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ResponseHead, MAX_CHUNK};

    #[test]
    fn a_head_carries_a_body_only_when_it_ends_and_at_most_one_chunk() {
        let cases = [
            (0, false, Ok(())),
            (0, true, Ok(())),
            (1, true, Ok(())),
            (MAX_CHUNK, true, Ok(())),
            (1, false, Err(InlineBodyProblem::NotTheEnd)),
            (MAX_CHUNK + 1, false, Err(InlineBodyProblem::NotTheEnd)),
            (
                MAX_CHUNK + 1,
                true,
                Err(InlineBodyProblem::TooLarge(MAX_CHUNK + 1)),
            ),
        ];
        for (len, end, want) in cases {
            assert_eq!(check_inline_body(len, end), want, "{len} bytes, end {end}");
        }
        assert_eq!(
            InlineBodyProblem::TooLarge(70_000).to_string(),
            "the head carries a body of 70000 bytes, over 65536"
        );
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
