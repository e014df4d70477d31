//! The routing decision: which tunnel server a tunnel id's next call goes to.
//!
//! Pure and deterministic: [`Router::update`] takes the table of servers holding each
//! tunnel id ([`ServerView`]s, as last reported) and `now` as a value; it reads no clock and
//! does no I/O. It builds one [`TunnelPlan`] per tunnel id, which the call path picks from
//! with an atomic counter ([`TunnelPlan::pick`]) without taking any lock.
//!
//! Policies (`[routing] policy`):
//! - `sticky`: the seed behaviour, the most recently announced server that is not draining.
//! - `available`: one *home* server per tunnel id, kept while it has idle streams (sticky,
//!   so calls don't flap). A *spill share* of new calls goes to other servers with idle
//!   streams while either
//!   - the home is saturated (calls queued there, or no idle stream and a call just
//!     answered NO_CAPACITY): the targets are the other servers with idle streams (those below the
//!     load high-water mark when there are any), or
//!   - the home is *much busier* than a peer (`load_aware`): its load (the smoothed CPU
//!     use it reports) exceeds the peer's by more than `load_margin`, and is at least
//!     `load_floor`. A margin between two figures, not a yes/no test of one: two servers
//!     at 60% and 70% never trade calls, one at 95% spills to one at 40%. The floor keeps
//!     a home with CPU to spare (30% against an idle peer's 2%) whole: its calls do not
//!     wait on its CPU, and spilling them would only split the batches its connections
//!     carry (on shared hardware, for more CPU per call). The targets are the peers that
//!     much less busy.
//!
//!   Targets are weighted by their idle streams, in their lowest latency tier. The share
//!   rises by `spill_step` per step while the condition holds, falls by `spill_decay` per
//!   step once it clears, is capped at `spill_max`, and is zero when no other server has
//!   idle streams (relaying adds no capacity). Steps happen at most every `step_interval`
//!   (when reports arrive or on the routing tick), never per call, so the share does not
//!   flap with the call rate. A tunnel id whose due step changed nothing (same home,
//!   share, tiers and plan) is *settled*: an update is a pure function of its state, its
//!   servers' views and whether a step is due, so the next step on the same views would
//!   change nothing either, and the routing tick skips it until a view changes or a
//!   NO_CAPACITY answer is noted. At rest that is every tunnel id: the tick, four times a
//!   second, then costs a comparison of views per tunnel id instead of a rebuild of its
//!   plan (with 1,000 tunnel ids on 10 servers the rebuilds, with their gauges, took about a
//!   sixth of a core per dispatcher; the cost grows with the tunnel ids times the servers).
//!   A home dwarfed by another server (whose idle streams alone exceed twice the home's
//!   whole pool, in the same or a better tier, or in any tier while the home is saturated;
//!   not much busier than the home, nor above the load high-water mark) yields the home to
//!   it at the next step: this corrects a home picked while the first reports were still
//!   arriving, and cannot swing back because of the factor.
//!   Overload yield (`load_aware`): a server whose load is at or above `load_high_water`
//!   takes no new home (a tunnel id without one, or whose home went, picks among the others
//!   when any has capacity), never takes one from a dwarfed home, and at a step hands the
//!   homes it has to a clearly cooler peer with capacity (less loaded by `load_margin`, and
//!   `load_margin` below the mark, so two servers cannot trade a home back and forth),
//!   lowest tier first: new calls go away from it while the calls in flight, and the
//!   agents' streams, stay where they are.
//! - Latency tiers inside `available`, from the smoothed RTT of a call's path: this
//!   dispatcher's leg to the server (`Forward.Probe`, timed on the connection calls use)
//!   plus the agent leg the server reports for the tunnel id's streams. Tiers are groups,
//!   built from the lowest remaining average: the lowest RTT not yet grouped anchors a tier
//!   of every remaining server within max(anchor + 2 ms, 2 x anchor); the rule is applied
//!   again to what remains. Hysteresis follows the group, not a tier number: a member stays
//!   with its group while its RTT is within the group's bound (taken from the group's
//!   lowest member now) plus `tier_hysteresis`, and a server or group that was grouped
//!   elsewhere before joins another only once `tier_hysteresis` inside its bound. So a
//!   server near a boundary does not flap, and a faster server appearing above a group
//!   forms its own tier instead of splitting the group. The home is taken from the lowest
//!   tier with capacity; a home in a higher tier moves down when a lower tier gets
//!   capacity for its calls (a server there whose idle streams could take the calls in
//!   flight and queued on the home: a busy server's RTT grows with its load, measured
//!   through its event loop, and its calls would only queue on a small server). Servers
//!   with no RTT yet (either leg unmeasured) count as tier 0 (no
//!   evidence against them).
//! - Draining servers are never chosen while another server holds the tunnel id; they come
//!   last in the retry order (a draining server still serves calls on the streams it holds
//!   until its agents move them; once it has none it answers UNKNOWN_TUNNEL or NO_CAPACITY).
//!
//! The registry owns the router and calls it from its writers only; the call path reads the
//! [`TunnelPlan`]s the registry publishes, never the router.

