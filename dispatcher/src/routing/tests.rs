//! Tables of cases for the routing decision: spill share, tiers, draining, sticky.

use super::*;
use std::time::Duration;

fn cfg(policy: RoutingPolicy) -> RoutingConfig {
    RoutingConfig {
        policy,
        spill_step: 0.1,
        spill_decay: 0.05,
        spill_max: 0.5,
        step_interval: Duration::from_millis(100),
        tier_hysteresis: 0.2,
        ..RoutingConfig::default()
    }
}

/// A server view: (id, idle, busy, queued, rtt_us), announced at `t0 + announced_ms`.
#[derive(Clone, Copy)]
struct S {
    id: &'static str,
    idle: u32,
    busy: u32,
    queued: u32,
    rtt_us: u32,
    load_permille: u32,
    draining: bool,
    announced_ms: u64,
}

fn s(id: &'static str, idle: u32, busy: u32, queued: u32) -> S {
    S {
        id,
        idle,
        busy,
        queued,
        rtt_us: 0,
        load_permille: 0,
        draining: false,
        announced_ms: 0,
    }
}

impl S {
    fn rtt(mut self, ms: f64) -> Self {
        self.rtt_us = (ms * 1000.0) as u32;
        self
    }
    /// Reported load (smoothed CPU use) as a fraction.
    fn load(mut self, share: f64) -> Self {
        self.load_permille = (share * 1000.0) as u32;
        self
    }
    fn draining(mut self) -> Self {
        self.draining = true;
        self
    }
    fn announced(mut self, ms: u64) -> Self {
        self.announced_ms = ms;
        self
    }
}

struct Sim {
    router: Router,
    t0: Instant,
    now: Instant,
}

impl Sim {
    fn new(policy: RoutingPolicy) -> Self {
        let t0 = Instant::now();
        Sim {
            router: Router::new(cfg(policy)),
            t0,
            now: t0,
        }
    }

    /// One report round: advances time by one step interval and updates.
    fn step(&mut self, servers: &[S]) {
        self.now += Duration::from_millis(100);
        self.update(servers);
    }

    /// Updates without advancing time (a report arriving between steps).
    fn update(&mut self, servers: &[S]) {
        let views = views_of(self.t0, servers);
        let table = HashMap::from([("demo".to_string(), views)]);
        self.router.update(self.now, &table);
    }

    fn spill(&self) -> f64 {
        self.router.status("demo").unwrap().spill_share
    }

    fn home(&self) -> String {
        self.router
            .status("demo")
            .unwrap()
            .home
            .map(|h| h.to_string())
            .unwrap_or_default()
    }

    fn order(&self) -> Vec<String> {
        self.router
            .plan("demo")
            .map(|p| p.order().iter().map(|t| t.server_id.to_string()).collect())
            .unwrap_or_default()
    }

    fn tier(&self, id: &str) -> usize {
        self.router
            .status("demo")
            .unwrap()
            .tiers
            .iter()
            .find(|(s, _)| &**s == id)
            .map(|(_, t)| *t)
            .unwrap()
    }

    /// How many of `n` calls go first to each server.
    fn spread(&self, n: u64) -> HashMap<String, u64> {
        let plan = self.router.plan("demo").unwrap();
        let mut out = HashMap::new();
        for i in 0..n {
            let p = plan.pick_nth(i);
            *out.entry(p.servers[0].server_id.to_string()).or_default() += 1;
        }
        out
    }
}

fn approx(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-9
}

#[test]
fn home_is_the_server_with_the_most_idle_streams_and_stays_while_it_has_idle_ones() {
    let mut sim = Sim::new(RoutingPolicy::Available);
    sim.step(&[s("a", 2, 0, 0), s("b", 9, 0, 0), s("c", 1, 0, 0)]);
    assert_eq!(sim.home(), "b");
    // b is busier than a now but still has an idle stream: no flap.
    sim.step(&[s("a", 5, 0, 0), s("b", 1, 8, 0), s("c", 1, 0, 0)]);
    assert_eq!(sim.home(), "b");
    assert_eq!(sim.spill(), 0.0);
    assert_eq!(sim.spread(100)["b"], 100);
}

