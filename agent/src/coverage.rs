//! Coverage: the sizing actor. It owns the table of tunnel streams (which server each
//! landed on, busy or idle, age, last use, retiring), each server's latest pressure and
//! draining flag, and where its load-balanced opens landed (`PlacementTally`); once per
//! `coverage.tick`, and at once when a server's queued-calls signal rises (or a call takes
//! a server's last idle stream while calls queue there), it takes a `Snapshot`, asks the
//! pure planner (`plan.rs`) for a `Plan`, and carries it out: tells the streams in
//! `plan.close` to retire, spawns stream opens (behind a jittered exponential backoff gate
//! after failed opens), logs and counts each coverage action (keeping the last [`RECENT_ACTIONS`]), and
//! publishes the states and those actions on a `watch`. Event plans are at most one per [`EVENT_GAP`]; they only grow (the planner's
//! `Cause::Pressure`).
//!
//! The actor never awaits the network: opens and retires run in the stream tasks, whose
//! news comes back as `StreamEvent`s. How a stream is opened is behind `Connector`, so
//! tests drive the actor with fake streams under paused time. The rules themselves live in
//! `plan`, which must not read the clock or do I/O.
//!
//! This file holds the actor's types, its loop, the snapshot and the carrying out of a
//! plan; `events` reads the streams' news, `view` publishes the view and the per-server
//! gauges, `backoff` is the gate in front of opens.

mod backoff;
mod events;
pub mod plan;
mod view;

#[cfg(test)]
mod tests;

use crate::error::OpenError;
use crate::metrics::AgentMetrics;
use futures::future::BoxFuture;
use plan::{
    ActionKind, Cause, PlacementTally, Plan, Planner, ServerKey, ServerView, Snapshot, State,
    StreamId, StreamView,
};
use serde::Serialize;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::future::Future;
use std::sync::atomic::{AtomicU32, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinSet;
use tokio::time::{Instant, Interval, MissedTickBehavior, Sleep};
use tonic::metadata::{Ascii, MetadataValue};
use tracing::{debug, info, warn};

use backoff::Backoff;
pub use view::{ActionReport, CoverageView, ReportedState, ServerReport, RECENT_ACTIONS};

/// Where a stream landed: its server's `ServerHello`.
#[derive(Clone, Debug, PartialEq)]
pub struct Landing {
    pub server_id: String,
    /// The server's life: random per process start.
    pub instance_id: String,
    /// Its direct agent-facing URL, empty when it offers none.
    pub direct_url: String,
    pub zone: String,
    /// The server's id for this stream.
    pub server_stream_id: u64,
    /// The server's ping period (zero: none announced).
    pub heartbeat: Duration,
    pub tunnel_id: String,
}

/// Why a landed stream ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CloseReason {
    /// The server ended the stream with OK (after GoingAway, or its own choice).
    ServerClosed,
    /// The server ended the stream with an error status.
    Status(String),
    /// The server sent a frame that breaks the protocol.
    Malformed(String),
    /// No frame from the server for three heartbeat periods.
    HeartbeatMissed,
    /// Retired by the agent and the server did not close it within the linger bound.
    Retired,
    /// The outbound half broke (the connection went away).
    Lost,
    /// The path to the server went silent: no frame on it while a stream idled for three
    /// of the server's liveness periods (`crate::liveness`).
    Silent,
}

impl std::fmt::Display for CloseReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CloseReason::ServerClosed => f.write_str("closed by the server"),
            CloseReason::Status(s) => write!(f, "server error: {s}"),
            CloseReason::Malformed(s) => write!(f, "malformed frame: {s}"),
            CloseReason::HeartbeatMissed => f.write_str("no heartbeat from the server"),
            CloseReason::Retired => f.write_str("retired"),
            CloseReason::Lost => f.write_str("connection lost"),
            CloseReason::Silent => {
                f.write_str("the tunnel server stopped answering on this connection")
            }
        }
    }
}

