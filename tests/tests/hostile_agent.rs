//! A hostile agent (any token holder) against the tunnel server and the dispatcher, end to
//! end: over-count and oversized response heads, response bodies that stall or trickle,
//! redirects into another tenant's tunnel, and error messages carrying control characters.
//! Each hostile input is a row of a table; for each the caller gets one clear answer, no
//! process panics, and the relay keeps serving.
//!
//! Also the per (caller key, tunnel id) concurrency limit, which keeps one tenant from
//! taking every slot of a key that several tenants share.

use bytes::Bytes;
use http::Method;
use relay_dispatcher::CallerConfig;
use relay_proto::agent_frame::Kind as Out;
use relay_proto::{BodyChunk, CallError, CallErrorKind, ResponseHead};
use relay_tests::client::Caller;
use relay_tests::hostile::{answered, call_via, stream_answer, HostileAgent};
use relay_tests::procs::{metric, scrape};
use relay_tests::stack::{agent_identity, Stack, CALLER_KEY, TOKEN, TUNNEL_ID};
use std::sync::{Arc, Mutex};
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(20);

/// A stack of one tunnel server and no agent of its own: the test's hostile agent is the
/// only one.
async fn one_server_without_agent() -> Stack {
    Stack::builder()
        .servers(1)
        .without_agent()
        .start()
        .await
        .unwrap()
}

/// The tunnel server's `relay_tunnel_calls_total` of `outcome`.
async fn tunnel_calls(stack: &Stack, outcome: &str) -> f64 {
    let server = stack.servers[0].as_ref().expect("server 0 runs");
    let text = scrape(server.admin_addr).await.unwrap();
    metric(&text, "relay_tunnel_calls_total", &[("outcome", outcome)])
}

fn agent_url(stack: &Stack) -> String {
    let server = stack.servers[0].as_ref().expect("server 0 runs");
    format!("http://{}", server.agent_addr)
}

fn head(call_id: u64, status: u32, headers: Vec<Bytes>, end: bool) -> Out {
    Out::ResponseHead(ResponseHead {
        call_id,
        status,
        headers,
        end_of_stream: end,
        body: Default::default(),
    })
}

/// A call through `agent` answered with a well-formed head: the caller gets its 204.
async fn serves_a_well_formed_answer(caller: &Caller, agent: &mut HostileAgent) {
    let (answer, req) = call_via(caller, agent, Method::GET, "/relay/demo/x", None).await;
    agent
        .send(head(
            req.call_id,
            204,
            vec![relay_proto::header("x-ok", "1")],
            true,
        ))
        .await
        .unwrap();
    assert_eq!(answered(answer).await.status, 204);
}

/// Hostile response heads: (what, headers). Each is over the default
/// `max_response_headers` (256) or `max_response_header_bytes` (64 KiB), and under the
/// default `max_frame_bytes` (1 MiB) so that it reaches the head checks.
fn hostile_heads() -> Vec<(&'static str, Vec<Bytes>)> {
    vec![
        // `HeaderMap::with_capacity(24577)` panics: the count once sized an allocation.
        (
            "24577 empty headers",
            vec![relay_proto::header("", ""); 24_577],
        ),
        (
            "40000 valid headers",
            vec![relay_proto::header("x-a", "1"); 40_000],
        ),
        (
            "257 small headers",
            vec![relay_proto::header("x-a", "1"); 257],
        ),
        (
            "one 900 KiB header",
            vec![relay_proto::header("x-big", vec![b'a'; 900 * 1024])],
        ),
        (
            "200 headers of 400 bytes",
            vec![relay_proto::header("x-b", vec![b'b'; 400]); 200],
        ),
    ]
}

