//! Behind a real load balancer: HAProxy in HTTP/2 mode (`bind ... proto h2` for agents,
//! `server ... proto h2` to the tunnel servers, h2c) in front of three tunnel servers with
//! zone-skewed weights 5/90/5, the agent dialing only HAProxy. HAProxy balances per HTTP
//! request, and one gRPC tunnel stream is one request, so the weights are where new
//! streams land.
//!
//! - the zone-skew incident does not happen: only the starved server (weight 5) is routed,
//!   and 400 concurrent calls to a 200 ms upstream all complete;
//! - with every server routed, coverage reaches every server the dispatcher uses, and a
//!   hard restart of HAProxy (every agent connection dropped) leaves no call unanswered.
//!
//! HAProxy is the Debian package `haproxy` (`scripts/test` installs it); the test starts its own
//! instance on loopback with a config generated like `examples/haproxy/haproxy.cfg`.

use bytes::Bytes;
use http::Method;
use relay_tests::client::Caller;
use relay_tests::haproxy::{Backend, Haproxy};
use relay_tests::ledger::{
    agent_ledger_text, dispatcher_attempts, hops_agree, server_ledger_text, Hops,
};
use relay_tests::metrics::value;
use relay_tests::procs::{free_addr, metric, scrape, series};
use relay_tests::stack::{Stack, CALLER_KEY, TUNNEL_ID};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;
use tokio::time::Instant;

const WEIGHTS: [u32; 3] = [5, 90, 5];

