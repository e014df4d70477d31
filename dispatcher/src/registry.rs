//! The routing registry: tunnel id -> tunnel servers holding streams of it, fed by the
//! servers' report streams (see `report`), read on every call by the HTTP front.
//!
//! [`RouteTable`] is the boundary: the HTTP front and the report service only talk to the
//! trait. [`MemoryRegistry`] is the embedded in-memory table. Reads are synchronous on
//! purpose: a shared-store implementation (Redis, next) keeps a local replica updated in the
//! background, so the call path never awaits the network to route.
//!
//! Each report stream is a *session*. A server that reconnects opens a new session that
//! replaces its old one (and resends its TunnelUp frames); anything the stale session sends
//! or its late end is ignored, so a slow-to-die old stream cannot erase the new entries.
//!
//! This module must not do I/O; it reads the clock only through `tokio::time::Instant`.

use serde::Serialize;
use std::collections::{HashMap, HashSet};
use std::sync::Mutex;
use std::time::SystemTime;
use tokio::time::Instant;

/// Identity of one report stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SessionId(u64);

/// What a tunnel server says about itself in its `ServerIntro`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerInfo {
    pub server_id: String,
    pub zone: String,
    /// Where its `Forward` service listens (`http://host:port`).
    pub forward_url: String,
}

/// One tunnel id's figures in a server's last load report.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct TunnelFigures {
    pub idle: u32,
    pub busy: u32,
    pub queued: u32,
    pub rtt_us: u32,
}

/// A server's last load report.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LoadFigures {
    pub tunnels: HashMap<String, TunnelFigures>,
    pub calls_in_flight: u32,
    pub draining: bool,
}

/// A server a call may be forwarded to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    pub server_id: String,
    pub forward_url: String,
}

/// Sizes of the table, for gauges and readiness.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RouteCounts {
    pub servers: usize,
    pub tunnels: usize,
}

/// The routing table as seen by the rest of the dispatcher.
pub trait RouteTable: Send + Sync + 'static {
    /// A server opened a report stream. Replaces any earlier session of the same server id.
    fn join(&self, server: ServerInfo) -> SessionId;
    /// The server now holds streams of `tunnel_id`. False if the session is no longer current.
    fn tunnel_up(&self, session: SessionId, tunnel_id: &str) -> bool;
    /// The server holds no stream of `tunnel_id` any more. False if the session is stale.
    fn tunnel_down(&self, session: SessionId, tunnel_id: &str) -> bool;
    /// Stores the server's latest load figures. False if the session is stale.
    fn load(&self, session: SessionId, load: LoadFigures) -> bool;
    /// The report stream ended: forget the server and all its tunnel ids. Returns the
    /// server's info if the session was current.
    fn leave(&self, session: SessionId) -> Option<ServerInfo>;
    /// Servers to try for `tunnel_id`, best first. Empty: nobody holds it.
    fn candidates(&self, tunnel_id: &str) -> Vec<Route>;
    /// Whether any current server uses `forward_url` (to drop cached channels).
    fn uses_forward_url(&self, forward_url: &str) -> bool;
    fn counts(&self) -> RouteCounts;
    /// The whole table for `/debug/routes`.
    fn snapshot(&self) -> serde_json::Value;
}

struct Announced {
    at: Instant,
    wall: SystemTime,
}

struct ServerEntry {
    info: ServerInfo,
    joined: Instant,
    tunnels: HashMap<String, Announced>,
    load: Option<(Instant, LoadFigures)>,
}

impl ServerEntry {
    fn draining(&self) -> bool {
        self.load.as_ref().is_some_and(|(_, l)| l.draining)
    }
}

#[derive(Default)]
struct Table {
    next_session: u64,
    servers: HashMap<SessionId, ServerEntry>,
    by_server_id: HashMap<String, SessionId>,
    /// Index: tunnel id -> sessions announcing it.
    tunnels: HashMap<String, HashSet<SessionId>>,
}

impl Table {
    fn remove_session(&mut self, session: SessionId) -> Option<ServerEntry> {
        let entry = self.servers.remove(&session)?;
        if self.by_server_id.get(&entry.info.server_id) == Some(&session) {
            self.by_server_id.remove(&entry.info.server_id);
        }
        for tunnel_id in entry.tunnels.keys() {
            self.unindex(tunnel_id, session);
        }
        Some(entry)
    }

