//! The whole relay in one process on loopback: a simulated upstream, one dispatcher,
//! several tunnel servers (optionally behind the stream-placing load-balancer fixture) and
//! one agent, each started through its library's `run`/`start` on `127.0.0.1:0`.
//!
//! Used by the end-to-end tests, the `relay-fleet demo` and the load tester. Builders
//! choose the shape; `Stack` exposes the addresses and the handles to inject faults.
//!
//! Fleet shapes (all opt-in; the defaults keep one agent with [`TOKEN`] -> [`TUNNEL_ID`]):
//! several agents, each with its own token and tunnel id ([`agent_identity`]); standby
//! server slots brought up later ([`Stack::start_server`]); kill, drain and restart a
//! server; restart an agent; per-component tokio runtimes ([`Runtimes`]) so the load
//! tester can read each component's CPU time from its threads.

use crate::client::Caller;
use crate::lb::{LbHandle, LoadBalancer, Policy};
use crate::upstream::{Upstream, UpstreamHandle};
use relay_agent::coverage::plan::CoverageConfig;
use relay_common::Secret;
use relay_tunnel_server::{TokenStore, TunnelServerHandle};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::runtime::Handle;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

pub const TOKEN: &str = "dev-token";
pub const TUNNEL_ID: &str = "demo";
pub const CALLER_KEY: &str = "dev-caller-key";
/// `max_concurrent_calls` of the harness's caller: above any burst a test sends.
pub const HARNESS_CALLER_MAX_CALLS: usize = 100_000;
/// Shared secret tunnel servers present to the dispatcher's registry.
pub const SERVER_KEY: &str = "dev-server-key";

/// Token and tunnel id of agent `i` in a multi-agent stack: agent 0 is [`TOKEN`] ->
/// [`TUNNEL_ID`], agent `i > 0` is `dev-token-{i}` -> `demo-{i}`. Every tunnel server of
/// the stack accepts all of them.
pub fn agent_identity(i: usize) -> (String, String) {
    if i == 0 {
        (TOKEN.to_string(), TUNNEL_ID.to_string())
    } else {
        (format!("{TOKEN}-{i}"), format!("{TUNNEL_ID}-{i}"))
    }
}

/// Runtimes the components run on (`Handle`s of runtimes the caller owns and keeps alive
/// longer than the stack). Every task a component spawns lands on its runtime, so its
/// threads' CPU time is that component's.
#[derive(Clone, Debug)]
pub struct Runtimes {
    pub dispatcher: Handle,
    pub servers: Handle,
    pub agents: Handle,
    pub lb: Handle,
    pub upstream: Handle,
    /// A runtime of its own for each server slot (one worker thread), with its threads'
    /// name: the server then reports those threads' CPU use as its load. Empty: every server
    /// on `servers`, each reporting the whole process's.
    pub per_server: Vec<(Handle, String)>,
}

impl Runtimes {
    /// The runtime of server slot `i`.
    pub fn server(&self, i: usize) -> &Handle {
        self.per_server.get(i).map_or(&self.servers, |(h, _)| h)
    }

    /// Whose CPU server slot `i` reports as its load.
    pub fn server_cpu(&self, i: usize) -> relay_tunnel_server::load::CpuSource {
        match self.per_server.get(i) {
            Some((_, name)) => relay_tunnel_server::load::CpuSource::Threads {
                name: name.clone(),
                cores: 1,
            },
            None => relay_tunnel_server::load::CpuSource::Process,
        }
    }
}

/// Runs `fut` on `rt` (so what it spawns stays there), or inline without one.
async fn on_rt<F>(rt: Option<&Handle>, fut: F) -> anyhow::Result<F::Output>
where
    F: std::future::Future + Send + 'static,
    F::Output: Send + 'static,
{
    match rt {
        Some(h) => Ok(h.spawn(fut).await?),
        None => Ok(fut.await),
    }
}

/// Adjusts the agent's config once the stack has filled in endpoints, token and upstream.
type AgentTweak = Box<dyn FnOnce(&mut relay_agent::Config) + Send>;

