//! Per-hop call accounting read from each component's Prometheus text: every hop's own
//! ledger (calls received = outcomes, nothing in flight once quiet) and the hops against
//! each other (forward attempts sent by the dispatcher = calls received by the tunnel
//! servers; calls reaching the agents = calls the servers received less those that never
//! had a stream). A series that is missing is an error, never 0.

use crate::procs::{metric, series};
use std::collections::BTreeMap;

/// Values of `name` by the value of its label `label`.
fn by_label(text: &str, name: &str, label: &str) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    for l in text.lines().filter(|l| l.starts_with(name)) {
        let Some((series, value)) = l.rsplit_once(' ') else {
            continue;
        };
        if series.split('{').next() != Some(name) {
            continue;
        }
        let key = format!("{label}=\"");
        let Some(v) = series
            .find(&key)
            .map(|i| &series[i + key.len()..])
            .and_then(|r| r.split('"').next())
        else {
            continue;
        };
        *out.entry(v.to_string()).or_default() += value.parse::<f64>().unwrap_or(f64::NAN);
    }
    out
}

/// Calls as the hops counted them, summed over every instance read.
#[derive(Debug, Default)]
pub struct Hops {
    /// Forward attempts the dispatcher sent, by tunnel server
    /// (`relay_dispatcher_routing_decisions_total`).
    pub attempts: BTreeMap<String, f64>,
    /// Calls each tunnel server received, by server id (summed over the incarnations
    /// read), and whether every incarnation of it was read.
    pub server_received: BTreeMap<String, (f64, bool)>,
    /// The servers' outcomes, by outcome.
    pub server_outcomes: BTreeMap<String, f64>,
    /// Calls the agents received (every incarnation read).
    pub agent_received: f64,
    /// An agent incarnation could not be read (it was killed, its counters died with it):
    /// `agent_received` is then only part of what the agents received.
    pub agents_partial: bool,
    /// Calls the dispatcher abandoned at their deadline while their server could not read
    /// (a frozen process): the request, or the reset that followed it, may be all the
    /// server ever saw of each, so each may be an attempt it never counted as received.
    pub abandoned: f64,
}

/// Tunnel server outcomes of calls that never had a stream, so never reached an agent.
pub const BEFORE_AGENT: [&str; 4] = ["unknown_tunnel", "no_capacity", "draining", "bad_request"];
/// Tunnel server outcomes of calls that ended around the hand-over to the agent: the
/// agent may or may not have received the call (its stream died, or the caller left).
pub const AROUND_AGENT: [&str; 2] = ["stream_lost", "cancelled"];

/// One tunnel server's ledger, from its Prometheus text: calls received = outcomes and
/// none in flight. Adds its figures to `hops` under `name` (its server id); `whole` says
/// whether every incarnation of that server is read. A missing series is an error; the
/// outcome counter has no series until the first outcome, so it may be missing only on a
/// server that received no call.
pub fn server_ledger_text(
    name: &str,
    text: &str,
    whole: bool,
    hops: &mut Hops,
) -> Result<(), String> {
    let e = |m: String| format!("{name}: {m}");
    let received = series(text, "relay_tunnel_calls_received_total", &[]).map_err(e)?;
    let in_flight = series(text, "relay_tunnel_calls_in_flight", &[]).map_err(e)?;
    let outcomes = if received == 0.0 {
        metric(text, "relay_tunnel_calls_total", &[])
    } else {
        series(text, "relay_tunnel_calls_total", &[]).map_err(e)?
    };
    if received != outcomes || in_flight != 0.0 {
        return Err(format!(
            "{name}: received {received} outcomes {outcomes} in flight {in_flight}"
        ));
    }
    let e = hops
        .server_received
        .entry(name.to_string())
        .or_insert((0.0, true));
    e.0 += received;
    e.1 &= whole;
    for (k, v) in by_label(text, "relay_tunnel_calls_total", "outcome") {
        *hops.server_outcomes.entry(k).or_default() += v;
    }
    Ok(())
}

/// The agent's ledger: every call it received ended with one outcome, and no stream of a
/// running agent is still busy. Adds its calls received to `hops`. A missing series is
/// an error (the outcome counter may be missing only while nothing was received).
pub fn agent_ledger_text(
    name: &str,
    text: &str,
    running: bool,
    hops: &mut Hops,
) -> Result<(), String> {
    let e = |m: String| format!("{name}: {m}");
    let received = series(text, "relay_agent_calls_received_total", &[]).map_err(e)?;
    let outcomes = if received == 0.0 {
        metric(text, "relay_agent_calls_total", &[])
    } else {
        series(text, "relay_agent_calls_total", &[]).map_err(e)?
    };
    let busy = if running {
        series(text, "grpc_tunnel_server_streams", &[("state", "busy")]).map_err(e)?
    } else {
        0.0
    };
    if received != outcomes || busy != 0.0 {
        return Err(format!(
            "{name}: received {received} outcomes {outcomes}, {busy} streams still busy"
        ));
    }
    hops.agent_received += received;
    Ok(())
}

