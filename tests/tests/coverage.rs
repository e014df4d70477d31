//! Per-server coverage end to end: a dispatcher, three tunnel servers behind the
//! stream-placing load-balancer fixture with zone-skewed placement, one agent and an
//! upstream that takes 200 ms per call. Every call goes to one server (the only one the
//! dispatcher knows), which the load balancer starves of new streams: the incident.
//! With coverage off the calls queue behind its single stream; with coverage on the agent
//! grows there until every call is in flight.

use bytes::Bytes;
use http::Method;
use relay_agent::coverage::plan::CoverageConfig;
use relay_tests::lb::Policy;
use relay_tests::metrics::histogram;
use relay_tests::stack::{Stack, TUNNEL_ID};
use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;

const CALLS: usize = 500;

/// Zone skew: the first stream lands on server 0 (so it holds one stream and is the
/// server the calls go to), then 5% of new streams land there and 95% on servers 1 and 2.
fn zone_skew() -> Policy {
    Policy::scripted(|n| {
        if n == 0 {
            return 0;
        }
        match n.wrapping_mul(2_654_435_761) % 100 {
            0..5 => 0,
            5..95 => 1,
            _ => 2,
        }
    })
}

struct Outcome {
    ok: usize,
    no_capacity: usize,
    other: Vec<String>,
    /// Seconds calls waited for a stream on the routed server, summed.
    queued_call_seconds: f64,
    queue_wait_p99: f64,
    states_seen: BTreeSet<String>,
    streams_on_routed: u64,
    /// Client-side latency p99 over all calls, seconds.
    latency_p99: f64,
}

