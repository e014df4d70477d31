//! The registry as the call path and the report service see it: routes, plans, gauges,
//! the fleet watch and the shared store's queue.

use super::*;
use crate::config::RoutingPolicy;

fn registry(shared: bool) -> Routes {
    let metrics = Metrics::register(&prometheus::Registry::new()).unwrap();
    Routes::new(
        RoutingConfig {
            policy: RoutingPolicy::Sticky,
            ..RoutingConfig::default()
        },
        Duration::from_secs(3),
        "d1".into(),
        shared,
        metrics,
    )
}

fn info(id: &str) -> ServerInfo {
    ServerInfo {
        server_id: id.into(),
        zone: "z".into(),
        forward_url: format!("http://{id}"),
        instance_id: "i1".into(),
        direct_url: String::new(),
    }
}

fn instance(id: &str, instance: &str) -> ServerInfo {
    ServerInfo {
        instance_id: instance.into(),
        ..info(id)
    }
}

fn ids(r: &Routes, tunnel_id: &str) -> Vec<String> {
    r.route(tunnel_id)
        .map(|p| {
            p.servers
                .into_iter()
                .map(|t| t.server_id.to_string())
                .collect()
        })
        .unwrap_or_default()
}

fn load(tunnels: &[(&str, u32)], draining: bool) -> LoadFigures {
    LoadFigures {
        tunnels: tunnels
            .iter()
            .map(|(t, idle)| {
                (
                    t.to_string(),
                    TunnelFigures {
                        idle: *idle,
                        ..Default::default()
                    },
                )
            })
            .collect(),
        calls_in_flight: 0,
        draining,
        cpu_permille: 0,
    }
}

/// Label sets of a gauge family, as `(server_id, tunnel_id)` or `tunnel_id`.
fn labels(family: &[prometheus::proto::MetricFamily], name: &str) -> Vec<Vec<String>> {
    let mut out: Vec<Vec<String>> = family
        .iter()
        .filter(|f| f.name() == name)
        .flat_map(|f| f.get_metric())
        .map(|m| {
            m.get_label()
                .iter()
                .map(|l| l.value().to_string())
                .collect()
        })
        .collect();
    out.sort();
    out
}

/// Routes with the default routing policy, its gauges in a registry of their own.
fn gauged() -> (prometheus::Registry, Routes) {
    let prom = prometheus::Registry::new();
    let metrics = Metrics::register(&prom).unwrap();
    let r = Routes::new(
        RoutingConfig::default(),
        Duration::from_secs(3),
        "d1".into(),
        false,
        metrics,
    );
    (prom, r)
}

#[tokio::test(start_paused = true)]
async fn announcing_one_tunnel_id_routes_it_and_gauges_follow_it_alone() {
    let (prom, r) = gauged();
    let a = r.join(info("a")).unwrap();
    let b = r.join(info("b")).unwrap();
    r.tunnel_up(a, "t");
    r.tunnel_up(b, "t");
    r.tunnel_up(a, "u");
    let mut both = ids(&r, "t");
    both.sort();
    assert_eq!(both, ["a", "b"]);
    assert_eq!(ids(&r, "u"), ["a"]);
    let tiers = || labels(&prom.gather(), "relay_dispatcher_server_tier");
    let spill = || labels(&prom.gather(), "relay_dispatcher_spill_share");
    assert_eq!(tiers().len(), 3, "{:?}", tiers());
    // b drops t: only the pair (b, t) goes; u is untouched.
    r.tunnel_down(b, "t");
    assert_eq!(ids(&r, "t"), ["a"]);
    assert!(
        !tiers().iter().any(|l| l.contains(&"b".to_string())),
        "{:?}",
        tiers()
    );
    assert_eq!(tiers().len(), 2, "{:?}", tiers());
    // a drops t: t is gone from routing and from every gauge.
    r.tunnel_down(a, "t");
    assert!(r.route("t").is_none());
    assert_eq!(spill(), vec![vec!["u".to_string()]]);
    assert_eq!(tiers().len(), 1, "{:?}", tiers());
    // A full rebuild (a load report) agrees with the per-tunnel one.
    r.load(a, load(&[("u", 1)], false), false);
    assert_eq!(ids(&r, "u"), ["a"]);
    assert_eq!(spill(), vec![vec!["u".to_string()]]);
    assert_eq!(tiers().len(), 1, "{:?}", tiers());
}

