//! The registry: tunnel id -> tunnel servers holding streams of it, and the routing plans
//! the call path picks from.
//!
//! The pieces, one owner each:
//! - [`table`]: the pure table. Typed events in (joined, tunnel up/down, load, left, leases
//!   expired, shared records read, forward leg measured), with `now` passed in; the list
//!   of changes out. It holds the rules: a reconnecting server's new session replaces its old one (so a
//!   slow-to-die old stream cannot erase the new entries), a second live instance of a
//!   server id is refused, a local entry always wins over a shared one, a local entry that
//!   has not reported within `lease` expires (a hung server whose stream stays open).
//! - [`Routes`] (here): the shell that feeds the table and carries each change out once:
//!   a departed server is logged, counted and its unused forward channel evicted; a local
//!   entry's change is queued for the shared store (only when there is one); the plans of
//!   the tunnel ids that changed are rebuilt and published; the fleet watch and the
//!   server and tunnel counts follow. The routing series (spill shares, tiers, RTTs,
//!   servers' load) are read from the table and the router when `/metrics` is scraped
//!   (`crate::metrics::RoutingSeries`), so no event sets a series.
//! - [`debug`]: the `/debug/routes` JSON.
//!
//! The call path ([`Routes::route`]) reads published plans from a sharded map and never
//! waits on the writers' lock (the table and the router behind one `Mutex`): an
//! event rebuilds only the plans of the tunnel ids it changed, under that lock, and swaps
//! each new plan into the map. A fleet of agents
//! connecting announces thousands of tunnel ids within seconds; rebuilding every plan on
//! each of them once held the lock long enough to back up report streams until their
//! leases expired. Spill shares still step for every tunnel id on the routing tick
//! ([`Routes::tick`]), which skips those settled on unchanged views. NO_CAPACITY answers
//! from the call path are parked in a small set and handed to the router at its next
//! rebuild.
//!
//! Nothing here does network I/O or holds a lock across an `.await`; only this shell reads
//! the clock, through `tokio::time::Instant` (and the wall clock for `/debug/routes`).

mod debug;
pub mod table;

pub use table::{
    Conflict, LoadFigures, Prune, RouteCounts, ServerInfo, ServerRecord, SessionId, TunnelFigures,
};

use crate::config::RoutingConfig;
use crate::metrics::{Metrics, RoutingFigures, RoutingRows, ServerRow, TunnelRow};
use crate::routing::{Pick, Router, TunnelPlan};
use dashmap::DashMap;
use parking_lot::Mutex;
use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use table::{Change, Event, Gone, Refused, Table};
use tokio::sync::Notify;
use tokio::time::Instant;
use tracing::{debug, info, warn};

/// A change of a local entry that the shared store must write (`Some`) or delete (`None`).
pub type Publish = (String, Option<ServerRecord>);

/// Called with a forward URL no entry uses any more (drops its cached channel).
type Evict = Box<dyn Fn(&str) + Send + Sync>;

/// What the writers (report streams, the routing tick, the shared store reader) share.
struct Writers {
    table: Table,
    router: Router,
}

/// The routing series' figures: each server in the table, and each tunnel id a server
/// holds with its routing status and the servers' views (see
/// `crate::metrics::RoutingSeries`).
impl RoutingFigures for Mutex<Writers> {
    fn routing_rows(&self) -> RoutingRows {
        let w = self.lock();
        let servers = w
            .table
            .entries()
            .map(|e| ServerRow {
                server_id: e.info.server_id.clone(),
                load_ratio: f64::from(e.cpu_permille()) / 1000.0,
                calls_in_flight: e.load.as_ref().map_or(0, |(_, l)| l.calls_in_flight),
                forward_rtt_us: w.table.forward_rtt_of(e),
            })
            .collect();
        let tunnels = w
            .table
            .all_views()
            .into_iter()
            .filter_map(|(tunnel_id, views)| {
                let status = w.router.status(&tunnel_id)?;
                let tier = |server_id: &str| {
                    status
                        .tiers
                        .iter()
                        .find(|(s, _)| &**s == server_id)
                        .map_or(-1, |(_, k)| *k as i64)
                };
                let servers = views
                    .iter()
                    .map(|v| (v.server_id.clone(), v.rtt_us, tier(&v.server_id)))
                    .collect();
                Some(TunnelRow {
                    tunnel_id,
                    spill_share: status.spill_share,
                    spills: status.spills,
                    servers,
                })
            })
            .collect();
        RoutingRows { servers, tunnels }
    }
}