use crate::config::{RoutingConfig, RoutingPolicy};
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use tokio::time::Instant;

/// The additive part of the tier width rule: max(best + 2 ms, 2 x best).
const TIER_SLACK_US: f64 = 2000.0;

/// One server holding streams of one tunnel id, as the routing table knows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerView {
    pub server_id: Arc<str>,
    pub forward_url: Arc<str>,
    /// When this dispatcher learned that the server holds the tunnel id (sticky order).
    pub announced: Instant,
    pub draining: bool,
    /// The tunnel id's figures in the server's last load report (zero before the first).
    pub idle: u32,
    pub busy: u32,
    pub queued: u32,
    /// Smoothed RTT of a call's path, microseconds: this dispatcher's leg to the server
    /// plus the server's leg to the agent's streams; 0 = unknown.
    pub rtt_us: u32,
    /// The server's load: its smoothed CPU use, per mille; 0 = idle or not measured.
    pub load_permille: u32,
}

/// A server a call may be sent to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    pub server_id: Arc<str>,
    pub forward_url: Arc<str>,
    /// Idle streams of the tunnel id it last reported; retries only spill capacity-less
    /// NO_CAPACITY answers onto servers where this is above zero.
    pub idle: u32,
}

/// The servers to try for one call, first choice first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pick {
    pub servers: Vec<Target>,
    /// The first choice is a spill away from the home server.
    pub spilled: bool,
}

/// A tunnel id's routing, rebuilt by [`Router::update`], read by every call.
#[derive(Debug)]
pub struct TunnelPlan {
    /// Home first, then spill targets, other live servers, draining servers.
    order: Vec<Target>,
    /// Spill targets as (index into `order`, weight = idle streams).
    spill_targets: Vec<(usize, u32)>,
    /// Share of calls spilled, per mille.
    spill_permille: u64,
    /// Calls picked and spilled so far; shared across rebuilds so the spill sequence does
    /// not restart and the spill count only grows.
    counts: Arc<PickCounts>,
}

/// A tunnel id's picks, counted across its plans' rebuilds.
#[derive(Debug, Default)]
struct PickCounts {
    calls: AtomicU64,
    /// Picks whose first choice was a spill (`relay_dispatcher_spills_total`).
    spills: AtomicU64,
}

impl TunnelPlan {
    /// The servers for the next call (a spill is counted here, for the tunnel id's
    /// `relay_dispatcher_spills_total`).
    pub fn pick(&self) -> Pick {
        let n = self.counts.calls.fetch_add(1, Ordering::Relaxed);
        let pick = self.pick_nth(n);
        if pick.spilled {
            self.counts.spills.fetch_add(1, Ordering::Relaxed);
        }
        pick
    }

