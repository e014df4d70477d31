//! The tests' one load generator and its call ledger. Every load the harness drives goes
//! through it: the fault tests' callers ([`start`]), the soak's keep-alive callers
//! (`relay-fleet soak`) and the fleet runner's rate-driven calls (`relay-fleet run`).
//!
//! - A [`Plan`] says what each call sends ([`Call`]: its request, what its answer must
//!   carry ([`Expect`]), its client deadline and when the caller leaves) and hears how
//!   each ended ([`Ended`]); it may end the load (a call budget).
//! - Workers reach the front over a [`Link`]: the shared pooled client of a
//!   [`Caller`], or one HTTP/1.1 keep-alive connection per worker.
//! - Closed loop ([`workers`]): N workers each sending calls back to back until stopped
//!   or the plan has no more. Open loop ([`paced`]): calls started at a rate that may
//!   change over time, with bursts of calls at set times and a cap on calls in flight.
//! - Every call ends with exactly one answer, written in the [`Ledger`]: a 200 (whose body
//!   is checked), an error answer (status and the JSON `error` code, the tunnel server
//!   its message names), a transport error, the client deadline, or the caller leaving.
//!   The ledger keeps totals, failures by reason with examples, ok latencies in a
//!   fixed-size histogram and, unless told not to, every call.
//!
//! [`Load::stop`] fails a test when a call was left without an answer or answered long
//! after its deadline: the two losses the relay promises never to cause.

pub mod hist;
pub mod outcome;

use crate::client::Caller;
use bytes::Bytes;
use hist::{Histogram, Snapshot};
use http::header::{AUTHORIZATION, HOST};
use http::{HeaderValue, Method, Request};
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
pub use outcome::{Expect, Failure, Reason};
use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio::time::{Instant, MissedTickBehavior};
use tokio_util::sync::CancellationToken;

/// What a [`Load`] started by [`start`] sends.
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

/// Which call a worker is about to make.
#[derive(Clone, Copy, Debug)]
pub struct CallId {
    /// The worker (closed loop); 0 in an open loop.
    pub worker: usize,
    /// 1, 2, 3, ... per worker (closed loop) or per load (open loop).
    pub seq: u64,
    /// The open loop's burst this call belongs to (its index).
    pub burst: Option<usize>,
}

/// One call to make.
pub struct Call {
    /// The request; with a keep-alive [`Link`] its URI is the path and it carries `Host`.
    pub req: Request<Full<Bytes>>,
    pub expect: Expect,
    /// The client's deadline for the whole call (head and body): past it the call fails
    /// as `client_timeout`. `None`: wait for the answer.
    pub timeout: Option<Duration>,
    /// The caller leaves after this long (counted `caller left`, not a failure).
    pub leave: Option<Duration>,
    /// A burst call: also counted in the ledger's burst totals.
    pub burst: bool,
}

impl Call {
    pub fn new(req: Request<Full<Bytes>>, expect: Expect) -> Self {
        Call {
            req,
            expect,
            timeout: None,
            leave: None,
            burst: false,
        }
    }
}

/// How one call ended.
#[derive(Clone, Debug)]
pub struct Ended {
    pub sent_at: Instant,
    pub took: Duration,
    /// HTTP status; 0 when there was none.
    pub status: u16,
    pub result: Result<(), Failure>,
}

/// What a load sends, and what it does with each answer beyond the ledger.
pub trait Plan: Send + Sync + 'static {
    /// Carried from [`Plan::next`] to [`Plan::ended`] for each call.
    type Tag: Send + 'static;
    /// Call `id`, or `None` when the plan has no more (the worker stops).
    fn next(&self, id: CallId) -> Option<(Call, Self::Tag)>;
    /// Where every call is written.
    fn ledger(&self) -> &Ledger;
    /// Called once per call, after the ledger wrote it.
    fn ended(&self, _tag: Self::Tag, _ended: &Ended) {}
}

/// How workers reach the front.
#[derive(Clone)]
pub enum Link {
    /// The pooled client of a [`Caller`], shared by every worker ([`Link::shared`]).
    Shared(Box<Caller>),
    /// One HTTP/1.1 keep-alive connection per worker to this address. A connection the
    /// front closed while idle is replaced before the next call (that is not a failed
    /// call: a client pool does the same); one that failed mid-call is replaced after
    /// the failure is written.
    KeepAlive(SocketAddr),
}

impl Link {
    pub fn shared(caller: Caller) -> Link {
        Link::Shared(Box::new(caller))
    }
}

