//! Test-only simulation of the fleet around the planner: tunnel servers (LIFO idle
//! stacks and a queue), a load balancer that places each new stream, a dispatcher that
//! sends every call to one server (`a`, or the first server still holding streams), and
//! calls lasting whole ticks. No sockets, no clock: time is `base + tick`.
//!
//! One `step` is one sizing tick: retiring streams finish their handshake, the opens of
//! earlier ticks land, calls end, the servers hand queued calls to their newest idle
//! stream; the agent takes a snapshot and plans (its closes go retiring, its opens land
//! `delay` ticks later); then the calls of that tick arrive, just after the agent's tick
//! (the worst moment for a burst) and are handed out; last, when `events` is on and a
//! server's queue grew, or its idle
//! streams ran out while calls queue (as the agent sees it: without `hint` it does not
//! know the queue, so every run-out counts), the agent plans once more for growth only
//! (`Cause::Pressure`). Every plan is checked against the invariants; breaches are
//! collected in `violations`.

use super::*;
use std::collections::VecDeque;

/// splitmix64: small, seeded, deterministic.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next() % n
        }
    }
}

/// Where the load balancer puts a new stream (draining servers never get one).
#[derive(Clone, Debug)]
pub enum Placement {
    /// Uniform round robin.
    RoundRobin,
    /// Seeded random by weight, one weight per server in order (0: never).
    Weighted(Vec<u32>),
    /// Server indexes in order, then round robin.
    Script(VecDeque<usize>),
}

#[derive(Clone, Debug)]
pub struct SimStream {
    pub id: StreamId,
    /// Tick at which its call ends.
    pub busy_until: Option<u64>,
    pub opened_at: Instant,
    pub last_used: Instant,
    pub retiring: bool,
    /// A fill open's stream that has carried no call (`StreamView::probe`).
    pub probe: bool,
}

#[derive(Clone, Debug)]
pub struct SimServer {
    pub id: String,
    pub zone: String,
    pub streams: Vec<SimStream>,
    /// Idle streams, newest on top.
    pub idle: Vec<StreamId>,
    /// Durations (ticks) of the calls waiting here.
    pub queue: VecDeque<u64>,
    pub draining: bool,
    /// The queue length the agent was last told (the pressure hint it has).
    told: u32,
}

impl SimServer {
    pub fn live(&self) -> u32 {
        count(self.streams.iter().filter(|s| !s.retiring).count())
    }

    pub fn in_flight(&self) -> u32 {
        count(
            self.streams
                .iter()
                .filter(|s| s.busy_until.is_some())
                .count(),
        )
    }

    fn idle_now(&self) -> usize {
        self.idle.len()
    }
}

/// Calls arriving at the dispatcher.
#[derive(Clone, Debug, Default)]
pub struct Load {
    /// (tick, calls, duration in ticks)
    pub bursts: Vec<(u64, u32, u64)>,
    /// (from tick, until tick exclusive, calls per tick, duration in ticks)
    pub steady: Option<(u64, u64, u32, u64)>,
}

impl Load {
    fn arrivals(&self, t: u64) -> Vec<(u32, u64)> {
        let mut out: Vec<(u32, u64)> = self
            .bursts
            .iter()
            .filter(|b| b.0 == t)
            .map(|b| (b.1, b.2))
            .collect();
        if let Some((from, until, n, dur)) = self.steady {
            if t >= from && t < until {
                out.push((n, dur));
            }
        }
        out
    }

    fn last_tick(&self) -> u64 {
        let b = self.bursts.iter().map(|b| b.0 + 1).max().unwrap_or(0);
        b.max(self.steady.map_or(0, |s| s.1))
    }
}

/// Opens in flight: when they land and where (`None`: the load balancer places them).
struct Pending {
    at: u64,
    count: u32,
    /// Of `count`, the fill opens (their streams land as probes).
    probes: u32,
    server: Option<usize>,
}