#[test]
fn spill_share_rises_in_steps_while_home_is_saturated_and_caps() {
    let mut sim = Sim::new(RoutingPolicy::Available);
    sim.step(&[s("a", 4, 0, 0), s("b", 2, 0, 0)]);
    assert_eq!(sim.home(), "a");
    let saturated = [s("a", 0, 4, 3), s("b", 2, 0, 0)];
    let mut seen = Vec::new();
    for _ in 0..8 {
        sim.step(&saturated);
        seen.push(sim.spill());
    }
    let want = [0.1, 0.2, 0.3, 0.4, 0.5, 0.5, 0.5, 0.5];
    assert!(
        seen.iter().zip(want).all(|(a, b)| approx(*a, b)),
        "{seen:?}"
    );
    assert_eq!(sim.home(), "a", "saturation alone does not move the home");
    let spread = sim.spread(1000);
    assert_eq!((spread["a"], spread["b"]), (500, 500));
}

#[test]
fn spilled_picks_are_counted_across_the_plans_rebuilds() {
    let mut sim = Sim::new(RoutingPolicy::Available);
    sim.step(&[s("a", 4, 0, 0), s("b", 2, 0, 0)]);
    let picks = |sim: &Sim, n: usize| {
        let plan = sim.router.plan("demo").unwrap();
        (0..n).filter(|_| plan.pick().spilled).count() as u64
    };
    assert_eq!(picks(&sim, 10), 0, "nothing spills at rest");
    let saturated = [s("a", 0, 4, 3), s("b", 2, 0, 0)];
    sim.step(&saturated);
    sim.step(&saturated);
    assert!(approx(sim.spill(), 0.2), "{}", sim.spill());
    let first = picks(&sim, 100);
    assert_eq!(first, 20, "a fifth of the calls spilled");
    // The next step rebuilds the plan: the count goes on from where it was.
    sim.step(&saturated);
    let second = picks(&sim, 100);
    assert_eq!(second, 30);
    assert_eq!(sim.router.status("demo").unwrap().spills, first + second);
}

#[test]
fn spill_share_steps_at_most_once_per_step_interval() {
    let mut sim = Sim::new(RoutingPolicy::Available);
    sim.step(&[s("a", 4, 0, 0), s("b", 2, 0, 0)]);
    let saturated = [s("a", 0, 4, 3), s("b", 2, 0, 0)];
    sim.step(&saturated);
    // Three more reports within the same interval (three servers reporting) do not step.
    for _ in 0..3 {
        sim.update(&saturated);
    }
    assert!(approx(sim.spill(), 0.1), "{}", sim.spill());
}

#[test]
fn spill_share_decays_when_the_home_clears() {
    let mut sim = Sim::new(RoutingPolicy::Available);
    sim.step(&[s("a", 4, 0, 0), s("b", 2, 0, 0)]);
    for _ in 0..4 {
        sim.step(&[s("a", 0, 4, 3), s("b", 2, 0, 0)]);
    }
    assert!(approx(sim.spill(), 0.4));
    let mut seen = Vec::new();
    for _ in 0..10 {
        sim.step(&[s("a", 2, 2, 0), s("b", 2, 0, 0)]);
        seen.push((sim.spill() * 100.0).round() as u32);
    }
    assert_eq!(seen, [35, 30, 25, 20, 15, 10, 5, 0, 0, 0]);
}

#[test]
fn nothing_spills_when_every_server_is_saturated() {
    let mut sim = Sim::new(RoutingPolicy::Available);
    sim.step(&[s("a", 4, 0, 0), s("b", 2, 0, 0)]);
    for _ in 0..3 {
        sim.step(&[s("a", 0, 4, 3), s("b", 2, 0, 0)]);
    }
    assert!(sim.spill() > 0.0);
    sim.step(&[s("a", 0, 4, 3), s("b", 0, 2, 1)]);
    assert_eq!(sim.spill(), 0.0);
    assert_eq!(sim.spread(100)["a"], 100);
    // Stays zero for as long as all are saturated.
    for _ in 0..5 {
        sim.step(&[s("a", 0, 4, 9), s("b", 0, 2, 9)]);
        assert_eq!(sim.spill(), 0.0);
    }
}

#[test]
fn a_no_capacity_answer_counts_as_saturation_before_the_next_report() {
    let mut sim = Sim::new(RoutingPolicy::Available);
    sim.step(&[s("a", 4, 0, 0), s("b", 2, 0, 0)]);
    // The report says "full, nobody queued"; a call just got NO_CAPACITY from a.
    sim.router.note_no_capacity("demo", "a");
    sim.step(&[s("a", 0, 4, 0), s("b", 2, 0, 0)]);
    assert!(approx(sim.spill(), 0.1), "{}", sim.spill());
    // The hint is used once: the next step sees no queue and decays.
    sim.step(&[s("a", 0, 4, 0), s("b", 2, 0, 0)]);
    assert!(approx(sim.spill(), 0.05), "{}", sim.spill());
}

