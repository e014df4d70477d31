//! `relay-agent check`: the preflight an operator runs where the agent will run (someone
//! else's network), answering "can it reach the relay and the upstream?" before the agent
//! is started, with one table row per check and an exit code.
//!
//! Checks, in order, each on the real network path the agent will use:
//! - `config`: the config loads and validates (done by the caller; its error names the
//!   key), plus warnings that do not stop the agent (no `[[allow]]` rule: every call is
//!   refused);
//! - `admin`: `admin_listen` can be bound (a warning when taken: a running agent holds it);
//! - `upstream`: one GET of `upstream_check.path` on the upstream, as `/systemcheck` does;
//!   any HTTP answer means reachable (a 5xx is a warning);
//! - per tunnel endpoint: `tcp` (name resolution and a TCP connect), `tls` (for `https://`:
//!   a handshake verified against `[tls]`, with the client certificate when configured),
//!   `token` (a real `Tunnel.Connect` with the agent's token, up to the server's hello,
//!   which names the tunnel id the token opens), and `clock` (the server's clock from the
//!   hello against ours);
//! - `streams`: whether any endpoint accepted the check's stream. A server that answers
//!   but takes no stream (draining, or at its per-token cap) is a warning on its own
//!   `token` row; when no endpoint takes one, the agent could not serve a call, and this
//!   row fails.
//!
//! The stream the `token` check opens takes no call: a tunnel server hands a stream calls
//! only after the agent's first frame, and the check's first frame is `GoingAway`, on which
//! the server closes the stream at once (counted as retired). Through a load balancer each
//! endpoint reaches one of the servers behind it; the row names which.
//!
//! Clock skew: the relay's deadlines travel as durations, so skew does not break calls; it
//! breaks certificate validity near a certificate's start or end and makes logs across
//! hops hard to line up. The server's clock comes from `ServerHello.unix_time_ms`; the
//! skew is measured against the middle of the open's round trip, with half of it as the
//! uncertainty, and fails only when it is certainly above the bound.
//!
//! This module reads the wall clock (`SystemTime`) only for the skew; it never starts the
//! agent and never serves a call.

use crate::config::Config;
use crate::error::OpenError;
use crate::stream::Dialer;
use relay_proto::agent_frame::Kind as Out;
use relay_proto::{AgentFrame, GoingAway};
use std::fmt::Write as _;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::time::Instant;

/// What the check may tolerate.
#[derive(Clone, Debug)]
pub struct CheckOptions {
    /// Largest clock difference to a tunnel server that passes.
    pub max_clock_skew: Duration,
}

impl Default for CheckOptions {
    fn default() -> Self {
        CheckOptions {
            max_clock_skew: Duration::from_secs(5),
        }
    }
}

/// The result of one row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    Ok,
    /// Worth knowing; the agent would still work.
    Warn,
    Fail,
    /// Not run, because an earlier check of the same target failed.
    Skipped,
}

impl Outcome {
    fn label(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::Warn => "WARN",
            Outcome::Fail => "FAIL",
            Outcome::Skipped => "skipped",
        }
    }
}

/// One row of the table.
#[derive(Clone, Debug)]
pub struct Row {
    pub check: &'static str,
    pub target: String,
    pub outcome: Outcome,
    pub detail: String,
}

/// Every row, in the order the checks ran.
#[derive(Clone, Debug, Default)]
pub struct Report {
    pub rows: Vec<Row>,
}

impl Report {
    fn push(&mut self, check: &'static str, target: &str, outcome: Outcome, detail: String) {
        self.rows.push(Row {
            check,
            target: target.to_string(),
            outcome,
            detail,
        });
    }

    /// A report of a config that did not load: one failing row naming the problem.
    pub fn config_failed(source: &str, error: &str) -> Self {
        let mut r = Report::default();
        r.push("config", source, Outcome::Fail, error.to_string());
        r
    }

    /// The rows that failed.
    pub fn failed(&self) -> Vec<&Row> {
        self.rows
            .iter()
            .filter(|r| r.outcome == Outcome::Fail)
            .collect()
    }

