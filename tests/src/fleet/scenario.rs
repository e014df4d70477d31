//! Scenario files: what a fleet run simulates, as TOML (`deny_unknown_fields`), validated
//! once with errors that name the key and the allowed range. The built-in scenarios are
//! embedded from `tests/scenarios/*.toml`.
//!
//! This module parses and checks; it must not start anything.

use relay_agent::coverage::plan::CoverageConfig;
use relay_common::config::ConfigError;
use serde::Deserialize;
use std::path::Path;
use std::time::Duration;

/// Built-in scenarios: (name, TOML text).
pub const BUILTIN: &[(&str, &str)] = &[
    ("uniform", include_str!("../../scenarios/uniform.toml")),
    ("zone-skew", include_str!("../../scenarios/zone-skew.toml")),
    (
        "unfillable",
        include_str!("../../scenarios/unfillable.toml"),
    ),
    (
        "burst-1000",
        include_str!("../../scenarios/burst-1000.toml"),
    ),
    (
        "server-restart",
        include_str!("../../scenarios/server-restart.toml"),
    ),
    (
        "rolling-drain",
        include_str!("../../scenarios/rolling-drain.toml"),
    ),
    (
        "server-returns",
        include_str!("../../scenarios/server-returns.toml"),
    ),
    (
        "many-agents",
        include_str!("../../scenarios/many-agents.toml"),
    ),
    (
        "busy-server",
        include_str!("../../scenarios/busy-server.toml"),
    ),
    (
        "busy-server-blind",
        include_str!("../../scenarios/busy-server-blind.toml"),
    ),
    (
        "haproxy-90-10",
        include_str!("../../scenarios/haproxy-90-10.toml"),
    ),
    (
        "ten-thousand-agents",
        include_str!("../../scenarios/ten-thousand-agents.toml"),
    ),
];

/// One simulated fleet run.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Scenario {
    /// Name shown in the report.
    pub name: String,
    /// One line on what the scenario shows.
    pub description: String,
    /// How long load is sent (faults and bursts are placed within it).
    #[serde(with = "humantime_serde")]
    pub duration: Duration,
    /// Seed of every random choice (tunnel ids of calls, upstream latency, placement).
    pub seed: u64,
    pub servers: Servers,
    pub agents: Agents,
    pub dispatchers: Dispatchers,
    /// The dispatcher's `[routing]` settings (same keys as its config).
    pub routing: relay_dispatcher::RoutingConfig,
    pub upstream: UpstreamSpec,
    pub load: Load,
    /// Faults on the timeline, in any order.
    pub faults: Vec<Fault>,
    /// The scenario's headline expectations, checked at the end of the run.
    pub expect: Expect,
}

/// `[servers]`: the tunnel servers and how the load balancer places new streams.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Servers {
    /// Tunnel servers running at the start (embedded mode), 1..=16.
    pub count: usize,
    /// Extra slots started later by an `add_server` fault, 0..=8.
    pub standby: usize,
    /// Zone of each server in order; the rest get `zone-<n>`.
    pub zones: Vec<String>,
    /// Where the load balancer places each new agent stream.
    pub placement: Placement,
    /// `placement = "weighted"`: weight per server index (zone skew), e.g. `[80, 10, 10]`.
    pub weights: Vec<u32>,
    /// `placement = "unfillable"`: the 1-based server that never gets a new stream.
    pub unfillable: usize,
    /// Tunnel server `queue_timeout`: longest a call waits for an idle stream.
    #[serde(with = "humantime_serde")]
    pub queue_timeout: Duration,
    /// Tunnel server `max_queue_per_tunnel`.
    pub max_queue: usize,
    /// Each server advertises its agent listener as `direct_url`, so agents with
    /// `[agents.coverage] direct_growth = true` open missing streams straight to it.
    pub direct: bool,
    /// The load-balancer fixture routes an open that names a server (agents with
    /// `[agents.coverage] steered_opens = true`) to it, as HAProxy's `use-server` rules on
    /// the `relay-server` header do (the shipped config has them); the other opens are
    /// placed by `placement`.
    pub route_by_name: bool,
    /// What places the agents' streams: the in-process fixture (`placement`), or a real
    /// HAProxy (`haproxy`: HTTP/2 both sides, each server at its `weights`, every one 1
    /// when unset; needs the haproxy binary).
    pub balancer: Balancer,
    /// The servers' `liveness_interval`: how often an agent connection with nothing on it
    /// gets a liveness ping on one of its idle streams (0 = off). Every server pings every
    /// agent connection: 10,000 idle agents on 10 servers at the default 750 ms are 133,000
    /// pings a second, more than one small machine running the whole fleet carries.
    #[serde(with = "humantime_serde")]
    pub liveness_interval: Duration,
    /// The servers' `liveness_timeout`: a liveness ping unanswered this long closes every
    /// stream of that agent connection. An agent answers from its worker's thread, shared
    /// by thousands of agents in a fleet this tool runs on one machine.
    #[serde(with = "humantime_serde")]
    pub liveness_timeout: Duration,
    /// How long an HTTP/2 PING on an agent connection may go unanswered, on both ends (the
    /// servers' `[agent_h2]` and the agents' `[tunnel_h2]` `keepalive_timeout`; default
    /// theirs, 2 s). hyper checks a PING's deadline before it reads what arrived, so a
    /// process that was not scheduled for that long closes its connections even though the
    /// peer answered: thousands of agents on one worker thread, and ten servers and a
    /// balancer in one process, are such processes on a small machine. A connection between
    /// the balancer and a server carries thousands of agents' streams.
    #[serde(with = "humantime_serde")]
    pub tunnel_keepalive_timeout: Duration,
}