pub struct StackBuilder {
    servers: usize,
    zones: Vec<String>,
    server_ids: Vec<String>,
    placement: Option<Policy>,
    coverage: CoverageConfig,
    upstream_latency: Duration,
    front: Option<SocketAddr>,
    tunnel: relay_tunnel_server::Config,
    dispatcher: relay_dispatcher::Config,
    agent: bool,
    routed: Option<usize>,
    agent_cfg: Option<AgentTweak>,
    agents: usize,
    standby: usize,
    runtimes: Option<Runtimes>,
    upstream_latency_fn: Option<Arc<dyn Fn() -> Duration + Send + Sync>>,
    lb_seed: u64,
    agent_addrs: Vec<SocketAddr>,
    agent_listeners: Vec<Option<std::net::TcpListener>>,
    /// Per server: its forward listener (bound by the test), and the URL it tells the
    /// dispatchers to dial (a fault forwarder in front of it, say).
    forward_listeners: Vec<Option<(std::net::TcpListener, String)>>,
    direct: bool,
    colocated: bool,
    /// Dispatchers (every server reports to each).
    dispatchers: usize,
    /// The load-balancer fixture's connections to each server.
    lb_backend_connections: usize,
    lb_route_by_name: bool,
    /// Agents run elsewhere (other processes) whose tokens the servers accept.
    remote_agents: usize,
}

impl Default for StackBuilder {
    fn default() -> Self {
        StackBuilder {
            servers: 2,
            zones: vec![],
            server_ids: vec![],
            placement: None,
            coverage: CoverageConfig::default(),
            upstream_latency: Duration::ZERO,
            front: None,
            tunnel: relay_tunnel_server::Config::default(),
            dispatcher: relay_dispatcher::Config::default(),
            agent: true,
            routed: None,
            agent_cfg: None,
            agents: 1,
            standby: 0,
            runtimes: None,
            upstream_latency_fn: None,
            lb_seed: 7,
            agent_addrs: Vec::new(),
            agent_listeners: Vec::new(),
            forward_listeners: Vec::new(),
            direct: false,
            colocated: false,
            dispatchers: 1,
            lb_backend_connections: 1,
            lb_route_by_name: false,
            remote_agents: 0,
        }
    }
}

impl StackBuilder {
    pub fn servers(mut self, n: usize) -> Self {
        self.servers = n;
        self
    }

    /// Zone of each server in order (the rest get `"zone-<i>"`).
    pub fn zones(mut self, zones: &[&str]) -> Self {
        self.zones = zones.iter().map(|z| z.to_string()).collect();
        self
    }

    /// Server id of each server in order (the rest get `"ts-<i>"`).
    pub fn server_ids(mut self, ids: &[&str]) -> Self {
        self.server_ids = ids.iter().map(|z| z.to_string()).collect();
        self
    }

    /// Puts the load-balancer fixture in front of the servers with this placement; the
    /// agent then dials only the fixture.
    pub fn placement(mut self, policy: Policy) -> Self {
        self.placement = Some(policy);
        self
    }

    pub fn coverage(mut self, coverage: CoverageConfig) -> Self {
        self.coverage = coverage;
        self
    }

    pub fn upstream_latency(mut self, d: Duration) -> Self {
        self.upstream_latency = d;
        self
    }

    /// Binds the dispatcher's HTTP front here instead of `127.0.0.1:0`.
    pub fn front(mut self, addr: SocketAddr) -> Self {
        self.front = Some(addr);
        self
    }

    pub fn tunnel_config(mut self, f: impl FnOnce(&mut relay_tunnel_server::Config)) -> Self {
        f(&mut self.tunnel);
        self
    }

    pub fn dispatcher_config(mut self, f: impl FnOnce(&mut relay_dispatcher::Config)) -> Self {
        f(&mut self.dispatcher);
        self
    }

    /// Adjusts the agent's config after the stack filled in endpoints, token and upstream.
    pub fn agent_config(
        mut self,
        f: impl FnOnce(&mut relay_agent::Config) + Send + 'static,
    ) -> Self {
        self.agent_cfg = Some(Box::new(f));
        self
    }

    /// Only the first `n` tunnel servers report to the dispatcher; the others hold the
    /// agent's streams where no call is ever routed (the incident's "idle streams on
    /// other servers").
    pub fn routed_servers(mut self, n: usize) -> Self {
        self.routed = Some(n);
        self
    }

    /// Starts `n` agents (default 1), agent `i` with [`agent_identity`]`(i)`; the
    /// [`StackBuilder::agent_config`] tweak applies to each.
    pub fn agents(mut self, n: usize) -> Self {
        self.agents = n;
        self
    }