    /// The table: CHECK, TARGET, RESULT, DETAIL.
    pub fn table(&self) -> String {
        let w_check = self
            .rows
            .iter()
            .map(|r| r.check.len())
            .max()
            .unwrap_or(0)
            .max(5);
        let w_target = self
            .rows
            .iter()
            .map(|r| r.target.len())
            .max()
            .unwrap_or(0)
            .max(6);
        let mut out = String::new();
        let _ = writeln!(
            out,
            "{:<w_check$}  {:<w_target$}  {:<7}  DETAIL",
            "CHECK", "TARGET", "RESULT"
        );
        for r in &self.rows {
            let _ = writeln!(
                out,
                "{:<w_check$}  {:<w_target$}  {:<7}  {}",
                r.check,
                r.target,
                r.outcome.label(),
                r.detail
            );
        }
        out
    }

    /// One line: what failed, or that everything passed.
    pub fn verdict(&self) -> String {
        let failed = self.failed();
        if failed.is_empty() {
            let warned = self
                .rows
                .iter()
                .filter(|r| r.outcome == Outcome::Warn)
                .count();
            if warned == 0 {
                "all checks passed".into()
            } else {
                format!("all checks passed ({warned} warning(s) above)")
            }
        } else {
            let what: Vec<String> = failed
                .iter()
                .map(|r| format!("{} ({})", r.check, r.target))
                .collect();
            format!("FAILED: {}", what.join(", "))
        }
    }
}

/// Runs every check against a validated `config`. `source` names where the config came
/// from (a file, or flags and environment) for the `config` row.
pub async fn run(config: &Config, source: &str, opts: &CheckOptions) -> Report {
    let mut report = Report::default();
    let rules = config.allow.len();
    let tls_note = if config.tls.insecure {
        "plain text (insecure = true)"
    } else {
        "TLS"
    };
    if rules == 0 {
        report.push(
            "config",
            source,
            Outcome::Warn,
            format!(
                "valid; but no [[allow]] rule: every call will be refused (accept filters are default deny); {} tunnel endpoint(s), {tls_note}",
                config.tunnels.len()
            ),
        );
    } else {
        report.push(
            "config",
            source,
            Outcome::Ok,
            format!(
                "valid: {} tunnel endpoint(s), {tls_note}, {rules} allow rule(s)",
                config.tunnels.len()
            ),
        );
    }

    admin(config, &mut report).await;
    upstream(config, &mut report).await;

    let tls = match config
        .tls
        .resolve("tls", relay_common::tls::ClientCerts::Optional)
    {
        Ok(Some(c)) => {
            match relay_common::tls::TlsClient::new("tls", c, relay_common::tls::ALPN_H2) {
                Ok(t) => Some(t),
                Err(e) => {
                    report.push("tls", "[tls]", Outcome::Fail, format!("cannot load: {e}"));
                    return report;
                }
            }
        }
        Ok(None) => None,
        Err(e) => {
            report.push("tls", "[tls]", Outcome::Fail, e.to_string());
            return report;
        }
    };
    let mut accepted = 0;
    for url in &config.tunnels {
        if tunnel(config, url, tls.as_ref(), opts, &mut report).await {
            accepted += 1;
        }
    }
    // The agent serves only on streams a server took: endpoints that all answer (every
    // server draining, or at its per-token cap) but take none leave it unable to serve.
    let endpoints = config.tunnels.len();
    if accepted == 0 {
        report.push(
            "streams",
            "tunnels",
            Outcome::Fail,
            format!(
                "no tunnel endpoint accepted a stream (0 of {endpoints}): the agent could not serve a call now; see the rows above (a server that is draining or at its per-token cap takes none)"
            ),
        );
    } else {
        report.push(
            "streams",
            "tunnels",
            Outcome::Ok,
            format!("{accepted} of {endpoints} tunnel endpoint(s) accepted a stream"),
        );
    }
    report
}

async fn admin(config: &Config, report: &mut Report) {
    let target = config.admin_listen.to_string();
    match tokio::net::TcpListener::bind(config.admin_listen).await {
        Ok(_) => report.push("admin", &target, Outcome::Ok, "admin_listen can be bound".into()),
        Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => report.push(
            "admin",
            &target,
            Outcome::Warn,
            "in use (a running agent?): the agent does not start while another process holds admin_listen".into(),
        ),
        Err(e) => report.push(
            "admin",
            &target,
            Outcome::Fail,
            format!("cannot bind admin_listen: {e}"),
        ),
    }
}

