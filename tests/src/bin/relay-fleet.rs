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
//!
//! `relay-fleet soak` drives calls at volume through the real release binaries (or a
//! running stack), optionally with faults, and reports every failure, memory and h2's
//! `reached limit` log lines (`relay_tests::soak`).
//!
//! `relay-fleet idle` opens 100,000 idle agent streams on one real `relay-tunnel-server`
//! and prints its memory per stream and its CPU while they idle (`relay_tests::fleet::idle`).
//!
//! `relay-fleet forward` and `relay-fleet stall` are the misbehaving peers of
//! `relay_tests::fault` for a running stack: a TCP forwarder on a path that can go silent,
//! delay or reset on a schedule, and callers that stop reading their downloads or send
//! uploads an upstream does not read (`relay-fleet upstream` serves `/stall-body/{ms}`).

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
    /// /slow/{ms}, /status/{code}, /delay-body/{ms}, /stall-body/{ms} (reads no request
    /// body for that long).
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
        /// Run the agents in this many worker processes (children of this binary) instead
        /// of the scenario's `agents.workers`; 0 runs them in this process.
        #[arg(long)]
        workers: Option<usize>,
    },
    /// A worker process of `run` (started by it; reads its spec on stdin).
    #[command(hide = true)]
    Worker,
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
    /// One tenant's small calls alone, then beside another tenant's burst of slow calls
    /// on the same dispatcher and tunnel servers: throughput, p50 and p99 of both runs.
    Neighbours {
        /// The quiet tenant's concurrent closed-loop callers.
        #[arg(long, default_value_t = 8)]
        callers: usize,
        /// How long each of the quiet tenant's runs lasts.
        #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
        each: Duration,
        /// The noisy tenant's calls kept in flight.
        #[arg(long, default_value_t = 1000)]
        burst: usize,
        /// How long each of the noisy tenant's calls takes at the upstream.
        #[arg(long, default_value = "1s", value_parser = humantime::parse_duration)]
        slow: Duration,
        /// Write the figures as JSON here.
        #[arg(long)]
        json: Option<std::path::PathBuf>,
    },
    /// What idle agent streams cost one tunnel server: starts the release
    /// relay-tunnel-server next to this executable (or in $RELAY_BIN_DIR), opens --streams
    /// idle streams over --connections agent connections (a lean client answering the
    /// server's pings), waits until the server holds them all, and prints its RSS before
    /// and after, bytes per stream, and its CPU while they idle.
    Idle {
        /// Idle streams to open.
        #[arg(long, default_value_t = 100_000)]
        streams: usize,
        /// Agent connections they are spread over (one token and tunnel id each).
        #[arg(long, default_value_t = 100)]
        connections: usize,
        /// How long the streams sit idle while the server's CPU is read.
        #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
        idle: Duration,
        /// The server's heartbeat [default: the binary's, 10s].
        #[arg(long, value_parser = humantime::parse_duration)]
        heartbeat: Option<Duration>,
        /// The server's worker_threads [default: one per core].
        #[arg(long)]
        worker_threads: Option<usize>,
        /// Streams each connection has opening at once (an agent's max_opening).
        #[arg(long, default_value_t = 64)]
        opening: usize,
        /// Give up when the server does not hold every stream this long after the start.
        #[arg(long, default_value = "10m", value_parser = humantime::parse_duration)]
        within: Duration,
        /// Write the figures as JSON here.
        #[arg(long)]
        json: Option<std::path::PathBuf>,
    },
    /// List the built-in scenarios.
    Scenarios,
    /// Write a throwaway TLS set (CA, server and client certificates and keys, PEM) for
    /// examples/tls: ca.pem, dispatcher.{pem,key}, dispatcher-client.{pem,key},
    /// tunnel-server.{pem,key}, tunnel-server-client.{pem,key}, agent-client.{pem,key}. For trying TLS out only.
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
    /// A TCP forwarder on a path (e.g. agent -> tunnel server): passes bytes, and on a
    /// schedule (or on SIGUSR1: silent, SIGUSR2: heal) goes silent (connections stay open,
    /// nothing flows), heals, or resets every open connection. Prints each step with its
    /// time. Runs until Ctrl-C.
    Forward {
        /// Where to listen (point the client side here).
        #[arg(long)]
        listen: SocketAddr,
        /// Where to forward.
        #[arg(long)]
        to: SocketAddr,
        /// Go silent this long after the start (e.g. 10s).
        #[arg(long, value_parser = humantime::parse_duration)]
        silent_after: Option<Duration>,
        /// Stay silent this long, then heal [default: until Ctrl-C].
        #[arg(long, value_parser = humantime::parse_duration, requires = "silent_after")]
        silent_for: Option<Duration>,
        /// Reset (TCP RST) every open connection this long after the start.
        #[arg(long, value_parser = humantime::parse_duration)]
        reset_after: Option<Duration>,
        /// Delay every read by this much before passing it on.
        #[arg(long, value_parser = humantime::parse_duration)]
        delay: Option<Duration>,
    },
    /// Callers that misbehave toward a dispatcher's front: N downloads whose callers read
    /// the response head and then nothing, or (--upload) N uploads sent as fast as the
    /// relay takes them (to a path whose upstream does not read them, e.g.
    /// /relay/demo/stall-body/600000 on `relay-fleet upstream`). Holds them for --hold (or
    /// until Ctrl-C), then closes them. Prints how many got a response head.
    Stall {
        /// The dispatcher's HTTP front.
        #[arg(long, default_value = "127.0.0.1:8080")]
        front: SocketAddr,
        #[arg(long, default_value = "dev-caller-key", env = "RELAY_FLEET_CALLER_KEY")]
        caller_key: String,
        /// Path through the front, e.g. /relay/demo/bytes/268435456.
        #[arg(long)]
        path: String,
        /// Stalled callers.
        #[arg(long, default_value_t = 32)]
        callers: usize,
        /// Send uploads of this many bytes instead of downloads.
        #[arg(long)]
        upload: Option<u64>,
        /// How long to hold them.
        #[arg(long, value_parser = humantime::parse_duration)]
        hold: Option<Duration>,
        /// The calls' deadline (x-relay-timeout-ms).
        #[arg(long, default_value = "1h", value_parser = humantime::parse_duration)]
        deadline: Duration,
    },
    /// Volume test against the real binaries: calls at a fixed concurrency over keep-alive
    /// connections, optional faults, every failure, VmRSS and `reached limit` log line
    /// reported. Exit code 1 on any failed or lost call or `reached limit` line.
    #[command(long_about = SOAK_ABOUT)]
    Soak(Box<SoakArgs>),
    /// A storm of agent stream opens on tunnel server processes (the release binaries):
    /// reports how long the opens took to be admitted, what waited, and whether the
    /// servers' reports kept their lease at the dispatcher. Exit code 1 on a missed lease
    /// or a stream that did not get in.
    Storm(relay_tests::storm::StormArgs),
}

