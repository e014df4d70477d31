//! End-to-end tests of the dispatcher library: a real `run` on 127.0.0.1:0, fake tunnel
//! servers (`relay_tests::fake_server`: a tonic `Forward` service scripted by a typed
//! behaviour, plus a `Registry.Report` client announcing them), and a hyper client acting
//! as the backend. No sleeps: conditions are polled with a deadline.
//!
//! Some fakes reset their connections with a real TCP RST at a chosen point of a call, so
//! the error classification is also checked against what h2 and tonic make of a real
//! reset (UNKNOWN "transport error" before the response headers, UNKNOWN "error reading a
//! body" after them).

use bytes::Bytes;
use http::{Method, StatusCode};
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::Frame;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use relay_proto::MAX_CHUNK;
use relay_tests::dispatcher::{
    announce, announce_with_load, bind, empty, home_of, start_dispatcher, start_dispatcher_with,
    BoxError, TestBody, KEY, WAIT,
};
use relay_tests::fake_server::{
    header, intro, load_frame, report_stream, report_stream_with_key, up, Behaviour, FakeServer,
};
use relay_tests::{eventually, holds_for};
use std::time::Duration;
use tokio::time::Instant;

// ---------------------------------------------------------------- tests

#[tokio::test]
async fn get_round_trips_with_query_and_headers_but_no_credentials_or_hop_by_hop() {
    let d = start_dispatcher().await;
    let fake = FakeServer::start(Behaviour::Echo).await;
    let _a = announce(&d, "ts-1", &fake.url, "demo").await;

    let req = d
        .request(
            Method::GET,
            "/relay/demo/api/v1/items?x=1&y=two%20words",
            Some(KEY),
        )
        .header("x-custom", "a")
        .header("x-custom", "b")
        .header("connection", "keep-alive, x-hop")
        .header("x-hop", "1")
        .header("proxy-authorization", "Basic Zm9v")
        .header("x-relay-timeout-ms", "2000")
        .body(empty())
        .unwrap();
    let answer = d.send(req).await;
    assert_eq!(answer.status, StatusCode::OK);
    assert_eq!(answer.headers["x-seen-method"], "GET");
    assert_eq!(
        answer.headers["x-seen-path"],
        "/api/v1/items?x=1&y=two%20words"
    );
    let cookies: Vec<_> = answer.headers.get_all("set-cookie").iter().collect();
    assert_eq!(cookies, ["a=1", "b=2"]);
    assert!(answer.headers.get("keep-alive").is_none());
    assert!(
        answer.headers.get("x-internal").is_none(),
        "named in the response's Connection header"
    );
    assert_eq!(answer.body.unwrap(), Bytes::new());

    let seen = fake.seen();
    assert_eq!(seen.len(), 1);
    let head = &seen[0].head;
    assert_eq!(seen[0].tunnel_id, "demo");
    assert_eq!(head.method, "GET");
    assert_eq!(head.path_and_query, "/api/v1/items?x=1&y=two%20words");
    assert!(head.end_of_stream);
    assert!(
        head.deadline_ms > 0 && head.deadline_ms <= 2000,
        "deadline_ms {}",
        head.deadline_ms
    );
    assert_eq!(header(head, "x-custom"), [b"a".as_slice(), b"b".as_slice()]);
    for gone in [
        "authorization",
        "connection",
        "x-hop",
        "proxy-authorization",
        "x-relay-timeout-ms",
    ] {
        assert!(
            header(head, gone).is_empty(),
            "{gone} must not be forwarded"
        );
    }
    assert!(head
        .headers
        .iter()
        .all(|r| !String::from_utf8_lossy(r).contains(KEY)));

    assert_eq!(
        d.metric("relay_dispatcher_calls_total{outcome=\"ok\"}")
            .await,
        1.0
    );
    assert_eq!(
        d.metric("relay_dispatcher_routing_decisions_total{server_id=\"ts-1\"}")
            .await,
        1.0
    );
    assert!(!d.admin_get("/metrics").await.contains(KEY));
    d.shutdown().await;
}

#[tokio::test]
async fn post_body_streams_through_in_bounded_chunks() {
    let d = start_dispatcher().await;
    let fake = FakeServer::start(Behaviour::Echo).await;
    let _a = announce(&d, "ts-1", &fake.url, "demo").await;

    // A streamed request body of several frames, one bigger than MAX_CHUNK.
    let parts: Vec<Bytes> = vec![
        Bytes::from(vec![1u8; 1000]),
        Bytes::from(
            (0..(MAX_CHUNK * 3 + 17))
                .map(|i| (i % 251) as u8)
                .collect::<Vec<u8>>(),
        ),
        Bytes::from_static(b"tail"),
    ];
    let expected: Vec<u8> = parts.iter().flat_map(|b| b.to_vec()).collect();
    let stream =
        futures::stream::iter(parts.into_iter().map(|b| Ok::<_, BoxError>(Frame::data(b))));
    let req = d
        .request(Method::POST, "/relay/demo/upload", Some(KEY))
        .body(BodyExt::boxed(StreamBody::new(stream)))
        .unwrap();
    let answer = d.send(req).await;
    assert_eq!(answer.status, StatusCode::OK);
    assert_eq!(answer.body.unwrap().as_ref(), expected.as_slice());

    let seen = &fake.seen()[0];
    assert_eq!(seen.head.method, "POST");
    assert!(!seen.head.end_of_stream);
    assert_eq!(seen.body_len, expected.len());
    assert!(seen.ended);
    assert!(
        seen.chunk_sizes.iter().all(|n| *n <= MAX_CHUNK),
        "{:?}",
        seen.chunk_sizes
    );
    d.shutdown().await;
}

