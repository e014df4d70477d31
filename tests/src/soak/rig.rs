//! The processes of an embedded soak (the release binaries as children: a dispatcher,
//! tunnel servers, an agent, optionally HAProxy between the agent and the servers; or in
//! the co-located mode no dispatcher process, ts-1 serving the front itself; started with
//! [`crate::procfleet::FleetSpec`]) and the faults injected into them while the load runs:
//! rolling restarts (SIGTERM, wait for the exit, start again on the same ports, wait until
//! the fleet is whole) and a SIGKILL of one server, optionally restarted.
//!
//! [`drive`] owns the [`Rig`] for the run and publishes a table of the processes (pid,
//! log file) on a `watch` channel for the sampler; it records every fault step and every
//! exit nobody asked for as an [`Event`]. Dropping the rig kills every process. This
//! module must not decide whether a run passed; it reports what it did and what it saw.

use super::{Fault, FaultTiming};
use crate::client::Caller;
use crate::haproxy::{Checks, Haproxy};
use crate::poll;
use crate::procfleet::{FleetProcs, FleetSpec, FrontAddrs, HaproxySpec};
use crate::procs::{
    metric, scrape, AgentOpts, AgentProc, DispatcherOpts, DispatcherProc, ScratchDir, Spawn,
    TunnelServerOpts, TunnelServerProc,
};
use crate::stack::TOKEN;
use parking_lot::Mutex;
use serde::Serialize;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use tokio::time::{Instant, MissedTickBehavior};
use tokio_util::sync::CancellationToken;

/// How long a fresh stack may take to route its first call.
const READY_WITHIN: Duration = Duration::from_secs(30);

/// How long a restarted server may take to answer `/readyz`, report to the dispatcher
/// and (behind HAProxy) pass its health check.
const WHOLE_WITHIN: Duration = Duration::from_secs(30);
/// How long a restarted server may take to receive streams of the tunnel id again.
const STREAMS_WITHIN: Duration = Duration::from_secs(20);
/// Beyond the server's own `shutdown_grace`, how long a SIGTERMed server may take to exit.
const EXIT_SLACK: Duration = Duration::from_secs(10);
/// How often the processes are checked for exits nobody asked for.
const CHECK_EVERY: Duration = Duration::from_secs(1);
/// How often a wait on the fleet checks it.
const EVERY: Duration = Duration::from_millis(100);

/// What the embedded stack looks like.
#[derive(Clone, Debug)]
pub(crate) struct RigSpec {
    pub servers: usize,
    /// HAProxy between the agent and the servers, with these weights.
    pub haproxy_weights: Option<Vec<u32>>,
    pub upstream_url: String,
    /// The dispatcher's `call_timeout`.
    pub call_timeout: Duration,
    /// How the children are spawned (`RELAY_LOG`, own process group).
    pub spawn: Spawn,
    pub tunnel_id: String,
    /// The co-located mode: ts-1 serves the dispatcher front (its `front_config`); there
    /// is no dispatcher process.
    pub colocated: bool,
}

/// Something that happened to the fleet during the run.
#[derive(Clone, Debug, Serialize)]
pub struct Event {
    /// Seconds since the load started.
    pub at_s: f64,
    pub what: String,
    /// An exit nobody asked for, a restart that failed, a fleet that did not become
    /// whole: fails the run.
    pub problem: bool,
}

/// The run's events, shared by the fault tasks.
#[derive(Debug)]
pub(crate) struct Events {
    list: Mutex<Vec<Event>>,
    t0: Instant,
    /// Print each event to stderr as it happens.
    echo: bool,
}

impl Events {
    pub fn new(t0: Instant, echo: bool) -> Self {
        Events {
            list: Mutex::default(),
            t0,
            echo,
        }
    }

    pub fn note(&self, what: impl Into<String>) {
        self.push(what.into(), false);
    }

    pub fn problem(&self, what: impl Into<String>) {
        self.push(what.into(), true);
    }

    fn push(&self, what: String, problem: bool) {
        let at_s = self.t0.elapsed().as_secs_f64();
        if self.echo {
            let mark = if problem { "PROBLEM: " } else { "" };
            eprintln!("[{at_s:>7.1}s] {mark}{what}");
        }
        self.list.lock().push(Event {
            at_s,
            what,
            problem,
        });
    }

    pub fn list(&self) -> Vec<Event> {
        self.list.lock().clone()
    }
}

/// One process as the sampler sees it.
#[derive(Clone, Debug)]
pub(crate) struct ProcInfo {
    pub name: String,
    /// While it runs.
    pub pid: Option<u32>,
    pub log: Option<PathBuf>,
    pub restarts: u32,
    /// How it ended, if it is not running.
    pub exited: Option<String>,
}

