//! `relay-agent`: parse flags and config, init tracing, bind the admin listener, run until
//! SIGTERM/SIGINT, map errors to an exit code.

use anyhow::Context;
use clap::Parser;
use relay_agent::Config;
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
    /// TOML config file; flags and RELAY_* variables override its keys.
    #[arg(long, env = "RELAY_CONFIG")]
    config: Option<PathBuf>,
    /// The agent token (prefer --token-file or the environment variable to keep it out of `ps`).
    #[arg(long, env = "RELAY_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// A file holding the agent token, e.g. a systemd credential (`%d/token`).
    #[arg(long, env = "RELAY_TOKEN_FILE", conflicts_with = "token")]
    token_file: Option<PathBuf>,
    /// Tunnel endpoint URL; repeat the flag, or comma-separate in RELAY_TUNNELS.
    #[arg(long = "tunnel", env = "RELAY_TUNNELS", value_delimiter = ',')]
    tunnels: Vec<String>,
    /// Upstream origin, e.g. http://127.0.0.1:8000.
    #[arg(long, env = "RELAY_UPSTREAM")]
    upstream: Option<String>,
    /// Admin listener address (/metrics, /healthz, /readyz, /systemcheck).
    #[arg(long, env = "RELAY_ADMIN_LISTEN")]
    admin_listen: Option<SocketAddr>,
    /// Pool size when coverage is off.
    #[arg(long)]
    fixed_streams: Option<u32>,
    /// Turn per-server coverage off and keep a fixed pool (comparison runs).
    #[arg(long)]
    no_coverage: bool,
}

fn load(args: Args) -> anyhow::Result<Config> {
    let mut config: Config = relay_common::config::load(args.config.as_deref())?;
    // A token source given as a flag or variable replaces the config file's.
    if let Some(t) = args.token {
        config.token = Secret::new(t);
        config.token_file = None;
    }
    if let Some(f) = args.token_file {
        config.token = Secret::new("");
        config.token_file = Some(f);
    }
    config.read_token_file()?;
    let tunnels: Vec<String> = args
        .tunnels
        .into_iter()
        .map(|t| t.trim().to_string())
        .filter(|t| !t.is_empty())
        .collect();
    if !tunnels.is_empty() {
        config.tunnels = tunnels;
    }
    if let Some(u) = args.upstream {
        config.upstream = u;
    }
    if let Some(a) = args.admin_listen {
        config.admin_listen = a;
    }
    if let Some(n) = args.fixed_streams {
        config.coverage.fixed_streams = n;
    }
    if args.no_coverage {
        config.coverage.enabled = false;
    }
    config.validate()?;
    Ok(config)
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    relay_common::telemetry::init("info");
    match main_inner().await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = format!("{e:#}"), "relay-agent failed");
            eprintln!("relay-agent: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn main_inner() -> anyhow::Result<()> {
    let config = load(Args::parse())?;
    let admin = tokio::net::TcpListener::bind(config.admin_listen)
        .await
        .with_context(|| format!("cannot bind the admin listener on {}", config.admin_listen))?;
    tracing::info!(admin = %config.admin_listen, "admin listener bound");
    relay_agent::run(config, admin, relay_common::shutdown::signal()).await?;
    Ok(())
}
