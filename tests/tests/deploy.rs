//! The deploy kit (`deploy/`), checked with the tools operators use it with:
//!
//! - the Prometheus rules pass `promtool check rules` and `promtool test rules`, every alert
//!   has a test where it fires and one where it stays quiet, and a runbook line in
//!   docs/operations.md;
//! - the systemd units are hardened and pass `systemd-analyze verify` with no complaint;
//! - `systemctl reload` (SIGHUP) never stops a binary, even one with nothing to reload;
//! - every query of the Grafana dashboard and of the rules names only metrics and labels
//!   the relay's processes export (scraped from real processes over TLS);
//! - a real Prometheus scraping a running stack (dispatcher, two tunnel servers, an agent
//!   that reads its token from a file, TLS on every internal hop) sees every series the
//!   rules and the dashboard use, evaluates every dashboard query, and fires the expected
//!   alerts when the agent's token is revoked.
//!
//! The tools come from Debian packages: `promtool` and `prometheus` from `prometheus`,
//! `systemd-analyze` from `systemd`. A missing tool fails the test and names the package
//! (`$PROMTOOL`, `$PROMETHEUS` and `$SYSTEMD_ANALYZE` point at other binaries).

use relay_tests::client::Caller;
use relay_tests::deploy::{repo, tool, Prometheus, TlsStack};
use relay_tests::procs::{binary, wait_http, AgentOpts, AgentProc};
use relay_tests::procs::{DispatcherOpts, DispatcherProc, Proc, ScratchDir};
use relay_tests::procs::{TunnelServerOpts, TunnelServerProc};
use relay_tests::promql;
use relay_tests::stack::{CALLER_KEY, TOKEN, TUNNEL_ID};
use relay_tests::upstream::Upstream;
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

/// Runs `cmd`; returns (success, stdout + stderr).
fn run(cmd: &mut Command) -> (bool, String) {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

fn files(dir: &Path, suffix: &str) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.to_string_lossy().ends_with(suffix))
        .collect();
    v.sort();
    assert!(!v.is_empty(), "no *{suffix} in {}", dir.display());
    v
}

fn rule_files() -> Vec<PathBuf> {
    files(&repo().join("deploy/prometheus"), ".rules.yml")
}

/// Alert names defined in the rule files (`- alert: Name`).
fn alert_names() -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for f in rule_files() {
        for line in std::fs::read_to_string(&f).unwrap().lines() {
            if let Some(n) = line.trim().strip_prefix("- alert:") {
                names.insert(n.trim().to_string());
            }
        }
    }
    names
}

#[test]
fn alert_rules_pass_promtool_and_every_alert_has_tests_and_a_runbook_line() {
    let promtool = tool("promtool", "PROMTOOL", "prometheus");
    let dir = repo().join("deploy/prometheus");
    let (ok, out) = run(Command::new(&promtool)
        .arg("check")
        .arg("rules")
        .args(rule_files()));
    assert!(ok, "promtool check rules failed:\n{out}");
    let (ok, out) = run(Command::new(&promtool)
        .args(["check", "config"])
        .arg(dir.join("prometheus.yml")));
    assert!(ok, "promtool check config failed:\n{out}");
    let tests = files(&dir.join("tests"), ".test.yml");
    let (ok, out) = run(Command::new(&promtool).args(["test", "rules"]).args(&tests));
    assert!(ok, "promtool test rules failed:\n{out}");

    // Every alert is tested firing (exp_labels) and quiet (exp_alerts: []).
    let mut firing = BTreeSet::new();
    let mut quiet = BTreeSet::new();
    for t in &tests {
        let text = std::fs::read_to_string(t).unwrap();
        for case in text.split("- eval_time:").skip(1) {
            let Some(name) = case
                .lines()
                .find_map(|l| l.trim().strip_prefix("alertname:"))
                .map(|n| n.trim().to_string())
            else {
                continue;
            };
            if case.contains("exp_labels:") {
                firing.insert(name);
            } else if case.contains("exp_alerts: []") {
                quiet.insert(name);
            }
        }
    }
    let alerts = alert_names();
    assert!(alerts.len() >= 6, "too few alerts found: {alerts:?}");
    let untested: Vec<_> = alerts.difference(&firing).collect();
    assert!(
        untested.is_empty(),
        "alerts without a test where they fire: {untested:?}"
    );
    let unquiet: Vec<_> = alerts.difference(&quiet).collect();
    assert!(
        unquiet.is_empty(),
        "alerts without a test where they stay quiet: {unquiet:?}"
    );

    // The runbook (docs/operations.md) has a row per alert.
    let runbook = std::fs::read_to_string(repo().join("docs/operations.md")).unwrap();
    let missing: Vec<_> = alerts
        .iter()
        .filter(|a| !runbook.contains(&format!("| `{a}` |")))
        .collect();
    assert!(
        missing.is_empty(),
        "alerts without a runbook row in docs/operations.md: {missing:?}"
    );
}

