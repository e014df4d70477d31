//! A real HAProxy in front of tunnel servers, for the end-to-end test behind the kind of
//! load balancer users deploy. It writes a config (the settings of
//! `examples/haproxy/haproxy.cfg`: HTTP/2 on both sides, long timeouts for long-lived
//! streams, `/readyz` health checks on each server's admin port) into a scratch directory,
//! runs `haproxy -db -f <cfg>` on loopback, and kills it on drop.
//!
//! The binary is `$HAPROXY` if set, else `haproxy` on `PATH`, else `/usr/sbin/haproxy`
//! (the Debian package; `scripts/test` installs it). HAProxy balances per HTTP request, and one
//! gRPC tunnel stream is one request, so `weight` skews where new streams land.
//!
//! [`Haproxy::start_example`] runs the shipped `examples/haproxy/haproxy.cfg` itself, with
//! only its addresses and ports replaced by loopback ones ([`example_config`]).
//!
//! [`Haproxy::start_tcp_proxy_v2`] runs it as an L4 (TCP) load balancer instead, each
//! server line with `send-proxy-v2`, so the servers learn each client's address from the
//! PROXY protocol header ([`tcp_proxy_config`]).
//!
//! This module must not decide what a test asserts.

use crate::procs::{free_addr, Proc, ScratchDir, Spawn};
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

/// One backend: a tunnel server's agent-facing listener, its admin listener (health
/// check on `/readyz`) and its weight.
#[derive(Clone, Debug)]
pub struct Backend {
    pub name: String,
    pub addr: SocketAddr,
    pub admin: Option<SocketAddr>,
    pub weight: u32,
    /// Starts in maintenance (`disabled`); bring it in with [`Haproxy::enable`].
    pub disabled: bool,
}

/// HAProxy's health checks of every backend: one every `inter`, `fall` failures in a row
/// mark it down, `rise` successes up again. The default is quick for tests (down within
/// 1 s); `examples/haproxy/haproxy.cfg` checks every 2 s, so a crashed server still gets
/// new streams for up to 4 s there.
#[derive(Clone, Copy, Debug)]
pub struct Checks {
    pub inter: Duration,
    pub fall: u32,
    pub rise: u32,
}

impl Default for Checks {
    fn default() -> Self {
        Checks {
            inter: Duration::from_millis(500),
            fall: 2,
            rise: 2,
        }
    }
}

impl Checks {
    /// The checks of `examples/haproxy/haproxy.cfg` (`inter 2s fall 2 rise 2`).
    pub fn example() -> Self {
        Checks {
            inter: Duration::from_secs(2),
            ..Checks::default()
        }
    }
}

/// Where the haproxy binary is, or an error that says how to install it.
pub fn binary() -> anyhow::Result<PathBuf> {
    if let Some(p) = std::env::var_os("HAPROXY") {
        let p = PathBuf::from(p);
        anyhow::ensure!(
            p.is_file(),
            "HAPROXY={} is not a file: point it at the haproxy binary, or unset it and \
             install the Debian package (`apt-get install haproxy`; scripts/test does)",
            p.display()
        );
        return Ok(p);
    }
    if let Some(path) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&path) {
            let p = dir.join("haproxy");
            if p.is_file() {
                return Ok(p);
            }
        }
    }
    let p = PathBuf::from("/usr/sbin/haproxy");
    anyhow::ensure!(
        p.is_file(),
        "haproxy not found: install the Debian package (`apt-get install haproxy`; scripts/test does) \
         or set HAPROXY to the binary"
    );
    Ok(p)
}

