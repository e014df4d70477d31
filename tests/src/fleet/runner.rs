//! Runs one scenario: sets up the fleet (embedded stack or simulated agents against an
//! external deployment), sends the load, injects the faults, samples the fleet once a
//! second, and turns what it recorded into a [`Report`].
//!
//! Accounting: every call carries its deadline (`load.call_timeout`) to the relay in
//! `x-relay-timeout-ms`, so the relay owes it an answer by then (a 504 at the latest).
//! Each call ends in exactly one recorded outcome: ok, or failed with a reason (the
//! relay's error code; `client_timeout` when a success came only after the deadline, the
//! caller having given up; `interrupted` when an interrupted run stopped waiting for it);
//! or lost: no answer by the deadline plus [`ANSWER_GRACE`]. A call answered twice, or
//! never recorded, is lost too. `calls_lost` is anything but 0 only on a bug in the relay
//! or here.
//!
//! CPU: in embedded mode each component runs on its own tokio runtime whose threads are
//! named after it (`fleet-dispatch`, `fleet-servers`, `fleet-agents`, `fleet-lb`,
//! `fleet-upstream`); the report reads `/proc/self/task/*/stat` per thread name. The load
//! generator and sampler run on the caller's runtime ("load generator" row). CPU of
//! threads that exited during the run (idle blocking-pool threads) is only in the process
//! total. A scenario with a busy neighbour (`load_server`) gives every tunnel server a
//! one-thread runtime of its own (`fleet-ts-<n>`), whose CPU the server reports as its load;
//! the neighbour is a task on that runtime that keeps its thread busy (its CPU counts as
//! the tunnel servers').
//!
//! Load: open loop at the scenario's rate and bursts, plus `load.concurrency` closed-loop
//! callers. The stream placement: the in-process fixture (`crate::lb`), or a real HAProxy
//! (`servers.balancer = "haproxy"`, `crate::haproxy`).
//!
//! This module must not write to stdout; the progress line goes to stderr (TTY only).

use super::report::{self, Report, Sample, ServerStreams};
use super::scenario::{Balancer, Distribution, FaultAction, Placement, Scenario};
use super::worker::{self, ActionTotals, WorkerSpec, Workers};
use crate::client::Caller;
use crate::lb::Policy;
use crate::load::{Call, CallId, Ended, Expect, Ledger, Plan, Reason};
use crate::poll;
use crate::stack::{agent_identity, Runtimes, Stack, CALLER_KEY};
use crate::upstream::{Upstream, UpstreamHandle};
use bytes::Bytes;
use http::Method;
use parking_lot::Mutex;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use relay_agent::AgentHandle;
use std::collections::BTreeMap;
use std::io::{IsTerminal, Write};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::runtime::Runtime;
use tokio::sync::Semaphore;
use tokio::time::{Instant, MissedTickBehavior};
use tokio_util::sync::CancellationToken;

/// Where the fleet runs.
#[derive(Clone, Debug)]
pub enum Mode {
    /// Dispatcher, tunnel servers, load balancer, agents and upstream in this process.
    Embedded,
    /// Simulated agents and upstream here, driving a running dispatcher and tunnel
    /// endpoint (a server or its load balancer).
    External {
        dispatcher: String,
        tunnel: String,
        caller_key: String,
    },
}

/// How to run.
#[derive(Clone, Debug)]
pub struct RunOptions {
    pub mode: Mode,
    /// Draw the progress line on stderr (only if stderr is a terminal).
    pub progress: bool,
    /// Cancelled on Ctrl-C: the run stops and still reports what ran.
    pub stop: CancellationToken,
    /// Notified as calls of the load are answered (the run is past its warm-up).
    pub answered: Arc<tokio::sync::Notify>,
    /// Worker processes for the agents, instead of the scenario's `agents.workers`.
    pub workers: Option<usize>,
    /// The binary the workers run (`<exe> worker`); default: this process's own.
    pub worker_exe: Option<std::path::PathBuf>,
}

impl Default for RunOptions {
    fn default() -> Self {
        RunOptions {
            mode: Mode::Embedded,
            progress: false,
            stop: CancellationToken::new(),
            answered: Arc::default(),
            workers: None,
            worker_exe: None,
        }
    }
}

/// Runtimes of the components, one per component, threads named after it.
struct Rts {
    rts: Vec<Runtime>,
    handles: Runtimes,
}

impl Rts {
    /// `own_servers`: server slots that get a one-thread runtime of their own.
    fn new(own_servers: usize) -> std::io::Result<Rts> {
        let mk = |name: &str, threads: usize| {
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(threads)
                .thread_name(name)
                .enable_all()
                .build()
        };
        let mut rts = vec![
            mk("fleet-dispatch", 1)?,
            mk("fleet-servers", 2)?,
            mk("fleet-agents", 2)?,
            mk("fleet-lb", 1)?,
            mk("fleet-upstream", 1)?,
        ];
        let mut per_server = Vec::new();
        for i in 0..own_servers {
            let name = format!("fleet-ts-{}", i + 1);
            let rt = mk(&name, 1)?;
            per_server.push((rt.handle().clone(), name));
            rts.push(rt);
        }
        let h = |i: usize| rts[i].handle().clone();
        let handles = Runtimes {
            dispatcher: h(0),
            servers: h(1),
            agents: h(2),
            lb: h(3),
            upstream: h(4),
            per_server,
        };
        Ok(Rts { rts, handles })
    }

    fn stop(self) {
        for rt in self.rts {
            rt.shutdown_background();
        }
    }
}

/// Busy neighbours: a task per loaded server slot keeping its runtime's thread busy.
#[derive(Default)]
struct Neighbours {
    /// Each server slot's runtime (empty without per-server runtimes).
    runtimes: Vec<tokio::runtime::Handle>,
    /// Stops each running neighbour, by slot.
    running: Mutex<BTreeMap<usize, CancellationToken>>,
    /// Seconds into the run the first neighbour started.
    from_s: Mutex<Option<f64>>,
    /// Server ids that got a neighbour.
    loaded: Mutex<Vec<String>>,
}

/// How long a busy neighbour runs before it lets the server's tasks have the thread: each
/// task of the server waits up to this long for its turn, every time it wakes.
const NEIGHBOUR_SLICE: Duration = Duration::from_millis(10);

/// A busy neighbour: spins for a slice, yields, again, until `stop`.
async fn busy_neighbour(stop: CancellationToken) {
    while !stop.is_cancelled() {
        let until = Instant::now() + NEIGHBOUR_SLICE;
        while Instant::now() < until {
            std::hint::spin_loop();
        }
        tokio::task::yield_now().await;
    }
}

/// The load each server last reported and the calls each answered so far, from the
/// dispatcher's metrics.
/// With several dispatchers: the load as the first one has it, the calls summed.
/// What a dispatcher's `/metrics` says of each server, and when it was read.
type DispatcherView = (BTreeMap<String, f64>, BTreeMap<String, u64>);

/// How often the samples read the dispatchers' `/metrics`: every second, and a second more
/// per thousand agents. The page holds a series per tunnel id and server (tiers, round
/// trips, spill shares): at 3,000 tunnel ids a scrape took tens of milliseconds of the
/// process the fleet runs in, and a scrape a second was a tenth of that process's CPU
/// (monitoring scrapes every 15 s or so). Small fleets, such as the neighbour scenarios
/// that read which server answered from each second on, keep the second.
fn dispatcher_view_every(agents: usize) -> Duration {
    Duration::from_secs((agents / 1000).max(1) as u64)
}

/// The dispatchers' view, read again once [`dispatcher_view_every`] has passed.
async fn dispatcher_view_paced(ctx: &Ctx) -> DispatcherView {
    let mut last = ctx.dispatcher_view.lock().await;
    if let Some((at, view)) = &*last {
        // Within a few milliseconds of the period counts as due: samples come a second
        // apart.
        let every = dispatcher_view_every(ctx.agents);
        if at.elapsed() + Duration::from_millis(50) < every {
            return view.clone();
        }
    }
    let view = dispatcher_view(&ctx.admins).await;
    *last = Some((Instant::now(), view.clone()));
    view
}

async fn dispatcher_view(admins: &[SocketAddr]) -> DispatcherView {
    let mut load = BTreeMap::new();
    let mut calls: BTreeMap<String, u64> = BTreeMap::new();
    for (i, admin) in admins.iter().enumerate() {
        let Ok(text) = crate::procs::scrape(*admin).await else {
            continue;
        };
        for (k, v) in labelled(&text, "relay_dispatcher_calls_by_server_total", "server_id") {
            *calls.entry(k).or_default() += v as u64;
        }
        if i == 0 {
            load = labelled(&text, "relay_dispatcher_server_load_ratio", "server_id");
        }
    }
    (load, calls)
}

