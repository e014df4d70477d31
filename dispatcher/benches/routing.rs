//! The per-call cost of the routing decision under each policy: `TunnelPlan::pick` (what
//! every call runs) and `Router::update` (what each load report or routing tick runs), on
//! a table of 3 servers per tunnel id, with the home saturated so `available` spills.
//! And the registry's routing tick (`Routes::tick`, four times a second on the control
//! plane's thread) with 3,000 tunnel ids on 10 servers, each server's CPU figure changed
//! by a report before each tick (as the servers' reports each second do), and a
//! `/metrics` scrape of the same registry.
//!
//! `cargo bench -p relay-dispatcher --bench routing`

use criterion::{criterion_group, criterion_main, BatchSize, Criterion};
use relay_dispatcher::config::{RoutingConfig, RoutingPolicy};
use relay_dispatcher::metrics::Metrics;
use relay_dispatcher::registry::{LoadFigures, Routes, ServerInfo, SessionId, TunnelFigures};
use relay_dispatcher::routing::{Router, ServerView};
use std::collections::HashMap;
use std::hint::black_box;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

fn table(tunnels: usize, now: Instant) -> HashMap<String, Vec<ServerView>> {
    (0..tunnels)
        .map(|t| {
            let views = (0..3u32)
                .map(|s| ServerView {
                    server_id: Arc::from(format!("ts-{s}")),
                    forward_url: Arc::from(format!("http://10.0.0.{s}:8451")),
                    announced: now,
                    draining: false,
                    // The first server is saturated, the others have idle streams.
                    idle: if s == 0 { 0 } else { 4 + s },
                    busy: 8,
                    queued: if s == 0 { 3 } else { 0 },
                    rtt_us: 500 + 100 * s,
                    load_permille: 300 + 100 * s,
                })
                .collect();
            (format!("tunnel-{t}"), views)
        })
        .collect()
}

fn router(policy: RoutingPolicy, tunnels: usize) -> (Router, HashMap<String, Vec<ServerView>>) {
    let start = Instant::now();
    let table = table(tunnels, start);
    let mut r = Router::new(RoutingConfig {
        policy,
        latency_tiers: true,
        ..RoutingConfig::default()
    });
    // A few steps so `available` has a home and a spill share.
    for i in 0..10 {
        r.update(start + Duration::from_secs(i), &table);
    }
    (r, table)
}

fn bench(c: &mut Criterion) {
    for policy in [RoutingPolicy::Sticky, RoutingPolicy::Available] {
        let name = format!("{policy:?}").to_lowercase();
        let (r, table) = router(policy, 1000);
        let plan = r.plan("tunnel-7").expect("a plan");
        c.bench_function(&format!("pick/{name}"), |b| {
            b.iter(|| black_box(plan.pick()))
        });
        c.bench_function(&format!("update_1000_tunnels/{name}"), |b| {
            b.iter_batched(
                || router(policy, 1000).0,
                |mut r| {
                    r.update(Instant::now() + Duration::from_secs(60), &table);
                    r
                },
                BatchSize::LargeInput,
            )
        });
    }
}

/// A registry holding `tunnels` tunnel ids on each of `servers` servers, every server's
/// figures reported, and the sessions to report on.
fn fleet(servers: usize, tunnels: usize) -> (Routes, prometheus::Registry, Vec<SessionId>) {
    let prom = prometheus::Registry::new();
    let metrics = Metrics::register(&prom).expect("metrics");
    let routes = Routes::new(
        RoutingConfig::default(),
        Duration::from_secs(3600),
        "bench".into(),
        false,
        metrics,
    );
    let mut sessions = Vec::new();
    for s in 0..servers {
        let id = format!("ts-{s}");
        let session = routes
            .join(ServerInfo {
                server_id: id.clone(),
                zone: "z".into(),
                forward_url: format!("http://10.0.0.{s}:8451"),
                instance_id: "i".into(),
                direct_url: String::new(),
            })
            .expect("join");
        for t in 0..tunnels {
            routes.tunnel_up(session, &format!("tunnel-{t}"));
        }
        routes.load(session, figures(tunnels, s as u32, 100), false);
        sessions.push(session);
    }
    routes.forward_rtt("http://10.0.0.0:8451", Some(800));
    (routes, prom, sessions)
}

fn figures(tunnels: usize, server: u32, cpu_permille: u32) -> LoadFigures {
    LoadFigures {
        tunnels: (0..tunnels)
            .map(|t| {
                let f = TunnelFigures {
                    idle: 1 + server % 3,
                    busy: (t % 2) as u32,
                    queued: 0,
                    rtt_us: 300 + server * 10,
                };
                (format!("tunnel-{t}"), f)
            })
            .collect(),
        calls_in_flight: 0,
        draining: false,
        cpu_permille,
    }
}

fn tick(c: &mut Criterion) {
    let (routes, prom, sessions) = fleet(10, 3000);
    let mut round = 0u32;
    c.bench_function("registry_tick_3000_tunnels_10_servers", |b| {
        b.iter(|| {
            round += 1;
            for (s, session) in sessions.iter().enumerate() {
                let cpu = LoadFigures {
                    cpu_permille: 100 + (round + s as u32) % 50,
                    ..figures(0, s as u32, 0)
                };
                routes.load(*session, cpu, true);
            }
            routes.tick(Instant::now());
        })
    });
    c.bench_function("metrics_scrape_3000_tunnels_10_servers", |b| {
        b.iter(|| black_box(prom.gather().len()))
    });
}

criterion_group!(benches, bench, tick);
criterion_main!(benches);