/// The dispatcher's registry. See the module docs.
pub struct Routes {
    /// Shared with the per-tunnel-id series, which read it at scrape time.
    writers: Arc<Mutex<Writers>>,
    /// Each tunnel id's current plan, for the call path.
    plans: DashMap<String, Arc<TunnelPlan>>,
    /// `(tunnel id, server id)` pairs that answered NO_CAPACITY since the last rebuild.
    no_capacity: Mutex<HashSet<(String, String)>>,
    next_session: AtomicU64,
    /// Name of this dispatcher in shared records.
    dispatcher: String,
    /// Server ids whose local record the shared store must rewrite; `None` without a
    /// shared store.
    outbox: Option<Mutex<HashSet<String>>>,
    /// Wakes the shared store's writer when the outbox gains an entry.
    pub dirty_notify: Notify,
    metrics: Metrics,
    evict: Evict,
    /// The fleet's members (local and shared entries), for `Registry.Watch`.
    fleet: tokio::sync::watch::Sender<Vec<relay_proto::FleetMember>>,
}

impl Routes {
    /// `shared`: queue local changes for a shared store (Redis backend).
    pub fn new(
        routing: RoutingConfig,
        lease: Duration,
        dispatcher: String,
        shared: bool,
        metrics: Metrics,
    ) -> Self {
        let writers = Arc::new(Mutex::new(Writers {
            table: Table::new(lease),
            router: Router::new(routing),
        }));
        let source: std::sync::Weak<Mutex<Writers>> = Arc::downgrade(&writers);
        metrics.routing_series.attach(source);
        Routes {
            writers,
            plans: DashMap::new(),
            no_capacity: Mutex::new(HashSet::new()),
            next_session: AtomicU64::new(0),
            dispatcher,
            outbox: shared.then(|| Mutex::new(HashSet::new())),
            dirty_notify: Notify::new(),
            metrics,
            evict: Box::new(|_| {}),
            fleet: tokio::sync::watch::Sender::new(Vec::new()),
        }
    }

    /// Calls `evict` with each forward URL that no entry uses any more.
    pub fn with_evict(mut self, evict: impl Fn(&str) + Send + Sync + 'static) -> Self {
        self.evict = Box::new(evict);
        self
    }

    /// Follows the fleet's members: every server with an entry, local or shared.
    pub fn watch_fleet(&self) -> tokio::sync::watch::Receiver<Vec<relay_proto::FleetMember>> {
        self.fleet.subscribe()
    }

    /// Applies `event` to the table at `now` and carries its changes out.
    fn apply(&self, now: Instant, event: Event) -> Result<Vec<Change>, Refused> {
        let mut w = self.writers.lock();
        let changes = w.table.apply(now, event)?;
        let mut queued = false;
        for change in &changes {
            match change {
                Change::Gone {
                    server,
                    why,
                    url_in_use,
                } => {
                    let (id, zone) = (&server.server_id, &server.zone);
                    match why {
                        Gone::Left => info!(server_id = %id, %zone, "tunnel server left"),
                        Gone::LeaseExpired => {
                            self.metrics.lease_expiries.inc();
                            warn!(server_id = %id, "tunnel server dropped: no report within its lease");
                        }
                        Gone::Replaced => debug!(server_id = %id, "tunnel server entry replaced"),
                        Gone::Unshared => {
                            debug!(server_id = %id, "tunnel server gone from the shared registry")
                        }
                    }
                    if !url_in_use {
                        (self.evict)(&server.forward_url);
                    }
                }
                Change::Record(id) => {
                    if let Some(outbox) = &self.outbox {
                        outbox.lock().insert(id.clone());
                        queued = true;
                    }
                }
                Change::Routes(tid) => self.rebuild_one(&mut w, now, tid),
                Change::Fleet => {
                    let members = w.table.members();
                    self.fleet.send_if_modified(|old| {
                        let changed = *old != members;
                        if changed {
                            *old = members;
                        }
                        changed
                    });
                }
            }
        }
        let counts = w.table.counts();
        drop(w);
        self.metrics.tunnel_servers.set(counts.servers as i64);
        self.metrics.tunnels.set(counts.tunnels as i64);
        if queued {
            self.dirty_notify.notify_one();
        }
        Ok(changes)
    }