/// Tunnel server entries dropped for a missed lease, summed over the dispatchers; `None`
/// if one did not answer.
async fn leases_missed(admins: &[SocketAddr]) -> Option<u64> {
    let mut sum = 0.0;
    for admin in admins {
        let text = crate::procs::scrape(*admin).await.ok()?;
        sum += crate::procs::metric(&text, "relay_dispatcher_lease_expiries_total", &[]);
    }
    Some(sum as u64)
}

/// What the run shares besides the stack: the worker processes, the dispatchers' admin
/// listeners, and what coverage after a server start is measured against.
struct Ctx {
    workers: Option<Arc<Workers>>,
    admins: Vec<SocketAddr>,
    cover: CoverWatch,
    agents: usize,
    /// How the fleet came up, for the report.
    startup: Mutex<Vec<String>>,
    /// The last dispatchers' view the samples read ([`dispatcher_view_paced`]).
    dispatcher_view: tokio::sync::Mutex<Option<(Instant, DispatcherView)>>,
}

/// The running servers (what an agent covers to count as covered) and the server starts
/// whose coverage is being timed.
#[derive(Default)]
struct CoverWatch {
    expected: Mutex<Vec<String>>,
    starts: Mutex<Vec<report::CoveredAfter>>,
    /// When each start happened, by index into `starts`.
    started_at: Mutex<Vec<Instant>>,
}

/// How long after a busy neighbour starts its server's load is read high enough to act on
/// (a few samples of the smoothed figure) and routing has stepped: the busy server's
/// `settled` share counts from then.
const SETTLE: Duration = Duration::from_secs(5);

/// The samples of metric `name` in Prometheus text, by the value of label `label`.
fn labelled(text: &str, name: &str, label: &str) -> BTreeMap<String, f64> {
    let mut out: BTreeMap<String, f64> = BTreeMap::new();
    let prefix = format!("{name}{{");
    let key = format!("{label}=\"");
    for line in text.lines() {
        let Some(rest) = line.strip_prefix(prefix.as_str()) else {
            continue;
        };
        let Some((labels, value)) = rest.split_once("} ") else {
            continue;
        };
        let id = labels
            .split(',')
            .find_map(|l| l.strip_prefix(key.as_str()))
            .and_then(|v| v.strip_suffix('"'));
        if let (Some(id), Ok(v)) = (id, value.trim().parse::<f64>()) {
            *out.entry(id.to_string()).or_default() += v;
        }
    }
    out
}

/// The fleet under test, as the sampler and the fault injector see it.
enum UnderTest {
    Embedded(Arc<tokio::sync::Mutex<Stack>>),
    External {
        agents: Arc<tokio::sync::Mutex<Vec<Option<AgentHandle>>>>,
        configs: Vec<relay_agent::Config>,
        upstream: UpstreamHandle,
        agent_rt: tokio::runtime::Handle,
    },
}

/// How long past its deadline a call may still be answered before it counts as lost.
/// The relay answers a call it cannot serve at its deadline; this covers scheduling on a
/// loaded machine.
pub const ANSWER_GRACE: Duration = Duration::from_secs(5);

/// How one call ended, as the caller saw it.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Outcome {
    /// Answered: ok by its deadline, or failed with the reason (by the deadline plus the
    /// grace).
    Answered(Result<(), String>),
    /// Answered ok, but after its deadline (within the grace): the caller had given up.
    Late,
    /// No answer by the deadline plus [`ANSWER_GRACE`].
    Lost,
    /// Still running when an interrupted run stopped waiting.
    Interrupted,
}

/// What the load generator recorded.
#[derive(Default)]
pub(crate) struct Recorder {
    pub sent: AtomicU64,
    pub ok: AtomicU64,
    pub failed: AtomicU64,
    /// Calls never answered by their deadline plus the grace.
    pub lost: AtomicU64,
    pub in_flight: AtomicI64,
    pub inner: Mutex<RecInner>,
}

#[derive(Default)]
pub(crate) struct RecInner {
    /// (start second into the run, latency ms) of every answered call, ok or not.
    pub latencies: Vec<(f32, f32)>,
    pub failures: BTreeMap<String, u64>,
    /// Start second of every failed call.
    pub failed_at: Vec<f32>,
    /// Start and end second of every failed call (not the interrupted ones).
    pub failed_span: Vec<(f32, f32)>,
    /// Per call id: whether an outcome was recorded.
    pub recorded: Vec<bool>,
    /// Outcomes recorded for a call that already had one.
    pub answered_twice: u64,
    /// Set when the run stops waiting: later outcomes are not recorded.
    pub closed: bool,
    /// Second into the run when the first fault had taken effect (a kill is applied a
    /// little after its scheduled time: calls started in between were in flight at it).
    pub first_fault_applied: Option<f32>,
}

impl Recorder {
    /// A new call's id (ids are 0, 1, 2, ... in sending order).
    fn next_id(&self) -> u64 {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        self.sent.fetch_add(1, Ordering::Relaxed)
    }

    /// Records call `id`'s outcome; a second outcome for the same call is counted as
    /// answered twice and otherwise ignored. Nothing is recorded once closed.
    fn record(&self, id: u64, t: f32, latency_ms: f32, outcome: Outcome) {
        let mut g = self.inner.lock();
        if !g.closed {
            self.record_locked(&mut g, id, t, latency_ms, outcome);
        }
    }

    /// Stops recording; every call without an outcome gets `leftover`.
    fn close(&self, t: f32, leftover: Outcome) {
        let mut g = self.inner.lock();
        g.closed = true;
        for id in 0..self.sent.load(Ordering::Relaxed) {
            if !g.recorded.get(id as usize).copied().unwrap_or(false) {
                self.record_locked(&mut g, id, t, 0.0, leftover.clone());
            }
        }
    }

