//! The real binaries as child processes, for the fault tests that need a process boundary:
//! SIGKILL (a crash with no goodbye), SIGSTOP (a frozen server whose sockets stay open),
//! SIGTERM (the binary's own graceful drain), and per-process memory (`VmRSS`).
//!
//! The binaries are the ones `cargo test --workspace` (or `cargo build --bins`) builds next
//! to the test executable: `target/<profile>/relay-tunnel-server` and friends. Each child
//! gets a generated TOML config in its own scratch directory, listens on loopback ports
//! picked free just before it starts, logs to a file there, and is killed when its
//! [`Proc`] is dropped.
//!
//! Also here: reading a child's Prometheus `/metrics` text over HTTP ([`scrape`],
//! [`metric`]). This module must not decide what a test asserts.

use crate::client::Caller;
use crate::poll;
use anyhow::Context;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Path of a workspace binary built next to the running test executable, or in
/// `$RELAY_BIN_DIR` when that is set (to run the process tests against another build, e.g.
/// an earlier version's release binaries).
pub fn binary(name: &str) -> anyhow::Result<PathBuf> {
    if let Some(dir) = std::env::var_os("RELAY_BIN_DIR") {
        let path = PathBuf::from(dir).join(name);
        anyhow::ensure!(
            path.is_file(),
            "{} not found (RELAY_BIN_DIR)",
            path.display()
        );
        return Ok(path);
    }
    let exe = std::env::current_exe().context("current_exe")?;
    // target/<profile>/deps/<test>-<hash> -> target/<profile>/<name>
    let dir = exe
        .parent()
        .and_then(|d| {
            if d.ends_with("deps") {
                d.parent()
            } else {
                Some(d)
            }
        })
        .ok_or_else(|| anyhow::anyhow!("no parent directory for {}", exe.display()))?;
    let path = dir.join(name);
    anyhow::ensure!(
        path.is_file(),
        "{} not found: build the binaries first with `cargo build --bins` \
         (`cargo test --workspace` builds them too)",
        path.display()
    );
    Ok(path)
}

/// A loopback address that was free a moment ago (bound to port 0, then released), for a
/// child that binds its own listeners.
pub fn free_addr() -> anyhow::Result<SocketAddr> {
    let l = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(l.local_addr()?)
}

/// A scratch directory removed on drop.
#[derive(Debug)]
pub struct ScratchDir(PathBuf);