    /// The servers for call number `n`: call `n` spills when the running count of spilled
    /// calls `floor(n * share)` steps up, so exactly `share` of the calls spill, evenly
    /// spaced; the k-th spilled call goes to targets in proportion to their idle streams.
    pub fn pick_nth(&self, n: u64) -> Pick {
        let total: u64 = self.spill_targets.iter().map(|(_, w)| u64::from(*w)).sum();
        let p = self.spill_permille;
        let spill = total > 0 && p > 0 && (n + 1) * p / 1000 > n * p / 1000;
        if !spill {
            return Pick {
                servers: self.order.clone(),
                spilled: false,
            };
        }
        let k = n * p / 1000;
        let mut at = k % total;
        let mut chosen = self.spill_targets[0].0;
        for (i, w) in &self.spill_targets {
            if at < u64::from(*w) {
                chosen = *i;
                break;
            }
            at -= u64::from(*w);
        }
        let mut servers = Vec::with_capacity(self.order.len());
        servers.push(self.order[chosen].clone());
        servers.extend(
            self.order
                .iter()
                .enumerate()
                .filter(|(i, _)| *i != chosen)
                .map(|(_, t)| t.clone()),
        );
        Pick {
            servers,
            spilled: true,
        }
    }

    /// The planned order (home first), for `/debug/routes` and tests.
    pub fn order(&self) -> &[Target] {
        &self.order
    }
}

/// What `/debug/routes` and the metrics show of one tunnel id's routing.
#[derive(Debug, Clone, PartialEq)]
pub struct TunnelStatus {
    pub home: Option<Arc<str>>,
    pub spill_share: f64,
    /// Why the share last rose: `saturated` (calls queued on the home) or `load` (the
    /// home was much busier than a peer); `None` before it ever did.
    pub spill_reason: Option<&'static str>,
    /// Tier of each live server (0 = best).
    pub tiers: Vec<(Arc<str>, usize)>,
    /// Calls whose first choice was a spill, since a server first held the tunnel id.
    pub spills: u64,
}

#[derive(Debug)]
struct TunnelState {
    home: Option<Arc<str>>,
    spill: f64,
    spill_reason: Option<&'static str>,
    last_step: Option<Instant>,
    tiers: HashMap<Arc<str>, usize>,
    /// The latency groups of the last update, lowest first (measured servers only).
    groups: Groups,
    /// Servers that answered NO_CAPACITY for this tunnel id since the last step.
    no_capacity: HashSet<Arc<str>>,
    /// The views of a due update that changed nothing (see the module docs): while the
    /// views are these and no NO_CAPACITY is noted, the routing tick skips the tunnel id.
    settled: Option<Vec<ServerView>>,
    counts: Arc<PickCounts>,
    plan: Arc<TunnelPlan>,
}

impl TunnelState {
    fn new() -> Self {
        let counts = Arc::new(PickCounts::default());
        TunnelState {
            home: None,
            spill: 0.0,
            spill_reason: None,
            last_step: None,
            tiers: HashMap::new(),
            groups: Vec::new(),
            no_capacity: HashSet::new(),
            settled: None,
            plan: Arc::new(TunnelPlan {
                order: Vec::new(),
                spill_targets: Vec::new(),
                spill_permille: 0,
                counts: counts.clone(),
            }),
            counts,
        }
    }
}

/// Every tunnel id's routing state. Owned by the registry's writers; see the module docs.
#[derive(Debug)]
pub struct Router {
    cfg: RoutingConfig,
    tunnels: HashMap<String, TunnelState>,
}

impl Router {
    pub fn new(cfg: RoutingConfig) -> Self {
        Router {
            cfg,
            tunnels: HashMap::new(),
        }
    }

    pub fn policy(&self) -> RoutingPolicy {
        self.cfg.policy
    }