/// News from one stream task to the actor.
#[derive(Clone, Debug, PartialEq)]
pub enum StreamEvent {
    /// The ServerHello arrived: the stream is open on that server.
    Landed(Landing),
    CallStarted,
    /// The call on the stream ended; with how long it took from its head to its end when
    /// it was answered (the stream task's own clock: the actor may see both events of a
    /// short call at once).
    CallEnded(Option<Duration>),
    /// The server's latest count of this tunnel id's queued calls.
    Pressure(u32),
    /// The server sent Drain: its streams are recycled as the plan decides.
    Drained,
    /// The fleet as the servers know it (from any stream; the latest wins).
    Fleet(Vec<relay_proto::FleetMember>),
    /// A landed stream ended. Last event of a stream.
    Closed(CloseReason),
    /// The open failed before any hello. Last event of a stream.
    OpenFailed(OpenError),
    /// The open is still waiting for its hello past the open window's timeout: presumed
    /// lost (`Snapshot::stalled`); it may still land or fail.
    Stalled,
}

/// What a stream task gets from the actor: its id, the way to report, and the retire
/// signal (fires, or its sender is dropped, when the stream must send GoingAway).
#[derive(Debug)]
pub struct StreamLink {
    pub id: StreamId,
    /// Open straight to this URL (a server's direct URL) instead of the load balancer.
    pub target: Option<String>,
    /// Through the load balancer, naming this server id (`relay_proto::AGENT_STEER`).
    pub steer: Option<MetadataValue<Ascii>>,
    pub retire: oneshot::Receiver<()>,
    events: mpsc::UnboundedSender<(StreamId, StreamEvent)>,
}

impl StreamLink {
    /// Reports `event`; silently dropped if the actor is gone.
    pub fn emit(&self, event: StreamEvent) {
        let _ = self.events.send((self.id, event));
    }

    pub(crate) fn events_sender(&self) -> mpsc::UnboundedSender<(StreamId, StreamEvent)> {
        self.events.clone()
    }
}

/// Opens one tunnel stream and runs it to its end (the returned future is the stream
/// task). The real one dials a tunnel server; tests fake landings.
pub trait Connector: Send + Sync + 'static {
    fn open(&self, link: StreamLink) -> BoxFuture<'static, ()>;
}

/// The pure planning step, as the actor sees it (the real one is `plan::Planner`).
pub trait PlanStep: Send + 'static {
    fn plan(&mut self, snapshot: &Snapshot) -> Plan;
}

impl PlanStep for Planner {
    fn plan(&mut self, snapshot: &Snapshot) -> Plan {
        Planner::plan(self, snapshot)
    }
}

/// The actor's own knobs (the rules are in the planner).
#[derive(Clone, Debug)]
pub struct ActorSettings {
    /// Period of the sizing tick.
    pub tick: Duration,
    /// First backoff delay after a failed open.
    pub backoff_initial: Duration,
    /// Largest backoff delay.
    pub backoff_max: Duration,
    /// Hard cap on streams, applied again here in case a plan overshoots.
    pub max_streams: u32,
    /// How long shutdown waits for calls in flight before dropping the streams.
    pub drain_grace: Duration,
    /// `coverage.grace`, for the /systemcheck verdict.
    pub grace: Duration,
    /// `coverage.reconnect_for`: how long a lost server is remembered as lost, so that a
    /// new instance of it (the server restarted) is filled back at the reconnect pace.
    pub reconnect_for: Duration,
}

impl ActorSettings {
    pub fn from_config(c: &crate::config::Config) -> Self {
        ActorSettings {
            tick: c.coverage.tick,
            backoff_initial: c.backoff_initial,
            backoff_max: c.backoff_max,
            max_streams: c.coverage.max_streams,
            drain_grace: Duration::from_secs(10),
            grace: c.coverage.grace,
            reconnect_for: c.coverage.reconnect_for,
        }
    }
}

struct Entry {
    server: ServerKey,
    /// The server's calls in flight, shared with its `ServerInfo`.
    load: Arc<Load>,
    zone: String,
    busy: bool,
    opened_at: Instant,
    last_used: Instant,
    retiring: bool,
    retire: Option<oneshot::Sender<()>>,
    /// A fill open's stream that has carried no call (`plan::StreamView::probe`).
    probe: bool,
}

