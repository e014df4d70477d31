//! `relay-dispatcher`: parse config, init tracing, start the runtime the config sizes, bind
//! the three listeners, run until SIGTERM/SIGINT, map errors to exit code 1.

use anyhow::Context;
use clap::Parser;
use relay_dispatcher::{CallerConfig, Config, Listeners};
use std::net::SocketAddr;
use std::path::PathBuf;
use tokio::net::TcpListener;

/// The relay dispatcher: HTTP front for backends, routing calls to tunnel servers.
#[derive(Parser, Debug)]
#[command(name = "relay-dispatcher", version, about)]
struct Args {
    /// TOML config file (defaults apply without one).
    #[arg(long, env = "RELAY_CONFIG")]
    config: Option<PathBuf>,
    /// HTTP front address (overrides `listen`).
    #[arg(long, env = "RELAY_LISTEN")]
    listen: Option<SocketAddr>,
    /// Registry gRPC address tunnel servers report to (overrides `registry_listen`).
    #[arg(long, env = "RELAY_REGISTRY_LISTEN")]
    registry_listen: Option<SocketAddr>,
    /// Admin address (overrides `admin_listen`).
    #[arg(long, env = "RELAY_ADMIN_LISTEN")]
    admin_listen: Option<SocketAddr>,
    /// Adds a caller named "default" with this key; it may reach every tunnel id.
    #[arg(long, env = "RELAY_CALLER_KEY", hide_env_values = true)]
    caller_key: Option<String>,
    /// The shared registry's record key (overrides `[registry] record_key`).
    #[arg(long, env = "RELAY_REGISTRY_RECORD_KEY", hide_env_values = true)]
    registry_record_key: Option<String>,
}

fn config(args: Args) -> anyhow::Result<Config> {
    let mut config: Config = relay_common::config::load(args.config.as_deref())?;
    if let Some(a) = args.listen {
        config.listen = a;
    }
    if let Some(a) = args.registry_listen {
        config.registry_listen = a;
    }
    if let Some(a) = args.admin_listen {
        config.admin_listen = a;
    }
    if let Some(key) = args.caller_key {
        config
            .callers
            .push(CallerConfig::allow_all("default", &key));
    }
    if let Some(key) = args.registry_record_key {
        config.registry.record_key = Some(relay_common::Secret::new(key));
    }
    config.validate()?;
    Ok(config)
}

async fn bind(addr: SocketAddr, what: &str) -> anyhow::Result<TcpListener> {
    TcpListener::bind(addr)
        .await
        .with_context(|| format!("cannot bind the {what} listener on {addr}"))
}

async fn serve(config: Config) -> anyhow::Result<()> {
    let listeners = Listeners {
        http: bind(config.listen, "HTTP").await?,
        registry: bind(config.registry_listen, "registry").await?,
        admin: bind(config.admin_listen, "admin").await?,
    };
    relay_dispatcher::run(config, listeners, relay_common::shutdown::signal()).await?;
    Ok(())
}

fn main_inner() -> anyhow::Result<()> {
    let config = config(Args::parse())?;
    relay_common::runtime::build(config.worker_threads)
        .context("cannot start the runtime")?
        .block_on(serve(config))
}

fn main() {
    relay_common::telemetry::init("info");
    if let Err(e) = main_inner() {
        tracing::error!(error = %format!("{e:#}"), "relay-dispatcher failed");
        eprintln!("relay-dispatcher: {e:#}");
        std::process::exit(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_record_key_flag_overrides_the_config() {
        let example = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../examples/local/dispatcher.toml"
        );
        let args = Args::parse_from([
            "relay-dispatcher",
            "--config",
            example,
            "--registry-record-key",
            "0123456789abcdef0123456789abcdef",
        ]);
        let c = config(args).unwrap();
        assert_eq!(
            c.registry.record_key.as_ref().map(|k| k.expose()),
            Some("0123456789abcdef0123456789abcdef")
        );
    }
}
