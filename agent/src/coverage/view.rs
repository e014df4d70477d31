//! What the actor publishes: the view `/systemcheck` and the status page show
//! (`CoverageView`, one `ServerReport` per server, the last coverage actions) and the
//! per-server gauges, both written after every plan (`CoverageActor::publish`).

use super::*;

/// One server as `/systemcheck` shows it (from the last tick's plan).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ServerReport {
    pub server_id: String,
    pub instance_id: String,
    pub zone: String,
    pub streams: u32,
    pub busy: u32,
    pub idle: u32,
    pub budget: u32,
    pub state: ReportedState,
    /// Seconds the server has been short without a break (0 when covered).
    pub short_for_s: u64,
    /// Smoothed time of the answered calls on its streams, from their head to their end as
    /// the stream saw them (upstream time included), in microseconds; `None` before the
    /// first answered call.
    pub call_time_us: Option<u32>,
}

/// A server's state as the view reports it: its coverage state from the last plan, or
/// lost (its path went silent or broke and none of the agent's streams is there). In the
/// JSON it is the state's name (`covered`, ..., `lost`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReportedState {
    Plan(State),
    Lost,
}

impl ReportedState {
    pub fn as_str(self) -> &'static str {
        match self {
            ReportedState::Plan(s) => s.as_str(),
            ReportedState::Lost => "lost",
        }
    }
}

impl Serialize for ReportedState {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.as_str())
    }
}

/// Compares by name, as the JSON reads (`state == "covered"`).
impl PartialEq<&str> for ReportedState {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

/// What the actor publishes after every tick.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct CoverageView {
    pub servers: Vec<ServerReport>,
    /// Landed streams, retiring ones included.
    pub streams_total: u32,
    /// Streams being opened (no hello yet).
    pub opening: u32,
    /// Live (non-retiring) streams across servers.
    pub live: u32,
    /// `coverage.grace`: how long a server carrying calls may stay short.
    pub grace_s: u64,
    /// The last [`RECENT_ACTIONS`] coverage actions carried out, newest first.
    pub recent_actions: Vec<ActionReport>,
}

/// How many coverage actions the view keeps.
pub const RECENT_ACTIONS: usize = 20;

/// One coverage action carried out, as its log line says it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ActionReport {
    /// When (wall clock, milliseconds since the Unix epoch).
    pub unix_ms: u64,
    pub server_id: String,
    /// `grow`, `fill`, `evacuate`, `recycle` or `retire`.
    pub action: &'static str,
    /// Streams opened or closed.
    pub count: u32,
    pub reason: String,
}

impl CoverageActor {
    pub(super) fn publish(&mut self, snap: &Snapshot, plan: &Plan) {
        // Metrics are per server id (what operators see): `Rows` adds up its instances.
        self.metrics.servers.update(|rows| {
            for s in snap.servers.iter().filter(|s| !s.streams.is_empty()) {
                let busy = s.streams.iter().filter(|st| st.busy).count() as u32;
                let idle = s.streams.len() as u32 - busy;
                let state = plan
                    .states
                    .iter()
                    .find(|p| p.server_id == s.server_id && p.instance_id == s.instance_id)
                    .map(|p| p.state);
                rows.instance(&s.server_id, idle, busy, state);
            }
            // Short-for for every server the tick planned (a server can be short while
            // holding no stream).
            for p in &plan.states {
                rows.short(&p.server_id, p.short_for);
            }
        });
        let live = self.streams.values().filter(|e| !e.retiring).count() as u32;
        self.metrics.streams_live.set(i64::from(live));
        let view = CoverageView {
            servers: plan
                .states
                .iter()
                .map(|p| ServerReport {
                    server_id: p.server_id.clone(),
                    instance_id: p.instance_id.clone(),
                    zone: p.zone.clone(),
                    streams: p.streams,
                    busy: p.busy,
                    idle: p.idle,
                    budget: p.budget,
                    // A server the agent lost holds none of its streams: shown as lost
                    // until one lands there again.
                    state: if p.streams == 0
                        && self
                            .lost
                            .contains_key(&(p.server_id.clone(), p.instance_id.clone()))
                    {
                        ReportedState::Lost
                    } else {
                        ReportedState::Plan(p.state)
                    },
                    short_for_s: p.short_for.as_secs(),
                    call_time_us: self
                        .servers
                        .get(&(p.server_id.clone(), p.instance_id.clone()))
                        .map(|i| i.call_time.micros())
                        .filter(|us| *us > 0),
                })
                .collect(),
            streams_total: self.streams.len() as u32,
            opening: self.opening.len() as u32,
            live,
            grace_s: self.settings.grace.as_secs(),
            recent_actions: self.recent.iter().rev().cloned().collect(),
        };
        self.view.send_replace(view);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reported_state_is_its_name_in_the_json() {
        for s in State::ALL {
            let json = serde_json::to_value(ReportedState::Plan(s)).unwrap();
            assert_eq!(json, s.as_str());
        }
        assert_eq!(serde_json::to_value(ReportedState::Lost).unwrap(), "lost");
        assert!(ReportedState::Plan(State::Covered) == "covered");
    }
}
