//! The pure planning step of coverage: `Planner::plan(&Snapshot) -> Plan`.
//!
//! The snapshot carries `now` and its `cause` as values; this module must not read the
//! clock, spawn, or do I/O. The planner keeps only the memory the rules need across plans
//! (since when a server has been short and idle, when it was evacuated, when the last
//! evacuation ran, how many fill opens a short server has had), so the rules are testable
//! tick by tick with simulated servers and placement.
//!
//! This file holds the types, `Planner::plan` (which runs the steps in order) and
//! `plan_fixed` (coverage off); each step has a file: `states` (classify), `grow` (grow,
//! bootstrap, the sum of opens and room at the cap), `fill_evacuate` (fill, evacuate,
//! recycle), `retire`. `sim` and `tests` drive the planner tick by tick.
//!
//! # When it plans
//!
//! Two causes, one function ([`Cause`]):
//! - **the tick** (`coverage.tick`, 1 s): every rule below;
//! - **an event**: a server's queued-calls signal (a pressure hint that went up), or a
//!   server whose idle streams ran out while calls queue there. Only growth runs, at once:
//!   a burst should not wait up to a tick for its streams. Fill, evacuation, recycling and
//!   retirement stay paced by the tick.
//!
//! # The rules, as implemented
//!
//! Streams are grouped by server. A server whose streams are all retiring (or that has
//! none) is ignored: it is not listed in `Plan::states` and takes no action. For the
//! others: `live` = non-retiring streams (retiring ones are not capacity), `in flight` =
//! the larger of the busy streams now (retiring ones included: the call is real) and the
//! most calls in flight there at once since the last tick (`peak_in_flight`: calls of a
//! busy second that sit between hops at the tick's instant are demand all the same),
//! `busy` = in flight + `queued` (the pressure hint), `budget` = busy + `reserve`,
//! `shortfall` = budget - live.
//! Each plan classifies every server (`classify`), then runs one function per action
//! kind (`evacuate`, `recycle`, `grow`, `fill`, `bootstrap`, `open`, `retire`):
//!
//! - **evacuated**: draining, or evacuated within `evacuated_for`. Its idle streams are
//!   recycled (closed), busy ones finish first and go on a later tick. No grow, no fill.
//!   A draining server's idle streams are held until another server is covered (make
//!   before break: the tunnel id stays routable while replacements land).
//! - **covered**: live >= budget.
//! - **growing**: short with busy > 0. The server should gain `max(grow_min, shortfall)`
//!   when it reports its queue (the pressure hint says what the queue needs; `grow_min`
//!   keeps a little headroom for a load that is still rising), or
//!   `max(grow_min, in flight, shortfall)` when its queue is not known (doubling: the
//!   queue may be anything). Through the load balancer only a share of the opens lands
//!   there, so the opens are that growth divided by the server's *placement share*: the
//!   share of the agent's recent load-balanced opens that landed on it ([`PlacementTally`],
//!   a decayed count; with a prior of one open spread evenly, and never below
//!   `1 / (1 + idle_elsewhere_factor)`, so one step is at most that many times the
//!   growth). Not budgeted, but clipped by the 4x rule and the caps. With direct growth to
//!   a server that offers a direct URL the step is the shortfall alone, and the 4x rule
//!   does not apply: those streams land on that server.
//! - **filling**: short with busy = 0. Opens the shortfall divided by the share (toward the
//!   reserve), less what the plan's other opens will land there (several servers filled at
//!   once share their opens: each lands somewhere), within a *fill budget*: at most `reserve` x servers x 2 opens since the
//!   server became short, then one open per `fill_retry` for as long as it stays short
//!   (listed in the fleet or holding streams). A server that holds none of the agent's
//!   streams but is listed in the fleet (new, or back as a new instance) is filling too.
//! - **returned**: a fill open goes where the load balancer puts it (a placement probe).
//!   One that landed on a covered server with no calls there (busy 0: nothing in flight,
//!   queued or at the peak since the last tick), beyond its budget, is closed at the next
//!   tick while it has carried no call, the newest first.
//! - **overdue**: filling for `grace`. Evacuated: all its (idle) streams are closed so
//!   the server drops the tunnel id; only while another server is covered, never with a
//!   call in flight or queued there, at most one evacuation per `evacuate_cooldown`.
//!
//! Opens are global (the load balancer places them), so requests are summed: growth first
//! (busiest server first), then fill, then the bootstrap. Streams already `opening` are
//! credited against the requests in that order, so an open is not repeated every plan
//! while the previous one is in flight; an open past the open window's timeout (stalled:
//! presumed lost) is not credited, so growth does not wait behind opens the balancer
//! placed on a dead server. The total is capped so live + opening + stalled + new <=
//! `max_streams`. At that cap, a tick recycles idle streams of the best-covered server (the
//! most idle streams beyond its busy + reserve) to make room for a short server's opens, at
//! most `grow_min` a tick and within the short server's fill budget. With no server to
//! call home (none known at start, or only draining ones), the agent opens `reserve` minus
//! opening so it lands somewhere.
//!
//! While any server is short (growing, filling, overdue) nothing is retired. Otherwise an
//! idle stream at least `retire_min_age` old and unused for `retire_unused` is retired,
//! least recently used first, never taking a server below busy + reserve. Retirement runs
//! in batches: while another stream (of any server) will qualify within the *retire
//! window* (`retire_unused / 10`, at least two ticks), the ones that qualify wait for it,
//! but no qualifying stream waits longer than the window. The excess of a burst (which
//! ended within a few ticks) so goes in one or two steps instead of a step every tick.
//! Above `max_streams` (a lowered cap), the oldest idle streams anywhere are retired to get
//! under it, short or not.
//!
//! # Choices where the design is silent, and deviations
//!
//! - **4x rule on surplus, and as a clip.** A growing server's step is clipped so that
//!   idle streams on other (non-evacuated) servers *beyond their own reserve*, plus the
//!   step, stay within `idle_elsewhere_factor` x its demand; growth is paused when nothing
//!   is left. Counting only the surplus keeps a quiet fleet's reserves (which every server
//!   holds anyway) from pausing the first growth of a lightly loaded server; clipping
//!   rather than a plain pause makes the bound hold exactly instead of overshooting by one
//!   step. Consequence: placement that gives the busy server a share below about
//!   `1 / (1 + factor)` (20% with 4) cannot fill it through growth alone while every call
//!   keeps going there: in the simulation (5% share, all calls on it) it reaches exactly
//!   the arrival rate and the queue stops growing but does not drain. The agent stays
//!   bounded; the dispatcher's spill-over is what moves calls to the idle streams. The
//!   simulation tests show both sides.
//! - **Growth by placement share, not doubling.** The design's step is
//!   `max(8, calls in flight, shortfall)`: doubling, because the queue may be unknown.
//!   With the hint the queue is known, and doubling only parks streams (measured in
//!   `burst-1000`: 1,695 streams at peak for 1,000 calls, 2,066 opened for one burst). The
//!   doubling stays for a server that does not report its queue (`ServerView::hints`).
//! - **Opening is credited against growth too**, not only fill. Without the credit a
//!   slow open (longer than a tick) would re-issue the whole step every tick; with it the
//!   growth waits for the previous step to land.
//! - **max_inflight**: queued calls count as demand only up to the agent's remaining
//!   headroom (max_inflight - calls in flight across the agent); at the cap no server grows.
//! - **Overdue servers are not filled**: their fill has already failed for `grace` and
//!   every further open lands elsewhere; they wait for evacuation (bounded drift).
//! - **An evacuated server is the home of last resort**: if no other server (not draining,
//!   not evacuated) holds live streams, a recently evacuated server is classified normally
//!   instead of having everything recycled. Draining servers are always evacuated.
//! - **Retirement keeps busy + reserve** (not just reserve) on a server with calls, so
//!   retiring never makes a covered server short.
//! - **Fill opens that land where nothing is missing go back at once**, not after
//!   `retire_unused`, and even while another server is short (the design holds every stream
//!   while any server is short). Covering N servers through a balancer that places streams
//!   at random takes about N x (1 + 1/2 + ... + 1/N) opens (the coupon collector: 29 for
//!   10 servers at a reserve of 1); held for ten minutes, the extra 19 were most of an idle
//!   agent's streams, and of a large fleet's memory and heartbeats. A probe is only ever a
//!   fill open (growth's streams that land elsewhere stay: the 4x rule and the dispatcher's
//!   spill count on them), it goes only from a server with no calls and only beyond its
//!   budget, and a probe that carried a call is capacity like any other stream.
//! - **A lost server is reconnected to quickly, and so is its next instance**: a server
//!   whose last streams closed with their path gets one open per `reconnect` once its
//!   budget is spent, for `reconnect_for`; a server that crashed and started again is a new
//!   instance of its server id, lost since the old one was (the actor keeps a departed
//!   instance's loss for `reconnect_for`), so it is filled back at that pace too, not at
//!   `fill_retry`'s (30 s by default: after a restart, the agents whose budget of opens
//!   through the balancer missed it waited that long for each further try).
//! - **Steered opens** (`steered_opens`): an open for one server names it to the load
//!   balancer, which routes it there (HAProxy `use-server` on `relay-server`). They are
//!   planned as direct opens are (the shortfall, no 4x clip, credited per server), since
//!   they land where they are needed, but a steered fill keeps the fill budget and its
//!   pace: they go through the balancer, and without the budget a fleet whose opens time
//!   out in a storm asked for each again every tick (a 10,000-agent run counted 769,422
//!   fill actions for 11,286 streams). The actor turns a server's steering off for 30 s
//!   once an open naming it lands elsewhere.
//! - **A listed server the load balancer does not reach is never given up**: after its fill
//!   budget it keeps getting one open per `fill_retry` (an earlier version avoided it for
//!   `evacuated_for` once its budget was spent, so a server that came back within those
//!   ten minutes was not covered). Each such open that lands elsewhere is an idle stream
//!   there until it is retired: at most `retire_unused / fill_retry` (20 by default) per
//!   server no stream reaches.

