//! `relay-fleet`: runs the whole relay in one process.
//!
//! `relay-fleet demo` starts a sample upstream, a dispatcher, two tunnel servers and an
//! agent on loopback, relays a few real calls, prints what happened and a curl line to
//! try, then keeps serving until Ctrl-C.

use bytes::Bytes;
use clap::{Parser, Subcommand};
use http::Method;
use relay_tests::client::Caller;
use relay_tests::stack::{Stack, CALLER_KEY, TUNNEL_ID};
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
