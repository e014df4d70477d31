//! What decoding a hostile frame costs in memory, measured by a counting allocator (this
//! test binary's only test, so no other thread allocates while it measures).
//!
//! A 1 MiB frame of empty header records (2 bytes each on the wire, 524,287 of them) is
//! what a hostile agent, tunnel server or dispatcher can send within `max_frame_bytes`.
//! Decoded as it comes, each record would become a 32-byte `Bytes` in a vector grown by
//! doubling: 16 to 32 MiB per frame on every hop before any limit looked at the head. The
//! codec counts the records on the bytes first and refuses the frame.

use bytes::Bytes;
use prost::Message;
use relay_proto::agent_frame::Kind as Out;
use relay_proto::codec::decode_message;
use relay_proto::server_frame::Kind as In;
use relay_proto::{AgentFrame, ForwardResponse, RequestHead, ResponseHead, ServerFrame};
use stats_alloc::{Region, StatsAlloc, INSTRUMENTED_SYSTEM};
use std::alloc::System;

#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

const MIB: usize = 1024 * 1024;

/// A frame whose field `head_field` is a head holding nothing but empty header records
/// (its field `records_field`, 2 bytes each), just under 1 MiB in all.
fn one_mib_of_empty_records(records_field: u8, head_field: u8) -> Bytes {
    let records = (MIB - 16) / 2;
    let mut head = Vec::with_capacity(records * 2);
    for _ in 0..records {
        head.extend([records_field << 3 | 2, 0]);
    }
    let mut frame = Vec::with_capacity(MIB);
    frame.push(head_field << 3 | 2);
    prost::encoding::encode_varint(head.len() as u64, &mut frame);
    frame.extend(head);
    assert!(frame.len() <= MIB);
    Bytes::from(frame)
}

/// Bytes allocated (new allocations plus growth) while `f` runs.
fn allocated_by<T>(f: impl FnOnce() -> T) -> (T, usize) {
    let region = Region::new(GLOBAL);
    let out = f();
    let stats = region.change();
    (
        out,
        stats.bytes_allocated + stats.bytes_reallocated.max(0) as usize,
    )
}

#[test]
fn a_one_mib_frame_of_empty_header_records_is_refused_before_it_is_allocated() {
    // AgentFrame.response_head (1) -> ResponseHead.headers (3): what a tunnel server reads
    // from an agent.
    let agent = one_mib_of_empty_records(3, 1);
    // ForwardResponse.head (1) -> ResponseHead.headers (3): what a dispatcher reads.
    let forward = one_mib_of_empty_records(3, 1);
    // ServerFrame.request_head (2) -> RequestHead.headers (4): what an agent reads.
    let server = one_mib_of_empty_records(4, 2);

    // prost alone would take it: the amplification this guards against.
    let (plain, inflated) = allocated_by(|| AgentFrame::decode(agent.clone()).unwrap());
    let Some(Out::ResponseHead(ResponseHead { headers, .. })) = &plain.kind else {
        panic!("a response head");
    };
    assert_eq!(headers.len(), (MIB - 16) / 2);
    assert!(inflated > 16 * MIB, "prost allocated {inflated} bytes");
    drop(plain);

    let (refused, cost) = allocated_by(|| decode_message::<AgentFrame>(agent.clone()));
    let status = refused.unwrap_err();
    assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
    assert!(
        status.message().contains("more than 16384 header records"),
        "{status:?}"
    );
    // The status and its message, nothing sized by the frame.
    assert!(cost < 4096, "refusing the frame allocated {cost} bytes");
    println!(
        "a {} byte frame of {} empty records: prost alone allocates {inflated} bytes, the codec refuses it after allocating {cost}",
        agent.len(),
        (MIB - 16) / 2
    );

    let (refused, cost) = allocated_by(|| decode_message::<ForwardResponse>(forward.clone()));
    assert_eq!(refused.unwrap_err().code(), tonic::Code::ResourceExhausted);
    assert!(cost < 4096, "refusing the frame allocated {cost} bytes");

    let (refused, cost) = allocated_by(|| decode_message::<ServerFrame>(server.clone()));
    assert_eq!(refused.unwrap_err().code(), tonic::Code::ResourceExhausted);
    assert!(cost < 4096, "refusing the frame allocated {cost} bytes");

    // A head at the bound still decodes, costing at most its records' handles.
    let head = ServerFrame::of(In::RequestHead(RequestHead {
        call_id: 1,
        method: "GET".into(),
        path_and_query: "/".into(),
        headers: vec![relay_proto::header("a", ""); relay_proto::MAX_HEAD_RECORDS],
        ..Default::default()
    }))
    .encode_to_vec();
    let (decoded, cost) = allocated_by(|| decode_message::<ServerFrame>(Bytes::from(head)));
    assert!(decoded.is_ok());
    let handles = relay_proto::MAX_HEAD_RECORDS * std::mem::size_of::<Bytes>();
    assert!(
        cost <= 2 * handles + 4096,
        "decoding allocated {cost} bytes"
    );
}