    /// Hands the parked NO_CAPACITY answers to the router.
    fn take_no_capacity(&self, router: &mut Router) {
        let parked = std::mem::take(&mut *self.no_capacity.lock());
        for (tid, sid) in parked {
            router.note_no_capacity(&tid, &sid);
        }
    }

    /// Rebuilds and publishes one tunnel id's plan.
    fn rebuild_one(&self, w: &mut Writers, now: Instant, tunnel_id: &str) {
        self.take_no_capacity(&mut w.router);
        let views = w.table.views(tunnel_id);
        w.router.update_one(now, tunnel_id, &views);
        match w.router.plan(tunnel_id) {
            Some(plan) => {
                self.plans.insert(tunnel_id.to_string(), plan);
            }
            None => {
                self.plans.remove(tunnel_id);
            }
        }
    }

    /// Rebuilds and publishes every plan not settled on its views (see
    /// [`crate::routing`]), stepping the spill shares that are due.
    fn rebuild_all(&self, w: &mut Writers, now: Instant) {
        self.take_no_capacity(&mut w.router);
        let views = w.table.all_views();
        let rebuilt = w.router.update(now, &views);
        self.plans.retain(|tid, _| views.contains_key(tid));
        for tid in rebuilt {
            match w.router.plan(tid) {
                // In place when the tunnel id has a plan: the tick rebuilds most plans while
                // the servers' load figures move, and a new key would copy the id each time.
                Some(plan) => match self.plans.get_mut(tid) {
                    Some(mut old) => *old = plan,
                    None => {
                        self.plans.insert(tid.to_string(), plan);
                    }
                },
                None => {
                    self.plans.remove(tid);
                }
            }
        }
    }

    /// A server opened a report stream. Replaces any earlier entry of the same server id,
    /// except a local one of another instance whose report stream is still up: two live
    /// servers claiming one id is a configuration error, refused rather than merged.
    pub fn join(&self, server: ServerInfo) -> Result<SessionId, Conflict> {
        let session = SessionId(self.next_session.fetch_add(1, Ordering::Relaxed) + 1);
        match self.apply(Instant::now(), Event::Join { session, server }) {
            Ok(_) => Ok(session),
            Err(Refused::Conflict(c)) => Err(c),
            Err(Refused::Stale) => unreachable!("a join has no session to be stale"),
        }
    }

    /// The server now holds streams of `tunnel_id`. False if the session is no longer current.
    pub fn tunnel_up(&self, session: SessionId, tunnel_id: &str) -> bool {
        let tunnel_id = tunnel_id.to_string();
        let event = Event::TunnelUp { session, tunnel_id };
        self.apply(Instant::now(), event).is_ok()
    }

    /// The server holds no stream of `tunnel_id` any more. False if the session is stale.
    pub fn tunnel_down(&self, session: SessionId, tunnel_id: &str) -> bool {
        let tunnel_id = tunnel_id.to_string();
        let event = Event::TunnelDown { session, tunnel_id };
        self.apply(Instant::now(), event).is_ok()
    }

    /// Stores the server's latest load figures (`partial`: only the tunnel ids whose
    /// figures changed; the others keep theirs). False if the session is stale.
    pub fn load(&self, session: SessionId, load: LoadFigures, partial: bool) -> bool {
        let event = Event::Load {
            session,
            load,
            partial,
        };
        self.apply(Instant::now(), event).is_ok()
    }

    /// The report stream ended: forget the server and all its tunnel ids (logged, and its
    /// forward channel evicted when no other entry uses it). Returns the server's info if
    /// the session was current.
    pub fn leave(&self, session: SessionId) -> Option<ServerInfo> {
        let changes = self.apply(Instant::now(), Event::Leave { session }).ok()?;
        changes.into_iter().find_map(|c| match c {
            Change::Gone { server, .. } => Some(server),
            _ => None,
        })
    }