pub struct Sim {
    pub planner: Planner,
    pub base: Instant,
    /// The next tick to run.
    pub t: u64,
    pub servers: Vec<SimServer>,
    pub placement: Placement,
    pub load: Load,
    /// Ticks from an open to its landing (>= 1).
    pub delay: u64,
    /// Whether servers report queued calls (the pressure hint).
    pub hint: bool,
    /// Whether the agent plans growth on events (a queue that grew, idle streams that ran
    /// out) as well as on the tick. Events land like the tick's opens, `delay` later.
    pub events: bool,
    /// Whether servers offer a direct URL (`sim://<id>`); with `direct_growth` in the
    /// config the agent opens there and those opens land on that server.
    pub direct: bool,
    /// Whether the servers are listed in the fleet the agent knows.
    pub listed: bool,
    pub last_plan: Plan,
    pub violations: Vec<String>,
    /// Every action taken, with its tick.
    pub actions: Vec<(u64, Action)>,
    /// Opens that found no server (all draining).
    pub lost_opens: u32,
    /// Opens asked for, through the load balancer and direct.
    pub opened: u32,
    /// The most live streams at once.
    pub peak_live: u32,
    /// Where the agent's load-balanced opens landed.
    pub tally: PlacementTally,
    pending: VecDeque<Pending>,
    rr: usize,
    rng: Rng,
    next_id: StreamId,
}

/// Time zero of the simulation lies an hour after `base`, so seeded streams can be old.
const EPOCH: Duration = Duration::from_secs(3600);

impl Sim {
    pub fn new(cfg: CoverageConfig, servers: &[(&str, &str)], placement: Placement) -> Self {
        Sim {
            planner: Planner::new(cfg),
            base: Instant::now(),
            t: 0,
            servers: servers
                .iter()
                .map(|(id, zone)| SimServer {
                    id: id.to_string(),
                    zone: zone.to_string(),
                    streams: Vec::new(),
                    idle: Vec::new(),
                    queue: VecDeque::new(),
                    draining: false,
                    told: 0,
                })
                .collect(),
            placement,
            load: Load::default(),
            delay: 1,
            hint: true,
            events: true,
            direct: false,
            listed: false,
            last_plan: Plan::default(),
            violations: Vec::new(),
            actions: Vec::new(),
            lost_opens: 0,
            opened: 0,
            peak_live: 0,
            tally: PlacementTally::default(),
            pending: VecDeque::new(),
            rr: 0,
            rng: Rng::new(7),
            next_id: 1,
        }
    }

    pub fn seeded(mut self, seed: u64) -> Self {
        self.rng = Rng::new(seed);
        self
    }

    pub fn cfg(&self) -> &CoverageConfig {
        self.planner.config()
    }

    pub fn at(&self, t: u64) -> Instant {
        self.base + EPOCH + self.cfg().tick * u32::try_from(t).unwrap_or(u32::MAX)
    }

    pub fn now(&self) -> Instant {
        self.at(self.t)
    }

    pub fn index(&self, id: &str) -> usize {
        self.servers
            .iter()
            .position(|s| s.id == id)
            .expect("known server")
    }

    /// Gives server `id` `n` idle streams opened and last used `age` ago.
    pub fn seed_streams(&mut self, id: &str, n: u32, age: Duration) {
        let at = self.now() - age;
        let i = self.index(id);
        for _ in 0..n {
            self.add_stream(i, at, false);
        }
    }

    /// Records `n` earlier load-balanced landings as the placement policy would have made
    /// them: what an agent that has been running knows of its load balancer.
    pub fn learn_placement(&mut self, n: u32) {
        for _ in 0..n {
            if let Some(i) = self.place() {
                let k = (self.servers[i].id.clone(), "1".to_string());
                self.tally.land(&k);
            }
        }
    }

