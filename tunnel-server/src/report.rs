//! Reporting to dispatchers: one `Registry.Report` stream per dispatcher. It opens with a
//! `ServerIntro`, announces each tunnel id when it gets its first stream here and when its
//! last one leaves (not per stream), and sends a compact `LoadReport` every
//! `report_interval` (per tunnel id figures, calls in flight, the smoothed CPU use that
//! `crate::load` measures), and early (at most one per [`EARLY_REPORT_GAP`]) when calls
//! start to wait in a queue here. On reconnect the full set of tunnel ids is announced again.
//!
//! Announcements are computed as the difference between what the hub holds and what this
//! dispatcher was told, so they can neither be lost nor reordered.
//!
//! Beside the report stream runs `Registry.Watch`: the dispatcher's view of the fleet,
//! kept in the hub and passed on to agents (see `Hub::set_fleet`). A dispatcher without
//! it (UNIMPLEMENTED) is reported on without fleet news.
//!
//! A dispatcher that answers ALREADY_EXISTS holds another live instance of this server
//! id: a configuration error (two servers with one `server_id`), logged as an error on
//! every retry until one of them goes.
//!
//! With a `dispatcher_key` configured the stream carries `authorization: Bearer <key>`;
//! a dispatcher that refuses it (UNAUTHENTICATED / PERMISSION_DENIED) is logged with its
//! reason and retried with backoff like any other failure. The key is never logged.
//!
//! The reporters run on the control plane's thread (`relay_common::runtime::ControlRuntime`,
//! started in `crate::start`): a storm of agent stream opens on the agent runtime cannot
//! delay a report past the dispatcher's lease.
//!
//! Reconnects back off from 100 ms, doubling to [`RETRY_MAX`] (1 s), each with ±25%
//! jitter, and start over from 100 ms once a report stream was accepted (it outlived one
//! report tick). So a dispatcher that crashes and comes back hears from every server within
//! 1.25 s of listening again, however often it crashed before. (An earlier version kept
//! the backoff of past outages and capped it at 5 s: after a second crash the servers
//! stayed away for up to 6.25 s, and the dispatcher answered `tunnel_unavailable` meanwhile.)

use crate::hub::Hub;
use relay_common::Secret;
use relay_proto::registry_client::RegistryClient;
use relay_proto::TunnelLoad;
use relay_proto::{
    server_report, LoadReport, ServerIntro, ServerReport, TunnelDown, TunnelUp, WatchRequest,
};
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::time::{Instant, MissedTickBehavior};
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

/// First wait before reconnecting a report stream.
const RETRY_INITIAL: Duration = Duration::from_millis(100);
/// Longest wait between two reconnects (before jitter).
const RETRY_MAX: Duration = Duration::from_secs(1);
/// How long dialing a dispatcher may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
/// How long after a tunnel id comes or goes the announcements go out: the changes of that
/// moment go together. Each round reads every tunnel id the hub holds; when ten thousand
/// came one by one, a round per tunnel id read them all ten thousand times (on the report's
/// own thread, that work is no longer held back by the storm that causes it).
const ANNOUNCE_BATCH: Duration = Duration::from_millis(10);
/// Shortest time between a load report and one sent early because calls started to wait.
pub const EARLY_REPORT_GAP: Duration = Duration::from_millis(100);

pub struct Reporter {
    pub hub: Arc<Hub>,
    /// The server's smoothed CPU use, per mille (`crate::load`).
    pub cpu: Arc<std::sync::atomic::AtomicU32>,
    pub dispatcher: String,
    pub intro: ServerIntro,
    pub interval: Duration,
    /// Shared secret the dispatcher expects from tunnel servers, if any.
    pub key: Option<Secret>,
    /// How the dispatcher is dialed: TLS for `https://` URLs (`[dispatcher_tls]`, `None`
    /// dials plain h2c) and the report connection's HTTP/2 limits (`[dispatcher_h2]`).
    pub client: relay_common::grpc::GrpcClient,
    /// `max_frame_bytes`: the largest message sent to or accepted from the dispatcher.
    pub max_frame_bytes: usize,
    pub stop: CancellationToken,
}