/// The load balancer in front of the tunnel servers' agent listeners.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum Balancer {
    /// `crate::lb`: placement by policy, changeable mid-run (`set_placement`).
    Fixture,
    /// `crate::haproxy`: a real HAProxy with the shipped config's settings.
    Haproxy,
}

/// Stream placement policy of the load-balancer fixture.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum Placement {
    Uniform,
    RoundRobin,
    /// The server with the fewest open streams (HAProxy's `balance leastconn`).
    Leastconn,
    Weighted,
    Unfillable,
}

/// `[agents]`: the simulated agents, one tunnel id each.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Agents {
    /// Agents (= tunnel ids), 1..=20000.
    pub count: usize,
    /// Worker processes the agents run in (0..=64): 0 runs them in this process (embedded
    /// mode), N > 0 splits them over N children of this binary (`relay-fleet worker`).
    pub workers: usize,
    /// With workers: agents started per second over the fleet (0 = all at once, 0..=100000),
    /// so that the first opens do not storm the tunnel servers.
    pub start_rate: f64,
    /// The agents' `[coverage]` settings (same keys as the agent config).
    pub coverage: CoverageConfig,
}

/// `[dispatchers]`: how many dispatchers run; every tunnel server reports to each, and
/// the callers' calls alternate between their fronts.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Dispatchers {
    /// 1..=4.
    pub count: usize,
}

impl Default for Dispatchers {
    fn default() -> Self {
        Dispatchers { count: 1 }
    }
}

/// `[upstream]`: the simulated upstream every agent calls.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct UpstreamSpec {
    /// Mean delay before each response head.
    #[serde(with = "humantime_serde")]
    pub latency: Duration,
    /// Shape of the delay around `latency`.
    pub distribution: Distribution,
    /// Response body bytes, 0..=16 MiB (0: a short `/hello` answer).
    pub response_bytes: u64,
    /// Request body bytes, 0..=16 MiB (> 0: the call is a `POST /echo`, echoed back).
    pub request_bytes: u64,
}

/// Upstream delay distribution.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum Distribution {
    /// Always `latency`.
    Fixed,
    /// Uniform in [0.5, 1.5] x latency.
    Uniform,
    /// Exponential with mean `latency` (capped at 20 x latency).
    Exponential,
}