const SOAK_ABOUT: &str = "\
Volume test against the real release binaries (relay-dispatcher, relay-tunnel-server and
relay-agent next to this executable: build them with `cargo build --release --bins`).

Starts a dispatcher, --servers tunnel servers and an agent as child processes on loopback
(optionally HAProxy between agent and servers) with an in-process simulated upstream, then
runs --concurrency callers, each on its own HTTP/1.1 keep-alive connection, through the
dispatcher's front until --calls calls were made or for --duration. Every answer's status
and body are checked. Every call ends in one outcome: ok; failed by reason (`502
stream_lost`, `transport closed`, `client_timeout`, `200 bad_body`, ...); or lost (not
answered by the end).

Prints a progress line every few seconds, and at the end: calls sent/answered/ok/failed/lost,
calls/s, latency p50/p90/p99/p99.9/max, failures by reason and by the tunnel server the
error names, the fault timeline, VmRSS of every process (start, mid, end, peak), and per
process log the WARN/ERROR counts and h2's `reached limit` lines. Exit code 1 if any call
failed or was lost, any `reached limit` line was logged, or a process exited unasked.

Faults (--fault): rolling-restart (SIGTERM each server in turn, restart it on the same
ports, wait until the fleet is whole; at --fault-at, then every --fault-every),
kill-server (SIGKILL server --kill-server at --fault-at; --restart-after starts it again),
burst (raise to --burst-concurrency callers of GET /slow/{--burst-slow} for --burst-for;
meant with --haproxy).

