//! `relay-fleet idle`: what idle agent streams cost one tunnel server.
//!
//! Starts the real `relay-tunnel-server` binary (the one next to this executable, or in
//! `$RELAY_BIN_DIR`) with no dispatcher, one token (and tunnel id) per agent connection,
//! then opens `streams` `Tunnel.Connect` streams spread over `connections` HTTP/2
//! connections and keeps them idle: each stream answers every `Ping` with a `Pong`, as an
//! agent does, and nothing else. It waits until the server's `relay_tunnel_streams` holds
//! them all, lets them sit idle for `idle`, and reads the server's resident memory
//! (`VmRSS`) before the first stream and after the idle window, and the server's CPU time
//! over the window (`/proc/<pid>/stat`).
//!
//! The agent side is a lean client on the `h2` crate, not the agent library: one task per
//! stream holding the stream's two halves, so 100,000 streams take a few hundred MB on the
//! measuring side and the cost read is the server's alone. It sends the metadata the real
//! agent sends (features, connection name, body credit), so the server keeps the same
//! state per stream as for a real agent.
//!
//! Nothing here prints to stdout: progress goes to the caller's closure, and the caller
//! prints the [`Report`].

use crate::procs::{self, ScratchDir, Spawn, TunnelServerOpts, TunnelServerProc};
use bytes::{Buf, BufMut, Bytes, BytesMut};
use prost::Message;
use relay_proto::{agent_frame, server_frame, AgentFrame, Pong, ServerFrame};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

/// What to open and how long to watch.
#[derive(Clone, Debug)]
pub struct Options {
    /// Idle streams to open in all.
    pub streams: usize,
    /// Agent connections they are spread over (one token and tunnel id each).
    pub connections: usize,
    /// The server's `heartbeat` (the binary's default, 10 s, when `None`).
    pub heartbeat: Option<Duration>,
    /// How long the streams sit idle while the server's CPU is read.
    pub idle: Duration,
    /// Deadline for every stream to be held by the server.
    pub within: Duration,
    /// The server's `worker_threads` (one per core when `None`).
    pub worker_threads: Option<usize>,
    /// Streams each connection has opening at once (waiting for their hello), as an
    /// agent's `max_opening` bounds them.
    pub opening: usize,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            streams: 100_000,
            connections: 100,
            heartbeat: None,
            idle: Duration::from_secs(30),
            within: Duration::from_secs(600),
            worker_threads: None,
            opening: 64,
        }
    }
}

/// The figures of one run.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Report {
    pub streams: usize,
    pub connections: usize,
    /// The server's `VmRSS` once up, before any stream, KiB.
    pub rss_before_kib: u64,
    /// Its `VmRSS` as soon as it held every stream, KiB.
    pub rss_held_kib: u64,
    /// Its `VmRSS` at the end of the idle window, KiB: the figure per stream is from this.
    pub rss_after_kib: u64,
    /// Its peak `VmRSS` (`VmHWM`) over the run, KiB.
    pub rss_peak_kib: u64,
    /// `(rss_after - rss_before) / streams`.
    pub bytes_per_stream: f64,
    /// How long opening every stream took, up to the server holding them all.
    pub open_seconds: f64,
    /// The idle window.
    pub idle_seconds: f64,
    /// Server CPU time over the idle window, seconds.
    pub idle_cpu_seconds: f64,
    /// Streams the server held at the end of the window (`relay_tunnel_streams`).
    pub held_at_end: u64,
    /// Pings the streams answered during the window.
    pub pongs_in_window: u64,
    /// Streams that ended (refused or closed by the server) during the run.
    pub ended: u64,
    /// The first few reasons streams ended.
    pub end_reasons: Vec<String>,
    /// This (measuring) process's `VmRSS` at the end, KiB.
    pub client_rss_kib: u64,
}

impl Report {
    /// Server CPU per second of idle time, as a share of one core.
    pub fn cpu_share(&self) -> f64 {
        if self.idle_seconds > 0.0 {
            self.idle_cpu_seconds / self.idle_seconds
        } else {
            0.0
        }
    }

