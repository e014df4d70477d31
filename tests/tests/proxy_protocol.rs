//! Behind an L4 load balancer: HAProxy in TCP mode with `send-proxy-v2` in front of a
//! tunnel server (the real binaries), whose `[agent_limits] proxy_protocol` names
//! HAProxy's address. Every connection reaches the server from HAProxy's address, and the
//! PROXY header names the real client, so the per-source authentication budget, the logs
//! and `/metrics` see each client: a source that keeps failing authentication is blocked
//! while agents from other sources behind the same HAProxy keep connecting.
//!
//! On loopback, 127.0.0.2 and 127.0.0.3 are distinct client sources (the client socket is
//! bound to them); HAProxy itself and the real agent connect from 127.0.0.1.

use relay_common::listen::ListenerLimits;
use relay_tests::client::Caller;
use relay_tests::haproxy::{Backend, Haproxy};
use relay_tests::hostile::open_from;
use relay_tests::procs::{
    metric, scrape, AgentOpts, AgentProc, DispatcherOpts, DispatcherProc, ScratchDir,
    TunnelServerOpts, TunnelServerProc,
};
use relay_tests::stack::{CALLER_KEY, TOKEN, TUNNEL_ID};
use relay_tests::upstream::Upstream;
use std::net::IpAddr;
use std::time::Duration;

const HOSTILE: [u8; 4] = [127, 0, 0, 2];
const OTHER: [u8; 4] = [127, 0, 0, 3];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn behind_haproxy_with_proxy_v2_a_failing_source_is_blocked_and_other_sources_keep_connecting(
) {
    let dir = ScratchDir::new("proxy-v2").unwrap();
    let upstream = Upstream::builder().spawn().await.unwrap();
    let dispatcher = DispatcherProc::start(dir.path(), DispatcherOpts::default())
        .await
        .unwrap();
    // The budget is the product's default; only the load balancer's address is set.
    let budget = ListenerLimits::default().auth_failures;
    let server = TunnelServerProc::start(
        dir.path(),
        TunnelServerOpts {
            dispatchers: vec![dispatcher.registry_url()],
            extra: "[agent_limits]\nproxy_protocol = [\"127.0.0.1\"]\n".into(),
            ..TunnelServerOpts::default()
        },
    )
    .await
    .unwrap();
    let haproxy = Haproxy::start_tcp_proxy_v2(vec![Backend {
        name: server.server_id.clone(),
        addr: server.agent_addr,
        admin: None,
        weight: 1,
        disabled: false,
    }])
    .await
    .unwrap();
    let cfg = haproxy.config_text().unwrap();
    assert!(
        cfg.contains("mode tcp") && cfg.contains("send-proxy-v2"),
        "{cfg}"
    );
    let _agent = AgentProc::start(
        dir.path(),
        AgentOpts {
            tunnels: vec![haproxy.url()],
            token: TOKEN.into(),
            upstream: upstream.url(),
            ..AgentOpts::default()
        },
    )
    .await
    .unwrap();
    let caller = Caller::new(dispatcher.http, Some(CALLER_KEY));
    let c = &caller;
    relay_tests::eventually(
        "routable through haproxy",
        Duration::from_secs(30),
        || async move {
            matches!(c.get(&format!("/relay/{TUNNEL_ID}/hello")).await, Ok(a) if a.status == 200)
        },
    )
    .await;
    let url = haproxy.url();
    let hostile = IpAddr::from(HOSTILE);

    // Within its budget the source is refused each wrong token, and still served.
    for _ in 0..budget {
        let Err(e) = open_from(&url, hostile, "wrong-token").await else {
            panic!("a wrong token opened a stream");
        };
        assert_eq!(e.code(), tonic::Code::Unauthenticated, "{e}");
    }
    let opened = open_from(&url, hostile, TOKEN).await;
    assert!(opened.is_ok(), "within its budget: {:?}", opened.err());
    drop(opened);
    // One more failure puts it over: from now on even the right token is refused from
    // that source, at the server's accept...
    let _ = open_from(&url, hostile, "wrong-token").await;
    let blocked = open_from(&url, hostile, TOKEN).await;
    assert!(blocked.is_err(), "a source over its budget opened a stream");
    // ...while other sources behind the same HAProxy keep connecting: another client,
    // and the real agent's address.
    for from in [OTHER, [127, 0, 0, 1]] {
        let o = open_from(&url, IpAddr::from(from), TOKEN).await;
        assert!(o.is_ok(), "{from:?} was refused: {:?}", o.err());
    }
    for _ in 0..10 {
        let a = caller
            .get(&format!("/relay/{TUNNEL_ID}/hello"))
            .await
            .unwrap();
        assert_eq!(a.status, 200, "{}", a.text());
    }

    // /metrics names the real source, never HAProxy's address.
    let text = scrape(server.admin_addr).await.unwrap();
    let by = |reason: &str, source: &str| {
        metric(
            &text,
            "relay_listener_source_refused_total",
            &[
                ("listener", "agent"),
                ("reason", reason),
                ("source", source),
            ],
        )
    };
    assert_eq!(by("auth_budget", "127.0.0.2"), 1.0, "{text}");
    assert!(by("source_blocked", "127.0.0.2") >= 1.0, "{text}");
    for reason in ["auth_budget", "source_blocked"] {
        assert_eq!(by(reason, "127.0.0.1"), 0.0, "{text}");
        assert_eq!(by(reason, "127.0.0.3"), 0.0, "{text}");
    }
    // So do the logs: the refusals name 127.0.0.2, reached through HAProxy.
    let log = server.proc.log();
    let refusals: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("agent stream refused") || l.contains("source over"))
        .collect();
    assert!(!refusals.is_empty(), "{log}");
    for line in &refusals {
        assert!(
            line.contains("127.0.0.2:") && line.contains("via=Some(127.0.0.1:"),
            "a refusal that does not name the real source: {line}"
        );
    }
}
