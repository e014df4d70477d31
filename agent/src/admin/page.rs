//! The agent's status page at `/` on its admin listener, rendered from the very document
//! `/systemcheck` serves ([`SystemCheck`]): the verdict in words, the tunnel servers with
//! their coverage state and streams, the upstream check, the calls of the last minutes by
//! outcome, the last coverage actions with their reasons, and the accept rules in force.
//!
//! Server ids, zones, reasons and error texts come from peers: every string goes through
//! `relay_common::html::text`. This module only renders; it decides nothing.

use super::SystemCheck;
use crate::coverage::plan::State;
use crate::coverage::ReportedState;
use relay_common::html::{self, badge, para, section, table, text, Html};

/// `unix_ms` as `HH:MM:SS UTC`.
fn clock(unix_ms: u64) -> String {
    let s = (unix_ms / 1000) % 86_400;
    format!("{:02}:{:02}:{:02} UTC", s / 3600, s / 60 % 60, s % 60)
}

/// What the verdict says, in words.
fn verdict(c: &SystemCheck) -> Html {
    let mut v = Html::default();
    let mut line = if c.ok {
        badge("Healthy", true, false)
    } else {
        badge("Not healthy", false, true)
    };
    line.push(text(if c.ok {
        ": every /systemcheck rule holds."
    } else {
        ": /systemcheck answers 503 because:"
    }));
    v.push(para("", line));
    if !c.problems.is_empty() {
        v.push(Html::wrap(
            "ul",
            "",
            c.problems
                .iter()
                .map(|p| Html::wrap("li", "", text(p)))
                .collect(),
        ));
    }
    let mut ready = if c.ready {
        badge("Ready", true, false)
    } else {
        badge("Not ready", false, true)
    };
    ready.push(text(if c.ready {
        ": a call could be served now"
    } else {
        ": no call can be served now (no live stream, or the upstream does not answer)"
    }));
    ready.push(text(format!(
        "; {} streams held, {} being opened.",
        c.streams_total, c.opening
    )));
    v.push(para("", ready));
    v
}