    /// The terminal summary.
    pub fn table(&self) -> String {
        let mib = |kib: u64| kib as f64 / 1024.0;
        let mut s = String::new();
        use std::fmt::Write as _;
        let _ = writeln!(
            s,
            "idle streams: {} on {} connections, all held after {:.1} s",
            self.streams, self.connections, self.open_seconds
        );
        let _ = writeln!(
            s,
            "tunnel server RSS: before {:.1} MiB, all held {:.1} MiB, after {:.0} s idle {:.1} MiB (peak {:.1} MiB)",
            mib(self.rss_before_kib),
            mib(self.rss_held_kib),
            self.idle_seconds,
            mib(self.rss_after_kib),
            mib(self.rss_peak_kib)
        );
        let _ = writeln!(s, "bytes per idle stream: {:.0}", self.bytes_per_stream);
        let _ = writeln!(
            s,
            "tunnel server CPU while idle: {:.2} s in {:.0} s = {:.1}% of a core ({} pings answered)",
            self.idle_cpu_seconds,
            self.idle_seconds,
            100.0 * self.cpu_share(),
            self.pongs_in_window
        );
        let _ = writeln!(
            s,
            "streams held at the end: {} (ended during the run: {})",
            self.held_at_end, self.ended
        );
        for r in &self.end_reasons {
            let _ = writeln!(s, "  ended: {r}");
        }
        let _ = writeln!(
            s,
            "measuring process RSS: {:.1} MiB",
            mib(self.client_rss_kib)
        );
        s
    }
}

/// What the client's streams saw, shared by their tasks.
#[derive(Default)]
struct Counters {
    /// Streams that got their hello.
    hellos: AtomicU64,
    pongs: AtomicU64,
    ended: AtomicU64,
    reasons: parking_lot::Mutex<Vec<String>>,
}

impl Counters {
    fn ended(&self, why: String) {
        self.ended.fetch_add(1, Ordering::Relaxed);
        let mut r = self.reasons.lock();
        if r.len() < 5 && !r.contains(&why) {
            r.push(why);
        }
    }
}

/// The token and tunnel id of connection `i`.
fn identity(i: usize) -> (String, String) {
    (format!("idle-token-{i}"), format!("idle-{i}"))
}