    fn unindex(&mut self, tunnel_id: &str, session: SessionId) {
        if let Some(set) = self.tunnels.get_mut(tunnel_id) {
            set.remove(&session);
            if set.is_empty() {
                self.tunnels.remove(tunnel_id);
            }
        }
    }
}

/// The embedded in-memory routing table. One short `Mutex` section per operation.
#[derive(Default)]
pub struct MemoryRegistry {
    table: Mutex<Table>,
}

impl MemoryRegistry {
    pub fn new() -> Self {
        Self::default()
    }

    fn with<R>(&self, f: impl FnOnce(&mut Table) -> R) -> R {
        // A panic while holding the lock cannot leave the table half-updated in a way that
        // matters more than losing routing, so recover the guard instead of propagating.
        let mut guard = self.table.lock().unwrap_or_else(|e| e.into_inner());
        f(&mut guard)
    }
}

fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

impl RouteTable for MemoryRegistry {
    fn join(&self, server: ServerInfo) -> SessionId {
        self.with(|t| {
            t.next_session += 1;
            let session = SessionId(t.next_session);
            if let Some(old) = t.by_server_id.get(&server.server_id).copied() {
                t.remove_session(old);
            }
            t.by_server_id.insert(server.server_id.clone(), session);
            t.servers.insert(
                session,
                ServerEntry {
                    info: server,
                    joined: Instant::now(),
                    tunnels: HashMap::new(),
                    load: None,
                },
            );
            session
        })
    }

    fn tunnel_up(&self, session: SessionId, tunnel_id: &str) -> bool {
        self.with(|t| {
            let Some(entry) = t.servers.get_mut(&session) else {
                return false;
            };
            entry.tunnels.insert(
                tunnel_id.to_string(),
                Announced {
                    at: Instant::now(),
                    wall: SystemTime::now(),
                },
            );
            t.tunnels
                .entry(tunnel_id.to_string())
                .or_default()
                .insert(session);
            true
        })
    }

    fn tunnel_down(&self, session: SessionId, tunnel_id: &str) -> bool {
        self.with(|t| {
            let Some(entry) = t.servers.get_mut(&session) else {
                return false;
            };
            if entry.tunnels.remove(tunnel_id).is_some() {
                t.unindex(tunnel_id, session);
            }
            true
        })
    }

    fn load(&self, session: SessionId, load: LoadFigures) -> bool {
        self.with(|t| {
            let Some(entry) = t.servers.get_mut(&session) else {
                return false;
            };
            entry.load = Some((Instant::now(), load));
            true
        })
    }

    fn leave(&self, session: SessionId) -> Option<ServerInfo> {
        self.with(|t| t.remove_session(session).map(|e| e.info))
    }

    fn candidates(&self, tunnel_id: &str) -> Vec<Route> {
        self.with(|t| {
            let Some(sessions) = t.tunnels.get(tunnel_id) else {
                return Vec::new();
            };
            let mut found: Vec<(Instant, Route)> = sessions
                .iter()
                .filter_map(|s| t.servers.get(s))
                .filter(|e| !e.draining())
                .filter_map(|e| {
                    let announced = e.tunnels.get(tunnel_id)?;
                    Some((
                        announced.at,
                        Route {
                            server_id: e.info.server_id.clone(),
                            forward_url: e.info.forward_url.clone(),
                        },
                    ))
                })
                .collect();
            // Most recently announced first (the seed behaviour); server id breaks ties so the
            // order is stable.
            found.sort_by(|a, b| {
                b.0.cmp(&a.0)
                    .then_with(|| a.1.server_id.cmp(&b.1.server_id))
            });
            found.into_iter().map(|(_, r)| r).collect()
        })
    }

    fn uses_forward_url(&self, forward_url: &str) -> bool {
        self.with(|t| {
            t.servers
                .values()
                .any(|e| e.info.forward_url == forward_url)
        })
    }

    fn counts(&self) -> RouteCounts {
        self.with(|t| RouteCounts {
            servers: t.servers.len(),
            tunnels: t.tunnels.len(),
        })
    }