    fn add_stream(&mut self, i: usize, at: Instant, probe: bool) {
        let id = self.next_id;
        self.next_id += 1;
        let server = &mut self.servers[i];
        server.streams.push(SimStream {
            id,
            busy_until: None,
            opened_at: at,
            last_used: at,
            retiring: false,
            probe,
        });
        server.idle.push(id);
    }

    fn place(&mut self) -> Option<usize> {
        let open: Vec<usize> = (0..self.servers.len())
            .filter(|&i| !self.servers[i].draining)
            .collect();
        if open.is_empty() {
            return None;
        }
        let scripted = match &mut self.placement {
            Placement::Script(q) => q.pop_front().filter(|i| open.contains(i)),
            _ => None,
        };
        if let Some(i) = scripted {
            return Some(i);
        }
        if let Placement::Weighted(w) = &self.placement {
            let weights: Vec<u64> = open
                .iter()
                .map(|&i| u64::from(w.get(i).copied().unwrap_or(0)))
                .collect();
            let total: u64 = weights.iter().sum();
            if total == 0 {
                return None;
            }
            let mut r = self.rng.below(total);
            for (k, wt) in weights.iter().enumerate() {
                if r < *wt {
                    return Some(open[k]);
                }
                r -= wt;
            }
            return None;
        }
        self.rr = (self.rr + 1) % open.len();
        Some(open[self.rr])
    }

    /// Where the dispatcher sends calls: `a` while it holds live streams, else the first
    /// non-draining server that does (else `a` anyway).
    fn target(&self) -> usize {
        let holds = |s: &SimServer| s.live() > 0 && !s.draining;
        if holds(&self.servers[0]) {
            return 0;
        }
        self.servers.iter().position(holds).unwrap_or(0)
    }

    pub fn in_flight(&self) -> u32 {
        self.servers.iter().map(SimServer::in_flight).sum()
    }

    pub fn queued(&self) -> u32 {
        self.servers.iter().map(|s| count(s.queue.len())).sum()
    }

    pub fn live(&self) -> u32 {
        self.servers.iter().map(SimServer::live).sum()
    }

    /// Load-balanced opens in flight.
    pub fn opening(&self) -> u32 {
        self.pending
            .iter()
            .filter(|p| p.server.is_none())
            .map(|p| p.count)
            .sum()
    }

    fn opening_direct(&self, i: usize) -> u32 {
        self.pending
            .iter()
            .filter(|p| p.server == Some(i))
            .map(|p| p.count)
            .sum()
    }

    /// Live streams per server, in server order.
    pub fn live_per_server(&self) -> Vec<(String, u32)> {
        self.servers
            .iter()
            .map(|s| (s.id.clone(), s.live()))
            .collect()
    }

    pub fn snapshot(&self, cause: Cause) -> Snapshot {
        Snapshot {
            now: self.now(),
            cause,
            opening: self.opening(),
            stalled: 0,
            servers: self
                .servers
                .iter()
                .enumerate()
                .filter(|(_, s)| !s.streams.is_empty() || self.listed)
                .map(|(i, s)| ServerView {
                    server_id: s.id.clone(),
                    instance_id: "1".into(),
                    zone: s.zone.clone(),
                    listed: self.listed,
                    cap: None,
                    direct_url: if self.direct {
                        format!("sim://{}", s.id)
                    } else {
                        String::new()
                    },
                    opening: self.opening_direct(i),
                    streams: s
                        .streams
                        .iter()
                        .map(|st| StreamView {
                            id: st.id,
                            busy: st.busy_until.is_some(),
                            opened_at: st.opened_at,
                            last_used: st.last_used,
                            retiring: st.retiring,
                            probe: st.probe,
                        })
                        .collect(),
                    queued: if self.hint { count(s.queue.len()) } else { 0 },
                    hints: self.hint,
                    // Calls here last whole ticks: the busy streams are the peak.
                    peak_in_flight: 0,
                    placed: self.tally.get(&(s.id.clone(), "1".to_string())),
                    draining: s.draining,
                    lost_since: None,
                    steerable: true,
                })
                .collect(),
        }
    }

