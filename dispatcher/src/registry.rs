//! The routing table: tunnel id -> tunnel servers holding streams of it, with each server's
//! last load figures, and the [`Router`] that turns it into a per tunnel id plan.
//!
//! Two sources feed it:
//! - *local* entries, one per report stream open on this dispatcher (see `report`); each
//!   stream is a session, and a server that reconnects opens a new session that replaces its
//!   old one, so a slow-to-die old stream cannot erase the new entries;
//! - *shared* entries, read back from Redis by the `shared` module when several dispatchers
//!   serve one fleet ([`Registry::apply_shared`]); a local entry always wins over a shared
//!   one for the same server id.
//!
//! Leases: a local entry that has not reported for `lease` is dropped by [`Registry::sweep`]
//! (a hung server whose stream stays open); shared entries carry their lease in Redis and
//! vanish from the next read when it runs out.
//!
//! Reads on the call path ([`Registry::route`]) take one short `Mutex` section to clone the
//! tunnel id's plan and never wait on the network. This module must not do I/O; it reads
//! the clock only through `tokio::time::Instant`.

use crate::config::RoutingConfig;
use crate::metrics::Metrics;
use crate::routing::{Pick, Router, ServerView};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};
use tokio::sync::Notify;
use tokio::time::Instant;

/// Identity of one report stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SessionId(u64);

/// What a tunnel server says about itself in its `ServerIntro`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServerInfo {
    pub server_id: String,
    pub zone: String,
    /// Where its `Forward` service listens (`http://host:port`).
    pub forward_url: String,
    /// This life of the server id (random per process start); empty from servers that
    /// do not send one.
    #[serde(default)]
    pub instance_id: String,
    /// Its direct agent-facing URL, empty when it offers none.
    #[serde(default)]
    pub direct_url: String,
}

/// A live server id is claimed by another instance while its report stream is up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Conflict {
    pub live_instance: String,
}

/// One tunnel id's figures in a server's last load report.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TunnelFigures {
    pub idle: u32,
    pub busy: u32,
    pub queued: u32,
    pub rtt_us: u32,
}

/// A server's last load report.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoadFigures {
    pub tunnels: BTreeMap<String, TunnelFigures>,
    pub calls_in_flight: u32,
    pub draining: bool,
}

/// A server's entry as shared between dispatchers (the JSON sealed into Redis by
/// `shared::record`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServerRecord {
    pub info: ServerInfo,
    /// Tunnel ids the server holds streams of.
    pub tunnels: Vec<String>,
    pub load: Option<LoadFigures>,
    /// The dispatcher the server reports to.
    pub dispatcher: String,
}

/// Sizes of the table, for gauges and readiness.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RouteCounts {
    pub servers: usize,
    pub tunnels: usize,
}

/// Which shared entries missing from a read of the shared store are dropped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Prune {
    /// Every one: the shared store is the truth.
    Missing,
    /// Only those whose dispatcher wrote that they left (just after an outage, when the
    /// records of live servers may have expired and their dispatchers have not rewritten
    /// them yet).
    Left(HashSet<String>),
}

/// A change of a local entry that the shared store must write (`Some`) or delete (`None`).
pub type Publish = (String, Option<ServerRecord>);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Origin {
    Local(SessionId),
    Shared,
}

struct Announced {
    at: Instant,
    wall: SystemTime,
}

struct Entry {
    info: ServerInfo,
    origin: Origin,
    joined: Instant,
    /// Last frame from the server (local) or last read that listed it (shared).
    seen: Instant,
    tunnels: HashMap<String, Announced>,
    load: Option<(Instant, LoadFigures)>,
}

impl Entry {
    fn draining(&self) -> bool {
        self.load.as_ref().is_some_and(|(_, l)| l.draining)
    }

    fn record(&self, dispatcher: &str) -> ServerRecord {
        let mut tunnels: Vec<String> = self.tunnels.keys().cloned().collect();
        tunnels.sort();
        ServerRecord {
            info: self.info.clone(),
            tunnels,
            load: self.load.as_ref().map(|(_, l)| l.clone()),
            dispatcher: dispatcher.to_string(),
        }
    }
}

struct Table {
    next_session: u64,
    /// By server id.
    entries: HashMap<String, Entry>,
    router: Router,
    /// Local changes not yet written to the shared store, by server id.
    dirty: HashMap<String, Option<ServerRecord>>,
    /// Label sets currently exported, to remove them when they go.
    gauged_tunnels: HashSet<String>,
    gauged_pairs: HashSet<(String, String)>,
}

