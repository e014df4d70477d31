//! Behind a real load balancer: HAProxy in HTTP/2 mode (`bind ... proto h2` for agents,
//! `server ... proto h2` to the tunnel servers, h2c) in front of three tunnel servers with
//! zone-skewed weights 5/90/5, the agent dialing only HAProxy. HAProxy balances per HTTP
//! request, and one gRPC tunnel stream is one request, so the weights are where new
//! streams land.
//!
//! - the zone-skew incident does not happen: only the starved server (weight 5) is routed,
//!   and 400 concurrent calls to a 200 ms upstream all complete;
//! - with every server routed, coverage reaches every server the dispatcher uses, and a
//!   hard restart of HAProxy (every agent connection dropped) leaves no call unanswered;
//! - with the shipped `examples/haproxy/haproxy.cfg` itself (addresses replaced) in front
//!   of the real binaries, a draining (SIGTERMed) tunnel server answers `/readyz` 503,
//!   HAProxy marks it down and places no new stream there.
//!
//! HAProxy is the Debian package `haproxy` (`scripts/test` installs it); each test starts its own
//! instance on loopback, with a config generated like `examples/haproxy/haproxy.cfg` or
//! with that file.

use bytes::Bytes;
use http::Method;
use relay_tests::client::Caller;
use relay_tests::haproxy::{Backend, Haproxy};
use relay_tests::ledger::{
    agent_ledger_text, dispatcher_attempts, hops_agree, server_ledger_text, Hops,
};
use relay_tests::load::LoadSpec;
use relay_tests::metrics::value;
use relay_tests::procs::{
    metric, scrape, series, wait_http, AgentOpts, AgentProc, DispatcherOpts, DispatcherProc,
    ScratchDir, TunnelServerOpts, TunnelServerProc,
};
use relay_tests::stack::{Stack, CALLER_KEY, TOKEN, TUNNEL_ID};
use relay_tests::upstream::Upstream;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;
use tokio::time::Instant;

const WEIGHTS: [u32; 3] = [5, 90, 5];

/// HAProxy in front of three server ports bound now, then the stack on those listeners.
async fn stack_behind_haproxy(routed: Option<usize>) -> (Stack, Haproxy) {
    let listeners: Vec<std::net::TcpListener> = (0..3)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0").unwrap())
        .collect();
    let agent_addrs: Vec<SocketAddr> = listeners.iter().map(|l| l.local_addr().unwrap()).collect();
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
        .server_agent_listeners(listeners)
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
        let h = &haproxy;
        relay_tests::eventually(
            "haproxy backends up",
            Duration::from_secs(10),
            || async move {
                let csv = h.stats_csv().await.unwrap_or_default();
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
                    Ok(())
                } else {
                    Err(csv)
                }
            },
        )
        .await;
    }
    (stack, haproxy)
}

/// Fires `n` concurrent calls; returns answers by "status error".
async fn burst(front: SocketAddr, n: usize, timeout_ms: u64) -> BTreeMap<String, usize> {
    burst_to(front, n, timeout_ms, "/hello").await
}

