//! `diag`: the support archive every binary writes (`relay-agent diag --config FILE
//! --output FILE.tar.gz`, the same for the servers). One `.tar.gz` with the version, the
//! config with every secret redacted, what the running process's admin listener answers
//! (or a note saying why it did not), the last log lines (or a note saying where they
//! are), and whatever the binary adds (the agent's `check` results, the tunnel server's
//! co-located front: its config and its admin listener's answers). Every binary's
//! subcommand has the same shape: [`Diag::start`] (output check, redacted config,
//! environment), what it collects, [`Diag::write`], all run by [`run`].
//!
//! Secrets never reach the archive, by two independent rules:
//! 1. the config is re-written from its parsed TOML (comments dropped) with the value of
//!    every secret key replaced ([`is_secret_key`]) and the password of every URL
//!    replaced ([`redact_url`]);
//! 2. every secret value found that way, plus the ones the binary adds (a token read
//!    from `token_file`, secret `RELAY_*` variables), is scrubbed from every member just
//!    before the archive is written: a secret echoed in a log line, an error message or
//!    an admin answer is replaced too.
//!
//! This module owns collecting and writing; it must not know a binary's config types (the
//! binaries pass what they know: the admin address, extra members, extra secrets).

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::TokioIo;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// What replaces a secret in the archive.
pub const REDACTED: &str = "<redacted>";

/// Largest admin answer or log tail kept in the archive; anything longer is cut (and
/// the cut said).
const MAX_MEMBER_BYTES: usize = 8 << 20;

/// Secrets shorter than this are not scrubbed from free text (a 1-2 character "secret"
/// would shred every member); the config's own values are redacted whatever their length.
const MIN_SCRUB_LEN: usize = 3;