External mode (--dispatcher URL): calls a running stack (e.g. examples/local, whose
upstream is `relay-fleet upstream`); no faults, no process figures.

Ctrl-C stops starting calls, waits for the calls in flight, reports, and kills every
process it started.

Examples:
  relay-fleet soak --calls 20000 --concurrency 32
  relay-fleet soak --duration 30m --upstream-latency 50ms --json soak.json
  relay-fleet soak --calls 5000 --concurrency 50 --upstream-latency 50ms \\
      --fault rolling-restart --fault-every 5s
  relay-fleet soak --calls 200000 --fault kill-server --fault-at 10s --restart-after 5s
  relay-fleet soak --calls 50000 --haproxy --weights 90,10 --fault burst --upstream-latency 20ms
  relay-fleet soak --dispatcher http://127.0.0.1:8080 --caller-key dev-caller-key \\
      --tunnel-id demo --duration 10m";

#[derive(clap::ValueEnum, Clone, Copy, Debug)]
enum SoakFault {
    RollingRestart,
    KillServer,
    Burst,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug)]
enum SoakMethod {
    Get,
    Post,
}

#[derive(clap::Args, Debug)]
struct SoakArgs {
    /// Calls to make [default: 1000000, or unbounded with --duration].
    #[arg(long)]
    calls: Option<u64>,
    /// Run this long (e.g. 30m) instead of (or, with --calls, at most) a number of calls.
    #[arg(long, value_parser = humantime::parse_duration)]
    duration: Option<Duration>,
    /// Concurrent callers, each with its own keep-alive connection.
    #[arg(long, default_value_t = 64)]
    concurrency: usize,
    /// get: GET /bytes/{16..143} (body checked byte by byte); post: POST /echo/soak with
    /// a per-call marker echoed back.
    #[arg(long, value_enum, default_value = "get")]
    method: SoakMethod,
    /// Tunnel servers to start.
    #[arg(long, default_value_t = 2)]
    servers: usize,
    /// The simulated upstream's delay before every answer, e.g. 50ms.
    #[arg(long, default_value = "0ms", value_parser = humantime::parse_duration)]
    upstream_latency: Duration,
    /// Put a real HAProxy between the agent and the tunnel servers.
    #[arg(long)]
    haproxy: bool,
    /// The co-located mode: ts-1 serves the dispatcher front itself (its
    /// `front_config`), no dispatcher process; calls cross from the front to the agent's
    /// streams inside ts-1.
    #[arg(long, conflicts_with = "fault")]
    colocated: bool,
    /// HAProxy weight per tunnel server, e.g. 90,10 [default: equal].
    #[arg(long, value_delimiter = ',', requires = "haproxy")]
    weights: Option<Vec<u32>>,
    /// Fault to inject while the load runs.
    #[arg(long, value_enum)]
    fault: Option<SoakFault>,
    /// When the fault first happens, after the load starts.
    #[arg(long, default_value = "2s", value_parser = humantime::parse_duration)]
    fault_at: Duration,
    /// Repeat the fault (rolling-restart, burst) with this period; once without it.
    #[arg(long, value_parser = humantime::parse_duration, requires = "fault")]
    fault_every: Option<Duration>,
    /// kill-server: which tunnel server (1-based).
    #[arg(long, default_value_t = 1)]
    kill_server: usize,
    /// kill-server: start it again (same ports) this long after the kill.
    #[arg(long, value_parser = humantime::parse_duration, requires = "fault")]
    restart_after: Option<Duration>,
    /// burst: callers during the burst (the extra ones call GET /slow/{--burst-slow}).
    #[arg(long, default_value_t = 300)]
    burst_concurrency: usize,
    /// burst: how long it lasts.
    #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
    burst_for: Duration,
    /// burst: the extra callers' upstream delay (on top of --upstream-latency).
    #[arg(long, default_value = "200ms", value_parser = humantime::parse_duration)]
    burst_slow: Duration,
    /// The client's deadline for one whole call; past it the call fails as client_timeout.
    #[arg(long, default_value = "35s", value_parser = humantime::parse_duration)]
    client_timeout: Duration,
    /// The dispatcher's call_timeout (embedded).
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    call_timeout: Duration,
    /// The children's RELAY_LOG filter (h2's `reached limit` warnings need WARN for h2).
    #[arg(long, default_value = "info")]
    child_log: String,
    /// External mode: a running dispatcher's front, e.g. http://127.0.0.1:8080.
    #[arg(long)]
    dispatcher: Option<String>,
    /// External mode: the caller key.
    #[arg(long, default_value = "dev-caller-key", requires = "dispatcher")]
    caller_key: String,
    /// External mode: the tunnel id to call.
    #[arg(long, default_value = "demo", requires = "dispatcher")]
    tunnel_id: String,
    /// Write the report as JSON here.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
    /// Progress line period.
    #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
    progress_every: Duration,
    /// No progress line or event lines on stderr.
    #[arg(long)]
    quiet: bool,
    /// VmRSS sampling period.
    #[arg(long, default_value = "1s", value_parser = humantime::parse_duration)]
    rss_every: Duration,
}

