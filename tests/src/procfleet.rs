//! Fleets of relay processes. [`FleetSpec::start`] is the one way the harness starts the
//! relay's processes together (a dispatcher or a co-located front, tunnel servers,
//! optionally HAProxy, agents; `crate::procs` children); the soak's rig and the process
//! tests start theirs with it. On top, the fleet of the fault tests ([`Fleet`]), with a
//! simulated upstream: faults are process signals (kill, stop, drain, restart) and a
//! connection dropped silently on the path ([`Blackhole`]). Each fleet checks its own
//! per-hop accounting ([`Fleet::accounted`]): every call the callers sent is counted once
//! at every hop it reached.

use crate::client::Caller;
use crate::haproxy::{Backend, Checks, Haproxy};
use crate::ledger::{agent_ledger_text, dispatcher_attempts, hops_agree, server_ledger_text, Hops};
use crate::procs::{
    free_addr, metric, scrape, series, AgentOpts, AgentProc, DispatcherOpts, DispatcherProc,
    ScratchDir, Spawn, TunnelServerOpts, TunnelServerProc,
};
use crate::stack::{Stack, CALLER_KEY, TOKEN, TUNNEL_ID};
use crate::time_until;
use crate::upstream::{Upstream, UpstreamHandle};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::net::{TcpListener, TcpStream};

/// How long a fleet may take to become routable, or a wait on it to come true.
const READY: Duration = Duration::from_secs(20);
/// How long a fleet may take to go quiet.
const QUIET: Duration = Duration::from_secs(20);

/// Dispatcher calls handled so far (every outcome) and in flight, from its `/metrics`.
/// A missing series is an error, never 0.
pub async fn dispatcher_calls(admin: SocketAddr) -> Result<(f64, f64), String> {
    let text = scrape(admin).await.map_err(|e| e.to_string())?;
    Ok((
        series(&text, "relay_dispatcher_calls_total", &[])?,
        series(&text, "relay_dispatcher_calls_in_flight", &[])?,
    ))
}

/// The accounting check on the in-process stack: `sent` calls since the dispatcher had
/// handled `base` calls.
pub async fn stack_accounted(stack: &Stack, sent: u64, base: f64) -> Result<(), String> {
    let mut hops = dispatcher_accounted(stack.dispatcher_admin, sent, base, 0.0).await?;
    // Every incarnation's registry survives in the in-process stack.
    for (i, reg) in stack.server_registries() {
        let text = relay_common::admin::render_metrics(&reg);
        let id = stack
            .server_id(i)
            .map_or(format!("slot {i}"), str::to_string);
        server_ledger_text(&id, &text, true, &mut hops)?;
    }
    for (i, reg, running) in stack.agent_registries() {
        agent_ledger_text(
            &format!("agent {i}"),
            &relay_common::admin::render_metrics(&reg),
            running,
            &mut hops,
        )?;
    }
    hops_agree(&hops)
}

/// The dispatcher's half of an accounting check: `sent` calls since it had handled `base`
/// (not counting `probes`, calls the harness made itself) each have one outcome and none
/// is in flight. Returns the ledger with the dispatcher's forward attempts filled in.
async fn dispatcher_accounted(
    admin: SocketAddr,
    sent: u64,
    base: f64,
    probes: f64,
) -> Result<Hops, String> {
    let (calls, in_flight) = dispatcher_calls(admin).await?;
    let calls = calls - probes;
    if calls - base != sent as f64 || in_flight != 0.0 {
        return Err(format!(
            "dispatcher: {} outcomes for {sent} calls sent, {in_flight} in flight",
            calls - base
        ));
    }
    let text = scrape(admin).await.map_err(|e| e.to_string())?;
    Ok(Hops {
        attempts: dispatcher_attempts(&text)?,
        ..Hops::default()
    })
}

pub async fn dispatcher_base(admin: SocketAddr) -> f64 {
    dispatcher_calls(admin).await.unwrap().0
}

pub async fn dispatcher_servers(admin: SocketAddr) -> f64 {
    match scrape(admin).await {
        Ok(t) => metric(&t, "relay_dispatcher_tunnel_servers", &[]),
        Err(_) => -1.0,
    }
}

// ---------------------------------------------------------------------------------------
// Starting a fleet: the one way the harness starts the relay's processes together