impl ScratchDir {
    pub fn new(prefix: &str) -> anyhow::Result<Self> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let nanos = relay_common::wall::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        let path =
            std::env::temp_dir().join(format!("relay-{prefix}-{}-{n}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&path)?;
        Ok(ScratchDir(path))
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        if std::env::var_os("RELAY_KEEP_SCRATCH").is_none() {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

/// One child process, killed (SIGKILL) and reaped on drop.
#[derive(Debug)]
pub struct Proc {
    pub name: String,
    child: Child,
    log: PathBuf,
    exited: Option<ExitStatus>,
}

impl Proc {
    /// Starts `program` with `args`, stdout and stderr appended to `log`.
    pub fn spawn(
        name: &str,
        program: &Path,
        args: &[String],
        envs: &[(&str, &str)],
        log: PathBuf,
    ) -> anyhow::Result<Proc> {
        Self::spawn_cmd(name, program, args, envs, false, log)
    }

    /// [`Proc::spawn`] as `how` says (environment, process group).
    pub fn spawn_with(
        name: &str,
        program: &Path,
        args: &[String],
        how: &Spawn,
        log: PathBuf,
    ) -> anyhow::Result<Proc> {
        let envs: Vec<(&str, &str)> = how
            .env
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        Self::spawn_cmd(name, program, args, &envs, how.own_process_group, log)
    }

    fn spawn_cmd(
        name: &str,
        program: &Path,
        args: &[String],
        envs: &[(&str, &str)],
        own_process_group: bool,
        log: PathBuf,
    ) -> anyhow::Result<Proc> {
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)?;
        let err = out.try_clone()?;
        let mut cmd = Command::new(program);
        cmd.args(args)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .env_remove("RELAY_CONFIG");
        for (k, v) in envs {
            cmd.env(k, v);
        }
        if own_process_group {
            use std::os::unix::process::CommandExt as _;
            cmd.process_group(0);
        }
        let child = cmd
            .spawn()
            .with_context(|| format!("starting {}", program.display()))?;
        Ok(Proc {
            name: name.to_string(),
            child,
            log,
            exited: None,
        })
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends a signal by name (`TERM`, `STOP`, `CONT`, `KILL`) with `kill(1)`.
    pub fn signal(&self, sig: &str) -> anyhow::Result<()> {
        let status = Command::new("kill")
            .args(["-s", sig, &self.pid().to_string()])
            .status()
            .context("running kill(1)")?;
        anyhow::ensure!(status.success(), "kill -s {sig} {} failed", self.pid());
        Ok(())
    }

    /// SIGKILL and reap: a crash.
    pub fn kill(&mut self) {
        if self.exited.is_none() {
            let _ = self.child.kill();
            self.exited = self.child.wait().ok();
        }
    }

    /// Whether the process has exited (reaping it if so).
    pub fn try_exited(&mut self) -> Option<ExitStatus> {
        if self.exited.is_none() {
            self.exited = self.child.try_wait().ok().flatten();
        }
        self.exited
    }

    /// Waits (polling) until the process exits, up to `within`.
    pub async fn wait_exit(&mut self, within: Duration) -> anyhow::Result<ExitStatus> {
        let what = format!("{} exits", self.name);
        let status = poll::until(what, within, || {
            let exited = self.try_exited();
            async move { exited.ok_or("still running") }
        });
        Ok(status.await?)
    }

    /// Resident memory in KiB (`VmRSS` of `/proc/<pid>/status`); an error if the process
    /// has exited or its status cannot be read.
    pub fn rss_kib(&self) -> anyhow::Result<u64> {
        anyhow::ensure!(
            self.exited.is_none(),
            "{} has exited ({:?}): no memory to read",
            self.name,
            self.exited
        );
        rss_kib_of(&format!("/proc/{}/status", self.pid()))
            .with_context(|| format!("memory of {}", self.name))
    }

    /// Peak resident memory in KiB over the process's life so far (`VmHWM`); an error if
    /// the process has exited or its status cannot be read.
    pub fn peak_rss_kib(&self) -> anyhow::Result<u64> {
        anyhow::ensure!(
            self.exited.is_none(),
            "{} has exited ({:?}): no memory to read",
            self.name,
            self.exited
        );
        status_kib(&format!("/proc/{}/status", self.pid()), "VmHWM")
            .with_context(|| format!("peak memory of {}", self.name))
    }

    /// Where its stdout and stderr go (appended: a restart on the same name continues it).
    pub fn log_path(&self) -> &Path {
        &self.log
    }

    /// The log so far (stdout and stderr).
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The last `n` lines of the log, for failure messages.
    pub fn log_tail(&self, n: usize) -> String {
        let log = self.log();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        // A stopped process must be continued to die promptly on some kernels' accounting;
        // SIGKILL works on stopped processes, but reaping is cleaner after CONT.
        if self.exited.is_none() {
            let _ = self.signal("CONT");
        }
        self.kill();
    }
}

/// `VmRSS` in KiB from a `/proc/.../status` file; an error if the file cannot be read or
/// holds no `VmRSS` line (a process that exited but is not reaped yet has none).
pub fn rss_kib_of(status_path: &str) -> anyhow::Result<u64> {
    status_kib(status_path, "VmRSS")
}

/// A `kB` field (`VmRSS`, `VmHWM`, ...) of a `/proc/.../status` file.
fn status_kib(status_path: &str, field: &str) -> anyhow::Result<u64> {
    let text = std::fs::read_to_string(status_path)
        .with_context(|| format!("cannot read {status_path}"))?;
    let line = text
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .ok_or_else(|| anyhow::anyhow!("{status_path} has no {field} line"))?;
    line.trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .with_context(|| format!("{status_path}: {field} {line:?} is not a number of kB"))
}

/// This process's resident memory in KiB.
pub fn self_rss_kib() -> anyhow::Result<u64> {
    rss_kib_of("/proc/self/status")
}

/// Polls `GET {path}` on `addr` until it answers `status`, up to `within`.
pub async fn wait_http(
    addr: SocketAddr,
    path: &str,
    status: u16,
    within: Duration,
) -> anyhow::Result<()> {
    let c = &Caller::new(addr, None);
    let what = format!("GET http://{addr}{path} answers {status}");
    poll::until(what, within, || async move {
        match c.get(path).await {
            Ok(a) if a.status.as_u16() == status => Ok(()),
            last => Err(format!("{last:?}")),
        }
    })
    .await?;
    Ok(())
}

/// How the `*_with` starters spawn a child; the default is what the plain starters
/// ([`DispatcherProc::start`] and friends) do.
#[derive(Clone, Debug)]
pub struct Spawn {
    /// Environment variables set for the child (on top of this process's).
    pub env: Vec<(String, String)>,
    /// Start it in a process group of its own, so a terminal's Ctrl-C (SIGINT to the
    /// foreground process group) reaches only the parent. Only for a parent that handles
    /// SIGINT and then drops its children: otherwise a Ctrl-C leaves them running.
    pub own_process_group: bool,
}

impl Default for Spawn {
    fn default() -> Self {
        Spawn {
            env: vec![("RUST_LOG".into(), "info".into())],
            own_process_group: false,
        }
    }
}

/// How many times a child is started on fresh ports when one was taken meanwhile (the
/// ports are picked free, then bound by the child: another process can win the race).
const PORT_ATTEMPTS: usize = 5;

/// Waits for a child's `/healthz` on `admin`. `Ok(false)`: it exited because a port was taken
/// (start it again on other ports); `Err`: it failed otherwise or never came up.
pub async fn wait_up(proc: &mut Proc, admin: SocketAddr, within: Duration) -> anyhow::Result<bool> {
    let c = &Caller::new(admin, None);
    let what = format!("{} answers /healthz", proc.name);
    // Up, or exited (with its status): either ends the wait.
    let up = poll::until(what, within, || {
        let exited = proc.try_exited();
        async move {
            if let Some(status) = exited {
                return Ok(Err(status));
            }
            match c.get("/healthz").await {
                Ok(a) if a.status == 200 => Ok(Ok(())),
                last => Err(format!("{last:?}")),
            }
        }
    })
    .await;
    match up {
        Ok(Ok(())) => Ok(true),
        Ok(Err(status)) => {
            let log = proc.log_tail(20);
            if log.contains("Address already in use") {
                return Ok(false);
            }
            anyhow::bail!("{} exited ({status}) before it was up:\n{log}", proc.name)
        }
        Err(e) => anyhow::bail!("{e}:\n{}", proc.log_tail(20)),
    }
}

/// The Prometheus text of a child's admin `/metrics`.
pub async fn scrape(admin: SocketAddr) -> anyhow::Result<String> {
    let a = Caller::new(admin, None).get("/metrics").await?;
    anyhow::ensure!(a.status == 200, "/metrics answered {}", a.status);
    Ok(a.text())
}

/// Sum of the samples of `name` (exact metric name, no suffix matching) whose labels
/// include every `labels` pair, in Prometheus text; 0 when there is none.
pub fn metric(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    samples(text, name, labels).sum()
}

/// Like [`metric`], but an error when no sample matches: for checks where a series that
/// disappeared must not read as 0.
pub fn series(text: &str, name: &str, labels: &[(&str, &str)]) -> Result<f64, String> {
    let mut found = samples(text, name, labels).peekable();
    if found.peek().is_none() {
        return Err(format!("no series {name}{labels:?} in the metrics"));
    }
    Ok(found.sum())
}

fn samples<'a>(
    text: &'a str,
    name: &'a str,
    labels: &'a [(&'a str, &'a str)],
) -> impl Iterator<Item = f64> + 'a {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(move |l| {
            let (series, value) = l.rsplit_once(' ')?;
            let (n, rest) = match series.find('{') {
                Some(i) => (&series[..i], &series[i..]),
                None => (series, ""),
            };
            if n != name {
                return None;
            }
            let all = labels
                .iter()
                .all(|(k, v)| rest.contains(&format!("{k}=\"{v}\"")));
            all.then(|| value.parse::<f64>().ok()).flatten()
        })
}