/// `Key=Value` lines of a unit file (comments and section headers skipped).
fn unit_keys(text: &str) -> Vec<(String, String)> {
    text.lines()
        .map(str::trim)
        .filter(|l| {
            !l.is_empty() && !l.starts_with('#') && !l.starts_with(';') && !l.starts_with('[')
        })
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect()
}

fn seconds(v: &str) -> u64 {
    let v = v.trim();
    if let Some(m) = v.strip_suffix("min") {
        return m.trim().parse::<u64>().expect("minutes") * 60;
    }
    v.trim_end_matches('s')
        .parse()
        .unwrap_or_else(|_| panic!("TimeoutStopSec={v} is not a number of seconds"))
}

#[test]
fn systemd_units_are_hardened_and_pass_systemd_analyze_verify() {
    let analyze = tool("systemd-analyze", "SYSTEMD_ANALYZE", "systemd");
    let units = repo().join("deploy/systemd");
    // How long each binary may take to stop by default (its drain grace).
    let graces = [
        ("relay-agent", Duration::from_secs(10)),
        (
            "relay-tunnel-server",
            relay_tunnel_server::Config::default().shutdown_grace,
        ),
        (
            "relay-dispatcher",
            relay_dispatcher::Config::default().shutdown_grace,
        ),
    ];
    let scratch = ScratchDir::new("units").unwrap();
    let mut copies = Vec::new();
    for (bin, grace) in graces {
        let path = units.join(format!("{bin}.service"));
        let text =
            std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let keys = unit_keys(&text);
        let get = |k: &str| -> Vec<&str> {
            keys.iter()
                .filter(|(key, _)| key == k)
                .map(|(_, v)| v.as_str())
                .collect()
        };
        let one = |k: &str| -> &str {
            let v = get(k);
            assert_eq!(
                v.len(),
                1,
                "{bin}.service: {k}= must be set once, found {v:?}"
            );
            v[0]
        };
        assert_eq!(one("DynamicUser"), "yes", "{bin}.service");
        assert_eq!(one("ProtectSystem"), "strict", "{bin}.service");
        assert_eq!(one("NoNewPrivileges"), "yes", "{bin}.service");
        assert_eq!(
            one("CapabilityBoundingSet"),
            "",
            "{bin}.service: no capability at all"
        );
        assert_eq!(one("AmbientCapabilities"), "", "{bin}.service");
        assert_eq!(
            one("ExecReload"),
            "/bin/kill -HUP $MAINPID",
            "{bin}.service"
        );
        let exec = one("ExecStart");
        assert!(
            exec.starts_with(&format!("/usr/local/bin/{bin} ")),
            "{bin}.service: ExecStart={exec}"
        );
        let stop = Duration::from_secs(seconds(one("TimeoutStopSec")));
        assert!(
            stop >= grace + Duration::from_secs(10),
            "{bin}.service: TimeoutStopSec {stop:?} must be well above the drain grace {grace:?}, or systemd kills a draining process"
        );
        if bin == "relay-agent" {
            assert!(
                exec.contains("--token-file %d/token") && !exec.contains("--token "),
                "the agent's token must come from its credential, never the command line: {exec}"
            );
            assert_eq!(one("LoadCredential"), "token:/etc/relay/agent.token");
        }
        // systemd-analyze checks that the program exists: point the copy at the built
        // binary, leaving every other line as shipped.
        let built = binary(bin).unwrap();
        let copy = scratch.path().join(format!("{bin}.service"));
        std::fs::write(
            &copy,
            text.replace(
                &format!("/usr/local/bin/{bin}"),
                &built.display().to_string(),
            ),
        )
        .unwrap();
        copies.push(copy);
    }
    let (ok, out) = run(Command::new(&analyze).arg("verify").args(&copies));
    assert!(
        ok && out.trim().is_empty(),
        "systemd-analyze verify must pass without a word (unknown keys and bad values only warn):\n{out}"
    );
    for copy in &copies {
        let (ok, out) = run(Command::new(&analyze)
            .args(["security", "--offline=yes"])
            .arg(copy));
        assert!(ok, "systemd-analyze security failed:\n{out}");
        let level: f64 = out
            .lines()
            .find_map(|l| l.split("Overall exposure level for ").nth(1))
            .and_then(|l| l.split(": ").nth(1))
            .and_then(|l| l.split_whitespace().next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no exposure level in:\n{out}"));
        assert!(
            level <= 2.0,
            "{}: exposure {level} (systemd-analyze security), expected at most 2.0:\n{out}",
            copy.display()
        );
    }
}

/// Waits until `proc`'s log contains `needle`, failing if it exits first.
async fn wait_log(proc: &mut Proc, needle: &str, within: Duration) {
    let what = format!("{} logs {needle:?}", proc.name);
    let exited = relay_tests::eventually(&what, within, || {
        let seen = match proc.try_exited() {
            Some(status) => Ok(Some(status)),
            None if proc.log().contains(needle) => Ok(None),
            None => Err(proc.log_tail(20)),
        };
        async move { seen }
    })
    .await;
    if let Some(status) = exited {
        panic!(
            "{} exited ({status}) instead of logging {needle:?}:\n{}",
            proc.name,
            proc.log_tail(20)
        );
    }
}

/// `systemctl reload` sends SIGHUP. Its default action ends a process, so every binary
/// must take it, including one whose hops are all plain text and that has nothing to
/// reload (the local example's).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_reloads_and_never_stops_a_binary() {
    let dir = ScratchDir::new("sighup").unwrap();
    let upstream = Upstream::builder().spawn().await.unwrap();
    let mut dispatcher = DispatcherProc::start(dir.path(), DispatcherOpts::default())
        .await
        .unwrap();
    let mut server = TunnelServerProc::start(
        dir.path(),
        TunnelServerOpts {
            dispatchers: vec![dispatcher.registry_url()],
            ..TunnelServerOpts::default()
        },
    )
    .await
    .unwrap();
    let mut agent = AgentProc::start(
        dir.path(),
        AgentOpts {
            tunnels: vec![server.agent_url()],
            token: TOKEN.into(),
            upstream: upstream.url(),
            ..AgentOpts::default()
        },
    )
    .await
    .unwrap();
    for (proc, admin, needle) in [
        (
            &mut dispatcher.proc,
            dispatcher.admin,
            "SIGHUP: nothing to reload",
        ),
        (
            &mut server.proc,
            server.admin_addr,
            "reloaded from its files",
        ),
        (&mut agent.proc, agent.admin, "SIGHUP: nothing to reload"),
    ] {
        proc.signal("HUP").unwrap();
        wait_log(proc, needle, Duration::from_secs(10)).await;
        wait_http(admin, "/healthz", 200, Duration::from_secs(5))
            .await
            .unwrap();
        assert!(
            proc.try_exited().is_none(),
            "{} stopped on SIGHUP",
            proc.name
        );
    }
    // And the relay still relays.
    let caller = Caller::new(dispatcher.http, Some(CALLER_KEY));
    relay_tests::eventually("a call through the relay after SIGHUP", Duration::from_secs(10), || {
        let caller = caller.clone();
        async move {
            matches!(caller.get(&format!("/relay/{TUNNEL_ID}/hello")).await, Ok(a) if a.status == 200)
        }
    })
    .await;
}