/// Every hostile head is refused at the tunnel server: the caller gets one 502
/// `bad_response` naming the limit, the agent's stream ends with RESOURCE_EXHAUSTED, and
/// the tunnel server counts one `bad_response` per call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_response_heads_are_refused_at_the_tunnel_server_with_one_502() {
    let stack = one_server_without_agent().await;
    let caller = stack.caller();
    let cases = hostile_heads();
    for (what, headers) in &cases {
        let mut agent = HostileAgent::open(&agent_url(&stack), TOKEN).await.unwrap();
        let (answer, req) = call_via(&caller, &mut agent, Method::GET, "/relay/demo/x", None).await;
        agent
            .send(head(req.call_id, 200, headers.clone(), true))
            .await
            .unwrap();
        let a = answered(answer).await;
        assert_eq!(a.status, 502, "{what}: {}", a.text());
        assert_eq!(a.json()["error"], "bad_response", "{what}: {}", a.text());
        let message = a.json()["message"].as_str().unwrap_or_default().to_string();
        assert!(message.contains("max_response_header"), "{what}: {message}");
        let end = agent.ended(WAIT).await.unwrap();
        let status = end.expect_err("the stream ends with an error status");
        assert_eq!(
            status.code(),
            tonic::Code::ResourceExhausted,
            "{what}: {status}"
        );
    }
    assert_eq!(
        tunnel_calls(&stack, "bad_response").await,
        cases.len() as f64,
        "one outcome per call"
    );
    assert_eq!(tunnel_calls(&stack, "stream_lost").await, 0.0);
    stack.shutdown().await;
}

/// A 1 MiB frame of empty header records (2 bytes each on the wire, 32 bytes each once
/// decoded) is refused by the tunnel server's codec, which counts the records before it
/// decodes any: the caller gets one 502 `bad_response` naming the protocol's bound, the
/// agent's stream ends with RESOURCE_EXHAUSTED, and the next stream serves. (The bound on
/// what decoding such a frame allocates is measured in `proto/tests/decode_allocation.rs`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_one_mib_head_of_empty_records_is_refused_before_it_is_decoded() {
    let stack = one_server_without_agent().await;
    let caller = stack.caller();
    let mut agent = HostileAgent::open(&agent_url(&stack), TOKEN).await.unwrap();
    let (answer, req) = call_via(&caller, &mut agent, Method::GET, "/relay/demo/x", None).await;
    // 2 bytes a record plus a dozen of head and frame: within the default max_frame_bytes
    // (1 MiB), so the frame reaches the codec's count.
    let records = (1024 * 1024 - 64) / 2;
    let frame = head(req.call_id, 200, vec![Bytes::new(); records], true);
    agent.send(frame).await.unwrap();
    let a = answered(answer).await;
    assert_eq!(a.status, 502, "{}", a.text());
    assert_eq!(a.json()["error"], "bad_response", "{}", a.text());
    let message = a.json()["message"].as_str().unwrap_or_default().to_string();
    assert!(
        message.contains("more than 16384 header records in a response head"),
        "{message}"
    );
    let status = agent
        .ended(WAIT)
        .await
        .unwrap()
        .expect_err("the stream ends with an error status");
    assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status}");
    let mut agent = HostileAgent::open(&agent_url(&stack), TOKEN).await.unwrap();
    serves_a_well_formed_answer(&caller, &mut agent).await;
    assert_eq!(tunnel_calls(&stack, "bad_response").await, 1.0);
    stack.shutdown().await;
}

/// A response head holding a header record that is not an encoded `Header` is refused at
/// the tunnel server, which reads each record's lengths for its limits: the caller gets one
/// 502 `bad_response` naming the malformed header, the agent's stream ends with
/// INVALID_ARGUMENT, and the next stream serves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_header_record_is_refused_at_the_tunnel_server_with_one_502() {
    let stack = one_server_without_agent().await;
    let caller = stack.caller();
    let mut agent = HostileAgent::open(&agent_url(&stack), TOKEN).await.unwrap();
    let (answer, req) = call_via(&caller, &mut agent, Method::GET, "/relay/demo/x", None).await;
    // The second record's name claims 9 bytes and has 1.
    let headers = vec![
        relay_proto::header("x-ok", "1"),
        Bytes::from_static(&[0x0a, 9, b'x']),
    ];
    agent
        .send(head(req.call_id, 200, headers, true))
        .await
        .unwrap();
    let a = answered(answer).await;
    assert_eq!(a.status, 502, "{}", a.text());
    assert_eq!(a.json()["error"], "bad_response", "{}", a.text());
    let message = a.json()["message"].as_str().unwrap_or_default().to_string();
    assert!(message.contains("malformed header (entry 1"), "{message}");
    let status = agent
        .ended(WAIT)
        .await
        .unwrap()
        .expect_err("the stream ends with an error status");
    assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status}");
    let mut agent = HostileAgent::open(&agent_url(&stack), TOKEN).await.unwrap();
    serves_a_well_formed_answer(&caller, &mut agent).await;
    assert_eq!(tunnel_calls(&stack, "bad_response").await, 1.0);
    stack.shutdown().await;
}

