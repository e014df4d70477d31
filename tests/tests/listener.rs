//! The tunnel server's agent listener (the one facing the internet) bounds what a peer
//! costs before it authenticates: a source that keeps presenting wrong tokens is cut off
//! for the failure window, and a connection that never authenticates is closed, while the
//! real agent's streams keep serving calls.

use relay_common::listen::ListenerLimits;
use relay_tests::metrics::value;
use relay_tests::stack::{Stack, TOKEN};
use relay_tests::time_until;
use std::time::Duration;
use tokio::io::AsyncReadExt;

/// `Tunnel.Connect` on a new connection with `token`: the hello's tunnel id, or the
/// refusal. The stream closes again at once.
async fn open(url: &str, token: &str) -> Result<String, tonic::Status> {
    relay_tests::hostile::open(url, token)
        .await
        .map(|o| o.tunnel_id)
}

fn refused(registry: &prometheus::Registry, reason: &str) -> f64 {
    value(
        registry,
        "relay_listener_refused_total",
        &[("listener", "agent"), ("reason", reason)],
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_source_presenting_wrong_tokens_is_cut_off_for_the_window_and_then_served_again() {
    let window = Duration::from_secs(3);
    let stack = Stack::builder()
        .servers(1)
        .tunnel_config(|c| {
            c.agent_limits = ListenerLimits {
                auth_failures: 3,
                auth_failure_window: window,
                ..ListenerLimits::default()
            }
        })
        .start()
        .await
        .unwrap();
    stack.wait_routable(Duration::from_secs(20)).await.unwrap();
    let server = stack.servers[0].as_ref().unwrap();
    let url = format!("http://{}", server.agent_addr);

    for _ in 0..3 {
        let e = open(&url, "wrong-token").await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unauthenticated, "{e}");
    }
    assert_eq!(
        open(&url, TOKEN).await.unwrap(),
        "demo",
        "within the budget"
    );
    // The fourth wrong token puts the source over its budget: from now on even the right
    // token is refused from this address, at accept.
    let _ = open(&url, "wrong-token").await;
    let blocked = open(&url, TOKEN).await;
    assert!(blocked.is_err(), "a source over its budget opened a stream");
    assert_eq!(refused(&server.registry, "auth_budget"), 1.0);
    assert!(refused(&server.registry, "source_blocked") >= 1.0);
    // The agent's streams, opened before, keep serving.
    let a = stack.caller().get("/relay/demo/hello").await.unwrap();
    assert_eq!(a.status, 200, "{}", a.text());
    // After the window the source is served again.
    let back = time_until(window * 3, || async { open(&url, TOKEN).await.is_ok() }).await;
    assert!(back.is_some(), "the source was never served again");
    assert!(back.unwrap() <= window + Duration::from_secs(2), "{back:?}");
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_that_never_authenticates_is_closed_and_the_agent_keeps_serving() {
    let timeout = Duration::from_millis(500);
    let stack = Stack::builder()
        .servers(1)
        .tunnel_config(|c| {
            c.agent_limits = ListenerLimits {
                auth_timeout: timeout,
                ..ListenerLimits::default()
            }
        })
        .start()
        .await
        .unwrap();
    stack.wait_routable(Duration::from_secs(20)).await.unwrap();
    let server = stack.servers[0].as_ref().unwrap();
    // A peer that connects and sends the HTTP/2 preface, then nothing.
    let mut idle = tokio::net::TcpStream::connect(server.agent_addr)
        .await
        .unwrap();
    tokio::io::AsyncWriteExt::write_all(&mut idle, b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        .await
        .unwrap();
    // The server's settings frame may come first; then the close.
    let mut buf = [0u8; 4096];
    let closed = loop {
        match tokio::time::timeout(Duration::from_secs(10), idle.read(&mut buf)).await {
            Err(_) => break None,
            Ok(Ok(0)) | Ok(Err(_)) => break Some(()),
            Ok(Ok(_)) => continue,
        }
    };
    assert!(
        closed.is_some(),
        "an unauthenticated connection stayed open"
    );
    assert!(refused(&server.registry, "auth_timeout") >= 1.0);
    // The agent's own connection authenticated long ago and is untouched.
    for _ in 0..20 {
        let a = stack.caller().get("/relay/demo/hello").await.unwrap();
        assert_eq!(a.status, 200, "{}", a.text());
    }
    stack.shutdown().await;
}
