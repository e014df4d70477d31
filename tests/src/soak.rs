//! `relay-fleet soak`: proves "no call lost" at the volumes users run (hundreds of
//! thousands to millions of calls through one connection) against the real release
//! binaries, and prints every finding.
//!
//! It owns:
//! - the stack: `relay-dispatcher`, N `relay-tunnel-server`s and `relay-agent` as child
//!   processes (found next to the running executable, [`crate::procs::binary`]) on fresh
//!   loopback ports in a scratch directory, optionally a real HAProxy between the agent
//!   and the servers, and the in-process simulated upstream ([`crate::upstream`]) with a
//!   fixed latency; or, in external mode, a running stack it only calls ([`Mode`]);
//! - the load: a fixed number of callers, each on its own HTTP/1.1 keep-alive
//!   connection, calling `/relay/{tunnel_id}/...` until a number of calls were made or
//!   for a duration, checking every answer's status and body (`load`: the calls, made
//!   and written by [`crate::load`]'s closed loop and [`crate::load::Ledger`]);
//! - the faults ([`Fault`]): rolling restarts, a SIGKILL of one server, bursts of slow
//!   calls (`rig`, and the burst driver here);
//! - watching: a progress line, every process's VmRSS, every process's log (h2's
//!   `reached limit` abuse-guard lines, WARN and ERROR counts) (`logscan`);
//! - the report and its verdict ([`SoakReport`]).
//!
//! Every call it starts ends in exactly one outcome: ok, failed for one reason (status
//! and the dispatcher's `error` code, `transport ...`, `client_timeout`, `200 bad_body`),
//! or `lost` (not answered by the end: the client deadline plus grace after the last
//! call started). It must not hide anything the relay does: every failure is counted,
//! every `reached limit` line is reported and fails the run. It waits for conditions
//! with deadlines, never for fixed sleeps, and every process it starts is killed when
//! [`run`] returns or its future is dropped.

mod load;
mod logscan;
mod report;
mod rig;

pub use logscan::Findings;
pub use report::{FailureReport, LatencyReport, LogReport, ProcessReport, RssTrack, SoakReport};
pub use rig::Event;

use crate::load::{Expect, Ledger, Link};
use crate::procs::{rss_kib_of, Spawn};
use crate::stack::{CALLER_KEY, TUNNEL_ID};
use crate::upstream::{Upstream, UpstreamHandle};
use anyhow::Context as _;
use http::HeaderValue;
use load::{CallKind, Calls, Target};
use logscan::LogWatch;
use rig::{Events, ProcInfo, Rig, RigSpec};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio::time::{Instant, MissedTickBehavior};
use tokio_util::sync::CancellationToken;

/// What a soak drives and how.
#[derive(Clone, Debug)]
pub struct SoakConfig {
    /// A stack the soak starts, or a running one.
    pub mode: Mode,
    /// Concurrent callers, each on its own HTTP/1.1 keep-alive connection.
    pub concurrency: usize,
    /// Make this many calls (each answered or counted lost), then stop. With `duration`
    /// too, whichever ends first; with neither, run until `stop`.
    pub calls: Option<u64>,
    /// Stop starting calls after this long.
    pub duration: Option<Duration>,
    pub method: CallMethod,
    /// The client's deadline for one whole call (head and body); past it the call fails
    /// as `client_timeout`. Above the dispatcher's `call_timeout`, so the relay's own
    /// deadline answers first.
    pub client_timeout: Duration,
    /// How long past `client_timeout` after the last call started the soak waits for
    /// answers before counting the rest `lost`.
    pub grace: Duration,
    pub fault: Fault,
    pub timing: FaultTiming,
    /// A progress line (and each event) to stderr this often; `None`: quiet.
    pub progress_every: Option<Duration>,
    /// How often every process's VmRSS is sampled.
    pub rss_every: Duration,
}

