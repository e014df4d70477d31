//! The table's rules, event by event: each scenario feeds typed events at simulated times
//! and checks both the table that results and the changes each event returns.

use super::*;

const LEASE: Duration = Duration::from_secs(3);

/// A table and a simulated clock: time is `base + ms`.
struct Sim {
    table: Table,
    base: Instant,
}

impl Sim {
    fn new() -> Self {
        Sim {
            table: Table::new(LEASE),
            base: Instant::now(),
        }
    }

    fn at(&self, ms: u64) -> Instant {
        self.base + Duration::from_millis(ms)
    }

    fn at_ms(&mut self, ms: u64, event: Event) -> Result<Vec<Change>, Refused> {
        self.table.apply(self.at(ms), event)
    }

    /// Server ids holding `tid`, sorted.
    fn holders(&self, tid: &str) -> Vec<String> {
        let mut ids: Vec<String> = self
            .table
            .views(tid)
            .into_iter()
            .map(|v| v.server_id.to_string())
            .collect();
        ids.sort();
        ids
    }
}

fn server(id: &str, instance: &str) -> ServerInfo {
    ServerInfo {
        server_id: id.into(),
        zone: "z".into(),
        forward_url: format!("http://{id}"),
        instance_id: instance.into(),
        direct_url: String::new(),
    }
}

fn join(session: u64, id: &str) -> Event {
    Event::Join {
        session: SessionId(session),
        server: server(id, "i1"),
    }
}

fn up(session: u64, tid: &str) -> Event {
    Event::TunnelUp {
        session: SessionId(session),
        tunnel_id: tid.into(),
    }
}

fn down(session: u64, tid: &str) -> Event {
    Event::TunnelDown {
        session: SessionId(session),
        tunnel_id: tid.into(),
    }
}

fn load(session: u64, idle: &[(&str, u32)], draining: bool) -> Event {
    Event::Load {
        session: SessionId(session),
        load: figures(idle, draining),
        partial: false,
    }
}

/// A load report of only the tunnel ids whose figures changed (`LoadReport.partial`).
fn partial(session: u64, idle: &[(&str, u32)], draining: bool) -> Event {
    Event::Load {
        session: SessionId(session),
        load: figures(idle, draining),
        partial: true,
    }
}

fn figures(idle: &[(&str, u32)], draining: bool) -> LoadFigures {
    LoadFigures {
        tunnels: idle
            .iter()
            .map(|(t, idle)| {
                let f = TunnelFigures {
                    idle: *idle,
                    ..Default::default()
                };
                (t.to_string(), f)
            })
            .collect(),
        calls_in_flight: 0,
        draining,
        cpu_permille: 0,
    }
}

fn record(id: &str) -> Change {
    Change::Record(id.into())
}

fn routes(tid: &str) -> Change {
    Change::Routes(tid.into())
}

fn gone(id: &str, why: Gone, url_in_use: bool) -> Change {
    Change::Gone {
        server: server(id, "i1"),
        why,
        url_in_use,
    }
}

fn shared_record(id: &str, tunnels: &[&str], idle: u32) -> ServerRecord {
    ServerRecord {
        info: server(id, "i1"),
        tunnels: tunnels.iter().map(|s| s.to_string()).collect(),
        load: Some(figures(
            &tunnels.iter().map(|t| (*t, idle)).collect::<Vec<_>>(),
            false,
        )),
        dispatcher: "d2".into(),
    }
}

#[test]
fn a_server_joins_announces_tunnels_and_drops_one() {
    let mut s = Sim::new();
    assert_eq!(
        s.at_ms(0, join(1, "a")),
        Ok(vec![record("a"), Change::Fleet]),
        "a join is a new record and a new fleet member; no tunnel id yet"
    );
    assert_eq!(s.at_ms(10, up(1, "t")), Ok(vec![record("a"), routes("t")]));
    assert_eq!(s.at_ms(20, up(1, "u")), Ok(vec![record("a"), routes("u")]));
    assert_eq!(
        s.at_ms(30, up(1, "t")),
        Ok(vec![record("a")]),
        "announcing a held tunnel id again renews the entry and changes no route"
    );
    assert_eq!(s.holders("t"), ["a"]);
    assert_eq!(
        s.table.counts(),
        RouteCounts {
            servers: 1,
            tunnels: 2
        }
    );
    assert_eq!(
        s.at_ms(40, down(1, "t")),
        Ok(vec![record("a"), routes("t")])
    );
    assert_eq!(s.at_ms(50, down(1, "t")), Ok(vec![record("a")]));
    assert!(s.holders("t").is_empty());
    assert_eq!(s.table.counts().tunnels, 1);
}

