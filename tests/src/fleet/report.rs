//! The run report: figures computed from what the runner recorded, the headline
//! expectations checked, the terminal summary table, and the JSON form (`--json`).
//!
//! Percentiles of latency are exact (every call's latency is kept); queue-wait
//! percentiles come from the tunnel servers' `relay_tunnel_queue_wait_seconds`
//! histograms, summed over every server incarnation, interpolated linearly inside a
//! bucket; its `max` is the upper bound of the highest non-empty bucket.
//!
//! This module computes and formats; it must not do I/O except where a caller asks to
//! write a file.

use super::runner::{BurstStat, RecInner};
use super::scenario::Scenario;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::Ordering;
use std::time::Duration;

/// Streams of a server by state, summed over the agents.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct ServerStreams {
    pub idle: u64,
    pub busy: u64,
    /// Agents whose coverage view does not show this server covered (counted for the
    /// running servers, which every agent should cover).
    #[serde(default)]
    pub short: u64,
}

/// One sampling point (about once a second).
#[derive(Clone, Debug, Serialize)]
pub struct Sample {
    /// Seconds since the load started.
    pub t: f64,
    /// Streams per server id by state, from the agents' coverage views.
    pub servers: BTreeMap<String, ServerStreams>,
    /// Calls the load generator has in flight.
    pub in_flight: u64,
    /// Calls queued on the tunnel servers (embedded mode only).
    pub queued: Option<f64>,
    /// The load (CPU use, 0..=1) each server last reported, as the dispatcher has it
    /// (embedded mode only).
    pub load: BTreeMap<String, f64>,
    /// Calls each server answered so far, as the dispatcher counts them (embedded mode).
    pub answered_by: BTreeMap<String, u64>,
    /// Totals so far.
    pub sent: u64,
    pub ok: u64,
    pub failed: u64,
    /// Coverage actions so far by action (all agents).
    pub actions: BTreeMap<String, u64>,
}

/// p50/p90/p99/max in milliseconds.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Quantiles {
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub max: f64,
    pub count: u64,
}

/// One second of the timeline: per-second figures derived from the samples.
#[derive(Clone, Debug, Serialize)]
pub struct Point {
    pub t: f64,
    pub servers: BTreeMap<String, ServerStreams>,
    pub streams: u64,
    pub in_flight: u64,
    pub queued: Option<f64>,
    /// The load (CPU use, 0..=1) each server last reported (embedded mode only).
    pub load: BTreeMap<String, f64>,
    /// Calls answered (ok or failed) per second since the previous point.
    pub calls_per_s: f64,
    /// Calls failed since the previous point.
    pub errors: u64,
    /// Latency of the calls started in the second before this point.
    pub latency_p50_ms: Option<f64>,
    pub latency_p99_ms: Option<f64>,
    /// Coverage actions taken since the previous point, by action.
    pub actions: BTreeMap<String, u64>,
}

/// How many calls the servers with a busy neighbour still answered.
#[derive(Clone, Debug, Serialize)]
pub struct BusyShare {
    pub servers: Vec<String>,
    /// Seconds into the run the first neighbour started.
    pub from_s: f64,
    /// Their share (0..=1) of the calls answered since then (to a sample's precision).
    pub share: f64,
    pub calls: u64,
    /// From when their load has been read and acted on (`from_s` plus a few seconds).
    pub settled_from_s: f64,
    /// Their share of the calls answered since `settled_from_s`.
    pub settled_share: f64,
    pub settled_calls: u64,
    /// Latency of the calls started since `settled_from_s` (every server).
    pub settled_latency_ms: Quantiles,
}

