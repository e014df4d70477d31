//! `relay-fleet bench`: the same small call made directly to the simulated upstream and
//! through the whole relay (dispatcher, tunnel server, agent), at several numbers of
//! concurrent closed-loop callers, side by side in one run on one machine.
//!
//! Each component runs on its own runtime, as in `run`. The relay is warmed up first (so
//! the agent has grown its streams) and each level runs direct then relayed for the same
//! time. This module measures; it must not print.

use super::runner::procstat;
use crate::client::Caller;
use crate::load::{Call, CallId, Expect, Ledger, Link, Plan};
use crate::stack::{Stack, TUNNEL_ID};
use bytes::Bytes;
use http::Method;
use serde::Serialize;
use std::sync::Arc;
use std::time::Duration;
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// Throughput and latency of one side at one level.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Side {
    pub calls: u64,
    pub errors: u64,
    pub calls_per_s: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
    /// Process CPU seconds per 1000 calls during this side's run.
    pub cpu_s_per_1000_calls: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct Row {
    pub callers: usize,
    pub direct: Side,
    pub relayed: Side,
}

/// GET `path` through the caller, any 2xx counting as ok.
struct Get {
    caller: Caller,
    path: String,
    ledger: Ledger,
}

impl Plan for Get {
    type Tag = ();

    fn next(&self, _: CallId) -> Option<(Call, ())> {
        let req = self.caller.request(Method::GET, &self.path, Bytes::new());
        Some((Call::new(req, Expect::Any), ()))
    }

    fn ledger(&self) -> &Ledger {
        &self.ledger
    }
}

/// Closed loop ([`crate::load::workers`]): `callers` workers calling `path` back to back
/// for `d`.
pub(super) async fn closed_loop(caller: &Caller, path: &str, callers: usize, d: Duration) -> Side {
    let plan = Arc::new(Get {
        caller: caller.clone(),
        path: path.to_string(),
        ledger: Ledger::new(true),
    });
    let cpu0 = procstat::process_cpu();
    let start = Instant::now();
    let stop = CancellationToken::new();
    let mut workers = JoinSet::new();
    crate::load::workers(
        &plan,
        &Link::shared(caller.clone()),
        0..callers,
        &[],
        &stop,
        &mut workers,
    );
    tokio::time::sleep_until(start + d).await;
    stop.cancel();
    while workers.join_next().await.is_some() {}
    let took = start.elapsed().as_secs_f64();
    let cpu = procstat::process_cpu() - cpu0;
    let mut v: Vec<f64> = plan
        .ledger
        .calls()
        .iter()
        .filter(|c| c.code.is_empty())
        .map(|c| c.took.as_secs_f64() * 1000.0)
        .collect();
    v.sort_by(|a, b| a.total_cmp(b));
    let q = |p: f64| {
        if v.is_empty() {
            0.0
        } else {
            v[((p * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1]
        }
    };
    let calls = v.len() as u64;
    Side {
        calls,
        errors: plan.ledger.failed(),
        calls_per_s: calls as f64 / took,
        p50_ms: q(0.5),
        p99_ms: q(0.99),
        cpu_s_per_1000_calls: if calls == 0 {
            0.0
        } else {
            cpu / calls as f64 * 1000.0
        },
    }
}

/// Runs the benchmark at each level for `each` per side.
pub async fn bench(levels: &[usize], each: Duration) -> anyhow::Result<Vec<Row>> {
    let mk = |name: &str, threads: usize| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads)
            .thread_name(name)
            .enable_all()
            .build()
    };
    let rts = [
        mk("fleet-dispatch", 1)?,
        mk("fleet-servers", 1)?,
        mk("fleet-agents", 1)?,
        mk("fleet-lb", 1)?,
        mk("fleet-upstream", 1)?,
    ];
    let handles = crate::stack::Runtimes {
        dispatcher: rts[0].handle().clone(),
        servers: rts[1].handle().clone(),
        agents: rts[2].handle().clone(),
        lb: rts[3].handle().clone(),
        upstream: rts[4].handle().clone(),
        per_server: Vec::new(),
    };
    let result = async {
        let stack = Stack::builder()
            .servers(1)
            .runtimes(handles)
            .start()
            .await?;
        stack.wait_routable(Duration::from_secs(20)).await?;
        let relayed = stack.caller();
        let direct = Caller::new(stack.upstream.addr, None);
        let rpath = format!("/relay/{TUNNEL_ID}/hello");
        let top = levels.iter().copied().max().unwrap_or(1);
        // Warm-up: connections on both paths, and the agent grows to the top level.
        closed_loop(&direct, "/hello", top, Duration::from_secs(1)).await;
        closed_loop(&relayed, &rpath, top, Duration::from_secs(3)).await;
        let mut rows = Vec::new();
        for &n in levels {
            let d = closed_loop(&direct, "/hello", n, each).await;
            let r = closed_loop(&relayed, &rpath, n, each).await;
            rows.push(Row {
                callers: n,
                direct: d,
                relayed: r,
            });
        }
        let _ = tokio::time::timeout(Duration::from_secs(20), stack.shutdown()).await;
        Ok(rows)
    }
    .await;
    for rt in rts {
        rt.shutdown_background();
    }
    result
}

/// The side-by-side table.
pub fn table(rows: &[Row]) -> String {
    let mut o = String::from(
        "callers | direct calls/s   p50 ms   p99 ms | relayed calls/s   p50 ms   p99 ms | throughput relayed/direct | p50 relayed/direct | relayed CPU s/1k calls\n",
    );
    for r in rows {
        o.push_str(&format!(
            "{:>7} | {:>14.0} {:>8.3} {:>8.3} | {:>15.0} {:>8.3} {:>8.3} | {:>25.2} | {:>18.1} | {:>22.3}\n",
            r.callers,
            r.direct.calls_per_s,
            r.direct.p50_ms,
            r.direct.p99_ms,
            r.relayed.calls_per_s,
            r.relayed.p50_ms,
            r.relayed.p99_ms,
            r.relayed.calls_per_s / r.direct.calls_per_s.max(1e-9),
            r.relayed.p50_ms / r.direct.p50_ms.max(1e-9),
            r.relayed.cpu_s_per_1000_calls,
        ));
        if r.direct.errors + r.relayed.errors > 0 {
            o.push_str(&format!(
                "        errors: direct {}, relayed {}\n",
                r.direct.errors, r.relayed.errors
            ));
        }
    }
    o
}
