//! Dispatcher routing end to end on real sockets: zone-skewed placement under `sticky` vs
//! `available`, a tunnel server killed mid-load, and two dispatchers sharing one real Redis
//! (including Redis stopped and restarted mid-run).
//!
//! Redis tests start their own `redis-server` on a free loopback port. Without the binary
//! they fail, naming the package to install (`apt-get install redis-server`).

use relay_agent::coverage::plan::CoverageConfig;
use relay_dispatcher::config::RedisTls;
use relay_dispatcher::RoutingPolicy;
use relay_tests::client::Caller;
use relay_tests::lb::Policy;
use relay_tests::load::{self, Load, LoadSpec};
use relay_tests::redis::{require_redis, RedisServer, RedisTlsFiles};
use relay_tests::shared_registry::{
    admin_json, any, demo_route, figure, servers_of, start_dispatcher_on, unique_prefix,
    TwoDispatchers, LEASE, RECORD_KEY, REDIS_TIMEOUT, REFRESH,
};
use relay_tests::stack::{Stack, TUNNEL_ID};
use relay_tests::{eventually, time_until};
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

const READY: Duration = Duration::from_secs(20);

async fn metric(addr: SocketAddr, prefix: &str) -> f64 {
    let Ok(a) = Caller::new(addr, None).get("/metrics").await else {
        return 0.0;
    };
    a.text()
        .lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

// ---------------------------------------------------------------- load

/// What loads of the tests' generator (`relay_tests::load`) saw, added up.
#[derive(Debug, Default, Clone)]
struct Outcome {
    sent: u64,
    answered: u64,
    ok: u64,
    /// Error code (or transport error) -> count.
    errors: std::collections::BTreeMap<String, u64>,
    /// (sent at, HTTP status (0: none), error code) per call.
    calls: Vec<(Instant, u16, String)>,
    /// Longest time to an answer.
    slowest: Duration,
}

/// Starts `workers` callers sending `path` through each of `callers`.
fn start_all(callers: Vec<Caller>, workers: usize, path: &str, timeout_ms: u64) -> Vec<Load> {
    callers
        .into_iter()
        .map(|c| load::start(c, LoadSpec::new(workers, path, timeout_ms)))
        .collect()
}

/// Stops `loads` (each call answered once, in time) and adds up what they saw.
async fn stop_all(loads: Vec<Load>) -> Outcome {
    let mut total = Outcome::default();
    for l in loads {
        let ledger = l.stop().await;
        total.sent += ledger.sent();
        total.answered += ledger.answered();
        total.ok += ledger.ok();
        total.slowest = total.slowest.max(ledger.slowest());
        for c in ledger.calls() {
            if c.status != 200 {
                *total.errors.entry(c.code.clone()).or_default() += 1;
            }
            total.calls.push((c.sent_at, c.status, c.code));
        }
    }
    total
}

/// Queue waits observed by the tunnel servers: (cumulative bucket counts, total count).
fn queue_waits(stack: &Stack) -> (Vec<(f64, u64)>, u64) {
    let mut buckets: Vec<(f64, u64)> = Vec::new();
    let mut total = 0;
    for (_, registry) in stack.server_registries() {
        for family in registry.gather() {
            if family.name() != "relay_tunnel_queue_wait_seconds" {
                continue;
            }
            for m in family.get_metric() {
                let h = m.get_histogram();
                total += h.get_sample_count();
                for (i, b) in h.get_bucket().iter().enumerate() {
                    if buckets.len() <= i {
                        buckets.push((b.upper_bound(), 0));
                    }
                    buckets[i].1 += b.cumulative_count();
                }
            }
        }
    }
    (buckets, total)
}

/// Queue-wait figures between two snapshots: (waits, waits over `over` s, p99 bound s).
fn queue_wait_delta(
    before: &(Vec<(f64, u64)>, u64),
    after: &(Vec<(f64, u64)>, u64),
    over: f64,
) -> (u64, u64, f64) {
    let total = after.1 - before.1;
    let at = |v: &Vec<(f64, u64)>, i: usize| v.get(i).map(|b| b.1).unwrap_or(0);
    let mut within_over = 0;
    let mut p99 = f64::INFINITY;
    for (i, (bound, _)) in after.0.iter().enumerate() {
        let cum = at(&after.0, i) - at(&before.0, i);
        if *bound <= over + 1e-12 {
            within_over = cum;
        }
        if p99.is_infinite() && total > 0 && cum as f64 >= 0.99 * total as f64 {
            p99 = *bound;
        }
    }
    (total, total - within_over, p99)
}

// ---------------------------------------------------------------- zone skew

const SKEW_STREAMS: u32 = 24;
const SKEW_WORKERS: usize = 8;
/// How long the load of a zone-skew run is measured.
const SKEW_WINDOW: Duration = Duration::from_secs(3);

struct SkewRun {
    outcome: Outcome,
    /// Queue waits, waits over 24.3 ms, p99 upper bucket bound (s).
    waits: (u64, u64, f64),
    home_streams: u64,
    placements: Vec<u64>,
}

/// One zone-skewed run under `policy`.
///
/// The seed behaviour sends every call to the most recently announced server. To stage the
/// incident deterministically, the smallest server loses its streams (the load balancer
/// resets them) and gets them back: it is then the last one announced, as a server that
/// just regained a tunnel id is in production. Both policies get the same staging.
async fn zone_skew_run(policy: RoutingPolicy) -> SkewRun {
    let stack = Stack::builder()
        .servers(3)
        .placement(Policy::Weighted(vec![90, 5, 5]))
        .coverage(CoverageConfig {
            enabled: false,
            fixed_streams: SKEW_STREAMS,
            ..CoverageConfig::default()
        })
        // Capacity is the subject here; RTTs between loopback servers are scheduling noise.
        .dispatcher_config(move |c| {
            c.routing.policy = policy;
            c.routing.latency_tiers = false;
        })
        .start()
        .await
        .unwrap();
    stack.wait_routable(READY).await.unwrap();
    let all_idle = || async {
        let route = demo_route(stack.dispatcher_admin).await;
        let idle: u64 = servers_of(&route).iter().map(|s| figure(s, "idle")).sum();
        idle == u64::from(SKEW_STREAMS)
    };
    eventually("all streams reported idle", READY, all_idle).await;
    let lb = stack.lb.as_ref().unwrap();
    let open = lb.open_streams();
    let (small, n) = open
        .iter()
        .enumerate()
        .filter(|(_, n)| **n > 0)
        .min_by_key(|(i, n)| (**n, *i))
        .map(|(i, n)| (i, *n as usize))
        .unwrap();
    let small_id = stack.server_id(small).unwrap().to_string();
    lb.set_next(vec![small; n]);
    lb.reset_backend(small);
    eventually(
        "the small server lost and regained its streams",
        READY,
        || async {
            let route = demo_route(stack.dispatcher_admin).await;
            let servers = servers_of(&route);
            let age = |id: &str| {
                servers
                    .iter()
                    .find(|s| s["server_id"] == id)
                    .and_then(|s| s["announced_age_ms"].as_u64())
            };
            let newest = servers
                .iter()
                .filter_map(|s| s["announced_age_ms"].as_u64())
                .min();
            all_idle().await
                && age(&small_id).is_some()
                && age(&small_id) == newest
                && lb.open_streams()[small] as usize == n
        },
    )
    .await;
    if policy == RoutingPolicy::Available {
        // The routing settles on the server holding the most streams (it may have picked
        // a smaller one while the first reports were still coming in).
        eventually("available settles on the biggest server", READY, || async {
            let route = demo_route(stack.dispatcher_admin).await;
            let servers = servers_of(&route);
            let max = servers.iter().map(|s| figure(s, "idle")).max().unwrap_or(0);
            servers
                .iter()
                .any(|s| s["server_id"] == route["home"] && figure(s, "idle") == max)
        })
        .await;
    }
    let route = demo_route(stack.dispatcher_admin).await;
    let home = route["home"].as_str().unwrap_or_default().to_string();
    let home_streams = servers_of(&route)
        .iter()
        .find(|s| s["server_id"] == home.as_str())
        .map(|s| figure(s, "idle") + figure(s, "busy"))
        .unwrap_or(0);
    let placements = stack
        .lb
        .as_ref()
        .map(|lb| lb.placements())
        .unwrap_or_default();

    let before = queue_waits(&stack);
    let loads = start_all(
        vec![stack.caller()],
        SKEW_WORKERS,
        &format!("/relay/{TUNNEL_ID}/slow/50"),
        400,
    );
    // The measurement window: the same span of load under both policies; whether calls
    // queue in it is what the test compares (a window, not a wait for a condition).
    tokio::time::sleep(SKEW_WINDOW).await;
    let outcome = stop_all(loads).await;
    let after = queue_waits(&stack);
    let waits = queue_wait_delta(&before, &after, 0.0243);
    stack.shutdown().await;
    SkewRun {
        outcome,
        waits,
        home_streams,
        placements,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zone_skew_queues_under_sticky_and_not_under_available() {
    let sticky = zone_skew_run(RoutingPolicy::Sticky).await;
    let available = zone_skew_run(RoutingPolicy::Available).await;
    for (name, run) in [("sticky", &sticky), ("available", &available)] {
        eprintln!(
            "zone skew [{name}]: placements {:?}, home holds {} streams; calls {} ok {} errors {:?}; \
             queue waits {} of which over 24 ms {}, p99 <= {:.4} s",
            run.placements,
            run.home_streams,
            run.outcome.sent,
            run.outcome.ok,
            run.outcome.errors,
            run.waits.0,
            run.waits.1,
            run.waits.2,
        );
        assert_eq!(
            run.outcome.answered, run.outcome.sent,
            "[{name}] every call gets an answer"
        );
    }
    assert!(
        sticky.home_streams < SKEW_WORKERS as u64,
        "staging: sticky's server holds {} streams",
        sticky.home_streams
    );
    assert!(sticky.waits.1 > 10, "sticky: {:?}", sticky.waits);
    assert_eq!(
        available.outcome.errors.get("no_capacity"),
        None,
        "available: {:?}",
        available.outcome.errors
    );
    assert_eq!(available.outcome.ok, available.outcome.sent);
    assert_eq!(
        available.waits.1, 0,
        "available queued calls: {:?}",
        available.waits
    );
}

// ---------------------------------------------------------------- killed server

/// After the first whole load report on a stream, a tunnel server sends a dispatcher that
/// lists `partial-load` only the figures that changed; the route still follows them: a
/// slow call's busy stream shows at the dispatcher, and goes when the call ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partial_load_reports_carry_what_changed_and_the_route_follows() {
    let stack = Stack::builder()
        .servers(1)
        .coverage(CoverageConfig {
            enabled: false,
            fixed_streams: 4,
            ..CoverageConfig::default()
        })
        .start()
        .await
        .unwrap();
    stack.wait_routable(READY).await.unwrap();
    let admin = stack.dispatcher_admin;
    let reports = |kind: &'static str| async move {
        metric(
            admin,
            &format!("relay_dispatcher_load_reports_total{{kind=\"{kind}\"}}"),
        )
        .await
    };
    eventually("partial load reports arrive", READY, || async {
        reports("partial").await >= 2.0
    })
    .await;
    let busy = || async {
        servers_of(&demo_route(admin).await)
            .first()
            .map_or(u64::MAX, |s| figure(s, "busy"))
    };
    assert_eq!(busy().await, 0, "no call yet");
    let caller = stack.caller();
    let slow = tokio::spawn(async move {
        caller
            .get(&format!("/relay/{TUNNEL_ID}/slow/3000"))
            .await
            .map(|a| a.status.as_u16())
    });
    eventually("the slow call's stream shows busy", READY, || async {
        busy().await == 1
    })
    .await;
    assert_eq!(slow.await.unwrap().unwrap(), 200);
    eventually("the stream shows idle again", READY, || async {
        busy().await == 0
    })
    .await;
    assert_eq!(
        reports("whole").await,
        1.0,
        "one report stream, one whole report: the rest were partial"
    );
    // At rest the reports go on (they renew the lease) and carry no figures: whole ones
    // would carry this tunnel id's every time.
    eventually("reports at rest carry nothing", READY, || async {
        let figures = metric(admin, "relay_dispatcher_load_report_tunnels_total").await;
        let reports = reports("partial").await + reports("whole").await;
        reports >= figures + 3.0
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_killed_mid_load_loses_only_calls_in_progress_and_every_call_is_answered() {
    let mut stack = Stack::builder()
        .servers(3)
        .placement(Policy::RoundRobin)
        .coverage(CoverageConfig {
            enabled: false,
            fixed_streams: 12,
            ..CoverageConfig::default()
        })
        .start()
        .await
        .unwrap();
    stack.wait_routable(READY).await.unwrap();
    eventually("every server reports idle streams", READY, || async {
        let route = demo_route(stack.dispatcher_admin).await;
        let s = servers_of(&route);
        s.len() == 3 && s.iter().all(|s| figure(s, "idle") > 0)
    })
    .await;
    let home = demo_route(stack.dispatcher_admin).await["home"]
        .as_str()
        .unwrap()
        .to_string();
    let victim = (0..3)
        .find(|i| stack.server_id(*i) == Some(home.as_str()))
        .expect("home is one of the servers");

    let loads = start_all(
        vec![stack.caller()],
        6,
        &format!("/relay/{TUNNEL_ID}/slow/300"),
        10_000,
    );
    loads[0].flowing(12, READY).await;
    let killed_at = Instant::now();
    assert!(stack.kill_server(victim));
    // A call sent before the dispatcher saw the server's connections close may have
    // reached its agent, as a call in progress may: both may fail, as stream_lost.
    eventually(
        "the dispatcher dropped the killed server",
        READY,
        || async {
            !servers_of(&demo_route(stack.dispatcher_admin).await)
                .iter()
                .any(|s| s["server_id"] == home.as_str())
        },
    )
    .await;
    let dropped_at = Instant::now();
    // Calls sent after that, to the servers left (at most 6 were in flight at the kill).
    loads[0].flowing(18, READY).await;
    let outcome = stop_all(loads).await;
    let retries = metric(stack.dispatcher_admin, "relay_dispatcher_retries_total").await;
    eprintln!(
        "killed {home}: calls {} answered {} ok {} errors {:?}; dispatcher retries {retries}",
        outcome.sent, outcome.answered, outcome.ok, outcome.errors
    );
    assert_eq!(outcome.answered, outcome.sent, "every call gets an answer");
    for (at, status, code) in &outcome.calls {
        if *status == 200 {
            continue;
        }
        // Only calls that may have been on the killed server fail, with a clear 502.
        assert_eq!(
            (*status, code.as_str()),
            (502, "stream_lost"),
            "call sent {:?} after the kill",
            at.checked_duration_since(killed_at)
        );
        assert!(
            *at < dropped_at,
            "a call sent after the dispatcher dropped the killed server failed: {code}"
        );
    }
    // One call per caller at a time: each fails at most once (its next call is sent to a
    // connection the dispatcher knows is closed, and retried).
    let failed = outcome.sent - outcome.ok;
    assert!(failed <= 6, "more failures ({failed}) than callers");
    let after_drop = outcome.calls.iter().filter(|c| c.0 > dropped_at).count();
    assert!(after_drop > 6, "the load kept flowing after the kill");
    stack.shutdown().await;
}

// ---------------------------------------------------------------- two dispatchers, one Redis

/// Margin on a detection bound: polling, scheduling on a loaded 2-core machine.
const SLACK: Duration = Duration::from_secs(1);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_dispatchers_sharing_redis_both_route_the_tunnel_id() {
    // A shared instance (scripts/test exports one) is fine here: the key prefix is unique.
    let mut _own = None;
    let url = match std::env::var("RELAY_TEST_REDIS_URL") {
        Ok(u) if !u.is_empty() => u,
        _ => {
            require_redis("two_dispatchers_sharing_redis_both_route_the_tunnel_id");
            let r = RedisServer::start().await;
            let url = r.url();
            _own = Some(r);
            url
        }
    };
    let fleet = TwoDispatchers::start(&url, &unique_prefix("share")).await;
    fleet.wait_sees(0, &["ts-1", "ts-2"]).await;
    fleet.wait_sees(1, &["ts-1", "ts-2"]).await;
    let (_, routes) = admin_json(fleet.dispatchers[0].admin, "/debug/routes").await;
    let origin = |id: &str| {
        routes["servers"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["server_id"] == id)
            .map(|s| s["origin"].clone())
    };
    assert_eq!(origin("ts-1"), Some("local".into()));
    assert_eq!(origin("ts-2"), Some("shared".into()));
    for d in 0..2 {
        let caller = fleet.caller(d);
        for _ in 0..20 {
            let a = caller
                .get(&format!("/relay/{TUNNEL_ID}/hello"))
                .await
                .unwrap();
            assert_eq!(a.status, 200, "via dispatcher {d}: {}", a.text());
        }
    }
    // ts-1 (the only server reporting to dispatcher 0) goes away: dispatcher 0 still routes
    // through ts-2, which it knows only from Redis.
    let mut fleet = fleet;
    fleet.servers[0].take().unwrap().shutdown().await;
    let admin0 = fleet.dispatchers[0].admin;
    eventually("dispatcher 0 forgets ts-1", READY, || async {
        !servers_of(&demo_route(admin0).await)
            .iter()
            .any(|s| s["server_id"] == "ts-1")
    })
    .await;
    let caller = fleet.caller(0);
    for _ in 0..10 {
        let a = caller
            .get(&format!("/relay/{TUNNEL_ID}/hello"))
            .await
            .unwrap();
        assert_eq!(a.status, 200, "{}", a.text());
    }
    assert!(
        metric(
            admin0,
            "relay_dispatcher_calls_by_server_total{outcome=\"ok\",server_id=\"ts-2\"}"
        )
        .await
            >= 10.0
    );
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_stopped_mid_run_keeps_calls_flowing_and_readyz_recovers() {
    require_redis("redis_stopped_mid_run_keeps_calls_flowing_and_readyz_recovers");
    let mut redis = RedisServer::start().await;
    let fleet = TwoDispatchers::start(&redis.url(), &unique_prefix("outage")).await;
    fleet.wait_sees(0, &["ts-1", "ts-2"]).await;
    fleet.wait_sees(1, &["ts-1", "ts-2"]).await;
    for d in &fleet.dispatchers {
        assert_eq!(admin_json(d.admin, "/readyz").await.0, 200);
    }

    let loads = start_all(
        (0..2).map(|d| fleet.caller(d)).collect(),
        2,
        &format!("/relay/{TUNNEL_ID}/slow/20"),
        5000,
    );

    redis.stop();
    let stopped_at = Instant::now();
    for d in &fleet.dispatchers {
        let admin = d.admin;
        eventually(
            "readyz reports the registry degraded",
            READY,
            || async move {
                let (status, body) = admin_json(admin, "/readyz").await;
                status == 503 && body["detail"]["registry"]["state"] == "degraded"
            },
        )
        .await;
    }
    let degraded_after = stopped_at.elapsed();
    // Still routing from the last known table: both dispatchers answer calls with Redis
    // down.
    for l in &loads {
        l.flowing(20, READY).await;
    }
    redis.restart().await;
    let restarted_at = Instant::now();
    for d in &fleet.dispatchers {
        let admin = d.admin;
        eventually("readyz recovers", READY, || async move {
            admin_json(admin, "/readyz").await.0 == 200
        })
        .await;
    }
    let recovered_after = restarted_at.elapsed();
    // The shared table is rebuilt in the fresh Redis.
    fleet.wait_sees(0, &["ts-1", "ts-2"]).await;
    fleet.wait_sees(1, &["ts-1", "ts-2"]).await;
    for l in &loads {
        l.flowing(5, READY).await;
    }
    let total = stop_all(loads).await;
    eprintln!(
        "redis outage: degraded seen after {degraded_after:?}, recovered {recovered_after:?} after restart; \
         calls {} ok {} errors {:?}",
        total.sent, total.ok, total.errors
    );
    assert_eq!(total.answered, total.sent);
    assert_eq!(
        total.ok, total.sent,
        "calls kept flowing: {:?}",
        total.errors
    );
    assert!(total.sent > 20, "the load ran: {}", total.sent);
    fleet.shutdown().await;
}

/// Whether dispatcher `admin`'s `/readyz` reports the shared registry degraded.
async fn degraded(admin: SocketAddr) -> bool {
    let (status, body) = admin_json(admin, "/readyz").await;
    status == 503 && body["detail"]["registry"]["state"] == "degraded"
}

/// Whether `server_id` is in dispatcher `admin`'s table (`/debug/routes`).
async fn lists(admin: SocketAddr, server_id: &str) -> bool {
    let (_, routes) = admin_json(admin, "/debug/routes").await;
    routes["servers"]
        .as_array()
        .is_some_and(|s| s.iter().any(|s| s["server_id"] == server_id))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_frozen_mid_run_keeps_calls_flowing_reports_degraded_and_drops_a_crashed_server() {
    require_redis(
        "redis_frozen_mid_run_keeps_calls_flowing_reports_degraded_and_drops_a_crashed_server",
    );
    let redis = RedisServer::start().await;
    let mut fleet = TwoDispatchers::start(&redis.url(), &unique_prefix("freeze")).await;
    fleet.wait_sees(0, &["ts-1", "ts-2"]).await;
    fleet.wait_sees(1, &["ts-1", "ts-2"]).await;
    for d in &fleet.dispatchers {
        assert_eq!(admin_json(d.admin, "/readyz").await.0, 200);
    }
    let both: Vec<Caller> = (0..2).map(|d| fleet.caller(d)).collect();
    let callers = || both.clone();
    let path = format!("/relay/{TUNNEL_ID}/slow/20");

    // Before: the same load with Redis answering, for comparison.
    let before = start_all(callers(), 2, &path, 5000);
    for l in &before {
        l.flowing(10, READY).await;
    }
    let before = stop_all(before).await;

    // Frozen: connections to Redis stay open and nothing answers (unlike a killed Redis,
    // which refuses at once). Calls must not wait on it.
    let during = start_all(callers(), 2, &path, 5000);
    redis.freeze();
    let frozen_at = Instant::now();
    let (a0, a1) = (fleet.dispatchers[0].admin, fleet.dispatchers[1].admin);
    let (d0, d1) = tokio::join!(
        time_until(READY, || degraded(a0)),
        time_until(READY, || degraded(a1))
    );
    // Calls go on on the last known table.
    for l in &during {
        l.flowing(10, READY).await;
    }
    let during = stop_all(during).await;
    eprintln!(
        "redis frozen: degraded after {d0:?} / {d1:?}; calls before: {} ok {} slowest {:?}; \
         during: {} ok {} errors {:?} slowest {:?}",
        before.sent,
        before.ok,
        before.slowest,
        during.sent,
        during.ok,
        during.errors,
        during.slowest
    );
    let bound = REDIS_TIMEOUT + REFRESH + SLACK;
    for (d, t) in [d0, d1].into_iter().enumerate() {
        let t = t.unwrap_or_else(|| panic!("dispatcher {d} never reported the registry degraded"));
        assert!(
            t <= bound,
            "dispatcher {d} reported the registry degraded after {t:?}, bound {bound:?} \
             (redis_timeout + refresh_interval + {SLACK:?})"
        );
    }
    assert_eq!(
        before.ok, before.sent,
        "before the freeze: {:?}",
        before.errors
    );
    assert_eq!(during.answered, during.sent);
    assert_eq!(
        during.ok, during.sent,
        "calls failed while Redis was frozen: {:?}",
        during.errors
    );
    assert!(during.sent > 20, "the load ran: {}", during.sent);

    // A server crashes while Redis is still frozen (no goodbye: its report stream just
    // ends). Dispatcher 0 hears it; dispatcher 1 knows ts-1 only from Redis.
    fleet.servers[0].take().unwrap().abort();
    let crashed = Instant::now();
    eventually("dispatcher 0 drops ts-1", READY, || async move {
        !lists(a0, "ts-1").await
    })
    .await;
    // Calls go on through the crash, the thaw and the rewrite of the shared table: to the
    // live server (a call dispatcher 1 tries on the dead one first is retried, since no
    // agent saw it).
    let after = start_all(callers(), 2, &path, 5000);
    // Redis answers again once the records of the live servers expired (frozen longer
    // than the lease: their TTL is counted on the clock, so this waits for a time), and
    // within the crashed server's lease.
    tokio::time::sleep_until(frozen_at + LEASE + REFRESH).await;
    assert!(
        crashed.elapsed() < LEASE,
        "staging: the thaw comes {:?} after the crash, within its lease {LEASE:?}",
        crashed.elapsed()
    );
    redis.thaw();
    let dropped = time_until(READY, || async { !lists(a1, "ts-1").await }).await;
    let dropped = dropped.map(|_| crashed.elapsed());
    for d in &fleet.dispatchers {
        let admin = d.admin;
        eventually("readyz recovers", READY, || async move {
            admin_json(admin, "/readyz").await.0 == 200
        })
        .await;
    }
    // A window as long as the grace after the outage: both still route to the live
    // server, no call fails.
    relay_tests::holds_for(
        "calls through both dispatchers succeed past the grace",
        LEASE,
        || async { after.iter().all(|l| l.ledger().failed() == 0) },
    )
    .await;
    let after = stop_all(after).await;
    eprintln!(
        "ts-1 crashed during the freeze: dispatcher 1 dropped it {dropped:?} after the crash; \
         calls from the crash on: {} ok {} errors {:?} slowest {:?}",
        after.sent, after.ok, after.errors, after.slowest
    );
    let bound = LEASE + REFRESH + SLACK;
    let dropped = dropped.expect("dispatcher 1 kept the crashed server");
    assert!(
        dropped <= bound,
        "dispatcher 1 dropped the crashed server {dropped:?} after the crash, bound {bound:?} \
         (lease + refresh_interval + {SLACK:?})"
    );
    assert_eq!(after.answered, after.sent);
    assert_eq!(
        after.ok, after.sent,
        "calls failed after the crash and the thaw: {:?}",
        after.errors
    );
    for d in 0..2 {
        fleet.wait_sees(d, &["ts-2"]).await;
    }
    fleet.shutdown().await;
}

// ---------------------------------------------------------------- a hostile Redis writer

/// A TCP listener the test owns, counting the connections it accepts: an endpoint an
/// attacker controls. Any call routed to it shows as a connection.
async fn trap() -> (SocketAddr, Arc<std::sync::atomic::AtomicUsize>) {
    let l = any().await;
    let addr = l.local_addr().unwrap();
    let hits = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let h = hits.clone();
    tokio::spawn(async move {
        while let Ok((s, _)) = l.accept().await {
            h.fetch_add(1, Ordering::SeqCst);
            drop(s);
        }
    });
    (addr, hits)
}

/// A record's content as dispatchers write it, claiming `demo` with every stream idle
/// (`idle` = 4294967295) on a server at `forward_url`.
fn forged_record(server_id: &str, forward_url: &str) -> serde_json::Value {
    serde_json::json!({
        "info": {
            "server_id": server_id,
            "zone": "z",
            "forward_url": forward_url,
            "instance_id": format!("{server_id}-1"),
        },
        "tunnels": [TUNNEL_ID],
        "load": {
            "tunnels": {TUNNEL_ID: {"idle": 4294967295u32, "busy": 0, "queued": 0, "rtt_us": 0}},
            "calls_in_flight": 0,
            "draining": false,
        },
        "dispatcher": "dispatcher@attacker",
    })
}

async fn redis_conn(url: &str) -> redis::aio::MultiplexedConnection {
    redis::Client::open(url)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}

/// `relay_dispatcher_registry_records_refused_total{reason}` on dispatcher `admin`.
async fn refused(admin: SocketAddr, reason: &str) -> f64 {
    metric(
        admin,
        &format!("relay_dispatcher_registry_records_refused_total{{reason=\"{reason}\"}}"),
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_tampered_moved_and_replayed_registry_records_get_no_call_and_are_counted() {
    require_redis(
        "forged_tampered_moved_and_replayed_registry_records_get_no_call_and_are_counted",
    );
    let redis = RedisServer::start().await;
    let prefix = unique_prefix("forged");
    let fleet = TwoDispatchers::start(&redis.url(), &prefix).await;
    fleet.wait_sees(0, &["ts-1", "ts-2"]).await;
    fleet.wait_sees(1, &["ts-1", "ts-2"]).await;
    let (trap_addr, hits) = trap().await;
    let trap_url = format!("http://{trap_addr}");
    let conn = redis_conn(&redis.url()).await;
    let key = |id: &str| format!("{prefix}:server:{id}");
    let plant = |id: &'static str, value: String| {
        let (set, list) = (key(id), format!("{prefix}:servers"));
        let mut conn = conn.clone();
        async move {
            let _: () = redis::cmd("SET")
                .arg(set)
                .arg(value)
                .query_async(&mut conn)
                .await
                .unwrap();
            let _: () = redis::cmd("SADD")
                .arg(list)
                .arg(id)
                .query_async(&mut conn)
                .await
                .unwrap();
        }
    };
    // Whoever holds the record key can seal; the attacker's records below are what one
    // without it (or with an old record) can write.
    let sealer = relay_dispatcher::shared::record::RecordRules::new(
        RECORD_KEY.as_bytes(),
        Vec::new(),
        false,
        &["private".to_string()],
    )
    .unwrap();
    let record = |id: &str, url: &str| -> relay_dispatcher::registry::ServerRecord {
        serde_json::from_value(forged_record(id, url)).unwrap()
    };
    let now_ms = || relay_common::wall::unix_ms();

    // 1. The attack: a record by hand (plain JSON).
    plant("evil", forged_record("evil", &trap_url).to_string()).await;
    // 2. A sealed record edited: its forward_url swapped for the attacker's.
    let ts1_url = format!("http://{}", fleet.servers[0].as_ref().unwrap().forward_addr);
    let sealed = sealer.seal(
        &key("evil-edited"),
        &record("evil-edited", &ts1_url),
        now_ms() + 60_000,
    );
    plant("evil-edited", sealed.replace(&ts1_url, &trap_url)).await;
    // 3. A live server's real record copied under another server id.
    let real: String = redis::cmd("GET")
        .arg(key("ts-2"))
        .query_async(&mut conn.clone())
        .await
        .unwrap();
    plant("evil-moved", real).await;
    // 4. A record sealed with the key, written back after its expiry.
    let old = sealer.seal(
        &key("evil-replayed"),
        &record("evil-replayed", &trap_url),
        now_ms() - 10_000,
    );
    plant("evil-replayed", old).await;
    // 5. A sealed record whose forward_url names a host outside registry.forward_hosts
    //    (default: private addresses; a host name must be listed).
    let outside = format!("http://localhost:{}", trap_addr.port());
    let sealed = sealer.seal(
        &key("evil-host"),
        &record("evil-host", &outside),
        now_ms() + 60_000,
    );
    plant("evil-host", sealed).await;
    // 6. A value over the size bound, and a key that is not a string: refused, and the
    //    other records are read on.
    plant("evil-big", "v1.".to_string() + &"x".repeat(5 << 20)).await;
    let _: () = redis::cmd("HSET")
        .arg(key("evil-hash"))
        .arg("f")
        .arg("v")
        .query_async(&mut conn.clone())
        .await
        .unwrap();
    let _: () = redis::cmd("SADD")
        .arg(format!("{prefix}:servers"))
        .arg("evil-hash")
        .query_async(&mut conn.clone())
        .await
        .unwrap();

    let want = [
        ("unsealed", 1.0),
        ("bad_seal", 2.0),
        ("expired", 1.0),
        ("forward_url", 1.0),
        ("too_large", 1.0),
        ("malformed", 1.0),
    ];
    for d in &fleet.dispatchers {
        let admin = d.admin;
        eventually(
            "the dispatcher refused the planted records",
            READY,
            || async move {
                let mut all = true;
                for (reason, n) in want {
                    all &= refused(admin, reason).await >= n;
                }
                all
            },
        )
        .await;
    }
    for d in 0..2 {
        let caller = fleet.caller(d);
        for _ in 0..20 {
            let a = caller
                .get(&format!("/relay/{TUNNEL_ID}/hello"))
                .await
                .unwrap();
            assert_eq!(a.status, 200, "via dispatcher {d}: {}", a.text());
        }
    }
    assert_eq!(
        hits.load(Ordering::SeqCst),
        0,
        "calls reached the address of a record planted in Redis"
    );
    for d in &fleet.dispatchers {
        for id in [
            "evil",
            "evil-edited",
            "evil-moved",
            "evil-replayed",
            "evil-host",
            "evil-big",
            "evil-hash",
        ] {
            assert!(!lists(d.admin, id).await, "{id} is in the routing table");
        }
        // Read again on every refresh, counted once.
        for (reason, n) in want {
            assert_eq!(refused(d.admin, reason).await, n, "{reason}");
        }
    }
    fleet.wait_sees(0, &["ts-1", "ts-2"]).await;
    fleet.shutdown().await;
}

// ---------------------------------------------------------------- TLS and an ACL user

/// The ACL docs/routing.md documents for the relay's Redis user, for key prefix `prefix`: the
/// commands the shared registry sends, on its own keys only.
fn relay_acl(user: &str, password: &str, prefix: &str) -> Vec<String> {
    let rule = format!(
        "{user} on >{password} resetkeys ~{prefix}:* resetchannels -@all +set +getrange +exists +del +sadd +srem +smembers"
    );
    std::iter::once("ACL".to_string())
        .chain(std::iter::once("SETUSER".to_string()))
        .chain(rule.split(' ').map(str::to_string))
        .collect()
}

/// The error `/readyz` reports for the shared registry, once it reports one.
async fn registry_error(admin: SocketAddr) -> String {
    let why = Arc::new(std::sync::Mutex::new(String::new()));
    eventually("readyz reports the registry's error", READY, || {
        let why = why.clone();
        async move {
            let (status, body) = admin_json(admin, "/readyz").await;
            match body["detail"]["registry"]["error"].as_str() {
                Some(e) if status == 503 => {
                    *why.lock().unwrap() = e.to_string();
                    true
                }
                _ => false,
            }
        }
    })
    .await;
    let why = why.lock().unwrap().clone();
    why
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rediss_with_an_acl_user_routes_and_a_wrong_password_or_an_untrusted_ca_is_a_clear_error() {
    require_redis(
        "rediss_with_an_acl_user_routes_and_a_wrong_password_or_an_untrusted_ca_is_a_clear_error",
    );
    let dir = relay_tests::procs::ScratchDir::new("rediss").unwrap();
    let certs = relay_tests::certs::generate(&dir.path().join("good"), &["127.0.0.1"]).unwrap();
    let other = relay_tests::certs::generate(&dir.path().join("other"), &["127.0.0.1"]).unwrap();
    let redis = RedisServer::start_tls(RedisTlsFiles {
        cert: certs.dispatcher.0.clone(),
        key: certs.dispatcher.1.clone(),
        ca: certs.ca.clone(),
    })
    .await;
    let prefix = unique_prefix("rediss");
    // The documented ACL, applied by an administrator (the default user).
    let admin = redis::Client::build_with_tls(
        redis.url(),
        redis::TlsCertificates {
            client_tls: None,
            root_cert: Some(std::fs::read(&certs.ca).unwrap()),
        },
    )
    .unwrap();
    let mut conn = admin.get_multiplexed_async_connection().await.unwrap();
    let acl = relay_acl("relay", "relay-pw", &prefix);
    let mut cmd = redis::cmd(&acl[0]);
    for a in &acl[1..] {
        cmd.arg(a);
    }
    let _: () = cmd.query_async(&mut conn).await.unwrap();

    let url = |password: &str| format!("rediss://relay:{password}@127.0.0.1:{}", redis.port());
    let trusted = RedisTls {
        ca: Some(certs.ca.clone()),
        ..RedisTls::default()
    };
    let fleet = TwoDispatchers::start_on(&url("relay-pw"), &prefix, trusted.clone()).await;
    fleet.wait_sees(0, &["ts-1", "ts-2"]).await;
    fleet.wait_sees(1, &["ts-1", "ts-2"]).await;
    for d in 0..2 {
        let caller = fleet.caller(d);
        for _ in 0..10 {
            let a = caller
                .get(&format!("/relay/{TUNNEL_ID}/hello"))
                .await
                .unwrap();
            assert_eq!(a.status, 200, "via dispatcher {d}: {}", a.text());
        }
        assert_eq!(
            admin_json(fleet.dispatchers[d].admin, "/readyz").await.0,
            200
        );
    }
    // The records are where the ACL lets the relay write, sealed.
    let listed: Vec<String> = redis::cmd("SMEMBERS")
        .arg(format!("{prefix}:servers"))
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(listed.len(), 2, "{listed:?}");

    // A wrong password: Redis refuses, /readyz says so (and never shows the password).
    let wrong = start_dispatcher_on(&url("not-the-pw"), &prefix, trusted.clone()).await;
    let why = registry_error(wrong.admin).await;
    eprintln!("wrong password: {why}");
    assert!(
        why.to_lowercase().contains("authentication failed"),
        "{why}"
    );
    assert!(!why.contains("not-the-pw"), "{why}");
    // A Redis certificate from a CA the dispatcher does not trust.
    let untrusted = start_dispatcher_on(
        &url("relay-pw"),
        &prefix,
        RedisTls {
            ca: Some(other.ca.clone()),
            ..RedisTls::default()
        },
    )
    .await;
    let why = registry_error(untrusted.admin).await;
    eprintln!("untrusted CA: {why}");
    // (Both test CAs have one name: the issuer is found and its signature does not match.)
    assert!(why.contains("invalid peer certificate"), "{why}");
    // No CA configured: the system's trust store, which does not hold the test CA either.
    let system = start_dispatcher_on(&url("relay-pw"), &prefix, RedisTls::default()).await;
    let why = registry_error(system.admin).await;
    eprintln!("system trust store: {why}");
    assert!(
        why.contains("invalid peer certificate: UnknownIssuer"),
        "{why}"
    );
    for d in [wrong, untrusted, system] {
        d.shutdown().await;
    }
    fleet.shutdown().await;
}
