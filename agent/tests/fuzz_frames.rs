//! Fuzzing the agent's frame handling over real sockets: arbitrary sequences of server
//! frames (heads with hostile targets and headers, stray or oversized body chunks, cancels
//! for any call, second hellos, empty frames, drains) are sent on a tunnel stream. Bounded:
//! a committed corpus of tricky sequences plus 64 generated ones from a fixed seed.
//!
//! For every sequence: no panic anywhere in the agent, every CallError carries a message,
//! and the stream either answers a final ping or is closed cleanly (never hangs). After the
//! run, a fresh stream still serves a good call.

mod common;

use common::*;
use proptest::prelude::*;
use proptest::strategy::ValueTree;
use proptest::test_runner::{Config as RunnerConfig, TestRunner};
use relay_proto::{Pressure, ServerHello};
use std::sync::atomic::AtomicUsize;

static PANICS: AtomicUsize = AtomicUsize::new(0);

fn count_panics() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        PANICS.fetch_add(1, Ordering::SeqCst);
        default(info);
    }));
}

fn target() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("/x".to_string()),
        Just("/hang".to_string()),
        Just("http://evil.example/".to_string()),
        Just("//evil.example".to_string()),
        Just("/a/../b".to_string()),
        Just("*".to_string()),
        Just(String::new()),
        "/[ -~]{0,20}",
        "\\PC{0,10}",
    ]
}

fn header() -> impl Strategy<Value = bytes::Bytes> {
    let name = prop_oneof![
        Just("content-length".to_string()),
        Just("transfer-encoding".to_string()),
        Just("host".to_string()),
        Just("connection".to_string()),
        "[a-z:\r\n -]{0,10}",
    ];
    let value = prop_oneof![
        Just(b"3".to_vec()),
        Just(b"chunked".to_vec()),
        prop::collection::vec(any::<u8>(), 0..10),
    ];
    prop_oneof![
        9 => (name, value).prop_map(|(name, value)| relay_proto::header(name, value)),
        // Now and then a record that may not be a `Header` at all.
        1 => prop::collection::vec(any::<u8>(), 0..8).prop_map(bytes::Bytes::from),
    ]
}

fn frame() -> impl Strategy<Value = ServerFrame> {
    let call_id = 0u64..4;
    let head = (
        call_id.clone(),
        prop_oneof![
            Just("GET".to_string()),
            Just("POST".to_string()),
            "[ -~\r\n]{0,6}"
        ],
        target(),
        prop::collection::vec(header(), 0..4),
        prop_oneof![Just(0u32), 1u32..2000, Just(u32::MAX)],
        any::<bool>(),
        // A body inside the head: none, or a few bytes (with or without end_of_stream).
        prop_oneof![Just(Vec::new()), prop::collection::vec(any::<u8>(), 1..64)],
        // A trace context: none, or any ids and flags (zero ids included).
        proptest::option::of((any::<u64>(), any::<u64>(), any::<u64>(), any::<u32>())),
    )
        .prop_map(
            |(
                call_id,
                method,
                path_and_query,
                headers,
                deadline_ms,
                end_of_stream,
                body,
                trace,
            )| {
                ServerFrame::of(In::RequestHead(RequestHead {
                    call_id,
                    method,
                    path_and_query,
                    headers,
                    deadline_ms,
                    end_of_stream,
                    body: body.into(),
                    trace: trace.map(|(trace_id_high, trace_id_low, parent_id, flags)| {
                        relay_proto::TraceParent {
                            trace_id_high,
                            trace_id_low,
                            parent_id,
                            flags,
                        }
                    }),
                }))
            },
        );
    let body = (
        call_id.clone(),
        prop::collection::vec(any::<u8>(), 0..200),
        any::<bool>(),
    )
        .prop_map(|(call_id, data, end)| {
            ServerFrame::of(In::RequestBody(BodyChunk {
                call_id,
                data: data.into(),
                end,
            }))
        });
    prop_oneof![
        6 => head,
        6 => body,
        2 => call_id.prop_map(|call_id| ServerFrame::of(In::Cancel(Cancel { call_id }))),
        2 => any::<u64>().prop_map(|seq| ServerFrame::of(In::Ping(Ping { seq: seq >> 1 }))),
        1 => any::<u32>().prop_map(|queued| ServerFrame::of(In::Pressure(Pressure { queued }))),
        1 => Just(ServerFrame::of(In::Drain(Drain { grace_ms: 10 }))),
        1 => Just(ServerFrame::of(In::Hello(ServerHello::default()))),
        1 => Just(ServerFrame { kind: None }),
    ]
}