#[test]
fn a_load_report_changes_only_the_routes_whose_figures_moved() {
    let mut s = Sim::new();
    s.at_ms(0, join(1, "a")).unwrap();
    for tid in ["t", "u", "v"] {
        s.at_ms(0, up(1, tid)).unwrap();
    }
    assert_eq!(
        s.at_ms(1000, load(1, &[("t", 2), ("u", 1)], false)),
        Ok(vec![record("a"), routes("t"), routes("u")]),
        "v has no figures before or after"
    );
    assert_eq!(
        s.at_ms(2000, load(1, &[("t", 2), ("u", 0)], false)),
        Ok(vec![record("a"), routes("u")]),
        "t's figures are the same"
    );
    assert_eq!(
        s.at_ms(3000, load(1, &[("t", 2), ("u", 0)], false)),
        Ok(vec![record("a")]),
        "an unchanged report only renews the entry (and its shared record)"
    );
    assert_eq!(s.table.views("t")[0].idle, 2);
}

#[test]
fn a_partial_report_changes_what_it_lists_and_keeps_the_rest() {
    let mut s = Sim::new();
    s.at_ms(0, join(1, "a")).unwrap();
    for tid in ["t", "u", "v"] {
        s.at_ms(0, up(1, tid)).unwrap();
    }
    s.at_ms(0, load(1, &[("t", 2), ("u", 1), ("v", 3)], false))
        .unwrap();
    assert_eq!(
        s.at_ms(1000, partial(1, &[("u", 0)], false)),
        Ok(vec![record("a"), routes("u")]),
        "only u moved"
    );
    let idle = |s: &Sim, t: &str| s.table.views(t)[0].idle;
    assert_eq!(
        (idle(&s, "t"), idle(&s, "u"), idle(&s, "v")),
        (2, 0, 3),
        "t and v keep the figures they had"
    );
    assert_eq!(
        s.at_ms(2000, partial(1, &[], false)),
        Ok(vec![record("a")]),
        "an empty partial report renews the lease and changes no route"
    );
    assert_eq!(
        s.at_ms(
            2000 + s.table.lease().as_millis() as u64,
            Event::ExpireLeases
        ),
        Ok(vec![]),
        "the partial report counted as a report"
    );
    // Draining reaches every route of the server, listed or not.
    assert_eq!(
        s.at_ms(3000, partial(1, &[], true)),
        Ok(vec![
            record("a"),
            routes("t"),
            routes("u"),
            routes("v"),
            Change::Fleet
        ])
    );
}

#[test]
fn a_tunnel_that_went_down_is_listed_again_when_it_comes_back() {
    let mut s = Sim::new();
    s.at_ms(0, join(1, "a")).unwrap();
    s.at_ms(0, up(1, "t")).unwrap();
    s.at_ms(0, load(1, &[("t", 2)], false)).unwrap();
    s.at_ms(100, down(1, "t")).unwrap();
    s.at_ms(200, up(1, "t")).unwrap();
    assert_eq!(
        s.table.views("t")[0].idle,
        0,
        "its old figures went with it"
    );
    assert_eq!(
        s.at_ms(1000, partial(1, &[("t", 1)], false)),
        Ok(vec![record("a"), routes("t")])
    );
    assert_eq!(s.table.views("t")[0].idle, 1);
}

#[test]
fn a_first_report_marked_partial_is_taken_whole() {
    let mut s = Sim::new();
    s.at_ms(0, join(1, "a")).unwrap();
    s.at_ms(0, up(1, "t")).unwrap();
    assert_eq!(
        s.at_ms(1000, partial(1, &[("t", 4)], false)),
        Ok(vec![record("a"), routes("t")])
    );
    assert_eq!(s.table.views("t")[0].idle, 4);
    assert_eq!(
        s.at_ms(2000, partial(9, &[("t", 1)], false)),
        Err(Refused::Stale),
        "a stale session's report is refused, partial or not"
    );
}