/// One tunnel server slot: the process (while it runs) and how to start it again.
#[derive(Debug)]
pub(crate) struct Server {
    proc: Option<TunnelServerProc>,
    opts: TunnelServerOpts,
    ports: (SocketAddr, SocketAddr, SocketAddr),
    log: PathBuf,
    restarts: u32,
    /// Down or going down on purpose: its exit is no finding.
    expected_down: bool,
    /// An unexpected exit was reported already.
    reported: bool,
    exited: Option<String>,
}

impl Server {
    fn id(&self) -> &str {
        &self.opts.server_id
    }
}

/// The processes of an embedded soak. Field order is drop order: the agent goes first,
/// the scratch directory (with the logs) last.
pub(crate) struct Rig {
    agent: AgentProc,
    agent_reported: bool,
    haproxy: Option<Haproxy>,
    servers: Vec<Server>,
    /// `None` in the co-located mode.
    dispatcher: Option<DispatcherProc>,
    pub front: FrontAddrs,
    dispatcher_reported: bool,
    spec: RigSpec,
    dir: ScratchDir,
}

impl Rig {
    /// Starts the dispatcher, the servers, HAProxy (if asked) and the agent, each on
    /// fresh loopback ports ([`FleetSpec::start`]).
    pub async fn start(spec: RigSpec) -> anyhow::Result<Rig> {
        let fleet = FleetSpec {
            servers: spec.servers,
            heartbeat: TunnelServerOpts::default().heartbeat,
            dispatcher: DispatcherOpts {
                call_timeout: spec.call_timeout,
                ..DispatcherOpts::default()
            },
            colocated: spec.colocated,
            haproxy: spec.haproxy_weights.clone().map(|weights| HaproxySpec {
                weights,
                checks: Checks::default(),
            }),
            agent_per_server: false,
            agent: AgentOpts {
                token: TOKEN.into(),
                upstream: spec.upstream_url.clone(),
                ..AgentOpts::default()
            },
            spawn: spec.spawn.clone(),
            scratch: "soak".into(),
        };
        let FleetProcs {
            mut agents,
            haproxy,
            servers,
            dispatcher,
            front,
            dir,
        } = fleet.start().await?;
        let servers = servers
            .into_iter()
            .map(|(p, opts)| Server {
                ports: p.ports(),
                log: p.proc.log_path().to_path_buf(),
                proc: Some(p),
                opts,
                restarts: 0,
                expected_down: false,
                reported: false,
                exited: None,
            })
            .collect();
        let (agent, _) = agents.remove(0);
        Ok(Rig {
            agent,
            agent_reported: false,
            haproxy,
            servers,
            dispatcher,
            front,
            dispatcher_reported: false,
            spec,
            dir,
        })
    }

    pub fn server_ids(&self) -> Vec<String> {
        self.servers.iter().map(|s| s.id().to_string()).collect()
    }

    /// Where the scratch directory (configs and logs) is.
    pub fn dir(&self) -> &std::path::Path {
        self.dir.path()
    }

    /// Waits until the dispatcher hears from every server, HAProxy (if any) sees every
    /// server up, and a call through the relay answers 200.
    pub async fn wait_ready(&mut self) -> anyhow::Result<Duration> {
        let caller = &Caller::new(self.front.http, Some(crate::stack::CALLER_KEY));
        let probe = &format!("/relay/{}/hello", self.spec.tunnel_id);
        let (admin, servers) = (self.front.admin, self.servers.len());
        let haproxy = &self.haproxy_check();
        // Ready, or the name of a process that exited: either ends the wait.
        let ready = poll::poll("the stack is ready", READY_WITHIN, EVERY, || {
            let exited = self.exited_now().into_iter().next();
            async move {
                if let Some(name) = exited {
                    return Ok(Err(name));
                }
                let reporting = reporting_servers(admin).await;
                let haproxy_up = haproxy_all_up(haproxy).await;
                match caller.get(probe).await {
                    Ok(a) if a.status == 200 && reporting >= servers && haproxy_up => Ok(Ok(())),
                    answer => Err(format!(
                        "the dispatcher hears from {reporting} of {servers} servers, haproxy all up: {haproxy_up}, GET {probe}: {}",
                        match &answer {
                            Ok(a) => format!("{} {}", a.status, a.text()),
                            Err(e) => e.to_string(),
                        }
                    )),
                }
            }
        })
        .await;
        match ready {
            Ok((Ok(()), took)) => Ok(took),
            Ok((Err(name), _)) => anyhow::bail!("{name} exited while the stack was starting"),
            Err(e) => anyhow::bail!("{e}\nagent log:\n{}", self.agent.proc.log_tail(15)),
        }
    }

