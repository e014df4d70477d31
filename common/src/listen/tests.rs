//! The guard's table, and each limit against real loopback sockets.

use super::*;
use crate::devcerts::{write, DevCa};
use crate::tls::{ClientTls, ServerTls, TlsClient, ALPN_H2};
use futures::StreamExt;
use prometheus::Registry;
use std::future::Future;
use std::net::IpAddr;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const T0_SECS: u64 = 1_000;

fn at(base: Instant, ms: u64) -> Instant {
    base + Duration::from_millis(ms)
}

#[test]
fn a_source_is_blocked_past_its_budget_until_its_window_ends() {
    let base = Instant::now() + Duration::from_secs(T0_SECS);
    let mut b = AuthBudget::new(2, Duration::from_secs(60));
    let ip: IpAddr = [10, 0, 0, 1].into();
    let other: IpAddr = [10, 0, 0, 2].into();
    assert!(!b.failed(ip, at(base, 0)));
    assert!(!b.failed(ip, at(base, 10)));
    assert!(
        !b.blocked(ip, at(base, 20)),
        "two failures are within the budget"
    );
    assert!(b.failed(ip, at(base, 30)), "the third is over it");
    assert!(b.blocked(ip, at(base, 59_999)));
    assert!(
        !b.blocked(other, at(base, 100)),
        "another source is not affected"
    );
    assert!(!b.blocked(ip, at(base, 60_000)), "the window ended");
    assert!(
        !b.failed(ip, at(base, 60_001)),
        "a new window starts from zero"
    );
}

#[test]
fn a_zero_budget_never_blocks() {
    let base = Instant::now();
    let mut b = AuthBudget::new(0, Duration::from_secs(60));
    let ip: IpAddr = [10, 0, 0, 1].into();
    for i in 0..100 {
        assert!(!b.failed(ip, at(base, i)));
    }
    assert!(!b.blocked(ip, base));
    assert!(b.is_empty(), "nothing is tracked");
}

#[test]
fn the_table_of_sources_stays_bounded() {
    let base = Instant::now();
    let mut b = AuthBudget::new(1, Duration::from_secs(60));
    for i in 0..(MAX_TRACKED_SOURCES as u32 + 10) {
        b.failed(IpAddr::from(i.to_be_bytes()), at(base, u64::from(i) / 1000));
    }
    assert_eq!(b.len(), MAX_TRACKED_SOURCES);
}

#[test]
fn logs_are_limited_per_period_and_the_next_line_counts_the_rest() {
    let l = LogLimiter::default();
    let base = Instant::now();
    for _ in 0..LOG_BURST {
        assert_eq!(l.allow_at(base), Some(0));
    }
    for _ in 0..5 {
        assert_eq!(l.allow_at(base + Duration::from_secs(1)), None);
    }
    assert_eq!(l.allow_at(base + LOG_PERIOD), Some(5));
}