#[test]
fn spilled_calls_go_to_servers_with_idle_streams_in_proportion() {
    let mut sim = Sim::new(RoutingPolicy::Available);
    sim.step(&[
        s("a", 4, 0, 0),
        s("b", 3, 0, 0),
        s("c", 1, 0, 0),
        s("d", 0, 1, 0),
    ]);
    for _ in 0..10 {
        sim.step(&[
            s("a", 0, 4, 2),
            s("b", 3, 0, 0),
            s("c", 1, 0, 0),
            s("d", 0, 1, 0),
        ]);
    }
    let spread = sim.spread(800);
    assert_eq!(spread["a"], 400);
    assert_eq!(spread["b"], 300);
    assert_eq!(spread["c"], 100);
    assert!(
        !spread.contains_key("d"),
        "d has no idle stream: {spread:?}"
    );
    // Every pick still lists every server, for retries.
    let plan = sim.router.plan("demo").unwrap();
    assert_eq!(plan.pick_nth(1).servers.len(), 4);
}

#[test]
fn a_draining_server_is_never_chosen_while_another_can_serve() {
    let mut sim = Sim::new(RoutingPolicy::Available);
    sim.step(&[s("a", 9, 0, 0), s("b", 1, 0, 0)]);
    assert_eq!(sim.home(), "a");
    sim.step(&[s("a", 9, 0, 0).draining(), s("b", 0, 1, 4)]);
    assert_eq!(sim.home(), "b", "saturated but not draining");
    assert_eq!(sim.order(), ["b", "a"], "draining last");
    assert_eq!(sim.spread(100)["b"], 100);
    // Draining servers are never spill targets either.
    for _ in 0..5 {
        sim.step(&[s("a", 9, 0, 0).draining(), s("b", 0, 1, 4), s("c", 0, 1, 4)]);
    }
    assert_eq!(sim.spill(), 0.0);
    // Only draining servers left: they are still listed (they answer DRAINING, retried).
    sim.step(&[s("a", 9, 0, 0).draining()]);
    assert_eq!(sim.order(), ["a"]);
}

#[test]
fn sticky_follows_the_most_recent_announcement_and_never_spills() {
    let mut sim = Sim::new(RoutingPolicy::Sticky);
    let servers = [
        s("a", 9, 0, 0).announced(0),
        s("b", 0, 1, 7).announced(20),
        s("c", 3, 0, 0).announced(10),
    ];
    for _ in 0..5 {
        sim.step(&servers);
    }
    assert_eq!(sim.order(), ["b", "c", "a"]);
    assert_eq!(sim.spill(), 0.0);
    assert_eq!(sim.spread(100)["b"], 100);
    let mut servers = servers;
    servers[1] = servers[1].draining();
    sim.step(&servers);
    assert_eq!(sim.order(), ["c", "a", "b"]);
}

#[test]
fn tiers_are_grouped_from_the_lowest_remaining_average() {
    let mut sim = Sim::new(RoutingPolicy::Available);
    let servers = [
        s("a", 1, 0, 0).rtt(1.0),
        s("b", 1, 0, 0).rtt(2.9),
        s("c", 1, 0, 0).rtt(4.0),
        s("d", 1, 0, 0).rtt(7.5),
        s("e", 1, 0, 0).rtt(30.0),
        s("f", 1, 0, 0),
    ];
    sim.step(&servers);
    // a anchors tier 0 (bound max(1 + 2, 2 x 1) = 3 ms: b); c is the lowest of what
    // remains and anchors tier 1 (bound max(6, 8) = 8 ms: d); e is alone. Bounds taken
    // from the best alone (3, 6, 12, 24 ms) would split c from d and put e in tier 4. f
    // has no RTT yet: tier 0, no evidence against it.
    let tiers: Vec<usize> = ["a", "b", "c", "d", "e", "f"]
        .iter()
        .map(|id| sim.tier(id))
        .collect();
    assert_eq!(tiers, [0, 0, 1, 1, 2, 0]);
    // Slow paths: 2 x best wins over best + 2 ms.
    let mut sim = Sim::new(RoutingPolicy::Available);
    sim.step(&[
        s("a", 1, 0, 0).rtt(40.0),
        s("b", 1, 0, 0).rtt(79.0),
        s("c", 1, 0, 0).rtt(81.0),
    ]);
    assert_eq!((sim.tier("a"), sim.tier("b"), sim.tier("c")), (0, 0, 1));
}