    /// What [`haproxy_all_up`] checks: HAProxy's stats address (if any) and the running
    /// servers' names.
    fn haproxy_check(&self) -> Option<(SocketAddr, Vec<String>)> {
        let h = self.haproxy.as_ref()?;
        let running = self.servers.iter().filter(|s| s.proc.is_some());
        Some((h.stats, running.map(|s| s.id().to_string()).collect()))
    }

    fn exited_now(&mut self) -> Vec<String> {
        let mut out = Vec::new();
        if let Some(st) = self.dispatcher.as_mut().and_then(|d| d.proc.try_exited()) {
            if !self.dispatcher_reported {
                self.dispatcher_reported = true;
                out.push(format!("dispatcher ({st})"));
            }
        }
        if let Some(st) = self.agent.proc.try_exited() {
            if !self.agent_reported {
                self.agent_reported = true;
                out.push(format!("agent ({st})"));
            }
        }
        for s in &mut self.servers {
            if let Some(st) = s.proc.as_mut().and_then(|p| p.proc.try_exited()) {
                s.exited = Some(st.to_string());
                if !s.expected_down && !s.reported {
                    s.reported = true;
                    out.push(format!("{} ({st})", s.opts.server_id));
                }
            }
        }
        out
    }

    /// The processes, for the sampler.
    pub fn table(&mut self) -> Vec<ProcInfo> {
        let mut out = Vec::new();
        let info = |name: &str, p: &mut crate::procs::Proc, restarts: u32| {
            let exited = p.try_exited().map(|s| s.to_string());
            ProcInfo {
                name: name.to_string(),
                pid: exited.is_none().then(|| p.pid()),
                log: Some(p.log_path().to_path_buf()),
                restarts,
                exited,
            }
        };
        if let Some(d) = self.dispatcher.as_mut() {
            out.push(info("dispatcher", &mut d.proc, 0));
        }
        for s in &mut self.servers {
            let id = s.opts.server_id.clone();
            match s.proc.as_mut() {
                Some(p) => out.push(info(&id, &mut p.proc, s.restarts)),
                None => out.push(ProcInfo {
                    name: id,
                    pid: None,
                    log: Some(s.log.clone()),
                    restarts: s.restarts,
                    exited: Some(s.exited.clone().unwrap_or_else(|| "stopped".into())),
                }),
            }
        }
        out.push(info("agent", &mut self.agent.proc, 0));
        if let Some(h) = &self.haproxy {
            out.push(ProcInfo {
                name: "haproxy".into(),
                pid: h.pid(),
                log: h.log_path(),
                restarts: 0,
                exited: None,
            });
        }
        out
    }

    /// SIGTERM server `i`, wait for its exit, start it again on the same ports and wait
    /// until the fleet is whole.
    async fn restart(&mut self, i: usize, ctx: &Ctx) {
        let id = self.servers[i].id().to_string();
        let grace = self.servers[i].opts.shutdown_grace;
        self.servers[i].expected_down = true;
        if let Some(p) = self.servers[i].proc.as_mut() {
            ctx.status(format!("{id}: SIGTERM, draining"));
            let t = Instant::now();
            match p.proc.signal("TERM") {
                Ok(()) => ctx.events.note(format!("{id}: SIGTERM")),
                Err(e) => ctx.events.problem(format!("{id}: SIGTERM failed: {e:#}")),
            }
            match p.proc.wait_exit(grace + EXIT_SLACK).await {
                Ok(st) => ctx.events.note(format!(
                    "{id}: exited ({st}) {:.1}s after SIGTERM",
                    t.elapsed().as_secs_f64()
                )),
                Err(_) => {
                    p.proc.kill();
                    ctx.events.problem(format!(
                        "{id}: still running {:?} after SIGTERM (shutdown_grace {grace:?}); SIGKILLed",
                        grace + EXIT_SLACK
                    ));
                }
            }
        }
        self.servers[i].proc = None;
        self.servers[i].exited = Some("stopped for a restart".into());
        ctx.publish(self);
        self.start_again(i, ctx).await;
    }

    /// SIGKILL server `i`: a crash.
    fn kill(&mut self, i: usize, ctx: &Ctx) {
        let id = self.servers[i].id().to_string();
        self.servers[i].expected_down = true;
        if let Some(mut p) = self.servers[i].proc.take() {
            p.proc.kill();
            ctx.events.note(format!("{id}: SIGKILL"));
        }
        self.servers[i].exited = Some("SIGKILLed".into());
        ctx.publish(self);
    }

