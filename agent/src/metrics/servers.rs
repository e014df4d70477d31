//! The per-server coverage series: `grpc_tunnel_server_streams{server_id,state}`,
//! `grpc_tunnel_coverage_state{server_id,state}` and
//! `grpc_tunnel_server_short_seconds{server_id}`. [`ServerTable`] keeps one small row per
//! server id, which the sizing actor rewrites after every plan, and is the Prometheus
//! collector that turns the rows into those series when `/metrics` is scraped.
//!
//! Which series exist: a server id holding streams has its idle and busy series and one
//! state series per [`State`] (all 0 until a plan has given it a state; a plan that gives
//! none leaves the last one shown); a server id the plan lists has its short-for series.
//!
//! It adds up a server id's instances as [`Rows::instance`] says and decides nothing else:
//! the rows say what the actor tells them.

use super::State;
use parking_lot::Mutex;
use prometheus::core::{Collector, Desc};
use prometheus::proto::{MetricFamily, MetricType};
use relay_common::scraped::{family, gauge};
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

#[cfg(test)]
mod tests;

/// The three series' names, help texts and label names (in name order, as the text format
/// writes them), in the order of [`ServerTable::descs`].
const SERIES: [(&str, &str, &[&str]); 3] = [
    (
        "grpc_tunnel_server_streams",
        "Live tunnel streams of this agent per tunnel server, idle or busy",
        &["server_id", "state"],
    ),
    (
        "grpc_tunnel_coverage_state",
        "Coverage state of each tunnel server as the last sizing tick judged it (1 = current state)",
        &["server_id", "state"],
    ),
    (
        "grpc_tunnel_server_short_seconds",
        "How long each tunnel server has been short of busy + reserve without a break (0 when covered)",
        &["server_id"],
    ),
];

/// The per-server coverage series of one agent, kept as rows and built at scrape time.
/// Cheap to clone (shared); register it once on the agent's `Registry`.
#[derive(Clone)]
pub struct ServerTable {
    /// One row per server id with a series, in server id order.
    rows: Arc<Mutex<BTreeMap<String, Row>>>,
    /// What the collector exports, as [`SERIES`] lists it.
    descs: Arc<[Desc; 3]>,
}

/// One server id's figures.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct Row {
    /// The stream and state series: `Some` while the server id holds streams.
    streams: Option<Streams>,
    /// Whole seconds the server id has been short: `Some` while the plan lists it.
    short_s: Option<u64>,
    /// The streams of the update under way ([`ServerTable::update`]); `None` between
    /// updates.
    next: Option<Streams>,
}

/// A server id's streams, summed over its instances, and its coverage state.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Streams {
    idle: u32,
    busy: u32,
    /// The state shown; `None` until a plan gave one (every state series then shows 0).
    state: Option<State>,
    /// Streams of the instance whose state is shown: the one holding the most wins.
    held: u32,
}

/// The table while [`ServerTable::update`] rewrites it.
pub struct Rows<'a> {
    rows: &'a mut BTreeMap<String, Row>,
}

impl ServerTable {
    pub fn new() -> Result<Self, prometheus::Error> {
        let desc = |(name, help, labels): (&str, &str, &[&str])| {
            Desc::new(
                name.to_owned(),
                help.to_owned(),
                labels.iter().map(|l| (*l).to_owned()).collect(),
                HashMap::new(),
            )
        };
        let [streams, state, short] = SERIES;
        Ok(ServerTable {
            rows: Arc::default(),
            descs: Arc::new([desc(streams)?, desc(state)?, desc(short)?]),
        })
    }

    /// Rewrites the rows in one lock: `write` states every server id's figures for this
    /// plan through [`Rows`], and a server id it does not mention loses its series. A row
    /// whose figures did not change is written in place; only a server id new to the
    /// table allocates. `write` runs under the lock a scrape takes: it should only count.
    pub fn update(&self, write: impl FnOnce(&mut Rows<'_>)) {
        let mut rows = self.rows.lock();
        for row in rows.values_mut() {
            row.short_s = None;
            row.next = None;
        }
        write(&mut Rows { rows: &mut rows });
        for row in rows.values_mut() {
            let shown = row.streams.and_then(|s| s.state);
            row.streams = row.next.take().map(|next| Streams {
                state: next.state.or(shown),
                ..next
            });
        }
        rows.retain(|_, row| row.streams.is_some() || row.short_s.is_some());
    }

    /// Drops every row (the agent stopped: it holds no streams and plans no more).
    pub fn clear(&self) {
        self.rows.lock().clear();
    }
}

impl Rows<'_> {
    /// One instance of `server_id` holding `idle` + `busy` streams (at least one), in the
    /// state the plan gave it (`None`: the plan did not list it). The server id's figures
    /// are its instances' streams added up and the state of the instance holding the most
    /// (the later one on a tie); when that instance has no state, the last one shown stays.
    pub fn instance(&mut self, server_id: &str, idle: u32, busy: u32, state: Option<State>) {
        let held = idle + busy;
        let row = self.row(server_id);
        match &mut row.next {
            None => {
                row.next = Some(Streams {
                    idle,
                    busy,
                    state,
                    held,
                })
            }
            Some(next) => {
                next.idle += idle;
                next.busy += busy;
                if held >= next.held {
                    next.state = state;
                    next.held = held;
                }
            }
        }
    }

    /// One planned instance of `server_id`, short for `short` (zero when covered): the
    /// server id shows the longest of its instances, in whole seconds.
    pub fn short(&mut self, server_id: &str, short: Duration) {
        let secs = short.as_secs();
        let row = self.row(server_id);
        row.short_s = Some(row.short_s.map_or(secs, |s| s.max(secs)));
    }

    fn row(&mut self, server_id: &str) -> &mut Row {
        // Looked up by `&str` first: the id is copied only the first time it is seen.
        if !self.rows.contains_key(server_id) {
            self.rows.insert(server_id.to_owned(), Row::default());
        }
        self.rows
            .get_mut(server_id)
            .expect("the row was inserted above")
    }
}

impl Collector for ServerTable {
    fn desc(&self) -> Vec<&Desc> {
        self.descs.iter().collect()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        let [streams, state, short] = &*self.descs;
        let (mut streams_m, mut state_m, mut short_m) = (Vec::new(), Vec::new(), Vec::new());
        // Built under the lock: O(servers) small allocations, once per scrape.
        for (id, row) in self.rows.lock().iter() {
            if let Some(s) = row.streams {
                streams_m.push(gauge(
                    &[("server_id", id), ("state", "busy")],
                    s.busy.into(),
                ));
                streams_m.push(gauge(
                    &[("server_id", id), ("state", "idle")],
                    s.idle.into(),
                ));
                for st in State::ALL {
                    let value = f64::from(u8::from(s.state == Some(st)));
                    state_m.push(gauge(&[("server_id", id), ("state", st.as_str())], value));
                }
            }
            if let Some(secs) = row.short_s {
                short_m.push(gauge(&[("server_id", id)], secs as f64));
            }
        }
        vec![
            family(streams, MetricType::GAUGE, streams_m),
            family(state, MetricType::GAUGE, state_m),
            family(short, MetricType::GAUGE, short_m),
        ]
    }
}