/// A tunnel server that passes hostile heads on (here: one configured with the largest
/// limits) still cannot hurt the dispatcher: the caller gets one 502 `bad_response`. (Heads
/// of more than `MAX_HEAD_RECORDS` records never get past the tunnel server's codec.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dispatcher_refuses_oversized_response_heads_a_tunnel_server_passes_on() {
    let stack = Stack::builder()
        .servers(1)
        .without_agent()
        .tunnel_config(|c| {
            c.max_response_headers = relay_proto::MAX_HEAD_RECORDS;
            c.max_response_header_bytes = 16 * 1024 * 1024;
        })
        .start()
        .await
        .unwrap();
    let caller = stack.caller();
    let mut agent = HostileAgent::open(&agent_url(&stack), TOKEN).await.unwrap();
    let cases: Vec<_> = hostile_heads()
        .into_iter()
        .filter(|(_, headers)| headers.len() <= relay_proto::MAX_HEAD_RECORDS)
        .collect();
    assert!(cases.len() >= 3);
    for (what, headers) in &cases {
        let (answer, req) = call_via(&caller, &mut agent, Method::GET, "/relay/demo/x", None).await;
        agent
            .send(head(req.call_id, 200, headers.clone(), true))
            .await
            .unwrap();
        let a = answered(answer).await;
        assert_eq!(a.status, 502, "{what}: {}", a.text());
        assert_eq!(a.json()["error"], "bad_response", "{what}: {}", a.text());
        assert!(
            a.text().contains("max_response_header"),
            "{what}: {}",
            a.text()
        );
    }
    // The same stream serves a well-formed answer next.
    serves_a_well_formed_answer(&caller, &mut agent).await;
    let text = scrape(stack.dispatcher_admin).await.unwrap();
    assert_eq!(
        metric(
            &text,
            "relay_dispatcher_calls_total",
            &[("outcome", "bad_response")]
        ),
        cases.len() as f64
    );
    drop(agent);
    stack.shutdown().await;
}

