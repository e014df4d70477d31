//! `relay-agent`: parse flags and config, init tracing, start the runtime the config sizes,
//! bind the admin listener, run until SIGTERM/SIGINT, map errors to an exit code.
//! `relay-agent check` runs the preflight (`relay_agent::check`) with the same config, flags
//! and environment instead; `relay-agent diag` writes a support archive
//! (`relay_common::diag`) with the check's results in it.

use anyhow::Context;
use clap::{Parser, Subcommand};
use relay_agent::Config;
use relay_common::config::Overrides;
use relay_common::Secret;
use std::net::SocketAddr;
use std::path::PathBuf;

#[derive(Parser, Debug)]
#[command(
    name = "relay-agent",
    version,
    about = "relay agent: outbound tunnel streams to the relay, calls to the upstream"
)]
struct Args {
    #[command(subcommand)]
    command: Option<Command>,
    /// TOML config file; flags and RELAY_* variables override its keys.
    #[arg(long, env = "RELAY_CONFIG", global = true)]
    config: Option<PathBuf>,
    /// The agent token (prefer --token-file or the environment variable to keep it out of `ps`).
    #[arg(long, env = "RELAY_TOKEN", hide_env_values = true, global = true)]
    token: Option<String>,
    /// A file holding the agent token, e.g. a systemd credential (`%d/token`).
    #[arg(
        long,
        env = "RELAY_TOKEN_FILE",
        conflicts_with = "token",
        global = true
    )]
    token_file: Option<PathBuf>,
    /// Tunnel endpoint URL; repeat the flag, or comma-separate in RELAY_TUNNELS.
    #[arg(
        long = "tunnel",
        env = "RELAY_TUNNELS",
        value_delimiter = ',',
        global = true
    )]
    tunnels: Vec<String>,
    /// Upstream origin, e.g. http://127.0.0.1:8000.
    #[arg(long, env = "RELAY_UPSTREAM", global = true)]
    upstream: Option<String>,
    /// Admin listener address (/metrics, /healthz, /readyz, /systemcheck).
    #[arg(long, env = "RELAY_ADMIN_LISTEN", global = true)]
    admin_listen: Option<SocketAddr>,
    /// Pool size when coverage is off.
    #[arg(long)]
    fixed_streams: Option<u32>,
    /// Turn per-server coverage off and keep a fixed pool (comparison runs).
    #[arg(long)]
    no_coverage: bool,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Preflight, run where the agent will run: config valid, upstream reachable, each
    /// tunnel endpoint reachable (TCP, TLS) with the token accepted, clock skew. Prints a
    /// table; exit 0 when nothing failed, 1 when a check failed, 2 when the config is
    /// invalid. Opens no stream that could take a call.
    Check {
        /// Largest clock difference to a tunnel server that passes.
        #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
        max_clock_skew: std::time::Duration,
    },
    /// Support archive (.tar.gz): version, the config with every secret redacted, the
    /// running agent's /systemcheck, /readyz and /metrics (from its admin listener), the
    /// last log lines, and the results of `relay-agent check`. Takes the same config,
    /// flags and environment as the agent.
    Diag {
        #[command(flatten)]
        diag: relay_common::diag::DiagArgs,
    },
}

/// The config file with the flags and `RELAY_*` variables over it, validated.
fn load(args: Args) -> Result<Config, relay_common::config::ConfigError> {
    let tunnels: Vec<String> = args
        .tunnels
        .into_iter()
        .map(|t| t.trim().to_string())
        .filter(|t| !t.is_empty())
        .collect();
    Overrides::load(args.config.as_deref())?
        // A token source given as a flag or variable replaces the config file's.
        .set(args.token, |c: &mut Config, t| {
            c.token = Secret::new(t);
            c.token_file = None;
        })
        .set(args.token_file, |c, f| {
            c.token = Secret::new("");
            c.token_file = Some(f);
        })
        .step(Config::read_token_file)?
        .list(tunnels, |c, v| c.tunnels = v)
        .set(args.upstream, |c, v| c.upstream = v)
        .set(args.admin_listen, |c, v| c.admin_listen = v)
        .set(args.fixed_streams, |c, n| c.coverage.fixed_streams = n)
        .switch(args.no_coverage, |c| c.coverage.enabled = false)
        .validate(Config::validate)
}