#[tokio::test(start_paused = true)]
async fn most_recently_announced_server_comes_first_under_sticky() {
    let r = registry(false);
    let a = r.join(info("a")).unwrap();
    let b = r.join(info("b")).unwrap();
    r.tunnel_up(b, "demo");
    tokio::time::advance(Duration::from_millis(5)).await;
    r.tunnel_up(a, "demo");
    assert_eq!(ids(&r, "demo"), ["a", "b"]);
    assert!(r.route("other").is_none());
    assert_eq!(
        r.counts(),
        RouteCounts {
            servers: 2,
            tunnels: 1
        }
    );
}

#[tokio::test(start_paused = true)]
async fn draining_servers_come_last_and_downed_tunnels_are_dropped() {
    let r = registry(false);
    let a = r.join(info("a")).unwrap();
    let b = r.join(info("b")).unwrap();
    r.tunnel_up(b, "demo");
    tokio::time::advance(Duration::from_millis(5)).await;
    r.tunnel_up(a, "demo");
    r.load(a, load(&[("demo", 3)], true), false);
    assert_eq!(ids(&r, "demo"), ["b", "a"]);
    r.tunnel_down(b, "demo");
    assert_eq!(ids(&r, "demo"), ["a"], "only a draining server is left");
    assert_eq!(r.counts().tunnels, 1);
}

#[tokio::test(start_paused = true)]
async fn leaving_removes_every_entry_and_a_stale_session_is_ignored() {
    let r = registry(false);
    let old = r.join(info("a")).unwrap();
    r.tunnel_up(old, "demo");
    let new = r.join(info("a")).unwrap();
    assert!(
        r.route("demo").is_none(),
        "the new session must resend its tunnels"
    );
    assert!(!r.tunnel_up(old, "demo"));
    assert!(r.tunnel_up(new, "demo"));
    assert_eq!(r.leave(old), None);
    assert_eq!(ids(&r, "demo"), ["a"]);
    assert_eq!(r.leave(new), Some(info("a")));
    assert!(r.route("demo").is_none());
    assert_eq!(r.counts(), RouteCounts::default());
    assert!(!r.uses_forward_url("http://a"));
}

#[tokio::test(start_paused = true)]
async fn a_second_live_instance_of_a_server_id_is_refused_and_a_restart_is_not() {
    let r = registry(false);
    let mut fleet = r.watch_fleet();
    let first = r.join(instance("a", "one")).unwrap();
    r.tunnel_up(first, "demo");
    assert_eq!(
        r.join(instance("a", "two")),
        Err(Conflict {
            live_instance: "one".into()
        }),
        "two live servers claiming one id are not merged"
    );
    assert_eq!(ids(&r, "demo"), ["a"], "the live instance keeps routing");
    let members = fleet.borrow_and_update().clone();
    assert_eq!(members.len(), 1);
    assert_eq!(members[0].instance_id, "one");
    // The same instance reconnecting replaces its own entry.
    let again = r.join(instance("a", "one")).unwrap();
    assert!(!r.tunnel_up(first, "demo"), "the old session is stale");
    // Once it left, a new life of the id joins and the fleet shows it.
    r.leave(again);
    let restarted = r.join(instance("a", "two")).unwrap();
    assert!(r.tunnel_up(restarted, "demo"));
    assert!(fleet.has_changed().unwrap());
    let members = fleet.borrow_and_update().clone();
    assert_eq!(
        members
            .iter()
            .map(|m| (m.server_id.as_str(), m.instance_id.as_str()))
            .collect::<Vec<_>>(),
        [("a", "two")]
    );
}

#[tokio::test(start_paused = true)]
async fn a_server_that_stops_reporting_expires_after_its_lease() {
    let r = registry(true);
    let a = r.join(info("a")).unwrap();
    let b = r.join(info("b")).unwrap();
    r.tunnel_up(a, "demo");
    r.tunnel_up(b, "demo");
    r.take_dirty();
    let mut expired = Vec::new();
    for _ in 0..4 {
        tokio::time::advance(Duration::from_secs(1)).await;
        r.load(b, load(&[("demo", 1)], false), false);
        expired.extend(r.sweep(Instant::now()));
    }
    // a last reported 4 s ago (lease 3 s): gone at the sweep above.
    assert_eq!(expired, [info("a")]);
    assert_eq!(ids(&r, "demo"), ["b"]);
    assert!(
        !r.load(a, load(&[], false), false),
        "the expired session is stale"
    );
    let dirty = r.take_dirty();
    assert!(dirty.contains(&("a".to_string(), None)), "{dirty:?}");
}