    /// Adds `n` server slots that start down (`ts-{servers+1}`..): bring one up with
    /// [`Stack::start_server`]. With the load-balancer fixture they are backends marked
    /// down until then.
    pub fn standby_servers(mut self, n: usize) -> Self {
        self.standby = n;
        self
    }

    /// Runs each component on its own runtime.
    pub fn runtimes(mut self, runtimes: Runtimes) -> Self {
        self.runtimes = Some(runtimes);
        self
    }

    /// Upstream delay drawn per request (overrides [`StackBuilder::upstream_latency`]).
    pub fn upstream_latency_fn(mut self, f: impl Fn() -> Duration + Send + Sync + 'static) -> Self {
        self.upstream_latency_fn = Some(Arc::new(f));
        self
    }

    /// Seed of the load-balancer fixture's random placement (default 7).
    pub fn lb_seed(mut self, seed: u64) -> Self {
        self.lb_seed = seed;
        self
    }

    /// Binds server `i`'s agent-facing listener on `addrs[i]` (the rest on port 0), so a
    /// load balancer configured before the stack starts (a real HAProxy) can point there.
    /// The agent listeners of the first servers, bound by the caller (who needed their
    /// addresses first, e.g. for a load balancer's config): no other socket can take the
    /// port in between, as one can between picking a free address and binding it.
    pub fn server_agent_listeners(mut self, listeners: Vec<std::net::TcpListener>) -> Self {
        self.agent_listeners = listeners.into_iter().map(Some).collect();
        self
    }

    /// Server `i` serves its forward listener on `listener` and has dispatchers dial it at
    /// `url` (a [`crate::fault::Forwarder`] in front of the listener, say).
    pub fn server_forward_listener(
        mut self,
        i: usize,
        listener: std::net::TcpListener,
        url: String,
    ) -> Self {
        if self.forward_listeners.len() <= i {
            self.forward_listeners.resize_with(i + 1, || None);
        }
        self.forward_listeners[i] = Some((listener, url));
        self
    }

    pub fn server_agent_addrs(mut self, addrs: Vec<SocketAddr>) -> Self {
        self.agent_addrs = addrs;
        self
    }

    /// Every tunnel server advertises its own agent listener as its `direct_url`
    /// (placement-aware growth bypasses the load-balancer fixture).
    pub fn direct_urls(mut self, on: bool) -> Self {
        self.direct = on;
        self
    }

    /// Runs `n` dispatchers (default 1; at least 1), each with the same config on listeners
    /// of its own; every tunnel server reports to each of them (its `dispatchers` lists
    /// their registry listeners), so each routes every tunnel id. Not with `colocated`.
    pub fn dispatchers(mut self, n: usize) -> Self {
        self.dispatchers = n.max(1);
        self
    }

    /// The load-balancer fixture reaches each server over `n` connections (default 1):
    /// a server takes at most 4096 streams a connection.
    pub fn lb_backend_connections(mut self, n: usize) -> Self {
        self.lb_backend_connections = n.max(1);
        self
    }

    /// The load-balancer fixture routes a stream that names a server (`relay-server`, the
    /// agents' `[coverage] steered_opens`) to it ([`crate::lb::LbBuilder::route_by_name`]).
    pub fn lb_route_by_name(mut self, on: bool) -> Self {
        self.lb_route_by_name = on;
        self
    }

    /// The servers also accept the tokens of agents `0..n` ([`agent_identity`]) run
    /// elsewhere (the load tester's worker processes), besides the agents started here.
    pub fn remote_agents(mut self, n: usize) -> Self {
        self.remote_agents = n;
        self
    }

    /// Starts no agent (tests that script their own).
    pub fn without_agent(mut self) -> Self {
        self.agent = false;
        self
    }

    /// The co-located mode: the first tunnel server also runs the dispatcher (its front,
    /// registry and admin listeners are the stack's dispatcher addresses); other servers
    /// report to it as to a separate dispatcher.
    pub fn colocated(mut self) -> Self {
        self.colocated = true;
        self
    }

