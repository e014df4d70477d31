//! The pure planning step of the sizing tick: `Planner::plan(&Snapshot) -> Plan`.
//!
//! The snapshot carries `now` as a value; this module must not read the clock, spawn,
//! or do I/O. The planner keeps only the memory the rules need across ticks (since when a
//! server has been short and idle, when it was evacuated, when the last evacuation ran),
//! so the rules are testable tick by tick with simulated servers and placement.

use serde::Deserialize;
use std::collections::HashMap;
use std::time::Duration;
use tokio::time::Instant;

/// Identifies one tunnel stream within the agent.
pub type StreamId = u64;

/// `[coverage]` in the agent config. Every constant of the coverage rules, with the
/// design's defaults.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct CoverageConfig {
    /// Per-server coverage on (default). Off keeps a fixed pool of `fixed_streams`,
    /// for comparison runs.
    pub enabled: bool,
    /// Pool size when coverage is off.
    pub fixed_streams: u32,
    /// Period of the sizing tick.
    #[serde(with = "humantime_serde")]
    pub tick: Duration,
    /// Idle streams each server that carries the tunnel id should hold beyond its busy ones.
    pub reserve: u32,
    /// Smallest grow step for a server with calls in flight that is short.
    pub grow_min: u32,
    /// Growth pauses while idle streams on other servers reach this multiple of demand.
    pub idle_elsewhere_factor: u32,
    /// How long a server may stay short and idle before it is evacuated.
    #[serde(with = "humantime_serde")]
    pub grace: Duration,
    /// At most one evacuation per this period.
    #[serde(with = "humantime_serde")]
    pub evacuate_cooldown: Duration,
    /// How long an evacuated server keeps having streams that land on it recycled.
    #[serde(with = "humantime_serde")]
    pub evacuated_for: Duration,
    /// Streams younger than this are never retired.
    #[serde(with = "humantime_serde")]
    pub retire_min_age: Duration,
    /// Idle streams unused for this long are retired.
    #[serde(with = "humantime_serde")]
    pub retire_unused: Duration,
    /// Cap on the agent's streams across all servers.
    pub max_streams: u32,
    /// Cap on the agent's calls in flight (demand beyond it does not grow the pool).
    pub max_inflight: u32,
}

impl Default for CoverageConfig {
    fn default() -> Self {
        CoverageConfig {
            enabled: true,
            fixed_streams: 8,
            tick: Duration::from_secs(1),
            reserve: 2,
            grow_min: 8,
            idle_elsewhere_factor: 4,
            grace: Duration::from_secs(30),
            evacuate_cooldown: Duration::from_secs(30),
            evacuated_for: Duration::from_secs(600),
            retire_min_age: Duration::from_secs(120),
            retire_unused: Duration::from_secs(600),
            max_streams: 2048,
            max_inflight: 2048,
        }
    }
}

/// One stream as the sizing actor sees it at the tick.
#[derive(Clone, Debug, PartialEq)]
pub struct StreamView {
    pub id: StreamId,
    /// Carrying a call now.
    pub busy: bool,
    pub opened_at: Instant,
    /// When its last call ended (or `opened_at` if it never carried one).
    pub last_used: Instant,
    /// Already asked to go away (GoingAway sent); no longer counts as capacity.
    pub retiring: bool,
}

/// One tunnel server (by the `server_id` of its streams' ServerHello).
#[derive(Clone, Debug, PartialEq)]
pub struct ServerView {
    pub server_id: String,
    pub zone: String,
    pub streams: Vec<StreamView>,
    /// Calls of this tunnel id queued on that server (the latest pressure hint).
    pub queued: u32,
    /// The server sent Drain: it is going away.
    pub draining: bool,
}

/// Everything the planner may look at, taken at one instant.
#[derive(Clone, Debug, PartialEq)]
pub struct Snapshot {
    pub now: Instant,
    pub servers: Vec<ServerView>,
    /// Streams being opened whose ServerHello has not arrived yet.
    pub opening: u32,
}

/// A server's coverage state (DESIGN.md, "Agent coverage").
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum State {
    Covered,
    Growing,
    Filling,
    Overdue,
    Evacuated,
}

