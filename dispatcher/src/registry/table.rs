//! The routing table as a pure state machine: [`Table::apply`] takes one typed [`Event`]
//! (a server joined, a tunnel id went up or down, a load report, a server left, leases
//! checked, shared records read, this dispatcher's leg to a server measured) with `now` as
//! a value, and returns the [`Change`]s it made.
//!
//! Why this shape: the table is the one place that decides what a report means, and every
//! consumer (the Redis writer, the counts, the forward-channel cache, the routing plans, the
//! fleet watch) follows from the change list instead of being called from inside the
//! table's methods. The rules are then testable event by event, with no clock, no runtime,
//! no metrics and no Redis (see `table/tests.rs`).
//!
//! This module must not read the clock, do I/O, touch metrics or log.

use crate::routing::ServerView;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

/// Identity of one report stream, chosen by the caller (unique per join).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SessionId(pub u64);

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
    /// The server's smoothed CPU use, per mille; 0 when it does not measure it (and in
    /// records of dispatchers that did not know it).
    #[serde(default)]
    pub cpu_permille: u32,
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

/// One input to the table.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// A server opened report stream `session`.
    Join {
        session: SessionId,
        server: ServerInfo,
    },
    /// The server now holds streams of the tunnel id.
    TunnelUp {
        session: SessionId,
        tunnel_id: String,
    },
    /// The server holds no stream of the tunnel id any more.
    TunnelDown {
        session: SessionId,
        tunnel_id: String,
    },
    /// The server's periodic load report; `partial`: `load.tunnels` holds only the tunnel
    /// ids whose figures changed, the others keep theirs (`LoadReport.partial`).
    Load {
        session: SessionId,
        load: LoadFigures,
        partial: bool,
    },
    /// The report stream ended.
    Leave { session: SessionId },
    /// Drop the local entries that have not reported within the lease.
    ExpireLeases,
    /// This dispatcher's smoothed round trip to the server at `forward_url` (local or
    /// shared), measured on its forward connection; `None` forgets it. Added to the RTT the
    /// server reports for a tunnel id's streams. Changes no plan at once: the routing tick
    /// rebuilds every plan.
    ForwardRtt {
        forward_url: String,
        rtt_us: Option<u32>,
    },
    /// Entries read back from the shared store.
    Shared {
        records: Vec<ServerRecord>,
        prune: Prune,
    },
}

/// Why an event changed nothing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refused {
    /// The session is not the server's current one (replaced, left or expired).
    Stale,
    /// Another live instance holds the server id.
    Conflict(Conflict),
}

/// Why an entry went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gone {
    /// Its report stream ended.
    Left,
    /// It did not report within the lease.
    LeaseExpired,
    /// A new report stream (or, for a shared entry, a local one) of the same server id
    /// took its place.
    Replaced,
    /// The shared store no longer lists it.
    Unshared,
}

/// What an event changed, for the consumers of the table. An event's list holds each
/// item once, in this order: departures, records, routes, fleet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    /// An entry went; `url_in_use` says whether a remaining entry has the same
    /// `forward_url` (otherwise its cached channel can go).
    Gone {
        server: ServerInfo,
        why: Gone,
        url_in_use: bool,
    },
    /// A local entry changed or was renewed: its shared record is to be rewritten (or
    /// deleted, when no local entry of the server id is left).
    Record(String),
    /// The servers holding this tunnel id, or their figures, changed: its plan is stale.
    Routes(String),
    /// The fleet's members (id, instance, zone, draining, direct URL) changed.
    Fleet,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    Local(SessionId),
    Shared,
}

/// One server's entry.
#[derive(Debug, Clone)]
pub struct Entry {
    pub info: ServerInfo,
    pub origin: Origin,
    pub joined: Instant,
    /// Last frame from the server (local) or last read that listed it (shared).
    pub seen: Instant,
    /// Tunnel ids it holds, with when this dispatcher learned it; ordered as the figures
    /// of its load report are, so [`Table::all_views`] walks the two side by side.
    pub tunnels: BTreeMap<String, Instant>,
    pub load: Option<(Instant, LoadFigures)>,
    /// `info.server_id` and `info.forward_url` as the views share them: the routing tick
    /// builds a view per tunnel id and server, and copying the two strings into new
    /// allocations for each was most of its cost with thousands of tunnel ids.
    names: (Arc<str>, Arc<str>),
}