    fn record_locked(&self, g: &mut RecInner, id: u64, t: f32, latency_ms: f32, outcome: Outcome) {
        let i = id as usize;
        if g.recorded.len() <= i {
            g.recorded.resize(i + 1, false);
        }
        if std::mem::replace(&mut g.recorded[i], true) {
            g.answered_twice += 1;
            return;
        }
        let failure = match outcome {
            Outcome::Answered(Ok(())) => {
                g.latencies.push((t, latency_ms));
                self.ok.fetch_add(1, Ordering::Relaxed);
                None
            }
            Outcome::Answered(Err(reason)) => Some(reason),
            Outcome::Late => Some("client_timeout".to_string()),
            Outcome::Interrupted => {
                *g.failures.entry("interrupted".into()).or_default() += 1;
                self.failed.fetch_add(1, Ordering::Relaxed);
                None
            }
            Outcome::Lost => {
                self.lost.fetch_add(1, Ordering::Relaxed);
                None
            }
        };
        if let Some(reason) = failure {
            g.latencies.push((t, latency_ms));
            *g.failures.entry(reason).or_default() += 1;
            g.failed_at.push(t);
            g.failed_span.push((t, t + latency_ms / 1000.0));
            self.failed.fetch_add(1, Ordering::Relaxed);
        }
        self.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

/// One burst's progress.
pub(crate) struct BurstStat {
    pub at: f64,
    pub calls: u64,
    pub ok: AtomicU64,
    pub done: AtomicU64,
    /// Milliseconds from the burst's start to its last answer.
    pub last_done_ms: AtomicU64,
}

/// The run's calls, made by [`crate::load::paced`]: each goes to a tunnel id (a burst's
/// own, the hot ones for `hot_share` of the calls, else any) with its deadline in
/// `x-relay-timeout-ms`, and waits for its answer until the deadline plus
/// [`ANSWER_GRACE`]. Each ending is turned into the run's [`Outcome`] and recorded.
struct RunCalls {
    ledger: Ledger,
    rec: Arc<Recorder>,
    /// One per dispatcher front; calls alternate between them.
    callers: Vec<Caller>,
    method: Method,
    suffix: String,
    body: Bytes,
    timeout: Duration,
    tunnel_ids: Vec<String>,
    hot_share: f64,
    hot_tunnels: usize,
    /// Each burst's tunnel id index and figures.
    burst_tunnels: Vec<usize>,
    bursts: Arc<Vec<BurstStat>>,
    rng: Mutex<StdRng>,
    start: Instant,
    answered: Arc<tokio::sync::Notify>,
}

impl RunCalls {
    fn new(
        s: &Scenario,
        callers: Vec<Caller>,
        tunnel_ids: Vec<String>,
        rec: Arc<Recorder>,
        bursts: Arc<Vec<BurstStat>>,
        start: Instant,
        answered: Arc<tokio::sync::Notify>,
    ) -> RunCalls {
        let up = &s.upstream;
        let (method, suffix, body) = if up.request_bytes > 0 {
            let body: Bytes = (0..up.request_bytes).map(|i| (i % 251) as u8).collect();
            (Method::POST, "/echo".to_string(), body)
        } else if up.response_bytes > 0 {
            (
                Method::GET,
                format!("/bytes/{}", up.response_bytes),
                Bytes::new(),
            )
        } else {
            (Method::GET, "/hello".to_string(), Bytes::new())
        };
        RunCalls {
            ledger: Ledger::new(false),
            rec,
            callers,
            method,
            suffix,
            body,
            timeout: s.load.call_timeout,
            tunnel_ids,
            hot_share: s.load.hot_share,
            hot_tunnels: s.load.hot_tunnels,
            burst_tunnels: s.load.bursts.iter().map(|b| b.tunnel).collect(),
            bursts,
            rng: Mutex::new(StdRng::seed_from_u64(s.seed)),
            start,
            answered,
        }
    }

    /// How a call ended, in the run's terms: answered ok or with a reason (the
    /// dispatcher's `error` code, `http_<status>`, `transport`, `body`), a success after
    /// the deadline (late), or no answer by the deadline plus the grace (lost).
    fn outcome(&self, e: &Ended) -> Outcome {
        match &e.result {
            Ok(()) if e.took > self.timeout => Outcome::Late,
            Ok(()) => Outcome::Answered(Ok(())),
            Err(f) => match &f.reason {
                Reason::ClientTimeout => Outcome::Lost,
                Reason::Status { status, code, .. } if code == "-" => {
                    Outcome::Answered(Err(format!("http_{status}")))
                }
                Reason::Status { code, .. } => Outcome::Answered(Err(code.clone())),
                Reason::Transport("body") | Reason::BadBody => {
                    Outcome::Answered(Err("body".into()))
                }
                Reason::Transport(_) | Reason::Left => Outcome::Answered(Err("transport".into())),
            },
        }
    }
}

impl Plan for RunCalls {
    /// The call's id in the recorder.
    type Tag = (u64, Option<usize>);

    fn next(&self, id: CallId) -> Option<(Call, Self::Tag)> {
        let idx = match id.burst {
            Some(b) => self.burst_tunnels[b],
            None => {
                let mut rng = self.rng.lock();
                if self.hot_share > 0.0 && rng.gen::<f64>() < self.hot_share {
                    rng.gen_range(0..self.hot_tunnels)
                } else {
                    rng.gen_range(0..self.tunnel_ids.len())
                }
            }
        };
        let call_id = self.rec.next_id();
        let caller = &self.callers[call_id as usize % self.callers.len()];
        let mut req = caller.request(
            self.method.clone(),
            &format!("/relay/{}{}", self.tunnel_ids[idx], self.suffix),
            self.body.clone(),
        );
        req.headers_mut().insert(
            "x-relay-timeout-ms",
            http::HeaderValue::from(self.timeout.as_millis().max(1) as u64),
        );
        let mut call = Call::new(req, Expect::Any);
        call.timeout = Some(self.timeout + ANSWER_GRACE);
        Some((call, (call_id, id.burst)))
    }

    fn ledger(&self) -> &Ledger {
        &self.ledger
    }

    fn ended(&self, (id, burst): Self::Tag, e: &Ended) {
        let outcome = self.outcome(e);
        if let Some(b) = burst.and_then(|b| self.bursts.get(b)) {
            if outcome == Outcome::Answered(Ok(())) {
                b.ok.fetch_add(1, Ordering::Relaxed);
            }
            if outcome != Outcome::Lost {
                b.done.fetch_add(1, Ordering::Relaxed);
                let since = (self.start.elapsed().as_secs_f64() - b.at).max(0.0);
                b.last_done_ms
                    .fetch_max((since * 1000.0) as u64, Ordering::Relaxed);
            }
        }
        let t = e.sent_at.duration_since(self.start).as_secs_f32();
        self.rec
            .record(id, t, e.took.as_secs_f32() * 1000.0, outcome);
        self.answered.notify_one();
    }
}

/// Upstream delay sampler for the scenario's distribution.
fn latency_fn(s: &Scenario) -> impl Fn() -> Duration + Send + Sync + 'static {
    let mean = s.upstream.latency;
    let dist = s.upstream.distribution;
    let rng = Mutex::new(StdRng::seed_from_u64(s.seed ^ 0x5eed));
    move || {
        if mean.is_zero() {
            return Duration::ZERO;
        }
        let u: f64 = rng.lock().gen::<f64>();
        match dist {
            Distribution::Fixed => mean,
            Distribution::Uniform => mean.mul_f64(0.5 + u),
            Distribution::Exponential => mean.mul_f64((-(1.0 - u).max(1e-9).ln()).min(20.0)),
        }
    }
}

fn policy(s: &Scenario, p: Placement) -> Policy {
    match p {
        Placement::Uniform => Policy::Uniform,
        Placement::RoundRobin => Policy::RoundRobin,
        Placement::Leastconn => Policy::LeastStreams,
        Placement::Weighted => Policy::Weighted(s.servers.weights.clone()),
        Placement::Unfillable => Policy::Unfillable(s.servers.unfillable.saturating_sub(1)),
    }
}

/// `/proc` readings: CPU seconds per thread name and of the process, peak and current RSS.
pub(crate) mod procstat {
    use std::collections::BTreeMap;

    /// Linux clock ticks per second (USER_HZ), fixed at 100 on every mainstream kernel.
    const HZ: f64 = 100.0;

    fn parse_stat(text: &str) -> Option<(String, f64)> {
        let open = text.find('(')?;
        let close = text.rfind(')')?;
        let comm = text.get(open + 1..close)?.to_string();
        let rest: Vec<&str> = text.get(close + 2..)?.split_whitespace().collect();
        // After "pid (comm) ": state is field 3; utime and stime are fields 14 and 15.
        let utime: f64 = rest.get(11)?.parse().ok()?;
        let stime: f64 = rest.get(12)?.parse().ok()?;
        Some((comm, (utime + stime) / HZ))
    }

    /// CPU seconds of the whole process (exited threads included).
    pub fn process_cpu() -> f64 {
        std::fs::read_to_string("/proc/self/stat")
            .ok()
            .and_then(|t| parse_stat(&t))
            .map(|(_, s)| s)
            .unwrap_or(0.0)
    }

    /// CPU seconds per live thread, keyed by thread id, with the thread's name.
    pub fn threads() -> BTreeMap<u64, (String, f64)> {
        let mut out = BTreeMap::new();
        let Ok(dir) = std::fs::read_dir("/proc/self/task") else {
            return out;
        };
        for e in dir.flatten() {
            let Some(tid) = e.file_name().to_str().and_then(|s| s.parse::<u64>().ok()) else {
                continue;
            };
            if let Some(v) = std::fs::read_to_string(e.path().join("stat"))
                .ok()
                .and_then(|t| parse_stat(&t))
            {
                out.insert(tid, v);
            }
        }
        out
    }

    /// (VmHWM, VmRSS) in KiB.
    pub fn memory_kib() -> (u64, u64) {
        let text = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
        let field = |name: &str| {
            text.lines()
                .find(|l| l.starts_with(name))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
                .unwrap_or(0)
        };
        (field("VmHWM:"), field("VmRSS:"))
    }
}

/// Component name of a thread, from the runtime it belongs to.
fn component(thread: &str) -> &'static str {
    match thread {
        "fleet-dispatch" => "dispatcher",
        "fleet-servers" => "tunnel servers",
        "fleet-agents" => "agents",
        "fleet-lb" => "load balancer",
        "fleet-upstream" => "upstream",
        t if t.starts_with("fleet-ts-") => "tunnel servers",
        // The dispatchers' registries and routing ticks and the servers' report streams,
        // each on a thread of its own (`relay_common::runtime::ControlRuntime`).
        "relay-control" => "control planes",
        _ => "load generator",
    }
}

/// CPU seconds per component between two thread readings.
fn cpu_by_component(
    before: &BTreeMap<u64, (String, f64)>,
    after: &BTreeMap<u64, (String, f64)>,
) -> BTreeMap<&'static str, f64> {
    let mut out = BTreeMap::new();
    for (tid, (name, cpu)) in after {
        let base = before.get(tid).map(|(_, c)| *c).unwrap_or(0.0);
        *out.entry(component(name)).or_insert(0.0) += (cpu - base).max(0.0);
    }
    out
}

/// Runs `scenario` and returns its report. Errors only if the fleet cannot be set up.
pub async fn run(scenario: &Scenario, opts: RunOptions) -> anyhow::Result<Report> {
    scenario.validate()?;
    // Thousands of agents hold thousands of sockets on each side, in this process and in
    // the workers (which inherit the limit).
    if scenario.agents.count > 200 || workers_of(scenario, &opts) > 0 {
        let limit = worker::raise_fd_limit();
        tracing::debug!(limit, "open-file limit");
    }
    let own = if scenario.loads_servers() && matches!(opts.mode, Mode::Embedded) {
        scenario.servers.count + scenario.servers.standby
    } else {
        0
    };
    let rts = Rts::new(own)?;
    let result = run_on(scenario, &opts, &rts).await;
    rts.stop();
    result
}