    /// Rebuilds the plan of every tunnel id in `table` (tunnel id -> servers holding it)
    /// that is not settled on its views, stepping the spill shares that are due at `now`,
    /// and returns the ids it rebuilt (the others' plans and status are as they were).
    /// Tunnel ids absent from `table` are forgotten.
    pub fn update<'t>(
        &mut self,
        now: Instant,
        table: &'t HashMap<String, Vec<ServerView>>,
    ) -> Vec<&'t str> {
        self.tunnels.retain(|id, _| table.contains_key(id));
        let mut rebuilt = Vec::new();
        for (tunnel_id, views) in table {
            // Looked up before it is inserted: the tick visits every tunnel id, and an entry
            // by key would copy the id each time.
            let st = match self.tunnels.get_mut(tunnel_id.as_str()) {
                Some(st) => st,
                None => self
                    .tunnels
                    .entry(tunnel_id.clone())
                    .or_insert_with(TunnelState::new),
            };
            if st.no_capacity.is_empty() && st.settled.as_deref() == Some(views.as_slice()) {
                // What the update would have changed: the time of its step.
                if is_due(&self.cfg, st, now) {
                    st.last_step = Some(now);
                }
                continue;
            }
            let due = is_due(&self.cfg, st, now);
            let noted = !st.no_capacity.is_empty();
            // Only a due step without a NO_CAPACITY answer can settle the tunnel id: the
            // snapshot to compare with is taken for those alone.
            let before = (due && !noted).then(|| Snapshot::of(st));
            update_tunnel(&self.cfg, st, now, views);
            st.settled = before
                .is_some_and(|b| b == Snapshot::of(st))
                .then(|| views.clone());
            rebuilt.push(tunnel_id.as_str());
        }
        rebuilt
    }

    /// Rebuilds one tunnel id's plan from the servers holding it (`views`), stepping its
    /// spill share if due; forgets it when `views` is empty. A server announcing or
    /// dropping one tunnel id costs this, not a rebuild of every plan.
    pub fn update_one(&mut self, now: Instant, tunnel_id: &str, views: &[ServerView]) {
        if views.is_empty() {
            self.tunnels.remove(tunnel_id);
            return;
        }
        let st = self
            .tunnels
            .entry(tunnel_id.to_string())
            .or_insert_with(TunnelState::new);
        update_tunnel(&self.cfg, st, now, views);
        st.settled = None;
    }

    /// The plan for `tunnel_id`; `None` when no server holds it.
    pub fn plan(&self, tunnel_id: &str) -> Option<Arc<TunnelPlan>> {
        self.tunnels
            .get(tunnel_id)
            .filter(|t| !t.plan.order.is_empty())
            .map(|t| t.plan.clone())
    }

    /// Per-call feedback: `server_id` answered NO_CAPACITY for `tunnel_id`. Counts as that
    /// server being saturated at the next spill step (its report may be up to a second old).
    pub fn note_no_capacity(&mut self, tunnel_id: &str, server_id: &str) {
        if let Some(st) = self.tunnels.get_mut(tunnel_id) {
            st.no_capacity.insert(Arc::from(server_id));
        }
    }

    pub fn status(&self, tunnel_id: &str) -> Option<TunnelStatus> {
        let st = self.tunnels.get(tunnel_id)?;
        let mut tiers: Vec<(Arc<str>, usize)> =
            st.tiers.iter().map(|(s, t)| (s.clone(), *t)).collect();
        tiers.sort();
        Some(TunnelStatus {
            home: st.home.clone(),
            spill_share: st.spill,
            spill_reason: st.spill_reason,
            tiers,
            spills: st.counts.spills.load(Ordering::Relaxed),
        })
    }

    /// Tunnel ids with routing state.
    pub fn tunnel_ids(&self) -> impl Iterator<Item = &str> {
        self.tunnels.keys().map(String::as_str)
    }
}

