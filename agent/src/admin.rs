//! The agent's admin surface on `relay_common::admin`: `/metrics`, `/healthz`, `/readyz`
//! and `GET /systemcheck` (per-server coverage plus upstream reachability, 200 when
//! healthy, 503 when not), and the background upstream check that feeds it.
//!
//! The verdict (`ok`, with every failing rule in `problems`) is what a person pages on.
//! Not ok when:
//! - the agent holds no live tunnel stream (no call can reach it);
//! - a server carrying calls has been short for longer than `coverage.grace` (its
//!   callers queue while the agent cannot cover it);
//! - the upstream check fails.
//!
//! `/readyz` answers whether a call could be served now: 503 with no live stream or an
//! unreachable upstream; a short server still serves (its calls queue), so it stays 200.
//!
//! Besides the verdict, `/systemcheck` shows what the agent did lately and what it lets
//! through: the last coverage actions with their reasons, the calls of the last minutes
//! by outcome, and the accept rules in force. The status page at `/` (`page`) renders this
//! same document.
//!
//! Answers come from `watch` snapshots (the coverage actor's last tick, the last upstream
//! check) and the per-minute call counters; a request never triggers network work.

mod page;

use crate::config::UpstreamCheckConfig;
use crate::coverage::{ActionReport, CoverageView, ServerReport};
use crate::filter::AllowRule;
use crate::metrics::{MinuteCalls, RecentCalls};
use crate::upstream::Upstream;
use http::StatusCode;
use relay_common::admin::{json, Admin};
use serde::Serialize;
use std::sync::Arc;
use tokio::sync::watch;
use tokio::time::{Instant, MissedTickBehavior};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

/// The last upstream reachability check.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct UpstreamHealth {
    pub url: String,
    /// Any HTTP answer counts as reachable.
    pub reachable: bool,
    pub status: Option<u16>,
    pub latency_ms: Option<u64>,
    pub error: Option<String>,
}

impl UpstreamHealth {
    /// Before the first check has finished.
    pub fn unchecked(url: String) -> Self {
        UpstreamHealth {
            url,
            reachable: false,
            status: None,
            latency_ms: None,
            error: Some("not checked yet".into()),
        }
    }
}

/// The `/systemcheck` document.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SystemCheck {
    pub ok: bool,
    /// Why `ok` is false, one line per failing rule; empty when ok.
    pub problems: Vec<String>,
    /// Whether a call could be served now (`/readyz`).
    pub ready: bool,
    pub servers: Vec<ServerReport>,
    pub upstream: UpstreamHealth,
    pub streams_total: u32,
    pub opening: u32,
    /// The last coverage actions, newest first.
    pub recent_actions: Vec<ActionReport>,
    /// Calls of the last minutes by outcome, the minute under way first.
    pub recent_calls: Vec<MinuteCalls>,
    /// The `[[allow]]` rules in force, in order.
    pub accept_rules: Vec<RuleReport>,
}

/// One `[[allow]]` rule as `/systemcheck` shows it: what it matches on, without the
/// required headers' and query parameters' value patterns (a required header's value can
/// be a shared secret).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RuleReport {
    /// The rule's `name`, or `allow[i]`.
    pub name: String,
    pub methods: Vec<String>,
    pub path: String,
    /// Names of the headers the rule requires.
    pub headers: Vec<String>,
    /// Names of the query parameters the rule requires.
    pub query: Vec<String>,
}

impl RuleReport {
    pub fn of(rules: &[AllowRule]) -> Vec<Self> {
        rules
            .iter()
            .enumerate()
            .map(|(i, r)| RuleReport {
                name: r.name.clone().unwrap_or_else(|| format!("allow[{i}]")),
                methods: r.methods.clone(),
                path: r.path.clone(),
                headers: r.headers.keys().cloned().collect(),
                query: r.query.keys().cloned().collect(),
            })
            .collect()
    }
}

/// What `/systemcheck` shows besides coverage and the upstream: the call counters and the
/// accept rules. Cheap to clone.
#[derive(Clone)]
pub struct Activity {
    pub calls: RecentCalls,
    pub rules: Arc<Vec<RuleReport>>,
}

