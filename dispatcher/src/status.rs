//! The dispatcher's status page at `/` on its admin listener: rendered from the very
//! document `GET /debug/routes` serves (tunnel ids, the servers holding each with their
//! tier, the spill share, the servers' figures, the registry's health), so the page and
//! the JSON cannot disagree.
//!
//! Every string in that document came from a peer (server ids, zones, URLs, Redis errors):
//! all of it goes through `relay_common::html::text`. A field missing from the document
//! shows as `-`; nothing here panics on any input.

use relay_common::html::{self, badge, para, section, table, text, Html};
use serde_json::Value;

/// A JSON value as page text: strings as they are, null or missing as `-`.
fn plain(v: &Value) -> String {
    match v {
        Value::Null => "-".to_string(),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// The servers holding a tunnel id, in the order calls try them, each with its tier.
pub fn holders(tunnel: &Value) -> String {
    let servers = tunnel["servers"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or(&[]);
    let names: Vec<String> = servers
        .iter()
        .map(|s| match s["tier"].as_u64() {
            Some(tier) => format!("{} (tier {tier})", plain(&s["server_id"])),
            None => plain(&s["server_id"]),
        })
        .collect();
    names.join(", ")
}

/// A share (0 to 1) as a whole percentage.
pub fn percent(v: &Value) -> String {
    match v.as_f64() {
        Some(f) => format!("{:.0}%", f * 100.0),
        None => "-".to_string(),
    }
}

/// The page for `routes`, the `/debug/routes` document.
pub fn page(routes: &Value) -> String {
    let mut main = Html::default();
    let registry = &routes["registry"];
    let state = plain(&registry["state"]);
    let mut reg = text(format!("Registry {}: ", plain(&registry["backend"])));
    reg.push(badge(&state, state == "ok", state == "degraded"));
    if let Some(e) = registry["error"].as_str() {
        reg.push(text(format!(
            " ({e}; routing {})",
            plain(&registry["routing"])
        )));
    }
    let tunnels = routes["tunnels"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or(&[]);
    let servers = routes["servers"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or(&[]);
    reg.push(text(format!(
        ". {} tunnel ids on {} tunnel servers.",
        tunnels.len(),
        servers.len()
    )));
    main.push(section("Registry", para("", reg)));

    let rows = tunnels
        .iter()
        .map(|t| {
            vec![
                text(plain(&t["tunnel_id"])),
                text(plain(&t["home"])),
                text(holders(t)),
                text(percent(&t["spill_share"])),
                text(plain(&t["spill_reason"])),
                text(plain(&t["policy"])),
            ]
        })
        .collect();
    main.push(section(
        "Tunnel ids",
        table(
            "tunnels",
            &[
                "tunnel id",
                "home",
                "servers (in order tried)",
                "spill share",
                "spill reason",
                "policy",
            ],
            rows,
            "No tunnel server holds a stream of any tunnel id.",
        ),
    ));

    let rows = servers
        .iter()
        .map(|s| {
            let draining = s["draining"].as_bool().unwrap_or(false);
            vec![
                text(plain(&s["server_id"])),
                text(plain(&s["zone"])),
                text(plain(&s["origin"])),
                if draining {
                    badge("draining", false, false)
                } else {
                    badge("serving", true, false)
                },
                text(plain(&s["tunnels"])),
                text(plain(&s["calls_in_flight"])),
                text(match s["cpu_permille"].as_u64() {
                    Some(p) => format!("{:.1}%", p as f64 / 10.0),
                    None => "-".to_string(),
                }),
                text(match s["forward_rtt_us"].as_u64() {
                    Some(us) => format!("{:.1} ms", us as f64 / 1000.0),
                    None => "-".to_string(),
                }),
                text(plain(&s["forward_url"])),
            ]
        })
        .collect();
    main.push(section(
        "Tunnel servers",
        table(
            "servers",
            &[
                "server id",
                "zone",
                "origin",
                "state",
                "tunnel ids",
                "calls in flight",
                "cpu",
                "forward rtt",
                "forward url",
            ],
            rows,
            "No tunnel server reports to this dispatcher.",
        ),
    ));
    html::page("relay dispatcher", "GET /debug/routes for JSON.", main)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_page_escapes_every_peer_supplied_string() {
        let bad = "<img/src=x/onerror=alert(1)>";
        let routes = serde_json::json!({
            "tunnels": [{"tunnel_id": bad, "home": bad, "spill_share": 0.25,
                         "spill_reason": "load", "policy": "home",
                         "servers": [{"server_id": bad, "tier": 0}, {"server_id": "ts-2", "tier": 1}]}],
            "servers": [{"server_id": bad, "zone": bad, "origin": "local", "draining": false,
                         "tunnels": 1, "calls_in_flight": 2, "cpu_permille": 125,
                         "forward_rtt_us": 1500, "forward_url": bad}],
            "registry": {"backend": "redis", "state": "degraded", "error": bad, "routing": "from the last known table"},
        });
        let p = page(&routes);
        assert!(!p.contains("<img"), "{p}");
        assert!(p.contains(
            "<td>&lt;img/src=x/onerror=alert(1)&gt; (tier 0), ts-2 (tier 1)</td><td>25%</td>"
        ));
        assert!(p.contains("12.5%") && p.contains("1.5 ms"));
        // Tunnel ids are checked where they enter, and escaped here all the same.
        assert!(p.contains("<tr><td>&lt;img/src=x/onerror=alert(1)&gt;</td>"));
    }

    #[test]
    fn a_document_of_the_wrong_shape_renders_without_panicking() {
        for doc in [
            serde_json::json!(null),
            serde_json::json!({"tunnels": 3, "servers": "x"}),
            serde_json::json!({"tunnels": [1, null, {"servers": [7]}], "servers": [[]]}),
        ] {
            let p = page(&doc);
            assert!(p.contains("<main>"));
        }
    }
}