/// The config HAProxy runs with: the example's settings with loopback addresses.
pub fn config(
    listen: SocketAddr,
    stats: SocketAddr,
    socket: &std::path::Path,
    backends: &[Backend],
    checks: Checks,
) -> String {
    let mut c = format!(
        "global\n\
         \x20   stats socket {} mode 600 level admin\n\
         \x20   # Small for tests (haproxy needs about 2 file descriptors per connection);\n\
         \x20   # the example config sizes it for production.\n\
         \x20   maxconn 500\n\
         \x20   # Agents multiplex many tunnel streams on one HTTP/2 connection (default 100).\n\
         \x20   tune.h2.max-concurrent-streams 4096\n\
         \n\
         defaults\n\
         \x20   mode http\n\
         \x20   timeout connect 2s\n\
         \x20   timeout client 1h\n\
         \x20   timeout server 1h\n\
         \x20   timeout tunnel 1h\n\
         \x20   timeout http-request 10s\n\
         \x20   timeout queue 5s\n\
         \x20   timeout check 2s\n\
         \n\
         frontend stats\n\
         \x20   bind {stats}\n\
         \x20   http-request return status 200 content-type text/plain string ok if {{ path /healthz }}\n\
         \x20   stats enable\n\
         \x20   stats uri /stats\n\
         \n\
         frontend agents\n\
         \x20   bind {listen} proto h2\n\
         \x20   default_backend tunnel_servers\n\
         \n\
         backend tunnel_servers\n\
         \x20   balance roundrobin\n\
         \x20   option httpchk\n\
         \x20   http-check send meth GET uri /readyz\n\
         \x20   http-check expect status 200\n\
         \x20   default-server proto h2 inter {}ms fall {} rise {}\n",
        socket.display(),
        checks.inter.as_millis(),
        checks.fall,
        checks.rise,
    );
    // Steered opens (`relay-server`), as the example routes them.
    for b in backends {
        let _ = writeln!(
            c,
            "    use-server {0} if {{ req.hdr(relay-server) -m str {0} }}",
            b.name
        );
    }
    for b in backends {
        let check = match b.admin {
            Some(a) => format!(" check addr {} port {}", a.ip(), a.port()),
            None => String::new(),
        };
        let disabled = if b.disabled { " disabled" } else { "" };
        let _ = writeln!(
            c,
            "    server {} {} weight {}{check}{disabled}",
            b.name, b.addr, b.weight
        );
    }
    c
}

/// HAProxy in TCP mode (L4, one backend per client connection) putting a PROXY v2 header
/// before each connection to a server (`send-proxy-v2`); no health checks.
pub fn tcp_proxy_config(
    listen: SocketAddr,
    stats: SocketAddr,
    socket: &std::path::Path,
    backends: &[Backend],
) -> String {
    let mut c = format!(
        "global\n\
         \x20   stats socket {} mode 600 level admin\n\
         \x20   maxconn 500\n\
         \n\
         defaults\n\
         \x20   mode tcp\n\
         \x20   timeout connect 2s\n\
         \x20   timeout client 1h\n\
         \x20   timeout server 1h\n\
         \n\
         frontend stats\n\
         \x20   mode http\n\
         \x20   bind {stats}\n\
         \x20   stats enable\n\
         \x20   stats uri /stats\n\
         \n\
         frontend agents\n\
         \x20   bind {listen}\n\
         \x20   default_backend tunnel_servers\n\
         \n\
         backend tunnel_servers\n\
         \x20   balance roundrobin\n",
        socket.display(),
    );
    for b in backends {
        let _ = writeln!(c, "    server {} {} send-proxy-v2", b.name, b.addr);
    }
    c
}

/// The shipped example config (`examples/haproxy/haproxy.cfg`, read from the workspace).
pub fn example_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../examples/haproxy/haproxy.cfg")
}

