//! Tests of the test fixtures themselves: the stream-placing load balancer and the
//! simulated upstream. Everything runs on 127.0.0.1:0 in real time; waits poll with a
//! deadline.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Method, Request, Response, StatusCode};
use http_body_util::channel::{Channel, Sender};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::client::conn::http2::SendRequest;
use hyper::service::service_fn;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use relay_tests::lb::{LbHandle, LoadBalancer, Policy};
use relay_tests::upstream::{pattern_byte, Upstream, UpstreamHandle};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Instant;
use tokio_util::task::AbortOnDropHandle;

use relay_tests::eventually;

type TestBody = BoxBody<Bytes, Infallible>;

const DEADLINE: Duration = Duration::from_secs(10);

/// A gRPC-like HTTP/2 backend: answers every request at once with headers
/// `x-backend: {idx}`, echoes each request body frame as it arrives, and ends with
/// trailers `grpc-status: 0`, `x-backend: {idx}` once the request body ends.
struct EchoBackend {
    addr: SocketAddr,
    _task: AbortOnDropHandle<()>,
}

async fn echo_backend(idx: usize) -> EchoBackend {
    let listener = TcpListener::bind(("127.0.0.1", 0)).await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let task = tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let svc = service_fn(move |req: Request<Incoming>| async move {
                    let (tx, body) = Channel::<Bytes, Infallible>::new(8);
                    tokio::spawn(echo_frames(req.into_body(), tx, idx));
                    let res = Response::builder()
                        .header("content-type", "application/grpc")
                        .header("x-backend", idx.to_string())
                        .body(body)
                        .expect("response");
                    Ok::<_, Infallible>(res)
                });
                let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                    .max_concurrent_streams(10_000)
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    EchoBackend {
        addr,
        _task: AbortOnDropHandle::new(task),
    }
}

async fn echo_frames(mut body: Incoming, mut tx: Sender<Bytes, Infallible>, idx: usize) {
    while let Some(frame) = body.frame().await {
        let Ok(frame) = frame else { return };
        if let Ok(data) = frame.into_data() {
            if tx.send_data(data).await.is_err() {
                return;
            }
        }
    }
    let mut trailers = HeaderMap::new();
    trailers.insert("grpc-status", "0".parse().expect("value"));
    trailers.insert("x-backend", idx.to_string().parse().expect("value"));
    let _ = tx.send_trailers(trailers).await;
}

async fn backends(n: usize) -> Vec<EchoBackend> {
    let mut v = Vec::new();
    for i in 0..n {
        v.push(echo_backend(i).await);
    }
    v
}

async fn lb_over(backends: &[EchoBackend], policy: Policy) -> LbHandle {
    LoadBalancer::builder()
        .backends(backends.iter().map(|b| b.addr))
        .policy(policy)
        .seed(42)
        .spawn()
        .await
        .expect("spawn lb")
}

/// One HTTP/2 (prior knowledge) client connection, as an agent holds to the LB.
async fn h2_client(addr: SocketAddr) -> SendRequest<TestBody> {
    let tcp = TcpStream::connect(addr).await.expect("connect");
    let (send, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tcp))
            .await
            .expect("h2 handshake");
    tokio::spawn(conn);
    send
}

