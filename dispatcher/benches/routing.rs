//! The per-call cost of the routing decision under each policy: `TunnelPlan::pick` (what
//! every call runs) and `Router::update` (what each load report or routing tick runs), on
//! a table of 3 servers per tunnel id, with the home saturated so `available` spills.
//!
//! `cargo bench -p relay-dispatcher --bench routing`

use criterion::{criterion_group, criterion_main, BatchSize, Criterion};
use relay_dispatcher::config::{RoutingConfig, RoutingPolicy};
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

criterion_group!(benches, bench);
criterion_main!(benches);