#[test]
fn a_faster_server_appearing_above_a_group_does_not_split_it() {
    for a_ms in [6.0, 7.0] {
        let mut sim = Sim::new(RoutingPolicy::Available);
        // b and c form one group: 19 ms is within max(10 + 2, 2 x 10) = 20 ms.
        let bc = [s("b", 1, 0, 0).rtt(10.0), s("c", 1, 0, 0).rtt(19.0)];
        sim.step(&bc);
        assert_eq!((sim.tier("b"), sim.tier("c")), (0, 0));
        // a appears above. Its own bound (12 or 14 ms) reaches b but not c: the group goes
        // below a as a whole instead of b joining a and c being left alone.
        sim.step(&[s("a", 1, 0, 0).rtt(a_ms), bc[0], bc[1]]);
        assert_eq!(
            (sim.tier("a"), sim.tier("b"), sim.tier("c")),
            (0, 1, 1),
            "a at {a_ms} ms"
        );
        // And it stays so while nothing moves.
        for _ in 0..3 {
            sim.step(&[s("a", 1, 0, 0).rtt(a_ms), bc[0], bc[1]]);
        }
        assert_eq!((sim.tier("b"), sim.tier("c")), (1, 1));
    }
}

#[test]
fn hysteresis_follows_the_groups_lowest_member() {
    let mut sim = Sim::new(RoutingPolicy::Available);
    sim.step(&[s("a", 1, 0, 0).rtt(1.0), s("b", 1, 0, 0).rtt(2.5)]);
    assert_eq!(sim.tier("b"), 0);
    // a got slower: the group's bound is max(1.6 + 2, 3.2) = 3.6 ms, b may drift to 4.32.
    sim.step(&[s("a", 1, 0, 0).rtt(1.6), s("b", 1, 0, 0).rtt(4.2)]);
    assert_eq!(sim.tier("b"), 0, "with its group");
    sim.step(&[s("a", 1, 0, 0).rtt(1.6), s("b", 1, 0, 0).rtt(4.4)]);
    assert_eq!(sim.tier("b"), 1, "past the group's bound and margin");
}

#[test]
fn a_server_near_a_tier_boundary_does_not_flap() {
    let mut sim = Sim::new(RoutingPolicy::Available);
    let with_b = |b_ms: f64| [s("a", 1, 0, 0).rtt(1.0), s("b", 1, 0, 0).rtt(b_ms)];
    sim.step(&with_b(2.5));
    assert_eq!(sim.tier("b"), 0);
    // Bound 3 ms, hysteresis 20%: b may drift to 3.6 ms and stay.
    for ms in [3.1, 3.5, 2.9, 3.4] {
        sim.step(&with_b(ms));
        assert_eq!(sim.tier("b"), 0, "at {ms} ms");
    }
    sim.step(&with_b(3.7));
    assert_eq!(sim.tier("b"), 1, "left past the margin");
    // Back just under the bound is not enough: it must come 20% inside (2.4 ms).
    for ms in [2.9, 2.5, 3.2] {
        sim.step(&with_b(ms));
        assert_eq!(sim.tier("b"), 1, "at {ms} ms");
    }
    sim.step(&with_b(2.3));
    assert_eq!(sim.tier("b"), 0);
}

#[test]
fn the_home_is_taken_from_the_lowest_tier_with_capacity() {
    let mut sim = Sim::new(RoutingPolicy::Available);
    // c has the most idle streams but is far away.
    sim.step(&[
        s("a", 2, 0, 0).rtt(1.0),
        s("b", 1, 0, 0).rtt(1.5),
        s("c", 9, 0, 0).rtt(20.0),
    ]);
    assert_eq!(sim.home(), "a");
    // The near tier saturates: calls spill to the far server rather than queue (c is not
    // big enough to take the home: 5 < 2 x 2 + 2).
    for _ in 0..3 {
        sim.step(&[
            s("a", 0, 2, 3).rtt(1.0),
            s("b", 0, 1, 1).rtt(1.5),
            s("c", 5, 0, 0).rtt(20.0),
        ]);
    }
    assert_eq!(sim.home(), "a");
    assert!(approx(sim.spill(), 0.3));
    assert_eq!(sim.order()[1], "c");
    // A home in a far tier moves to a near one as soon as the near tier has capacity.
    let mut sim = Sim::new(RoutingPolicy::Available);
    sim.step(&[s("a", 0, 2, 0).rtt(1.0), s("c", 9, 0, 0).rtt(20.0)]);
    assert_eq!(sim.home(), "c");
    sim.step(&[s("a", 1, 1, 0).rtt(1.0), s("c", 9, 0, 0).rtt(20.0)]);
    assert_eq!(sim.home(), "a");
}