impl Entry {
    fn new(
        info: ServerInfo,
        origin: Origin,
        joined: Instant,
        tunnels: BTreeMap<String, Instant>,
        load: Option<(Instant, LoadFigures)>,
        now: Instant,
    ) -> Self {
        let names = (
            Arc::from(info.server_id.as_str()),
            Arc::from(info.forward_url.as_str()),
        );
        Entry {
            info,
            origin,
            joined,
            seen: now,
            tunnels,
            load,
            names,
        }
    }

    /// The server's smoothed CPU use from its last report, per mille (0: unknown).
    pub fn cpu_permille(&self) -> u32 {
        self.load.as_ref().map_or(0, |(_, l)| l.cpu_permille)
    }

    pub fn draining(&self) -> bool {
        self.load.as_ref().is_some_and(|(_, l)| l.draining)
    }

    fn figures(&self, tunnel_id: &str) -> Option<&TunnelFigures> {
        self.load
            .as_ref()
            .and_then(|(_, l)| l.tunnels.get(tunnel_id))
    }

    /// Everything a tunnel id's plan reads of this entry.
    fn route_key(&self, tunnel_id: &str) -> Option<RouteKey<'_>> {
        let at = *self.tunnels.get(tunnel_id)?;
        Some((
            at,
            self.draining(),
            self.figures(tunnel_id),
            &self.info.forward_url,
        ))
    }

    fn member(&self) -> relay_proto::FleetMember {
        relay_proto::FleetMember {
            server_id: self.info.server_id.clone(),
            instance_id: self.info.instance_id.clone(),
            zone: self.info.zone.clone(),
            draining: self.draining(),
            direct_url: self.info.direct_url.clone(),
        }
    }

    /// What the router sees of this entry for `tunnel_id`; `forward_rtt_us` is this
    /// dispatcher's leg to the server, when measured.
    fn view(&self, tunnel_id: &str, at: Instant, forward_rtt_us: Option<u32>) -> ServerView {
        let f = self.figures(tunnel_id).cloned().unwrap_or_default();
        self.view_with(f, at, forward_rtt_us)
    }

    /// [`Entry::view`] with the tunnel id's figures already looked up.
    fn view_with(&self, f: TunnelFigures, at: Instant, forward_rtt_us: Option<u32>) -> ServerView {
        // The latency of a call's path: this dispatcher's leg plus the agent leg the server
        // measures; unknown until both are.
        let rtt_us = match forward_rtt_us {
            Some(fwd) if f.rtt_us > 0 => f.rtt_us.saturating_add(fwd),
            _ => 0,
        };
        ServerView {
            server_id: self.names.0.clone(),
            forward_url: self.names.1.clone(),
            announced: at,
            draining: self.draining(),
            idle: f.idle,
            busy: f.busy,
            queued: f.queued,
            rtt_us,
            load_permille: self.cpu_permille(),
        }
    }
}

type RouteKey<'a> = (Instant, bool, Option<&'a TunnelFigures>, &'a str);

/// Changes collected while one event is applied.
#[derive(Default)]
struct Diff {
    gone: Vec<(ServerInfo, Gone)>,
    records: BTreeSet<String>,
    routes: BTreeSet<String>,
    fleet: bool,
}

impl Diff {
    /// Notes what differs between two versions of one server's entry.
    fn entry(&mut self, old: Option<&Entry>, new: Option<&Entry>) {
        if old.map(Entry::member) != new.map(Entry::member) {
            self.fleet = true;
        }
        let ids = old
            .into_iter()
            .chain(new)
            .flat_map(|e| e.tunnels.keys())
            .collect::<HashSet<_>>();
        for tid in ids {
            let before = old.and_then(|e| e.route_key(tid));
            let after = new.and_then(|e| e.route_key(tid));
            if before != after {
                self.routes.insert(tid.clone());
            }
        }
    }
}

/// The dispatcher's routing table. See the module docs.
pub struct Table {
    lease: Duration,
    /// By server id.
    entries: HashMap<String, Entry>,
    /// Server id of each current local session.
    sessions: HashMap<SessionId, String>,
    /// Number of entries holding each tunnel id.
    holders: HashMap<String, usize>,
    /// This dispatcher's smoothed round trip to each forward URL in use, microseconds.
    forward_rtt: HashMap<String, u32>,
}

impl Table {
    /// `lease`: how long a local entry lives past its last frame.
    pub fn new(lease: Duration) -> Self {
        Table {
            lease,
            entries: HashMap::new(),
            sessions: HashMap::new(),
            holders: HashMap::new(),
            forward_rtt: HashMap::new(),
        }
    }

    pub fn lease(&self) -> Duration {
        self.lease
    }