fn target(v: &ServerView) -> Target {
    Target {
        server_id: v.server_id.clone(),
        forward_url: v.forward_url.clone(),
        idle: v.idle,
    }
}

/// Upper RTT bound (microseconds) of a tier anchored at `best`: max(best + 2 ms, 2 x best).
fn tier_bound(best: f64) -> f64 {
    (best + TIER_SLACK_US).max(2.0 * best)
}

/// Latency groups, lowest first: the servers of each tier.
type Groups = Vec<Vec<Arc<str>>>;

/// One step of latency grouping: a previous group (what is left of it) or a server of no
/// group.
struct Unit {
    members: Vec<Arc<str>>,
    best: f64,
    worst: f64,
    /// Grouped before: it joins another group only well inside that group's bound.
    past: bool,
}

/// Latency tiers from the lowest remaining average, with hysteresis that follows the group
/// (see the module docs). `prev` is the grouping of the last update, lowest first. Returns
/// each live server's tier (unmeasured ones: 0) and the new grouping.
fn group_tiers(
    hysteresis: f64,
    live: &[&ServerView],
    prev: &[Vec<Arc<str>>],
) -> (HashMap<Arc<str>, usize>, Groups) {
    let rtt: HashMap<&Arc<str>, f64> = live
        .iter()
        .filter(|v| v.rtt_us > 0)
        .map(|v| (&v.server_id, f64::from(v.rtt_us)))
        .collect();
    let mut units: Vec<Unit> = Vec::new();
    let mut grouped: HashSet<&Arc<str>> = HashSet::new();
    for g in prev {
        let present: Vec<(&Arc<str>, f64)> = g
            .iter()
            .filter_map(|id| rtt.get_key_value(id).map(|(k, r)| (*k, *r)))
            .collect();
        let Some(best) = present.iter().map(|(_, r)| *r).reduce(f64::min) else {
            continue;
        };
        // Members stay while within the group's bound (from its lowest member now) plus
        // the margin; the others leave it.
        let keep = tier_bound(best) * (1.0 + hysteresis);
        let (kept, left): (Vec<_>, Vec<_>) = present.into_iter().partition(|(_, r)| *r <= keep);
        let worst = kept.iter().map(|(_, r)| *r).fold(best, f64::max);
        units.push(Unit {
            members: kept.iter().map(|(id, _)| (*id).clone()).collect(),
            best,
            worst,
            past: true,
        });
        for (id, r) in left {
            units.push(Unit {
                members: vec![id.clone()],
                best: r,
                worst: r,
                past: true,
            });
        }
        grouped.extend(
            g.iter()
                .filter_map(|id| rtt.get_key_value(id).map(|(k, _)| *k)),
        );
    }
    for (id, r) in &rtt {
        if !grouped.contains(id) {
            units.push(Unit {
                members: vec![(*id).clone()],
                best: *r,
                worst: *r,
                past: false,
            });
        }
    }
    units.sort_by(|a, b| {
        a.best
            .total_cmp(&b.best)
            .then_with(|| a.members.cmp(&b.members))
    });
    let mut groups: Vec<Vec<Arc<str>>> = Vec::new();
    let mut taken = vec![false; units.len()];
    for i in 0..units.len() {
        if taken[i] {
            continue;
        }
        taken[i] = true;
        let bound = tier_bound(units[i].best);
        let mut group = units[i].members.clone();
        for j in i + 1..units.len() {
            if taken[j] {
                continue;
            }
            let limit = if units[j].past {
                bound * (1.0 - hysteresis)
            } else {
                bound
            };
            if units[j].worst <= limit {
                taken[j] = true;
                group.extend(units[j].members.iter().cloned());
            }
        }
        group.sort();
        groups.push(group);
    }
    let mut tiers: HashMap<Arc<str>, usize> =
        live.iter().map(|v| (v.server_id.clone(), 0)).collect();
    for (k, g) in groups.iter().enumerate() {
        for id in g {
            tiers.insert(id.clone(), k);
        }
    }
    (tiers, groups)
}