/// One failure reason's figures.
#[derive(Clone, Debug, Default)]
pub struct ReasonStat {
    pub count: u64,
    /// Since the ledger started.
    pub first_at: Duration,
    pub last_at: Duration,
    /// Up to [`EXAMPLES`] distinct messages.
    pub examples: Vec<String>,
}

/// Distinct examples kept per failure reason.
pub const EXAMPLES: usize = 3;

#[derive(Debug, Default)]
struct Failures {
    by_reason: BTreeMap<Reason, ReasonStat>,
    /// Server the message named (or `(none)`) -> reason -> count.
    by_server: BTreeMap<String, BTreeMap<String, u64>>,
}

/// One call as the caller saw it.
#[derive(Clone, Debug)]
pub struct CallRecord {
    pub sent_at: Instant,
    pub took: Duration,
    /// HTTP status; 0 when there was none (transport error or the caller left).
    pub status: u16,
    /// The JSON `error` code of an error answer, the failure reason otherwise (e.g.
    /// `transport closed`, `caller left`), or empty.
    pub code: String,
}

/// Every call of a load: totals, failures by reason (with examples and the server each
/// blames), ok latencies and the call list.
#[derive(Debug)]
pub struct Ledger {
    t0: Instant,
    sent: AtomicU64,
    answered: AtomicU64,
    ok: AtomicU64,
    failed: AtomicU64,
    caller_cancelled: AtomicU64,
    burst_sent: AtomicU64,
    burst_answered: AtomicU64,
    /// Keep-alive connections opened.
    connects: AtomicU64,
    /// Open-loop calls not started because the cap on calls in flight was reached.
    skipped: AtomicU64,
    slowest_ms: AtomicU64,
    latency: Histogram,
    failures: Mutex<Failures>,
    calls: Option<Mutex<Vec<CallRecord>>>,
}

impl Default for Ledger {
    fn default() -> Self {
        Ledger::new(true)
    }
}

impl Ledger {
    /// A ledger starting now; `keep_calls`: keep every call's record (a long load
    /// keeps only totals, reasons and the histogram, whose memory is fixed).
    pub fn new(keep_calls: bool) -> Self {
        Ledger {
            t0: Instant::now(),
            sent: AtomicU64::new(0),
            answered: AtomicU64::new(0),
            ok: AtomicU64::new(0),
            failed: AtomicU64::new(0),
            caller_cancelled: AtomicU64::new(0),
            burst_sent: AtomicU64::new(0),
            burst_answered: AtomicU64::new(0),
            connects: AtomicU64::new(0),
            skipped: AtomicU64::new(0),
            slowest_ms: AtomicU64::new(0),
            latency: Histogram::default(),
            failures: Mutex::default(),
            calls: keep_calls.then(Mutex::default),
        }
    }

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

    pub fn burst_sent(&self) -> u64 {
        self.burst_sent.load(Ordering::SeqCst)
    }

    pub fn burst_answered(&self) -> u64 {
        self.burst_answered.load(Ordering::SeqCst)
    }

    pub fn connects(&self) -> u64 {
        self.connects.load(Ordering::SeqCst)
    }

    pub fn skipped(&self) -> u64 {
        self.skipped.load(Ordering::SeqCst)
    }

    pub fn slowest(&self) -> Duration {
        Duration::from_millis(self.slowest_ms.load(Ordering::SeqCst))
    }

    pub fn failed(&self) -> u64 {
        self.failed.load(Ordering::SeqCst)
    }

    /// Latencies of the calls answered ok.
    pub fn latency(&self) -> Snapshot {
        self.latency.snapshot()
    }

    /// Failures by reason (`503 no_capacity`, `transport closed`, ...) -> count.
    pub fn failures(&self) -> BTreeMap<String, u64> {
        self.failures
            .lock()
            .by_reason
            .iter()
            .map(|(r, s)| (r.to_string(), s.count))
            .collect()
    }

    /// Every failure reason's figures.
    pub fn reasons(&self) -> Vec<(Reason, ReasonStat)> {
        self.failures
            .lock()
            .by_reason
            .iter()
            .map(|(r, s)| (r.clone(), s.clone()))
            .collect()
    }

    /// The tunnel server each failure's message named (or `(none)`) -> reason -> count.
    pub fn failures_by_server(&self) -> BTreeMap<String, BTreeMap<String, u64>> {
        self.failures.lock().by_server.clone()
    }