/// Worker processes of the run: the option, else the scenario's.
fn workers_of(s: &Scenario, opts: &RunOptions) -> usize {
    opts.workers.unwrap_or(s.agents.workers)
}

async fn run_on(scenario: &Scenario, opts: &RunOptions, rts: &Rts) -> anyhow::Result<Report> {
    let s = scenario;
    let mut haproxy: Option<crate::haproxy::Haproxy> = None;
    let n_workers = workers_of(s, opts);
    anyhow::ensure!(
        n_workers == 0 || matches!(opts.mode, Mode::Embedded),
        "agents in worker processes (agents.workers, --workers) need embedded mode"
    );
    let mut workers: Option<Arc<Workers>> = None;
    let mut admins = Vec::new();
    let (fleet, callers, tunnel_ids) = match &opts.mode {
        Mode::Embedded => {
            // One line for the whole simulated fleet; each component's own would repeat
            // it (a thousand agents, a thousand lines).
            relay_common::tls::note_plain_text(
                "relay-fleet run",
                &["every hop of the embedded fleet (loopback, no certificates)"],
            );
            let cov = s.agents.coverage.clone();
            let (qt, mq) = (s.servers.queue_timeout, s.servers.max_queue);
            let liveness = s.servers.liveness_interval;
            let keepalive = s.servers.tunnel_keepalive_timeout;
            let liveness_timeout = s.servers.liveness_timeout;
            let zones: Vec<&str> = s.servers.zones.iter().map(String::as_str).collect();
            let routing = s.routing.clone();
            let mut b = Stack::builder()
                .servers(s.servers.count)
                .standby_servers(s.servers.standby)
                .zones(&zones)
                .lb_seed(s.seed)
                .direct_urls(s.servers.direct)
                .lb_route_by_name(s.servers.route_by_name)
                .coverage(cov)
                .agents(if n_workers > 0 { 0 } else { s.agents.count })
                .remote_agents(s.agents.count)
                .dispatchers(s.dispatchers.count)
                // A server takes 4096 streams a connection; room for about 8 streams an
                // agent on each (opens through the balancer overshoot while filling).
                .lb_backend_connections(s.agents.count / 500 + 1)
                .runtimes(rts.handles.clone())
                .upstream_latency_fn(latency_fn(s))
                .tunnel_config(move |c| {
                    c.queue_timeout = qt;
                    c.max_queue_per_tunnel = mq;
                    c.liveness_interval = liveness;
                    c.liveness_timeout = liveness_timeout;
                    c.agent_h2.keepalive_timeout = Some(keepalive);
                })
                .dispatcher_config(move |c| c.routing = routing);
            let mut tunnels = None;
            match s.servers.balancer {
                Balancer::Fixture => b = b.placement(policy(s, s.servers.placement)),
                Balancer::Haproxy => {
                    // HAProxy in front of agent listeners bound now; the stack serves them.
                    let listeners: Vec<std::net::TcpListener> = (0..s.servers.count)
                        .map(|_| std::net::TcpListener::bind("127.0.0.1:0"))
                        .collect::<Result<_, _>>()?;
                    let backends = listeners
                        .iter()
                        .enumerate()
                        .map(|(i, l)| {
                            Ok(crate::haproxy::Backend {
                                name: format!("ts-{}", i + 1),
                                addr: l.local_addr()?,
                                admin: None,
                                weight: s.servers.weights.get(i).copied().unwrap_or(1),
                                disabled: false,
                            })
                        })
                        .collect::<std::io::Result<Vec<_>>>()?;
                    let h = crate::haproxy::Haproxy::start(backends).await?;
                    tunnels = Some(h.url());
                    haproxy = Some(h);
                    b = b.server_agent_listeners(listeners);
                }
            }
            let tunnels_for_workers = tunnels.clone();
            let stack = b
                .agent_config(move |c| {
                    c.upstream_check.interval = Duration::from_secs(30);
                    c.tunnel_h2.keepalive_timeout = Some(keepalive);
                    if let Some(url) = tunnels {
                        c.tunnels = vec![url];
                    }
                })
                .start()
                .await?;
            let callers: Vec<Caller> = stack
                .dispatchers
                .iter()
                .map(|d| Caller::new(d.http, Some(CALLER_KEY)))
                .collect();
            admins = stack.dispatchers.iter().map(|d| d.admin).collect();
            let ids = if n_workers > 0 {
                let spec = WorkerSpec {
                    index: 0,
                    first: 0,
                    count: 0,
                    tunnels: match tunnels_for_workers {
                        Some(url) => vec![url],
                        None => stack.agent_tunnels.clone(),
                    },
                    upstream: stack.upstream.url(),
                    coverage: s.agents.coverage.clone(),
                    start_rate: s.agents.start_rate / n_workers as f64,
                    servers: running_ids(&stack),
                    threads: 1,
                    keepalive_timeout: keepalive,
                };
                let exe = match &opts.worker_exe {
                    Some(p) => p.clone(),
                    None => std::env::current_exe()?,
                };
                let started = Workers::start(&exe, n_workers, s.agents.count, spec).await;
                match started {
                    Ok(w) => workers = Some(Arc::new(w)),
                    Err(e) => {
                        stack.shutdown().await;
                        return Err(e);
                    }
                }
                (0..s.agents.count).map(|i| agent_identity(i).1).collect()
            } else {
                stack.tunnel_ids()
            };
            (
                UnderTest::Embedded(Arc::new(tokio::sync::Mutex::new(stack))),
                callers,
                ids,
            )
        }
        Mode::External {
            dispatcher,
            tunnel,
            caller_key,
        } => {
            let front = reachable(dispatcher, "dispatcher (--dispatcher)").await?;
            reachable(tunnel, "tunnel endpoint (--tunnel)").await?;
            let upstream = rts
                .handles
                .upstream
                .spawn(Upstream::builder().latency_fn(latency_fn(s)).spawn())
                .await??;
            let mut agents = Vec::new();
            let mut configs = Vec::new();
            let mut ids = Vec::new();
            relay_common::tls::note_plain_text(
                "relay-fleet run",
                &["the simulated agents' tunnel streams (plain http:// to --tunnel)"],
            );
            for i in 0..s.agents.count {
                let (token, id) = agent_identity(i);
                let mut cfg = relay_agent::Config {
                    tunnels: vec![tunnel.clone()],
                    token: relay_common::Secret::new(&token),
                    upstream: upstream.url(),
                    coverage: s.agents.coverage.clone(),
                    ..relay_agent::Config::default().insecure()
                };
                cfg.upstream_check.interval = Duration::from_secs(30);
                let admin = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
                let _g = rts.handles.agents.enter();
                agents.push(Some(relay_agent::start(cfg.clone(), admin)?));
                configs.push(cfg);
                ids.push(id);
            }
            (
                UnderTest::External {
                    agents: Arc::new(tokio::sync::Mutex::new(agents)),
                    configs,
                    upstream,
                    agent_rt: rts.handles.agents.clone(),
                },
                vec![Caller::new(front, Some(caller_key))],
                ids,
            )
        }
    };
    // Rest is the reserve on every server; a fixed pool (coverage off) has no such rest,
    // and an external deployment's size is not known here.
    let servers = match &opts.mode {
        Mode::Embedded if s.agents.coverage.enabled => s.servers.count,
        _ => 0,
    };
    let expected = match &fleet {
        UnderTest::Embedded(stack) => running_ids(&*stack.lock().await),
        UnderTest::External { .. } => Vec::new(),
    };
    let ctx = Arc::new(Ctx {
        workers,
        admins,
        cover: CoverWatch {
            expected: Mutex::new(expected),
            ..CoverWatch::default()
        },
        agents: s.agents.count,
        startup: Mutex::default(),
        dispatcher_view: Default::default(),
    });
    let ready = wait_ready(s, &fleet, &ctx, &callers, &tunnel_ids, servers, &opts.stop).await;
    let neighbours = Arc::new(Neighbours {
        runtimes: rts
            .handles
            .per_server
            .iter()
            .map(|(h, _)| h.clone())
            .collect(),
        ..Neighbours::default()
    });
    let report = match ready {
        Ok(()) => Some(drive(s, opts, &fleet, &ctx, callers, tunnel_ids, &neighbours).await),
        Err(e) => {
            if let Some(w) = &ctx.workers {
                w.stop(WORKER_STOP).await;
            }
            shutdown(fleet).await;
            return Err(e);
        }
    };
    for stop in neighbours.running.lock().values() {
        stop.cancel();
    }
    let left = match &ctx.workers {
        Some(w) => w.stop(WORKER_STOP).await,
        None => Vec::new(),
    };
    shutdown(fleet).await;
    drop(haproxy);
    let mut report = report.ok_or_else(|| anyhow::anyhow!("no report"))?;
    for r in &mut report.workers {
        r.running_after = r.pid.is_some_and(|p| left.contains(&p));
    }
    Ok(report)
}