/// What fleet of processes [`FleetSpec::start`] starts: a dispatcher (or, co-located, none:
/// ts-1 serves its front), tunnel servers `ts-1`..`ts-n` in zones `zone-1`.., optionally
/// HAProxy between the agents and the servers, and the agents. The process tests' [`Fleet`]
/// and the soak's rig both start theirs this way.
#[derive(Clone, Debug)]
pub struct FleetSpec {
    pub servers: usize,
    /// The servers' heartbeat to the dispatcher.
    pub heartbeat: Duration,
    pub dispatcher: DispatcherOpts,
    /// ts-1 serves the dispatcher front (the dispatcher's config as its `front_config`);
    /// there is no dispatcher process.
    pub colocated: bool,
    pub haproxy: Option<HaproxySpec>,
    /// One agent per server, each dialing its server alone, instead of one agent dialing
    /// every server (or HAProxy).
    pub agent_per_server: bool,
    /// The agents' options; their `tunnels` are filled in.
    pub agent: AgentOpts,
    /// How every child is spawned.
    pub spawn: Spawn,
    /// The scratch directory's name prefix.
    pub scratch: String,
}

/// HAProxy between the agents and the servers.
#[derive(Clone, Debug)]
pub struct HaproxySpec {
    /// Per server, in order.
    pub weights: Vec<u32>,
    /// Its health checks on each server's `/readyz`.
    pub checks: Checks,
}

/// Where callers reach the dispatcher front: the dispatcher process's listeners, or the
/// co-located ts-1's front listeners.
#[derive(Clone, Copy, Debug)]
pub struct FrontAddrs {
    pub http: SocketAddr,
    pub admin: SocketAddr,
}

/// The processes [`FleetSpec::start`] started, with the options each was started with (to
/// start it again). Field order is drop order: the agents go first, the scratch directory
/// (with the logs) last.
pub struct FleetProcs {
    pub agents: Vec<(AgentProc, AgentOpts)>,
    pub haproxy: Option<Haproxy>,
    pub servers: Vec<(TunnelServerProc, TunnelServerOpts)>,
    /// `None` in the co-located shape.
    pub dispatcher: Option<DispatcherProc>,
    pub front: FrontAddrs,
    pub dir: ScratchDir,
}

/// How many times the co-located front's ports are picked before the start gives up.
const FRONT_PORT_ATTEMPTS: usize = 3;

