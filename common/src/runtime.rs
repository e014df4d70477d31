//! The tokio runtime of a relay binary, sized by the `worker_threads` key of its config.
//!
//! Unset, a binary runs one worker thread per core: tokio's default, which
//! `TOKIO_WORKER_THREADS` still overrides. That is right for a process with a host of its
//! own. A process sharing its cores with other busy ones (a single-box install: dispatcher,
//! tunnel servers and agent on one machine, as the examples run them) does better with
//! fewer: each call wakes a task in every process it crosses, and a second worker per
//! process is a second thread to wake across cores, steal work and park again. On two
//! cores with the three relay processes, the upstream and the load generator, one worker
//! per process cut the CPU per call by about a fifth and raised calls/s by a tenth
//! (`bench/relay-bench.sh`, docs/benchmarks.md).
//!
//! `worker_threads = 1` builds a current-thread runtime (the main thread runs every task;
//! blocking work still gets its own threads): with a single worker there is nothing to
//! steal, and it skips the multi-threaded scheduler's shared queues: in two alternating
//! rounds against a one-worker multi-threaded runtime, the same CPU per call at 16
//! connections and 10-20% less at 64 through the three processes. Nothing in the binaries
//! blocks a worker (`block_in_place` is not used), which a current-thread runtime would not
//! allow.
//!
//! A current-thread runtime takes at most [`IO_EVENTS_PER_TICK`] socket events each time
//! it polls the OS (tokio's default is 1024). Every process of the relay batches its writes:
//! the calls whose sockets turned ready together run first, then the HTTP/2 connection task
//! writes all their frames at once. With every ready socket taken in one turn, the calls of
//! a busy process moved through the hops as one lump: while one process worked on it, the
//! next had nothing to do, and at 64 connections a third of the two-core machine stayed idle
//! (relay 0.79-0.96x the nginx chain). Taking 16 events a turn hands the first calls on
//! while the rest are still read, so neighbouring processes work side by side: calls/s at
//! 64 connections rose by a tenth and more, and moved within the run-to-run spread at 1 and
//! 16 connections (docs/benchmarks.md: the figures and the commands).
//!
//! The key is read before the runtime exists, so the binaries build it here instead of
//! with `#[tokio::main]`.

use crate::config::ConfigError;

/// Most worker threads a config may ask for: a typo such as 10000 is refused rather than
/// spawning that many threads.
pub const MAX_WORKER_THREADS: usize = 1024;

/// Checks a config's `worker_threads`; the error names the key.
pub fn check(worker_threads: Option<usize>) -> Result<(), ConfigError> {
    const KEY: &str = "worker_threads";
    match worker_threads {
        Some(0) => Err(ConfigError::invalid(
            KEY,
            "must be at least 1 (unset: one worker thread per core)",
        )),
        Some(n) if n > MAX_WORKER_THREADS => Err(ConfigError::invalid(
            KEY,
            format!("must be at most {MAX_WORKER_THREADS}, got {n}"),
        )),
        _ => Ok(()),
    }
}

/// Most socket events a current-thread runtime takes from the OS per poll (see the module
/// docs).
pub const IO_EVENTS_PER_TICK: usize = 16;

/// A runtime with IO and timers: `worker_threads` workers (unset: one per core, or
/// `TOKIO_WORKER_THREADS`), the current-thread runtime for 1, which takes at most
/// [`IO_EVENTS_PER_TICK`] socket events per poll.
pub fn build(worker_threads: Option<usize>) -> std::io::Result<tokio::runtime::Runtime> {
    let mut builder = match worker_threads {
        Some(1) => {
            let mut b = tokio::runtime::Builder::new_current_thread();
            b.max_io_events_per_tick(IO_EVENTS_PER_TICK);
            b
        }
        _ => tokio::runtime::Builder::new_multi_thread(),
    };
    builder.enable_all();
    if let Some(n) = worker_threads.filter(|n| *n > 1) {
        builder.worker_threads(n);
    }
    builder.build()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_and_absurd_counts_are_refused_naming_the_key() {
        for bad in [0, MAX_WORKER_THREADS + 1] {
            let e = check(Some(bad)).unwrap_err().to_string();
            assert!(e.contains("worker_threads"), "{e}");
        }
        for good in [None, Some(1), Some(MAX_WORKER_THREADS)] {
            check(good).unwrap();
        }
    }

    #[test]
    fn the_runtime_has_the_workers_asked_for() {
        let rt = build(Some(3)).unwrap();
        assert_eq!(rt.metrics().num_workers(), 3);
        let rt = build(Some(1)).unwrap();
        assert_eq!(rt.metrics().num_workers(), 1);
        assert_eq!(rt.block_on(async { 7 }), 7);
    }
}