/// How long a worker may take to stop its agents and exit before it is killed.
const WORKER_STOP: Duration = Duration::from_secs(10);

/// Ids of the stack's running servers.
fn running_ids(stack: &Stack) -> Vec<String> {
    stack
        .servers
        .iter()
        .flatten()
        .map(|s| s.server_id.clone())
        .collect()
}

/// Fails fast with a clear message if `url` does not accept a TCP connection.
async fn reachable(url: &str, what: &str) -> anyhow::Result<SocketAddr> {
    let uri: http::Uri = url
        .parse()
        .map_err(|e| anyhow::anyhow!("{what}: {url:?} is not a URL: {e}"))?;
    let host = uri
        .host()
        .ok_or_else(|| anyhow::anyhow!("{what}: {url:?} has no host"))?;
    let port = uri.port_u16().unwrap_or(80);
    let addr = tokio::net::lookup_host((host, port))
        .await
        .map_err(|e| anyhow::anyhow!("{what}: cannot resolve {host}: {e}"))?
        .next()
        .ok_or_else(|| anyhow::anyhow!("{what}: {host} resolves to nothing"))?;
    match tokio::time::timeout(Duration::from_secs(3), tokio::net::TcpStream::connect(addr)).await {
        Ok(Ok(_)) => Ok(addr),
        Ok(Err(e)) => anyhow::bail!("cannot reach the {what} at {url}: {e}; is it running?"),
        Err(_) => anyhow::bail!("cannot reach the {what} at {url}: no answer within 3 s"),
    }
}

/// How long the run waits for the agents to reach their resting reserve before the load
/// starts anyway.
const REST_WAIT: Duration = Duration::from_secs(10);
/// How long the agents may take to open their streams and route every tunnel id.
const READY_WITHIN: Duration = Duration::from_secs(60);
/// The least time the routability probes get.
const PROBE_AT_LEAST: Duration = Duration::from_secs(20);
/// How often the waits before the run check the fleet.
const EVERY: Duration = Duration::from_millis(50);

/// Waits until every agent holds a stream and every tunnel id answers through the relay,
/// then (embedded, with `servers` known) until every agent covers all `servers` at its
/// reserve, at most [`REST_WAIT`]: each scenario starts from agents at rest, as its
/// description says, not from the first stream of each.
#[allow(clippy::too_many_arguments)]
async fn wait_ready(
    s: &Scenario,
    fleet: &UnderTest,
    ctx: &Ctx,
    callers: &[Caller],
    ids: &[String],
    servers: usize,
    stop: &CancellationToken,
) -> anyhow::Result<()> {
    // Paced starts take their time on top.
    let ready_within = READY_WITHIN
        + match ctx.workers {
            Some(_) if s.agents.start_rate > 0.0 => {
                Duration::from_secs_f64(s.agents.count as f64 / s.agents.start_rate)
            }
            _ => Duration::ZERO,
        };
    let deadline = Instant::now() + ready_within;
    let landed = poll::poll(
        "every agent holds a tunnel stream",
        ready_within,
        EVERY,
        || async {
            if stop.is_cancelled() {
                return Ok(false);
            }
            if let Some(w) = ctx
                .workers
                .as_ref()
                .and_then(|w| w.deaths().into_iter().next())
            {
                return Err(w);
            }
            match agents_landed(fleet, ctx).await {
                (landed, total) if landed == total => Ok(true),
                (landed, total) => Err(format!("only {landed} of {total} agents hold one")),
            }
        },
    );
    let began = Instant::now();
    match landed.await {
        Ok((true, _)) => {}
        Ok((false, _)) => anyhow::bail!("stopped while the agents opened their tunnel streams"),
        // A fleet in workers runs anyway, its start the first finding of the report.
        Err(e) if ctx.workers.is_some() => {
            ctx.startup
                .lock()
                .push(format!("not every agent held a stream in time: {e}"));
        }
        Err(e) => anyhow::bail!(
            "{e}: is the tunnel endpoint right and does its token store know the fleet's tokens \
             (relay-fleet tokens)?"
        ),
    }
    let landed = agents_landed(fleet, ctx).await.0;
    ctx.startup.lock().push(format!(
        "agents holding a stream {:.1} s after the relay was up ({} of {})",
        began.elapsed().as_secs_f64(),
        landed,
        ctx.agents
    ));
    // Probes get their time even when the wait above used it all (a fleet in workers goes
    // on after a slow start).
    let probe_deadline = deadline.max(Instant::now() + PROBE_AT_LEAST);
    let sem = Arc::new(Semaphore::new(32));
    let mut probes = Vec::new();
    for (i, id) in ids.iter().enumerate() {
        let caller = callers[i % callers.len()].clone();
        let (id, sem) = (id.clone(), sem.clone());
        probes.push(tokio::spawn(async move {
            let _p = sem.acquire_owned().await;
            let (caller, path) = (&caller, &format!("/relay/{id}/hello"));
            let within = probe_deadline.saturating_duration_since(Instant::now());
            let what = format!("tunnel id {id} routable");
            poll::poll(what, within, EVERY, || async move {
                match caller.get(path).await {
                    Ok(a) if a.status == 200 => Ok(()),
                    Ok(a) => Err(format!("last answer {} {}", a.status, a.text())),
                    Err(e) => Err(format!("last answer {e}")),
                }
            })
            .await
        }));
    }
    let mut unroutable = Vec::new();
    for p in probes {
        match p.await? {
            Ok(_) => {}
            Err(e) if ctx.workers.is_some() => unroutable.push(e.to_string()),
            Err(e) => return Err(e.into()),
        }
    }
    ctx.startup.lock().push(match unroutable.first() {
        None => format!(
            "every tunnel id routable {:.1} s after the relay was up",
            began.elapsed().as_secs_f64()
        ),
        Some(first) => format!(
            "{} of {} tunnel ids not routable in time (first: {first})",
            unroutable.len(),
            ids.len()
        ),
    });
    if servers > 0 {
        // Best effort: the run starts anyway once `REST_WAIT` has passed.
        let _ = poll::poll("the agents at rest", REST_WAIT, EVERY, || async {
            if stop.is_cancelled() {
                return Ok(());
            }
            match agents_at_rest(fleet, ctx, servers).await {
                (resting, total) if resting == total => Ok(()),
                _ => Err(""),
            }
        })
        .await;
    }
    Ok(())
}

/// Agents whose streams cover every one of `servers` (each covered: its reserve held).
async fn agents_at_rest(fleet: &UnderTest, ctx: &Ctx, servers: usize) -> (usize, usize) {
    if let Some(w) = &ctx.workers {
        return (w.total().covered, ctx.agents);
    }
    let at_rest = |h: Option<&AgentHandle>| {
        h.is_some_and(|h| {
            let v = h.coverage().borrow().clone();
            v.servers.len() >= servers && v.servers.iter().all(|s| s.state == "covered")
        })
    };
    match fleet {
        UnderTest::Embedded(stack) => {
            let st = stack.lock().await;
            let n = st.agent_count();
            ((0..n).filter(|i| at_rest(st.agent(*i))).count(), n)
        }
        UnderTest::External { agents, .. } => {
            let a = agents.lock().await;
            (a.iter().filter(|h| at_rest(h.as_ref())).count(), a.len())
        }
    }
}

async fn agents_landed(fleet: &UnderTest, ctx: &Ctx) -> (usize, usize) {
    if let Some(w) = &ctx.workers {
        return (w.total().landed, ctx.agents);
    }
    let count = |h: Option<&AgentHandle>| {
        h.map(|h| h.coverage().borrow().streams_total > 0)
            .unwrap_or(false)
    };
    match fleet {
        UnderTest::Embedded(stack) => {
            let st = stack.lock().await;
            let n = st.agent_count();
            ((0..n).filter(|i| count(st.agent(*i))).count(), n)
        }
        UnderTest::External { agents, .. } => {
            let a = agents.lock().await;
            (a.iter().filter(|h| count(h.as_ref())).count(), a.len())
        }
    }
}