impl FleetSpec {
    /// Starts the dispatcher, the servers, HAProxy (if asked) and the agents, each on
    /// fresh loopback ports, in that order. Does not wait for the fleet to route.
    pub async fn start(&self) -> anyhow::Result<FleetProcs> {
        anyhow::ensure!(
            !self.colocated || self.servers > 0,
            "the co-located shape needs a tunnel server to serve its front"
        );
        let dir = ScratchDir::new(&self.scratch)?;
        let how = &self.spawn;
        let server_opts = |i: usize, registry_url: &str, extra: String| TunnelServerOpts {
            server_id: format!("ts-{}", i + 1),
            zone: format!("zone-{}", i + 1),
            dispatchers: vec![registry_url.to_string()],
            heartbeat: self.heartbeat,
            extra,
            ..TunnelServerOpts::default()
        };
        // In the co-located shape ts-1 serves the front, and starts first.
        let mut first = None;
        let (dispatcher, front, registry_url) = if self.colocated {
            // The front's ports are picked free, then bound by ts-1: if one was taken in
            // between, ts-1 does not come up, and the front gets other ports.
            let mut attempt = 0;
            loop {
                attempt += 1;
                let ports = (free_addr()?, free_addr()?, free_addr()?);
                let path = DispatcherProc::write_config(dir.path(), &self.dispatcher, ports)?;
                let registry_url = format!("http://{}", ports.1);
                let line = format!("front_config = {:?}\n", path.display().to_string());
                let opts = server_opts(0, &registry_url, line);
                match TunnelServerProc::start_on_with(dir.path(), opts.clone(), None, how).await {
                    Ok(p) => {
                        first = Some((p, opts));
                        let front = FrontAddrs {
                            http: ports.0,
                            admin: ports.2,
                        };
                        break (None, front, registry_url);
                    }
                    Err(_) if attempt < FRONT_PORT_ATTEMPTS => {}
                    Err(e) => return Err(e.context("the co-located front (ts-1) did not start")),
                }
            }
        } else {
            let d = DispatcherProc::start_with(dir.path(), self.dispatcher.clone(), how).await?;
            let front = FrontAddrs {
                http: d.http,
                admin: d.admin,
            };
            let url = d.registry_url();
            (Some(d), front, url)
        };
        let mut servers = Vec::new();
        for i in 0..self.servers {
            let started = match first.take() {
                Some(started) => started,
                None => {
                    let opts = server_opts(i, &registry_url, String::new());
                    let p = TunnelServerProc::start_on_with(dir.path(), opts.clone(), None, how)
                        .await?;
                    (p, opts)
                }
            };
            servers.push(started);
        }
        let haproxy = match &self.haproxy {
            Some(spec) => {
                let backends = servers
                    .iter()
                    .zip(&spec.weights)
                    .map(|((s, _), w)| Backend {
                        name: s.server_id.clone(),
                        addr: s.agent_addr,
                        admin: Some(s.admin_addr),
                        weight: *w,
                        disabled: false,
                    })
                    .collect();
                Some(Haproxy::start_checked(backends, how, spec.checks).await?)
            }
            None => None,
        };
        let tunnels: Vec<Vec<String>> = match &haproxy {
            Some(h) => vec![vec![h.url()]],
            None if self.agent_per_server => {
                servers.iter().map(|(s, _)| vec![s.agent_url()]).collect()
            }
            None => vec![servers.iter().map(|(s, _)| s.agent_url()).collect()],
        };
        let mut agents = Vec::new();
        for tunnels in tunnels {
            let opts = AgentOpts {
                tunnels,
                ..self.agent.clone()
            };
            agents.push((
                AgentProc::start_with(dir.path(), opts.clone(), how).await?,
                opts,
            ));
        }
        Ok(FleetProcs {
            agents,
            haproxy,
            servers,
            dispatcher,
            front,
            dir,
        })
    }
}

// ---------------------------------------------------------------------------------------
// The fleet as child processes

/// How a [`Fleet`] is made.
#[derive(Clone)]
pub struct FleetOpts {
    pub servers: usize,
    pub heartbeat: Duration,
    pub upstream_latency: Duration,
    /// The agent dials a real HAProxy with these health checks on each server's
    /// `/readyz` (as in `examples/haproxy/haproxy.cfg`) instead of the servers themselves.
    pub haproxy: Option<Checks>,
    /// One agent replica of the tunnel id per server, each dialing its server alone,
    /// instead of one agent dialing every server. An agent dialing several servers places
    /// each stream on one at random: all of a small fixed pool may land on one server.
    pub agent_per_server: bool,
    /// The agent's open backoff (initial, max).
    pub agent_backoff: (Duration, Duration),
    /// Appended to the agent's config file.
    pub agent_extra: String,
    pub dispatcher: DispatcherOpts,
}

impl FleetOpts {
    pub fn new(servers: usize, heartbeat: Duration, upstream_latency: Duration) -> Self {
        FleetOpts {
            servers,
            heartbeat,
            upstream_latency,
            haproxy: None,
            agent_per_server: false,
            agent_backoff: AgentOpts::default().backoff,
            agent_extra: String::new(),
            dispatcher: DispatcherOpts::default(),
        }
    }
}

/// A dispatcher, `n` tunnel servers (`ts-1`..`ts-n`, zones `zone-1`..) and an agent
/// (or one per server) as child processes, and a simulated upstream. `servers[i]` is
/// `None` while a test has taken the process out (killed, drained).
pub struct Fleet {
    pub dir: ScratchDir,
    pub upstream: UpstreamHandle,
    pub dispatcher: DispatcherProc,
    dispatcher_opts: DispatcherOpts,
    pub servers: Vec<Option<TunnelServerProc>>,
    opts: Vec<TunnelServerOpts>,
    ports: Vec<(SocketAddr, SocketAddr, SocketAddr)>,
    /// Between the agent and the servers, when asked for; kept for the fleet's life.
    _haproxy: Option<Haproxy>,
    /// The agent (with `agent_per_server`, the one dialing ts-1).
    pub agent: AgentProc,
    agent_opts: AgentOpts,
    /// With `agent_per_server`, the agents dialing ts-2.. in order.
    pub replicas: Vec<AgentProc>,
    /// Calls the fleet's own readiness probes sent through the dispatcher.
    probes: AtomicU64,
    /// Per server slot: restarted at least once (its earlier counters are gone).
    restarted: Vec<bool>,
    /// The agent was killed and started again (the first one's counters are gone).
    agent_restarted: bool,
}