#[test]
fn spill_targets_prefer_the_lowest_tier_with_idle_streams() {
    let mut sim = Sim::new(RoutingPolicy::Available);
    let servers = [
        s("a", 0, 2, 3).rtt(1.0),
        s("b", 1, 0, 0).rtt(1.2),
        s("c", 5, 0, 0).rtt(20.0),
    ];
    sim.step(&[s("a", 2, 0, 0).rtt(1.0), servers[1], servers[2]]);
    for _ in 0..10 {
        sim.step(&servers);
    }
    let spread = sim.spread(100);
    assert_eq!((spread["a"], spread["b"]), (50, 50));
    assert!(!spread.contains_key("c"), "{spread:?}");
}

#[test]
fn a_home_that_leaves_is_replaced_and_the_share_restarts() {
    let mut sim = Sim::new(RoutingPolicy::Available);
    sim.step(&[s("a", 4, 0, 0), s("b", 2, 0, 0), s("c", 1, 0, 0)]);
    for _ in 0..3 {
        sim.step(&[s("a", 0, 4, 3), s("b", 2, 0, 0), s("c", 1, 0, 0)]);
    }
    assert!(sim.spill() > 0.0);
    sim.step(&[s("b", 2, 0, 0), s("c", 1, 0, 0)]);
    assert_eq!(sim.home(), "b");
    assert_eq!(sim.spill(), 0.0);
    sim.step(&[]);
    assert!(sim.router.plan("demo").is_none());
    sim.router.update(sim.now, &HashMap::new());
    assert!(sim.router.status("demo").is_none(), "forgotten");
}

#[test]
fn spill_share_stays_within_bounds_under_any_report_sequence() {
    // A small exhaustive walk: every sequence of 6 reports over 3 load states.
    let states = [
        [s("a", 0, 4, 3), s("b", 2, 0, 0)],
        [s("a", 2, 2, 0), s("b", 2, 0, 0)],
        [s("a", 0, 4, 3), s("b", 0, 2, 2)],
    ];
    for seq in 0..3u32.pow(6) {
        let mut sim = Sim::new(RoutingPolicy::Available);
        sim.step(&[s("a", 4, 0, 0), s("b", 2, 0, 0)]);
        let mut code = seq;
        let mut prev = sim.spill();
        for _ in 0..6 {
            let st = &states[(code % 3) as usize];
            code /= 3;
            sim.step(st);
            let now = sim.spill();
            assert!((0.0..=0.5 + 1e-9).contains(&now));
            assert!(now - prev <= 0.1 + 1e-9, "rose by more than one step");
            if st[1].idle == 0 {
                assert_eq!(now, 0.0);
            }
            prev = now;
        }
    }
}

#[test]
fn a_home_dwarfed_by_another_server_yields_once_and_does_not_swing_back() {
    let mut sim = Sim::new(RoutingPolicy::Available);
    // Only c had reported when the home was picked.
    sim.step(&[s("a", 0, 0, 0), s("c", 2, 0, 0)]);
    assert_eq!(sim.home(), "c");
    // a reports 21 idle streams: more than twice c's pool of 2 (plus 2).
    sim.step(&[s("a", 21, 0, 0), s("c", 2, 0, 0)]);
    assert_eq!(sim.home(), "a");
    // A comparable server never takes the home from one with idle streams.
    sim.step(&[s("a", 1, 20, 0), s("c", 5, 0, 0)]);
    assert_eq!(sim.home(), "a");
    // Not dwarfed (5 < 2 * 4 + 2): stays, with spill for the overflow.
    let mut sim = Sim::new(RoutingPolicy::Available);
    sim.step(&[s("a", 4, 0, 0), s("b", 1, 0, 0)]);
    sim.step(&[s("a", 0, 4, 2), s("b", 5, 0, 0)]);
    assert_eq!(sim.home(), "a");
    assert!(approx(sim.spill(), 0.1));
}

#[test]
fn a_saturated_home_yields_across_tiers_and_tiers_can_be_turned_off() {
    let mut sim = Sim::new(RoutingPolicy::Available);
    sim.step(&[s("near", 1, 0, 0).rtt(1.0), s("far", 21, 0, 0).rtt(10.0)]);
    assert_eq!(sim.home(), "near", "lowest tier with capacity");
    sim.step(&[s("near", 0, 1, 6).rtt(1.0), s("far", 21, 0, 0).rtt(10.0)]);
    assert_eq!(sim.home(), "far", "queueing costs more than 9 ms");

    let mut router = Router::new(RoutingConfig {
        latency_tiers: false,
        ..cfg(RoutingPolicy::Available)
    });
    let mut sim2 = Sim::new(RoutingPolicy::Available);
    std::mem::swap(&mut sim2.router, &mut router);
    sim2.step(&[s("near", 1, 0, 0).rtt(1.0), s("far", 21, 0, 0).rtt(10.0)]);
    assert_eq!(sim2.home(), "far");
    assert_eq!((sim2.tier("near"), sim2.tier("far")), (0, 0));
}