    /// Every call, in the order they ended (empty when the ledger keeps no calls).
    pub fn calls(&self) -> Vec<CallRecord> {
        self.calls
            .as_ref()
            .map(|c| c.lock().clone())
            .unwrap_or_default()
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
        let mut conn = Conn::new(Link::shared(caller.clone()));
        let mut call = Call::new(relay_get(caller, path, timeout_ms), Expect::Any);
        call.leave = leave;
        self.make(&mut conn, call, &[]).await;
    }

    /// Makes `call` on `conn` and writes its one answer. `servers`: the tunnel server
    /// ids to look for in error messages (empty: any id-like word).
    async fn make(&self, conn: &mut Conn, call: Call, servers: &[String]) -> Ended {
        let Call {
            req,
            expect,
            timeout,
            leave,
            burst,
        } = call;
        self.sent.fetch_add(1, Ordering::SeqCst);
        if burst {
            self.burst_sent.fetch_add(1, Ordering::SeqCst);
        }
        let sent_at = Instant::now();
        let limit = match (timeout, leave) {
            (Some(t), Some(l)) => Some((t.min(l), l < t)),
            (Some(t), None) => Some((t, false)),
            (None, Some(l)) => Some((l, true)),
            (None, None) => None,
        };
        let exchange = conn.exchange(req, &expect, &self.connects);
        let answer = match limit {
            None => Some(exchange.await),
            Some((after, _)) => tokio::time::timeout(after, exchange).await.ok(),
        };
        let took = sent_at.elapsed();
        let (status, result) = match answer {
            Some(Ok((status, retry_after, body))) => (
                status,
                outcome::classify(status, retry_after, &body, &expect, servers),
            ),
            Some(Err(f)) => {
                conn.reset();
                (0, Err(f))
            }
            None => {
                // Whatever state the connection is in, it is not reusable.
                conn.reset();
                let f = if limit.is_some_and(|(_, left)| left) {
                    Failure::new(Reason::Left, "the caller left")
                } else {
                    Failure::new(
                        Reason::ClientTimeout,
                        format!("no whole answer within {:?}", timeout.unwrap_or_default()),
                    )
                };
                (0, Err(f))
            }
        };
        let ended = Ended {
            sent_at,
            took,
            status,
            result,
        };
        self.write(&ended, burst);
        ended
    }

    fn write(&self, e: &Ended, burst: bool) {
        self.slowest_ms
            .fetch_max(e.took.as_millis() as u64, Ordering::SeqCst);
        let code = match &e.result {
            Ok(()) => {
                self.latency.record(e.took);
                self.ok.fetch_add(1, Ordering::SeqCst);
                String::new()
            }
            Err(f) if f.reason == Reason::Left => {
                self.caller_cancelled.fetch_add(1, Ordering::SeqCst);
                f.reason.to_string()
            }
            Err(f) => {
                let at = self.t0.elapsed();
                {
                    let mut all = self.failures.lock();
                    let server = f.server.clone().unwrap_or_else(|| "(none)".into());
                    *all.by_server
                        .entry(server)
                        .or_default()
                        .entry(f.reason.to_string())
                        .or_default() += 1;
                    let stat =
                        all.by_reason
                            .entry(f.reason.clone())
                            .or_insert_with(|| ReasonStat {
                                first_at: at,
                                ..ReasonStat::default()
                            });
                    stat.count += 1;
                    stat.last_at = at;
                    let mut detail = f.detail.clone();
                    truncate(&mut detail, 300);
                    if stat.examples.len() < EXAMPLES && !stat.examples.contains(&detail) {
                        stat.examples.push(detail);
                    }
                }
                self.failed.fetch_add(1, Ordering::SeqCst);
                match &f.reason {
                    Reason::Status { code, .. } => code.clone(),
                    r => r.to_string(),
                }
            }
        };
        if let Some(calls) = &self.calls {
            calls.lock().push(CallRecord {
                sent_at: e.sent_at,
                took: e.took,
                status: e.status,
                code,
            });
        }
        self.answered.fetch_add(1, Ordering::SeqCst);
        if burst {
            self.burst_answered.fetch_add(1, Ordering::SeqCst);
        }
    }
}

/// Cuts `s` to at most `max` bytes, on a character boundary.
pub fn truncate(s: &mut String, max: usize) {
    let mut i = max.min(s.len());
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    s.truncate(i);
}