impl Fleet {
    pub async fn start(n: usize, heartbeat: Duration, upstream_latency: Duration) -> Fleet {
        Self::start_with(FleetOpts::new(n, heartbeat, upstream_latency)).await
    }

    pub async fn start_with(o: FleetOpts) -> Fleet {
        let n = o.servers;
        let upstream = Upstream::builder()
            .latency(o.upstream_latency)
            .spawn()
            .await
            .unwrap();
        let spec = FleetSpec {
            servers: n,
            heartbeat: o.heartbeat,
            dispatcher: o.dispatcher.clone(),
            colocated: false,
            haproxy: o.haproxy.map(|checks| HaproxySpec {
                weights: vec![1; n],
                checks,
            }),
            agent_per_server: o.agent_per_server,
            agent: AgentOpts {
                token: TOKEN.into(),
                upstream: upstream.url(),
                backoff: o.agent_backoff,
                extra: o.agent_extra.clone(),
                ..AgentOpts::default()
            },
            spawn: Spawn::default(),
            scratch: "fleet".into(),
        };
        let FleetProcs {
            mut agents,
            haproxy,
            servers: started,
            dispatcher,
            dir,
            ..
        } = spec.start().await.unwrap();
        let dispatcher = dispatcher.expect("a dispatcher process");
        let ports = started.iter().map(|(s, _)| s.ports()).collect();
        let (servers, opts) = started.into_iter().map(|(s, o)| (Some(s), o)).unzip();
        let (agent, agent_opts) = agents.remove(0);
        let replicas = agents.into_iter().map(|(a, _)| a).collect();
        let fleet = Fleet {
            dir,
            upstream,
            dispatcher,
            dispatcher_opts: o.dispatcher,
            servers,
            opts,
            ports,
            _haproxy: haproxy,
            agent,
            agent_opts,
            replicas,
            probes: AtomicU64::new(0),
            restarted: vec![false; n],
            agent_restarted: false,
        };
        fleet.wait_covered(n).await;
        fleet
    }

    pub fn front(&self) -> SocketAddr {
        self.dispatcher.http
    }

    /// Waits until the dispatcher hears from `n` servers and a call answers 200. (The
    /// agent holds streams where they landed, not necessarily on every server.)
    pub async fn wait_covered(&self, n: usize) {
        let t = time_until(READY, || async {
            dispatcher_servers(self.dispatcher.admin).await >= n as f64
        })
        .await;
        assert!(
            t.is_some(),
            "dispatcher hears from {} servers, not {n}",
            dispatcher_servers(self.dispatcher.admin).await,
        );
        let c = Caller::new(self.front(), Some(CALLER_KEY));
        let ok = time_until(READY, || async {
            self.probes.fetch_add(1, Ordering::SeqCst);
            matches!(c.get(&format!("/relay/{TUNNEL_ID}/hello")).await, Ok(a) if a.status == 200)
        })
        .await;
        assert!(
            ok.is_some(),
            "fleet not routable:\n{}",
            self.agent.proc.log_tail(20)
        );
    }

    /// Index of the running server holding most of the agent's streams (the one carrying
    /// the calls).
    pub async fn busiest(&self) -> usize {
        let streams = self.agent_servers().await;
        (0..self.servers.len())
            .filter(|i| self.servers[*i].is_some())
            .max_by_key(|i| {
                streams
                    .get(&format!("ts-{}", i + 1))
                    .map_or((0, 0), |s| (s.1, s.0))
            })
            .unwrap()
    }

    /// The agent's streams and busy streams per server id, from `/systemcheck`.
    pub async fn agent_servers(&self) -> BTreeMap<String, (u64, u64)> {
        let mut out = BTreeMap::new();
        if let Ok(a) = Caller::new(self.agent.admin, None)
            .get("/systemcheck")
            .await
        {
            for s in a.json()["servers"].as_array().into_iter().flatten() {
                let id = s["server_id"].as_str().unwrap_or("?").to_string();
                let streams = s["streams"].as_u64().unwrap_or(0);
                let busy = s["busy"].as_u64().unwrap_or(0);
                out.insert(id, (streams, busy));
            }
        }
        out
    }