/// Polls `check` until it holds, failing after `within`.
async fn until<F, Fut>(within: Duration, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + within;
    while !check().await {
        assert!(Instant::now() < deadline, "not within {within:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn guard(limits: ListenerLimits) -> (Arc<ListenerGuard>, Registry) {
    let reg = Registry::new();
    let m = ListenerMetrics::register(&reg).unwrap();
    (ListenerGuard::new("test", limits, m), reg)
}

fn refused(reg: &Registry, reason: &str) -> u64 {
    reg.gather()
        .iter()
        .find(|f| f.name() == "relay_listener_refused_total")
        .and_then(|f| {
            f.get_metric().iter().find(|m| {
                m.get_label()
                    .iter()
                    .any(|l| l.name() == "reason" && l.value() == reason)
            })
        })
        .map_or(0, |m| m.get_counter().get_value() as u64)
}

/// Serves `guard`'s listener, one byte at a time: `A` marks the connection
/// authenticated, `T` authenticates it for tunnel id `acme` (answered `X` when refused),
/// `F` counts a refused authentication, `H` holds a request open and `R` ends those held;
/// every byte is echoed.
async fn serve(guard: Arc<ListenerGuard>, tls: Option<crate::tls::TlsServer>) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let g = guard.clone();
    let mut conns = Box::pin(incoming(listener, tls, guard, CancellationToken::new()));
    tokio::spawn(async move {
        while let Some(Ok(mut c)) = conns.next().await {
            let g = g.clone();
            tokio::spawn(async move {
                let mut buf = [0u8; 1];
                let mut held = Vec::new();
                while let Ok(1) = c.read(&mut buf).await {
                    match buf[0] {
                        b'A' => g.authenticated(Some(c.info())),
                        b'T' if g.authenticate(Some(c.info()), "acme").is_err() => buf[0] = b'X',
                        b'T' => {}
                        b'F' => g.auth_failed(Some(c.info()), "refused"),
                        b'H' => held.push(c.info().hold()),
                        b'R' => held.clear(),
                        _ => {}
                    }
                    if c.write_all(&buf).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    addr
}

/// A connection to `addr` from the loopback address `from` (127.0.0.2, ... are distinct
/// sources on Linux).
async fn connect_from(from: [u8; 4], addr: SocketAddr) -> TcpStream {
    let s = tokio::net::TcpSocket::new_v4().unwrap();
    s.bind(SocketAddr::from((from, 0))).unwrap();
    s.connect(addr).await.unwrap()
}

fn by_source(reg: &Registry, reason: &str) -> Vec<(String, u64)> {
    let mut out = Vec::new();
    for f in reg.gather() {
        if f.name() != "relay_listener_source_refused_total" {
            continue;
        }
        for m in f.get_metric() {
            let label = |n: &str| {
                m.get_label()
                    .iter()
                    .find(|l| l.name() == n)
                    .map(|l| l.value().to_string())
                    .unwrap_or_default()
            };
            if label("reason") == reason {
                out.push((label("source"), m.get_counter().get_value() as u64));
            }
        }
    }
    out
}

/// Whether the server closes `s` within `within` (a read ends or fails).
async fn closed_within(s: &mut TcpStream, within: Duration) -> bool {
    let mut buf = [0u8; 16];
    loop {
        match tokio::time::timeout(within, s.read(&mut buf)).await {
            Err(_) => return false,
            Ok(Ok(0)) | Ok(Err(_)) => return true,
            Ok(Ok(_)) => continue,
        }
    }
}

async fn echo(s: &mut TcpStream, b: u8) -> bool {
    if s.write_all(&[b]).await.is_err() {
        return false;
    }
    let mut buf = [0u8; 1];
    matches!(
        tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf)).await,
        Ok(Ok(1))
    ) && buf[0] == b
}

#[tokio::test]
async fn a_connection_with_no_authenticated_stream_is_closed_after_auth_timeout() {
    let (g, reg) = guard(ListenerLimits {
        auth_timeout: Duration::from_millis(300),
        ..ListenerLimits::default()
    });
    let addr = serve(g, None).await;
    let mut silent = TcpStream::connect(addr).await.unwrap();
    let mut talker = TcpStream::connect(addr).await.unwrap();
    assert!(
        echo(&mut talker, b'x').await,
        "unauthenticated traffic is served meanwhile"
    );
    let mut authed = TcpStream::connect(addr).await.unwrap();
    assert!(echo(&mut authed, b'A').await);
    assert!(
        closed_within(&mut silent, Duration::from_secs(5)).await,
        "a silent connection stays open past auth_timeout"
    );
    assert!(closed_within(&mut talker, Duration::from_secs(5)).await);
    // The authenticated one is still served, well past the timeout.
    assert!(!closed_within(&mut authed, Duration::from_millis(600)).await);
    assert!(echo(&mut authed, b'y').await);
    assert_eq!(refused(&reg, "auth_timeout"), 2);
}

#[tokio::test]
async fn connections_past_max_connections_are_closed_at_accept() {
    let (g, reg) = guard(ListenerLimits {
        max_connections: 2,
        ..ListenerLimits::without_auth()
    });
    let addr = serve(g, None).await;
    let mut a = TcpStream::connect(addr).await.unwrap();
    let mut b = TcpStream::connect(addr).await.unwrap();
    assert!(echo(&mut a, b'1').await && echo(&mut b, b'2').await);
    let mut c = TcpStream::connect(addr).await.unwrap();
    assert!(closed_within(&mut c, Duration::from_secs(5)).await);
    assert_eq!(refused(&reg, "max_connections"), 1);
    drop(a);
    // The slot frees once the server sees the close.
    until(Duration::from_secs(5), || async {
        let mut d = TcpStream::connect(addr).await.unwrap();
        echo(&mut d, b'3').await
    })
    .await;
    assert!(echo(&mut b, b'4').await);
}

#[tokio::test]
async fn a_source_over_its_failure_budget_is_closed_and_refused_until_the_window_ends() {
    let (g, reg) = guard(ListenerLimits {
        auth_failures: 2,
        auth_failure_window: Duration::from_millis(800),
        ..ListenerLimits::without_auth()
    });
    let addr = serve(g, None).await;
    let mut s = TcpStream::connect(addr).await.unwrap();
    assert!(echo(&mut s, b'F').await && echo(&mut s, b'F').await);
    let mut other = TcpStream::connect(addr).await.unwrap();
    assert!(echo(&mut other, b'x').await, "within budget: still served");
    // The third failure closes the connection that failed...
    let _ = s.write_all(b"F").await;
    assert!(closed_within(&mut s, Duration::from_secs(5)).await);
    assert_eq!(refused(&reg, "auth_budget"), 1);
    // ...and new connections from the source are closed at accept, while one already
    // open is left alone.
    let mut again = TcpStream::connect(addr).await.unwrap();
    assert!(closed_within(&mut again, Duration::from_secs(5)).await);
    assert!(refused(&reg, "source_blocked") >= 1);
    assert!(echo(&mut other, b'y').await);
    // Once the window ends the source is served again.
    until(Duration::from_secs(5), || async {
        let mut d = TcpStream::connect(addr).await.unwrap();
        echo(&mut d, b'z').await
    })
    .await;
}

fn tls_pair(tag: &str) -> (crate::tls::TlsServer, TlsClient) {
    // Both ends read their files as they are built; the directory goes with this call.
    let tmp = tempfile::Builder::new()
        .prefix(&format!("relay-listen-{tag}-"))
        .tempdir()
        .unwrap();
    let dir = tmp.path();
    let ca = DevCa::new("relay listen test ca").unwrap();
    let leaf = ca.server(&["localhost"]).unwrap();
    let server = crate::tls::TlsServer::new(
        "test",
        ServerTls {
            cert: write(dir, "s.pem", &leaf.cert_pem).unwrap(),
            key: write(dir, "s.key", &leaf.key_pem).unwrap(),
            client_ca: None,
            client_cert_optional: false,
            client_names: Vec::new(),
        },
        ALPN_H2,
    )
    .unwrap();
    let client = TlsClient::new(
        "test",
        ClientTls {
            ca: Some(write(dir, "ca.pem", &ca.cert_pem).unwrap()),
            cert: None,
            key: None,
            server_name: None,
        },
        ALPN_H2,
    )
    .unwrap();
    (server, client)
}

#[tokio::test]
async fn a_silent_peer_times_out_its_handshake_and_holds_no_handshake_slot() {
    let (server, client) = tls_pair("hs");
    let (g, reg) = guard(ListenerLimits {
        max_handshakes: 1,
        handshake_timeout: Duration::from_secs(3),
        ..ListenerLimits::without_auth()
    });
    let addr = serve(g, Some(server)).await;
    let mut silent = Vec::new();
    for _ in 0..3 {
        silent.push(TcpStream::connect(addr).await.unwrap());
    }
    // The only handshake slot is free for a real client however many peers stay silent:
    // it gets through while they all still hold their connections.
    let mut s = client
        .connect("localhost", &addr.to_string())
        .await
        .unwrap();
    assert_eq!(
        refused(&reg, "handshake_timeout"),
        0,
        "the handshake waited for silent peers to time out"
    );
    s.write_all(b"x").await.unwrap();
    let mut buf = [0u8; 1];
    s.read_exact(&mut buf).await.unwrap();
    for mut p in silent {
        assert!(closed_within(&mut p, Duration::from_secs(10)).await);
    }
    assert_eq!(refused(&reg, "handshake_timeout"), 3);
}

#[tokio::test]
async fn silent_connections_are_closed_at_first_byte_timeout_while_a_real_peer_is_served() {
    let (g, reg) = guard(ListenerLimits {
        first_byte_timeout: Duration::from_millis(300),
        ..ListenerLimits::without_auth()
    });
    let addr = serve(g, None).await;
    let mut silent = Vec::new();
    for _ in 0..20 {
        silent.push(TcpStream::connect(addr).await.unwrap());
    }
    // One that starts the HTTP/2 preface and stops: its protocol is not told yet.
    let mut stalled = TcpStream::connect(addr).await.unwrap();
    stalled.write_all(b"PRI * HTTP/2.0\r\n").await.unwrap();
    // A peer that talks is served meanwhile, and well past the timeout.
    let mut talker = TcpStream::connect(addr).await.unwrap();
    assert!(echo(&mut talker, b'x').await);
    for mut s in silent {
        assert!(closed_within(&mut s, Duration::from_secs(5)).await);
    }
    assert!(closed_within(&mut stalled, Duration::from_secs(5)).await);
    assert_eq!(refused(&reg, "first_byte_timeout"), 21);
    assert!(echo(&mut talker, b'y').await, "the talker was cut");
}

#[tokio::test]
async fn the_first_bytes_read_to_tell_the_protocol_reach_the_server_unchanged() {
    let (g, _reg) = guard(ListenerLimits::without_auth());
    let addr = serve(g, None).await;
    let mut s = TcpStream::connect(addr).await.unwrap();
    // The whole HTTP/2 preface and more in one write: echoed back byte for byte.
    let sent = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\nafter";
    s.write_all(sent).await.unwrap();
    let mut got = vec![0u8; sent.len()];
    tokio::time::timeout(Duration::from_secs(5), s.read_exact(&mut got))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(&got, sent);
}

#[tokio::test]
async fn a_connection_holding_nothing_is_closed_after_idle_timeout_and_one_holding_a_request_is_not(
) {
    let idle = Duration::from_millis(400);
    let (g, reg) = guard(ListenerLimits {
        idle_timeout: idle,
        ..ListenerLimits::without_auth()
    });
    let addr = serve(g, None).await;
    let mut busy = TcpStream::connect(addr).await.unwrap();
    assert!(echo(&mut busy, b'H').await);
    let mut done = TcpStream::connect(addr).await.unwrap();
    assert!(echo(&mut done, b'H').await && echo(&mut done, b'R').await);
    let mut quiet = TcpStream::connect(addr).await.unwrap();
    assert!(echo(&mut quiet, b'x').await);
    // The connection whose request ended and the one that never held one close...
    assert!(closed_within(&mut done, idle * 2 + IDLE_GRACE + Duration::from_secs(3)).await);
    assert!(closed_within(&mut quiet, Duration::from_secs(5)).await);
    assert_eq!(refused(&reg, "idle_timeout"), 2);
    // ...the one holding a request stays, however long it holds it.
    assert!(!closed_within(&mut busy, idle * 2 + IDLE_GRACE).await);
    assert!(echo(&mut busy, b'R').await);
    // Once it holds nothing, it is idle too.
    assert!(closed_within(&mut busy, idle * 2 + IDLE_GRACE + Duration::from_secs(3)).await);
}

#[tokio::test]
async fn a_source_past_its_connection_cap_is_refused_while_other_sources_are_served() {
    let (g, reg) = guard(ListenerLimits {
        max_connections_per_source: 2,
        ..ListenerLimits::without_auth()
    });
    let addr = serve(g, None).await;
    let mut a = connect_from([127, 0, 0, 2], addr).await;
    let mut b = connect_from([127, 0, 0, 2], addr).await;
    assert!(echo(&mut a, b'1').await && echo(&mut b, b'2').await);
    let mut extra = connect_from([127, 0, 0, 2], addr).await;
    assert!(closed_within(&mut extra, Duration::from_secs(5)).await);
    assert_eq!(refused(&reg, "source_connections"), 1);
    assert_eq!(
        by_source(&reg, "source_connections"),
        vec![("127.0.0.2".to_string(), 1)]
    );
    // Another source is served; the capped source's connections are too.
    let mut other = connect_from([127, 0, 0, 3], addr).await;
    assert!(echo(&mut other, b'3').await);
    assert!(echo(&mut a, b'4').await);
    // A closed connection frees its place.
    drop(b);
    until(Duration::from_secs(5), || async {
        let mut c = connect_from([127, 0, 0, 2], addr).await;
        echo(&mut c, b'5').await
    })
    .await;
}

#[tokio::test]
async fn a_tunnel_id_past_its_connection_cap_is_refused_on_one_more_connection() {
    let (g, reg) = guard(ListenerLimits {
        max_connections_per_token: 2,
        ..ListenerLimits::default()
    });
    let addr = serve(g, None).await;
    let mut a = TcpStream::connect(addr).await.unwrap();
    let mut b = TcpStream::connect(addr).await.unwrap();
    assert!(echo(&mut a, b'T').await && echo(&mut b, b'T').await);
    // A second stream of the tunnel id on a connection that counts already is fine.
    assert!(echo(&mut a, b'T').await);
    let mut c = TcpStream::connect(addr).await.unwrap();
    c.write_all(b"T").await.unwrap();
    let mut buf = [0u8; 1];
    c.read_exact(&mut buf).await.unwrap();
    assert_eq!(
        buf[0], b'X',
        "a third connection of the tunnel id was accepted"
    );
    assert_eq!(refused(&reg, "token_connections"), 1);
    // The others still serve; once one closes, the third connection gets in.
    assert!(echo(&mut b, b'y').await);
    drop(a);
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        c.write_all(b"T").await.unwrap();
        c.read_exact(&mut buf).await.unwrap();
        if buf[0] == b'T' {
            break;
        }
        assert!(Instant::now() < deadline, "the freed place was not taken");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn a_load_balancers_proxy_header_names_the_source_every_limit_sees() {
    let (g, reg) = guard(ListenerLimits {
        auth_failures: 1,
        auth_failure_window: Duration::from_secs(60),
        proxy_protocol: vec!["127.0.0.9".parse().unwrap()],
        ..ListenerLimits::without_auth()
    });
    let addr = serve(g, None).await;
    let header = |src: &str| {
        let src: SocketAddr = src.parse().unwrap();
        let addrs: ppp::v2::Addresses = (src, addr).into();
        ppp::v2::Builder::with_addresses(
            ppp::v2::Version::Two | ppp::v2::Command::Proxy,
            ppp::v2::Protocol::Stream,
            addrs,
        )
        .build()
        .unwrap()
    };
    // Two clients behind the load balancer; one fails twice and is blocked.
    let mut bad = connect_from([127, 0, 0, 9], addr).await;
    bad.write_all(&header("198.51.100.7:4000")).await.unwrap();
    assert!(echo(&mut bad, b'F').await);
    let _ = bad.write_all(b"F").await;
    assert!(closed_within(&mut bad, Duration::from_secs(5)).await);
    let mut again = connect_from([127, 0, 0, 9], addr).await;
    again.write_all(&header("198.51.100.7:4001")).await.unwrap();
    assert!(closed_within(&mut again, Duration::from_secs(5)).await);
    assert_eq!(
        by_source(&reg, "source_blocked"),
        vec![("198.51.100.7".to_string(), 1)]
    );
    // The other client, through the same load balancer, is served.
    let mut good = connect_from([127, 0, 0, 9], addr).await;
    good.write_all(&header("203.0.113.5:5000")).await.unwrap();
    assert!(echo(&mut good, b'x').await);
    // A connection from the load balancer without a header is closed...
    let mut bare = connect_from([127, 0, 0, 9], addr).await;
    bare.write_all(b"GET / HTTP/1.1\r\n\r\n").await.unwrap();
    assert!(closed_within(&mut bare, Duration::from_secs(5)).await);
    assert_eq!(refused(&reg, "proxy_header"), 1);
    // ...and anyone else's header is not read as one: a direct peer is its own source.
    let mut direct = connect_from([127, 0, 0, 10], addr).await;
    direct
        .write_all(&header("198.51.100.7:4002"))
        .await
        .unwrap();
    let mut echoed = vec![0u8; 16];
    tokio::time::timeout(Duration::from_secs(5), direct.read_exact(&mut echoed))
        .await
        .unwrap()
        .unwrap();
}

/// A ClientHello a real TLS client would send, for a peer that sends it and then stalls.
fn client_hello() -> Vec<u8> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(rustls::RootCertStore::empty())
        .with_no_client_auth();
    config.alpn_protocols = vec![b"h2".to_vec()];
    let mut c =
        rustls::ClientConnection::new(Arc::new(config), "localhost".try_into().unwrap()).unwrap();
    let mut out = Vec::new();
    while c.wants_write() {
        c.write_tls(&mut out).unwrap();
    }
    out
}

#[tokio::test]
async fn a_handshake_stalled_after_the_servers_flight_holds_no_handshake_slot() {
    let (server, client) = tls_pair("stall");
    let (g, reg) = guard(ListenerLimits {
        max_handshakes: 1,
        handshake_timeout: Duration::from_secs(5),
        ..ListenerLimits::without_auth()
    });
    let addr = serve(g, Some(server)).await;
    // Peers that send a ClientHello, read the server's flight and never answer it.
    let mut stalled = Vec::new();
    for _ in 0..3 {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(&client_hello()).await.unwrap();
        let mut buf = [0u8; 1024];
        let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf))
            .await
            .unwrap()
            .unwrap();
        assert!(n > 0, "the server sent its flight");
        stalled.push(s);
    }
    // The only handshake slot is free for a real client while they all stall.
    let mut s = client
        .connect("localhost", &addr.to_string())
        .await
        .unwrap();
    assert_eq!(
        refused(&reg, "handshake_timeout"),
        0,
        "the real handshake waited for the stalled ones to time out"
    );
    s.write_all(b"x").await.unwrap();
    let mut buf = [0u8; 1];
    s.read_exact(&mut buf).await.unwrap();
    for mut p in stalled {
        assert!(closed_within(&mut p, Duration::from_secs(10)).await);
    }
    assert_eq!(refused(&reg, "handshake_timeout"), 3);
}

#[test]
fn limits_parse_from_toml_and_bad_values_name_their_key() {
    let l: ListenerLimits = crate::config::parse(
        r#"
        idle_timeout = "2m"
        max_connections_per_token = 8
        proxy_protocol = ["10.0.0.5", "fd00::/8"]
        "#,
        std::path::Path::new("agent_limits.toml"),
    )
    .unwrap();
    assert_eq!(l.idle_timeout, Duration::from_secs(120));
    assert_eq!(l.max_connections_per_token, 8);
    assert_eq!(
        l.first_byte_timeout,
        ListenerLimits::default().first_byte_timeout
    );
    assert!(l.proxy_protocol[0].contains("10.0.0.5".parse().unwrap()));
    assert!(l.proxy_protocol[0].contains("::ffff:10.0.0.5".parse().unwrap()));
    assert!(!l.proxy_protocol[0].contains("10.0.0.6".parse().unwrap()));
    assert!(l.proxy_protocol[1].contains("fd12::1".parse().unwrap()));
    l.validate("agent_limits").unwrap();
    let err = crate::config::parse::<ListenerLimits>(
        "proxy_protocol = [\"lb.example\"]",
        std::path::Path::new("x.toml"),
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("proxy_protocol"), "{err}");
    let bad = |l: ListenerLimits| l.validate("agent_limits").unwrap_err().to_string();
    assert!(bad(ListenerLimits {
        idle_timeout: Duration::from_millis(5),
        ..ListenerLimits::default()
    })
    .contains("agent_limits.idle_timeout"));
    assert!(bad(ListenerLimits {
        max_partial_frame_bytes: 1000,
        ..ListenerLimits::default()
    })
    .contains("agent_limits.max_partial_frame_bytes"));
    assert!(bad(ListenerLimits {
        first_byte_timeout: Duration::ZERO,
        proxy_protocol: vec!["10.0.0.5".parse().unwrap()],
        ..ListenerLimits::default()
    })
    .contains("agent_limits.first_byte_timeout"));
}

#[test]
fn per_source_limits_count_an_ipv6_host_by_its_64() {
    let a: IpAddr = "2001:db8:1:2:aaaa::1".parse().unwrap();
    let b: IpAddr = "2001:db8:1:2:bbbb::9".parse().unwrap();
    let other: IpAddr = "2001:db8:1:3::1".parse().unwrap();
    assert_eq!(source_key(a), source_key(b));
    assert_ne!(source_key(a), source_key(other));
    let mapped: IpAddr = "::ffff:192.0.2.1".parse().unwrap();
    assert_eq!(source_key(mapped), IpAddr::from([192, 0, 2, 1]));
}

#[tokio::test]
async fn past_the_gate_connections_wait_their_turn_with_deadlines_from_it() {
    let (g, _reg) = guard(ListenerLimits {
        first_byte_timeout: Duration::from_millis(200),
        auth_timeout: Duration::ZERO,
        ..ListenerLimits::default()
    });
    let waiting = prometheus::IntGauge::new("w", "w").unwrap();
    let wait = prometheus::Histogram::with_opts(prometheus::HistogramOpts::new("h", "h")).unwrap();
    let g = g.with_admission(Arc::new(Admission::new(1, waiting.clone(), wait.clone())));
    let addr = serve(g, None).await;
    // Opens and authenticates: its place is given back at once.
    let mut first = TcpStream::connect(addr).await.unwrap();
    assert!(echo(&mut first, b'A').await);
    // Opens and never authenticates: holds the place for OPENING_HOLD at most.
    let mut holder = TcpStream::connect(addr).await.unwrap();
    assert!(echo(&mut holder, b'x').await);
    let started = Instant::now();
    let mut next = TcpStream::connect(addr).await.unwrap();
    next.write_all(b"y").await.unwrap();
    until(Duration::from_secs(5), || {
        let w = waiting.get();
        async move { w == 1 }
    })
    .await;
    // Admitted once the holder's hold ends, long past first_byte_timeout from its accept:
    // its first byte is read then, and it is served.
    let mut buf = [0u8; 1];
    let read = tokio::time::timeout(Duration::from_secs(5), next.read(&mut buf)).await;
    assert!(matches!(read, Ok(Ok(1))) && buf[0] == b'y', "{read:?}");
    assert!(started.elapsed() >= admission::OPENING_HOLD / 2);
    assert_eq!(waiting.get(), 0);
    assert_eq!(wait.get_sample_count(), 3);
    assert!(wait.get_sample_sum() > 0.2, "{}", wait.get_sample_sum());
    // Everyone is still served.
    assert!(echo(&mut first, b'z').await);
    assert!(echo(&mut holder, b'z').await);
    assert!(echo(&mut next, b'z').await);
}