impl SystemCheck {
    /// The verdict over the coverage actor's last tick and the last upstream check (see
    /// the module docs).
    pub fn build(view: &CoverageView, upstream: &UpstreamHealth, activity: &Activity) -> Self {
        let mut problems = Vec::new();
        if view.live == 0 {
            problems.push(format!(
                "no live tunnel stream ({} opening): no call can reach this agent",
                view.opening
            ));
        }
        for s in &view.servers {
            if s.busy > 0 && s.short_for_s > view.grace_s {
                problems.push(format!(
                    "server {} carries {} calls and has been short for {}s (more than grace {}s): streams {} < budget {}",
                    s.server_id, s.busy, s.short_for_s, view.grace_s, s.streams, s.budget
                ));
            }
        }
        if !upstream.reachable {
            problems.push(format!(
                "upstream {} unreachable: {}",
                upstream.url,
                upstream.error.as_deref().unwrap_or("no answer")
            ));
        }
        SystemCheck {
            ok: problems.is_empty(),
            problems,
            ready: view.live > 0 && upstream.reachable,
            servers: view.servers.clone(),
            upstream: upstream.clone(),
            streams_total: view.streams_total,
            opening: view.opening,
            recent_actions: view.recent_actions.clone(),
            recent_calls: activity.calls.minutes(Instant::now()),
            accept_rules: activity.rules.to_vec(),
        }
    }
}

/// The admin routes over the two snapshots.
pub fn admin(
    registry: prometheus::Registry,
    coverage: watch::Receiver<CoverageView>,
    upstream: watch::Receiver<UpstreamHealth>,
    activity: Activity,
) -> Admin {
    let check = move || SystemCheck::build(&coverage.borrow(), &upstream.borrow(), &activity);
    let ready_check = check.clone();
    Admin::new(registry)
        .with_ready(move || {
            let c = ready_check();
            (c.ready, serde_json::to_value(&c).unwrap_or_default())
        })
        .with_routes(move |path| match path {
            "/systemcheck" => {
                let c = check();
                let status = if c.ok {
                    StatusCode::OK
                } else {
                    StatusCode::SERVICE_UNAVAILABLE
                };
                Some(json(status, &serde_json::to_value(&c).unwrap_or_default()))
            }
            "/" => Some(relay_common::html::response(page::page(&check()))),
            _ => None,
        })
}

/// Checks the upstream every `cfg.interval` until `stop`, publishing each result.
pub async fn check_upstream(
    upstream: Upstream,
    cfg: UpstreamCheckConfig,
    tx: watch::Sender<UpstreamHealth>,
    stop: CancellationToken,
) {
    let mut ticker = tokio::time::interval(cfg.interval);
    ticker.set_missed_tick_behavior(MissedTickBehavior::Skip);
    let url = format!("{}{}", upstream.origin(), cfg.path);
    let mut was_reachable: Option<bool> = None;
    loop {
        tokio::select! {
            biased;
            _ = stop.cancelled() => return,
            _ = ticker.tick() => {}
        }
        let result = tokio::select! {
            biased;
            _ = stop.cancelled() => return,
            r = upstream.probe(&cfg.path, cfg.timeout) => r,
        };
        let health = match result {
            Ok((status, latency)) => UpstreamHealth {
                url: url.clone(),
                reachable: true,
                status: Some(status.as_u16()),
                latency_ms: Some(latency.as_millis() as u64),
                error: None,
            },
            Err(e) => UpstreamHealth {
                url: url.clone(),
                reachable: false,
                status: None,
                latency_ms: None,
                error: Some(e.to_string()),
            },
        };
        if was_reachable != Some(health.reachable) {
            if health.reachable {
                info!(url = %health.url, status = health.status, "upstream reachable");
            } else {
                warn!(url = %health.url, error = health.error.as_deref().unwrap_or(""), "upstream unreachable");
            }
            was_reachable = Some(health.reachable);
        }
        tx.send_replace(health);
    }
}