/// Options of a tunnel server child.
#[derive(Clone, Debug)]
pub struct TunnelServerOpts {
    pub server_id: String,
    pub zone: String,
    /// Registry URLs of the dispatchers it reports to.
    pub dispatchers: Vec<String>,
    pub dispatcher_key: String,
    /// `(token, tunnel id)` pairs the token store accepts.
    pub tokens: Vec<(String, String)>,
    pub heartbeat: Duration,
    pub shutdown_grace: Duration,
    pub report_interval: Duration,
    /// Extra top-level TOML keys.
    pub extra: String,
    /// `reload_interval` (the binary's default, 5 s, when `None`).
    pub reload_interval: Option<Duration>,
    /// `[agent_tls]` certificate and key files; plain text (`insecure = true`) when `None`.
    pub agent_tls: Option<(PathBuf, PathBuf)>,
}

impl Default for TunnelServerOpts {
    fn default() -> Self {
        TunnelServerOpts {
            server_id: "ts-1".into(),
            zone: "zone-1".into(),
            dispatchers: vec![],
            dispatcher_key: crate::stack::SERVER_KEY.into(),
            tokens: vec![(crate::stack::TOKEN.into(), crate::stack::TUNNEL_ID.into())],
            heartbeat: Duration::from_secs(1),
            shutdown_grace: Duration::from_secs(10),
            report_interval: Duration::from_millis(250),
            extra: String::new(),
            reload_interval: None,
            agent_tls: None,
        }
    }
}

