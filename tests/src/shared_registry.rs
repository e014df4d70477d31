//! Two dispatchers sharing one Redis, in process: the fleet the shared-registry tests run
//! (ts-1 reporting to the first dispatcher, ts-2 to the second, one agent replica per
//! server), and readers of a dispatcher's `/debug/routes`. The Redis itself is
//! [`crate::redis`]'s. This module must not decide what a test asserts.

use crate::client::Caller;
use crate::eventually;
use crate::stack::{CALLER_KEY, TOKEN, TUNNEL_ID};
use crate::upstream::{Upstream, UpstreamHandle};
use relay_agent::coverage::plan::CoverageConfig;
use relay_common::Secret;
use relay_dispatcher::config::RedisTls;
use relay_dispatcher::RegistryBackend;
use relay_tunnel_server::{TokenStore, TunnelServerHandle};
use std::net::SocketAddr;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// How long the fleet may take to route as asked.
const READY: Duration = Duration::from_secs(20);

/// A dispatcher admin listener's answer to `GET path`: status and JSON body (`0` and null
/// when it does not answer).
pub async fn admin_json(addr: SocketAddr, path: &str) -> (u16, serde_json::Value) {
    match Caller::new(addr, None).get(path).await {
        Ok(a) => (a.status.as_u16(), a.json()),
        Err(_) => (0, serde_json::Value::Null),
    }
}

/// The `demo` entry of a dispatcher's `/debug/routes`.
pub async fn demo_route(admin: SocketAddr) -> serde_json::Value {
    let (_, routes) = admin_json(admin, "/debug/routes").await;
    routes["tunnels"]
        .as_array()
        .and_then(|t| t.iter().find(|t| t["tunnel_id"] == TUNNEL_ID).cloned())
        .unwrap_or(serde_json::Value::Null)
}

/// A route's servers.
pub fn servers_of(route: &serde_json::Value) -> Vec<serde_json::Value> {
    route["servers"].as_array().cloned().unwrap_or_default()
}

/// A server's load figure `key` (`idle`, `busy`, ...) in a route; 0 when absent.
pub fn figure(server: &serde_json::Value, key: &str) -> u64 {
    server["load"][key].as_u64().unwrap_or(0)
}

/// The shared registry's `refresh_interval`, `redis_timeout` and `lease` (the default) in
/// these fleets.
pub const REFRESH: Duration = Duration::from_millis(200);
pub const REDIS_TIMEOUT: Duration = Duration::from_millis(500);
pub const LEASE: Duration = Duration::from_secs(3);
/// `[registry] record_key` of every dispatcher in these fleets.
pub const RECORD_KEY: &str = "test-record-key-0123456789abcdef-0123456789";

/// An in-process dispatcher on the shared registry.
pub struct DispatcherUnderTest {
    pub http: SocketAddr,
    pub registry: SocketAddr,
    pub admin: SocketAddr,
    pub handle: relay_dispatcher::DispatcherHandle,
}

impl DispatcherUnderTest {
    pub async fn shutdown(self) {
        let _ = tokio::time::timeout(Duration::from_secs(10), self.handle.shutdown()).await;
    }
}

/// A listener on a free loopback port.
pub async fn any() -> TcpListener {
    TcpListener::bind("127.0.0.1:0").await.unwrap()
}

/// A dispatcher on the shared registry at `redis_url`, with `[registry.redis_tls]`.
pub async fn start_dispatcher_on(
    redis_url: &str,
    prefix: &str,
    tls: RedisTls,
) -> DispatcherUnderTest {
    let cfg = relay_dispatcher::Config {
        callers: vec![relay_dispatcher::CallerConfig::allow_all("dev", CALLER_KEY)],
        call_timeout: Duration::from_secs(10),
        registry: relay_dispatcher::RegistryConfig {
            backend: RegistryBackend::Redis,
            url: Some(Secret::new(redis_url)),
            key_prefix: prefix.to_string(),
            refresh_interval: REFRESH,
            redis_timeout: REDIS_TIMEOUT,
            server_key: Some(relay_common::KeyDigest::of(b"fleet-key")),
            record_key: Some(Secret::new(RECORD_KEY)),
            redis_tls: tls,
            ..Default::default()
        },
        ..relay_dispatcher::Config::default().insecure()
    };
    let listeners = relay_dispatcher::Listeners {
        http: any().await,
        registry: any().await,
        admin: any().await,
    };
    let handle = relay_dispatcher::start(cfg, listeners)
        .await
        .unwrap_or_else(|e| panic!("dispatcher failed: {e}"));
    DispatcherUnderTest {
        http: handle.http_addr,
        registry: handle.registry_addr,
        admin: handle.admin_addr,
        handle,
    }
}