async fn upstream(config: &Config, report: &mut Report) {
    let path = &config.upstream_check.path;
    let target = format!("{}{}", config.upstream.trim_end_matches('/'), path);
    let upstream =
        match crate::upstream::Upstream::new(&config.upstream, config.connect_timeout, None) {
            Ok(u) => u,
            Err(e) => {
                report.push("upstream", &target, Outcome::Fail, e.to_string());
                return;
            }
        };
    match upstream.probe(path, config.upstream_check.timeout).await {
        Ok((status, took)) if status.is_server_error() => report.push(
            "upstream",
            &target,
            Outcome::Warn,
            format!(
                "reachable, but GET {path} answered HTTP {} in {}",
                status.as_u16(),
                ms(took)
            ),
        ),
        Ok((status, took)) => report.push(
            "upstream",
            &target,
            Outcome::Ok,
            format!(
                "reachable: GET {path} answered HTTP {} in {}",
                status.as_u16(),
                ms(took)
            ),
        ),
        Err(crate::error::UpstreamError::Timeout) => report.push(
            "upstream",
            &target,
            Outcome::Fail,
            format!(
                "unreachable: no answer within upstream_check.timeout ({})",
                humantime::format_duration(config.upstream_check.timeout)
            ),
        ),
        Err(e) => report.push("upstream", &target, Outcome::Fail, e.to_string()),
    }
}