    pub async fn agent_metrics(&self) -> String {
        scrape(self.agent.admin).await.unwrap_or_default()
    }

    /// Streams of the demo tunnel id server `i` holds, per its own `/metrics`.
    pub async fn server_streams(&self, i: usize) -> Option<f64> {
        let s = self.servers[i].as_ref()?;
        let t = scrape(s.admin_addr).await.ok()?;
        Some(metric(
            &t,
            "relay_tunnel_streams",
            &[("tunnel_id", TUNNEL_ID)],
        ))
    }

    pub async fn restart(&mut self, i: usize) {
        assert!(self.servers[i].is_none());
        self.restarted[i] = true;
        let s =
            TunnelServerProc::start_on(self.dir.path(), self.opts[i].clone(), Some(self.ports[i]))
                .await
                .unwrap();
        self.servers[i] = Some(s);
    }

    /// Starts the agent again (after it was killed), with its config.
    pub async fn restart_agent(&mut self) {
        assert!(
            self.agent.proc.try_exited().is_some(),
            "the agent still runs"
        );
        self.agent_restarted = true;
        self.agent = AgentProc::start(self.dir.path(), self.agent_opts.clone())
            .await
            .unwrap();
    }

    /// Kills the dispatcher (SIGKILL), leaves it down for `down`, and starts it again on
    /// the same ports (the servers and callers look for it there). Returns when it
    /// answers `/healthz` again.
    pub async fn crash_dispatcher(&mut self, down: Duration) {
        let ports = self.dispatcher.ports();
        self.dispatcher.proc.kill();
        // The outage itself: the servers' report streams retry meanwhile.
        tokio::time::sleep(down).await;
        self.dispatcher =
            DispatcherProc::start_on(self.dir.path(), self.dispatcher_opts.clone(), Some(ports))
                .await
                .unwrap();
        self.probes.store(0, Ordering::SeqCst);
    }

    /// Dispatcher calls so far, less the fleet's own probes: the base of [`Fleet::accounted`].
    pub async fn base(&self) -> f64 {
        dispatcher_base(self.dispatcher.admin).await - self.probes.load(Ordering::SeqCst) as f64
    }

    /// The accounting check across the running processes: `sent` calls since [`Fleet::base`].
    pub async fn accounted(&self, sent: u64, base: f64) -> Result<(), String> {
        self.accounted_abandoning(sent, base, 0).await
    }

    /// [`Fleet::accounted`] where `abandoned` calls were given up at their deadline while
    /// their server could not read ([`Hops::abandoned`]).
    pub async fn accounted_abandoning(
        &self,
        sent: u64,
        base: f64,
        abandoned: u64,
    ) -> Result<(), String> {
        let probes = self.probes.load(Ordering::SeqCst) as f64;
        let mut hops = dispatcher_accounted(self.dispatcher.admin, sent, base, probes).await?;
        // A killed or drained process's counters are gone: only a server that ran through
        // the whole test is read whole.
        for (i, s) in self.servers.iter().enumerate() {
            let Some(s) = s else { continue };
            let t = scrape(s.admin_addr).await.map_err(|e| e.to_string())?;
            server_ledger_text(&s.server_id, &t, !self.restarted[i], &mut hops)?;
        }
        if self.servers.iter().any(Option::is_none) {
            for (i, s) in self.servers.iter().enumerate() {
                if s.is_none() {
                    hops.server_received
                        .insert(self.opts[i].server_id.clone(), (0.0, false));
                }
            }
        }
        agent_ledger_text("agent", &self.agent_metrics().await, true, &mut hops)?;
        for (i, a) in self.replicas.iter().enumerate() {
            let t = scrape(a.admin).await.map_err(|e| e.to_string())?;
            agent_ledger_text(&format!("agent {}", i + 2), &t, true, &mut hops)?;
        }
        hops.agents_partial = self.agent_restarted;
        hops.abandoned = abandoned as f64;
        hops_agree(&hops)
    }