/// Where an open goes.
#[derive(Clone)]
enum Path {
    /// Through the load balancer, landing where it puts it.
    Balanced,
    /// Straight to the server's direct URL.
    Direct(ServerKey, String),
    /// Through the load balancer, naming the server (`CoverageConfig::steered_opens`).
    Steered(ServerKey),
}

struct Opening {
    started: Instant,
    retire: Option<oneshot::Sender<()>>,
    /// Opened for this server: straight to its direct URL, or `steered`.
    direct: Option<ServerKey>,
    /// Through the load balancer naming `direct`'s server.
    steered: bool,
    /// A fill open (`Plan::probes`).
    probe: bool,
    /// Past the open window's timeout (`StreamEvent::Stalled`).
    stalled: bool,
}

/// How long a server's direct URL is not used after an open to it failed (the load
/// balancer takes over meanwhile).
pub const DIRECT_RETRY: Duration = Duration::from_secs(30);

#[derive(Default)]
struct ServerInfo {
    /// The latest pressure hint and when it came: a hint not refreshed within
    /// [`PRESSURE_TTL`] is forgotten (the server repeats a standing one every second).
    queued: u32,
    queued_at: Option<Instant>,
    draining: bool,
    /// From the server's hello.
    direct_url: String,
    load: Arc<Load>,
    /// Smoothed time of the calls on its streams, start to end as the actor sees them.
    call_time: relay_common::rtt::Rtt,
}

impl ServerInfo {
    /// The latest pressure hint, if it is fresh (else 0).
    fn fresh_queued(&self, now: Instant) -> u32 {
        let fresh = self
            .queued_at
            .is_some_and(|at| now.saturating_duration_since(at) < PRESSURE_TTL);
        if fresh {
            self.queued
        } else {
            0
        }
    }
}

/// Calls in flight on one server's streams now, and the most at once since the last tick
/// (see `ServerView::peak_in_flight`). Each of the server's stream entries holds it, so a
/// call's start and end (two events per call) count without a lookup by server key. Only
/// the actor touches it; atomics because the actor is a `Send` task.
#[derive(Default)]
struct Load {
    in_flight: AtomicU32,
    peak: AtomicU32,
}

impl Load {
    fn started(&self) {
        let now = self.in_flight.load(Relaxed) + 1;
        self.in_flight.store(now, Relaxed);
        if now > self.peak.load(Relaxed) {
            self.peak.store(now, Relaxed);
        }
    }

    fn ended(&self) {
        let now = self.in_flight.load(Relaxed).saturating_sub(1);
        self.in_flight.store(now, Relaxed);
    }

    fn peak(&self) -> u32 {
        self.peak.load(Relaxed)
    }

    /// The next tick's peak starts from the calls in flight now.
    fn restart_peak(&self) {
        self.peak.store(self.in_flight.load(Relaxed), Relaxed);
    }
}

/// Most stream events the actor takes in one turn of its loop before it looks at shutdown,
/// the tick and its tasks again.
const EVENT_BATCH: usize = 256;

/// How long a pressure hint counts without being refreshed.
pub const PRESSURE_TTL: Duration = Duration::from_secs(3);

/// Shortest time between two event plans (growth on a server's queued-calls signal). A
/// burst's signals and call starts arrive by the thousand; one plan per gap covers them.
pub const EVENT_GAP: Duration = Duration::from_millis(50);

