//! Trace context across the hops, on the real binaries (`relay-dispatcher`,
//! `relay-tunnel-server`, `relay-agent`, each with its generated config, on loopback):
//!
//! - a call with a W3C `traceparent`: its trace id is on the dispatcher's, the tunnel
//!   server's and the agent's log lines for the call, and the upstream receives the same
//!   trace id (with the agent's span as the parent) and the caller's `tracestate`;
//! - a call without one, or with a malformed one: the dispatcher starts a trace, and the
//!   same holds for the started trace;
//! - with OTLP export on (the standard `OTEL_EXPORTER_OTLP_ENDPOINT`), a collector this
//!   test runs receives one span per hop, each parented by the hop before: the
//!   dispatcher's by the caller's span, the tunnel server's by the dispatcher's, the
//!   agent's by the tunnel server's, and the upstream's `traceparent` names the agent's;
//! - an OTLP endpoint that is not a URL stops a binary at start with a message naming the
//!   variable.

use bytes::Bytes;
use http::{HeaderValue, Method};
use relay_tests::client::{Answer, Caller};
use relay_tests::eventually;
use relay_tests::otlp::{Collector, ReceivedSpan};
use relay_tests::procs::{
    binary, AgentOpts, AgentProc, DispatcherOpts, DispatcherProc, Proc, ScratchDir, Spawn,
    TunnelServerOpts, TunnelServerProc,
};
use relay_tests::stack::{CALLER_KEY, TOKEN, TUNNEL_ID};
use relay_tests::upstream::{Upstream, UpstreamHandle};
use std::time::Duration;

const READY: Duration = Duration::from_secs(20);
/// The caller's span in the examples: the dispatcher's span must name it as its parent.
const CALLER_SPAN: &str = "00f067aa0ba902b7";
const TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";

struct Trio {
    _dir: ScratchDir,
    _upstream: UpstreamHandle,
    dispatcher: DispatcherProc,
    server: TunnelServerProc,
    agent: AgentProc,
}

impl Trio {
    /// The three binaries with the call's log lines on (debug for relay's own crates) and
    /// `env` on top.
    async fn start(tag: &str, env: &[(&str, String)]) -> Trio {
        let dir = ScratchDir::new(tag).unwrap();
        let upstream = Upstream::builder().spawn().await.unwrap();
        let mut vars = vec![(
            "RELAY_LOG".to_string(),
            "info,relay_dispatcher=debug,relay_tunnel_server=debug,relay_agent=debug".to_string(),
        )];
        vars.extend(env.iter().map(|(k, v)| (k.to_string(), v.clone())));
        let how = Spawn {
            env: vars,
            ..Spawn::default()
        };
        let dispatcher = DispatcherProc::start_with(dir.path(), DispatcherOpts::default(), &how)
            .await
            .unwrap();
        let server = TunnelServerProc::start_on_with(
            dir.path(),
            TunnelServerOpts {
                dispatchers: vec![dispatcher.registry_url()],
                ..TunnelServerOpts::default()
            },
            None,
            &how,
        )
        .await
        .unwrap();
        let agent = AgentProc::start_with(
            dir.path(),
            AgentOpts {
                tunnels: vec![server.agent_url()],
                token: TOKEN.into(),
                upstream: upstream.url(),
                ..AgentOpts::default()
            },
            &how,
        )
        .await
        .unwrap();
        let trio = Trio {
            _dir: dir,
            _upstream: upstream,
            dispatcher,
            server,
            agent,
        };
        let caller = trio.caller();
        eventually("the trio relays a call", READY, || {
            let c = caller.clone();
            async move {
                matches!(c.get(&format!("/relay/{TUNNEL_ID}/hello")).await, Ok(a) if a.status == 200)
            }
        })
        .await;
        trio
    }

    fn caller(&self) -> Caller {
        Caller::new(self.dispatcher.http, Some(CALLER_KEY))
    }

    fn procs(&self) -> [&Proc; 3] {
        [&self.dispatcher.proc, &self.server.proc, &self.agent.proc]
    }

    /// `POST /relay/demo/echo` with `headers`; the upstream echoes what it received.
    async fn echo(&self, headers: &[(&str, &str)]) -> Answer {
        let caller = self.caller();
        let mut req = caller.request(
            Method::POST,
            &format!("/relay/{TUNNEL_ID}/echo"),
            Bytes::from_static(b"traced"),
        );
        for (name, value) in headers {
            req.headers_mut().insert(
                http::HeaderName::from_bytes(name.as_bytes()).unwrap(),
                HeaderValue::from_str(value).unwrap(),
            );
        }
        let answer = caller.call(req).await.unwrap();
        assert_eq!(answer.status, 200, "{:?}", answer.body);
        answer
    }

    /// Waits until each process's log has a line with `trace_id={trace}`.
    async fn each_log_names(&self, trace: &str) {
        let needle = format!("trace_id={trace}");
        for proc in self.procs() {
            eventually(
                &format!("{}'s log has a line with {needle}", proc.name),
                Duration::from_secs(10),
                || {
                    let found = proc.log().lines().any(|l| l.contains(&needle));
                    async move { found }
                },
            )
            .await;
        }
    }
}

/// The headers the upstream received, from the echo's `x-echo-headers` (a JSON object).
fn upstream_header(answer: &Answer, name: &str) -> Option<String> {
    let echoed = answer.headers.get("x-echo-headers")?.to_str().ok()?;
    let json: serde_json::Value = serde_json::from_str(echoed).ok()?;
    json.get(name)?.as_str().map(str::to_string)
}

