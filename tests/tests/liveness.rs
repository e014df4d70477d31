//! Silence is a fault, found in seconds: a path that stops carrying bytes while its
//! connections stay open (a partition, a NAT or load balancer that lost the flow) is found
//! by HTTP/2 PINGs within `keepalive_interval + keepalive_timeout` (2.75 s by default) on both
//! ends. The calls an agent had taken on it end then with a clear 502 `stream_lost`, the
//! calls that come later go to the servers the agent still reaches, and the lost server is
//! filled back to its reserve once it answers again.

use relay_tests::fault::Forwarder;
use relay_tests::haproxy::{Backend, Haproxy};
use relay_tests::load::{self, LoadSpec};
use relay_tests::metrics::value;
use relay_tests::stack::{Stack, TUNNEL_ID};
use std::net::SocketAddr;
use std::time::Duration;
use tokio::time::Instant;

/// The simulated upstream's answer time.
const CALL_TIME: Duration = Duration::from_millis(50);
/// How long the path stays silent.
const PARTITION: Duration = Duration::from_secs(10);
/// The default HTTP/2 keep-alive: a PING after 750 ms without a frame, 2 s to answer it;
/// the tunnel servers' liveness pings alike.
const DETECTION: Duration = Duration::from_millis(2750);
/// Slack for the test's own polling and a busy machine.
const SLACK: Duration = Duration::from_millis(500);

