//! What the dispatcher -> tunnel server hop costs per call, by how calls ride HTTP/2:
//!
//! - `rpc per call`: one `Forward.Call` RPC per call (a new HTTP/2 stream: headers, the
//!   call's head message, the answer, trailers), what the relay does for a tunnel server
//!   without carriers;
//! - `message pair on a long-lived stream`: the same head and answer as two messages on
//!   an RPC that stays open across calls, one call at a time per RPC: how carriers
//!   (`Forward.Carry`) and the agent's tunnel streams carry calls.
//!
//! Both over loopback TCP with the forward hop's settings (`relay_common::grpc`,
//! `H2Limits::FORWARD`), client and server in one current-thread runtime, so the time per
//! call is the CPU of both ends plus the kernel's. Sequential calls, and 16 at a time (16
//! callers; 16 long-lived RPCs).
//!
//! `cargo bench -p relay-dispatcher --bench forward_hop`

use bytes::Bytes;
use criterion::{criterion_group, criterion_main, Criterion};
use futures::StreamExt;
use relay_common::grpc::{server, GrpcClient};
use relay_common::h2::H2Limits;
use relay_proto::forward_client::ForwardClient;
use relay_proto::forward_request::Kind as ReqKind;
use relay_proto::forward_response::Kind as RespKind;
use relay_proto::forward_server::{Forward, ForwardServer};
use relay_proto::{
    CallHead, ForwardRequest, ForwardResponse, ProceedReply, ProceedRequest, RequestHead,
    ResponseHead,
};
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tonic::transport::Channel;
use tonic::{Request, Response, Status, Streaming};

/// Answers every call head on an RPC with a whole 200 (8 bytes inside the head), for as
/// long as the RPC brings heads.
struct Answering;

#[tonic::async_trait]
impl Forward for Answering {
    type CallStream = ReceiverStream<Result<ForwardResponse, Status>>;

    async fn probe(
        &self,
        _request: Request<relay_proto::ProbeRequest>,
    ) -> Result<Response<relay_proto::ProbeReply>, Status> {
        Ok(Response::new(relay_proto::ProbeReply {}))
    }

