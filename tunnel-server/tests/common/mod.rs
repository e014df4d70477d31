//! Shared by the security and fuzz tests: a tunnel server on 127.0.0.1:0, scripted agent
//! streams and scripted dispatcher calls over real gRPC.
#![allow(dead_code)]

use relay_proto::forward_client::ForwardClient;
use relay_proto::tunnel_client::TunnelClient;
use relay_proto::*;
use relay_tunnel_server::{start, Config, Listeners, TokenStore, TunnelServerHandle};
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;
use tonic::Streaming;

pub async fn server(cfg: Config, tokens: TokenStore) -> TunnelServerHandle {
    let l = || TcpListener::bind("127.0.0.1:0");
    let listeners = Listeners {
        agent: l().await.unwrap(),
        forward: l().await.unwrap(),
        admin: l().await.unwrap(),
    };
    let cfg = Config {
        dispatchers: vec![],
        server_id: "ts-1".into(),
        // Scripted agents never move their streams away on Drain: keep the drain short.
        shutdown_grace: cfg
            .shutdown_grace
            .min(std::time::Duration::from_millis(300)),
        ..cfg
    }
    .insecure();
    start(cfg, tokens, listeners).await.unwrap()
}

pub async fn channel(addr: std::net::SocketAddr) -> Channel {
    tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap()
}

/// A scripted agent stream.
pub struct FakeStream {
    pub tx: mpsc::Sender<AgentFrame>,
    pub rx: Streaming<ServerFrame>,
    pub hello: ServerHello,
}

pub async fn open(ch: &Channel, token: &str) -> Result<FakeStream, tonic::Status> {
    open_with(ch, token, None).await
}

/// `open` for an agent that lists `features` in `relay-agent-features`.
pub async fn open_with(
    ch: &Channel,
    token: &str,
    features: Option<&str>,
) -> Result<FakeStream, tonic::Status> {
    let (tx, rx) = mpsc::channel(16);
    let mut req = tonic::Request::new(ReceiverStream::new(rx));
    req.metadata_mut()
        .insert("authorization", format!("Bearer {token}").parse().unwrap());
    if let Some(features) = features {
        req.metadata_mut()
            .insert("relay-agent-features", features.parse().unwrap());
    }
    let mut stream = TunnelClient::new(ch.clone())
        .max_encoding_message_size(64 * 1024 * 1024)
        .connect(req)
        .await?
        .into_inner();
    let first = stream
        .message()
        .await?
        .ok_or_else(|| tonic::Status::unknown("no hello"))?;
    let Some(server_frame::Kind::Hello(hello)) = first.kind else {
        return Err(tonic::Status::unknown("first frame is not a hello"));
    };
    // Confirm the stream as an agent does (its pong to the first ping): only then does
    // the server hand it calls.
    confirm(&tx).await;
    Ok(FakeStream {
        tx,
        rx: stream,
        hello,
    })
}