/// `00-{trace}-{parent}-{flags}` split into its fields, after checking its shape.
fn fields(traceparent: &str) -> (String, String, String) {
    let parts: Vec<&str> = traceparent.split('-').collect();
    assert_eq!(parts.len(), 4, "traceparent {traceparent:?}");
    assert_eq!(parts[0], "00", "traceparent {traceparent:?}");
    assert_eq!(parts[1].len(), 32, "traceparent {traceparent:?}");
    assert_eq!(parts[2].len(), 16, "traceparent {traceparent:?}");
    assert!(
        traceparent
            .bytes()
            .all(|b| b == b'-' || b.is_ascii_digit() || (b'a'..=b'f').contains(&b)),
        "traceparent {traceparent:?}"
    );
    (parts[1].into(), parts[2].into(), parts[3].into())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_callers_trace_reaches_the_upstream_and_every_hops_log() {
    let trio = Trio::start("traces-carry", &[]).await;
    let traceparent = format!("00-{TRACE}-{CALLER_SPAN}-01");
    let answer = trio
        .echo(&[
            ("traceparent", &traceparent),
            ("tracestate", "vendor=opaque,other=1"),
        ])
        .await;
    let received = upstream_header(&answer, "traceparent").expect("the upstream got a traceparent");
    let (trace, parent, flags) = fields(&received);
    assert_eq!(trace, TRACE, "the upstream sees the caller's trace");
    assert_ne!(
        parent, CALLER_SPAN,
        "the agent's span is the upstream's parent"
    );
    assert_eq!(flags, "01", "the sampled flag is kept");
    assert_eq!(
        upstream_header(&answer, "tracestate").as_deref(),
        Some("vendor=opaque,other=1"),
        "tracestate passes unchanged"
    );
    trio.each_log_names(TRACE).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_without_a_usable_traceparent_gets_a_trace_started_by_the_dispatcher() {
    let trio = Trio::start("traces-start", &[]).await;
    let mut started = Vec::new();
    for headers in [
        vec![],
        vec![("traceparent", "00-not-a-trace-01")],
        // All-zero trace id: invalid, replaced.
        vec![(
            "traceparent",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
        )],
    ] {
        let answer = trio.echo(&headers).await;
        let received =
            upstream_header(&answer, "traceparent").expect("the upstream got a traceparent");
        let (trace, _, flags) = fields(&received);
        assert_ne!(trace, "0".repeat(32));
        assert_eq!(flags, "01", "a started trace is sampled");
        trio.each_log_names(&trace).await;
        started.push(trace);
    }
    started.sort();
    started.dedup();
    assert_eq!(
        started.len(),
        3,
        "each call got a trace of its own: {started:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_otlp_on_a_collector_receives_one_span_per_hop_each_parented_by_the_hop_before() {
    let collector = Collector::start().await.unwrap();
    let trio = Trio::start(
        "traces-otlp",
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", collector.endpoint()),
            ("OTEL_BSP_SCHEDULE_DELAY", "100".to_string()),
        ],
    )
    .await;
    let traceparent = format!("00-{TRACE}-{CALLER_SPAN}-01");
    let answer = trio.echo(&[("traceparent", &traceparent)]).await;
    let received = upstream_header(&answer, "traceparent").unwrap();
    let (_, upstream_parent, _) = fields(&received);

    let spans: Vec<ReceivedSpan> = relay_tests::eventually(
        "the collector holds the call's three spans",
        Duration::from_secs(15),
        || {
            let spans = collector.trace(TRACE);
            async move {
                if spans.len() >= 3 {
                    Ok(spans)
                } else {
                    Err(format!("{} spans so far: {spans:?}", spans.len()))
                }
            }
        },
    )
    .await;
    assert_eq!(spans.len(), 3, "one span per hop: {spans:#?}");
    let of = |service: &str| {
        spans
            .iter()
            .find(|s| s.service == service)
            .unwrap_or_else(|| panic!("no span from {service}: {spans:#?}"))
    };
    let dispatcher = of("relay-dispatcher");
    let server = of("relay-tunnel-server");
    let agent = of("relay-agent");
    assert_eq!(dispatcher.parent_span_id, CALLER_SPAN, "{spans:#?}");
    assert_eq!(server.parent_span_id, dispatcher.span_id, "{spans:#?}");
    assert_eq!(agent.parent_span_id, server.span_id, "{spans:#?}");
    assert_eq!(
        upstream_parent, agent.span_id,
        "the upstream's parent is the agent's span"
    );
    for span in &spans {
        assert!(
            span.attributes
                .iter()
                .any(|(k, v)| k == "relay.outcome" && v == "ok"),
            "{span:?}"
        );
    }
    assert!(
        dispatcher
            .attributes
            .iter()
            .any(|(k, v)| k == "relay.tunnel_id" && v == TUNNEL_ID),
        "{dispatcher:?}"
    );
}

#[test]
fn an_otlp_endpoint_that_is_not_a_url_stops_the_binary_naming_the_variable() {
    let dir = ScratchDir::new("traces-bad-endpoint").unwrap();
    let example = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../examples/local/dispatcher.toml"
    );
    let out = std::process::Command::new(binary("relay-dispatcher").unwrap())
        .args(["--config", example])
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", "collector:4317 <bad>")
        .current_dir(dir.path())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("OTEL_EXPORTER_OTLP_ENDPOINT"),
        "stderr: {stderr}"
    );
}