/// The sizing actor. Build with `new`, drive with `run`.
pub struct CoverageActor {
    planner: Box<dyn PlanStep>,
    connector: Arc<dyn Connector>,
    metrics: AgentMetrics,
    settings: ActorSettings,
    streams: BTreeMap<StreamId, Entry>,
    opening: HashMap<StreamId, Opening>,
    servers: HashMap<ServerKey, ServerInfo>,
    /// The fleet's members as the servers last told it.
    fleet: Vec<relay_proto::FleetMember>,
    /// Per-token stream caps servers refused opens over (RESOURCE_EXHAUSTED), per instance.
    caps: HashMap<ServerKey, u32>,
    /// When a direct open to the server last failed.
    direct_failed: HashMap<ServerKey, Instant>,
    /// Where load-balanced opens landed, for the placement shares.
    placements: PlacementTally,
    /// Servers lost: the agent's last streams there closed because the path went silent or
    /// broke, and none has landed there since (see `plan::ServerView::lost_since`). An
    /// instance that left the fleet stays here for `reconnect_for`: its server id's next
    /// instance (the server restarted) is lost since the same time until a stream lands.
    lost: HashMap<ServerKey, Instant>,
    /// A growth trigger arrived (a queued-calls signal that rose, or a call that took a
    /// stream while calls queue): plan growth once [`EVENT_GAP`] since the last plan passed.
    growth_due: bool,
    /// When the last plan (tick or event) ran.
    last_plan: Option<Instant>,
    tasks: JoinSet<()>,
    task_ids: HashMap<tokio::task::Id, StreamId>,
    next_id: StreamId,
    events_tx: mpsc::UnboundedSender<(StreamId, StreamEvent)>,
    events_rx: mpsc::UnboundedReceiver<(StreamId, StreamEvent)>,
    backoff: Backoff,
    view: watch::Sender<CoverageView>,
    next_tick: Instant,
    shutting_down: bool,
    /// The last [`RECENT_ACTIONS`] actions, oldest first.
    recent: VecDeque<ActionReport>,
}

impl CoverageActor {
    pub fn new(
        planner: Box<dyn PlanStep>,
        connector: Arc<dyn Connector>,
        metrics: AgentMetrics,
        settings: ActorSettings,
    ) -> (Self, watch::Receiver<CoverageView>) {
        let (events_tx, events_rx) = mpsc::unbounded_channel();
        let (view, view_rx) = watch::channel(CoverageView::default());
        metrics.coverage_grace.set(settings.grace.as_secs_f64());
        let backoff = Backoff::new(settings.backoff_initial, settings.backoff_max);
        let actor = CoverageActor {
            planner,
            connector,
            metrics,
            settings,
            streams: BTreeMap::new(),
            opening: HashMap::new(),
            servers: HashMap::new(),
            fleet: Vec::new(),
            caps: HashMap::new(),
            direct_failed: HashMap::new(),
            placements: PlacementTally::default(),
            lost: HashMap::new(),
            growth_due: false,
            last_plan: None,
            tasks: JoinSet::new(),
            task_ids: HashMap::new(),
            next_id: 1,
            events_tx,
            events_rx,
            backoff,
            view,
            next_tick: Instant::now(),
            shutting_down: false,
            recent: VecDeque::with_capacity(RECENT_ACTIONS),
        };
        (actor, view_rx)
    }

    /// Runs the sizing loop until `shutdown` resolves, then retires every stream, lets
    /// calls in flight finish (bounded by `drain_grace`) and returns.
    pub async fn run(mut self, shutdown: impl Future<Output = ()>) {
        let mut ticker = tokio::time::interval(self.settings.tick);
        ticker.set_missed_tick_behavior(MissedTickBehavior::Skip);
        tokio::pin!(shutdown);
        // Armed while an event plan waits for EVENT_GAP to pass.
        let growth_timer = tokio::time::sleep(Duration::ZERO);
        tokio::pin!(growth_timer);
        let mut timer_armed = false;
        loop {
            tokio::select! {
                // Shutdown first; then the tick, which fires once a period and so cannot
                // starve the events; then a growth plan that waited out its gap; events may
                // queue briefly behind them, harmlessly.
                biased;
                _ = &mut shutdown => break,
                _ = ticker.tick() => self.plan_now(Cause::Tick),
                _ = &mut growth_timer, if timer_armed => {
                    timer_armed = false;
                    if self.growth_due {
                        self.plan_now(Cause::Pressure);
                    }
                }
                Some((id, ev)) = self.events_rx.recv() => {
                    self.on_event(id, ev, &mut ticker);
                    // The events that queued meanwhile, in the same wake-up: every call
                    // sends two, and a turn of this loop polls each branch again.
                    for _ in 1..EVENT_BATCH {
                        let Ok((id, ev)) = self.events_rx.try_recv() else { break };
                        self.on_event(id, ev, &mut ticker);
                    }
                    if self.growth_due && !timer_armed {
                        self.growth_soon(growth_timer.as_mut(), &mut timer_armed);
                    }
                }
                Some(res) = self.tasks.join_next_with_id() => self.on_task_exit(res),
            }
        }
        self.drain().await;
    }