    /// The running servers' streams of the demo tunnel id, summed (`None` while one
    /// cannot be read).
    pub async fn server_streams_total(&self) -> Option<f64> {
        let mut total = 0.0;
        for i in 0..self.servers.len() {
            if self.servers[i].is_some() {
                total += self.server_streams(i).await?;
            }
        }
        Some(total)
    }

    /// Server ids reporting on their own report stream to the dispatcher (origin `local`
    /// in `/debug/routes`), as opposed to records it read back from Redis.
    pub async fn reporting_locally(&self) -> usize {
        let Ok(a) = Caller::new(self.dispatcher.admin, None)
            .get("/debug/routes")
            .await
        else {
            return 0;
        };
        a.json()["servers"]
            .as_array()
            .map_or(0, |s| s.iter().filter(|s| s["origin"] == "local").count())
    }

    /// Whether the agent's `/systemcheck` shows every server of `ids` covered while they
    /// carry at least `busy` calls in all (in flight and queued there), and holds nothing
    /// on `gone`.
    pub async fn agent_covers(&self, ids: &[String], gone: Option<&str>, busy: u64) -> bool {
        let Ok(check) = Caller::new(self.agent.admin, None)
            .get("/systemcheck")
            .await
        else {
            return false;
        };
        let servers = check.json()["servers"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        let state = |id: &str| {
            servers
                .iter()
                .find(|s| s["server_id"] == id)
                .and_then(|s| s["state"].as_str().map(str::to_string))
        };
        let carried: u64 = servers
            .iter()
            .filter(|s| ids.iter().any(|i| s["server_id"] == i.as_str()))
            .map(|s| s["busy"].as_u64().unwrap_or(0))
            .sum();
        gone.is_none_or(|g| state(g).is_none())
            && ids.iter().all(|i| state(i).as_deref() == Some("covered"))
            && carried >= busy
    }

    /// One probe call through the front: whether it answered 200.
    pub async fn probe(&self) -> bool {
        self.probes.fetch_add(1, Ordering::SeqCst);
        let c = Caller::new(self.front(), Some(CALLER_KEY));
        matches!(c.get(&format!("/relay/{TUNNEL_ID}/hello")).await, Ok(a) if a.status == 200)
    }
}

/// Two tunnel server processes behind a dispatcher with sticky routing, and one agent
/// replica per server with a fixed pool of [`QueuedKillRig::STREAMS`] streams each: every
/// call goes to the home server, so once its streams are busy the next calls wait in its
/// queue, and killing it leaves them to be retried on the other server.
pub struct QueuedKillRig {
    pub fleet: Fleet,
    /// Index of the home server in `fleet.servers`, and its id.
    pub victim: usize,
    pub home: String,
    pub home_streams: u64,
    pub other_streams: u64,
}

impl QueuedKillRig {
    /// Streams each agent replica holds on its server.
    pub const STREAMS: u64 = 4;

    pub async fn start() -> Self {
        let mut o = FleetOpts::new(2, TunnelServerOpts::default().heartbeat, Duration::ZERO);
        o.agent_per_server = true;
        o.agent_extra = format!(
            "[coverage]\nenabled = false\nfixed_streams = {}\n",
            Self::STREAMS
        );
        o.dispatcher = DispatcherOpts {
            call_timeout: Duration::from_secs(30),
            extra: "[routing]\npolicy = \"sticky\"\n".into(),
            ..DispatcherOpts::default()
        };
        let fleet = Fleet::start_with(o).await;
        let mut rig = QueuedKillRig {
            fleet,
            victim: 0,
            home: String::new(),
            home_streams: 0,
            other_streams: 0,
        };
        let full = Self::STREAMS as f64;
        let ready = time_until(READY, || async {
            let (a, b) = (rig.streams_of(0).await, rig.streams_of(1).await);
            a.is_some_and(|a| a.0 == full) && b.is_some_and(|b| b.0 == full)
        })
        .await;
        assert!(
            ready.is_some(),
            "both servers hold {full} streams: {:?} {:?}",
            rig.streams_of(0).await,
            rig.streams_of(1).await
        );
        let routes = Caller::new(rig.fleet.dispatcher.admin, None)
            .get("/debug/routes")
            .await
            .unwrap()
            .json();
        rig.home = routes["tunnels"]
            .as_array()
            .and_then(|t| t.iter().find(|t| t["tunnel_id"] == TUNNEL_ID))
            .and_then(|t| t["home"].as_str())
            .expect("a home server")
            .to_string();
        rig.victim = if rig.home == "ts-1" { 0 } else { 1 };
        rig.home_streams = rig.streams_of(rig.victim).await.unwrap().0 as u64;
        rig.other_streams = rig.streams_of(1 - rig.victim).await.unwrap().0 as u64;
        rig
    }

