//! The server's own load, for the dispatchers' routing, sampled four times a second and
//! smoothed over about a second, as per mille. Reported in every `LoadReport` (`cpu_permille`). It is the
//! larger of two shares over each interval:
//! - its CPU use: the CPU time the kernel counted for the server (the process, or its own
//!   threads in a process that embeds several servers) out of the cores it may use;
//! - how busy its runtime is: the time its worker threads spent running tasks rather than
//!   waiting for work, out of the interval (tokio's per-worker busy time). A server whose
//!   threads get less than a full core (other processes, or a busy neighbour on its own
//!   runtime, take the rest) cannot keep up all the same, and this share shows it: its
//!   workers stop waiting for work while its CPU time stays below the cores it may use.
//!
//! [`CpuMeter`] is the arithmetic (cumulative seconds in, smoothed share out; no clock of its
//! own); [`sample`] reads `/proc`. This module must not decide anything about routing: the
//! dispatcher weighs the figure (`[routing] load_margin`, `load_high_water`).
//!
//! On a system without `/proc` the CPU part is 0; the runtime part is measured everywhere
//! tokio measures it (64-bit targets).

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

/// How often the load is sampled.
pub const SAMPLE_EVERY: Duration = Duration::from_millis(250);

/// One reading: cumulative seconds and what they are out of.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Reading {
    /// CPU seconds of the server.
    pub cpu_s: f64,
    /// Cores the CPU seconds are out of.
    pub cores: f64,
    /// Seconds the runtime's workers spent busy, summed over them.
    pub busy_s: f64,
    /// The runtime's workers.
    pub workers: f64,
}

/// Smoothed load from readings of cumulative seconds.
#[derive(Debug, Default)]
pub struct CpuMeter {
    last: Option<(Instant, Reading)>,
    smoothed: Option<f64>,
}

impl CpuMeter {
    /// Weight of a new sample: with four samples a second, about a second of memory, so a
    /// server that became saturated reads above 90% within two seconds.
    pub const ALPHA: f64 = 0.25;

    /// Feeds the reading at `now`; returns the smoothed load (0..=1) once two readings are
    /// in: the larger of the CPU share and the runtime's busy share over the interval.
    pub fn observe(&mut self, now: Instant, r: Reading) -> Option<f64> {
        let prev = self.last.replace((now, r));
        let (at, before) = prev?;
        let wall = now.saturating_duration_since(at).as_secs_f64();
        if wall <= 0.0 {
            return self.smoothed;
        }
        let share = |now: f64, then: f64, of: f64| {
            if of > 0.0 {
                ((now - then).max(0.0) / wall / of).clamp(0.0, 1.0)
            } else {
                0.0
            }
        };
        let use_ =
            share(r.cpu_s, before.cpu_s, r.cores).max(share(r.busy_s, before.busy_s, r.workers));
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

/// Busy seconds of the current runtime's workers, summed, and how many there are.
fn runtime_busy() -> (f64, f64) {
    let m = tokio::runtime::Handle::current().metrics();
    let workers = m.num_workers();
    #[cfg(target_has_atomic = "64")]
    let busy: f64 = (0..workers)
        .map(|w| m.worker_total_busy_duration(w).as_secs_f64())
        .sum();
    #[cfg(not(target_has_atomic = "64"))]
    let busy = 0.0;
    (busy, workers as f64)
}

/// Samples `source` and the runtime this task runs on (the server's) every
/// [`SAMPLE_EVERY`] into `out` (per mille) until `stop`.
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
        let (cpu_s, cores) = sample(&source).unwrap_or((0.0, 0.0));
        let (busy_s, workers) = runtime_busy();
        let reading = Reading {
            cpu_s,
            cores,
            busy_s,
            workers,
        };
        if let Some(u) = meter.observe(Instant::now(), reading) {
            out.store(permille(u), Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cpu(cpu_s: f64, cores: f64) -> Reading {
        Reading {
            cpu_s,
            cores,
            ..Reading::default()
        }
    }

    #[test]
    fn use_is_cpu_time_over_wall_time_and_cores_smoothed() {
        let t0 = Instant::now();
        let mut m = CpuMeter::default();
        assert_eq!(m.observe(t0, cpu(10.0, 2.0)), None, "one sample is no rate");
        // 1 CPU second in 1 s on 2 cores: half.
        let u = m
            .observe(t0 + Duration::from_secs(1), cpu(11.0, 2.0))
            .unwrap();
        assert!((u - 0.5).abs() < 1e-9);
        // Then fully busy: smoothed toward 1.
        let u = m
            .observe(t0 + Duration::from_secs(2), cpu(13.0, 2.0))
            .unwrap();
        assert!((u - (0.5 + CpuMeter::ALPHA * 0.5)).abs() < 1e-9);
        assert_eq!(permille(u), 625);
        // A counter that went back (a thread exited) counts as idle, not negative.
        let u = m
            .observe(t0 + Duration::from_secs(3), cpu(1.0, 2.0))
            .unwrap();
        assert!((0.0..0.625).contains(&u));
    }

    #[test]
    fn a_runtime_that_never_waits_for_work_is_loaded_though_its_cpu_time_is_low() {
        let t0 = Instant::now();
        let mut m = CpuMeter::default();
        let r = |cpu_s: f64, busy_s: f64| Reading {
            cpu_s,
            cores: 1.0,
            busy_s,
            workers: 1.0,
        };
        m.observe(t0, r(0.0, 0.0));
        // Other processes had the core for 60% of the second; the server's one worker was
        // busy the whole second all the same (its tasks waited for the core).
        let u = m.observe(t0 + Duration::from_secs(1), r(0.4, 1.0)).unwrap();
        assert!((u - 1.0).abs() < 1e-9);
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