async fn run(coverage: CoverageConfig) -> Outcome {
    let enabled = coverage.enabled;
    let stack = Stack::builder()
        .servers(3)
        .zones(&["far", "near", "near"])
        .routed_servers(1)
        .placement(zone_skew())
        .coverage(coverage)
        .upstream_latency(Duration::from_millis(200))
        .start()
        .await
        .unwrap();
    stack.wait_routable(Duration::from_secs(20)).await.unwrap();
    let routed = stack.servers[0].as_ref().unwrap().server_id.clone();

    // Watch /systemcheck while the load runs.
    let states = Arc::new(Mutex::new(BTreeSet::new()));
    let watching = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let admin = stack.agent_admin.unwrap();
    let watcher = {
        let (states, watching, routed) = (states.clone(), watching.clone(), routed.clone());
        tokio::spawn(async move {
            let client = relay_tests::client::Caller::new(admin, None);
            while watching.load(std::sync::atomic::Ordering::SeqCst) {
                if let Ok(a) = client.get("/systemcheck").await {
                    for s in a.json()["servers"].as_array().into_iter().flatten() {
                        if s["server_id"] == routed.as_str() {
                            if let Some(st) = s["state"].as_str() {
                                states.lock().unwrap().insert(st.to_string());
                            }
                        }
                    }
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    };

    let caller = stack.caller();
    let calls = (0..CALLS).map(|i| {
        let caller = caller.clone();
        tokio::spawn(async move {
            let mut req = caller.request(
                Method::GET,
                &format!("/relay/{TUNNEL_ID}/hello?i={i}"),
                Bytes::new(),
            );
            req.headers_mut()
                .insert("x-relay-timeout-ms", "15000".parse().unwrap());
            let t = Instant::now();
            (caller.call(req).await, t.elapsed())
        })
    });
    let answers = futures::future::join_all(calls).await;
    // After the load the routed server settles as covered (coverage on).
    if enabled {
        relay_tests::time_until(Duration::from_secs(10), || async {
            states.lock().unwrap().contains("covered")
        })
        .await;
    }
    watching.store(false, std::sync::atomic::Ordering::SeqCst);
    let _ = watcher.await;

    let mut out = Outcome {
        ok: 0,
        no_capacity: 0,
        other: vec![],
        queued_call_seconds: 0.0,
        queue_wait_p99: 0.0,
        states_seen: BTreeSet::new(),
        streams_on_routed: 0,
        latency_p99: 0.0,
    };
    let mut latencies = Vec::new();
    for a in answers {
        let (a, took) = a.unwrap();
        latencies.push(took.as_secs_f64());
        match a {
            Ok(a) if a.status == 200 => out.ok += 1,
            Ok(a) if a.status == 503 && a.json()["error"] == "no_capacity" => out.no_capacity += 1,
            Ok(a) => out.other.push(format!("{} {}", a.status, a.text())),
            Err(e) => out.other.push(e.to_string()),
        }
    }
    latencies.sort_by(f64::total_cmp);
    out.latency_p99 = latencies[(latencies.len() * 99 / 100).min(latencies.len() - 1)];
    let server = stack.servers[0].as_ref().unwrap();
    let wait = histogram(&server.registry, "relay_tunnel_queue_wait_seconds");
    out.queued_call_seconds = wait.sum;
    out.queue_wait_p99 = wait.quantile(0.99);
    out.states_seen = states.lock().unwrap().clone();
    out.streams_on_routed = relay_tests::metrics::value(
        &server.registry,
        "relay_tunnel_streams",
        &[("tunnel_id", TUNNEL_ID)],
    ) as u64;
    stack.shutdown().await;
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zone_skew_incident_queues_without_coverage_and_is_cured_with_it() {
    let started = Instant::now();
    let off = run(CoverageConfig {
        enabled: false,
        fixed_streams: 8,
        ..CoverageConfig::default()
    })
    .await;
    eprintln!(
        "coverage off: ok {} no_capacity {} other {} queued call-seconds {:.1} queue-wait p99 <= {:.3}s call p99 {:.3}s streams on routed server {} ({:.1}s)",
        off.ok, off.no_capacity, off.other.len(), off.queued_call_seconds, off.queue_wait_p99, off.latency_p99, off.streams_on_routed, started.elapsed().as_secs_f64()
    );
    let started = Instant::now();
    let on = run(CoverageConfig::default()).await;
    eprintln!(
        "coverage on: ok {} no_capacity {} other {} queued call-seconds {:.1} queue-wait p99 <= {:.3}s call p99 {:.3}s streams on routed server {} states {:?} ({:.1}s)",
        on.ok, on.no_capacity, on.other.len(), on.queued_call_seconds, on.queue_wait_p99, on.latency_p99, on.streams_on_routed, on.states_seen, started.elapsed().as_secs_f64()
    );

    // The incident: the routed server holds one stream and calls queue behind it.
    assert_eq!(
        off.streams_on_routed, 1,
        "coverage off keeps the routed server at its single stream"
    );
    assert!(
        off.no_capacity > 0,
        "coverage off: calls should have queued out; other: {:?}",
        &off.other[..off.other.len().min(3)]
    );
    // Cured: every call completes, none is turned away.
    assert_eq!(
        on.ok,
        CALLS,
        "coverage on: no_capacity {} other {:?}",
        on.no_capacity,
        &on.other[..on.other.len().min(3)]
    );
    assert!(
        on.streams_on_routed > 8,
        "coverage on grew the routed server: {}",
        on.streams_on_routed
    );
    assert!(
        on.queued_call_seconds < off.queued_call_seconds,
        "queueing fell with coverage on"
    );
    // /systemcheck reported the routed server growing under load and covered after it.
    assert!(
        on.states_seen.contains("growing"),
        "states seen: {:?}",
        on.states_seen
    );
    assert!(
        on.states_seen.contains("covered"),
        "states seen: {:?}",
        on.states_seen
    );
}

/// The keys of a JSON value, recursively (`a.b`, `servers[].state`), with the JSON type of
/// each where it is not null.
fn shape(v: &serde_json::Value, at: &str, out: &mut BTreeSet<String>) {
    use serde_json::Value;
    match v {
        Value::Object(m) => {
            for (k, x) in m {
                let path = if at.is_empty() {
                    k.clone()
                } else {
                    format!("{at}.{k}")
                };
                shape(x, &path, out);
            }
        }
        Value::Array(a) => {
            out.insert(format!("{at}: array"));
            for x in a.iter().filter(|x| x.is_object()) {
                shape(x, &format!("{at}[]"), out);
            }
        }
        Value::Null => {
            out.insert(at.to_string());
        }
        other => {
            let ty = match other {
                Value::Bool(_) => "bool",
                Value::Number(n) if n.is_f64() => "float",
                Value::Number(_) => "integer",
                _ => "string",
            };
            out.insert(at.to_string());
            out.insert(format!("{at}: {ty}"));
        }
    }
}

/// docs/coverage.md's `/systemcheck` example shows what a running agent serves: the same fields,
/// nested the same way, with the same types (a field the example shows as null is only
/// required to exist).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_documented_systemcheck_example_matches_what_the_agent_serves() {
    let doc = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/coverage.md"),
    )
    .unwrap();
    let from = doc
        .find("Watching it: `GET /systemcheck`")
        .expect("docs/coverage.md describes /systemcheck");
    let block = &doc[from..];
    let start = block.find("```json\n").expect("an example") + "```json\n".len();
    let end = start + block[start..].find("```").unwrap();
    let example: serde_json::Value = serde_json::from_str(&block[start..end]).unwrap();

    let stack = Stack::builder().servers(2).start().await.unwrap();
    stack.wait_routable(Duration::from_secs(30)).await.unwrap();
    // Served once the upstream was checked and a server is listed.
    let served = relay_tests::eventually(
        "a /systemcheck with servers and a checked upstream",
        Duration::from_secs(30),
        || async {
            let (_, v) = stack.systemcheck().await.map_err(|e| e.to_string())?;
            let ready = v["servers"].as_array().is_some_and(|s| !s.is_empty())
                && v["upstream"]["status"].is_number();
            if ready {
                Ok(v)
            } else {
                Err(v.to_string())
            }
        },
    )
    .await;
    let (mut want, mut got) = (BTreeSet::new(), BTreeSet::new());
    shape(&example, "", &mut want);
    shape(&served, "", &mut got);
    // Types of fields the served document has as null are not compared.
    let untyped = |set: &BTreeSet<String>, other: &BTreeSet<String>| -> BTreeSet<String> {
        set.iter()
            .filter(|k| match k.split_once(": ") {
                Some((path, _)) => other.iter().any(|o| o.starts_with(&format!("{path}: "))),
                None => true,
            })
            .cloned()
            .collect()
    };
    let (want, got) = (untyped(&want, &got), untyped(&got, &want));
    assert_eq!(
        want.difference(&got).collect::<Vec<_>>(),
        Vec::<&String>::new(),
        "docs/coverage.md shows what the agent does not serve (served: {served})"
    );
    assert_eq!(
        got.difference(&want).collect::<Vec<_>>(),
        Vec::<&String>::new(),
        "the agent serves what docs/coverage.md does not show"
    );
    stack.shutdown().await;
}

/// The agent's streams on server slot `i` (0 when it is not running).
fn streams_on(stack: &Stack, i: usize) -> u64 {
    stack.servers[i].as_ref().map_or(0, |s| {
        relay_tests::metrics::value(
            &s.registry,
            "relay_tunnel_streams",
            &[("tunnel_id", TUNNEL_ID)],
        ) as u64
    })
}

/// Steered opens (`[coverage] steered_opens`): the balancer never places a stream on
/// `ts-3` by its policy (`Policy::Unfillable`), yet the agent holds its reserve there by
/// naming it, and holds it again after `ts-3` crashes and starts as a new instance. When
/// the balancer ignores the name, the agent goes on filling `ts-3` through it unnamed (its
/// /systemcheck shows such a fill) and `ts-3` gets no stream, as without the setting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn steered_opens_cover_a_server_the_balancer_never_places_on_when_it_routes_by_name() {
    let reserve = CoverageConfig::default().reserve;
    for routes in [true, false] {
        let mut stack = Stack::builder()
            .servers(3)
            .placement(Policy::Unfillable(2))
            .lb_route_by_name(routes)
            .coverage(CoverageConfig {
                steered_opens: true,
                ..CoverageConfig::default()
            })
            .start()
            .await
            .unwrap();
        stack.wait_routable(Duration::from_secs(20)).await.unwrap();
        let covered = |stack: &Stack| {
            (0..3)
                .filter(|i| streams_on(stack, *i) >= u64::from(reserve))
                .count()
        };
        if routes {
            relay_tests::eventually(
                "every server at its reserve",
                Duration::from_secs(20),
                || {
                    let n = covered(&stack);
                    async move { n == 3 }
                },
            )
            .await;
            assert!(stack.kill_server(2));
            stack.start_server(2).await.unwrap();
            relay_tests::eventually(
                "the restarted ts-3 at its reserve",
                Duration::from_secs(20),
                || {
                    let n = streams_on(&stack, 2);
                    async move { n >= u64::from(reserve) }
                },
            )
            .await;
        } else {
            relay_tests::eventually(
                "ts-1 and ts-2 at their reserve",
                Duration::from_secs(20),
                || {
                    let n = covered(&stack);
                    async move { n == 2 }
                },
            )
            .await;
            // The fallback: a fill of ts-3 through the balancer, not naming it.
            let admin = stack.agent_admin.unwrap();
            let client = relay_tests::client::Caller::new(admin, None);
            relay_tests::eventually("an unnamed fill of ts-3", Duration::from_secs(20), || {
                let client = client.clone();
                async move {
                    let page = client
                        .get("/systemcheck")
                        .await
                        .map_err(|e| e.to_string())?
                        .json();
                    let unnamed =
                        page["recent_actions"]
                            .as_array()
                            .into_iter()
                            .flatten()
                            .any(|a| {
                                a["server_id"] == "ts-3"
                                    && a["action"] == "fill"
                                    && a["reason"].as_str().is_some_and(|r| !r.contains("naming"))
                            });
                    if unnamed {
                        Ok(())
                    } else {
                        Err(page["recent_actions"].to_string())
                    }
                }
            })
            .await;
            assert_eq!(
                streams_on(&stack, 2),
                0,
                "the balancer never places on ts-3"
            );
        }
        stack.shutdown().await;
    }
}