/// The status page for `c`.
pub fn page(c: &SystemCheck) -> String {
    let mut main = section("Verdict", verdict(c));

    let rows = c
        .servers
        .iter()
        .map(|s| {
            let good = s.state == ReportedState::Plan(State::Covered);
            let bad = s.state == ReportedState::Lost;
            vec![
                text(&s.server_id),
                text(&s.instance_id),
                text(&s.zone),
                badge(s.state.as_str(), good, bad),
                text(s.streams),
                text(s.idle),
                text(s.busy),
                text(s.budget),
                text(format!("{}s", s.short_for_s)),
                text(match s.call_time_us {
                    Some(us) if us < 1000 => format!("{us} µs"),
                    Some(us) => format!("{:.1} ms", f64::from(us) / 1000.0),
                    None => "-".to_string(),
                }),
            ]
        })
        .collect();
    main.push(section(
        "Tunnel servers",
        table(
            "servers",
            &[
                "server id",
                "instance",
                "zone",
                "state",
                "streams",
                "idle",
                "busy",
                "budget",
                "short for",
                "call time",
            ],
            rows,
            "No tunnel server known yet.",
        ),
    ));

    let u = &c.upstream;
    let mut up = text(format!("{}: ", u.url));
    up.push(if u.reachable {
        badge("reachable", true, false)
    } else {
        badge("unreachable", false, true)
    });
    if let Some(status) = u.status {
        up.push(text(format!(", HTTP {status}")));
    }
    if let Some(ms) = u.latency_ms {
        up.push(text(format!(", {ms} ms")));
    }
    if let Some(e) = &u.error {
        up.push(text(format!(" ({e})")));
    }
    main.push(section("Upstream check", para("", up)));

    // Columns: the outcomes the document lists (every one, in its order).
    let outcomes: Vec<&str> = c
        .recent_calls
        .first()
        .map(|m| m.calls.keys().copied().collect())
        .unwrap_or_default();
    let mut head = vec!["minutes ago".to_string()];
    head.extend(outcomes.iter().map(|o| o.replace('_', " ")));
    let head: Vec<&str> = head.iter().map(String::as_str).collect();
    let rows = c
        .recent_calls
        .iter()
        .map(|m| {
            let mut row = vec![text(m.minutes_ago)];
            row.extend(
                outcomes
                    .iter()
                    .map(|o| text(m.calls.get(o).copied().unwrap_or(0))),
            );
            row
        })
        .collect();
    main.push(section(
        "Calls by outcome, per minute",
        table("calls", &head, rows, "No minute counted yet."),
    ));

    let rows = c
        .recent_actions
        .iter()
        .map(|a| {
            vec![
                text(clock(a.unix_ms)),
                text(&a.server_id),
                text(a.action),
                text(a.count),
                text(&a.reason),
            ]
        })
        .collect();
    main.push(section(
        "Recent coverage actions",
        table(
            "actions",
            &["at", "server id", "action", "streams", "reason"],
            rows,
            "No coverage action yet.",
        ),
    ));

    let rows = c
        .accept_rules
        .iter()
        .map(|r| {
            let or_none = |v: &[String]| {
                if v.is_empty() {
                    "-".to_string()
                } else {
                    v.join(", ")
                }
            };
            vec![
                text(&r.name),
                text(r.methods.join(", ")),
                text(&r.path),
                text(or_none(&r.headers)),
                text(or_none(&r.query)),
            ]
        })
        .collect();
    main.push(section(
        "Accept rules in force",
        table(
            "rules",
            &[
                "rule",
                "methods",
                "path",
                "required headers",
                "required query",
            ],
            rows,
            "No [[allow]] rule: every call is refused.",
        ),
    ));
    html::page("relay agent", "GET /systemcheck for JSON.", main)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::admin::{RuleReport, UpstreamHealth};
    use crate::coverage::{ActionReport, ServerReport};
    use crate::metrics::MinuteCalls;

    const BAD: &str = "<img/src=x/onerror=alert(1)>";

    fn check() -> SystemCheck {
        SystemCheck {
            ok: false,
            problems: vec![format!("server {BAD} carries 3 calls")],
            ready: true,
            servers: vec![ServerReport {
                server_id: BAD.into(),
                instance_id: BAD.into(),
                zone: BAD.into(),
                streams: 4,
                busy: 3,
                idle: 1,
                budget: 5,
                state: ReportedState::Plan(State::Growing),
                short_for_s: 12,
                call_time_us: Some(2500),
            }],
            upstream: UpstreamHealth {
                url: format!("http://{BAD}/"),
                reachable: false,
                status: None,
                latency_ms: None,
                error: Some(BAD.into()),
            },
            streams_total: 4,
            opening: 1,
            recent_actions: vec![ActionReport {
                unix_ms: 3_723_000,
                server_id: BAD.into(),
                action: "grow",
                count: 2,
                reason: BAD.into(),
            }],
            recent_calls: vec![MinuteCalls {
                minutes_ago: 0,
                calls: [("ok", 7), ("upstream_timeout", 1)].into_iter().collect(),
            }],
            accept_rules: vec![RuleReport {
                name: BAD.into(),
                methods: vec!["GET".into()],
                path: "/api/**".into(),
                headers: vec![BAD.into()],
                query: vec![],
            }],
        }
    }

    #[test]
    fn the_page_says_the_verdict_and_escapes_every_peer_supplied_string() {
        let p = page(&check());
        assert!(!p.contains("<img"), "{p}");
        assert!(p.contains("Not healthy"));
        assert!(p.contains("<li>server &lt;img/src=x/onerror=alert(1)&gt; carries 3 calls</li>"));
        assert!(p.contains("<th>upstream timeout</th>"));
        assert!(p.contains("<td>12s</td><td>2.5 ms</td>"), "{p}");
        assert!(p.contains("<tr><td>0</td><td>7</td><td>1</td></tr>"), "{p}");
        assert!(p.contains("<td>01:02:03 UTC</td>"));
        assert!(p.contains("<td>/api/**</td><td>&lt;img/src=x/onerror=alert(1)&gt;</td><td>-</td>"));
    }

    #[test]
    fn an_empty_check_renders() {
        let mut c = check();
        c.servers.clear();
        c.recent_actions.clear();
        c.recent_calls.clear();
        c.accept_rules.clear();
        let p = page(&c);
        assert!(p.contains("No [[allow]] rule: every call is refused."));
        assert!(p.contains("No tunnel server known yet."));
    }
}