#[derive(Clone, Debug, Serialize)]
pub struct BurstReport {
    pub at_s: f64,
    pub calls: u64,
    pub ok: u64,
    pub answered: u64,
    /// Seconds from the burst's start to its last answer.
    pub done_after_s: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct Component {
    pub name: String,
    pub cpu_s: f64,
    pub cpu_s_per_1000_calls: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct Cpu {
    /// How the figures were measured.
    pub method: String,
    pub process_cpu_s: f64,
    pub process_cpu_s_per_1000_calls: f64,
    pub components: Vec<Component>,
}

#[derive(Clone, Debug, Serialize)]
pub struct Memory {
    /// Peak resident set of the process (VmHWM), MiB.
    pub peak_rss_mib: f64,
    /// Resident set at the end (VmRSS), MiB.
    pub rss_mib: f64,
}

/// One worker process of the agents.
#[derive(Clone, Debug, Serialize)]
pub struct WorkerReport {
    pub index: usize,
    /// Its agents, `first..end`.
    pub agents: String,
    pub pid: Option<u32>,
    /// CPU seconds over the run (from the load's start), and over its whole life.
    pub cpu_s: f64,
    pub cpu_s_total: f64,
    /// VmHWM and VmRSS as its last report had them, MiB.
    pub peak_rss_mib: f64,
    pub rss_mib: f64,
    /// How it ended, if it ended before the run stopped it.
    pub died: Option<String>,
    /// Still running after the run stopped it (an orphan): must be false.
    pub running_after: bool,
}

/// How long after a server start every agent covered every running server again.
#[derive(Clone, Debug, Serialize)]
pub struct CoveredAfter {
    pub server: String,
    /// Seconds into the run of the start.
    pub at_s: f64,
    /// Seconds from the start until every agent covered every running server (each
    /// `covered` or `growing` in its coverage view, `worker::COVERS`); `None`: not by the
    /// end of the run.
    pub after_s: Option<f64>,
    /// Seconds from the start until every agent covered the started server itself.
    pub server_after_s: Option<f64>,
}

#[derive(Clone, Debug, Serialize)]
pub struct Check {
    pub name: String,
    pub want: String,
    pub got: String,
    pub pass: bool,
}

/// Everything a run reports; this is the `--json` document.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    pub scenario: String,
    pub description: String,
    pub mode: String,
    pub seed: u64,
    pub interrupted: bool,
    /// Seconds from the first call to the end of the wait for the last answers.
    pub ran_for_s: f64,
    pub agents: usize,
    pub calls_sent: u64,
    pub calls_ok: u64,
    /// Failed calls by reason (the dispatcher's error code, `http_<status>`,
    /// `transport`, `client_timeout` for an answer after the deadline, `interrupted`).
    pub calls_failed: BTreeMap<String, u64>,
    pub calls_failed_total: u64,
    /// Calls never answered by their deadline plus the grace, answered twice, or with
    /// no recorded outcome: must be 0.
    pub calls_lost: i64,
    /// Of `calls_lost`: never answered by their deadline plus the grace.
    pub calls_never_answered: u64,
    /// Of `calls_lost`: answered twice.
    pub calls_answered_twice: u64,
    /// Arrivals not sent because `load.max_in_flight` calls were already in flight.
    pub calls_skipped: u64,
    pub latency_ms: Quantiles,
    /// None in external mode (the servers' registries are not reachable from here).
    pub queue_wait_ms: Option<Quantiles>,
    pub peak_streams: u64,
    /// Streams at the end of the run.
    pub resting_streams: u64,
    pub end_streams_per_server: BTreeMap<String, u64>,
    /// Agents not covering each running server at the end (servers every agent covers
    /// left out).
    pub end_short_per_server: BTreeMap<String, u64>,
    /// Calls each tunnel server answered over the run, from the dispatcher's
    /// `relay_dispatcher_calls_by_server_total` (embedded mode).
    pub calls_by_server: BTreeMap<String, u64>,
    /// With a busy neighbour on a server (`load_server`): that server's share of the calls
    /// answered from the fault to the end, and the calls counted.
    pub busy: Option<BusyShare>,
    pub coverage_actions: BTreeMap<String, u64>,
    pub bursts: Vec<BurstReport>,
    pub cpu: Cpu,
    pub memory: Memory,
    /// Dispatchers of the embedded relay.
    pub dispatchers: usize,
    /// The agents' worker processes (empty: the agents ran in this process).
    pub workers: Vec<WorkerReport>,
    /// Workers that ended before the run stopped them.
    pub worker_deaths: Vec<String>,
    /// Every process together: the most of (this process's RSS + the workers') at a
    /// sample, and the sum of their peaks (VmHWM), MiB.
    pub fleet_rss_peak_mib: f64,
    pub fleet_rss_peaks_sum_mib: f64,
    /// Tunnel server entries the dispatchers dropped for a missed lease (embedded mode).
    pub leases_missed: Option<u64>,
    /// Per server start: how long until every agent covered every running server again.
    pub covered_after: Vec<CoveredAfter>,
    /// How the fleet came up before the load started.
    pub startup: Vec<String>,
    pub expectations: Vec<Check>,
    /// Faults as applied: (seconds, what).
    pub events: Vec<(f64, String)>,
    pub timeline: Vec<Point>,
}

impl Report {
    /// True if every expectation holds and no call was lost.
    pub fn passed(&self) -> bool {
        self.calls_lost == 0 && self.expectations.iter().all(|c| c.pass)
    }

