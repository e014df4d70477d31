//! A soak's report: what was sent and how every call ended, latency, failures by reason
//! and by the tunnel server that answered, the fault timeline, memory (VmRSS) of every
//! process over the run, and what their logs held (h2's `reached limit` lines above
//! all). [`SoakReport::passed`] is the verdict; [`SoakReport::summary`] the text the CLI
//! prints. Pure: built from figures the run collected, no clock, no I/O.

use super::logscan::Findings;
use super::rig::Event;
use serde::Serialize;
use std::collections::BTreeMap;
use std::fmt::Write as _;

/// Most RSS points kept per process (older ones are thinned, every other one dropped).
const MAX_SERIES: usize = 512;

/// Memory of one process over the run, sampled periodically.
#[derive(Clone, Debug, Default, Serialize)]
pub struct RssTrack {
    /// At the first sample (taken just before the load started).
    pub start_kib: Option<u64>,
    pub peak_kib: Option<u64>,
    /// At the last sample (just after the last call was answered).
    pub end_kib: Option<u64>,
    pub samples: u64,
    /// Samples whose `/proc` read failed, and the last error.
    pub unread: u64,
    pub last_unread: Option<String>,
    /// `(seconds since the load started, KiB)`, thinned to at most 512 points.
    pub series: Vec<(f64, u64)>,
    #[serde(skip)]
    stride: u64,
}

impl RssTrack {
    pub fn observe(&mut self, at_s: f64, kib: u64) {
        if self.start_kib.is_none() {
            self.start_kib = Some(kib);
        }
        self.peak_kib = Some(self.peak_kib.map_or(kib, |p| p.max(kib)));
        self.end_kib = Some(kib);
        let stride = self.stride.max(1);
        if self.samples.is_multiple_of(stride) {
            self.series.push((at_s, kib));
            if self.series.len() > MAX_SERIES {
                // Keep every other point and sample half as often from now on.
                let mut i = 0;
                self.series.retain(|_| {
                    i += 1;
                    i % 2 == 1
                });
                self.stride = stride * 2;
            }
        }
        self.samples += 1;
    }

    /// A sample that could not be taken (`/proc` unreadable, or the process gone).
    pub fn unread(&mut self, error: String) {
        self.unread += 1;
        self.last_unread = Some(error);
    }

    /// The sample nearest the middle of the series' time span.
    pub fn mid_kib(&self) -> Option<u64> {
        let (first, last) = (self.series.first()?, self.series.last()?);
        let mid = (first.0 + last.0) / 2.0;
        self.series
            .iter()
            .min_by(|a, b| (a.0 - mid).abs().total_cmp(&(b.0 - mid).abs()))
            .map(|p| p.1)
    }
}

/// One failure reason.
#[derive(Clone, Debug, Serialize)]
pub struct FailureReport {
    /// `502 stream_lost`, `transport closed`, `client_timeout`, ...
    pub reason: String,
    pub count: u64,
    /// Seconds since the load started.
    pub first_at_s: f64,
    pub last_at_s: f64,
    /// A few distinct messages.
    pub examples: Vec<String>,
}

/// Latency of the calls that answered ok, in milliseconds.
#[derive(Clone, Debug, Default, Serialize)]
pub struct LatencyReport {
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub p999: f64,
    pub max: f64,
    pub mean: f64,
}

/// One process the soak started (or itself).
#[derive(Clone, Debug, Serialize)]
pub struct ProcessReport {
    pub name: String,
    /// The last pid seen.
    pub pid: Option<u32>,
    pub restarts: u32,
    /// How it ended, if it was not running at the end.
    pub exited: Option<String>,
    pub rss: RssTrack,
    /// What its log held (none for the soak process itself).
    pub log: Option<LogReport>,
}

/// What one process's log held.
#[derive(Clone, Debug, Serialize)]
pub struct LogReport {
    pub path: String,
    #[serde(flatten)]
    pub findings: Findings,
}

