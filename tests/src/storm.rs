//! A storm of agent stream opens on tunnel server processes, and what it does to the
//! control plane (`relay-fleet storm`, and the short version in tests/tests/storm.rs).
//!
//! [`run`] starts the real binaries (a dispatcher and `servers` tunnel servers, each with
//! `worker_threads` workers, the report interval and lease of the product's defaults), waits
//! until the dispatcher routes every server, then opens `connections` agent connections to
//! each server at once (from distinct loopback sources, one tunnel id each, as agents
//! would) and `streams` `Tunnel.Connect` streams on each, all together. Each stream waits
//! for its hello, confirms it as an agent does and answers every heartbeat ping until the
//! end. Meanwhile it samples the processes' metrics every [`SAMPLE`]:
//!
//! - the dispatcher's `relay_dispatcher_lease_expiries_total` (must stay 0) and
//!   `relay_dispatcher_tunnel_servers` (its lowest value: must stay `servers`), and at the
//!   end the largest gap between two report frames it handled
//!   (`relay_dispatcher_report_gap_seconds`, as the bucket bound it fell under): the lease
//!   margin is `lease` minus that;
//! - each server's `relay_tunnel_report_lateness_seconds` (how late its load reports went
//!   out), `relay_tunnel_opens_waiting` (its highest sampled value) and
//!   `relay_tunnel_open_wait_seconds`;
//!
//! and reports how long the opens took to be admitted (the time from the storm's start to
//! each stream's hello: median, p99, the last one), the opens that failed and why, the
//! servers' RSS, and the dispatcher's and servers' WARN and ERROR log lines.

use crate::hostile::dial_from;
use crate::procs::{
    metric, scrape, DispatcherOpts, DispatcherProc, ScratchDir, Spawn, TunnelServerOpts,
    TunnelServerProc,
};
use relay_proto::agent_frame::Kind as Out;
use relay_proto::server_frame::Kind as In;
use relay_proto::tunnel_client::TunnelClient;
use relay_proto::{AgentFrame, Pong, ServerFrame};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::{IpAddr, Ipv4Addr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// How often the processes' metrics are sampled during the storm.
pub const SAMPLE: Duration = Duration::from_millis(100);

/// What storm to raise.
#[derive(Clone, Debug)]
pub struct StormOpts {
    /// Tunnel servers (each takes its own storm).
    pub servers: usize,
    /// Agent connections to each server, opened at once; each has a tunnel id of its own.
    pub connections: usize,
    /// Streams opened on each connection at once.
    pub streams: usize,
    /// `worker_threads` of the dispatcher and the servers (1: as the examples run them).
    pub worker_threads: usize,
    /// The servers' `report_interval`.
    pub report_interval: Duration,
    /// The dispatcher's `registry.lease`.
    pub lease: Duration,
    /// The servers' `heartbeat`.
    pub heartbeat: Duration,
    /// Distinct loopback sources (127.0.0.2, 127.0.0.3, ...) the connections come from.
    pub sources: usize,
    /// How long every stream may take to get its hello.
    pub deadline: Duration,
    /// How long the streams stay open (and the metrics sampled) once every one is in.
    pub hold: Duration,
    /// Extra top-level TOML for the servers' configs (e.g. `max_opens_in_progress = 64`).
    pub server_extra: String,
    /// The scratch directory's name prefix.
    pub scratch: String,
}

impl Default for StormOpts {
    fn default() -> Self {
        StormOpts {
            servers: 1,
            connections: 1000,
            streams: 20,
            worker_threads: 1,
            report_interval: Duration::from_secs(1),
            lease: Duration::from_secs(3),
            heartbeat: Duration::from_secs(5),
            sources: 64,
            deadline: Duration::from_secs(120),
            hold: Duration::from_secs(5),
            server_extra: String::new(),
            scratch: "relay-storm".into(),
        }
    }
}

/// What a storm did. Durations from the storm's start.
#[derive(Clone, Debug, Default)]
pub struct StormReport {
    pub wanted: u64,
    /// Streams that got their hello.
    pub opened: u64,
    /// Opens that failed, by what the client saw.
    pub failed: BTreeMap<String, u64>,
    /// Streams the server closed after their hello, before the end.
    pub closed_early: u64,
    pub open_p50: Duration,
    pub open_p99: Duration,
    /// The last stream's hello (every stream in), `None` when some never got in.
    pub all_in: Option<Duration>,
    /// `relay_dispatcher_lease_expiries_total` at the end.
    pub lease_expiries: f64,
    /// The lowest `relay_dispatcher_tunnel_servers` sampled.
    pub servers_min: f64,
    /// `relay_dispatcher_tunnel_servers` at the end.
    pub servers_end: f64,
    /// The bucket bound the largest report gap at the dispatcher fell under (seconds;
    /// `inf` past the largest bucket), and how many frames it saw.
    pub report_gap_max: f64,
    pub report_frames: f64,
    /// The same of the servers' load report lateness (the worst server).
    pub report_lateness_max: f64,
    /// The highest `relay_tunnel_opens_waiting` sampled, summed over the servers.
    pub opens_waiting_max: f64,
    /// The bucket bound the longest admission wait fell under (the worst server).
    pub open_wait_max: f64,
    /// The admission waits' sum (seconds, every server): above 0 when any open waited.
    pub open_wait_sum: f64,
    /// Every server's RSS at the end, MiB.
    pub server_rss_mib: Vec<u64>,
    /// WARN and ERROR lines of the dispatcher's and the servers' logs (first few).
    pub warnings: Vec<String>,
    pub warning_count: usize,
    pub lease: Duration,
}

impl StormReport {
    /// What the report says, one figure a line.
    pub fn render(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "streams opened:        {} of {}",
            self.opened, self.wanted
        );
        for (why, n) in &self.failed {
            let _ = writeln!(s, "  failed: {n} x {why}");
        }
        let _ = writeln!(s, "closed by the server:  {}", self.closed_early);
        let all_in = self
            .all_in
            .map_or("never (not every stream got in)".into(), |d| {
                format!("{d:.2?}")
            });
        let _ = writeln!(
            s,
            "admitted (hello):      p50 {:.2?}  p99 {:.2?}  all in {all_in}",
            self.open_p50, self.open_p99
        );
        let _ = writeln!(
            s,
            "lease expiries:        {} (servers routable: lowest {}, at the end {})",
            self.lease_expiries, self.servers_min, self.servers_end
        );
        let _ = writeln!(
            s,
            "report gap at dispatcher: <= {}s over {} frames (lease {:?}: margin >= {:.2}s)",
            self.report_gap_max,
            self.report_frames,
            self.lease,
            self.lease.as_secs_f64() - self.report_gap_max
        );
        let _ = writeln!(
            s,
            "load report lateness:  <= {}s (worst server)",
            self.report_lateness_max
        );
        let _ = writeln!(
            s,
            "opens waiting:         highest {} sampled; longest admission wait <= {}s, {:.1}s waited in all",
            self.opens_waiting_max, self.open_wait_max, self.open_wait_sum
        );
        let _ = writeln!(s, "server RSS (MiB):      {:?}", self.server_rss_mib);
        let _ = writeln!(s, "WARN/ERROR log lines:  {}", self.warning_count);
        for w in &self.warnings {
            let _ = writeln!(s, "  {w}");
        }
        s
    }
}