    /// The expectation named `name`, if the scenario set it.
    pub fn check(&self, name: &str) -> Option<&Check> {
        self.expectations.iter().find(|c| c.name == name)
    }
}

pub(crate) struct Inputs<'a> {
    pub scenario: &'a Scenario,
    pub mode: &'a str,
    pub interrupted: bool,
    pub ran_for: Duration,
    pub sent: u64,
    pub ok: u64,
    pub never_answered: u64,
    pub skipped: u64,
    pub rec: RecInner,
    pub samples: Vec<Sample>,
    pub events: Vec<(f64, String)>,
    pub bursts: &'a [BurstStat],
    pub queue_wait: Option<crate::metrics::Histogram>,
    pub cpu: BTreeMap<&'static str, f64>,
    pub process_cpu: f64,
    pub memory: (u64, u64),
    pub fleet_rss_peak_kib: u64,
    pub workers: Vec<WorkerReport>,
    pub worker_deaths: Vec<String>,
    pub leases_missed: Option<u64>,
    pub covered_after: Vec<CoveredAfter>,
    pub startup: Vec<String>,
    pub dispatchers: usize,
    pub running_servers: Vec<String>,
    /// The dispatcher's calls by server at the end.
    pub calls_by_server: BTreeMap<String, u64>,
    pub busy: Option<BusyShare>,
}

/// Exact quantiles of latencies in ms.
pub(crate) fn quantiles(v: Vec<f32>) -> Quantiles {
    exact(v)
}