/// The dispatcher's routing table. See the module docs.
pub struct Registry {
    table: Mutex<Table>,
    lease: Duration,
    /// Name of this dispatcher in shared records.
    dispatcher: String,
    /// Whether local changes are queued for the shared store.
    shared: bool,
    /// Wakes the shared store's writer when `dirty` gains an entry.
    pub dirty_notify: Notify,
    metrics: Metrics,
    /// The fleet's members (local and shared entries), for `Registry.Watch`.
    fleet: tokio::sync::watch::Sender<Vec<relay_proto::FleetMember>>,
}

/// What the router sees of server entry `e` for `tid`.
fn view(
    e: &Entry,
    server_id: &Arc<str>,
    forward_url: &Arc<str>,
    tid: &str,
    announced: &Announced,
) -> ServerView {
    let f = e
        .load
        .as_ref()
        .and_then(|(_, l)| l.tunnels.get(tid))
        .cloned()
        .unwrap_or_default();
    ServerView {
        server_id: server_id.clone(),
        forward_url: forward_url.clone(),
        announced: announced.at,
        draining: e.draining(),
        idle: f.idle,
        busy: f.busy,
        queued: f.queued,
        rtt_us: f.rtt_us,
    }
}

fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn ms(d: Duration) -> u64 {
    d.as_millis().min(u128::from(u64::MAX)) as u64
}

impl Registry {
    /// `shared`: queue local changes for a shared store (Redis backend).
    pub fn new(
        routing: RoutingConfig,
        lease: Duration,
        dispatcher: String,
        shared: bool,
        metrics: Metrics,
    ) -> Self {
        Registry {
            table: Mutex::new(Table {
                next_session: 0,
                entries: HashMap::new(),
                router: Router::new(routing),
                dirty: HashMap::new(),
                gauged_tunnels: HashSet::new(),
                gauged_pairs: HashSet::new(),
            }),
            lease,
            dispatcher,
            shared,
            dirty_notify: Notify::new(),
            metrics,
            fleet: tokio::sync::watch::Sender::new(Vec::new()),
        }
    }

    /// Follows the fleet's members: every server with an entry, local or shared.
    pub fn watch_fleet(&self) -> tokio::sync::watch::Receiver<Vec<relay_proto::FleetMember>> {
        self.fleet.subscribe()
    }

    fn with<R>(&self, f: impl FnOnce(&mut Table) -> R) -> R {
        // A panic while holding the lock cannot leave the table half-updated in a way that
        // matters more than losing routing, so recover the guard instead of propagating.
        let mut guard = self.table.lock().unwrap_or_else(|e| e.into_inner());
        f(&mut guard)
    }

    /// Applies a change to a local entry, queues it for the shared store and rebuilds the
    /// routing plans.
    fn change<R>(&self, session: SessionId, f: impl FnOnce(&mut Entry) -> R) -> Option<R> {
        self.change_scoped(session, None, f)
    }

    /// As [`Registry::change`]; with `Some(tunnel_id)` the change touches only that tunnel
    /// id, and only its plan is rebuilt. A fleet of agents connecting announces thousands
    /// of tunnel ids within seconds: rebuilding every plan for each of them held the
    /// table's lock long enough to back up the report streams behind it until leases
    /// expired (1,000 agents on 3 servers).
    fn change_scoped<R>(
        &self,
        session: SessionId,
        tunnel_id: Option<&str>,
        f: impl FnOnce(&mut Entry) -> R,
    ) -> Option<R> {
        let now = Instant::now();
        let (r, publish) = self.with(|t| {
            let entry = t
                .entries
                .values_mut()
                .find(|e| e.origin == Origin::Local(session))?;
            entry.seen = now;
            let r = f(entry);
            let id = entry.info.server_id.clone();
            let record = entry.record(&self.dispatcher);
            let publish = self.shared;
            if publish {
                t.dirty.insert(id, Some(record));
            }
            match tunnel_id {
                Some(tid) => self.rebuild_one(t, now, tid),
                None => self.rebuild(t, now),
            }
            Some((r, publish))
        })?;
        if publish {
            self.dirty_notify.notify_one();
        }
        Some(r)
    }

