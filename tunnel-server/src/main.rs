//! `relay-tunnel-server`: parse config, init tracing, start the runtime the config sizes,
//! bind, run until SIGTERM/SIGINT.
//! `relay-tunnel-server tokens add | revoke | list` edits a token store file instead;
//! `relay-tunnel-server diag` writes a support archive (`relay_common::diag`).

use anyhow::Context;
use clap::{Parser, Subcommand};
use relay_common::config::Overrides;
use relay_common::Secret;
use relay_tunnel_server::{Config, Front, Listeners};
use std::net::SocketAddr;
use std::path::PathBuf;

/// relay tunnel server: holds agents' tunnel streams and serves dispatchers' calls.
#[derive(Parser, Debug)]
#[command(
    name = "relay-tunnel-server",
    version,
    args_conflicts_with_subcommands = true
)]
struct Args {
    #[command(subcommand)]
    command: Option<Command>,
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
    /// The co-located mode: also serve the dispatcher front of this dispatcher config
    /// file (overrides `front_config`).
    #[arg(long, env = "RELAY_FRONT_CONFIG")]
    front_config: Option<PathBuf>,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Mint, revoke and list agent tokens in a token store file. Running servers pick the
    /// change up on SIGHUP, or by themselves within `reload_interval`.
    #[command(subcommand)]
    Tokens(Tokens),
    /// Support archive (.tar.gz): version, the config (and the co-located front's) with
    /// every secret redacted, the running server's /readyz and /metrics (and the front's
    /// /debug/routes) from its admin listener, and the last log lines. The token store is
    /// not included.
    Diag {
        /// The server's config file.
        #[arg(long, env = "RELAY_CONFIG")]
        config: PathBuf,
        #[command(flatten)]
        diag: relay_common::diag::DiagArgs,
    },
}

#[derive(Subcommand, Debug)]
enum Tokens {
    /// Generate a strong random token for a tunnel id, print it (only this once) on
    /// stdout and add its SHA-256 to the store (created if missing).
    Add {
        /// The public tunnel id the token opens (backends call /relay/<tunnel id>/...).
        #[arg(long)]
        tunnel_id: String,
        #[command(flatten)]
        store: StoreArgs,
    },
    /// Remove entries: every token of --tunnel-id, or the one whose SHA-256 is (or
    /// starts with, 8+ hex digits) --sha256; both together must match the same entry.
    /// Streams opened with a removed token close when the servers reload.
    Revoke {
        /// The tunnel id whose tokens go (all of them, unless --sha256 names one).
        #[arg(long, required_unless_present = "sha256")]
        tunnel_id: Option<String>,
        /// SHA-256 of the token (or its first 8+ hex digits), as `tokens list` shows it.
        #[arg(long)]
        sha256: Option<String>,
        #[command(flatten)]
        store: StoreArgs,
    },
    /// List the store's entries: tunnel id and SHA-256 (the store holds no tokens).
    List {
        #[command(flatten)]
        store: StoreArgs,
    },
}

#[derive(clap::Args, Debug)]
struct StoreArgs {
    /// The token store file (the server's `token_store`).
    #[arg(long, env = "RELAY_TOKEN_STORE")]
    store: Option<PathBuf>,
    /// Instead of --store: the server's config file, whose `token_store` is used.
    #[arg(long, env = "RELAY_CONFIG")]
    config: Option<PathBuf>,
}

impl StoreArgs {
    fn path(&self) -> anyhow::Result<PathBuf> {
        if let Some(p) = &self.store {
            return Ok(p.clone());
        }
        if let Some(c) = &self.config {
            let config: Config = relay_common::config::load(Some(c))?;
            return config.token_store.ok_or_else(|| {
                anyhow::anyhow!(
                    "{} sets no token_store: name the store with --store FILE",
                    c.display()
                )
            });
        }
        anyhow::bail!("name the token store: --store FILE (or --config FILE with token_store)")
    }
}

