//! Short versions of the built-in fleet scenarios, run end to end: every call sent gets
//! exactly one outcome (`calls_lost == 0`) and each scenario's headline holds. Plus the
//! load tester's own edges: bad scenario files are refused naming the key, an unreachable
//! external target fails fast, and a stopped run still reports.

use relay_tests::fleet::scenario::Distribution;
use relay_tests::fleet::{run, Mode, Report, RunOptions, Scenario};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

fn builtin(name: &str) -> Scenario {
    Scenario::builtin(name).unwrap_or_else(|| panic!("built-in {name} parses"))
}

async fn run_short(s: Scenario) -> Report {
    let r = run(&s, RunOptions::default()).await.expect("scenario runs");
    println!("{}", relay_tests::fleet::report::summary(&r));
    assert_eq!(r.calls_lost, 0, "calls lost: {r:#?}");
    assert!(r.calls_sent > 0, "no call sent");
    r
}

/// Asserts every expectation the scenario sets (the report's verdict).
fn assert_expectations(r: &Report) {
    let failed: Vec<String> = r
        .expectations
        .iter()
        .filter(|c| !c.pass)
        .map(|c| format!("{} {} (got {})", c.name, c.want, c.got))
        .collect();
    assert!(
        failed.is_empty() && r.passed(),
        "{}: expectations not met: {failed:?}",
        r.scenario
    );
}

/// The scenario with coverage off: each agent keeps a fixed pool of streams.
fn coverage_off(mut s: Scenario) -> Scenario {
    s.agents.coverage.enabled = false;
    s
}

fn queue_wait_p99(r: &Report) -> f64 {
    r.queue_wait_ms
        .as_ref()
        .map(|q| q.p99)
        .expect("queue wait measured in embedded mode")
}

fn failed_ratio(r: &Report) -> f64 {
    r.calls_failed_total as f64 / r.calls_sent.max(1) as f64
}

#[test]
fn every_builtin_scenario_parses_and_validates() {
    for (name, _) in relay_tests::fleet::scenario::BUILTIN {
        let s = Scenario::load(name).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(s.name, *name);
    }
}