    /// Drops local entries that have not reported within the lease (each logged, counted
    /// and its forward channel evicted when unused). Returns the servers whose lease expired.
    pub fn sweep(&self, now: Instant) -> Vec<ServerInfo> {
        let changes = self.apply(now, Event::ExpireLeases).unwrap_or_default();
        changes
            .into_iter()
            .filter_map(|c| match c {
                Change::Gone { server, .. } => Some(server),
                _ => None,
            })
            .collect()
    }

    /// This dispatcher's smoothed round trip to the server at `forward_url` (measured by
    /// `crate::latency`); `None` forgets it. Plans take it at the next routing tick.
    pub fn forward_rtt(&self, forward_url: &str, rtt_us: Option<u32>) {
        let event = Event::ForwardRtt {
            forward_url: forward_url.to_string(),
            rtt_us,
        };
        let _ = self.apply(Instant::now(), event);
    }

    /// `(server id, forward URL)` of every server in the table (local and shared).
    pub fn forward_targets(&self) -> Vec<(String, String)> {
        self.writers.lock().table.forward_targets()
    }

    /// The routing tick: expires leases, then steps every tunnel id's routing (spill decay
    /// and growth) without a table change.
    pub fn tick(&self, now: Instant) {
        self.sweep(now);
        let mut w = self.writers.lock();
        self.rebuild_all(&mut w, now);
    }

    /// Ids of the shared entries (servers known from the shared store).
    pub fn shared_ids(&self) -> Vec<String> {
        self.writers.lock().table.ids(false)
    }

    /// Replaces the shared entries with `records` read from the shared store. Servers that
    /// report here are skipped (the local entry is the fresher one). Shared entries missing
    /// from `records` are dropped as `prune` says.
    pub fn apply_shared(&self, records: Vec<ServerRecord>, prune: Prune) {
        let _ = self.apply(Instant::now(), Event::Shared { records, prune });
    }

    /// Local records to write to the shared store since the last call: the current record
    /// of each local entry that changed, `None` for one that is gone.
    pub fn take_dirty(&self) -> Vec<Publish> {
        let Some(outbox) = &self.outbox else {
            return Vec::new();
        };
        let ids = std::mem::take(&mut *outbox.lock());
        let w = self.writers.lock();
        ids.into_iter()
            .map(|id| {
                let record = w.table.local_record(&id, &self.dispatcher);
                (id, record)
            })
            .collect()
    }

    /// Puts back changes a failed write could not store (they are written as they are
    /// when the next write runs).
    pub fn restore_dirty(&self, items: Vec<Publish>) {
        if let Some(outbox) = &self.outbox {
            outbox.lock().extend(items.into_iter().map(|(id, _)| id));
        }
    }

    /// Current records of every local entry (rewritten after the shared store comes back).
    pub fn local_records(&self) -> Vec<Publish> {
        let w = self.writers.lock();
        w.table
            .ids(true)
            .into_iter()
            .map(|id| {
                let record = w.table.local_record(&id, &self.dispatcher);
                (id, record)
            })
            .collect()
    }

    /// The servers to try for a call of `tunnel_id`, first choice first; `None` when no
    /// server holds it. Reads the published plan: never waits on a rebuild.
    pub fn route(&self, tunnel_id: &str) -> Option<Pick> {
        let plan = self.plans.get(tunnel_id)?.clone();
        Some(plan.pick())
    }

    /// Per-call feedback: `server_id` answered NO_CAPACITY for `tunnel_id`. Parked until
    /// the next rebuild of the plans.
    pub fn note_no_capacity(&self, tunnel_id: &str, server_id: &str) {
        self.no_capacity
            .lock()
            .insert((tunnel_id.to_string(), server_id.to_string()));
    }

    /// Whether any current server uses `forward_url` (to drop cached channels).
    pub fn uses_forward_url(&self, forward_url: &str) -> bool {
        self.writers.lock().table.uses_forward_url(forward_url)
    }

    pub fn counts(&self) -> RouteCounts {
        self.writers.lock().table.counts()
    }

    /// The whole table for `/debug/routes` (see [`debug`]).
    pub fn snapshot(&self) -> serde_json::Value {
        let w = self.writers.lock();
        debug::routes(
            &w.table,
            &w.router,
            Instant::now(),
            relay_common::wall::now(),
        )
    }
}

#[cfg(test)]
mod tests;
