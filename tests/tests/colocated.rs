//! The co-located mode: a tunnel server that also serves the dispatcher's HTTP front
//! (`relay-tunnel-server --front-config`), reaching the streams it holds without gRPC.
//! A caller must not tell it from the three-process path: the same answers (auth, routing,
//! errors, bodies), the same queue handshake and cancellation; only one hop less.

use bytes::Bytes;
use http::Method;
use relay_agent::coverage::plan::CoverageConfig;
use relay_tests::checks;
use relay_tests::client::Caller;
use relay_tests::eventually;
use relay_tests::lb::Policy;
use relay_tests::metrics::value;
use relay_tests::procs::{metric, scrape};
use relay_tests::stack::{Stack, StackBuilder, TUNNEL_ID};
use std::time::Duration;

const READY: Duration = Duration::from_secs(20);

fn fixed_pool(n: u32) -> CoverageConfig {
    CoverageConfig {
        enabled: false,
        fixed_streams: n,
        ..CoverageConfig::default()
    }
}

/// One server; its advertised `forward_url` reaches nothing, so a call the co-located
/// front answers cannot have crossed the network to it.
fn colocated_alone() -> StackBuilder {
    Stack::builder()
        .servers(1)
        .colocated()
        .tunnel_config(|c| c.forward_url = Some("http://127.0.0.1:9".into()))
}

/// Calls counted by server `i` (`relay_tunnel_calls_received_total`).
fn received(stack: &Stack, i: usize) -> f64 {
    let registry = &stack.servers[i].as_ref().expect("server running").registry;
    value(registry, "relay_tunnel_calls_received_total", &[])
}

/// A request (caller key, method, path, body) and the status both fronts must answer.
type Case = (Option<&'static str>, Method, String, &'static [u8], u16);

/// What a caller sees of an answer: status, the JSON `error` code, `retry-after`, body.
type Seen = (u16, String, bool, Bytes);

async fn seen(caller: &Caller, method: Method, path: &str, body: &'static [u8]) -> Seen {
    let a = caller
        .call(caller.request(method, path, Bytes::from_static(body)))
        .await
        .unwrap();
    let code = if a.status == 200 {
        String::new()
    } else {
        a.json()["error"].as_str().unwrap_or_default().to_string()
    };
    let retry_after = a.headers.contains_key("retry-after");
    (a.status.as_u16(), code, retry_after, a.body)
}

/// The same requests to a three-process-shaped stack and to a co-located one get the same
/// answers: passthrough, echo, upstream errors, auth, unknown tunnel, bad paths, body limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_colocated_front_answers_as_the_dispatcher_does() {
    let limit = |c: &mut relay_dispatcher::Config| c.max_request_body_bytes = Some(1000);
    let separate = Stack::builder()
        .servers(1)
        .dispatcher_config(limit)
        .start()
        .await
        .unwrap();
    let colocated = colocated_alone()
        .dispatcher_config(limit)
        .start()
        .await
        .unwrap();
    separate.wait_routable(READY).await.unwrap();
    colocated.wait_routable(READY).await.unwrap();
    let big: &'static [u8] = &[7u8; 4000];
    let good = Some(relay_tests::stack::CALLER_KEY);
    // Request, then the status both must answer (so that two fronts broken alike fail).
    let cases: [Case; 9] = [
        (
            good,
            Method::GET,
            format!("/relay/{TUNNEL_ID}/hello"),
            b"",
            200,
        ),
        (
            good,
            Method::POST,
            format!("/relay/{TUNNEL_ID}/echo"),
            b"a small body",
            200,
        ),
        (
            good,
            Method::GET,
            format!("/relay/{TUNNEL_ID}/status/404"),
            b"",
            404,
        ),
        (
            good,
            Method::GET,
            format!("/relay/{TUNNEL_ID}/status/503"),
            b"",
            503,
        ),
        (
            None,
            Method::GET,
            format!("/relay/{TUNNEL_ID}/hello"),
            b"",
            401,
        ),
        (
            Some("wrong-key"),
            Method::GET,
            format!("/relay/{TUNNEL_ID}/hello"),
            b"",
            401,
        ),
        (
            good,
            Method::GET,
            "/relay/nobody-here/hello".into(),
            b"",
            503,
        ),
        (good, Method::GET, "/not-relay/x".into(), b"", 404),
        (
            good,
            Method::POST,
            format!("/relay/{TUNNEL_ID}/echo"),
            big,
            413,
        ),
    ];
    for (key, method, path, body, status) in cases {
        let want = seen(
            &Caller::new(separate.http, key),
            method.clone(),
            &path,
            body,
        )
        .await;
        let got = seen(
            &Caller::new(colocated.http, key),
            method.clone(),
            &path,
            body,
        )
        .await;
        assert_eq!(got, want, "{method} {path} key {key:?}");
        assert_eq!(got.0, status, "{method} {path} key {key:?}: {got:?}");
    }
    separate.shutdown().await;
    colocated.shutdown().await;
}

