//! Opens against a busy server, over real sockets: a hello that does not come in time
//! while other opens land on the same connection narrows the agent's open window
//! (`relay_agent_open_window`) and keeps the connection; a connection on which no hello
//! comes any more is replaced, as before.

mod common;

use common::*;

async fn agent_metric(admin: SocketAddr, name: &str) -> f64 {
    let (_, body) = http_get(admin, "/metrics").await;
    body.lines()
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(f64::NAN)
}

fn busy_config(tunnel: &str, upstream: &str, streams: u32) -> Config {
    let mut cfg = config(tunnel, upstream, streams);
    cfg.connect_timeout = Duration::from_millis(1500);
    cfg
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hellos_that_time_out_beside_landings_narrow_the_window_and_keep_the_connection() {
    let upstream = hyper_upstream().await;
    let mut tunnel = FakeTunnel::start(10_000, true).await;
    // Every other open gets its hello; the rest wait like opens at a busy server.
    tunnel.hello_every.store(2, Ordering::SeqCst);
    let (agent, admin) = start_agent(busy_config(&tunnel.url, &upstream, 8)).await;
    let _first = tunnel.next_conn().await;
    // The window opened up to the agent's 8 streams while the hellos came quickly.
    let deadline = Instant::now() + WAIT;
    while agent_metric(admin, "relay_agent_open_window").await < 8.0 {
        assert!(Instant::now() < deadline, "the window grew to 8");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Held opens time out and are opened again: two rounds of them.
    let opens = &tunnel.opens;
    eventually("two rounds of opens", || opens.load(Ordering::SeqCst) >= 12).await;
    let window = agent_metric(admin, "relay_agent_open_window").await;
    assert!(
        (1.0..8.0).contains(&window),
        "timed-out hellos narrowed the window: {window}"
    );
    let peers = tunnel.peers.lock().unwrap().clone();
    assert_eq!(
        peers.len(),
        1,
        "the connection carried hellos: it was kept ({peers:?})"
    );
    // Every open so far went over that connection, and the agent serves on the streams
    // that landed.
    let mut conn = tunnel.next_conn().await;
    let a = conn.call(head(1, "GET", "/hello", true), vec![]).await;
    assert_eq!(a.status(), 200, "{a:?}");
    drop(agent);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_that_stopped_carrying_hellos_is_replaced() {
    let upstream = hyper_upstream().await;
    let tunnel = FakeTunnel::start(10_000, true).await;
    // Only the first open gets a hello.
    tunnel.hello_every.store(u64::MAX, Ordering::SeqCst);
    let (_agent, _admin) = start_agent(busy_config(&tunnel.url, &upstream, 2)).await;
    let peers = tunnel.peers.clone();
    eventually("the agent dials a fresh connection", || {
        peers.lock().unwrap().len() >= 2
    })
    .await;
}