#[test]
fn a_home_much_busier_than_a_peer_spills_a_share_of_its_calls() {
    let mut sim = Sim::new(RoutingPolicy::Available);
    sim.step(&[s("a", 5, 1, 0).load(0.3), s("b", 4, 0, 0).load(0.3)]);
    assert_eq!(sim.home(), "a");
    // a at 85% CPU (below the high-water mark), b at 40%: more than the margin (0.25)
    // apart. a is not saturated (it has idle streams), yet a share of its calls goes to b,
    // in steps, up to spill_max.
    for k in 1..=3 {
        sim.step(&[s("a", 5, 1, 0).load(0.85), s("b", 4, 0, 0).load(0.4)]);
        assert!(
            approx(sim.spill(), 0.1 * f64::from(k)),
            "step {k}: {}",
            sim.spill()
        );
    }
    let status = sim.router.status("demo").unwrap();
    assert_eq!(status.spill_reason, Some("load"));
    assert_eq!(sim.home(), "a", "the home stays where it is");
    for _ in 0..10 {
        sim.step(&[s("a", 5, 1, 0).load(0.85), s("b", 4, 0, 0).load(0.4)]);
    }
    assert!(approx(sim.spill(), 0.5));
    assert_eq!(sim.spread(100)["b"], 50);
    // Within the margin (60% against 40%): no reason to spill; the share decays.
    sim.step(&[s("a", 5, 1, 0).load(0.6), s("b", 4, 0, 0).load(0.4)]);
    assert!(approx(sim.spill(), 0.45));
    // Two servers close together never trade calls, whatever their level.
    let mut sim = Sim::new(RoutingPolicy::Available);
    for _ in 0..5 {
        sim.step(&[s("a", 5, 1, 0).load(0.7), s("b", 4, 0, 0).load(0.6)]);
    }
    assert_eq!(sim.spill(), 0.0);
    // A home with CPU to spare (below load_floor, 0.5) keeps its calls, however idle the
    // peer: they do not wait on its CPU.
    let mut sim = Sim::new(RoutingPolicy::Available);
    for _ in 0..5 {
        sim.step(&[s("a", 5, 1, 0).load(0.3), s("b", 4, 0, 0).load(0.02)]);
    }
    assert_eq!(sim.spill(), 0.0);
    // From the floor up, the margin decides.
    sim.step(&[s("a", 5, 1, 0).load(0.55), s("b", 4, 0, 0).load(0.02)]);
    assert!(approx(sim.spill(), 0.1), "{}", sim.spill());
}

#[test]
fn a_server_above_the_high_water_mark_takes_no_new_home_and_hands_its_homes_to_a_cooler_peer() {
    let mut sim = Sim::new(RoutingPolicy::Available);
    // a has the most idle streams but is at 95% CPU: the new home is b.
    sim.step(&[s("a", 9, 0, 0).load(0.95), s("b", 2, 0, 0).load(0.3)]);
    assert_eq!(sim.home(), "b");
    // Nor does a dwarfed home yield to it.
    for _ in 0..3 {
        sim.step(&[s("a", 30, 0, 0).load(0.95), s("b", 1, 0, 0).load(0.3)]);
    }
    assert_eq!(sim.home(), "b");
    // A home that gets hot hands the home to a clearly cooler peer: new calls go there.
    let mut sim = Sim::new(RoutingPolicy::Available);
    sim.step(&[s("a", 9, 0, 0).load(0.3), s("b", 2, 0, 0).load(0.3)]);
    assert_eq!(sim.home(), "a");
    sim.step(&[s("a", 9, 0, 0).load(0.95), s("b", 2, 0, 0).load(0.3)]);
    assert_eq!(sim.home(), "b");
    assert_eq!(sim.spread(100)["b"], 100);
    // Not to a peer that is hot too, or not cool enough to keep it (within the margin of
    // the mark): the home stays and spills by the margin instead.
    let mut sim = Sim::new(RoutingPolicy::Available);
    sim.step(&[s("a", 9, 0, 0).load(0.3), s("b", 2, 0, 0).load(0.3)]);
    for _ in 0..3 {
        sim.step(&[s("a", 9, 0, 0).load(0.95), s("b", 2, 0, 0).load(0.68)]);
    }
    assert_eq!(sim.home(), "a");
    assert!(approx(sim.spill(), 0.3), "{}", sim.spill());
    // When every server is hot, one of them is the home all the same.
    let mut sim = Sim::new(RoutingPolicy::Available);
    sim.step(&[s("a", 9, 0, 0).load(0.95), s("b", 2, 0, 0).load(0.99)]);
    assert_eq!(sim.home(), "a");
}