/// `[load]`: calls over time.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Load {
    /// Calls per second from the start, 0..=50000.
    pub rate: f64,
    /// Calls the load generator keeps in flight at most; arrivals beyond it are counted
    /// as `skipped` (not sent). 1..=20000.
    pub max_in_flight: usize,
    /// Share of calls (0..=1) that go to the first `hot_tunnels` tunnel ids; the rest
    /// spread uniformly over all.
    pub hot_share: f64,
    /// Tunnel ids that get `hot_share`, 1..=agents.
    pub hot_tunnels: usize,
    /// Deadline of one call, sent to the relay in `x-relay-timeout-ms`: a success after
    /// it is `client_timeout`, no answer by 5 s after it is a lost call.
    #[serde(with = "humantime_serde")]
    pub call_timeout: Duration,
    /// Rate changes: from `at`, the rate moves linearly over `ramp` to `rate`.
    pub phases: Vec<Phase>,
    /// Bursts: `calls` calls at once at `at` to one tunnel id (beyond `max_in_flight`).
    pub bursts: Vec<Burst>,
    /// Closed loop besides the rate: this many callers, each starting its next call when
    /// its last one is answered, from the start for the whole duration. 0..=5000.
    pub concurrency: usize,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Phase {
    #[serde(with = "humantime_serde")]
    pub at: Duration,
    pub rate: f64,
    #[serde(with = "humantime_serde", default)]
    pub ramp: Duration,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Burst {
    #[serde(with = "humantime_serde")]
    pub at: Duration,
    /// 1..=10000.
    pub calls: usize,
    /// 0-based agent index of the tunnel id the burst calls.
    #[serde(default)]
    pub tunnel: usize,
}

/// One fault on the timeline.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Fault {
    #[serde(with = "humantime_serde")]
    pub at: Duration,
    pub action: FaultAction,
    /// 1-based server (`ts-<n>`) for server faults.
    #[serde(default)]
    pub server: usize,
    /// 0-based agent for `restart_agent`.
    #[serde(default)]
    pub agent: usize,
    /// `set_placement`: the new policy (its `weights`/`unfillable` come from `[servers]`).
    pub placement: Option<Placement>,
}

#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum FaultAction {
    /// Crash a server: no drain; its streams and calls in flight are cut.
    KillServer,
    /// Graceful shutdown of a server (drain, then stop).
    DrainServer,
    /// Start a killed or drained server again with the same id.
    StartServer,
    /// Bring up the next standby server slot.
    AddServer,
    /// Stop an agent gracefully and start it again.
    RestartAgent,
    /// Change the load balancer's placement policy.
    SetPlacement,
    /// A busy neighbour on a server: a task that keeps the server's own runtime thread
    /// busy (the server runs at full CPU; its calls wait their turn). Every server then runs
    /// on a runtime of its own, whose threads' CPU it reports as its load.
    LoadServer,
    /// The busy neighbour goes.
    UnloadServer,
}

/// `[expect]`: headline expectations; each one set is checked and shown in the report.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Expect {
    /// Failed calls / sent calls at most this (0..=1).
    pub max_failed_ratio: Option<f64>,
    /// Queue-wait p99 (summed over tunnel servers) at most this.
    #[serde(with = "humantime_serde")]
    pub max_queue_wait_p99: Option<Duration>,
    /// Every burst's last call answered within this of the burst's start.
    #[serde(with = "humantime_serde")]
    pub burst_done_within: Option<Duration>,
    /// Peak streams (all agents, all servers) at most this.
    pub max_peak_streams: Option<u64>,
    /// Streams at rest at most this (pruned back after a burst): the last sample, taken
    /// once the streams are within it or 10 s after the run's end, whichever is first.
    pub max_resting_streams: Option<u64>,
    /// At the end every running server holds at least this many streams.
    pub min_end_streams_per_server: Option<u64>,
    /// Calls failed after the last fault at most this many.
    pub max_failed_after_last_fault: Option<u64>,
    /// Failed calls that were not in flight when the first fault struck (ended before
    /// it, or started at or after it) at most this many: with a crash as the first fault,
    /// the failures the crash did not have in flight.
    pub max_failed_not_in_flight_at_fault: Option<u64>,
    /// Call latency p99 (the callers' view, every call) at most this.
    #[serde(with = "humantime_serde")]
    pub max_latency_p99: Option<Duration>,
    /// Share (0..=1) of the calls answered by the server(s) `load_server` faults loaded,
    /// from a few seconds after the first such fault (their load read and acted on) to
    /// the end, at most this.
    pub max_busy_share: Option<f64>,
    /// Every process of the fleet together (this one and the workers): the sum of their
    /// peak resident sets at most this many MiB.
    pub max_fleet_rss_mib: Option<f64>,
    /// Tunnel server entries the dispatchers dropped because the server did not report
    /// within its lease (`relay_dispatcher_lease_expiries_total`, summed over the
    /// dispatchers, the whole run) at most this many.
    pub max_leases_missed: Option<u64>,
    /// After each `start_server` / `add_server` fault, every agent covers every running
    /// server again (each `covered` or `growing` in its coverage view, `worker::COVERS`)
    /// within this.
    #[serde(with = "humantime_serde")]
    pub covered_within: Option<Duration>,
    /// After each `start_server` / `add_server` fault, every agent covers the started
    /// server itself (as `covered_within` counts covering) within this. Agents short of
    /// another server since before the start (a start-up budget of opens that missed it,
    /// retried each `fill_retry`) do not count against it; they do against
    /// `covered_within`.
    #[serde(with = "humantime_serde")]
    pub server_covered_within: Option<Duration>,
}