/// One reading of the fleet: streams per server by state (from the agents' coverage
/// views), calls queued on the servers, coverage actions so far.
async fn sample_fleet(
    fleet: &UnderTest,
    ctx: &Ctx,
    actions: &mut ActionTotals,
) -> (
    BTreeMap<String, ServerStreams>,
    Option<f64>,
    (BTreeMap<String, f64>, BTreeMap<String, u64>),
) {
    let mut servers: BTreeMap<String, ServerStreams> = BTreeMap::new();
    // The running servers, which every agent should cover.
    let expected = ctx.cover.expected.lock().clone();
    let mut add = |i: usize, h: &AgentHandle, actions: &mut ActionTotals| {
        let rx = h.coverage();
        let view = rx.borrow();
        for sv in &view.servers {
            let e = servers.entry(sv.server_id.clone()).or_default();
            e.idle += u64::from(sv.idle);
            e.busy += u64::from(sv.streams.saturating_sub(sv.idle));
        }
        for id in &expected {
            let covered = view
                .servers
                .iter()
                .any(|s| &s.server_id == id && s.state == "covered");
            if !covered {
                servers.entry(id.clone()).or_default().short += 1;
            }
        }
        // The agent's coverage actor waits to publish while its view is borrowed.
        drop(view);
        actions.update(i, worker::agent_actions(h));
    };
    match fleet {
        UnderTest::Embedded(stack) => {
            let st = stack.lock().await;
            for i in 0..st.agent_count() {
                if let Some(h) = st.agent(i) {
                    add(i, h, actions);
                }
            }
            let queued: f64 = st
                .servers
                .iter()
                .flatten()
                .map(|s| crate::metrics::value(&s.registry, "relay_tunnel_calls_queued", &[]))
                .sum();
            // Running servers with no stream of ours show as 0.
            for s in st.servers.iter().flatten() {
                servers.entry(s.server_id.clone()).or_default();
            }
            drop(st);
            if let Some(w) = &ctx.workers {
                let t = w.total();
                for (id, v) in t.servers {
                    *servers.entry(id).or_default() = v;
                }
                actions.total = t.actions;
            }
            (servers, Some(queued), dispatcher_view_paced(ctx).await)
        }
        UnderTest::External { agents, .. } => {
            let a = agents.lock().await;
            for (i, h) in a.iter().enumerate() {
                if let Some(h) = h {
                    add(i, h, actions);
                }
            }
            (servers, None, Default::default())
        }
    }
}

/// How long past its end a run waits for the agents to prune to the scenario's
/// `max_resting_streams`.
const RESTING_WITHIN: Duration = Duration::from_secs(10);

/// Sends the load, runs faults and the sampler until the duration ends or `stop`.
async fn drive(
    s: &Scenario,
    opts: &RunOptions,
    fleet: &UnderTest,
    ctx: &Arc<Ctx>,
    callers: Vec<Caller>,
    tunnel_ids: Vec<String>,
    neighbours: &Arc<Neighbours>,
) -> Report {
    let rec = Arc::new(Recorder::default());
    let threads_before = procstat::threads();
    let cpu_before = procstat::process_cpu();
    if let Some(w) = &ctx.workers {
        w.mark_base();
    }
    let caller = callers[0].clone();
    let mut fleet_rss_peak_kib = 0u64;
    let start = Instant::now();
    let end = start + s.duration;
    let stop = opts.stop.clone();
    let answered = opts.answered.clone();
    let bursts: Arc<Vec<BurstStat>> = Arc::new(
        s.load
            .bursts
            .iter()
            .map(|b| BurstStat {
                at: b.at.as_secs_f64(),
                calls: b.calls as u64,
                ok: AtomicU64::new(0),
                done: AtomicU64::new(0),
                last_done_ms: AtomicU64::new(0),
            })
            .collect(),
    );
    let events: Arc<Mutex<Vec<(f64, String)>>> = Arc::default();

    // Load generator.
    let calls = Arc::new(RunCalls::new(
        s,
        callers,
        tunnel_ids,
        rec.clone(),
        bursts.clone(),
        start,
        answered,
    ));
    let gen = {
        let rate = {
            let s = s.clone();
            Box::new(move |t| s.rate_at(t))
        };
        let pace = crate::load::Pace {
            rate,
            duration: s.duration,
            max_in_flight: s.load.max_in_flight,
            bursts: s.load.bursts.iter().map(|b| (b.at, b.calls)).collect(),
        };
        tokio::spawn(crate::load::paced(
            calls.clone(),
            caller.clone(),
            pace,
            start,
            stop.clone(),
        ))
    };
    // Closed-loop callers: each starts its next call when its last one is answered, until
    // the end of the run (its call in flight then still gets its outcome).
    let closed_stop = CancellationToken::new();
    let mut closed = tokio::task::JoinSet::new();
    if s.load.concurrency > 0 {
        crate::load::workers(
            &calls,
            &crate::load::Link::shared(caller),
            0..s.load.concurrency,
            &[],
            &closed_stop,
            &mut closed,
        );
        let (stop, closed_stop) = (stop.clone(), closed_stop.clone());
        tokio::spawn(async move {
            tokio::select! {
                _ = stop.cancelled() => {}
                _ = tokio::time::sleep_until(end) => {}
            }
            closed_stop.cancel();
        });
    }

    // Faults.
    let faults = {
        let mut list = s.faults.clone();
        list.sort_by_key(|f| f.at);
        let stop = stop.clone();
        let events = events.clone();
        let s = s.clone();
        let fleet_faults = fault_target(fleet, neighbours.clone());
        let ctx = ctx.clone();
        let rec = rec.clone();
        tokio::spawn(async move {
            let mut added = 0;
            for f in list {
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tokio::time::sleep_until(start + f.at) => {}
                }
                let what = apply_fault(&s, &fleet_faults, &ctx, &f, &mut added).await;
                let applied = start.elapsed().as_secs_f32();
                rec.inner.lock().first_fault_applied.get_or_insert(applied);
                after_fault(&fleet_faults, &ctx, &f, start).await;
                let t = start.elapsed().as_secs_f64();
                tracing::info!(t, fault = %what, "fault");
                events.lock().push((t, what));
            }
        })
    };

    // Sampler (and progress line).
    let progress = opts.progress && std::io::stderr().is_terminal();
    let mut samples: Vec<Sample> = Vec::new();
    let mut actions = ActionTotals::default();
    let mut tick = tokio::time::interval(Duration::from_millis(250));
    tick.set_missed_tick_behavior(MissedTickBehavior::Skip);
    let mut next_sample = start;
    let mut last_ok_failed = (0u64, 0u64, start);
    let mut rate_shown = 0.0;
    let mut streams_shown = 0u64;
    let mut interrupted = false;
    let mut stopped_at: Option<Instant> = None;
    loop {
        tokio::select! {
            biased;
            _ = stop.cancelled(), if !interrupted => { interrupted = true; }
            _ = tick.tick() => {}
        }
        let now = Instant::now();
        check_covered(fleet, ctx, now).await;
        let generating = now < end && !interrupted;
        let in_flight = rec.in_flight.load(Ordering::Relaxed);
        if now >= next_sample || (!generating && in_flight == 0) {
            next_sample += Duration::from_secs(1);
            let (servers, queued, (load, answered_by)) =
                sample_fleet(fleet, ctx, &mut actions).await;
            let parent_rss = procstat::memory_kib().1;
            let workers_rss = ctx.workers.as_ref().map_or(0, |w| w.total().rss_kib);
            fleet_rss_peak_kib = fleet_rss_peak_kib.max(parent_rss + workers_rss);
            if let Some(w) = &ctx.workers {
                let t = now.duration_since(start).as_secs_f64();
                events
                    .lock()
                    .extend(w.take_events().into_iter().map(|e| (t, e)));
            }
            let (ok, failed) = (
                rec.ok.load(Ordering::Relaxed),
                rec.failed.load(Ordering::Relaxed),
            );
            let dt = now.duration_since(last_ok_failed.2).as_secs_f64().max(1e-3);
            rate_shown = (ok + failed - last_ok_failed.0 - last_ok_failed.1) as f64 / dt;
            last_ok_failed = (ok, failed, now);
            streams_shown = servers.values().map(|v| v.idle + v.busy).sum();
            samples.push(Sample {
                t: now.duration_since(start).as_secs_f64(),
                servers,
                in_flight: in_flight.max(0) as u64,
                queued,
                load,
                answered_by,
                sent: rec.sent.load(Ordering::Relaxed),
                ok,
                failed,
                actions: actions.total.clone(),
            });
        }
        if progress {
            draw_progress(s, start, &rec, rate_shown, streams_shown);
        }
        if !generating {
            // Wait for calls in flight: past their deadline plus the grace (each call has
            // an outcome by then), or 5 s when interrupted.
            let grace = if interrupted {
                Duration::from_secs(5)
            } else {
                s.load.call_timeout + ANSWER_GRACE + Duration::from_secs(1)
            };
            let since = *stopped_at.get_or_insert(now);
            if in_flight == 0 || now > since + grace {
                break;
            }
        }
    }
    // At rest: the agents prune on their own clock (slower on a busy machine). With a
    // resting bound to check, the sampler goes on after the run's end until the streams
    // are within it or `RESTING_WITHIN` has passed; the last sample is the resting count.
    if let (Some(max), false) = (s.expect.max_resting_streams, interrupted) {
        let until = Instant::now() + RESTING_WITHIN;
        let streams = |p: &Sample| -> u64 { p.servers.values().map(|v| v.idle + v.busy).sum() };
        while samples.last().is_some_and(|p| streams(p) > max) && Instant::now() < until {
            tick.tick().await;
            let (servers, queued, (load, answered_by)) =
                sample_fleet(fleet, ctx, &mut actions).await;
            samples.push(Sample {
                t: start.elapsed().as_secs_f64(),
                servers,
                in_flight: rec.in_flight.load(Ordering::Relaxed).max(0) as u64,
                queued,
                load,
                answered_by,
                sent: rec.sent.load(Ordering::Relaxed),
                ok: rec.ok.load(Ordering::Relaxed),
                failed: rec.failed.load(Ordering::Relaxed),
                actions: actions.total.clone(),
            });
        }
    }
    if progress {
        eprint!("\r\x1b[K");
        let _ = std::io::stderr().flush();
    }
    gen.abort();
    faults.abort();
    closed_stop.cancel();
    closed.abort_all();
    let _ = gen.await;
    let _ = faults.await;
    let ran_for = start.elapsed();
    // Calls still running after the wait: an interrupted run stopped waiting for them;
    // otherwise they are past their deadline plus the grace, so lost.
    rec.close(
        ran_for.as_secs_f32(),
        if interrupted {
            Outcome::Interrupted
        } else {
            Outcome::Lost
        },
    );
    let cpu = cpu_by_component(&threads_before, &procstat::threads());
    let process_cpu = procstat::process_cpu() - cpu_before;
    let queue_wait = match fleet {
        UnderTest::Embedded(stack) => {
            let st = stack.lock().await;
            let mut h = crate::metrics::Histogram::default();
            for (_, r) in st.server_registries() {
                let one = crate::metrics::histogram(&r, "relay_tunnel_queue_wait_seconds");
                h.count += one.count;
                h.sum += one.sum;
                for (i, b) in one.buckets.iter().enumerate() {
                    if h.buckets.len() <= i {
                        h.buckets.push((b.0, 0));
                    }
                    h.buckets[i].1 += b.1;
                }
            }
            Some(h)
        }
        UnderTest::External { .. } => None,
    };
    let running_servers: Vec<String> = match fleet {
        UnderTest::Embedded(stack) => stack
            .lock()
            .await
            .servers
            .iter()
            .flatten()
            .map(|s| s.server_id.clone())
            .collect(),
        UnderTest::External { .. } => Vec::new(),
    };
    let by_server = match fleet {
        UnderTest::Embedded(_) => dispatcher_view(&ctx.admins).await.1,
        UnderTest::External { .. } => BTreeMap::new(),
    };
    let leases = match fleet {
        UnderTest::Embedded(_) => leases_missed(&ctx.admins).await,
        UnderTest::External { .. } => None,
    };
    let workers = ctx
        .workers
        .as_ref()
        .map(|w| worker_reports(w))
        .unwrap_or_default();
    let worker_deaths = ctx.workers.as_ref().map(|w| w.deaths()).unwrap_or_default();
    let covered_after = ctx.cover.starts.lock().clone();
    let startup = ctx.startup.lock().clone();
    let from = *neighbours.from_s.lock();
    let busy = from.map(|from_s| {
        let servers = neighbours.loaded.lock().clone();
        // Calls answered from the first sample at or after `t` to the end: all, theirs.
        let since = |t: f64| {
            let before = samples
                .iter()
                .find(|p| p.t >= t)
                .map(|p| p.answered_by.clone())
                .unwrap_or_default();
            let after = |id: &String| {
                by_server
                    .get(id)
                    .copied()
                    .unwrap_or(0)
                    .saturating_sub(before.get(id).copied().unwrap_or(0))
            };
            let all: u64 = by_server.keys().map(after).sum();
            let theirs: u64 = servers.iter().map(after).sum();
            (all, theirs)
        };
        let (calls, theirs) = since(from_s);
        let settled_from_s = from_s + SETTLE.as_secs_f64();
        let (settled_calls, settled) = since(settled_from_s);
        let settled_latency = rec
            .inner
            .lock()
            .latencies
            .iter()
            .filter(|(t, _)| f64::from(*t) >= settled_from_s)
            .map(|(_, l)| *l)
            .collect();
        report::BusyShare {
            servers,
            from_s,
            share: theirs as f64 / calls.max(1) as f64,
            calls,
            settled_from_s,
            settled_share: settled as f64 / settled_calls.max(1) as f64,
            settled_calls,
            settled_latency_ms: report::quantiles(settled_latency),
        }
    });
    let events = events.lock().clone();
    let inner = std::mem::take(&mut *rec.inner.lock());
    report::build(report::Inputs {
        scenario: s,
        mode: match &opts.mode {
            Mode::Embedded => "embedded",
            Mode::External { .. } => "external",
        },
        interrupted,
        ran_for,
        sent: rec.sent.load(Ordering::Relaxed),
        ok: rec.ok.load(Ordering::Relaxed),
        never_answered: rec.lost.load(Ordering::Relaxed),
        skipped: calls.ledger.skipped(),
        rec: inner,
        samples,
        events,
        bursts: &bursts,
        queue_wait,
        cpu,
        process_cpu,
        memory: procstat::memory_kib(),
        fleet_rss_peak_kib,
        workers,
        worker_deaths,
        leases_missed: leases,
        covered_after,
        startup,
        dispatchers: ctx.admins.len().max(1),
        running_servers,
        calls_by_server: by_server,
        busy,
    })
}

