//! The status pages at `/` on each admin listener, as a browser renders them: headless
//! Chromium's DOM of each page against a running stack shows the ids, states and counts
//! the JSON endpoints (`/systemcheck`, `/debug/routes`, `/debug/tunnels`) report at the
//! same moment, and a server id with markup in it is shown as text, never as an element.
//!
//! Needs Debian's `chromium` (scripts/test installs it); without it these tests fail
//! saying so. `RELAY_STATUS_SCREENSHOTS=docs cargo test -p relay-tests --test status_pages
//! -- --ignored screenshots` refreshes the screenshots docs/running.md shows.

use relay_tests::browser::{self, table_rows};
use relay_tests::client::Caller;
use relay_tests::eventually;
use relay_tests::stack::{Stack, TUNNEL_ID};
use std::net::SocketAddr;
use std::time::Duration;

/// A server id a hostile or careless operator could configure: valid (printable ASCII, no
/// spaces) and an element if a page wrote it unescaped.
const HOSTILE: &str = "<img/src=x/onerror=alert(1)>";
/// How HOSTILE reads in a serialized DOM where it is text.
const HOSTILE_AS_TEXT: &str = "&lt;img/src=x/onerror=alert(1)&gt;";

const WITHIN: Duration = Duration::from_secs(60);

async fn stack_with_a_hostile_server_id() -> Stack {
    let stack = Stack::builder()
        .servers(2)
        .server_ids(&["ts-1", HOSTILE])
        .start()
        .await
        .unwrap();
    stack.wait_routable(Duration::from_secs(30)).await.unwrap();
    stack
}

/// GET `path` on `addr` as JSON; an error (never an empty document) when the read fails.
async fn get_json(addr: SocketAddr, path: &str) -> Result<serde_json::Value, String> {
    let a = Caller::new(addr, None)
        .get(path)
        .await
        .map_err(|e| format!("GET {path}: {e}"))?;
    Ok(a.json())
}

/// The page's markup never turned HOSTILE into an element, and shows it as text.
fn shows_hostile_as_text(dom: &str) {
    assert!(
        !dom.contains("<img"),
        "the hostile server id became an element: {dom}"
    );
    assert!(
        dom.contains(HOSTILE_AS_TEXT),
        "the hostile server id is not shown as text: {dom}"
    );
}