/// A GET of `path` through `caller` with its deadline in `x-relay-timeout-ms`.
fn relay_get(caller: &Caller, path: &str, timeout_ms: u64) -> Request<Full<Bytes>> {
    let mut req = caller.request(Method::GET, path, Bytes::new());
    req.headers_mut()
        .insert("x-relay-timeout-ms", HeaderValue::from(timeout_ms));
    req
}

/// A request for a keep-alive [`Link`]: `path` as the URI, with `Host` and the caller's
/// `Authorization`.
pub fn keep_alive_request(
    method: Method,
    path: &str,
    host: &str,
    auth: &HeaderValue,
    body: Bytes,
) -> Request<Full<Bytes>> {
    let mut b = Request::builder()
        .method(method)
        .uri(path)
        .header(HOST, host)
        .header(AUTHORIZATION, auth.clone());
    if !body.is_empty() {
        b = b.header(http::header::CONTENT_TYPE, "application/octet-stream");
    }
    b.body(Full::new(body)).expect("valid request")
}

/// A worker's way to the front.
enum Conn {
    Shared(Box<Caller>),
    KeepAlive(SocketAddr, Option<KeepAlive>),
}

/// One HTTP/1.1 connection; its driver task ends with it.
struct KeepAlive {
    sender: SendRequest<Full<Bytes>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for KeepAlive {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl KeepAlive {
    async fn open(addr: SocketAddr) -> Result<KeepAlive, Failure> {
        let connect =
            |e: &dyn std::fmt::Display| Failure::new(Reason::Transport("connect"), e.to_string());
        let tcp = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|e| connect(&e))?;
        let _ = tcp.set_nodelay(true);
        let (sender, driver) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
            .await
            .map_err(|e| connect(&e))?;
        let task = tokio::spawn(async move {
            let _ = driver.await;
        });
        Ok(KeepAlive { sender, task })
    }
}

impl Conn {
    fn new(link: Link) -> Conn {
        match link {
            Link::Shared(c) => Conn::Shared(c),
            Link::KeepAlive(addr) => Conn::KeepAlive(addr, None),
        }
    }

    /// Drops a keep-alive connection whose state is unknown.
    fn reset(&mut self) {
        if let Conn::KeepAlive(_, c) = self {
            *c = None;
        }
    }