impl Default for SoakConfig {
    fn default() -> Self {
        SoakConfig {
            mode: Mode::Embedded(Embedded::default()),
            concurrency: 64,
            calls: Some(1_000_000),
            duration: None,
            method: CallMethod::Get,
            client_timeout: Duration::from_secs(35),
            grace: Duration::from_secs(5),
            fault: Fault::None,
            timing: FaultTiming::default(),
            progress_every: Some(Duration::from_secs(5)),
            rss_every: Duration::from_secs(1),
        }
    }
}

/// What the soak calls.
#[derive(Clone, Debug)]
pub enum Mode {
    /// Child processes of the release binaries on loopback, started and killed by the soak.
    Embedded(Embedded),
    /// A running stack (e.g. examples/local): calls only, no faults, no process figures.
    /// Its upstream must be `relay-fleet upstream` (the soak checks its answers).
    External(External),
}

/// The stack an embedded soak starts.
#[derive(Clone, Debug)]
pub struct Embedded {
    /// Tunnel servers (`ts-1`, `ts-2`, ...).
    pub servers: usize,
    /// The simulated upstream's delay before every answer.
    pub upstream_latency: Duration,
    /// HAProxy between the agent and the servers, with one weight per server.
    pub haproxy_weights: Option<Vec<u32>>,
    /// The dispatcher's `call_timeout`.
    pub call_timeout: Duration,
    /// The children's `RELAY_LOG` filter. h2's abuse guards log at WARN (h2 0.4
    /// `tracing::warn!("locally-reset streams reached limit ...")`), so `info` shows
    /// them; it is set explicitly because an inherited `RELAY_LOG` would win over the
    /// harness's `RUST_LOG` and could hide them.
    pub child_log: String,
    /// The co-located mode: ts-1 serves the dispatcher front, no dispatcher process (no
    /// faults: the front would go with ts-1).
    pub colocated: bool,
}

impl Default for Embedded {
    fn default() -> Self {
        Embedded {
            servers: 2,
            upstream_latency: Duration::ZERO,
            haproxy_weights: None,
            call_timeout: Duration::from_secs(30),
            child_log: "info".into(),
            colocated: false,
        }
    }
}

/// A running stack to call.
#[derive(Clone, Debug)]
pub struct External {
    /// The dispatcher's front, `http://host:port`.
    pub dispatcher: String,
    pub caller_key: String,
    pub tunnel_id: String,
}

/// The calls the callers make.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CallMethod {
    /// `GET /bytes/{n}`, `n` in 16..=143 varying per call; the body must be the
    /// upstream's pattern of that length.
    #[default]
    Get,
    /// `POST /echo/soak` with a marker naming the caller and call; the echoed body must
    /// be that marker. Never retried by the dispatcher once it may have started.
    Post,
}

/// A fault injected while the load runs (embedded mode only).
#[derive(Clone, Debug, Default, PartialEq)]
pub enum Fault {
    #[default]
    None,
    /// SIGTERM each tunnel server in turn, wait for its exit, start it again on the same
    /// ports, wait until the fleet is whole (it answers `/readyz`, the dispatcher hears
    /// from it, HAProxy sees it up, it holds streams again), then the next server.
    RollingRestart,
    /// SIGKILL one tunnel server (1-based), optionally starting it again after a while.
    KillServer {
        server: usize,
        restart_after: Option<Duration>,
    },
    /// Raise the number of callers to `concurrency` for `length`; the extra callers call
    /// `GET /slow/{slow}` (meant with HAProxy in front of the servers).
    Burst {
        concurrency: usize,
        length: Duration,
        slow: Duration,
    },
}

/// When the fault happens, measured from the start of the load.
#[derive(Clone, Copy, Debug)]
pub struct FaultTiming {
    /// The first time.
    pub at: Duration,
    /// Repeat with this period (rolling restart and burst; a cycle that takes longer is
    /// followed at once by the next); `None`: once.
    pub every: Option<Duration>,
}

impl Default for FaultTiming {
    fn default() -> Self {
        FaultTiming {
            at: Duration::from_secs(2),
            every: None,
        }
    }
}