    /// A caller through the dispatcher's front.
    pub fn caller(&self) -> Caller {
        Caller::new(self.fleet.front(), Some(CALLER_KEY))
    }

    /// Server `i`'s streams and queued calls of the tunnel id; `None` once it is gone.
    pub async fn streams_of(&self, i: usize) -> Option<(f64, f64)> {
        let admin = self.fleet.servers[i].as_ref().map(|s| s.admin_addr)?;
        let t = scrape(admin).await.ok()?;
        Some((
            metric(&t, "relay_tunnel_streams", &[("tunnel_id", TUNNEL_ID)]),
            metric(&t, "relay_tunnel_calls_queued", &[("tunnel_id", TUNNEL_ID)]),
        ))
    }

    /// Waits until `queued` calls wait in the home server's queue and the dispatcher
    /// heard so (`Queued`).
    pub async fn wait_queued(&self, queued: u64) {
        let waiting = time_until(READY, || async {
            let heard = metric(
                &scrape(self.fleet.dispatcher.admin)
                    .await
                    .unwrap_or_default(),
                "relay_dispatcher_queued_total",
                &[],
            );
            heard >= queued as f64
                && self
                    .streams_of(self.victim)
                    .await
                    .is_some_and(|(_, q)| q >= queued as f64)
        })
        .await;
        assert!(
            waiting.is_some(),
            "{queued} calls wait in {}'s queue",
            self.home
        );
    }

    /// SIGKILL of the home server.
    pub fn kill_home(&mut self) {
        let mut proc = self.fleet.servers[self.victim].take().unwrap().proc;
        proc.kill();
    }

    pub async fn retries(&self) -> f64 {
        metric(
            &scrape(self.fleet.dispatcher.admin).await.unwrap(),
            "relay_dispatcher_retries_total",
            &[],
        )
    }

    /// Requests the upstream received so far (answered or cancelled).
    pub fn reached(&self) -> u64 {
        self.fleet.upstream.served() + self.fleet.upstream.cancelled()
    }

    pub async fn wait_upstream_quiet(&self) {
        let quiet = time_until(QUIET, || async { self.fleet.upstream.in_flight() == 0 }).await;
        assert!(quiet.is_some(), "the upstream goes quiet");
    }
}

/// A TCP relay that can silently drop every connection open now: their bytes stop flowing
/// both ways while the sockets stay open (a NAT entry or load balancer that forgot them).
/// Connections made later pass.
pub struct Blackhole {
    pub addr: SocketAddr,
    generation: Arc<AtomicU64>,
}

impl Blackhole {
    pub async fn start(target: SocketAddr) -> Blackhole {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let generation = Arc::new(AtomicU64::new(0));
        let g = generation.clone();
        tokio::spawn(async move {
            while let Ok((client, _)) = l.accept().await {
                let born = g.load(Ordering::SeqCst);
                let g = g.clone();
                tokio::spawn(async move {
                    let Ok(server) = TcpStream::connect(target).await else {
                        return;
                    };
                    let _ = client.set_nodelay(true);
                    let _ = server.set_nodelay(true);
                    let (cr, cw) = client.into_split();
                    let (sr, sw) = server.into_split();
                    let a = tokio::spawn(pipe(cr, sw, born, g.clone()));
                    let b = tokio::spawn(pipe(sr, cw, born, g));
                    let _ = tokio::join!(a, b);
                });
            }
        });
        Blackhole { addr, generation }
    }

    /// Silently drops every connection open now.
    pub fn drop_open_connections(&self) {
        self.generation.fetch_add(1, Ordering::SeqCst);
    }
}

async fn pipe(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    born: u64,
    generation: Arc<AtomicU64>,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if generation.load(Ordering::SeqCst) != born {
            // Dropped: swallow everything, never close (keep both sockets open).
            loop {
                if matches!(from.read(&mut buf).await, Ok(0) | Err(_)) {
                    std::future::pending::<()>().await;
                }
            }
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}