fn exact(mut v: Vec<f32>) -> Quantiles {
    if v.is_empty() {
        return Quantiles::default();
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let q = |p: f64| {
        let i = ((p * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1;
        f64::from(v[i])
    };
    Quantiles {
        p50: q(0.5),
        p90: q(0.9),
        p99: q(0.99),
        max: f64::from(v[v.len() - 1]),
        count: v.len() as u64,
    }
}

/// Quantile `q` of a cumulative histogram, interpolated inside its bucket, in ms.
fn hist_quantile(h: &crate::metrics::Histogram, q: f64) -> f64 {
    if h.count == 0 {
        return 0.0;
    }
    let rank = q * h.count as f64;
    let mut prev = (0.0, 0u64);
    for &(le, c) in &h.buckets {
        if c as f64 >= rank {
            let inside = (c - prev.1) as f64;
            let frac = if inside > 0.0 {
                (rank - prev.1 as f64) / inside
            } else {
                1.0
            };
            return (prev.0 + (le - prev.0) * frac.clamp(0.0, 1.0)) * 1000.0;
        }
        prev = (le, c);
    }
    // Beyond the last bucket: report its bound.
    prev.0 * 1000.0
}

fn hist_max(h: &crate::metrics::Histogram) -> f64 {
    let mut prev = 0u64;
    let mut max = 0.0;
    for &(le, c) in &h.buckets {
        if c > prev {
            max = le;
        }
        prev = c;
    }
    max * 1000.0
}

fn secs(d: Duration) -> String {
    format!("{}", humantime::format_duration(d))
}

pub(crate) fn build(i: Inputs<'_>) -> Report {
    let s = i.scenario;
    let failed_total: u64 = i.rec.failures.values().sum();
    let latency_ms = exact(i.rec.latencies.iter().map(|(_, l)| *l).collect());
    let queue_wait_ms = i.queue_wait.as_ref().map(|h| Quantiles {
        p50: hist_quantile(h, 0.5),
        p90: hist_quantile(h, 0.9),
        p99: hist_quantile(h, 0.99),
        max: hist_max(h),
        count: h.count,
    });

    // Per-second latency by start second.
    let mut by_sec: BTreeMap<i64, Vec<f32>> = BTreeMap::new();
    for (t, l) in &i.rec.latencies {
        by_sec.entry(*t as i64).or_default().push(*l);
    }
    let mut timeline = Vec::new();
    let mut prev: Option<&Sample> = None;
    for smp in &i.samples {
        let streams = smp.servers.values().map(|v| v.idle + v.busy).sum();
        let (calls_per_s, errors, actions) = match prev {
            Some(p) => {
                let dt = (smp.t - p.t).max(1e-3);
                let done = (smp.ok + smp.failed).saturating_sub(p.ok + p.failed);
                let actions = smp
                    .actions
                    .iter()
                    .map(|(k, v)| {
                        (
                            k.clone(),
                            v.saturating_sub(p.actions.get(k).copied().unwrap_or(0)),
                        )
                    })
                    .filter(|(_, v)| *v > 0)
                    .collect();
                (
                    done as f64 / dt,
                    smp.failed.saturating_sub(p.failed),
                    actions,
                )
            }
            None => (
                0.0,
                smp.failed,
                smp.actions
                    .clone()
                    .into_iter()
                    .filter(|(_, v)| *v > 0)
                    .collect(),
            ),
        };
        let sec = smp.t.floor() as i64 - 1;
        let lat = by_sec.get(&sec).map(|v| exact(v.clone()));
        timeline.push(Point {
            t: smp.t,
            servers: smp.servers.clone(),
            streams,
            in_flight: smp.in_flight,
            queued: smp.queued,
            load: smp.load.clone(),
            calls_per_s,
            errors,
            latency_p50_ms: lat.as_ref().map(|q| q.p50),
            latency_p99_ms: lat.as_ref().map(|q| q.p99),
            actions,
        });
        prev = Some(smp);
    }
    let peak_streams = timeline.iter().map(|p| p.streams).max().unwrap_or(0);
    let last = timeline.last();
    let resting_streams = last.map(|p| p.streams).unwrap_or(0);
    let end_streams_per_server: BTreeMap<String, u64> = last
        .map(|p| {
            p.servers
                .iter()
                .map(|(k, v)| (k.clone(), v.idle + v.busy))
                .collect()
        })
        .unwrap_or_default();
    let end_short_per_server: BTreeMap<String, u64> = last
        .map(|p| {
            p.servers
                .iter()
                .filter(|(_, v)| v.short > 0)
                .map(|(k, v)| (k.clone(), v.short))
                .collect()
        })
        .unwrap_or_default();
    let coverage_actions = i
        .samples
        .last()
        .map(|s| s.actions.clone())
        .unwrap_or_default();
    let bursts: Vec<BurstReport> = i
        .bursts
        .iter()
        .map(|b| BurstReport {
            at_s: b.at,
            calls: b.calls,
            ok: b.ok.load(Ordering::Relaxed),
            answered: b.done.load(Ordering::Relaxed),
            done_after_s: b.last_done_ms.load(Ordering::Relaxed) as f64 / 1000.0,
        })
        .collect();

    let calls = i.sent.max(1) as f64 / 1000.0;
    let per_k = |cpu: f64| if i.sent == 0 { 0.0 } else { cpu / calls };
    let order = [
        "dispatcher",
        "tunnel servers",
        "control planes",
        "load balancer",
        "agents",
        "upstream",
        "load generator",
    ];
    let mut components: Vec<Component> = order
        .iter()
        .filter_map(|n| i.cpu.get(n).map(|c| (n, *c)))
        .map(|(n, c)| Component {
            name: n.to_string(),
            cpu_s: c,
            cpu_s_per_1000_calls: per_k(c),
        })
        .collect();
    let threads_sum: f64 = components.iter().map(|c| c.cpu_s).sum();
    let exited = (i.process_cpu - threads_sum).max(0.0);
    if exited > 0.005 {
        components.push(Component {
            name: "exited threads".into(),
            cpu_s: exited,
            cpu_s_per_1000_calls: per_k(exited),
        });
    }
    for w in &i.workers {
        components.push(Component {
            name: format!("agents worker {}", w.index),
            cpu_s: w.cpu_s,
            cpu_s_per_1000_calls: per_k(w.cpu_s),
        });
    }
    let cpu = Cpu {
        method: if !i.workers.is_empty() {
            "this process: each component on its own tokio runtime with named threads, CPU read per thread from /proc/self/task/*/stat ('control planes' is the relay-control threads: registries, routing ticks, report streams; 'load generator' is the callers, sampling and report); each agents worker: its process CPU from /proc/self/stat, as it reported it".into()
        } else if i.mode == "embedded" {
            "one process; each component on its own tokio runtime with named threads, CPU read per thread from /proc/self/task/*/stat; 'load generator' is the caller's runtime (calls, sampling, report)".into()
        } else {
            "simulated agents and upstream only (this process); the deployment's own CPU is not visible from here".into()
        },
        process_cpu_s: i.process_cpu,
        process_cpu_s_per_1000_calls: per_k(i.process_cpu),
        components,
    };

    let mut r = Report {
        scenario: s.name.clone(),
        description: s.description.clone(),
        mode: i.mode.to_string(),
        seed: s.seed,
        interrupted: i.interrupted,
        ran_for_s: i.ran_for.as_secs_f64(),
        agents: s.agents.count,
        calls_sent: i.sent,
        calls_ok: i.ok,
        calls_failed: i.rec.failures.clone(),
        calls_failed_total: failed_total,
        // Never answered and answered twice, plus any call with no outcome at all.
        calls_lost: (i.never_answered + i.rec.answered_twice) as i64
            + (i.sent as i64 - (i.ok + failed_total + i.never_answered) as i64),
        calls_never_answered: i.never_answered,
        calls_answered_twice: i.rec.answered_twice,
        calls_skipped: i.skipped,
        latency_ms,
        queue_wait_ms,
        peak_streams,
        resting_streams,
        end_streams_per_server,
        end_short_per_server,
        calls_by_server: i.calls_by_server,
        busy: i.busy,
        coverage_actions,
        bursts,
        cpu,
        memory: Memory {
            peak_rss_mib: i.memory.0 as f64 / 1024.0,
            rss_mib: i.memory.1 as f64 / 1024.0,
        },
        dispatchers: i.dispatchers,
        fleet_rss_peak_mib: (i.fleet_rss_peak_kib.max(i.memory.1)) as f64 / 1024.0,
        fleet_rss_peaks_sum_mib: i.memory.0 as f64 / 1024.0
            + i.workers.iter().map(|w| w.peak_rss_mib).sum::<f64>(),
        workers: i.workers,
        worker_deaths: i.worker_deaths,
        leases_missed: i.leases_missed,
        covered_after: i.covered_after,
        startup: i.startup,
        expectations: Vec::new(),
        events: i.events,
        timeline,
    };
    r.expectations = checks(s, &r, &i.rec, &i.running_servers);
    r
}

fn checks(s: &Scenario, r: &Report, rec: &RecInner, running: &[String]) -> Vec<Check> {
    let e = &s.expect;
    let mut out = vec![Check {
        name: "calls_lost".into(),
        want: "= 0".into(),
        got: r.calls_lost.to_string(),
        pass: r.calls_lost == 0,
    }];
    if let Some(max) = e.max_failed_ratio {
        let ratio = r.calls_failed_total as f64 / r.calls_sent.max(1) as f64;
        out.push(Check {
            name: "max_failed_ratio".into(),
            want: format!("<= {:.2}%", max * 100.0),
            got: format!(
                "{:.2}% ({} of {})",
                ratio * 100.0,
                r.calls_failed_total,
                r.calls_sent
            ),
            pass: ratio <= max,
        });
    }
    if let Some(max) = e.max_latency_p99 {
        out.push(Check {
            name: "max_latency_p99".into(),
            want: format!("<= {}", secs(max)),
            got: format!("{:.2} ms", r.latency_ms.p99),
            pass: r.latency_ms.p99 <= max.as_secs_f64() * 1000.0,
        });
    }
    if let Some(max) = e.max_busy_share {
        let (got, pass) = match &r.busy {
            Some(b) => (
                format!(
                    "{:.1}% of {} calls from {:.0} s",
                    b.settled_share * 100.0,
                    b.settled_calls,
                    b.settled_from_s
                ),
                b.settled_share <= max,
            ),
            None => ("not measured".into(), false),
        };
        out.push(Check {
            name: "max_busy_share".into(),
            want: format!("<= {:.1}%", max * 100.0),
            got,
            pass,
        });
    }
    if let Some(max) = e.max_queue_wait_p99 {
        let (got, pass) = match &r.queue_wait_ms {
            Some(q) => (
                format!("{:.2} ms", q.p99),
                q.p99 <= max.as_secs_f64() * 1000.0,
            ),
            None => ("not measured (external mode)".into(), true),
        };
        out.push(Check {
            name: "max_queue_wait_p99".into(),
            want: format!("<= {}", secs(max)),
            got,
            pass,
        });
    }
    if let Some(within) = e.burst_done_within {
        let worst = r.bursts.iter().map(|b| b.done_after_s).fold(0.0, f64::max);
        let all = r.bursts.iter().all(|b| b.answered == b.calls);
        out.push(Check {
            name: "burst_done_within".into(),
            want: format!("<= {}", secs(within)),
            got: format!(
                "{worst:.2} s{}",
                if all { "" } else { " (not all answered)" }
            ),
            pass: all && worst <= within.as_secs_f64(),
        });
    }
    if let Some(max) = e.max_peak_streams {
        out.push(Check {
            name: "max_peak_streams".into(),
            want: format!("<= {max}"),
            got: r.peak_streams.to_string(),
            pass: r.peak_streams <= max,
        });
    }
    if let Some(max) = e.max_resting_streams {
        out.push(Check {
            name: "max_resting_streams".into(),
            want: format!("<= {max}"),
            got: r.resting_streams.to_string(),
            pass: r.resting_streams <= max,
        });
    }
    if let Some(min) = e.min_end_streams_per_server {
        let ids: Vec<&String> = if running.is_empty() {
            r.end_streams_per_server.keys().collect()
        } else {
            running.iter().collect()
        };
        let worst = ids
            .iter()
            .map(|id| {
                (
                    id.as_str(),
                    r.end_streams_per_server.get(*id).copied().unwrap_or(0),
                )
            })
            .min_by_key(|(_, n)| *n);
        let (got, pass) = match worst {
            Some((id, n)) => (format!("{n} on {id}"), n >= min),
            None => ("no server".into(), false),
        };
        out.push(Check {
            name: "min_end_streams_per_server".into(),
            want: format!(">= {min}"),
            got,
            pass,
        });
    }
    if !r.workers.is_empty() {
        let orphans = r.workers.iter().filter(|w| w.running_after).count();
        out.push(Check {
            name: "workers".into(),
            want: "none ended early, none left running".into(),
            got: if r.worker_deaths.is_empty() && orphans == 0 {
                format!("{} ran to the end", r.workers.len())
            } else {
                format!(
                    "{} ended early, {orphans} left running",
                    r.worker_deaths.len()
                )
            },
            pass: r.worker_deaths.is_empty() && orphans == 0,
        });
    }
    if let Some(max) = e.max_fleet_rss_mib {
        out.push(Check {
            name: "max_fleet_rss_mib".into(),
            want: format!("<= {max:.0} MiB (sum of every process's peak)"),
            got: format!("{:.1} MiB", r.fleet_rss_peaks_sum_mib),
            pass: r.fleet_rss_peaks_sum_mib <= max,
        });
    }
    if let Some(max) = e.max_leases_missed {
        let (got, pass) = match r.leases_missed {
            Some(n) => (n.to_string(), n <= max),
            None => ("not measured".into(), false),
        };
        out.push(Check {
            name: "max_leases_missed".into(),
            want: format!("<= {max}"),
            got,
            pass,
        });
    }
    // Each covering check: its name, its bound, which time of a start it reads, and what.
    type After = fn(&CoveredAfter) -> Option<f64>;
    let covered: [(&str, Option<Duration>, After, &str); 2] = [
        (
            "covered_within",
            e.covered_within,
            |c| c.after_s,
            "every running server",
        ),
        (
            "server_covered_within",
            e.server_covered_within,
            |c| c.server_after_s,
            "the started server",
        ),
    ];
    for (name, within, after, what) in covered {
        let Some(within) = within else { continue };
        let worst = r
            .covered_after
            .iter()
            .map(|c| after(c).unwrap_or(f64::INFINITY))
            .fold(0.0, f64::max);
        let pass = !r.covered_after.is_empty() && worst <= within.as_secs_f64();
        out.push(Check {
            name: name.into(),
            want: format!("<= {} after each server start ({what})", secs(within)),
            got: if r.covered_after.is_empty() {
                "no server start".into()
            } else if worst.is_finite() {
                format!("{worst:.2} s")
            } else {
                "not covered by the end".into()
            },
            pass,
        });
    }
    if let Some(max) = e.max_failed_not_in_flight_at_fault {
        // From the fault's scheduled time to when it had taken effect (a kill waits for
        // the stack's lock), a call that started was still in flight at it.
        let scheduled = s
            .faults
            .iter()
            .map(|f| f.at)
            .min()
            .unwrap_or_default()
            .as_secs_f32();
        let applied = rec.first_fault_applied.unwrap_or(scheduled).max(scheduled);
        let n = rec
            .failed_span
            .iter()
            .filter(|(from, to)| *to < scheduled || *from >= applied)
            .count() as u64;
        out.push(Check {
            name: "max_failed_not_in_flight_at_fault".into(),
            want: format!("<= {max}"),
            got: format!("{n} (of {} failed)", r.calls_failed_total),
            pass: n <= max,
        });
    }
    if let Some(max) = e.max_failed_after_last_fault {
        let last = s
            .faults
            .iter()
            .map(|f| f.at)
            .max()
            .unwrap_or_default()
            .as_secs_f32();
        let n = rec.failed_at.iter().filter(|t| **t >= last).count() as u64;
        out.push(Check {
            name: "max_failed_after_last_fault".into(),
            want: format!("<= {max}"),
            got: n.to_string(),
            pass: n <= max,
        });
    }
    out
}

/// The terminal summary table.
pub fn summary(r: &Report) -> String {
    let mut o = String::new();
    let _ = writeln!(
        o,
        "scenario {} ({} mode, {} agents{}, seed {}, ran {:.1} s{})",
        r.scenario,
        r.mode,
        r.agents,
        match (r.workers.len(), r.dispatchers) {
            (0, 1) => String::new(),
            (0, d) => format!(", {d} dispatchers"),
            (w, d) => format!(" in {w} worker processes, {d} dispatchers"),
        },
        r.seed,
        r.ran_for_s,
        if r.interrupted { ", INTERRUPTED" } else { "" }
    );
    if !r.description.is_empty() {
        let _ = writeln!(o, "  {}", r.description);
    }
    let row = |o: &mut String, k: &str, v: String| {
        let _ = writeln!(o, "  {k:<16} {v}");
    };
    for line in &r.startup {
        row(&mut o, "startup", line.clone());
    }
    row(
        &mut o,
        "calls",
        format!(
            "sent {}  ok {}  failed {}  lost {}{}  skipped {}",
            r.calls_sent,
            r.calls_ok,
            r.calls_failed_total,
            r.calls_lost,
            if r.calls_lost > 0 {
                format!(
                    " (never answered {}, answered twice {})",
                    r.calls_never_answered, r.calls_answered_twice
                )
            } else {
                String::new()
            },
            r.calls_skipped
        ),
    );
    if !r.calls_failed.is_empty() {
        let reasons: Vec<String> = r
            .calls_failed
            .iter()
            .map(|(k, v)| format!("{k} {v}"))
            .collect();
        row(&mut o, "failed by reason", reasons.join("  "));
    }
    let q = |q: &Quantiles| {
        format!(
            "p50 {:.2}  p90 {:.2}  p99 {:.2}  max {:.2}",
            q.p50, q.p90, q.p99, q.max
        )
    };
    row(&mut o, "latency ms", q(&r.latency_ms));
    row(
        &mut o,
        "queue wait ms",
        match &r.queue_wait_ms {
            Some(w) => format!("{}  ({} calls; max = bucket bound)", q(w), w.count),
            None => "not measured in external mode".into(),
        },
    );
    let per: Vec<String> = r
        .end_streams_per_server
        .iter()
        .map(|(k, v)| format!("{k} {v}"))
        .collect();
    row(
        &mut o,
        "streams",
        format!(
            "peak {}  resting {}  at end: {}",
            r.peak_streams,
            r.resting_streams,
            per.join(", ")
        ),
    );
    if !r.calls_by_server.is_empty() {
        let total: u64 = r.calls_by_server.values().sum();
        let per: Vec<String> = r
            .calls_by_server
            .iter()
            .map(|(k, v)| format!("{k} {v} ({:.1}%)", *v as f64 * 100.0 / total.max(1) as f64))
            .collect();
        row(&mut o, "calls by server", per.join(", "));
    }
    if let Some(b) = &r.busy {
        row(
            &mut o,
            "busy neighbour",
            format!(
                "{} answered {:.1}% of the {} calls from {:.1} s on, {:.1}% of the {} from {:.1} s",
                b.servers.join(", "),
                b.share * 100.0,
                b.calls,
                b.from_s,
                b.settled_share * 100.0,
                b.settled_calls,
                b.settled_from_s
            ),
        );
        row(
            &mut o,
            "  latency ms",
            format!(
                "of the calls from {:.1} s: {}",
                b.settled_from_s,
                q(&b.settled_latency_ms)
            ),
        );
    }
    let acts: Vec<String> = ["grow", "fill", "evacuate", "recycle", "retire", "return"]
        .iter()
        .map(|a| format!("{a} {}", r.coverage_actions.get(*a).copied().unwrap_or(0)))
        .collect();
    row(&mut o, "coverage actions", acts.join("  "));
    for b in &r.bursts {
        row(
            &mut o,
            "burst",
            format!(
                "{} calls at {:.1} s: {} ok, last answer after {:.2} s",
                b.calls, b.at_s, b.ok, b.done_after_s
            ),
        );
    }
    for (t, what) in &r.events {
        row(&mut o, "fault", format!("{t:>6.1} s  {what}"));
    }
    row(
        &mut o,
        "cpu",
        format!(
            "process {:.2} s = {:.3} s per 1000 calls",
            r.cpu.process_cpu_s, r.cpu.process_cpu_s_per_1000_calls
        ),
    );
    for c in &r.cpu.components {
        row(
            &mut o,
            "  cpu component",
            format!(
                "{:<15} {:>7.2} s  {:>7.3} s per 1000 calls",
                c.name, c.cpu_s, c.cpu_s_per_1000_calls
            ),
        );
    }
    if r.workers.is_empty() {
        row(
            &mut o,
            "memory",
            format!(
                "peak RSS {:.1} MiB, at end {:.1} MiB",
                r.memory.peak_rss_mib, r.memory.rss_mib
            ),
        );
    } else {
        row(
            &mut o,
            "memory",
            format!(
                "fleet peak RSS {:.1} MiB (sum of peaks {:.1} MiB) over {} processes",
                r.fleet_rss_peak_mib,
                r.fleet_rss_peaks_sum_mib,
                r.workers.len() + 1
            ),
        );
        row(
            &mut o,
            "  memory process",
            format!(
                "relay (dispatchers, servers, lb, upstream, load generator) peak {:.1} MiB, at end {:.1} MiB",
                r.memory.peak_rss_mib, r.memory.rss_mib
            ),
        );
        for w in &r.workers {
            row(
                &mut o,
                "  memory process",
                format!(
                    "agents worker {} (agents {}, pid {}) peak {:.1} MiB, at end {:.1} MiB",
                    w.index,
                    w.agents,
                    w.pid.map_or("-".into(), |p| p.to_string()),
                    w.peak_rss_mib,
                    w.rss_mib
                ),
            );
        }
    }
    for d in &r.worker_deaths {
        row(&mut o, "worker ended", d.clone());
    }
    if let Some(n) = r.leases_missed {
        row(
            &mut o,
            "leases missed",
            format!("{n} (over {} dispatchers)", r.dispatchers),
        );
    }
    let short_at_end = if r.end_short_per_server.is_empty() {
        "not sampled".to_string()
    } else {
        let short: Vec<String> = r
            .end_short_per_server
            .iter()
            .map(|(k, v)| format!("{k} {v}"))
            .collect();
        short.join(", ")
    };
    for c in &r.covered_after {
        row(
            &mut o,
            "covered again",
            match c.after_s {
                Some(a) => format!(
                    "every agent covers every running server {a:.2} s after {} started at {:.1} s",
                    c.server, c.at_s
                ),
                None => match c.server_after_s {
                    Some(a) => format!(
                        "every agent covers {} {a:.2} s after it started at {:.1} s, but not every agent covered every running server by the end (agents short at the end: {short_at_end})",
                        c.server, c.at_s
                    ),
                    None => format!(
                        "not every agent covered every running server by the end, after {} started at {:.1} s (agents short at the end: {short_at_end})",
                        c.server, c.at_s
                    ),
                },
            },
        );
    }
    for c in &r.expectations {
        row(
            &mut o,
            if c.pass { "expect  ok" } else { "expect  FAIL" },
            format!("{} {} (got {})", c.name, c.want, c.got),
        );
    }
    let _ = writeln!(
        o,
        "  result           {}",
        if r.passed() { "PASS" } else { "FAIL" }
    );
    o
}
