//! Bounds on the repeated fields of a peer's message, checked on its encoded bytes before
//! it is decoded.
//!
//! prost decodes a repeated field by pushing one value per entry into a `Vec` that grows as
//! it goes. Entries can be tiny on the wire and large in memory: an empty header record is
//! 2 bytes and becomes a 32-byte `Bytes` in a vector that may have doubled past it, so a
//! 1 MiB frame of them would take 16 to 32 MiB on every hop before any limit looked at the
//! head; an empty `FleetMember` (2 bytes) becomes about 100. [`check`] walks the message's
//! field keys and lengths (the same reading as prost's: fields in any order, an embedded
//! message repeated in its parent merges into one, unknown fields and groups skipped) and
//! counts the entries of each bounded field. The codec refuses a message over a bound with
//! RESOURCE_EXHAUSTED, like one over `max_frame_bytes`, so nothing of it is allocated.
//!
//! A hop's own limits (`max_response_headers`, `limits.max_headers`) are at most these
//! bounds and are checked after decoding, with the clearer errors of each hop. This module
//! reads bytes only: no allocation, no I/O.

use crate::head::{field_key, length_delimited, skip_field, MalformedHeader, MALFORMED};

/// A repeated field reached from a message through embedded message fields, and the most
/// entries one message may hold of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bound {
    /// Field numbers from the outer message down: the embedded messages, then the
    /// repeated field itself.
    pub path: &'static [u64],
    /// Most entries allowed.
    pub max: usize,
    /// What the entries are, for the refusal ("header records in a response head").
    pub what: &'static str,
}

/// A message type a relay hop decodes, with the bounds its repeated fields must keep.
pub trait Bounded {
    /// The bounds checked before a message of this type is decoded (none by default).
    const BOUNDS: &'static [Bound] = &[];
}

/// Why a message is refused before it is decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OverBound {
    /// More than `bound.max` entries of `bound.what`.
    Over(Bound),
    /// The message does not parse (prost would refuse it too).
    Malformed(MalformedHeader),
}

impl std::fmt::Display for OverBound {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            OverBound::Over(b) => {
                write!(f, "more than {} {} (the protocol's bound)", b.max, b.what)
            }
            OverBound::Malformed(_) => f.write_str("a malformed message"),
        }
    }
}

/// Checks `message` (one encoded message of a type with these `bounds`) against each
/// bound. Reads field keys and lengths only, and stops counting a field one entry past its
/// bound.
pub fn check(message: &[u8], bounds: &[Bound]) -> Result<(), OverBound> {
    for bound in bounds {
        let mut n = 0;
        count(message, bound.path, bound.max, &mut n).map_err(OverBound::Malformed)?;
        if n > bound.max {
            return Err(OverBound::Over(*bound));
        }
    }
    Ok(())
}

/// The fewest bytes an entry of a bounded field takes in its message: its field key and a
/// zero length (an empty header record, an empty fleet member).
pub const MIN_ENTRY_BYTES: usize = 2;

/// Whether a message of `len` bytes could hold more entries than one of `bounds` allows.
/// Every entry takes at least [`MIN_ENTRY_BYTES`] of the message, so one of fewer than
/// `MIN_ENTRY_BYTES x (max + 1)` bytes never can: the codec walks only the messages that
/// could (the call heads and small frames of every call are far under: 32 KiB for a head,
/// 8 KiB for a fleet frame), and those few are walked as before.
pub fn may_exceed(len: usize, bounds: &[Bound]) -> bool {
    bounds.iter().any(|b| len / MIN_ENTRY_BYTES > b.max)
}

/// Adds to `n` the entries of the field at `path` in `message`, stopping once `n` passes
/// `max`.
fn count(message: &[u8], path: &[u64], max: usize, n: &mut usize) -> Result<(), MalformedHeader> {
    let Some((&field, deeper)) = path.split_first() else {
        return Ok(());
    };
    let mut rest = message;
    while !rest.is_empty() && *n <= max {
        let (number, wire_type) = field_key(&mut rest)?;
        if number != field {
            skip_field(&mut rest, number, wire_type, 0)?;
            continue;
        }
        // Embedded messages and `bytes` entries are length-delimited; prost refuses
        // anything else for these fields.
        if wire_type != 2 {
            return Err(MALFORMED);
        }
        let inner = length_delimited(&mut rest)?;
        if deeper.is_empty() {
            *n += 1;
        } else {
            count(inner, deeper, max, n)?;
        }
    }
    Ok(())
}