/// On a carrier whose server reads a body inside the call head (it said so in the
/// carrier's metadata), a small whole POST body rides inside the head: one frame. The
/// carrier's first call went out before that metadata came back and sends its body as a
/// frame; a body too big for the head goes as frames too.
#[tokio::test]
async fn small_bodies_ride_inside_the_call_head_where_the_server_reads_them() {
    let d = start_dispatcher().await;
    let fake = FakeServer::start_carrying_echo().await;
    let _a = announce(&d, "ts-1", &fake.url, "demo").await;

    let small: [&'static [u8]; 3] = [b"first small body", b"second", b"third one"];
    for body in small {
        let answer = d.post("/relay/demo/upload", body).await;
        assert_eq!(answer.status, StatusCode::OK);
        assert_eq!(answer.body.unwrap().as_ref(), body);
    }
    let big: &'static [u8] = &[9u8; MAX_CHUNK];
    let answer = d.post("/relay/demo/upload", big).await;
    assert_eq!(answer.status, StatusCode::OK);
    assert_eq!(answer.body.unwrap().as_ref(), big);

    assert_eq!(fake.carriers(), 1, "one carrier, reused");
    let seen = fake.seen();
    assert_eq!(seen.len(), 4);
    let first = &seen[0];
    assert!(
        first.head.body.is_empty() && !first.head.end_of_stream,
        "{first:?}"
    );
    assert_eq!(first.chunk_sizes, [small[0].len()]);
    for (s, body) in seen[1..3].iter().zip(&small[1..]) {
        assert!(s.head.end_of_stream, "{s:?}");
        assert_eq!(&s.head.body[..], *body);
        assert!(s.chunk_sizes.is_empty(), "{s:?}");
    }
    let last = &seen[3];
    assert!(
        last.head.body.is_empty() && !last.head.end_of_stream,
        "{last:?}"
    );
    assert_eq!(last.body_len, big.len());
    d.shutdown().await;
}

/// A tunnel server that does not know carriers (it answers `Forward.Carry` with
/// UNIMPLEMENTED, as servers before them do) gets every call as a `Forward.Call` of its
/// own: the first call, whose POST body went out on the refused carrier, is replayed whole
/// on its `Forward.Call`, and no later call tries a carrier again.
#[tokio::test]
async fn a_server_without_carriers_gets_one_forward_call_per_call() {
    let d = start_dispatcher().await;
    let fake = FakeServer::start(Behaviour::Echo).await;
    let _a = announce(&d, "ts-1", &fake.url, "demo").await;

    let body: &'static [u8] = &[7u8; 3 * MAX_CHUNK + 5];
    let answer = d.post("/relay/demo/upload", body).await;
    assert_eq!(answer.status, StatusCode::OK);
    assert_eq!(answer.body.unwrap().as_ref(), body);
    for i in 0..5 {
        let answer = d.get(&format!("/relay/demo/{i}")).await;
        assert_eq!(answer.status, StatusCode::OK);
        assert_eq!(answer.headers["x-seen-path"], format!("/{i}"));
    }
    assert_eq!(fake.carry_refused(), 1, "one refused carrier, then calls");
    let seen = fake.seen();
    assert_eq!(seen.len(), 6, "each call reached the server once");
    assert_eq!(seen[0].body_len, body.len());
    assert!(seen[0].ended);
    assert_eq!(
        d.metric("relay_dispatcher_forward_carriers_opened_total")
            .await,
        0.0
    );
    assert_eq!(d.metric("relay_dispatcher_retries_total").await, 0.0);
    d.shutdown().await;
}

/// A call sent on an idle carrier that its server ends between calls (the server stops
/// serving as the call's head arrives) was never taken: the dispatcher treats it as a
/// server it could not reach (retryable, here with no other server to try: 502
/// `tunnel_server_unreachable`), never as `stream_lost`, which would tell the caller the
/// call may have run. The next call opens a new carrier.
#[tokio::test]
async fn a_call_on_a_carrier_its_server_ended_is_not_lost_but_unreached() {
    let d = start_dispatcher().await;
    let fake = FakeServer::start_carrying_one_call().await;
    let _a = announce(&d, "ts-1", &fake.url, "demo").await;

    let first = d.get("/relay/demo/first").await;
    assert_eq!(first.status, StatusCode::OK);
    assert_eq!(first.body.unwrap().as_ref(), b"/first");
    let second = d.get("/relay/demo/second").await;
    assert_eq!(second.status, StatusCode::BAD_GATEWAY);
    let reason = second.json();
    assert_eq!(reason["error"], "tunnel_server_unreachable", "{reason}");
    assert!(
        reason["message"]
            .as_str()
            .unwrap()
            .contains("before taking the call"),
        "{reason}"
    );
    let third = d.get("/relay/demo/third").await;
    assert_eq!(third.status, StatusCode::OK);
    assert_eq!(third.body.unwrap().as_ref(), b"/third");
    assert_eq!(fake.carriers(), 2, "the ended carrier is not reused");
    assert_eq!(
        d.metric("relay_dispatcher_calls_total{outcome=\"stream_lost\"}")
            .await,
        0.0
    );
    d.shutdown().await;
}

#[tokio::test]
async fn a_64_mib_response_streams_to_the_caller() {
    let d = start_dispatcher().await;
    let fake = FakeServer::start(Behaviour::Echo).await;
    let _a = announce(&d, "ts-1", &fake.url, "demo").await;
    let total = 64 * 1024 * 1024;
    fake.set(Behaviour::Big(total));
    let req = d
        .request(Method::GET, "/relay/demo/big", Some(KEY))
        .body(empty())
        .unwrap();
    let resp = d.client.request(req).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let mut body = resp.into_body();
    let (mut received, mut largest) = (0usize, 0usize);
    while let Some(frame) = body.frame().await {
        if let Ok(data) = frame.unwrap().into_data() {
            received += data.len();
            largest = largest.max(data.len());
        }
    }
    assert_eq!(received, total);
    assert!(
        largest <= 1024 * 1024,
        "frames stay small, largest {largest}"
    );
    d.shutdown().await;
}

#[tokio::test]
async fn missing_or_wrong_caller_key_is_401_json() {
    let d = start_dispatcher().await;
    for key in [None, Some("wrong-key")] {
        let answer = d
            .send(
                d.request(Method::GET, "/relay/demo/x", key)
                    .body(empty())
                    .unwrap(),
            )
            .await;
        assert_eq!(answer.status, StatusCode::UNAUTHORIZED);
        assert_eq!(answer.headers["www-authenticate"], "Bearer");
        assert_eq!(answer.headers["content-type"], "application/json");
        let json = answer.json();
        assert_eq!(json["error"], "unauthorized");
        assert_eq!(json["tunnel_id"], "demo");
        assert!(json["message"].as_str().unwrap().contains("key"));
        assert!(!answer.body.unwrap().windows(9).any(|w| w == b"wrong-key"));
    }
    assert_eq!(
        d.metric("relay_dispatcher_calls_total{outcome=\"unauthorized\"}")
            .await,
        2.0
    );
    d.shutdown().await;
}

#[tokio::test]
async fn each_call_of_one_connection_gets_the_rights_of_its_own_key() {
    // The front remembers the key a connection's last accepted call presented; a call
    // with another key on the same connection must be checked as if it were the first.
    let d = start_dispatcher_with(|c| {
        let mut narrow = relay_dispatcher::CallerConfig::allow_all("narrow", "narrow-key");
        narrow.tunnels = vec!["other".into()];
        c.callers.push(narrow);
    })
    .await;
    let fake = FakeServer::start(Behaviour::Echo).await;
    let _a = announce(&d, "ts-1", &fake.url, "demo").await;
    let tcp = tokio::net::TcpStream::connect(d.http).await.unwrap();
    let (mut conn, driver) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tcp))
            .await
            .unwrap();
    tokio::spawn(driver);
    let prefix = &KEY[..KEY.len() - 1];
    let longer = format!("{KEY}x");
    let steps: [(Option<&str>, StatusCode); 9] = [
        (Some(KEY), StatusCode::OK),
        (Some("narrow-key"), StatusCode::FORBIDDEN),
        (Some(KEY), StatusCode::OK),
        (Some(KEY), StatusCode::OK),
        (Some(prefix), StatusCode::UNAUTHORIZED),
        (Some(&longer), StatusCode::UNAUTHORIZED),
        (None, StatusCode::UNAUTHORIZED),
        (Some("wrong-key"), StatusCode::UNAUTHORIZED),
        (Some(KEY), StatusCode::OK),
    ];
    for (i, (key, want)) in steps.into_iter().enumerate() {
        conn.ready().await.expect("the same connection stays open");
        let req = d
            .request(Method::GET, "/relay/demo/x", key)
            .body(empty())
            .unwrap();
        let resp = conn.send_request(req).await.unwrap();
        assert_eq!(resp.status(), want, "step {i}: key {key:?}");
        resp.into_body().collect().await.unwrap();
    }
    d.shutdown().await;
}