fn main() -> std::process::ExitCode {
    // A worker runs its agents on a runtime of its own, outside the main one.
    if std::env::args().nth(1).as_deref() == Some("worker") {
        relay_common::telemetry::init("warn");
        return match relay_tests::fleet::worker::worker_main() {
            Ok(()) => std::process::ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("relay-fleet worker: {e:#}");
                std::process::ExitCode::FAILURE
            }
        };
    }
    async_main()
}

#[tokio::main]
async fn async_main() -> std::process::ExitCode {
    relay_common::telemetry::init("warn");
    let args = Args::parse();
    let result = match args.command {
        Command::Demo {
            listen,
            servers,
            once,
        } => demo(listen, servers, once).await,
        Command::Upstream { listen, latency_ms } => upstream(listen, latency_ms).await,
        Command::Forward {
            listen,
            to,
            silent_after,
            silent_for,
            reset_after,
            delay,
        } => forward(listen, to, silent_after, silent_for, reset_after, delay).await,
        Command::Stall {
            front,
            caller_key,
            path,
            callers,
            upload,
            hold,
            deadline,
        } => stall(front, &caller_key, &path, callers, upload, hold, deadline).await,
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
            workers,
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
                workers,
            })
            .await
        }
        Command::Worker => Err(anyhow::anyhow!(
            "relay-fleet worker is started by relay-fleet run (--workers)"
        )),
        Command::Bench {
            callers,
            each,
            json,
        } => bench(callers, each, json).await,
        Command::Neighbours {
            callers,
            each,
            burst,
            slow,
            json,
        } => {
            let o = relay_tests::fleet::neighbours::Options {
                callers,
                each,
                burst,
                slow,
            };
            match relay_tests::fleet::neighbours::run(&o).await {
                Ok(r) => {
                    print!("{}", r.table(&o));
                    match json {
                        Some(path) => {
                            std::fs::write(&path, serde_json::to_vec_pretty(&r).unwrap_or_default())
                                .map_err(|e| {
                                    anyhow::anyhow!("cannot write {}: {e}", path.display())
                                })
                        }
                        None => Ok(()),
                    }
                }
                Err(e) => Err(e),
            }
        }
        Command::Idle {
            streams,
            connections,
            idle,
            heartbeat,
            worker_threads,
            opening,
            within,
            json,
        } => {
            let o = relay_tests::fleet::idle::Options {
                streams,
                connections,
                heartbeat,
                idle,
                within,
                worker_threads,
                opening,
            };
            match relay_tests::fleet::idle::run(&o, |line| eprintln!("{line}")).await {
                Ok(r) => {
                    print!("{}", r.table());
                    match json {
                        Some(path) => {
                            std::fs::write(&path, serde_json::to_vec_pretty(&r).unwrap_or_default())
                                .map_err(|e| {
                                    anyhow::anyhow!("cannot write {}: {e}", path.display())
                                })
                        }
                        None => Ok(()),
                    }
                }
                Err(e) => Err(e),
            }
        }
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
        Command::Soak(a) => soak(*a).await,
        Command::Storm(a) => relay_tests::storm::main(a).await,
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
    // The one start-up warning: every component's own would repeat it.
    relay_common::tls::note_plain_text(
        "relay-fleet demo",
        &["every hop of the demo (loopback, no certificates; see examples/tls for TLS)"],
    );
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