/// Everything a soak saw.
#[derive(Clone, Debug, Serialize)]
pub struct SoakReport {
    /// The stack and the load, in words.
    pub setup: String,
    /// Stopped early (Ctrl-C); the figures cover what ran.
    pub interrupted: bool,
    /// Calls started (base and burst).
    pub sent: u64,
    /// Calls that ended in an outcome (`ok + failed`).
    pub answered: u64,
    pub ok: u64,
    pub failed: u64,
    /// Calls started and never answered by the end (client deadline plus grace).
    pub lost: u64,
    pub burst_sent: u64,
    pub burst_answered: u64,
    /// From the first call to the last answer.
    pub duration_s: f64,
    pub calls_per_s: f64,
    pub latency_ms: LatencyReport,
    pub failures: Vec<FailureReport>,
    /// Tunnel server named by the error message (`(none)` when it names none) ->
    /// reason -> count.
    pub failures_by_server: BTreeMap<String, BTreeMap<String, u64>>,
    /// The dispatcher's own `relay_dispatcher_calls_by_server_total`: server -> outcome
    /// -> count (embedded mode; includes the readiness probes).
    pub dispatcher_calls_by_server: BTreeMap<String, BTreeMap<String, u64>>,
    /// `relay_dispatcher_retries_total` at the end (embedded mode).
    pub dispatcher_retries: Option<u64>,
    /// HTTP/1.1 connections the callers opened (one per caller when keep-alive holds).
    pub connections: u64,
    pub events: Vec<Event>,
    pub processes: Vec<ProcessReport>,
    /// Where the processes' configs and logs were (removed at exit unless
    /// `RELAY_KEEP_SCRATCH` is set).
    pub scratch_dir: Option<String>,
}

impl SoakReport {
    /// `reached limit` lines over every process's log.
    pub fn reached_limit(&self) -> u64 {
        self.processes
            .iter()
            .filter_map(|p| p.log.as_ref())
            .map(|l| l.findings.reached_limit)
            .sum()
    }

    /// Events that are problems (exits nobody asked for, failed restarts).
    pub fn problems(&self) -> usize {
        self.events.iter().filter(|e| e.problem).count()
    }

    /// Processes whose memory was tried and never read, with the last error: an
    /// unreadable `/proc` is a finding, never a figure of 0.
    pub fn memory_unread(&self) -> Vec<String> {
        self.processes
            .iter()
            .filter(|p| p.rss.samples == 0 && p.rss.unread > 0)
            .map(|p| {
                format!(
                    "{}: {}",
                    p.name,
                    p.rss.last_unread.as_deref().unwrap_or("unread")
                )
            })
            .collect()
    }

    /// No call failed or was lost, no `reached limit` line, no problem event, every
    /// process's memory read.
    pub fn passed(&self) -> bool {
        self.failed == 0
            && self.lost == 0
            && self.reached_limit() == 0
            && self.problems() == 0
            && self.memory_unread().is_empty()
    }

    /// Why it did not pass, one clause per finding; empty when it passed.
    pub fn findings(&self) -> Vec<String> {
        let mut out = Vec::new();
        if self.failed > 0 {
            out.push(format!("{} calls failed", self.failed));
        }
        if self.lost > 0 {
            out.push(format!("{} calls lost", self.lost));
        }
        let limit = self.reached_limit();
        if limit > 0 {
            out.push(format!("{limit} `reached limit` log lines"));
        }
        let problems = self.problems();
        if problems > 0 {
            out.push(format!("{problems} problem events"));
        }
        for m in self.memory_unread() {
            out.push(format!("memory never read ({m})"));
        }
        out
    }