/// A response whose head went out is bounded in time: a body that stalls is cut after
/// `body_idle_timeout`, one that trickles a byte now and then is cut at the call's
/// deadline; each cut counts as its own outcome and gives the caller's slot back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_and_trickled_response_bodies_are_cut_and_free_the_callers_slot() {
    let stack = Stack::builder()
        .servers(1)
        .without_agent()
        .dispatcher_config(|c| {
            c.body_idle_timeout = Duration::from_millis(600);
            c.callers = vec![CallerConfig {
                max_concurrent_calls: 1,
                ..CallerConfig::allow_all("one", CALLER_KEY)
            }];
        })
        .start()
        .await
        .unwrap();
    let caller = stack.caller();
    let mut agent = HostileAgent::open(&agent_url(&stack), TOKEN).await.unwrap();
    // (what, deadline asked for, seconds between body bytes (None: one byte, then
    // silence), outcome counted)
    let cases: [(&str, u64, Option<u64>, &str); 2] = [
        ("stall after one byte", 60_000, None, "body_idle_timeout"),
        ("a byte every 200 ms", 2_000, Some(200), "deadline_exceeded"),
    ];
    for (what, timeout_ms, every, _) in cases {
        let out = agent.sender();
        let (status, body, took) = stream_answer(
            &caller,
            &mut agent,
            "/relay/demo/x",
            timeout_ms,
            |call_id| {
                tokio::spawn(async move {
                    let _ = out.send(head(call_id, 200, vec![], false)).await;
                    loop {
                        let byte = Out::ResponseBody(BodyChunk {
                            call_id,
                            data: bytes::Bytes::from_static(b"x"),
                            end: false,
                        });
                        if out.send(byte).await.is_err() {
                            return;
                        }
                        match every {
                            Some(ms) => tokio::time::sleep(Duration::from_millis(ms)).await,
                            None => return,
                        }
                    }
                })
            },
        )
        .await;
        assert_eq!(status, 200, "{what}");
        assert!(
            body.is_err(),
            "{what}: the body must end with an error, got {body:?}"
        );
        assert!(took < Duration::from_secs(10), "{what}: cut after {took:?}");
        // The slot is free again: the next call of this one-call key reaches the agent.
        let (answer, req) =
            call_via(&caller, &mut agent, Method::GET, "/relay/demo/next", None).await;
        agent
            .send(head(req.call_id, 204, vec![], true))
            .await
            .unwrap();
        assert_eq!(answered(answer).await.status, 204, "{what}");
    }
    let text = scrape(stack.dispatcher_admin).await.unwrap();
    for (what, _, _, outcome) in cases {
        assert_eq!(
            metric(
                &text,
                "relay_dispatcher_calls_total",
                &[("outcome", outcome)]
            ),
            1.0,
            "{what}"
        );
    }
    drop(agent);
    stack.shutdown().await;
}

/// Hostile `Location` values for a call to `/relay/demo/app/page` and whether the front
/// refuses the answer (a backend following it would resend its key and body into another
/// tenant's tunnel). The full table of spellings is in the dispatcher's `headers` tests.
const LOCATIONS: &[(&str, bool)] = &[
    ("/relay/other/x", true),
    ("http://{front}/relay/other/x", true),
    ("../../other/x", true),
    ("/relay/demo/%2e%2e/other/", true),
    ("/relay/demo/next", false),
    ("https://elsewhere.example/relay/other/x", false),
    // The front's address in the spellings a WHATWG URL parser reads as it.
    ("http://2130706433:{port}/relay/other/x", true),
    ("http://[::ffff:127.0.0.1]:{port}/relay/other/x", true),
    ("http://0x7f.1:{port}/relay/other/x", true),
    ("http://%31%32%37.0.0.1:{port}/relay/other/x", true),
    ("http://127.0.0.2:{port}/relay/other/x", false),
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redirects_into_another_tunnel_id_on_the_front_are_refused() {
    let stack = one_server_without_agent().await;
    let caller = stack.caller();
    let mut agent = HostileAgent::open(&agent_url(&stack), TOKEN).await.unwrap();
    for (location, refused) in LOCATIONS {
        let location = location
            .replace("{front}", &stack.http.to_string())
            .replace("{port}", &stack.http.port().to_string());
        let (answer, req) = call_via(
            &caller,
            &mut agent,
            Method::GET,
            "/relay/demo/app/page",
            None,
        )
        .await;
        let headers = vec![relay_proto::header("location", location.clone())];
        agent
            .send(head(req.call_id, 302, headers, true))
            .await
            .unwrap();
        let a = answered(answer).await;
        if *refused {
            assert_eq!(a.status, 502, "{location}: {}", a.text());
            assert_eq!(a.json()["error"], "bad_response", "{location}");
            assert!(
                a.text().contains("\\\"other\\\""),
                "{location}: {}",
                a.text()
            );
            assert!(a.headers.get("location").is_none());
        } else {
            assert_eq!(a.status, 302, "{location}: {}", a.text());
            assert_eq!(a.headers["location"], location.as_str());
        }
    }
    drop(agent);
    stack.shutdown().await;
}

/// The spellings the WHATWG URL parser (reqwest, browsers, Node's fetch) reads as the
/// front's own host, with curl as the backend: the front is `relay.example` (curl resolves
/// it to 127.0.0.1), and the upstream redirects into tunnel id `other` by another spelling
/// of that name or address. Each answer is one 502 `bad_response`, never the redirect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redirects_spelling_the_fronts_host_differently_are_refused_to_curl() {
    let stack = one_server_without_agent().await;
    let caller = stack.caller();
    let mut agent = HostileAgent::open(&agent_url(&stack), TOKEN).await.unwrap();
    // Routable before curl calls (curl sends once).
    serves_a_well_formed_answer(&caller, &mut agent).await;
    let port = stack.http.port();
    let cases = [
        (
            "relay.example",
            "http://%72elay.example:{port}/relay/other/x",
        ),
        (
            "relay.example",
            "http://RELAY.example.:{port}/relay/other/x",
        ),
        ("127.0.0.1", "http://2130706433:{port}/relay/other/x"),
        (
            "127.0.0.1",
            "http://[::ffff:127.0.0.1]:{port}/relay/other/x",
        ),
        ("127.0.0.1", "http://0177.0.0.1:{port}/relay/other/x"),
    ];
    for (host, location) in cases {
        let location = location.replace("{port}", &port.to_string());
        let url = format!("http://{host}:{port}/relay/demo/app/page");
        let resolve = format!("relay.example:{port}:127.0.0.1");
        let auth = format!("Authorization: Bearer {CALLER_KEY}");
        let args = ["--resolve", &resolve, "-H", &auth, &url];
        let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        let answer = tokio::spawn(async move {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            relay_tests::client::curl(&args).await
        });
        let req = agent
            .next_call(WAIT)
            .await
            .expect("curl's call reaches the agent");
        let headers = vec![relay_proto::header("location", location.clone())];
        agent
            .send(head(req.call_id, 302, headers, true))
            .await
            .unwrap();
        let a = answered(answer).await;
        assert_eq!(a.status, 502, "{location}: {}", a.text());
        assert_eq!(a.json()["error"], "bad_response", "{location}");
        assert!(
            a.text().contains("\\\"other\\\""),
            "{location}: {}",
            a.text()
        );
        assert!(a.headers.get("location").is_none(), "{location}");
    }
    drop(agent);
    stack.shutdown().await;
}

