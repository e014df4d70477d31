//! The tunnel server over real gRPC on 127.0.0.1:0, driven by a scripted agent and a
//! scripted dispatcher written with the generated clients.

use relay_proto::*;
use relay_tunnel_server::{Config, TokenStore, TunnelServerHandle};
use std::time::Duration;
use tonic::{Code, Streaming};

mod common;

use common::{call, call_with, channel, open, outcome, Outcome};

async fn server(cfg: Config) -> TunnelServerHandle {
    common::server(cfg, TokenStore::single("good-token", "acme")).await
}

/// The call's answer as (status, body), or the ForwardError kind it ended with.
async fn collect(resp: Streaming<ForwardResponse>) -> Result<(u32, Vec<u8>), i32> {
    match outcome(resp).await {
        Outcome::Answer(status, body) => Ok((status, body)),
        Outcome::Error(kind) => Err(kind),
        Outcome::Broken(why) => panic!("call broken: {why}"),
    }
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
    common::until_idle(&s, "acme", 2).await;
    assert_eq!(a.hello.tunnel_id, "acme");
    assert_eq!(b.hello.server_id, "ts-1");
    let (_tx, resp) = call(&disp, "acme", 5000).await;
    let head = b.serve_one(b"from b").await;
    assert_eq!(head.path_and_query, "/x");
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
    let Some(server_frame::Kind::RequestHead(h1)) = a.next().await.ok().flatten() else {
        panic!()
    };
    // The only stream is busy: this one queues and runs when the first ends.
    let (_t2, second) = call(&disp, "acme", 5000).await;
    a.answer(h1.call_id, 204).await;
    assert_eq!(collect(first).await.unwrap().0, 204);
    a.serve_one(b"second").await;
    assert_eq!(collect(second).await.unwrap().1, b"second".to_vec());
    // Busy again, and this caller's deadline is short.
    let (_t3, third) = call(&disp, "acme", 5000).await;
    let Some(server_frame::Kind::RequestHead(_)) = a.next().await.ok().flatten() else {
        panic!()
    };
    let (_t4, fourth) = call(&disp, "acme", 200).await;
    let err = collect(fourth).await.unwrap_err();
    assert_eq!(err, ForwardErrorKind::NoCapacity as i32);
    drop(third);
}

/// The next message of a handshake call's response stream.
async fn next_kind(resp: &mut Streaming<ForwardResponse>) -> forward_response::Kind {
    tokio::time::timeout(Duration::from_secs(10), resp.message())
        .await
        .expect("an answer within 10 s")
        .expect("the call stays up")
        .and_then(|m| m.kind)
        .expect("a frame")
}

fn body(data: &[u8], end: bool) -> ForwardRequest {
    ForwardRequest::of(forward_request::Kind::Body(BodyChunk {
        call_id: 0,
        data: data.to_vec().into(),
        end,
    }))
}

