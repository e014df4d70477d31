//! Bounded fuzzing (proptest, 256 cases each, in the normal test suite) of what a peer can
//! send a tunnel server: arbitrary bytes through the frame decoders, and arbitrary agent
//! frame sequences through the real per-stream state machine. A small committed corpus of
//! tricky inputs runs as table tests first.
//!
//! Properties: decoding never panics; a scripted agent sending any sequence never panics
//! the server, every call gets exactly one outcome (an answer or one error) and nothing
//! after it, and a stream of another tunnel id keeps serving throughout.

mod common;

use common::*;
use proptest::prelude::*;
use proptest::test_runner::{Config as RunnerConfig, TestRunner};
use prost::Message;
use relay_proto::*;
use relay_tunnel_server::{Config, TokenStore};
use std::time::Duration;

/// Inputs that broke or nearly broke decoders elsewhere: truncated varints, lengths past
/// the end, wrong wire types, deep nesting, invalid UTF-8 in string fields.
const CORPUS: &[&[u8]] = &[
    b"",
    &[0x00],
    &[0xff; 11],
    &[0x0a, 0xff, 0xff, 0xff, 0xff, 0x0f],
    &[0x0a, 0x05, 0x01],
    &[0x0b],
    &[0x0c],
    &[0x0d, 0x01, 0x02],
    &[0x12, 0x02, 0xc3, 0x28],
    &[0x0a, 0x04, 0x0a, 0x02, 0x0a, 0x00],
    &[0x3a, 0x03, 0x0a, 0x01, 0xff],
    &[
        0x08, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x02,
    ],
    &[0x0a, 0x02, 0x08],
    &[0xf8, 0xff, 0xff, 0xff, 0x0f, 0x01],
];

fn decode_all(bytes: &[u8]) {
    let _ = AgentFrame::decode(bytes);
    let _ = ServerFrame::decode(bytes);
    let _ = ForwardRequest::decode(bytes);
    let _ = ForwardResponse::decode(bytes);
    let _ = ServerReport::decode(bytes);
}

#[test]
fn corpus_decodes_without_panicking() {
    for input in CORPUS {
        decode_all(input);
    }
    // Nesting as deep as the bytes allow.
    let deep: Vec<u8> = std::iter::repeat_n([0x0a_u8, 0x7f], 64).flatten().collect();
    decode_all(&deep);
}

proptest! {
    #![proptest_config(RunnerConfig { cases: 256, ..RunnerConfig::default() })]

    #[test]
    fn arbitrary_bytes_never_panic_a_decoder(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        decode_all(&bytes);
    }

    #[test]
    fn valid_frames_with_flipped_bytes_never_panic_a_decoder(
        pos in any::<prop::sample::Index>(),
        byte in any::<u8>(),
        len in 0usize..200,
    ) {
        let frame = AgentFrame::of(agent_frame::Kind::ResponseBody(BodyChunk {
            call_id: 7,
            data: vec![9; len].into(),
            end: true,
        }));
        let mut bytes = frame.encode_to_vec();
        let i = pos.index(bytes.len());
        bytes[i] = byte;
        decode_all(&bytes);
    }
}

/// One scripted agent frame; `call` picks the call id: 0 the real one, 1 the next, 2 zero.
#[derive(Debug, Clone)]
enum Step {
    Head { call: u8, status: u32, end: bool },
    Body { call: u8, len: usize, end: bool },
    Error { call: u8, kind: i32 },
    Pong,
    GoingAway,
    Empty,
}

fn step() -> impl Strategy<Value = Step> {
    let call = 0u8..3;
    prop_oneof![
        4 => (call.clone(), prop_oneof![Just(200u32), 0u32..1000], any::<bool>())
            .prop_map(|(call, status, end)| Step::Head { call, status, end }),
        4 => (call.clone(), 0usize..2048, any::<bool>())
            .prop_map(|(call, len, end)| Step::Body { call, len, end }),
        2 => (call, -1i32..8).prop_map(|(call, kind)| Step::Error { call, kind }),
        1 => Just(Step::Pong),
        1 => Just(Step::GoingAway),
        1 => Just(Step::Empty),
    ]
}

