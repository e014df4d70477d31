//! `relay-tunnel-server`: parse config, init tracing, bind, run until SIGTERM/SIGINT.

use anyhow::Context;
use clap::Parser;
use relay_tunnel_server::{Config, Listeners};
use std::net::SocketAddr;
use std::path::PathBuf;

/// relay tunnel server: holds agents' tunnel streams and serves dispatchers' calls.
#[derive(Parser, Debug)]
#[command(name = "relay-tunnel-server", version)]
struct Args {
    /// TOML config file (unknown keys are refused).
    #[arg(long, env = "RELAY_CONFIG")]
    config: Option<PathBuf>,
    /// Server id (default: tunnel-<agent port>).
    #[arg(long, env = "RELAY_SERVER_ID")]
    server_id: Option<String>,
    /// Zone label.
    #[arg(long, env = "RELAY_ZONE")]
    zone: Option<String>,
    /// Agent-facing gRPC listener.
    #[arg(long, env = "RELAY_AGENT_LISTEN")]
    agent_listen: Option<SocketAddr>,
    /// Dispatcher-facing gRPC listener.
    #[arg(long, env = "RELAY_FORWARD_LISTEN")]
    forward_listen: Option<SocketAddr>,
    /// Admin HTTP listener (/metrics, /healthz, /readyz).
    #[arg(long, env = "RELAY_ADMIN_LISTEN")]
    admin_listen: Option<SocketAddr>,
    /// URL dispatchers use to reach the forward listener.
    #[arg(long, env = "RELAY_FORWARD_URL")]
    forward_url: Option<String>,
    /// Dispatcher registry URL (repeatable; comma-separated in the environment).
    #[arg(long = "dispatcher", env = "RELAY_DISPATCHERS", value_delimiter = ',')]
    dispatchers: Vec<String>,
    /// Token store file.
    #[arg(long, env = "RELAY_TOKEN_STORE")]
    token_store: Option<PathBuf>,
    /// Shared secret for the dispatchers' registry (overrides `dispatcher_key`).
    #[arg(long, env = "RELAY_DISPATCHER_KEY", hide_env_values = true)]
    dispatcher_key: Option<String>,
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    relay_common::telemetry::init("info");
    match main_inner().await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("relay-tunnel-server: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn main_inner() -> anyhow::Result<()> {
    let args = Args::parse();
    let mut config: Config = relay_common::config::load(args.config.as_deref())?;
    if let Some(v) = args.server_id {
        config.server_id = v;
    }
    if let Some(v) = args.dispatcher_key {
        config.dispatcher_key = Some(relay_common::Secret::new(v));
    }
    if let Some(v) = args.zone {
        config.zone = v;
    }
    if let Some(v) = args.agent_listen {
        config.agent_listen = v;
    }
    if let Some(v) = args.forward_listen {
        config.forward_listen = v;
    }
    if let Some(v) = args.admin_listen {
        config.admin_listen = v;
    }
    if let Some(v) = args.forward_url {
        config.forward_url = Some(v);
    }
    if !args.dispatchers.is_empty() {
        config.dispatchers = args.dispatchers;
    }
    if let Some(v) = args.token_store {
        config.token_store = Some(v);
    }
    config.validate()?;
    let bind = |addr: SocketAddr, what: &'static str| async move {
        tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("cannot bind {what} {addr}"))
    };
    let listeners = Listeners {
        agent: bind(config.agent_listen, "agent_listen").await?,
        forward: bind(config.forward_listen, "forward_listen").await?,
        admin: bind(config.admin_listen, "admin_listen").await?,
    };
    relay_tunnel_server::run(config, listeners, relay_common::shutdown::signal()).await?;
    Ok(())
}