fn h(call_id: u64, method: &str, target: &str, eos: bool, headers: &[(&str, &str)]) -> ServerFrame {
    let mut x = head(call_id, method, target, eos);
    x.headers = headers
        .iter()
        .map(|(n, v)| relay_proto::header(*n, v))
        .collect();
    ServerFrame::of(In::RequestHead(x))
}

fn b(call_id: u64, data: &[u8], end: bool) -> ServerFrame {
    ServerFrame::of(In::RequestBody(BodyChunk {
        call_id,
        data: data.to_vec().into(),
        end,
    }))
}

/// The committed corpus: sequences that once were, or could be, trouble.
fn corpus() -> Vec<Vec<ServerFrame>> {
    let cancel = |call_id| ServerFrame::of(In::Cancel(Cancel { call_id }));
    vec![
        // Smuggling with a body following, then a body for the refused call.
        vec![
            h(
                1,
                "POST",
                "/x",
                false,
                &[("content-length", "3"), ("transfer-encoding", "chunked")],
            ),
            b(1, b"abc", true),
            h(2, "GET", "/x", true, &[]),
        ],
        // A refused call whose body keeps coming, then a stray chunk of an old call.
        vec![
            h(1, "POST", "http://evil/", false, &[]),
            b(1, b"a", false),
            b(1, b"b", true),
            b(1, b"c", true),
        ],
        // Cancel before, during and after a call.
        vec![
            cancel(1),
            h(1, "GET", "/hang", true, &[]),
            cancel(1),
            cancel(1),
            h(2, "GET", "/x", true, &[]),
        ],
        // A body larger than the declared length.
        vec![
            h(1, "POST", "/x", false, &[("content-length", "1")]),
            b(1, &[b'z'; 5000], true),
        ],
        // A body shorter than the declared length, then the next head.
        vec![
            h(1, "POST", "/x", false, &[("content-length", "100")]),
            b(1, b"ab", true),
            h(2, "GET", "/x", true, &[]),
        ],
        // Zero-length and empty-end chunks.
        vec![
            h(1, "POST", "/x", false, &[]),
            b(1, b"", false),
            b(1, b"", true),
        ],
        // A second head while a call is in flight (malformed: closes the stream).
        vec![
            h(1, "POST", "/hang", false, &[]),
            h(2, "GET", "/x", true, &[]),
        ],
        // Drain mid-call, then a head that crossed it.
        vec![
            h(1, "GET", "/x", true, &[]),
            ServerFrame::of(In::Drain(Drain { grace_ms: 0 })),
            h(2, "GET", "/x", true, &[]),
        ],
        // Hostile strings everywhere.
        vec![
            h(0, "GET\r\n", "/\0", true, &[("\r\n", "\0")]),
            h(0, "", "", true, &[]),
        ],
    ]
}

/// Sends `frames`, then a final ping; reads until its pong or the end of the stream.
async fn exercise(conn: &mut Conn, frames: Vec<ServerFrame>) {
    const FINAL: u64 = u64::MAX;
    for f in frames {
        if conn.tx.send(Ok(f)).await.is_err() {
            break;
        }
    }
    let _ = conn
        .tx
        .send(Ok(ServerFrame::of(In::Ping(Ping { seq: FINAL }))))
        .await;
    loop {
        match conn.next().await {
            None => return,
            Some(Out::Pong(p)) if p.seq == FINAL => return,
            Some(Out::CallError(e)) => assert!(!e.message.is_empty(), "{e:?}"),
            Some(_) => {}
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn arbitrary_frame_sequences_never_panic_or_hang_the_agent() {
    count_panics();
    let mut tunnel = FakeTunnel::start(10_000, true).await;
    let upstream = raw_upstream().await;
    let mut cfg = config(&tunnel.url, &upstream.url, 1);
    cfg.limits.max_body_bytes = Some(4096);
    cfg.coverage.tick = Duration::from_millis(20);
    let (_agent, _) = start_agent(cfg).await;

    let mut cases = corpus();
    let mut runner = TestRunner::new_with_rng(
        RunnerConfig::default(),
        proptest::test_runner::TestRng::deterministic_rng(RunnerConfig::default().rng_algorithm),
    );
    let strategy = prop::collection::vec(frame(), 0..12);
    for _ in 0..64 {
        cases.push(strategy.new_tree(&mut runner).expect("generate").current());
    }
    for frames in cases {
        let mut conn = tunnel.next_conn().await;
        exercise(&mut conn, frames).await;
        // Ending the stream drops any call left on it; the agent opens a replacement.
        drop(conn);
    }
    assert_eq!(PANICS.load(Ordering::SeqCst), 0, "the agent panicked");

    let mut conn = tunnel.next_conn().await;
    let a = conn.call(head(1, "GET", "/x", true), vec![]).await;
    assert_eq!(a.status(), 200, "{a:?}");
}
