//! Agents in worker processes: a run with `[agents] workers = N` (or `relay-fleet run
//! --workers N`) starts N children of its own binary (`relay-fleet worker`, hidden), each
//! running a slice of the agents (the real agent library, on one runtime of its own)
//! against the relay the parent runs. That spreads the agents' memory and file
//! descriptors over processes and gives each slice its own CPU and RSS figures.
//!
//! The protocol is JSON lines. The parent writes the [`WorkerSpec`] as the first line of
//! the child's stdin, then [`Command`]s; the child writes a [`WorkerSample`] to stdout
//! every [`SAMPLE_EVERY`]. A child exits when its stdin closes (the parent ended, however
//! it ended: no orphan outlives the run) or on [`Command::Stop`]. Agent `i` of the run is
//! agent `i` everywhere: token and tunnel id from [`crate::stack::agent_identity`].
//!
//! Also the pieces both modes share: reading a set of agents' coverage views
//! ([`read_agents`]: streams per server, agents landed, agents covering every running
//! server) and their coverage-action counters ([`ActionTotals`]), and raising the open-file
//! limit ([`raise_fd_limit`]).

use super::report::ServerStreams;
use crate::stack::agent_identity;
use relay_agent::coverage::plan::CoverageConfig;
use relay_agent::coverage::ServerReport;
use relay_agent::AgentHandle;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::time::{Instant, MissedTickBehavior};

/// How often a worker reports.
pub const SAMPLE_EVERY: Duration = Duration::from_millis(500);

/// What a worker runs: agents `first..first + count` of the run.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct WorkerSpec {
    /// Which worker (0-based), for its log lines.
    pub index: usize,
    pub first: usize,
    pub count: usize,
    /// The agents' `tunnels` (the load balancer, or every server).
    pub tunnels: Vec<String>,
    /// The simulated upstream's URL.
    pub upstream: String,
    pub coverage: CoverageConfig,
    /// Agents started per second (paced, so that the first opens do not storm the servers);
    /// 0 starts them all at once.
    pub start_rate: f64,
    /// Server ids an agent must cover to count as covered (the running servers).
    pub servers: Vec<String>,
    /// Worker threads of the worker's runtime.
    pub threads: usize,
    /// The agents' `[tunnel_h2] keepalive_timeout` (`servers.tunnel_keepalive_timeout`).
    #[serde(with = "humantime_serde")]
    pub keepalive_timeout: Duration,
}

/// What the parent tells a running worker (one JSON line each).
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Command {
    /// Stop agent `agent` (gracefully, bounded) and start it again with the same config.
    RestartAgent { agent: usize },
    /// The running servers changed: an agent is covered when it covers each of these.
    /// `generation` comes back in every later sample.
    Servers { ids: Vec<String>, generation: u64 },
    /// Stop the agents and exit.
    Stop,
}

/// One report of a worker (or of the in-process agents).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct WorkerSample {
    /// Agents started so far.
    pub started: usize,
    /// Agents holding at least one stream.
    pub landed: usize,
    /// Agents whose view has every expected server in state `covered`.
    pub covered: usize,
    /// The generation of the server list `covered` was counted against.
    pub generation: u64,
    /// In a sum of samples ([`Workers::total`]): agents of workers whose latest sample was
    /// counted against an older server list (their `covered` and `short` are left out).
    #[serde(default)]
    pub stale: usize,
    /// Streams per server id by state, summed over the agents.
    pub servers: BTreeMap<String, ServerStreams>,
    /// Coverage actions so far by action (agent restarts included).
    pub actions: BTreeMap<String, u64>,
    /// CPU seconds of the worker process so far.
    pub cpu_s: f64,
    /// VmRSS and VmHWM of the worker process, KiB.
    pub rss_kib: u64,
    pub hwm_kib: u64,
    /// What the worker did since its last sample (agent restarts), for the timeline.
    pub events: Vec<String>,
}