/// Forward attempts the dispatcher sent by tunnel server, from its Prometheus text.
pub fn dispatcher_attempts(text: &str) -> Result<BTreeMap<String, f64>, String> {
    series(text, "relay_dispatcher_routing_decisions_total", &[])
        .map_err(|m| format!("dispatcher: {m}"))?;
    Ok(by_label(
        text,
        "relay_dispatcher_routing_decisions_total",
        "server_id",
    ))
}

/// Across hops, once quiet:
/// - every forward attempt to a tunnel server whose every incarnation was read was
///   received by it (`attempts{server} == received`, less at most the calls
///   [`Hops::abandoned`]), and no server read received more than it was sent;
/// - the agents received every call the servers read received, less the calls that
///   never had a stream ([`BEFORE_AGENT`]), and less at most those that ended around
///   the hand-over ([`AROUND_AGENT`]) (unless an agent incarnation was not read); when
///   every server was read, no more than that.
pub fn hops_agree(hops: &Hops) -> Result<(), String> {
    let whole = hops.server_received.values().all(|(_, w)| *w);
    for (id, (received, all)) in &hops.server_received {
        let sent = hops.attempts.get(id).copied().unwrap_or(0.0);
        if (*all && *received < sent - hops.abandoned) || *received > sent {
            return Err(format!(
                "{id}: the dispatcher sent {sent} forward attempts, the server received \
                 {received}{}: {hops:?}",
                if *all {
                    ""
                } else {
                    " (not every incarnation read)"
                }
            ));
        }
    }
    let sum = |names: &[&str]| -> f64 {
        names
            .iter()
            .map(|n| hops.server_outcomes.get(*n).copied().unwrap_or(0.0))
            .sum()
    };
    let received: f64 = hops.server_received.values().map(|(r, _)| r).sum();
    let at_most = received - sum(&BEFORE_AGENT);
    let at_least = at_most - sum(&AROUND_AGENT);
    let agents = hops.agent_received;
    if (agents < at_least && !hops.agents_partial) || (whole && agents > at_most) {
        return Err(format!(
            "agents received {agents} calls; the servers' outcomes allow {at_least}..={at_most}{}: {hops:?}",
            if whole { "" } else { " (lower bound only: not every server incarnation read)" }
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const SERVER: &str = "relay_tunnel_calls_received_total 5\n\
        relay_tunnel_calls_in_flight 0\n\
        relay_tunnel_calls_total{outcome=\"ok\"} 4\n\
        relay_tunnel_calls_total{outcome=\"unknown_tunnel\"} 1\n";
    const AGENT: &str = "relay_agent_calls_received_total 4\n\
        relay_agent_calls_total{outcome=\"ok\"} 4\n\
        grpc_tunnel_server_streams{server_id=\"ts-1\",state=\"busy\"} 0\n";

    fn hops(attempts: f64, agent: &str) -> Result<Hops, String> {
        let mut h = Hops::default();
        h.attempts.insert("ts-1".into(), attempts);
        server_ledger_text("ts-1", SERVER, true, &mut h)?;
        agent_ledger_text("agent", agent, true, &mut h)?;
        Ok(h)
    }

    #[test]
    fn hops_that_agree_pass() {
        hops_agree(&hops(5.0, AGENT).unwrap()).unwrap();
    }

    #[test]
    fn a_missing_series_is_an_error_not_zero() {
        let err = agent_ledger_text("agent", "", true, &mut Hops::default()).unwrap_err();
        assert!(err.contains("relay_agent_calls_received_total"), "{err}");
        let no_busy = AGENT.lines().take(2).collect::<Vec<_>>().join("\n");
        let err = agent_ledger_text("agent", &no_busy, true, &mut Hops::default()).unwrap_err();
        assert!(err.contains("grpc_tunnel_server_streams"), "{err}");
        let no_outcomes = SERVER.lines().take(2).collect::<Vec<_>>().join("\n");
        let err = server_ledger_text("ts-1", &no_outcomes, true, &mut Hops::default()).unwrap_err();
        assert!(err.contains("relay_tunnel_calls_total"), "{err}");
        let err = dispatcher_attempts("").unwrap_err();
        assert!(err.contains("routing_decisions"), "{err}");
    }

    #[test]
    fn an_attempt_no_server_received_fails() {
        let err = hops_agree(&hops(6.0, AGENT).unwrap()).unwrap_err();
        assert!(err.contains("sent 6 forward attempts"), "{err}");
    }

    #[test]
    fn attempts_abandoned_while_a_server_could_not_read_may_go_unreceived_and_no_more() {
        let mut h = hops(6.0, AGENT).unwrap();
        h.abandoned = 1.0;
        hops_agree(&h).unwrap();
        let mut h = hops(7.0, AGENT).unwrap();
        h.abandoned = 1.0;
        let err = hops_agree(&h).unwrap_err();
        assert!(err.contains("sent 7 forward attempts"), "{err}");
    }

    #[test]
    fn an_agent_receiving_more_or_fewer_calls_than_the_servers_passed_on_fails() {
        for n in [3, 5] {
            let agent = AGENT.replace("received_total 4", &format!("received_total {n}"));
            let agent = agent.replace("} 4", &format!("}} {n}"));
            let err = hops_agree(&hops(5.0, &agent).unwrap()).unwrap_err();
            assert!(err.contains("allow 4..=4"), "{n}: {err}");
        }
    }
}