fn main() -> std::process::ExitCode {
    let mut args = Args::parse();
    match args.command.take() {
        // A short preflight: the default runtime, whatever the config sizes for serving.
        Some(Command::Check { max_clock_skew }) => {
            return match relay_common::runtime::build(None) {
                Ok(runtime) => runtime.block_on(check(args, max_clock_skew)),
                Err(e) => {
                    eprintln!("relay-agent check: cannot start the runtime: {e}");
                    std::process::ExitCode::from(2)
                }
            };
        }
        Some(Command::Diag { diag: opts }) => {
            return relay_common::diag::run("relay-agent", diag(args, opts));
        }
        None => {}
    }
    relay_common::telemetry::init("info");
    match main_inner(args) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = format!("{e:#}"), "relay-agent failed");
            eprintln!("relay-agent: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn main_inner(args: Args) -> anyhow::Result<()> {
    // Spans over OTLP when the OpenTelemetry variables name a collector; held to the end,
    // when it flushes what is queued.
    let _spans = relay_common::trace::init_export("relay-agent").map_err(anyhow::Error::msg)?;
    let config = load(args)?;
    relay_common::runtime::build(config.worker_threads)
        .context("cannot start the runtime")?
        .block_on(serve(config))
}

async fn serve(config: Config) -> anyhow::Result<()> {
    let admin = tokio::net::TcpListener::bind(config.admin_listen)
        .await
        .with_context(|| format!("cannot bind the admin listener on {}", config.admin_listen))?;
    tracing::info!(admin = %config.admin_listen, "admin listener bound");
    relay_agent::run(config, admin, relay_common::shutdown::signal()).await?;
    Ok(())
}

/// `relay-agent check`: the table on stdout, the verdict on stderr, the exit code.
async fn check(args: Args, max_clock_skew: std::time::Duration) -> std::process::ExitCode {
    // Logs only when asked for: the table is the output.
    if std::env::var_os("RELAY_LOG").is_some() {
        relay_common::telemetry::init("warn");
    }
    let source = match &args.config {
        Some(p) => p.display().to_string(),
        None => "(flags and environment)".to_string(),
    };
    let (report, code) = match load(args) {
        Err(e) => (
            relay_agent::check::Report::config_failed(&source, &e.to_string()),
            2,
        ),
        Ok(config) => {
            let opts = relay_agent::check::CheckOptions { max_clock_skew };
            let report = relay_agent::check::run(&config, &source, &opts).await;
            let code = if report.failed().is_empty() { 0 } else { 1 };
            (report, code)
        }
    };
    print!("{}", report.table());
    eprintln!("relay-agent check: {}", report.verdict());
    std::process::ExitCode::from(code)
}

/// `relay-agent diag`: collects the archive and writes it (whatever the running agent
/// answered: the archive says); fails when the config file cannot be read or the archive
/// cannot be written.
async fn diag(
    args: Args,
    opts: relay_common::diag::DiagArgs,
) -> Result<String, relay_common::diag::DiagError> {
    use relay_common::diag::Diag;
    let source = match &args.config {
        Some(p) => p.display().to_string(),
        None => "(flags and environment)".to_string(),
    };
    let (mut d, file) = Diag::start(
        "relay-agent",
        env!("CARGO_PKG_VERSION"),
        &opts.output,
        args.config.as_deref(),
    )?;
    if let Some(t) = &args.token {
        d.secret(t);
    }
    let admin_flag = args.admin_listen;
    let loaded = load(args);
    let admin = opts.admin_address(
        loaded.as_ref().ok().map(|c| c.admin_listen),
        admin_flag,
        file.as_ref(),
        Config::default().admin_listen,
    );
    match &loaded {
        // The token read from `token_file` (or given by flag): scrubbed wherever it shows.
        Ok(c) => d.secret(c.token.expose()),
        Err(e) => d.config_error(e),
    }
    d.admin(
        "admin",
        admin,
        &[
            ("/systemcheck", "systemcheck.json"),
            ("/readyz", "readyz.json"),
            ("/healthz", "healthz.txt"),
            ("/metrics", "metrics.txt"),
        ],
        opts.timeout,
    )
    .await;
    d.logs_of(&opts, "relay-agent.service");
    let report = match &loaded {
        Err(e) => relay_agent::check::Report::config_failed(&source, &e.to_string()),
        Ok(config) => {
            let opts = relay_agent::check::CheckOptions::default();
            relay_agent::check::run(config, &source, &opts).await
        }
    };
    d.add(
        "check.txt",
        format!("{}\n{}\n", report.table(), report.verdict()),
        format!("relay-agent check: {}", report.verdict()),
    );
    d.write(&opts.output)
}