use serde::{Deserialize, Serialize};
use std::collections::{HashMap, HashSet};
use std::time::Duration;
use tokio::time::Instant;

mod fill_evacuate;
mod grow;
mod retire;
mod states;

/// Identifies one tunnel stream within the agent.
pub type StreamId = u64;

/// `[coverage]` in the agent config. Every constant of the coverage rules, with the
/// design's defaults.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
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
    /// Smallest growth of a short server with calls in flight; the most streams recycled in
    /// one tick at `max_streams`.
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
    /// Once a short server's fill budget is spent, one more open per this period while it
    /// stays short.
    #[serde(with = "humantime_serde")]
    pub fill_retry: Duration,
    /// A lost server (its path went silent or broke) whose fill budget is spent gets one
    /// open per `reconnect` for `reconnect_for` after it was lost (then one per
    /// `fill_retry`), so that it is filled back within seconds of answering again.
    #[serde(with = "humantime_serde")]
    pub reconnect: Duration,
    /// How long a lost server is reconnected to at the `reconnect` pace.
    #[serde(with = "humantime_serde")]
    pub reconnect_for: Duration,
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
    /// Placement-aware growth: open a short server's missing streams straight to the
    /// direct URL it advertises (`direct_url` on the tunnel server) instead of through
    /// the load balancer. Off by default.
    pub direct_growth: bool,
    /// Steered opens: open a short server's missing streams through the load balancer
    /// naming that server (`relay_proto::AGENT_STEER`), for a balancer that routes such an
    /// open to it (HAProxy: `use-server`). Like direct growth they land where they are
    /// needed, on the agent's one connection. Off by default.
    pub steered_opens: bool,
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
            fill_retry: Duration::from_secs(30),
            reconnect: Duration::from_secs(1),
            reconnect_for: Duration::from_secs(300),
            retire_min_age: Duration::from_secs(120),
            retire_unused: Duration::from_secs(600),
            max_streams: 2048,
            max_inflight: 2048,
            direct_growth: false,
            steered_opens: false,
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
    /// Opened to fill (a placement probe: it went where the load balancer put it) and has
    /// carried no call yet. One that landed on a server already holding its budget, with
    /// no calls there, is returned at the next tick (see the module docs).
    pub probe: bool,
}