fn draw_progress(s: &Scenario, start: Instant, rec: &Recorder, rate: f64, streams: u64) {
    let el = start.elapsed().as_secs_f64();
    let total = s.duration.as_secs_f64().max(0.001);
    let frac = (el / total).min(1.0);
    let width = 24;
    let filled = (frac * width as f64) as usize;
    eprint!(
        "\r\x1b[K{} [{}{}] {:>5.1}/{:.0}s  {:>7.0} calls/s  errors {}  streams {}  in flight {}",
        s.name,
        "#".repeat(filled),
        "-".repeat(width - filled),
        el,
        total,
        rate,
        rec.failed.load(Ordering::Relaxed),
        streams,
        rec.in_flight.load(Ordering::Relaxed)
    );
    let _ = std::io::stderr().flush();
}

/// What the fault task may touch.
#[derive(Clone)]
enum FaultTarget {
    Embedded(Arc<tokio::sync::Mutex<Stack>>, Arc<Neighbours>),
    External {
        agents: Arc<tokio::sync::Mutex<Vec<Option<AgentHandle>>>>,
        configs: Vec<relay_agent::Config>,
        agent_rt: tokio::runtime::Handle,
    },
}

fn fault_target(fleet: &UnderTest, neighbours: Arc<Neighbours>) -> FaultTarget {
    match fleet {
        UnderTest::Embedded(s) => FaultTarget::Embedded(s.clone(), neighbours),
        UnderTest::External {
            agents,
            configs,
            agent_rt,
            ..
        } => FaultTarget::External {
            agents: agents.clone(),
            configs: configs.clone(),
            agent_rt: agent_rt.clone(),
        },
    }
}