/// Writes a token store file (`[[tokens]] tunnel_id`, `sha256`) of `(token, tunnel id)`
/// pairs, as a tunnel server reads it.
pub fn write_token_store(path: &Path, tokens: &[(String, String)]) -> anyhow::Result<()> {
    let mut text = String::new();
    for (token, tunnel_id) in tokens {
        let _ = writeln!(
            text,
            "[[tokens]]\ntunnel_id = \"{tunnel_id}\"\nsha256 = \"{}\"\n",
            relay_common::secret::sha256_hex(token.as_bytes())
        );
    }
    // Written whole, then renamed: a reload never reads half a file.
    let tmp = path.with_extension("toml.tmp");
    std::fs::write(&tmp, text)?;
    std::fs::rename(&tmp, path)?;
    Ok(())
}

/// The TOML table of a listener's TLS: certificate and key, or plain text.
fn listener_tls(table: &str, tls: &Option<(PathBuf, PathBuf)>) -> String {
    match tls {
        Some((cert, key)) => format!(
            "[{table}]\ncert = {:?}\nkey = {:?}\n",
            cert.display().to_string(),
            key.display().to_string()
        ),
        None => format!("[{table}]\ninsecure = true\n"),
    }
}

fn reload_line(d: Option<Duration>) -> String {
    d.map(|d| format!("reload_interval = \"{}\"\n", humantime(d)))
        .unwrap_or_default()
}

/// A `relay-tunnel-server` child.
#[derive(Debug)]
pub struct TunnelServerProc {
    pub proc: Proc,
    pub server_id: String,
    pub agent_addr: SocketAddr,
    pub forward_addr: SocketAddr,
    pub admin_addr: SocketAddr,
    pub opts: TunnelServerOpts,
    /// Its token store file (written at start from `opts.tokens`).
    pub token_store: PathBuf,
}

/// A config's `worker_threads` line, or nothing (one worker per core).
fn worker_threads_line(n: Option<usize>) -> String {
    n.map(|n| format!("worker_threads = {n}\n"))
        .unwrap_or_default()
}

fn humantime(d: Duration) -> String {
    format!("{}ms", d.as_millis())
}

impl TunnelServerProc {
    /// Starts a tunnel server on fresh loopback ports and waits for its `/healthz`.
    pub async fn start(dir: &Path, opts: TunnelServerOpts) -> anyhow::Result<Self> {
        Self::start_on(dir, opts, None).await
    }

