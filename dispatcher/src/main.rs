//! `relay-dispatcher`: parse config, init tracing, start the runtime the config sizes, bind
//! the three listeners, run until SIGTERM/SIGINT, map errors to exit code 1.
//! `relay-dispatcher diag` writes a support archive (`relay_common::diag`) instead.

use anyhow::Context;
use clap::{Parser, Subcommand};
use relay_common::config::Overrides;
use relay_common::Secret;
use relay_dispatcher::{CallerConfig, Config, Listeners};
use std::net::SocketAddr;
use std::path::PathBuf;
use tokio::net::TcpListener;

/// The relay dispatcher: HTTP front for backends, routing calls to tunnel servers.
#[derive(Parser, Debug)]
#[command(
    name = "relay-dispatcher",
    version,
    about,
    args_conflicts_with_subcommands = true
)]
struct Args {
    #[command(subcommand)]
    command: Option<Command>,
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
    /// The shared registry's Redis URL (overrides `[registry] url`): a URL with a password
    /// can then come from a secret store instead of the config file.
    #[arg(long, env = "RELAY_REGISTRY_URL", hide_env_values = true)]
    registry_url: Option<String>,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Support archive (.tar.gz): version, the config with every secret redacted (caller
    /// keys, server_key, record_key, the Redis URL's password), the running dispatcher's
    /// /readyz, /debug/routes and /metrics from its admin listener, and the last log lines.
    Diag {
        /// The dispatcher's config file.
        #[arg(long, env = "RELAY_CONFIG")]
        config: PathBuf,
        #[command(flatten)]
        diag: relay_common::diag::DiagArgs,
    },
}

/// The config file with the flags and `RELAY_*` variables over it, validated.
fn config(args: Args) -> anyhow::Result<Config> {
    let config = Overrides::load(args.config.as_deref())?
        .set(args.listen, |c: &mut Config, a| c.listen = a)
        .set(args.registry_listen, |c, a| c.registry_listen = a)
        .set(args.admin_listen, |c, a| c.admin_listen = a)
        .set(args.caller_key, |c, key| {
            c.callers.push(CallerConfig::allow_all("default", &key))
        })
        .set(args.registry_record_key, |c, key| {
            c.registry.record_key = Some(Secret::new(key))
        })
        .set(args.registry_url, |c, url| {
            c.registry.url = Some(Secret::new(url))
        })
        .validate(Config::validate)?;
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

fn main_inner(args: Args) -> anyhow::Result<()> {
    // Spans over OTLP when the OpenTelemetry variables name a collector; held to the end,
    // when it flushes what is queued.
    let _spans =
        relay_common::trace::init_export("relay-dispatcher").map_err(anyhow::Error::msg)?;
    let config = config(args)?;
    relay_common::runtime::build(config.worker_threads)
        .context("cannot start the runtime")?
        .block_on(serve(config))
}

/// `relay-dispatcher diag`: collects the archive and writes it (whatever the running
/// dispatcher answered: the archive says); fails when the config file cannot be read or the
/// archive cannot be written.
async fn diag(
    args: Args,
    opts: relay_common::diag::DiagArgs,
) -> Result<String, relay_common::diag::DiagError> {
    use relay_common::diag::{redact_url, Diag};
    let (mut d, file) = Diag::start(
        "relay-dispatcher",
        env!("CARGO_PKG_VERSION"),
        &opts.output,
        args.config.as_deref(),
    )?;
    for s in [&args.caller_key, &args.registry_record_key]
        .into_iter()
        .flatten()
    {
        d.secret(s);
    }
    if let Some((_, Some(password))) = args.registry_url.as_deref().map(redact_url) {
        d.secret(&password);
    }
    let admin_flag = args.admin_listen;
    let loaded = config(args);
    let admin = opts.admin_address(
        loaded.as_ref().ok().map(|c| c.admin_listen),
        admin_flag,
        file.as_ref(),
        Config::default().admin_listen,
    );
    if let Err(e) = &loaded {
        d.config_error(e);
    }
    d.admin(
        "admin",
        admin,
        &[
            ("/readyz", "readyz.json"),
            ("/debug/routes", "routes.json"),
            ("/healthz", "healthz.txt"),
            ("/metrics", "metrics.txt"),
        ],
        opts.timeout,
    )
    .await;
    d.logs_of(&opts, "relay-dispatcher.service");
    d.write(&opts.output)
}

fn main() -> std::process::ExitCode {
    let mut args = Args::parse();
    if let Some(Command::Diag { config, diag: opts }) = args.command.take() {
        args.config = Some(config);
        return relay_common::diag::run("relay-dispatcher", diag(args, opts));
    }
    relay_common::telemetry::init("info");
    if let Err(e) = main_inner(args) {
        tracing::error!(error = %format!("{e:#}"), "relay-dispatcher failed");
        eprintln!("relay-dispatcher: {e:#}");
        return std::process::ExitCode::FAILURE;
    }
    std::process::ExitCode::SUCCESS
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

    #[test]
    fn the_registry_url_flag_overrides_the_config() {
        let example = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../examples/local/dispatcher.toml"
        );
        let args = Args::parse_from([
            "relay-dispatcher",
            "--config",
            example,
            "--registry-url",
            "redis://relay:pw@10.0.0.5:6379/0",
        ]);
        let c = config(args).unwrap();
        assert_eq!(
            c.registry.url.as_ref().map(|u| u.expose()),
            Some("redis://relay:pw@10.0.0.5:6379/0")
        );
    }
}
