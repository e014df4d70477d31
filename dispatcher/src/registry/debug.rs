//! `/debug/routes`: the table and the routing state as JSON, for a person reading it.
//!
//! Built from a table and a router it is handed, with both clocks passed in (the table
//! keeps only monotonic instants; wall times are derived from their ages).

use super::table::{Entry, Origin, Table};
use crate::routing::Router;
use std::collections::BTreeMap;
use std::time::{Duration, SystemTime};
use tokio::time::Instant;

fn ms(d: Duration) -> u64 {
    d.as_millis().min(u128::from(u64::MAX)) as u64
}

/// Per tunnel id the servers with their figures, tier, the home, the spill share and why it
/// last rose; per server its origin, lease, load (calls in flight, CPU) and this
/// dispatcher's measured leg to it. `wall` is the wall clock at `now`.
pub fn routes(table: &Table, router: &Router, now: Instant, wall: SystemTime) -> serde_json::Value {
    let lease = table.lease();
    let age = |t: Instant| now.saturating_duration_since(t);
    let unix_ms = |t: Instant| {
        wall.checked_sub(age(t))
            .and_then(|w| w.duration_since(SystemTime::UNIX_EPOCH).ok())
            .map_or(0, ms)
    };
    let mut by_tunnel: BTreeMap<&str, Vec<&Entry>> = BTreeMap::new();
    for e in table.entries() {
        for tid in e.tunnels.keys() {
            by_tunnel.entry(tid.as_str()).or_default().push(e);
        }
    }
    let tunnels: Vec<serde_json::Value> = by_tunnel
        .into_iter()
        .map(|(tid, mut entries)| {
            let status = router.status(tid);
            let order: Vec<String> = router
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
                    let at = e.tunnels[tid];
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
                        "announced_unix_ms": unix_ms(at),
                        "announced_age_ms": ms(age(at)),
                        "draining": e.draining(),
                        "load": figures,
                        "tier": tier,
                    })
                })
                .collect();
            serde_json::json!({
                "tunnel_id": tid,
                "policy": router.policy(),
                "home": status.as_ref().and_then(|s| s.home.as_deref().map(str::to_string)),
                "spill_share": status.as_ref().map(|s| s.spill_share).unwrap_or(0.0),
                "spill_reason": status.as_ref().and_then(|s| s.spill_reason),
                "order": order,
                "servers": servers,
            })
        })
        .collect();
    let mut entries: Vec<&Entry> = table.entries().collect();
    entries.sort_by(|a, b| a.info.server_id.cmp(&b.info.server_id));
    let servers: Vec<serde_json::Value> = entries
        .into_iter()
        .map(|e| {
            let seen = age(e.seen);
            let local = matches!(e.origin, Origin::Local(_));
            serde_json::json!({
                "server_id": e.info.server_id,
                "zone": e.info.zone,
                "forward_url": e.info.forward_url,
                "origin": if local { "local" } else { "shared" },
                "connected_age_ms": ms(age(e.joined)),
                "seen_age_ms": ms(seen),
                "lease_left_ms": local.then(|| ms(lease.saturating_sub(seen))),
                "tunnels": e.tunnels.len(),
                "draining": e.draining(),
                "calls_in_flight": e.load.as_ref().map(|(_, l)| l.calls_in_flight),
                "cpu_permille": e.load.as_ref().map(|(_, l)| l.cpu_permille),
                "forward_rtt_us": table.forward_rtt_of(e),
                "load_age_ms": e.load.as_ref().map(|(at, _)| ms(age(*at))),
            })
        })
        .collect();
    serde_json::json!({"tunnels": tunnels, "servers": servers})
}