/// One life of a tunnel server: its `server_id` and the `instance_id` of its
/// ServerHello. Per-server memory (evacuation, short since) belongs to an instance, so a
/// restarted server starts fresh.
pub type ServerKey = (String, String);

/// One tunnel server instance (by the `server_id` and `instance_id` of its streams'
/// ServerHello), or a member of the fleet that holds none of the agent's streams.
#[derive(Clone, Debug, PartialEq)]
pub struct ServerView {
    pub server_id: String,
    pub instance_id: String,
    pub zone: String,
    /// Listed in the fleet the servers passed on (`Fleet` frames). A listed server with no
    /// stream is filled toward the reserve; an unlisted one with none is forgotten.
    pub listed: bool,
    /// The server's per-token stream cap, once it refused an open over it: its budget
    /// never exceeds it, so the agent stops asking it for more.
    pub cap: Option<u32>,
    /// Where streams can be opened straight to this server; empty when it offers none
    /// (or a direct open to it failed recently).
    pub direct_url: String,
    /// Direct opens to this server in flight (no hello yet).
    pub opening: u32,
    pub streams: Vec<StreamView>,
    /// Calls of this tunnel id queued on that server (the latest pressure hint).
    pub queued: u32,
    /// Whether the server reports its queued calls (pressure hints; every tunnel server of
    /// this protocol does, within 100 ms of a change). Growth is sized by the queue when
    /// it is reported and doubles when it is not.
    pub hints: bool,
    /// The most calls in flight on this server's streams at once since the last tick
    /// (0 when not known). The server's in-flight count is the larger of it and the streams
    /// busy now: a count taken at the tick's instant alone misses the calls of a busy
    /// second that are between hops at that instant (at 64 concurrent callers the agent
    /// sized to it left a quarter of the calls queued on the server).
    pub peak_in_flight: u32,
    /// Recent opens through the load balancer that landed here, as a decayed count (see
    /// [`PlacementTally`]): where the next opens will likely land.
    pub placed: f64,
    /// The server sent Drain: it is going away.
    pub draining: bool,
    /// Since when the server is lost: the agent's streams there closed because its path
    /// went silent or broke, and none landed there since (`None`: not lost). A lost server
    /// that stays listed is reconnected to at a quicker pace than other servers with none
    /// of the agent's streams (`reconnect`).
    pub lost_since: Option<Instant>,
    /// Opens naming this server land on it, as far as the agent knows: false for a while
    /// after one landed elsewhere (`CoverageConfig::steered_opens`).
    pub steerable: bool,
}