/// Bodies cross the in-process hop whole in both directions, streamed: a 1 MiB request
/// and a 64 MiB response, byte for byte, with the server's forward address unreachable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn colocated_calls_skip_the_network_and_stream_large_bodies() {
    let stack = colocated_alone().start().await.unwrap();
    stack.wait_routable(READY).await.unwrap();
    checks::large_bodies_pass_byte_for_byte(&stack).await;
    stack.shutdown().await;
}

/// Calls that wait for a stream go through the queue handshake in process (`Queued`,
/// `StreamReserved`, `Proceed`) and all complete; every call is counted once by the
/// front and once by the server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queued_calls_complete_through_the_in_process_handshake() {
    let stack = colocated_alone()
        .coverage(fixed_pool(2))
        .start()
        .await
        .unwrap();
    stack.wait_routable(READY).await.unwrap();
    let before = received(&stack, 0);
    let caller = stack.caller();
    let calls = (0..30).map(|i| {
        let caller = caller.clone();
        tokio::spawn(async move {
            caller
                .get(&format!("/relay/{TUNNEL_ID}/slow/100?i={i}"))
                .await
        })
    });
    for a in futures::future::join_all(calls).await {
        let a = a.unwrap().unwrap();
        assert_eq!(a.status, 200, "{}", a.text());
    }
    let text = scrape(stack.dispatcher_admin).await.unwrap();
    assert!(
        metric(&text, "relay_dispatcher_queued_total", &[]) > 0.0,
        "no call waited in the queue: the test did not exercise the handshake"
    );
    assert_eq!(received(&stack, 0) - before, 30.0);
    stack.shutdown().await;
}

/// A caller that leaves mid-call, and one whose upload breaks off, each cancel the
/// upstream request through the in-process hop (a cut upload never ends as if whole), and
/// the agent's only stream serves the next call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_leaving_mid_call_or_mid_upload_cancels_through_the_in_process_hop() {
    let stack = colocated_alone()
        .coverage(fixed_pool(1))
        .start()
        .await
        .unwrap();
    stack.wait_routable(READY).await.unwrap();
    checks::a_caller_leaving_cancels_the_upstream(&stack).await;
    checks::a_caller_whose_upload_breaks_off_cancels_the_upstream(&stack).await;
    stack.shutdown().await;
}

/// With a second server reporting to the co-located front and holding streams of the
/// tunnel id too, the front sends the calls to the server in its own process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_front_prefers_its_own_server() {
    let stack = Stack::builder()
        .servers(2)
        .colocated()
        // The load balancer fixture deals the agent's streams to the servers in turn.
        .placement(Policy::RoundRobin)
        .coverage(fixed_pool(4))
        .start()
        .await
        .unwrap();
    stack.wait_routable(READY).await.unwrap();
    eventually("both servers hold streams and report", READY, || async {
        let text = scrape(stack.dispatcher_admin)
            .await
            .map_err(|e| e.to_string())?;
        let servers = metric(&text, "relay_dispatcher_tunnel_servers", &[]);
        let streams: Vec<f64> = (0..2)
            .map(|i| {
                let reg = &stack.servers[i].as_ref().unwrap().registry;
                value(reg, "relay_tunnel_streams", &[])
            })
            .collect();
        if servers >= 2.0 && streams.iter().all(|s| *s > 0.0) {
            Ok(())
        } else {
            Err(format!("servers known {servers}, streams {streams:?}"))
        }
    })
    .await;
    let (local0, other0) = (received(&stack, 0), received(&stack, 1));
    let caller = stack.caller();
    for i in 0..50 {
        let a = caller
            .get(&format!("/relay/{TUNNEL_ID}/hello?i={i}"))
            .await
            .unwrap();
        assert_eq!(a.status, 200, "{}", a.text());
    }
    assert_eq!(received(&stack, 0) - local0, 50.0, "calls left the process");
    assert_eq!(received(&stack, 1) - other0, 0.0);
    stack.shutdown().await;
}

/// Stopping the co-located server drains its front first: calls in flight finish with
/// their answers, then the front stops taking calls.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stopping_the_colocated_server_lets_calls_in_flight_finish() {
    let mut stack = colocated_alone()
        .tunnel_config(|c| c.shutdown_grace = Duration::from_secs(2))
        .start()
        .await
        .unwrap();
    stack.wait_routable(READY).await.unwrap();
    let caller = stack.caller();
    let calls: Vec<_> = (0..5)
        .map(|i| {
            let caller = caller.clone();
            tokio::spawn(async move {
                caller
                    .get(&format!("/relay/{TUNNEL_ID}/slow/500?i={i}"))
                    .await
            })
        })
        .collect();
    eventually("the calls reached the upstream", READY, || async {
        stack.upstream.in_flight() == 5
    })
    .await;
    let server = stack.take_server(0).expect("the co-located server");
    let stopping = tokio::spawn(server.shutdown());
    for call in calls {
        let a = call.await.unwrap().unwrap();
        assert_eq!(a.status, 200, "{}", a.text());
    }
    stopping.await.unwrap();
    let after = caller.get(&format!("/relay/{TUNNEL_ID}/hello")).await;
    assert!(
        after.is_err(),
        "the front still answers: {:?}",
        after.map(|a| a.status)
    );
    stack.shutdown().await;
}