    /// Starts it on `ports` (agent, forward, admin), e.g. a restart on the same ports a
    /// load balancer points at; fresh ports when `None`.
    pub async fn start_on(
        dir: &Path,
        opts: TunnelServerOpts,
        ports: Option<(SocketAddr, SocketAddr, SocketAddr)>,
    ) -> anyhow::Result<Self> {
        Self::start_on_with(dir, opts, ports, &Spawn::default()).await
    }

    /// [`TunnelServerProc::start_on`], spawned as `how` says (e.g. another `RELAY_LOG`).
    pub async fn start_on_with(
        dir: &Path,
        opts: TunnelServerOpts,
        ports: Option<(SocketAddr, SocketAddr, SocketAddr)>,
        how: &Spawn,
    ) -> anyhow::Result<Self> {
        for _ in 0..PORT_ATTEMPTS {
            let (agent, forward, admin) = match ports {
                Some(p) => p,
                None => (free_addr()?, free_addr()?, free_addr()?),
            };
            let mut s = Self::spawn(dir, opts.clone(), (agent, forward, admin), how)?;
            if wait_up(&mut s.proc, admin, Duration::from_secs(20)).await? {
                return Ok(s);
            }
            if ports.is_some() {
                // Its old ports are taken (by a client socket, say): fresh ones.
                return Box::pin(Self::start_on_with(dir, opts, None, how)).await;
            }
        }
        anyhow::bail!(
            "{}: no free ports after {PORT_ATTEMPTS} attempts",
            opts.server_id
        )
    }

    fn spawn(
        dir: &Path,
        opts: TunnelServerOpts,
        (agent, forward, admin): (SocketAddr, SocketAddr, SocketAddr),
        how: &Spawn,
    ) -> anyhow::Result<Self> {
        let id = &opts.server_id.clone();
        let tokens_path = dir.join(format!("{id}-tokens.toml"));
        write_token_store(&tokens_path, &opts.tokens)?;
        let cfg_path = dir.join(format!("{id}.toml"));
        let dispatchers: Vec<String> = opts.dispatchers.iter().map(|d| format!("{d:?}")).collect();
        let cfg = format!(
            "server_id = {id:?}\nzone = {:?}\nagent_listen = \"{agent}\"\nforward_listen = \"{forward}\"\n\
             admin_listen = \"{admin}\"\ndispatchers = [{}]\ndispatcher_key = {:?}\ntoken_store = {:?}\n\
             heartbeat = \"{}\"\nshutdown_grace = \"{}\"\nreport_interval = \"{}\"\n{}{}\n\n\
             {}[forward_tls]\ninsecure = true\n[dispatcher_tls]\ninsecure = true\n",
            opts.zone,
            dispatchers.join(", "),
            opts.dispatcher_key,
            tokens_path.display().to_string(),
            humantime(opts.heartbeat),
            humantime(opts.shutdown_grace),
            humantime(opts.report_interval),
            reload_line(opts.reload_interval),
            opts.extra,
            listener_tls("agent_tls", &opts.agent_tls),
        );
        std::fs::write(&cfg_path, cfg)?;
        let proc = Proc::spawn_with(
            id,
            &binary("relay-tunnel-server")?,
            &["--config".into(), cfg_path.display().to_string()],
            how,
            dir.join(format!("{id}.log")),
        )?;
        Ok(TunnelServerProc {
            proc,
            server_id: id.clone(),
            agent_addr: agent,
            forward_addr: forward,
            admin_addr: admin,
            opts,
            token_store: tokens_path,
        })
    }

    /// Where agents dial it: `https://` with `[agent_tls]` certificates, else `http://`.
    pub fn agent_url(&self) -> String {
        let scheme = if self.opts.agent_tls.is_some() {
            "https"
        } else {
            "http"
        };
        format!("{scheme}://{}", self.agent_addr)
    }

    /// Its token store file (rewrite it with [`write_token_store`]).
    pub fn token_store_path(&self, dir: &Path) -> PathBuf {
        dir.join(format!("{}-tokens.toml", self.server_id))
    }

    /// Its listener addresses, to start a replacement on the same ports.
    pub fn ports(&self) -> (SocketAddr, SocketAddr, SocketAddr) {
        (self.agent_addr, self.forward_addr, self.admin_addr)
    }
}