async fn forward(
    listen: SocketAddr,
    to: SocketAddr,
    silent_after: Option<Duration>,
    silent_for: Option<Duration>,
    reset_after: Option<Duration>,
    delay: Option<Duration>,
) -> anyhow::Result<()> {
    use relay_tests::fault::{Forwarder, Mode};
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .map_err(|e| anyhow::anyhow!("cannot bind {listen}: {e}"))?;
    let f = Forwarder::on(listener, to);
    let pass = match delay {
        Some(d) => Mode::Delay(d),
        None => Mode::Pass,
    };
    f.set(pass);
    let t0 = Instant::now();
    let say = |what: String| println!("{:>8.3}s  {what}", t0.elapsed().as_secs_f64());
    say(format!(
        "forwarding {listen} -> {to} ({pass:?}); Ctrl-C stops"
    ));
    // The schedule: (when, step).
    let mut steps: Vec<(Duration, &str)> = Vec::new();
    if let Some(at) = silent_after {
        steps.push((at, "silent"));
        if let Some(len) = silent_for {
            steps.push((at + len, "heal"));
        }
    }
    if let Some(at) = reset_after {
        steps.push((at, "reset"));
    }
    steps.sort();
    let schedule = async {
        for (at, step) in steps {
            tokio::time::sleep_until(t0 + at).await;
            match step {
                "silent" => f.silence(),
                "heal" => f.set(pass),
                _ => f.reset_open_connections(),
            }
            say(format!(
                "{step} ({} connections open, {} bytes passed so far)",
                f.open_connections(),
                f.forwarded_bytes()
            ));
        }
        std::future::pending::<()>().await
    };
    // By hand: SIGUSR1 silences, SIGUSR2 heals.
    let by_hand = async {
        use tokio::signal::unix::{signal, SignalKind};
        let (Ok(mut silence), Ok(mut heal)) = (
            signal(SignalKind::user_defined1()),
            signal(SignalKind::user_defined2()),
        ) else {
            return std::future::pending::<()>().await;
        };
        loop {
            let step = tokio::select! {
                _ = silence.recv() => {
                    f.silence();
                    "silent (SIGUSR1)"
                }
                _ = heal.recv() => {
                    f.set(pass);
                    "heal (SIGUSR2)"
                }
            };
            say(format!(
                "{step} ({} connections open, {} bytes passed so far)",
                f.open_connections(),
                f.forwarded_bytes()
            ));
        }
    };
    tokio::select! {
        _ = schedule => {}
        _ = by_hand => {}
        _ = relay_common::shutdown::signal() => {}
    }
    say(format!(
        "stopped: {} connections accepted, {} bytes passed",
        f.accepted(),
        f.forwarded_bytes()
    ));
    Ok(())
}