impl SoakConfig {
    /// Refuses settings that cannot run, naming the setting.
    pub fn validate(&self) -> anyhow::Result<()> {
        anyhow::ensure!(
            (1..=20_000).contains(&self.concurrency),
            "concurrency must be 1..=20000"
        );
        anyhow::ensure!(self.calls != Some(0), "calls must be at least 1");
        anyhow::ensure!(
            !self.client_timeout.is_zero(),
            "client timeout must be above 0"
        );
        anyhow::ensure!(
            !self.rss_every.is_zero(),
            "rss sampling period must be above 0"
        );
        anyhow::ensure!(
            self.progress_every.is_none_or(|p| !p.is_zero()),
            "progress period must be above 0"
        );
        match &self.mode {
            Mode::External(x) => {
                anyhow::ensure!(
                    self.fault == Fault::None,
                    "external mode injects no faults (drop --fault)"
                );
                anyhow::ensure!(!x.tunnel_id.is_empty(), "tunnel id must not be empty");
            }
            Mode::Embedded(e) => {
                anyhow::ensure!((1..=16).contains(&e.servers), "servers must be 1..=16");
                anyhow::ensure!(
                    !e.colocated || self.fault == Fault::None,
                    "the co-located mode injects no faults (drop --fault): the front runs in ts-1"
                );
                if let Some(w) = &e.haproxy_weights {
                    anyhow::ensure!(
                        w.len() == e.servers,
                        "weights: {} given for {} servers",
                        w.len(),
                        e.servers
                    );
                    anyhow::ensure!(
                        w.iter().all(|w| (1..=256).contains(w)),
                        "weights must be 1..=256"
                    );
                }
                match &self.fault {
                    Fault::KillServer { server, .. } => anyhow::ensure!(
                        (1..=e.servers).contains(server),
                        "the server to kill must be 1..={}",
                        e.servers
                    ),
                    Fault::Burst { concurrency, .. } => anyhow::ensure!(
                        *concurrency > self.concurrency,
                        "burst concurrency ({concurrency}) must be above the concurrency ({})",
                        self.concurrency
                    ),
                    Fault::None | Fault::RollingRestart => {}
                }
            }
        }
        if let Some(every) = self.timing.every {
            anyhow::ensure!(!every.is_zero(), "fault period must be above 0");
        }
        Ok(())
    }

    fn describe(&self) -> String {
        let load = format!(
            "{} callers, {}{}",
            self.concurrency,
            match self.method {
                CallMethod::Get => "GET /bytes/{16..143}",
                CallMethod::Post => "POST /echo/soak",
            },
            match (self.calls, self.duration) {
                (Some(c), Some(d)) => format!(", {c} calls or {d:?}"),
                (Some(c), None) => format!(", {c} calls"),
                (None, Some(d)) => format!(", for {d:?}"),
                (None, None) => ", until stopped".into(),
            }
        );
        let when = format!(
            "at {:?}{}",
            self.timing.at,
            self.timing
                .every
                .map_or(" once".into(), |e| format!(", every {e:?}"))
        );
        let fault = match &self.fault {
            Fault::None => "no fault".to_string(),
            Fault::RollingRestart => format!("fault rolling-restart {when}"),
            Fault::KillServer {
                server,
                restart_after,
            } => format!(
                "fault kill-server ts-{server} at {:?}{}",
                self.timing.at,
                restart_after.map_or(", not restarted".into(), |d| format!(
                    ", restarted after {d:?}"
                ))
            ),
            Fault::Burst {
                concurrency,
                length,
                slow,
            } => format!(
                "fault burst to {concurrency} callers of GET /slow/{} for {length:?} {when}",
                slow.as_millis()
            ),
        };
        match &self.mode {
            Mode::Embedded(e) => format!(
                "{}{} tunnel servers {}, upstream latency {}; {load}; {fault}",
                if e.colocated {
                    "co-located front in ts-1, "
                } else {
                    ""
                },
                e.servers,
                e.haproxy_weights
                    .as_ref()
                    .map_or("(agent dials each)".into(), |w| format!(
                        "behind haproxy (weights {})",
                        w.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
                    )),
                humantime::format_duration(e.upstream_latency)
            ),
            Mode::External(x) => {
                format!("external {} tunnel {}; {load}", x.dispatcher, x.tunnel_id)
            }
        }
    }
}