#[test]
fn draining_changes_every_route_of_the_server_and_the_fleet() {
    let mut s = Sim::new();
    s.at_ms(0, join(1, "a")).unwrap();
    s.at_ms(0, up(1, "t")).unwrap();
    s.at_ms(0, up(1, "u")).unwrap();
    s.at_ms(0, load(1, &[("t", 1)], false)).unwrap();
    assert_eq!(
        s.at_ms(1000, load(1, &[("t", 1)], true)),
        Ok(vec![record("a"), routes("t"), routes("u"), Change::Fleet])
    );
    assert!(s.table.views("u")[0].draining);
    assert!(s.table.members()[0].draining);
}

#[test]
fn leaving_removes_the_server_and_its_tunnels_once() {
    let mut s = Sim::new();
    s.at_ms(0, join(1, "a")).unwrap();
    s.at_ms(0, join(2, "b")).unwrap();
    s.at_ms(0, up(1, "t")).unwrap();
    s.at_ms(0, up(2, "t")).unwrap();
    s.at_ms(0, up(1, "u")).unwrap();
    assert_eq!(
        s.at_ms(
            100,
            Event::Leave {
                session: SessionId(1)
            }
        ),
        Ok(vec![
            gone("a", Gone::Left, false),
            record("a"),
            routes("t"),
            routes("u"),
            Change::Fleet
        ])
    );
    assert_eq!(s.holders("t"), ["b"]);
    assert_eq!(
        s.table.counts(),
        RouteCounts {
            servers: 1,
            tunnels: 1
        }
    );
    assert_eq!(
        s.at_ms(
            200,
            Event::Leave {
                session: SessionId(1)
            }
        ),
        Err(Refused::Stale),
        "a server leaves once"
    );
    assert_eq!(s.at_ms(200, up(1, "t")), Err(Refused::Stale));
}

#[test]
fn a_silent_server_expires_after_its_lease_and_a_reporting_one_stays() {
    let mut s = Sim::new();
    s.at_ms(0, join(1, "a")).unwrap();
    s.at_ms(0, join(2, "b")).unwrap();
    s.at_ms(0, up(1, "t")).unwrap();
    s.at_ms(0, up(2, "t")).unwrap();
    for second in 1..=3 {
        s.at_ms(second * 1000, load(2, &[("t", 1)], false)).unwrap();
        assert_eq!(
            s.at_ms(second * 1000, Event::ExpireLeases),
            Ok(vec![]),
            "a last reported {second} s ago, within the 3 s lease"
        );
    }
    s.at_ms(3001, load(2, &[("t", 1)], false)).unwrap();
    assert_eq!(
        s.at_ms(3001, Event::ExpireLeases),
        Ok(vec![
            gone("a", Gone::LeaseExpired, false),
            record("a"),
            routes("t"),
            Change::Fleet
        ])
    );
    assert_eq!(s.holders("t"), ["b"]);
    assert_eq!(s.at_ms(3002, load(1, &[], false)), Err(Refused::Stale));
}

#[test]
fn a_second_live_instance_is_refused_and_a_restart_is_accepted() {
    let mut s = Sim::new();
    let join_as = |session, instance: &str| Event::Join {
        session: SessionId(session),
        server: server("a", instance),
    };
    s.at_ms(0, join_as(1, "one")).unwrap();
    s.at_ms(0, up(1, "t")).unwrap();
    assert_eq!(
        s.at_ms(10, join_as(2, "two")),
        Err(Refused::Conflict(Conflict {
            live_instance: "one".into()
        }))
    );
    assert_eq!(s.holders("t"), ["a"], "the live instance keeps routing");
    // The same instance reconnecting replaces its own entry; the new session starts empty.
    let replaced = Change::Gone {
        server: server("a", "one"),
        why: Gone::Replaced,
        url_in_use: true,
    };
    assert_eq!(
        s.at_ms(20, join_as(3, "one")),
        Ok(vec![replaced, record("a"), routes("t")]),
        "same member, same url: no fleet change and no channel eviction"
    );
    assert_eq!(s.at_ms(30, up(1, "t")), Err(Refused::Stale));
    assert!(
        s.holders("t").is_empty(),
        "the new session resends its tunnels"
    );
    // Once it left, a new life of the id joins.
    s.at_ms(
        40,
        Event::Leave {
            session: SessionId(3),
        },
    )
    .unwrap();
    assert_eq!(
        s.at_ms(50, join_as(4, "two")),
        Ok(vec![record("a"), Change::Fleet])
    );
    assert_eq!(s.table.members()[0].instance_id, "two");
}