/// Applies one fault; returns what happened, for the timeline.
async fn apply_fault(
    s: &Scenario,
    target: &FaultTarget,
    ctx: &Ctx,
    f: &super::scenario::Fault,
    added: &mut usize,
) -> String {
    let idx = f.server.saturating_sub(1);
    let name = format!("ts-{}", f.server);
    if let (Some(w), FaultAction::RestartAgent) = (&ctx.workers, f.action) {
        return w.restart_agent(f.agent).await;
    }
    match (target, f.action) {
        (FaultTarget::Embedded(stack, _), FaultAction::KillServer) => {
            let done = stack.lock().await.kill_server(idx);
            format!("kill {name}{}", if done { "" } else { " (not running)" })
        }
        (FaultTarget::Embedded(stack, _), FaultAction::DrainServer) => {
            let taken = stack.lock().await.take_server(idx);
            match taken {
                Some(h) => {
                    h.shutdown().await;
                    format!("drain {name}")
                }
                None => format!("drain {name} (not running)"),
            }
        }
        (FaultTarget::Embedded(stack, _), FaultAction::StartServer) => {
            match stack.lock().await.start_server(idx).await {
                Ok(()) => format!("start {name}"),
                Err(e) => format!("start {name} failed: {e}"),
            }
        }
        (FaultTarget::Embedded(stack, _), FaultAction::AddServer) => {
            let slot = s.servers.count + *added;
            *added += 1;
            match stack.lock().await.start_server(slot).await {
                Ok(()) => format!("add ts-{}", slot + 1),
                Err(e) => format!("add ts-{} failed: {e}", slot + 1),
            }
        }
        (FaultTarget::Embedded(stack, _), FaultAction::RestartAgent) => {
            let h = stack.lock().await.take_agent(f.agent);
            if let Some(h) = h {
                let _ = tokio::time::timeout(Duration::from_secs(15), h.shutdown()).await;
            }
            match stack.lock().await.respawn_agent(f.agent).await {
                Ok(()) => format!("restart agent {}", f.agent),
                Err(e) => format!("restart agent {} failed: {e}", f.agent),
            }
        }
        (FaultTarget::Embedded(_, n), FaultAction::LoadServer) => {
            let Some(rt) = n.runtimes.get(idx) else {
                return format!("load {name}: no runtime of its own");
            };
            let stop = CancellationToken::new();
            let prev = n.running.lock().insert(idx, stop.clone());
            if let Some(prev) = prev {
                prev.cancel();
            }
            rt.spawn(busy_neighbour(stop));
            n.from_s.lock().get_or_insert(f.at.as_secs_f64());
            n.loaded.lock().push(name.clone());
            format!("busy neighbour on {name}")
        }
        (FaultTarget::Embedded(_, n), FaultAction::UnloadServer) => {
            let stop = n.running.lock().remove(&idx);
            match stop {
                Some(stop) => {
                    stop.cancel();
                    format!("busy neighbour off {name}")
                }
                None => format!("busy neighbour off {name} (none)"),
            }
        }
        (FaultTarget::Embedded(stack, _), FaultAction::SetPlacement) => {
            let p = f.placement.unwrap_or(Placement::Uniform);
            match &stack.lock().await.lb {
                Some(lb) => {
                    lb.set_policy(policy(s, p));
                    format!("placement {p:?}")
                }
                None => "placement: no load balancer".into(),
            }
        }
        (
            FaultTarget::External {
                agents,
                configs,
                agent_rt,
            },
            FaultAction::RestartAgent,
        ) => {
            let h = agents.lock().await.get_mut(f.agent).and_then(Option::take);
            if let Some(h) = h {
                let _ = tokio::time::timeout(Duration::from_secs(15), h.shutdown()).await;
            }
            let Some(cfg) = configs.get(f.agent).cloned() else {
                return format!("restart agent {}: no such agent", f.agent);
            };
            let admin = match tokio::net::TcpListener::bind("127.0.0.1:0").await {
                Ok(l) => l,
                Err(e) => return format!("restart agent {} failed: {e}", f.agent),
            };
            let spawned = {
                let _g = agent_rt.enter();
                relay_agent::start(cfg, admin)
            };
            match spawned {
                Ok(h) => {
                    if let Some(slot) = agents.lock().await.get_mut(f.agent) {
                        *slot = Some(h);
                    }
                    format!("restart agent {}", f.agent)
                }
                Err(e) => format!("restart agent {} failed: {e}", f.agent),
            }
        }
        (FaultTarget::External { .. }, a) => {
            format!("{a:?} skipped: external mode only restarts agents")
        }
    }
}

/// After a fault that changed the running servers: the servers every agent must cover
/// now, and for a server start, the start whose coverage is timed.
async fn after_fault(target: &FaultTarget, ctx: &Ctx, f: &super::scenario::Fault, start: Instant) {
    let FaultTarget::Embedded(stack, _) = target else {
        return;
    };
    if !matches!(
        f.action,
        FaultAction::KillServer
            | FaultAction::DrainServer
            | FaultAction::StartServer
            | FaultAction::AddServer
    ) {
        return;
    }
    let ids = running_ids(&*stack.lock().await);
    let now = Instant::now();
    if matches!(f.action, FaultAction::StartServer | FaultAction::AddServer) {
        let server = match f.action {
            FaultAction::StartServer => format!("ts-{}", f.server),
            _ => ids.last().cloned().unwrap_or_default(),
        };
        ctx.cover.starts.lock().push(report::CoveredAfter {
            server,
            at_s: now.duration_since(start).as_secs_f64(),
            after_s: None,
            server_after_s: None,
        });
        ctx.cover.started_at.lock().push(now);
    }
    *ctx.cover.expected.lock() = ids.clone();
    if let Some(w) = &ctx.workers {
        w.set_servers(ids).await;
    }
}

/// With a server start being timed: once every agent covers every running server, the
/// time since each such start.
async fn check_covered(fleet: &UnderTest, ctx: &Ctx, now: Instant) {
    let pending = ctx.cover.starts.lock().iter().any(|c| c.after_s.is_none());
    if !pending {
        return;
    }
    let (covered, total, servers, stale) = match (fleet, &ctx.workers) {
        (_, Some(w)) => {
            let t = w.total();
            (t.covered, ctx.agents, t.servers, t.stale)
        }
        (UnderTest::Embedded(stack), None) => {
            let expected = ctx.cover.expected.lock().clone();
            let st = stack.lock().await;
            let n = st.agent_count();
            let (servers, _, covered) =
                worker::read_agents((0..n).filter_map(|i| st.agent(i)), &expected);
            (covered, n, servers, 0)
        }
        (UnderTest::External { .. }, None) => return,
    };
    // The started server alone: no agent (counted against the current server list) short
    // of it.
    if stale == 0 {
        let at = ctx.cover.started_at.lock().clone();
        for (c, at) in ctx.cover.starts.lock().iter_mut().zip(at) {
            let short = servers.get(&c.server).map_or(0, |s| s.short);
            if c.server_after_s.is_none() && short == 0 {
                c.server_after_s = Some(now.duration_since(at).as_secs_f64());
            }
        }
    }
    if covered < total {
        return;
    }
    let at = ctx.cover.started_at.lock().clone();
    for (c, at) in ctx.cover.starts.lock().iter_mut().zip(at) {
        if c.after_s.is_none() {
            c.after_s = Some(now.duration_since(at).as_secs_f64());
        }
    }
}

/// Each worker's CPU over the run and memory, as its last sample had them.
fn worker_reports(w: &Workers) -> Vec<report::WorkerReport> {
    w.slots()
        .iter()
        .map(|slot| {
            let latest = slot.latest.lock().as_ref().map(|(_, w)| w.clone());
            let base = slot.base.lock().as_ref().map_or(0.0, |b| b.cpu_s);
            let latest = latest.unwrap_or_default();
            report::WorkerReport {
                index: slot.index,
                agents: format!("{}..{}", slot.first, slot.first + slot.count),
                pid: slot.pid,
                cpu_s: (latest.cpu_s - base).max(0.0),
                cpu_s_total: latest.cpu_s,
                peak_rss_mib: latest.hwm_kib as f64 / 1024.0,
                rss_mib: latest.rss_kib as f64 / 1024.0,
                died: slot.died.lock().clone(),
                running_after: false,
            }
        })
        .collect()
}

/// Stops the fleet, bounded.
async fn shutdown(fleet: UnderTest) {
    let work = async move {
        match fleet {
            UnderTest::Embedded(stack) => {
                if let Ok(m) = Arc::try_unwrap(stack) {
                    m.into_inner().shutdown().await;
                }
            }
            UnderTest::External {
                agents, upstream, ..
            } => {
                let hs: Vec<AgentHandle> = agents.lock().await.drain(..).flatten().collect();
                futures::future::join_all(hs.into_iter().map(|h| h.shutdown())).await;
                drop(upstream);
            }
        }
    };
    let _ = tokio::time::timeout(Duration::from_secs(30), work).await;
}

/// Caller key of the embedded stack (for docs and the external default).
pub const EMBEDDED_CALLER_KEY: &str = CALLER_KEY;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_call_without_an_answer_or_answered_twice_is_lost_and_a_late_one_times_out() {
        let rec = Recorder::default();
        let ids: Vec<u64> = (0..5).map(|_| rec.next_id()).collect();
        rec.record(ids[0], 0.0, 1.0, Outcome::Answered(Ok(())));
        rec.record(
            ids[1],
            0.0,
            1.0,
            Outcome::Answered(Err("stream_lost".into())),
        );
        rec.record(ids[2], 0.0, 9.0, Outcome::Late);
        rec.record(ids[3], 0.0, 0.0, Outcome::Lost);
        // A second answer to call 0, and call 4 never answered.
        rec.record(ids[0], 0.0, 1.0, Outcome::Answered(Ok(())));
        rec.close(1.0, Outcome::Lost);
        let g = rec.inner.lock();
        assert_eq!(rec.ok.load(Ordering::Relaxed), 1);
        assert_eq!(rec.failed.load(Ordering::Relaxed), 2);
        assert_eq!(g.failures.get("client_timeout"), Some(&1));
        assert_eq!(rec.lost.load(Ordering::Relaxed), 2);
        assert_eq!(g.answered_twice, 1);
        assert_eq!(rec.in_flight.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn an_interrupted_run_records_what_it_stopped_waiting_for_as_interrupted() {
        let rec = Recorder::default();
        let a = rec.next_id();
        rec.next_id();
        rec.record(a, 0.0, 1.0, Outcome::Answered(Ok(())));
        rec.close(1.0, Outcome::Interrupted);
        // An answer after the run stopped waiting is not recorded.
        rec.record(a + 1, 0.0, 1.0, Outcome::Answered(Ok(())));
        let g = rec.inner.lock();
        assert_eq!(g.failures.get("interrupted"), Some(&1));
        assert_eq!(rec.lost.load(Ordering::Relaxed), 0);
        assert_eq!(g.answered_twice, 0);
        assert_eq!(rec.ok.load(Ordering::Relaxed), 1);
    }
}
