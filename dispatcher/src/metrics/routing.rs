//! The routing series, built when `/metrics` is scraped: per tunnel id
//! `relay_dispatcher_spill_share{tunnel_id}`, `relay_dispatcher_spills_total{tunnel_id}`,
//! `relay_dispatcher_server_rtt_seconds{server_id,tunnel_id}` and
//! `relay_dispatcher_server_tier{server_id,tunnel_id}`; per tunnel server
//! `relay_dispatcher_server_load_ratio`, `relay_dispatcher_server_calls_in_flight` and
//! `relay_dispatcher_forward_rtt_seconds` (only once measured).
//!
//! They are read from the registry's router and table ([`RoutingFigures`]) at each scrape,
//! not kept as Prometheus series. A series kept in a metric vector holds its label pairs
//! as owned strings, a hash map entry and a shared atomic: with a series per tunnel id and
//! server (22 per tunnel id on 10 servers), that was about 10 KB per tunnel id in each
//! dispatcher, 100 MB for 10,000 agents, and each change of a figure was a label lookup
//! under the vector's lock on the routing tick (and the per-server ones were three label
//! lookups per server on every report handled). Built at scrape time they cost nothing
//! between scrapes; a scrape copies the figures out under the registry's lock (the same
//! walk the routing tick makes four times a second) and builds the page outside it.
//!
//! The counter of spilled calls lives with the tunnel id's plans
//! (`crate::routing::TunnelPlan::pick` counts it), so the call path counts a spill with an
//! atomic increment, not a label lookup.

use parking_lot::Mutex;
use prometheus::core::{Collector, Desc};
use prometheus::proto::{Metric, MetricFamily, MetricType};
use relay_common::scraped::{counter, family, gauge};
use std::collections::HashMap;
use std::sync::{Arc, Weak};

/// One tunnel id's routing figures, as its series show them.
#[derive(Debug, Clone, PartialEq)]
pub struct TunnelRow {
    pub tunnel_id: String,
    /// Share of its new calls spilled away from its home server.
    pub spill_share: f64,
    /// Calls whose first choice was a spill.
    pub spills: u64,
    /// Each server holding it: server id, the smoothed RTT of a call's path through it
    /// (microseconds, 0 = unknown) and its latency tier (-1 = not routable).
    pub servers: Vec<(Arc<str>, u32, i64)>,
}

/// One tunnel server's figures, as its series show them.
#[derive(Debug, Clone, PartialEq)]
pub struct ServerRow {
    pub server_id: String,
    /// Its reported load: smoothed CPU use out of the CPU it may use, 0 to 1.
    pub load_ratio: f64,
    /// Calls in flight it reports (all tunnel ids).
    pub calls_in_flight: u32,
    /// This dispatcher's smoothed round trip to it, microseconds; `None` until measured.
    pub forward_rtt_us: Option<u32>,
}

/// Every series' figures, taken at once.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RoutingRows {
    pub servers: Vec<ServerRow>,
    pub tunnels: Vec<TunnelRow>,
}

/// Where the series are read from (the registry's writers).
pub trait RoutingFigures: Send + Sync {
    /// The figures of every server and of every tunnel id some server holds, as of now.
    fn routing_rows(&self) -> RoutingRows;
}

/// The families' descriptions, in [`RoutingSeries::collect`] order.
const FAMILIES: [(&str, &str, MetricType, &[&str]); 7] = [
    (
        "relay_dispatcher_spill_share",
        "Share of a tunnel id's new calls spilled away from its home server",
        MetricType::GAUGE,
        &["tunnel_id"],
    ),
    (
        "relay_dispatcher_spills_total",
        "Calls whose first choice was a spill away from their tunnel id's home server, by tunnel id",
        MetricType::COUNTER,
        &["tunnel_id"],
    ),
    (
        "relay_dispatcher_server_rtt_seconds",
        "Smoothed round-trip time of a call's path through a tunnel server to a tunnel id's agent streams: this dispatcher's leg plus the server's (0 until both are measured)",
        MetricType::GAUGE,
        &["server_id", "tunnel_id"],
    ),
    (
        "relay_dispatcher_server_tier",
        "Latency tier of a tunnel server for a tunnel id (0 = best, -1 = not routable)",
        MetricType::GAUGE,
        &["server_id", "tunnel_id"],
    ),
    (
        "relay_dispatcher_server_load_ratio",
        "Load a tunnel server reports: its smoothed CPU use out of the CPU it may use (0 to 1), weighed by routing",
        MetricType::GAUGE,
        &["server_id"],
    ),
    (
        "relay_dispatcher_server_calls_in_flight",
        "Calls in flight a tunnel server reports (all tunnel ids)",
        MetricType::GAUGE,
        &["server_id"],
    ),
    (
        "relay_dispatcher_forward_rtt_seconds",
        "Smoothed round-trip time from this dispatcher to a tunnel server (Forward.Probe on the connection calls use)",
        MetricType::GAUGE,
        &["server_id"],
    ),
];

/// The routing series: a collector registered once with the other metrics; the registry
/// attaches itself as their source. Before it does (or once it is gone) the families are
/// empty.
#[derive(Clone)]
pub struct RoutingSeries {
    descs: Arc<Vec<Desc>>,
    source: Arc<Mutex<Option<Weak<dyn RoutingFigures>>>>,
}