/// Runs a `tokens` subcommand; what it prints is its answer (no log lines).
fn tokens(cmd: Tokens) -> anyhow::Result<()> {
    use relay_tunnel_server::tokens::edit;
    const RELOAD: &str = "running tunnel servers load the change on SIGHUP \
        (`systemctl reload`, `kill -HUP`) or by themselves within reload_interval (5s by default)";
    match cmd {
        Tokens::Add { tunnel_id, store } => {
            let path = store.path()?;
            let added = edit::add(&path, &tunnel_id)?;
            // stdout: the token alone, so `TOKEN=$(relay-tunnel-server tokens add ...)` works.
            println!("{}", added.token);
            eprintln!(
                "{} token store {}: tunnel id {} -> sha256 {}",
                if added.created { "created" } else { "added to" },
                path.display(),
                added.entry.tunnel_id,
                added.entry.sha256
            );
            eprintln!(
                "the token is shown only this once: give it to the agent (`token`, or RELAY_TOKEN)"
            );
            if added.tokens_of_tunnel > 1 {
                eprintln!(
                    "tunnel id {} now has {} tokens; once agents use the new one, revoke the old \
                     with `relay-tunnel-server tokens revoke --sha256 <hash> --store {}`",
                    added.entry.tunnel_id,
                    added.tokens_of_tunnel,
                    path.display()
                );
            }
            eprintln!("{RELOAD}");
        }
        Tokens::Revoke {
            tunnel_id,
            sha256,
            store,
        } => {
            let path = store.path()?;
            let removed = edit::revoke(&path, tunnel_id.as_deref(), sha256.as_deref())?;
            for e in &removed {
                println!("revoked {} sha256 {}", e.tunnel_id, e.sha256);
            }
            eprintln!(
                "removed {} entr{} from {}; {RELOAD}, and close the streams opened with {}",
                removed.len(),
                if removed.len() == 1 { "y" } else { "ies" },
                path.display(),
                if removed.len() == 1 { "it" } else { "them" },
            );
        }
        Tokens::List { store } => {
            let path = store.path()?;
            let entries = edit::list(&path)?;
            let width = entries
                .iter()
                .map(|e| e.tunnel_id.len())
                .max()
                .unwrap_or(0)
                .max("tunnel_id".len());
            println!("{:<width$}  sha256", "tunnel_id");
            for e in &entries {
                println!("{:<width$}  {}", e.tunnel_id, e.sha256);
            }
        }
    }
    Ok(())
}

fn main() -> std::process::ExitCode {
    let mut args = Args::parse();
    match args.command.take() {
        Some(Command::Tokens(cmd)) => {
            return match tokens(cmd) {
                Ok(()) => std::process::ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("relay-tunnel-server tokens: {e:#}");
                    std::process::ExitCode::FAILURE
                }
            };
        }
        Some(Command::Diag { config, diag: opts }) => {
            args.config = Some(config);
            return relay_common::diag::run("relay-tunnel-server", diag(args, opts));
        }
        None => {}
    }
    relay_common::telemetry::init("info");
    match main_inner(args) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("relay-tunnel-server: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn main_inner(args: Args) -> anyhow::Result<()> {
    // Spans over OTLP when the OpenTelemetry variables name a collector; held to the end,
    // when it flushes what is queued.
    let _spans =
        relay_common::trace::init_export("relay-tunnel-server").map_err(anyhow::Error::msg)?;
    let config = load(args)?;
    let front_config = match &config.front_config {
        Some(path) => Some(
            relay_common::config::load::<relay_dispatcher::Config>(Some(path))
                .with_context(|| format!("front_config {}", path.display()))?,
        ),
        None => None,
    };
    // The process has one runtime: the tunnel server's `worker_threads` sizes it, the
    // front config's (the dispatcher's own, when it runs alone) is not used.
    relay_common::runtime::build(config.worker_threads)
        .context("cannot start the runtime")?
        .block_on(serve(config, front_config))
}