impl Reporter {
    pub async fn run(self) {
        let mut backoff = RETRY_INITIAL;
        let mut logged_down = false;
        while !self.stop.is_cancelled() {
            let mut accepted = false;
            let result = self.session(&mut accepted).await;
            if accepted {
                // The stream was up: this outage starts afresh.
                backoff = RETRY_INITIAL;
                logged_down = false;
            }
            match result {
                Ok(()) => return,
                Err(e) if e.contains("AlreadyExists") => {
                    error!(dispatcher = %self.dispatcher, server_id = %self.intro.server_id, error = %e, "another live tunnel server reports with this server id: give each server its own server_id");
                }
                Err(e) => {
                    if !logged_down {
                        warn!(dispatcher = %self.dispatcher, error = %e, "dispatcher report stream down; retrying");
                        logged_down = true;
                    }
                }
            }
            let jitter = rand::random::<f64>() * 0.5 + 0.75;
            tokio::select! {
                _ = self.stop.cancelled() => return,
                _ = tokio::time::sleep(backoff.mul_f64(jitter)) => {}
            }
            backoff = (backoff * 2).min(RETRY_MAX);
        }
    }

    /// One report stream; returns Ok on stop, Err when the stream broke. Sets `accepted`
    /// once the dispatcher kept the stream open past a report tick (a refusal ends it at
    /// once).
    async fn session(&self, accepted: &mut bool) -> Result<(), String> {
        let endpoint = self
            .client
            .endpoint(&self.dispatcher)
            .map_err(|e| e.to_string())?;
        let channel = self
            .client
            .connect(endpoint)
            .await
            .map_err(|e| format!("{e}: {}", source_chain(&e)))?;
        let mut client = RegistryClient::new(channel)
            .max_decoding_message_size(self.max_frame_bytes)
            .max_encoding_message_size(self.max_frame_bytes);
        // Set once the dispatcher's Watch answer lists `partial-load`.
        let partial_ok = Arc::new(AtomicBool::new(false));
        let _watch = AbortOnDrop(tokio::spawn(watch(
            client.clone(),
            self.hub.clone(),
            self.dispatcher.clone(),
            self.intro.server_id.clone(),
            self.key.clone(),
            partial_ok.clone(),
        )));
        let (tx, rx) = mpsc::channel(64);
        let _ = tx
            .send(ServerReport::of(server_report::Kind::Intro(
                self.intro.clone(),
            )))
            .await;
        let mut request = tonic::Request::new(ReceiverStream::new(rx));
        if let Some(key) = &self.key {
            let value = format!("Bearer {}", key.expose())
                .parse()
                .map_err(|_| "dispatcher_key is not a valid header value".to_string())?;
            request.metadata_mut().insert("authorization", value);
        }
        let mut call = tokio::spawn(async move { client.report(request).await });
        info!(dispatcher = %self.dispatcher, "reporting to dispatcher");
        let mut told: HashSet<String> = HashSet::new();
        // What this dispatcher was last sent of each tunnel id's figures.
        let mut sent = Sent::new(partial_ok);
        let mut tick = tokio::time::interval(self.interval);
        tick.set_missed_tick_behavior(MissedTickBehavior::Skip);
        let mut was_draining = false;
        // Load ticks so far: the first fires at once, the second after a full period.
        let mut ticks = 0u32;
        // Calls that start to wait here make a report go early: the dispatcher then spills
        // away from a saturated home within milliseconds, not at the next period.
        let mut queued = self.hub.queued_calls.subscribe();
        let mut last_load = Instant::now();
        loop {
            // Register interest before reading the hub so no change slips between.
            let changed = self.hub.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            let (ups, downs) = self.hub.tunnel_changes(&told);
            for id in ups {
                sent.forget(&id);
                told.insert(id.clone());
                let up =
                    ServerReport::of(server_report::Kind::TunnelUp(TunnelUp { tunnel_id: id }));
                tx.send(up)
                    .await
                    .map_err(|_| "report stream closed".to_string())?;
            }
            for id in downs {
                sent.forget(&id);
                told.remove(&id);
                let down = ServerReport::of(server_report::Kind::TunnelDown(TunnelDown {
                    tunnel_id: id,
                }));
                tx.send(down)
                    .await
                    .map_err(|_| "report stream closed".to_string())?;
            }
            let draining = self.hub.is_draining();
            let send_load = draining != was_draining;
            was_draining = draining;
            if send_load {
                self.send_load(&tx, &mut sent).await?;
                last_load = Instant::now();
            }
            tokio::select! {
                biased;
                _ = self.stop.cancelled() => {
                    drop(tx);
                    let _ = tokio::time::timeout(Duration::from_secs(1), call).await;
                    return Ok(());
                }
                _ = &mut changed => {
                    // Tunnel ids coming in a storm (thousands of agents opening at once)
                    // go out together: each announcement round reads every tunnel id.
                    tokio::time::sleep(ANNOUNCE_BATCH).await;
                }
                due = tick.tick() => {
                    self.hub.metrics.report_lateness.observe(due.elapsed().as_secs_f64());
                    ticks = ticks.saturating_add(1);
                    self.send_load(&tx, &mut sent).await?;
                    last_load = Instant::now();
                }
                Ok(()) = queued.changed() => {
                    queued.borrow_and_update();
                    if last_load.elapsed() >= EARLY_REPORT_GAP {
                        self.send_load(&tx, &mut sent).await?;
                        last_load = Instant::now();
                    }
                }
            }
            if ticks >= 2 && !call.is_finished() {
                *accepted = true;
            }
            if call.is_finished() {
                return Err(match (&mut call).await {
                    Ok(Err(status)) => format!(
                        "dispatcher ended the report stream: {:?}: {}",
                        status.code(),
                        status.message()
                    ),
                    _ => "dispatcher ended the report stream".to_string(),
                });
            }
        }
    }

