//! Handshakes over real loopback sockets with generated certificates.

use super::*;
use crate::devcerts::{write, DevCa};
use std::net::SocketAddr;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;

struct Set {
    /// The set's files, removed with it.
    dir: tempfile::TempDir,
    ca: PathBuf,
    server: ServerTls,
}

/// A directory of the test's own, removed when the returned guard drops.
fn temp_dir(tag: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(&format!("relay-tls-{tag}-"))
        .tempdir()
        .unwrap()
}

fn set(tag: &str, mtls: bool) -> (Set, DevCa) {
    let tmp = temp_dir(tag);
    let dir = tmp.path();
    let ca = DevCa::new("relay test ca").unwrap();
    let leaf = ca.server(&["localhost", "127.0.0.1"]).unwrap();
    let ca_path = write(dir, "ca.pem", &ca.cert_pem).unwrap();
    let server = ServerTls {
        cert: write(dir, "server.pem", &leaf.cert_pem).unwrap(),
        key: write(dir, "server.key", &leaf.key_pem).unwrap(),
        client_ca: mtls.then(|| ca_path.clone()),
        client_cert_optional: false,
        client_names: Vec::new(),
    };
    (
        Set {
            dir: tmp,
            ca: ca_path,
            server,
        },
        ca,
    )
}

/// Serves: each TLS connection answers "hello" with "world".
async fn serve(tls: TlsServer) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let guard = crate::listen::ListenerGuard::new(
        "test",
        crate::listen::ListenerLimits::without_auth(),
        crate::listen::ListenerMetrics::register(&prometheus::Registry::new()).unwrap(),
    );
    let mut conns = Box::pin(crate::listen::incoming(
        listener,
        Some(tls),
        guard,
        CancellationToken::new(),
    ));
    tokio::spawn(async move {
        use futures::StreamExt;
        while let Some(Ok(mut c)) = conns.next().await {
            tokio::spawn(async move {
                let mut buf = [0u8; 5];
                if c.read_exact(&mut buf).await.is_ok() && &buf == b"hello" {
                    let _ = c.write_all(b"world").await;
                    let _ = c.flush().await;
                }
            });
        }
    });
    addr
}

async fn talk(client: &TlsClient, addr: SocketAddr) -> std::io::Result<()> {
    let mut s = client.connect("localhost", &addr.to_string()).await?;
    s.write_all(b"hello").await?;
    s.flush().await?;
    let mut buf = [0u8; 5];
    s.read_exact(&mut buf).await?;
    assert_eq!(&buf, b"world");
    Ok(())
}

#[tokio::test]
async fn a_client_trusting_the_ca_connects() {
    let (s, _) = set("ok", false);
    let addr = serve(TlsServer::new("t", s.server.clone(), ALPN_H2).unwrap()).await;
    let client = TlsClient::new(
        "c",
        ClientTls {
            ca: Some(s.ca.clone()),
            ..Default::default()
        },
        ALPN_H2,
    )
    .unwrap();
    talk(&client, addr).await.unwrap();
}

#[tokio::test]
async fn a_client_trusting_another_ca_is_refused() {
    let (s, _) = set("wrongca", false);
    let addr = serve(TlsServer::new("t", s.server.clone(), ALPN_H2).unwrap()).await;
    let other = DevCa::new("someone else").unwrap();
    let other_ca = write(s.dir.path(), "other-ca.pem", &other.cert_pem).unwrap();
    let client = TlsClient::new(
        "c",
        ClientTls {
            ca: Some(other_ca),
            ..Default::default()
        },
        ALPN_H2,
    )
    .unwrap();
    let err = talk(&client, addr).await.unwrap_err();
    assert!(
        err.to_string().to_lowercase().contains("certificate"),
        "{err}"
    );
}

#[tokio::test]
async fn an_expired_server_certificate_is_refused() {
    let (s, ca) = set("expired", false);
    let leaf = ca.expired_server(&["localhost"]).unwrap();
    let server = ServerTls {
        cert: write(s.dir.path(), "expired.pem", &leaf.cert_pem).unwrap(),
        key: write(s.dir.path(), "expired.key", &leaf.key_pem).unwrap(),
        ..s.server.clone()
    };
    let addr = serve(TlsServer::new("t", server, ALPN_H2).unwrap()).await;
    let client = TlsClient::new(
        "c",
        ClientTls {
            ca: Some(s.ca.clone()),
            ..Default::default()
        },
        ALPN_H2,
    )
    .unwrap();
    let err = talk(&client, addr).await.unwrap_err();
    assert!(err.to_string().to_lowercase().contains("expired"), "{err}");
}