    /// Applies `event` at `now`; returns what changed (see [`Change`]).
    pub fn apply(&mut self, now: Instant, event: Event) -> Result<Vec<Change>, Refused> {
        let mut d = Diff::default();
        match event {
            Event::Join { session, server } => self.join(now, session, server, &mut d)?,
            Event::TunnelUp { session, tunnel_id } => {
                let e = local(&mut self.entries, &self.sessions, now, session, &mut d)?;
                if !e.tunnels.contains_key(&tunnel_id) {
                    e.tunnels.insert(tunnel_id.clone(), now);
                    *self.holders.entry(tunnel_id.clone()).or_default() += 1;
                    d.routes.insert(tunnel_id);
                }
            }
            Event::TunnelDown { session, tunnel_id } => {
                let e = local(&mut self.entries, &self.sessions, now, session, &mut d)?;
                if e.tunnels.remove(&tunnel_id).is_some() {
                    release(&mut self.holders, &tunnel_id);
                    d.routes.insert(tunnel_id.clone());
                }
                // Its figures go too: a partial report lists it again when it comes back.
                if let Some((_, l)) = e.load.as_mut() {
                    l.tunnels.remove(&tunnel_id);
                }
            }
            Event::Load {
                session,
                load,
                partial: true,
            } if self
                .sessions
                .get(&session)
                .is_some_and(|id| self.entries.get(id).is_some_and(|e| e.load.is_some())) =>
            {
                let e = local(&mut self.entries, &self.sessions, now, session, &mut d)?;
                let old_draining = e.draining();
                let Some((at, l)) = e.load.as_mut() else {
                    return Err(Refused::Stale);
                };
                *at = now;
                l.calls_in_flight = load.calls_in_flight;
                l.draining = load.draining;
                l.cpu_permille = load.cpu_permille;
                let mut changed = Vec::new();
                for (tid, f) in load.tunnels {
                    if l.tunnels.get(&tid) != Some(&f) {
                        l.tunnels.insert(tid.clone(), f);
                        changed.push(tid);
                    }
                }
                if old_draining != e.draining() {
                    d.fleet = true;
                    d.routes.extend(e.tunnels.keys().cloned());
                } else {
                    d.routes
                        .extend(changed.into_iter().filter(|t| e.tunnels.contains_key(t)));
                }
            }
            // A whole report (or a partial one with nothing to add to: it lists all there is).
            Event::Load { session, load, .. } => {
                let e = local(&mut self.entries, &self.sessions, now, session, &mut d)?;
                let old = e.load.replace((now, load));
                let old_draining = old.as_ref().is_some_and(|(_, l)| l.draining);
                let draining = e.draining();
                if old_draining != draining {
                    d.fleet = true;
                }
                for tid in e.tunnels.keys() {
                    let before = old.as_ref().and_then(|(_, l)| l.tunnels.get(tid));
                    if old_draining != draining || before != e.figures(tid) {
                        d.routes.insert(tid.clone());
                    }
                }
            }
            Event::Leave { session } => {
                let id = self.sessions.get(&session).ok_or(Refused::Stale)?.clone();
                if let Some(old) = self.replace(&id, None, &mut d) {
                    d.gone.push((old.info, Gone::Left));
                }
                d.records.insert(id);
            }
            Event::ExpireLeases => {
                let lease = self.lease;
                let mut expired: Vec<String> = self
                    .entries
                    .iter()
                    .filter(|(_, e)| {
                        matches!(e.origin, Origin::Local(_))
                            && now.saturating_duration_since(e.seen) > lease
                    })
                    .map(|(id, _)| id.clone())
                    .collect();
                expired.sort();
                for id in expired {
                    if let Some(old) = self.replace(&id, None, &mut d) {
                        d.gone.push((old.info, Gone::LeaseExpired));
                    }
                    d.records.insert(id);
                }
            }
            Event::Shared { records, prune } => self.shared(now, records, prune, &mut d),
            Event::ForwardRtt {
                forward_url,
                rtt_us,
            } => match rtt_us {
                Some(us) if self.uses_forward_url(&forward_url) => {
                    self.forward_rtt.insert(forward_url, us);
                }
                _ => {
                    self.forward_rtt.remove(&forward_url);
                }
            },
        }
        if !d.gone.is_empty() {
            let entries = &self.entries;
            self.forward_rtt
                .retain(|url, _| entries.values().any(|e| &e.info.forward_url == url));
        }
        Ok(self.changes(d))
    }