    pub async fn start(mut self) -> anyhow::Result<Stack> {
        let stop = CancellationToken::new();
        let mut tasks = Vec::new();
        let rts = self.runtimes.clone();
        let mut ub = Upstream::builder().latency(self.upstream_latency);
        if let Some(f) = self.upstream_latency_fn.clone() {
            ub = ub.latency_fn(move || f());
        }
        let upstream = on_rt(rts.as_ref().map(|r| &r.upstream), ub.spawn()).await??;

        let any = || TcpListener::bind("127.0.0.1:0");
        let front = match self.front {
            Some(a) => TcpListener::bind(a).await?,
            None => any().await?,
        };
        let dl = relay_dispatcher::Listeners {
            http: front,
            registry: any().await?,
            admin: any().await?,
        };
        let http = dl.http.local_addr()?;
        let registry = dl.registry.local_addr()?;
        let dispatcher_admin = dl.admin.local_addr()?;
        let mut dispatchers = vec![DispatcherAddrs {
            http,
            registry,
            admin: dispatcher_admin,
        }];
        let mut more_listeners = Vec::new();
        if !self.colocated {
            for _ in 1..self.dispatchers {
                let l = relay_dispatcher::Listeners {
                    http: any().await?,
                    registry: any().await?,
                    admin: any().await?,
                };
                dispatchers.push(DispatcherAddrs {
                    http: l.http.local_addr()?,
                    registry: l.registry.local_addr()?,
                    admin: l.admin.local_addr()?,
                });
                more_listeners.push(l);
            }
        }
        let mut dcfg = self.dispatcher;
        // Hops the test left unset run plain text (`insecure = true`); a test that sets a
        // TLS section gets TLS there and `https://` URLs.
        plain_unless_set(&mut dcfg.tls);
        plain_unless_set(&mut dcfg.registry_tls);
        dial_plain_unless_set(&mut dcfg.forward_tls);
        let registry_scheme = scheme(dcfg.registry_tls.insecure);
        // The dispatcher keeps the digest of the key; the servers present the key itself.
        // A test that sets its own dispatcher server key sets the servers' key as well.
        if dcfg.registry.server_key_digest().is_none() {
            dcfg.registry.server_key = Some(relay_common::KeyDigest::of(SERVER_KEY.as_bytes()));
        }
        let server_key = Secret::new(SERVER_KEY);
        if dcfg.callers.is_empty() {
            // Load tests send bursts of thousands of calls from this one caller.
            dcfg.callers = vec![relay_dispatcher::config::CallerConfig {
                max_concurrent_calls: HARNESS_CALLER_MAX_CALLS,
                ..relay_dispatcher::config::CallerConfig::allow_all("dev", CALLER_KEY)
            }];
        }
        let mut front = None;
        if self.colocated {
            front = Some(relay_tunnel_server::Front {
                config: dcfg,
                listeners: dl,
            });
        } else {
            for dl in std::iter::once(dl).chain(more_listeners) {
                let (s, dcfg) = (stop.clone(), dcfg.clone());
                let dispatcher = async move {
                    if let Err(e) = relay_dispatcher::run(dcfg, dl, s.cancelled_owned()).await {
                        tracing::error!(error = %e, "dispatcher stopped");
                    }
                };
                tasks.push(match rts.as_ref() {
                    Some(r) => r.dispatcher.spawn(dispatcher),
                    None => tokio::spawn(dispatcher),
                });
            }
        }
        let agent_count = if self.agent { self.agents } else { 0 };
        let mut tokens = TokenStore::single(TOKEN, TUNNEL_ID);
        for i in 1..agent_count.max(self.remote_agents) {
            let (token, id) = agent_identity(i);
            tokens.add(&token, &id);
        }
        let mut slots = Vec::new();
        let mut tunnel_cfg = self.tunnel;
        plain_unless_set(&mut tunnel_cfg.agent_tls);
        plain_unless_set(&mut tunnel_cfg.forward_tls);
        dial_plain_unless_set(&mut tunnel_cfg.dispatcher_tls);
        let agent_scheme = scheme(tunnel_cfg.agent_tls.insecure);

        let mut servers = Vec::new();
        for i in 0..self.servers + self.standby {
            let mut cfg = tunnel_cfg.clone();
            cfg.server_id = self
                .server_ids
                .get(i)
                .cloned()
                .unwrap_or_else(|| format!("ts-{}", i + 1));
            cfg.zone = self
                .zones
                .get(i)
                .cloned()
                .unwrap_or_else(|| format!("zone-{}", i + 1));
            cfg.dispatchers = if self.routed.is_none_or(|n| i < n) {
                dispatchers
                    .iter()
                    .map(|d| format!("{registry_scheme}://{}", d.registry))
                    .collect()
            } else {
                vec![]
            };
            cfg.dispatcher_key.get_or_insert_with(|| server_key.clone());
            if i >= self.servers {
                slots.push(cfg);
                servers.push(None);
                continue;
            }
            let l = relay_tunnel_server::Listeners {
                agent: match (
                    self.agent_listeners.get_mut(i).and_then(Option::take),
                    self.agent_addrs.get(i),
                ) {
                    (Some(l), _) => {
                        l.set_nonblocking(true)?;
                        TcpListener::from_std(l)?
                    }
                    (None, Some(a)) => TcpListener::bind(a).await?,
                    (None, None) => any().await?,
                },
                forward: match self.forward_listeners.get_mut(i).and_then(Option::take) {
                    Some((l, url)) => {
                        l.set_nonblocking(true)?;
                        cfg.forward_url = Some(url);
                        TcpListener::from_std(l)?
                    }
                    None => any().await?,
                },
                admin: any().await?,
            };
            if self.direct {
                cfg.direct_url = Some(format!("{agent_scheme}://{}", l.agent.local_addr()?));
            }
            if let Some(r) = rts.as_ref() {
                cfg.cpu_source = r.server_cpu(i);
            }
            let handle = on_rt(
                rts.as_ref().map(|r| r.server(i)),
                relay_tunnel_server::start_with_front(
                    cfg.clone(),
                    tokens.clone(),
                    l,
                    if i == 0 { front.take() } else { None },
                ),
            )
            .await??;
            slots.push(cfg);
            servers.push(Some(handle));
        }
        let lb = match self.placement {
            Some(policy) => {
                // Standby slots point at the first live server until they come up.
                let first = servers.iter().flatten().map(|s| s.agent_addr).next();
                let addrs: Vec<SocketAddr> = servers
                    .iter()
                    .map(|s| s.as_ref().map(|s| s.agent_addr))
                    .map(|a| {
                        a.or(first)
                            .unwrap_or_else(|| SocketAddr::from(([127, 0, 0, 1], 9)))
                    })
                    .collect();
                let mut b = LoadBalancer::builder()
                    .backends(addrs)
                    .policy(policy)
                    .seed(self.lb_seed)
                    .backend_connections(self.lb_backend_connections);
                if self.lb_route_by_name {
                    b = b.route_by_name(slots.iter().map(|c| c.server_id.clone()).collect());
                }
                let lb = on_rt(rts.as_ref().map(|r| &r.lb), b.spawn()).await??;
                for (i, s) in servers.iter().enumerate() {
                    if s.is_none() {
                        lb.set_backend_down(i, true);
                    }
                }
                Some(lb)
            }
            None => None,
        };
        let tunnels = tunnels_for_agents(&lb, &servers, agent_scheme);
        let mut agent_admin = None;
        let mut agents = Vec::new();
        if agent_count > 0 {
            let mut template = relay_agent::Config {
                tunnels,
                token: Secret::new(TOKEN),
                upstream: upstream.url(),
                coverage: self.coverage,
                // Accept filters are default deny; the harness allows every method and path.
                allow: vec![relay_agent::config::AllowRule {
                    name: Some("harness-all".into()),
                    methods: vec!["*".into()],
                    path: "/**".into(),
                    ..Default::default()
                }],
                // Plain when the servers are; a TLS stack sets `[tls]` in its agent tweak.
                tls: if agent_scheme == "http" {
                    relay_common::tls::DialerTls::insecure()
                } else {
                    relay_common::tls::DialerTls::default()
                },
                ..relay_agent::Config::default()
            };
            if let Some(f) = self.agent_cfg {
                f(&mut template);
            }
            for i in 0..agent_count {
                let (token, tunnel_id) = agent_identity(i);
                let mut cfg = template.clone();
                if i > 0 {
                    cfg.token = Secret::new(&token);
                }
                let admin = any().await?;
                let addr = admin.local_addr()?;
                if i == 0 {
                    agent_admin = Some(addr);
                }
                let handle = spawn_agent(rts.as_ref(), cfg.clone(), admin);
                agents.push(AgentSlot {
                    tunnel_id,
                    cfg,
                    admin: addr,
                    handle,
                });
            }
        }
        let agent_tunnels = tunnels_for_agents(&lb, &servers, agent_scheme);
        Ok(Stack {
            http,
            dispatcher_admin,
            dispatchers,
            agent_tunnels,
            registry,
            agent_admin,
            servers,
            lb,
            upstream,
            stop,
            tasks,
            agents,
            slots,
            tokens,
            runtimes: rts,
            registries: Vec::new(),
            agent_registries: Vec::new(),
            last_addrs: Default::default(),
            direct: self.direct,
        })
    }
}

