//! The tunnel server over real gRPC on 127.0.0.1:0, driven by a scripted agent and a
//! scripted dispatcher written with the generated clients.

use relay_proto::forward_client::ForwardClient;
use relay_proto::tunnel_client::TunnelClient;
use relay_proto::*;
use relay_tunnel_server::{start, Config, Listeners, TokenStore, TunnelServerHandle};
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;
use tonic::{Code, Streaming};

async fn server(cfg: Config) -> TunnelServerHandle {
    let l = || TcpListener::bind("127.0.0.1:0");
    let listeners = Listeners {
        agent: l().await.unwrap(),
        forward: l().await.unwrap(),
        admin: l().await.unwrap(),
    };
    let cfg = Config {
        dispatchers: vec![],
        server_id: "ts-1".into(),
        ..cfg
    }
    .insecure();
    start(cfg, TokenStore::single("good-token", "acme"), listeners)
        .await
        .unwrap()
}

async fn channel(addr: std::net::SocketAddr) -> Channel {
    tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap()
}

/// A scripted agent stream.
struct FakeStream {
    tx: mpsc::Sender<AgentFrame>,
    rx: Streaming<ServerFrame>,
    hello: ServerHello,
}

async fn open(ch: &Channel, token: &str) -> Result<FakeStream, tonic::Status> {
    let (tx, rx) = mpsc::channel(16);
    let mut req = tonic::Request::new(ReceiverStream::new(rx));
    req.metadata_mut()
        .insert("authorization", format!("Bearer {token}").parse().unwrap());
    let mut stream = TunnelClient::new(ch.clone())
        .connect(req)
        .await?
        .into_inner();
    let first = stream.message().await?.expect("hello");
    let Some(server_frame::Kind::Hello(hello)) = first.kind else {
        panic!("first frame is not a hello: {first:?}")
    };
    Ok(FakeStream {
        tx,
        rx: stream,
        hello,
    })
}

impl FakeStream {
    /// Next frame that is not a ping or pressure hint.
    async fn next(&mut self) -> Option<server_frame::Kind> {
        loop {
            match tokio::time::timeout(Duration::from_secs(10), self.rx.message())
                .await
                .expect("frame in time")
            {
                Ok(Some(ServerFrame {
                    kind: Some(server_frame::Kind::Ping(_) | server_frame::Kind::Pressure(_)),
                })) => continue,
                Ok(Some(f)) => return f.kind,
                _ => return None,
            }
        }
    }

    async fn send(&self, kind: agent_frame::Kind) {
        self.tx.send(AgentFrame::of(kind)).await.unwrap();
    }

    /// Serves one call with a fixed answer; returns the request head.
    async fn serve_one(&mut self, body: &[u8]) -> RequestHead {
        let Some(server_frame::Kind::RequestHead(head)) = self.next().await else {
            panic!("expected a request head")
        };
        let id = head.call_id;
        self.send(agent_frame::Kind::ResponseHead(ResponseHead {
            call_id: id,
            status: 200,
            headers: vec![],
            end_of_stream: false,
            ..Default::default()
        }))
        .await;
        self.send(agent_frame::Kind::ResponseBody(BodyChunk {
            call_id: id,
            data: body.to_vec(),
            end: true,
        }))
        .await;
        head
    }
}