const REQUEST_HEAD_RECORDS: &str = "header records in a request head";
const RESPONSE_HEAD_RECORDS: &str = "header records in a response head";

impl Bounded for crate::ServerFrame {
    const BOUNDS: &'static [Bound] = &[
        // ServerFrame.request_head (2) -> RequestHead.headers (4)
        Bound {
            path: &[2, 4],
            max: crate::MAX_HEAD_RECORDS,
            what: REQUEST_HEAD_RECORDS,
        },
        // ServerFrame.fleet (8) -> Fleet.members (1)
        Bound {
            path: &[8, 1],
            max: crate::MAX_FLEET_MEMBERS,
            what: "fleet members",
        },
    ];
}

impl Bounded for crate::AgentFrame {
    // AgentFrame.response_head (1) -> ResponseHead.headers (3)
    const BOUNDS: &'static [Bound] = &[Bound {
        path: &[1, 3],
        max: crate::MAX_HEAD_RECORDS,
        what: RESPONSE_HEAD_RECORDS,
    }];
}

impl Bounded for crate::ForwardRequest {
    // ForwardRequest.head (1) -> CallHead.request (2) -> RequestHead.headers (4)
    const BOUNDS: &'static [Bound] = &[Bound {
        path: &[1, 2, 4],
        max: crate::MAX_HEAD_RECORDS,
        what: REQUEST_HEAD_RECORDS,
    }];
}

impl Bounded for crate::ForwardResponse {
    // ForwardResponse.head (1) -> ResponseHead.headers (3)
    const BOUNDS: &'static [Bound] = &[Bound {
        path: &[1, 3],
        max: crate::MAX_HEAD_RECORDS,
        what: RESPONSE_HEAD_RECORDS,
    }];
}