fn frame(step: &Step, real: u64) -> AgentFrame {
    let id = |c: u8| match c {
        0 => real,
        1 => real + 1,
        _ => 0,
    };
    match step {
        Step::Head { call, status, end } => {
            AgentFrame::of(agent_frame::Kind::ResponseHead(ResponseHead {
                call_id: id(*call),
                status: *status,
                end_of_stream: *end,
                ..Default::default()
            }))
        }
        Step::Body { call, len, end } => {
            AgentFrame::of(agent_frame::Kind::ResponseBody(BodyChunk {
                call_id: id(*call),
                data: vec![b'x'; *len].into(),
                end: *end,
            }))
        }
        Step::Error { call, kind } => AgentFrame::of(agent_frame::Kind::CallError(CallError {
            call_id: id(*call),
            kind: *kind,
            message: "fuzz".into(),
        })),
        Step::Pong => AgentFrame::of(agent_frame::Kind::Pong(Pong { seq: 1 })),
        Step::GoingAway => AgentFrame::of(agent_frame::Kind::GoingAway(GoingAway {})),
        Step::Empty => AgentFrame { kind: None },
    }
}

#[test]
fn arbitrary_agent_frame_sequences_give_every_call_one_outcome() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut tokens = TokenStore::single("fuzz-token", "fuzz");
    tokens.add("control-token", "control");
    let cfg = Config {
        heartbeat: Duration::from_secs(30),
        ..Config::default()
    };
    let s = rt.block_on(server(cfg, tokens));
    let agents = rt.block_on(channel(s.agent_addr));
    let dispatcher = rt.block_on(channel(s.forward_addr));
    let control = tokio::sync::Mutex::new(rt.block_on(open(&agents, "control-token")).unwrap());

    let mut runner = TestRunner::new(RunnerConfig {
        cases: 256,
        ..RunnerConfig::default()
    });
    let strategy = proptest::collection::vec(step(), 0..8);
    runner
        .run(&strategy, |steps| {
            rt.block_on(async {
                let mut agent = open(&agents, "fuzz-token").await.expect("open");
                let (_tx, resp) = call(&dispatcher, "fuzz", 10_000).await;
                let head = match agent.next().await {
                    Ok(Some(server_frame::Kind::RequestHead(head))) => head,
                    other => panic!("the call reached the scripted stream, not {other:?}"),
                };
                for st in &steps {
                    if agent.tx.send(frame(st, head.call_id)).await.is_err() {
                        break;
                    }
                }
                // The agent goes away: whatever the frames did, the call must end.
                drop(agent);
                let mut resp = resp;
                let got = tokio::time::timeout(Duration::from_secs(10), async {
                    let first = next_terminal(&mut resp).await;
                    let after = resp.message().await;
                    (first, after)
                })
                .await
                .expect("the call ends within 10 s");
                let (first, after) = got;
                assert!(first.is_some(), "the call got an outcome: {steps:?}");
                assert!(
                    !matches!(after, Ok(Some(_))),
                    "nothing after the outcome: {after:?} for {steps:?}"
                );
                // Another tunnel id's stream serves on.
                let (_tx, resp) = call(&dispatcher, "control", 5_000).await;
                let mut control = control.lock().await;
                control.serve_one(b"ok").await;
                assert_eq!(outcome(resp).await, Outcome::Answer(200, b"ok".to_vec()));
                // The server lets the departed stream go, so the next case's call can only
                // meet that case's stream (not this one, idle again until its end is read).
                let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
                while s.hub().tunnel_ids().iter().any(|t| t == "fuzz") {
                    assert!(
                        tokio::time::Instant::now() < deadline,
                        "the departed stream is let go within 10 s: {steps:?}"
                    );
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
            });
            Ok(())
        })
        .unwrap();
    rt.block_on(s.shutdown());
}

/// Reads up to the call's terminal frame: `Some` for an answer's last frame or an error.
async fn next_terminal(
    resp: &mut tonic::Streaming<ForwardResponse>,
) -> Option<forward_response::Kind> {
    loop {
        match resp.message().await {
            Ok(Some(ForwardResponse { kind: Some(k) })) => match &k {
                forward_response::Kind::Head(h) if h.end_of_stream => return Some(k),
                forward_response::Kind::Body(b) if b.end => return Some(k),
                forward_response::Kind::Error(_) => return Some(k),
                _ => continue,
            },
            _ => return None,
        }
    }
}