#[tokio::test]
async fn a_queued_call_reaches_the_agent_only_after_proceed() {
    // Queued is said once the call has waited 5 ms.
    let s = server(Config {
        queue_handshake_after: Duration::from_millis(5),
        ..Config::default()
    })
    .await;
    let agent = channel(s.agent_addr).await;
    let disp = channel(s.forward_addr).await;
    let mut a = open(&agent, "good-token").await.unwrap();
    // An idle stream: the call goes straight to the agent, no queue notice.
    let (_t1, mut first) = call_with(&disp, "acme", 5000, true, true).await;
    let Some(server_frame::Kind::RequestHead(h1)) = a.next().await.ok().flatten() else {
        panic!("the first call reaches the agent at once")
    };
    // The only stream is busy: the second call queues and says so.
    let (t2, mut second) = call_with(&disp, "acme", 5000, true, false).await;
    assert!(matches!(
        next_kind(&mut second).await,
        forward_response::Kind::Queued(_)
    ));
    // A body chunk already in flight when the dispatcher heard Queued.
    t2.send(body(b"early ", false)).await.unwrap();
    a.answer(h1.call_id, 204).await;
    assert!(matches!(
        next_kind(&mut first).await,
        forward_response::Kind::Head(h) if h.status == 204
    ));
    // The stream is reserved for the second call, which still has not reached the agent.
    let forward_response::Kind::Reserved(r) = next_kind(&mut second).await else {
        panic!("a reservation")
    };
    assert!(
        tokio::time::timeout(Duration::from_millis(200), a.next())
            .await
            .is_err(),
        "the agent must see nothing before Proceed"
    );
    let mut client = forward_client::ForwardClient::new(disp.clone());
    let wrong = client
        .proceed(ProceedRequest {
            reservation: r.reservation.wrapping_add(1),
        })
        .await
        .unwrap_err();
    assert_eq!(wrong.code(), Code::NotFound, "an unknown reservation");
    client
        .proceed(ProceedRequest {
            reservation: r.reservation,
        })
        .await
        .unwrap();
    t2.send(body(b"late", true)).await.unwrap();
    let Some(server_frame::Kind::RequestHead(h2)) = a.next().await.ok().flatten() else {
        panic!("the head follows Proceed")
    };
    let mut got = Vec::new();
    loop {
        let Some(server_frame::Kind::RequestBody(chunk)) = a.next().await.ok().flatten() else {
            panic!("body chunks follow the head")
        };
        assert_eq!(chunk.call_id, h2.call_id);
        got.extend_from_slice(&chunk.data);
        if chunk.end {
            break;
        }
    }
    assert_eq!(
        got,
        b"early late".to_vec(),
        "the body arrives whole and in order"
    );
    a.send(agent_frame::Kind::ResponseHead(ResponseHead {
        call_id: h2.call_id,
        status: 200,
        body: prost::bytes::Bytes::from_static(b"done"),
        end_of_stream: true,
        ..Default::default()
    }))
    .await;
    assert_eq!(collect(second).await.unwrap(), (200, b"done".to_vec()));
}

#[tokio::test]
async fn a_short_wait_in_the_queue_skips_the_handshake() {
    let s = server(Config {
        queue_handshake_after: Duration::from_secs(30),
        ..Config::default()
    })
    .await;
    let agent = channel(s.agent_addr).await;
    let disp = channel(s.forward_addr).await;
    let mut a = open(&agent, "good-token").await.unwrap();
    let (_t1, first) = call_with(&disp, "acme", 5000, true, true).await;
    let Some(server_frame::Kind::RequestHead(h1)) = a.next().await.ok().flatten() else {
        panic!()
    };
    let (_t2, second) = call_with(&disp, "acme", 5000, true, true).await;
    a.answer(h1.call_id, 204).await;
    assert_eq!(collect(first).await.unwrap().0, 204);
    // Freed well before the threshold: straight to the agent, no Queued, no Proceed.
    a.serve_one(b"second").await;
    assert_eq!(collect(second).await.unwrap(), (200, b"second".to_vec()));
}

#[tokio::test]
async fn a_dispatcher_leaving_before_proceed_gives_the_stream_back_unused() {
    let s = server(Config::default()).await;
    let agent = channel(s.agent_addr).await;
    let disp = channel(s.forward_addr).await;
    let mut a = open(&agent, "good-token").await.unwrap();
    let (_t1, first) = call_with(&disp, "acme", 5000, true, true).await;
    let Some(server_frame::Kind::RequestHead(h1)) = a.next().await.ok().flatten() else {
        panic!()
    };
    let (t2, mut second) = call_with(&disp, "acme", 5000, true, true).await;
    assert!(matches!(
        next_kind(&mut second).await,
        forward_response::Kind::Queued(_)
    ));
    a.answer(h1.call_id, 204).await;
    assert_eq!(collect(first).await.unwrap().0, 204);
    assert!(matches!(
        next_kind(&mut second).await,
        forward_response::Kind::Reserved(_)
    ));
    // The dispatcher goes away (its server died, or it retried elsewhere).
    drop((t2, second));
    // The stream serves the next call; the abandoned one never reached the agent.
    let (_t3, third) = call_with(&disp, "acme", 5000, true, true).await;
    a.serve_one(b"third").await;
    assert_eq!(collect(third).await.unwrap(), (200, b"third".to_vec()));
    assert!(
        tokio::time::timeout(Duration::from_millis(200), a.next())
            .await
            .is_err(),
        "no other call reached the agent"
    );
}