/// A scripted dispatcher call.
async fn call(
    ch: &Channel,
    tunnel_id: &str,
    deadline_ms: u32,
) -> (mpsc::Sender<ForwardRequest>, Streaming<ForwardResponse>) {
    let (tx, rx) = mpsc::channel(16);
    let head = CallHead {
        tunnel_id: tunnel_id.into(),
        request: Some(RequestHead {
            call_id: 0,
            method: "GET".into(),
            path_and_query: "/x?y=1".into(),
            headers: vec![Header::new("accept", "text/plain")],
            deadline_ms,
            end_of_stream: true,
        }),
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

async fn collect(mut resp: Streaming<ForwardResponse>) -> Result<(u32, Vec<u8>), ForwardError> {
    let mut status = 0;
    let mut body = Vec::new();
    while let Some(frame) = resp.message().await.unwrap() {
        match frame.kind.unwrap() {
            forward_response::Kind::Head(h) => status = h.status,
            forward_response::Kind::Body(b) => {
                body.extend_from_slice(&b.data);
                if b.end {
                    break;
                }
            }
            forward_response::Kind::Error(e) => return Err(e),
        }
    }
    Ok((status, body))
}

#[tokio::test]
async fn unknown_token_is_refused_unauthenticated() {
    let s = server(Config::default()).await;
    let ch = channel(s.agent_addr).await;
    let err = open(&ch, "wrong").await.err().expect("refused");
    assert_eq!(err.code(), Code::Unauthenticated);
    assert!(
        !err.message().contains("wrong"),
        "the token must not be echoed: {}",
        err.message()
    );
}

#[tokio::test]
async fn a_call_goes_to_the_newest_idle_stream() {
    let s = server(Config::default()).await;
    let agent = channel(s.agent_addr).await;
    let disp = channel(s.forward_addr).await;
    let mut a = open(&agent, "good-token").await.unwrap();
    let mut b = open(&agent, "good-token").await.unwrap();
    assert_eq!(a.hello.tunnel_id, "acme");
    assert_eq!(b.hello.server_id, "ts-1");
    let (_tx, resp) = call(&disp, "acme", 5000).await;
    let head = b.serve_one(b"from b").await;
    assert_eq!(head.path_and_query, "/x?y=1");
    assert_eq!(collect(resp).await.unwrap(), (200, b"from b".to_vec()));
    // b is the newest idle stream again.
    let (_tx, resp) = call(&disp, "acme", 5000).await;
    b.serve_one(b"again b").await;
    assert_eq!(collect(resp).await.unwrap().1, b"again b".to_vec());
    // a never saw a call.
    assert!(tokio::time::timeout(Duration::from_millis(50), a.next())
        .await
        .is_err());
}

#[tokio::test]
async fn a_call_waits_for_a_stream_then_gives_no_capacity_at_its_deadline() {
    let s = server(Config::default()).await;
    let agent = channel(s.agent_addr).await;
    let disp = channel(s.forward_addr).await;
    let mut a = open(&agent, "good-token").await.unwrap();
    let (_t1, first) = call(&disp, "acme", 5000).await;
    let Some(server_frame::Kind::RequestHead(h1)) = a.next().await else {
        panic!()
    };
    // The only stream is busy: this one queues and runs when the first ends.
    let (_t2, second) = call(&disp, "acme", 5000).await;
    a.send(agent_frame::Kind::ResponseHead(ResponseHead {
        call_id: h1.call_id,
        status: 204,
        headers: vec![],
        end_of_stream: true,
        ..Default::default()
    }))
    .await;
    assert_eq!(collect(first).await.unwrap().0, 204);
    a.serve_one(b"second").await;
    assert_eq!(collect(second).await.unwrap().1, b"second".to_vec());
    // Busy again, and this caller's deadline is short.
    let (_t3, third) = call(&disp, "acme", 5000).await;
    let Some(server_frame::Kind::RequestHead(_)) = a.next().await else {
        panic!()
    };
    let (_t4, fourth) = call(&disp, "acme", 200).await;
    let err = collect(fourth).await.unwrap_err();
    assert_eq!(err.kind, ForwardErrorKind::NoCapacity as i32);
    drop(third);
}

#[tokio::test]
async fn unknown_tunnel_id_is_reported() {
    let s = server(Config::default()).await;
    let disp = channel(s.forward_addr).await;
    let (_t, resp) = call(&disp, "nobody", 1000).await;
    assert_eq!(
        collect(resp).await.unwrap_err().kind,
        ForwardErrorKind::UnknownTunnel as i32
    );
}

#[tokio::test]
async fn streams_over_the_per_token_cap_are_refused_resource_exhausted() {
    let s = server(Config {
        max_streams_per_token: 2,
        ..Config::default()
    })
    .await;
    let agent = channel(s.agent_addr).await;
    let _a = open(&agent, "good-token").await.unwrap();
    let _b = open(&agent, "good-token").await.unwrap();
    let err = open(&agent, "good-token").await.err().unwrap();
    assert_eq!(err.code(), Code::ResourceExhausted);
}

#[tokio::test]
async fn a_malformed_frame_closes_only_that_stream() {
    let s = server(Config::default()).await;
    let agent = channel(s.agent_addr).await;
    let disp = channel(s.forward_addr).await;
    let mut good = open(&agent, "good-token").await.unwrap();
    let mut bad = open(&agent, "good-token").await.unwrap();
    bad.send(agent_frame::Kind::ResponseBody(BodyChunk {
        call_id: 99,
        data: vec![1],
        end: true,
    }))
    .await;
    let status = loop {
        match tokio::time::timeout(Duration::from_secs(5), bad.rx.message())
            .await
            .unwrap()
        {
            Ok(Some(_)) => continue,
            Ok(None) => panic!("closed without a status"),
            Err(status) => break status,
        }
    };
    assert_eq!(status.code(), Code::InvalidArgument);
    let (_t, resp) = call(&disp, "acme", 5000).await;
    good.serve_one(b"still serving").await;
    assert_eq!(collect(resp).await.unwrap().1, b"still serving".to_vec());
}

#[tokio::test]
async fn a_call_crossing_going_away_is_served_then_the_stream_closes() {
    let s = server(Config::default()).await;
    let agent = channel(s.agent_addr).await;
    let disp = channel(s.forward_addr).await;
    let mut a = open(&agent, "good-token").await.unwrap();
    let (_t, resp) = call(&disp, "acme", 5000).await;
    // The head is on the wire toward the agent when it says GoingAway.
    a.send(agent_frame::Kind::GoingAway(GoingAway {})).await;
    a.serve_one(b"crossed").await;
    assert_eq!(collect(resp).await.unwrap().1, b"crossed".to_vec());
    // The server then ends the stream with OK.
    assert!(a.next().await.is_none());
    let (_t, resp) = call(&disp, "acme", 300).await;
    assert!(
        collect(resp).await.is_err(),
        "no stream is left for the tunnel id"
    );
}

#[tokio::test]
async fn a_caller_leaving_sends_cancel_and_the_stream_serves_the_next_call() {
    let s = server(Config::default()).await;
    let agent = channel(s.agent_addr).await;
    let disp = channel(s.forward_addr).await;
    let mut a = open(&agent, "good-token").await.unwrap();
    let (tx, resp) = call(&disp, "acme", 5000).await;
    let Some(server_frame::Kind::RequestHead(h)) = a.next().await else {
        panic!()
    };
    drop(resp);
    drop(tx);
    let Some(server_frame::Kind::Cancel(c)) = a.next().await else {
        panic!("expected a cancel")
    };
    assert_eq!(c.call_id, h.call_id);
    a.send(agent_frame::Kind::CallError(CallError {
        call_id: h.call_id,
        kind: CallErrorKind::Cancelled as i32,
        message: "cancelled".into(),
    }))
    .await;
    let (_t, resp) = call(&disp, "acme", 5000).await;
    a.serve_one(b"next").await;
    assert_eq!(collect(resp).await.unwrap().1, b"next".to_vec());
}

#[tokio::test]
async fn a_stream_dying_mid_call_gives_stream_lost() {
    let s = server(Config::default()).await;
    let agent = channel(s.agent_addr).await;
    let disp = channel(s.forward_addr).await;
    let mut a = open(&agent, "good-token").await.unwrap();
    let (_t, resp) = call(&disp, "acme", 5000).await;
    let Some(server_frame::Kind::RequestHead(_)) = a.next().await else {
        panic!()
    };
    drop(a);
    assert_eq!(
        collect(resp).await.unwrap_err().kind,
        ForwardErrorKind::StreamLost as i32
    );
}

#[tokio::test]
async fn a_silent_stream_is_dropped_by_the_heartbeat() {
    let s = server(Config {
        heartbeat: Duration::from_millis(50),
        heartbeat_misses: 2,
        ..Config::default()
    })
    .await;
    let agent = channel(s.agent_addr).await;
    // Never answers pings; keeps its request half open.
    let mut a = open(&agent, "good-token").await.unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while let Ok(Some(_)) = tokio::time::timeout_at(deadline, a.rx.message())
        .await
        .expect("dropped before the deadline")
    {}
    assert!(s.hub().tunnel_ids().is_empty());
}