fn grpc_request(addr: SocketAddr, body: TestBody) -> Request<TestBody> {
    Request::post(format!("http://{addr}/relay.v1.Tunnel/Connect"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(body)
        .expect("request")
}

fn backend_of(res: &Response<Incoming>) -> Option<usize> {
    res.headers().get("x-backend")?.to_str().ok()?.parse().ok()
}

struct Unary {
    status: StatusCode,
    backend: Option<usize>,
    grpc_status: Option<String>,
    body: Bytes,
}

/// A one-message stream: sends `msg`, ends, collects the answer with its trailers.
async fn unary(client: &SendRequest<TestBody>, addr: SocketAddr, msg: &'static str) -> Unary {
    let mut client = client.clone();
    let body = Full::new(Bytes::from_static(msg.as_bytes())).boxed();
    let res = client
        .send_request(grpc_request(addr, body))
        .await
        .expect("response");
    let status = res.status();
    let backend = backend_of(&res);
    let header_status = res
        .headers()
        .get("grpc-status")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let collected = res.into_body().collect().await.expect("body");
    let grpc_status = collected
        .trailers()
        .and_then(|t| t.get("grpc-status"))
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
        .or(header_status);
    Unary {
        status,
        backend,
        grpc_status,
        body: collected.to_bytes(),
    }
}

/// Runs `n` one-message streams over one connection, 100 at a time; returns how many
/// landed on each backend according to the backends' own answers.
async fn spread(lb: &LbHandle, n: usize) -> Vec<u64> {
    let client = h2_client(lb.addr).await;
    let mut seen = vec![0u64; lb.backend_count()];
    let mut left = n;
    while left > 0 {
        let batch = left.min(100);
        left -= batch;
        let mut set = tokio::task::JoinSet::new();
        for _ in 0..batch {
            let client = client.clone();
            let addr = lb.addr;
            set.spawn(async move { unary(&client, addr, "ping").await });
        }
        while let Some(r) = set.join_next().await {
            let r = r.expect("task");
            assert_eq!(r.status, StatusCode::OK);
            assert_eq!(r.grpc_status.as_deref(), Some("0"));
            assert_eq!(r.body, Bytes::from_static(b"ping"));
            seen[r.backend.expect("x-backend")] += 1;
        }
    }
    seen
}

#[tokio::test]
async fn bidi_stream_flows_both_ways_and_trailers_pass() {
    let backends = backends(2).await;
    let lb = lb_over(&backends, Policy::Uniform).await;
    lb.set_next(vec![1]);
    let mut client = h2_client(lb.addr).await;

    let (mut tx, body) = Channel::<Bytes, Infallible>::new(1);
    let res = client
        .send_request(grpc_request(lb.addr, body.boxed()))
        .await
        .expect("response head before any request body");
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(backend_of(&res), Some(1));
    assert_eq!(lb.open_streams(), vec![0, 1]);

    let mut rx = res.into_body();
    for i in 0..50 {
        // Each echo must come back before the next message is sent: no buffering.
        let msg = Bytes::from(format!("message {i}"));
        tx.send_data(msg.clone()).await.expect("send");
        let mut got = Vec::new();
        while got.len() < msg.len() {
            let frame = rx.frame().await.expect("frame").expect("ok frame");
            got.extend_from_slice(&frame.into_data().expect("data frame"));
        }
        assert_eq!(got, msg);
    }
    drop(tx);
    let last = rx.frame().await.expect("trailers frame").expect("ok frame");
    let trailers = last.into_trailers().expect("trailers");
    assert_eq!(trailers["grpc-status"], "0");
    assert_eq!(trailers["x-backend"], "1");
    assert!(rx.frame().await.is_none());
    drop(rx);
    eventually("stream closed on backend 1", DEADLINE, || async {
        lb.open_streams() == vec![0, 0]
    })
    .await;
    assert_eq!(lb.placements(), vec![0, 1]);
}

#[tokio::test]
async fn weighted_placement_follows_weights_over_1000_streams() {
    let backends = backends(3).await;
    let lb = lb_over(&backends, Policy::Weighted(vec![90, 5, 5])).await;
    let seen = spread(&lb, 1000).await;
    assert_eq!(lb.placements(), seen);
    assert!((850..=950).contains(&seen[0]), "{seen:?}");
    assert!((20..=90).contains(&seen[1]), "{seen:?}");
    assert!((20..=90).contains(&seen[2]), "{seen:?}");
}

#[tokio::test]
async fn uniform_and_round_robin_use_every_backend() {
    let backends = backends(3).await;
    let lb = lb_over(&backends, Policy::Uniform).await;
    let seen = spread(&lb, 300).await;
    assert!(seen.iter().all(|&n| (60..=140).contains(&n)), "{seen:?}");

    lb.set_policy(Policy::RoundRobin);
    let seen = spread(&lb, 300).await;
    assert_eq!(seen, vec![100, 100, 100]);
}

#[tokio::test]
async fn unfillable_backend_never_gets_a_stream() {
    let backends = backends(3).await;
    let lb = lb_over(&backends, Policy::Unfillable(1)).await;
    let seen = spread(&lb, 300).await;
    assert_eq!(seen[1], 0, "{seen:?}");
    assert!(seen[0] > 0 && seen[2] > 0, "{seen:?}");

    // Changed mid-run: backend 0 gets nothing more, backend 1 fills again.
    lb.set_policy(Policy::Unfillable(0));
    let seen = spread(&lb, 300).await;
    assert_eq!(seen[0], 0, "{seen:?}");
    assert!(seen[1] > 0 && seen[2] > 0, "{seen:?}");
}

#[tokio::test]
async fn scripted_placement_is_exact() {
    let backends = backends(3).await;
    let lb = lb_over(&backends, Policy::Uniform).await;
    let client = h2_client(lb.addr).await;

    lb.set_next(vec![2, 0, 1, 1, 2]);
    let mut got = Vec::new();
    for _ in 0..5 {
        got.push(unary(&client, lb.addr, "x").await.backend);
    }
    assert_eq!(got, [2, 0, 1, 1, 2].map(Some));

    // Stream numbers count every stream the LB received: 5, 6, 7, 8 next.
    lb.set_policy(Policy::scripted(|n| if n % 2 == 0 { 0 } else { 2 }));
    let mut got = Vec::new();
    for _ in 0..4 {
        got.push(unary(&client, lb.addr, "x").await.backend);
    }
    assert_eq!(got, [2, 0, 2, 0].map(Some));
    // Queued placements win over the policy.
    lb.set_next(vec![1]);
    assert_eq!(unary(&client, lb.addr, "x").await.backend, Some(1));
    assert_eq!(lb.placements(), vec![3, 3, 4]);
}

#[tokio::test]
async fn down_backend_is_skipped_and_explicit_placement_on_it_is_unavailable() {
    let backends = backends(3).await;
    let lb = lb_over(&backends, Policy::Uniform).await;
    lb.set_backend_down(1, true);
    let seen = spread(&lb, 200).await;
    assert_eq!(seen[1], 0, "{seen:?}");

    let client = h2_client(lb.addr).await;
    lb.set_next(vec![1]);
    let r = unary(&client, lb.addr, "x").await;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(r.grpc_status.as_deref(), Some("14"));
    assert_eq!(lb.rejected(), 1);

    lb.set_backend_down(1, false);
    lb.set_next(vec![1]);
    assert_eq!(unary(&client, lb.addr, "x").await.backend, Some(1));
}

#[tokio::test]
async fn refusing_backend_gives_unavailable_and_others_still_work() {
    let closed = {
        let l = TcpListener::bind(("127.0.0.1", 0)).await.expect("bind");
        l.local_addr().expect("addr")
    };
    let live = echo_backend(1).await;
    let lb = LoadBalancer::builder()
        .backend(closed)
        .backend(live.addr)
        .policy(Policy::scripted(|n| (n % 2) as usize))
        .spawn()
        .await
        .expect("spawn lb");
    let client = h2_client(lb.addr).await;

    let r = unary(&client, lb.addr, "x").await;
    assert_eq!(r.status, StatusCode::BAD_GATEWAY);
    assert_eq!(r.grpc_status.as_deref(), Some("14"));
    let r = unary(&client, lb.addr, "x").await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.backend, Some(1));

    // The backend comes back at a new address.
    let revived = echo_backend(0).await;
    lb.set_backend_addr(0, revived.addr);
    assert_eq!(unary(&client, lb.addr, "x").await.backend, Some(0));
}

#[tokio::test]
async fn reset_backend_fails_its_open_streams_only() {
    let backends = backends(2).await;
    let lb = lb_over(&backends, Policy::Uniform).await;
    let mut client = h2_client(lb.addr).await;

    let mut open = Vec::new();
    for idx in [0, 1] {
        lb.set_next(vec![idx]);
        let (tx, body) = Channel::<Bytes, Infallible>::new(1);
        let res = client
            .send_request(grpc_request(lb.addr, body.boxed()))
            .await
            .expect("response");
        assert_eq!(backend_of(&res), Some(idx));
        open.push((tx, res.into_body()));
    }
    lb.reset_backend(0);

    let (_tx0, mut rx0) = open.remove(0);
    assert!(
        !matches!(rx0.frame().await, Some(Ok(f)) if f.is_trailers()),
        "a reset stream must not end cleanly"
    );
    let (mut tx1, mut rx1) = open.remove(0);
    tx1.send_data(Bytes::from_static(b"still here"))
        .await
        .expect("send");
    let frame = rx1.frame().await.expect("frame").expect("ok");
    assert_eq!(frame.into_data().expect("data"), "still here");

    lb.set_next(vec![0]);
    let r = unary(&client, lb.addr, "again").await;
    assert_eq!((r.status, r.backend), (StatusCode::OK, Some(0)));
}

#[tokio::test]
async fn dropping_the_handle_stops_the_proxy() {
    let backends = backends(1).await;
    let lb = lb_over(&backends, Policy::Uniform).await;
    let addr = lb.addr;
    let client = h2_client(addr).await;
    assert_eq!(unary(&client, addr, "x").await.status, StatusCode::OK);
    drop(lb);
    eventually("listener closed", DEADLINE, || async {
        TcpStream::connect(addr).await.is_err()
    })
    .await;
    eventually("connection closed", DEADLINE, || async {
        client.is_closed()
    })
    .await;
}

// ---- upstream ----

fn h1_client() -> Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>> {
    Client::builder(TokioExecutor::new()).build_http()
}

async fn get(up: &UpstreamHandle, path: &str) -> (StatusCode, Bytes) {
    let res = h1_client()
        .get(format!("{}{path}", up.url()).parse().expect("uri"))
        .await
        .expect("response");
    let status = res.status();
    (
        status,
        res.into_body().collect().await.expect("body").to_bytes(),
    )
}

#[tokio::test]
async fn upstream_bytes_returns_exactly_n_bytes_in_pattern() {
    let up = Upstream::builder().spawn().await.expect("spawn");
    let client = h1_client();
    for n in [0u64, 1, 250, 251, 65_536, 65_537, 1_000_003] {
        let res = client
            .get(format!("{}/bytes/{n}", up.url()).parse().expect("uri"))
            .await
            .expect("response");
        assert_eq!(res.status(), StatusCode::OK);
        assert_eq!(res.headers()["content-length"], n.to_string().as_str());
        let mut body = res.into_body();
        let mut i = 0u64;
        while let Some(frame) = body.frame().await {
            let data = frame.expect("frame").into_data().expect("data");
            for &b in data.iter() {
                assert_eq!(b, pattern_byte(i), "byte {i} of {n}");
                i += 1;
            }
        }
        assert_eq!(i, n);
    }
    let expected = 7;
    eventually("all served", DEADLINE, || async { up.served() == expected }).await;
    assert_eq!((up.in_flight(), up.cancelled()), (0, 0));
}

#[tokio::test]
async fn upstream_echo_returns_a_1mib_body_with_request_details() {
    let up = Upstream::builder().spawn().await.expect("spawn");
    let payload: Bytes = (0..1024 * 1024u32).map(|i| (i % 253) as u8).collect();
    let req = Request::builder()
        .method(Method::PUT)
        .uri(format!("{}/echo?x=1&y=two", up.url()))
        .header("x-test", "abc")
        .header("content-type", "application/octet-stream")
        .body(Full::new(payload.clone()))
        .expect("request");
    let res = h1_client().request(req).await.expect("response");
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(res.headers()["x-echo-method"], "PUT");
    assert_eq!(res.headers()["x-echo-path"], "/echo?x=1&y=two");
    let headers: serde_json::Value =
        serde_json::from_slice(res.headers()["x-echo-headers"].as_bytes()).expect("json");
    assert_eq!(headers["x-test"], "abc");
    assert_eq!(headers["content-length"], "1048576");
    let body = res.into_body().collect().await.expect("body").to_bytes();
    assert_eq!(body.len(), payload.len());
    assert!(body == payload, "echoed body differs");
}

#[tokio::test]
async fn upstream_echo_streams_over_h2c_without_buffering() {
    let up = Upstream::builder().spawn().await.expect("spawn");
    let mut client = h2_client(up.addr).await;
    let (mut tx, body) = Channel::<Bytes, Infallible>::new(1);
    let req = Request::post(format!("{}/echo", up.url()))
        .body(body.boxed())
        .expect("request");
    let res = client.send_request(req).await.expect("response");
    assert_eq!(res.status(), StatusCode::OK);
    let mut rx = res.into_body();
    for i in 0..10 {
        let msg = Bytes::from(format!("chunk {i}"));
        tx.send_data(msg.clone()).await.expect("send");
        let mut got = Vec::new();
        while got.len() < msg.len() {
            let frame = rx.frame().await.expect("frame").expect("ok");
            got.extend_from_slice(&frame.into_data().expect("data"));
        }
        assert_eq!(got, msg);
    }
    drop(tx);
    while rx.frame().await.is_some() {}
    eventually("served", DEADLINE, || async { up.served() == 1 }).await;
}

#[tokio::test]
async fn upstream_routes_answer_as_documented() {
    let up = Upstream::builder().spawn().await.expect("spawn");
    assert_eq!(
        get(&up, "/hello").await,
        (StatusCode::OK, Bytes::from_static(b"hello from upstream\n"))
    );
    assert_eq!(get(&up, "/status/418").await.0, StatusCode::IM_A_TEAPOT);
    assert_eq!(get(&up, "/status/99").await.0, StatusCode::BAD_REQUEST);
    assert_eq!(get(&up, "/slow/20").await.0, StatusCode::OK);
    assert_eq!(
        get(&up, "/delay-body/20").await,
        (StatusCode::OK, Bytes::from_static(b"delayed body\n"))
    );
    assert_eq!(get(&up, "/bytes/lots").await.0, StatusCode::BAD_REQUEST);
    assert_eq!(get(&up, "/nope").await.0, StatusCode::NOT_FOUND);
    let res = h1_client()
        .request(
            Request::post(format!("{}/hello", up.url()))
                .body(Full::new(Bytes::new()))
                .expect("request"),
        )
        .await
        .expect("response");
    assert_eq!(res.status(), StatusCode::METHOD_NOT_ALLOWED);
    eventually("all served", DEADLINE, || async { up.served() == 8 }).await;
    assert_eq!(up.in_flight(), 0);
}

#[tokio::test]
async fn upstream_latency_delays_every_head() {
    let up = Upstream::builder()
        .latency(Duration::from_millis(150))
        .spawn()
        .await
        .expect("spawn");
    let start = Instant::now();
    assert_eq!(get(&up, "/hello").await.0, StatusCode::OK);
    assert!(start.elapsed() >= Duration::from_millis(150));
}

#[tokio::test]
async fn upstream_counts_a_client_that_leaves_mid_response() {
    let up = Upstream::builder().spawn().await.expect("spawn");
    let res = h1_client()
        .get(
            format!("{}/delay-body/60000", up.url())
                .parse()
                .expect("uri"),
        )
        .await
        .expect("head arrives before the body");
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(up.in_flight(), 1);
    drop(res);
    eventually("cancel counted", DEADLINE, || async {
        up.cancelled() == 1 && up.in_flight() == 0
    })
    .await;
    assert_eq!(up.served(), 0);
}

#[tokio::test]
async fn upstream_stops_when_the_handle_drops() {
    let up = Upstream::builder().spawn().await.expect("spawn");
    let addr = up.addr;
    drop(up);
    eventually("listener closed", DEADLINE, || async {
        TcpStream::connect(addr).await.is_err()
    })
    .await;
}

#[tokio::test]
async fn lb_shutdown_ends_open_streams_and_returns() {
    let backends = backends(1).await;
    let lb = lb_over(&backends, Policy::Uniform).await;
    let mut client = h2_client(lb.addr).await;
    let (_tx, body) = Channel::<Bytes, Infallible>::new(1);
    let res = client
        .send_request(grpc_request(lb.addr, body.boxed()))
        .await
        .expect("response");
    let mut rx = res.into_body();
    tokio::time::timeout(DEADLINE, lb.shutdown())
        .await
        .expect("shutdown returns");
    assert!(
        !matches!(rx.frame().await, Some(Ok(f)) if f.is_trailers()),
        "an open stream must not end cleanly on shutdown"
    );
}

#[tokio::test]
async fn upstream_serve_runs_until_shutdown() {
    let listener = TcpListener::bind(("127.0.0.1", 0)).await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(relay_tests::upstream::serve(
        listener,
        Default::default(),
        async move {
            let _ = stopped.await;
        },
    ));
    let res = h1_client()
        .get(format!("http://{addr}/hello").parse().expect("uri"))
        .await
        .expect("response");
    assert_eq!(res.status(), StatusCode::OK);
    drop(res);
    let _ = stop.send(());
    tokio::time::timeout(DEADLINE, server)
        .await
        .expect("serve returns after shutdown")
        .expect("task");
    assert!(TcpStream::connect(addr).await.is_err());
}