    /// A server opened a report stream. Replaces any earlier entry of the same server id,
    /// except a local one of another instance whose report stream is still up: two live
    /// servers claiming one id is a configuration error, refused rather than merged.
    pub fn join(&self, server: ServerInfo) -> Result<SessionId, Conflict> {
        let now = Instant::now();
        let session = self.with(|t| {
            if let Some(e) = t.entries.get(&server.server_id) {
                let other = !e.info.instance_id.is_empty()
                    && !server.instance_id.is_empty()
                    && e.info.instance_id != server.instance_id;
                if other && matches!(e.origin, Origin::Local(_)) {
                    return Err(Conflict {
                        live_instance: e.info.instance_id.clone(),
                    });
                }
            }
            t.next_session += 1;
            let session = SessionId(t.next_session);
            let id = server.server_id.clone();
            let entry = Entry {
                info: server,
                origin: Origin::Local(session),
                joined: now,
                seen: now,
                tunnels: HashMap::new(),
                load: None,
            };
            if self.shared {
                t.dirty
                    .insert(id.clone(), Some(entry.record(&self.dispatcher)));
            }
            t.entries.insert(id, entry);
            self.rebuild(t, now);
            Ok(session)
        })?;
        if self.shared {
            self.dirty_notify.notify_one();
        }
        Ok(session)
    }

    /// The server now holds streams of `tunnel_id`. False if the session is no longer current.
    pub fn tunnel_up(&self, session: SessionId, tunnel_id: &str) -> bool {
        self.change_scoped(session, Some(tunnel_id), |e| {
            e.tunnels
                .entry(tunnel_id.to_string())
                .or_insert_with(|| Announced {
                    at: Instant::now(),
                    wall: SystemTime::now(),
                });
        })
        .is_some()
    }

    /// The server holds no stream of `tunnel_id` any more. False if the session is stale.
    pub fn tunnel_down(&self, session: SessionId, tunnel_id: &str) -> bool {
        self.change_scoped(session, Some(tunnel_id), |e| {
            e.tunnels.remove(tunnel_id);
        })
        .is_some()
    }

    /// Stores the server's latest load figures. False if the session is stale.
    pub fn load(&self, session: SessionId, load: LoadFigures) -> bool {
        self.change(session, |e| {
            e.load = Some((Instant::now(), load));
        })
        .is_some()
    }

    /// The report stream ended: forget the server and all its tunnel ids. Returns the
    /// server's info if the session was current.
    pub fn leave(&self, session: SessionId) -> Option<ServerInfo> {
        let now = Instant::now();
        let info = self.with(|t| {
            let id = t
                .entries
                .iter()
                .find(|(_, e)| e.origin == Origin::Local(session))
                .map(|(id, _)| id.clone())?;
            let entry = t.entries.remove(&id)?;
            if self.shared {
                t.dirty.insert(id, None);
            }
            self.rebuild(t, now);
            Some(entry.info)
        })?;
        if self.shared {
            self.dirty_notify.notify_one();
        }
        Some(info)
    }

    /// Drops local entries that have not reported within the lease and steps the routing.
    /// Returns the servers whose lease expired.
    pub fn sweep(&self, now: Instant) -> Vec<ServerInfo> {
        let lease = self.lease;
        let expired = self.with(|t| {
            let expired: Vec<String> = t
                .entries
                .iter()
                .filter(|(_, e)| {
                    matches!(e.origin, Origin::Local(_))
                        && now.saturating_duration_since(e.seen) > lease
                })
                .map(|(id, _)| id.clone())
                .collect();
            let mut gone = Vec::with_capacity(expired.len());
            for id in expired {
                if let Some(e) = t.entries.remove(&id) {
                    gone.push(e.info);
                }
                if self.shared {
                    t.dirty.insert(id, None);
                }
            }
            self.rebuild(t, now);
            gone
        });
        if self.shared && !expired.is_empty() {
            self.dirty_notify.notify_one();
        }
        expired
    }

    /// Ids of the shared entries (servers known from the shared store).
    pub fn shared_ids(&self) -> Vec<String> {
        self.with(|t| {
            t.entries
                .iter()
                .filter(|(_, e)| e.origin == Origin::Shared)
                .map(|(id, _)| id.clone())
                .collect()
        })
    }