/// Every metric in Prometheus text, with each of its labels and the values seen.
type Exported = BTreeMap<String, BTreeMap<String, BTreeSet<String>>>;

fn exported(texts: &[String]) -> Exported {
    let mut out = Exported::new();
    for text in texts {
        for line in text
            .lines()
            .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        {
            let name_end = line.find(['{', ' ']).unwrap_or(line.len());
            let labels = out.entry(line[..name_end].to_string()).or_default();
            let Some(rest) = line[name_end..].strip_prefix('{') else {
                continue;
            };
            let chars: Vec<char> = rest.chars().collect();
            let mut i = 0;
            while i < chars.len() && chars[i] != '}' {
                let start = i;
                while chars[i] != '=' {
                    i += 1;
                }
                let label: String = chars[start..i].iter().collect();
                i += 2; // ="
                let mut value = String::new();
                while chars[i] != '"' {
                    if chars[i] == '\\' {
                        i += 1;
                    }
                    value.push(chars[i]);
                    i += 1;
                }
                i += 1;
                if chars.get(i) == Some(&',') {
                    i += 1;
                }
                labels.entry(label).or_default().insert(value);
            }
        }
    }
    out
}

/// The dashboard's queries (Grafana's `$__rate_interval` made a real range).
fn dashboard_queries() -> Vec<(String, String)> {
    let path = repo().join("deploy/grafana/relay.json");
    let dash: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap())
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut out = Vec::new();
    fn walk(v: &Value, out: &mut Vec<(String, String)>) {
        if let Some(panels) = v["panels"].as_array() {
            for p in panels {
                for t in p["targets"].as_array().into_iter().flatten() {
                    let expr = t["expr"].as_str().expect("every target has an expr");
                    out.push((
                        p["title"].as_str().unwrap_or("?").to_string(),
                        expr.replace("$__rate_interval", "1m"),
                    ));
                }
                walk(p, out);
            }
        }
    }
    walk(&dash, &mut out);
    out
}

