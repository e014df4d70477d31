//! `relay-fleet`: runs the whole relay in one process.
//!
//! `relay-fleet demo` starts a sample upstream, a dispatcher, two tunnel servers and an
//! agent on loopback, relays a few real calls, prints what happened and a curl line to
//! try, then keeps serving until Ctrl-C.
//!
//! `relay-fleet run --scenario NAME|FILE` runs a simulated-fleet load test and reports
//! (terminal table, `--json`, `--html`); `relay-fleet bench` compares direct and relayed
//! calls; `relay-fleet scenarios` lists the built-ins; `relay-fleet tokens` prints the
//! token store entries an external deployment needs for the simulated agents;
//! `relay-fleet certs --out DIR` writes a throwaway TLS set for `examples/tls/`.

use bytes::Bytes;
use clap::{Parser, Subcommand};
use http::Method;
use relay_tests::client::Caller;
use relay_tests::fleet::{html, report, Mode, RunOptions, Scenario};
use relay_tests::stack::{agent_identity, Stack, CALLER_KEY, TUNNEL_ID};
use std::net::SocketAddr;
use std::time::Duration;
use tokio::time::Instant;

#[derive(Parser, Debug)]
#[command(
    name = "relay-fleet",
    version,
    about = "Run the relay stack in one process: demo and load tests"
)]
struct Args {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run dispatcher, tunnel servers, agent and a sample upstream on loopback, relay a few
    /// calls, then keep serving until Ctrl-C.
    Demo {
        /// Dispatcher HTTP front.
        #[arg(long, default_value = "127.0.0.1:8080")]
        listen: SocketAddr,
        /// Number of tunnel servers.
        #[arg(long, default_value_t = 2)]
        servers: usize,
        /// Exit after the sample calls instead of serving until Ctrl-C.
        #[arg(long)]
        once: bool,
    },
    /// Serve the sample upstream alone (for examples/local): /hello, /echo, /bytes/{n},
    /// /slow/{ms}, /status/{code}.
    Upstream {
        #[arg(long, default_value = "127.0.0.1:8000")]
        listen: SocketAddr,
        /// Delay before every response head, in milliseconds.
        #[arg(long, default_value_t = 0)]
        latency_ms: u64,
    },
    /// Run a load-test scenario and report. Embedded (the whole relay in this process) by
    /// default; with --dispatcher and --tunnel, simulated agents and upstream drive a
    /// running deployment. Ctrl-C stops the run and still reports what ran.
    Run {
        /// A built-in scenario name (see `relay-fleet scenarios`) or a TOML file.
        #[arg(long)]
        scenario: String,
        /// External mode: the dispatcher's HTTP front, e.g. http://127.0.0.1:8080.
        #[arg(long, requires = "tunnel", env = "RELAY_FLEET_DISPATCHER")]
        dispatcher: Option<String>,
        /// External mode: where agents dial (a tunnel server or its load balancer).
        #[arg(long, requires = "dispatcher", env = "RELAY_FLEET_TUNNEL")]
        tunnel: Option<String>,
        /// External mode: the caller key for the dispatcher.
        #[arg(long, default_value = "dev-caller-key", env = "RELAY_FLEET_CALLER_KEY")]
        caller_key: String,
        /// Write the report as JSON here.
        #[arg(long)]
        json: Option<std::path::PathBuf>,
        /// Write the self-contained HTML report here.
        #[arg(long)]
        html: Option<std::path::PathBuf>,
        /// Multiply every time on the scenario's timeline (duration, phases, bursts,
        /// faults) by this, e.g. 0.25 for a quick look.
        #[arg(long, default_value_t = 1.0)]
        time_scale: f64,
        /// Multiply the scenario's rates by this.
        #[arg(long, default_value_t = 1.0)]
        rate_scale: f64,
        /// No progress line even on a terminal.
        #[arg(long)]
        quiet: bool,
    },
    /// Direct-to-upstream vs relayed calls/s and latency at several numbers of
    /// concurrent callers, side by side.
    Bench {
        /// Concurrent closed-loop callers per level.
        #[arg(long, value_delimiter = ',', default_value = "1,16,64")]
        callers: Vec<usize>,
        /// How long each side runs at each level.
        #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
        each: Duration,
        /// Write the rows as JSON here.
        #[arg(long)]
        json: Option<std::path::PathBuf>,
    },
    /// List the built-in scenarios.
    Scenarios,
    /// Write a throwaway TLS set (CA, server and client certificates and keys, PEM) for
    /// examples/tls: ca.pem, dispatcher.{pem,key}, dispatcher-client.{pem,key},
    /// tunnel-server.{pem,key}, tunnel-server-client.{pem,key}. For trying TLS out only.
    Certs {
        /// Directory to write into (created if missing; existing files are replaced).
        #[arg(long, default_value = "examples/tls/certs")]
        out: std::path::PathBuf,
        /// Names the server certificates are valid for (DNS names or IP addresses).
        #[arg(
            long = "name",
            value_delimiter = ',',
            default_value = "localhost,127.0.0.1"
        )]
        names: Vec<String>,
    },
    /// Print token store entries (tunnel-server `token_store` TOML) for N simulated
    /// agents, for external mode.
    Tokens {
        #[arg(long, default_value_t = 1)]
        agents: usize,
    },
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    relay_common::telemetry::init("warn");
    let args = Args::parse();
    let result = match args.command {
        Command::Demo {
            listen,
            servers,
            once,
        } => demo(listen, servers, once).await,
        Command::Upstream { listen, latency_ms } => upstream(listen, latency_ms).await,
        Command::Run {
            scenario,
            dispatcher,
            tunnel,
            caller_key,
            json,
            html,
            time_scale,
            rate_scale,
            quiet,
        } => {
            let mode = match (dispatcher, tunnel) {
                (Some(dispatcher), Some(tunnel)) => Mode::External {
                    dispatcher,
                    tunnel,
                    caller_key,
                },
                _ => Mode::Embedded,
            };
            run(RunArgs {
                scenario,
                mode,
                json,
                html,
                time_scale,
                rate_scale,
                quiet,
            })
            .await
        }
        Command::Bench {
            callers,
            each,
            json,
        } => bench(callers, each, json).await,
        Command::Scenarios => {
            for (name, _) in relay_tests::fleet::scenario::BUILTIN {
                if let Some(s) = Scenario::builtin(name) {
                    println!("{name:<16} {}", s.description);
                }
            }
            Ok(())
        }
        Command::Certs { out, names } => {
            let names: Vec<&str> = names.iter().map(String::as_str).collect();
            relay_tests::certs::generate(&out, &names).map(|set| {
                println!(
                    "wrote a throwaway TLS set for {} into {} (CA: {})",
                    names.join(", "),
                    set.dir.display(),
                    set.ca.display()
                );
            })
        }
        Command::Tokens { agents } => {
            println!("# token store entries for relay-fleet's simulated agents (tunnel server token_store)");
            for i in 0..agents {
                let (token, id) = agent_identity(i);
                println!(
                    "[[tokens]]\ntunnel_id = \"{id}\"\nsha256 = \"{}\"  # token {token}\n",
                    relay_common::secret::sha256_hex(token.as_bytes())
                );
            }
            Ok(())
        }
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("relay-fleet: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn demo(listen: SocketAddr, servers: usize, once: bool) -> anyhow::Result<()> {
    let stack = Stack::builder()
        .servers(servers)
        .front(listen)
        .start()
        .await
        .map_err(|e| {
            anyhow::anyhow!(
                "cannot start the stack on {listen}: {e} (pass --listen ADDR to pick another port)"
            )
        })?;
    println!(
        "relay demo: dispatcher http://{}  tunnel servers {}  agent admin http://{}  upstream {}",
        stack.http,
        stack
            .servers
            .iter()
            .flatten()
            .map(|s| s.agent_addr.to_string())
            .collect::<Vec<_>>()
            .join(", "),
        stack.agent_admin.map(|a| a.to_string()).unwrap_or_default(),
        stack.upstream.url()
    );
    let started = Instant::now();
    stack.wait_routable(Duration::from_secs(20)).await?;
    println!(
        "tunnel id `{TUNNEL_ID}` routable after {} ms\n",
        started.elapsed().as_millis()
    );

    let caller = stack.caller();
    let base = format!("/relay/{TUNNEL_ID}");
    println!("{:<46} {:>6} {:>10} {:>8}", "call", "status", "bytes", "ms");
    let show = |what: &str, status: u16, bytes: usize, t: Instant| {
        println!(
            "{what:<46} {status:>6} {bytes:>10} {:>8.1}",
            t.elapsed().as_secs_f64() * 1000.0
        );
    };
    let t = Instant::now();
    let a = caller.get(&format!("{base}/hello")).await?;
    show("GET  /hello", a.status.as_u16(), a.body.len(), t);
    let t = Instant::now();
    let a = caller
        .call(caller.request(
            Method::POST,
            &format!("{base}/echo?lang=en"),
            Bytes::from_static(b"ping through the tunnel"),
        ))
        .await?;
    show(
        "POST /echo?lang=en (23-byte body)",
        a.status.as_u16(),
        a.body.len(),
        t,
    );
    let t = Instant::now();
    let a = caller.get(&format!("{base}/bytes/1048576")).await?;
    show(
        "GET  /bytes/1048576 (1 MiB, streamed)",
        a.status.as_u16(),
        a.body.len(),
        t,
    );
    let t = Instant::now();
    let a = Caller::new(stack.http, Some("wrong-key"))
        .get(&format!("{base}/hello"))
        .await?;
    show(
        "GET  /hello with a wrong caller key",
        a.status.as_u16(),
        a.body.len(),
        t,
    );
    let t = Instant::now();
    let a = caller.get("/relay/nobody/hello").await?;
    show(
        "GET  /relay/nobody/hello (unknown tunnel id)",
        a.status.as_u16(),
        a.body.len(),
        t,
    );
    println!("\ntry it:\n  curl -i -H 'Authorization: Bearer {CALLER_KEY}' http://{}/relay/{TUNNEL_ID}/hello", stack.http);
    if let Some(admin) = stack.agent_admin {
        println!("  curl -s http://{admin}/systemcheck");
    }
    if !once {
        println!("\nserving until Ctrl-C");
        relay_common::shutdown::signal().await;
        println!("stopping");
    }
    stack.shutdown().await;
    Ok(())
}

async fn upstream(listen: SocketAddr, latency_ms: u64) -> anyhow::Result<()> {
    use relay_tests::upstream::{serve, Latency, UpstreamConfig};
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .map_err(|e| anyhow::anyhow!("cannot bind {listen}: {e}"))?;
    let latency = if latency_ms == 0 {
        Latency::None
    } else {
        Latency::Fixed(Duration::from_millis(latency_ms))
    };
    println!("sample upstream on http://{listen} (Ctrl-C stops it)");
    serve(
        listener,
        UpstreamConfig { latency },
        relay_common::shutdown::signal(),
    )
    .await;
    Ok(())
}

struct RunArgs {
    scenario: String,
    mode: Mode,
    json: Option<std::path::PathBuf>,
    html: Option<std::path::PathBuf>,
    time_scale: f64,
    rate_scale: f64,
    quiet: bool,
}

async fn run(a: RunArgs) -> anyhow::Result<()> {
    let mut scenario = Scenario::load(&a.scenario)?;
    if a.time_scale != 1.0 || a.rate_scale != 1.0 {
        anyhow::ensure!(
            a.time_scale > 0.0 && a.rate_scale >= 0.0,
            "--time-scale must be > 0 and --rate-scale >= 0"
        );
        scenario = scenario.scaled(a.time_scale, a.rate_scale);
        scenario.validate()?;
    }
    let stop = tokio_util::sync::CancellationToken::new();
    let on_signal = stop.clone();
    tokio::spawn(async move {
        relay_common::shutdown::signal().await;
        eprintln!("\nstopping: writing the report of what ran");
        on_signal.cancel();
    });
    let report = relay_tests::fleet::run(
        &scenario,
        RunOptions {
            mode: a.mode,
            progress: !a.quiet,
            stop,
        },
    )
    .await?;
    print!("{}", report::summary(&report));
    if let Some(path) = &a.json {
        std::fs::write(path, serde_json::to_vec_pretty(&report)?)
            .map_err(|e| anyhow::anyhow!("cannot write {}: {e}", path.display()))?;
        println!("json report: {}", path.display());
    }
    if let Some(path) = &a.html {
        std::fs::write(path, html::render(&report))
            .map_err(|e| anyhow::anyhow!("cannot write {}: {e}", path.display()))?;
        println!("html report: {}", path.display());
    }
    anyhow::ensure!(
        report.passed(),
        "scenario {} did not meet its expectations",
        report.scenario
    );
    Ok(())
}

async fn bench(
    callers: Vec<usize>,
    each: Duration,
    json: Option<std::path::PathBuf>,
) -> anyhow::Result<()> {
    anyhow::ensure!(
        callers.iter().all(|c| (1..=4096).contains(c)),
        "--callers: each level must be in 1..=4096"
    );
    let build = if cfg!(debug_assertions) {
        "debug"
    } else {
        "release"
    };
    eprintln!(
        "bench ({build} build): {} s per side per level, levels {callers:?}",
        each.as_secs_f64()
    );
    let rows = relay_tests::fleet::bench::bench(&callers, each).await?;
    print!("{}", relay_tests::fleet::bench::table(&rows));
    if let Some(path) = json {
        std::fs::write(&path, serde_json::to_vec_pretty(&rows)?)?;
    }
    Ok(())
}
