//! Handshakes over real loopback sockets with generated certificates.

use super::*;
use crate::devcerts::{write, DevCa};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

struct Set {
    dir: PathBuf,
    ca: PathBuf,
    server: ServerTls,
}

fn temp_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!(
        "relay-tls-{tag}-{}-{}",
        std::process::id(),
        rand_suffix()
    ));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn rand_suffix() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u8(0);
    h.finish()
}

fn set(tag: &str, mtls: bool) -> (Set, DevCa) {
    let dir = temp_dir(tag);
    let ca = DevCa::new("relay test ca").unwrap();
    let leaf = ca.server(&["localhost", "127.0.0.1"]).unwrap();
    let ca_path = write(&dir, "ca.pem", &ca.cert_pem).unwrap();
    let server = ServerTls {
        cert: write(&dir, "server.pem", &leaf.cert_pem).unwrap(),
        key: write(&dir, "server.key", &leaf.key_pem).unwrap(),
        client_ca: mtls.then(|| ca_path.clone()),
        client_cert_optional: false,
    };
    (
        Set {
            dir,
            ca: ca_path,
            server,
        },
        ca,
    )
}

/// Serves: each TLS connection answers "hello" with "world".
async fn serve(tls: TlsServer) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let mut conns = Box::pin(incoming(listener, Some(tls), CancellationToken::new()));
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
    let other_ca = write(&s.dir, "other-ca.pem", &other.cert_pem).unwrap();
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
        cert: write(&s.dir, "expired.pem", &leaf.cert_pem).unwrap(),
        key: write(&s.dir, "expired.key", &leaf.key_pem).unwrap(),
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
        cert: Some(write(&s.dir, "client.pem", &leaf.cert_pem).unwrap()),
        key: Some(write(&s.dir, "client.key", &leaf.key_pem).unwrap()),
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
    let new_ca_path = write(&s.dir, "new-ca.pem", &new_ca.cert_pem).unwrap();
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