/// What the agents dial: the load balancer, or else every running server.
fn tunnels_for_agents(
    lb: &Option<LbHandle>,
    servers: &[Option<TunnelServerHandle>],
    agent_scheme: &str,
) -> Vec<String> {
    match lb {
        Some(lb) => vec![lb.url()],
        None => servers
            .iter()
            .flatten()
            .map(|s| format!("{agent_scheme}://{}", s.agent_addr))
            .collect(),
    }
}

/// One dispatcher's listeners.
#[derive(Clone, Copy, Debug)]
pub struct DispatcherAddrs {
    /// The HTTP front callers use.
    pub http: SocketAddr,
    /// The registry listener the tunnel servers report to.
    pub registry: SocketAddr,
    pub admin: SocketAddr,
}

fn scheme(insecure: bool) -> &'static str {
    if insecure {
        "http"
    } else {
        "https"
    }
}

/// A listener section the test did not set becomes `insecure = true`.
fn plain_unless_set(t: &mut relay_common::tls::ListenerTls) {
    if *t == relay_common::tls::ListenerTls::default() {
        *t = relay_common::tls::ListenerTls::insecure();
    }
}

/// A dialer section the test did not set becomes `insecure = true`.
fn dial_plain_unless_set(t: &mut relay_common::tls::DialerTls) {
    if *t == relay_common::tls::DialerTls::default() {
        *t = relay_common::tls::DialerTls::insecure();
    }
}