/// Which of two servers carries the load's calls (the tunnel id's home): waits until
/// one of them carried 20 more calls than when asked.
async fn busy_one(regs: [&prometheus::Registry; 2]) -> usize {
    let calls = |r: &prometheus::Registry| value(r, "relay_tunnel_calls_total", &[]);
    let before = [calls(regs[0]), calls(regs[1])];
    relay_tests::eventually(
        "a server carries the calls",
        Duration::from_secs(20),
        || {
            let now = [calls(regs[0]), calls(regs[1])];
            let busy = (0..2).find(|&i| now[i] > before[i] + 20.0);
            async move { busy.ok_or_else(|| format!("calls so far: {now:?}")) }
        },
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_partition_of_one_server_is_found_in_seconds_and_costs_only_the_calls_it_held() {
    // The agent reaches each server through a forwarder of its own; the one in front of
    // the server carrying the calls goes silent.
    let listeners: Vec<std::net::TcpListener> = (0..2)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0").unwrap())
        .collect();
    let mut paths = Vec::new();
    for l in &listeners {
        paths.push(Forwarder::start(l.local_addr().unwrap()).await.unwrap());
    }
    let urls: Vec<String> = paths.iter().map(Forwarder::url).collect();
    let reserve = relay_agent::coverage::plan::CoverageConfig::default().reserve as f64;
    let stack = Stack::builder()
        .servers(2)
        .server_agent_listeners(listeners)
        .upstream_latency(CALL_TIME)
        .agent_config(move |c| c.tunnels = urls)
        .start()
        .await
        .unwrap();
    stack.wait_routable(Duration::from_secs(20)).await.unwrap();
    let registry = |i: usize| stack.servers[i].as_ref().unwrap().registry.clone();
    let regs = [registry(0), registry(1)];
    let streams =
        |r: &prometheus::Registry| value(r, "relay_tunnel_streams", &[("tunnel_id", TUNNEL_ID)]);

    let load = load::start(
        stack.caller(),
        LoadSpec::new(50, format!("/relay/{TUNNEL_ID}/hello"), 20_000),
    );
    // The server the calls go to is the one whose path goes silent.
    let busy = busy_one([&regs[0], &regs[1]]).await;
    let (r1, path) = (regs[busy].clone(), &paths[busy]);

    path.silence();
    let t0 = Instant::now();
    let found = relay_tests::time_until(PARTITION, || async { streams(&r1) == 0.0 }).await;
    let found = found.unwrap_or_else(|| {
        panic!(
            "the silent server still holds {} streams of its path after {PARTITION:?}",
            streams(&r1)
        )
    });
    eprintln!("the silent path was found after {found:?}");
    assert!(
        found <= DETECTION + SLACK,
        "the silent path was found after {found:?} (keep-alive: {DETECTION:?})"
    );
    // The agent covers the server it reaches: calls keep flowing meanwhile.
    tokio::time::sleep_until(t0 + PARTITION).await;
    path.heal();
    let back = relay_tests::time_until(Duration::from_secs(30), || async {
        streams(&r1) >= reserve
    })
    .await;
    let ledger = load.stop().await;
    let back = back.expect("the silent server was not filled back after the heal");
    eprintln!(
        "the silent server back at its reserve {back:?} after the heal; {}",
        ledger.summary()
    );
    assert!(
        back <= Duration::from_secs(5),
        "the silent server back at its reserve only {back:?} after the heal"
    );

    let detected = t0 + found;
    for call in ledger.calls() {
        let ended = call.sent_at + call.took;
        if call.sent_at < detected {
            // Calls in flight when the path went silent end by the time it is found.
            if call.status != 200 {
                assert!(
                    call.code == "stream_lost",
                    "a call held on the silent path ended with {} ({})",
                    call.status,
                    call.code
                );
                assert!(
                    ended <= detected + SLACK,
                    "a call held on the silent path ended {:?} after the path was found",
                    ended - detected
                );
            }
        } else {
            // Calls after the path was found all succeed within their call time plus 1 s.
            assert_eq!(
                call.status,
                200,
                "a call {:?} after the path was found failed ({})",
                call.sent_at - detected,
                call.code
            );
            assert!(
                call.took <= CALL_TIME + Duration::from_secs(1),
                "a call {:?} after the path was found took {:?}",
                call.sent_at - detected,
                call.took
            );
        }
    }
    stack.shutdown().await;
}

/// Two tunnel servers behind a real HAProxy (HTTP/2 both sides, `mode http`: it answers
/// HTTP/2 PINGs itself). `agent_path`: the agent reaches HAProxy through a forwarder (the
/// one returned); else HAProxy reaches each server through a forwarder of its own (both
/// returned, in server order).
async fn behind_haproxy(agent_path: bool) -> (Stack, Haproxy, Vec<Forwarder>) {
    let listeners: Vec<std::net::TcpListener> = (0..2)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0").unwrap())
        .collect();
    let addrs: Vec<SocketAddr> = listeners.iter().map(|l| l.local_addr().unwrap()).collect();
    let mut server_paths = Vec::new();
    if !agent_path {
        for a in &addrs {
            server_paths.push(Forwarder::start(*a).await.unwrap());
        }
    }
    let backends = (0..2)
        .map(|i| Backend {
            name: format!("ts-{}", i + 1),
            addr: server_paths.get(i).map_or(addrs[i], Forwarder::addr),
            admin: None,
            weight: 50,
            disabled: false,
        })
        .collect();
    let haproxy = Haproxy::start(backends).await.unwrap();
    let haproxy_addr: SocketAddr = haproxy.url().trim_start_matches("http://").parse().unwrap();
    let (paths, url) = if agent_path {
        let f = Forwarder::start(haproxy_addr).await.unwrap();
        let url = f.url();
        (vec![f], url)
    } else {
        (server_paths, haproxy.url())
    };
    let stack = Stack::builder()
        .servers(2)
        .server_agent_listeners(listeners)
        .upstream_latency(CALL_TIME)
        .agent_config(move |c| c.tunnels = vec![url])
        .start()
        .await
        .unwrap();
    stack.wait_routable(Duration::from_secs(30)).await.unwrap();
    (stack, haproxy, paths)
}

/// Checks the calls of `ledger` against a silence that began at `t0` and was found at
/// `found`, when the silent path was the only one to the agent: a call that failed was
/// held on the path (`stream_lost`) or waited for a stream there (then no server had one
/// left: `tunnel_unavailable` or `no_capacity`), and it ended by the time the silence was
/// found; later calls find no stream at once.
fn calls_held_on_the_path_ended_when_it_was_found(
    ledger: &relay_tests::load::Ledger,
    t0: Instant,
    found: Duration,
) {
    let no_stream = |code: &str| code == "tunnel_unavailable" || code == "no_capacity";
    for call in ledger.calls() {
        if call.status == 200 {
            continue;
        }
        let ended = call.sent_at + call.took;
        if call.sent_at < t0 + found {
            assert!(
                call.code == "stream_lost" || no_stream(&call.code),
                "a call held on the silent path ended with {} ({})",
                call.status,
                call.code
            );
            assert!(
                ended <= t0 + found + SLACK,
                "a call held on the silent path ended {:?} after the silence began",
                ended - t0
            );
        } else {
            assert!(
                no_stream(&call.code),
                "a call after the silence was found ended with {} ({})",
                call.status,
                call.code
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn behind_an_l7_load_balancer_a_silent_agent_is_found_by_the_servers_in_seconds() {
    let (stack, _haproxy, paths) = behind_haproxy(true).await;
    let path = &paths[0];
    let regs: Vec<prometheus::Registry> = (0..2)
        .map(|i| stack.servers[i].as_ref().unwrap().registry.clone())
        .collect();
    let streams = || -> f64 {
        regs.iter()
            .map(|r| value(r, "relay_tunnel_streams", &[("tunnel_id", TUNNEL_ID)]))
            .sum()
    };
    let load = load::start(
        stack.caller(),
        LoadSpec::new(20, format!("/relay/{TUNNEL_ID}/hello"), 20_000),
    );
    load.flowing(100, Duration::from_secs(20)).await;
    path.silence();
    let t0 = Instant::now();
    // HAProxy answers both ends' PINGs and keeps the streams open: only the servers'
    // liveness pings, which cross it, find the agent gone.
    let found = relay_tests::time_until(Duration::from_secs(10), || async { streams() == 0.0 })
        .await
        .unwrap_or_else(|| panic!("the servers still hold {} streams", streams()));
    eprintln!("the servers dropped the silent agent's streams after {found:?}");
    assert!(found <= DETECTION + SLACK, "found after {found:?}");
    let silent: f64 = regs
        .iter()
        .map(|r| value(r, "relay_tunnel_silent_connections_total", &[]))
        .sum();
    assert!(silent >= 1.0, "no connection was closed for silence");
    let ledger = load.stop().await;
    calls_held_on_the_path_ended_when_it_was_found(&ledger, t0, found);
    path.heal();
    stack.wait_routable(Duration::from_secs(30)).await.unwrap();
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn behind_an_l7_load_balancer_a_silent_server_is_found_by_the_agent_in_seconds() {
    let (stack, _haproxy, paths) = behind_haproxy(false).await;
    let regs: Vec<prometheus::Registry> = (0..2)
        .map(|i| stack.servers[i].as_ref().unwrap().registry.clone())
        .collect();
    let load = load::start(
        stack.caller(),
        LoadSpec::new(20, format!("/relay/{TUNNEL_ID}/hello"), 20_000),
    );
    // The server carrying the calls is the one whose path from HAProxy goes silent.
    let busy = busy_one([&regs[0], &regs[1]]).await;
    let path = &paths[busy];
    let agent = stack.agent(0).unwrap().coverage();
    let id1 = stack.server_id(busy).unwrap().to_string();
    let agent_streams_at_1 = || {
        agent
            .borrow()
            .servers
            .iter()
            .filter(|s| s.server_id == id1)
            .map(|s| s.streams)
            .sum::<u32>()
    };
    relay_tests::eventually(
        "the agent holds streams at the busy server",
        Duration::from_secs(20),
        || {
            let held = agent_streams_at_1() > 0;
            async move { held }
        },
    )
    .await;
    path.silence();
    let t0 = Instant::now();
    // HAProxy keeps the agent's streams to server 1 open (nothing tells it the path is
    // gone): only the server's liveness pings stopping tell the agent.
    let found = relay_tests::time_until(Duration::from_secs(10), || async {
        agent_streams_at_1() == 0
    })
    .await
    .unwrap_or_else(|| {
        panic!(
            "the agent still holds {} streams at the silent server",
            agent_streams_at_1()
        )
    });
    eprintln!("the agent closed its streams at the silent server after {found:?}");
    assert!(found <= DETECTION + SLACK, "found after {found:?}");
    let ledger = load.stop().await;
    // Server 1 found the silence on its own connection from HAProxy too (HTTP/2 PINGs).
    for call in ledger.calls() {
        if call.status != 200 && call.sent_at < t0 {
            assert_eq!(call.code, "stream_lost");
            let ended = call.sent_at + call.took;
            assert!(
                ended <= t0 + DETECTION + SLACK,
                "ended {:?} after",
                ended - t0
            );
        }
    }
    path.heal();
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_path_from_the_dispatcher_to_a_server_is_found_in_seconds_and_calls_go_elsewhere()
{
    // The dispatcher reaches each server through a forwarder of its own; the one in front
    // of the server carrying the calls goes silent.
    let mut builder = Stack::builder().servers(2).upstream_latency(CALL_TIME);
    let mut paths = Vec::new();
    for i in 0..2 {
        let forward = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let path = Forwarder::start(forward.local_addr().unwrap())
            .await
            .unwrap();
        builder = builder.server_forward_listener(i, forward, path.url());
        paths.push(path);
    }
    let stack = builder.start().await.unwrap();
    stack.wait_routable(Duration::from_secs(20)).await.unwrap();
    let regs: Vec<prometheus::Registry> = (0..2)
        .map(|i| stack.servers[i].as_ref().unwrap().registry.clone())
        .collect();
    let load = load::start(
        stack.caller(),
        LoadSpec::new(50, format!("/relay/{TUNNEL_ID}/hello"), 20_000),
    );
    let path = &paths[busy_one([&regs[0], &regs[1]]).await];
    path.silence();
    let t0 = Instant::now();
    let admin = stack.dispatcher_admin;
    let down = || async move {
        let text = relay_tests::procs::scrape(admin)
            .await
            .expect("the dispatcher's /metrics answers");
        relay_tests::procs::series(&text, "relay_dispatcher_forward_servers_down", &[])
            .expect("the dispatcher exports relay_dispatcher_forward_servers_down")
    };
    let found = relay_tests::time_until(PARTITION, || async { down().await == 1.0 })
        .await
        .expect("the dispatcher did not find the silent path");
    eprintln!("the dispatcher found the silent path after {found:?}");
    assert!(found <= DETECTION + SLACK, "found after {found:?}");
    tokio::time::sleep_until(t0 + PARTITION).await;
    path.heal();
    let healed = Instant::now();
    relay_tests::eventually(
        "the dispatcher finds the server again after the heal",
        Duration::from_secs(10),
        || async { down().await == 0.0 },
    )
    .await;
    let ledger = load.stop().await;
    eprintln!("{}", ledger.summary());
    let found = t0 + found;
    for call in ledger.calls() {
        let ended = call.sent_at + call.took;
        if call.sent_at < found {
            // Held on the silent path: lost (the agent may have taken them), when found.
            if call.status != 200 {
                assert_eq!(
                    call.code, "stream_lost",
                    "a call held on the silent path ended with {}",
                    call.status
                );
                assert!(
                    ended <= found + SLACK,
                    "a call held on the silent path ended {:?} after it was found",
                    ended - found
                );
            }
        } else if call.sent_at < healed {
            assert_eq!(
                call.status,
                200,
                "a call {:?} after the silence was found failed ({})",
                call.sent_at - found,
                call.code
            );
            assert!(
                call.took <= CALL_TIME + Duration::from_secs(1),
                "a call {:?} after the silence was found took {:?}",
                call.sent_at - found,
                call.took
            );
        }
    }
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_answer_while_the_server_has_nothing_to_send_is_not_taken_for_silence() {
    let stack = Stack::builder().servers(1).start().await.unwrap();
    stack.wait_routable(Duration::from_secs(20)).await.unwrap();
    // 40 chunks, one every 100 ms: the agent sends for 4 s while the server, with no call
    // to hand out, has nothing to send on the path but its liveness pings; the agent's
    // idle streams on the same path must not take that for a silent server.
    let chunks = 40u64;
    let answer = stack
        .caller()
        .get(&format!("/relay/{TUNNEL_ID}/trickle/{chunks}/100"))
        .await
        .unwrap();
    assert_eq!(answer.status, 200, "{}", answer.text());
    assert_eq!(
        answer.body.len() as u64,
        chunks * relay_tests::upstream::TRICKLE_CHUNK as u64,
        "the answer was cut"
    );
    let r = &stack.servers[0].as_ref().unwrap().registry;
    assert_eq!(
        value(r, "relay_tunnel_stream_closes_total", &[]),
        0.0,
        "a stream closed during a healthy answer"
    );
    stack.shutdown().await;
}
