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
//!   so calls don't flap). While the home is saturated (no idle stream and calls queued, or
//!   a call just answered NO_CAPACITY) and another healthy server holds idle streams, a
//!   *spill share* of new calls goes to those servers, weighted by their idle streams. The
//!   share rises by `spill_step` per step while that holds, falls by `spill_decay` per step
//!   once the home has idle streams again, is capped at `spill_max`, and is zero when no
//!   other server has idle streams (relaying adds no capacity). Steps happen at most every
//!   `step_interval` (when reports arrive or on the routing tick), never per call, so the
//!   share does not flap with the call rate.
//!   A home dwarfed by another server (whose idle streams alone exceed twice the home's
//!   whole pool, in the same or a better tier, or in any tier while the home is saturated)
//!   yields the home to it at the next step: this
//!   corrects a home picked while the first reports were still arriving, and cannot swing
//!   back because of the factor.
//! - Latency tiers inside `available`: servers are grouped by the smoothed RTT reported for
//!   the tunnel id; tier 0 holds every server within max(best + 2 ms, 2 x best), tier 1 the
//!   next band of the same width rule, and so on. The home is taken from the lowest tier
//!   with capacity; a home in a higher tier moves down when a lower tier gets capacity.
//!   Hysteresis: a member stays in its tier until its RTT passes the bound by
//!   `tier_hysteresis` (a fraction), and comes back only once it is that far inside.
//!   Servers with no RTT yet count as tier 0 (no evidence against them).
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

/// A tier bound never grows past this many tiers (bounds at least double each tier).
const MAX_TIER: usize = 16;
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
    /// Smoothed RTT to the agent's streams, microseconds; 0 = unknown.
    pub rtt_us: u32,
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
    /// Calls picked so far; shared across rebuilds so the spill sequence does not restart.
    calls: Arc<AtomicU64>,
}

