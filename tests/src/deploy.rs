//! Fixtures of the deploy kit's checks: the operators' tools found on the machine
//! ([`tool`]), the relay's three binaries as a stack with TLS on every internal hop
//! ([`TlsStack`]), and a real Prometheus scraping it ([`Prometheus`]).

use crate::client::Caller;
use crate::procs::{binary, free_addr, metric, scrape, wait_http, wait_up, Proc, ScratchDir};
use crate::stack::{CALLER_KEY, SERVER_KEY, TOKEN, TUNNEL_ID};
use crate::upstream::{Upstream, UpstreamHandle};
use serde_json::Value;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The repository root.
pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ has a parent")
        .to_path_buf()
}

/// `name` from `$env`, `PATH`, `/usr/bin` or `/usr/sbin`; panics naming the Debian package.
pub fn tool(name: &str, env: &str, package: &str) -> PathBuf {
    if let Some(p) = std::env::var_os(env) {
        let p = PathBuf::from(p);
        assert!(p.is_file(), "{env}={} is not a file", p.display());
        return p;
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    let dirs = std::env::split_paths(&path).chain(["/usr/bin".into(), "/usr/sbin".into()]);
    for d in dirs {
        let p = d.join(name);
        if p.is_file() {
            return p;
        }
    }
    panic!(
        "{name} not found: install the Debian package `{package}` \
         (apt-get install -y --no-install-recommends {package}), or set {env} to the binary"
    );
}

/// A process of the TLS stack.
pub struct Node {
    pub proc: Proc,
    pub admin: SocketAddr,
    /// Its listeners, in the order its config was written with.
    pub ports: Vec<SocketAddr>,
}

/// Starts `bin` with the config `config(ports)` writes (on `n` fresh loopback ports, the
/// last one the admin listener), again on other ports if one was taken meanwhile.
pub async fn start_node(
    dir: &Path,
    name: &str,
    bin: &str,
    n: usize,
    args: &[String],
    config: impl Fn(&[SocketAddr]) -> String,
) -> Node {
    for _ in 0..5 {
        let ports: Vec<SocketAddr> = (0..n).map(|_| free_addr().unwrap()).collect();
        let cfg = dir.join(format!("{name}.toml"));
        std::fs::write(&cfg, config(&ports)).unwrap();
        // A fresh log per attempt, so an earlier attempt's port clash is not read again.
        let _ = std::fs::remove_file(dir.join(format!("{name}.log")));
        let mut all = vec!["--config".to_string(), cfg.display().to_string()];
        all.extend(args.iter().cloned());
        let mut proc = Proc::spawn(
            name,
            &binary(bin).unwrap(),
            &all,
            &[("RELAY_LOG", "info")],
            dir.join(format!("{name}.log")),
        )
        .unwrap();
        let admin = ports[n - 1];
        match wait_up(&mut proc, admin, Duration::from_secs(20)).await {
            Ok(true) => return Node { proc, admin, ports },
            Ok(false) => {}
            Err(e) => panic!("{name}: {e}"),
        }
    }
    panic!("{name}: no free ports after 5 attempts");
}

/// Dispatcher, two tunnel servers and an agent as child processes, with TLS on every
/// internal hop (the backends' front stays plain so the test client can call it); the
/// agent reads its token from a file, as the systemd unit runs it.
pub struct TlsStack {
    pub dir: ScratchDir,
    pub _upstream: UpstreamHandle,
    pub dispatcher: Node,
    pub servers: Vec<Node>,
    pub agent: Node,
}

impl TlsStack {
    pub async fn start(prefix: &str) -> TlsStack {
        let dir = ScratchDir::new(prefix).unwrap();
        let d = dir.path();
        let certs = crate::certs::generate(&d.join("certs"), &["127.0.0.1", "localhost"]).unwrap();
        let p = |p: &Path| p.display().to_string();
        let upstream = Upstream::builder().spawn().await.unwrap();
        let dispatcher = start_node(d, "dispatcher", "relay-dispatcher", 3, &[], |ports| {
            format!(
                "listen = \"{}\"\nregistry_listen = \"{}\"\nadmin_listen = \"{}\"\n\
                 call_timeout = \"10s\"\nreload_interval = \"200ms\"\n\n\
                 [[callers]]\nname = \"test\"\nkey = {CALLER_KEY:?}\ntunnels = [\"*\"]\n\n\
                 [registry]\nserver_key = {SERVER_KEY:?}\n\n\
                 [tls]\ninsecure = true\n\
                 [registry_tls]\ncert = {:?}\nkey = {:?}\nclient_ca = {:?}\n\
                 client_names = [\"tunnel-server\"]\n\
                 [forward_tls]\nca = {:?}\ncert = {:?}\nkey = {:?}\n",
                ports[0],
                ports[1],
                ports[2],
                p(&certs.dispatcher.0),
                p(&certs.dispatcher.1),
                p(&certs.ca),
                p(&certs.ca),
                p(&certs.dispatcher_client.0),
                p(&certs.dispatcher_client.1),
            )
        })
        .await;
        let registry = dispatcher.ports[1];
        let tokens = d.join("tokens.toml");
        std::fs::write(
            &tokens,
            format!(
                "[[tokens]]\ntunnel_id = {TUNNEL_ID:?}\nsha256 = {:?}\n",
                relay_common::secret::sha256_hex(TOKEN.as_bytes())
            ),
        )
        .unwrap();
        let mut servers = Vec::new();
        for i in 1..=2 {
            let name = format!("ts-{i}");
            let node = start_node(d, &name, "relay-tunnel-server", 3, &[], |ports| {
                format!(
                    "server_id = {name:?}\nzone = \"zone-{i}\"\nagent_listen = \"{}\"\n\
                     forward_listen = \"{}\"\nadmin_listen = \"{}\"\n\
                     dispatchers = [\"https://{registry}\"]\ndispatcher_key = {SERVER_KEY:?}\n\
                     token_store = {:?}\nheartbeat = \"1s\"\nreport_interval = \"250ms\"\n\
                     reload_interval = \"200ms\"\nshutdown_grace = \"5s\"\n\n\
                     [agent_tls]\ncert = {:?}\nkey = {:?}\n\
                     [forward_tls]\ncert = {:?}\nkey = {:?}\nclient_ca = {:?}\n\
                     client_names = [\"dispatcher\"]\n\
                     [dispatcher_tls]\nca = {:?}\ncert = {:?}\nkey = {:?}\n",
                    ports[0],
                    ports[1],
                    ports[2],
                    p(&tokens),
                    p(&certs.tunnel_server.0),
                    p(&certs.tunnel_server.1),
                    p(&certs.tunnel_server.0),
                    p(&certs.tunnel_server.1),
                    p(&certs.ca),
                    p(&certs.ca),
                    p(&certs.tunnel_server_client.0),
                    p(&certs.tunnel_server_client.1),
                )
            })
            .await;
            servers.push(node);
        }
        let token_file = d.join("agent.token");
        std::fs::write(&token_file, format!("{TOKEN}\n")).unwrap();
        let tunnels: Vec<String> = servers
            .iter()
            .map(|s| format!("\"https://{}\"", s.ports[0]))
            .collect();
        let agent = start_node(
            d,
            "agent",
            "relay-agent",
            1,
            &["--token-file".into(), p(&token_file)],
            |ports| {
                format!(
                    "tunnels = [{}]\nupstream = {:?}\nadmin_listen = \"{}\"\n\
                     backoff_initial = \"100ms\"\nbackoff_max = \"1s\"\n\n\
                     [tls]\nca = {:?}\n\n\
                     [[allow]]\nname = \"all\"\nmethods = [\"*\"]\npath = \"/**\"\n",
                    tunnels.join(", "),
                    upstream.url(),
                    ports[0],
                    p(&certs.ca),
                )
            },
        )
        .await;
        let stack = TlsStack {
            dir,
            _upstream: upstream,
            dispatcher,
            servers,
            agent,
        };
        let caller = stack.caller();
        crate::eventually("a first call through the TLS stack", Duration::from_secs(20), || {
            let caller = caller.clone();
            async move {
                matches!(caller.get(&format!("/relay/{TUNNEL_ID}/hello")).await, Ok(a) if a.status == 200)
            }
        })
        .await;
        // The agent's coverage metrics follow its sizing tick.
        let admin = stack.agent.admin;
        crate::eventually(
            "the agent's metrics show its live streams",
            Duration::from_secs(10),
            || async move {
                let text = scrape(admin).await.unwrap_or_default();
                metric(&text, "relay_agent_streams_live", &[]) > 0.0
                    && metric(&text, "grpc_tunnel_server_streams", &[]) > 0.0
            },
        )
        .await;
        stack
    }

    pub fn caller(&self) -> Caller {
        Caller::new(self.dispatcher.ports[0], Some(CALLER_KEY))
    }

    /// Some calls, 16 at a time, each answered 200.
    pub async fn drive_calls(&self, n: usize) {
        let caller = self.caller();
        let calls = (0..n).map(|i| {
            let caller = caller.clone();
            async move {
                let path = match i % 3 {
                    0 => format!("/relay/{TUNNEL_ID}/hello"),
                    1 => format!("/relay/{TUNNEL_ID}/slow/20"),
                    _ => format!("/relay/{TUNNEL_ID}/bytes/{}", 100 + i),
                };
                caller.get(&path).await.map(|a| a.status.as_u16())
            }
        });
        use futures::StreamExt;
        let statuses: Vec<_> = futures::stream::iter(calls)
            .buffer_unordered(16)
            .collect()
            .await;
        for s in statuses {
            assert_eq!(s.unwrap(), 200);
        }
    }

    /// Scrape targets by job, as deploy/prometheus/prometheus.yml names them.
    pub fn targets(&self) -> Vec<(&'static str, Vec<SocketAddr>)> {
        vec![
            ("relay-dispatcher", vec![self.dispatcher.admin]),
            (
                "relay-tunnel-server",
                self.servers.iter().map(|s| s.admin).collect(),
            ),
            ("relay-agent", vec![self.agent.admin]),
        ]
    }

    /// The /metrics text of the four processes.
    pub async fn scrape_all(&self) -> Vec<String> {
        let mut out = Vec::new();
        for n in [
            &self.dispatcher,
            &self.servers[0],
            &self.servers[1],
            &self.agent,
        ] {
            out.push(scrape(n.admin).await.unwrap());
        }
        out
    }
}

/// A `prometheus` child on loopback with its own config and storage in `dir`.
pub struct Prometheus {
    pub proc: Proc,
    pub addr: SocketAddr,
}

impl Prometheus {
    pub async fn start(dir: &Path, targets: &[(&str, Vec<SocketAddr>)], rules: &[PathBuf]) -> Self {
        let bin = tool("prometheus", "PROMETHEUS", "prometheus");
        let mut cfg = String::from(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n",
        );
        cfg.push_str("rule_files:\n");
        for r in rules {
            cfg.push_str(&format!("  - {:?}\n", r.display().to_string()));
        }
        cfg.push_str("scrape_configs:\n");
        for (job, addrs) in targets {
            let addrs: Vec<String> = addrs.iter().map(|a| format!("\"{a}\"")).collect();
            cfg.push_str(&format!(
                "  - job_name: {job}\n    static_configs:\n      - targets: [{}]\n",
                addrs.join(", ")
            ));
        }
        let cfg_path = dir.join("prometheus.yml");
        std::fs::write(&cfg_path, cfg).unwrap();
        for _ in 0..5 {
            let addr = free_addr().unwrap();
            let _ = std::fs::remove_file(dir.join("prometheus.log"));
            let mut proc = Proc::spawn(
                "prometheus",
                &bin,
                &[
                    format!("--config.file={}", cfg_path.display()),
                    format!(
                        "--storage.tsdb.path={}",
                        dir.join("prometheus-data").display()
                    ),
                    format!("--web.listen-address={addr}"),
                ],
                &[],
                dir.join("prometheus.log"),
            )
            .unwrap();
            match wait_http(addr, "/-/ready", 200, Duration::from_secs(30)).await {
                Ok(()) => return Prometheus { proc, addr },
                Err(e) => {
                    proc.kill();
                    if !proc.log().contains("address already in use") {
                        panic!("prometheus did not start: {e}\n{}", proc.log_tail(30));
                    }
                }
            }
        }
        panic!("prometheus: no free port after 5 attempts");
    }

    /// `GET /api/v1/{path}?{params}`; panics unless Prometheus answers `success`.
    pub async fn api(&self, path: &str, params: &[(&str, &str)]) -> Value {
        let query: Vec<String> = params
            .iter()
            .map(|(k, v)| format!("{k}={}", encode(v)))
            .collect();
        let url = format!("/api/v1/{path}?{}", query.join("&"));
        let a = Caller::new(self.addr, None).get(&url).await.unwrap();
        let v = a.json();
        assert_eq!(
            v["status"],
            "success",
            "prometheus {path} {params:?} answered {}: {}",
            a.status,
            a.text()
        );
        v["data"].clone()
    }

    /// An instant query's result vector.
    pub async fn query(&self, q: &str) -> Vec<Value> {
        let data = self.api("query", &[("query", q)]).await;
        data["result"].as_array().cloned().unwrap_or_default()
    }

    /// Loaded rules: (type, name, query, labels).
    pub async fn rules(&self) -> Vec<(String, String, String, BTreeMap<String, String>)> {
        let data = self.api("rules", &[]).await;
        let mut out = Vec::new();
        for g in data["groups"].as_array().unwrap() {
            for r in g["rules"].as_array().unwrap() {
                let labels = r["labels"]
                    .as_object()
                    .map(|o| {
                        o.iter()
                            .map(|(k, v)| (k.clone(), v.as_str().unwrap_or("").to_string()))
                            .collect()
                    })
                    .unwrap_or_default();
                out.push((
                    r["type"].as_str().unwrap().to_string(),
                    r["name"].as_str().unwrap().to_string(),
                    r["query"].as_str().unwrap().to_string(),
                    labels,
                ));
            }
        }
        out
    }

    /// Firing alerts as (alertname, labels).
    pub async fn firing(&self) -> Vec<(String, BTreeMap<String, String>)> {
        let data = self.api("alerts", &[]).await;
        data["alerts"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|a| a["state"] == "firing")
            .map(|a| {
                let labels: BTreeMap<String, String> = a["labels"]
                    .as_object()
                    .unwrap()
                    .iter()
                    .map(|(k, v)| (k.clone(), v.as_str().unwrap_or("").to_string()))
                    .collect();
                (labels["alertname"].clone(), labels)
            })
            .collect()
    }
}

/// Percent-encoding of a query parameter value.
pub fn encode(v: &str) -> String {
    let mut out = String::new();
    for b in v.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}
