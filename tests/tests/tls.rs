//! TLS on every hop, end to end: the whole stack with HTTPS at the dispatcher front,
//! mutual TLS between the dispatcher and the tunnel servers both ways, and agents dialing
//! the tunnel servers over TLS; refusals (wrong CA, expired certificate, plain text where
//! TLS is required, a tunnel server without a client certificate); certificates reloaded
//! while streams stay up.

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::TokioIo;
use relay_common::devcerts::{write, DevCa};
use relay_common::tls::{ClientTls, TlsClient, ALPN_HTTP};
use relay_tests::certs::{generate, CertSet};
use relay_tests::client::Caller;
use relay_tests::procs::ScratchDir;
use relay_tests::stack::{Stack, CALLER_KEY, TUNNEL_ID};
use std::net::SocketAddr;
use std::time::Duration;

/// A certificate set in a directory of its own, removed when the returned guard drops.
fn certs(tag: &str) -> (ScratchDir, CertSet) {
    let dir = ScratchDir::new(&format!("tls-e2e-{tag}")).unwrap();
    let set = generate(dir.path(), &["localhost", "127.0.0.1"]).unwrap();
    (dir, set)
}

/// A stack with TLS on every hop, from `set`.
async fn tls_stack(set: &CertSet) -> Stack {
    let (d_front, d_reg, d_fwd) = (
        set.dispatcher_front(),
        set.dispatcher_registry(),
        set.dispatcher_forward(),
    );
    let (t_agent, t_fwd, t_disp) = (
        set.tunnel_agent(),
        set.tunnel_forward(),
        set.tunnel_dispatcher(),
    );
    let agent_tls = set.agent();
    Stack::builder()
        .servers(2)
        .dispatcher_config(move |c| {
            c.tls = d_front;
            c.registry_tls = d_reg;
            c.forward_tls = d_fwd;
            c.reload_interval = Duration::from_millis(50);
        })
        .tunnel_config(move |c| {
            c.agent_tls = t_agent;
            c.forward_tls = t_fwd;
            c.dispatcher_tls = t_disp;
            c.reload_interval = Duration::from_millis(50);
        })
        .agent_config(move |c| c.tls = agent_tls)
        .start()
        .await
        .unwrap()
}

fn client(ca: &std::path::Path) -> TlsClient {
    TlsClient::new(
        "test",
        ClientTls {
            ca: Some(ca.to_path_buf()),
            ..Default::default()
        },
        ALPN_HTTP,
    )
    .unwrap()
}

/// One HTTPS/1.1 GET on a fresh connection.
async fn https_get(
    tls: &TlsClient,
    addr: SocketAddr,
    path: &str,
) -> anyhow::Result<(StatusCode, Bytes)> {
    let mut conn = HttpsConn::open(tls, addr).await?;
    conn.get(path).await
}

/// An HTTP/1.1 keep-alive connection over TLS.
struct HttpsConn {
    send: hyper::client::conn::http1::SendRequest<Empty<Bytes>>,
}