#[tokio::test]
async fn bad_paths_and_tunnel_ids_are_rejected() {
    let d = start_dispatcher().await;
    let a = d
        .send(
            d.request(Method::GET, "/other/demo", Some(KEY))
                .body(empty())
                .unwrap(),
        )
        .await;
    assert_eq!(
        (a.status, a.json()["error"].clone()),
        (StatusCode::NOT_FOUND, "not_found".into())
    );
    let a = d
        .send(
            d.request(Method::GET, "/relay/bad$id/x", Some(KEY))
                .body(empty())
                .unwrap(),
        )
        .await;
    assert_eq!(
        (a.status, a.json()["error"].clone()),
        (StatusCode::BAD_REQUEST, "bad_request".into())
    );
    assert_eq!(a.json()["tunnel_id"], serde_json::Value::Null);
    let a = d
        .send(
            d.request(Method::GET, "/relay/demo/x", Some(KEY))
                .header("x-relay-timeout-ms", "soon")
                .body(empty())
                .unwrap(),
        )
        .await;
    assert_eq!(a.status, StatusCode::BAD_REQUEST);
    let a = d
        .send(
            d.request(Method::GET, "/relay/demo/x", Some(KEY))
                .header("x-big", "v".repeat(70 * 1024))
                .body(empty())
                .unwrap(),
        )
        .await;
    assert_eq!(a.status, StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE);
    d.shutdown().await;
}

