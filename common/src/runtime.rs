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

/// The control plane's runtime: a one-thread runtime on a thread of its own (named
/// `relay-control`), for the few tasks whose deadlines another process watches (a tunnel
/// server's report streams, which a dispatcher drops after `registry.lease` of silence; a
/// dispatcher's registry listener and routing tick, which judge those leases). On a
/// process's main runtime they take their turn behind every ready task of the data plane:
/// with one worker thread, a storm of ten thousand agent stream opens kept a tunnel
/// server's report frames waiting past the 3 s lease (`relay-fleet storm`,
/// docs/operations.md). On their own thread the OS scheduler gives them their turn whatever
/// the data plane does; their work is small, so they never hold the data plane up in turn.
///
/// The runtime lives as long as the value: dropping it ends the thread, and with it
/// whatever still runs there.
pub struct ControlRuntime {
    handle: tokio::runtime::Handle,
    /// Ends the thread when dropped.
    _stop: tokio::sync::oneshot::Sender<()>,
}

impl ControlRuntime {
    /// Starts the thread with its runtime.
    pub fn start() -> std::io::Result<Self> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let handle = rt.handle().clone();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        std::thread::Builder::new()
            .name("relay-control".into())
            .spawn(move || {
                rt.block_on(async {
                    let _ = stopped.await;
                });
            })?;
        Ok(ControlRuntime {
            handle,
            _stop: stop,
        })
    }

    /// Where the control plane's tasks are spawned.
    pub fn handle(&self) -> &tokio::runtime::Handle {
        &self.handle
    }
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

    #[tokio::test(flavor = "current_thread")]
    async fn control_tasks_run_while_the_callers_thread_is_busy_and_stop_with_it() {
        let control = ControlRuntime::start().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let task = control.handle().spawn(async move {
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
            tx.send(std::thread::current().name().map(str::to_string))
                .unwrap();
            std::future::pending::<()>().await;
        });
        // This thread never yields meanwhile: the task runs on its own thread.
        let name = rx.recv_timeout(std::time::Duration::from_secs(10)).unwrap();
        assert_eq!(name.as_deref(), Some("relay-control"));
        drop(control);
        assert!(task.await.unwrap_err().is_cancelled());
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