    fn snapshot(&self) -> serde_json::Value {
        let now = Instant::now();
        self.with(|t| {
            let mut tunnel_ids: Vec<&String> = t.tunnels.keys().collect();
            tunnel_ids.sort();
            let tunnels: Vec<serde_json::Value> = tunnel_ids
                .into_iter()
                .map(|tid| {
                    let mut servers: Vec<(&ServerEntry, &Announced)> = t.tunnels[tid]
                        .iter()
                        .filter_map(|s| t.servers.get(s))
                        .filter_map(|e| Some((e, e.tunnels.get(tid)?)))
                        .collect();
                    servers.sort_by_key(|s| std::cmp::Reverse(s.1.at));
                    let servers: Vec<serde_json::Value> = servers
                        .into_iter()
                        .map(|(e, a)| {
                            let figures = e.load.as_ref().and_then(|(_, l)| l.tunnels.get(tid));
                            serde_json::json!({
                                "server_id": e.info.server_id,
                                "zone": e.info.zone,
                                "forward_url": e.info.forward_url,
                                "announced_unix_ms": unix_ms(a.wall),
                                "announced_age_ms": now.saturating_duration_since(a.at).as_millis() as u64,
                                "draining": e.draining(),
                                "load": figures,
                            })
                        })
                        .collect();
                    serde_json::json!({"tunnel_id": tid, "servers": servers})
                })
                .collect();
            let mut entries: Vec<&ServerEntry> = t.servers.values().collect();
            entries.sort_by(|a, b| a.info.server_id.cmp(&b.info.server_id));
            let servers: Vec<serde_json::Value> = entries
                .into_iter()
                .map(|e| {
                    serde_json::json!({
                        "server_id": e.info.server_id,
                        "zone": e.info.zone,
                        "forward_url": e.info.forward_url,
                        "connected_age_ms": now.saturating_duration_since(e.joined).as_millis() as u64,
                        "tunnels": e.tunnels.len(),
                        "draining": e.draining(),
                        "calls_in_flight": e.load.as_ref().map(|(_, l)| l.calls_in_flight),
                        "load_age_ms": e.load.as_ref().map(|(at, _)| now.saturating_duration_since(*at).as_millis() as u64),
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
    use std::time::Duration;

    fn info(id: &str) -> ServerInfo {
        ServerInfo {
            server_id: id.into(),
            zone: "z".into(),
            forward_url: format!("http://{id}"),
        }
    }

    fn ids(routes: Vec<Route>) -> Vec<String> {
        routes.into_iter().map(|r| r.server_id).collect()
    }

    #[tokio::test(start_paused = true)]
    async fn most_recently_announced_server_comes_first() {
        let r = MemoryRegistry::new();
        let a = r.join(info("a"));
        let b = r.join(info("b"));
        r.tunnel_up(b, "demo");
        tokio::time::advance(Duration::from_millis(5)).await;
        r.tunnel_up(a, "demo");
        assert_eq!(ids(r.candidates("demo")), ["a", "b"]);
        assert!(r.candidates("other").is_empty());
        assert_eq!(
            r.counts(),
            RouteCounts {
                servers: 2,
                tunnels: 1
            }
        );
    }

    #[tokio::test(start_paused = true)]
    async fn draining_servers_and_downed_tunnels_are_skipped() {
        let r = MemoryRegistry::new();
        let a = r.join(info("a"));
        let b = r.join(info("b"));
        r.tunnel_up(a, "demo");
        r.tunnel_up(b, "demo");
        r.load(
            a,
            LoadFigures {
                draining: true,
                ..Default::default()
            },
        );
        assert_eq!(ids(r.candidates("demo")), ["b"]);
        r.tunnel_down(b, "demo");
        assert!(r.candidates("demo").is_empty());
        assert_eq!(r.counts().tunnels, 1, "a still holds it while draining");
    }

    #[tokio::test(start_paused = true)]
    async fn leaving_removes_every_entry_and_a_stale_session_is_ignored() {
        let r = MemoryRegistry::new();
        let old = r.join(info("a"));
        r.tunnel_up(old, "demo");
        let new = r.join(info("a"));
        assert!(
            r.candidates("demo").is_empty(),
            "the new session must resend its tunnels"
        );
        assert!(!r.tunnel_up(old, "demo"));
        assert!(r.tunnel_up(new, "demo"));
        assert_eq!(r.leave(old), None);
        assert_eq!(ids(r.candidates("demo")), ["a"]);
        assert_eq!(r.leave(new), Some(info("a")));
        assert!(r.candidates("demo").is_empty());
        assert_eq!(r.counts(), RouteCounts::default());
        assert!(!r.uses_forward_url("http://a"));
    }
}