/// The bound of the lowest bucket of histogram `name` that holds every observation (the
/// largest observation is at most that); 0 when nothing was observed, `inf` past the
/// largest finite bucket. Also the count. Summed over every sample of that name.
pub fn histogram_max(text: &str, name: &str) -> (f64, f64) {
    let count = metric(text, &format!("{name}_count"), &[]);
    if count == 0.0 {
        return (0.0, 0.0);
    }
    let bucket = format!("{name}_bucket{{");
    let mut bounds: BTreeMap<u64, (f64, f64)> = BTreeMap::new();
    for line in text.lines().filter(|l| l.starts_with(&bucket)) {
        let Some((series, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let Some(le) = series
            .split("le=\"")
            .nth(1)
            .and_then(|r| r.split('"').next())
        else {
            continue;
        };
        let le = if le == "+Inf" {
            f64::INFINITY
        } else {
            le.parse().unwrap_or(f64::INFINITY)
        };
        let v: f64 = value.parse().unwrap_or(0.0);
        let e = bounds.entry(le.to_bits()).or_insert((le, 0.0));
        e.1 += v;
    }
    let mut sorted: Vec<(f64, f64)> = bounds.into_values().collect();
    sorted.sort_by(|a, b| a.0.total_cmp(&b.0));
    let max = sorted
        .iter()
        .find(|(_, n)| *n >= count)
        .map_or(f64::INFINITY, |(le, _)| *le);
    (max, count)
}

/// The token of connection `i`'s tunnel id.
fn token(i: usize) -> (String, String) {
    (format!("storm-token-{i:06}"), format!("storm-{i:06}"))
}

/// What the streams tell the storm.
#[derive(Default)]
struct Tally {
    opened: AtomicU64,
    closed_early: AtomicU64,
    failed: Mutex<BTreeMap<String, u64>>,
    /// Each stream's time to its hello.
    admitted: Mutex<Vec<Duration>>,
}

impl Tally {
    fn fail(&self, why: String) {
        *self.failed.lock().unwrap().entry(why).or_default() += 1;
    }
}

/// A short name for a failed open (the status code and the start of its message).
fn why(status: &tonic::Status) -> String {
    let mut msg = status.message().to_string();
    let mut cur = std::error::Error::source(status);
    while let Some(e) = cur {
        msg.push_str(": ");
        msg.push_str(&e.to_string());
        cur = e.source();
    }
    let msg: String = msg.chars().take(160).collect();
    format!("{:?}: {msg}", status.code())
}

/// One stream: open, hello, confirm, then answer pings until `stop`.
async fn stream(
    channel: tonic::transport::Channel,
    token: String,
    start: Instant,
    tally: Arc<Tally>,
    stop: CancellationToken,
) {
    let (tx, rx) = mpsc::channel(4);
    let mut req = tonic::Request::new(tokio_stream::wrappers::ReceiverStream::new(rx));
    req.metadata_mut().insert(
        "authorization",
        format!("Bearer {token}").parse().expect("a token is ASCII"),
    );
    let mut inbound = match TunnelClient::new(channel).connect(req).await {
        Ok(r) => r.into_inner(),
        Err(s) => return tally.fail(why(&s)),
    };
    match inbound.message().await {
        Ok(Some(ServerFrame {
            kind: Some(In::Hello(_)),
        })) => {}
        Ok(other) => return tally.fail(format!("no hello: {other:?}")),
        Err(s) => return tally.fail(why(&s)),
    }
    tally.admitted.lock().unwrap().push(start.elapsed());
    tally.opened.fetch_add(1, Ordering::Relaxed);
    if tx
        .send(AgentFrame::of(Out::Pong(Pong { seq: 0 })))
        .await
        .is_err()
    {
        tally.closed_early.fetch_add(1, Ordering::Relaxed);
        return;
    }
    loop {
        let frame = tokio::select! {
            _ = stop.cancelled() => return,
            f = inbound.message() => f,
        };
        match frame {
            Ok(Some(ServerFrame {
                kind: Some(In::Ping(p)),
            })) => {
                let _ = tx
                    .send(AgentFrame::of(Out::Pong(Pong { seq: p.seq })))
                    .await;
            }
            Ok(Some(_)) => {}
            Ok(None) | Err(_) => {
                if !stop.is_cancelled() {
                    tally.closed_early.fetch_add(1, Ordering::Relaxed);
                }
                return;
            }
        }
    }
}

/// The running fleet of a storm.
pub struct StormFleet {
    pub dispatcher: DispatcherProc,
    pub servers: Vec<TunnelServerProc>,
    pub dir: ScratchDir,
}

impl StormFleet {
    /// Starts the dispatcher and the servers and waits until the dispatcher routes every
    /// server.
    pub async fn start(o: &StormOpts) -> anyhow::Result<StormFleet> {
        anyhow::ensure!(o.servers > 0, "a storm needs at least one tunnel server");
        anyhow::ensure!(o.connections > 0 && o.streams > 0, "a storm needs streams");
        anyhow::ensure!(
            (1..=250).contains(&o.sources),
            "sources must be 1 to 250 (127.0.0.2 ...)"
        );
        let dir = ScratchDir::new(&o.scratch)?;
        let spawn = Spawn::default();
        let dispatcher = DispatcherProc::start_with(
            dir.path(),
            DispatcherOpts {
                worker_threads: Some(o.worker_threads),
                registry: format!("lease = \"{}ms\"", o.lease.as_millis()),
                ..DispatcherOpts::default()
            },
            &spawn,
        )
        .await?;
        let tokens: Vec<(String, String)> = (0..o.connections).map(token).collect();
        let mut servers = Vec::new();
        for i in 0..o.servers {
            let opts = TunnelServerOpts {
                server_id: format!("ts-{}", i + 1),
                zone: format!("zone-{}", i + 1),
                dispatchers: vec![dispatcher.registry_url()],
                tokens: tokens.clone(),
                heartbeat: o.heartbeat,
                report_interval: o.report_interval,
                extra: format!("worker_threads = {}\n{}", o.worker_threads, o.server_extra),
                ..TunnelServerOpts::default()
            };
            servers.push(TunnelServerProc::start_on_with(dir.path(), opts, None, &spawn).await?);
        }
        let admin = dispatcher.admin;
        let want = o.servers as f64;
        crate::poll::until(
            "the dispatcher routes every server",
            Duration::from_secs(30),
            || async move {
                let n = crate::procfleet::dispatcher_servers(admin).await;
                if n == want {
                    Ok(())
                } else {
                    Err(format!("{n} of {want}"))
                }
            },
        )
        .await?;
        Ok(StormFleet {
            dispatcher,
            servers,
            dir,
        })
    }

    /// Raises the storm on every server and reports.
    pub async fn storm(&self, o: &StormOpts) -> anyhow::Result<StormReport> {
        let tally = Arc::new(Tally::default());
        let stop = CancellationToken::new();
        let wanted = (o.servers * o.connections * o.streams) as u64;
        let start = Instant::now();
        let mut tasks = tokio::task::JoinSet::new();
        for server in &self.servers {
            let url = server.agent_url();
            for c in 0..o.connections {
                let from = IpAddr::V4(Ipv4Addr::new(127, 0, 0, 2 + (c % o.sources) as u8));
                let (url, tally, stop) = (url.clone(), tally.clone(), stop.clone());
                let (token, _) = token(c);
                let streams = o.streams;
                tasks.spawn(async move {
                    let channel = match dial_from(&url, from).await {
                        Ok(ch) => ch,
                        Err(s) => {
                            for _ in 0..streams {
                                tally.fail(format!("dial: {}", why(&s)));
                            }
                            return;
                        }
                    };
                    let mut set = tokio::task::JoinSet::new();
                    for _ in 0..streams {
                        set.spawn(stream(
                            channel.clone(),
                            token.clone(),
                            start,
                            tally.clone(),
                            stop.clone(),
                        ));
                    }
                    while set.join_next().await.is_some() {}
                });
            }
        }
        let mut servers_min = f64::INFINITY;
        let mut waiting_max: f64 = 0.0;
        let mut held_since: Option<Instant> = None;
        let deadline = start + o.deadline;
        loop {
            let (servers_now, waiting) = self.sample().await;
            if let Some(n) = servers_now {
                servers_min = servers_min.min(n);
            }
            waiting_max = waiting_max.max(waiting);
            let settled = tally.opened.load(Ordering::Relaxed)
                + tally.failed.lock().unwrap().values().sum::<u64>()
                >= wanted;
            if settled && held_since.is_none() {
                held_since = Some(Instant::now());
            }
            if held_since.is_some_and(|t| t.elapsed() >= o.hold) || Instant::now() >= deadline {
                break;
            }
            tokio::time::sleep(SAMPLE).await;
        }
        let dtext = scrape(self.dispatcher.admin).await?;
        let mut report = StormReport {
            wanted,
            opened: tally.opened.load(Ordering::Relaxed),
            failed: tally.failed.lock().unwrap().clone(),
            closed_early: tally.closed_early.load(Ordering::Relaxed),
            lease_expiries: metric(&dtext, "relay_dispatcher_lease_expiries_total", &[]),
            servers_min,
            servers_end: metric(&dtext, "relay_dispatcher_tunnel_servers", &[]),
            opens_waiting_max: waiting_max,
            lease: o.lease,
            ..StormReport::default()
        };
        (report.report_gap_max, report.report_frames) =
            histogram_max(&dtext, "relay_dispatcher_report_gap_seconds");
        for s in &self.servers {
            let text = scrape(s.admin_addr).await?;
            let (late, _) = histogram_max(&text, "relay_tunnel_report_lateness_seconds");
            report.report_lateness_max = report.report_lateness_max.max(late);
            let (wait, _) = histogram_max(&text, "relay_tunnel_open_wait_seconds");
            report.open_wait_max = report.open_wait_max.max(wait);
            report.open_wait_sum += metric(&text, "relay_tunnel_open_wait_seconds_sum", &[]);
            report
                .server_rss_mib
                .push(s.proc.rss_kib().unwrap_or(0) / 1024);
        }
        let mut admitted = tally.admitted.lock().unwrap().clone();
        admitted.sort();
        if let Some(last) = admitted.last() {
            let at = |q: f64| admitted[((admitted.len() - 1) as f64 * q).round() as usize];
            report.open_p50 = at(0.5);
            report.open_p99 = at(0.99);
            report.all_in = (admitted.len() as u64 == wanted).then_some(*last);
        }
        let logs = std::iter::once(self.dispatcher.proc.log())
            .chain(self.servers.iter().map(|s| s.proc.log()));
        for log in logs {
            for line in log
                .lines()
                .filter(|l| l.contains(" WARN ") || l.contains(" ERROR "))
            {
                report.warning_count += 1;
                if report.warnings.len() < 10 {
                    report.warnings.push(line.chars().take(240).collect());
                }
            }
        }
        stop.cancel();
        tasks.abort_all();
        Ok(report)
    }

    /// `relay_dispatcher_tunnel_servers` now (`None`: no answer within a second), and the
    /// servers' opens waiting summed (a server that does not answer counts 0).
    async fn sample(&self) -> (Option<f64>, f64) {
        let within = Duration::from_secs(1);
        let servers = tokio::time::timeout(within, scrape(self.dispatcher.admin));
        let waiting = futures::future::join_all(self.servers.iter().map(|s| async move {
            match tokio::time::timeout(within, scrape(s.admin_addr)).await {
                Ok(Ok(t)) => metric(&t, "relay_tunnel_opens_waiting", &[]),
                _ => 0.0,
            }
        }));
        let (servers, waiting) = tokio::join!(servers, waiting);
        let servers = match servers {
            Ok(Ok(t)) => Some(metric(&t, "relay_dispatcher_tunnel_servers", &[])),
            _ => None,
        };
        (servers, waiting.into_iter().sum())
    }
}

/// Starts the fleet, raises the storm, reports.
pub async fn run(o: &StormOpts) -> anyhow::Result<StormReport> {
    let fleet = StormFleet::start(o).await?;
    fleet.storm(o).await
}

/// `relay-fleet storm`'s flags.
#[derive(clap::Args, Debug)]
pub struct StormArgs {
    /// Tunnel servers (each takes its own storm).
    #[arg(long, default_value_t = 1)]
    pub servers: usize,
    /// Agent connections opened at once to each server (one tunnel id each).
    #[arg(long, default_value_t = 1000)]
    pub connections: usize,
    /// Streams opened at once on each connection.
    #[arg(long, default_value_t = 20)]
    pub streams: usize,
    /// `worker_threads` of the dispatcher and the servers.
    #[arg(long, default_value_t = 1)]
    pub worker_threads: usize,
    /// The servers' `report_interval`.
    #[arg(long, default_value = "1s", value_parser = humantime::parse_duration)]
    pub report_interval: Duration,
    /// The dispatcher's `registry.lease`.
    #[arg(long, default_value = "3s", value_parser = humantime::parse_duration)]
    pub lease: Duration,
    /// How long the streams stay open once every one is in.
    #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
    pub hold: Duration,
    /// How long every stream may take to get in.
    #[arg(long, default_value = "120s", value_parser = humantime::parse_duration)]
    pub deadline: Duration,
    /// Extra top-level lines of the servers' configs, e.g. `max_opens_in_progress = 64`
    /// (repeatable).
    #[arg(long = "server-config")]
    pub server_config: Vec<String>,
}

/// `relay-fleet storm`: raises the storm, prints the report; an error when a lease was
/// missed, a server stopped being routable or a stream did not get in.
pub async fn main(a: StormArgs) -> anyhow::Result<()> {
    let o = StormOpts {
        servers: a.servers,
        connections: a.connections,
        streams: a.streams,
        worker_threads: a.worker_threads,
        report_interval: a.report_interval,
        lease: a.lease,
        hold: a.hold,
        deadline: a.deadline,
        server_extra: a.server_config.iter().map(|l| format!("{l}\n")).collect(),
        ..StormOpts::default()
    };
    println!(
        "storm: {} server(s) x {} connections x {} streams = {} stream opens at once \
         (worker_threads {}, report_interval {:?}, lease {:?})",
        o.servers,
        o.connections,
        o.streams,
        o.servers * o.connections * o.streams,
        o.worker_threads,
        o.report_interval,
        o.lease
    );
    let r = run(&o).await?;
    print!("{}", r.render());
    anyhow::ensure!(
        r.lease_expiries == 0.0 && r.servers_min == o.servers as f64,
        "the control plane starved: {} lease(s) missed, {} of {} servers routable at the worst sample",
        r.lease_expiries,
        r.servers_min,
        o.servers
    );
    anyhow::ensure!(
        r.all_in.is_some(),
        "{} of {} streams did not get in",
        r.wanted - r.opened,
        r.wanted
    );
    Ok(())
}