/// The config file with the flags and `RELAY_*` variables over it, validated.
fn load(args: Args) -> anyhow::Result<Config> {
    let config = Overrides::load(args.config.as_deref())?
        .set(args.server_id, |c: &mut Config, v| c.server_id = v)
        .set(args.dispatcher_key, |c, v| {
            c.dispatcher_key = Some(Secret::new(v))
        })
        .set(args.zone, |c, v| c.zone = v)
        .set(args.agent_listen, |c, v| c.agent_listen = v)
        .set(args.forward_listen, |c, v| c.forward_listen = v)
        .set(args.admin_listen, |c, v| c.admin_listen = v)
        .set(args.forward_url, |c, v| c.forward_url = Some(v))
        .list(args.dispatchers, |c, v| c.dispatchers = v)
        .set(args.token_store, |c, v| c.token_store = Some(v))
        .set(args.front_config, |c, v| c.front_config = Some(v))
        .validate(Config::validate)?;
    Ok(config)
}

/// `relay-tunnel-server diag`: collects the archive and writes it (whatever the running
/// server answered: the archive says); fails when the config file cannot be read or the
/// archive cannot be written.
async fn diag(
    args: Args,
    opts: relay_common::diag::DiagArgs,
) -> Result<String, relay_common::diag::DiagError> {
    use relay_common::diag::{admin_listen_of, Diag};
    let (mut d, file) = Diag::start(
        "relay-tunnel-server",
        env!("CARGO_PKG_VERSION"),
        &opts.output,
        args.config.as_deref(),
    )?;
    if let Some(k) = &args.dispatcher_key {
        d.secret(k);
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
        Ok(c) => {
            if let Some(store) = &c.token_store {
                d.note(
                    "token store",
                    format!("{} not included (token hashes)", store.display()),
                );
            }
        }
        Err(e) => d.config_error(e),
    }
    d.admin(
        "admin",
        admin,
        &[
            ("/readyz", "readyz.json"),
            ("/healthz", "healthz.txt"),
            ("/metrics", "metrics.txt"),
        ],
        opts.timeout,
    )
    .await;
    // The co-located mode: the front's config and admin listener too.
    let front_path = match &loaded {
        Ok(c) => c.front_config.clone(),
        Err(_) => file
            .as_ref()
            .and_then(|v| v.get("front_config")?.as_str().map(PathBuf::from)),
    };
    if let Some(front_path) = front_path {
        match d.config("front-config.toml", &front_path) {
            Ok(front_file) => {
                let front_admin =
                    relay_common::config::load::<relay_dispatcher::Config>(Some(&front_path))
                        .ok()
                        .map(|c| c.admin_listen)
                        .or_else(|| admin_listen_of(front_file.as_ref()))
                        .unwrap_or_else(|| relay_dispatcher::Config::default().admin_listen);
                d.admin(
                    "front-admin",
                    front_admin,
                    &[
                        ("/readyz", "readyz.json"),
                        ("/debug/routes", "routes.json"),
                        ("/metrics", "metrics.txt"),
                    ],
                    opts.timeout,
                )
                .await;
            }
            Err(e) => d.note("front-config.toml", e.to_string()),
        }
    }
    d.logs_of(&opts, "relay-tunnel-server.service");
    d.write(&opts.output)
}

async fn serve(
    config: Config,
    front_config: Option<relay_dispatcher::Config>,
) -> anyhow::Result<()> {
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
    let front = match front_config {
        Some(c) => Some(Front {
            listeners: relay_dispatcher::Listeners {
                http: bind(c.listen, "front_config's listen").await?,
                registry: bind(c.registry_listen, "front_config's registry_listen").await?,
                admin: bind(c.admin_listen, "front_config's admin_listen").await?,
            },
            config: c,
        }),
        None => None,
    };
    relay_tunnel_server::run(config, listeners, front, relay_common::shutdown::signal()).await?;
    Ok(())
}