    /// Replaces the shared entries with `records` read from the shared store. Servers that
    /// report here are skipped (the local entry is the fresher one). Shared entries missing
    /// from `records` are dropped as `prune` says.
    pub fn apply_shared(&self, records: Vec<ServerRecord>, prune: Prune) {
        let now = Instant::now();
        self.with(|t| {
            let listed: HashSet<String> =
                records.iter().map(|r| r.info.server_id.clone()).collect();
            t.entries.retain(|id, e| {
                e.origin != Origin::Shared
                    || listed.contains(id)
                    || match &prune {
                        Prune::Missing => false,
                        Prune::Left(left) => !left.contains(id),
                    }
            });
            for r in records {
                let id = r.info.server_id.clone();
                if matches!(t.entries.get(&id), Some(e) if e.origin != Origin::Shared) {
                    continue;
                }
                let entry = t.entries.entry(id).or_insert_with(|| Entry {
                    info: r.info.clone(),
                    origin: Origin::Shared,
                    joined: now,
                    seen: now,
                    tunnels: HashMap::new(),
                    load: None,
                });
                entry.info = r.info;
                entry.seen = now;
                let held: HashSet<&String> = r.tunnels.iter().collect();
                entry.tunnels.retain(|id, _| held.contains(id));
                for tid in &r.tunnels {
                    entry
                        .tunnels
                        .entry(tid.clone())
                        .or_insert_with(|| Announced {
                            at: now,
                            wall: SystemTime::now(),
                        });
                }
                if entry.load.as_ref().map(|(_, l)| l) != r.load.as_ref() {
                    entry.load = r.load.map(|l| (now, l));
                }
            }
            self.rebuild(t, now);
        });
    }

    /// Local changes not yet written to the shared store.
    pub fn take_dirty(&self) -> Vec<Publish> {
        self.with(|t| t.dirty.drain().collect())
    }

    /// Puts back changes a failed write could not store (newer ones win).
    pub fn restore_dirty(&self, items: Vec<Publish>) {
        self.with(|t| {
            for (id, record) in items {
                t.dirty.entry(id).or_insert(record);
            }
        });
    }

    /// Current records of every local entry (rewritten after the shared store comes back).
    pub fn local_records(&self) -> Vec<Publish> {
        self.with(|t| {
            t.entries
                .values()
                .filter(|e| matches!(e.origin, Origin::Local(_)))
                .map(|e| (e.info.server_id.clone(), Some(e.record(&self.dispatcher))))
                .collect()
        })
    }

    /// The servers to try for a call of `tunnel_id`, first choice first; `None` when no
    /// server holds it.
    pub fn route(&self, tunnel_id: &str) -> Option<Pick> {
        let plan = self.with(|t| t.router.plan(tunnel_id))?;
        Some(plan.pick())
    }

    /// Per-call feedback: `server_id` answered NO_CAPACITY for `tunnel_id`.
    pub fn note_no_capacity(&self, tunnel_id: &str, server_id: &str) {
        self.with(|t| t.router.note_no_capacity(tunnel_id, server_id));
    }

    /// Steps the routing (spill decay and growth) without a table change.
    pub fn tick(&self, now: Instant) {
        self.with(|t| self.rebuild(t, now));
    }

    /// Whether any current server uses `forward_url` (to drop cached channels).
    pub fn uses_forward_url(&self, forward_url: &str) -> bool {
        self.with(|t| {
            t.entries
                .values()
                .any(|e| e.info.forward_url == forward_url)
        })
    }

    pub fn counts(&self) -> RouteCounts {
        self.with(|t| RouteCounts {
            servers: t.entries.len(),
            tunnels: t
                .entries
                .values()
                .flat_map(|e| e.tunnels.keys())
                .collect::<HashSet<_>>()
                .len(),
        })
    }

    /// Rebuilds the routing plans from the entries and refreshes the routing gauges.
    fn rebuild(&self, t: &mut Table, now: Instant) {
        let mut views: HashMap<String, Vec<ServerView>> = HashMap::new();
        for e in t.entries.values() {
            let server_id: Arc<str> = Arc::from(e.info.server_id.as_str());
            let forward_url: Arc<str> = Arc::from(e.info.forward_url.as_str());
            for (tid, announced) in &e.tunnels {
                views.entry(tid.clone()).or_default().push(view(
                    e,
                    &server_id,
                    &forward_url,
                    tid,
                    announced,
                ));
            }
        }
        t.router.update(now, &views);
        self.export_gauges(t, &views);
        let mut members: Vec<relay_proto::FleetMember> = t
            .entries
            .values()
            .map(|e| relay_proto::FleetMember {
                server_id: e.info.server_id.clone(),
                instance_id: e.info.instance_id.clone(),
                zone: e.info.zone.clone(),
                draining: e.draining(),
                direct_url: e.info.direct_url.clone(),
            })
            .collect();
        members.sort_by(|a, b| a.server_id.cmp(&b.server_id));
        self.fleet.send_if_modified(|old| {
            let changed = *old != members;
            if changed {
                *old = members;
            }
            changed
        });
    }