pub struct Stack {
    /// The dispatcher's HTTP front.
    pub http: SocketAddr,
    pub dispatcher_admin: SocketAddr,
    /// Every dispatcher, the first one (`http`, `dispatcher_admin`, `registry`) first.
    pub dispatchers: Vec<DispatcherAddrs>,
    /// The `tunnels` the stack's agents dial (the load balancer, or every server as
    /// started), for agents run elsewhere.
    pub agent_tunnels: Vec<String>,
    /// The dispatcher's registry listener (tunnel servers' reports).
    pub registry: SocketAddr,
    pub agent_admin: Option<SocketAddr>,
    /// Tunnel servers; `None` once killed.
    pub servers: Vec<Option<TunnelServerHandle>>,
    pub lb: Option<LbHandle>,
    pub upstream: UpstreamHandle,
    stop: CancellationToken,
    tasks: Vec<JoinHandle<()>>,
    agents: Vec<AgentSlot>,
    /// Config of each server slot (id, zone, dispatchers), for restarts.
    slots: Vec<relay_tunnel_server::Config>,
    tokens: TokenStore,
    runtimes: Option<Runtimes>,
    /// Registries of server incarnations that were stopped, by slot.
    registries: Vec<(usize, prometheus::Registry)>,
    /// Registries of agent incarnations that were taken away, by agent.
    agent_registries: Vec<(usize, prometheus::Registry)>,
    /// Listener addresses of stopped servers, by slot, to restart them on the same ports.
    last_addrs: std::collections::HashMap<usize, (SocketAddr, SocketAddr, SocketAddr)>,
    /// Servers advertise their agent listener as `direct_url`.
    direct: bool,
}

struct AgentSlot {
    tunnel_id: String,
    cfg: relay_agent::Config,
    admin: SocketAddr,
    /// `None` if the agent failed to start (logged) or is restarting.
    handle: Option<relay_agent::AgentHandle>,
}

/// Starts one agent on its runtime; a start error is logged, as `relay_agent::run` would.
fn spawn_agent(
    rts: Option<&Runtimes>,
    cfg: relay_agent::Config,
    admin: TcpListener,
) -> Option<relay_agent::AgentHandle> {
    let _guard = rts.map(|r| r.agents.enter());
    match relay_agent::start(cfg, admin) {
        Ok(h) => Some(h),
        Err(e) => {
            tracing::error!(error = %e, "agent stopped");
            None
        }
    }
}

impl Stack {
    pub fn builder() -> StackBuilder {
        StackBuilder::default()
    }

    /// A backend with the stack's caller key.
    pub fn caller(&self) -> Caller {
        Caller::new(self.http, Some(CALLER_KEY))
    }