    /// Plans growth now if the last plan is [`EVENT_GAP`] old, else arms `timer` for then.
    fn growth_soon(&mut self, timer: std::pin::Pin<&mut Sleep>, armed: &mut bool) {
        let now = Instant::now();
        match self.last_plan.map(|at| at + EVENT_GAP) {
            Some(due) if due > now => {
                timer.reset(due);
                *armed = true;
            }
            _ => self.plan_now(Cause::Pressure),
        }
    }

    fn on_task_exit(&mut self, res: Result<(tokio::task::Id, ()), tokio::task::JoinError>) {
        let task = match &res {
            Ok((id, ())) => *id,
            Err(e) => e.id(),
        };
        if let Err(e) = &res {
            warn!(error = %e, "tunnel stream task failed");
        }
        if let Some(sid) = self.task_ids.remove(&task) {
            // A task that ended without its last event (it should not happen) still
            // leaves the table.
            self.opening.remove(&sid);
            if self.streams.contains_key(&sid) {
                self.remove_stream(sid);
            }
        }
    }

    fn remove_stream(&mut self, id: StreamId) {
        let Some(e) = self.streams.remove(&id) else {
            return;
        };
        if !self.streams.values().any(|o| o.server == e.server) {
            self.servers.remove(&e.server);
        } else if e.busy {
            e.load.ended();
        }
    }

    /// A stream went away: plan again shortly rather than a full tick later.
    fn replan_soon(&mut self, now: Instant, ticker: &mut Interval) {
        if self.shutting_down {
            return;
        }
        let soon = self.settings.tick.min(Duration::from_millis(100));
        if self.next_tick > now + soon {
            ticker.reset_after(soon);
            self.next_tick = now + soon;
        }
    }

    fn snapshot(&self, now: Instant, cause: Cause) -> Snapshot {
        let lb_opening = |which: fn(&Opening) -> bool| {
            self.opening
                .values()
                .filter(|o| o.direct.is_none() && which(o))
                .count() as u32
        };
        let direct_opening = |k: &ServerKey| {
            self.opening
                .values()
                .filter(|o| o.direct.as_ref() == Some(k))
                .count() as u32
        };
        // A server's own path (its direct URL, or opens naming it) is offered unless an
        // open on it failed or landed elsewhere within DIRECT_RETRY.
        let failed = |k: &ServerKey| {
            self.direct_failed
                .get(k)
                .is_some_and(|at| now.saturating_duration_since(*at) < DIRECT_RETRY)
        };
        let direct = |k: &ServerKey, url: &str| {
            if failed(k) {
                String::new()
            } else {
                url.to_string()
            }
        };
        let listed = |k: &ServerKey| {
            self.fleet
                .iter()
                .any(|m| m.server_id == k.0 && m.instance_id == k.1)
        };
        let mut servers: BTreeMap<&ServerKey, ServerView> = BTreeMap::new();
        for (id, e) in &self.streams {
            let view = servers.entry(&e.server).or_insert_with(|| {
                let info = self.servers.get(&e.server);
                ServerView {
                    server_id: e.server.0.clone(),
                    instance_id: e.server.1.clone(),
                    zone: e.zone.clone(),
                    listed: listed(&e.server),
                    cap: self.caps.get(&e.server).copied(),
                    direct_url: direct(&e.server, info.map_or("", |i| i.direct_url.as_str())),
                    opening: direct_opening(&e.server),
                    streams: Vec::new(),
                    queued: info.map_or(0, |i| i.fresh_queued(now)),
                    // Every tunnel server of this protocol reports its queue (within 100 ms
                    // of a change, and again each second while calls wait).
                    hints: true,
                    peak_in_flight: info.map_or(0, |i| i.load.peak()),
                    placed: self.placements.get(&e.server),
                    draining: info.is_some_and(|i| i.draining),
                    lost_since: None,
                    steerable: !failed(&e.server),
                }
            });
            view.streams.push(StreamView {
                id: *id,
                busy: e.busy,
                opened_at: e.opened_at,
                last_used: e.last_used,
                retiring: e.retiring,
                probe: e.probe,
            });
        }
        let mut servers: Vec<ServerView> = servers.into_values().collect();
        // Members of the fleet that hold none of our streams: new or returning servers.
        for m in &self.fleet {
            let held = servers
                .iter()
                .any(|v| v.server_id == m.server_id && v.instance_id == m.instance_id);
            if !held {
                let key = (m.server_id.clone(), m.instance_id.clone());
                servers.push(ServerView {
                    server_id: m.server_id.clone(),
                    instance_id: m.instance_id.clone(),
                    zone: m.zone.clone(),
                    listed: true,
                    cap: self.caps.get(&key).copied(),
                    direct_url: direct(&key, &m.direct_url),
                    opening: direct_opening(&key),
                    streams: Vec::new(),
                    queued: 0,
                    hints: true,
                    peak_in_flight: 0,
                    placed: self.placements.get(&key),
                    draining: m.draining,
                    lost_since: self.lost_since(&key),
                    steerable: !failed(&key),
                });
            }
        }
        Snapshot {
            now,
            cause,
            servers,
            opening: lb_opening(|o| !o.stalled),
            stalled: lb_opening(|o| o.stalled),
        }
    }