/// What `run` started and drives.
struct Started {
    /// Kept alive for the run (embedded mode).
    upstream: Option<UpstreamHandle>,
    rig: Option<Rig>,
    target: Target,
}

/// Runs a soak: starts the stack (or checks the external one answers), drives the load
/// and the fault, and reports. `stop` (Ctrl-C) stops starting calls; the calls in
/// flight are still waited for and the report covers what ran. Every process started is
/// killed before this returns. An `Err` means the soak could not run (binaries missing,
/// stack not ready); what the relay did is in the report, judged by
/// [`SoakReport::passed`].
///
/// A short CI version (the binaries must be built: `cargo build --bins`):
///
/// ```no_run
/// # async fn ci() -> anyhow::Result<()> {
/// use relay_tests::soak::{run, Fault, SoakConfig};
/// let config = SoakConfig {
///     calls: Some(20_000),
///     concurrency: 32,
///     fault: Fault::RollingRestart,
///     progress_every: None,
///     ..SoakConfig::default()
/// };
/// let report = run(&config, Default::default()).await?;
/// assert!(report.passed(), "{}", report.summary());
/// # Ok(())
/// # }
/// ```
pub async fn run(config: &SoakConfig, stop: CancellationToken) -> anyhow::Result<SoakReport> {
    config.validate()?;
    let echo = config.progress_every.is_some();
    let setup = async {
        match &config.mode {
            Mode::Embedded(e) => start_embedded(config, e, echo).await,
            Mode::External(x) => start_external(config, x).await,
        }
    };
    let started = tokio::select! {
        biased;
        _ = stop.cancelled() => anyhow::bail!("interrupted while starting the stack"),
        s = setup => s?,
    };
    let report = drive(config, started, stop).await;
    Ok(report)
}