    /// Starts server `i` on its old ports and waits until the fleet is whole.
    async fn start_again(&mut self, i: usize, ctx: &Ctx) {
        let id = self.servers[i].id().to_string();
        ctx.status(format!("{id}: starting"));
        let t = Instant::now();
        let s = &self.servers[i];
        let started = TunnelServerProc::start_on_with(
            self.dir.path(),
            s.opts.clone(),
            Some(s.ports),
            &self.spec.spawn,
        )
        .await;
        match started {
            Ok(p) => {
                if p.ports() != self.servers[i].ports {
                    ctx.events.problem(format!(
                        "{id}: its old ports were taken; it runs on {:?} now, where neither the agent nor haproxy look",
                        p.ports()
                    ));
                }
                let s = &mut self.servers[i];
                s.proc = Some(p);
                s.restarts += 1;
                s.expected_down = false;
                s.reported = false;
                s.exited = None;
                ctx.events.note(format!(
                    "{id}: up again ({:.1}s to /healthz)",
                    t.elapsed().as_secs_f64()
                ));
            }
            Err(e) => {
                ctx.events
                    .problem(format!("{id}: could not start it again: {e:#}"));
                return;
            }
        }
        ctx.publish(self);
        ctx.status(format!("{id}: waiting for the fleet to be whole"));
        self.wait_whole(i, ctx).await;
        ctx.status(String::new());
    }

    /// After server `i` restarted: it answers `/readyz`, the dispatcher hears from every
    /// running server, HAProxy (if any) sees it up; then (a note, not a problem, if it
    /// does not happen) it holds streams of the tunnel id again.
    async fn wait_whole(&mut self, i: usize, ctx: &Ctx) {
        let id = self.servers[i].id().to_string();
        let Some(admin) = self.servers[i].proc.as_ref().map(|p| p.admin_addr) else {
            return;
        };
        let running = self.servers.iter().filter(|s| s.proc.is_some()).count();
        let t = Instant::now();
        let admin_caller = &Caller::new(admin, None);
        let front_admin = self.front.admin;
        let haproxy = &self.haproxy_check();
        let whole = poll::poll("the fleet is whole", WHOLE_WITHIN, EVERY, || async move {
            let ready = matches!(admin_caller.get("/readyz").await, Ok(a) if a.status == 200);
            let reporting = reporting_servers(front_admin).await;
            let lb = haproxy_all_up(haproxy).await;
            if ready && reporting >= running && lb {
                Ok(())
            } else {
                Err(format!("/readyz 200 {ready}, dispatcher hears from {reporting} of {running}, haproxy up {lb}"))
            }
        })
        .await;
        if let Err(e) = whole {
            ctx.events.problem(format!(
                "fleet not whole {WHOLE_WITHIN:?} after {id} restarted: {}",
                e.last
            ));
            return;
        }
        let whole_after = t.elapsed();
        ctx.status(format!(
            "{id}: waiting for streams of {}",
            self.spec.tunnel_id
        ));
        let tunnel_id = self.spec.tunnel_id.as_str();
        let streams = poll::poll("streams", STREAMS_WITHIN, EVERY, || async move {
            let n = match scrape(admin).await {
                Ok(text) => metric(&text, "relay_tunnel_streams", &[("tunnel_id", tunnel_id)]),
                Err(_) => 0.0,
            };
            if n > 0.0 {
                Ok(n)
            } else {
                Err("")
            }
        })
        .await
        .map_or(0.0, |(n, _)| n);
        if streams > 0.0 {
            ctx.events.note(format!(
                "fleet whole again {:.1}s after {id} came up ({id} holds {streams} streams of {})",
                t.elapsed().as_secs_f64(),
                self.spec.tunnel_id
            ));
        } else {
            ctx.events.note(format!(
                "fleet whole {:.1}s after {id} came up, but {id} got no stream of {} within {STREAMS_WITHIN:?}",
                whole_after.as_secs_f64(),
                self.spec.tunnel_id
            ));
        }
    }
}

/// `relay_dispatcher_tunnel_servers`: servers with an open report stream.
/// Whether HAProxy (if any: its stats address and the running servers' names) reports
/// every running server's backend up.
async fn haproxy_all_up(haproxy: &Option<(SocketAddr, Vec<String>)>) -> bool {
    let Some((stats, running)) = haproxy else {
        return true;
    };
    let csv = match Caller::new(*stats, None).get("/stats;csv").await {
        Ok(a) => a.text(),
        Err(_) => String::new(),
    };
    running.iter().all(|name| haproxy_backend_up(&csv, name))
}