#[tokio::test]
async fn mutual_tls_refuses_a_client_without_a_certificate_and_accepts_one_with() {
    let (s, ca) = set("mtls", true);
    let addr = serve(TlsServer::new("t", s.server.clone(), ALPN_H2).unwrap()).await;
    let anonymous = TlsClient::new(
        "c",
        ClientTls {
            ca: Some(s.ca.clone()),
            ..Default::default()
        },
        ALPN_H2,
    )
    .unwrap();
    assert!(talk(&anonymous, addr).await.is_err());
    let leaf = ca.client("dispatcher-1").unwrap();
    let with_cert = ClientTls {
        ca: Some(s.ca.clone()),
        cert: Some(write(s.dir.path(), "client.pem", &leaf.cert_pem).unwrap()),
        key: Some(write(s.dir.path(), "client.key", &leaf.key_pem).unwrap()),
        server_name: None,
    };
    talk(&TlsClient::new("c", with_cert, ALPN_H2).unwrap(), addr)
        .await
        .unwrap();
}

#[tokio::test]
async fn a_plain_connection_to_a_tls_listener_gets_nothing() {
    let (s, _) = set("plain", false);
    let addr = serve(TlsServer::new("t", s.server.clone(), ALPN_H2).unwrap()).await;
    let mut tcp = TcpStream::connect(addr).await.unwrap();
    tcp.write_all(b"hello").await.unwrap();
    let mut buf = [0u8; 5];
    let r = tokio::time::timeout(Duration::from_secs(5), tcp.read_exact(&mut buf))
        .await
        .unwrap();
    assert!(r.is_err() || &buf != b"world", "a plain client was served");
}

#[tokio::test]
async fn reloading_swaps_the_certificate_for_new_handshakes_only() {
    let (s, _) = set("reload", false);
    let tls = TlsServer::new("t", s.server.clone(), ALPN_H2).unwrap();
    let addr = serve(tls.clone()).await;
    let client = TlsClient::new(
        "c",
        ClientTls {
            ca: Some(s.ca.clone()),
            ..Default::default()
        },
        ALPN_H2,
    )
    .unwrap();
    // A connection opened before the swap.
    let mut early = client
        .connect("localhost", &addr.to_string())
        .await
        .unwrap();
    // Replace the files with a certificate from a new CA and reload.
    let new_ca = DevCa::new("rotated ca").unwrap();
    let leaf = new_ca.server(&["localhost"]).unwrap();
    std::fs::write(&s.server.cert, &leaf.cert_pem).unwrap();
    std::fs::write(&s.server.key, &leaf.key_pem).unwrap();
    tls.reload().unwrap();
    // New handshakes see the new certificate: the old trust fails, the new one works.
    assert!(talk(&client, addr).await.is_err());
    let new_ca_path = write(s.dir.path(), "new-ca.pem", &new_ca.cert_pem).unwrap();
    let rotated = TlsClient::new(
        "c",
        ClientTls {
            ca: Some(new_ca_path),
            ..Default::default()
        },
        ALPN_H2,
    )
    .unwrap();
    talk(&rotated, addr).await.unwrap();
    // The early connection still works.
    early.write_all(b"hello").await.unwrap();
    let mut buf = [0u8; 5];
    early.read_exact(&mut buf).await.unwrap();
    assert_eq!(&buf, b"world");
}

#[tokio::test]
async fn a_broken_file_on_reload_keeps_the_previous_config() {
    let (s, _) = set("broken", false);
    let tls = TlsServer::new("t", s.server.clone(), ALPN_H2).unwrap();
    let addr = serve(tls.clone()).await;
    std::fs::write(&s.server.cert, "not a certificate").unwrap();
    assert!(tls.reload().is_err());
    let client = TlsClient::new(
        "c",
        ClientTls {
            ca: Some(s.ca.clone()),
            ..Default::default()
        },
        ALPN_H2,
    )
    .unwrap();
    talk(&client, addr).await.unwrap();
}

/// The exported expiry of `(section, role)`, if any.
fn expiry_of(registry: &prometheus::Registry, section: &str, role: &str) -> Option<f64> {
    registry
        .gather()
        .iter()
        .filter(|f| f.name() == CertExpiry::NAME)
        .flat_map(|f| f.get_metric().iter())
        .find(|m| {
            let l = m.get_label();
            l.iter()
                .any(|p| p.name() == "section" && p.value() == section)
                && l.iter().any(|p| p.name() == "role" && p.value() == role)
        })
        .map(|m| m.get_gauge().get_value())
}

/// 2021-01-01T00:00:00Z, the end of `DevCa::expired_server` certificates.
const END_2020: f64 = 1_609_459_200.0;