/// HAProxy in front of three server ports picked now, then the stack on those ports.
async fn stack_behind_haproxy(routed: Option<usize>) -> (Stack, Haproxy) {
    let agent_addrs: Vec<SocketAddr> = (0..3).map(|_| free_addr().unwrap()).collect();
    let backends = agent_addrs
        .iter()
        .enumerate()
        .map(|(i, a)| Backend {
            name: format!("ts-{}", i + 1),
            addr: *a,
            // The in-process servers' admin ports are picked at start; TCP checks suffice
            // here (the example config checks /readyz on the admin port).
            admin: None,
            weight: WEIGHTS[i],
            // For the incident, the routed server takes the first stream: the others
            // join after it (as when they were restarted or scaled out later).
            disabled: routed.is_some() && i > 0,
        })
        .collect();
    let haproxy = Haproxy::start(backends).await.unwrap();
    let url = haproxy.url();
    let mut b = Stack::builder()
        .servers(3)
        .zones(&["far", "near", "far"])
        .server_agent_addrs(agent_addrs)
        .upstream_latency(Duration::from_millis(200))
        .agent_config(move |c| c.tunnels = vec![url]);
    if let Some(n) = routed {
        b = b.routed_servers(n);
    }
    let stack = b.start().await.unwrap();
    stack.wait_routable(Duration::from_secs(30)).await.unwrap();
    if routed.is_some() {
        for name in ["ts-2", "ts-3"] {
            haproxy.enable(name).await.unwrap();
        }
        // Up once HAProxy's checks pass (rise 2 x inter 500ms).
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let csv = haproxy.stats_csv().await.unwrap_or_default();
            let up = csv
                .lines()
                .filter(|l| l.starts_with("tunnel_servers,ts-"))
                .filter(|l| {
                    l.split(',')
                        .nth(17)
                        .is_some_and(|st| st == "UP" || st == "no check")
                })
                .count();
            if up == 3 {
                break;
            }
            assert!(Instant::now() < deadline, "haproxy backends not up:\n{csv}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    (stack, haproxy)
}

/// Fires `n` concurrent calls; returns answers by "status error".
async fn burst(front: SocketAddr, n: usize, timeout_ms: u64) -> BTreeMap<String, usize> {
    let caller = Caller::new(front, Some(CALLER_KEY));
    let calls = (0..n).map(|i| {
        let caller = caller.clone();
        tokio::spawn(async move {
            let mut req = caller.request(
                Method::GET,
                &format!("/relay/{TUNNEL_ID}/hello?i={i}"),
                Bytes::new(),
            );
            req.headers_mut().insert(
                "x-relay-timeout-ms",
                timeout_ms.to_string().parse().unwrap(),
            );
            match caller.call(req).await {
                Ok(a) if a.status == 200 => "200".to_string(),
                Ok(a) => format!("{} {}", a.status.as_u16(), a.json()["error"]),
                Err(e) => format!("transport {e}"),
            }
        })
    });
    let mut out = BTreeMap::new();
    for a in futures::future::join_all(calls).await {
        *out.entry(a.unwrap()).or_default() += 1;
    }
    out
}

fn streams(stack: &Stack, i: usize) -> f64 {
    stack.servers[i]
        .as_ref()
        .map(|s| {
            value(
                &s.registry,
                "relay_tunnel_streams",
                &[("tunnel_id", TUNNEL_ID)],
            )
        })
        .unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn behind_haproxy_the_starved_routed_server_is_grown_and_no_call_queues_out() {
    let (stack, haproxy) = stack_behind_haproxy(Some(1)).await;
    let started = Instant::now();
    let answers = burst(stack.http, 400, 15_000).await;
    let took = started.elapsed();
    let routed = streams(&stack, 0);
    let all: Vec<f64> = (0..3).map(|i| streams(&stack, i)).collect();
    eprintln!(
        "haproxy zone skew {WEIGHTS:?}, only ts-1 routed: {answers:?} in {took:?}; streams per server {all:?}"
    );
    assert_eq!(
        answers.get("200").copied().unwrap_or(0),
        400,
        "every call completes: {answers:?}\n{}",
        haproxy.log()
    );
    assert!(routed > 8.0, "the starved server was grown: {all:?}");
    assert!(
        all[1] > all[0],
        "placement followed HAProxy's weights (ts-2 gets most new streams): {all:?}"
    );
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn behind_haproxy_coverage_reaches_every_routed_server_and_a_restart_loses_no_call() {
    let (stack, mut haproxy) = stack_behind_haproxy(None).await;
    let base = {
        let t = scrape(stack.dispatcher_admin).await.unwrap();
        metric(&t, "relay_dispatcher_calls_total", &[])
    };
    let mut sent = 0usize;
    // Load spreads the agent's streams over the servers HAProxy picks.
    let first = burst(stack.http, 200, 15_000).await;
    sent += 200;
    assert_eq!(first.get("200").copied(), Some(200), "{first:?}");
    // Every server the dispatcher routes to (it announced the tunnel id) holds streams,
    // and the agent sees each as covered.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (_, check) = stack.systemcheck().await.unwrap();
        let servers = check["servers"].as_array().cloned().unwrap_or_default();
        let all_covered = !servers.is_empty()
            && servers
                .iter()
                .all(|s| s["state"] == "covered" && s["streams"].as_u64().unwrap_or(0) > 0);
        if all_covered {
            eprintln!(
                "haproxy: agent coverage {}",
                serde_json::to_string(&servers).unwrap()
            );
            break;
        }
        assert!(
            Instant::now() < deadline,
            "not every server covered: {check}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let dispatcher_routes: Vec<String> = {
        let t = scrape(stack.dispatcher_admin).await.unwrap();
        t.lines()
            .filter(|l| l.starts_with("relay_dispatcher_routing_decisions_total{"))
            .map(str::to_string)
            .collect()
    };
    let with_streams: Vec<f64> = (0..3).map(|i| streams(&stack, i)).collect();
    eprintln!(
        "haproxy: streams per server {with_streams:?}; dispatcher routing {dispatcher_routes:?}"
    );
    for (i, s) in stack.servers.iter().enumerate() {
        let s = s.as_ref().unwrap();
        let routed_here = dispatcher_routes
            .iter()
            .any(|l| l.contains(&format!("\"{}\"", s.server_id)));
        if routed_here {
            assert!(
                with_streams[i] > 0.0,
                "{} is routed but holds no stream",
                s.server_id
            );
        }
    }

    // Hard restart of HAProxy under load: every agent connection drops at once.
    let caller = Caller::new(stack.http, Some(CALLER_KEY));
    let load = tokio::spawn(async move { burst_for(caller, Duration::from_secs(4)).await });
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let restarted = Instant::now();
    haproxy.restart().await.unwrap();
    let (answers, n) = load.await.unwrap();
    sent += n;
    // Routable again.
    stack.wait_routable(Duration::from_secs(20)).await.unwrap();
    let back = restarted.elapsed();
    sent += 1; // the successful probe (failed probes counted below)
    eprintln!("haproxy restart: answers {answers:?}; routable again within {back:?}");
    for k in answers.keys() {
        assert!(
            k == "200"
                || k.starts_with("502 \"stream_lost\"")
                || k.starts_with("503 \"tunnel_unavailable\"")
                || k.starts_with("503 \"no_capacity\""),
            "unexpected answer {k}: {answers:?}"
        );
    }
    // Accounting: the dispatcher answered each call once (probes of wait_routable that
    // failed are the difference, so compare with >= and check nothing is in flight).
    // Per hop (a missing series fails): each server's calls in = outcomes out, the
    // dispatcher's forward attempts = calls the servers received, and the agent received
    // what the servers passed on; polled until quiet.
    let accounted = || async {
        let t = scrape(stack.dispatcher_admin)
            .await
            .map_err(|e| e.to_string())?;
        let outcomes = series(&t, "relay_dispatcher_calls_total", &[])? - base;
        let in_flight = series(&t, "relay_dispatcher_calls_in_flight", &[])?;
        if outcomes < sent as f64 || in_flight != 0.0 {
            return Err(format!(
                "dispatcher: {outcomes} outcomes for {sent} calls, {in_flight} in flight"
            ));
        }
        let mut hops = Hops {
            attempts: dispatcher_attempts(&t)?,
            ..Hops::default()
        };
        for (i, reg) in stack.server_registries() {
            let id = stack.server_id(i).unwrap_or("?").to_string();
            let text = relay_common::admin::render_metrics(&reg);
            server_ledger_text(&id, &text, true, &mut hops)?;
        }
        for (i, reg, running) in stack.agent_registries() {
            let text = relay_common::admin::render_metrics(&reg);
            agent_ledger_text(&format!("agent {i}"), &text, running, &mut hops)?;
        }
        hops_agree(&hops)
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match accounted().await {
            Ok(()) => break,
            Err(e) if Instant::now() > deadline => panic!("accounting not settled: {e}"),
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
    stack.shutdown().await;
}

/// Sequential calls from 8 workers for `d`; answers by kind and how many were sent.
async fn burst_for(caller: Caller, d: Duration) -> (BTreeMap<String, usize>, usize) {
    let until = Instant::now() + d;
    let workers = (0..8).map(|_| {
        let caller = caller.clone();
        tokio::spawn(async move {
            let mut out: BTreeMap<String, usize> = BTreeMap::new();
            let mut n = 0;
            while Instant::now() < until {
                n += 1;
                let mut req = caller.request(
                    Method::GET,
                    &format!("/relay/{TUNNEL_ID}/hello"),
                    Bytes::new(),
                );
                req.headers_mut()
                    .insert("x-relay-timeout-ms", "5000".parse().unwrap());
                let k = match caller.call(req).await {
                    Ok(a) if a.status == 200 => "200".to_string(),
                    Ok(a) => format!("{} {}", a.status.as_u16(), a.json()["error"]),
                    Err(e) => format!("transport {e}"),
                };
                *out.entry(k).or_default() += 1;
                if out.len() > 1 {
                    // Errors come fast: do not spin.
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
            (out, n)
        })
    });
    let mut all = BTreeMap::new();
    let mut total = 0;
    for w in futures::future::join_all(workers).await {
        let (out, n) = w.unwrap();
        total += n;
        for (k, v) in out {
            *all.entry(k).or_default() += v;
        }
    }
    (all, total)
}