impl HttpsConn {
    async fn open(tls: &TlsClient, addr: SocketAddr) -> anyhow::Result<Self> {
        let stream = tls.connect("localhost", &addr.to_string()).await?;
        let (send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
        tokio::spawn(conn);
        Ok(HttpsConn { send })
    }

    async fn get(&mut self, path: &str) -> anyhow::Result<(StatusCode, Bytes)> {
        self.send.ready().await?;
        let req = Request::get(path)
            .header("host", "localhost")
            .header("authorization", format!("Bearer {CALLER_KEY}"))
            .body(Empty::new())?;
        let resp = self.send.send_request(req).await?;
        let status = resp.status();
        let body = resp.into_body().collect().await?.to_bytes();
        Ok((status, body))
    }
}

/// Polls until a relayed call over HTTPS answers 200.
async fn wait_routable(tls: &TlsClient, addr: SocketAddr) {
    relay_tests::eventually(
        "routable over TLS",
        Duration::from_secs(20),
        || async move {
            match https_get(tls, addr, &format!("/relay/{TUNNEL_ID}/hello")).await {
                Ok((s, _)) if s == StatusCode::OK => Ok(()),
                last => Err(format!("last answer {last:?}")),
            }
        },
    )
    .await;
}

#[tokio::test]
async fn a_call_round_trips_with_tls_on_every_hop() {
    let (_dir, set) = certs("all");
    let stack = tls_stack(&set).await;
    let backend = client(&set.ca);
    wait_routable(&backend, stack.http).await;
    let (status, body) = https_get(&backend, stack.http, &format!("/relay/{TUNNEL_ID}/hello"))
        .await
        .unwrap();
    assert_eq!(status, StatusCode::OK);
    assert!(!body.is_empty());
    // The agent holds streams on both servers, over TLS.
    let (code, check) = stack.systemcheck().await.unwrap();
    assert_eq!(code, 200, "{check}");
    stack.shutdown().await;
}

#[tokio::test]
async fn refusals_wrong_ca_expired_certificate_plain_text_and_missing_client_certificate() {
    let (_dir, set) = certs("refuse");
    let stack = tls_stack(&set).await;
    let backend = client(&set.ca);
    wait_routable(&backend, stack.http).await;

    // A backend that trusts another CA refuses the dispatcher's certificate.
    let other = DevCa::new("someone else").unwrap();
    let other_ca = write(&set.dir, "other-ca.pem", &other.cert_pem).unwrap();
    let err = https_get(&client(&other_ca), stack.http, "/relay/demo/hello")
        .await
        .unwrap_err();
    assert!(
        format!("{err:#}").to_lowercase().contains("certificate"),
        "{err:#}"
    );

    // Plain HTTP to the TLS front gets no HTTP answer.
    let plain = Caller::new(stack.http, Some(CALLER_KEY))
        .get("/relay/demo/hello")
        .await;
    assert!(
        plain.is_err(),
        "plain HTTP to a TLS front answered: {plain:?}"
    );

    // Plain h2c to a tunnel server's TLS agent listener: the RPC never happens.
    let agent_addr = stack.servers[0].as_ref().unwrap().agent_addr;
    let ch = tonic::transport::Endpoint::from_shared(format!("http://{agent_addr}"))
        .unwrap()
        .connect_timeout(Duration::from_secs(2))
        .timeout(Duration::from_secs(2))
        .connect()
        .await;
    // The TLS listener reads the h2c preface as a broken handshake and closes: the client
    // sees a connection or h2 protocol failure, never an answer from the tunnel service.
    let refused = match ch {
        Err(e) => format!("{e:?}"),
        Ok(ch) => {
            let (_tx, rx) = tokio::sync::mpsc::channel::<relay_proto::AgentFrame>(1);
            let mut req = tonic::Request::new(tokio_stream::wrappers::ReceiverStream::new(rx));
            req.metadata_mut()
                .insert("authorization", "Bearer dev-token".parse().unwrap());
            match relay_proto::tunnel_client::TunnelClient::new(ch)
                .connect(req)
                .await
            {
                Ok(_) => panic!("plain h2c reached a TLS agent listener"),
                Err(s) => {
                    assert!(
                        matches!(
                            s.code(),
                            tonic::Code::Internal | tonic::Code::Unavailable | tonic::Code::Unknown
                        ),
                        "plain h2c got an answer from the tunnel service: {s:?}"
                    );
                    format!("{s:?}")
                }
            }
        }
    };
    assert!(
        refused.contains("protocol error") || refused.contains("onnect"),
        "plain h2c to a TLS listener: not a connection failure: {refused}"
    );

    // A tunnel server's forward listener requires a client certificate: a dialer trusting
    // the CA but presenting none is refused (TLS 1.3 reports it on the first read).
    let forward_addr = stack.servers[0].as_ref().unwrap().forward_addr;
    let anonymous = TlsClient::new(
        "anon",
        ClientTls {
            ca: Some(set.ca.clone()),
            ..Default::default()
        },
        relay_common::tls::ALPN_H2,
    )
    .unwrap();
    let ch = tonic::transport::Endpoint::from_shared(format!("https://{forward_addr}"))
        .unwrap()
        .timeout(Duration::from_secs(2))
        .connect_with_connector(anonymous.tonic_connector())
        .await;
    let refused = match ch {
        Err(e) => format!("{e:?}"),
        Ok(ch) => {
            let (_tx, rx) = tokio::sync::mpsc::channel::<relay_proto::ForwardRequest>(1);
            match relay_proto::forward_client::ForwardClient::new(ch)
                .call(tokio_stream::wrappers::ReceiverStream::new(rx))
                .await
            {
                Ok(_) => panic!("a dispatcher without a client certificate was served"),
                Err(s) => format!("{s:?}"),
            }
        }
    };
    assert!(
        refused.contains("CertificateRequired"),
        "a dispatcher without a client certificate: not refused for it: {refused}"
    );

    // The relay still serves the legitimate backend.
    let (status, _) = https_get(&backend, stack.http, "/relay/demo/hello")
        .await
        .unwrap();
    assert_eq!(status, StatusCode::OK);
    stack.shutdown().await;
}

#[tokio::test]
async fn an_expired_server_certificate_is_refused() {
    let (_dir, set) = certs("expired");
    let ca_key = DevCa::new("expired-test ca").unwrap();
    let ca_path = write(&set.dir, "expired-ca.pem", &ca_key.cert_pem).unwrap();
    let leaf = ca_key.expired_server(&["localhost", "127.0.0.1"]).unwrap();
    let cert = write(&set.dir, "expired.pem", &leaf.cert_pem).unwrap();
    let key = write(&set.dir, "expired.key", &leaf.key_pem).unwrap();
    // A dispatcher front serving an expired certificate: backends refuse it.
    let front = relay_common::tls::ListenerTls::tls(relay_common::tls::ServerTls {
        cert,
        key,
        client_ca: None,
        client_cert_optional: false,
        client_names: Vec::new(),
    });
    let stack = Stack::builder()
        .servers(1)
        .without_agent()
        .dispatcher_config(move |c| c.tls = front)
        .start()
        .await
        .unwrap();
    let err = https_get(&client(&ca_path), stack.http, "/relay/demo/hello")
        .await
        .unwrap_err();
    assert!(
        format!("{err:#}").to_lowercase().contains("expired"),
        "{err:#}"
    );
    stack.shutdown().await;
}

#[tokio::test]
async fn a_rotated_certificate_is_used_for_new_connections_while_streams_stay_up() {
    let (_dir, set) = certs("rotate");
    let stack = tls_stack(&set).await;
    let backend = client(&set.ca);
    wait_routable(&backend, stack.http).await;
    let mut kept = HttpsConn::open(&backend, stack.http).await.unwrap();
    assert_eq!(
        kept.get("/relay/demo/hello").await.unwrap().0,
        StatusCode::OK
    );

    // Replace the dispatcher's server certificate with one from a new CA.
    let ca2 = DevCa::new("relay rotated ca").unwrap();
    let ca2_path = write(&set.dir, "ca2.pem", &ca2.cert_pem).unwrap();
    let leaf = ca2.server(&["localhost", "127.0.0.1"]).unwrap();
    std::fs::write(&set.dispatcher.1, &leaf.key_pem).unwrap();
    std::fs::write(&set.dispatcher.0, &leaf.cert_pem).unwrap();
    let rotated = client(&ca2_path);
    let (r, front) = (&rotated, stack.http);
    relay_tests::eventually(
        "the new certificate is picked up",
        Duration::from_secs(10),
        || async move { https_get(r, front, "/relay/demo/hello").await.is_ok() },
    )
    .await;
    // New connections trusting only the old CA are refused now...
    assert!(https_get(&backend, stack.http, "/relay/demo/hello")
        .await
        .is_err());
    // ...while the connection established before keeps serving, and so do the agent's
    // tunnel streams and the report streams (the registry listener shares the rotated
    // certificate: its established streams keep their session).
    assert_eq!(
        kept.get("/relay/demo/hello").await.unwrap().0,
        StatusCode::OK
    );
    assert_eq!(
        https_get(&rotated, stack.http, "/relay/demo/hello")
            .await
            .unwrap()
            .0,
        StatusCode::OK
    );
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_id_its_client_certificate_does_not_name_is_refused_by_the_registry() {
    // The tunnel servers' client certificate names "tunnel-server" and "ts-1": with
    // server_id_in_cert, ts-1 reports and ts-2 (same CA, same certificate) is refused.
    let (_dir, set) = certs("id-in-cert");
    let (d_front, d_reg, d_fwd) = (
        set.dispatcher_front(),
        set.dispatcher_registry(),
        set.dispatcher_forward(),
    );
    let (t_agent, t_fwd, t_disp) = (
        set.tunnel_agent(),
        set.tunnel_forward(),
        set.tunnel_dispatcher(),
    );
    let agent_tls = set.agent();
    let stack = Stack::builder()
        .servers(2)
        .dispatcher_config(move |c| {
            c.tls = d_front;
            c.registry_tls = d_reg;
            c.forward_tls = d_fwd;
            c.registry.server_id_in_cert = true;
        })
        .tunnel_config(move |c| {
            c.agent_tls = t_agent;
            c.forward_tls = t_fwd;
            c.dispatcher_tls = t_disp;
        })
        .agent_config(move |c| c.tls = agent_tls)
        .start()
        .await
        .unwrap();
    let admin = stack.dispatcher_admin;
    let refused = || async move {
        let text = relay_tests::procs::scrape(admin).await.unwrap_or_default();
        relay_tests::procs::metric(
            &text,
            "relay_dispatcher_reports_refused_total",
            &[("reason", "server_id_not_in_cert")],
        )
    };
    assert!(
        relay_tests::time_until(Duration::from_secs(20), || async { refused().await >= 1.0 })
            .await
            .is_some(),
        "ts-2 was never refused"
    );
    let servers = || async move {
        let text = relay_tests::procs::scrape(admin).await.unwrap_or_default();
        relay_tests::procs::metric(&text, "relay_dispatcher_tunnel_servers", &[])
    };
    assert!(
        relay_tests::time_until(Duration::from_secs(20), || async { servers().await == 1.0 })
            .await
            .is_some(),
        "ts-1 never joined"
    );
    relay_tests::eventually(
        "ts-2 retried and was refused again",
        Duration::from_secs(20),
        || async { refused().await >= 2.0 },
    )
    .await;
    // A window: ts-2 keeps retrying and is never admitted.
    relay_tests::holds_for(
        "a server its certificate does not name stays out",
        Duration::from_secs(2),
        || async { servers().await == 1.0 },
    )
    .await;
    stack.shutdown().await;
}

/// A mutual-TLS listener whose certificate is the peer's whole authentication pins an
/// identity. A config with `client_ca` and neither `client_names` nor (on the registry)
/// `server_id_in_cert` does not start, naming the key; and with the names pinned, a
/// certificate the same CA signed for an agent can neither call `Forward.Call` on a tunnel
/// server nor report to the dispatcher's registry (hand-made gRPC clients over mutual TLS).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_tls_needs_a_pinned_identity_and_an_agent_certificate_is_refused() {
    let (dir, set) = certs("pinned");
    let p = |p: &std::path::Path| p.display().to_string();

    // The binaries refuse the unpinned configs at start, naming the key.
    let ts = dir.path().join("ts.toml");
    std::fs::write(
        &ts,
        format!(
            "[agent_tls]\ninsecure = true\n[forward_tls]\ncert = {:?}\nkey = {:?}\nclient_ca = {:?}\n",
            p(&set.tunnel_server.0),
            p(&set.tunnel_server.1),
            p(&set.ca)
        ),
    )
    .unwrap();
    let d = dir.path().join("d.toml");
    std::fs::write(
        &d,
        format!(
            "[[callers]]\nname = \"c\"\nkey = \"k\"\ntunnels = [\"*\"]\n[tls]\ninsecure = true\n\
             [registry_tls]\ncert = {:?}\nkey = {:?}\nclient_ca = {:?}\n[forward_tls]\ninsecure = true\n",
            p(&set.dispatcher.0),
            p(&set.dispatcher.1),
            p(&set.ca)
        ),
    )
    .unwrap();
    for (bin, config, key) in [
        ("relay-tunnel-server", &ts, "`forward_tls.client_names`"),
        ("relay-dispatcher", &d, "`registry_tls.client_names`"),
    ] {
        let out = tokio::process::Command::new(relay_tests::procs::binary(bin).unwrap())
            .args(["--config", &p(config)])
            .env_remove("RELAY_CONFIG")
            .kill_on_drop(true)
            .output()
            .await
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{bin} started unpinned: {stderr}");
        assert!(stderr.contains(key), "{bin}: {stderr}");
    }

    // Pinned: the agent's certificate (same CA) is refused on both mutual-TLS listeners.
    let stack = tls_stack(&set).await;
    let agent_cert = TlsClient::new(
        "agent-cert",
        ClientTls {
            ca: Some(set.ca.clone()),
            cert: Some(set.agent_client.0.clone()),
            key: Some(set.agent_client.1.clone()),
            ..Default::default()
        },
        relay_common::tls::ALPN_H2,
    )
    .unwrap();
    let dial = |addr: SocketAddr| {
        let connector = agent_cert.tonic_connector();
        async move {
            tonic::transport::Endpoint::from_shared(format!("https://{addr}"))
                .unwrap()
                .timeout(Duration::from_secs(2))
                .connect_with_connector(connector)
                .await
        }
    };
    let forward_addr = stack.servers[0].as_ref().unwrap().forward_addr;
    let refused = match dial(forward_addr).await {
        Err(e) => format!("{e:?}"),
        Ok(ch) => {
            let (_tx, rx) = tokio::sync::mpsc::channel::<relay_proto::ForwardRequest>(1);
            match relay_proto::forward_client::ForwardClient::new(ch)
                .call(tokio_stream::wrappers::ReceiverStream::new(rx))
                .await
            {
                Ok(_) => panic!("an agent's certificate opened Forward.Call"),
                Err(s) => format!("{s:?}"),
            }
        }
    };
    assert!(
        refused_by_tls(&refused),
        "an agent's certificate on the forward listener: not refused by TLS: {refused}"
    );
    let refused = match dial(stack.registry).await {
        Err(e) => format!("{e:?}"),
        Ok(ch) => {
            let mut req = tonic::Request::new(futures::stream::iter(vec![
                relay_tests::fake_server::intro("ts-evil", "https://127.0.0.1:1"),
            ]));
            req.metadata_mut().insert(
                "authorization",
                format!("Bearer {}", relay_tests::stack::SERVER_KEY)
                    .parse()
                    .unwrap(),
            );
            match relay_proto::registry_client::RegistryClient::new(ch)
                .report(req)
                .await
            {
                Ok(_) => panic!("an agent's certificate reported to the registry"),
                Err(s) => format!("{s:?}"),
            }
        }
    };
    assert!(
        refused_by_tls(&refused),
        "an agent's certificate on the registry listener: not refused by TLS: {refused}"
    );
    // The relay's own hops still work.
    let backend = client(&set.ca);
    wait_routable(&backend, stack.http).await;
    stack.shutdown().await;
}

/// Whether a dial's or call's error says the server's TLS refused the client: the alert
/// naming the certificate, or, under TLS 1.3 (the client's certificate is judged after the
/// client already counts the handshake done and writes its request), the connection the
/// server closed on it as it sent the alert: a write into it (broken pipe), a reset, or,
/// when the close is read before the alert, hyper's "connection closed" for the request
/// it had sent (seen on the registry listener, which runs on a thread of its own).
fn refused_by_tls(error: &str) -> bool {
    let e = error.to_lowercase();
    e.contains("certificate")
        || e.contains("alert")
        || e.contains("broken pipe")
        || e.contains("connection reset")
        || e.contains("connection closed")
}