impl Default for Scenario {
    fn default() -> Self {
        Scenario {
            name: "custom".into(),
            description: String::new(),
            duration: Duration::from_secs(20),
            seed: 1,
            servers: Servers::default(),
            agents: Agents::default(),
            dispatchers: Dispatchers::default(),
            routing: relay_dispatcher::RoutingConfig::default(),
            upstream: UpstreamSpec::default(),
            load: Load::default(),
            faults: Vec::new(),
            expect: Expect::default(),
        }
    }
}

impl Default for Servers {
    fn default() -> Self {
        Servers {
            count: 3,
            standby: 0,
            zones: Vec::new(),
            placement: Placement::Uniform,
            weights: Vec::new(),
            unfillable: 1,
            queue_timeout: Duration::from_secs(5),
            max_queue: 1024,
            direct: false,
            route_by_name: false,
            balancer: Balancer::Fixture,
            liveness_interval: relay_tunnel_server::Config::default().liveness_interval,
            liveness_timeout: relay_tunnel_server::Config::default().liveness_timeout,
            tunnel_keepalive_timeout: relay_common::h2::H2Limits::TUNNEL.keepalive_timeout,
        }
    }
}

impl Default for Agents {
    fn default() -> Self {
        Agents {
            count: 1,
            workers: 0,
            start_rate: 0.0,
            coverage: CoverageConfig::default(),
        }
    }
}

impl Default for UpstreamSpec {
    fn default() -> Self {
        UpstreamSpec {
            latency: Duration::from_millis(10),
            distribution: Distribution::Fixed,
            response_bytes: 0,
            request_bytes: 0,
        }
    }
}

impl Default for Load {
    fn default() -> Self {
        Load {
            rate: 100.0,
            max_in_flight: 2000,
            hot_share: 0.0,
            hot_tunnels: 1,
            call_timeout: Duration::from_secs(30),
            phases: Vec::new(),
            bursts: Vec::new(),
            concurrency: 0,
        }
    }
}

const MAX_BODY: u64 = 16 * 1024 * 1024;

fn range<T: PartialOrd + std::fmt::Display>(
    key: &str,
    v: T,
    lo: T,
    hi: T,
) -> Result<(), ConfigError> {
    if v < lo || v > hi {
        return Err(ConfigError::invalid(
            key,
            format!("{v} is out of range: allowed {lo}..={hi}"),
        ));
    }
    Ok(())
}

fn within(key: &str, at: Duration, duration: Duration) -> Result<(), ConfigError> {
    if at > duration {
        return Err(ConfigError::invalid(
            key,
            format!(
                "{} is after the end of the run: allowed 0s..={}",
                humantime::format_duration(at),
                humantime::format_duration(duration)
            ),
        ));
    }
    Ok(())
}

impl Scenario {
    /// A built-in scenario by name.
    pub fn builtin(name: &str) -> Option<Scenario> {
        let (_, text) = BUILTIN.iter().find(|(n, _)| *n == name)?;
        // The built-ins are checked by the test suite; a broken one is a build bug.
        Scenario::parse(text, Path::new(name)).ok()
    }