impl State {
    pub const ALL: [State; 5] =
        [State::Covered, State::Growing, State::Filling, State::Overdue, State::Evacuated];

    pub fn as_str(self) -> &'static str {
        match self {
            State::Covered => "covered",
            State::Growing => "growing",
            State::Filling => "filling",
            State::Overdue => "overdue",
            State::Evacuated => "evacuated",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ActionKind {
    Grow,
    Fill,
    Evacuate,
    Recycle,
    Retire,
}

impl ActionKind {
    pub const ALL: [ActionKind; 5] = [
        ActionKind::Grow,
        ActionKind::Fill,
        ActionKind::Evacuate,
        ActionKind::Recycle,
        ActionKind::Retire,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ActionKind::Grow => "grow",
            ActionKind::Fill => "fill",
            ActionKind::Evacuate => "evacuate",
            ActionKind::Recycle => "recycle",
            ActionKind::Retire => "retire",
        }
    }
}

/// One coverage action, for the log line and the metric.
#[derive(Clone, Debug, PartialEq)]
pub struct Action {
    pub server_id: String,
    pub kind: ActionKind,
    /// Streams opened (grow/fill) or closed (evacuate/recycle/retire).
    pub count: u32,
    pub reason: String,
}

/// A server's figures and state as the plan judged them.
#[derive(Clone, Debug, PartialEq)]
pub struct ServerState {
    pub server_id: String,
    pub zone: String,
    pub state: State,
    /// Live (non-retiring) streams.
    pub streams: u32,
    /// Calls in flight plus calls queued there.
    pub busy: u32,
    pub idle: u32,
    /// Streams the server should hold: busy + reserve.
    pub budget: u32,
}

/// What the tick should do. Opens are global: the load balancer decides where a new
/// stream lands.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Plan {
    /// New streams to open.
    pub open: u32,
    /// Idle streams to retire with the GoingAway handshake.
    pub close: Vec<StreamId>,
    pub actions: Vec<Action>,
    pub states: Vec<ServerState>,
}

impl Plan {
    /// Nothing to do: the fixpoint at rest.
    pub fn is_empty(&self) -> bool {
        self.open == 0 && self.close.is_empty()
    }
}

/// The coverage rules with the memory they need across ticks.
#[derive(Debug)]
pub struct Planner {
    cfg: CoverageConfig,
    memory: HashMap<String, ServerMemory>,
    last_evacuation: Option<Instant>,
}

#[derive(Debug, Default, Clone)]
struct ServerMemory {
    /// Since when the server has been short with no calls in flight.
    short_idle_since: Option<Instant>,
    /// When it was evacuated (or seen draining).
    evacuated_at: Option<Instant>,
}

impl Planner {
    pub fn new(cfg: CoverageConfig) -> Self {
        Planner { cfg, memory: HashMap::new(), last_evacuation: None }
    }

    pub fn config(&self) -> &CoverageConfig {
        &self.cfg
    }

    pub fn plan(&mut self, snap: &Snapshot) -> Plan {
        if !self.cfg.enabled {
            return self.plan_fixed(snap);
        }
        self.plan_fixed(snap)
    }

    /// Coverage off: hold `fixed_streams` in total, wherever they land.
    fn plan_fixed(&mut self, snap: &Snapshot) -> Plan {
        let live: u32 = snap
            .servers
            .iter()
            .map(|s| s.streams.iter().filter(|st| !st.retiring).count() as u32)
            .sum();
        let have = live + snap.opening;
        let open = self.cfg.fixed_streams.min(self.cfg.max_streams).saturating_sub(have);
        let states = snap
            .servers
            .iter()
            .map(|s| {
                let streams = s.streams.iter().filter(|st| !st.retiring).count() as u32;
                let in_flight = s.streams.iter().filter(|st| st.busy).count() as u32;
                let busy = in_flight + s.queued;
                let budget = busy + self.cfg.reserve;
                let state = if streams >= budget { State::Covered } else { State::Filling };
                ServerState {
                    server_id: s.server_id.clone(),
                    zone: s.zone.clone(),
                    state,
                    streams,
                    busy,
                    idle: streams.saturating_sub(in_flight),
                    budget,
                }
            })
            .collect();
        Plan { open, close: Vec::new(), actions: Vec::new(), states }
    }
}