/// [`burst`] to `path` (after `/relay/{tunnel}`).
async fn burst_to(
    front: SocketAddr,
    n: usize,
    timeout_ms: u64,
    path: &str,
) -> BTreeMap<String, usize> {
    let caller = Caller::new(front, Some(CALLER_KEY));
    let calls = (0..n).map(|i| {
        let caller = caller.clone();
        let path = path.to_string();
        tokio::spawn(async move {
            let mut req = caller.request(
                Method::GET,
                &format!("/relay/{TUNNEL_ID}{path}?i={i}"),
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
    let st = &stack;
    let servers = relay_tests::eventually(
        "every server covered",
        Duration::from_secs(20),
        || async move {
            let (_, check) = st.systemcheck().await.unwrap();
            let servers = check["servers"].as_array().cloned().unwrap_or_default();
            let all_covered = !servers.is_empty()
                && servers
                    .iter()
                    .all(|s| s["state"] == "covered" && s["streams"].as_u64().unwrap_or(0) > 0);
            if all_covered {
                Ok(servers)
            } else {
                Err(check.to_string())
            }
        },
    )
    .await;
    eprintln!(
        "haproxy: agent coverage {}",
        serde_json::to_string(&servers).unwrap()
    );
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
    let load = relay_tests::load::start(
        caller,
        LoadSpec::new(8, format!("/relay/{TUNNEL_ID}/hello"), 5000),
    );
    load.flowing(20, Duration::from_secs(20)).await; // calls flow before the fault
    let restarted = Instant::now();
    haproxy.restart().await.unwrap();
    // The load runs on through the restart until calls are answered 200 again.
    load.flowing(20, Duration::from_secs(20)).await;
    let tally = load.stop().await;
    sent += tally.sent() as usize;
    let answers = tally.failures();
    // Routable again.
    stack.wait_routable(Duration::from_secs(20)).await.unwrap();
    let back = restarted.elapsed();
    sent += 1; // the successful probe (failed probes counted below)
    eprintln!(
        "haproxy restart: {}; routable again within {back:?}",
        tally.summary()
    );
    for k in answers.keys() {
        assert!(
            k.starts_with("502 stream_lost")
                || k.starts_with("503 tunnel_unavailable")
                || k.starts_with("503 no_capacity"),
            "unexpected answer {k}: {}",
            tally.summary()
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
    relay_tests::eventually("accounting settled", Duration::from_secs(20), accounted).await;
    stack.shutdown().await;
}

/// Every agent stream open that reached the server's handler, by any result (accepted,
/// refused as draining, ...).
async fn opens(admin: SocketAddr) -> f64 {
    let t = scrape(admin).await.unwrap_or_default();
    metric(&t, "relay_tunnel_stream_opens_total", &[])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shipped_haproxy_config_stops_placing_streams_on_a_draining_server() {
    // The real binaries behind HAProxy running examples/haproxy/haproxy.cfg as shipped
    // (only addresses replaced): health checks on each tunnel server's /readyz, every 2 s,
    // down after 2 failures. A SIGTERMed server drains while a call runs on it: /readyz
    // answers 503, HAProxy marks it down, and the new streams the agent opens meanwhile
    // land on the other servers only.
    let dir = ScratchDir::new("haproxy-drain").unwrap();
    let upstream = Upstream::builder().spawn().await.unwrap();
    let dispatcher = DispatcherProc::start(
        dir.path(),
        DispatcherOpts {
            call_timeout: Duration::from_secs(30),
            // Every call to one home server, so the slow call surely runs on the victim.
            extra: "[routing]\npolicy = \"sticky\"\n".into(),
            ..DispatcherOpts::default()
        },
    )
    .await
    .unwrap();
    let mut servers = Vec::new();
    for i in 1..=3 {
        let o = TunnelServerOpts {
            server_id: format!("ts-{i}"),
            dispatchers: vec![dispatcher.registry_url()],
            shutdown_grace: Duration::from_secs(60),
            ..TunnelServerOpts::default()
        };
        servers.push(TunnelServerProc::start(dir.path(), o).await.unwrap());
    }
    let backends = servers
        .iter()
        .map(|s| Backend {
            name: s.server_id.clone(),
            addr: s.agent_addr,
            admin: Some(s.admin_addr),
            weight: 0, // the example's weights apply
            disabled: false,
        })
        .collect();
    let haproxy = Haproxy::start_example(backends).await.unwrap();
    let cfg = haproxy.config_text().unwrap();
    assert!(
        cfg.contains("http-check send meth GET uri /readyz"),
        "the example checks /readyz:\n{cfg}"
    );
    let agent = AgentProc::start(
        dir.path(),
        AgentOpts {
            tunnels: vec![haproxy.url()],
            token: TOKEN.into(),
            upstream: upstream.url(),
            ..AgentOpts::default()
        },
    )
    .await
    .unwrap();
    let caller = Caller::new(dispatcher.http, Some(CALLER_KEY));
    let (h, c) = (&haproxy, &caller);
    relay_tests::eventually(
        "routable behind haproxy with every server up",
        Duration::from_secs(30),
        || async move {
            let up = h.servers().await.unwrap_or_default();
            let ok = matches!(c.get(&format!("/relay/{TUNNEL_ID}/hello")).await, Ok(a) if a.status == 200);
            if ok && up.len() == 3 && up.values().all(|(st, _)| st == "UP") {
                Ok(())
            } else {
                Err(format!("ok {ok}, servers {up:?}\n{}", h.log()))
            }
        },
    )
    .await;
    let routes = Caller::new(dispatcher.admin, None)
        .get("/debug/routes")
        .await
        .unwrap()
        .json();
    let home = routes["tunnels"]
        .as_array()
        .and_then(|t| t.iter().find(|t| t["tunnel_id"] == TUNNEL_ID))
        .and_then(|t| t["home"].as_str())
        .expect("a home server")
        .to_string();
    let victim = servers.iter().position(|s| s.server_id == home).unwrap();
    let others: Vec<usize> = (0..3).filter(|&i| i != victim).collect();
    // A slow call holds the victim while it drains.
    let slow = {
        let c = caller.clone();
        tokio::spawn(async move {
            let mut req = c.request(
                Method::GET,
                &format!("/relay/{TUNNEL_ID}/slow/15000"),
                Bytes::new(),
            );
            req.headers_mut()
                .insert("x-relay-timeout-ms", "30000".parse().unwrap());
            c.call(req).await.map(|a| a.status.as_u16())
        })
    };
    let admin = servers[victim].admin_addr;
    relay_tests::eventually(
        &format!("the slow call runs on {home}"),
        Duration::from_secs(10),
        || async move {
            let t = scrape(admin).await.unwrap_or_default();
            metric(&t, "relay_tunnel_calls_in_flight", &[]) >= 1.0
        },
    )
    .await;

    servers[victim].proc.signal("TERM").unwrap();
    wait_http(admin, "/readyz", 503, Duration::from_secs(5))
        .await
        .expect("a draining server's /readyz answers 503");
    // inter 2s, fall 2: down within about two checks.
    let marked = Instant::now();
    let (h, home_ref) = (&haproxy, &home);
    relay_tests::eventually(
        "haproxy marks the draining server down",
        Duration::from_secs(15),
        || async move {
            let st = h.servers().await.unwrap_or_default();
            if st.get(home_ref).is_some_and(|(s, _)| s.starts_with("DOWN")) {
                Ok(())
            } else {
                Err(format!(
                    "haproxy still places streams on {home_ref}: {st:?}"
                ))
            }
        },
    )
    .await;
    eprintln!(
        "haproxy marked draining {home} down after {:?}",
        marked.elapsed()
    );
    let victim_opens = opens(admin).await;
    let mut others_opens = 0.0;
    for &i in &others {
        others_opens += opens(servers[i].admin_addr).await;
    }
    // The agent opens streams now: replacements for its draining streams, and growth for
    // a burst of calls on the new home.
    let answers = burst_to(dispatcher.http, 40, 20_000, "/slow/1000").await;
    assert_eq!(answers.get("200").copied(), Some(40), "{answers:?}");
    let mut others_now = 0.0;
    for &i in &others {
        others_now += opens(servers[i].admin_addr).await;
    }
    let victim_now = opens(admin).await;
    eprintln!(
        "while {home} drained: {} new streams on the others, {} on {home}",
        others_now - others_opens,
        victim_now - victim_opens
    );
    assert!(
        others_now - others_opens >= 8.0,
        "the agent opened streams meanwhile ({} on the others)",
        others_now - others_opens
    );
    assert_eq!(
        victim_now, victim_opens,
        "haproxy placed new streams on draining {home}"
    );
    assert!(
        servers[victim].proc.try_exited().is_none(),
        "{home} still drains (its call runs): the check above is about placement"
    );
    assert_eq!(
        slow.await.unwrap().ok(),
        Some(200),
        "the draining server's call finishes"
    );
    let status = servers[victim]
        .proc
        .wait_exit(Duration::from_secs(30))
        .await
        .unwrap();
    assert!(status.success(), "{home} exits 0 after its drain: {status}");
    drop(agent);
}

/// Steered opens through a real HAProxy: `ts-3` at weight 0 never gets a balanced stream,
/// but the `use-server` rule on `relay-server` (as the shipped config has one per server)
/// routes an open that names it there, so an agent with `[coverage] steered_opens` holds
/// its reserve on every server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn behind_haproxy_steered_opens_reach_a_server_it_never_balances_to() {
    let listeners: Vec<std::net::TcpListener> = (0..3)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0").unwrap())
        .collect();
    let backends = listeners
        .iter()
        .enumerate()
        .map(|(i, l)| Backend {
            name: format!("ts-{}", i + 1),
            addr: l.local_addr().unwrap(),
            admin: None,
            weight: [1, 1, 0][i],
            disabled: false,
        })
        .collect();
    let haproxy = Haproxy::start(backends).await.unwrap();
    let url = haproxy.url();
    let stack = Stack::builder()
        .servers(3)
        .server_agent_listeners(listeners)
        .coverage(relay_agent::coverage::plan::CoverageConfig {
            steered_opens: true,
            ..Default::default()
        })
        .agent_config(move |c| c.tunnels = vec![url])
        .start()
        .await
        .unwrap();
    stack.wait_routable(Duration::from_secs(30)).await.unwrap();
    let reserve = f64::from(relay_agent::coverage::plan::CoverageConfig::default().reserve);
    let st = &stack;
    let held = relay_tests::eventually(
        "every server at the agent's reserve",
        Duration::from_secs(20),
        || async move {
            let held: Vec<f64> = (0..3).map(|i| streams(st, i)).collect();
            if held.iter().all(|n| *n >= reserve) {
                Ok(held)
            } else {
                Err(format!("streams per server {held:?}"))
            }
        },
    )
    .await;
    eprintln!("haproxy steered: streams per server {held:?}");
    drop(haproxy);
    stack.shutdown().await;
}