    async fn call(
        &self,
        request: Request<Streaming<ForwardRequest>>,
    ) -> Result<Response<Self::CallStream>, Status> {
        let mut inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(4);
        tokio::spawn(async move {
            while let Some(Ok(ForwardRequest {
                kind: Some(ReqKind::Head(head)),
            })) = inbound.next().await
            {
                let call_id = head.request.map_or(0, |r| r.call_id);
                if tx.send(Ok(answer(call_id))).await.is_err() {
                    return;
                }
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    type CarryStream = ReceiverStream<Result<ForwardResponse, Status>>;

    async fn carry(
        &self,
        request: Request<Streaming<ForwardRequest>>,
    ) -> Result<Response<Self::CarryStream>, Status> {
        self.call(request).await
    }

    async fn proceed(
        &self,
        _request: Request<ProceedRequest>,
    ) -> Result<Response<ProceedReply>, Status> {
        Err(Status::unimplemented("not in this bench"))
    }
}

fn answer(call_id: u64) -> ForwardResponse {
    ForwardResponse::of(RespKind::Head(ResponseHead {
        call_id,
        status: 200,
        headers: vec![
            relay_proto::header("content-type", "text/plain"),
            relay_proto::header("content-length", "8"),
        ],
        end_of_stream: true,
        body: Bytes::from_static(b"12345678"),
    }))
}

fn head(call_id: u64) -> ForwardRequest {
    ForwardRequest::of(ReqKind::Head(CallHead {
        tunnel_id: "demo".into(),
        request: Some(RequestHead {
            call_id,
            method: "GET".into(),
            path_and_query: "/".into(),
            headers: vec![
                relay_proto::header("host", "127.0.0.1:8080"),
                relay_proto::header("user-agent", "wrk"),
            ],
            deadline_ms: 30_000,
            end_of_stream: true,
            ..Default::default()
        }),
        queue_handshake: true,
    }))
}

async fn start() -> Channel {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    // TCP_NODELAY on accepted sockets, as the tunnel server's listener sets it (a tonic
    // server given its own incoming stream leaves it off).
    let incoming = TcpListenerStream::new(listener).map(|accepted| {
        accepted.and_then(|socket| {
            socket.set_nodelay(true)?;
            Ok(socket)
        })
    });
    tokio::spawn(
        server(&H2Limits::FORWARD)
            .add_service(ForwardServer::new(Answering))
            .serve_with_incoming(incoming),
    );
    let client = GrpcClient::new(H2Limits::FORWARD, Duration::from_secs(5), None);
    client.lazy(client.endpoint(&url).unwrap())
}

/// One call as the relay makes it: its own RPC, read to its end.
async fn rpc_per_call(channel: &Channel, call_id: u64) {
    let mut client = ForwardClient::new(channel.clone());
    let request = futures::stream::iter([head(call_id)]);
    let mut answers = client.call(request).await.unwrap().into_inner();
    let first = answers.next().await.unwrap().unwrap();
    assert!(matches!(first.kind, Some(RespKind::Head(_))));
    // The relay reads the RPC to its end (the trailers) before dropping it.
    assert!(answers.next().await.is_none());
}

/// A long-lived RPC carrying one call at a time.
struct Carrier {
    heads: mpsc::Sender<ForwardRequest>,
    answers: Streaming<ForwardResponse>,
}

impl Carrier {
    async fn open(channel: &Channel) -> Carrier {
        let (heads, rx) = mpsc::channel(4);
        let answers = ForwardClient::new(channel.clone())
            .call(ReceiverStream::new(rx))
            .await
            .unwrap()
            .into_inner();
        Carrier { heads, answers }
    }

    async fn call(&mut self, call_id: u64) {
        self.heads.send(head(call_id)).await.unwrap();
        let first = self.answers.next().await.unwrap().unwrap();
        assert!(matches!(first.kind, Some(RespKind::Head(_))));
    }
}

const CONCURRENT: u64 = 16;

fn forward_hop(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let channel = rt.block_on(start());
    let mut group = c.benchmark_group("forward_hop");
    group.measurement_time(Duration::from_secs(5));

    group.bench_function("rpc per call, sequential", |b| {
        b.iter_custom(|iters| {
            rt.block_on(async {
                let start = Instant::now();
                for i in 0..iters {
                    rpc_per_call(&channel, i).await;
                }
                start.elapsed()
            })
        })
    });
    group.bench_function("message pair on a long-lived stream, sequential", |b| {
        let mut carrier = rt.block_on(Carrier::open(&channel));
        b.iter_custom(|iters| {
            rt.block_on(async {
                let start = Instant::now();
                for i in 0..iters {
                    carrier.call(i).await;
                }
                start.elapsed()
            })
        })
    });
    group.bench_function("rpc per call, 16 at a time", |b| {
        b.iter_custom(|iters| {
            rt.block_on(async {
                let start = Instant::now();
                let callers: Vec<_> = (0..CONCURRENT)
                    .map(|k| {
                        let channel = channel.clone();
                        tokio::spawn(async move {
                            for i in (k..iters).step_by(CONCURRENT as usize) {
                                rpc_per_call(&channel, i).await;
                            }
                        })
                    })
                    .collect();
                for c in callers {
                    c.await.unwrap();
                }
                start.elapsed()
            })
        })
    });
    group.bench_function("message pair on a long-lived stream, 16 at a time", |b| {
        let carriers: Vec<Carrier> = rt.block_on(async {
            let mut v = Vec::new();
            for _ in 0..CONCURRENT {
                v.push(Carrier::open(&channel).await);
            }
            v
        });
        let mut carriers = Some(carriers);
        b.iter_custom(|iters| {
            rt.block_on(async {
                let start = Instant::now();
                let callers: Vec<_> = carriers
                    .take()
                    .unwrap()
                    .into_iter()
                    .enumerate()
                    .map(|(k, mut carrier)| {
                        tokio::spawn(async move {
                            for i in (k as u64..iters).step_by(CONCURRENT as usize) {
                                carrier.call(i).await;
                            }
                            carrier
                        })
                    })
                    .collect();
                let mut back = Vec::new();
                for c in callers {
                    back.push(c.await.unwrap());
                }
                carriers = Some(back);
                start.elapsed()
            })
        })
    });
    group.finish();
}

criterion_group!(benches, forward_hop);
criterion_main!(benches);
