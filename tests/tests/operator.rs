//! What an operator runs besides the relay itself, with the real binaries:
//! `relay-tunnel-server tokens add | revoke` against a running server that reloads on
//! SIGHUP, `relay-agent check` (the agent's preflight) against a real tunnel server and
//! upstream, and the start-up noise of `relay-fleet demo` and `relay-fleet run`.

use relay_tests::hostile::{open, Opened};
use relay_tests::procs::{
    binary, free_addr, metric, scrape, series, AgentOpts, AgentProc, DispatcherOpts,
    DispatcherProc, ScratchDir, TunnelServerOpts, TunnelServerProc,
};
use relay_tests::stack::{TOKEN, TUNNEL_ID};
use relay_tests::upstream::Upstream;
use std::path::Path;
use std::process::Output;
use std::time::Duration;

/// Runs a binary to its end (off the runtime's threads) and returns what it printed.
async fn run(name: &str, args: &[&str], envs: &[(&str, &str)]) -> Output {
    let bin = binary(name).expect("binary");
    let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    let envs: Vec<(String, String)> = envs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    tokio::task::spawn_blocking(move || {
        let mut cmd = std::process::Command::new(bin);
        cmd.args(&args)
            .env_remove("RELAY_CONFIG")
            .env_remove("RELAY_TOKEN")
            .env_remove("RELAY_TOKEN_STORE")
            .env_remove("RELAY_LOG")
            .env_remove("RUST_LOG");
        for (k, v) in envs {
            cmd.env(k, v);
        }
        cmd.output().expect("run the binary")
    })
    .await
    .expect("join")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Polls `open` until `ok(result)`, up to `within`.
async fn open_until(
    url: &str,
    token: &str,
    within: Duration,
    what: &str,
    ok: impl Fn(&Result<Opened, tonic::Status>) -> bool,
) -> Result<Opened, tonic::Status> {
    let ok = &ok;
    relay_tests::eventually(what, within, || async move {
        let r = open(url, token).await;
        if ok(&r) {
            Ok(r)
        } else {
            Err(format!("last {:?}", r.as_ref().map(|o| &o.tunnel_id)))
        }
    })
    .await
}

fn refused(r: &Result<Opened, tonic::Status>) -> bool {
    matches!(r, Err(s) if s.code() == tonic::Code::Unauthenticated)
}

/// A minted token reaches a running server on SIGHUP (not before: the file watch is set to
/// an hour), opens its tunnel id, and is gone again after `tokens revoke` and another
/// SIGHUP, which also closes the stream it had open. Other tokens are untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_added_and_revoked_reach_a_running_server_on_sighup() {
    let dir = ScratchDir::new("tokens").unwrap();
    let server = TunnelServerProc::start(
        dir.path(),
        TunnelServerOpts {
            extra: "reload_interval = \"1h\"".into(),
            ..TunnelServerOpts::default()
        },
    )
    .await
    .unwrap();
    let url = server.agent_url();
    let store = server.token_store.display().to_string();

    let out = run(
        "relay-tunnel-server",
        &[
            "tokens",
            "add",
            "--tunnel-id",
            "acme-scm",
            "--store",
            &store,
        ],
        &[],
    )
    .await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    let token = stdout.trim().to_string();
    assert_eq!(
        stdout.lines().count(),
        1,
        "stdout is the token alone: {stdout}"
    );
    assert!(token.starts_with("relay_") && token.len() >= 40, "{token}");
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("acme-scm") && stderr.contains("shown only this once"),
        "{stderr}"
    );
    assert!(
        !std::fs::read_to_string(&server.token_store)
            .unwrap()
            .contains(&token),
        "the store holds the hash, not the token"
    );

    // Not loaded yet: the running server still has the old store.
    assert!(refused(&open(&url, &token).await), "opened before reload");
    server.proc.signal("HUP").unwrap();
    let held = open_until(
        &url,
        &token,
        Duration::from_secs(10),
        "new token accepted",
        |r| r.is_ok(),
    )
    .await
    .unwrap();
    assert_eq!(held.tunnel_id, "acme-scm");
    assert_eq!(open(&url, TOKEN).await.unwrap().tunnel_id, TUNNEL_ID);

    // A revoke naming nothing in the store fails and says what the store holds.
    let out = run(
        "relay-tunnel-server",
        &[
            "tokens",
            "revoke",
            "--tunnel-id",
            "acme-scn",
            "--store",
            &store,
        ],
        &[],
    )
    .await;
    assert_eq!(out.status.code(), Some(1));
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("\"acme-scn\"") && stderr.contains("acme-scm (1)"),
        "{stderr}"
    );

    let out = run(
        "relay-tunnel-server",
        &[
            "tokens",
            "revoke",
            "--tunnel-id",
            "acme-scm",
            "--store",
            &store,
        ],
        &[],
    )
    .await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).contains("revoked acme-scm"),
        "{}",
        text(&out.stdout)
    );
    server.proc.signal("HUP").unwrap();
    open_until(
        &url,
        &token,
        Duration::from_secs(10),
        "revoked token refused",
        refused,
    )
    .await
    .err();
    // The stream opened with it is closed with the revocation.
    let mut inbound = held.inbound;
    let end = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            match inbound.message().await {
                Ok(Some(_)) => continue,
                Ok(None) => return None,
                Err(s) => return Some(s),
            }
        }
    })
    .await
    .expect("the revoked token's stream ends");
    let end = end.expect("an error status");
    assert_eq!(end.code(), tonic::Code::Unauthenticated, "{end:?}");
    assert!(end.message().contains("revoked"), "{end:?}");
    assert_eq!(open(&url, TOKEN).await.unwrap().tunnel_id, TUNNEL_ID);

    // `--config` finds the store through the server's config.
    let cfg = dir.path().join("ts-1.toml").display().to_string();
    let out = run(
        "relay-tunnel-server",
        &["tokens", "list", "--config", &cfg],
        &[],
    )
    .await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    let listed = text(&out.stdout);
    assert!(
        listed.contains(TUNNEL_ID) && !listed.contains("acme-scm"),
        "{listed}"
    );
}