impl TunnelPlan {
    /// The servers for the next call.
    pub fn pick(&self) -> Pick {
        let n = self.calls.fetch_add(1, Ordering::Relaxed);
        self.pick_nth(n)
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
    /// Tier of each live server (0 = best).
    pub tiers: Vec<(Arc<str>, usize)>,
}

#[derive(Debug)]
struct TunnelState {
    home: Option<Arc<str>>,
    spill: f64,
    last_step: Option<Instant>,
    tiers: HashMap<Arc<str>, usize>,
    /// Servers that answered NO_CAPACITY for this tunnel id since the last step.
    no_capacity: HashSet<Arc<str>>,
    calls: Arc<AtomicU64>,
    plan: Arc<TunnelPlan>,
}

impl TunnelState {
    fn new() -> Self {
        let calls = Arc::new(AtomicU64::new(0));
        TunnelState {
            home: None,
            spill: 0.0,
            last_step: None,
            tiers: HashMap::new(),
            no_capacity: HashSet::new(),
            plan: Arc::new(TunnelPlan {
                order: Vec::new(),
                spill_targets: Vec::new(),
                spill_permille: 0,
                calls: calls.clone(),
            }),
            calls,
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

    /// Rebuilds every tunnel id's plan from `table` (tunnel id -> servers holding it) and
    /// steps the spill shares that are due at `now`. Tunnel ids absent from `table` are
    /// forgotten.
    pub fn update(&mut self, now: Instant, table: &HashMap<String, Vec<ServerView>>) {
        self.tunnels.retain(|id, _| table.contains_key(id));
        for (tunnel_id, views) in table {
            let st = self
                .tunnels
                .entry(tunnel_id.clone())
                .or_insert_with(TunnelState::new);
            update_tunnel(&self.cfg, st, now, views);
        }
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
            tiers,
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

/// Upper RTT bound (microseconds) of tier `k` given the best RTT.
fn tier_bound(best: f64, k: usize) -> f64 {
    let mut b = best;
    for _ in 0..=k {
        b = (b + TIER_SLACK_US).max(2.0 * b);
    }
    b
}

/// Tier of each live server, with hysteresis against `prev`.
fn assign_tiers(
    hysteresis: f64,
    live: &[&ServerView],
    prev: &HashMap<Arc<str>, usize>,
) -> HashMap<Arc<str>, usize> {
    let best = live
        .iter()
        .filter(|v| v.rtt_us > 0)
        .map(|v| f64::from(v.rtt_us))
        .fold(f64::INFINITY, f64::min);
    live.iter()
        .map(|v| {
            if v.rtt_us == 0 || !best.is_finite() {
                return (v.server_id.clone(), 0);
            }
            let rtt = f64::from(v.rtt_us);
            let raw = (0..MAX_TIER)
                .find(|k| rtt <= tier_bound(best, *k))
                .unwrap_or(MAX_TIER);
            let tier = match prev.get(&v.server_id) {
                Some(&p) if p != raw && p < MAX_TIER => {
                    let upper = tier_bound(best, p) * (1.0 + hysteresis);
                    let lower = if p == 0 {
                        0.0
                    } else {
                        tier_bound(best, p - 1) * (1.0 - hysteresis)
                    };
                    if rtt <= upper && rtt > lower {
                        p
                    } else {
                        raw
                    }
                }
                _ => raw,
            };
            (v.server_id.clone(), tier)
        })
        .collect()
}

fn update_tunnel(cfg: &RoutingConfig, st: &mut TunnelState, now: Instant, views: &[ServerView]) {
    let live: Vec<&ServerView> = views.iter().filter(|v| !v.draining).collect();
    let mut draining: Vec<&ServerView> = views.iter().filter(|v| v.draining).collect();
    draining.sort_by(|a, b| {
        b.announced
            .cmp(&a.announced)
            .then_with(|| a.server_id.cmp(&b.server_id))
    });
    let due = st
        .last_step
        .is_none_or(|t| now.saturating_duration_since(t) >= cfg.step_interval);

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
            order.extend(live.iter().map(|v| target(v)));
        }
        RoutingPolicy::Available => {
            st.tiers = if cfg.latency_tiers {
                assign_tiers(cfg.tier_hysteresis, &live, &st.tiers)
            } else {
                live.iter().map(|v| (v.server_id.clone(), 0)).collect()
            };
            let tiers = &st.tiers;
            let tier = |v: &ServerView| tiers.get(&v.server_id).copied().unwrap_or(0);
            let no_cap = &st.no_capacity;
            let has_cap = |v: &ServerView| v.idle > 0 && !no_cap.contains(&v.server_id);
            let cap_tier = live.iter().filter(|v| has_cap(v)).map(|v| tier(v)).min();

            let prev = st
                .home
                .as_ref()
                .and_then(|h| live.iter().find(|v| v.server_id == *h).copied());
            let keep = prev.filter(|p| cap_tier.is_none_or(|t| tier(p) <= t));
            let home = keep.or_else(|| match cap_tier {
                // The best server of the lowest tier with capacity: most idle streams, then
                // lowest RTT, then id for a stable choice.
                Some(t) => live
                    .iter()
                    .filter(|v| has_cap(v) && tier(v) == t)
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
            // Overload yield: at a step, a home that another server (in the same or a
            // better tier, with capacity) dwarfs gives way to it: that server's idle
            // streams alone exceed twice the home's whole pool. The factor keeps two
            // servers from trading the home back and forth, and the spill share covers
            // everything short of that.
            let home = match home {
                Some(h) if due => live
                    .iter()
                    .filter(|v| {
                        let h_saturated =
                            h.idle == 0 && (h.queued > 0 || no_cap.contains(&h.server_id));
                        // A saturated home yields across tiers: queueing costs more than
                        // the latency difference.
                        v.server_id != h.server_id
                            && has_cap(v)
                            && (tier(v) <= tier(h) || h_saturated)
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
            if home.map(|h| &h.server_id) != st.home.as_ref() {
                st.spill = 0.0;
            }
            st.home = home.map(|h| h.server_id.clone());

            if let Some(home) = home {
                order.push(target(home));
                // Spill targets: the other servers with capacity, in their lowest tier.
                let others: Vec<&ServerView> = live
                    .iter()
                    .filter(|v| v.server_id != home.server_id && has_cap(v))
                    .copied()
                    .collect();
                let target_tier = others.iter().map(|v| tier(v)).min();
                let mut targets: Vec<&ServerView> = others
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
                    let saturated = home.idle == 0
                        && (home.queued > 0 || st.no_capacity.contains(&home.server_id));
                    st.spill = if targets.is_empty() {
                        0.0
                    } else if saturated {
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
        calls: st.calls.clone(),
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