/// `text` (the example config) with only its addresses replaced: the `bind` of each
/// frontend (`agents` on `listen`, `stats` on `stats`), the runtime API socket, and each
/// `server` line's address and health-check `addr`/`port` from the backend of that name.
/// Everything else (timeouts, checks, weights, limits) stays as shipped. An error if a
/// backend has no `server` line, or a line to replace is missing.
pub fn example_config(
    text: &str,
    listen: SocketAddr,
    stats: SocketAddr,
    socket: &std::path::Path,
    backends: &[Backend],
) -> anyhow::Result<String> {
    let mut out = String::new();
    let mut section = String::new();
    let mut replaced = std::collections::BTreeSet::new();
    for line in text.lines() {
        let trimmed = line.trim_start();
        let indent = &line[..line.len() - trimmed.len()];
        let words: Vec<&str> = trimmed.split_whitespace().collect();
        if !line.starts_with(char::is_whitespace)
            && !trimmed.is_empty()
            && !trimmed.starts_with('#')
        {
            section = words.iter().take(2).cloned().collect::<Vec<_>>().join(" ");
        }
        let new_line = match words.as_slice() {
            ["stats", "socket", _path, rest @ ..] => {
                replaced.insert("stats socket".to_string());
                format!(
                    "{indent}stats socket {} {}",
                    socket.display(),
                    rest.join(" ")
                )
            }
            ["bind", _addr, rest @ ..] if section == "frontend agents" => {
                replaced.insert("frontend agents".to_string());
                format!("{indent}bind {listen} {}", rest.join(" "))
            }
            ["bind", _addr, rest @ ..] if section == "frontend stats" => {
                replaced.insert("frontend stats".to_string());
                format!("{indent}bind {stats} {}", rest.join(" "))
            }
            ["server", name, _addr, rest @ ..] => {
                let b = backends
                    .iter()
                    .find(|b| b.name == *name)
                    .ok_or_else(|| anyhow::anyhow!("no backend for `server {name}`"))?;
                let mut rest: Vec<String> = rest.iter().map(|w| w.to_string()).collect();
                for i in 0..rest.len() {
                    match (rest[i].as_str(), b.admin) {
                        ("addr", Some(a)) if i + 1 < rest.len() => rest[i + 1] = a.ip().to_string(),
                        ("port", Some(a)) if i + 1 < rest.len() => {
                            rest[i + 1] = a.port().to_string()
                        }
                        _ => {}
                    }
                }
                replaced.insert(format!("server {name}"));
                format!("{indent}server {name} {} {}", b.addr, rest.join(" "))
            }
            _ => line.to_string(),
        };
        out.push_str(new_line.trim_end());
        out.push('\n');
    }
    let mut want: Vec<String> = ["stats socket", "frontend agents", "frontend stats"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    want.extend(backends.iter().map(|b| format!("server {}", b.name)));
    for w in want {
        anyhow::ensure!(
            replaced.contains(&w),
            "the example config has no `{w}` line to point at loopback"
        );
    }
    Ok(out)
}

/// A running haproxy. Dropping it kills the process.
pub struct Haproxy {
    pub addr: SocketAddr,
    /// Stats page (`/stats`) and `/healthz`.
    pub stats: SocketAddr,
    backends: Vec<Backend>,
    /// The shipped example's text, when it runs that instead of [`config`].
    example: Option<String>,
    /// TCP mode with `send-proxy-v2` ([`tcp_proxy_config`]).
    tcp_proxy_v2: bool,
    dir: ScratchDir,
    proc: Option<Proc>,
    starts: u32,
    how: Spawn,
    checks: Checks,
}

impl Haproxy {
    /// Starts haproxy on a fresh loopback port in front of `backends`.
    pub async fn start(backends: Vec<Backend>) -> anyhow::Result<Haproxy> {
        let how = Spawn {
            env: Vec::new(),
            own_process_group: false,
        };
        Self::start_with(backends, &how).await
    }

    /// [`Haproxy::start`], spawned as `how` says (e.g. in its own process group).
    pub async fn start_with(backends: Vec<Backend>, how: &Spawn) -> anyhow::Result<Haproxy> {
        Self::start_checked(backends, how, Checks::default()).await
    }

    /// [`Haproxy::start_with`], with these health checks.
    pub async fn start_checked(
        backends: Vec<Backend>,
        how: &Spawn,
        checks: Checks,
    ) -> anyhow::Result<Haproxy> {
        let mut h = Haproxy {
            addr: free_addr()?,
            stats: free_addr()?,
            backends,
            example: None,
            tcp_proxy_v2: false,
            dir: ScratchDir::new("haproxy")?,
            proc: None,
            starts: 0,
            how: how.clone(),
            checks,
        };
        h.launch().await?;
        Ok(h)
    }

    /// Starts haproxy with the shipped `examples/haproxy/haproxy.cfg`, addresses replaced
    /// by fresh loopback ports and `backends` (see [`example_config`]).
    pub async fn start_example(backends: Vec<Backend>) -> anyhow::Result<Haproxy> {
        let text = std::fs::read_to_string(example_path())?;
        let mut h = Haproxy {
            addr: free_addr()?,
            stats: free_addr()?,
            backends,
            example: Some(text),
            tcp_proxy_v2: false,
            dir: ScratchDir::new("haproxy")?,
            proc: None,
            starts: 0,
            how: Spawn {
                env: Vec::new(),
                own_process_group: false,
            },
            checks: Checks::example(),
        };
        h.launch().await?;
        Ok(h)
    }

    /// Starts haproxy as a TCP load balancer sending PROXY v2 headers to `backends` (see
    /// [`tcp_proxy_config`]).
    pub async fn start_tcp_proxy_v2(backends: Vec<Backend>) -> anyhow::Result<Haproxy> {
        let mut h = Haproxy {
            addr: free_addr()?,
            stats: free_addr()?,
            backends,
            example: None,
            tcp_proxy_v2: true,
            dir: ScratchDir::new("haproxy")?,
            proc: None,
            starts: 0,
            how: Spawn {
                env: Vec::new(),
                own_process_group: false,
            },
            checks: Checks::default(),
        };
        h.launch().await?;
        Ok(h)
    }

    /// The config it runs with.
    pub fn config_text(&self) -> anyhow::Result<String> {
        if self.tcp_proxy_v2 {
            return Ok(tcp_proxy_config(
                self.addr,
                self.stats,
                &self.socket(),
                &self.backends,
            ));
        }
        match &self.example {
            Some(text) => {
                example_config(text, self.addr, self.stats, &self.socket(), &self.backends)
            }
            None => Ok(config(
                self.addr,
                self.stats,
                &self.socket(),
                &self.backends,
                self.checks,
            )),
        }
    }

    /// `http://{addr}`, for agents.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    async fn launch(&mut self) -> anyhow::Result<()> {
        let cfg = self.dir.path().join("haproxy.cfg");
        std::fs::write(&cfg, self.config_text()?)?;
        self.starts += 1;
        let bin = binary()?;
        let check = std::process::Command::new(&bin)
            .args(["-c", "-q", "-f"])
            .arg(&cfg)
            .output()?;
        anyhow::ensure!(
            check.status.success(),
            "haproxy rejected its config: {}{}",
            String::from_utf8_lossy(&check.stdout),
            String::from_utf8_lossy(&check.stderr)
        );
        let proc = Proc::spawn_with(
            "haproxy",
            &bin,
            &["-db".into(), "-f".into(), cfg.display().to_string()],
            &self.how,
            self.dir.path().join(format!("haproxy-{}.log", self.starts)),
        )?;
        self.proc = Some(proc);
        // Up once its stats page answers (it binds every frontend together), or exited.
        let c = &crate::client::Caller::new(self.stats, None);
        let proc = &mut self.proc;
        let up = crate::poll::until("haproxy comes up", Duration::from_secs(10), || {
            let exited = proc.as_mut().and_then(|p| p.try_exited());
            async move {
                if exited.is_some() {
                    return Ok(exited);
                }
                match c.get("/stats;csv").await {
                    Ok(a) if a.status == 200 => Ok(None),
                    last => Err(format!("{last:?}")),
                }
            }
        })
        .await?;
        if let (Some(s), Some(p)) = (up, self.proc.as_ref()) {
            anyhow::bail!("haproxy exited ({s}): {}", p.log_tail(20));
        }
        Ok(())
    }

    /// Kills haproxy (every agent connection drops at once, as in a crash or a hard
    /// restart) and starts it again on the same ports with the same config.
    pub async fn restart(&mut self) -> anyhow::Result<()> {
        if let Some(mut p) = self.proc.take() {
            p.kill();
        }
        self.launch().await
    }

    /// The CSV stats (`/stats;csv`): one line per frontend, backend and server.
    pub async fn stats_csv(&self) -> anyhow::Result<String> {
        let a = crate::client::Caller::new(self.stats, None)
            .get("/stats;csv")
            .await?;
        Ok(a.text())
    }

    fn socket(&self) -> PathBuf {
        self.dir.path().join("admin.sock")
    }

    /// One command on HAProxy's runtime API (the admin stats socket); its answer.
    pub async fn command(&self, cmd: &str) -> anyhow::Result<String> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut s = tokio::net::UnixStream::connect(self.socket()).await?;
        s.write_all(format!("{cmd}\n").as_bytes()).await?;
        let mut out = String::new();
        tokio::time::timeout(Duration::from_secs(5), s.read_to_string(&mut out)).await??;
        Ok(out)
    }

    /// Each server's `(status, total sessions)` from the stats CSV (`status` as HAProxy
    /// shows it: `UP`, `DOWN`, `UP 1/2`, `MAINT`, `no check`, ...).
    pub async fn servers(
        &self,
    ) -> anyhow::Result<std::collections::BTreeMap<String, (String, u64)>> {
        let csv = self.stats_csv().await?;
        let mut out = std::collections::BTreeMap::new();
        for line in csv.lines().filter(|l| !l.starts_with('#')) {
            let f: Vec<&str> = line.split(',').collect();
            if f.len() > 17 && f[0] == "tunnel_servers" && f[1] != "BACKEND" {
                let stot = f[7].parse().unwrap_or(0);
                out.insert(f[1].to_string(), (f[17].to_string(), stot));
            }
        }
        Ok(out)
    }

    /// Takes a server out of maintenance (`enable server tunnel_servers/<name>`); it gets
    /// new streams once its health check passes.
    pub async fn enable(&self, name: &str) -> anyhow::Result<()> {
        let out = self
            .command(&format!("enable server tunnel_servers/{name}"))
            .await?;
        anyhow::ensure!(out.trim().is_empty(), "enable server {name}: {out}");
        Ok(())
    }

    /// Its process id while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.proc.as_ref().map(Proc::pid)
    }

    /// Where the running instance logs (each start writes a new file).
    pub fn log_path(&self) -> Option<PathBuf> {
        self.proc.as_ref().map(|p| p.log_path().to_path_buf())
    }

    /// HAProxy's log so far.
    pub fn log(&self) -> String {
        self.proc.as_ref().map(|p| p.log()).unwrap_or_default()
    }
}