/// The coverage states in which an agent covers a server: `covered` (streams >= busy +
/// reserve), and `growing`, which holds streams there that carry calls and is sizing up
/// for them (a call in the last second makes a server at its reserve `growing` until the
/// growth stream lands; under steady load some agents always are). `filling` (short with
/// no calls, or holding none of the agent's streams), `overdue` and `evacuated` do not.
pub const COVERS: [&str; 2] = ["covered", "growing"];

/// Streams per server, agents landed and agents covering every one of `expected` (all
/// listed servers in a state of [`COVERS`] when `expected` is empty), over `agents`.
pub fn read_agents<'a>(
    agents: impl Iterator<Item = &'a AgentHandle>,
    expected: &[String],
) -> (BTreeMap<String, ServerStreams>, usize, usize) {
    let mut servers: BTreeMap<String, ServerStreams> = BTreeMap::new();
    let (mut landed, mut covered) = (0, 0);
    for h in agents {
        let rx = h.coverage();
        let v = rx.borrow();
        if v.streams_total > 0 {
            landed += 1;
        }
        for sv in &v.servers {
            let e = servers.entry(sv.server_id.clone()).or_default();
            e.idle += u64::from(sv.idle);
            e.busy += u64::from(sv.streams.saturating_sub(sv.idle));
        }
        let covers = |s: &ServerReport| COVERS.contains(&s.state.as_str());
        let is_covered = |id: &str| v.servers.iter().any(|s| s.server_id == id && covers(s));
        let all = if expected.is_empty() {
            !v.servers.is_empty() && v.servers.iter().all(covers)
        } else {
            let mut all = true;
            for id in expected.iter().filter(|id| !is_covered(id)) {
                servers.entry(id.clone()).or_default().short += 1;
                all = false;
            }
            all
        };
        if all {
            covered += 1;
        }
    }
    (servers, landed, covered)
}

/// Per-agent coverage-action counters, accumulated across agent restarts.
#[derive(Default)]
pub struct ActionTotals {
    last: Vec<BTreeMap<String, u64>>,
    pub total: BTreeMap<String, u64>,
}

impl ActionTotals {
    /// Agent `i`'s counters now (a restarted agent counts from 0 again).
    pub fn update(&mut self, i: usize, now: BTreeMap<String, u64>) {
        if self.last.len() <= i {
            self.last.resize(i + 1, BTreeMap::new());
        }
        for (k, v) in &now {
            let before = self.last[i].get(k).copied().unwrap_or(0);
            let delta = if *v >= before { v - before } else { *v };
            *self.total.entry(k.clone()).or_default() += delta;
        }
        self.last[i] = now;
    }
}

/// An agent's `grpc_tunnel_coverage_actions_total` by action.
pub fn agent_actions(h: &AgentHandle) -> BTreeMap<String, u64> {
    h.coverage_actions()
        .into_iter()
        .map(|(action, n)| (action.to_string(), n))
        .collect()
}

/// The config of agent `i` of a fleet (what the embedded stack gives its agents: every
/// method and path allowed, plain text, the upstream check every 30 s).
pub fn agent_config(
    i: usize,
    tunnels: &[String],
    upstream: &str,
    coverage: &CoverageConfig,
) -> relay_agent::Config {
    let (token, _) = agent_identity(i);
    let mut cfg = relay_agent::Config {
        tunnels: tunnels.to_vec(),
        token: relay_common::Secret::new(&token),
        upstream: upstream.to_string(),
        coverage: coverage.clone(),
        allow: vec![relay_agent::config::AllowRule {
            name: Some("harness-all".into()),
            methods: vec!["*".into()],
            path: "/**".into(),
            ..Default::default()
        }],
        ..relay_agent::Config::default().insecure()
    };
    cfg.upstream_check.interval = Duration::from_secs(30);
    cfg
}