    /// A built-in name, or else a TOML file path.
    pub fn load(name_or_file: &str) -> Result<Scenario, ConfigError> {
        if let Some((_, text)) = BUILTIN.iter().find(|(n, _)| *n == name_or_file) {
            return Scenario::parse(text, Path::new(name_or_file));
        }
        let path = Path::new(name_or_file);
        let text = std::fs::read_to_string(path).map_err(|e| {
            ConfigError::invalid(
                "--scenario",
                format!(
                    "{name_or_file:?} is neither a built-in ({}) nor a readable file: {e}",
                    BUILTIN
                        .iter()
                        .map(|(n, _)| *n)
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            )
        })?;
        Scenario::parse(&text, path)
    }

    /// Parses and validates TOML text.
    pub fn parse(text: &str, origin: &Path) -> Result<Scenario, ConfigError> {
        let s: Scenario = relay_common::config::parse(text, origin)?;
        s.validate()?;
        Ok(s)
    }

    /// Checks every key; the error names the key and the allowed range.
    pub fn validate(&self) -> Result<(), ConfigError> {
        range("duration", self.duration.as_secs_f64(), 0.5, 24.0 * 3600.0)?;
        let sv = &self.servers;
        range("servers.count", sv.count, 1, 16)?;
        range("servers.standby", sv.standby, 0, 8)?;
        range("servers.max_queue", sv.max_queue, 1, 100_000)?;
        if !sv.liveness_interval.is_zero() {
            range(
                "servers.liveness_interval",
                sv.liveness_interval.as_secs_f64(),
                0.1,
                3600.0,
            )?;
        }
        range(
            "servers.liveness_timeout",
            sv.liveness_timeout.as_secs_f64(),
            0.1,
            3600.0,
        )?;
        range(
            "servers.tunnel_keepalive_timeout",
            sv.tunnel_keepalive_timeout.as_secs_f64(),
            0.1,
            3600.0,
        )?;
        range(
            "servers.queue_timeout",
            sv.queue_timeout.as_secs_f64(),
            0.001,
            300.0,
        )?;
        let slots = sv.count + sv.standby;
        if sv.zones.len() > slots {
            return Err(ConfigError::invalid(
                "servers.zones",
                format!(
                    "{} zones for {slots} servers: allowed at most one per server",
                    sv.zones.len()
                ),
            ));
        }
        let uses =
            |p: Placement| sv.placement == p || self.faults.iter().any(|f| f.placement == Some(p));
        if uses(Placement::Weighted)
            && (sv.weights.len() != slots || sv.weights.iter().all(|w| *w == 0))
        {
            return Err(ConfigError::invalid(
                "servers.weights",
                format!("weighted placement needs {slots} weights (one per server, not all 0)"),
            ));
        }
        if uses(Placement::Unfillable) {
            range("servers.unfillable", sv.unfillable, 1, slots)?;
        }
        if sv.balancer == Balancer::Haproxy {
            if sv.standby > 0 {
                return Err(ConfigError::invalid(
                    "servers.standby",
                    "must be 0 with balancer = \"haproxy\": its backends are fixed at start",
                ));
            }
            if !sv.weights.is_empty() && sv.weights.len() != sv.count {
                return Err(ConfigError::invalid(
                    "servers.weights",
                    format!(
                        "balancer = \"haproxy\" takes one weight per server ({})",
                        sv.count
                    ),
                ));
            }
            if let Some(i) = self
                .faults
                .iter()
                .position(|f| f.action == FaultAction::SetPlacement)
            {
                return Err(ConfigError::invalid(
                    format!("faults[{i}].action"),
                    "set_placement needs balancer = \"fixture\"",
                ));
            }
        }
        let ag = &self.agents;
        range("agents.count", ag.count, 1, 20_000)?;
        range("agents.workers", ag.workers, 0, 64)?;
        range("agents.start_rate", ag.start_rate, 0.0, 100_000.0)?;
        range("dispatchers.count", self.dispatchers.count, 1, 4)?;
        if sv.balancer == Balancer::Haproxy && self.dispatchers.count > 1 {
            return Err(ConfigError::invalid(
                "dispatchers.count",
                "must be 1 with balancer = \"haproxy\"",
            ));
        }
        // The agent's own rules for its coverage keys.
        let probe = relay_agent::Config {
            token: relay_common::Secret::new("probe"),
            tunnels: vec!["http://127.0.0.1:1".into()],
            upstream: "http://127.0.0.1:1".into(),
            coverage: ag.coverage.clone(),
            ..relay_agent::Config::default().insecure()
        };
        probe
            .validate()
            .map_err(|e| ConfigError::invalid("agents.coverage", e.to_string()))?;
        self.routing.validate()?;
        let up = &self.upstream;
        range("upstream.latency", up.latency.as_secs_f64(), 0.0, 60.0)?;
        range("upstream.response_bytes", up.response_bytes, 0, MAX_BODY)?;
        range("upstream.request_bytes", up.request_bytes, 0, MAX_BODY)?;
        let ld = &self.load;
        range("load.rate", ld.rate, 0.0, 50_000.0)?;
        range("load.max_in_flight", ld.max_in_flight, 1, 20_000)?;
        range("load.hot_share", ld.hot_share, 0.0, 1.0)?;
        range("load.hot_tunnels", ld.hot_tunnels, 1, ag.count)?;
        range("load.concurrency", ld.concurrency, 0, 5000)?;
        range(
            "load.call_timeout",
            ld.call_timeout.as_secs_f64(),
            0.01,
            600.0,
        )?;
        for (i, p) in ld.phases.iter().enumerate() {
            range(&format!("load.phases[{i}].rate"), p.rate, 0.0, 50_000.0)?;
            within(&format!("load.phases[{i}].at"), p.at, self.duration)?;
        }
        for (i, b) in ld.bursts.iter().enumerate() {
            range(&format!("load.bursts[{i}].calls"), b.calls, 1, 10_000)?;
            range(
                &format!("load.bursts[{i}].tunnel"),
                b.tunnel,
                0,
                ag.count - 1,
            )?;
            within(&format!("load.bursts[{i}].at"), b.at, self.duration)?;
        }
        for (i, f) in self.faults.iter().enumerate() {
            within(&format!("faults[{i}].at"), f.at, self.duration)?;
            match f.action {
                FaultAction::KillServer
                | FaultAction::DrainServer
                | FaultAction::StartServer
                | FaultAction::LoadServer
                | FaultAction::UnloadServer => {
                    range(&format!("faults[{i}].server"), f.server, 1, slots)?;
                }
                FaultAction::RestartAgent => {
                    range(&format!("faults[{i}].agent"), f.agent, 0, ag.count - 1)?;
                }
                FaultAction::AddServer => {}
                FaultAction::SetPlacement => {
                    if f.placement.is_none() {
                        return Err(ConfigError::invalid(
                            format!("faults[{i}].placement"),
                            "set_placement needs placement = uniform|round-robin|weighted|unfillable",
                        ));
                    }
                }
            }
        }
        let adds = self
            .faults
            .iter()
            .filter(|f| f.action == FaultAction::AddServer)
            .count();
        if adds > sv.standby {
            return Err(ConfigError::invalid(
                "faults",
                format!(
                    "{adds} add_server faults but servers.standby = {}: allowed at most standby",
                    sv.standby
                ),
            ));
        }
        if let Some(r) = self.expect.max_failed_ratio {
            range("expect.max_failed_ratio", r, 0.0, 1.0)?;
        }
        if let Some(m) = self.expect.max_fleet_rss_mib {
            range("expect.max_fleet_rss_mib", m, 1.0, 1_048_576.0)?;
        }
        let starts = self
            .faults
            .iter()
            .any(|f| matches!(f.action, FaultAction::StartServer | FaultAction::AddServer));
        for (key, set) in [
            (
                "expect.covered_within",
                self.expect.covered_within.is_some(),
            ),
            (
                "expect.server_covered_within",
                self.expect.server_covered_within.is_some(),
            ),
        ] {
            if set && !starts {
                return Err(ConfigError::invalid(
                    key,
                    "needs a start_server or add_server fault (it is measured from each)",
                ));
            }
        }
        if let Some(r) = self.expect.max_busy_share {
            range("expect.max_busy_share", r, 0.0, 1.0)?;
            if !self.loads_servers() {
                return Err(ConfigError::invalid(
                    "expect.max_busy_share",
                    "needs a load_server fault",
                ));
            }
        }
        Ok(())
    }

    /// A shorter copy for tests and quick looks: every time on the timeline (duration,
    /// phases, bursts, faults) times `time`, and rates times `rate`.
    pub fn scaled(&self, time: f64, rate: f64) -> Scenario {
        let t = |d: Duration| d.mul_f64(time);
        let mut s = self.clone();
        s.duration = t(s.duration);
        s.load.rate *= rate;
        for p in &mut s.load.phases {
            p.at = t(p.at);
            p.ramp = t(p.ramp);
            p.rate *= rate;
        }
        for b in &mut s.load.bursts {
            b.at = t(b.at);
        }
        for f in &mut s.faults {
            f.at = t(f.at);
        }
        s
    }

    /// Whether a fault puts a busy neighbour on a server (every server then gets a runtime
    /// of its own).
    pub fn loads_servers(&self) -> bool {
        self.faults
            .iter()
            .any(|f| f.action == FaultAction::LoadServer)
    }

    /// The load generator's target rate at `t` into the run.
    pub fn rate_at(&self, t: Duration) -> f64 {
        let mut rate = self.load.rate;
        let mut phases: Vec<&Phase> = self.load.phases.iter().collect();
        phases.sort_by_key(|p| p.at);
        for p in phases {
            if t < p.at {
                break;
            }
            let into = (t - p.at).as_secs_f64();
            let ramp = p.ramp.as_secs_f64();
            rate = if ramp > 0.0 && into < ramp {
                rate + (p.rate - rate) * into / ramp
            } else {
                p.rate
            };
        }
        rate
    }
}