/// Why the planner runs (see the module docs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Cause {
    /// The sizing tick: every rule.
    #[default]
    Tick,
    /// A server's queue grew, or its idle streams ran out while calls queue: growth only.
    Pressure,
}

/// Everything the planner may look at, taken at one instant.
#[derive(Clone, Debug, PartialEq)]
pub struct Snapshot {
    pub now: Instant,
    pub cause: Cause,
    pub servers: Vec<ServerView>,
    /// Streams being opened through the load balancer whose ServerHello has not arrived
    /// yet (direct opens are counted per server), not counting `stalled` ones.
    pub opening: u32,
    /// Opens through the load balancer still waiting for their hello past the open
    /// window's retransmission timeout (`crate::stream::window`): presumed lost, as the
    /// balancer placed them where hellos do not come (a server that just died, before its
    /// health checks mark it down). They count against `max_streams` but are not credited
    /// against growth, so the growth they were for goes on through the balancer.
    pub stalled: u32,
}

/// Where the agent's recent load-balanced opens landed: one decayed count per server. Each
/// landing multiplies every count by `1 - 1/WINDOW` and adds one to its server's, so the
/// counts follow the last few hundred landings and a change of the balancer's weights is
/// learned within about [`PlacementTally::WINDOW`] opens. Kept by the actor (and the
/// simulation), read by the planner through [`ServerView::placed`].
#[derive(Clone, Debug, Default)]
pub struct PlacementTally {
    counts: HashMap<ServerKey, f64>,
    /// Landings so far, for `decay`: the counts are stored scaled by `grow^landings`, so a
    /// landing touches one entry instead of every one.
    scale: f64,
}

