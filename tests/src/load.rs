//! The tests' one load generator: `workers` callers each sending calls back to back through
//! a dispatcher front until stopped, every call's single answer written in a [`Ledger`].
//!
//! A call is sent with its deadline (`x-relay-timeout-ms`); it ends with exactly one of: a
//! 200, an error answer (status and the JSON `error` code), a transport error, or the
//! caller leaving (spec's `cancel_every`). [`Load::stop`] fails the test when a call was
//! left without an answer or answered long after its deadline: the two losses the relay
//! promises never to cause.

use crate::client::Caller;
use bytes::Bytes;
use http::Method;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;

/// What a [`Load`] sends.
#[derive(Clone, Debug)]
pub struct LoadSpec {
    /// Callers sending back to back.
    pub workers: usize,
    /// Full path through the front (`/relay/<tunnel id>/...`); each call adds
    /// `?w=<worker>&i=<n>` (or `&w=...` when the path has a query).
    pub path: String,
    /// The call's deadline, sent as `x-relay-timeout-ms`.
    pub timeout_ms: u64,
    /// Every n-th call of a worker, the caller leaves after `cancel_after`.
    pub cancel_every: Option<u64>,
    pub cancel_after: Duration,
}

impl LoadSpec {
    pub fn new(workers: usize, path: impl Into<String>, timeout_ms: u64) -> Self {
        LoadSpec {
            workers,
            path: path.into(),
            timeout_ms,
            cancel_every: None,
            cancel_after: Duration::ZERO,
        }
    }
}

/// One call as the caller saw it.
#[derive(Clone, Debug)]
pub struct CallRecord {
    pub sent_at: Instant,
    pub took: Duration,
    /// HTTP status; 0 when there was none (transport error or the caller left).
    pub status: u16,
    /// The JSON `error` code of an error answer, the transport error, or empty.
    pub code: String,
}

/// Every call of a load: totals, failures by kind and the call list.
#[derive(Default)]
pub struct Ledger {
    sent: AtomicU64,
    answered: AtomicU64,
    ok: AtomicU64,
    caller_cancelled: AtomicU64,
    slowest_ms: AtomicU64,
    /// "<status> <code>" (with " WITHOUT retry-after" for a 503 lacking it), or
    /// "transport <error>" -> count.
    failures: Mutex<BTreeMap<String, u64>>,
    calls: Mutex<Vec<CallRecord>>,
}

impl Ledger {
    pub fn sent(&self) -> u64 {
        self.sent.load(Ordering::SeqCst)
    }

    pub fn answered(&self) -> u64 {
        self.answered.load(Ordering::SeqCst)
    }

    pub fn ok(&self) -> u64 {
        self.ok.load(Ordering::SeqCst)
    }

    pub fn caller_cancelled(&self) -> u64 {
        self.caller_cancelled.load(Ordering::SeqCst)
    }

    pub fn slowest(&self) -> Duration {
        Duration::from_millis(self.slowest_ms.load(Ordering::SeqCst))
    }

    pub fn failed(&self) -> u64 {
        self.failures.lock().unwrap().values().sum()
    }

    pub fn failures(&self) -> BTreeMap<String, u64> {
        self.failures.lock().unwrap().clone()
    }

    /// Every call, in the order they ended.
    pub fn calls(&self) -> Vec<CallRecord> {
        self.calls.lock().unwrap().clone()
    }

    pub fn summary(&self) -> String {
        format!(
            "sent {} answered {} ok {} caller-cancelled {} failed {:?} slowest {} ms",
            self.sent(),
            self.answered(),
            self.ok(),
            self.caller_cancelled(),
            self.failures(),
            self.slowest_ms.load(Ordering::SeqCst)
        )
    }

