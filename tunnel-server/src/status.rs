//! What the tunnel server's admin listener shows about it: `GET /debug/tunnels` (JSON) and
//! the status page at `/` (HTML), both rendered from one [`Status`] document taken from the
//! hub at the time of the request.
//!
//! Reading only: this module must not change the hub.

use crate::hub::{Hub, TunnelStatus};
use relay_common::html::{self, badge, para, section, table, text, Html};
use serde::Serialize;

/// The document `/debug/tunnels` serves and the page renders.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Status {
    pub server_id: String,
    pub instance_id: String,
    pub zone: String,
    /// Shutting down: no new streams, calls in flight finish.
    pub draining: bool,
    pub tunnels: Vec<TunnelStatus>,
}

impl Status {
    pub fn of(hub: &Hub, server_id: &str, zone: &str) -> Self {
        Status {
            server_id: server_id.to_string(),
            instance_id: hub.instance_id.clone(),
            zone: zone.to_string(),
            draining: hub.is_draining(),
            tunnels: hub.tunnel_status(),
        }
    }
}

/// The status page.
pub fn page(s: &Status) -> String {
    let mut main = Html::default();
    let state = if s.draining {
        badge("draining", false, true)
    } else {
        badge("serving", true, false)
    };
    let mut summary = text(format!(
        "Server {} (instance {}, zone {}) is ",
        s.server_id, s.instance_id, s.zone
    ));
    summary.push(state);
    summary.push(text(format!(
        ": {} tunnel ids, {} streams, {} calls queued.",
        s.tunnels.len(),
        s.tunnels.iter().map(|t| u64::from(t.streams)).sum::<u64>(),
        s.tunnels.iter().map(|t| u64::from(t.queued)).sum::<u64>(),
    )));
    main.push(section("Server", para("", summary)));
    let rows = s
        .tunnels
        .iter()
        .map(|t| {
            vec![
                text(&t.tunnel_id),
                text(t.streams),
                text(t.idle),
                text(t.busy),
                text(t.queued),
                if t.rtt_us == 0 {
                    text("-")
                } else {
                    text(format!("{:.1} ms", f64::from(t.rtt_us) / 1000.0))
                },
            ]
        })
        .collect();
    main.push(section(
        "Tunnel ids",
        table(
            "tunnels",
            &["tunnel id", "streams", "idle", "busy", "queued", "rtt"],
            rows,
            "No agent holds a stream here.",
        ),
    ));
    html::page(
        &format!("relay tunnel server {}", s.server_id),
        "GET /debug/tunnels for JSON.",
        main,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_page_shows_each_tunnel_and_escapes_the_server_id() {
        let s = Status {
            server_id: "<img/src=x/onerror=alert(1)>".into(),
            instance_id: "ab12".into(),
            zone: "z\"1".into(),
            draining: true,
            tunnels: vec![TunnelStatus {
                tunnel_id: "demo&<b>".into(),
                streams: 3,
                idle: 1,
                busy: 2,
                queued: 4,
                rtt_us: 1500,
            }],
        };
        let p = page(&s);
        assert!(!p.contains("<img"), "{p}");
        assert!(p.contains("&lt;img/src=x/onerror=alert(1)&gt;"));
        assert!(p.contains("z&quot;1"));
        assert!(p.contains(
            "<tr><td>demo&amp;&lt;b&gt;</td><td>3</td><td>1</td><td>2</td><td>4</td><td>1.5 ms</td></tr>"
        ));
        assert!(p.contains("draining"));
    }
}