async fn reporting_servers(admin: SocketAddr) -> usize {
    match scrape(admin).await {
        Ok(t) => metric(&t, "relay_dispatcher_tunnel_servers", &[]) as usize,
        Err(_) => 0,
    }
}

/// Whether HAProxy's CSV stats show backend server `name` of `tunnel_servers` UP.
pub(crate) fn haproxy_backend_up(csv: &str, name: &str) -> bool {
    csv.lines().any(|l| {
        let mut cols = l.split(',');
        cols.next() == Some("tunnel_servers")
            && cols.next() == Some(name)
            && cols.nth(15).is_some_and(|st| st == "UP")
    })
}

/// What the fault task reports through.
pub(crate) struct Ctx {
    pub events: Arc<Events>,
    pub table: watch::Sender<Vec<ProcInfo>>,
    /// What a fault is doing right now, for the progress line.
    pub status: watch::Sender<String>,
}

impl Ctx {
    fn status(&self, s: String) {
        self.status.send_replace(s);
    }

    fn publish(&self, rig: &mut Rig) {
        self.table.send_replace(rig.table());
    }
}

/// Owns the rig for the run: injects `fault` on `timing` (rolling restart, kill-server;
/// burst is the load's business), checks every second for exits nobody asked for, and
/// hands the rig back when `stop` is cancelled.
pub(crate) async fn drive(
    mut rig: Rig,
    fault: Fault,
    timing: FaultTiming,
    t0: Instant,
    stop: CancellationToken,
    ctx: Ctx,
) -> Rig {
    let mut check = tokio::time::interval(CHECK_EVERY);
    check.set_missed_tick_behavior(MissedTickBehavior::Skip);
    let mut next = match fault {
        Fault::RollingRestart | Fault::KillServer { .. } => Some(t0 + timing.at),
        _ => None,
    };
    let mut cycle = 0u32;
    let mut killed = false;
    let wake = tokio::time::sleep_until(next.unwrap_or(t0));
    tokio::pin!(wake);
    loop {
        tokio::select! {
            // biased: a stop wins; a due fault step goes before the routine check.
            biased;
            _ = stop.cancelled() => break,
            _ = &mut wake, if next.is_some() => {
                let started = Instant::now();
                let step = async {
                    match &fault {
                        Fault::RollingRestart => {
                            cycle += 1;
                            ctx.events.note(format!("rolling restart {cycle}: begins"));
                            for i in 0..rig.servers.len() {
                                rig.restart(i, &ctx).await;
                            }
                            ctx.events.note(format!(
                                "rolling restart {cycle}: done in {:.1}s",
                                started.elapsed().as_secs_f64()
                            ));
                            timing.every.map(|e| (started + e).max(Instant::now()))
                        }
                        Fault::KillServer { server, restart_after } => {
                            let i = server.saturating_sub(1).min(rig.servers.len() - 1);
                            if !killed {
                                killed = true;
                                rig.kill(i, &ctx);
                                restart_after.map(|d| Instant::now() + d)
                            } else {
                                rig.start_again(i, &ctx).await;
                                None
                            }
                        }
                        _ => None,
                    }
                };
                let due = tokio::select! {
                    biased;
                    _ = stop.cancelled() => {
                        let doing = ctx.status.borrow().clone();
                        ctx.events.note(format!("the load ended during the fault ({doing}); not waited for"));
                        break;
                    }
                    due = step => due,
                };
                next = due;
                if let Some(at) = next {
                    wake.as_mut().reset(at);
                }
            }
            _ = check.tick() => {
                for name in rig.exited_now() {
                    ctx.events.problem(format!("{name} exited; nobody asked it to"));
                }
                ctx.publish(&mut rig);
            }
        }
    }
    ctx.status(String::new());
    rig
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn haproxy_csv_status_is_read_per_server() {
        let csv = "# pxname,svname,qcur,qmax,scur,smax,slim,stot,bin,bout,dreq,dresp,ereq,econ,eresp,wretr,wredis,status,weight\n\
                   tunnel_servers,ts-1,0,0,3,4,,9,1,2,,0,,0,0,0,0,UP,90\n\
                   tunnel_servers,ts-2,0,0,0,0,,0,0,0,,0,,0,0,0,0,DOWN,10\n\
                   tunnel_servers,BACKEND,0,0,3,4,,9,1,2,0,0,,0,0,0,0,UP,100\n";
        assert!(haproxy_backend_up(csv, "ts-1"));
        assert!(!haproxy_backend_up(csv, "ts-2"));
        assert!(!haproxy_backend_up(csv, "ts-3"));
    }
}