impl PlacementTally {
    /// Landings after which a count has decayed to 1/e.
    pub const WINDOW: f64 = 128.0;

    fn grow() -> f64 {
        1.0 / (1.0 - 1.0 / Self::WINDOW)
    }

    /// One load-balanced open landed on `server`.
    pub fn land(&mut self, server: &ServerKey) {
        if self.scale <= 0.0 {
            self.scale = 1.0;
        }
        self.scale *= Self::grow();
        *self.counts.entry(server.clone()).or_default() += self.scale;
        if self.scale > 1e12 {
            // Renormalise before the scale loses precision; drop what has decayed away.
            let s = self.scale;
            self.counts.retain(|_, c| {
                *c /= s;
                *c > 1e-3
            });
            self.scale = 1.0;
        }
    }

    /// The decayed count of `server`.
    pub fn get(&self, server: &ServerKey) -> f64 {
        match self.counts.get(server) {
            Some(c) if self.scale > 0.0 => c / self.scale,
            _ => 0.0,
        }
    }

    /// Forgets servers `keep` says no, with what they counted.
    pub fn retain(&mut self, mut keep: impl FnMut(&ServerKey) -> bool) {
        self.counts.retain(|k, _| keep(k));
    }
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
    pub const ALL: [State; 5] = [
        State::Covered,
        State::Growing,
        State::Filling,
        State::Overdue,
        State::Evacuated,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            State::Covered => "covered",
            State::Growing => "growing",
            State::Filling => "filling",
            State::Overdue => "overdue",
            State::Evacuated => "evacuated",
        }
    }

    /// Short of busy + reserve: the states that hold retirement.
    pub fn is_short(self) -> bool {
        matches!(self, State::Growing | State::Filling | State::Overdue)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ActionKind {
    Grow,
    Fill,
    Evacuate,
    Recycle,
    Retire,
    Return,
}

impl ActionKind {
    pub const ALL: [ActionKind; 6] = [
        ActionKind::Grow,
        ActionKind::Fill,
        ActionKind::Evacuate,
        ActionKind::Recycle,
        ActionKind::Retire,
        ActionKind::Return,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ActionKind::Grow => "grow",
            ActionKind::Fill => "fill",
            ActionKind::Evacuate => "evacuate",
            ActionKind::Recycle => "recycle",
            ActionKind::Retire => "retire",
            ActionKind::Return => "return",
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
    /// Opened straight to the server's direct URL (grow/fill).
    pub direct: bool,
    pub reason: String,
}

/// A server's figures and state as the plan judged them.
#[derive(Clone, Debug, PartialEq)]
pub struct ServerState {
    pub server_id: String,
    pub instance_id: String,
    pub zone: String,
    pub state: State,
    /// Live (non-retiring) streams.
    pub streams: u32,
    /// Calls in flight plus calls queued there.
    pub busy: u32,
    pub idle: u32,
    /// Streams the server should hold: busy + reserve.
    pub budget: u32,
    /// How long the server has been short (growing, filling or overdue) without a break.
    pub short_for: Duration,
}

/// What the tick should do. Opens are global: the load balancer decides where a new
/// stream lands.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Plan {
    /// New streams to open through the load balancer.
    pub open: u32,
    /// Of `open`, the fill opens (placement probes): their streams are marked
    /// [`StreamView::probe`] until they carry a call.
    pub probes: u32,
    /// New streams to open straight to servers' direct URLs.
    pub direct: Vec<DirectOpen>,
    /// Idle streams to retire with the GoingAway handshake.
    pub close: Vec<StreamId>,
    pub actions: Vec<Action>,
    pub states: Vec<ServerState>,
}

impl Plan {
    /// Nothing to do: the fixpoint at rest.
    pub fn is_empty(&self) -> bool {
        self.open == 0 && self.direct.is_empty() && self.close.is_empty()
    }

    /// Closes `ids` (idle streams of `server_id`) as one `kind` action with `reason`.
    fn close_on(
        &mut self,
        server_id: &str,
        kind: ActionKind,
        ids: impl IntoIterator<Item = StreamId>,
        reason: String,
    ) {
        let before = self.close.len();
        self.close.extend(ids);
        self.actions.push(Action {
            server_id: server_id.to_string(),
            kind,
            count: count(self.close.len() - before),
            direct: false,
            reason,
        });
    }

    /// Streams to open, through the load balancer and direct.
    pub fn opens(&self) -> u32 {
        self.direct
            .iter()
            .fold(self.open, |n, d| n.saturating_add(d.count))
    }
}

/// Opens for one server: straight to its direct URL, or through the load balancer
/// naming it (steered).
#[derive(Clone, Debug, PartialEq)]
pub struct DirectOpen {
    pub server_id: String,
    pub instance_id: String,
    /// The server's direct URL; empty for steered opens.
    pub url: String,
    pub count: u32,
    /// Fill opens (`Plan::probes`): a steered one that lands elsewhere goes back.
    pub fill: bool,
}

impl DirectOpen {
    /// Through the load balancer, naming the server.
    pub fn steered(&self) -> bool {
        self.url.is_empty()
    }
}

/// `Action::server_id` of an open that is for no particular server (the bootstrap).
pub const ANY_SERVER: &str = "*";

/// The coverage rules with the memory they need across ticks.
#[derive(Debug)]
pub struct Planner {
    cfg: CoverageConfig,
    memory: HashMap<ServerKey, ServerMemory>,
    last_evacuation: Option<Instant>,
}

#[derive(Debug, Default, Clone)]
struct ServerMemory {
    /// Since when the server has been short (any short state).
    short_since: Option<Instant>,
    /// Opens asked for to fill the server (fill, or recycled room at `max_streams`) since
    /// it became short: its fill budget is spent against this.
    fill_opens: u32,
    /// When the last fill open past the budget was asked for (paced by `fill_retry`).
    paced_at: Option<Instant>,
    /// Since when the server has been short with no calls in flight.
    short_idle_since: Option<Instant>,
    /// When it was evacuated (or seen draining).
    evacuated_at: Option<Instant>,
    /// It held none of the agent's streams at the last plan: the first stream to land
    /// there again starts a fresh fill (its budget spent while it was away is forgotten).
    absent: bool,
}

/// The placement share floor's factor: a share is never taken below
/// `1 / (1 + idle_elsewhere_factor)`.
fn share_floor(cfg: &CoverageConfig) -> f64 {
    1.0 / (1.0 + f64::from(cfg.idle_elsewhere_factor.max(1)))
}

/// Opens needed through the load balancer for `growth` streams on a server with `share`.
fn opens_for(growth: u32, share: f64) -> u32 {
    if growth == 0 {
        return 0;
    }
    let n = (f64::from(growth) / share).ceil();
    if n >= f64::from(u32::MAX) {
        u32::MAX
    } else {
        n as u32
    }
}

/// How many of `opens` load-balanced opens are expected to land on a server with `share`.
fn landing_of(opens: u32, share: f64) -> u32 {
    (f64::from(opens) * share).floor() as u32
}

/// One server's figures for this tick.
#[derive(Debug)]
struct Server<'a> {
    view: &'a ServerView,
    state: State,
    /// Non-retiring streams.
    live: u32,
    /// Busy streams, retiring ones included.
    in_flight: u32,
    /// Non-busy, non-retiring streams.
    idle: u32,
    /// Estimated share of the next load-balanced opens that land here.
    share: f64,
}

