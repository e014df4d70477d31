//! The routing gauges (`relay_dispatcher_spill_share{tunnel_id}` and the
//! `relay_dispatcher_spills_total{tunnel_id}` series, exported at 0 with it;
//! `relay_dispatcher_server_rtt_seconds` and `relay_dispatcher_server_tier{server_id,
//! tunnel_id}`; per server `relay_dispatcher_server_load_ratio`,
//! `relay_dispatcher_server_calls_in_flight` and `relay_dispatcher_forward_rtt_seconds`;
//! the server and tunnel counts), set from the plans the registry rebuilds and the table.
//!
//! It remembers which label sets it exported, by tunnel id and by server, so a tunnel id or
//! a server that goes takes its series with it and a rebuild of one tunnel id touches only
//! its own series. A rebuild whose figures are the ones exported last (the spill share,
//! each server's RTT and tier: a tunnel id's idle and busy streams change its plan, not
//! these) sets nothing: each series set is a label lookup, and with thousands of tunnel
//! ids opening streams those were a large part of the registry's work.

use super::table::{RouteCounts, Table};
use crate::metrics::Metrics;
use crate::routing::{ServerView, TunnelStatus};
use std::collections::{HashMap, HashSet};
use std::sync::Arc;

/// What one tunnel id's series hold.
struct Exported {
    servers: HashSet<String>,
    /// The spill share (its bits) and each server's RTT (µs) and tier, in views order.
    figures: (u64, Vec<(Arc<str>, u32, i64)>),
}

pub struct Gauges {
    metrics: Metrics,
    /// Exported server ids and figures, by tunnel id.
    exported: HashMap<String, Exported>,
    /// Server ids with per-server series.
    servers: HashSet<String>,
}

impl Gauges {
    pub fn new(metrics: Metrics) -> Self {
        Gauges {
            metrics,
            exported: HashMap::new(),
            servers: HashSet::new(),
        }
    }

    pub fn counts(&self, counts: RouteCounts) {
        self.metrics.tunnel_servers.set(counts.servers as i64);
        self.metrics.tunnels.set(counts.tunnels as i64);
    }

    /// Sets each server's load, calls in flight and forward RTT from `table`; removes the
    /// series of servers no longer in it.
    pub fn servers(&mut self, table: &Table) {
        let m = &self.metrics;
        let mut now = HashSet::new();
        for e in table.entries() {
            let id = e.info.server_id.as_str();
            m.server_load
                .with_label_values(&[id])
                .set(f64::from(e.cpu_permille()) / 1000.0);
            let in_flight = e.load.as_ref().map_or(0, |(_, l)| l.calls_in_flight);
            m.server_calls_in_flight
                .with_label_values(&[id])
                .set(i64::from(in_flight));
            match table.forward_rtt_of(e) {
                Some(us) => m
                    .forward_rtt
                    .with_label_values(&[id])
                    .set(f64::from(us) / 1e6),
                None => {
                    let _ = m.forward_rtt.remove_label_values(&[id]);
                }
            }
            now.insert(id.to_string());
        }
        for gone in self.servers.difference(&now) {
            let _ = m.server_load.remove_label_values(&[gone]);
            let _ = m.server_calls_in_flight.remove_label_values(&[gone]);
            let _ = m.forward_rtt.remove_label_values(&[gone]);
        }
        self.servers = now;
    }

    /// Sets one tunnel id's series from its routing `status` and the servers holding it;
    /// removes them all when `status` is `None` (no server holds it).
    pub fn tunnel(&mut self, tunnel_id: &str, status: Option<&TunnelStatus>, views: &[ServerView]) {
        let m = &self.metrics;
        let Some(status) = status.filter(|_| !views.is_empty()) else {
            if let Some(gone) = self.exported.remove(tunnel_id) {
                let _ = m.spill_share.remove_label_values(&[tunnel_id]);
                let _ = m.spills.remove_label_values(&[tunnel_id]);
                for s in gone.servers {
                    let _ = m.server_rtt.remove_label_values(&[&s, tunnel_id]);
                    let _ = m.server_tier.remove_label_values(&[&s, tunnel_id]);
                }
            }
            return;
        };
        let tier_of = |server_id: &str| {
            status
                .tiers
                .iter()
                .find(|(s, _)| &**s == server_id)
                .map(|(_, k)| *k as i64)
                .unwrap_or(-1)
        };
        let figures = (
            status.spill_share.to_bits(),
            views
                .iter()
                .map(|v| (v.server_id.clone(), v.rtt_us, tier_of(&v.server_id)))
                .collect::<Vec<_>>(),
        );
        if self
            .exported
            .get(tunnel_id)
            .is_some_and(|e| e.figures == figures)
        {
            return;
        }
        m.spill_share
            .with_label_values(&[tunnel_id])
            .set(status.spill_share);
        // At 0 from the tunnel id's first plan, so `rate()` sees its first spill.
        m.spills.with_label_values(&[tunnel_id]);
        let mut now: HashSet<String> = HashSet::with_capacity(views.len());
        for v in views {
            m.server_rtt
                .with_label_values(&[&v.server_id, tunnel_id])
                .set(f64::from(v.rtt_us) / 1e6);
            let tier = tier_of(&v.server_id);
            m.server_tier
                .with_label_values(&[&v.server_id, tunnel_id])
                .set(tier);
            now.insert(v.server_id.to_string());
        }
        if let Some(before) = self.exported.get(tunnel_id) {
            for s in before.servers.difference(&now) {
                let _ = m.server_rtt.remove_label_values(&[s, tunnel_id]);
                let _ = m.server_tier.remove_label_values(&[s, tunnel_id]);
            }
        }
        self.exported.insert(
            tunnel_id.to_string(),
            Exported {
                servers: now,
                figures,
            },
        );
    }

    /// Removes the series of every tunnel id not in `keep`.
    pub fn retain(&mut self, keep: &HashMap<String, Vec<ServerView>>) {
        let gone: Vec<String> = self
            .exported
            .keys()
            .filter(|t| !keep.contains_key(*t))
            .cloned()
            .collect();
        for tid in gone {
            self.tunnel(&tid, None, &[]);
        }
    }
}