    fn join(
        &mut self,
        now: Instant,
        session: SessionId,
        server: ServerInfo,
        d: &mut Diff,
    ) -> Result<(), Refused> {
        if let Some(e) = self.entries.get(&server.server_id) {
            let other = !e.info.instance_id.is_empty()
                && !server.instance_id.is_empty()
                && e.info.instance_id != server.instance_id;
            if other && matches!(e.origin, Origin::Local(_)) {
                return Err(Refused::Conflict(Conflict {
                    live_instance: e.info.instance_id.clone(),
                }));
            }
        }
        let id = server.server_id.clone();
        let entry = Entry::new(
            server,
            Origin::Local(session),
            now,
            BTreeMap::new(),
            None,
            now,
        );
        if let Some(old) = self.replace(&id, Some(entry), d) {
            d.gone.push((old.info, Gone::Replaced));
        }
        d.records.insert(id);
        Ok(())
    }

    fn shared(&mut self, now: Instant, records: Vec<ServerRecord>, prune: Prune, d: &mut Diff) {
        let listed: HashSet<&str> = records.iter().map(|r| r.info.server_id.as_str()).collect();
        let mut dropped: Vec<String> = self
            .entries
            .iter()
            .filter(|(id, e)| {
                e.origin == Origin::Shared
                    && !listed.contains(id.as_str())
                    && match &prune {
                        Prune::Missing => true,
                        Prune::Left(left) => left.contains(*id),
                    }
            })
            .map(|(id, _)| id.clone())
            .collect();
        dropped.sort();
        for id in dropped {
            if let Some(old) = self.replace(&id, None, d) {
                d.gone.push((old.info, Gone::Unshared));
            }
        }
        for r in records {
            let id = r.info.server_id.clone();
            let old = self.entries.get(&id);
            if old.is_some_and(|e| e.origin != Origin::Shared) {
                // A server reporting here: the local entry is the fresher one.
                continue;
            }
            let tunnels = r
                .tunnels
                .into_iter()
                .map(|tid| {
                    let at = old.and_then(|e| e.tunnels.get(&tid)).copied();
                    (tid, at.unwrap_or(now))
                })
                .collect();
            let load = match old.and_then(|e| e.load.as_ref()) {
                Some((at, l)) if Some(l) == r.load.as_ref() => Some((*at, l.clone())),
                _ => r.load.map(|l| (now, l)),
            };
            let joined = old.map_or(now, |e| e.joined);
            let entry = Entry::new(r.info, Origin::Shared, joined, tunnels, load, now);
            self.replace(&id, Some(entry), d);
        }
    }

    /// Puts `new` in place of server `id`'s entry (or removes it), keeping the indexes;
    /// returns the old entry.
    fn replace(&mut self, id: &str, new: Option<Entry>, d: &mut Diff) -> Option<Entry> {
        d.entry(self.entries.get(id), new.as_ref());
        let old = match new {
            Some(e) => {
                if let Origin::Local(s) = e.origin {
                    self.sessions.insert(s, id.to_string());
                }
                for tid in e.tunnels.keys() {
                    *self.holders.entry(tid.clone()).or_default() += 1;
                }
                self.entries.insert(id.to_string(), e)
            }
            None => self.entries.remove(id),
        };
        if let Some(old) = &old {
            if let Origin::Local(s) = old.origin {
                self.sessions.remove(&s);
            }
            for tid in old.tunnels.keys() {
                release(&mut self.holders, tid);
            }
        }
        old
    }

    fn changes(&self, d: Diff) -> Vec<Change> {
        let mut out = Vec::new();
        for (server, why) in d.gone {
            let url_in_use = self.uses_forward_url(&server.forward_url);
            out.push(Change::Gone {
                server,
                why,
                url_in_use,
            });
        }
        out.extend(d.records.into_iter().map(Change::Record));
        out.extend(d.routes.into_iter().map(Change::Routes));
        if d.fleet {
            out.push(Change::Fleet);
        }
        out
    }

    /// What the router sees of the servers holding `tunnel_id` (empty when none does).
    pub fn views(&self, tunnel_id: &str) -> Vec<ServerView> {
        if !self.holders.contains_key(tunnel_id) {
            return Vec::new();
        }
        self.entries
            .values()
            .filter_map(|e| {
                let at = *e.tunnels.get(tunnel_id)?;
                Some(e.view(tunnel_id, at, self.forward_rtt_of(e)))
            })
            .collect()
    }