/// Raises this process's open-file limit (inherited by its children) to what the kernel
/// allows: the soft limit to the hard one, and as root the hard one to `fs.nr_open`. A
/// fleet of thousands of agents holds a socket per agent connection and admin listener on
/// each side. Returns the soft limit in force.
pub fn raise_fd_limit() -> u64 {
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    let now = getrlimit(Resource::Nofile);
    let nr_open = std::fs::read_to_string("/proc/sys/fs/nr_open")
        .ok()
        .and_then(|t| t.trim().parse::<u64>().ok());
    let hard = now.maximum;
    // First try the kernel's ceiling (needs CAP_SYS_RESOURCE), else the hard limit.
    for want in [nr_open, hard].into_iter().flatten() {
        let target = Rlimit {
            current: Some(want),
            maximum: Some(want.max(hard.unwrap_or(0))),
        };
        if setrlimit(Resource::Nofile, target).is_ok() {
            break;
        }
    }
    getrlimit(Resource::Nofile).current.unwrap_or(u64::MAX)
}

/// The hidden `relay-fleet worker` subcommand: reads its spec from stdin, runs its agents
/// until stdin closes or it is told to stop, reporting on stdout.
pub fn worker_main() -> anyhow::Result<()> {
    let mut line = String::new();
    std::io::stdin().read_line(&mut line)?;
    let spec: WorkerSpec = serde_json::from_str(line.trim())
        .map_err(|e| anyhow::anyhow!("relay-fleet worker: bad spec on stdin: {e}"))?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(spec.threads.max(1))
        .thread_name(format!("fleet-worker-{}", spec.index))
        .enable_all()
        .build()?;
    rt.block_on(run_worker(spec))
}

/// A worker's agents, by index into its slice.
struct Slice {
    first: usize,
    agents: Vec<Option<AgentHandle>>,
    configs: Vec<relay_agent::Config>,
}

impl Slice {
    async fn start(&mut self, k: usize) -> anyhow::Result<()> {
        let admin = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let h = relay_agent::start(self.configs[k].clone(), admin)
            .map_err(|e| anyhow::anyhow!("agent {}: {e}", self.first + k))?;
        if let Some(slot) = self.agents.get_mut(k) {
            *slot = Some(h);
        } else {
            self.agents.push(Some(h));
        }
        Ok(())
    }
}