    /// Sends `req` and reads the whole answer: status, whether it carried
    /// `Retry-After`, and the body (not kept for a 2xx when any body will do).
    async fn exchange(
        &mut self,
        req: Request<Full<Bytes>>,
        expect: &Expect,
        connects: &AtomicU64,
    ) -> Result<(u16, bool, Bytes), Failure> {
        let resp = match self {
            Conn::Shared(caller) => caller.send(req).await.map_err(|e| {
                let kind = outcome::transport_kind_of(e.as_ref());
                Failure::new(Reason::Transport(kind), format!("{e:#}"))
            })?,
            Conn::KeepAlive(addr, conn) => {
                if let Some(c) = conn.as_mut() {
                    if c.sender.ready().await.is_err() {
                        // Closed while idle (the front may close keep-alive connections).
                        *conn = None;
                    }
                }
                if conn.is_none() {
                    *conn = Some(KeepAlive::open(*addr).await?);
                    connects.fetch_add(1, Ordering::SeqCst);
                }
                let Some(c) = conn.as_mut() else {
                    return Err(Failure::new(Reason::Transport("connect"), "no connection"));
                };
                let transport = |e: hyper::Error| {
                    Failure::new(
                        Reason::Transport(outcome::transport_kind(&e)),
                        e.to_string(),
                    )
                };
                c.sender.ready().await.map_err(transport)?;
                c.sender.send_request(req).await.map_err(transport)?
            }
        };
        let status = resp.status().as_u16();
        let retry_after = resp.headers().contains_key(http::header::RETRY_AFTER);
        let body_cut = |e: hyper::Error| Failure::new(Reason::Transport("body"), e.to_string());
        let mut body = resp.into_body();
        if *expect == Expect::Any && (200..300).contains(&status) {
            while let Some(frame) = body.frame().await {
                frame.map_err(body_cut)?;
            }
            return Ok((status, retry_after, Bytes::new()));
        }
        let bytes = body.collect().await.map_err(body_cut)?.to_bytes();
        Ok((status, retry_after, bytes))
    }
}

async fn worker<P: Plan>(
    plan: Arc<P>,
    link: Link,
    w: usize,
    servers: Arc<Vec<String>>,
    stop: CancellationToken,
) {
    let mut conn = Conn::new(link);
    let mut seq = 0u64;
    while !stop.is_cancelled() {
        seq += 1;
        let id = CallId {
            worker: w,
            seq,
            burst: None,
        };
        let Some((call, tag)) = plan.next(id) else {
            break;
        };
        let ended = plan.ledger().make(&mut conn, call, &servers).await;
        plan.ended(tag, &ended);
    }
}

/// Closed loop: starts workers `ids` in `set`, each making `plan`'s calls back to back
/// over its own connection of `link` until `stop` or the plan has no more. Every call a
/// worker starts is written before it looks at `stop` again. `servers`: the tunnel server
/// ids error messages are matched against (empty: any id-like word).
pub fn workers<P: Plan>(
    plan: &Arc<P>,
    link: &Link,
    ids: Range<usize>,
    servers: &[String],
    stop: &CancellationToken,
    set: &mut JoinSet<()>,
) {
    let servers = Arc::new(servers.to_vec());
    for w in ids {
        set.spawn(worker(
            plan.clone(),
            link.clone(),
            w,
            servers.clone(),
            stop.clone(),
        ));
    }
}

/// When an open loop starts calls.
pub struct Pace {
    /// Calls per second at this time since the start.
    pub rate: Box<dyn Fn(Duration) -> f64 + Send>,
    /// Stop starting calls after this long.
    pub duration: Duration,
    /// Calls in flight at most (bursts not counted); a call due beyond it is skipped
    /// (the ledger's `skipped`).
    pub max_in_flight: usize,
    /// At each time since the start, this many calls at once (burst `i` is the index).
    pub bursts: Vec<(Duration, usize)>,
}

/// Open loop: starts `plan`'s calls through `caller` at `pace` from `start` until its
/// duration is over or `stop`; each call runs in its own task and is written when it
/// ends (the tasks are not waited for).
pub async fn paced<P: Plan>(
    plan: Arc<P>,
    caller: Caller,
    pace: Pace,
    start: Instant,
    stop: CancellationToken,
) {
    let permits = Arc::new(Semaphore::new(pace.max_in_flight));
    let mut fired = vec![false; pace.bursts.len()];
    let mut acc = 0.0f64;
    let mut last = Instant::now();
    let mut seq = 0u64;
    let mut tick = tokio::time::interval(Duration::from_millis(5));
    tick.set_missed_tick_behavior(MissedTickBehavior::Skip);
    let mut spawn = |burst: Option<usize>, permit: Option<tokio::sync::OwnedSemaphorePermit>| {
        seq += 1;
        let id = CallId {
            worker: 0,
            seq,
            burst,
        };
        let Some((call, tag)) = plan.next(id) else {
            return;
        };
        let (plan, caller) = (plan.clone(), caller.clone());
        tokio::spawn(async move {
            let _permit = permit;
            let mut conn = Conn::Shared(Box::new(caller));
            let ended = plan.ledger().make(&mut conn, call, &[]).await;
            plan.ended(tag, &ended);
        });
    };
    loop {
        tokio::select! {
            biased;
            _ = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        let now = Instant::now();
        let t = now.duration_since(start);
        if t >= pace.duration {
            return;
        }
        let dt = now.duration_since(last).as_secs_f64();
        last = now;
        for (i, (at, calls)) in pace.bursts.iter().enumerate() {
            if !fired[i] && t >= *at {
                fired[i] = true;
                for _ in 0..*calls {
                    spawn(Some(i), None);
                }
            }
        }
        acc += (pace.rate)(t) * dt;
        while acc >= 1.0 {
            acc -= 1.0;
            match permits.clone().try_acquire_owned() {
                Ok(p) => spawn(None, Some(p)),
                Err(_) => {
                    plan.ledger().skipped.fetch_add(1, Ordering::SeqCst);
                }
            }
        }
    }
}

/// The fault tests' plan: GET `spec.path` with the worker and call number, the deadline
/// in `x-relay-timeout-ms`, leaving every `cancel_every`-th call.
struct Fixed {
    caller: Caller,
    spec: LoadSpec,
    ledger: Arc<Ledger>,
}

impl Plan for Fixed {
    type Tag = ();

    fn next(&self, id: CallId) -> Option<(Call, ())> {
        let spec = &self.spec;
        let sep = if spec.path.contains('?') { '&' } else { '?' };
        let path = format!("{}{sep}w={}&i={}", spec.path, id.worker, id.seq);
        let mut call = Call::new(relay_get(&self.caller, &path, spec.timeout_ms), Expect::Any);
        call.leave = spec
            .cancel_every
            .filter(|n| id.seq.is_multiple_of(*n))
            .map(|_| spec.cancel_after);
        Some((call, ()))
    }

    fn ledger(&self) -> &Ledger {
        &self.ledger
    }
}

/// A running load; [`Load::stop`] ends it.
pub struct Load {
    stop: CancellationToken,
    workers: JoinSet<()>,
    ledger: Arc<Ledger>,
    timeout_ms: u64,
}

/// Starts `spec` through `caller`.
pub fn start(caller: Caller, spec: LoadSpec) -> Load {
    let stop = CancellationToken::new();
    let ledger = Arc::new(Ledger::default());
    let timeout_ms = spec.timeout_ms;
    let n = spec.workers;
    let plan = Arc::new(Fixed {
        caller: caller.clone(),
        spec,
        ledger: ledger.clone(),
    });
    let mut set = JoinSet::new();
    workers(&plan, &Link::shared(caller), 0..n, &[], &stop, &mut set);
    Load {
        stop,
        workers: set,
        ledger,
        timeout_ms,
    }
}

impl Load {
    /// Stops the workers after their current call. Fails if a call hangs 10 s past its
    /// deadline, if a call sent got no answer, or if an answer came more than 3 s after
    /// the call's deadline.
    pub async fn stop(mut self) -> Arc<Ledger> {
        self.stop.cancel();
        let bound = Duration::from_millis(self.timeout_ms) + Duration::from_secs(10);
        tokio::time::timeout(bound, async {
            while let Some(w) = self.workers.join_next().await {
                w.unwrap();
            }
        })
        .await
        .unwrap_or_else(|_| panic!("a call hung past its deadline + 10 s"));
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

#[cfg(test)]
mod tests {
    use super::*;

    fn ended(took_ms: u64, status: u16, result: Result<(), Failure>) -> Ended {
        Ended {
            sent_at: Instant::now(),
            took: Duration::from_millis(took_ms),
            status,
            result,
        }
    }

    fn lost_stream(server: &str) -> Failure {
        outcome::classify(
            502,
            false,
            format!(r#"{{"error":"stream_lost","message":"tunnel server {server} went away"}}"#)
                .as_bytes(),
            &Expect::Any,
            &[],
        )
        .unwrap_err()
    }

    #[test]
    fn every_call_is_written_once_under_its_reason_and_the_server_it_blames() {
        let l = Ledger::new(true);
        l.write(&ended(5, 200, Ok(())), false);
        l.write(&ended(7, 200, Ok(())), true);
        for server in ["ts-1", "ts-1", "ts-2", "ts-3", "ts-4"] {
            l.write(&ended(9, 502, Err(lost_stream(server))), false);
        }
        l.write(
            &ended(3, 0, Err(Failure::new(Reason::Left, "the caller left"))),
            false,
        );
        assert_eq!((l.answered(), l.ok(), l.failed()), (8, 2, 5));
        assert_eq!(l.caller_cancelled(), 1, "leaving is not a failure");
        assert_eq!(l.burst_answered(), 1);
        assert_eq!(l.latency().count, 2, "only ok calls are in the histogram");
        assert_eq!(
            l.failures(),
            BTreeMap::from([("502 stream_lost".to_string(), 5)])
        );
        let by_server = l.failures_by_server();
        assert_eq!(by_server["ts-1"]["502 stream_lost"], 2);
        assert_eq!(by_server["ts-4"]["502 stream_lost"], 1);
        let (_, stat) = &l.reasons()[0];
        assert_eq!(
            stat.examples,
            [
                "tunnel server ts-1 went away",
                "tunnel server ts-2 went away",
                "tunnel server ts-3 went away"
            ],
            "distinct examples, at most {EXAMPLES}"
        );
        let codes: Vec<String> = l.calls().into_iter().map(|c| c.code).collect();
        assert_eq!(codes.len(), 8);
        assert_eq!(codes[2], "stream_lost");
        assert_eq!(codes[7], "caller left");
        assert_eq!(l.slowest(), Duration::from_millis(9));
    }

    #[test]
    fn a_ledger_told_not_to_keeps_no_call_list() {
        let l = Ledger::new(false);
        l.write(&ended(5, 200, Ok(())), false);
        assert_eq!(l.ok(), 1);
        assert!(l.calls().is_empty());
    }
}