fn u(v: &serde_json::Value) -> String {
    match v {
        serde_json::Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// Polls until Chromium's DOM of `url` and the JSON at `json_path` taken just before and
/// just after it agree by `rows_of`; returns that DOM.
async fn dom_agreeing_with(
    what: &str,
    addr: SocketAddr,
    json_path: &str,
    table: &'static str,
    rows_of: impl Fn(&serde_json::Value) -> Result<Vec<Vec<String>>, String>,
    columns: usize,
) -> String {
    let url = format!("http://{addr}/");
    eventually(what, WITHIN, || async {
        let before = rows_of(&get_json(addr, json_path).await?)?;
        let dom = browser::dump_dom(&url).await.map_err(|e| e.to_string())?;
        let after = rows_of(&get_json(addr, json_path).await?)?;
        if before != after {
            return Err(format!("{json_path} moved during the render"));
        }
        let shown: Vec<Vec<String>> = table_rows(&dom, table)
            .ok_or_else(|| format!("no table {table} in {dom}"))?
            .into_iter()
            .map(|r| r.into_iter().take(columns).collect())
            .collect();
        if shown == after {
            Ok(dom)
        } else {
            Err(format!("page shows {shown:?}, {json_path} says {after:?}"))
        }
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tunnel_servers_page_shows_its_tunnels_as_debug_tunnels_reports_them() {
    browser::chromium();
    let stack = stack_with_a_hostile_server_id().await;
    for server in stack.servers.iter().flatten() {
        let rows_of = |v: &serde_json::Value| -> Result<Vec<Vec<String>>, String> {
            let tunnels = v["tunnels"].as_array().ok_or("no tunnels")?;
            // The agent covers every server: a page with no stream to show proves nothing.
            if !tunnels
                .iter()
                .any(|t| t["tunnel_id"] == TUNNEL_ID && t["streams"].as_u64() > Some(0))
            {
                return Err(format!("{TUNNEL_ID} holds no stream yet: {v}"));
            }
            Ok(tunnels
                .iter()
                .map(|t| {
                    ["tunnel_id", "streams", "idle", "busy", "queued"]
                        .iter()
                        .map(|k| u(&t[*k]))
                        .collect()
                })
                .collect())
        };
        let dom = dom_agreeing_with(
            &format!("{}'s page agrees with its /debug/tunnels", server.server_id),
            server.admin_addr,
            "/debug/tunnels",
            "tunnels",
            rows_of,
            5,
        )
        .await;
        assert!(dom.contains("serving"), "{dom}");
        if server.server_id == HOSTILE {
            shows_hostile_as_text(&dom);
        } else {
            assert!(!dom.contains("<img"), "{dom}");
        }
    }
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dispatchers_page_shows_the_routes_as_debug_routes_reports_them() {
    browser::chromium();
    let stack = stack_with_a_hostile_server_id().await;
    let addr = stack.dispatcher_admin;
    let tunnel_rows = |v: &serde_json::Value| -> Result<Vec<Vec<String>>, String> {
        let tunnels = v["tunnels"].as_array().ok_or("no tunnels")?;
        let demo = tunnels
            .iter()
            .find(|t| t["tunnel_id"] == TUNNEL_ID)
            .ok_or_else(|| format!("{TUNNEL_ID} not routed yet: {v}"))?;
        // Both servers hold the agent's streams: the row names both.
        if demo["servers"].as_array().map(Vec::len) != Some(2) {
            return Err(format!("{TUNNEL_ID} not on both servers yet: {v}"));
        }
        Ok(tunnels
            .iter()
            .map(|t| {
                vec![
                    u(&t["tunnel_id"]),
                    u(&t["home"]),
                    relay_dispatcher::status::holders(t),
                    relay_dispatcher::status::percent(&t["spill_share"]),
                ]
            })
            .collect())
    };
    let dom = dom_agreeing_with(
        "the dispatcher's page agrees with /debug/routes on tunnel ids",
        addr,
        "/debug/routes",
        "tunnels",
        tunnel_rows,
        4,
    )
    .await;
    shows_hostile_as_text(&dom);
    let server_rows = |v: &serde_json::Value| -> Result<Vec<Vec<String>>, String> {
        let servers = v["servers"].as_array().ok_or("no servers")?;
        if servers.len() != 2 {
            return Err(format!("not both servers yet: {v}"));
        }
        Ok(servers
            .iter()
            .map(|s| {
                let state = if s["draining"] == true {
                    "draining"
                } else {
                    "serving"
                };
                vec![
                    u(&s["server_id"]),
                    u(&s["zone"]),
                    u(&s["origin"]),
                    state.to_string(),
                    u(&s["tunnels"]),
                ]
            })
            .collect())
    };
    let dom = dom_agreeing_with(
        "the dispatcher's page agrees with /debug/routes on servers",
        addr,
        "/debug/routes",
        "servers",
        server_rows,
        5,
    )
    .await;
    shows_hostile_as_text(&dom);
    let routes = get_json(addr, "/debug/routes").await.unwrap();
    let registry = format!(
        "Registry {}: <span class=\"ok\">{}</span>",
        u(&routes["registry"]["backend"]),
        u(&routes["registry"]["state"])
    );
    assert!(dom.contains(&registry), "{registry} not in {dom}");
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agents_page_shows_what_systemcheck_reports() {
    browser::chromium();
    let stack = Stack::builder()
        .servers(2)
        .server_ids(&["ts-1", HOSTILE])
        .agent_config(|c| {
            // Only /hello is let through: a call elsewhere is refused by the agent.
            c.allow = vec![relay_agent::config::AllowRule {
                name: Some("hello <b>only</b>".into()),
                methods: vec!["GET".into()],
                path: "/hello".into(),
                ..Default::default()
            }];
        })
        .start()
        .await
        .unwrap();
    stack.wait_routable(Duration::from_secs(30)).await.unwrap();
    let caller = stack.caller();
    let refused = caller
        .get(&format!("/relay/{TUNNEL_ID}/not-allowed"))
        .await
        .unwrap();
    assert_eq!(refused.status, 403, "{}", refused.text());
    let addr = stack.agent_admin.unwrap();

    let server_rows = |v: &serde_json::Value| -> Result<Vec<Vec<String>>, String> {
        let servers = v["servers"].as_array().ok_or("no servers")?;
        let covered = servers.len() == 2
            && servers.iter().all(|s| s["state"] == "covered")
            && v["upstream"]["reachable"] == true;
        if !covered {
            return Err(format!(
                "not both servers covered and the upstream checked: {v}"
            ));
        }
        Ok(servers
            .iter()
            .map(|s| {
                [
                    "server_id",
                    "instance_id",
                    "zone",
                    "state",
                    "streams",
                    "idle",
                    "busy",
                    "budget",
                ]
                .iter()
                .map(|k| u(&s[*k]))
                .collect()
            })
            .collect())
    };
    let dom = dom_agreeing_with(
        "the agent's page agrees with /systemcheck on servers",
        addr,
        "/systemcheck",
        "servers",
        server_rows,
        8,
    )
    .await;
    shows_hostile_as_text(&dom);
    // The calls made went through one of the servers: its call time is shown.
    let rows = table_rows(&dom, "servers").unwrap();
    assert!(
        rows.iter().any(|r| r
            .get(9)
            .is_some_and(|t| t.ends_with(" ms") || t.ends_with(" µs"))),
        "no call time shown: {rows:?}"
    );
    assert!(
        dom.contains("Healthy</span>: every /systemcheck rule holds."),
        "{dom}"
    );
    assert!(
        dom.contains("Ready</span>: a call could be served now"),
        "{dom}"
    );

    let call_rows = |v: &serde_json::Value| -> Result<Vec<Vec<String>>, String> {
        let minutes = v["recent_calls"].as_array().ok_or("no recent_calls")?;
        let sum = |outcome: &str| {
            minutes
                .iter()
                .map(|m| m["calls"][outcome].as_u64().unwrap_or(0))
                .sum::<u64>()
        };
        if sum("ok") == 0 || sum("refused") != 1 {
            return Err(format!("the calls made are not all counted: {v}"));
        }
        Ok(minutes
            .iter()
            .map(|m| {
                let calls = m["calls"].as_object().map(|c| c.values().map(u).collect());
                let mut row = vec![u(&m["minutes_ago"])];
                row.extend(calls.unwrap_or_else(Vec::new));
                row
            })
            .collect())
    };
    let dom = dom_agreeing_with(
        "the agent's page agrees with /systemcheck on calls per minute",
        addr,
        "/systemcheck",
        "calls",
        call_rows,
        usize::MAX,
    )
    .await;
    assert!(dom.contains("<th>refused</th>"), "{dom}");

    let action_rows = |v: &serde_json::Value| -> Result<Vec<Vec<String>>, String> {
        let actions = v["recent_actions"].as_array().ok_or("no recent_actions")?;
        if actions.is_empty() {
            return Err(format!("no coverage action shown: {v}"));
        }
        Ok(actions
            .iter()
            .map(|a| {
                ["server_id", "action", "count", "reason"]
                    .iter()
                    .map(|k| u(&a[*k]))
                    .collect()
            })
            .collect())
    };
    let url = format!("http://{addr}/");
    let dom = eventually(
        "the agent's page lists the actions /systemcheck lists",
        WITHIN,
        || async {
            let want = action_rows(&get_json(addr, "/systemcheck").await?)?;
            let dom = browser::dump_dom(&url).await.map_err(|e| e.to_string())?;
            let after = action_rows(&get_json(addr, "/systemcheck").await?)?;
            // The first column is the time of the action.
            let shown: Vec<Vec<String>> = table_rows(&dom, "actions")
                .ok_or("no actions table")?
                .into_iter()
                .map(|r| r.into_iter().skip(1).collect())
                .collect();
            if want == after && shown == after {
                Ok(dom)
            } else {
                Err(format!("page shows {shown:?}, /systemcheck says {after:?}"))
            }
        },
    )
    .await;

    let rules = table_rows(&dom, "rules").expect("a rules table");
    assert_eq!(
        rules,
        vec![vec!["hello <b>only</b>", "GET", "/hello", "-", "-"]],
        "{dom}"
    );
    assert!(!dom.contains("<b>"), "{dom}");
    stack.shutdown().await;
}

/// While a server drains with a call in flight, its page says so, as `/debug/tunnels`
/// does at the same moment, and shows the busy stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tunnel_servers_page_says_draining_while_it_drains() {
    browser::chromium();
    // The drain lasts its grace: the agent's idle streams have nowhere else to go.
    let grace = Duration::from_secs(15);
    let mut stack = Stack::builder()
        .servers(1)
        .tunnel_config(|c| c.shutdown_grace = grace)
        .start()
        .await
        .unwrap();
    stack.wait_routable(Duration::from_secs(30)).await.unwrap();
    let caller = stack.caller();
    // A call that lasts longer than the test: the drain waits for it.
    let call =
        tokio::spawn(async move { caller.get(&format!("/relay/{TUNNEL_ID}/slow/120000")).await });
    let server = stack.take_server(0).unwrap();
    let addr = server.admin_addr;
    let url = format!("http://{addr}/");
    let busy_of = |v: &serde_json::Value| {
        v["tunnels"]
            .as_array()
            .and_then(|t| t.iter().find(|t| t["tunnel_id"] == TUNNEL_ID))
            .map(|t| u(&t["busy"]))
    };
    eventually("the call is in flight", WITHIN, || async {
        let v = get_json(addr, "/debug/tunnels").await?;
        (busy_of(&v).as_deref() == Some("1"))
            .then_some(())
            .ok_or(v.to_string())
    })
    .await;
    let draining = tokio::spawn(server.shutdown());
    eventually(
        "the page says draining as /debug/tunnels does",
        WITHIN,
        || async {
            let before = get_json(addr, "/debug/tunnels").await?;
            let dom = browser::dump_dom(&url).await.map_err(|e| e.to_string())?;
            let after = get_json(addr, "/debug/tunnels").await?;
            let both = before["draining"] == true && after["draining"] == true;
            let shown =
                dom.contains("<span class=\"bad\">draining</span>") && !dom.contains("serving");
            let rows = table_rows(&dom, "tunnels").unwrap_or_default();
            let busy_shown = rows.iter().any(|r| {
                r.first().map(String::as_str) == Some(TUNNEL_ID)
                    && r.get(3).cloned() == busy_of(&after)
            });
            (both && shown && busy_shown && busy_of(&after).as_deref() == Some("1"))
                .then_some(())
                .ok_or(format!("{after}: {dom}"))
        },
    )
    .await;
    call.abort();
    tokio::time::timeout(grace + Duration::from_secs(15), draining)
        .await
        .expect("the drain ends within its grace")
        .unwrap();
    stack.shutdown().await;
}

/// Every page is whole without JavaScript: the HTML as served (what a browser without
/// script shows) holds the tables with their rows, says it is static, and has no
/// `<meta http-equiv="refresh">`. With script the page refreshes itself: after more than
/// one refresh period the script has fetched the page again and swapped in its content.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_page_reads_without_javascript_and_refreshes_with_it() {
    browser::chromium();
    let stack = stack_with_a_hostile_server_id().await;
    let pages = [
        (stack.agent_admin.unwrap(), "servers"),
        (stack.dispatcher_admin, "tunnels"),
        (stack.servers[0].as_ref().unwrap().admin_addr, "tunnels"),
    ];
    let period_ms = u64::from(relay_common::html::REFRESH_SECONDS) * 1000;
    for (addr, table) in pages {
        let url = format!("http://{addr}/");
        let table_shown = |dom: &str| table_rows(dom, table).is_some_and(|r| !r.is_empty());
        eventually(&format!("{url} as served"), WITHIN, || async {
            let a = Caller::new(addr, None)
                .get("/")
                .await
                .map_err(|e| e.to_string())?;
            let html = a.text();
            let static_page = a.status == 200
                && html.contains("static page: reload to refresh")
                && !html.contains("http-equiv")
                && table_shown(&html);
            static_page.then_some(()).ok_or(html)
        })
        .await;
        eventually(
            &format!("{url} refreshed by its script"),
            WITHIN,
            || async {
                let dom = browser::dump_dom_after(&url, period_ms * 2 + period_ms / 2)
                    .await
                    .map_err(|e| e.to_string())?;
                let refreshed =
                    dom.contains("<span id=\"refresh\">refreshed ") && table_shown(&dom);
                refreshed.then_some(()).ok_or(dom)
            },
        )
        .await;
    }
    stack.shutdown().await;
}

/// Writes the screenshots docs/running.md shows (`status-agent.png`, `status-dispatcher.png`,
/// `status-tunnel-server.png`) into `$RELAY_STATUS_SCREENSHOTS` (a path from the workspace
/// root, or absolute), from a stack of two
/// servers that has carried a few calls (one refused by the agent's accept rules).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "writes files: RELAY_STATUS_SCREENSHOTS=docs cargo test ... -- --ignored screenshots"]
async fn screenshots() {
    // Relative to the workspace root (cargo runs tests in the package's directory).
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(
            std::env::var_os("RELAY_STATUS_SCREENSHOTS")
                .expect("RELAY_STATUS_SCREENSHOTS names the directory to write into"),
        );
    let stack = Stack::builder()
        .servers(2)
        .agent_config(|c| {
            c.allow = vec![relay_agent::config::AllowRule {
                name: Some("api-read".into()),
                methods: vec!["GET".into(), "HEAD".into()],
                path: "/**".into(),
                ..Default::default()
            }];
        })
        .start()
        .await
        .unwrap();
    stack.wait_routable(Duration::from_secs(30)).await.unwrap();
    let caller = stack.caller();
    for _ in 0..20 {
        caller
            .get(&format!("/relay/{TUNNEL_ID}/hello"))
            .await
            .unwrap();
    }
    let refused = caller
        .call(caller.request(
            http::Method::POST,
            &format!("/relay/{TUNNEL_ID}/hello"),
            bytes::Bytes::new(),
        ))
        .await
        .unwrap();
    assert_eq!(refused.status, 403);
    let agent = stack.agent_admin.unwrap();
    eventually("both servers covered", WITHIN, || async {
        let v = get_json(agent, "/systemcheck").await?;
        let covered = v["servers"]
            .as_array()
            .is_some_and(|s| s.len() == 2 && s.iter().all(|s| s["state"] == "covered"))
            && v["upstream"]["reachable"] == true;
        covered.then_some(()).ok_or(v.to_string())
    })
    .await;
    let shots = [
        ("status-agent.png", agent),
        ("status-dispatcher.png", stack.dispatcher_admin),
        (
            "status-tunnel-server.png",
            stack.servers[0].as_ref().unwrap().admin_addr,
        ),
    ];
    for (name, addr) in shots {
        browser::screenshot(&format!("http://{addr}/"), &dir.join(name), 1200, 900)
            .await
            .unwrap();
    }
    stack.shutdown().await;
}
