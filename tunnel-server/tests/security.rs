//! Tokens and frame limits on a real tunnel server: a token removed from the store file
//! closes its streams with UNAUTHENTICATED "token revoked" (and no other token's); an
//! oversized frame or body chunk closes only the stream that sent it, with a clear status.

mod common;

use common::*;
use relay_common::secret::sha256_hex;
use relay_proto::*;
use relay_tunnel_server::{Config, TokenStore};
use std::path::PathBuf;
use std::time::Duration;
use tonic::Code;

fn store_file(entries: &[(&str, &str)]) -> String {
    entries
        .iter()
        .map(|(token, id)| {
            format!(
                "[[tokens]]\ntunnel_id = \"{id}\"\nsha256 = \"{}\"\n",
                sha256_hex(token.as_bytes())
            )
        })
        .collect()
}

fn temp_file(tag: &str) -> PathBuf {
    std::env::temp_dir().join(format!(
        "relay-tokens-{tag}-{}-{}.toml",
        std::process::id(),
        rand_suffix()
    ))
}

fn rand_suffix() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u8(1);
    h.finish()
}

#[tokio::test]
async fn a_removed_token_closes_its_streams_and_only_its_streams() {
    let path = temp_file("revoke");
    std::fs::write(
        &path,
        store_file(&[("acme-token", "acme"), ("beta-token", "beta")]),
    )
    .unwrap();
    let cfg = Config {
        token_store: Some(path.clone()),
        reload_interval: Duration::from_millis(20),
        ..Config::default()
    };
    let s = server(cfg, TokenStore::load(&path).unwrap()).await;
    let agents = channel(s.agent_addr).await;
    let mut acme = vec![
        open(&agents, "acme-token").await.unwrap(),
        open(&agents, "acme-token").await.unwrap(),
    ];
    let mut beta = open(&agents, "beta-token").await.unwrap();

    std::fs::write(&path, store_file(&[("beta-token", "beta")])).unwrap();
    for stream in &mut acme {
        let end = tokio::time::timeout(Duration::from_secs(5), async {
            loop {
                match stream.next().await {
                    Ok(Some(_)) => continue,
                    other => return other,
                }
            }
        })
        .await
        .expect("a revoked token's stream closes within 5 s");
        let status = end.expect_err("closed with a status");
        assert_eq!(status.code(), Code::Unauthenticated, "{status:?}");
        assert_eq!(status.message(), "token revoked");
        assert!(!status.message().contains("acme-token"));
    }
    // The removed token cannot open new streams; the other token keeps serving.
    let refused = open(&agents, "acme-token").await.err().expect("refused");
    assert_eq!(refused.code(), Code::Unauthenticated);
    let dispatcher = channel(s.forward_addr).await;
    let (_tx, resp) = call(&dispatcher, "beta", 5_000).await;
    beta.serve_one(b"still here").await;
    assert_eq!(
        outcome(resp).await,
        Outcome::Answer(200, b"still here".to_vec())
    );
    assert_eq!(s.hub().tunnel_ids(), vec!["beta".to_string()]);
    let _ = std::fs::remove_file(&path);
    s.shutdown().await;
}

#[tokio::test]
async fn a_call_on_a_revoked_stream_ends_once_as_stream_lost() {
    let path = temp_file("revoke-call");
    std::fs::write(&path, store_file(&[("acme-token", "acme")])).unwrap();
    let cfg = Config {
        token_store: Some(path.clone()),
        reload_interval: Duration::from_millis(20),
        ..Config::default()
    };
    let s = server(cfg, TokenStore::load(&path).unwrap()).await;
    let agents = channel(s.agent_addr).await;
    let mut acme = open(&agents, "acme-token").await.unwrap();
    let dispatcher = channel(s.forward_addr).await;
    let (_tx, resp) = call(&dispatcher, "acme", 10_000).await;
    let Ok(Some(server_frame::Kind::RequestHead(_))) = acme.next().await else {
        panic!("the call reached the stream")
    };
    std::fs::write(&path, "").unwrap();
    let got = tokio::time::timeout(Duration::from_secs(5), outcome(resp))
        .await
        .expect("the call ends");
    assert_eq!(got, Outcome::Error(ForwardErrorKind::StreamLost as i32));
    let _ = std::fs::remove_file(&path);
    s.shutdown().await;
}

#[tokio::test]
async fn an_oversized_frame_closes_only_its_stream_with_resource_exhausted() {
    let cfg = Config {
        max_frame_bytes: 256 * 1024,
        ..Config::default()
    };
    let s = server(cfg, TokenStore::single("good-token", "acme")).await;
    let agents = channel(s.agent_addr).await;
    let mut big = open(&agents, "good-token").await.unwrap();
    let mut other = open(&agents, "good-token").await.unwrap();
    big.send(agent_frame::Kind::ResponseBody(BodyChunk {
        call_id: 1,
        data: vec![0u8; 512 * 1024].into(),
        end: false,
    }))
    .await;
    let status = loop {
        match big.next().await {
            Ok(Some(_)) => continue,
            Ok(None) => panic!("closed without a status"),
            Err(s) => break s,
        }
    };
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert!(status.message().contains("max_frame_bytes"), "{status:?}");
    // The other stream of the same connection serves on.
    let dispatcher = channel(s.forward_addr).await;
    let (_tx, resp) = call(&dispatcher, "acme", 5_000).await;
    other.serve_one(b"ok").await;
    assert_eq!(outcome(resp).await, Outcome::Answer(200, b"ok".to_vec()));
    s.shutdown().await;
}

#[tokio::test]
async fn an_oversized_body_chunk_closes_its_stream_and_fails_its_call_once() {
    let s = server(Config::default(), TokenStore::single("good-token", "acme")).await;
    let agents = channel(s.agent_addr).await;
    let mut a = open(&agents, "good-token").await.unwrap();
    let dispatcher = channel(s.forward_addr).await;
    let (_tx, resp) = call(&dispatcher, "acme", 5_000).await;
    let Ok(Some(server_frame::Kind::RequestHead(head))) = a.next().await else {
        panic!("expected the call")
    };
    a.send(agent_frame::Kind::ResponseHead(ResponseHead {
        call_id: head.call_id,
        status: 200,
        ..Default::default()
    }))
    .await;
    a.send(agent_frame::Kind::ResponseBody(BodyChunk {
        call_id: head.call_id,
        data: vec![1u8; MAX_CHUNK + 1].into(),
        end: false,
    }))
    .await;
    let status = loop {
        match a.next().await {
            Ok(Some(_)) => continue,
            Ok(None) => panic!("closed without a status"),
            Err(s) => break s,
        }
    };
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert!(status.message().contains("64 KiB"), "{status:?}");
    let got = outcome(resp).await;
    assert!(
        matches!(got, Outcome::Error(k) if k == ForwardErrorKind::StreamLost as i32),
        "{got:?}"
    );
    // The server serves a new stream at once.
    let mut b = open(&agents, "good-token").await.unwrap();
    let (_tx, resp) = call(&dispatcher, "acme", 5_000).await;
    b.serve_one(b"ok").await;
    assert_eq!(outcome(resp).await, Outcome::Answer(200, b"ok".to_vec()));
    s.shutdown().await;
}