/// How the children are spawned: logging at `filter` in plain text lines without
/// colours (whatever this process inherited), each in its own process group so that a
/// Ctrl-C in the terminal reaches only the soak, which lets the calls in flight finish
/// and then kills them (a SIGINT of their own would start their graceful shutdown and fail
/// those calls).
fn child_spawn(filter: &str) -> Spawn {
    Spawn {
        env: [
            ("RELAY_LOG", filter),
            ("RELAY_LOG_FORMAT", "text"),
            ("NO_COLOR", "1"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect(),
        own_process_group: true,
    }
}

async fn start_embedded(config: &SoakConfig, e: &Embedded, echo: bool) -> anyhow::Result<Started> {
    let t = Instant::now();
    let upstream = Upstream::builder()
        .latency(e.upstream_latency)
        .spawn()
        .await
        .context("starting the simulated upstream")?;
    let mut rig = Rig::start(RigSpec {
        servers: e.servers,
        haproxy_weights: e.haproxy_weights.clone(),
        upstream_url: upstream.url(),
        call_timeout: e.call_timeout,
        spawn: child_spawn(&e.child_log),
        tunnel_id: TUNNEL_ID.into(),
        colocated: e.colocated,
    })
    .await?;
    rig.wait_ready().await?;
    let addr = rig.front.http;
    if echo {
        eprintln!(
            "soak: stack ready in {:.1}s: dispatcher http://{addr}, {} ({})",
            t.elapsed().as_secs_f64(),
            rig.server_ids().join(", "),
            rig.dir().display()
        );
    }
    let target = Target {
        addr,
        host: addr.to_string(),
        auth: bearer(CALLER_KEY)?,
        tunnel_id: TUNNEL_ID.into(),
        servers: rig.server_ids(),
        timeout: config.client_timeout,
        method: config.method,
    };
    Ok(Started {
        upstream: Some(upstream),
        rig: Some(rig),
        target,
    })
}

async fn start_external(config: &SoakConfig, x: &External) -> anyhow::Result<Started> {
    let (addr, host) = resolve(&x.dispatcher).await?;
    // One call first: the soak checks answers against `relay-fleet upstream`'s.
    let probe = format!("/relay/{}/bytes/16", x.tunnel_id);
    let caller = crate::client::Caller::new(addr, Some(&x.caller_key));
    let (caller, probe) = (&caller, &probe);
    let what = format!(
        "GET {} {probe} answers 200 with 16 pattern bytes (the soak needs the stack's \
         upstream to be `relay-fleet upstream`)",
        x.dispatcher
    );
    let every = Duration::from_millis(200);
    crate::poll::poll(what, Duration::from_secs(10), every, || async move {
        match caller.get(probe).await {
            Ok(a) if a.status == 200 && Expect::Pattern(16).mismatch(&a.body).is_none() => Ok(()),
            Ok(a) => Err(format!("{} {}", a.status, a.text())),
            Err(e) => Err(e.to_string()),
        }
    })
    .await?;
    Ok(Started {
        upstream: None,
        rig: None,
        target: Target {
            addr,
            host,
            auth: bearer(&x.caller_key)?,
            tunnel_id: x.tunnel_id.clone(),
            servers: Vec::new(),
            timeout: config.client_timeout,
            method: config.method,
        },
    })
}

fn bearer(key: &str) -> anyhow::Result<HeaderValue> {
    HeaderValue::from_str(&format!("Bearer {key}"))
        .context("the caller key is not a valid header value")
}

/// `http://host:port[/...]` -> the address to connect to and the `Host` header.
async fn resolve(url: &str) -> anyhow::Result<(SocketAddr, String)> {
    anyhow::ensure!(
        !url.starts_with("https://"),
        "{url}: the soak calls over plain HTTP/1.1 only"
    );
    let rest = url.strip_prefix("http://").unwrap_or(url);
    let authority = rest.split('/').next().unwrap_or(rest);
    anyhow::ensure!(!authority.is_empty(), "{url}: no host");
    let with_port = if authority
        .rsplit_once(':')
        .is_some_and(|(_, p)| p.parse::<u16>().is_ok())
    {
        authority.to_string()
    } else {
        format!("{authority}:80")
    };
    let addr = tokio::net::lookup_host(&with_port)
        .await
        .with_context(|| format!("resolving {with_port}"))?
        .next()
        .ok_or_else(|| anyhow::anyhow!("{with_port}: no address"))?;
    Ok((addr, authority.to_string()))
}

/// One process being watched.
struct Watched {
    info: ProcInfo,
    rss: RssTrack,
    log: Option<LogWatch>,
}

/// Every process's VmRSS and log, plus this process's memory.
struct Monitor {
    procs: Vec<Watched>,
    me: RssTrack,
    t0: Instant,
}

impl Monitor {
    fn new(t0: Instant) -> Self {
        Monitor {
            procs: Vec::new(),
            me: RssTrack::default(),
            t0,
        }
    }

    /// Takes the latest process table (pids change on restarts).
    fn update(&mut self, table: &[ProcInfo]) {
        for p in table {
            match self.procs.iter_mut().find(|w| w.info.name == p.name) {
                Some(w) => w.info = p.clone(),
                None => self.procs.push(Watched {
                    info: p.clone(),
                    rss: RssTrack::default(),
                    log: p.log.clone().map(LogWatch::new),
                }),
            }
        }
    }

    fn sample(&mut self) {
        let at = self.t0.elapsed().as_secs_f64();
        for w in &mut self.procs {
            // A read can fail for a process exiting between the table and the read; one
            // that never yields a sample is a finding of the report (`memory_unread`).
            match w
                .info
                .pid
                .map(|pid| rss_kib_of(&format!("/proc/{pid}/status")))
            {
                Some(Ok(kib)) => w.rss.observe(at, kib),
                Some(Err(e)) => w.rss.unread(e.to_string()),
                None => {}
            }
        }
        match crate::procs::self_rss_kib() {
            Ok(kib) => self.me.observe(at, kib),
            Err(e) => self.me.unread(e.to_string()),
        }
    }

    fn poll_logs(&mut self) {
        for w in &mut self.procs {
            if let Some(l) = w.log.as_mut() {
                l.poll();
            }
        }
    }

    fn reached_limit(&self) -> u64 {
        self.procs
            .iter()
            .filter_map(|w| w.log.as_ref())
            .map(|l| l.findings.reached_limit)
            .sum()
    }

    fn finish(mut self) -> Vec<ProcessReport> {
        let mut out = Vec::new();
        for w in &mut self.procs {
            if let Some(l) = w.log.as_mut() {
                l.finish();
            }
        }
        for w in self.procs {
            out.push(ProcessReport {
                name: w.info.name,
                pid: w.info.pid,
                restarts: w.info.restarts,
                exited: w.info.exited,
                rss: w.rss,
                log: w.log.map(|l| LogReport {
                    path: l.path().display().to_string(),
                    findings: l.findings,
                }),
            });
        }
        out.push(ProcessReport {
            name: "relay-fleet (this process)".into(),
            pid: Some(std::process::id()),
            restarts: 0,
            exited: None,
            rss: self.me,
            log: None,
        });
        out
    }
}

/// The progress line's memory of the last one, for the rate "now".
struct Progress {
    last_at: Instant,
    last_answered: u64,
}

impl Progress {
    fn line(&mut self, ledger: &Ledger, t0: Instant, limit_lines: u64, status: &str) -> String {
        let now = Instant::now();
        let answered = ledger.answered();
        let sent = ledger.sent();
        let elapsed = now.duration_since(t0).as_secs_f64();
        let window = now.duration_since(self.last_at).as_secs_f64();
        let rate_now = if window > 0.0 {
            (answered - self.last_answered) as f64 / window
        } else {
            0.0
        };
        self.last_at = now;
        self.last_answered = answered;
        let mut s = format!(
            "[{elapsed:>7.1}s] answered {answered}  {:.0}/s (now {rate_now:.0}/s)  ok {}  failed {}  in flight {}  `reached limit` lines {limit_lines}",
            if elapsed > 0.0 { answered as f64 / elapsed } else { 0.0 },
            ledger.ok(),
            ledger.failed(),
            sent.saturating_sub(answered),
        );
        if !status.is_empty() {
            s.push_str("  | ");
            s.push_str(status);
        }
        s
    }
}

/// The burst fault: adds callers of a slow path on the fault's timing.
struct Bursts {
    /// The burst calls (their ledger is the run's).
    calls: Arc<Calls>,
    /// Callers during a burst, the burst's length, the extra callers' upstream delay.
    concurrency: usize,
    length: Duration,
    slow: Duration,
    timing: FaultTiming,
    /// The run's own callers.
    base: usize,
    t0: Instant,
    events: Arc<Events>,
    status: watch::Sender<String>,
}

impl Bursts {
    /// Bursts until `stop`; each burst's callers finish their call in flight first.
    async fn run(self, stop: CancellationToken) {
        let Bursts {
            calls,
            concurrency,
            length,
            slow,
            timing,
            base,
            t0,
            events,
            status,
        } = self;
        let extra = concurrency.saturating_sub(base);
        let slow_ms = u64::try_from(slow.as_millis()).unwrap_or(u64::MAX);
        let mut next = t0 + timing.at;
        for round in 1u64.. {
            tokio::select! {
                biased;
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep_until(next) => {}
            }
            let started = Instant::now();
            let before = calls.ledger.failed();
            events.note(format!(
            "burst {round}: +{extra} callers (to {concurrency}) of GET /slow/{slow_ms} for {length:?}"
        ));
            status.send_replace(format!("burst {round}: {concurrency} callers"));
            let these = stop.child_token();
            let mut callers = JoinSet::new();
            crate::load::workers(
                &calls,
                &Link::KeepAlive(calls.target.addr),
                base..base + extra,
                &calls.target.servers,
                &these,
                &mut callers,
            );
            tokio::select! {
                biased;
                _ = stop.cancelled() => {}
                _ = tokio::time::sleep(length) => {}
            }
            these.cancel();
            status.send_replace(format!("burst {round}: winding down"));
            // Each caller ends after its call in flight (bounded by the client deadline).
            while callers.join_next().await.is_some() {}
            status.send_replace(String::new());
            events.note(format!(
                "burst {round}: over after {:.1}s; failures during it: {}",
                started.elapsed().as_secs_f64(),
                calls.ledger.failed() - before
            ));
            match timing.every {
                Some(every) if !stop.is_cancelled() => next = (started + every).max(Instant::now()),
                _ => return,
            }
        }
    }
}

/// Runs the load (and the fault) on a started stack and builds the report. The stack's
/// processes are killed before this returns.
async fn drive(config: &SoakConfig, started: Started, stop: CancellationToken) -> SoakReport {
    let Started {
        upstream,
        mut rig,
        target,
    } = started;
    let echo = config.progress_every.is_some();
    let scratch_dir = rig.as_ref().map(|r| r.dir().display().to_string());
    let mut monitor = Monitor::new(Instant::now());
    if let Some(r) = rig.as_mut() {
        monitor.update(&r.table());
    }
    // The start-of-load sample.
    monitor.sample();
    let t0 = Instant::now();
    monitor.t0 = t0;

    let budget = config.calls;
    let ledger = Arc::new(Ledger::new(false));
    let target = Arc::new(target);
    let base = Arc::new(Calls::new(
        target.clone(),
        ledger.clone(),
        CallKind::Base,
        budget,
    ));
    let events = Arc::new(Events::new(t0, echo));
    let issuing = CancellationToken::new();
    let mut callers = JoinSet::new();
    crate::load::workers(
        &base,
        &Link::KeepAlive(target.addr),
        0..config.concurrency,
        &target.servers,
        &issuing,
        &mut callers,
    );
    let (status_tx, status_rx) = watch::channel(String::new());
    let (table_tx, mut table_rx) = watch::channel(Vec::new());
    let rig_stop = CancellationToken::new();
    let rig_task = rig.take().map(|r| {
        tokio::spawn(rig::drive(
            r,
            config.fault.clone(),
            config.timing,
            t0,
            rig_stop.clone(),
            rig::Ctx {
                events: events.clone(),
                table: table_tx,
                status: status_tx.clone(),
            },
        ))
    });
    let mut burst_task = match config.fault {
        Fault::Burst {
            concurrency,
            length,
            slow,
        } => {
            let bursts = Bursts {
                calls: Arc::new(Calls::new(
                    target.clone(),
                    ledger.clone(),
                    CallKind::Slow(u64::try_from(slow.as_millis()).unwrap_or(u64::MAX)),
                    None,
                )),
                concurrency,
                length,
                slow,
                timing: config.timing,
                base: config.concurrency,
                t0,
                events: events.clone(),
                status: status_tx.clone(),
            };
            Some(tokio::spawn(bursts.run(issuing.clone())))
        }
        _ => None,
    };

    let mut progress_tick =
        tokio::time::interval(config.progress_every.unwrap_or(Duration::from_secs(5)));
    progress_tick.set_missed_tick_behavior(MissedTickBehavior::Skip);
    progress_tick.reset();
    let mut rss_tick = tokio::time::interval(config.rss_every);
    rss_tick.set_missed_tick_behavior(MissedTickBehavior::Skip);
    let mut progress = Progress {
        last_at: t0,
        last_answered: 0,
    };
    let end = tokio::time::sleep_until(t0 + config.duration.unwrap_or(Duration::ZERO));
    tokio::pin!(end);
    let mut interrupted = false;
    let mut table_open = true;
    let tick = |monitor: &mut Monitor, progress: &mut Progress, print: bool| {
        monitor.poll_logs();
        if echo && print {
            eprintln!(
                "{}",
                progress.line(&ledger, t0, monitor.reached_limit(), &status_rx.borrow())
            );
        }
    };

    // Running: until the budget is spent, the duration is over or `stop`.
    loop {
        tokio::select! {
            // biased: stopping wins over bookkeeping.
            biased;
            _ = stop.cancelled() => {
                interrupted = true;
                if echo {
                    eprintln!("soak: stopping: no new calls; waiting for the calls in flight");
                }
                break;
            }
            _ = &mut end, if config.duration.is_some() => break,
            done = callers.join_next() => {
                if done.is_none() {
                    break;
                }
            }
            changed = table_rx.changed(), if table_open => match changed {
                Ok(()) => monitor.update(&table_rx.borrow_and_update()),
                // No rig (external mode) or it is done: nothing more to hear.
                Err(_) => table_open = false,
            },
            _ = rss_tick.tick() => monitor.sample(),
            _ = progress_tick.tick() => tick(&mut monitor, &mut progress, true),
        }
    }

    // Draining: no new calls; the calls in flight get their deadline plus grace.
    issuing.cancel();
    rig_stop.cancel();
    let drain_deadline = Instant::now() + config.client_timeout + config.grace;
    let drain_end = tokio::time::sleep_until(drain_deadline);
    tokio::pin!(drain_end);
    let mut drained = false;
    loop {
        if callers.is_empty() && burst_task.is_none() {
            drained = true;
            break;
        }
        tokio::select! {
            biased;
            _ = &mut drain_end => break,
            _ = callers.join_next(), if !callers.is_empty() => {}
            _ = async { burst_task.as_mut().expect("guarded").await }, if burst_task.is_some() => {
                burst_task = None;
            }
            _ = rss_tick.tick() => monitor.sample(),
            _ = progress_tick.tick() => tick(&mut monitor, &mut progress, true),
        }
    }
    let load_end = Instant::now();
    if !drained {
        events.problem(format!(
            "{} calls still unanswered {:?} after the last call started; abandoned",
            ledger.sent() - ledger.answered(),
            config.client_timeout + config.grace
        ));
        callers.abort_all();
        if let Some(b) = burst_task.take() {
            b.abort();
        }
    }

    // The end-of-load sample, with every process still up.
    let mut rig = match rig_task {
        Some(t) => t.await.ok(),
        None => None,
    };
    if let Some(r) = rig.as_mut() {
        monitor.update(&r.table());
    }
    monitor.sample();
    tick(&mut monitor, &mut progress, false);
    let (dispatcher_calls_by_server, dispatcher_retries) = match rig.as_ref() {
        Some(r) => match crate::procs::scrape(r.front.admin).await {
            Ok(text) => (
                report::calls_by_server(&text),
                Some(crate::procs::metric(&text, "relay_dispatcher_retries_total", &[]) as u64),
            ),
            Err(_) => Default::default(),
        },
        None => Default::default(),
    };
    // The rest of every log, then every process is killed.
    let processes = monitor.finish();
    drop(rig);
    if let Some(u) = upstream {
        u.shutdown().await;
    }

    let sent = ledger.sent();
    let answered = ledger.answered();
    let duration_s = load_end.duration_since(t0).as_secs_f64();
    let lat = ledger.latency();
    let ms = |us: u64| us as f64 / 1000.0;
    let mut failures: Vec<FailureReport> = ledger
        .reasons()
        .into_iter()
        .map(|(reason, st)| FailureReport {
            reason: reason.to_string(),
            count: st.count,
            first_at_s: st.first_at.as_secs_f64(),
            last_at_s: st.last_at.as_secs_f64(),
            examples: st.examples,
        })
        .collect();
    failures.sort_by(|a, b| b.count.cmp(&a.count).then_with(|| a.reason.cmp(&b.reason)));
    SoakReport {
        setup: config.describe(),
        interrupted,
        sent,
        answered,
        ok: ledger.ok(),
        failed: ledger.failed(),
        lost: sent.saturating_sub(answered),
        burst_sent: ledger.burst_sent(),
        burst_answered: ledger.burst_answered(),
        duration_s,
        calls_per_s: if duration_s > 0.0 {
            answered as f64 / duration_s
        } else {
            0.0
        },
        latency_ms: LatencyReport {
            p50: ms(lat.quantile_us(0.5)),
            p90: ms(lat.quantile_us(0.9)),
            p99: ms(lat.quantile_us(0.99)),
            p999: ms(lat.quantile_us(0.999)),
            max: ms(lat.max_us),
            mean: lat.mean_us() / 1000.0,
        },
        failures,
        failures_by_server: ledger.failures_by_server(),
        dispatcher_calls_by_server,
        dispatcher_retries,
        connections: ledger.connects(),
        events: events.list(),
        processes,
        scratch_dir,
    }
}