    /// Hands queued calls to idle streams; returns, per server, whether a call took its
    /// last idle stream.
    fn hand_off(&mut self) -> Vec<bool> {
        let t = self.t;
        let mut ran_out = vec![false; self.servers.len()];
        for (i, s) in self.servers.iter_mut().enumerate() {
            let mut handed = false;
            while !s.queue.is_empty() {
                let Some(id) = s.idle.pop() else { break };
                let dur = s.queue.pop_front().unwrap_or(1);
                if let Some(st) = s.streams.iter_mut().find(|st| st.id == id) {
                    st.busy_until = Some(t + dur);
                    st.probe = false;
                }
                handed = true;
            }
            ran_out[i] = handed && s.idle_now() == 0;
        }
        ran_out
    }

    /// Runs one tick.
    pub fn step(&mut self) {
        let t = self.t;
        let now = self.now();
        // GoingAway handshakes from the previous tick complete.
        for s in &mut self.servers {
            s.streams
                .retain(|st| !(st.retiring && st.busy_until.is_none()));
        }
        // Opens land.
        while self.pending.front().is_some_and(|p| p.at <= t) {
            let Some(p) = self.pending.pop_front() else {
                break;
            };
            for k in 0..p.count {
                let to = match p.server {
                    Some(i) if !self.servers[i].draining => Some(i),
                    Some(_) => None,
                    None => {
                        let i = self.place();
                        if let Some(i) = i {
                            let k = (self.servers[i].id.clone(), "1".to_string());
                            self.tally.land(&k);
                        }
                        i
                    }
                };
                match to {
                    Some(i) => self.add_stream(i, now, k < p.probes),
                    None => self.lost_opens += 1,
                }
            }
        }
        // Calls end.
        for s in &mut self.servers {
            for st in &mut s.streams {
                if st.busy_until.is_some_and(|end| end <= t) {
                    st.busy_until = None;
                    st.last_used = now;
                    if !st.retiring {
                        s.idle.push(st.id);
                    }
                }
            }
        }
        let mut ran_out = self.hand_off();
        // The agent's tick.
        self.plan(Cause::Tick);
        // Calls arrive, just after the tick; calls stranded on a server without streams
        // move to the target.
        let target = self.target();
        for i in 0..self.servers.len() {
            if i != target && self.servers[i].live() == 0 && !self.servers[i].queue.is_empty() {
                let moved: Vec<u64> = self.servers[i].queue.drain(..).collect();
                self.servers[target].queue.extend(moved);
            }
        }
        for (n, dur) in self.load.arrivals(t) {
            self.servers[target]
                .queue
                .extend(std::iter::repeat_n(dur.max(1), n as usize));
        }
        for (i, r) in self.hand_off().into_iter().enumerate() {
            ran_out[i] |= r;
        }
        // Events: a queue that grew, or idle streams that ran out while calls queue.
        let mut event = false;
        for (i, s) in self.servers.iter_mut().enumerate() {
            let queued = count(s.queue.len());
            let grew = self.hint && queued > s.told;
            let run_out = ran_out[i] && (!self.hint || queued > 0);
            event |= grew || run_out;
            s.told = queued;
        }
        if self.events && event {
            self.plan(Cause::Pressure);
        }
        self.peak_live = self.peak_live.max(self.live());
        self.t += 1;
    }