/// Waits (bounded) until `n` streams of the tunnel id can take a call: a new stream is
/// confirmed by its first frame, which the server reads on its own time.
pub async fn until_idle(s: &TunnelServerHandle, tunnel_id: &str, n: usize) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while s.hub().idle_streams(tunnel_id) < n {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{n} idle streams of {tunnel_id} within 10 s"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// The agent's first frame, which makes a new stream take calls.
pub async fn confirm(tx: &mpsc::Sender<AgentFrame>) {
    let _ = tx
        .send(AgentFrame::of(agent_frame::Kind::Pong(relay_proto::Pong {
            seq: 0,
        })))
        .await;
}

/// Opens a stream and reads its hello without confirming it (an agent that gave up
/// before the hello arrived).
pub async fn open_unconfirmed(ch: &Channel, token: &str) -> Result<FakeStream, tonic::Status> {
    let (tx, rx) = mpsc::channel(16);
    let mut req = tonic::Request::new(ReceiverStream::new(rx));
    req.metadata_mut()
        .insert("authorization", format!("Bearer {token}").parse().unwrap());
    let mut stream = TunnelClient::new(ch.clone())
        .connect(req)
        .await?
        .into_inner();
    let first = stream
        .message()
        .await?
        .ok_or_else(|| tonic::Status::unknown("no hello"))?;
    let Some(server_frame::Kind::Hello(hello)) = first.kind else {
        return Err(tonic::Status::unknown("first frame is not a hello"));
    };
    Ok(FakeStream {
        tx,
        rx: stream,
        hello,
    })
}

impl FakeStream {
    /// Next frame that is not a ping or pressure hint; `Err` with the status the RPC
    /// ended with, `Ok(None)` on a clean end.
    pub async fn next(&mut self) -> Result<Option<server_frame::Kind>, tonic::Status> {
        loop {
            match tokio::time::timeout(Duration::from_secs(10), self.rx.message())
                .await
                .map_err(|_| tonic::Status::deadline_exceeded("no frame in 10 s"))??
            {
                Some(ServerFrame {
                    kind: Some(server_frame::Kind::Ping(_) | server_frame::Kind::Pressure(_)),
                }) => continue,
                Some(f) => return Ok(f.kind),
                None => return Ok(None),
            }
        }
    }

    /// Sends a frame; false if the stream is gone.
    pub async fn send(&self, kind: agent_frame::Kind) -> bool {
        self.tx.send(AgentFrame::of(kind)).await.is_ok()
    }

    /// Ends call `call_id` with a bodiless `status` answer.
    pub async fn answer(&self, call_id: u64, status: u32) -> bool {
        self.send(agent_frame::Kind::ResponseHead(ResponseHead {
            call_id,
            status,
            end_of_stream: true,
            ..Default::default()
        }))
        .await
    }

    /// Serves the next call with 200 and `body`.
    pub async fn serve_one(&mut self, body: &[u8]) -> RequestHead {
        let Ok(Some(server_frame::Kind::RequestHead(head))) = self.next().await else {
            panic!("expected a request head")
        };
        let id = head.call_id;
        self.send(agent_frame::Kind::ResponseHead(ResponseHead {
            call_id: id,
            status: 200,
            ..Default::default()
        }))
        .await;
        self.send(agent_frame::Kind::ResponseBody(BodyChunk {
            call_id: id,
            data: body.to_vec().into(),
            end: true,
        }))
        .await;
        head
    }
}

/// A scripted dispatcher call to `tunnel_id`, without the queue handshake.
pub async fn call(
    ch: &Channel,
    tunnel_id: &str,
    deadline_ms: u32,
) -> (mpsc::Sender<ForwardRequest>, Streaming<ForwardResponse>) {
    call_with(ch, tunnel_id, deadline_ms, false, true).await
}

/// A scripted dispatcher call: `handshake` asks for the queue handshake; `end_of_stream`
/// false means body chunks follow the head (sent through the returned sender).
pub async fn call_with(
    ch: &Channel,
    tunnel_id: &str,
    deadline_ms: u32,
    handshake: bool,
    end_of_stream: bool,
) -> (mpsc::Sender<ForwardRequest>, Streaming<ForwardResponse>) {
    let (tx, rx) = mpsc::channel(16);
    let head = CallHead {
        tunnel_id: tunnel_id.into(),
        request: Some(RequestHead {
            call_id: 0,
            method: "GET".into(),
            path_and_query: "/x".into(),
            headers: vec![],
            deadline_ms,
            end_of_stream,
            ..Default::default()
        }),
        queue_handshake: handshake,
    };
    tx.send(ForwardRequest::of(forward_request::Kind::Head(head)))
        .await
        .unwrap();
    let resp = ForwardClient::new(ch.clone())
        .call(ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    (tx, resp)
}

/// How one call ended, as the dispatcher saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Head status and body.
    Answer(u32, Vec<u8>),
    /// A ForwardError kind.
    Error(i32),
    /// The RPC ended with a status or without a terminal frame.
    Broken(String),
}

/// Reads a call's response stream to its end.
pub async fn outcome(mut resp: Streaming<ForwardResponse>) -> Outcome {
    let mut status = None;
    let mut body = Vec::new();
    loop {
        match resp.message().await {
            Ok(Some(f)) => match f.kind {
                Some(forward_response::Kind::Head(h)) => {
                    status = Some(h.status);
                    body.extend_from_slice(&h.body);
                    if h.end_of_stream {
                        return Outcome::Answer(h.status, body);
                    }
                }
                Some(forward_response::Kind::Body(b)) => {
                    body.extend_from_slice(&b.data);
                    if b.end {
                        return match status {
                            Some(s) => Outcome::Answer(s, body),
                            None => Outcome::Broken("body without head".into()),
                        };
                    }
                }
                Some(forward_response::Kind::Error(e)) => return Outcome::Error(e.kind),
                Some(forward_response::Kind::Queued(_) | forward_response::Kind::Reserved(_)) => {
                    return Outcome::Broken("a queue notice the call did not ask for".into())
                }
                None => return Outcome::Broken("empty frame".into()),
            },
            Ok(None) => return Outcome::Broken("ended without a terminal frame".into()),
            Err(s) => return Outcome::Broken(format!("{:?}: {}", s.code(), s.message())),
        }
    }
}