/// An in-process tunnel server reporting to the dispatcher's registry listener at
/// `dispatcher`, with the fleet's dispatcher key.
pub async fn start_server(id: &str, dispatcher: SocketAddr) -> TunnelServerHandle {
    let cfg = relay_tunnel_server::Config {
        server_id: id.to_string(),
        dispatchers: vec![format!("http://{dispatcher}")],
        dispatcher_key: Some(Secret::new("fleet-key")),
        ..relay_tunnel_server::Config::default().insecure()
    };
    let l = relay_tunnel_server::Listeners {
        agent: any().await,
        forward: any().await,
        admin: any().await,
    };
    relay_tunnel_server::start(cfg, TokenStore::single(TOKEN, TUNNEL_ID), l)
        .await
        .unwrap()
}

/// Two dispatchers on one Redis, ts-1 reporting to the first and ts-2 to the second, and
/// one agent replica of the tunnel id per server, each dialing its server alone: an agent
/// dialing both would place each stream on a server at random, and all of one pool on one server (1
/// start in 128 with 8 streams) leaves the other without streams.
pub struct TwoDispatchers {
    pub upstream: UpstreamHandle,
    pub dispatchers: Vec<DispatcherUnderTest>,
    pub servers: Vec<Option<TunnelServerHandle>>,
    pub agent_stop: CancellationToken,
    pub agents: Vec<tokio::task::JoinHandle<()>>,
}

impl TwoDispatchers {
    pub async fn start(redis_url: &str, prefix: &str) -> TwoDispatchers {
        TwoDispatchers::start_on(redis_url, prefix, RedisTls::default()).await
    }

    /// With `[registry.redis_tls]` on both dispatchers.
    pub async fn start_on(redis_url: &str, prefix: &str, tls: RedisTls) -> TwoDispatchers {
        let upstream = Upstream::builder().spawn().await.unwrap();
        let d1 = start_dispatcher_on(redis_url, prefix, tls.clone()).await;
        let d2 = start_dispatcher_on(redis_url, prefix, tls).await;
        let s1 = start_server("ts-1", d1.registry).await;
        let s2 = start_server("ts-2", d2.registry).await;
        let agent_stop = CancellationToken::new();
        let mut agents = Vec::new();
        for server in [&s1, &s2] {
            let cfg = relay_agent::Config {
                tunnels: vec![format!("http://{}", server.agent_addr)],
                token: Secret::new(TOKEN),
                upstream: upstream.url(),
                coverage: CoverageConfig {
                    enabled: false,
                    fixed_streams: 8,
                    ..CoverageConfig::default()
                },
                allow: vec![relay_agent::config::AllowRule {
                    name: Some("test-all".into()),
                    methods: vec!["*".into()],
                    path: "/**".into(),
                    ..Default::default()
                }],
                ..relay_agent::Config::default().insecure()
            };
            let admin = any().await;
            let s = agent_stop.clone();
            agents.push(tokio::spawn(async move {
                let _ = relay_agent::run(cfg, admin, s.cancelled_owned()).await;
            }));
        }
        TwoDispatchers {
            upstream,
            dispatchers: vec![d1, d2],
            servers: vec![Some(s1), Some(s2)],
            agent_stop,
            agents,
        }
    }

    /// Waits until dispatcher `d` routes `demo` to every server in `ids`.
    pub async fn wait_sees(&self, d: usize, ids: &[&str]) {
        let admin = self.dispatchers[d].admin;
        let ids: Vec<String> = ids.iter().map(|s| s.to_string()).collect();
        eventually(
            &format!("dispatcher {d} routes {TUNNEL_ID} to {ids:?}"),
            READY,
            || {
                let ids = ids.clone();
                async move {
                    let route = demo_route(admin).await;
                    let seen: Vec<String> = servers_of(&route)
                        .iter()
                        .filter(|s| figure(s, "idle") + figure(s, "busy") > 0)
                        .filter_map(|s| s["server_id"].as_str().map(str::to_string))
                        .collect();
                    ids.iter().all(|i| seen.contains(i))
                }
            },
        )
        .await;
    }

    pub fn caller(&self, d: usize) -> Caller {
        Caller::new(self.dispatchers[d].http, Some(CALLER_KEY))
    }

    pub async fn shutdown(mut self) {
        self.agent_stop.cancel();
        for agent in self.agents {
            let _ = tokio::time::timeout(Duration::from_secs(10), agent).await;
        }
        for s in self.servers.iter_mut().filter_map(Option::take) {
            s.shutdown().await;
        }
        for d in self.dispatchers {
            d.shutdown().await;
        }
        self.upstream.shutdown().await;
    }
}

/// A key prefix of this test process's own, so tests sharing one Redis do not meet.
pub fn unique_prefix(name: &str) -> String {
    format!("relay-test-{name}-{}", std::process::id())
}