#[tokio::test]
async fn unknown_tunnel_id_is_503_tunnel_unavailable_with_retry_after() {
    let d = start_dispatcher().await;
    let answer = d.get("/relay/nobody-home/x").await;
    assert_eq!(answer.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(answer.headers["retry-after"], "1");
    let json = answer.json();
    assert_eq!(json["error"], "tunnel_unavailable");
    assert_eq!(json["tunnel_id"], "nobody-home");
    d.shutdown().await;
}

#[tokio::test]
async fn tunnel_server_and_agent_errors_map_to_http_statuses() {
    let d = start_dispatcher().await;
    let fake = FakeServer::start(Behaviour::Echo).await;
    let _a = announce(&d, "ts-1", &fake.url, "demo").await;
    let cases = [
        (Behaviour::NoCapacity, 503, "no_capacity"),
        (Behaviour::Refused, 403, "refused"),
        (Behaviour::UpstreamUnreachable, 502, "upstream_unreachable"),
        (Behaviour::UpstreamTimeout, 504, "upstream_timeout"),
        (Behaviour::StreamLost, 502, "stream_lost"),
        (Behaviour::UnknownTunnel, 503, "tunnel_unavailable"),
    ];
    for (behaviour, status, code) in cases {
        fake.set(behaviour);
        let answer = d.get("/relay/demo/x").await;
        assert_eq!(answer.status.as_u16(), status, "{behaviour:?}");
        let json = answer.json();
        assert_eq!(json["error"], code, "{behaviour:?}");
        assert_eq!(json["tunnel_id"], "demo");
        if status == 503 {
            assert_eq!(answer.headers["retry-after"], "1", "{behaviour:?}");
        }
    }
    fake.set(Behaviour::Refused);
    let refused = d.get("/relay/demo/x").await;
    assert!(refused.json()["message"]
        .as_str()
        .unwrap()
        .contains("filter says no"));
    d.shutdown().await;
}

#[tokio::test]
async fn no_head_before_the_deadline_is_504_and_the_forward_call_is_dropped() {
    let d = start_dispatcher().await;
    let fake = FakeServer::start(Behaviour::Echo).await;
    let _a = announce(&d, "ts-1", &fake.url, "demo").await;
    fake.set(Behaviour::Hang);
    let req = d
        .request(Method::GET, "/relay/demo/slow", Some(KEY))
        .header("x-relay-timeout-ms", "300")
        .body(empty())
        .unwrap();
    let answer = d.send(req).await;
    assert_eq!(answer.status, StatusCode::GATEWAY_TIMEOUT);
    assert_eq!(answer.json()["error"], "deadline_exceeded");
    eventually("the fake sees the forward call dropped", WAIT, || async {
        fake.cancelled() == 1
    })
    .await;
    d.shutdown().await;
}

/// A call answered whole (its length known: `Content-Length`, or a body inside the head)
/// has its `Forward.Call` read to the end, not cancelled: hyper drops a response body once
/// the announced bytes are written, and a cancel there was an RST_STREAM per such call
/// whose trailers came a packet behind, each one kept in the h2 client's memory of reset
/// streams (megabytes of a dispatcher's memory at rest after a soak).
#[tokio::test]
async fn a_call_answered_whole_has_its_rpc_read_to_the_end_not_cancelled() {
    let d = start_dispatcher().await;
    let fake = FakeServer::start(Behaviour::Echo).await;
    let _a = announce(&d, "ts-1", &fake.url, "demo").await;
    let calls = 20;
    for (behaviour, len) in [
        (Behaviour::WholeHeadThenHeldEnd, 100),
        (Behaviour::WholeBodyThenHeldEnd, 1000),
    ] {
        fake.set(behaviour);
        for i in 0..calls {
            let answer = d.get(&format!("/relay/demo/whole/{i}")).await;
            assert_eq!(answer.status, StatusCode::OK, "{behaviour:?}");
            assert_eq!(
                answer.body.as_ref().map(|b| b.len()),
                Ok(len),
                "{behaviour:?}"
            );
        }
    }
    holds_for(
        "no RPC of a call answered whole is cancelled",
        Duration::from_millis(500),
        || async { fake.cancelled() == 0 },
    )
    .await;
    fake.release();
    eventually(
        "every held RPC ends with the dispatcher still reading it",
        WAIT,
        || async { fake.ended() == 2 * calls },
    )
    .await;
    assert_eq!(fake.cancelled(), 0);
    d.shutdown().await;
}

#[tokio::test]
async fn caller_disconnect_drops_the_forward_call() {
    let d = start_dispatcher().await;
    let fake = FakeServer::start(Behaviour::Hang).await;
    let _a = announce(&d, "ts-1", &fake.url, "demo").await;
    let req = d
        .request(Method::GET, "/relay/demo/slow", Some(KEY))
        .body(empty())
        .unwrap();
    let pending = tokio::spawn(d.client.request(req));
    eventually("the call reaches the fake", WAIT, || async {
        !fake.seen().is_empty()
    })
    .await;
    pending.abort();
    eventually("the fake sees the forward call dropped", WAIT, || async {
        fake.cancelled() == 1
    })
    .await;
    d.shutdown().await;
}

/// A caller whose upload breaks off (its chunked body ends without the last chunk) on a
/// server without carriers: the dispatcher resets that call's `Forward.Call` and never
/// half-closes it, since such a server takes the RPC's end as the body's end and would
/// hand the agent a cut body as a whole one.
#[tokio::test]
async fn a_caller_leaving_mid_upload_resets_the_forward_call_never_ends_it() {
    let d = start_dispatcher().await;
    let fake = FakeServer::start(Behaviour::Echo).await;
    let _a = announce(&d, "ts-1", &fake.url, "demo").await;

    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, BoxError>>(4);
    let req = d
        .request(Method::POST, "/relay/demo/upload", Some(KEY))
        .body(BodyExt::boxed(StreamBody::new(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
        .unwrap();
    let pending = tokio::spawn(d.client.request(req));
    tx.send(Ok(Frame::data(Bytes::from(vec![3u8; 1000]))))
        .await
        .unwrap();
    eventually(
        "the first part of the body reaches the fake",
        WAIT,
        || async { fake.seen().first().is_some_and(|s| s.body_len == 1000) },
    )
    .await;
    // The caller's body fails: hyper closes the connection without the last chunk.
    tx.send(Err("the caller went away".into())).await.unwrap();
    eventually("the fake sees the call's RPC reset", WAIT, || async {
        fake.bodies_reset() == 1
    })
    .await;
    assert_eq!(fake.bodies_cut(), 0, "the RPC was never ended as if whole");
    let seen = &fake.seen()[0];
    assert!(!seen.ended, "no body chunk with end reached the server");
    assert_eq!(seen.body_len, 1000);
    let _ = pending.await;
    assert_eq!(fake.seen().len(), 1, "the cut call was not retried");
    d.shutdown().await;
}

#[tokio::test]
async fn an_error_after_the_head_aborts_the_body() {
    let d = start_dispatcher().await;
    let fake = FakeServer::start(Behaviour::Echo).await;
    let _a = announce(&d, "ts-1", &fake.url, "demo").await;
    fake.set(Behaviour::HeadThenError);
    let req = d
        .request(Method::GET, "/relay/demo/x", Some(KEY))
        .body(empty())
        .unwrap();
    // The head and the first bytes may leave in one write, so the caller sees either a cut
    // response or a cut body: never a complete one.
    match d.client.request(req).await {
        Err(_) => {}
        Ok(resp) => {
            assert_eq!(resp.status(), StatusCode::OK);
            assert!(
                resp.into_body().collect().await.is_err(),
                "a truncated body must not look complete"
            );
        }
    }
    assert_eq!(
        d.metric("relay_dispatcher_calls_total{outcome=\"aborted\"}")
            .await,
        1.0
    );
    d.shutdown().await;
}

#[tokio::test]
async fn retries_on_another_server_when_the_newest_is_unreachable() {
    // Sticky: the most recently announced server is tried first.
    let d =
        start_dispatcher_with(|c| c.routing.policy = relay_dispatcher::RoutingPolicy::Sticky).await;
    let good = FakeServer::start(Behaviour::Echo).await;
    let _good = announce(&d, "ts-good", &good.url, "demo").await;
    let dead_url = {
        let l = bind().await;
        format!("http://{}", l.local_addr().unwrap())
    };
    // Announced last, so tried first.
    let _dead = announce(&d, "ts-dead", &dead_url, "demo").await;

    let answer = d.post("/relay/demo/x", b"payload").await;
    assert_eq!(answer.status, StatusCode::OK);
    assert_eq!(
        answer.body.unwrap(),
        Bytes::from_static(b"payload"),
        "the body is replayed on the retry"
    );
    assert_eq!(good.seen().len(), 1);
    assert_eq!(d.metric("relay_dispatcher_retries_total").await, 1.0);
    assert_eq!(
        d.metric("relay_dispatcher_routing_decisions_total{server_id=\"ts-dead\"}")
            .await,
        1.0
    );
    d.shutdown().await;
}

#[tokio::test]
async fn retries_on_another_server_when_the_newest_lost_the_tunnel() {
    // Sticky: the most recently announced server is tried first.
    let d =
        start_dispatcher_with(|c| c.routing.policy = relay_dispatcher::RoutingPolicy::Sticky).await;
    let good = FakeServer::start(Behaviour::Echo).await;
    let stale = FakeServer::start(Behaviour::UnknownTunnel).await;
    let _good = announce(&d, "ts-good", &good.url, "demo").await;
    let _stale = announce(&d, "ts-stale", &stale.url, "demo").await;
    let answer = d.get("/relay/demo/x").await;
    assert_eq!(answer.status, StatusCode::OK);
    assert_eq!((stale.seen().len(), good.seen().len()), (1, 1));
    d.shutdown().await;
}

#[tokio::test]
async fn a_report_stream_ending_removes_its_server() {
    let d = start_dispatcher().await;
    let fake = FakeServer::start(Behaviour::Echo).await;
    let a = announce(&d, "ts-1", &fake.url, "demo").await;
    assert_eq!(d.get("/relay/demo/x").await.status, StatusCode::OK);
    assert_eq!(d.metric("relay_dispatcher_tunnel_servers").await, 1.0);
    let ready: serde_json::Value = serde_json::from_str(&d.admin_get("/readyz").await).unwrap();
    assert_eq!(ready["detail"]["tunnels"], 1);

    drop(a.tx);
    assert!(a.result.await.unwrap().is_ok());
    d.wait_route("demo", "ts-1", false).await;
    let answer = d.get("/relay/demo/x").await;
    assert_eq!(answer.json()["error"], "tunnel_unavailable");
    assert_eq!(d.metric("relay_dispatcher_tunnel_servers").await, 0.0);
    assert_eq!(d.metric("relay_dispatcher_tunnels").await, 0.0);
    d.shutdown().await;
}

#[tokio::test]
async fn a_report_stream_without_an_intro_is_refused() {
    let d = start_dispatcher().await;
    let a = report_stream(d.registry, vec![up("demo")]).await;
    let status = a.result.await.unwrap().unwrap_err();
    assert_eq!(status.code(), tonic::Code::InvalidArgument);
    assert!(
        status.message().contains("ServerIntro"),
        "{}",
        status.message()
    );

    let fake = FakeServer::start(Behaviour::Echo).await;
    let a = report_stream(d.registry, vec![intro("ts-1", &fake.url), up("bad id!")]).await;
    let status = a.result.await.unwrap().unwrap_err();
    assert_eq!(status.code(), tonic::Code::InvalidArgument);
    assert_eq!(d.metric("relay_dispatcher_tunnel_servers").await, 0.0);
    d.shutdown().await;
}

#[tokio::test]
async fn shutdown_ends_report_streams_and_returns() {
    let d = start_dispatcher().await;
    let fake = FakeServer::start(Behaviour::Echo).await;
    let a = announce(&d, "ts-1", &fake.url, "demo").await;
    d.shutdown().await;
    let status = a.result.await.unwrap().unwrap_err();
    assert_eq!(status.code(), tonic::Code::Unavailable);
    drop(a.tx);
}

#[tokio::test]
async fn h2c_callers_are_served() {
    let d = start_dispatcher().await;
    let fake = FakeServer::start(Behaviour::Echo).await;
    let _a = announce(&d, "ts-1", &fake.url, "demo").await;
    let h2: Client<HttpConnector, TestBody> = Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build_http();
    let req = d
        .request(Method::POST, "/relay/demo/h2?q=1", Some(KEY))
        .body(
            Full::new(Bytes::from_static(b"over h2"))
                .map_err(|n| match n {})
                .boxed(),
        )
        .unwrap();
    let resp = h2.request(req).await.unwrap();
    assert_eq!(resp.version(), http::Version::HTTP_2);
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(resp.headers()["x-seen-path"], "/h2?q=1");
    assert_eq!(
        resp.into_body().collect().await.unwrap().to_bytes(),
        Bytes::from_static(b"over h2")
    );
    d.shutdown().await;
}

#[tokio::test]
async fn shutdown_lets_a_call_in_flight_finish() {
    let d = start_dispatcher().await;
    let fake = FakeServer::start(Behaviour::Hang).await;
    let _a = announce(&d, "ts-1", &fake.url, "demo").await;
    let req = d
        .request(Method::GET, "/relay/demo/slow", Some(KEY))
        .header("x-relay-timeout-ms", "500")
        .body(empty())
        .unwrap();
    let in_flight = tokio::spawn(d.client.request(req));
    eventually("the call reaches the fake", WAIT, || async {
        !fake.seen().is_empty()
    })
    .await;
    let http = d.http;
    d.shutdown().await;
    // The call got its answer (the deadline's 504) instead of a cut connection.
    let resp = in_flight
        .await
        .unwrap()
        .expect("the call in flight is answered");
    assert_eq!(resp.status(), StatusCode::GATEWAY_TIMEOUT);
    assert!(
        tokio::net::TcpStream::connect(http).await.is_err(),
        "no longer accepting"
    );
}

// ---------------------------------------------------------------- routing, retries, admission

#[tokio::test]
async fn reports_without_the_server_key_or_from_unlisted_servers_are_refused() {
    let d = start_dispatcher_with(|c| {
        c.registry.server_key = Some(relay_common::KeyDigest::of(b"server-key"));
        c.registry.allowed_servers = vec!["ts-1".into()];
    })
    .await;
    let fake = FakeServer::start(Behaviour::Echo).await;
    for key in [None, Some("wrong")] {
        let a = report_stream_with_key(d.registry, key, vec![intro("ts-1", &fake.url), up("demo")])
            .await;
        let status = a.result.await.unwrap().unwrap_err();
        assert_eq!(status.code(), tonic::Code::Unauthenticated, "{status:?}");
        assert!(!status.message().contains("server-key"));
    }
    let a = report_stream_with_key(
        d.registry,
        Some("server-key"),
        vec![intro("ts-9", &fake.url), up("demo")],
    )
    .await;
    let status = a.result.await.unwrap().unwrap_err();
    assert_eq!(status.code(), tonic::Code::PermissionDenied, "{status:?}");
    assert_eq!(
        d.metric("relay_dispatcher_reports_refused_total{reason=\"unauthenticated\"}")
            .await,
        2.0
    );
    assert_eq!(d.metric("relay_dispatcher_tunnel_servers").await, 0.0);

    let _ok = report_stream_with_key(
        d.registry,
        Some("server-key"),
        vec![intro("ts-1", &fake.url), up("demo")],
    )
    .await;
    d.wait_route("demo", "ts-1", true).await;
    assert_eq!(d.get("/relay/demo/x").await.status, StatusCode::OK);
    d.shutdown().await;
}

#[tokio::test]
async fn no_capacity_is_retried_on_a_server_reporting_idle_streams_under_available() {
    let d = start_dispatcher().await;
    let full = FakeServer::start(Behaviour::NoCapacity).await;
    let spare = FakeServer::start(Behaviour::Echo).await;
    let _full = announce_with_load(&d, "ts-full", &full.url, "demo", 5).await;
    let _spare = announce_with_load(&d, "ts-spare", &spare.url, "demo", 1).await;
    assert_eq!(home_of(&d, "demo").await, "ts-full", "most idle streams");
    let answer = d.get("/relay/demo/x").await;
    assert_eq!(answer.status, StatusCode::OK);
    assert_eq!((full.seen().len(), spare.seen().len()), (1, 1));
    assert_eq!(d.metric("relay_dispatcher_retries_total").await, 1.0);
    assert_eq!(
        d.metric("relay_dispatcher_calls_by_server_total{outcome=\"ok\",server_id=\"ts-spare\"}")
            .await,
        1.0
    );
    d.shutdown().await;

    // Sticky keeps the seed behaviour: NO_CAPACITY goes back to the caller.
    let d =
        start_dispatcher_with(|c| c.routing.policy = relay_dispatcher::RoutingPolicy::Sticky).await;
    let full = FakeServer::start(Behaviour::NoCapacity).await;
    let spare = FakeServer::start(Behaviour::Echo).await;
    let _spare = announce_with_load(&d, "ts-spare", &spare.url, "demo", 1).await;
    let _full = announce_with_load(&d, "ts-full", &full.url, "demo", 5).await;
    let answer = d.get("/relay/demo/x").await;
    assert_eq!(answer.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(answer.json()["error"], "no_capacity");
    assert_eq!(spare.seen().len(), 0);
    d.shutdown().await;
}

#[tokio::test]
async fn a_call_lost_before_its_head_is_retried_only_when_idempotent_and_enabled() {
    for retry_idempotent in [false, true] {
        let d = start_dispatcher_with(|c| c.routing.retry_idempotent = retry_idempotent).await;
        let lossy = FakeServer::start(Behaviour::StreamLost).await;
        let good = FakeServer::start(Behaviour::Echo).await;
        let _lossy = announce_with_load(&d, "ts-lossy", &lossy.url, "demo", 5).await;
        let _good = announce_with_load(&d, "ts-good", &good.url, "demo", 1).await;
        let get = d.get("/relay/demo/x").await;
        let post = d.post("/relay/demo/x", b"p").await;
        assert_eq!(
            post.status,
            StatusCode::BAD_GATEWAY,
            "POST is never retried"
        );
        assert_eq!(post.json()["error"], "stream_lost");
        if retry_idempotent {
            assert_eq!(get.status, StatusCode::OK);
            assert_eq!(good.seen().len(), 1);
        } else {
            assert_eq!(get.status, StatusCode::BAD_GATEWAY);
            assert_eq!(good.seen().len(), 0);
        }
        d.shutdown().await;
    }
}

#[tokio::test]
async fn a_call_lost_while_queued_is_retried_and_one_lost_after_proceed_is_not() {
    for (behaviour, retried) in [
        (Behaviour::QueuedThenLost, true),
        (Behaviour::ReservedThenLost, false),
    ] {
        let d = start_dispatcher().await;
        let lossy = FakeServer::start(behaviour).await;
        let good = FakeServer::start(Behaviour::Echo).await;
        let _lossy = announce_with_load(&d, "ts-lossy", &lossy.url, "demo", 5).await;
        let _good = announce_with_load(&d, "ts-good", &good.url, "demo", 1).await;
        assert_eq!(home_of(&d, "demo").await, "ts-lossy");
        let post = d.post("/relay/demo/x", b"payload").await;
        assert_eq!(lossy.seen().len(), 1, "{behaviour:?}");
        assert_eq!(d.metric("relay_dispatcher_queued_total").await, 1.0);
        if retried {
            // Queued, never reserved: no agent can have seen it, even a POST is retried.
            assert_eq!(post.status, StatusCode::OK, "{behaviour:?}");
            assert_eq!(post.body.unwrap(), Bytes::from_static(b"payload"));
            assert_eq!(good.seen().len(), 1);
            assert_eq!(d.metric("relay_dispatcher_retries_total").await, 1.0);
        } else {
            // Proceed was sent: the call may have reached the agent.
            assert!(
                lossy.seen()[0].ended,
                "the fake got Proceed for its reservation"
            );
            assert_eq!(post.status, StatusCode::BAD_GATEWAY, "{behaviour:?}");
            assert_eq!(post.json()["error"], "stream_lost");
            assert_eq!(good.seen().len(), 0);
        }
        d.shutdown().await;
    }
}

#[tokio::test]
async fn a_server_that_stops_reporting_is_dropped_after_its_lease() {
    let d = start_dispatcher_with(|c| {
        c.registry.lease = Duration::from_millis(400);
        c.registry.refresh_interval = Duration::from_millis(100);
    })
    .await;
    let fake = FakeServer::start(Behaviour::Echo).await;
    // Announces once, then stays silent with its stream open (a hung server).
    let a = announce_with_load(&d, "ts-hung", &fake.url, "demo", 2).await;
    let started = Instant::now();
    d.wait_route("demo", "ts-hung", false).await;
    let gone_after = started.elapsed();
    assert!(gone_after < Duration::from_secs(2), "{gone_after:?}");
    assert_eq!(d.metric("relay_dispatcher_lease_expiries_total").await, 1.0);
    let answer = d.get("/relay/demo/x").await;
    assert_eq!(answer.json()["error"], "tunnel_unavailable");
    // Its next frame finds the session gone: the stream ends and the server must rejoin.
    a.tx.send(load_frame("demo", 2, 0, 0)).await.unwrap();
    let status = a.result.await.unwrap().unwrap_err();
    assert_eq!(status.code(), tonic::Code::Aborted);
    d.shutdown().await;
}

#[tokio::test]
async fn a_real_connection_reset_is_retried_only_where_no_agent_can_have_the_call() {
    // Each case: the resetting server is the home (most idle streams), a good one has
    // room; a POST (never retried once it may have reached an agent) goes to the home,
    // whose connection is reset with a TCP RST at the given point of the call.
    for (behaviour, retried) in [
        // The call arrived, no response header left: a tunnel server hands a call to an
        // agent before its response header is on the wire, so the agent may have it.
        (Behaviour::ResetBeforeHeaders, false),
        // The call waits in the server's queue (the dispatcher heard `Queued`).
        (Behaviour::QueuedThenHang, true),
        // We sent Proceed: the call may have reached the agent.
        (Behaviour::ProceededThenReset, false),
    ] {
        let d = start_dispatcher().await;
        let lossy = FakeServer::start_resetting(behaviour).await;
        let good = FakeServer::start(Behaviour::Echo).await;
        let _lossy = announce_with_load(&d, "ts-lossy", &lossy.url, "demo", 5).await;
        let _good = announce_with_load(&d, "ts-good", &good.url, "demo", 1).await;
        assert_eq!(home_of(&d, "demo").await, "ts-lossy");
        let post = async {
            if behaviour == Behaviour::QueuedThenHang {
                let post = d.post("/relay/demo/x", b"payload");
                let reset = async {
                    eventually("the dispatcher hears Queued", WAIT, || async {
                        d.metric("relay_dispatcher_queued_total").await == 1.0
                    })
                    .await;
                    lossy.reset();
                };
                tokio::join!(post, reset).0
            } else {
                d.post("/relay/demo/x", b"payload").await
            }
        }
        .await;
        assert_eq!(
            lossy.seen().len(),
            1,
            "{behaviour:?}: the call reached the server"
        );
        if retried {
            assert_eq!(
                post.status,
                StatusCode::OK,
                "{behaviour:?}: {:?}",
                post.body
            );
            assert_eq!(post.body.unwrap(), Bytes::from_static(b"payload"));
            assert_eq!(good.seen().len(), 1, "{behaviour:?}");
            assert_eq!(d.metric("relay_dispatcher_retries_total").await, 1.0);
        } else {
            if behaviour == Behaviour::ProceededThenReset {
                assert!(lossy.seen()[0].ended, "the fake got Proceed");
            }
            assert_eq!(post.status, StatusCode::BAD_GATEWAY, "{behaviour:?}");
            assert_eq!(post.json()["error"], "stream_lost", "{behaviour:?}");
            assert_eq!(good.seen().len(), 0, "{behaviour:?}: not retried");
        }
        d.shutdown().await;
    }
}

#[tokio::test]
async fn a_real_connection_reset_after_the_response_head_cuts_the_body_short() {
    let d = start_dispatcher().await;
    let lossy = FakeServer::start_resetting(Behaviour::HeadThenHang).await;
    let good = FakeServer::start(Behaviour::Echo).await;
    let _lossy = announce_with_load(&d, "ts-lossy", &lossy.url, "demo", 5).await;
    let _good = announce_with_load(&d, "ts-good", &good.url, "demo", 1).await;
    let resp = d
        .client
        .request(
            d.request(Method::GET, "/relay/demo/x", Some(KEY))
                .body(empty())
                .unwrap(),
        )
        .await
        .expect("response head");
    // The head went to the caller: the call is not retried, and once the server's
    // connection is reset the body must not look complete.
    assert_eq!(resp.status(), StatusCode::OK);
    lossy.reset();
    let body = resp.into_body().collect().await;
    assert!(body.is_err(), "a truncated body looked complete");
    assert_eq!(good.seen().len(), 0);
    eventually("the call counted aborted", WAIT, || async {
        d.metric("relay_dispatcher_calls_total{outcome=\"aborted\"}")
            .await
            == 1.0
    })
    .await;
    d.shutdown().await;
}