/// Options of a dispatcher child.
#[derive(Clone, Debug)]
pub struct DispatcherOpts {
    pub caller_key: String,
    pub server_key: String,
    pub call_timeout: Duration,
    /// Extra keys of the `[registry]` table, one per line (e.g. `backend = "redis"`).
    pub registry: String,
    /// Extra TOML appended to the generated config (e.g. a `[routing]` table).
    pub extra: String,
    /// `worker_threads` (one per core when `None`).
    pub worker_threads: Option<usize>,
    /// `reload_interval` (the binary's default, 5 s, when `None`).
    pub reload_interval: Option<Duration>,
    /// `max_call_timeout` (the binary's default, 5 min, when `None`).
    pub max_call_timeout: Option<Duration>,
    /// `[tls]` (the HTTP front) certificate and key files; plain text when `None`.
    pub front_tls: Option<(PathBuf, PathBuf)>,
}

impl Default for DispatcherOpts {
    fn default() -> Self {
        DispatcherOpts {
            caller_key: crate::stack::CALLER_KEY.into(),
            server_key: crate::stack::SERVER_KEY.into(),
            call_timeout: Duration::from_secs(10),
            registry: String::new(),
            extra: String::new(),
            worker_threads: None,
            reload_interval: None,
            max_call_timeout: None,
            front_tls: None,
        }
    }
}

/// A `relay-dispatcher` child.
#[derive(Debug)]
pub struct DispatcherProc {
    pub proc: Proc,
    pub http: SocketAddr,
    pub registry: SocketAddr,
    pub admin: SocketAddr,
}

impl DispatcherProc {
    pub async fn start(dir: &Path, opts: DispatcherOpts) -> anyhow::Result<Self> {
        Self::start_with(dir, opts, &Spawn::default()).await
    }

    /// [`DispatcherProc::start`], spawned as `how` says.
    pub async fn start_with(dir: &Path, opts: DispatcherOpts, how: &Spawn) -> anyhow::Result<Self> {
        Self::start_on_with(dir, opts, None, how).await
    }

    /// Starts it on `ports` (front, registry, admin), e.g. a restart where the tunnel
    /// servers and callers look for it; fresh ports when `None`.
    pub async fn start_on(
        dir: &Path,
        opts: DispatcherOpts,
        ports: Option<(SocketAddr, SocketAddr, SocketAddr)>,
    ) -> anyhow::Result<Self> {
        Self::start_on_with(dir, opts, ports, &Spawn::default()).await
    }

    async fn start_on_with(
        dir: &Path,
        opts: DispatcherOpts,
        ports: Option<(SocketAddr, SocketAddr, SocketAddr)>,
        how: &Spawn,
    ) -> anyhow::Result<Self> {
        for _ in 0..PORT_ATTEMPTS {
            let (http, registry, admin) = match ports {
                Some(p) => p,
                None => (free_addr()?, free_addr()?, free_addr()?),
            };
            let cfg_path = Self::write_config(dir, &opts, (http, registry, admin))?;
            let mut proc = Proc::spawn_with(
                "dispatcher",
                &binary("relay-dispatcher")?,
                &["--config".into(), cfg_path.display().to_string()],
                how,
                dir.join("dispatcher.log"),
            )?;
            if wait_up(&mut proc, admin, Duration::from_secs(20)).await? {
                return Ok(DispatcherProc {
                    proc,
                    http,
                    registry,
                    admin,
                });
            }
            anyhow::ensure!(
                ports.is_none(),
                "dispatcher: its ports {ports:?} are taken by another process"
            );
        }
        anyhow::bail!("dispatcher: no free ports after {PORT_ATTEMPTS} attempts")
    }