async fn run_worker(spec: WorkerSpec) -> anyhow::Result<()> {
    let mut slice = Slice {
        first: spec.first,
        agents: Vec::with_capacity(spec.count),
        configs: (spec.first..spec.first + spec.count)
            .map(|i| {
                let mut c = agent_config(i, &spec.tunnels, &spec.upstream, &spec.coverage);
                c.tunnel_h2.keepalive_timeout = Some(spec.keepalive_timeout);
                c
            })
            .collect(),
    };
    let mut expected = spec.servers.clone();
    let mut generation = 0u64;
    let mut actions = ActionTotals::default();
    let mut events = Vec::new();
    // Stdin is read by a thread of its own (lines to a channel; its end is the parent's).
    let (tx, mut commands) = tokio::sync::mpsc::unbounded_channel::<String>();
    std::thread::spawn(move || {
        for line in std::io::stdin().lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let mut out = std::io::stdout();
    let mut tick = tokio::time::interval(SAMPLE_EVERY);
    tick.set_missed_tick_behavior(MissedTickBehavior::Skip);
    // Starts are paced in small batches every 10 ms.
    let mut pace = tokio::time::interval(Duration::from_millis(10));
    pace.set_missed_tick_behavior(MissedTickBehavior::Skip);
    let began = Instant::now();
    let mut samples = 0u64;
    loop {
        let starting = slice.agents.len() < spec.count;
        tokio::select! {
            biased;
            line = commands.recv() => {
                let Some(line) = line else { break };
                match serde_json::from_str::<Command>(&line) {
                    Ok(Command::Stop) => break,
                    Ok(Command::Servers { ids, generation: g }) => {
                        expected = ids;
                        generation = g;
                    }
                    Ok(Command::RestartAgent { agent }) => {
                        events.push(restart(&mut slice, agent).await);
                    }
                    Err(e) => events.push(format!("worker {}: bad command: {e}", spec.index)),
                }
            }
            _ = tick.tick() => {
                samples += 1;
                let (servers, landed, covered) =
                    read_agents(slice.agents.iter().flatten(), &expected);
                // Read from the counters (no registry gather): once a second.
                if samples % 2 == 1 {
                    for (k, h) in slice.agents.iter().enumerate() {
                        if let Some(h) = h {
                            actions.update(k, agent_actions(h));
                        }
                    }
                }
                let (hwm_kib, rss_kib) = super::runner::procstat::memory_kib();
                let sample = WorkerSample {
                    started: slice.agents.len(),
                    landed,
                    covered,
                    generation,
                    stale: 0,
                    servers,
                    actions: actions.total.clone(),
                    cpu_s: super::runner::procstat::process_cpu(),
                    rss_kib,
                    hwm_kib,
                    events: std::mem::take(&mut events),
                };
                let mut text = serde_json::to_string(&sample)?;
                text.push('\n');
                // Small lines the parent reads at once: a plain write.
                use std::io::Write as _;
                if out.write_all(text.as_bytes()).is_err() || out.flush().is_err() {
                    break;
                }
            }
            _ = pace.tick(), if starting => {
                let due = if spec.start_rate > 0.0 {
                    ((began.elapsed().as_secs_f64() * spec.start_rate).ceil() as usize).min(spec.count)
                } else {
                    spec.count
                };
                while slice.agents.len() < due {
                    let k = slice.agents.len();
                    if let Err(e) = slice.start(k).await {
                        tracing::error!(worker = spec.index, error = %e, "agent did not start");
                        slice.agents.push(None);
                    }
                }
            }
        }
    }
    // Stopping: the agents' streams end with the process (the parent is done with them).
    let hs: Vec<AgentHandle> = slice.agents.drain(..).flatten().collect();
    let _ = tokio::time::timeout(
        Duration::from_secs(5),
        futures::future::join_all(hs.into_iter().map(|h| h.shutdown())),
    )
    .await;
    Ok(())
}

/// Restarts agent `agent` (an index of the run) if it is in this slice.
async fn restart(slice: &mut Slice, agent: usize) -> String {
    let Some(k) = agent
        .checked_sub(slice.first)
        .filter(|k| *k < slice.configs.len())
    else {
        return format!("restart agent {agent}: not in this worker");
    };
    if k >= slice.agents.len() {
        return format!("restart agent {agent}: not started yet");
    }
    if let Some(h) = slice.agents.get_mut(k).and_then(Option::take) {
        let _ = tokio::time::timeout(Duration::from_secs(15), h.shutdown()).await;
    }
    match slice.start(k).await {
        Ok(()) => format!("restart agent {agent}"),
        Err(e) => format!("restart agent {agent} failed: {e}"),
    }
}

/// The parent's side: the worker children, their latest samples and what became of them.
pub struct Workers {
    slots: Vec<Arc<WorkerSlot>>,
    /// Set once the parent stops them: an exit after that is not a finding.
    stopping: Arc<std::sync::atomic::AtomicBool>,
    generation: std::sync::atomic::AtomicU64,
}

/// One worker child.
pub struct WorkerSlot {
    pub index: usize,
    pub first: usize,
    pub count: usize,
    pub pid: Option<u32>,
    stdin: tokio::sync::Mutex<Option<tokio::process::ChildStdin>>,
    child: tokio::sync::Mutex<Option<tokio::process::Child>>,
    /// The latest sample and when it came.
    pub latest: parking_lot::Mutex<Option<(Instant, WorkerSample)>>,
    /// The first sample after the load started (its CPU figure is the baseline).
    pub base: parking_lot::Mutex<Option<WorkerSample>>,
    /// How it ended, when it ended before the parent stopped it.
    pub died: parking_lot::Mutex<Option<String>>,
}

use std::sync::atomic::Ordering;
use std::sync::Arc;

impl Workers {
    /// Starts `n` children of `exe` (`relay-fleet worker`), splitting agents `0..agents`
    /// into `n` slices; `spec` is the template (its `index`, `first`, `count` are set
    /// here).
    pub async fn start(
        exe: &std::path::Path,
        n: usize,
        agents: usize,
        spec: WorkerSpec,
    ) -> anyhow::Result<Workers> {
        let n = n.clamp(1, agents.max(1));
        let stopping = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let mut slots = Vec::new();
        let mut first = 0;
        for index in 0..n {
            let count = agents / n + usize::from(index < agents % n);
            let mut child = tokio::process::Command::new(exe)
                .arg("worker")
                .stdin(std::process::Stdio::piped())
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::inherit())
                .kill_on_drop(true)
                .spawn()
                .map_err(|e| {
                    anyhow::anyhow!("cannot start worker {index} ({}): {e}", exe.display())
                })?;
            let mut stdin = child.stdin.take().expect("piped");
            let stdout = child.stdout.take().expect("piped");
            let mine = WorkerSpec {
                index,
                first,
                count,
                ..spec.clone()
            };
            let mut line = serde_json::to_string(&mine)?;
            line.push('\n');
            stdin.write_all(line.as_bytes()).await?;
            stdin.flush().await?;
            let slot = Arc::new(WorkerSlot {
                index,
                first,
                count,
                pid: child.id(),
                stdin: tokio::sync::Mutex::new(Some(stdin)),
                child: tokio::sync::Mutex::new(Some(child)),
                latest: parking_lot::Mutex::new(None),
                base: parking_lot::Mutex::new(None),
                died: parking_lot::Mutex::new(None),
            });
            tokio::spawn(read_samples(slot.clone(), stdout, stopping.clone()));
            slots.push(slot);
            first += count;
        }
        Ok(Workers {
            slots,
            stopping,
            generation: std::sync::atomic::AtomicU64::new(0),
        })
    }

    pub fn slots(&self) -> &[Arc<WorkerSlot>] {
        &self.slots
    }

    /// The latest samples' sum: streams per server, actions, started, landed, and
    /// covered counted against the current server list only (a sample counted against an
    /// older list counts no agent covered).
    pub fn total(&self) -> WorkerSample {
        let generation = self.generation.load(Ordering::Relaxed);
        let mut t = WorkerSample {
            generation,
            ..WorkerSample::default()
        };
        for s in &self.slots {
            let g = s.latest.lock();
            let Some((_, w)) = g.as_ref() else { continue };
            t.started += w.started;
            t.landed += w.landed;
            let current = w.generation == generation;
            if current {
                t.covered += w.covered;
            } else {
                t.stale += w.started;
            }
            for (id, v) in &w.servers {
                let e = t.servers.entry(id.clone()).or_default();
                e.idle += v.idle;
                e.busy += v.busy;
                if current {
                    e.short += v.short;
                }
            }
            for (k, v) in &w.actions {
                *t.actions.entry(k.clone()).or_default() += v;
            }
            t.cpu_s += w.cpu_s;
            t.rss_kib += w.rss_kib;
            t.hwm_kib += w.hwm_kib;
        }
        t
    }

    /// Events the workers reported since the last call.
    pub fn take_events(&self) -> Vec<String> {
        let mut out = Vec::new();
        for s in &self.slots {
            if let Some((_, w)) = s.latest.lock().as_mut() {
                out.append(&mut w.events);
            }
        }
        out
    }

    /// Marks the current samples as the baseline of the run's CPU figures.
    pub fn mark_base(&self) {
        for s in &self.slots {
            *s.base.lock() = s.latest.lock().as_ref().map(|(_, w)| w.clone());
        }
    }

    async fn send(&self, slot: &WorkerSlot, c: &Command) -> bool {
        let Ok(mut line) = serde_json::to_string(c) else {
            return false;
        };
        line.push('\n');
        let mut g = slot.stdin.lock().await;
        match g.as_mut() {
            Some(w) => w.write_all(line.as_bytes()).await.is_ok() && w.flush().await.is_ok(),
            None => false,
        }
    }

    /// Tells every worker the running servers (what an agent covers to count as covered).
    pub async fn set_servers(&self, ids: Vec<String>) {
        let generation = self.generation.fetch_add(1, Ordering::Relaxed) + 1;
        let c = Command::Servers { ids, generation };
        for s in &self.slots {
            self.send(s, &c).await;
        }
    }

    /// Sends agent `agent`'s restart to the worker running it; which worker, or why not.
    pub async fn restart_agent(&self, agent: usize) -> String {
        match self
            .slots
            .iter()
            .find(|s| (s.first..s.first + s.count).contains(&agent))
        {
            Some(s) if self.send(s, &Command::RestartAgent { agent }).await => {
                format!("restart agent {agent} (worker {})", s.index)
            }
            Some(s) => format!("restart agent {agent}: worker {} is gone", s.index),
            None => format!("restart agent {agent}: no such agent"),
        }
    }

    /// Workers that ended before the parent stopped them, with how.
    pub fn deaths(&self) -> Vec<String> {
        self.slots
            .iter()
            .filter_map(|s| {
                s.died.lock().as_ref().map(|d| {
                    format!(
                        "worker {} (agents {}..{}) {d}",
                        s.index,
                        s.first,
                        s.first + s.count
                    )
                })
            })
            .collect()
    }

    /// Stops every worker: `Stop`, then its stdin closed; one that has not exited within
    /// `within` is killed. Returns the pids of workers still running after that (none).
    pub async fn stop(&self, within: Duration) -> Vec<u32> {
        self.stopping.store(true, Ordering::SeqCst);
        for s in &self.slots {
            self.send(s, &Command::Stop).await;
            s.stdin.lock().await.take();
        }
        let mut left = Vec::new();
        for s in &self.slots {
            let Some(mut child) = s.child.lock().await.take() else {
                continue;
            };
            if tokio::time::timeout(within, child.wait()).await.is_err() {
                let _ = child.kill().await;
            }
            if let (Ok(None), Some(pid)) = (child.try_wait(), s.pid) {
                left.push(pid);
            }
        }
        left
    }
}

/// Reads a worker's samples until its stdout ends; an end before the parent stopped it
/// is recorded as its death.
async fn read_samples(
    slot: Arc<WorkerSlot>,
    stdout: tokio::process::ChildStdout,
    stopping: Arc<std::sync::atomic::AtomicBool>,
) {
    let mut lines = BufReader::new(stdout).lines();
    let began = Instant::now();
    let mut bad = 0u64;
    // A read error ends the samples as the end of the pipe does; the exit status below
    // says why.
    while let Ok(Some(line)) = lines.next_line().await {
        match serde_json::from_str::<WorkerSample>(&line) {
            Ok(mut w) => {
                let now = Instant::now();
                let mut g = slot.latest.lock();
                // Keep events not yet taken.
                if let Some((_, prev)) = g.as_mut() {
                    let mut ev = std::mem::take(&mut prev.events);
                    ev.append(&mut w.events);
                    w.events = ev;
                }
                *g = Some((now, w));
            }
            Err(_) => bad += 1,
        }
    }
    if stopping.load(Ordering::SeqCst) {
        return;
    }
    let status = match slot.child.lock().await.as_mut() {
        Some(c) => match tokio::time::timeout(Duration::from_secs(5), c.wait()).await {
            Ok(Ok(st)) => st.to_string(),
            Ok(Err(e)) => format!("wait failed: {e}"),
            Err(_) => "closed its stdout and is still running".into(),
        },
        None => "gone".into(),
    };
    if stopping.load(Ordering::SeqCst) {
        return;
    }
    *slot.died.lock() = Some(format!(
        "ended {:.1} s after it started: {status}{}",
        began.elapsed().as_secs_f64(),
        if bad > 0 {
            format!(" ({bad} unreadable lines)")
        } else {
            String::new()
        }
    ));
}