    /// Caps of instances that hold none of our streams and left the fleet are history, and
    /// so is where opens landed on them; their loss is kept for `reconnect_for` (see
    /// [`CoverageActor::lost_since`]).
    fn forget_departed(&mut self, now: Instant) {
        let (streams, fleet) = (&self.streams, &self.fleet);
        let known = |k: &ServerKey| {
            streams.values().any(|e| &e.server == k)
                || fleet
                    .iter()
                    .any(|m| m.server_id == k.0 && m.instance_id == k.1)
        };
        self.caps.retain(|k, _| known(k));
        self.placements.retain(known);
        let remember = self.settings.reconnect_for;
        self.lost
            .retain(|k, since| known(k) || now.saturating_duration_since(*since) < remember);
    }

    /// Since when `key` is lost: its own loss, or else the latest loss of another instance
    /// of its server id. A server that crashed comes back as a new instance; its streams
    /// went with the old one's path, and it is filled back at the reconnect pace like a
    /// lost instance that answers again (not at `fill_retry`'s once its budget is spent).
    fn lost_since(&self, key: &ServerKey) -> Option<Instant> {
        self.lost.get(key).copied().or_else(|| {
            self.lost
                .iter()
                .filter(|(k, _)| k.0 == key.0 && k.1 != key.1)
                .map(|(_, since)| *since)
                .max()
        })
    }