    /// Rebuilds the plan and gauges of one tunnel id (the fleet's members are unchanged).
    fn rebuild_one(&self, t: &mut Table, now: Instant, tunnel_id: &str) {
        let views: Vec<ServerView> = t
            .entries
            .values()
            .filter_map(|e| {
                let announced = e.tunnels.get(tunnel_id)?;
                Some(view(
                    e,
                    &Arc::from(e.info.server_id.as_str()),
                    &Arc::from(e.info.forward_url.as_str()),
                    tunnel_id,
                    announced,
                ))
            })
            .collect();
        t.router.update_one(now, tunnel_id, &views);
        let m = &self.metrics;
        let mut pairs = HashSet::new();
        if views.is_empty() {
            if t.gauged_tunnels.remove(tunnel_id) {
                let _ = m.spill_share.remove_label_values(&[tunnel_id]);
            }
        } else if let Some(status) = t.router.status(tunnel_id) {
            self.export_tunnel(tunnel_id, &status, &views, &mut pairs);
            t.gauged_tunnels.insert(tunnel_id.to_string());
        }
        let gone: Vec<(String, String)> = t
            .gauged_pairs
            .iter()
            .filter(|(_, tid)| tid == tunnel_id)
            .filter(|p| !pairs.contains(*p))
            .cloned()
            .collect();
        for p in gone {
            let _ = m.server_rtt.remove_label_values(&[&p.0, &p.1]);
            let _ = m.server_tier.remove_label_values(&[&p.0, &p.1]);
            t.gauged_pairs.remove(&p);
        }
        t.gauged_pairs.extend(pairs);
    }

    /// Sets one tunnel id's gauges; adds the (server, tunnel) pairs it exported to `pairs`.
    fn export_tunnel(
        &self,
        tid: &str,
        status: &crate::routing::TunnelStatus,
        servers: &[ServerView],
        pairs: &mut HashSet<(String, String)>,
    ) {
        let m = &self.metrics;
        m.spill_share
            .with_label_values(&[tid])
            .set(status.spill_share);
        for v in servers {
            let pair = (v.server_id.to_string(), tid.to_string());
            m.server_rtt
                .with_label_values(&[&pair.0, &pair.1])
                .set(f64::from(v.rtt_us) / 1e6);
            let tier = status
                .tiers
                .iter()
                .find(|(s, _)| *s == v.server_id)
                .map(|(_, k)| *k as i64)
                .unwrap_or(-1);
            m.server_tier
                .with_label_values(&[&pair.0, &pair.1])
                .set(tier);
            pairs.insert(pair);
        }
    }

    fn export_gauges(&self, t: &mut Table, views: &HashMap<String, Vec<ServerView>>) {
        let m = &self.metrics;
        let mut tunnels = HashSet::new();
        let mut pairs = HashSet::new();
        for (tid, servers) in views {
            let Some(status) = t.router.status(tid) else {
                continue;
            };
            self.export_tunnel(tid, &status, servers, &mut pairs);
            tunnels.insert(tid.clone());
        }
        for gone in t.gauged_tunnels.difference(&tunnels) {
            let _ = m.spill_share.remove_label_values(&[gone.as_str()]);
        }
        for (s, tid) in t.gauged_pairs.difference(&pairs) {
            let _ = m.server_rtt.remove_label_values(&[s, tid]);
            let _ = m.server_tier.remove_label_values(&[s, tid]);
        }
        t.gauged_tunnels = tunnels;
        t.gauged_pairs = pairs;
    }