    /// Polls until a call through the relay answers 200, or fails at the deadline.
    pub async fn wait_routable(&self, within: Duration) -> anyhow::Result<()> {
        let caller = &self.caller();
        let what = format!("tunnel id {TUNNEL_ID} routable");
        crate::poll::until(what, within, || async move {
            match caller.get(&format!("/relay/{TUNNEL_ID}/hello")).await {
                Ok(a) if a.status == 200 => Ok(()),
                last => Err(format!("last answer {last:?}")),
            }
        })
        .await?;
        Ok(())
    }

    /// The agent's `/systemcheck` JSON (and HTTP status).
    pub async fn systemcheck(&self) -> anyhow::Result<(u16, serde_json::Value)> {
        let addr = self
            .agent_admin
            .ok_or_else(|| anyhow::anyhow!("no agent"))?;
        let a = Caller::new(addr, None).get("/systemcheck").await?;
        Ok((a.status.as_u16(), a.json()))
    }

    /// Number of agents started (their indexes for [`agent_identity`]).
    pub fn agent_count(&self) -> usize {
        self.agents.len()
    }

    /// Tunnel ids of the agents, in agent order.
    pub fn tunnel_ids(&self) -> Vec<String> {
        self.agents.iter().map(|a| a.tunnel_id.clone()).collect()
    }

    /// Agent `i`'s handle (metrics registry, coverage view, systemcheck), if running.
    pub fn agent(&self, i: usize) -> Option<&relay_agent::AgentHandle> {
        self.agents.get(i).and_then(|a| a.handle.as_ref())
    }

    /// Agent `i`'s admin listener address.
    pub fn agent_admin_addr(&self, i: usize) -> Option<SocketAddr> {
        self.agents.get(i).map(|a| a.admin)
    }

    /// Stops agent `i` (its streams retire gracefully) and starts it again with the same
    /// config, on the same admin port when it is free.
    pub async fn restart_agent(&mut self, i: usize) -> anyhow::Result<()> {
        let slot = self
            .agents
            .get_mut(i)
            .ok_or_else(|| anyhow::anyhow!("no agent {i}"))?;
        if let Some(h) = slot.handle.take() {
            let _ = tokio::time::timeout(Duration::from_secs(15), h.shutdown()).await;
        }
        self.respawn_agent(i).await
    }

    /// Server id of slot `i` (`ts-{i+1}` unless the builder named it), running or not.
    pub fn server_id(&self, i: usize) -> Option<&str> {
        self.slots.get(i).map(|c| c.server_id.as_str())
    }

    /// Metric registries of every server incarnation so far, by slot: running ones and
    /// ones killed, drained or restarted (so totals survive faults).
    pub fn server_registries(&self) -> Vec<(usize, prometheus::Registry)> {
        let mut out = self.registries.clone();
        for (i, s) in self.servers.iter().enumerate() {
            if let Some(s) = s {
                out.push((i, s.registry.clone()));
            }
        }
        out
    }

    /// Crashes server `i` (no drain, no goodbye); with the load-balancer fixture the
    /// backend is marked down. False if it was not running.
    pub fn kill_server(&mut self, i: usize) -> bool {
        let Some(s) = self.servers.get_mut(i).and_then(Option::take) else {
            return false;
        };
        if let Some(lb) = &self.lb {
            lb.set_backend_down(i, true);
        }
        self.registries.push((i, s.registry.clone()));
        self.last_addrs
            .insert(i, (s.agent_addr, s.forward_addr, s.admin_addr));
        s.abort();
        true
    }

    /// Drains and stops server `i` gracefully (as on SIGTERM); with the load-balancer
    /// fixture the backend is marked down first. False if it was not running.
    pub async fn drain_server(&mut self, i: usize) -> bool {
        match self.take_server(i) {
            Some(s) => {
                s.shutdown().await;
                true
            }
            None => false,
        }
    }

    /// Takes server `i` out of the stack (the load-balancer fixture marks it down) and
    /// hands it over still running, so the caller can drain it (`shutdown`) without
    /// holding the stack.
    pub fn take_server(&mut self, i: usize) -> Option<TunnelServerHandle> {
        let s = self.servers.get_mut(i).and_then(Option::take)?;
        if let Some(lb) = &self.lb {
            lb.set_backend_down(i, true);
        }
        self.registries.push((i, s.registry.clone()));
        self.last_addrs
            .insert(i, (s.agent_addr, s.forward_addr, s.admin_addr));
        Some(s)
    }