impl Server<'_> {
    fn key(&self) -> ServerKey {
        key(self.view)
    }

    /// Listed in the fleet but holding none of the agent's streams.
    fn absent(&self) -> bool {
        self.live == 0
    }

    fn busy(&self) -> u32 {
        self.in_flight.saturating_add(self.view.queued)
    }

    fn budget(&self, reserve: u32) -> u32 {
        let budget = self.busy().saturating_add(reserve);
        self.view.cap.map_or(budget, |cap| budget.min(cap))
    }

    fn shortfall(&self, reserve: u32) -> u32 {
        self.budget(reserve).saturating_sub(self.live)
    }

    /// Idle streams beyond the server's own reserve.
    fn surplus(&self, reserve: u32) -> u32 {
        self.idle.saturating_sub(reserve)
    }

    /// Short in a way that holds retirement: an absent server carries no call, and the
    /// streams it takes come from opens, not from the others.
    fn is_short(&self) -> bool {
        self.state.is_short() && !self.absent()
    }

    /// Idle streams that may be closed, least recently used first.
    fn idle_streams(&self) -> Vec<&StreamView> {
        let mut idle: Vec<&StreamView> = self
            .view
            .streams
            .iter()
            .filter(|st| !st.busy && !st.retiring)
            .collect();
        idle.sort_by_key(|st| (st.last_used, st.opened_at, st.id));
        idle
    }
}