#[tokio::test]
async fn certificate_expiry_is_exported_per_file_and_follows_reloads() {
    let (s, ca) = set("expiry", true);
    let registry = prometheus::Registry::new();
    let expiry = CertExpiry::register(&registry).unwrap();
    let tls = TlsServer::new("agent_tls", s.server.clone(), ALPN_H2)
        .unwrap()
        .with_expiry(&expiry);
    let cert = expiry_of(&registry, "agent_tls", "cert").expect("the certificate's expiry");
    assert_eq!(cert, earliest_expiry(&s.server.cert).unwrap() as f64);
    assert!(
        cert > END_2020,
        "a fresh certificate expires in the future: {cert}"
    );
    assert_eq!(
        expiry_of(&registry, "agent_tls", "client_ca"),
        Some(earliest_expiry(&s.ca).unwrap() as f64)
    );

    // Rotated to a chain whose first certificate ended in 2020: the earliest counts, and
    // the reload updates the series.
    let old = ca.expired_server(&["localhost"]).unwrap();
    std::fs::write(&s.server.cert, format!("{}{}", old.cert_pem, ca.cert_pem)).unwrap();
    std::fs::write(&s.server.key, &old.key_pem).unwrap();
    tls.reload().unwrap();
    assert_eq!(expiry_of(&registry, "agent_tls", "cert"), Some(END_2020));

    // A dialer exports its CA and its client certificate.
    let client = TlsClient::new(
        "forward_tls",
        ClientTls {
            ca: Some(s.ca.clone()),
            cert: Some(s.server.cert.clone()),
            key: Some(s.server.key.clone()),
            server_name: None,
        },
        ALPN_H2,
    )
    .unwrap()
    .with_expiry(&expiry);
    assert_eq!(expiry_of(&registry, "forward_tls", "cert"), Some(END_2020));
    assert!(expiry_of(&registry, "forward_tls", "ca").is_some());
    drop(client);
    assert!(earliest_expiry(&s.dir.path().join("missing.pem")).is_err());
}

#[tokio::test]
async fn a_listener_pinned_to_client_names_refuses_another_certificate_of_the_same_ca() {
    let (mut s, ca) = set("pinned", true);
    s.server.client_names = vec!["dispatcher-1".into()];
    let addr = serve(TlsServer::new("t", s.server.clone(), ALPN_H2).unwrap()).await;
    let client = |name: &str| {
        let leaf = ca.client(name).unwrap();
        let c = ClientTls {
            ca: Some(s.ca.clone()),
            cert: Some(write(s.dir.path(), &format!("{name}.pem"), &leaf.cert_pem).unwrap()),
            key: Some(write(s.dir.path(), &format!("{name}.key"), &leaf.key_pem).unwrap()),
            server_name: None,
        };
        TlsClient::new("c", c, ALPN_H2).unwrap()
    };
    // An agent's certificate from the same CA verifies against the CA but names no
    // allowed peer: refused.
    let err = talk(&client("agent-7"), addr).await.unwrap_err();
    assert!(
        err.kind() != std::io::ErrorKind::TimedOut,
        "refused, not timed out: {err}"
    );
    talk(&client("dispatcher-1"), addr).await.unwrap();
}

/// Counts its reloads; its one file is `path`.
struct Counted {
    path: PathBuf,
    reloads: Arc<std::sync::atomic::AtomicUsize>,
}

impl Reload for Counted {
    fn reload(&self) -> Result<(), TlsError> {
        self.reloads
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Ok(())
    }
    fn files(&self) -> Vec<PathBuf> {
        vec![self.path.clone()]
    }
    fn name(&self) -> &str {
        "counted"
    }
}

#[tokio::test]
async fn reloads_follow_file_changes_until_stopped() {
    let tmp = temp_dir("reloads");
    let dir = tmp.path();
    let path = write(dir, "watched.pem", "one").unwrap();
    let reloads = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let count = || reloads.load(std::sync::atomic::Ordering::SeqCst);
    let stop = CancellationToken::new();
    let mut set = Reloads::default().with(None::<TlsServer>);
    set.push(Counted {
        path: path.clone(),
        reloads: reloads.clone(),
    });
    let task = set.spawn(Duration::from_millis(10), stop.clone());
    // Changes the file's modification time shows (set explicitly: a rewrite within the
    // file system's timestamp granularity would not), repeated until one lands after the
    // task took its first look.
    let file = std::fs::File::options().write(true).open(&path).unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let mut later = crate::wall::now();
    while count() == 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no reload after the file changed"
        );
        later += Duration::from_secs(1);
        file.set_modified(later).unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop.cancel();
    tokio::time::timeout(Duration::from_secs(5), task)
        .await
        .expect("the reload task ends when stopped")
        .unwrap();
}

#[tokio::test]
async fn a_dialer_reloads_its_trust_as_a_listener_reloads_its_certificate() {
    let (s, _) = set("client-reload", false);
    let addr = serve(TlsServer::new("t", s.server.clone(), ALPN_H2).unwrap()).await;
    // The dialer starts out trusting another CA, then its `ca` file is replaced by the
    // server's: the same reload as a listener's, on the same type.
    let other = DevCa::new("someone else").unwrap();
    let ca_file = write(s.dir.path(), "dialer-ca.pem", &other.cert_pem).unwrap();
    let client = TlsClient::new(
        "c",
        ClientTls {
            ca: Some(ca_file.clone()),
            ..Default::default()
        },
        ALPN_H2,
    )
    .unwrap();
    assert!(talk(&client, addr).await.is_err(), "trusted another CA");
    assert_eq!(Reload::files(&client), vec![ca_file.clone()]);
    std::fs::copy(&s.ca, &ca_file).unwrap();
    client.reload().unwrap();
    talk(&client, addr).await.unwrap();
}