#[derive(Debug, thiserror::Error)]
pub enum DiagError {
    #[error("cannot read config file {path}: {source}")]
    ReadConfig {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot write the archive {path}: {source}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// Options every binary's `diag` subcommand shares.
#[derive(clap::Args, Debug, Clone)]
pub struct DiagArgs {
    /// Where to write the archive (a .tar.gz file; created or replaced, mode 0600).
    #[arg(long, short = 'o')]
    pub output: PathBuf,
    /// The admin listener to query (default: the config's `admin_listen`; an unspecified
    /// address such as 0.0.0.0 is asked on loopback).
    #[arg(long)]
    pub admin: Option<SocketAddr>,
    /// A file the process's log (its stderr) is written to; its last lines go into the
    /// archive. Without it the systemd journal of --journal-unit is read when
    /// `journalctl` is available.
    #[arg(long)]
    pub log_file: Option<PathBuf>,
    /// The systemd unit whose journal holds the process's log.
    #[arg(long)]
    pub journal_unit: Option<String>,
    /// How many log lines to keep.
    #[arg(long, default_value_t = 500)]
    pub log_lines: usize,
    /// Bound on each admin request.
    #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
    pub timeout: Duration,
}

impl DiagArgs {
    /// The admin listener to ask: `--admin`, else the loaded config's `admin_listen`, else
    /// the binary's own `--admin-listen` flag, else the config file's `admin_listen` as
    /// written (a file that did not load whole), else the binary's default.
    pub fn admin_address(
        &self,
        loaded: Option<SocketAddr>,
        flag: Option<SocketAddr>,
        file: Option<&toml::Value>,
        default: SocketAddr,
    ) -> SocketAddr {
        self.admin
            .or(loaded)
            .or(flag)
            .or_else(|| admin_listen_of(file))
            .unwrap_or(default)
    }
}

/// One file of the archive.
struct Member {
    name: String,
    data: Vec<u8>,
}

/// The archive being collected.
pub struct Diag {
    binary: String,
    members: Vec<Member>,
    secrets: Vec<String>,
    /// One line per member or missing part, written as `summary.txt`.
    summary: Vec<String>,
}

impl Diag {
    /// Starts an archive of `binary` (`relay-agent`, ...) at `version`; adds `version.txt`.
    pub fn new(binary: &str, version: &str) -> Self {
        let mut d = Diag {
            binary: binary.to_string(),
            members: Vec::new(),
            secrets: Vec::new(),
            summary: Vec::new(),
        };
        let collected = crate::wall::unix_ms() / 1000;
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_string())
            .unwrap_or_else(|_| "(unknown)".to_string());
        d.add(
            "version.txt",
            format!(
                "{binary} {version}\ntarget: {}-{}\nhost: {host}\ncollected: {collected} \
                 (seconds since the Unix epoch)\n",
                std::env::consts::ARCH,
                std::env::consts::OS
            ),
            format!("{binary} {version}"),
        );
        d
    }

    /// Starts the archive of a `diag` subcommand: fails early when `output` could not be
    /// written ([`check_output`]), then adds the config file at `config` (redacted; `None`:
    /// a note that there is none) and the environment. Returns the parsed config file too,
    /// for what a config that does not load still tells (its `admin_listen`).
    pub fn start(
        binary: &str,
        version: &str,
        output: &Path,
        config: Option<&Path>,
    ) -> Result<(Self, Option<toml::Value>), DiagError> {
        check_output(output)?;
        let mut d = Diag::new(binary, version);
        let file = match config {
            Some(path) => d.config("config.toml", path)?,
            None => {
                d.note(
                    "config.toml",
                    "no --config: flags, RELAY_* variables and defaults only",
                );
                None
            }
        };
        d.environment();
        Ok((d, file))
    }

    /// The config did not load: why, as `config-error.txt`.
    pub fn config_error(&mut self, e: &dyn std::fmt::Display) {
        self.add(
            "config-error.txt",
            format!("{e:#}\n"),
            format!("the config does not load: {e:#}"),
        );
    }

    /// Adds a member with a one-line description for the summary.
    pub fn add(&mut self, name: &str, data: impl Into<Vec<u8>>, about: impl AsRef<str>) {
        self.summary
            .push(format!("{name:<28} {}", about.as_ref().replace('\n', " ")));
        self.members.push(Member {
            name: name.to_string(),
            data: data.into(),
        });
    }

    /// A line in the summary for a part that is not in the archive, and why.
    pub fn note(&mut self, what: &str, why: impl AsRef<str>) {
        self.summary
            .push(format!("{what:<28} {}", why.as_ref().replace('\n', " ")));
    }

    /// A value that must appear nowhere in the archive.
    pub fn secret(&mut self, value: &str) {
        if !value.is_empty() && !self.secrets.iter().any(|s| s == value) {
            self.secrets.push(value.to_string());
        }
    }

    /// Reads the config file, adds it as `name` with every secret redacted, and returns
    /// its parsed TOML (for the caller to find e.g. `admin_listen` when the typed config
    /// does not load). A file that cannot be read is an error; a file that is not TOML is
    /// noted (its text is never copied: it may hold secrets that cannot be found).
    pub fn config(&mut self, name: &str, path: &Path) -> Result<Option<toml::Value>, DiagError> {
        let text = std::fs::read_to_string(path).map_err(|source| DiagError::ReadConfig {
            path: path.to_path_buf(),
            source,
        })?;
        match redact_toml(&text) {
            Ok((value, redacted, secrets)) => {
                for s in &secrets {
                    self.secret(s);
                }
                let body = format!(
                    "# {} as read by diag: every secret replaced by \"{REDACTED}\", comments \
                     dropped.\n{redacted}",
                    path.display()
                );
                self.add(
                    name,
                    body,
                    format!(
                        "{}, {} secret value(s) redacted",
                        path.display(),
                        secrets.len()
                    ),
                );
                Ok(Some(value))
            }
            Err(e) => {
                self.note(
                    name,
                    format!(
                        "not included: {} is not valid TOML ({e}); its text is not copied",
                        path.display()
                    ),
                );
                Ok(None)
            }
        }
    }

    /// Adds the `RELAY_*` environment variables (secret ones by name only) as
    /// `environment.txt`, and takes the secret ones' values as secrets.
    pub fn environment(&mut self) {
        let mut lines = Vec::new();
        let mut vars: Vec<(String, String)> = std::env::vars()
            .filter(|(k, _)| k.starts_with("RELAY_") || k == "RUST_LOG")
            .collect();
        vars.sort();
        for (k, v) in vars {
            if is_secret_env(&k) {
                self.secret(&v);
                lines.push(format!("{k}={REDACTED}"));
            } else {
                let (shown, password) = redact_url(&v);
                if let Some(p) = password {
                    self.secret(&p);
                }
                lines.push(format!("{k}={shown}"));
            }
        }
        let n = lines.len();
        let mut body = lines.join("\n");
        if n == 0 {
            body = "(no RELAY_* variable is set)".to_string();
        }
        body.push('\n');
        self.add(
            "environment.txt",
            body,
            format!("{n} RELAY_* variable(s) of this diag run (secret ones by name only)"),
        );
    }

    /// Fetches `paths` from the admin listener at `addr` (an unspecified address is asked
    /// on loopback) into `<dir>/<file>`; when the listener does not answer, adds
    /// `<dir>/unreachable.txt` saying so. Returns whether it answered.
    pub async fn admin(
        &mut self,
        dir: &str,
        addr: SocketAddr,
        paths: &[(&str, &str)],
        timeout: Duration,
    ) -> bool {
        let addr = dialable(addr);
        let mut reached = false;
        let mut failures = Vec::new();
        for (path, file) in paths {
            match get(addr, path, timeout).await {
                Ok((status, body)) => {
                    reached = true;
                    let name = format!("{dir}/{file}");
                    let (body, cut) = cut(body.to_vec());
                    self.add(
                        &name,
                        body,
                        format!(
                            "GET http://{addr}{path}: HTTP {status}{}",
                            if cut { " (cut at 8 MiB)" } else { "" }
                        ),
                    );
                }
                Err(e) => failures.push(format!("GET http://{addr}{path}: {e}")),
            }
        }
        if !failures.is_empty() {
            let text = format!(
                "The admin listener of the running {} did not answer at {addr}.\n\
                 Is the process running, and is its admin_listen this address? Pass --admin \
                 ADDR to ask another one.\n\n{}\n",
                self.binary,
                failures.join("\n")
            );
            let about = if reached {
                format!("some admin requests to {addr} failed")
            } else {
                format!("admin listener {addr} unreachable: nothing fetched from it")
            };
            self.add(&format!("{dir}/unreachable.txt"), text, about);
        }
        reached
    }

    /// Adds the last `lines` log lines as `logs.txt`: from `log_file` when given, else the
    /// journal of `unit` when `journalctl` runs here; else a note where the log goes.
    /// The log tail as `opts` asks: its `--log-file`, else the journal of its
    /// `--journal-unit` or of `default_unit`.
    pub fn logs_of(&mut self, opts: &DiagArgs, default_unit: &str) {
        let unit = opts.journal_unit.as_deref().unwrap_or(default_unit);
        self.logs(opts.log_file.as_deref(), unit, opts.log_lines);
    }

    pub fn logs(&mut self, log_file: Option<&Path>, unit: &str, lines: usize) {
        if let Some(path) = log_file {
            match tail_file(path, lines) {
                Ok(text) => self.add(
                    "logs.txt",
                    text,
                    format!("last {lines} lines of {}", path.display()),
                ),
                Err(e) => self.add(
                    "logs.txt",
                    format!("--log-file {}: cannot read it: {e}\n", path.display()),
                    format!("no log: cannot read {}: {e}", path.display()),
                ),
            }
            return;
        }
        let journal = std::process::Command::new("journalctl")
            .args(["--no-pager", "-o", "short-iso", "-n"])
            .arg(lines.to_string())
            .args(["-u", unit])
            .stdin(std::process::Stdio::null())
            .output();
        let why = match journal {
            Ok(out) if out.status.success() => {
                let text = String::from_utf8_lossy(&out.stdout).into_owned();
                if text.lines().any(|l| !l.starts_with("-- ")) {
                    let (text, _) = cut(text.into_bytes());
                    self.add(
                        "logs.txt",
                        text,
                        format!("last {lines} lines of the journal of {unit} (journalctl)"),
                    );
                    return;
                }
                format!("the journal has no lines of {unit}")
            }
            Ok(out) => format!(
                "journalctl -u {unit} failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ),
            Err(e) => format!("journalctl cannot run here ({e})"),
        };
        let text = format!(
            "No log lines collected: {why}.\n\
             {binary} logs to stderr. Under systemd its lines are in the journal (pass \
             --journal-unit if the unit has another name); in a container, `kubectl logs` or \
             `podman logs` has them; elsewhere pass --log-file FILE where its stderr is kept.\n",
            binary = self.binary
        );
        self.add("logs.txt", text, format!("no log lines: {why}"));
    }

    /// Scrubs every secret from every member and writes the archive: each member under
    /// `<binary>-diag/`, plus `summary.txt`. The file is created with mode 0600. Returns
    /// what to tell the user: where it went and the summary.
    pub fn write(mut self, output: &Path) -> Result<String, DiagError> {
        let summary = format!(
            "{} diag: what this archive holds (secrets are redacted in every file)\n\n{}\n",
            self.binary,
            self.summary.join("\n")
        );
        self.members.insert(
            0,
            Member {
                name: "summary.txt".to_string(),
                data: summary.into_bytes(),
            },
        );
        let mut secrets: Vec<&str> = self
            .secrets
            .iter()
            .map(String::as_str)
            .filter(|s| s.len() >= MIN_SCRUB_LEN)
            .collect();
        // Longest first, so a secret that contains another is replaced whole.
        secrets.sort_by_key(|s| std::cmp::Reverse(s.len()));
        for m in &mut self.members {
            for s in &secrets {
                m.data = replace_all(&m.data, s.as_bytes(), REDACTED.as_bytes());
            }
        }
        let err = |source| DiagError::Write {
            path: output.to_path_buf(),
            source,
        };
        let file = open_private(output).map_err(err)?;
        let gz = flate2::write::GzEncoder::new(file, flate2::Compression::default());
        let mut tar = tar::Builder::new(gz);
        let mtime = crate::wall::unix_ms() / 1000;
        let prefix = format!("{}-diag", self.binary);
        for m in &self.members {
            let mut header = tar::Header::new_gnu();
            header.set_size(m.data.len() as u64);
            header.set_mode(0o600);
            header.set_mtime(mtime);
            header.set_entry_type(tar::EntryType::Regular);
            let name = format!("{prefix}/{}", m.name);
            tar.append_data(&mut header, &name, m.data.as_slice())
                .map_err(err)?;
        }
        let gz = tar.into_inner().map_err(err)?;
        let file = gz.finish().map_err(err)?;
        file.sync_all().map_err(err)?;
        let summary = String::from_utf8_lossy(&self.members[0].data);
        Ok(format!(
            "wrote {} ({} files)\n{summary}",
            output.display(),
            self.members.len()
        ))
    }
}

/// Runs a `diag` subcommand on a runtime of its own: `collect` gathers and writes the
/// archive and returns what to tell the user (printed on stderr, exit 0), or why it could
/// not (printed after `binary`'s name, exit 1).
pub fn run<F>(binary: &str, collect: F) -> std::process::ExitCode
where
    F: std::future::Future<Output = Result<String, DiagError>>,
{
    let result = match crate::runtime::build(None) {
        Ok(runtime) => runtime.block_on(collect),
        Err(e) => {
            eprintln!("{binary} diag: cannot start the runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    match result {
        Ok(summary) => {
            eprintln!("{summary}");
            std::process::ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("{binary} diag: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// Fails early, before anything is collected, when the archive could not be written
/// (its folder missing or read-only). Leaves no file behind and an existing one as it was.
pub fn check_output(output: &Path) -> Result<(), DiagError> {
    let err = |source| DiagError::Write {
        path: output.to_path_buf(),
        source,
    };
    if output.exists() {
        return std::fs::OpenOptions::new()
            .append(true)
            .open(output)
            .map(drop)
            .map_err(err);
    }
    open_private(output).map_err(err)?;
    std::fs::remove_file(output).map_err(err)
}

/// The `admin_listen` of a parsed config file, when it is set and an address: for a config
/// that does not load as a whole.
pub fn admin_listen_of(config: Option<&toml::Value>) -> Option<SocketAddr> {
    config?.get("admin_listen")?.as_str()?.parse().ok()
}

/// Creates or truncates `path`, readable by its owner only (also when it existed before
/// with another mode).
fn open_private(path: &Path) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)?;
    file.set_permissions(std::fs::Permissions::from_mode(0o600))?;
    Ok(file)
}

/// `data` with every occurrence of `needle` replaced.
fn replace_all(data: &[u8], needle: &[u8], with: &[u8]) -> Vec<u8> {
    if needle.is_empty() || data.len() < needle.len() {
        return data.to_vec();
    }
    let mut out = Vec::with_capacity(data.len());
    let mut i = 0;
    while i < data.len() {
        if data[i..].starts_with(needle) {
            out.extend_from_slice(with);
            i += needle.len();
        } else {
            out.push(data[i]);
            i += 1;
        }
    }
    out
}

/// At most [`MAX_MEMBER_BYTES`], keeping the end (the newest lines), and whether it was cut.
fn cut(mut data: Vec<u8>) -> (Vec<u8>, bool) {
    if data.len() <= MAX_MEMBER_BYTES {
        return (data, false);
    }
    let drop = data.len() - MAX_MEMBER_BYTES;
    data.drain(..drop);
    (data, true)
}

/// The last `lines` lines of a file (reading at most its last 8 MiB).
fn tail_file(path: &Path, lines: usize) -> std::io::Result<String> {
    use std::io::{Read, Seek, SeekFrom};
    let mut f = std::fs::File::open(path)?;
    let len = f.metadata()?.len();
    let start = len.saturating_sub(MAX_MEMBER_BYTES as u64);
    f.seek(SeekFrom::Start(start))?;
    let mut buf = Vec::new();
    f.read_to_end(&mut buf)?;
    let text = String::from_utf8_lossy(&buf);
    let all: Vec<&str> = text.lines().collect();
    let from = all.len().saturating_sub(lines);
    let mut out = all[from..].join("\n");
    out.push('\n');
    Ok(out)
}

/// Loopback for an unspecified listen address (`0.0.0.0`, `[::]`): the address a process
/// on the same host reaches it at.
pub fn dialable(addr: SocketAddr) -> SocketAddr {
    match addr.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => {
            SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), addr.port())
        }
        IpAddr::V6(ip) if ip.is_unspecified() => {
            SocketAddr::new(IpAddr::V6(Ipv6Addr::LOCALHOST), addr.port())
        }
        _ => addr,
    }
}

/// One `GET` on the admin listener: status and body, bounded by `timeout`.
async fn get(addr: SocketAddr, path: &str, timeout: Duration) -> Result<(u16, Bytes), String> {
    let work = async {
        let tcp = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|e| format!("cannot connect: {e}"))?;
        let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
            .await
            .map_err(|e| format!("HTTP handshake: {e}"))?;
        let conn = tokio::spawn(conn);
        let req = http::Request::get(path)
            .header(http::header::HOST, addr.to_string())
            .body(Empty::<Bytes>::new())
            .map_err(|e| e.to_string())?;
        let resp = send
            .send_request(req)
            .await
            .map_err(|e| format!("request failed: {e}"))?;
        let status = resp.status().as_u16();
        let body = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| format!("reading the answer: {e}"))?
            .to_bytes();
        conn.abort();
        Ok((status, body))
    };
    match tokio::time::timeout(timeout, work).await {
        Ok(r) => r,
        Err(_) => Err(format!("no answer within {timeout:?}")),
    }
}

/// Whether a config key holds a secret. `table` is the name of the table the key is in
/// (`tls`, `registry`, `callers`, ...; empty at the top). A `key` in a TLS section is the
/// path of a private key file, kept; the file itself is never read. Header names count as
/// keys too (`set_headers = { Authorization = "..." }`), with `-` read as `_`.
pub fn is_secret_key(table: &str, key: &str) -> bool {
    let k = key.to_ascii_lowercase().replace('-', "_");
    if k == "key" {
        return !table.to_ascii_lowercase().ends_with("tls");
    }
    const NAMES: [&str; 6] = [
        "token",
        "passwd",
        "credential",
        "auth",
        "apikey",
        "key_sha256",
    ];
    const PARTS: [&str; 4] = ["password", "secret", "authorization", "cookie"];
    const SUFFIXES: [&str; 6] = [
        "_token",
        "_passwd",
        "_key",
        "_key_sha256",
        "_credential",
        "_credentials",
    ];
    // `token_file`, `token_store` name files (never read by diag): kept.
    NAMES.contains(&k.as_str())
        || PARTS.iter().any(|p| k.contains(p))
        || SUFFIXES.iter().any(|s| k.ends_with(s))
}

/// Whether a `RELAY_*` variable holds a secret (`RELAY_TOKEN`, `RELAY_CALLER_KEY`, ...).
fn is_secret_env(name: &str) -> bool {
    let n = name.to_ascii_uppercase();
    n.ends_with("TOKEN")
        || n.ends_with("_KEY")
        || n.contains("PASSWORD")
        || n.contains("SECRET")
        || n.contains("CREDENTIAL")
}

/// A URL with its password (`scheme://user:PASSWORD@host`) replaced, and the password.
/// Anything that is not such a URL comes back unchanged.
pub fn redact_url(s: &str) -> (String, Option<String>) {
    let Some(scheme_end) = s.find("://") else {
        return (s.to_string(), None);
    };
    let rest = &s[scheme_end + 3..];
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let authority = &rest[..authority_end];
    let Some(at) = authority.rfind('@') else {
        return (s.to_string(), None);
    };
    let userinfo = &authority[..at];
    let Some(colon) = userinfo.find(':') else {
        return (s.to_string(), None);
    };
    let password = &userinfo[colon + 1..];
    if password.is_empty() {
        return (s.to_string(), None);
    }
    let out = format!(
        "{}://{}:{REDACTED}@{}",
        &s[..scheme_end],
        &userinfo[..colon],
        &rest[at + 1..]
    );
    (out, Some(password.to_string()))
}

/// Parses a TOML config and returns it, its text with every secret replaced by
/// [`REDACTED`] (comments dropped), and the secret values found.
pub fn redact_toml(text: &str) -> Result<(toml::Value, String, Vec<String>), String> {
    let value: toml::Value = toml::from_str(text).map_err(|e| {
        // The message alone: toml's Display quotes the offending line, which may hold a
        // secret.
        let line = e
            .span()
            .map(|s| text[..s.start.min(text.len())].lines().count().max(1));
        match line {
            Some(l) => format!("line {l}: {}", e.message().trim()),
            None => e.message().trim().to_string(),
        }
    })?;
    let mut secrets = Vec::new();
    let mut redacted = value.clone();
    redact_value(&mut redacted, "", false, &mut secrets);
    let text = toml::to_string(&redacted).map_err(|e| e.to_string())?;
    Ok((value, text, secrets))
}

fn redact_value(v: &mut toml::Value, table: &str, secret: bool, found: &mut Vec<String>) {
    match v {
        toml::Value::String(s) => {
            if secret {
                found.push(std::mem::replace(s, REDACTED.to_string()));
            } else if let (out, Some(pw)) = redact_url(s) {
                found.push(pw);
                *s = out;
            }
        }
        toml::Value::Array(items) => {
            for item in items {
                redact_value(item, table, secret, found);
            }
        }
        toml::Value::Table(t) => {
            for (k, item) in t.iter_mut() {
                let is_secret = secret || is_secret_key(table, k);
                // A nested table is named by its own key; an array of tables by the array's.
                redact_value(item, k, is_secret, found);
            }
        }
        other => {
            if secret {
                found.push(other.to_string());
                *other = toml::Value::String(REDACTED.to_string());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redacts_every_secret_key_and_url_password_and_keeps_the_rest() {
        let text = r#"
            # token = "commented-secret"
            token = "agent-token-1"
            token_file = "/run/token"
            admin_listen = "0.0.0.0:9090"
            dispatcher_key = "disp-key-2"
            [tls]
            cert = "/etc/relay/cert.pem"
            key = "/etc/relay/key.pem"
            [registry]
            url = "rediss://relay:redis-pw-3@10.0.0.5:6380/0"
            server_key = "server-key-4"
            record_key = "record-key-5"
            key_prefix = "relay"
            [[callers]]
            name = "backend"
            key = "caller-key-6"
            tunnels = ["acme"]
            [[callers]]
            name = "other"
            key_sha256 = "abcdef"
            [[allow]]
            name = "r"
            set_headers = { Authorization = "Bearer upstream-cred-7", "X-Api-Key" = "api-key-8", "x-trace" = "kept-9" }
        "#;
        let (_, out, secrets) = redact_toml(text).unwrap();
        for s in [
            "agent-token-1",
            "disp-key-2",
            "redis-pw-3",
            "server-key-4",
            "record-key-5",
            "caller-key-6",
            "abcdef",
            "commented-secret",
            "upstream-cred-7",
            "api-key-8",
        ] {
            assert!(!out.contains(s), "{s} in {out}");
        }
        for s in ["agent-token-1", "disp-key-2", "redis-pw-3", "caller-key-6"] {
            assert!(secrets.iter().any(|x| x == s), "{s} not found: {secrets:?}");
        }
        for kept in [
            "/run/token",
            "0.0.0.0:9090",
            "/etc/relay/key.pem",
            "rediss://relay:<redacted>@10.0.0.5:6380/0",
            "key_prefix = \"relay\"",
            "name = \"backend\"",
            "kept-9",
        ] {
            assert!(out.contains(kept), "{kept} missing from {out}");
        }
    }

    #[test]
    fn a_config_that_is_not_toml_is_refused_without_quoting_it() {
        let e = redact_toml("token = \"sekrit-value\nx").unwrap_err();
        assert!(!e.contains("sekrit"), "{e}");
        assert!(e.contains("line 1"), "{e}");
    }

    #[test]
    fn url_passwords_only() {
        assert_eq!(redact_url("redis://h:6379/0").1, None);
        assert_eq!(redact_url("redis://user@h").1, None);
        assert_eq!(
            redact_url("redis://:pw@h/1"),
            (
                "redis://:<redacted>@h/1".to_string(),
                Some("pw".to_string())
            )
        );
        assert_eq!(redact_url("not a url").1, None);
    }

    #[test]
    fn scrubs_secrets_from_every_member() {
        let mut d = Diag::new("relay-test", "0");
        d.secret("s3cret-value");
        d.add("a.txt", "line with s3cret-value inside", "x");
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("d.tar.gz");
        std::fs::write(&out, "an older file anyone could read").unwrap();
        let told = d.write(&out).unwrap();
        assert!(told.contains("a.txt"), "{told}");
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&out).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        let f = std::fs::File::open(&out).unwrap();
        let mut ar = tar::Archive::new(flate2::read::GzDecoder::new(f));
        let mut all = Vec::new();
        for e in ar.entries().unwrap() {
            let mut e = e.unwrap();
            std::io::Read::read_to_end(&mut e, &mut all).unwrap();
        }
        let all = String::from_utf8(all).unwrap();
        assert!(!all.contains("s3cret-value"));
        assert!(all.contains("line with <redacted> inside"));
    }
}
