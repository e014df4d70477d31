//! `relay-agent diag`, `relay-tunnel-server diag` and `relay-dispatcher diag` against a
//! running stack of the real binaries (dispatcher, tunnel server, agent reading its token
//! from a file): each archive holds the members a support case needs (version, the
//! redacted config, what the admin listener answered, the log tail, the agent's check),
//! and no secret of any config (tokens, the token file's contents, caller keys,
//! `server_key`, `record_key`, the Redis URL's password) appears anywhere in it, not even
//! when a secret was written into the log the archive copies. Without a running process
//! the archive says the admin listener did not answer; a config file that cannot be read
//! and an output that cannot be written are errors naming the file.

use relay_tests::procs::{binary, free_addr, wait_http, DispatcherOpts, DispatcherProc};
use relay_tests::procs::{Proc, ScratchDir, TunnelServerOpts, TunnelServerProc};
use relay_tests::upstream::Upstream;
use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

const TOKEN: &str = "agent-token-5f1c9e0b7d2a";
const CALLER_KEY: &str = "caller-key-3a8e61fd09c4";
const SERVER_KEY: &str = "server-key-b72d4c19e5a0";
const RECORD_KEY: &str = "record-key-0e9f8a7b6c5d4e3f2a1b0c9d8e7f6a5b";
const REDIS_PASSWORD: &str = "redis-pw-8d3b2f1e0a9c";

/// Every secret the stack's configs hold.
const SECRETS: [&str; 5] = [TOKEN, CALLER_KEY, SERVER_KEY, RECORD_KEY, REDIS_PASSWORD];

/// The archive's members by name (without the `<binary>-diag/` folder) and contents.
fn members(archive: &Path, binary: &str) -> BTreeMap<String, String> {
    let f = std::fs::File::open(archive).expect("the archive exists");
    let mut ar = tar::Archive::new(flate2::read::GzDecoder::new(f));
    let mut out = BTreeMap::new();
    for e in ar.entries().expect("a tar.gz") {
        let mut e = e.expect("an entry");
        let name = e.path().unwrap().display().to_string();
        let mut data = Vec::new();
        std::io::Read::read_to_end(&mut e, &mut data).unwrap();
        let short = name
            .strip_prefix(&format!("{binary}-diag/"))
            .unwrap_or_else(|| panic!("{name} is not under {binary}-diag/"))
            .to_string();
        out.insert(short, String::from_utf8(data).expect("text members"));
    }
    out
}

fn assert_no_secret(members: &BTreeMap<String, String>, archive: &Path) {
    let raw = std::fs::read(archive).unwrap();
    for s in SECRETS {
        for (name, text) in members {
            assert!(!name.contains(s), "{s} in the member name {name}");
            assert!(!text.contains(s), "{s} in {name}:\n{text}");
        }
        // The compressed bytes too (a secret in a tar header field would show there only
        // if stored uncompressed; cheap to check).
        assert!(!raw.windows(s.len()).any(|w| w == s.as_bytes()));
    }
}