#[test]
fn with_the_load_signal_off_routing_ignores_the_load() {
    let mut sim = Sim::new(RoutingPolicy::Available);
    sim.router = Router::new(RoutingConfig {
        load_aware: false,
        ..cfg(RoutingPolicy::Available)
    });
    for _ in 0..5 {
        sim.step(&[s("a", 9, 1, 0).load(0.95), s("b", 2, 0, 0).load(0.1)]);
    }
    assert_eq!(sim.home(), "a");
    assert_eq!(sim.spill(), 0.0);
}

#[test]
fn a_home_with_calls_queued_is_saturated_though_its_report_shows_an_idle_stream() {
    // A stream that landed a moment before the queue's next call took it: the report shows
    // it idle beside the queue. The calls wait all the same: spill, and yield to a server
    // that dwarfs the home even in a worse tier.
    let mut sim = Sim::new(RoutingPolicy::Available);
    sim.step(&[s("a", 2, 0, 0).rtt(1.0), s("b", 2, 0, 0).rtt(9.0)]);
    assert_eq!(sim.home(), "a");
    sim.step(&[s("a", 1, 40, 30).rtt(1.0), s("b", 5, 0, 0).rtt(9.0)]);
    assert!(approx(sim.spill(), 0.1), "{}", sim.spill());
    sim.step(&[s("a", 1, 40, 30).rtt(1.0), s("b", 200, 0, 0).rtt(9.0)]);
    assert_eq!(sim.home(), "b");
}

#[test]
fn a_home_moved_for_load_is_not_taken_back_by_a_busier_server_that_dwarfs_it() {
    let mut sim = Sim::new(RoutingPolicy::Available);
    // b holds most of the agent's streams; it gets hot and hands the home to a.
    sim.step(&[s("a", 2, 0, 0).load(0.05), s("b", 9, 0, 0).load(0.3)]);
    assert_eq!(sim.home(), "b");
    sim.step(&[s("a", 2, 0, 0).load(0.05), s("b", 120, 0, 0).load(0.95)]);
    assert_eq!(sim.home(), "a");
    // b's load dips under the high-water mark: it dwarfs a, but is still much busier.
    for _ in 0..5 {
        sim.step(&[s("a", 2, 0, 0).load(0.05), s("b", 120, 0, 0).load(0.85)]);
        assert_eq!(sim.home(), "a");
    }
    // Once it is cool again, the dwarfed home yields to it as before.
    sim.step(&[s("a", 2, 0, 0).load(0.05), s("b", 120, 0, 0).load(0.2)]);
    assert_eq!(sim.home(), "b");
}

#[test]
fn a_busy_home_whose_rtt_grew_stays_unless_the_better_tier_can_take_its_calls() {
    let mut sim = Sim::new(RoutingPolicy::Available);
    sim.step(&[s("a", 13, 0, 0).rtt(1.0), s("b", 1, 0, 0).rtt(1.2)]);
    assert_eq!(sim.home(), "a");
    // A burst on a: 300 calls, its RTT (through its busy event loop) grows to 9 ms. b, in
    // the better tier now, holds one idle stream: the calls would only queue there.
    for _ in 0..3 {
        sim.step(&[s("a", 20, 300, 0).rtt(9.0), s("b", 1, 0, 0).rtt(1.2)]);
    }
    assert_eq!(sim.tier("b"), 0);
    assert_eq!(sim.tier("a"), 1);
    assert_eq!(sim.home(), "a");
    // Once b could take them, the home moves down.
    sim.step(&[s("a", 20, 300, 0).rtt(9.0), s("b", 320, 0, 0).rtt(1.2)]);
    assert_eq!(sim.home(), "b");
}

fn views_of(t0: Instant, servers: &[S]) -> Vec<ServerView> {
    servers
        .iter()
        .map(|s| ServerView {
            server_id: Arc::from(s.id),
            forward_url: Arc::from(format!("http://{}", s.id).as_str()),
            announced: t0 + Duration::from_millis(s.announced_ms),
            draining: s.draining,
            idle: s.idle,
            busy: s.busy,
            queued: s.queued,
            rtt_us: s.rtt_us,
            load_permille: s.load_permille,
        })
        .collect()
}