/// The servers of one tick, classified.
#[derive(Debug)]
struct Tick<'a> {
    now: Instant,
    cause: Cause,
    opening: u32,
    /// `Snapshot::stalled`.
    stalled: u32,
    servers: Vec<Server<'a>>,
}

impl Tick<'_> {
    fn live(&self) -> u32 {
        self.servers.iter().map(|s| s.live).sum()
    }

    fn in_flight(&self) -> u32 {
        self.servers.iter().map(|s| s.in_flight).sum()
    }
}

/// Opens one rule asks for, before crediting and caps.
struct OpenRequest {
    server_id: String,
    /// Set for a filling server: the opens count against its fill budget.
    budgeted: Option<ServerKey>,
    /// Open straight to this server (its key, URL and direct opens in flight).
    direct: Option<(ServerKey, String, u32)>,
    kind: ActionKind,
    want: u32,
    why: String,
}

fn key(view: &ServerView) -> ServerKey {
    (view.server_id.clone(), view.instance_id.clone())
}

fn count(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

impl Planner {
    pub fn new(cfg: CoverageConfig) -> Self {
        Planner {
            cfg,
            memory: HashMap::new(),
            last_evacuation: None,
        }
    }

    pub fn config(&self) -> &CoverageConfig {
        &self.cfg
    }

    /// Where the server's missing streams go: straight to its direct URL when direct
    /// growth is on and it offers one (with the direct opens already in flight).
    /// The server's own path for opens (its key, direct URL or empty when steered, and
    /// such opens in flight): its direct URL with `direct_growth`, else the load balancer
    /// naming it with `steered_opens`, while opens there land there.
    fn direct_of(&self, s: &Server) -> Option<(ServerKey, String, u32)> {
        if self.cfg.direct_growth && !s.view.direct_url.is_empty() {
            return Some((s.key(), s.view.direct_url.clone(), s.view.opening));
        }
        (self.cfg.steered_opens && s.view.steerable)
            .then(|| (s.key(), String::new(), s.view.opening))
    }

    /// Fill opens a short server may have before they are paced: about what uniform
    /// placement needs to land the reserve there.
    fn fill_budget(&self, servers: usize) -> u32 {
        self.cfg
            .reserve
            .saturating_mul(count(servers).max(1))
            .saturating_mul(2)
    }

    /// How long qualifying streams may wait for others to qualify, so they retire together.
    fn retire_window(&self) -> Duration {
        (self.cfg.retire_unused / 10).max(self.cfg.tick * 2)
    }

    pub fn plan(&mut self, snap: &Snapshot) -> Plan {
        if !self.cfg.enabled {
            return match snap.cause {
                Cause::Tick => self.plan_fixed(snap),
                Cause::Pressure => Plan::default(),
            };
        }
        let tick = self.classify(snap);
        let mut plan = Plan::default();
        match tick.cause {
            Cause::Tick => {
                self.evacuate(&tick, &mut plan);
                self.recycle(&tick, &mut plan);
                self.give_back(&tick, &mut plan);
                let mut requests = self.grow(&tick);
                let fills = self.fill(&tick, &requests);
                requests.extend(fills);
                requests.extend(self.bootstrap(&tick));
                self.open(&tick, requests, &mut plan);
                self.retire(&tick, &mut plan);
            }
            Cause::Pressure => {
                let requests = self.grow(&tick);
                self.open(&tick, requests, &mut plan);
            }
        }
        plan.states = tick
            .servers
            .iter()
            .map(|s| ServerState {
                server_id: s.view.server_id.clone(),
                instance_id: s.view.instance_id.clone(),
                zone: s.view.zone.clone(),
                state: s.state,
                streams: s.live,
                busy: s.busy(),
                idle: s.idle,
                budget: s.budget(self.cfg.reserve),
                short_for: self
                    .memory
                    .get(&s.key())
                    .and_then(|m| m.short_since)
                    .map_or(Duration::ZERO, |at| snap.now.saturating_duration_since(at)),
            })
            .collect();
        plan
    }

    /// Coverage off: hold `fixed_streams` in total, wherever they land.
    /// Streams on draining servers do not count: their idle ones are recycled and
    /// replaced in the same tick, busy ones once their call ends.
    fn plan_fixed(&mut self, snap: &Snapshot) -> Plan {
        let live: u32 = snap
            .servers
            .iter()
            .filter(|s| !s.draining)
            .map(|s| s.streams.iter().filter(|st| !st.retiring).count() as u32)
            .sum();
        let mut close = Vec::new();
        let mut actions = Vec::new();
        for s in snap.servers.iter().filter(|s| s.draining) {
            let idle: Vec<StreamId> = s
                .streams
                .iter()
                .filter(|st| !st.busy && !st.retiring)
                .map(|st| st.id)
                .collect();
            if idle.is_empty() {
                continue;
            }
            actions.push(Action {
                server_id: s.server_id.clone(),
                kind: ActionKind::Recycle,
                count: count(idle.len()),
                direct: false,
                reason: format!("draining: closing {} idle streams (fixed pool)", idle.len()),
            });
            close.extend(idle);
        }
        let have = live + snap.opening + snap.stalled;
        let open = self
            .cfg
            .fixed_streams
            .min(self.cfg.max_streams)
            .saturating_sub(have);
        let states = snap
            .servers
            .iter()
            .filter(|s| !s.streams.is_empty())
            .map(|s| {
                let streams = s.streams.iter().filter(|st| !st.retiring).count() as u32;
                let busy_now = s.streams.iter().filter(|st| st.busy).count() as u32;
                let busy = busy_now.max(s.peak_in_flight).saturating_add(s.queued);
                let budget = busy.saturating_add(self.cfg.reserve);
                let state = if s.draining {
                    State::Evacuated
                } else if streams >= budget {
                    State::Covered
                } else {
                    State::Filling
                };
                ServerState {
                    server_id: s.server_id.clone(),
                    instance_id: s.instance_id.clone(),
                    zone: s.zone.clone(),
                    state,
                    streams,
                    busy,
                    idle: streams.saturating_sub(busy_now),
                    budget,
                    short_for: Duration::ZERO,
                }
            })
            .collect();
        Plan {
            open,
            probes: 0,
            direct: Vec::new(),
            close,
            actions,
            states,
        }
    }
}

#[cfg(test)]
mod sim;
#[cfg(test)]
mod tests;