    /// Writes its config (`dispatcher.toml` in `dir`) for listeners on `ports` (front,
    /// registry, admin): what the process reads, or a co-located tunnel server's
    /// `front_config`.
    pub fn write_config(
        dir: &Path,
        opts: &DispatcherOpts,
        (http, registry, admin): (SocketAddr, SocketAddr, SocketAddr),
    ) -> anyhow::Result<PathBuf> {
        let cfg_path = dir.join("dispatcher.toml");
        let cfg = format!(
            "listen = \"{http}\"\nregistry_listen = \"{registry}\"\nadmin_listen = \"{admin}\"\n\
             call_timeout = \"{}\"\n{}{}\n[[callers]]\nname = \"test\"\nkey = {:?}\ntunnels = [\"*\"]\nmax_concurrent_calls = 100000\n\n[registry]\nserver_key = {:?}\n{}\n\
             {}[registry_tls]\ninsecure = true\n[forward_tls]\ninsecure = true\n\n{}\n",
            humantime(opts.call_timeout),
            reload_line(opts.reload_interval)
                + &opts
                    .max_call_timeout
                    .map(|d| format!("max_call_timeout = \"{}\"\n", humantime(d)))
                    .unwrap_or_default(),
            worker_threads_line(opts.worker_threads),
            opts.caller_key,
            opts.server_key,
            opts.registry,
            listener_tls("tls", &opts.front_tls),
            opts.extra,
        );
        std::fs::write(&cfg_path, cfg)?;
        Ok(cfg_path)
    }

    pub fn registry_url(&self) -> String {
        format!("http://{}", self.registry)
    }

    /// Its listener addresses (front, registry, admin), to start a replacement on them.
    pub fn ports(&self) -> (SocketAddr, SocketAddr, SocketAddr) {
        (self.http, self.registry, self.admin)
    }
}

/// Options of an agent child.
#[derive(Clone, Debug)]
pub struct AgentOpts {
    pub tunnels: Vec<String>,
    pub token: String,
    pub upstream: String,
    /// `backoff_initial` and `backoff_max` of its stream opens. The default (100 ms, 2 s)
    /// is shorter than the product's (200 ms, 30 s) so that fault tests recover quickly;
    /// a test of the backoff itself sets the product's.
    pub backoff: (Duration, Duration),
    /// Extra TOML appended to the generated config (e.g. a `[coverage]` table).
    pub extra: String,
    /// `worker_threads` (one per core when `None`).
    pub worker_threads: Option<usize>,
}

impl Default for AgentOpts {
    fn default() -> Self {
        AgentOpts {
            tunnels: Vec::new(),
            token: crate::stack::TOKEN.into(),
            upstream: String::new(),
            backoff: (Duration::from_millis(100), Duration::from_secs(2)),
            extra: String::new(),
            worker_threads: None,
        }
    }
}

/// A `relay-agent` child.
#[derive(Debug)]
pub struct AgentProc {
    pub proc: Proc,
    pub admin: SocketAddr,
}

impl AgentProc {
    pub async fn start(dir: &Path, opts: AgentOpts) -> anyhow::Result<Self> {
        Self::start_with(dir, opts, &Spawn::default()).await
    }

    /// [`AgentProc::start`], spawned as `how` says.
    pub async fn start_with(dir: &Path, opts: AgentOpts, how: &Spawn) -> anyhow::Result<Self> {
        for _ in 0..PORT_ATTEMPTS {
            let admin = free_addr()?;
            let cfg_path = dir.join("agent.toml");
            let tunnels: Vec<String> = opts.tunnels.iter().map(|t| format!("{t:?}")).collect();
            let cfg = format!(
                "tunnels = [{}]\ntoken = {:?}\nupstream = {:?}\nadmin_listen = \"{admin}\"\n{}\
                 backoff_initial = \"{}\"\nbackoff_max = \"{}\"\n\n[tls]\ninsecure = true\n\n\
                 [[allow]]\nname = \"test-all\"\nmethods = [\"*\"]\npath = \"/**\"\n\n{}\n",
                tunnels.join(", "),
                opts.token,
                opts.upstream,
                worker_threads_line(opts.worker_threads),
                humantime(opts.backoff.0),
                humantime(opts.backoff.1),
                opts.extra,
            );
            std::fs::write(&cfg_path, cfg)?;
            let mut proc = Proc::spawn_with(
                "agent",
                &binary("relay-agent")?,
                &["--config".into(), cfg_path.display().to_string()],
                how,
                dir.join("agent.log"),
            )?;
            if wait_up(&mut proc, admin, Duration::from_secs(20)).await? {
                return Ok(AgentProc { proc, admin });
            }
        }
        anyhow::bail!("agent: no free ports after {PORT_ATTEMPTS} attempts")
    }
}