    /// The text report.
    pub fn summary(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "\n== soak: {}", self.setup);
        if self.interrupted {
            let _ = writeln!(s, "   (interrupted: figures cover what ran)");
        }
        let _ = writeln!(
            s,
            "calls      sent {}  answered {}  ok {}  failed {}  lost {}",
            self.sent, self.answered, self.ok, self.failed, self.lost
        );
        if self.burst_sent > 0 {
            let _ = writeln!(
                s,
                "           of which burst: sent {}  answered {}",
                self.burst_sent, self.burst_answered
            );
        }
        let _ = writeln!(
            s,
            "duration   {:.1} s   {:.0} calls/s   {} client connections",
            self.duration_s, self.calls_per_s, self.connections
        );
        let l = &self.latency_ms;
        let _ = writeln!(
            s,
            "latency    p50 {:.2} ms  p90 {:.2} ms  p99 {:.2} ms  p99.9 {:.2} ms  max {:.2} ms  (ok calls)",
            l.p50, l.p90, l.p99, l.p999, l.max
        );
        if self.failures.is_empty() {
            let _ = writeln!(s, "failures   none");
        } else {
            let _ = writeln!(s, "failures by reason");
            for f in &self.failures {
                let _ = writeln!(
                    s,
                    "  {:<34} {:>9}   first at {:.1}s, last at {:.1}s",
                    f.reason, f.count, f.first_at_s, f.last_at_s
                );
                for e in &f.examples {
                    let _ = writeln!(s, "      e.g. {e}");
                }
            }
            let _ = writeln!(s, "failures by tunnel server (named in the error message)");
            for (server, reasons) in &self.failures_by_server {
                let list: Vec<String> = reasons.iter().map(|(r, n)| format!("{r} {n}")).collect();
                let _ = writeln!(s, "  {server:<12} {}", list.join(", "));
            }
        }
        if !self.dispatcher_calls_by_server.is_empty() {
            let _ = writeln!(
                s,
                "dispatcher calls by server and outcome (relay_dispatcher_calls_by_server_total; retries {})",
                self.dispatcher_retries
                    .map_or("?".to_string(), |r| r.to_string())
            );
            for (server, outcomes) in &self.dispatcher_calls_by_server {
                let list: Vec<String> = outcomes.iter().map(|(o, n)| format!("{o} {n}")).collect();
                let _ = writeln!(s, "  {server:<12} {}", list.join(", "));
            }
        }
        if !self.events.is_empty() {
            let _ = writeln!(s, "events");
            for e in &self.events {
                let mark = if e.problem { "PROBLEM: " } else { "" };
                let _ = writeln!(s, "  {:>7.1}s  {mark}{}", e.at_s, e.what);
            }
        }
        let mib =
            |k: Option<u64>| k.map_or("-".to_string(), |k| format!("{:.1}", k as f64 / 1024.0));
        let _ = writeln!(
            s,
            "memory (VmRSS MiB)              start     mid     end    peak  samples  restarts"
        );
        for p in &self.processes {
            let r = &p.rss;
            let _ = writeln!(
                s,
                "  {:<28} {:>7} {:>7} {:>7} {:>7} {:>8} {:>9}{}",
                p.name,
                mib(r.start_kib),
                mib(r.mid_kib()),
                mib(r.end_kib),
                mib(r.peak_kib),
                r.samples,
                p.restarts,
                p.exited
                    .as_ref()
                    .map_or(String::new(), |e| format!("  (at the end: {e})"))
            );
        }
        if self.processes.iter().all(|p| p.log.is_none()) {
            let _ = writeln!(s, "logs       none read (the soak started no process)");
        } else {
            let _ = writeln!(
                s,
                "logs                              lines     WARN    ERROR  reached limit"
            );
        }
        for p in &self.processes {
            let Some(log) = &p.log else { continue };
            let f = &log.findings;
            let _ = writeln!(
                s,
                "  {:<28} {:>9} {:>8} {:>8} {:>14}",
                p.name, f.lines, f.warn, f.error, f.reached_limit
            );
        }
        for p in &self.processes {
            let Some(log) = &p.log else { continue };
            let f = &log.findings;
            if f.reached_limit > 0 {
                let _ = writeln!(
                    s,
                    "  {}: `reached limit` lines (first {}):",
                    p.name,
                    f.reached_limit_lines.len()
                );
                for l in &f.reached_limit_lines {
                    let _ = writeln!(s, "      {l}");
                }
            }
            let top = f.top(5);
            if !top.is_empty() {
                let _ = writeln!(s, "  {}: most frequent WARN/ERROR lines:", p.name);
                for (m, n) in top {
                    let _ = writeln!(s, "      {n:>7} x {m}");
                }
            }
        }
        if let Some(dir) = &self.scratch_dir {
            let _ = writeln!(s, "scratch    {dir} (kept only with RELAY_KEEP_SCRATCH=1)");
        }
        let findings = self.findings();
        if findings.is_empty() {
            let _ = writeln!(
                s,
                "verdict    PASS: every call answered ok, no `reached limit` line"
            );
        } else {
            let _ = writeln!(s, "verdict    FAIL: {}", findings.join(", "));
        }
        s
    }
}