    /// The whole table for `/debug/routes`: per tunnel id the servers with their figures,
    /// tier, the home and the spill share; per server its origin, lease and load.
    pub fn snapshot(&self) -> serde_json::Value {
        let now = Instant::now();
        let lease = self.lease;
        self.with(|t| {
            let mut by_tunnel: BTreeMap<&str, Vec<&Entry>> = BTreeMap::new();
            for e in t.entries.values() {
                for tid in e.tunnels.keys() {
                    by_tunnel.entry(tid.as_str()).or_default().push(e);
                }
            }
            let tunnels: Vec<serde_json::Value> = by_tunnel
                .into_iter()
                .map(|(tid, mut entries)| {
                    let status = t.router.status(tid);
                    let order: Vec<String> = t
                        .router
                        .plan(tid)
                        .map(|p| p.order().iter().map(|x| x.server_id.to_string()).collect())
                        .unwrap_or_default();
                    entries.sort_by_key(|e| {
                        order
                            .iter()
                            .position(|s| *s == e.info.server_id)
                            .unwrap_or(usize::MAX)
                    });
                    let servers: Vec<serde_json::Value> = entries
                        .into_iter()
                        .map(|e| {
                            let a = &e.tunnels[tid];
                            let figures = e.load.as_ref().and_then(|(_, l)| l.tunnels.get(tid));
                            let tier = status.as_ref().and_then(|s| {
                                s.tiers
                                    .iter()
                                    .find(|(id, _)| **id == *e.info.server_id)
                                    .map(|(_, k)| *k)
                            });
                            serde_json::json!({
                                "server_id": e.info.server_id,
                                "zone": e.info.zone,
                                "forward_url": e.info.forward_url,
                                "announced_unix_ms": unix_ms(a.wall),
                                "announced_age_ms": ms(now.saturating_duration_since(a.at)),
                                "draining": e.draining(),
                                "load": figures,
                                "tier": tier,
                            })
                        })
                        .collect();
                    serde_json::json!({
                        "tunnel_id": tid,
                        "policy": t.router.policy(),
                        "home": status.as_ref().and_then(|s| s.home.as_deref().map(str::to_string)),
                        "spill_share": status.as_ref().map(|s| s.spill_share).unwrap_or(0.0),
                        "order": order,
                        "servers": servers,
                    })
                })
                .collect();
            let mut entries: Vec<&Entry> = t.entries.values().collect();
            entries.sort_by(|a, b| a.info.server_id.cmp(&b.info.server_id));
            let servers: Vec<serde_json::Value> = entries
                .into_iter()
                .map(|e| {
                    let age = now.saturating_duration_since(e.seen);
                    serde_json::json!({
                        "server_id": e.info.server_id,
                        "zone": e.info.zone,
                        "forward_url": e.info.forward_url,
                        "origin": match e.origin { Origin::Local(_) => "local", Origin::Shared => "shared" },
                        "connected_age_ms": ms(now.saturating_duration_since(e.joined)),
                        "seen_age_ms": ms(age),
                        "lease_left_ms": match e.origin {
                            Origin::Local(_) => Some(ms(lease.saturating_sub(age))),
                            Origin::Shared => None,
                        },
                        "tunnels": e.tunnels.len(),
                        "draining": e.draining(),
                        "calls_in_flight": e.load.as_ref().map(|(_, l)| l.calls_in_flight),
                        "load_age_ms": e.load.as_ref().map(|(at, _)| ms(now.saturating_duration_since(*at))),
                    })
                })
                .collect();
            serde_json::json!({"tunnels": tunnels, "servers": servers})
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::RoutingPolicy;

    fn registry(shared: bool) -> Registry {
        let metrics = Metrics::register(&prometheus::Registry::new()).unwrap();
        Registry::new(
            RoutingConfig {
                policy: RoutingPolicy::Sticky,
                ..RoutingConfig::default()
            },
            Duration::from_secs(3),
            "d1".into(),
            shared,
            metrics,
        )
    }

    fn info(id: &str) -> ServerInfo {
        ServerInfo {
            server_id: id.into(),
            zone: "z".into(),
            forward_url: format!("http://{id}"),
            instance_id: "i1".into(),
            direct_url: String::new(),
        }
    }

    fn instance(id: &str, instance: &str) -> ServerInfo {
        ServerInfo {
            instance_id: instance.into(),
            ..info(id)
        }
    }

    fn ids(r: &Registry, tunnel_id: &str) -> Vec<String> {
        r.route(tunnel_id)
            .map(|p| {
                p.servers
                    .into_iter()
                    .map(|t| t.server_id.to_string())
                    .collect()
            })
            .unwrap_or_default()
    }

    fn load(tunnels: &[(&str, u32)], draining: bool) -> LoadFigures {
        LoadFigures {
            tunnels: tunnels
                .iter()
                .map(|(t, idle)| {
                    (
                        t.to_string(),
                        TunnelFigures {
                            idle: *idle,
                            ..Default::default()
                        },
                    )
                })
                .collect(),
            calls_in_flight: 0,
            draining,
        }
    }

    /// Label sets of a gauge family, as `(server_id, tunnel_id)` or `tunnel_id`.
    fn labels(family: &[prometheus::proto::MetricFamily], name: &str) -> Vec<Vec<String>> {
        let mut out: Vec<Vec<String>> = family
            .iter()
            .filter(|f| f.name() == name)
            .flat_map(|f| f.get_metric())
            .map(|m| {
                m.get_label()
                    .iter()
                    .map(|l| l.value().to_string())
                    .collect()
            })
            .collect();
        out.sort();
        out
    }

    #[tokio::test(start_paused = true)]
    async fn announcing_one_tunnel_id_routes_it_and_gauges_follow_it_alone() {
        let prom = prometheus::Registry::new();
        let metrics = Metrics::register(&prom).unwrap();
        let r = Registry::new(
            RoutingConfig::default(),
            Duration::from_secs(3),
            "d1".into(),
            false,
            metrics,
        );
        let a = r.join(info("a")).unwrap();
        let b = r.join(info("b")).unwrap();
        r.tunnel_up(a, "t");
        r.tunnel_up(b, "t");
        r.tunnel_up(a, "u");
        let mut both = ids(&r, "t");
        both.sort();
        assert_eq!(both, ["a", "b"]);
        assert_eq!(ids(&r, "u"), ["a"]);
        let tiers = || labels(&prom.gather(), "relay_dispatcher_server_tier");
        let spill = || labels(&prom.gather(), "relay_dispatcher_spill_share");
        assert_eq!(tiers().len(), 3, "{:?}", tiers());
        // b drops t: only the pair (b, t) goes; u is untouched.
        r.tunnel_down(b, "t");
        assert_eq!(ids(&r, "t"), ["a"]);
        assert!(
            !tiers().iter().any(|l| l.contains(&"b".to_string())),
            "{:?}",
            tiers()
        );
        assert_eq!(tiers().len(), 2, "{:?}", tiers());
        // a drops t: t is gone from routing and from every gauge.
        r.tunnel_down(a, "t");
        assert!(r.route("t").is_none());
        assert_eq!(spill(), vec![vec!["u".to_string()]]);
        assert_eq!(tiers().len(), 1, "{:?}", tiers());
        // A full rebuild (a load report) agrees with the per-tunnel one.
        r.load(a, load(&[("u", 1)], false));
        assert_eq!(ids(&r, "u"), ["a"]);
        assert_eq!(spill(), vec![vec!["u".to_string()]]);
        assert_eq!(tiers().len(), 1, "{:?}", tiers());
    }

    #[tokio::test(start_paused = true)]
    async fn most_recently_announced_server_comes_first_under_sticky() {
        let r = registry(false);
        let a = r.join(info("a")).unwrap();
        let b = r.join(info("b")).unwrap();
        r.tunnel_up(b, "demo");
        tokio::time::advance(Duration::from_millis(5)).await;
        r.tunnel_up(a, "demo");
        assert_eq!(ids(&r, "demo"), ["a", "b"]);
        assert!(r.route("other").is_none());
        assert_eq!(
            r.counts(),
            RouteCounts {
                servers: 2,
                tunnels: 1
            }
        );
    }

    #[tokio::test(start_paused = true)]
    async fn draining_servers_come_last_and_downed_tunnels_are_dropped() {
        let r = registry(false);
        let a = r.join(info("a")).unwrap();
        let b = r.join(info("b")).unwrap();
        r.tunnel_up(b, "demo");
        tokio::time::advance(Duration::from_millis(5)).await;
        r.tunnel_up(a, "demo");
        r.load(a, load(&[("demo", 3)], true));
        assert_eq!(ids(&r, "demo"), ["b", "a"]);
        r.tunnel_down(b, "demo");
        assert_eq!(ids(&r, "demo"), ["a"], "only a draining server is left");
        assert_eq!(r.counts().tunnels, 1);
    }

    #[tokio::test(start_paused = true)]
    async fn leaving_removes_every_entry_and_a_stale_session_is_ignored() {
        let r = registry(false);
        let old = r.join(info("a")).unwrap();
        r.tunnel_up(old, "demo");
        let new = r.join(info("a")).unwrap();
        assert!(
            r.route("demo").is_none(),
            "the new session must resend its tunnels"
        );
        assert!(!r.tunnel_up(old, "demo"));
        assert!(r.tunnel_up(new, "demo"));
        assert_eq!(r.leave(old), None);
        assert_eq!(ids(&r, "demo"), ["a"]);
        assert_eq!(r.leave(new), Some(info("a")));
        assert!(r.route("demo").is_none());
        assert_eq!(r.counts(), RouteCounts::default());
        assert!(!r.uses_forward_url("http://a"));
    }

    #[tokio::test(start_paused = true)]
    async fn a_second_live_instance_of_a_server_id_is_refused_and_a_restart_is_not() {
        let r = registry(false);
        let mut fleet = r.watch_fleet();
        let first = r.join(instance("a", "one")).unwrap();
        r.tunnel_up(first, "demo");
        assert_eq!(
            r.join(instance("a", "two")),
            Err(Conflict {
                live_instance: "one".into()
            }),
            "two live servers claiming one id are not merged"
        );
        assert_eq!(ids(&r, "demo"), ["a"], "the live instance keeps routing");
        let members = fleet.borrow_and_update().clone();
        assert_eq!(members.len(), 1);
        assert_eq!(members[0].instance_id, "one");
        // The same instance reconnecting replaces its own entry.
        let again = r.join(instance("a", "one")).unwrap();
        assert!(!r.tunnel_up(first, "demo"), "the old session is stale");
        // Once it left, a new life of the id joins and the fleet shows it.
        r.leave(again);
        let restarted = r.join(instance("a", "two")).unwrap();
        assert!(r.tunnel_up(restarted, "demo"));
        assert!(fleet.has_changed().unwrap());
        let members = fleet.borrow_and_update().clone();
        assert_eq!(
            members
                .iter()
                .map(|m| (m.server_id.as_str(), m.instance_id.as_str()))
                .collect::<Vec<_>>(),
            [("a", "two")]
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_server_that_stops_reporting_expires_after_its_lease() {
        let r = registry(true);
        let a = r.join(info("a")).unwrap();
        let b = r.join(info("b")).unwrap();
        r.tunnel_up(a, "demo");
        r.tunnel_up(b, "demo");
        r.take_dirty();
        let mut expired = Vec::new();
        for _ in 0..4 {
            tokio::time::advance(Duration::from_secs(1)).await;
            r.load(b, load(&[("demo", 1)], false));
            expired.extend(r.sweep(Instant::now()));
        }
        // a last reported 4 s ago (lease 3 s): gone at the sweep above.
        assert_eq!(expired, [info("a")]);
        assert_eq!(ids(&r, "demo"), ["b"]);
        assert!(!r.load(a, load(&[], false)), "the expired session is stale");
        let dirty = r.take_dirty();
        assert!(dirty.contains(&("a".to_string(), None)), "{dirty:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn shared_records_route_and_local_entries_win() {
        let r = registry(true);
        let rec = |id: &str, tunnels: &[&str]| ServerRecord {
            info: info(id),
            tunnels: tunnels.iter().map(|s| s.to_string()).collect(),
            load: Some(load(&[("demo", 2)], false)),
            dispatcher: "d2".into(),
        };
        r.apply_shared(
            vec![rec("x", &["demo"]), rec("y", &["demo", "other"])],
            Prune::Missing,
        );
        assert_eq!(
            r.counts(),
            RouteCounts {
                servers: 2,
                tunnels: 2
            }
        );
        assert_eq!(ids(&r, "other"), ["y"]);
        // y reconnects here: the local entry replaces the shared one and stays.
        let y = r.join(info("y")).unwrap();
        r.tunnel_up(y, "third");
        r.apply_shared(
            vec![rec("x", &["demo"]), rec("y", &["demo", "other"])],
            Prune::Missing,
        );
        assert_eq!(ids(&r, "third"), ["y"]);
        assert!(r.route("other").is_none());
        // Right after an outage a missing record is kept, unless its server left; then
        // it is dropped.
        r.apply_shared(vec![], Prune::Left(HashSet::new()));
        assert_eq!(ids(&r, "demo"), ["x"]);
        assert_eq!(r.shared_ids(), ["x"]);
        r.apply_shared(vec![], Prune::Left(HashSet::from(["x".to_string()])));
        assert!(r.route("demo").is_none());
        r.apply_shared(vec![rec("x", &["demo"])], Prune::Missing);
        assert_eq!(ids(&r, "demo"), ["x"]);
        r.apply_shared(vec![], Prune::Missing);
        assert!(r.route("demo").is_none());
        assert_eq!(ids(&r, "third"), ["y"]);
        let snap = r.snapshot();
        assert_eq!(snap["servers"][0]["origin"], "local");
    }

    #[test]
    fn a_record_round_trips_through_json() {
        let rec = ServerRecord {
            info: info("a"),
            tunnels: vec!["demo".into()],
            load: Some(load(&[("demo", 2)], true)),
            dispatcher: "d".into(),
        };
        let json = serde_json::to_string(&rec).unwrap();
        assert_eq!(serde_json::from_str::<ServerRecord>(&json).unwrap(), rec);
    }
}