#[tokio::test]
async fn a_stream_takes_no_call_before_the_agent_confirms_it() {
    let s = server(Config::default()).await;
    let agent = channel(s.agent_addr).await;
    let disp = channel(s.forward_addr).await;
    // The agent got the hello late and gave up on the stream: its first frame is GoingAway.
    let mut late = common::open_unconfirmed(&agent, "good-token")
        .await
        .unwrap();
    let (_tx, resp) = call(&disp, "acme", 300).await;
    late.send(agent_frame::Kind::GoingAway(GoingAway {})).await;
    assert_eq!(
        late.next().await.unwrap(),
        None,
        "the stream closes without ever carrying the call"
    );
    let err = collect(resp).await.unwrap_err();
    assert!(
        err == ForwardErrorKind::NoCapacity as i32 || err == ForwardErrorKind::UnknownTunnel as i32,
        "the call never reached an agent, so it is safe to retry: {err}"
    );
    // A stream the agent confirms takes calls.
    let mut ok = common::open_unconfirmed(&agent, "good-token")
        .await
        .unwrap();
    let (_tx, resp) = call(&disp, "acme", 5000).await;
    common::confirm(&ok.tx).await;
    ok.serve_one(b"confirmed").await;
    assert_eq!(collect(resp).await.unwrap().1, b"confirmed".to_vec());
}