/// `tcp`, `tls`, `token` and `clock` rows of one tunnel endpoint; true when a server
/// behind it accepted the check's stream (its hello came).
async fn tunnel(
    config: &Config,
    url: &str,
    tls: Option<&relay_common::tls::TlsClient>,
    opts: &CheckOptions,
    report: &mut Report,
) -> bool {
    let timeout = config.connect_timeout;
    let skip_rest = |report: &mut Report, from: &[&'static str], why: &str| {
        for check in from {
            report.push(check, url, Outcome::Skipped, why.to_string());
        }
    };
    let Some((host, port)) = host_port(url) else {
        report.push("tcp", url, Outcome::Fail, "not a URL with a host".into());
        return false;
    };

    // tcp: resolve and connect, as the agent's dialer will.
    let started = Instant::now();
    let addrs =
        match tokio::time::timeout(timeout, tokio::net::lookup_host((host.as_str(), port))).await {
            Ok(Ok(a)) => a.collect::<Vec<_>>(),
            Ok(Err(e)) => {
                report.push(
                    "tcp",
                    url,
                    Outcome::Fail,
                    format!("cannot resolve {host}: {e}"),
                );
                skip_rest(report, &["tls", "token", "clock"], "tcp failed");
                return false;
            }
            Err(_) => {
                report.push(
                    "tcp",
                    url,
                    Outcome::Fail,
                    format!("resolving {host} timed out"),
                );
                skip_rest(report, &["tls", "token", "clock"], "tcp failed");
                return false;
            }
        };
    let mut last_err = format!("{host} resolves to no address");
    let mut connected = None;
    for addr in &addrs {
        match tokio::time::timeout(timeout, tokio::net::TcpStream::connect(addr)).await {
            Ok(Ok(_)) => {
                connected = Some(*addr);
                break;
            }
            Ok(Err(e)) => last_err = format!("cannot connect to {addr}: {e}"),
            Err(_) => {
                last_err = format!(
                    "connecting to {addr} timed out after connect_timeout ({})",
                    humantime::format_duration(timeout)
                )
            }
        }
    }
    let Some(addr) = connected else {
        report.push("tcp", url, Outcome::Fail, last_err);
        skip_rest(report, &["tls", "token", "clock"], "tcp failed");
        return false;
    };
    report.push(
        "tcp",
        url,
        Outcome::Ok,
        format!("connected to {addr} in {}", ms(started.elapsed())),
    );

    // tls: a verified handshake with the agent's own [tls] settings.
    match tls {
        None => report.push(
            "tls",
            url,
            Outcome::Warn,
            "plain text: [tls] insecure = true, the token travels unencrypted".into(),
        ),
        Some(tls) => {
            let started = Instant::now();
            let hs = tokio::time::timeout(timeout, tls.connect(&host, &addr.to_string())).await;
            match hs {
                Ok(Ok(stream)) => {
                    let (_, conn) = stream.get_ref();
                    let version = conn
                        .protocol_version()
                        .map(|v| format!("{v:?}").replace("TLSv1_", "TLS 1."))
                        .unwrap_or_else(|| "TLS".into());
                    let alpn = conn
                        .alpn_protocol()
                        .map(|p| String::from_utf8_lossy(p).into_owned())
                        .unwrap_or_else(|| "no ALPN".into());
                    report.push(
                        "tls",
                        url,
                        Outcome::Ok,
                        format!(
                            "{version}, {alpn}, server certificate verified against [tls] ca in {}",
                            ms(started.elapsed())
                        ),
                    );
                }
                Ok(Err(e)) => {
                    report.push("tls", url, Outcome::Fail, format!("handshake failed: {e}"));
                    skip_rest(report, &["token", "clock"], "tls failed");
                    return false;
                }
                Err(_) => {
                    report.push(
                        "tls",
                        url,
                        Outcome::Fail,
                        format!(
                            "handshake timed out after connect_timeout ({})",
                            humantime::format_duration(timeout)
                        ),
                    );
                    skip_rest(report, &["token", "clock"], "tls failed");
                    return false;
                }
            }
        }
    }

    // token: a real open, up to the hello, then GoingAway before anything else.
    let dialer = match Dialer::new(
        &[url.to_string()],
        &config.token,
        timeout,
        match config.tunnel_h2() {
            Ok(h2) => h2,
            Err(e) => {
                report.push("token", url, Outcome::Fail, e.to_string());
                return false;
            }
        },
        tls.cloned(),
    ) {
        Ok(d) => d.with_max_frame_bytes(config.max_frame_bytes),
        Err(e) => {
            report.push("token", url, Outcome::Fail, e.to_string());
            return false;
        }
    };
    let crate::stream::Picked {
        endpoint, channel, ..
    } = dialer.pick();
    let sent_at = relay_common::wall::now();
    let started = Instant::now();
    let opened = tokio::time::timeout(
        timeout,
        crate::stream::open(&dialer, endpoint, channel, None, None),
    )
    .await;
    let received_at = relay_common::wall::now();
    let took = started.elapsed();
    let (tx, mut inbound, hello) = match opened {
        Ok(Ok(x)) => x,
        Ok(Err(OpenError::Unauthenticated(msg))) => {
            report.push(
                "token",
                url,
                Outcome::Fail,
                format!(
                    "refused by the tunnel server ({msg}): the agent's `token` (or RELAY_TOKEN) is not in that server's token store"
                ),
            );
            skip_rest(report, &["clock"], "token refused");
            return false;
        }
        Ok(Err(OpenError::Exhausted(msg, refused))) => {
            let server = refused
                .map(|r| format!(" (server {})", r.server_id))
                .unwrap_or_default();
            report.push(
                "token",
                url,
                Outcome::Warn,
                format!("accepted, but the server{server} takes no stream now: {msg}"),
            );
            skip_rest(report, &["clock"], "no hello");
            return false;
        }
        Ok(Err(OpenError::Other(msg) | OpenError::Endpoint(msg) | OpenError::Busy(msg))) => {
            report.push(
                "token",
                url,
                Outcome::Fail,
                format!("could not open a tunnel stream: {msg}"),
            );
            skip_rest(report, &["clock"], "no hello");
            return false;
        }
        Err(_) => {
            report.push(
                "token",
                url,
                Outcome::Fail,
                format!(
                    "no server hello within connect_timeout ({})",
                    humantime::format_duration(timeout)
                ),
            );
            skip_rest(report, &["clock"], "no hello");
            return false;
        }
    };
    // Retire at once: GoingAway as the first frame means the server never hands this
    // stream a call and closes it; wait for that close so nothing is left half-open.
    let _ = tx.send(AgentFrame::of(Out::GoingAway(GoingAway {}))).await;
    let closed = tokio::time::timeout(timeout, async {
        while let Ok(Some(_)) = inbound.message().await {}
    })
    .await
    .is_ok();
    drop(tx);
    let zone = if hello.zone.is_empty() {
        String::new()
    } else {
        format!(", zone {}", hello.zone)
    };
    report.push(
        "token",
        url,
        if closed { Outcome::Ok } else { Outcome::Warn },
        format!(
            "accepted: tunnel id {} on server {}{zone}, protocol {}, hello in {}{}",
            crate::stream::server_text(&hello.tunnel_id),
            hello.server_id,
            hello.protocol_version,
            ms(took),
            if closed {
                ""
            } else {
                "; the server did not close the check's stream in time"
            }
        ),
    );

    // clock
    if hello.unix_time_ms == 0 {
        report.push(
            "clock",
            url,
            Outcome::Skipped,
            "the server does not send its time (an older tunnel server); compare `date -u` on both hosts".into(),
        );
        return true;
    }
    let server = UNIX_EPOCH + Duration::from_millis(hello.unix_time_ms);
    let (skew, uncertainty) = skew(server, sent_at, received_at);
    let bound = opts.max_clock_skew.as_secs_f64();
    let text = format!(
        "server clock {:+.3} s from ours (±{:.3} s; bound {} s)",
        skew,
        uncertainty,
        fmt_secs(bound)
    );
    if skew.abs() - uncertainty > bound {
        report.push(
            "clock",
            url,
            Outcome::Fail,
            format!("{text}: sync this host's clock (NTP)"),
        );
    } else {
        report.push("clock", url, Outcome::Ok, text);
    }
    true
}