    /// Takes a snapshot, plans, checks the plan and carries it out.
    fn plan(&mut self, cause: Cause) {
        let t = self.t;
        let snap = self.snapshot(cause);
        let plan = self.planner.plan(&snap);
        self.check(&snap, &plan);
        for id in &plan.close {
            for s in &mut self.servers {
                if let Some(st) = s.streams.iter_mut().find(|st| st.id == *id) {
                    if st.busy_until.is_some() {
                        self.violations
                            .push(format!("t{t}: closed busy stream {id}"));
                    }
                    st.retiring = true;
                    s.idle.retain(|x| x != id);
                }
            }
        }
        let at = t + self.delay.max(1);
        if plan.open > 0 {
            self.pending.push_back(Pending {
                at,
                count: plan.open,
                probes: plan.probes,
                server: None,
            });
        }
        for d in &plan.direct {
            let i = self.index(&d.server_id);
            self.pending.push_back(Pending {
                at,
                count: d.count,
                probes: 0,
                server: Some(i),
            });
        }
        self.opened += plan.opens();
        self.actions
            .extend(plan.actions.iter().map(|a| (t, a.clone())));
        self.last_plan = plan;
    }

    /// The invariants every plan must keep.
    fn check(&mut self, snap: &Snapshot, plan: &Plan) {
        let t = self.t;
        let cfg = self.planner.config().clone();
        let closing: std::collections::HashSet<StreamId> = plan.close.iter().copied().collect();
        let live: u32 = snap
            .servers
            .iter()
            .flat_map(|s| &s.streams)
            .filter(|st| !st.retiring && !closing.contains(&st.id))
            .count() as u32;
        let direct_opening: u32 = snap.servers.iter().map(|s| s.opening).sum();
        let opening = snap.opening + direct_opening;
        if live + opening + plan.opens() > cfg.max_streams {
            self.violations.push(format!(
                "t{t}: live {live} + opening {opening} + open {} > max_streams {}",
                plan.opens(),
                cfg.max_streams
            ));
        }
        if snap.cause == Cause::Pressure && !plan.close.is_empty() {
            self.violations
                .push(format!("t{t}: an event plan closed streams: {plan:?}"));
        }
        let mut seen = std::collections::HashSet::new();
        for id in &plan.close {
            if !seen.insert(*id) {
                self.violations
                    .push(format!("t{t}: stream {id} closed twice"));
            }
            let st = snap
                .servers
                .iter()
                .flat_map(|s| &s.streams)
                .find(|st| st.id == *id);
            match st {
                None => self
                    .violations
                    .push(format!("t{t}: closed unknown stream {id}")),
                Some(st) if st.busy || st.retiring => self
                    .violations
                    .push(format!("t{t}: closed busy/retiring stream {id}")),
                Some(_) => {}
            }
        }
        for a in plan
            .actions
            .iter()
            .filter(|a| a.kind == ActionKind::Evacuate)
        {
            let server = self.servers.iter().find(|s| s.id == a.server_id);
            if server.is_some_and(|s| s.in_flight() > 0 || !s.queue.is_empty()) {
                self.violations.push(format!(
                    "t{t}: evacuated {} with calls: {}",
                    a.server_id, a.reason
                ));
            }
        }
    }

    pub fn run(&mut self, ticks: u64) {
        for _ in 0..ticks {
            self.step();
        }
    }

    /// Runs until `done` holds after a tick; returns that tick, or None after `max` ticks.
    pub fn run_until(&mut self, max: u64, mut done: impl FnMut(&Sim) -> bool) -> Option<u64> {
        for _ in 0..max {
            self.step();
            if done(self) {
                return Some(self.t - 1);
            }
        }
        None
    }

    /// Whether every call has arrived and ended.
    pub fn quiet(&self) -> bool {
        self.t >= self.load.last_tick() && self.in_flight() == 0 && self.queued() == 0
    }

    pub fn actions_of(&self, kind: ActionKind) -> Vec<&(u64, Action)> {
        self.actions
            .iter()
            .filter(|(_, a)| a.kind == kind)
            .collect()
    }

    /// Ticks in which the agent retired streams.
    pub fn retire_steps(&self) -> Vec<u64> {
        let mut steps: Vec<u64> = self
            .actions_of(ActionKind::Retire)
            .iter()
            .map(|(t, _)| *t)
            .collect();
        steps.dedup();
        steps
    }
}
