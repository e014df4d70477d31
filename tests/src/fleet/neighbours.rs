//! `relay-fleet neighbours`: what one tenant's burst costs another tenant on the same
//! tunnel servers. Two agents (two tunnel ids) share a dispatcher and two tunnel servers;
//! the quiet tenant's small calls run alone, then while the noisy tenant keeps `burst`
//! slow calls in flight (each taking `slow`), and the two latency figures are compared.
//! Each component runs on its own runtime, as in `bench`.
//!
//! This module measures; it must not print.

use super::bench::{closed_loop, Side};
use crate::client::Caller;
use crate::stack::{agent_identity, Stack, TUNNEL_ID};
use serde::Serialize;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

/// What a run is asked to do.
#[derive(Clone, Debug)]
pub struct Options {
    /// The quiet tenant's closed-loop callers.
    pub callers: usize,
    /// How long each of the quiet tenant's measures runs.
    pub each: Duration,
    /// The noisy tenant's calls kept in flight.
    pub burst: usize,
    /// How long each of the noisy tenant's calls takes at the upstream.
    pub slow: Duration,
}

/// The figures of a run.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    /// The quiet tenant's calls with nothing else running.
    pub alone: Side,
    /// The quiet tenant's calls while the burst runs (from its start).
    pub beside_burst: Side,
    /// The noisy tenant's calls that were answered 200, and those that were not.
    pub burst_ok: u64,
    pub burst_failed: u64,
    /// How long the burst took to have all its calls in flight at the upstream.
    pub burst_ramp_s: Option<f64>,
}

impl Report {
    /// How much the burst raised the quiet tenant's p99, in milliseconds.
    pub fn p99_rise_ms(&self) -> f64 {
        self.beside_burst.p99_ms - self.alone.p99_ms
    }

    /// The report as text.
    pub fn table(&self, o: &Options) -> String {
        let side = |name: &str, s: &Side| {
            format!(
                "{name:<28} {:>9.0} calls/s  p50 {:>7.3} ms  p99 {:>7.3} ms  errors {}\n",
                s.calls_per_s, s.p50_ms, s.p99_ms, s.errors
            )
        };
        let mut t = String::new();
        t.push_str(&side("quiet tenant alone", &self.alone));
        t.push_str(&side("quiet tenant beside burst", &self.beside_burst));
        t.push_str(&format!(
            "p99 rise: {:+.3} ms; burst of {} calls of {:?}: {} ok, {} failed, all in flight after {}\n",
            self.p99_rise_ms(),
            o.burst,
            o.slow,
            self.burst_ok,
            self.burst_failed,
            self.burst_ramp_s
                .map_or("(never)".to_string(), |s| format!("{s:.2} s")),
        ));
        t
    }
}

/// Runs the comparison.
pub async fn run(o: &Options) -> anyhow::Result<Report> {
    let mk = |name: &str| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name(name)
            .enable_all()
            .build()
    };
    let rts = [
        mk("fleet-dispatch")?,
        mk("fleet-servers")?,
        mk("fleet-agents")?,
        mk("fleet-lb")?,
        mk("fleet-upstream")?,
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
            .servers(2)
            .agents(2)
            .runtimes(handles)
            .start()
            .await?;
        stack.wait_routable(Duration::from_secs(20)).await?;
        let caller = stack.caller();
        let quiet = format!("/relay/{TUNNEL_ID}/hello");
        let noisy_id = agent_identity(1).1;
        let noisy = format!("/relay/{noisy_id}/slow/{}", o.slow.as_millis());
        // Warm: the quiet tenant's agent has grown for its callers.
        closed_loop(&caller, &quiet, o.callers, Duration::from_secs(3)).await;
        let alone = closed_loop(&caller, &quiet, o.callers, o.each).await;

        let ok = Arc::new(AtomicU64::new(0));
        let failed = Arc::new(AtomicU64::new(0));
        let stop = CancellationToken::new();
        let mut burst = JoinSet::new();
        // Each burst caller has a connection of its own, as a thousand clients would.
        for _ in 0..o.burst {
            let (c, path) = (
                Caller::new(stack.http, Some(crate::stack::CALLER_KEY)),
                noisy.clone(),
            );
            let (ok, failed, stop) = (ok.clone(), failed.clone(), stop.clone());
            burst.spawn(async move {
                while !stop.is_cancelled() {
                    match c.get(&path).await {
                        Ok(a) if a.status == 200 => ok.fetch_add(1, Ordering::Relaxed),
                        _ => failed.fetch_add(1, Ordering::Relaxed),
                    };
                }
            });
        }
        let upstream = stack.upstream.stats();
        let burst_size = o.burst as u64;
        let ramp = tokio::spawn(async move {
            crate::time_until(Duration::from_secs(60), || {
                let reached = upstream.in_flight() >= burst_size;
                async move { reached }
            })
            .await
        });
        let beside_burst = closed_loop(&caller, &quiet, o.callers, o.each).await;
        let burst_ramp_s = ramp.await?.map(|d| d.as_secs_f64());
        stop.cancel();
        while burst.join_next().await.is_some() {}
        let _ = tokio::time::timeout(Duration::from_secs(20), stack.shutdown()).await;
        Ok(Report {
            alone,
            beside_burst,
            burst_ok: ok.load(Ordering::Relaxed),
            burst_failed: failed.load(Ordering::Relaxed),
            burst_ramp_s,
        })
    }
    .await;
    for rt in rts {
        rt.shutdown_background();
    }
    result
}