    /// One plan: snapshot, plan, apply. Never awaits. A tick (`Cause::Tick`) runs every
    /// rule; an event (`Cause::Pressure`) only grows.
    fn plan_now(&mut self, cause: Cause) {
        let now = Instant::now();
        self.growth_due = false;
        self.last_plan = Some(now);
        if cause == Cause::Tick {
            self.forget_departed(now);
            self.next_tick = now + self.settings.tick;
        }
        let snap = self.snapshot(now, cause);
        if cause == Cause::Tick {
            // The next tick's peak starts from the calls in flight now.
            for info in self.servers.values() {
                info.load.restart_peak();
            }
        }
        let plan = self.planner.plan(&snap);

        // Closes first: the plan counts the streams it closes as room for its opens.
        for id in &plan.close {
            if let Some(e) = self.streams.get_mut(id) {
                retire(e);
            }
        }
        let mut opens_held = false;
        if plan.opens() > 0 && !self.shutting_down {
            let have = self.streams.values().filter(|e| !e.retiring).count() + self.opening.len();
            let mut room = (self.settings.max_streams as usize).saturating_sub(have);
            // Direct opens go to servers that said where they are; the backoff gate
            // guards the load balancer path, steered opens included.
            let lb_allowed = self.backoff.allows(now);
            for d in &plan.direct {
                if d.steered() && !lb_allowed {
                    opens_held = true;
                    continue;
                }
                let n = (d.count as usize).min(room);
                room -= n;
                let key = (d.server_id.clone(), d.instance_id.clone());
                let path = if d.steered() {
                    Path::Steered(key)
                } else {
                    Path::Direct(key, d.url.clone())
                };
                for _ in 0..n {
                    self.spawn_open(now, path.clone(), d.fill);
                }
            }
            let n = (plan.open as usize).min(room);
            if n > 0 && lb_allowed {
                for k in 0..n {
                    self.spawn_open(now, Path::Balanced, k < plan.probes as usize);
                }
            } else if n > 0 {
                opens_held = true;
            }
        }
        for a in &plan.actions {
            let opens = matches!(a.kind, ActionKind::Grow | ActionKind::Fill);
            if opens && opens_held && !a.direct {
                // Not carried out this tick: the backoff step already logged why.
                debug!(server_id = %a.server_id, action = a.kind.as_str(), count = a.count, "coverage action held back by the open backoff");
                continue;
            }
            info!(server_id = %a.server_id, action = a.kind.as_str(), count = a.count, reason = %a.reason, "coverage action");
            self.metrics.action(a.kind, a.count);
            if self.recent.len() == RECENT_ACTIONS {
                self.recent.pop_front();
            }
            self.recent.push_back(ActionReport {
                unix_ms: relay_common::wall::unix_ms(),
                server_id: a.server_id.clone(),
                action: a.kind.as_str(),
                count: a.count,
                reason: a.reason.clone(),
            });
        }
        self.publish(&snap, &plan);
    }

    /// Opens one stream on `path`.
    fn spawn_open(&mut self, now: Instant, path: Path, probe: bool) {
        let id = self.next_id;
        self.next_id += 1;
        let (retire_tx, retire_rx) = oneshot::channel();
        let (direct, target, steer, steered) = match path {
            Path::Balanced => (None, None, None, false),
            Path::Direct(key, url) => (Some(key), Some(url), None, false),
            Path::Steered(key) => {
                let name = MetadataValue::try_from(key.0.as_str()).ok();
                (Some(key), None, name, true)
            }
        };
        let link = StreamLink {
            id,
            target,
            steer,
            retire: retire_rx,
            events: self.events_tx.clone(),
        };
        self.opening.insert(
            id,
            Opening {
                started: now,
                retire: Some(retire_tx),
                direct,
                steered,
                probe,
                stalled: false,
            },
        );
        let handle = self.tasks.spawn(self.connector.open(link));
        self.task_ids.insert(handle.id(), id);
    }

    /// Two-phase stop: every stream sends GoingAway and finishes its call; after
    /// `drain_grace` whatever is left is dropped.
    async fn drain(mut self) {
        self.shutting_down = true;
        for e in self.streams.values_mut() {
            retire(e);
        }
        for op in self.opening.values_mut() {
            if let Some(tx) = op.retire.take() {
                let _ = tx.send(());
            }
        }
        let busy = self.streams.values().filter(|e| e.busy).count();
        info!(
            streams = self.streams.len(),
            busy, "agent stopping: retiring every stream"
        );
        let deadline = Instant::now() + self.settings.drain_grace;
        let tasks = &mut self.tasks;
        if tokio::time::timeout_at(deadline, async {
            while tasks.join_next().await.is_some() {}
        })
        .await
        .is_err()
        {
            warn!(
                left = tasks.len(),
                "drain grace over; dropping the remaining streams"
            );
        }
        self.tasks.shutdown().await;
        self.metrics.servers.clear();
        self.metrics.streams_live.set(0);
    }
}

fn retire(e: &mut Entry) {
    e.retiring = true;
    if let Some(tx) = e.retire.take() {
        let _ = tx.send(());
    }
}