#[tokio::test(start_paused = true)]
async fn shared_records_route_and_local_entries_win() {
    let r = registry(true);
    let rec = |id: &str, tunnels: &[&str]| ServerRecord {
        info: info(id),
        tunnels: tunnels.iter().map(|s| s.to_string()).collect(),
        load: Some(load(&[("demo", 2)], false)),
        dispatcher: "d2".into(),
    };
    r.apply_shared(
        vec![rec("x", &["demo"]), rec("y", &["demo", "other"])],
        Prune::Missing,
    );
    assert_eq!(
        r.counts(),
        RouteCounts {
            servers: 2,
            tunnels: 2
        }
    );
    assert_eq!(ids(&r, "other"), ["y"]);
    // y reconnects here: the local entry replaces the shared one and stays.
    let y = r.join(info("y")).unwrap();
    r.tunnel_up(y, "third");
    r.apply_shared(
        vec![rec("x", &["demo"]), rec("y", &["demo", "other"])],
        Prune::Missing,
    );
    assert_eq!(ids(&r, "third"), ["y"]);
    assert!(r.route("other").is_none());
    // Right after an outage a missing record is kept, unless its server left; then
    // it is dropped.
    r.apply_shared(vec![], Prune::Left(HashSet::new()));
    assert_eq!(ids(&r, "demo"), ["x"]);
    assert_eq!(r.shared_ids(), ["x"]);
    r.apply_shared(vec![], Prune::Left(HashSet::from(["x".to_string()])));
    assert!(r.route("demo").is_none());
    r.apply_shared(vec![rec("x", &["demo"])], Prune::Missing);
    assert_eq!(ids(&r, "demo"), ["x"]);
    r.apply_shared(vec![], Prune::Missing);
    assert!(r.route("demo").is_none());
    assert_eq!(ids(&r, "third"), ["y"]);
    let snap = r.snapshot();
    assert_eq!(snap["servers"][0]["origin"], "local");
}

#[test]
fn a_record_round_trips_through_json() {
    let rec = ServerRecord {
        info: info("a"),
        tunnels: vec!["demo".into()],
        load: Some(load(&[("demo", 2)], true)),
        dispatcher: "d".into(),
    };
    let json = serde_json::to_string(&rec).unwrap();
    assert_eq!(serde_json::from_str::<ServerRecord>(&json).unwrap(), rec);
}

#[tokio::test(start_paused = true)]
async fn a_departed_server_is_counted_and_its_unused_channel_evicted_once() {
    let prom = prometheus::Registry::new();
    let metrics = Metrics::register(&prom).unwrap();
    let evicted = Arc::new(Mutex::new(Vec::<String>::new()));
    let r = Routes::new(
        RoutingConfig::default(),
        Duration::from_secs(3),
        "d1".into(),
        false,
        metrics.clone(),
    )
    .with_evict({
        let evicted = evicted.clone();
        move |url| evicted.lock().push(url.to_string())
    });
    let a = r.join(info("a")).unwrap();
    let b = r.join(info("b")).unwrap();
    // c shares b's forward URL (two ids behind one address).
    let c = r
        .join(ServerInfo {
            forward_url: "http://b".into(),
            ..info("c")
        })
        .unwrap();
    r.tunnel_up(a, "demo");
    r.tunnel_up(c, "demo");
    assert_eq!(metrics.tunnel_servers.get(), 3);
    assert_eq!(metrics.tunnels.get(), 1);
    // b leaves: c still uses its URL, so the channel stays.
    assert_eq!(r.leave(b), Some(info("b")));
    assert!(evicted.lock().is_empty());
    assert_eq!(r.leave(b), None, "a server leaves once");
    assert_eq!(metrics.tunnel_servers.get(), 2);
    // a stops reporting: the tick expires it, counts it and evicts its channel.
    for _ in 0..4 {
        tokio::time::advance(Duration::from_secs(1)).await;
        r.load(c, load(&[("demo", 1)], false), false);
        r.tick(Instant::now());
    }
    assert_eq!(*evicted.lock(), ["http://a"]);
    assert_eq!(metrics.lease_expiries.get(), 1);
    assert_eq!(metrics.tunnel_servers.get(), 1);
    assert_eq!(ids(&r, "demo"), ["c"]);
    assert!(
        !r.load(a, load(&[], false), false),
        "the expired session is stale"
    );
}

#[tokio::test(start_paused = true)]
async fn a_load_report_rebuilds_only_the_plans_it_changes() {
    let r = registry(false);
    let a = r.join(info("a")).unwrap();
    r.tunnel_up(a, "t");
    r.tunnel_up(a, "u");
    r.load(a, load(&[("t", 1), ("u", 1)], false), false);
    let plan = |tid: &str| r.plans.get(tid).map(|p| p.clone()).unwrap();
    let (t, u) = (plan("t"), plan("u"));
    r.load(a, load(&[("t", 2), ("u", 1)], false), false);
    assert!(!Arc::ptr_eq(&t, &plan("t")), "t's figures moved");
    assert!(Arc::ptr_eq(&u, &plan("u")), "u's plan is the same one");
    assert_eq!(plan("t").order()[0].idle, 2);
}