/// An agent config for `relay-agent check`.
fn agent_config(dir: &Path, tunnel: &str, token: &str, upstream: &str, tls: &str) -> String {
    let path = dir.join("agent-check.toml");
    let admin = free_addr().unwrap();
    std::fs::write(
        &path,
        format!(
            "tunnels = [{tunnel:?}]\ntoken = {token:?}\nupstream = {upstream:?}\nadmin_listen = \"{admin}\"\n\
             connect_timeout = \"3s\"\n\n[tls]\n{tls}\n\n[[allow]]\nmethods = [\"GET\"]\npath = \"/**\"\n"
        ),
    )
    .unwrap();
    path.display().to_string()
}

/// The table's row for `check` (first match), for assertions.
fn row<'a>(table: &'a str, check: &str) -> &'a str {
    table
        .lines()
        .find(|l| l.split_whitespace().next() == Some(check))
        .unwrap_or_else(|| panic!("no {check} row in:\n{table}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_check_passes_against_a_working_stack_and_takes_no_call() {
    let dir = ScratchDir::new("check-ok").unwrap();
    let server = TunnelServerProc::start(dir.path(), TunnelServerOpts::default())
        .await
        .unwrap();
    let upstream = Upstream::builder().spawn().await.unwrap();
    let cfg = agent_config(
        dir.path(),
        &server.agent_url(),
        TOKEN,
        &upstream.url(),
        "insecure = true",
    );
    let out = run("relay-agent", &["check", "--config", &cfg], &[]).await;
    let table = text(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{table}{}", text(&out.stderr));
    for check in ["config", "admin", "upstream", "tcp", "token", "clock"] {
        assert!(row(&table, check).contains(" ok "), "{check}:\n{table}");
    }
    assert!(row(&table, "tls").contains("WARN"), "{table}");
    let token = row(&table, "token");
    assert!(
        token.contains(&format!("tunnel id {TUNNEL_ID}")) && token.contains("server ts-1"),
        "{token}"
    );
    assert!(
        text(&out.stderr).contains("all checks passed"),
        "{}",
        text(&out.stderr)
    );
    // The check's stream was retired on the spot: none left, and no call went to it.
    let m = scrape(server.admin_addr).await.unwrap();
    assert_eq!(
        metric(&m, "relay_tunnel_streams", &[("tunnel_id", TUNNEL_ID)]),
        0.0,
        "{m}"
    );
    assert_eq!(
        metric(
            &m,
            "relay_tunnel_stream_closes_total",
            &[("reason", "retired")]
        ),
        1.0
    );
    assert_eq!(metric(&m, "relay_tunnel_calls_total", &[]), 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_check_fails_naming_the_token_the_upstream_or_the_config_key() {
    let dir = ScratchDir::new("check-fail").unwrap();
    let server = TunnelServerProc::start(dir.path(), TunnelServerOpts::default())
        .await
        .unwrap();
    let upstream = Upstream::builder().spawn().await.unwrap();

    // A token the server does not know.
    let cfg = agent_config(
        dir.path(),
        &server.agent_url(),
        "not-the-token",
        &upstream.url(),
        "insecure = true",
    );
    let out = run("relay-agent", &["check", "--config", &cfg], &[]).await;
    let table = text(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{table}");
    assert!(row(&table, "token").contains("FAIL"), "{table}");
    assert!(row(&table, "token").contains("token"), "{table}");
    assert!(row(&table, "upstream").contains(" ok "), "{table}");
    let verdict = text(&out.stderr);
    assert!(
        verdict.contains(&format!("FAILED: token ({})", server.agent_url())),
        "{verdict}"
    );
    // The token never shows up in what the check prints.
    assert!(!table.contains("not-the-token") && !verdict.contains("not-the-token"));

    // The right token from the environment overrides the file's.
    let out = run(
        "relay-agent",
        &["check", "--config", &cfg],
        &[("RELAY_TOKEN", TOKEN)],
    )
    .await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stdout));

    // An upstream nobody listens on.
    let down = format!("http://{}", free_addr().unwrap());
    let cfg = agent_config(
        dir.path(),
        &server.agent_url(),
        TOKEN,
        &down,
        "insecure = true",
    );
    let out = run("relay-agent", &["check", "--config", &cfg], &[]).await;
    let table = text(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{table}");
    assert!(row(&table, "upstream").contains("FAIL"), "{table}");
    assert!(row(&table, "token").contains(" ok "), "{table}");
    let verdict = text(&out.stderr);
    assert!(
        verdict.contains(&format!("FAILED: upstream ({down}/)")),
        "{verdict}"
    );

    // A tunnel endpoint nobody listens on.
    let gone = format!("http://{}", free_addr().unwrap());
    let cfg = agent_config(dir.path(), &gone, TOKEN, &upstream.url(), "insecure = true");
    let out = run("relay-agent", &["check", "--config", &cfg], &[]).await;
    let table = text(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{table}");
    assert!(row(&table, "tcp").contains("FAIL"), "{table}");
    assert!(row(&table, "token").contains("skipped"), "{table}");
    assert!(text(&out.stderr).contains(&format!("FAILED: tcp ({gone})")));

    // A config that does not validate: exit 2, naming the key.
    let cfg = agent_config(
        dir.path(),
        &server.agent_url(),
        TOKEN,
        "ftp://127.0.0.1:21",
        "insecure = true",
    );
    let out = run("relay-agent", &["check", "--config", &cfg], &[]).await;
    let table = text(&out.stdout);
    assert_eq!(out.status.code(), Some(2), "{table}");
    assert!(row(&table, "config").contains("FAIL"), "{table}");
    assert!(row(&table, "config").contains("`upstream`"), "{table}");
    assert!(text(&out.stderr).contains("FAILED: config"));
    // An unknown key is named too.
    let path = dir.path().join("typo.toml");
    std::fs::write(&path, "tunnels = [\"http://127.0.0.1:1\"]\ntokn = \"x\"\n").unwrap();
    let out = run(
        "relay-agent",
        &["check", "--config", &path.display().to_string()],
        &[],
    )
    .await;
    assert_eq!(out.status.code(), Some(2));
    assert!(
        row(&text(&out.stdout), "config").contains("tokn"),
        "{}",
        text(&out.stdout)
    );
}

/// A tunnel server that answers but takes no stream (here: draining, held open by one
/// agent stream it waits for) is a warning on its `token` row, and with no endpoint that
/// takes a stream the check fails: the agent could not serve a call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_check_fails_when_no_endpoint_accepts_a_stream() {
    let dir = ScratchDir::new("check-draining").unwrap();
    let server = TunnelServerProc::start(
        dir.path(),
        TunnelServerOpts {
            shutdown_grace: Duration::from_secs(120),
            ..TunnelServerOpts::default()
        },
    )
    .await
    .unwrap();
    let upstream = Upstream::builder().spawn().await.unwrap();
    let cfg = agent_config(
        dir.path(),
        &server.agent_url(),
        TOKEN,
        &upstream.url(),
        "insecure = true",
    );
    let out = run("relay-agent", &["check", "--config", &cfg], &[]).await;
    let table = text(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{table}");
    assert!(row(&table, "streams").contains(" ok "), "{table}");
    assert!(row(&table, "streams").contains("1 of 1"), "{table}");

    // One stream (answering heartbeats, ignoring Drain) keeps the server draining.
    let holder = relay_tests::hostile::HostileAgent::open(&server.agent_url(), TOKEN)
        .await
        .unwrap();
    server.proc.signal("TERM").unwrap();
    relay_tests::procs::wait_http(server.admin_addr, "/readyz", 503, Duration::from_secs(10))
        .await
        .unwrap();

    let out = run("relay-agent", &["check", "--config", &cfg], &[]).await;
    let table = text(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{table}{}", text(&out.stderr));
    let token = row(&table, "token");
    assert!(
        token.contains("WARN") && token.contains("draining"),
        "{table}"
    );
    let streams = row(&table, "streams");
    assert!(
        streams.contains("FAIL") && streams.contains("0 of 1"),
        "{table}"
    );
    assert!(
        text(&out.stderr).contains("FAILED: streams (tunnels)"),
        "{}",
        text(&out.stderr)
    );
    drop(holder);
}

/// With TLS: the handshake is verified against the agent's `[tls] ca`; another CA fails
/// the `tls` row and the token is not sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_check_verifies_the_tunnel_servers_certificate() {
    let dir = ScratchDir::new("check-tls").unwrap();
    let set = relay_tests::certs::generate(&dir.path().join("certs"), &["127.0.0.1", "localhost"])
        .unwrap();
    let other = relay_tests::certs::generate(&dir.path().join("other"), &["127.0.0.1"]).unwrap();
    let server = TunnelServerProc::start(
        dir.path(),
        TunnelServerOpts {
            agent_tls: Some(set.tunnel_server.clone()),
            ..TunnelServerOpts::default()
        },
    )
    .await
    .unwrap();
    let upstream = Upstream::builder().spawn().await.unwrap();
    let url = server.agent_url();
    assert!(url.starts_with("https://"), "{url}");

    let tls = format!("ca = {:?}", set.ca.display().to_string());
    let cfg = agent_config(dir.path(), &url, TOKEN, &upstream.url(), &tls);
    let out = run("relay-agent", &["check", "--config", &cfg], &[]).await;
    let table = text(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{table}{}", text(&out.stderr));
    assert!(row(&table, "tls").contains(" ok "), "{table}");
    assert!(row(&table, "tls").contains("TLS 1.3"), "{table}");
    assert!(row(&table, "token").contains(" ok "), "{table}");

    let tls = format!("ca = {:?}", other.ca.display().to_string());
    let cfg = agent_config(dir.path(), &url, TOKEN, &upstream.url(), &tls);
    let out = run("relay-agent", &["check", "--config", &cfg], &[]).await;
    let table = text(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{table}");
    assert!(row(&table, "tls").contains("FAIL"), "{table}");
    assert!(row(&table, "token").contains("skipped"), "{table}");
    let m = scrape(server.admin_addr).await.unwrap();
    assert_eq!(
        metric(&m, "relay_tunnel_stream_opens_total", &[]),
        1.0,
        "only the first check opened a stream: {m}"
    );
}

/// The log lines at WARN level (colour codes removed: the log format adds them).
fn warn_lines(log: &str) -> Vec<String> {
    log.lines()
        .map(strip_ansi)
        .filter(|l| l.contains(" WARN "))
        .collect()
}

fn strip_ansi(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            // CSI: ESC [ parameters final-byte (a letter)
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// `relay-fleet demo`: dispatcher, two tunnel servers and an agent, every hop plain text,
/// say so in one line, not one per hop of every component.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_demo_says_plain_text_once() {
    let out = run(
        "relay-fleet",
        &["demo", "--once", "--listen", "127.0.0.1:0"],
        &[],
    )
    .await;
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "{stdout}{stderr}");
    assert!(stdout.contains("GET  /hello"), "{stdout}");
    let all = format!("{stdout}{stderr}");
    let warns = warn_lines(&all);
    assert_eq!(warns.len(), 1, "{all}");
    assert!(warns[0].contains("insecure = true"), "{}", warns[0]);
}

/// `relay-fleet run` with 60 agents: one warning line, not one per agent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_run_says_plain_text_once_for_all_its_agents() {
    let dir = ScratchDir::new("fleet-quiet").unwrap();
    let scenario = dir.path().join("quiet.toml");
    std::fs::write(
        &scenario,
        "name = \"quiet\"\nduration = \"1s\"\n[servers]\ncount = 2\n[agents]\ncount = 60\n[load]\nrate = 20\n",
    )
    .unwrap();
    let out = run(
        "relay-fleet",
        &[
            "run",
            "--scenario",
            &scenario.display().to_string(),
            "--quiet",
        ],
        &[],
    )
    .await;
    let all = format!("{}{}", text(&out.stdout), text(&out.stderr));
    assert!(all.contains("scenario quiet"), "{all}");
    let warns = warn_lines(&all);
    assert_eq!(warns.len(), 1, "{all}");
    assert!(warns[0].contains("insecure = true"), "{}", warns[0]);
}

/// A co-located server whose `front_config` is missing or wrong does not start, and says
/// which file and which key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_front_config_stops_the_server_naming_the_file_and_key() {
    let dir = ScratchDir::new("front-config").unwrap();
    let server = |front: &Path| {
        format!(
            "agent_listen = \"{}\"\nforward_listen = \"{}\"\nadmin_listen = \"{}\"\ndispatchers = []\n\
             front_config = {:?}\n[agent_tls]\ninsecure = true\n[forward_tls]\ninsecure = true\n",
            free_addr().unwrap(),
            free_addr().unwrap(),
            free_addr().unwrap(),
            front.display().to_string(),
        )
    };
    let missing = dir.path().join("no-such-dispatcher.toml");
    let bad = dir.path().join("dispatcher.toml");
    std::fs::write(&bad, "listen = \"127.0.0.1:0\"\nbogus_key = 1\n").unwrap();
    for (front, want) in [(&missing, "no-such-dispatcher.toml"), (&bad, "bogus_key")] {
        let cfg = dir.path().join("ts.toml");
        std::fs::write(&cfg, server(front)).unwrap();
        let out = run(
            "relay-tunnel-server",
            &["--config", &cfg.display().to_string()],
            &[],
        )
        .await;
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{stderr}");
        assert!(
            stderr.contains("front_config") && stderr.contains(want),
            "{want}: {stderr}"
        );
    }
}

/// `worker_threads` sizes each binary's runtime (its `/metrics` says how many workers run),
/// unset means one per core, and a count of 0 stops the binary naming the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_threads_sizes_each_binary_and_zero_stops_it_naming_the_key() {
    let dir = ScratchDir::new("worker-threads").unwrap();
    let workers = |admin| async move {
        let text = scrape(admin).await.expect("/metrics");
        series(&text, "relay_runtime_worker_threads", &[]).expect("the workers gauge")
    };
    // One per core (tokio's default, which TOKIO_WORKER_THREADS overrides) when unset.
    let per_core = std::env::var("TOKIO_WORKER_THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| std::thread::available_parallelism().unwrap().get());

    let sized = TunnelServerProc::start(
        dir.path(),
        TunnelServerOpts {
            server_id: "ts-sized".into(),
            extra: "worker_threads = 3\n".into(),
            ..TunnelServerOpts::default()
        },
    )
    .await
    .unwrap();
    let unsized_ = TunnelServerProc::start(dir.path(), TunnelServerOpts::default())
        .await
        .unwrap();
    let dispatcher = DispatcherProc::start(
        dir.path(),
        DispatcherOpts {
            worker_threads: Some(1),
            ..DispatcherOpts::default()
        },
    )
    .await
    .unwrap();
    let agent = AgentProc::start(
        dir.path(),
        AgentOpts {
            tunnels: vec![sized.agent_url()],
            upstream: "http://127.0.0.1:9".into(),
            worker_threads: Some(2),
            ..AgentOpts::default()
        },
    )
    .await
    .unwrap();
    assert_eq!(workers(sized.admin_addr).await, 3.0);
    assert_eq!(workers(unsized_.admin_addr).await, per_core as f64);
    assert_eq!(workers(dispatcher.admin).await, 1.0);
    assert_eq!(workers(agent.admin).await, 2.0);

    let cfg = dir.path().join("zero.toml");
    std::fs::write(&cfg, "worker_threads = 0\n").unwrap();
    for name in ["relay-dispatcher", "relay-tunnel-server", "relay-agent"] {
        let out = run(name, &["--config", &cfg.display().to_string()], &[]).await;
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{name}: {stderr}");
        assert!(stderr.contains("worker_threads"), "{name}: {stderr}");
    }
}