async fn stall(
    front: SocketAddr,
    key: &str,
    path: &str,
    callers: usize,
    upload: Option<u64>,
    hold: Option<Duration>,
    deadline: Duration,
) -> anyhow::Result<()> {
    use relay_tests::fault::{StalledDownload, StalledUpload};
    let t0 = Instant::now();
    let mut downloads = Vec::new();
    let mut uploads = Vec::new();
    let mut no_head = 0usize;
    let mut statuses: std::collections::BTreeMap<u16, usize> = Default::default();
    for _ in 0..callers {
        match upload {
            Some(len) => uploads.push(StalledUpload::start(front, key, path, len, deadline).await?),
            None => {
                match StalledDownload::start(front, key, path, deadline, Duration::from_secs(10))
                    .await
                {
                    Ok(d) => {
                        *statuses.entry(d.status).or_default() += 1;
                        downloads.push(d);
                    }
                    Err(e) => {
                        no_head += 1;
                        eprintln!("a stalled download got no response head: {e}");
                    }
                }
            }
        }
    }
    match upload {
        Some(_) => println!(
            "{:.3}s: {callers} uploads started; they send as fast as the relay takes them",
            t0.elapsed().as_secs_f64()
        ),
        None => println!(
            "{:.3}s: {} stalled downloads hold their response head (statuses {statuses:?}), {no_head} got none",
            t0.elapsed().as_secs_f64(),
            downloads.len()
        ),
    }
    let wait = async {
        match hold {
            Some(d) => tokio::time::sleep(d).await,
            None => std::future::pending().await,
        }
    };
    tokio::select! {
        _ = wait => {}
        _ = relay_common::shutdown::signal() => {}
    }
    if !uploads.is_empty() {
        let sent: u64 = uploads.iter().map(StalledUpload::sent).sum();
        println!("the relay took {sent} bytes of the uploads");
    }
    println!(
        "{:.3}s: closing the stalled callers",
        t0.elapsed().as_secs_f64()
    );
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
    workers: Option<usize>,
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
            workers: a.workers,
            ..RunOptions::default()
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

async fn soak(a: SoakArgs) -> anyhow::Result<()> {
    use relay_tests::soak::{self, CallMethod, Embedded, External, Fault, FaultTiming, Mode};
    let mode = match &a.dispatcher {
        Some(url) => {
            anyhow::ensure!(
                !a.haproxy && !a.colocated,
                "--haproxy and --colocated start a stack: not with --dispatcher"
            );
            Mode::External(External {
                dispatcher: url.clone(),
                caller_key: a.caller_key.clone(),
                tunnel_id: a.tunnel_id.clone(),
            })
        }
        None => Mode::Embedded(Embedded {
            servers: a.servers,
            upstream_latency: a.upstream_latency,
            haproxy_weights: a
                .haproxy
                .then(|| a.weights.clone().unwrap_or_else(|| vec![1; a.servers])),
            call_timeout: a.call_timeout,
            child_log: a.child_log.clone(),
            colocated: a.colocated,
        }),
    };
    let fault = match a.fault {
        None => Fault::None,
        Some(SoakFault::RollingRestart) => Fault::RollingRestart,
        Some(SoakFault::KillServer) => {
            anyhow::ensure!(
                a.fault_every.is_none(),
                "kill-server happens once: drop --fault-every"
            );
            Fault::KillServer {
                server: a.kill_server,
                restart_after: a.restart_after,
            }
        }
        Some(SoakFault::Burst) => Fault::Burst {
            concurrency: a.burst_concurrency,
            length: a.burst_for,
            slow: a.burst_slow,
        },
    };
    let config = soak::SoakConfig {
        mode,
        concurrency: a.concurrency,
        calls: match (a.calls, a.duration) {
            (None, None) => Some(1_000_000),
            (calls, _) => calls,
        },
        duration: a.duration,
        method: match a.method {
            SoakMethod::Get => CallMethod::Get,
            SoakMethod::Post => CallMethod::Post,
        },
        client_timeout: a.client_timeout,
        grace: Duration::from_secs(5),
        fault,
        timing: FaultTiming {
            at: a.fault_at,
            every: a.fault_every,
        },
        progress_every: (!a.quiet).then_some(a.progress_every),
        rss_every: a.rss_every,
    };
    // SIGINT, SIGTERM or SIGHUP (terminal closed): stop, report, kill the children (they
    // run in process groups of their own and would outlive an unhandled signal).
    let stop = tokio_util::sync::CancellationToken::new();
    let on_signal = stop.clone();
    let mut hangup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())?;
    tokio::spawn(async move {
        tokio::select! {
            _ = relay_common::shutdown::signal() => {}
            _ = hangup.recv() => {}
        }
        on_signal.cancel();
    });
    let report = soak::run(&config, stop).await?;
    print!("{}", report.summary());
    if let Some(path) = &a.json {
        std::fs::write(path, serde_json::to_vec_pretty(&report)?)
            .map_err(|e| anyhow::anyhow!("cannot write {}: {e}", path.display()))?;
        println!("json report: {}", path.display());
    }
    anyhow::ensure!(
        report.passed(),
        "soak failed: {}",
        report.findings().join(", ")
    );
    Ok(())
}