#[test]
fn an_unknown_key_or_impossible_value_is_refused_naming_the_key() {
    let err = Scenario::parse("duration = \"5s\"\n[load]\nrat = 5\n", Path::new("x.toml"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("rat"), "{err}");
    let err = Scenario::parse("[servers]\ncount = 40\n", Path::new("x.toml"))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("servers.count") && err.contains("1..=16"),
        "{err}"
    );
    let err = Scenario::parse(
        "duration = \"5s\"\n[[faults]]\nat = \"9s\"\naction = \"kill_server\"\nserver = 1\n",
        Path::new("x.toml"),
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("faults[0].at"), "{err}");
    let err = Scenario::parse("[load]\nhot_share = 1.5\n", Path::new("x.toml"))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("load.hot_share") && err.contains("0..=1"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_external_target_fails_fast_with_a_clear_message() {
    let started = tokio::time::Instant::now();
    let err = run(
        &builtin("uniform"),
        RunOptions {
            mode: Mode::External {
                dispatcher: "http://127.0.0.1:1".into(),
                tunnel: "http://127.0.0.1:1".into(),
                caller_key: "k".into(),
            },
            ..RunOptions::default()
        },
    )
    .await
    .unwrap_err()
    .to_string();
    assert!(err.contains("cannot reach the dispatcher"), "{err}");
    assert!(started.elapsed() < Duration::from_secs(5));
}

/// Each call carries its deadline to the relay, which answers it by then even when the
/// upstream takes longer: every call fails at its deadline with the relay's 504, and
/// none is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_past_their_deadline_are_answered_by_the_relay_and_none_is_lost() {
    let mut s = builtin("uniform").scaled(0.1, 0.1);
    s.upstream.latency = Duration::from_secs(7);
    s.upstream.distribution = Distribution::Fixed;
    s.load.call_timeout = Duration::from_secs(1);
    s.expect = Default::default();
    let r = run(&s, RunOptions::default()).await.expect("scenario runs");
    println!("{}", relay_tests::fleet::report::summary(&r));
    assert_eq!(r.calls_lost, 0, "{:?}", r.calls_failed);
    assert!(r.calls_sent > 0, "no call sent");
    assert_eq!(r.calls_ok, 0, "{:?}", r.calls_failed);
    assert_eq!(r.calls_failed_total, r.calls_sent, "{:?}", r.calls_failed);
    assert!(
        r.calls_failed
            .keys()
            .all(|k| k == "deadline_exceeded" || k == "upstream_timeout"),
        "{:?}",
        r.calls_failed
    );
    assert!(
        r.latency_ms.max < 1000.0 + 5000.0,
        "answered after {} ms",
        r.latency_ms.max
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uniform_serves_everything() {
    // From agents at rest (the runner waits for their reserve on every server), calls
    // queue only briefly: every expectation holds, the queue-wait p99 included.
    let r = run_short(builtin("uniform").scaled(0.2, 0.5)).await;
    assert_eq!(r.calls_failed_total, 0, "{:?}", r.calls_failed);
    assert!(r.check("max_queue_wait_p99").is_some());
    assert_expectations(&r);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zone_skew_serves_everything() {
    let r = run_short(builtin("zone-skew").scaled(0.25, 0.4)).await;
    assert_eq!(r.calls_failed_total, 0, "{:?}", r.calls_failed);
    assert_expectations(&r);
}

/// At the scenario's own rates (150 ramping to 400 calls/s on one hot tunnel id, 80% of
/// streams placed on one server), the agents' fixed pools of coverage off cannot keep up:
/// calls wait for a stream far beyond the scenario's queue-wait bound, while coverage
/// grows the pools.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zone_skew_with_coverage_off_queues_far_longer() {
    let s = builtin("zone-skew").scaled(0.25, 1.0);
    let bound = s
        .expect
        .max_queue_wait_p99
        .expect("zone-skew bounds queue wait")
        .as_secs_f64()
        * 1000.0;
    let on = run_short(s.clone()).await;
    let off = run_short(coverage_off(s)).await;
    let (p_on, p_off) = (queue_wait_p99(&on), queue_wait_p99(&off));
    println!(
        "zone-skew queue wait p99: coverage on {p_on:.1} ms, off {p_off:.1} ms (bound {bound} ms); \
         failed on {:?} off {:?}",
        on.calls_failed, off.calls_failed
    );
    assert!(
        p_off > bound,
        "coverage off met the queue-wait bound: {p_off:.1} ms"
    );
    assert!(
        p_off >= 3.0 * p_on,
        "coverage off queued about as long as on: {p_off:.1} ms vs {p_on:.1} ms"
    );
    assert!(on.calls_failed_total <= off.calls_failed_total);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unfillable_stays_bounded_and_keeps_serving() {
    let r = run_short(builtin("unfillable").scaled(0.35, 0.4)).await;
    assert!(failed_ratio(&r) <= 0.01, "{:?}", r.calls_failed);
    assert_expectations(&r);
    assert_eq!(r.coverage_actions.get("evacuate").copied().unwrap_or(0), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn burst_of_1000_is_answered_within_8_ticks_of_its_call_time() {
    let _one = BURSTS.lock().await;
    // 12.5 s: the burst at 1.5 s, answered within 9 s, pruned 3 s after its last calls end.
    let mut s = builtin("burst-1000").scaled(0.5, 1.0);
    s.upstream.latency = Duration::from_secs(1);
    s.expect.burst_done_within = Some(Duration::from_secs(9));
    let r = run_short(s).await;
    assert_eq!(r.calls_failed_total, 0, "{:?}", r.calls_failed);
    assert_eq!(r.bursts[0].ok, 1000);
    assert_expectations(&r);
}

/// The 1,000-call bursts take the machine for seconds each: one at a time.
static BURSTS: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// With direct growth the burst's streams are opened straight to the server its calls
/// wait on: about one stream per call (at most 1.2 x the calls in flight plus the
/// reserves), where through the load balancer alone the agent peaks near two per call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn burst_of_1000_with_direct_growth_opens_about_one_stream_per_call() {
    let _one = BURSTS.lock().await;
    let mut s = builtin("burst-1000").scaled(0.3, 1.0);
    s.upstream.latency = Duration::from_secs(1);
    s.servers.direct = true;
    s.agents.coverage.direct_growth = true;
    s.expect.burst_done_within = Some(Duration::from_secs(9));
    // Pruning after the burst is the other burst test's headline.
    s.expect.max_resting_streams = None;
    // 1,000 burst calls plus the steady 5 calls/s of 1 s, and the reserve on each server.
    let in_flight = 1000 + 5;
    let reserves = u64::from(s.agents.coverage.reserve) * s.servers.count as u64;
    s.expect.max_peak_streams = Some(in_flight * 12 / 10 + reserves);
    let r = run_short(s).await;
    assert_eq!(r.calls_failed_total, 0, "{:?}", r.calls_failed);
    assert_eq!(r.bursts[0].ok, 1000);
    assert_expectations(&r);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_restart_fails_nothing_after_the_server_is_back() {
    let r = run_short(builtin("server-restart").scaled(0.5, 0.5)).await;
    assert!(failed_ratio(&r) <= 0.05, "{:?}", r.calls_failed);
    assert_expectations(&r);
}

/// The scenario's headline (no failure at all) does not hold yet: while a server drains,
/// a few calls (~0.2%) get `tunnel_unavailable`. This test pins what holds today (nothing
/// lost, failures rare and only of that kind); `rolling_drain_fails_no_call` is the goal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rolling_drain_loses_nothing_and_fails_rarely() {
    let r = run_short(builtin("rolling-drain").scaled(0.4, 0.5)).await;
    assert!(failed_ratio(&r) <= 0.02, "{:?}", r.calls_failed);
    assert!(
        r.calls_failed.keys().all(|k| k == "tunnel_unavailable"),
        "{:?}",
        r.calls_failed
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rolling_drain_fails_no_call() {
    let r = run_short(builtin("rolling-drain").scaled(0.4, 0.5)).await;
    assert_eq!(r.calls_failed_total, 0, "{:?}", r.calls_failed);
    assert_expectations(&r);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_returns_without_failures() {
    let r = run_short(builtin("server-returns").scaled(0.5, 0.5)).await;
    assert_eq!(r.calls_failed_total, 0, "{:?}", r.calls_failed);
    // The returned and the joined server hold streams again at the end.
    assert_expectations(&r);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_agents_serve_every_tunnel_id() {
    let mut s = builtin("many-agents").scaled(0.15, 0.5);
    s.agents.count = 200;
    let r = run_short(s).await;
    assert_eq!(r.calls_failed_total, 0, "{:?}", r.calls_failed);
    assert_expectations(&r);
    assert!(r.memory.peak_rss_mib > 0.0);
    assert!(r.cpu.process_cpu_s > 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_run_still_reports_what_ran() {
    let stop = CancellationToken::new();
    let answered = Arc::new(tokio::sync::Notify::new());
    // Stopped past the warm-up, once calls of the load are answered, and within its 20 s.
    let (s, a) = (stop.clone(), answered.clone());
    tokio::spawn(async move {
        a.notified().await;
        s.cancel();
    });
    let scenario = builtin("uniform");
    let r = run(
        &scenario,
        RunOptions {
            stop,
            answered,
            ..RunOptions::default()
        },
    )
    .await
    .expect("runs");
    assert!(r.interrupted);
    assert!(
        r.ran_for_s < scenario.duration.as_secs_f64() - 1.0,
        "ran {} s",
        r.ran_for_s
    );
    assert!(r.calls_sent > 0);
    assert_eq!(r.calls_lost, 0);
    let html = relay_tests::fleet::html::render(&r);
    assert!(html.contains("<svg") && !html.contains("<script"));
}