// Messages of the relay's own processes to each other (authenticated before any is read)
// and small fixed-shape ones: no bound beyond `max_frame_bytes`.
impl Bounded for crate::ServerReport {}
impl Bounded for crate::ReportAck {}
impl Bounded for crate::WatchRequest {}
impl Bounded for crate::Fleet {}
impl Bounded for crate::ProceedRequest {}
impl Bounded for crate::ProceedReply {}
impl Bounded for crate::ProbeRequest {}
impl Bounded for crate::ProbeReply {}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agent_frame::Kind as Out;
    use crate::server_frame::Kind as In;
    use crate::{
        header, AgentFrame, CallHead, Fleet, FleetMember, ForwardRequest, ForwardResponse,
        RequestHead, ResponseHead, ServerFrame,
    };
    use prost::Message;

    fn response_frame(records: usize) -> Vec<u8> {
        AgentFrame::of(Out::ResponseHead(ResponseHead {
            call_id: 1,
            status: 200,
            headers: vec![header("", ""); records],
            ..Default::default()
        }))
        .encode_to_vec()
    }

    #[test]
    fn every_head_a_hop_decodes_is_counted_at_its_bound() {
        let head = |n: usize| RequestHead {
            call_id: 1,
            method: "GET".into(),
            path_and_query: "/".into(),
            headers: vec![header("a", "b"); n],
            ..Default::default()
        };
        let response = |n: usize| ResponseHead {
            call_id: 1,
            status: 200,
            headers: vec![header("a", "b"); n],
            ..Default::default()
        };
        let bound = crate::MAX_HEAD_RECORDS;
        for n in [0, 1, bound] {
            let server = ServerFrame::of(In::RequestHead(head(n))).encode_to_vec();
            assert_eq!(check(&server, ServerFrame::BOUNDS), Ok(()));
            let forward = ForwardRequest::of(crate::forward_request::Kind::Head(CallHead {
                request: Some(head(n)),
                ..Default::default()
            }))
            .encode_to_vec();
            assert_eq!(check(&forward, ForwardRequest::BOUNDS), Ok(()));
            let back = ForwardResponse::of(crate::forward_response::Kind::Head(response(n)))
                .encode_to_vec();
            assert_eq!(check(&back, ForwardResponse::BOUNDS), Ok(()));
            assert_eq!(check(&response_frame(n), AgentFrame::BOUNDS), Ok(()));
        }
        let over = bound + 1;
        let server = ServerFrame::of(In::RequestHead(head(over))).encode_to_vec();
        assert_eq!(
            check(&server, ServerFrame::BOUNDS),
            Err(OverBound::Over(ServerFrame::BOUNDS[0]))
        );
        let forward = ForwardRequest::of(crate::forward_request::Kind::Head(CallHead {
            request: Some(head(over)),
            ..Default::default()
        }))
        .encode_to_vec();
        assert!(check(&forward, ForwardRequest::BOUNDS).is_err());
        let back = ForwardResponse::of(crate::forward_response::Kind::Head(response(over)))
            .encode_to_vec();
        assert!(check(&back, ForwardResponse::BOUNDS).is_err());
        assert!(check(&response_frame(over), AgentFrame::BOUNDS).is_err());
    }

    #[test]
    fn a_head_split_over_repeated_fields_counts_as_the_one_head_prost_merges() {
        // Two `response_head` fields of one frame: prost merges them into one head whose
        // records are both lists; the count is their sum.
        let half = crate::MAX_HEAD_RECORDS / 2 + 1;
        let mut frame = response_frame(half);
        frame.extend(response_frame(half));
        let merged = AgentFrame::decode(frame.as_slice()).unwrap();
        let Some(Out::ResponseHead(h)) = merged.kind else {
            panic!("a head")
        };
        assert_eq!(h.headers.len(), 2 * half);
        assert!(check(&frame, AgentFrame::BOUNDS).is_err());
    }

    #[test]
    fn a_fleet_frame_is_bounded_and_other_frames_are_not_counted() {
        let fleet = |n: usize| {
            ServerFrame::of(In::Fleet(Fleet {
                members: vec![FleetMember::default(); n],
            }))
            .encode_to_vec()
        };
        assert_eq!(
            check(&fleet(crate::MAX_FLEET_MEMBERS), ServerFrame::BOUNDS),
            Ok(())
        );
        assert_eq!(
            check(&fleet(crate::MAX_FLEET_MEMBERS + 1), ServerFrame::BOUNDS),
            Err(OverBound::Over(ServerFrame::BOUNDS[1]))
        );
        let body = ServerFrame::of(In::RequestBody(crate::BodyChunk {
            call_id: 1,
            data: vec![0x22; 65536].into(),
            end: true,
        }))
        .encode_to_vec();
        assert_eq!(check(&body, ServerFrame::BOUNDS), Ok(()));
    }

    #[test]
    fn a_message_too_short_to_pass_a_bound_is_not_walked_and_one_over_always_is() {
        // The shortest message over each bound: every entry empty.
        let bound = crate::MAX_HEAD_RECORDS;
        let over = response_frame(bound + 1);
        assert!(check(&over, AgentFrame::BOUNDS).is_err());
        assert!(may_exceed(over.len(), AgentFrame::BOUNDS));
        let fleet = ServerFrame::of(In::Fleet(Fleet {
            members: vec![FleetMember::default(); crate::MAX_FLEET_MEMBERS + 1],
        }))
        .encode_to_vec();
        assert!(check(&fleet, ServerFrame::BOUNDS).is_err());
        assert!(may_exceed(fleet.len(), ServerFrame::BOUNDS));
        // The bare entries alone, without the frame around them, are over too.
        let bare = (crate::MAX_FLEET_MEMBERS + 1) * MIN_ENTRY_BYTES;
        assert!(may_exceed(bare, ServerFrame::BOUNDS));
        assert!(!may_exceed(bare - 1, ServerFrame::BOUNDS));
        // A call's head is far under: decoded without the walk.
        let head = response_frame(40);
        assert!(!may_exceed(head.len(), AgentFrame::BOUNDS));
        assert!(!may_exceed(head.len(), ServerFrame::BOUNDS));
        // A type without bounds is never walked.
        assert!(!may_exceed(usize::MAX, &[]));
    }

    #[test]
    fn a_malformed_message_is_refused_as_prost_refuses_it() {
        let mut frame = response_frame(3);
        frame.truncate(frame.len() - 1);
        assert!(AgentFrame::decode(frame.as_slice()).is_err());
        assert!(matches!(
            check(&frame, AgentFrame::BOUNDS),
            Err(OverBound::Malformed(_))
        ));
    }
}
