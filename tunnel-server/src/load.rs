//! The server's own load, for the dispatchers' routing: its CPU use, read from the kernel's
//! per-process (or per-thread) CPU time, smoothed over a few report intervals, as per mille
//! of the CPU the server may use. Reported in every `LoadReport` (`cpu_permille`).
//!
//! [`CpuMeter`] is the arithmetic (samples of cumulative CPU seconds in, smoothed use out;
//! no clock of its own); [`sample`] reads `/proc`. This module must not decide anything
//! about routing: the dispatcher weighs the figure (`[routing] load_margin`,
//! `load_high_water`).
//!
//! On a system without `/proc` the figure is 0, which the dispatcher reads as "not
//! measured" (no load signal from this server).

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::time::{Instant, MissedTickBehavior};
use tokio_util::sync::CancellationToken;

/// Whose CPU time counts as this server's.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum CpuSource {
    /// The whole process, out of the cores it may use (`available_parallelism`, which
    /// follows cgroup CPU quotas). The default: one server per process.
    #[default]
    Process,
    /// The threads of this process with this name, out of `cores` cores: for an embedding
    /// that runs several servers in one process, each on a runtime of its own named
    /// threads (the `relay-fleet` load tester does), `cores` being its worker threads (its
    /// blocking threads, which carry the same name, are mostly idle).
    Threads { name: String, cores: usize },
}

/// How often the CPU use is sampled.
pub const SAMPLE_EVERY: Duration = Duration::from_secs(1);

/// Smoothed CPU use from samples of cumulative CPU seconds.
#[derive(Debug, Default)]
pub struct CpuMeter {
    last: Option<(Instant, f64)>,
    smoothed: Option<f64>,
}

impl CpuMeter {
    /// Weight of a new sample (with one sample a second: about two seconds of memory, so a
    /// server that became saturated reads above 90% within four seconds).
    pub const ALPHA: f64 = 0.5;

    /// Feeds the cumulative CPU seconds `cpu_s` of `cores` cores at `now`; returns the
    /// smoothed use (0..=1) once two samples are in.
    pub fn observe(&mut self, now: Instant, cpu_s: f64, cores: f64) -> Option<f64> {
        let prev = self.last.replace((now, cpu_s));
        let (at, before) = prev?;
        let wall = now.saturating_duration_since(at).as_secs_f64();
        if wall <= 0.0 || cores <= 0.0 {
            return self.smoothed;
        }
        let use_ = ((cpu_s - before).max(0.0) / wall / cores).clamp(0.0, 1.0);
        let s = match self.smoothed {
            Some(s) => s + Self::ALPHA * (use_ - s),
            None => use_,
        };
        self.smoothed = Some(s);
        Some(s)
    }
}

/// The smoothed use as per mille (0..=1000).
pub fn permille(use_: f64) -> u32 {
    (use_ * 1000.0).round().clamp(0.0, 1000.0) as u32
}

/// Linux clock ticks per second (USER_HZ), fixed at 100 on every mainstream kernel.
const HZ: f64 = 100.0;

/// `(comm, utime + stime seconds)` of one `/proc/.../stat` line.
fn parse_stat(text: &str) -> Option<(&str, f64)> {
    let open = text.find('(')?;
    let close = text.rfind(')')?;
    let comm = text.get(open + 1..close)?;
    let mut rest = text.get(close + 2..)?.split_whitespace();
    // After "pid (comm) ": state is field 3; utime and stime are fields 14 and 15.
    let utime: f64 = rest.nth(11)?.parse().ok()?;
    let stime: f64 = rest.next()?.parse().ok()?;
    Some((comm, (utime + stime) / HZ))
}

/// Cumulative CPU seconds of `source` and the cores they are out of; `None` without `/proc`
/// (or with no such thread).
pub fn sample(source: &CpuSource) -> Option<(f64, f64)> {
    match source {
        CpuSource::Process => {
            let text = std::fs::read_to_string("/proc/self/stat").ok()?;
            let (_, cpu) = parse_stat(&text)?;
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
            Some((cpu, cores as f64))
        }
        CpuSource::Threads { name, cores } => {
            let mut cpu = 0.0;
            let mut threads = 0usize;
            for e in std::fs::read_dir("/proc/self/task").ok()?.flatten() {
                let Ok(text) = std::fs::read_to_string(e.path().join("stat")) else {
                    continue;
                };
                if let Some((comm, s)) = parse_stat(&text) {
                    if comm == name {
                        cpu += s;
                        threads += 1;
                    }
                }
            }
            (threads > 0).then_some((cpu, (*cores).max(1) as f64))
        }
    }
}

/// Samples `source` every [`SAMPLE_EVERY`] into `out` (per mille) until `stop`.
pub async fn run(source: CpuSource, out: Arc<AtomicU32>, stop: CancellationToken) {
    let mut meter = CpuMeter::default();
    let mut tick = tokio::time::interval(SAMPLE_EVERY);
    tick.set_missed_tick_behavior(MissedTickBehavior::Skip);
    loop {
        tokio::select! {
            biased;
            _ = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        // A few small reads of /proc, in place: a blocking thread would carry the runtime's
        // name and count as the server's own.
        if let Some((cpu, cores)) = sample(&source) {
            if let Some(u) = meter.observe(Instant::now(), cpu, cores) {
                out.store(permille(u), Ordering::Relaxed);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn use_is_cpu_time_over_wall_time_and_cores_smoothed() {
        let t0 = Instant::now();
        let mut m = CpuMeter::default();
        assert_eq!(m.observe(t0, 10.0, 2.0), None, "one sample is no rate");
        // 1 CPU second in 1 s on 2 cores: half.
        let u = m.observe(t0 + Duration::from_secs(1), 11.0, 2.0).unwrap();
        assert!((u - 0.5).abs() < 1e-9);
        // Then fully busy: smoothed toward 1.
        let u = m.observe(t0 + Duration::from_secs(2), 13.0, 2.0).unwrap();
        assert!((u - (0.5 + CpuMeter::ALPHA * 0.5)).abs() < 1e-9);
        assert_eq!(permille(u), 750);
        // A counter that went back (a thread exited) counts as idle, not negative.
        let u = m.observe(t0 + Duration::from_secs(3), 1.0, 2.0).unwrap();
        assert!((0.0..0.75).contains(&u));
    }

    #[test]
    fn a_stat_line_with_spaces_in_the_name_parses() {
        let line = "42 (fleet ts-1) S 1 2 3 4 5 6 7 8 9 10 250 50 0 0 20 0 1 0";
        assert_eq!(parse_stat(line), Some(("fleet ts-1", 3.0)));
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn this_process_and_this_thread_are_measured() {
        let (cpu, cores) = sample(&CpuSource::Process).expect("/proc/self/stat");
        assert!(cpu >= 0.0 && cores >= 1.0);
        let name = std::thread::current().name().map(str::to_string);
        // The test thread's comm is its name cut to 15 bytes.
        if let Some(name) = name {
            let comm: String = name.chars().take(15).collect();
            let got = sample(&CpuSource::Threads {
                name: comm,
                cores: 1,
            });
            assert!(got.is_some_and(|(_, n)| n == 1.0), "{got:?}");
        }
        let none = CpuSource::Threads {
            name: "no such thread".into(),
            cores: 1,
        };
        assert_eq!(sample(&none), None);
    }
}