#[test]
fn a_tunnel_id_at_rest_settles_and_the_tick_rebuilds_it_again_only_when_something_changes() {
    let t0 = Instant::now();
    let mut router = Router::new(cfg(RoutingPolicy::Available));
    let rest = [s("a", 4, 0, 0), s("b", 2, 0, 0)];
    let table = HashMap::from([("demo".to_string(), views_of(t0, &rest))]);
    let mut now = t0;
    let mut tick = |router: &mut Router, table: &HashMap<String, Vec<ServerView>>| {
        now += Duration::from_millis(100);
        router
            .update(now, table)
            .into_iter()
            .map(str::to_string)
            .collect::<Vec<_>>()
    };
    // The first update builds the plan; the next, on the same views, changes nothing and
    // settles it; from then on the tick skips it.
    assert_eq!(tick(&mut router, &table), ["demo"]);
    assert_eq!(tick(&mut router, &table), ["demo"]);
    for _ in 0..5 {
        assert!(
            tick(&mut router, &table).is_empty(),
            "a settled tunnel id is skipped"
        );
    }
    assert_eq!(router.status("demo").unwrap().home.as_deref(), Some("a"));
    // A NO_CAPACITY answer is rebuilt at the next tick.
    router.note_no_capacity("demo", "a");
    assert_eq!(tick(&mut router, &table), ["demo"]);
    // A changed view (the home saturated) is rebuilt at every tick while the share steps.
    let busy = HashMap::from([(
        "demo".to_string(),
        views_of(t0, &[s("a", 0, 4, 3), s("b", 2, 0, 0)]),
    )]);
    for _ in 0..3 {
        assert_eq!(tick(&mut router, &busy), ["demo"]);
    }
    assert!(router.status("demo").unwrap().spill_share > 0.0);
}

#[test]
fn skipping_settled_tunnel_ids_routes_exactly_as_rebuilding_every_one_at_every_tick() {
    // Two routers fed the same reports, ticks and NO_CAPACITY answers: one skips what is
    // settled, the other forgets every settlement before each update. Their plans and
    // statuses must never differ.
    let states: [&[S]; 7] = [
        &[s("a", 4, 0, 0), s("b", 2, 0, 0)],
        &[s("a", 0, 4, 3), s("b", 2, 0, 0)],
        &[s("a", 0, 4, 3), s("b", 0, 2, 2)],
        &[s("a", 2, 2, 0).rtt(1.0), s("b", 12, 0, 0).rtt(6.0)],
        &[s("a", 2, 0, 0).load(0.95), s("b", 6, 0, 0).load(0.1)],
        &[
            s("a", 1, 3, 0),
            s("b", 40, 0, 0),
            s("c", 3, 0, 0).draining(),
        ],
        &[s("b", 3, 1, 0).rtt(2.0), s("c", 3, 0, 0).rtt(2.1)],
    ];
    let t0 = Instant::now();
    let mut skip = Router::new(cfg(RoutingPolicy::Available));
    let mut full = Router::new(cfg(RoutingPolicy::Available));
    let mut now = t0;
    let mut seed: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = |n: u64| {
        seed = seed
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (seed >> 33) % n
    };
    let mut state = 0usize;
    let mut skipped = 0;
    for round in 0..3000 {
        // States last a while (so tunnel ids settle), ticks come 40 to 160 ms apart
        // (steps are due every 100 ms).
        if next(8) == 0 {
            state = next(states.len() as u64) as usize;
        }
        now += Duration::from_millis(40 + next(121));
        if next(10) == 0 {
            let id = ["a", "b", "c"][next(3) as usize];
            skip.note_no_capacity("demo", id);
            full.note_no_capacity("demo", id);
        }
        let table = HashMap::from([("demo".to_string(), views_of(t0, states[state]))]);
        for st in full.tunnels.values_mut() {
            st.settled = None;
        }
        let rebuilt = skip.update(now, &table).len();
        full.update(now, &table);
        if rebuilt == 0 {
            skipped += 1;
        }
        let (a, b) = (skip.plan("demo").unwrap(), full.plan("demo").unwrap());
        assert_eq!(a.order, b.order, "round {round}: order");
        assert_eq!(
            a.spill_targets, b.spill_targets,
            "round {round}: spill targets"
        );
        assert_eq!(
            a.spill_permille, b.spill_permille,
            "round {round}: spill share"
        );
        assert_eq!(skip.status("demo"), full.status("demo"), "round {round}");
    }
    assert!(
        skipped > 300,
        "the walk settles often enough to test the skip: {skipped}"
    );
}