/// What an update may change of a tunnel id's state, to tell whether it changed anything.
#[derive(PartialEq)]
struct Snapshot {
    home: Option<Arc<str>>,
    spill: f64,
    spill_reason: Option<&'static str>,
    tiers: HashMap<Arc<str>, usize>,
    groups: Groups,
    order: Vec<Target>,
    spill_targets: Vec<(usize, u32)>,
    spill_permille: u64,
}

impl Snapshot {
    fn of(st: &TunnelState) -> Self {
        Snapshot {
            home: st.home.clone(),
            spill: st.spill,
            spill_reason: st.spill_reason,
            tiers: st.tiers.clone(),
            groups: st.groups.clone(),
            order: st.plan.order.clone(),
            spill_targets: st.plan.spill_targets.clone(),
            spill_permille: st.plan.spill_permille,
        }
    }
}

/// Whether an update at `now` steps the tunnel id's spill share.
fn is_due(cfg: &RoutingConfig, st: &TunnelState, now: Instant) -> bool {
    st.last_step
        .is_none_or(|t| now.saturating_duration_since(t) >= cfg.step_interval)
}

fn update_tunnel(cfg: &RoutingConfig, st: &mut TunnelState, now: Instant, views: &[ServerView]) {
    let live: Vec<&ServerView> = views.iter().filter(|v| !v.draining).collect();
    let mut draining: Vec<&ServerView> = views.iter().filter(|v| v.draining).collect();
    draining.sort_by(|a, b| {
        b.announced
            .cmp(&a.announced)
            .then_with(|| a.server_id.cmp(&b.server_id))
    });
    let due = is_due(cfg, st, now);

    let mut order: Vec<Target> = Vec::with_capacity(views.len());
    let mut spill_targets = Vec::new();
    match cfg.policy {
        RoutingPolicy::Sticky => {
            let mut live = live;
            live.sort_by(|a, b| {
                b.announced
                    .cmp(&a.announced)
                    .then_with(|| a.server_id.cmp(&b.server_id))
            });
            st.home = live.first().map(|v| v.server_id.clone());
            st.spill = 0.0;
            st.tiers.clear();
            st.groups.clear();
            order.extend(live.iter().map(|v| target(v)));
        }
        RoutingPolicy::Available => {
            if cfg.latency_tiers {
                let (tiers, groups) = group_tiers(cfg.tier_hysteresis, &live, &st.groups);
                st.tiers = tiers;
                st.groups = groups;
            } else {
                st.tiers = live.iter().map(|v| (v.server_id.clone(), 0)).collect();
                st.groups.clear();
            }
            let tiers = &st.tiers;
            let tier = |v: &ServerView| tiers.get(&v.server_id).copied().unwrap_or(0);
            let no_cap = &st.no_capacity;
            let has_cap = |v: &ServerView| v.idle > 0 && !no_cap.contains(&v.server_id);
            let load = |v: &ServerView| f64::from(v.load_permille) / 1000.0;
            // At or above the high-water mark a server takes no new home.
            let hot = |v: &ServerView| cfg.load_aware && load(v) >= cfg.load_high_water;
            // Calls wait there (a report can show an idle stream beside queued calls: one that
            // landed a moment before the queue's next call took it), or it just answered
            // NO_CAPACITY with no idle stream.
            let saturated =
                |v: &ServerView| v.queued > 0 || (v.idle == 0 && no_cap.contains(&v.server_id));
            // New homes go to servers below the high-water mark while any has capacity.
            let any_cool = live.iter().any(|v| has_cap(v) && !hot(v));
            let homeable = |v: &ServerView| has_cap(v) && (!hot(v) || !any_cool);
            let cap_tier = live.iter().filter(|v| homeable(v)).map(|v| tier(v)).min();

            let prev = st
                .home
                .as_ref()
                .and_then(|h| live.iter().find(|v| v.server_id == *h).copied());
            // The home stays (stickiness; a hot home too: its work stays where it is) unless
            // a lower tier has capacity for its calls: a server there whose idle streams
            // could take the calls in flight and queued on the home. A busy server's RTT grows
            // with its load (it is measured through its event loop); moving its calls to a
            // small server of a better tier would only queue them there.
            let takes = |v: &ServerView, p: &ServerView| {
                homeable(v) && v.idle >= p.busy.saturating_add(p.queued)
            };
            let keep = prev.filter(|p| {
                cap_tier.is_none_or(|t| {
                    tier(p) <= t || !live.iter().any(|v| tier(v) < tier(p) && takes(v, p))
                })
            });
            // Moving down: into the lowest tier with a server that can take the home's calls.
            let move_tier = prev
                .filter(|_| keep.is_none())
                .and_then(|p| {
                    live.iter()
                        .filter(|v| tier(v) < tier(p) && takes(v, p))
                        .map(|v| tier(v))
                        .min()
                })
                .or(cap_tier);
            let home = keep.or_else(|| match move_tier {
                // The best server of that tier with capacity: most idle streams, then lowest
                // RTT, then id for a stable choice.
                Some(t) => live
                    .iter()
                    .filter(|v| homeable(v) && tier(v) == t)
                    .min_by(|a, b| {
                        b.idle
                            .cmp(&a.idle)
                            .then_with(|| rtt_key(a).cmp(&rtt_key(b)))
                            .then_with(|| a.server_id.cmp(&b.server_id))
                    })
                    .copied(),
                // Nobody has capacity: keep the home if it is live, else the server with the
                // shortest queue and the most streams.
                None => prev.or_else(|| {
                    live.iter()
                        .min_by(|a, b| {
                            a.queued
                                .cmp(&b.queued)
                                .then_with(|| {
                                    b.idle
                                        .saturating_add(b.busy)
                                        .cmp(&a.idle.saturating_add(a.busy))
                                })
                                .then_with(|| b.announced.cmp(&a.announced))
                                .then_with(|| a.server_id.cmp(&b.server_id))
                        })
                        .copied()
                }),
            });
            // A home another server (in the same or a better tier, with capacity, below
            // the high-water mark) dwarfs gives way to it at a step: that server's idle
            // streams alone exceed twice the home's whole pool. The factor keeps two
            // servers from trading the home back and forth, and the spill share covers
            // everything short of that.
            let home = match home {
                Some(h) if due => live
                    .iter()
                    .filter(|v| {
                        // A saturated home yields across tiers: queueing costs more than
                        // the latency difference.
                        // Never to a server much busier than the home: the load spill would
                        // push the calls back, and the two would trade the home.
                        v.server_id != h.server_id
                            && has_cap(v)
                            && !hot(v)
                            && !(cfg.load_aware && load(v) - load(h) > cfg.load_margin)
                            && (tier(v) <= tier(h) || saturated(h))
                    })
                    .filter(|v| {
                        u64::from(v.idle) >= 2 * (u64::from(h.idle) + u64::from(h.busy)) + 2
                    })
                    .max_by(|a, b| {
                        a.idle
                            .cmp(&b.idle)
                            .then_with(|| b.server_id.cmp(&a.server_id))
                    })
                    .copied()
                    .or(Some(h)),
                other => other,
            };
            // Overload yield: a home at or above the high-water mark hands the home to a
            // clearly cooler peer with capacity (by the margin, and the margin below the
            // mark, so the two cannot trade it back and forth), lowest tier first. New
            // calls go there; the calls in flight stay where they are.
            let home = match home {
                Some(h) if due && hot(h) => live
                    .iter()
                    .filter(|v| {
                        v.server_id != h.server_id
                            && has_cap(v)
                            && load(v) + cfg.load_margin < load(h)
                            && load(v) <= cfg.load_high_water - cfg.load_margin
                    })
                    .min_by(|a, b| {
                        tier(a)
                            .cmp(&tier(b))
                            .then_with(|| a.load_permille.cmp(&b.load_permille))
                            .then_with(|| b.idle.cmp(&a.idle))
                            .then_with(|| a.server_id.cmp(&b.server_id))
                    })
                    .copied()
                    .or(Some(h)),
                other => other,
            };
            if home.map(|h| &h.server_id) != st.home.as_ref() {
                st.spill = 0.0;
            }
            st.home = home.map(|h| h.server_id.clone());

            if let Some(home) = home {
                order.push(target(home));
                let others: Vec<&ServerView> = live
                    .iter()
                    .filter(|v| v.server_id != home.server_id && has_cap(v))
                    .copied()
                    .collect();
                // Why calls would spill, and where to.
                let busier_than = |v: &ServerView| {
                    cfg.load_aware
                        && load(home) >= cfg.load_floor
                        && load(home) - load(v) > cfg.load_margin
                };
                let lighter: Vec<&ServerView> =
                    others.iter().filter(|v| busier_than(v)).copied().collect();
                let (reason, pool): (Option<&'static str>, Vec<&ServerView>) = if saturated(home) {
                    let cool: Vec<&ServerView> =
                        others.iter().filter(|v| !hot(v)).copied().collect();
                    let pool = if cool.is_empty() {
                        others.clone()
                    } else {
                        cool
                    };
                    (Some("saturated"), pool)
                } else if !lighter.is_empty() {
                    (Some("load"), lighter)
                } else {
                    (None, others.clone())
                };
                // Spill targets: the pool in its lowest tier, most idle streams first.
                let target_tier = pool.iter().map(|v| tier(v)).min();
                let mut targets: Vec<&ServerView> = pool
                    .iter()
                    .filter(|v| Some(tier(v)) == target_tier)
                    .copied()
                    .collect();
                targets.sort_by(|a, b| {
                    b.idle
                        .cmp(&a.idle)
                        .then_with(|| a.server_id.cmp(&b.server_id))
                });
                if due {
                    st.spill = if targets.is_empty() {
                        0.0
                    } else if reason.is_some() {
                        st.spill_reason = reason;
                        (st.spill + cfg.spill_step).min(cfg.spill_max)
                    } else {
                        (st.spill - cfg.spill_decay).max(0.0)
                    };
                }
                for v in &targets {
                    spill_targets.push((order.len(), v.idle));
                    order.push(target(v));
                }
                // Retry order for the rest: other servers with capacity by tier, then the
                // saturated ones by tier and queue length.
                let mut rest: Vec<&ServerView> = live
                    .iter()
                    .filter(|v| {
                        v.server_id != home.server_id
                            && !targets.iter().any(|t| t.server_id == v.server_id)
                    })
                    .copied()
                    .collect();
                rest.sort_by(|a, b| {
                    (!has_cap(a), tier(a), a.queued, std::cmp::Reverse(a.idle))
                        .cmp(&(!has_cap(b), tier(b), b.queued, std::cmp::Reverse(b.idle)))
                        .then_with(|| a.server_id.cmp(&b.server_id))
                });
                order.extend(rest.iter().map(|v| target(v)));
            } else {
                st.spill = 0.0;
            }
        }
    }
    if due {
        st.last_step = Some(now);
        st.no_capacity.clear();
    }
    order.extend(draining.iter().map(|v| target(v)));
    st.plan = Arc::new(TunnelPlan {
        order,
        spill_targets,
        spill_permille: (st.spill * 1000.0).round() as u64,
        counts: st.counts.clone(),
    });
}

/// Sort key for RTT: unknown (0) sorts after every measured value.
fn rtt_key(v: &ServerView) -> u32 {
    if v.rtt_us == 0 {
        u32::MAX
    } else {
        v.rtt_us
    }
}

#[cfg(test)]
mod tests;