/// `relay_dispatcher_calls_by_server_total` from Prometheus text: server -> outcome ->
/// count.
pub fn calls_by_server(text: &str) -> BTreeMap<String, BTreeMap<String, u64>> {
    const NAME: &str = "relay_dispatcher_calls_by_server_total{";
    let mut out: BTreeMap<String, BTreeMap<String, u64>> = BTreeMap::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix(NAME) else {
            continue;
        };
        let Some((labels, value)) = rest.rsplit_once("} ") else {
            continue;
        };
        let label = |key: &str| {
            labels.split(',').find_map(|kv| {
                let (k, v) = kv.split_once('=')?;
                (k.trim() == key).then(|| v.trim().trim_matches('"').to_string())
            })
        };
        let (Some(server), Some(outcome)) = (label("server_id"), label("outcome")) else {
            continue;
        };
        let n = value.trim().parse::<f64>().unwrap_or(0.0) as u64;
        *out.entry(server).or_default().entry(outcome).or_default() += n;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rss_track_keeps_start_peak_end_and_a_bounded_series() {
        let mut t = RssTrack::default();
        for i in 0..5000u64 {
            t.observe(i as f64, 1000 + (i % 700));
        }
        assert_eq!(t.start_kib, Some(1000));
        assert_eq!(t.peak_kib, Some(1699));
        assert_eq!(t.end_kib, Some(1000 + 4999 % 700));
        assert_eq!(t.samples, 5000);
        assert!(t.series.len() <= MAX_SERIES, "{}", t.series.len());
        assert!(t.series.len() >= MAX_SERIES / 2);
        // Evenly thinned, in time order, from the start.
        assert_eq!(t.series[0].0, 0.0);
        assert!(t.series.windows(2).all(|w| w[0].0 < w[1].0));
        let step = t.series[1].0 - t.series[0].0;
        assert!(t.series.windows(2).all(|w| w[1].0 - w[0].0 == step));
    }

    #[test]
    fn mid_is_the_sample_nearest_the_middle() {
        let mut t = RssTrack::default();
        for (at, kib) in [(0.0, 10), (4.0, 20), (6.0, 30), (10.0, 40)] {
            t.observe(at, kib);
        }
        assert_eq!(t.mid_kib(), Some(20));
        assert_eq!(RssTrack::default().mid_kib(), None);
    }

    #[test]
    fn calls_by_server_reads_the_dispatcher_counter() {
        let text = "# HELP relay_dispatcher_calls_by_server_total Calls\n\
                    # TYPE relay_dispatcher_calls_by_server_total counter\n\
                    relay_dispatcher_calls_by_server_total{outcome=\"ok\",server_id=\"ts-1\"} 1200\n\
                    relay_dispatcher_calls_by_server_total{outcome=\"stream_lost\",server_id=\"ts-1\"} 3\n\
                    relay_dispatcher_calls_by_server_total{outcome=\"ok\",server_id=\"ts-2\"} 7\n\
                    relay_dispatcher_calls_total{outcome=\"ok\"} 1207\n";
        let m = calls_by_server(text);
        assert_eq!(m["ts-1"]["ok"], 1200);
        assert_eq!(m["ts-1"]["stream_lost"], 3);
        assert_eq!(m["ts-2"]["ok"], 7);
        assert_eq!(m.len(), 2);
    }

    fn report() -> SoakReport {
        SoakReport {
            setup: "test".into(),
            interrupted: false,
            sent: 10,
            answered: 10,
            ok: 10,
            failed: 0,
            lost: 0,
            burst_sent: 0,
            burst_answered: 0,
            duration_s: 1.0,
            calls_per_s: 10.0,
            latency_ms: LatencyReport::default(),
            failures: vec![],
            failures_by_server: BTreeMap::new(),
            dispatcher_calls_by_server: BTreeMap::new(),
            dispatcher_retries: None,
            connections: 1,
            events: vec![],
            processes: vec![],
            scratch_dir: None,
        }
    }

    #[test]
    fn the_verdict_fails_on_any_failure_loss_limit_line_or_problem() {
        let r = report();
        assert!(r.passed());
        assert!(r.summary().contains("verdict    PASS"));

        let mut r = report();
        r.failed = 1;
        assert!(!r.passed());

        let mut r = report();
        r.lost = 1;
        assert!(!r.passed());

        let mut r = report();
        let mut findings = Findings::default();
        findings.feed("2025-06-01T10:00:00Z  WARN locally-reset streams reached limit (1024)");
        r.processes.push(ProcessReport {
            name: "ts-1".into(),
            pid: None,
            restarts: 0,
            exited: None,
            rss: RssTrack::default(),
            log: Some(LogReport {
                path: "ts-1.log".into(),
                findings,
            }),
        });
        assert_eq!(r.reached_limit(), 1);
        assert!(!r.passed());
        let text = r.summary();
        assert!(
            text.contains("locally-reset streams reached limit (1024)"),
            "{text}"
        );
        assert!(text.contains("FAIL: 1 `reached limit` log lines"), "{text}");

        let mut r = report();
        r.events.push(Event {
            at_s: 1.0,
            what: "ts-2 exited".into(),
            problem: true,
        });
        assert!(!r.passed());
    }

    #[test]
    fn a_process_whose_memory_was_never_read_fails_the_verdict() {
        let process = |rss: RssTrack| ProcessReport {
            name: "ts-1".into(),
            pid: Some(1),
            restarts: 0,
            exited: None,
            rss,
            log: None,
        };
        let mut unread = RssTrack::default();
        unread.unread("cannot read /proc/1/status: permission denied".into());
        let mut r = report();
        r.processes.push(process(unread.clone()));
        assert!(!r.passed());
        let text = r.summary();
        assert!(
            text.contains("memory never read (ts-1: cannot read /proc/1/status"),
            "{text}"
        );

        // A failed read beside good ones (a process exiting between the table and the
        // read) is not a finding.
        let mut r = report();
        let mut some = unread;
        some.observe(0.0, 1000);
        r.processes.push(process(some));
        assert!(r.passed(), "{}", r.summary());
    }
}