/// Labels every series has once Prometheus scrapes it.
const TARGET_LABELS: [&str; 2] = ["job", "instance"];

/// Checks that `query` names only metrics in `exported` or `recorded`, and labels they
/// carry; errors are pushed to `errors` prefixed with `what`.
fn check_names(
    what: &str,
    query: &str,
    exported: &Exported,
    recorded: &BTreeMap<String, BTreeSet<String>>,
    errors: &mut Vec<String>,
) {
    let names = match promql::names(query) {
        Ok(n) => n,
        Err(e) => return errors.push(format!("{what}: {e}")),
    };
    let mut known_labels: BTreeSet<String> = TARGET_LABELS.iter().map(|s| s.to_string()).collect();
    for s in &names.selectors {
        let Some(metric) = &s.metric else {
            errors.push(format!("{what}: selector {s} names no metric"));
            continue;
        };
        let labels: BTreeSet<String> = if let Some(l) = exported.get(metric) {
            l.keys().cloned().collect()
        } else if let Some(l) = recorded.get(metric) {
            l.clone()
        } else {
            errors.push(format!(
                "{what}: metric {metric} is not exported by any relay process"
            ));
            continue;
        };
        for m in &s.matchers {
            if !labels.contains(&m.label) && !TARGET_LABELS.contains(&m.label.as_str()) {
                errors.push(format!(
                    "{what}: {metric} has no label {:?} (it has {labels:?})",
                    m.label
                ));
                continue;
            }
            // A value the relay never exports is a typo or a renamed value: `=` then
            // matches nothing, `!=` excludes nothing.
            let seen = exported.get(metric).and_then(|l| l.get(&m.label));
            if let Some(seen) = seen {
                let values: Vec<&str> = if m.op == "=" || m.op == "!=" {
                    vec![m.value.as_str()]
                } else if m
                    .value
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '|')
                {
                    m.value.split('|').collect()
                } else {
                    vec![]
                };
                for v in values {
                    if !v.is_empty() && !seen.contains(v) {
                        errors.push(format!(
                            "{what}: {metric}{{{}=\"{v}\"}} is never exported (values seen: {seen:?})",
                            m.label
                        ));
                    }
                }
            }
        }
        if metric.ends_with("_bucket") {
            known_labels.insert("le".into());
        }
        known_labels.extend(labels);
    }
    for l in &names.grouping {
        if !known_labels.contains(l) {
            errors.push(format!(
                "{what}: label {l:?} in a by/without/on/ignoring clause is on none of its metrics ({known_labels:?})"
            ));
        }
    }
}