/// Runs `<binary> diag ARGS`; its exit status and stderr.
fn diag(binary_name: &str, args: &[&str], envs: &[(&str, &str)]) -> (bool, String) {
    let mut cmd = Command::new(binary(binary_name).unwrap());
    cmd.arg("diag").args(args).env_remove("RELAY_CONFIG");
    for (k, v) in envs {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn member<'a>(m: &'a BTreeMap<String, String>, name: &str) -> &'a str {
    m.get(name)
        .unwrap_or_else(|| panic!("no member {name}; members: {:?}", m.keys()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn diag_archives_hold_what_support_needs_and_no_secret() {
    let dir = ScratchDir::new("diag").unwrap();
    let upstream = Upstream::builder().spawn().await.unwrap();
    let dispatcher = DispatcherProc::start(
        dir.path(),
        DispatcherOpts {
            caller_key: CALLER_KEY.into(),
            server_key: SERVER_KEY.into(),
            registry: format!(
                "record_key = {RECORD_KEY:?}\nurl = \"redis://relay:{REDIS_PASSWORD}@127.0.0.1:1/0\"\n"
            ),
            ..DispatcherOpts::default()
        },
    )
    .await
    .unwrap();
    let server = TunnelServerProc::start(
        dir.path(),
        TunnelServerOpts {
            dispatchers: vec![dispatcher.registry_url()],
            dispatcher_key: SERVER_KEY.into(),
            tokens: vec![(TOKEN.into(), "acme".into())],
            ..TunnelServerOpts::default()
        },
    )
    .await
    .unwrap();

    // The agent reads its token from a file, as under systemd.
    let token_file = dir.path().join("agent.token");
    std::fs::write(&token_file, format!("{TOKEN}\n")).unwrap();
    let agent_admin = free_addr().unwrap();
    let agent_cfg = dir.path().join("agent.toml");
    std::fs::write(
        &agent_cfg,
        format!(
            "tunnels = [\"{}\"]\ntoken_file = {:?}\nupstream = \"{}\"\nadmin_listen = \"{agent_admin}\"\n\
             [tls]\ninsecure = true\n[[allow]]\nname = \"all\"\nmethods = [\"*\"]\npath = \"/**\"\n",
            server.agent_url(),
            token_file.display().to_string(),
            upstream.url(),
        ),
    )
    .unwrap();
    let agent_log = dir.path().join("agent.log");
    let _agent = Proc::spawn(
        "agent",
        &binary("relay-agent").unwrap(),
        &["--config".into(), agent_cfg.display().to_string()],
        &[("RELAY_LOG", "info")],
        agent_log.clone(),
    )
    .unwrap();
    // Ready: a live stream and a reachable upstream.
    wait_http(agent_admin, "/readyz", 200, Duration::from_secs(20))
        .await
        .unwrap();
    // The dispatcher routes the tunnel id once the server has reported it.
    let routes = relay_tests::client::Caller::new(dispatcher.admin, None);
    relay_tests::eventually(
        "the dispatcher routes acme",
        Duration::from_secs(10),
        || async {
            let r = routes.get("/debug/routes").await.unwrap();
            match r.text() {
                routes if routes.contains("acme") => Ok(()),
                routes => Err(routes),
            }
        },
    )
    .await;
    // Something wrote a secret into the agent's log: the archive must not carry it.
    let mut log = std::fs::read_to_string(&agent_log).unwrap();
    log.push_str(&format!("a line that leaked token={TOKEN}\n"));
    std::fs::write(&agent_log, log).unwrap();

    // The agent.
    let out = dir.path().join("agent-diag.tar.gz");
    let (ok, stderr) = diag(
        "relay-agent",
        &[
            "--config",
            &agent_cfg.display().to_string(),
            "--output",
            &out.display().to_string(),
            "--log-file",
            &agent_log.display().to_string(),
        ],
        &[],
    );
    assert!(ok, "relay-agent diag failed: {stderr}");
    let m = members(&out, "relay-agent");
    assert_no_secret(&m, &out);
    assert!(member(&m, "version.txt")
        .starts_with(&format!("relay-agent {}", env!("CARGO_PKG_VERSION"))));
    let config = member(&m, "config.toml");
    assert!(
        config.contains(&token_file.display().to_string()),
        "{config}"
    );
    let systemcheck: serde_json::Value =
        serde_json::from_str(member(&m, "admin/systemcheck.json")).unwrap();
    assert_eq!(
        systemcheck["servers"][0]["server_id"], "ts-1",
        "{systemcheck}"
    );
    assert!(member(&m, "admin/metrics.txt").contains("\nrelay_agent_streams_live "));
    let ready: serde_json::Value = serde_json::from_str(member(&m, "admin/readyz.json")).unwrap();
    assert_eq!(ready["ok"], true, "{ready}");
    assert!(!m.contains_key("admin/unreachable.txt"));
    let logs = member(&m, "logs.txt");
    assert!(
        logs.contains("a line that leaked token=<redacted>"),
        "{logs}"
    );
    assert!(logs.contains("admin listener bound"), "{logs}");
    let check = member(&m, "check.txt");
    assert!(
        check.contains("accepted: tunnel id acme on server ts-1"),
        "{check}"
    );
    assert!(check.contains("all checks passed"), "{check}");
    assert!(member(&m, "summary.txt").contains("admin/systemcheck.json"));

    // The tunnel server, its log from the (absent) journal: a note says where it is.
    let out = dir.path().join("ts-diag.tar.gz");
    let ts_cfg = dir.path().join("ts-1.toml");
    let (ok, stderr) = diag(
        "relay-tunnel-server",
        &[
            "--config",
            &ts_cfg.display().to_string(),
            "--output",
            &out.display().to_string(),
            "--journal-unit",
            "relay-diag-test-no-such-unit.service",
        ],
        &[],
    );
    assert!(ok, "relay-tunnel-server diag failed: {stderr}");
    let m = members(&out, "relay-tunnel-server");
    assert_no_secret(&m, &out);
    assert!(member(&m, "config.toml").contains("dispatcher_key = \"<redacted>\""));
    assert!(member(&m, "admin/metrics.txt").contains("relay_tunnel_"));
    let ready: serde_json::Value = serde_json::from_str(member(&m, "admin/readyz.json")).unwrap();
    assert_eq!(ready["ok"], true, "{ready}");
    assert!(member(&m, "logs.txt").contains("No log lines collected"));
    assert!(member(&m, "summary.txt").contains("not included (token hashes)"));

    // The dispatcher, with a secret flag value in the environment too.
    let out = dir.path().join("dispatcher-diag.tar.gz");
    let (ok, stderr) = diag(
        "relay-dispatcher",
        &[
            "--config",
            &dir.path().join("dispatcher.toml").display().to_string(),
            "--output",
            &out.display().to_string(),
            "--log-file",
            &dir.path().join("dispatcher.log").display().to_string(),
        ],
        &[("RELAY_REGISTRY_RECORD_KEY", RECORD_KEY)],
    );
    assert!(ok, "relay-dispatcher diag failed: {stderr}");
    let m = members(&out, "relay-dispatcher");
    assert_no_secret(&m, &out);
    let config = member(&m, "config.toml");
    assert!(
        config.contains("url = \"redis://relay:<redacted>@127.0.0.1:1/0\""),
        "{config}"
    );
    assert!(member(&m, "environment.txt").contains("RELAY_REGISTRY_RECORD_KEY=<redacted>"));
    let routes: serde_json::Value = serde_json::from_str(member(&m, "admin/routes.json")).unwrap();
    assert!(routes.to_string().contains("acme"), "{routes}");
    assert!(member(&m, "admin/metrics.txt").contains("relay_dispatcher_"));
    assert!(member(&m, "logs.txt").contains("INFO"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn diag_says_when_nothing_answers_and_names_a_bad_file() {
    let dir = ScratchDir::new("diag-down").unwrap();
    let admin = free_addr().unwrap();
    let cfg = dir.path().join("agent.toml");
    std::fs::write(
        &cfg,
        format!(
            "tunnels = [\"http://{}\"]\ntoken = {TOKEN:?}\nupstream = \"http://{}\"\n\
             admin_listen = \"{admin}\"\n[tls]\ninsecure = true\n",
            free_addr().unwrap(),
            free_addr().unwrap(),
        ),
    )
    .unwrap();
    let out = dir.path().join("a.tar.gz");
    let cfg_arg = cfg.display().to_string();
    let (ok, stderr) = diag(
        "relay-agent",
        &[
            "--config",
            &cfg_arg,
            "--output",
            &out.display().to_string(),
            "--timeout",
            "2s",
        ],
        &[],
    );
    assert!(
        ok,
        "the archive is written without a running agent: {stderr}"
    );
    let m = members(&out, "relay-agent");
    assert_no_secret(&m, &out);
    let note = member(&m, "admin/unreachable.txt");
    assert!(
        note.contains(&format!("did not answer at {admin}")),
        "{note}"
    );
    assert!(!m.contains_key("admin/systemcheck.json"));
    assert!(member(&m, "summary.txt").contains("unreachable"));
    assert!(member(&m, "check.txt").contains("FAILED"));

    // A config file that is not there: an error naming it, exit 1, no archive.
    let missing = dir.path().join("missing.toml");
    let out2 = dir.path().join("b.tar.gz");
    for bin in ["relay-agent", "relay-tunnel-server", "relay-dispatcher"] {
        let (ok, stderr) = diag(
            bin,
            &[
                "--config",
                &missing.display().to_string(),
                "--output",
                &out2.display().to_string(),
            ],
            &[],
        );
        assert!(!ok, "{bin}");
        assert!(!out2.exists(), "{bin} left a file behind");
        assert!(
            stderr.contains(&format!("cannot read config file {}", missing.display())),
            "{bin}: {stderr}"
        );
    }
    // An output whose folder does not exist: named, before anything is collected.
    let nowhere = dir.path().join("no-such-dir").join("a.tar.gz");
    let (ok, stderr) = diag(
        "relay-agent",
        &[
            "--config",
            &cfg_arg,
            "--output",
            &nowhere.display().to_string(),
        ],
        &[],
    );
    assert!(!ok);
    assert!(
        stderr.contains(&format!("cannot write the archive {}", nowhere.display())),
        "{stderr}"
    );
}