    /// Sends one call through `caller` and records its single answer.
    pub async fn call(
        &self,
        caller: &Caller,
        path: &str,
        timeout_ms: u64,
        leave: Option<Duration>,
    ) {
        self.sent.fetch_add(1, Ordering::SeqCst);
        let mut req = caller.request(Method::GET, path, Bytes::new());
        req.headers_mut().insert(
            "x-relay-timeout-ms",
            timeout_ms.to_string().parse().unwrap(),
        );
        let sent_at = Instant::now();
        let answer = match leave {
            Some(after) => tokio::time::timeout(after, caller.call(req)).await.ok(),
            None => Some(caller.call(req).await),
        };
        let took = sent_at.elapsed();
        self.slowest_ms
            .fetch_max(took.as_millis() as u64, Ordering::SeqCst);
        let (status, code, failure) = match answer {
            None => {
                self.caller_cancelled.fetch_add(1, Ordering::SeqCst);
                (0, "caller left".to_string(), None)
            }
            Some(Ok(a)) if a.status == 200 => {
                self.ok.fetch_add(1, Ordering::SeqCst);
                (200, String::new(), None)
            }
            Some(Ok(a)) => {
                let code = a.json()["error"].as_str().unwrap_or("?").to_string();
                let retry = if a.status == 503 && !a.headers.contains_key("retry-after") {
                    " WITHOUT retry-after"
                } else {
                    ""
                };
                let key = format!("{} {code}{retry}", a.status.as_u16());
                (a.status.as_u16(), code, Some(key))
            }
            Some(Err(e)) => {
                let code = format!("transport {e}");
                (0, code.clone(), Some(code))
            }
        };
        if let Some(k) = failure {
            *self.failures.lock().unwrap().entry(k).or_default() += 1;
        }
        self.calls.lock().unwrap().push(CallRecord {
            sent_at,
            took,
            status,
            code,
        });
        self.answered.fetch_add(1, Ordering::SeqCst);
    }
}

/// A running load; [`Load::stop`] ends it.
pub struct Load {
    stop: Arc<AtomicBool>,
    workers: Vec<tokio::task::JoinHandle<()>>,
    ledger: Arc<Ledger>,
    timeout_ms: u64,
}

/// Starts `spec` through `caller`.
pub fn start(caller: Caller, spec: LoadSpec) -> Load {
    let stop = Arc::new(AtomicBool::new(false));
    let ledger = Arc::new(Ledger::default());
    let sep = if spec.path.contains('?') { '&' } else { '?' };
    let workers = (0..spec.workers)
        .map(|w| {
            let (stop, ledger, caller, spec) =
                (stop.clone(), ledger.clone(), caller.clone(), spec.clone());
            tokio::spawn(async move {
                let mut i = 0u64;
                while !stop.load(Ordering::SeqCst) {
                    i += 1;
                    let leave = spec
                        .cancel_every
                        .filter(|n| i.is_multiple_of(*n))
                        .map(|_| spec.cancel_after);
                    let path = format!("{}{sep}w={w}&i={i}", spec.path);
                    ledger.call(&caller, &path, spec.timeout_ms, leave).await;
                }
            })
        })
        .collect();
    Load {
        stop,
        workers,
        ledger,
        timeout_ms: spec.timeout_ms,
    }
}

impl Load {
    /// Stops the workers after their current call. Fails if a call hangs 10 s past its
    /// deadline, if a call sent got no answer, or if an answer came more than 3 s after
    /// the call's deadline.
    pub async fn stop(self) -> Arc<Ledger> {
        self.stop.store(true, Ordering::SeqCst);
        let bound = Duration::from_millis(self.timeout_ms) + Duration::from_secs(10);
        for w in self.workers {
            tokio::time::timeout(bound, w)
                .await
                .unwrap_or_else(|_| panic!("a call hung past its deadline + 10 s"))
                .unwrap();
        }
        let l = self.ledger;
        assert_eq!(
            l.sent(),
            l.answered(),
            "every call sent gets exactly one answer: {}",
            l.summary()
        );
        assert!(
            l.slowest() <= Duration::from_millis(self.timeout_ms + 3000),
            "an answer came long after the call's deadline: {}",
            l.summary()
        );
        l
    }

    pub fn ledger(&self) -> &Ledger {
        &self.ledger
    }

    /// Waits until `n` more calls than now have been answered 200: the load is flowing
    /// (before a fault), or flows again (after one). Fails after `within`.
    pub async fn flowing(&self, n: u64, within: Duration) {
        let from = self.ledger.ok();
        let t = crate::time_until(within, || async { self.ledger.ok() >= from + n }).await;
        assert!(
            t.is_some(),
            "{n} calls were not answered 200 within {within:?}: {}",
            self.ledger.summary()
        );
    }
}