    async fn send_load(
        &self,
        tx: &mpsc::Sender<ServerReport>,
        sent: &mut Sent,
    ) -> Result<(), String> {
        let (tunnels, partial) = sent.report(self.hub.load());
        let calls_in_flight = self.hub.metrics.in_flight.get().max(0) as u32;
        let report = LoadReport {
            tunnels,
            calls_in_flight,
            draining: self.hub.is_draining(),
            cpu_permille: self.cpu.load(std::sync::atomic::Ordering::Relaxed),
            partial,
        };
        tx.send(ServerReport::of(server_report::Kind::Load(report)))
            .await
            .map_err(|_| "report stream closed".to_string())
    }
}

/// The figures one dispatcher was last sent, so that a load report to a dispatcher that
/// reads partial reports carries only what changed. Every server reports every tunnel id it
/// holds to every dispatcher each `report_interval`: with thousands of tunnel ids that
/// whole report was most of what a dispatcher's control thread did (decoding it, and
/// comparing each tunnel id's figures with the last ones), at rest as much as under load.
struct Sent {
    /// Set once the dispatcher listed `partial-load` (`relay_proto::FEATURE_PARTIAL_LOAD`).
    partial_ok: Arc<AtomicBool>,
    /// A whole report went out on this stream.
    whole_sent: bool,
    figures: HashMap<String, TunnelLoad>,
}

impl Sent {
    fn new(partial_ok: Arc<AtomicBool>) -> Self {
        Sent {
            partial_ok,
            whole_sent: false,
            figures: HashMap::new(),
        }
    }

    /// A tunnel id came or went: the next report lists it (when it is still here).
    fn forget(&mut self, tunnel_id: &str) {
        self.figures.remove(tunnel_id);
    }

    /// What the next report carries of `now` (every tunnel id's figures), and whether it is
    /// partial: the first report on the stream, and every report to a dispatcher that did
    /// not list `partial-load`, is whole.
    fn report(&mut self, now: Vec<TunnelLoad>) -> (Vec<TunnelLoad>, bool) {
        let first = !self.whole_sent;
        self.whole_sent = true;
        if !self.partial_ok.load(Ordering::Relaxed) {
            // Nothing to keep: should the dispatcher list the feature later, the first
            // partial report lists every tunnel id.
            self.figures.clear();
            return (now, false);
        }
        let mut out = Vec::new();
        let mut current = HashMap::with_capacity(now.len());
        for t in now {
            let kept = match self.figures.remove(&t.tunnel_id) {
                // Within the tolerance: the dispatcher keeps what it was sent, and so the
                // next comparison is with that, not with figures it never saw.
                Some(s) if !first && !moved(&s, &t) => s,
                _ => {
                    out.push(t.clone());
                    t
                }
            };
            current.insert(kept.tunnel_id.clone(), kept);
        }
        self.figures = current;
        (out, !first)
    }
}

/// Whether a tunnel id's figures moved from what was sent: any stream or queue count, or
/// its round trip by more than an eighth (the agents' RTT is a smoothed figure that drifts
/// a little every heartbeat; routing compares RTTs in tiers far wider than that).
fn moved(sent: &TunnelLoad, now: &TunnelLoad) -> bool {
    sent.idle != now.idle
        || sent.busy != now.busy
        || sent.queued != now.queued
        || sent.rtt_us.abs_diff(now.rtt_us) > sent.rtt_us / 8
        || (sent.rtt_us == 0) != (now.rtt_us == 0)
}

