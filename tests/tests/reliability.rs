//! Reliability under faults: every call gets exactly one answer, and the fleet heals.
//!
//! Each test runs steady load through the dispatcher's HTTP front while it injects one
//! fault: a tunnel server process killed (SIGKILL; also behind a real HAProxy that keeps
//! placing streams on it until its health check fails), frozen (SIGSTOP) or drained
//! (SIGTERM), a rolling restart of every server, an agent restart or crash (SIGKILL), a
//! dispatcher crash and restart (memory and Redis registry), the upstream going away,
//! callers leaving mid-call, the load balancer losing its connections, and a connection
//! dropped silently on the path. Then it checks the accounting:
//!
//! - client: every call sent got exactly one answer (a response, or the caller's own
//!   cancel), within its deadline plus slack (no hang);
//! - dispatcher: `relay_dispatcher_calls_total` grew by exactly the calls sent and nothing
//!   is in flight once quiet;
//! - each tunnel server (every incarnation whose counters survive):
//!   `relay_tunnel_calls_received_total == sum(relay_tunnel_calls_total)`, nothing in flight;
//! - agent: calls received = outcomes, and no stream is busy once quiet;
//! - across hops (`relay_tests::ledger`): the dispatcher's forward attempts to a server
//!   = calls that server received (where every incarnation's counters survive), and the
//!   agent received what the servers passed on. A missing series fails, never reads 0.
//!
//! The process-level faults run the real binaries as children (`relay_tests::procs`); the
//! rest use the in-process stack. The soak runs the whole fleet as children so each
//! process's memory can be read on its own.

use bytes::Bytes;
use http::Method;
use relay_tests::client::Caller;
use relay_tests::haproxy::Checks;
use relay_tests::lb::Policy;
use relay_tests::load::{Ledger, Load, LoadSpec};
use relay_tests::metrics::value;
use relay_tests::procfleet::{
    dispatcher_base, dispatcher_servers, stack_accounted, Blackhole, Fleet, FleetOpts,
    QueuedKillRig,
};
use relay_tests::procs::{metric, scrape};
use relay_tests::redis::{require_redis, RedisServer};
use relay_tests::stack::{Stack, CALLER_KEY, TUNNEL_ID};
use relay_tests::upstream::Upstream;
use relay_tests::{eventually, time_until};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::time::Instant;

const READY: Duration = Duration::from_secs(20);
const QUIET: Duration = Duration::from_secs(20);
/// The dispatcher's `[registry] lease` (its default, which the fleets run with).
const LEASE: Duration = Duration::from_secs(3);
/// The tunnel servers' heartbeat in the process fleets of the heartbeat tests.
const HEARTBEAT: Duration = Duration::from_secs(1);
/// Margin on a detection bound: polling, scheduling on a loaded 2-core machine.
const DETECT_SLACK: Duration = Duration::from_secs(2);

// ---------------------------------------------------------------------------------------
// Load and the client-side ledger

/// The tests' load generator through `front` with the harness caller key.
fn start_load(front: SocketAddr, spec: LoadSpec) -> Load {
    relay_tests::load::start(Caller::new(front, Some(CALLER_KEY)), spec)
}

/// Answers that a crash of the server carrying a call may give that call: it may have
/// reached the agent, so it is not retried (POST-like safety), and the caller is told.
fn crash_answers(k: &str) -> bool {
    k.starts_with("502 stream_lost")
        || k.starts_with("502 tunnel_server_unreachable")
        || k.starts_with("503 tunnel_unavailable")
        || k.starts_with("503 no_capacity")
        || k.starts_with("504 ")
}