/// The server's clock minus ours in seconds, against the middle of `[sent, received]`,
/// and half that interval as the uncertainty.
fn skew(server: SystemTime, sent: SystemTime, received: SystemTime) -> (f64, f64) {
    let secs = |t: SystemTime| {
        t.duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs_f64())
            .unwrap_or(0.0)
    };
    let (s, a, b) = (secs(server), secs(sent), secs(received));
    let b = b.max(a);
    (s - (a + b) / 2.0, (b - a) / 2.0)
}

fn host_port(url: &str) -> Option<(String, u16)> {
    let uri: http::Uri = url.parse().ok()?;
    let host = uri
        .host()?
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_string();
    let port = uri
        .port_u16()
        .unwrap_or(if uri.scheme_str() == Some("https") {
            443
        } else {
            80
        });
    Some((host, port))
}

fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1000.0)
}

fn fmt_secs(s: f64) -> String {
    if s.fract() == 0.0 {
        format!("{s:.0}")
    } else {
        format!("{s}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn skew_is_measured_against_the_middle_of_the_round_trip() {
        let t = |ms: u64| UNIX_EPOCH + Duration::from_millis(1_700_000_000_000 + ms);
        let (skew, unc) = skew(t(10_050), t(0), t(100));
        assert!((skew - 10.0).abs() < 1e-6, "{skew}");
        assert!((unc - 0.05).abs() < 1e-6, "{unc}");
        let (skew, _) = skew_of_behind();
        assert!(skew < -59.0, "{skew}");
    }

    fn skew_of_behind() -> (f64, f64) {
        let t = |ms: u64| UNIX_EPOCH + Duration::from_millis(1_700_000_000_000 + ms);
        skew(t(0), t(60_000), t(60_010))
    }

    #[test]
    fn the_verdict_names_each_failed_check_and_its_target() {
        let mut r = Report::default();
        r.push("config", "a.toml", Outcome::Ok, String::new());
        r.push("upstream", "http://127.0.0.1:1/", Outcome::Fail, "x".into());
        r.push("token", "http://127.0.0.1:2", Outcome::Fail, "y".into());
        r.push("clock", "http://127.0.0.1:2", Outcome::Skipped, "z".into());
        assert_eq!(
            r.verdict(),
            "FAILED: upstream (http://127.0.0.1:1/), token (http://127.0.0.1:2)"
        );
        let table = r.table();
        assert!(table.starts_with("CHECK"), "{table}");
        assert_eq!(table.lines().count(), 5, "{table}");
    }
}