    /// [`Table::views`] of every tunnel id.
    ///
    /// The routing tick calls this four times a second, for every tunnel id and server:
    /// each tunnel id's key is copied once (not once per server holding it), and each
    /// entry's tunnel ids and figures, both ordered by tunnel id, are walked side by side
    /// instead of looked up one in the other (a lookup per tunnel id and server was most of
    /// the tick's time with thousands of tunnel ids).
    pub fn all_views(&self) -> HashMap<String, Vec<ServerView>> {
        let mut views: HashMap<String, Vec<ServerView>> =
            HashMap::with_capacity(self.holders.len());
        let servers = self.entries.len();
        let mut push = |tid: &String, view: ServerView| match views.get_mut(tid.as_str()) {
            Some(v) => v.push(view),
            None => {
                let mut v = Vec::with_capacity(servers);
                v.push(view);
                views.insert(tid.clone(), v);
            }
        };
        for e in self.entries.values() {
            let fwd = self.forward_rtt_of(e);
            let mut figures = e.load.as_ref().map(|(_, l)| l.tunnels.iter().peekable());
            for (tid, at) in &e.tunnels {
                let f = figures.as_mut().and_then(|figures| {
                    while figures
                        .next_if(|(k, _)| k.as_str() < tid.as_str())
                        .is_some()
                    {}
                    figures.next_if(|(k, _)| *k == tid).map(|(_, f)| f.clone())
                });
                push(tid, e.view_with(f.unwrap_or_default(), *at, fwd));
            }
        }
        views
    }

    /// The shared record of server `id`'s local entry; `None` when it has none.
    pub fn local_record(&self, id: &str, dispatcher: &str) -> Option<ServerRecord> {
        let e = self.entries.get(id)?;
        if e.origin == Origin::Shared {
            return None;
        }
        let mut tunnels: Vec<String> = e.tunnels.keys().cloned().collect();
        tunnels.sort();
        Some(ServerRecord {
            info: e.info.clone(),
            tunnels,
            load: e.load.as_ref().map(|(_, l)| l.clone()),
            dispatcher: dispatcher.to_string(),
        })
    }

    /// Ids of the entries of the given kind (local or shared).
    pub fn ids(&self, local: bool) -> Vec<String> {
        let mut ids: Vec<String> = self
            .entries
            .iter()
            .filter(|(_, e)| matches!(e.origin, Origin::Local(_)) == local)
            .map(|(id, _)| id.clone())
            .collect();
        ids.sort();
        ids
    }

    /// The fleet's members (local and shared entries), by server id.
    pub fn members(&self) -> Vec<relay_proto::FleetMember> {
        let mut members: Vec<_> = self.entries.values().map(Entry::member).collect();
        members.sort_by(|a, b| a.server_id.cmp(&b.server_id));
        members
    }

    /// This dispatcher's measured leg to `e`, microseconds.
    pub fn forward_rtt_of(&self, e: &Entry) -> Option<u32> {
        self.forward_rtt.get(&e.info.forward_url).copied()
    }

    /// `(server id, forward URL)` of every entry: what the forward leg is measured to.
    pub fn forward_targets(&self) -> Vec<(String, String)> {
        let mut out: Vec<(String, String)> = self
            .entries
            .values()
            .map(|e| (e.info.server_id.clone(), e.info.forward_url.clone()))
            .collect();
        out.sort();
        out
    }

    pub fn uses_forward_url(&self, forward_url: &str) -> bool {
        self.entries
            .values()
            .any(|e| e.info.forward_url == forward_url)
    }

    pub fn counts(&self) -> RouteCounts {
        RouteCounts {
            servers: self.entries.len(),
            tunnels: self.holders.len(),
        }
    }

    /// Every entry, by server id.
    pub fn entries(&self) -> impl Iterator<Item = &Entry> {
        self.entries.values()
    }
}

/// The current local entry of `session`, renewed at `now`.
fn local<'a>(
    entries: &'a mut HashMap<String, Entry>,
    sessions: &HashMap<SessionId, String>,
    now: Instant,
    session: SessionId,
    d: &mut Diff,
) -> Result<&'a mut Entry, Refused> {
    let id = sessions.get(&session).ok_or(Refused::Stale)?;
    let e = entries.get_mut(id).ok_or(Refused::Stale)?;
    e.seen = now;
    d.records.insert(id.clone());
    Ok(e)
}

fn release(holders: &mut HashMap<String, usize>, tunnel_id: &str) {
    if let Some(n) = holders.get_mut(tunnel_id) {
        *n -= 1;
        if *n == 0 {
            holders.remove(tunnel_id);
        }
    }
}

#[cfg(test)]
mod tests;
