//! The revocation race, made deterministic: a reload that removes a token lands between
//! a new stream's token lookup and its registration (a hook in `SharedTokens::lookup`).
//! Once the reload has returned, no stream of that token may be left on the server.

use super::{SharedTokens, TokenStore};
use crate::hub::{Hub, Limits};
use crate::metrics::ServerMetrics;
use crate::stream::TunnelService;
use relay_proto::tunnel_client::TunnelClient;
use relay_proto::tunnel_server::TunnelServer;
use relay_proto::{server_frame, AgentFrame};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tokio_util::sync::CancellationToken;

/// A tunnel server's `Tunnel` service alone on 127.0.0.1:0, the reload the server runs
/// (swap the store, then close the streams whose token it no longer holds).
struct Server {
    hub: Arc<Hub>,
    tokens: SharedTokens,
    url: String,
    stop: CancellationToken,
}

impl Server {
    async fn start(store: TokenStore) -> Server {
        let registry = prometheus::Registry::new();
        let hub = Arc::new(Hub::new(
            Limits {
                max_queue_per_tunnel: 16,
                max_streams_per_token: 16,
                max_response_headers: relay_proto::DEFAULT_MAX_HEADERS,
                max_response_header_bytes: relay_proto::DEFAULT_MAX_HEAD_BYTES,
            },
            ServerMetrics::register(&registry).unwrap(),
        ));
        let tokens = SharedTokens::new(store);
        let service = TunnelService {
            hub: hub.clone(),
            tokens: tokens.clone(),
            server_id: "ts-race".into(),
            zone: "z".into(),
            direct_url: String::new(),
            heartbeat: Duration::from_secs(30),
            heartbeat_misses: 3,
            liveness: None,
            response_credit: 0,
            tracker: tokio_util::task::TaskTracker::new(),
            listener: relay_common::listen::ListenerGuard::new(
                "agent",
                relay_common::listen::ListenerLimits::default(),
                relay_common::listen::ListenerMetrics::register(&prometheus::Registry::new())
                    .unwrap(),
            ),
        };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let stop = CancellationToken::new();
        let until = stop.clone();
        tokio::spawn(async move {
            let _ = tonic::transport::Server::builder()
                .add_service(TunnelServer::new(service))
                .serve_with_incoming_shutdown(
                    TcpListenerStream::new(listener),
                    until.cancelled_owned(),
                )
                .await;
        });
        Server {
            hub,
            tokens,
            url,
            stop,
        }
    }

    /// What `TokenReloader::reload` and the server's `on_change` do.
    fn reload(hub: &Hub, tokens: &SharedTokens, store: TokenStore) -> usize {
        tokens.replace(store);
        hub.revoke(|hash, id| tokens.contains(hash, id))
    }
}

/// Opens a stream with `token`; returns how it ended within `watch`: `Err` status (refused
/// or closed), or `Ok(frames seen)` if it is still open then.
async fn open_and_watch(url: &str, token: &str, watch: Duration) -> Result<usize, tonic::Status> {
    let channel = tonic::transport::Endpoint::from_shared(url.to_string())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let (tx, rx) = mpsc::channel::<AgentFrame>(4);
    let mut req = tonic::Request::new(ReceiverStream::new(rx));
    req.metadata_mut()
        .insert("authorization", format!("Bearer {token}").parse().unwrap());
    let mut stream = TunnelClient::new(channel).connect(req).await?.into_inner();
    let mut frames = 0;
    let watched = tokio::time::timeout(watch, async {
        loop {
            match stream.message().await {
                Ok(Some(f)) => {
                    if let Some(server_frame::Kind::Hello(_)) = f.kind {
                        // Confirm the stream as an agent does, so it would take calls.
                        let pong =
                            relay_proto::agent_frame::Kind::Pong(relay_proto::Pong { seq: 0 });
                        let _ = tx.send(AgentFrame::of(pong)).await;
                    }
                    frames += 1;
                }
                Ok(None) => return Err(tonic::Status::ok("ended")),
                Err(status) => return Err(status),
            }
        }
    })
    .await;
    drop(tx);
    match watched {
        Ok(end) => end,
        Err(_) => Ok(frames),
    }
}

#[tokio::test]
async fn a_reload_between_lookup_and_registration_leaves_no_stream_of_the_revoked_token() {
    let s = Server::start(TokenStore::single("acme-token", "acme")).await;
    let (hub, tokens) = (s.hub.clone(), s.tokens.clone());
    let closed = Arc::new(std::sync::atomic::AtomicUsize::new(usize::MAX));
    let seen = closed.clone();
    *s.tokens.after_lookup.lock() = Some(Box::new(move || {
        let n = Server::reload(&hub, &tokens, TokenStore::default());
        seen.store(n, std::sync::atomic::Ordering::SeqCst);
    }));

    let end = open_and_watch(&s.url, "acme-token", Duration::from_secs(5)).await;
    assert_ne!(
        closed.load(std::sync::atomic::Ordering::SeqCst),
        usize::MAX,
        "the reload ran inside the open"
    );
    let status = end.expect_err("the stream of a revoked token is refused or closed");
    assert_eq!(status.code(), tonic::Code::Unauthenticated, "{status:?}");
    assert!(s.hub.tunnel_ids().is_empty(), "{:?}", s.hub.tunnel_ids());
    assert_eq!(s.hub.idle_streams("acme"), 0);
    s.stop.cancel();
}

#[tokio::test]
async fn a_reload_that_keeps_the_token_leaves_a_stream_opened_across_it_alone() {
    let s = Server::start(TokenStore::single("acme-token", "acme")).await;
    let (hub, tokens) = (s.hub.clone(), s.tokens.clone());
    *s.tokens.after_lookup.lock() = Some(Box::new(move || {
        let mut store = TokenStore::single("acme-token", "acme");
        store.add("beta-token", "beta");
        Server::reload(&hub, &tokens, store);
    }));
    // Open for the whole of a short watch: nothing closes a stream whose token stayed.
    let frames = open_and_watch(&s.url, "acme-token", Duration::from_millis(500))
        .await
        .expect("the stream stays open");
    assert!(frames >= 1, "the hello arrived");
    assert_eq!(s.hub.tunnel_ids(), vec!["acme".to_string()]);
    s.stop.cancel();
}