/// A log sink for the test's own thread (the stack runs on it: a current-thread runtime).
#[derive(Clone, Default)]
struct Logs(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Logs {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Logs {
    type Writer = Logs;
    fn make_writer(&'a self) -> Logs {
        self.clone()
    }
}

/// Agent-supplied error messages: (what, message). Each reaches the caller's JSON and the
/// dispatcher's log with its control characters escaped and its length capped.
fn hostile_messages() -> Vec<(&'static str, String)> {
    vec![
        ("newline", "upstream down\nlevel=ERROR forged line".into()),
        ("ansi", "\x1b[31mred\x1b[0m \x1b]0;title\x07".into()),
        ("carriage return and nul", "a\rb\0c".into()),
        ("long", "x".repeat(100_000)),
    ]
}

#[tokio::test]
async fn agent_error_messages_are_escaped_and_capped_in_logs_and_answers() {
    let logs = Logs::default();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(logs.clone())
        .with_ansi(false)
        .with_max_level(tracing::Level::INFO)
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);
    // tracing caches each log line's interest once for the whole process; while one
    // dispatcher exists it asks the default of whichever thread reaches the line first,
    // and a sibling test's thread has none, so the line would be off for this test too. A
    // second live dispatcher makes that cache the union of both, and each line then goes to
    // its own thread's default.
    let _anchor = tracing::Dispatch::new(
        tracing_subscriber::fmt()
            .with_writer(std::io::sink)
            .with_max_level(tracing::Level::INFO)
            .finish(),
    );
    tracing::callsite::rebuild_interest_cache();
    let stack = one_server_without_agent().await;
    let caller = stack.caller();
    let mut agent = HostileAgent::open(&agent_url(&stack), TOKEN).await.unwrap();
    for (what, message) in hostile_messages() {
        let (answer, req) = call_via(&caller, &mut agent, Method::GET, "/relay/demo/x", None).await;
        agent
            .send(Out::CallError(CallError {
                call_id: req.call_id,
                kind: CallErrorKind::UpstreamUnreachable as i32,
                message: message.clone(),
            }))
            .await
            .unwrap();
        let a = answered(answer).await;
        assert_eq!(a.status, 502, "{what}");
        let got = a.json()["message"].as_str().unwrap_or_default().to_string();
        assert!(
            !got.chars().any(|c| c.is_control()),
            "{what}: control characters reach the caller: {got:?}"
        );
        assert!(got.chars().count() <= 600, "{what}: {} chars", got.len());
    }
    let text = String::from_utf8_lossy(&logs.0.lock().unwrap()).into_owned();
    let failed: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("call failed") && l.contains("upstream_unreachable"))
        .collect();
    assert_eq!(failed.len(), 4, "one log line per call:\n{text}");
    assert!(
        failed[0].contains("upstream down\\nlevel=ERROR forged line"),
        "{}",
        failed[0]
    );
    assert!(failed[1].contains("\\u{1b}[31mred"), "{}", failed[1]);
    assert!(!text.contains('\x1b') && !text.contains('\0') && !text.contains('\r'));
    assert!(
        !text.lines().any(|l| l.starts_with("level=ERROR")),
        "a forged log line:\n{text}"
    );
    assert!(
        failed[3].len() < 2_000,
        "the long message is capped in the log"
    );
    drop(agent);
    stack.shutdown().await;
}