/// Recorded metric name -> the labels its series can carry (those of the metrics in its
/// expression, the rule's own labels, and the target labels).
fn recorded_labels(
    rules: &[(String, String, String, BTreeMap<String, String>)],
    exported: &Exported,
) -> BTreeMap<String, BTreeSet<String>> {
    let mut out: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    // Recording rules may build on each other: repeat until nothing changes.
    for _ in 0..4 {
        for (kind, name, query, labels) in rules {
            if kind != "recording" {
                continue;
            }
            let mut set: BTreeSet<String> = labels.keys().cloned().collect();
            set.extend(TARGET_LABELS.iter().map(|s| s.to_string()));
            if let Ok(n) = promql::names(query) {
                for s in n.selectors {
                    let m = s.metric.unwrap_or_default();
                    if let Some(l) = exported.get(&m) {
                        set.extend(l.keys().cloned());
                    }
                    if let Some(l) = out.get(&m) {
                        set.extend(l.iter().cloned());
                    }
                }
            }
            out.entry(name.clone()).or_default().extend(set);
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_query_names_only_metrics_and_labels_the_relay_exports() {
    let stack = TlsStack::start("deploy-names").await;
    stack.drive_calls(30).await;
    let exported = exported(&stack.scrape_all().await);
    // The certificate expiry is exported per loaded file, in all four processes.
    for (i, text) in stack.scrape_all().await.iter().enumerate() {
        assert!(
            text.contains("relay_tls_certificate_expiry_timestamp_seconds{"),
            "process {i} exports no certificate expiry:\n{text}"
        );
    }
    // Prometheus parses the rule files; its API hands back every rule's query.
    let prometheus = Prometheus::start(stack.dir.path(), &[], &rule_files()).await;
    let rules = prometheus.rules().await;
    assert_eq!(
        rules.iter().filter(|r| r.0 == "alerting").count(),
        alert_names().len(),
        "prometheus loaded other alerts than the rule files hold: {rules:?}"
    );
    let recorded = recorded_labels(&rules, &exported);
    let mut errors = Vec::new();
    for (kind, name, query, _) in &rules {
        check_names(
            &format!("{kind} rule {name}"),
            query,
            &exported,
            &recorded,
            &mut errors,
        );
    }
    let queries = dashboard_queries();
    assert!(
        queries.len() >= 20,
        "the dashboard has only {} queries",
        queries.len()
    );
    // The dashboard shows what docs/operations.md promises: coverage per server, calls by outcome,
    // latency and queue wait, spill share, RTT and tiers, registry health, certificates.
    let used: BTreeSet<String> = queries
        .iter()
        .flat_map(|(_, q)| promql::names(q).unwrap().selectors)
        .filter_map(|s| s.metric)
        .collect();
    for m in [
        "grpc_tunnel_server_streams",
        "grpc_tunnel_coverage_state",
        "relay_dispatcher_calls_total",
        "relay_dispatcher_call_duration_seconds_bucket",
        "relay_tunnel_queue_wait_seconds_bucket",
        "relay_dispatcher_spills_total",
        "relay_dispatcher_spill_share",
        "relay_dispatcher_server_rtt_seconds",
        "relay_dispatcher_server_tier",
        "relay_dispatcher_registry_degraded",
        "relay_tls_certificate_expiry_timestamp_seconds",
    ] {
        assert!(used.contains(m), "the dashboard does not show {m}");
    }
    for (panel, query) in &queries {
        check_names(
            &format!("dashboard panel {panel:?}"),
            query,
            &exported,
            &recorded,
            &mut errors,
        );
    }
    assert!(
        errors.is_empty(),
        "queries naming what the relay does not export:\n{}",
        errors.join("\n")
    );
}

/// The rule files as the alert test loads them: a copy in `dir` with every `for:` set to
/// 0s, so an alert fires at the first evaluation that sees its condition instead of
/// minutes later. Expressions and thresholds are the shipped ones.
fn rules_without_for(dir: &Path) -> Vec<PathBuf> {
    rule_files()
        .iter()
        .map(|f| {
            let text = std::fs::read_to_string(f).unwrap();
            let copy: Vec<String> = text
                .lines()
                .map(|l| {
                    let t = l.trim_start();
                    if t.starts_with("for:") {
                        format!("{}for: 0s", &l[..l.len() - t.len()])
                    } else {
                        l.to_string()
                    }
                })
                .collect();
            let path = dir.join(f.file_name().unwrap());
            std::fs::write(&path, copy.join("\n")).unwrap();
            path
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prometheus_sees_every_series_and_fires_alerts_when_a_token_is_revoked() {
    let stack = TlsStack::start("deploy-prom").await;
    // The agent's token came from a file: not on its command line, not in its environment.
    let pid = stack.agent.proc.pid();
    for f in ["cmdline", "environ"] {
        let bytes = std::fs::read(format!("/proc/{pid}/{f}")).unwrap();
        assert!(
            !String::from_utf8_lossy(&bytes).contains(TOKEN),
            "the agent's token shows in /proc/{pid}/{f}"
        );
    }
    let rules = rules_without_for(stack.dir.path());
    let prometheus = Prometheus::start(stack.dir.path(), &stack.targets(), &rules).await;
    stack.drive_calls(60).await;

    // Every target is scraped.
    let p = &prometheus;
    relay_tests::eventually("all 4 targets up", Duration::from_secs(30), || async move {
        let up = p.query("up == 1").await;
        if up.len() == 4 {
            Ok(())
        } else {
            Err(format!("up: {up:?}"))
        }
    })
    .await;

    // Every series a rule or a dashboard query selects exists in Prometheus (recorded
    // series included, once the recording rules have run).
    let mut selectors: BTreeMap<String, String> = BTreeMap::new();
    for (_, name, query, _) in prometheus.rules().await {
        for s in promql::names(&query).unwrap().selectors {
            selectors.insert(s.to_string(), format!("rule {name}"));
        }
    }
    let queries = dashboard_queries();
    for (panel, query) in &queries {
        for s in promql::names(query).unwrap().selectors {
            selectors
                .entry(s.to_string())
                .or_insert(format!("dashboard panel {panel:?}"));
        }
    }
    let selectors = &selectors;
    relay_tests::eventually(
        "every selected series in Prometheus",
        Duration::from_secs(30),
        || async move {
            let mut missing = Vec::new();
            for (sel, user) in selectors {
                if p.query(&format!("count({sel})")).await.is_empty() {
                    missing.push(format!("{sel} (used by {user})"));
                }
            }
            if missing.is_empty() {
                Ok(())
            } else {
                Err(format!("missing:\n{}", missing.join("\n")))
            }
        },
    )
    .await;
    // Every dashboard query runs (the query API rejects what is not valid PromQL).
    for (_, query) in &queries {
        prometheus.query(query).await;
    }
    let quiet = prometheus.firing().await;
    assert!(
        quiet.is_empty(),
        "alerts firing on a healthy stack: {quiet:?}"
    );

    // The fault: the agent's token is revoked (its entry leaves both servers' store).
    std::fs::write(stack.dir.path().join("tokens.toml"), "").unwrap();
    let caller = stack.caller();
    relay_tests::eventually("calls answered 503 once the token is revoked", Duration::from_secs(20), || {
        let caller = caller.clone();
        async move {
            matches!(caller.get(&format!("/relay/{TUNNEL_ID}/hello")).await, Ok(a) if a.status == 503)
        }
    })
    .await;
    let expected = ["RelayAgentNoLiveStream", "RelayTokenRefused"];
    let firing = relay_tests::eventually(
        "RelayAgentNoLiveStream and RelayTokenRefused fire",
        Duration::from_secs(60),
        || async move {
            let firing = p.firing().await;
            let names: BTreeSet<&str> = firing.iter().map(|(n, _)| n.as_str()).collect();
            if expected.iter().all(|e| names.contains(e)) {
                Ok(firing)
            } else {
                Err(format!(
                    "firing: {firing:?}\nprometheus log:\n{}",
                    p.proc.log_tail(20)
                ))
            }
        },
    )
    .await;
    let agent = firing
        .iter()
        .find(|(n, _)| n == "RelayAgentNoLiveStream")
        .unwrap();
    assert_eq!(agent.1["instance"], stack.agent.admin.to_string());
    assert_eq!(agent.1["job"], "relay-agent");
    let token = firing
        .iter()
        .find(|(n, _)| n == "RelayTokenRefused")
        .unwrap();
    assert_eq!(token.1["job"], "relay-tunnel-server");
}