impl RoutingSeries {
    pub fn new() -> Result<Self, prometheus::Error> {
        let descs = FAMILIES
            .iter()
            .map(|(name, help, _, labels)| {
                Desc::new(
                    name.to_string(),
                    help.to_string(),
                    labels.iter().map(|l| l.to_string()).collect(),
                    HashMap::new(),
                )
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(RoutingSeries {
            descs: Arc::new(descs),
            source: Arc::new(Mutex::new(None)),
        })
    }

    /// Reads the series from `source` from now on (held weakly: the source owns the
    /// metrics, not the other way round).
    pub fn attach(&self, source: Weak<dyn RoutingFigures>) {
        *self.source.lock() = Some(source);
    }

    fn rows(&self) -> RoutingRows {
        let source = self.source.lock().as_ref().and_then(Weak::upgrade);
        source.map(|s| s.routing_rows()).unwrap_or_default()
    }
}

impl Collector for RoutingSeries {
    fn desc(&self) -> Vec<&Desc> {
        self.descs.iter().collect()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        let RoutingRows { servers, tunnels } = self.rows();
        let pairs: usize = tunnels.iter().map(|r| r.servers.len()).sum();
        let mut metrics: [Vec<Metric>; 7] = [
            Vec::with_capacity(tunnels.len()),
            Vec::with_capacity(tunnels.len()),
            Vec::with_capacity(pairs),
            Vec::with_capacity(pairs),
            Vec::with_capacity(servers.len()),
            Vec::with_capacity(servers.len()),
            Vec::with_capacity(servers.len()),
        ];
        for r in &tunnels {
            let tid = [("tunnel_id", r.tunnel_id.as_str())];
            metrics[0].push(gauge(&tid, r.spill_share));
            metrics[1].push(counter(&tid, r.spills));
            for (server_id, rtt_us, tier) in &r.servers {
                let pair = [("server_id", &**server_id), ("tunnel_id", &r.tunnel_id)];
                metrics[2].push(gauge(&pair, f64::from(*rtt_us) / 1e6));
                metrics[3].push(gauge(&pair, *tier as f64));
            }
        }
        for s in &servers {
            let id = [("server_id", s.server_id.as_str())];
            metrics[4].push(gauge(&id, s.load_ratio));
            metrics[5].push(gauge(&id, f64::from(s.calls_in_flight)));
            if let Some(us) = s.forward_rtt_us {
                metrics[6].push(gauge(&id, f64::from(us) / 1e6));
            }
        }
        FAMILIES
            .iter()
            .zip(self.descs.iter())
            .zip(metrics)
            .map(|(((_, _, kind, _), desc), metrics)| family(desc, *kind, metrics))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus::Registry;
    use relay_common::admin::render_metrics as text;

    struct Fixed(RoutingRows);

    impl RoutingFigures for Fixed {
        fn routing_rows(&self) -> RoutingRows {
            self.0.clone()
        }
    }

    #[test]
    fn the_series_show_the_sources_figures_and_go_with_it() {
        let registry = Registry::new();
        let series = RoutingSeries::new().unwrap();
        registry.register(Box::new(series.clone())).unwrap();
        assert_eq!(text(&registry), "", "no source: no series");
        let source: Arc<dyn RoutingFigures> = Arc::new(Fixed(RoutingRows {
            servers: vec![
                ServerRow {
                    server_id: "a".into(),
                    load_ratio: 0.5,
                    calls_in_flight: 3,
                    forward_rtt_us: Some(1_000),
                },
                ServerRow {
                    server_id: "b".into(),
                    load_ratio: 0.0,
                    calls_in_flight: 0,
                    forward_rtt_us: None,
                },
            ],
            tunnels: vec![TunnelRow {
                tunnel_id: "t".into(),
                spill_share: 0.25,
                spills: 7,
                servers: vec![(Arc::from("b"), 2_000, 1), (Arc::from("a"), 1_500, 0)],
            }],
        }));
        series.attach(Arc::downgrade(&source));
        let page = text(&registry);
        for line in [
            "relay_dispatcher_spill_share{tunnel_id=\"t\"} 0.25",
            "relay_dispatcher_spills_total{tunnel_id=\"t\"} 7",
            "relay_dispatcher_server_rtt_seconds{server_id=\"a\",tunnel_id=\"t\"} 0.0015",
            "relay_dispatcher_server_rtt_seconds{server_id=\"b\",tunnel_id=\"t\"} 0.002",
            "relay_dispatcher_server_tier{server_id=\"a\",tunnel_id=\"t\"} 0",
            "relay_dispatcher_server_tier{server_id=\"b\",tunnel_id=\"t\"} 1",
            "relay_dispatcher_server_load_ratio{server_id=\"a\"} 0.5",
            "relay_dispatcher_server_load_ratio{server_id=\"b\"} 0",
            "relay_dispatcher_server_calls_in_flight{server_id=\"a\"} 3",
            "relay_dispatcher_forward_rtt_seconds{server_id=\"a\"} 0.001",
            "# TYPE relay_dispatcher_spills_total counter",
            "# TYPE relay_dispatcher_server_tier gauge",
        ] {
            assert!(page.lines().any(|l| l == line), "{line} in\n{page}");
        }
        assert!(
            !page.contains("forward_rtt_seconds{server_id=\"b\""),
            "an unmeasured leg has no series: {page}"
        );
        // Sorted by server id within a family, as the text format's readers expect.
        let a = page.find("server_tier{server_id=\"a\"").unwrap();
        let b = page.find("server_tier{server_id=\"b\"").unwrap();
        assert!(a < b, "{page}");
        drop(source);
        assert_eq!(text(&registry), "", "the source went: so did its series");
    }
}