/// One tenant's slow calls take at most `max_concurrent_calls_per_tunnel` of a shared
/// key's slots: its next call gets 429 naming the limit while another tenant behind the
/// same key is still served, and the slots come back when the calls end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_tenant_cannot_take_every_slot_of_a_shared_key() {
    let stack = Stack::builder()
        .servers(1)
        .agents(2)
        .dispatcher_config(|c| {
            c.callers = vec![CallerConfig {
                max_concurrent_calls: 4,
                max_concurrent_calls_per_tunnel: Some(2),
                ..CallerConfig::allow_all("shared", CALLER_KEY)
            }];
        })
        .start()
        .await
        .unwrap();
    stack.wait_routable(WAIT).await.unwrap();
    let other = agent_identity(1).1;
    let caller = stack.caller();
    relay_tests::eventually("the second tenant is routable", WAIT, || {
        let (c, other) = (caller.clone(), other.clone());
        async move {
            c.get(&format!("/relay/{other}/hello"))
                .await
                .is_ok_and(|a| a.status == 200)
        }
    })
    .await;
    let slow: Vec<_> = (0..2)
        .map(|_| {
            let c = caller.clone();
            tokio::spawn(async move { c.get(&format!("/relay/{TUNNEL_ID}/slow/3000")).await })
        })
        .collect();
    let text = || async { scrape(stack.dispatcher_admin).await.unwrap() };
    relay_tests::eventually("two slow calls in flight", WAIT, || async {
        metric(&text().await, "relay_dispatcher_calls_in_flight", &[]) == 2.0
    })
    .await;
    let refused = caller
        .get(&format!("/relay/{TUNNEL_ID}/hello"))
        .await
        .unwrap();
    assert_eq!(refused.status, 429, "{}", refused.text());
    assert_eq!(refused.json()["error"], "too_many_calls");
    assert!(
        refused.text().contains("max_concurrent_calls_per_tunnel"),
        "{}",
        refused.text()
    );
    assert!(refused.headers.contains_key("retry-after"));
    let served = caller.get(&format!("/relay/{other}/hello")).await.unwrap();
    assert_eq!(
        served.status,
        200,
        "the other tenant is served: {}",
        served.text()
    );
    for s in slow {
        assert_eq!(s.await.unwrap().unwrap().status, 200);
    }
    let again = caller
        .get(&format!("/relay/{TUNNEL_ID}/hello"))
        .await
        .unwrap();
    assert_eq!(again.status, 200, "the slots came back: {}", again.text());
    stack.shutdown().await;
}