    /// Takes agent `i`'s handle out (to stop it without holding the stack); start it
    /// again with [`Stack::respawn_agent`].
    pub fn take_agent(&mut self, i: usize) -> Option<relay_agent::AgentHandle> {
        let h = self.agents.get_mut(i).and_then(|a| a.handle.take());
        if let Some(h) = &h {
            self.agent_registries.push((i, h.registry().clone()));
        }
        h
    }

    /// Metric registries of every agent incarnation so far, by agent, each with whether
    /// it is the running one: running ones and ones taken away (so totals survive
    /// restarts).
    pub fn agent_registries(&self) -> Vec<(usize, prometheus::Registry, bool)> {
        let mut out: Vec<_> = self
            .agent_registries
            .iter()
            .map(|(i, r)| (*i, r.clone(), false))
            .collect();
        for (i, a) in self.agents.iter().enumerate() {
            if let Some(h) = &a.handle {
                out.push((i, h.registry().clone(), true));
            }
        }
        out
    }

    /// Starts agent `i` again with its config if it is not running.
    pub async fn respawn_agent(&mut self, i: usize) -> anyhow::Result<()> {
        let slot = self
            .agents
            .get_mut(i)
            .ok_or_else(|| anyhow::anyhow!("no agent {i}"))?;
        if slot.handle.is_some() {
            return Ok(());
        }
        let admin = match TcpListener::bind(slot.admin).await {
            Ok(l) => l,
            Err(_) => TcpListener::bind("127.0.0.1:0").await?,
        };
        slot.admin = admin.local_addr()?;
        slot.handle = spawn_agent(self.runtimes.as_ref(), slot.cfg.clone(), admin);
        if i == 0 {
            self.agent_admin = Some(slot.admin);
        }
        anyhow::ensure!(slot.handle.is_some(), "agent {i} failed to start again");
        Ok(())
    }

    /// Starts server slot `i` (a standby slot, or one killed or drained) with the same
    /// server id, on its previous ports when they are free; the load-balancer fixture
    /// sends new streams there again. Errors if it is running.
    pub async fn start_server(&mut self, i: usize) -> anyhow::Result<()> {
        let mut cfg = self
            .slots
            .get(i)
            .cloned()
            .ok_or_else(|| anyhow::anyhow!("no server slot {i}"))?;
        anyhow::ensure!(
            self.servers[i].is_none(),
            "server {} is running",
            cfg.server_id
        );
        let bind = |port: Option<SocketAddr>| async move {
            match port {
                Some(a) => match TcpListener::bind(a).await {
                    Ok(l) => Ok(l),
                    Err(_) => TcpListener::bind("127.0.0.1:0").await,
                },
                None => TcpListener::bind("127.0.0.1:0").await,
            }
        };
        let prev = self.last_addrs.get(&i).copied();
        let l = relay_tunnel_server::Listeners {
            agent: bind(prev.map(|p| p.0)).await?,
            forward: bind(prev.map(|p| p.1)).await?,
            admin: bind(prev.map(|p| p.2)).await?,
        };
        if self.direct {
            let agent_scheme = scheme(cfg.agent_tls.insecure);
            cfg.direct_url = Some(format!("{agent_scheme}://{}", l.agent.local_addr()?));
        }
        if let Some(r) = self.runtimes.as_ref() {
            cfg.cpu_source = r.server_cpu(i);
        }
        let handle = on_rt(
            self.runtimes.as_ref().map(|r| r.server(i)),
            relay_tunnel_server::start(cfg, self.tokens.clone(), l),
        )
        .await??;
        if let Some(lb) = &self.lb {
            lb.set_backend_addr(i, handle.agent_addr);
            lb.set_backend_down(i, false);
        }
        self.servers[i] = Some(handle);
        Ok(())
    }

    /// Stops everything gracefully, from the agent inward: agent, tunnel servers,
    /// dispatcher.
    pub async fn shutdown(mut self) {
        let agents = self.agents.iter_mut().filter_map(|a| a.handle.take());
        futures::future::join_all(
            agents.map(|h| tokio::time::timeout(Duration::from_secs(15), h.shutdown())),
        )
        .await;
        for s in self.servers.iter_mut().filter_map(Option::take) {
            s.shutdown().await;
        }
        self.stop.cancel();
        for t in self.tasks.drain(..) {
            let _ = tokio::time::timeout(Duration::from_secs(15), t).await;
        }
        if let Some(lb) = self.lb.take() {
            lb.shutdown().await;
        }
    }
}