// ---------------------------------------------------------------------------------------
// Tests

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_tunnel_server_process_leaves_no_call_unanswered() {
    let mut fleet = Fleet::start(3, HEARTBEAT, Duration::ZERO).await;
    let base = fleet.base().await;
    let load = start_load(
        fleet.front(),
        LoadSpec::new(8, format!("/relay/{TUNNEL_ID}/slow/100"), 5000),
    );
    load.flowing(40, READY).await; // steady state before the fault
    let victim = fleet.busiest().await;
    let before = fleet.agent_servers().await;
    let s = fleet.servers[victim].take().unwrap();
    let id = s.server_id.clone();
    let mut proc = s.proc;
    proc.kill();
    // The agent notices (its streams there fail) and the dispatcher drops the server.
    let (agent_gone, dispatcher_gone) = tokio::join!(
        time_until(QUIET, || async {
            !fleet.agent_servers().await.contains_key(&id)
        }),
        time_until(QUIET, || async {
            dispatcher_servers(fleet.dispatcher.admin).await == 2.0
        })
    );
    let failed_at_kill = load.ledger().failed();
    // Calls keep succeeding on the other servers.
    let ok_before = load.ledger().ok();
    let ok_after = time_until(READY, || async { load.ledger().ok() >= ok_before + 50 }).await;
    fleet.restart(victim).await;
    fleet.wait_covered(3).await;
    let tally = load.stop().await;
    eprintln!(
        "kill {id} (agent streams before: {before:?}): agent dropped it after {agent_gone:?}, dispatcher after {dispatcher_gone:?}; {}",
        tally.summary()
    );
    // A killed process's connections close with it: both notice well within the bounds
    // for a silent peer (3 heartbeats for the agent, the lease for the dispatcher).
    let agent_gone = agent_gone.expect("the agent kept the killed server's streams");
    assert!(
        agent_gone <= 3 * HEARTBEAT + DETECT_SLACK,
        "the agent dropped the killed server after {agent_gone:?}, bound is 3 heartbeats + \
         {DETECT_SLACK:?}"
    );
    let dispatcher_gone = dispatcher_gone.expect("the dispatcher kept the killed server");
    assert!(
        dispatcher_gone <= LEASE + DETECT_SLACK,
        "the dispatcher dropped the killed server after {dispatcher_gone:?}, bound is its \
         lease ({LEASE:?}) + {DETECT_SLACK:?}"
    );
    assert!(
        ok_after.is_some(),
        "calls did not resume after the kill: {}",
        tally.summary()
    );
    for (k, n) in tally.failures() {
        assert!(
            crash_answers(&k),
            "unexpected answer {k} x{n}: {}",
            tally.summary()
        );
    }
    // Only calls caught on the crashed server (at most one per worker, plus a few routed
    // there before the dispatcher heard) fail.
    assert!(
        tally.failed() <= 16,
        "too many failures for one crash ({} at the kill): {}",
        failed_at_kill,
        tally.summary()
    );
    eventually("accounting after a SIGKILL", QUIET, || {
        fleet.accounted(tally.sent(), base)
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_queued_on_a_killed_server_process_are_retried_elsewhere_and_run_once() {
    // Sticky routing sends every call to the home server; its streams are all busy with
    // slow calls, so the rest wait in its queue when the process is SIGKILLed.
    let mut rig = QueuedKillRig::start().await;
    let (home, home_streams) = (rig.home.clone(), rig.home_streams);
    // As many calls wait as the other server can take at once.
    let queued = rig.other_streams.min(home_streams);
    let calls = home_streams + queued;
    let reached_before = rig.reached();
    let tally = Arc::new(Ledger::default());
    let mut tasks = Vec::new();
    for _ in 0..calls {
        let (c, tally) = (rig.caller(), tally.clone());
        tasks.push(tokio::spawn(async move {
            tally
                .call(&c, &format!("/relay/{TUNNEL_ID}/slow/2000"), 20_000, None)
                .await
        }));
    }
    rig.wait_queued(queued).await;
    rig.kill_home();
    for t in tasks {
        t.await.unwrap();
    }
    let retries = rig.retries().await;
    eprintln!(
        "SIGKILL {home} with {home_streams} calls in progress and {queued} queued: {}; retries {retries}",
        tally.summary()
    );
    assert_eq!(tally.answered(), calls, "every call answered");
    for (k, n) in tally.failures() {
        assert!(
            k.starts_with("502 stream_lost"),
            "only calls in progress on the killed server may fail, not {k} x{n}: {}",
            tally.summary()
        );
    }
    assert!(
        tally.failed() <= home_streams,
        "more failures than calls in progress: {}",
        tally.summary()
    );
    assert!(
        tally.ok() >= queued,
        "every queued call succeeded on the other server: {}",
        tally.summary()
    );
    assert!(retries >= queued as f64, "queued calls were retried");
    // Run once: no call reached the upstream twice.
    rig.wait_upstream_quiet().await;
    assert_eq!(
        rig.reached() - reached_before,
        calls,
        "each call reached the upstream exactly once"
    );
}

/// A body of `len` bytes no other call sends (so a mix-up cannot pass for an echo).
fn distinct_body(seed: u64, len: usize) -> Bytes {
    use rand::{RngCore, SeedableRng};
    let mut b = vec![0u8; len];
    rand::rngs::StdRng::seed_from_u64(seed).fill_bytes(&mut b);
    Bytes::from(b)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queued_posts_with_large_bodies_on_a_killed_server_process_succeed_elsewhere_intact() {
    // docs/routing.md: queued calls are safe to retry, POSTs included. A POST waiting in a queue has
    // sent as much of its body as the forward stream window admits (1 MiB) before the
    // server reads any; it must still be retried elsewhere, whole, and reach the upstream
    // once. Bodies of 1 MiB and of 4 MiB (four windows: the rest is pulled from the caller
    // after the retry).
    let mut rig = QueuedKillRig::start().await;
    let home_streams = rig.home_streams;
    let reached_before = rig.reached();
    // Every stream of the home server busy with a slow call.
    let mut slow = Vec::new();
    for _ in 0..home_streams {
        let c = rig.caller();
        slow.push(tokio::spawn(async move {
            let mut req = c.request(
                Method::GET,
                &format!("/relay/{TUNNEL_ID}/slow/3000"),
                Bytes::new(),
            );
            req.headers_mut()
                .insert("x-relay-timeout-ms", "20000".parse().unwrap());
            c.call(req).await.map(|a| a.status.as_u16())
        }));
    }
    let busy = time_until(READY, || async {
        rig.fleet.upstream.in_flight() >= home_streams
    })
    .await;
    assert!(
        busy.is_some(),
        "{home_streams} slow calls hold the home's streams"
    );
    let sizes = [1024 * 1024, 4 * 1024 * 1024];
    let mut posts = Vec::new();
    for (i, len) in sizes.into_iter().enumerate() {
        let body = distinct_body(i as u64 + 1, len);
        let c = rig.caller();
        posts.push(tokio::spawn(async move {
            let mut req = c.request(
                Method::POST,
                &format!("/relay/{TUNNEL_ID}/echo/post-{i}"),
                body.clone(),
            );
            req.headers_mut()
                .insert("x-relay-timeout-ms", "20000".parse().unwrap());
            (body, c.call(req).await)
        }));
    }
    rig.wait_queued(sizes.len() as u64).await;
    rig.kill_home();
    for (i, p) in posts.into_iter().enumerate() {
        let (sent, answer) = p.await.unwrap();
        let a = answer.unwrap_or_else(|e| panic!("POST {i}: transport error {e}"));
        assert_eq!(
            a.status,
            200,
            "the queued POST of {} bytes was not retried elsewhere: {}",
            sent.len(),
            a.text()
        );
        assert_eq!(
            a.headers.get("x-echo-method").map(|v| v.as_bytes()),
            Some(&b"POST"[..])
        );
        assert!(
            a.body == sent,
            "the upstream saw a body of {} bytes, not the {} sent (or other bytes)",
            a.body.len(),
            sent.len()
        );
    }
    let mut slow_answers = BTreeMap::new();
    for t in slow {
        let k = match t.await.unwrap() {
            Ok(s) => s.to_string(),
            Err(e) => format!("transport {e}"),
        };
        *slow_answers.entry(k).or_insert(0u64) += 1;
    }
    assert!(
        slow_answers.keys().all(|k| k == "502" || k == "200"),
        "calls in progress on the killed server end in 502 (or finished): {slow_answers:?}"
    );
    assert!(
        rig.retries().await >= sizes.len() as f64,
        "the queued POSTs were retried"
    );
    rig.wait_upstream_quiet().await;
    assert_eq!(
        rig.reached() - reached_before,
        home_streams + sizes.len() as u64,
        "each call reached the upstream exactly once"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frozen_tunnel_server_is_found_in_seconds_and_no_stream_stays_half_dead() {
    // Heartbeat 1 s: the agent drops a stream after 3 s without a frame.
    let fleet = Fleet::start(2, HEARTBEAT, Duration::ZERO).await;
    let base = fleet.base().await;
    let load = start_load(
        fleet.front(),
        LoadSpec::new(4, format!("/relay/{TUNNEL_ID}/slow/50"), 3000),
    );
    load.flowing(40, READY).await;
    let victim = fleet.busiest().await;
    let before = fleet.agent_servers().await;
    let servers = |t: &str| metric(t, "relay_dispatcher_tunnel_servers", &[]);
    let servers_before = servers(&scrape(fleet.dispatcher.admin).await.unwrap());
    let frozen = fleet.servers[victim].as_ref().unwrap();
    let id = frozen.server_id.clone();
    frozen.proc.signal("STOP").unwrap();
    // Both measured from the freeze: the agent drops its streams there once its
    // connection's keep-alive PING goes unanswered; the dispatcher drops the server when
    // its report stream's keep-alive does, or at the latest when its lease (3 s) runs out.
    let (agent_detect, dispatcher_detect) = tokio::join!(
        time_until(QUIET, || async {
            !fleet.agent_servers().await.contains_key(&id)
        }),
        time_until(QUIET, || async {
            let t = scrape(fleet.dispatcher.admin).await.unwrap_or_default();
            !t.is_empty() && servers(&t) < servers_before
        })
    );
    // Once both noticed, calls succeed again.
    let probes = Ledger::default();
    let c = Caller::new(fleet.front(), Some(CALLER_KEY));
    for _ in 0..10 {
        probes
            .call(&c, &format!("/relay/{TUNNEL_ID}/hello"), 3000, None)
            .await;
    }
    assert_eq!(probes.ok(), 10, "after detection: {}", probes.summary());
    fleet.servers[victim]
        .as_ref()
        .unwrap()
        .proc
        .signal("CONT")
        .unwrap();
    let tally = load.stop().await;
    eprintln!(
        "frozen {id} (agent streams before: {before:?}, heartbeat 1s): agent detected after {agent_detect:?}, dispatcher after {dispatcher_detect:?}; {}",
        tally.summary()
    );
    let agent_detect = agent_detect.expect("the agent never dropped the frozen server's streams");
    assert!(
        agent_detect <= 3 * HEARTBEAT + DETECT_SLACK,
        "frozen server found after {agent_detect:?}, bound is 3 heartbeats + {DETECT_SLACK:?}"
    );
    let dispatcher_detect =
        dispatcher_detect.expect("the dispatcher kept routing to the frozen server");
    assert!(
        dispatcher_detect <= LEASE + DETECT_SLACK,
        "the dispatcher dropped the frozen server after {dispatcher_detect:?}, bound is its \
         lease ({LEASE:?}) + {DETECT_SLACK:?}"
    );
    for (k, n) in tally.failures() {
        assert!(
            crash_answers(&k),
            "unexpected answer {k} x{n}: {}",
            tally.summary()
        );
    }
    // After SIGCONT no stream stays half-dead: the thawed server and the agent agree on
    // the streams between them (the agent may have reopened some there).
    eventually("streams agree after the thaw", QUIET, || async {
        let server = fleet.server_streams(victim).await.unwrap_or(-1.0);
        let agent = fleet.agent_servers().await.get(&id).map_or(0, |s| s.0) as f64;
        if server == agent {
            Ok(())
        } else {
            Err(format!(
                "server {id} holds {server} streams, the agent {agent}"
            ))
        }
    })
    .await;
    let sent = tally.sent() + probes.sent();
    // A call the dispatcher gave up on at its deadline while the server was frozen may
    // never have been read by it: the server read its request and its reset together after
    // the thaw, or neither.
    let abandoned = tally
        .failures()
        .get("504 deadline_exceeded")
        .copied()
        .unwrap_or(0);
    eventually("accounting after a freeze", QUIET, || {
        fleet.accounted_abandoning(sent, base, abandoned)
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_a_tunnel_server_process_without_failing_a_call() {
    let mut fleet = Fleet::start(2, Duration::from_secs(1), Duration::ZERO).await;
    let base = fleet.base().await;
    let load = start_load(
        fleet.front(),
        LoadSpec::new(6, format!("/relay/{TUNNEL_ID}/slow/200"), 10_000),
    );
    load.flowing(24, READY).await;
    let victim = fleet.busiest().await;
    let s = fleet.servers[victim].take().unwrap();
    let mut proc = s.proc;
    let started = Instant::now();
    proc.signal("TERM").unwrap();
    let status = proc.wait_exit(Duration::from_secs(15)).await.unwrap();
    let took = started.elapsed();
    let log = proc.log();
    // The load goes on on the remaining server.
    load.flowing(12, READY).await;
    let tally = load.stop().await;
    eprintln!(
        "SIGTERM: exited {status} after {took:?}; {}",
        tally.summary()
    );
    assert!(status.success(), "exit status {status}\n{log}");
    assert!(log.contains("draining"), "no drain in the log:\n{log}");
    assert_eq!(
        tally.failed(),
        0,
        "a drain failed calls: {}",
        tally.summary()
    );
    eventually("accounting after a drain", QUIET, || {
        fleet.accounted(tally.sent(), base)
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rolling_restart_of_every_tunnel_server_under_steady_load_fails_no_call() {
    let mut stack = Stack::builder()
        .servers(3)
        .placement(Policy::Uniform)
        .tunnel_config(|c| {
            c.shutdown_grace = Duration::from_secs(10);
            c.report_interval = Duration::from_millis(250);
        })
        .start()
        .await
        .unwrap();
    stack.wait_routable(READY).await.unwrap();
    let base = dispatcher_base(stack.dispatcher_admin).await;
    let load = start_load(
        stack.http,
        LoadSpec::new(8, format!("/relay/{TUNNEL_ID}/slow/100"), 10_000),
    );
    load.flowing(40, READY).await;
    let mut back = Vec::new();
    for i in 0..3 {
        // As an operator would: wait until the fleet is whole (every server reporting),
        // take the server out of the load balancer, SIGTERM it, wait for it to exit, start
        // the new version. The server may hold every one of the agent's streams: the agent
        // opens replacements elsewhere before it lets the draining ones go.
        let t = time_until(READY, || async {
            dispatcher_servers(stack.dispatcher_admin).await == 3.0
        })
        .await;
        back.push(t);
        assert!(t.is_some(), "fleet not whole before restarting server {i}");
        let s = stack.take_server(i).unwrap();
        s.shutdown().await;
        stack.start_server(i).await.unwrap();
        load.flowing(40, READY).await;
    }
    load.flowing(20, READY).await;
    let tally = load.stop().await;
    eprintln!(
        "rolling restart: fleet whole again before each step after {back:?}; {}",
        tally.summary()
    );
    assert_eq!(
        tally.failed(),
        0,
        "failed calls in a rolling restart: {}",
        tally.summary()
    );
    assert!(tally.ok() > 50, "{}", tally.summary());
    eventually("accounting after a rolling restart", QUIET, || {
        stack_accounted(&stack, tally.sent(), base)
    })
    .await;
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_restart_routes_again_within_a_bound_and_calls_between_get_503_with_retry_after() {
    let mut stack = Stack::builder().servers(2).start().await.unwrap();
    stack.wait_routable(READY).await.unwrap();
    let base = dispatcher_base(stack.dispatcher_admin).await;
    let load = start_load(
        stack.http,
        LoadSpec::new(4, format!("/relay/{TUNNEL_ID}/slow/50"), 5000),
    );
    load.flowing(30, READY).await;
    let agent = stack.take_agent(0).unwrap();
    agent.shutdown().await; // streams retire; calls in flight finish first
                            // With no agent, calls are answered at once with 503 and Retry-After, not held.
    let probes = Ledger::default();
    let caller = stack.caller();
    let gone = time_until(READY, || async {
        probes
            .call(&caller, &format!("/relay/{TUNNEL_ID}/hello"), 5000, None)
            .await;
        probes.failures().contains_key("503 tunnel_unavailable")
    })
    .await;
    assert!(
        gone.is_some(),
        "the tunnel id stayed routable: {}",
        probes.summary()
    );
    for _ in 0..5 {
        let t = Instant::now();
        probes
            .call(&caller, &format!("/relay/{TUNNEL_ID}/hello"), 5000, None)
            .await;
        assert!(
            t.elapsed() < Duration::from_secs(1),
            "a call without an agent was held {:?}",
            t.elapsed()
        );
    }
    stack.respawn_agent(0).await.unwrap();
    let restarted = Instant::now();
    let routable = time_until(READY, || async {
        probes
            .call(&caller, &format!("/relay/{TUNNEL_ID}/hello"), 5000, None)
            .await;
        probes.ok() > 0
    })
    .await;
    load.flowing(8, READY).await;
    let tally = load.stop().await;
    eprintln!(
        "agent restart: tunnel id routable again {routable:?} after the agent started ({:?} since); load {}; probes {}",
        restarted.elapsed(),
        tally.summary(),
        probes.summary()
    );
    let routable = routable.expect("the tunnel id never became routable again");
    assert!(
        routable < Duration::from_secs(5),
        "routable again only after {routable:?}"
    );
    for t in [&tally, &probes] {
        for (k, n) in t.failures() {
            assert_eq!(
                k,
                "503 tunnel_unavailable",
                "unexpected answer x{n}: {}",
                t.summary()
            );
        }
    }
    let sent = tally.sent() + probes.sent();
    eventually("accounting after an agent restart", QUIET, || {
        stack_accounted(&stack, sent, base)
    })
    .await;
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_failure_and_callers_leaving_each_get_one_outcome() {
    let mut stack = Stack::builder().servers(2).start().await.unwrap();
    stack.wait_routable(READY).await.unwrap();
    let base = dispatcher_base(stack.dispatcher_admin).await;
    let mut spec = LoadSpec::new(6, format!("/relay/{TUNNEL_ID}/slow/100"), 5000);
    spec.cancel_every = Some(4);
    spec.cancel_after = Duration::from_millis(40);
    let load = start_load(stack.http, spec);
    load.flowing(30, READY).await;
    // The upstream goes away (its port refuses connections), then comes back on it.
    let addr: SocketAddr = stack
        .upstream
        .url()
        .trim_start_matches("http://")
        .parse()
        .unwrap();
    let stand_in = Upstream::builder().spawn().await.unwrap();
    let old = std::mem::replace(&mut stack.upstream, stand_in);
    let cancelled_before = old.cancelled();
    old.shutdown().await;
    let unreachable = time_until(READY, || async {
        load.ledger()
            .failures()
            .keys()
            .any(|k| k.starts_with("502 upstream_unreachable"))
    })
    .await;
    let back = Upstream::builder()
        .spawn_on(TcpListener::bind(addr).await.unwrap())
        .unwrap();
    let _stand_in = std::mem::replace(&mut stack.upstream, back);
    let ok_before = load.ledger().ok();
    let recovered = time_until(READY, || async { load.ledger().ok() > ok_before + 20 }).await;
    let tally = load.stop().await;
    eprintln!(
        "upstream down and back, callers leaving: {}; upstream saw {} cancels before the outage",
        tally.summary(),
        cancelled_before
    );
    assert!(
        unreachable.is_some(),
        "no call saw the upstream down: {}",
        tally.summary()
    );
    assert!(
        recovered.is_some(),
        "calls did not recover: {}",
        tally.summary()
    );
    assert!(tally.caller_cancelled() > 0);
    for (k, n) in tally.failures() {
        assert!(
            k.starts_with("502 upstream_unreachable") || k.starts_with("502 upstream_error"),
            "unexpected answer {k} x{n}: {}",
            tally.summary()
        );
    }
    eventually(
        "accounting with upstream failures and cancels",
        QUIET,
        || stack_accounted(&stack, tally.sent(), base),
    )
    .await;
    let text = scrape(stack.dispatcher_admin).await.unwrap();
    assert!(
        metric(
            &text,
            "relay_dispatcher_calls_total",
            &[("outcome", "cancelled")]
        ) > 0.0,
        "the dispatcher counted no caller cancel:\n{text}"
    );
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_balancer_dropping_every_stream_leaves_no_call_unanswered() {
    let stack = Stack::builder()
        .servers(3)
        .placement(Policy::Uniform)
        .start()
        .await
        .unwrap();
    stack.wait_routable(READY).await.unwrap();
    let base = dispatcher_base(stack.dispatcher_admin).await;
    let load = start_load(
        stack.http,
        LoadSpec::new(8, format!("/relay/{TUNNEL_ID}/slow/100"), 5000),
    );
    load.flowing(40, READY).await;
    // The load balancer restarts: every stream through it is reset at once.
    let lb = stack.lb.as_ref().unwrap();
    for i in 0..3 {
        lb.reset_backend(i);
    }
    let reset = Instant::now();
    let ok_before = load.ledger().ok();
    let recovered = time_until(READY, || async { load.ledger().ok() > ok_before + 50 }).await;
    let tally = load.stop().await;
    eprintln!(
        "load balancer reset: calls flowing again after {recovered:?} ({:?}); {}",
        reset.elapsed(),
        tally.summary()
    );
    assert!(
        recovered.is_some(),
        "calls did not resume: {}",
        tally.summary()
    );
    for (k, n) in tally.failures() {
        assert!(
            crash_answers(&k),
            "unexpected answer {k} x{n}: {}",
            tally.summary()
        );
    }
    eventually("accounting after a load balancer reset", QUIET, || {
        stack_accounted(&stack, tally.sent(), base)
    })
    .await;
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silently_dropped_connection_is_found_on_both_ends() {
    let server_addr = relay_tests::procs::free_addr().unwrap();
    let hole = Blackhole::start(server_addr).await;
    let hole_url = format!("http://{}", hole.addr);
    let stack = Stack::builder()
        .servers(1)
        .server_agent_addrs(vec![server_addr])
        .tunnel_config(|c| c.heartbeat = Duration::from_secs(1))
        .agent_config(move |c| {
            c.tunnels = vec![hole_url];
            c.connect_timeout = Duration::from_secs(2);
        })
        .start()
        .await
        .unwrap();
    stack.wait_routable(READY).await.unwrap();
    let base = dispatcher_base(stack.dispatcher_admin).await;
    let load = start_load(
        stack.http,
        LoadSpec::new(2, format!("/relay/{TUNNEL_ID}/slow/50"), 4000),
    );
    load.flowing(16, READY).await;
    let server = stack.servers[0].as_ref().unwrap();
    let before = value(
        &server.registry,
        "relay_tunnel_streams",
        &[("tunnel_id", TUNNEL_ID)],
    );
    let all_closes = || value(&server.registry, "relay_tunnel_stream_closes_total", &[]);
    let closed_before = all_closes();
    hole.drop_open_connections();
    // Server side: every stream on the dead connection is dropped (the connection's
    // keep-alive PING goes unanswered, or the streams' heartbeats do).
    let server_found = time_until(QUIET, || async { all_closes() - closed_before >= before }).await;
    // Agent side: calls flow again on fresh streams over a new connection.
    let ok_before = load.ledger().ok();
    let flowing = time_until(QUIET, || async { load.ledger().ok() > ok_before + 20 }).await;
    let tally = load.stop().await;
    eprintln!(
        "silent drop (heartbeat 1s, {before} streams): server dropped them after {server_found:?}, calls flowing again after {flowing:?}; {}",
        tally.summary()
    );
    let server_found = server_found.expect("the server kept streams on a dead connection");
    assert!(
        server_found <= Duration::from_secs(3 + 2),
        "found after {server_found:?}"
    );
    let flowing = flowing.expect("the agent did not reconnect");
    assert!(
        flowing <= Duration::from_secs(3 + 5),
        "calls flowing only after {flowing:?}"
    );
    for (k, n) in tally.failures() {
        assert!(
            crash_answers(&k),
            "unexpected answer {k} x{n}: {}",
            tally.summary()
        );
    }
    // No half-dead stream: what the server holds is what the agent holds.
    eventually("server and agent agree on streams", QUIET, || async {
        let server = value(
            &server.registry,
            "relay_tunnel_streams",
            &[("tunnel_id", TUNNEL_ID)],
        );
        let agent = stack.agent(0).unwrap().coverage().borrow().streams_total as f64;
        (server == agent)
            .then_some(())
            .ok_or(format!("server holds {server} streams, agent {agent}"))
    })
    .await;
    eventually("accounting after a silent drop", QUIET, || {
        stack_accounted(&stack, tally.sent(), base)
    })
    .await;
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_agent_process_fails_only_its_calls_in_progress_frees_its_streams_and_routes_again_after_restart(
) {
    let mut fleet = Fleet::start(2, HEARTBEAT, Duration::ZERO).await;
    let base = fleet.base().await;
    let workers = 6;
    let load = start_load(
        fleet.front(),
        LoadSpec::new(workers, format!("/relay/{TUNNEL_ID}/slow/200"), 5000),
    );
    load.flowing(4 * workers as u64, READY).await; // steady state before the fault
    let held = fleet.server_streams_total().await;
    assert!(
        held.is_some_and(|n| n > 0.0),
        "the servers hold its streams"
    );
    fleet.agent.proc.kill();
    // The servers free its streams: its connections closed with the process.
    let freed = time_until(QUIET, || async {
        fleet.server_streams_total().await == Some(0.0)
    })
    .await;
    // Callers are told at once that no agent is there (the tally marks a 503 without
    // Retry-After as such).
    let told = time_until(READY, || async {
        load.ledger()
            .failures()
            .keys()
            .any(|k| k.starts_with("503 tunnel_unavailable"))
    })
    .await;
    fleet.restart_agent().await;
    let restarted = Instant::now();
    let ok_before = load.ledger().ok();
    let routable = time_until(READY, || async { load.ledger().ok() > ok_before + 20 }).await;
    let tally = load.stop().await;
    eprintln!(
        "agent SIGKILL ({held:?} streams on the servers): freed after {freed:?}, callers told \
         after {told:?}, calls flowing {routable:?} after the restart ({:?} since); {}",
        restarted.elapsed(),
        tally.summary()
    );
    // Its connections closed with it: the servers free the streams at once, not after the
    // heartbeat (3 silent periods) that finds an agent whose connection stays open.
    let freed = freed.expect("the servers kept the killed agent's streams");
    assert!(
        freed <= HEARTBEAT,
        "the servers freed the killed agent's streams after {freed:?}, bound is one \
         heartbeat ({HEARTBEAT:?}): they found it by heartbeat, not by its closed connection"
    );
    assert!(
        told.is_some(),
        "no caller got 503 tunnel_unavailable: {}",
        tally.summary()
    );
    assert!(
        routable.is_some(),
        "calls did not flow again after the agent restarted: {}",
        tally.summary()
    );
    // Only the calls it had taken are lost; the rest are told to come back later.
    let failures = tally.failures();
    for (k, n) in &failures {
        assert!(
            k == "502 stream_lost" || k == "503 tunnel_unavailable",
            "unexpected answer {k} x{n}: {}",
            tally.summary()
        );
    }
    let lost = failures.get("502 stream_lost").copied().unwrap_or(0);
    assert!(
        lost <= workers as u64,
        "more calls lost ({lost}) than were in progress: {}",
        tally.summary()
    );
    eventually("accounting after an agent SIGKILL", QUIET, || {
        fleet.accounted(tally.sent(), base)
    })
    .await;
}

/// HAProxy's checks in the SIGKILL test below: those of `examples/haproxy/haproxy.cfg`.
/// With them HAProxy keeps placing new streams on a dead server for up to `fall` x
/// `inter` (4 s), and holds each such open for its connect retries (3, a second apart)
/// before it answers 503: the agent hears of those failed opens 3 to 7 s after the crash.
const DEAD_SERVER_PLACED_FOR: Duration = Duration::from_secs(4);
const HAPROXY_RETRIES_TAKE: Duration = Duration::from_secs(3);

/// How soon the agent covers the servers left after a crash: opens placed on the dead
/// server count as opening until HAProxy fails them, so growth there may wait for that
/// (plus a sizing tick and a margin).
const COVERED_AFTER_CRASH: Duration =
    Duration::from_secs(DEAD_SERVER_PLACED_FOR.as_secs() + HAPROXY_RETRIES_TAKE.as_secs() + 1);

/// How soon the agent covers servers whose load just grew, once the load balancer knows
/// the dead server (also while failed opens keep coming back from it): a few sizing ticks
/// (growth doubles per tick), as without a fault.
const COVERED_AFTER_GROWTH: Duration = Duration::from_secs(5);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkilled_server_behind_haproxy_fails_only_its_calls_and_growth_elsewhere_does_not_stall()
{
    // HAProxy between the agent and three servers, checking each server's /readyz as the
    // example config does; the agent backs off failed opens as in production (200 ms
    // doubling to 30 s).
    let mut o = FleetOpts::new(3, HEARTBEAT, Duration::ZERO);
    o.haproxy = Some(Checks::example());
    o.agent_backoff = (Duration::from_millis(200), Duration::from_secs(30));
    let mut fleet = Fleet::start_with(o).await;
    let workers = 8;
    let load = start_load(
        fleet.front(),
        LoadSpec::new(workers, format!("/relay/{TUNNEL_ID}/slow/100"), 10_000),
    );
    // Steady state before the fault: every server holds streams and is covered.
    let all: Vec<String> = fleet
        .servers
        .iter()
        .flatten()
        .map(|s| s.server_id.clone())
        .collect();
    let steady = time_until(READY, || fleet.agent_covers(&all, None, 0)).await;
    assert!(
        steady.is_some(),
        "the agent never covered every server: {:?}",
        fleet.agent_servers().await
    );
    let victim = fleet.busiest().await;
    let before = fleet.agent_servers().await;
    let failed_opens = |f: &Fleet| {
        f.agent
            .proc
            .log()
            .matches("tunnel stream open failed")
            .count()
    };
    let failed_before = failed_opens(&fleet);
    let s = fleet.servers[victim].take().unwrap();
    let id = s.server_id.clone();
    let mut proc = s.proc;
    proc.kill();
    // A call that left for the dead server before the dispatcher saw its connections close
    // may have reached its agent, as a call in progress may: both are answered stream_lost
    // (`load` below). The calls that must all succeed start once the dispatcher dropped it.
    let left = fleet.servers.iter().flatten().count() as f64;
    relay_tests::eventually(
        "the dispatcher dropped the killed server",
        READY,
        || async { dispatcher_servers(fleet.dispatcher.admin).await == left },
    )
    .await;
    let healthy: Vec<String> = fleet
        .servers
        .iter()
        .flatten()
        .map(|s| s.server_id.clone())
        .collect();
    // The dead server's share moves to the servers left, and more calls arrive: they
    // grow while HAProxy still places opens on the dead server.
    let more = start_load(
        fleet.front(),
        LoadSpec::new(2 * workers, format!("/relay/{TUNNEL_ID}/slow/100"), 10_000),
    );
    let first = time_until(QUIET, || fleet.agent_covers(&healthy, Some(&id), 0)).await;
    // The load grows again just as the opens HAProxy placed on the dead server come back
    // failed, one after another (3 to 7 s after the crash): growth must go on through the
    // load balancer, not wait behind the open backoff those failures start.
    let failing = time_until(COVERED_AFTER_CRASH, || async {
        failed_opens(&fleet) > failed_before
    })
    .await;
    // Slow calls (1 s), so that they are all in flight at once: the agent must hold a
    // stream for each of them on the servers left.
    let slow = 6 * workers;
    let burst = start_load(
        fleet.front(),
        LoadSpec::new(slow, format!("/relay/{TUNNEL_ID}/slow/1000"), 10_000),
    );
    let second = time_until(QUIET, || {
        fleet.agent_covers(&healthy, Some(&id), (slow * 9 / 10) as u64)
    })
    .await;
    let after = fleet.agent_servers().await;
    let ok_before = burst.ledger().ok();
    let flowing = time_until(READY, || async {
        burst.ledger().ok() >= ok_before + slow as u64
    })
    .await;
    let burst = burst.stop().await;
    let more = more.stop().await;
    let tally = load.stop().await;
    let failed_opens = failed_opens(&fleet);
    eprintln!(
        "SIGKILL {id} behind haproxy (agent streams {before:?}): servers left covered after \
         {first:?}, first failed open back {failing:?} after that, after the second step \
         after {second:?} ({after:?}); {failed_opens} backoff steps; calls in progress at the kill: {}; started after it: {}; second step: {}",
        tally.summary(),
        more.summary(),
        burst.summary()
    );
    for (step, t, bound) in [
        ("the crash", first, COVERED_AFTER_CRASH),
        ("the load grew", second, COVERED_AFTER_GROWTH),
    ] {
        let t = t.unwrap_or_else(|| {
            panic!(
                "the agent did not cover the servers left after {step}: {after:?}\n{}",
                fleet.agent.proc.log_tail(30)
            )
        });
        assert!(
            t <= bound,
            "the servers left were covered only {t:?} after {step} (bound {bound:?}): \
             growth stalled\n{}",
            fleet.agent.proc.log_tail(30)
        );
    }
    assert!(flowing.is_some(), "calls stopped: {}", burst.summary());
    // Calls started once the dispatcher dropped the dead server all succeed: new calls go
    // to live servers, and the servers left grow instead of queueing them into
    // `no_capacity`.
    for t in [&more, &burst] {
        assert_eq!(
            t.failed(),
            0,
            "a call started after the kill failed: {}",
            t.summary()
        );
    }
    // Of the calls running at the kill (or sent before the dispatcher saw it), only those
    // on the dead server fail, as stream_lost, at most one per caller.
    for (k, n) in tally.failures() {
        assert_eq!(k, "502 stream_lost", "x{n}: {}", tally.summary());
    }
    assert!(
        tally.failed() <= workers as u64,
        "more failures than calls in progress: {}",
        tally.summary()
    );
}

/// How long after a restarted dispatcher listens again the tunnel servers report to it at
/// the latest (docs/operations.md: their report stream retries back off to 1 s, with
/// up to 25% jitter).
const REPORT_RETRY_MAX: Duration = Duration::from_millis(1250);

/// A dispatcher SIGKILLed and started again on its ports, twice: after the first, long
/// outage the servers' report retries have backed off to their cap; the second outage is
/// short. After each, the servers report again and calls route within
/// [`REPORT_RETRY_MAX`] (plus [`DETECT_SLACK`]) of the dispatcher being up.
async fn dispatcher_crash_and_restart(registry: String) {
    let mut o = FleetOpts::new(2, HEARTBEAT, Duration::ZERO);
    o.dispatcher.registry = registry;
    let mut fleet = Fleet::start_with(o).await;
    for (round, down) in [Duration::from_secs(4), Duration::from_millis(300)]
        .into_iter()
        .enumerate()
    {
        fleet.crash_dispatcher(down).await;
        let (reported, routed) = tokio::join!(
            time_until(QUIET, || async { fleet.reporting_locally().await == 2 }),
            time_until(QUIET, || fleet.probe())
        );
        eprintln!(
            "dispatcher crash {} (down {down:?}): both servers report again after {reported:?}, \
             calls route after {routed:?} (from the restarted dispatcher answering /healthz)",
            round + 1
        );
        let bound = REPORT_RETRY_MAX + DETECT_SLACK;
        let reported = reported.expect("the servers never reported to the restarted dispatcher");
        assert!(
            reported <= bound,
            "crash {}: the servers reported again after {reported:?}, bound {bound:?}\n{}",
            round + 1,
            fleet.servers[0].as_ref().unwrap().proc.log_tail(10)
        );
        let routed = routed.expect("calls never routed through the restarted dispatcher");
        assert!(
            routed <= bound,
            "crash {}: calls routed again after {routed:?}, bound {bound:?}",
            round + 1
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crashed_dispatcher_with_the_memory_registry_routes_again_within_the_report_retry_bound() {
    dispatcher_crash_and_restart(String::new()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crashed_dispatcher_with_the_redis_registry_routes_again_within_the_report_retry_bound() {
    // A shared instance (scripts/test exports one) is fine here: the key prefix is unique.
    let mut _own = None;
    let url = match std::env::var("RELAY_TEST_REDIS_URL") {
        Ok(u) if !u.is_empty() => u,
        _ => {
            require_redis("crashed_dispatcher_with_the_redis_registry_routes_again");
            let r = RedisServer::start().await;
            let url = r.url();
            _own = Some(r);
            url
        }
    };
    let prefix = format!("relay-test-dispatcher-crash-{}", std::process::id());
    dispatcher_crash_and_restart(format!(
        "backend = \"redis\"\nurl = {url:?}\nkey_prefix = {prefix:?}\n\
         record_key = \"test-record-key-0123456789abcdef-0123456789\"\n"
    ))
    .await;
}

// ---------------------------------------------------------------------------------------
// Soak

/// The soak agent's `retire_min_age` and `retire_unused`, in seconds.
const RETIRE_SECS: u64 = 3;

/// Steady load on a fleet of child processes with a fault every `period` on ts-2 or ts-3:
/// killed and restarted, then drained and restarted, in turn. ts-1 runs through every
/// fault, so its memory, like the dispatcher's and the agent's, is measured over the
/// whole soak; an unreadable `/proc` fails the test.
///
/// The agent retires an idle stream after 3 s unused (600 s by default), so the streams a
/// fault made it grow elsewhere are pruned within the soak: flat streams means the count
/// comes back to its warm level once the last fault has healed, not that it never rises.
async fn soak(total: Duration, period: Duration) {
    let mut o = FleetOpts::new(3, Duration::from_secs(2), Duration::ZERO);
    o.agent_extra = format!(
        "[coverage]\nretire_min_age = \"{RETIRE_SECS}s\"\nretire_unused = \"{RETIRE_SECS}s\"\n"
    );
    let mut fleet = Fleet::start_with(o).await;
    let base = fleet.base().await;
    let load = start_load(
        fleet.front(),
        LoadSpec::new(6, format!("/relay/{TUNNEL_ID}/slow/20"), 5000),
    );
    let rss = |f: &Fleet| {
        let read = |p: &relay_tests::procs::Proc| p.rss_kib().unwrap_or_else(|e| panic!("{e:#}"));
        let ts1 = f.servers[0].as_ref().expect("ts-1 runs through the soak");
        (
            read(&f.dispatcher.proc),
            read(&f.agent.proc),
            read(&ts1.proc),
        )
    };
    let agent_streams = |t: &str| metric(t, "grpc_tunnel_server_streams", &[]);
    // Warm-up: allocators and pools reach their working size over the first calls.
    load.flowing(1000, READY).await;
    let (d0, a0, t0) = rss(&fleet);
    let s0 = agent_streams(&fleet.agent_metrics().await);
    eprintln!("soak warm: dispatcher {d0} KiB, agent {a0} KiB, ts-1 {t0} KiB, agent streams {s0}");
    let started = Instant::now();
    let mut n = 0usize;
    let mut max_streams = s0;
    // The soak's schedule: a fault every `period`, in the middle of it, under steady load.
    while started.elapsed() + period <= total {
        tokio::time::sleep_until(started + period * n as u32 + period / 2).await;
        let i = 1 + (n / 2) % 2;
        let s = fleet.servers[i].take().unwrap();
        let mut proc = s.proc;
        if n.is_multiple_of(2) {
            proc.kill();
        } else {
            proc.signal("TERM").unwrap();
            let status = proc.wait_exit(Duration::from_secs(15)).await.unwrap();
            assert!(status.success(), "drain exit {status}");
        }
        fleet.restart(i).await;
        fleet.wait_covered(3).await;
        n += 1;
        max_streams = max_streams.max(agent_streams(&fleet.agent_metrics().await));
        let (d, a, t) = rss(&fleet);
        eprintln!(
            "soak t={:.0}s fault {n} ({}) on ts-{}: dispatcher {d} KiB, agent {a} KiB, ts-1 {t} KiB; {}",
            started.elapsed().as_secs_f64(),
            if n % 2 == 1 { "kill" } else { "drain" },
            i + 1,
            load.ledger().summary()
        );
        load.flowing(20, READY).await;
    }
    tokio::time::sleep_until(started + period * n as u32).await;
    let (d1, a1, t1) = rss(&fleet);
    // Streams grown for the last fault are retired once unused for RETIRE_SECS (and not
    // while any server is short): wait for the count to come back, under the same load.
    let bound = (s0 * 1.5).max(s0 + 4.0);
    time_until(QUIET, || async {
        agent_streams(&fleet.agent_metrics().await) <= bound
    })
    .await;
    let s1 = agent_streams(&fleet.agent_metrics().await);
    let tally = load.stop().await;
    eprintln!(
        "soak end after {:.0}s and {n} faults: dispatcher {d0} -> {d1} KiB, agent {a0} -> {a1} KiB, ts-1 {t0} -> {t1} KiB, agent streams {s0} -> {s1} (max {max_streams}); {}",
        started.elapsed().as_secs_f64(),
        tally.summary()
    );
    for (k, c) in tally.failures() {
        assert!(
            crash_answers(&k),
            "unexpected answer {k} x{c}: {}",
            tally.summary()
        );
    }
    // Flat: within 1.5x of warm (plus 4 MiB of allocator slack on small figures).
    assert!(
        d1 <= d0 * 3 / 2 + 4096,
        "dispatcher memory grew {d0} -> {d1} KiB"
    );
    assert!(
        a1 <= a0 * 3 / 2 + 4096,
        "agent memory grew {a0} -> {a1} KiB"
    );
    assert!(
        t1 <= t0 * 3 / 2 + 4096,
        "tunnel server ts-1 memory grew {t0} -> {t1} KiB"
    );
    assert!(
        s1 <= bound,
        "agent streams grew {s0} -> {s1} and stayed above {bound} for {QUIET:?} after the last fault"
    );
    eventually("accounting after the soak", QUIET, || {
        fleet.accounted(tally.sent(), base)
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn soak_with_periodic_faults_keeps_memory_and_streams_flat_and_answers_every_call() {
    soak(Duration::from_secs(60), Duration::from_secs(10)).await;
}

/// The long soak, by hand: `SOAK_SECS=1800 cargo test -p relay-tests --test reliability
/// long_soak -- --ignored --nocapture`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "long; run by hand with SOAK_SECS"]
async fn long_soak() {
    let secs = std::env::var("SOAK_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(600);
    soak(Duration::from_secs(secs), Duration::from_secs(20)).await;
}