#[test]
fn shared_records_route_and_local_entries_win() {
    let mut s = Sim::new();
    let read = |records, prune| Event::Shared { records, prune };
    assert_eq!(
        s.at_ms(
            0,
            read(
                vec![
                    shared_record("x", &["t"], 2),
                    shared_record("y", &["t", "u"], 2)
                ],
                Prune::Missing
            )
        ),
        Ok(vec![routes("t"), routes("u"), Change::Fleet]),
        "shared entries write no record of this dispatcher"
    );
    assert_eq!(s.holders("t"), ["x", "y"]);
    assert_eq!(
        s.at_ms(
            1000,
            read(
                vec![
                    shared_record("x", &["t"], 2),
                    shared_record("y", &["t", "u"], 2)
                ],
                Prune::Missing
            )
        ),
        Ok(vec![]),
        "the same read again changes nothing"
    );
    // y reports here now: its local entry replaces the shared one and later reads skip it.
    assert_eq!(
        s.at_ms(1100, join(1, "y")),
        Ok(vec![
            gone("y", Gone::Replaced, true),
            record("y"),
            routes("t"),
            routes("u")
        ])
    );
    s.at_ms(1200, up(1, "v")).unwrap();
    assert_eq!(
        s.at_ms(
            2000,
            read(
                vec![
                    shared_record("x", &["t"], 3),
                    shared_record("y", &["t", "u"], 2)
                ],
                Prune::Missing
            )
        ),
        Ok(vec![routes("t")]),
        "x's figures moved; y's record is ignored"
    );
    assert_eq!(s.holders("v"), ["y"]);
    assert!(s.holders("u").is_empty());
    assert_eq!(s.table.ids(false), ["x"]);
    // Right after an outage a missing record is kept unless its server left.
    assert_eq!(
        s.at_ms(3000, read(vec![], Prune::Left(HashSet::new()))),
        Ok(vec![])
    );
    assert_eq!(s.holders("t"), ["x"]);
    assert_eq!(
        s.at_ms(3100, read(vec![], Prune::Left(HashSet::from(["x".into()])))),
        Ok(vec![
            gone("x", Gone::Unshared, false),
            routes("t"),
            Change::Fleet
        ])
    );
    assert!(s.holders("t").is_empty());
    assert_eq!(s.holders("v"), ["y"], "the local entry stays");
    assert_eq!(
        s.table.local_record("y", "d1").map(|r| r.tunnels),
        Some(vec!["v".to_string()])
    );
    assert_eq!(s.table.local_record("x", "d1"), None);
}

#[test]
fn a_servers_latency_is_this_dispatchers_leg_plus_the_agent_leg_once_both_are_measured() {
    let mut sim = Sim::new();
    sim.at_ms(0, join(1, "ts-1")).unwrap();
    sim.at_ms(0, up(1, "demo")).unwrap();
    let mut f = figures(&[("demo", 2)], false);
    f.tunnels.get_mut("demo").unwrap().rtt_us = 1500;
    f.cpu_permille = 420;
    sim.at_ms(
        10,
        Event::Load {
            session: SessionId(1),
            load: f,
            partial: false,
        },
    )
    .unwrap();
    let view = |sim: &Sim| sim.table.views("demo").remove(0);
    assert_eq!(view(&sim).rtt_us, 0, "the forward leg is not measured yet");
    assert_eq!(view(&sim).load_permille, 420);
    let changes = sim
        .at_ms(
            20,
            Event::ForwardRtt {
                forward_url: "http://ts-1".into(),
                rtt_us: Some(700),
            },
        )
        .unwrap();
    assert!(changes.is_empty(), "the routing tick takes it: {changes:?}");
    assert_eq!(view(&sim).rtt_us, 2200);
    // A leg to a URL no entry uses is not kept; one forgotten is unknown again.
    sim.at_ms(
        30,
        Event::ForwardRtt {
            forward_url: "http://elsewhere".into(),
            rtt_us: Some(5),
        },
    )
    .unwrap();
    assert_eq!(
        sim.table.forward_targets(),
        vec![("ts-1".to_string(), "http://ts-1".to_string())]
    );
    sim.at_ms(
        40,
        Event::ForwardRtt {
            forward_url: "http://ts-1".into(),
            rtt_us: None,
        },
    )
    .unwrap();
    assert_eq!(view(&sim).rtt_us, 0);
}