/// Runs the measurement; `progress` hears a line every few seconds while streams open.
pub async fn run(o: &Options, progress: impl Fn(&str)) -> anyhow::Result<Report> {
    anyhow::ensure!(o.streams > 0, "--streams must be at least 1");
    anyhow::ensure!(
        (1..=10_000).contains(&o.connections),
        "--connections must be 1..=10000"
    );
    anyhow::ensure!(
        o.connections <= o.streams,
        "--connections ({}) must not exceed --streams ({})",
        o.connections,
        o.streams
    );
    let per_conn = o.streams.div_ceil(o.connections);
    let dir = ScratchDir::new("idle")?;
    let mut extra = format!("max_streams_per_token = {}\n", per_conn.max(1024));
    if let Some(n) = o.worker_threads {
        extra.push_str(&format!("worker_threads = {n}\n"));
    }
    let opts = TunnelServerOpts {
        server_id: "ts-idle".into(),
        tokens: (0..o.connections).map(identity).collect(),
        heartbeat: o.heartbeat.unwrap_or(Duration::from_secs(10)),
        extra,
        ..TunnelServerOpts::default()
    };
    let how = Spawn {
        env: vec![("RELAY_LOG".into(), "info".into())],
        own_process_group: false,
    };
    let server = TunnelServerProc::start_on_with(dir.path(), opts, None, &how).await?;
    // Let the runtime's threads and the first scrape settle before the baseline.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let _ = procs::scrape(server.admin_addr).await?;
    let rss_before_kib = server.proc.rss_kib()?;

    let counters = Arc::new(Counters::default());
    let started = Instant::now();
    let mut conns = Vec::with_capacity(o.connections);
    for i in 0..o.connections {
        // The last connections take fewer streams when they do not divide evenly.
        let n = per_conn.min(o.streams.saturating_sub(i * per_conn));
        let (token, _) = identity(i);
        conns.push(tokio::spawn(connection(
            server.agent_addr,
            token,
            format!("idle-conn-{i}"),
            n,
            o.opening.max(1),
            counters.clone(),
        )));
    }
    let deadline = started + o.within;
    let mut next_progress = Instant::now() + Duration::from_secs(5);
    let mut opened_all = false;
    loop {
        let held = held(server.admin_addr).await.unwrap_or(0);
        let hellos = counters.hellos.load(Ordering::Relaxed);
        if !opened_all && conns.iter().all(|c| c.is_finished()) {
            opened_all = true;
            for c in conns.drain(..) {
                c.await??;
            }
        }
        if held as usize >= o.streams && hellos as usize >= o.streams {
            break;
        }
        if counters.ended.load(Ordering::Relaxed) > 0 {
            anyhow::bail!(
                "{} streams ended while opening: {}",
                counters.ended.load(Ordering::Relaxed),
                counters.reasons.lock().join("; ")
            );
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "the server holds {held} of {} streams after {:?} (hellos {hellos})",
            o.streams,
            o.within
        );
        if Instant::now() >= next_progress {
            next_progress += Duration::from_secs(5);
            progress(&format!(
                "{:>5.0} s: server holds {held} streams, {hellos} hellos, server RSS {:.1} MiB",
                started.elapsed().as_secs_f64(),
                server.proc.rss_kib().unwrap_or(0) as f64 / 1024.0
            ));
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let open_seconds = started.elapsed().as_secs_f64();
    let rss_held_kib = server.proc.rss_kib()?;
    progress(&format!(
        "all {} streams held after {open_seconds:.1} s; idle for {:?}",
        o.streams, o.idle
    ));

    let pid = server.proc.pid();
    let cpu0 = cpu_seconds(pid)?;
    let pongs0 = counters.pongs.load(Ordering::Relaxed);
    let t0 = Instant::now();
    tokio::time::sleep(o.idle).await;
    let cpu1 = cpu_seconds(pid)?;
    let idle_seconds = t0.elapsed().as_secs_f64();
    let pongs_in_window = counters.pongs.load(Ordering::Relaxed) - pongs0;
    let rss_after_kib = server.proc.rss_kib()?;
    let rss_peak_kib = server.proc.peak_rss_kib()?;
    let held_at_end = held(server.admin_addr).await?;
    let ended = counters.ended.load(Ordering::Relaxed);
    let end_reasons = counters.reasons.lock().clone();
    Ok(Report {
        streams: o.streams,
        connections: o.connections,
        rss_before_kib,
        rss_held_kib,
        rss_after_kib,
        rss_peak_kib,
        bytes_per_stream: (rss_after_kib.saturating_sub(rss_before_kib) * 1024) as f64
            / o.streams as f64,
        open_seconds,
        idle_seconds,
        idle_cpu_seconds: cpu1 - cpu0,
        held_at_end,
        pongs_in_window,
        ended,
        end_reasons,
        client_rss_kib: procs::self_rss_kib().unwrap_or(0),
    })
}

/// Streams the server holds, by its metrics.
async fn held(admin: SocketAddr) -> anyhow::Result<u64> {
    let text = procs::scrape(admin).await?;
    Ok(procs::metric(&text, "relay_tunnel_streams", &[]) as u64)
}

/// utime + stime of a process, seconds (`/proc/<pid>/stat`, in USER_HZ = 100 ticks).
fn cpu_seconds(pid: u32) -> anyhow::Result<f64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // After "pid (comm) ": state is field 3; utime and stime are fields 14 and 15.
    let rest = text
        .rsplit_once(") ")
        .map(|(_, r)| r)
        .ok_or_else(|| anyhow::anyhow!("/proc/{pid}/stat: no comm"))?;
    let f: Vec<&str> = rest.split_whitespace().collect();
    let tick = |i: usize| -> anyhow::Result<f64> {
        Ok(f.get(i)
            .ok_or_else(|| anyhow::anyhow!("/proc/{pid}/stat: short"))?
            .parse::<f64>()?)
    };
    Ok((tick(11)? + tick(12)?) / 100.0)
}

/// One agent connection: opens `n` streams on it, each in its own task, `opening` at a
/// time (a stream is open once its hello came).
async fn connection(
    addr: SocketAddr,
    token: String,
    conn_name: String,
    n: usize,
    opening: usize,
    counters: Arc<Counters>,
) -> anyhow::Result<()> {
    let opening = Arc::new(tokio::sync::Semaphore::new(opening));
    let tcp = tokio::net::TcpStream::connect(addr).await?;
    tcp.set_nodelay(true)?;
    let (send, conn) = h2::client::Builder::new()
        .initial_window_size(64 * 1024)
        .initial_connection_window_size(16 * 1024 * 1024)
        .handshake::<_, Bytes>(tcp)
        .await?;
    let c = counters.clone();
    tokio::spawn(async move {
        if let Err(e) = conn.await {
            c.ended(format!("connection: {e}"));
        }
    });
    let mut send = send.ready().await?;
    let credit = relay_proto::body_credit(relay_common::h2::H2Limits::TUNNEL.stream_window_bytes);
    for _ in 0..n {
        let req = http::Request::builder()
            .method(http::Method::POST)
            .uri(format!("http://{addr}/relay.v1.Tunnel/Connect"))
            .header("content-type", "application/grpc")
            .header("te", "trailers")
            .header("authorization", format!("Bearer {token}"))
            .header(relay_proto::AGENT_FEATURES, "fleet,inline-body")
            .header(relay_proto::AGENT_CONN, conn_name.as_str())
            .header(relay_proto::AGENT_CREDIT, credit.to_string())
            .body(())?;
        let permit = opening.clone().acquire_owned().await?;
        send = send.ready().await?;
        let (response, out) = send.send_request(req, false)?;
        tokio::spawn(stream(response, out, permit, counters.clone()));
    }
    Ok(())
}

/// One idle stream: reads the server's frames and answers each ping.
async fn stream(
    response: h2::client::ResponseFuture,
    mut out: h2::SendStream<Bytes>,
    opening: tokio::sync::OwnedSemaphorePermit,
    counters: Arc<Counters>,
) {
    let mut opening = Some(opening);
    let why = async {
        let response = response.await?;
        let status = |h: &http::HeaderMap| {
            h.get("grpc-status").map(|s| {
                format!(
                    "grpc-status {} {}",
                    s.to_str().unwrap_or("?"),
                    h.get("grpc-message")
                        .and_then(|m| m.to_str().ok())
                        .unwrap_or("")
                )
            })
        };
        if let Some(s) = status(response.headers()) {
            anyhow::bail!("refused: {s}");
        }
        let mut body = response.into_body();
        let mut pending = BytesMut::new();
        while let Some(data) = body.data().await {
            let data = data?;
            let _ = body.flow_control().release_capacity(data.len());
            pending.extend_from_slice(&data);
            while let Some(message) = next_message(&mut pending)? {
                match ServerFrame::decode(message)?.kind {
                    Some(server_frame::Kind::Hello(_)) => {
                        counters.hellos.fetch_add(1, Ordering::Relaxed);
                        drop(opening.take());
                    }
                    Some(server_frame::Kind::Ping(p)) => {
                        out.send_data(pong(p.seq), false)?;
                        counters.pongs.fetch_add(1, Ordering::Relaxed);
                    }
                    _ => {}
                }
            }
            if pending.is_empty() {
                // Hold no buffer between frames.
                pending = BytesMut::new();
            }
        }
        let trailers = body.trailers().await?;
        anyhow::bail!(
            "ended by the server: {}",
            trailers
                .as_ref()
                .and_then(status)
                .unwrap_or_else(|| "no status".into())
        )
    };
    let r: anyhow::Result<()> = why.await;
    if let Err(e) = r {
        counters.ended(format!("{e:#}"));
    }
}

/// The next whole gRPC message of `buf` (5-byte prefix: compressed flag, length), if any.
fn next_message(buf: &mut BytesMut) -> anyhow::Result<Option<Bytes>> {
    if buf.len() < 5 {
        return Ok(None);
    }
    anyhow::ensure!(buf[0] == 0, "compressed gRPC message");
    let len = u32::from_be_bytes([buf[1], buf[2], buf[3], buf[4]]) as usize;
    if buf.len() < 5 + len {
        return Ok(None);
    }
    buf.advance(5);
    Ok(Some(buf.split_to(len).freeze()))
}

/// A `Pong` answering ping `seq`, framed as a gRPC message.
fn pong(seq: u64) -> Bytes {
    let frame = AgentFrame::of(agent_frame::Kind::Pong(Pong { seq }));
    let len = frame.encoded_len();
    let mut b = BytesMut::with_capacity(5 + len);
    b.put_u8(0);
    b.put_u32(len as u32);
    frame.encode(&mut b).expect("room reserved");
    b.freeze()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_are_cut_at_their_length_prefix() {
        let mut buf = BytesMut::new();
        buf.extend_from_slice(&pong(7));
        buf.extend_from_slice(&pong(8)[..3]);
        let first = next_message(&mut buf).unwrap().expect("a whole message");
        assert_eq!(
            AgentFrame::decode(first).unwrap().kind,
            Some(agent_frame::Kind::Pong(Pong { seq: 7 }))
        );
        assert!(next_message(&mut buf).unwrap().is_none(), "half a message");
    }
}