#[tokio::test]
async fn unknown_tunnel_id_is_reported() {
    let s = server(Config::default()).await;
    let disp = channel(s.forward_addr).await;
    let (_t, resp) = call(&disp, "nobody", 1000).await;
    assert_eq!(
        collect(resp).await.unwrap_err(),
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
    // The refusal names the server and its cap, so the agent stops asking for more.
    let md = err.metadata();
    let text = |k: &str| md.get(k).and_then(|v| v.to_str().ok()).unwrap_or("");
    assert_eq!(text("relay-server-id"), "ts-1");
    assert_eq!(text("relay-instance-id"), s.hub().instance_id);
    assert_eq!(text("relay-max-streams"), "2");
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
        data: vec![1].into(),
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
    assert!(a.next().await.ok().flatten().is_none());
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
    let Some(server_frame::Kind::RequestHead(h)) = a.next().await.ok().flatten() else {
        panic!()
    };
    drop(resp);
    drop(tx);
    let Some(server_frame::Kind::Cancel(c)) = a.next().await.ok().flatten() else {
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
    let Some(server_frame::Kind::RequestHead(_)) = a.next().await.ok().flatten() else {
        panic!()
    };
    drop(a);
    assert_eq!(
        collect(resp).await.unwrap_err(),
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

/// `relay_tunnel_calls_total` by outcome, `relay_tunnel_calls_received_total` and
/// `relay_tunnel_calls_in_flight`, as /metrics shows them.
fn call_counts(s: &TunnelServerHandle) -> (Vec<(String, u64)>, u64, i64) {
    let (mut outcomes, mut received, mut in_flight) = (Vec::new(), 0, 0);
    for family in s.registry.gather() {
        for m in family.get_metric() {
            match family.name() {
                "relay_tunnel_calls_total" => {
                    let label = m.get_label()[0].value().to_string();
                    outcomes.push((label, m.get_counter().get_value() as u64));
                }
                "relay_tunnel_calls_received_total" => {
                    received = m.get_counter().get_value() as u64
                }
                "relay_tunnel_calls_in_flight" => in_flight = m.get_gauge().get_value() as i64,
                _ => {}
            }
        }
    }
    outcomes.sort();
    (outcomes, received, in_flight)
}

/// The next request head the agent gets.
async fn head(a: &mut common::FakeStream) -> RequestHead {
    match a.next().await {
        Ok(Some(server_frame::Kind::RequestHead(h))) => h,
        other => panic!("expected a request head, got {other:?}"),
    }
}

#[tokio::test]
async fn every_call_ends_with_exactly_one_outcome_and_leaves_nothing_in_flight() {
    let s = server(Config {
        queue_timeout: Duration::from_millis(200),
        ..Config::default()
    })
    .await;
    let agent = channel(s.agent_addr).await;
    let disp = channel(s.forward_addr).await;
    let mut a = open(&agent, "good-token").await.unwrap();
    common::until_idle(&s, "acme", 1).await;

    // ok, while a second call waits for the only stream and gives up: no_capacity.
    let (_t, first) = call(&disp, "acme", 5000).await;
    let h = head(&mut a).await;
    let (_t2, waiting) = call(&disp, "acme", 5000).await;
    assert_eq!(
        collect(waiting).await.unwrap_err(),
        ForwardErrorKind::NoCapacity as i32
    );
    let queued: u32 = s.hub().load().iter().map(|t| t.queued).sum();
    assert_eq!(queued, 0, "the call that gave up left the queue");
    a.answer(h.call_id, 200).await;
    assert_eq!(collect(first).await.unwrap().0, 200);
    // agent_error.
    let (_t, resp) = call(&disp, "acme", 5000).await;
    let h = head(&mut a).await;
    a.send(agent_frame::Kind::CallError(CallError {
        call_id: h.call_id,
        kind: CallErrorKind::Refused as i32,
        message: "not on the list".into(),
    }))
    .await;
    assert_eq!(
        collect(resp).await.unwrap_err(),
        ForwardErrorKind::Agent as i32
    );
    // cancelled: the caller leaves, the agent confirms.
    let (t, resp) = call(&disp, "acme", 5000).await;
    let h = head(&mut a).await;
    drop((t, resp));
    let Ok(Some(server_frame::Kind::Cancel(_))) = a.next().await else {
        panic!("expected a cancel")
    };
    a.send(agent_frame::Kind::CallError(CallError {
        call_id: h.call_id,
        kind: CallErrorKind::Cancelled as i32,
        message: "cancelled".into(),
    }))
    .await;
    // unknown_tunnel.
    let (_t, resp) = call(&disp, "nobody", 5000).await;
    assert_eq!(
        collect(resp).await.unwrap_err(),
        ForwardErrorKind::UnknownTunnel as i32
    );
    // bad_request: the first frame is not a call head.
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    tx.send(ForwardRequest::of(forward_request::Kind::Body(
        BodyChunk::default(),
    )))
    .await
    .unwrap();
    let refused = relay_proto::forward_client::ForwardClient::new(disp.clone())
        .call(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .expect_err("refused");
    assert_eq!(refused.code(), Code::InvalidArgument);
    // stream_lost: the stream dies under a call.
    let (_t, resp) = call(&disp, "acme", 5000).await;
    head(&mut a).await;
    drop(a);
    assert_eq!(
        collect(resp).await.unwrap_err(),
        ForwardErrorKind::StreamLost as i32
    );

    let expected: Vec<(String, u64)> = [
        ("agent_error", 1),
        ("bad_request", 1),
        ("bad_response", 0),
        ("cancelled", 1),
        ("no_capacity", 1),
        ("ok", 1),
        ("stream_lost", 1),
        ("unknown_tunnel", 1),
    ]
    .map(|(l, n)| (l.to_string(), n))
    .into();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let (outcomes, received, in_flight) = call_counts(&s);
        if outcomes == expected && received == 7 && in_flight == 0 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "one outcome per call, nothing in flight: {outcomes:?}, received {received}, in flight {in_flight}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A crash (`abort`) ends the agents' streams with UNAVAILABLE, not with the OK of a drain
/// or a retirement: behind a load balancer the agent sees an error when the server's
/// connection breaks, counts the server lost and reconnects to it at the quick pace.
#[tokio::test]
async fn an_aborted_server_ends_its_agent_streams_unavailable() {
    let s = server(Config::default()).await;
    let agent = channel(s.agent_addr).await;
    let mut a = open(&agent, "good-token").await.unwrap();
    common::until_idle(&s, "acme", 1).await;
    s.abort();
    let err = a
        .next()
        .await
        .expect_err("an error status, not a clean end");
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");
}
