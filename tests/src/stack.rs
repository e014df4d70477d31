//! The whole relay in one process on loopback: a simulated upstream, one dispatcher,
//! several tunnel servers (optionally behind the stream-placing load-balancer fixture) and
//! one agent, each started through its library's `run`/`start` on `127.0.0.1:0`.
//!
//! Used by the end-to-end tests, the `relay-fleet demo` and the load tester. Builders
//! choose the shape; `Stack` exposes the addresses and the handles to inject faults.

use crate::client::Caller;
use crate::lb::{LbHandle, LoadBalancer, Policy};
use crate::upstream::{Upstream, UpstreamHandle};
use relay_agent::coverage::plan::CoverageConfig;
use relay_common::Secret;
use relay_tunnel_server::{TokenStore, TunnelServerHandle};
use std::net::SocketAddr;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

pub const TOKEN: &str = "dev-token";
pub const TUNNEL_ID: &str = "demo";
pub const CALLER_KEY: &str = "dev-caller-key";

/// Adjusts the agent's config once the stack has filled in endpoints, token and upstream.
type AgentTweak = Box<dyn FnOnce(&mut relay_agent::Config) + Send>;

pub struct StackBuilder {
    servers: usize,
    zones: Vec<String>,
    placement: Option<Policy>,
    coverage: CoverageConfig,
    upstream_latency: Duration,
    front: Option<SocketAddr>,
    tunnel: relay_tunnel_server::Config,
    dispatcher: relay_dispatcher::Config,
    agent: bool,
    agent_cfg: Option<AgentTweak>,
}

impl Default for StackBuilder {
    fn default() -> Self {
        StackBuilder {
            servers: 2,
            zones: vec![],
            placement: None,
            coverage: CoverageConfig::default(),
            upstream_latency: Duration::ZERO,
            front: None,
            tunnel: relay_tunnel_server::Config::default(),
            dispatcher: relay_dispatcher::Config::default(),
            agent: true,
            agent_cfg: None,
        }
    }
}

impl StackBuilder {
    pub fn servers(mut self, n: usize) -> Self {
        self.servers = n;
        self
    }

    /// Zone of each server in order (the rest get "zone-<i>").
    pub fn zones(mut self, zones: &[&str]) -> Self {
        self.zones = zones.iter().map(|z| z.to_string()).collect();
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

    /// Starts no agent (tests that script their own).
    pub fn without_agent(mut self) -> Self {
        self.agent = false;
        self
    }

    pub async fn start(self) -> anyhow::Result<Stack> {
        let stop = CancellationToken::new();
        let stop_agent = CancellationToken::new();
        let mut tasks = Vec::new();
        let mut agent_task = None;
        let upstream = Upstream::builder()
            .latency(self.upstream_latency)
            .spawn()
            .await?;

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
        let mut dcfg = self.dispatcher;
        dcfg.callers = vec![relay_dispatcher::config::CallerConfig {
            name: "dev".into(),
            key: Secret::new(CALLER_KEY),
        }];
        let s = stop.clone();
        tasks.push(tokio::spawn(async move {
            if let Err(e) = relay_dispatcher::run(dcfg, dl, s.cancelled_owned()).await {
                tracing::error!(error = %e, "dispatcher stopped");
            }
        }));

        let mut servers = Vec::new();
        for i in 0..self.servers {
            let mut cfg = self.tunnel.clone();
            cfg.server_id = format!("ts-{}", i + 1);
            cfg.zone = self
                .zones
                .get(i)
                .cloned()
                .unwrap_or_else(|| format!("zone-{}", i + 1));
            cfg.dispatchers = vec![format!("http://{registry}")];
            let l = relay_tunnel_server::Listeners {
                agent: any().await?,
                forward: any().await?,
                admin: any().await?,
            };
            servers.push(Some(
                relay_tunnel_server::start(cfg, TokenStore::single(TOKEN, TUNNEL_ID), l).await?,
            ));
        }
        let lb = match self.placement {
            Some(policy) => {
                let addrs = servers.iter().flatten().map(|s| s.agent_addr);
                Some(
                    LoadBalancer::builder()
                        .backends(addrs)
                        .policy(policy)
                        .seed(7)
                        .spawn()
                        .await?,
                )
            }
            None => None,
        };
        let tunnels: Vec<String> = match &lb {
            Some(lb) => vec![lb.url()],
            None => servers
                .iter()
                .flatten()
                .map(|s| format!("http://{}", s.agent_addr))
                .collect(),
        };
        let mut agent_admin = None;
        if self.agent {
            let admin = any().await?;
            agent_admin = Some(admin.local_addr()?);
            let mut cfg = relay_agent::Config {
                tunnels,
                token: Secret::new(TOKEN),
                upstream: upstream.url(),
                coverage: self.coverage,
                ..relay_agent::Config::default()
            };
            if let Some(f) = self.agent_cfg {
                f(&mut cfg);
            }
            let s = stop_agent.clone();
            agent_task = Some(tokio::spawn(async move {
                if let Err(e) = relay_agent::run(cfg, admin, s.cancelled_owned()).await {
                    tracing::error!(error = %e, "agent stopped");
                }
            }));
        }
        Ok(Stack {
            http,
            dispatcher_admin,
            agent_admin,
            servers,
            lb,
            upstream,
            stop,
            stop_agent,
            agent_task,
            tasks,
        })
    }
}

pub struct Stack {
    /// The dispatcher's HTTP front.
    pub http: SocketAddr,
    pub dispatcher_admin: SocketAddr,
    pub agent_admin: Option<SocketAddr>,
    /// Tunnel servers; `None` once killed.
    pub servers: Vec<Option<TunnelServerHandle>>,
    pub lb: Option<LbHandle>,
    pub upstream: UpstreamHandle,
    stop: CancellationToken,
    stop_agent: CancellationToken,
    agent_task: Option<JoinHandle<()>>,
    tasks: Vec<JoinHandle<()>>,
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
        let caller = self.caller();
        let deadline = Instant::now() + within;
        loop {
            let last = caller.get(&format!("/relay/{TUNNEL_ID}/hello")).await;
            if let Ok(a) = &last {
                if a.status == 200 {
                    return Ok(());
                }
            }
            if Instant::now() > deadline {
                anyhow::bail!(
                    "tunnel id {TUNNEL_ID} not routable within {within:?}: last answer {last:?}"
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The agent's `/systemcheck` JSON (and HTTP status).
    pub async fn systemcheck(&self) -> anyhow::Result<(u16, serde_json::Value)> {
        let addr = self
            .agent_admin
            .ok_or_else(|| anyhow::anyhow!("no agent"))?;
        let a = Caller::new(addr, None).get("/systemcheck").await?;
        Ok((a.status.as_u16(), a.json()))
    }

    /// Stops everything gracefully, from the agent inward: agent, tunnel servers,
    /// dispatcher.
    pub async fn shutdown(mut self) {
        self.stop_agent.cancel();
        if let Some(t) = self.agent_task.take() {
            let _ = tokio::time::timeout(Duration::from_secs(15), t).await;
        }
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