#[test]
fn the_call_path_does_not_wait_for_the_writers() {
    let r = Arc::new(registry(false));
    let a = r.join(info("a")).unwrap();
    r.tunnel_up(a, "demo");
    // A writer holds the table (a rebuild in progress): routing goes on.
    let held = r.writers.lock();
    let (tx, rx) = std::sync::mpsc::channel();
    let caller = {
        let r = r.clone();
        std::thread::spawn(move || {
            let pick = r.route("demo").map(|p| p.servers[0].server_id.to_string());
            r.note_no_capacity("demo", "a");
            tx.send(pick).unwrap();
        })
    };
    let pick = rx
        .recv_timeout(Duration::from_secs(30))
        .expect("route and note_no_capacity returned while a writer held the table");
    drop(held);
    caller.join().unwrap();
    assert_eq!(pick.as_deref(), Some("a"));
}

/// The value of a gauge family's series with these label values.
fn gauge(r: &prometheus::Registry, name: &str, values: &[&str]) -> Option<f64> {
    r.gather()
        .iter()
        .filter(|f| f.name() == name)
        .flat_map(|f| f.get_metric())
        .find(|m| {
            let mut l: Vec<&str> = m.get_label().iter().map(|l| l.value()).collect();
            l.sort();
            let mut want = values.to_vec();
            want.sort();
            l == want
        })
        .map(|m| m.get_gauge().get_value())
}

#[tokio::test(start_paused = true)]
async fn the_gauges_follow_each_change_of_rtt_tier_and_spill_share_and_only_those() {
    let (prom, r) = gauged();
    let a = r.join(info("a")).unwrap();
    let b = r.join(info("b")).unwrap();
    r.tunnel_up(a, "t");
    r.tunnel_up(b, "t");
    let with = |idle_a: u32, queued_a: u32, rtt_a: u32| LoadFigures {
        tunnels: [(
            "t".to_string(),
            TunnelFigures {
                idle: idle_a,
                busy: 4,
                queued: queued_a,
                rtt_us: rtt_a,
            },
        )]
        .into(),
        ..load(&[], false)
    };
    let b_load = LoadFigures {
        tunnels: [(
            "t".to_string(),
            TunnelFigures {
                idle: 2,
                rtt_us: 1_000,
                ..Default::default()
            },
        )]
        .into(),
        ..load(&[], false)
    };
    r.forward_rtt("http://a", Some(1_000));
    r.forward_rtt("http://b", Some(1_000));
    r.load(b, b_load.clone(), false);
    r.load(a, with(3, 0, 1_000), false);
    r.tick(Instant::now());
    let rtt = |s: &str| gauge(&prom, "relay_dispatcher_server_rtt_seconds", &[s, "t"]);
    let tier = |s: &str| gauge(&prom, "relay_dispatcher_server_tier", &[s, "t"]);
    let spill = || gauge(&prom, "relay_dispatcher_spill_share", &["t"]);
    assert_eq!(rtt("a"), Some(0.002));
    assert_eq!((tier("a"), tier("b")), (Some(0.0), Some(0.0)));
    assert_eq!(spill(), Some(0.0));
    // Only the idle count changes: the plan is rebuilt, the series keep their values.
    r.load(a, with(2, 0, 1_000), false);
    assert_eq!(rtt("a"), Some(0.002));
    // a's agent leg grows tenfold: its RTT and tier follow.
    r.load(a, with(2, 0, 20_000), false);
    tokio::time::advance(Duration::from_millis(300)).await;
    r.tick(Instant::now());
    assert_eq!(rtt("a"), Some(0.021));
    assert_eq!((tier("a"), tier("b")), (Some(1.0), Some(0.0)));
    // Calls queue on the home (a: b, in the better tier, has too few idle streams to
    // take its calls): the share rises at each step and its gauge with it.
    r.load(a, with(0, 3, 20_000), false);
    let mut last = spill().unwrap();
    for _ in 0..3 {
        tokio::time::advance(Duration::from_millis(300)).await;
        r.tick(Instant::now());
        let now = spill().unwrap();
        assert!(now > last, "the share rose: {last} -> {now}");
        last = now;
    }
    // At rest again, the share decays and the tick settles.
    for _ in 0..20 {
        // Reports keep coming (within the lease), the same each time.
        r.load(a, with(2, 0, 20_000), false);
        r.load(b, b_load.clone(), false);
        tokio::time::advance(Duration::from_millis(300)).await;
        r.tick(Instant::now());
    }
    assert_eq!(spill(), Some(0.0), "the share decayed to zero");
    assert_eq!(rtt("b"), Some(0.002));
}