/// Aborts the task when dropped (the watch lives as long as its report session).
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Follows the dispatcher's fleet view into the hub until the stream ends.
async fn watch(
    mut client: RegistryClient<tonic::transport::Channel>,
    hub: Arc<Hub>,
    dispatcher: String,
    server_id: String,
    key: Option<Secret>,
    partial_ok: Arc<AtomicBool>,
) {
    let mut request = tonic::Request::new(WatchRequest { server_id });
    if let Some(key) = &key {
        if let Ok(value) = format!("Bearer {}", key.expose()).parse() {
            request.metadata_mut().insert("authorization", value);
        }
    }
    let mut stream = match client.watch(request).await {
        Ok(r) => {
            let listed = relay_proto::lists_feature(
                r.metadata(),
                relay_proto::REGISTRY_FEATURES,
                relay_proto::FEATURE_PARTIAL_LOAD,
            );
            partial_ok.store(listed, Ordering::Relaxed);
            r.into_inner()
        }
        Err(s) if s.code() == tonic::Code::Unimplemented => {
            info!(%dispatcher, "dispatcher sends no fleet news; agents learn servers from placement only");
            return;
        }
        Err(s) => {
            warn!(%dispatcher, status = %s.message(), "fleet watch refused");
            return;
        }
    };
    while let Ok(Some(fleet)) = stream.message().await {
        hub.set_fleet(&dispatcher, fleet.members);
    }
}

/// The causes under a transport error (a TLS refusal hides two levels down).
fn source_chain(e: &dyn std::error::Error) -> String {
    let mut out = Vec::new();
    let mut cur = e.source();
    while let Some(c) = cur {
        out.push(c.to_string());
        cur = c.source();
    }
    out.join(": ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(id: &str, idle: u32, rtt_us: u32) -> TunnelLoad {
        TunnelLoad {
            tunnel_id: id.into(),
            idle,
            busy: 0,
            queued: 0,
            rtt_us,
        }
    }

    fn ids(v: &[TunnelLoad]) -> Vec<&str> {
        v.iter().map(|t| t.tunnel_id.as_str()).collect()
    }

    #[test]
    fn after_a_whole_first_report_only_what_moved_is_sent() {
        let mut sent = Sent::new(Arc::new(AtomicBool::new(true)));
        let (out, partial) = sent.report(vec![t("a", 1, 1000), t("b", 2, 1000)]);
        assert!(!partial, "the first report on a stream is whole");
        assert_eq!(ids(&out), ["a", "b"]);
        let (out, partial) = sent.report(vec![t("a", 1, 1000), t("b", 3, 1000)]);
        assert!(partial);
        assert_eq!(ids(&out), ["b"], "a's figures did not move");
        let (out, _) = sent.report(vec![t("a", 1, 1000), t("b", 3, 1000)]);
        assert!(
            out.is_empty(),
            "nothing moved: an empty report renews the lease"
        );
    }

    #[test]
    fn a_round_trip_moves_by_more_than_an_eighth_of_what_was_sent() {
        let mut sent = Sent::new(Arc::new(AtomicBool::new(true)));
        sent.report(vec![t("a", 1, 1000)]);
        // Drift within the tolerance, in steps: compared with what the dispatcher has.
        for rtt in [1060, 1120, 1125] {
            let (out, _) = sent.report(vec![t("a", 1, rtt)]);
            assert!(out.is_empty(), "{rtt} us is within an eighth of 1000");
        }
        let (out, _) = sent.report(vec![t("a", 1, 1126)]);
        assert_eq!(out[0].rtt_us, 1126);
        let (out, _) = sent.report(vec![t("a", 1, 0)]);
        assert_eq!(ids(&out), ["a"], "a round trip no longer known is news");
    }

    #[test]
    fn a_tunnel_id_that_came_or_went_is_sent_again() {
        let mut sent = Sent::new(Arc::new(AtomicBool::new(true)));
        sent.report(vec![t("a", 1, 0), t("b", 1, 0)]);
        // b went down and came back between two reports, with the same figures.
        sent.forget("b");
        let (out, _) = sent.report(vec![t("a", 1, 0), t("b", 1, 0)]);
        assert_eq!(ids(&out), ["b"]);
        // a left: a later a is new again.
        sent.report(vec![t("b", 1, 0)]);
        let (out, _) = sent.report(vec![t("a", 1, 0), t("b", 1, 0)]);
        assert_eq!(ids(&out), ["a"]);
    }

    #[test]
    fn a_dispatcher_that_reads_no_partial_reports_gets_whole_ones() {
        let ok = Arc::new(AtomicBool::new(false));
        let mut sent = Sent::new(ok.clone());
        for _ in 0..3 {
            let (out, partial) = sent.report(vec![t("a", 1, 0), t("b", 1, 0)]);
            assert!(!partial);
            assert_eq!(ids(&out), ["a", "b"]);
        }
        // It lists the feature later: the first partial report lists everything.
        ok.store(true, Ordering::Relaxed);
        let (out, partial) = sent.report(vec![t("a", 1, 0), t("b", 1, 0)]);
        assert!(partial);
        assert_eq!(ids(&out), ["a", "b"]);
        let (out, _) = sent.report(vec![t("a", 1, 0), t("b", 1, 0)]);
        assert!(out.is_empty());
    }
}
