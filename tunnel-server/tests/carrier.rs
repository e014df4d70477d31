//! `Forward.Carry` over real gRPC: calls one after another on one carrier, each answered
//! before the next head is read, and the carrier's end rules that keep a dispatcher's
//! retries safe (it ends cleanly only between calls).

mod common;

use common::{channel, open, open_with, FakeStream};
use relay_proto::forward_client::ForwardClient;
use relay_proto::*;
use relay_tunnel_server::{Config, TokenStore, TunnelServerHandle};
use std::time::Duration;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Code, Streaming};

const WAIT: Duration = Duration::from_secs(10);

async fn server() -> TunnelServerHandle {
    common::server(Config::default(), TokenStore::single("good-token", "acme")).await
}

/// The dispatcher's side of one carrier.
struct Carrier {
    tx: mpsc::Sender<ForwardRequest>,
    resp: Streaming<ForwardResponse>,
    /// The server's `relay-forward-features` response metadata.
    features: String,
}

async fn carrier(ch: &tonic::transport::Channel) -> Carrier {
    let (tx, rx) = mpsc::channel(16);
    let resp = ForwardClient::new(ch.clone())
        .carry(ReceiverStream::new(rx))
        .await
        .unwrap();
    let features = resp
        .metadata()
        .get(FORWARD_FEATURES)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string();
    Carrier {
        tx,
        resp: resp.into_inner(),
        features,
    }
}

impl Carrier {
    /// Sends a call's head to tunnel id `acme`; `end_of_stream` false: body chunks follow.
    async fn head(&self, path: &str, end_of_stream: bool) {
        let head = CallHead {
            tunnel_id: "acme".into(),
            request: Some(RequestHead {
                method: if end_of_stream { "GET" } else { "POST" }.into(),
                path_and_query: path.into(),
                deadline_ms: 5_000,
                end_of_stream,
                ..Default::default()
            }),
            queue_handshake: false,
        };
        self.tx
            .send(ForwardRequest::of(forward_request::Kind::Head(head)))
            .await
            .unwrap();
    }

    /// Sends a call head to `acme` whose request carries `body` inside it, marked as the
    /// whole body (`end_of_stream`) or not.
    async fn head_with_body(&self, path: &str, body: &'static [u8], end_of_stream: bool) {
        let head = CallHead {
            tunnel_id: "acme".into(),
            request: Some(RequestHead {
                method: "POST".into(),
                path_and_query: path.into(),
                deadline_ms: 5_000,
                end_of_stream,
                body: body.into(),
                ..Default::default()
            }),
            queue_handshake: false,
        };
        self.tx
            .send(ForwardRequest::of(forward_request::Kind::Head(head)))
            .await
            .unwrap();
    }

    async fn body(&self, data: &'static [u8], end: bool) {
        let chunk = BodyChunk {
            call_id: 0,
            data: data.into(),
            end,
        };
        self.tx
            .send(ForwardRequest::of(forward_request::Kind::Body(chunk)))
            .await
            .unwrap();
    }

    /// Reads one call's answer up to its terminal frame, and nothing after it.
    async fn answer(&mut self) -> Result<(u32, Vec<u8>), String> {
        let mut status = 0;
        let mut body = Vec::new();
        loop {
            let frame = tokio::time::timeout(WAIT, self.resp.message())
                .await
                .map_err(|_| "no frame in 10 s".to_string())?;
            match frame {
                Ok(Some(ForwardResponse { kind: Some(k) })) => match k {
                    forward_response::Kind::Head(h) => {
                        status = h.status;
                        body.extend_from_slice(&h.body);
                        if h.end_of_stream {
                            return Ok((status, body));
                        }
                    }
                    forward_response::Kind::Body(b) => {
                        body.extend_from_slice(&b.data);
                        if b.end {
                            return Ok((status, body));
                        }
                    }
                    forward_response::Kind::Error(e) => {
                        return Err(format!("error frame {} {}", e.kind, e.message))
                    }
                    other => return Err(format!("unexpected {other:?}")),
                },
                Ok(Some(_)) => return Err("empty frame".into()),
                Ok(None) => return Err("the carrier ended".into()),
                Err(s) => return Err(format!("{:?}: {}", s.code(), s.message())),
            }
        }
    }
}

/// The agent's next request head; panics on anything else.
async fn request_head(a: &mut FakeStream) -> RequestHead {
    match a.next().await {
        Ok(Some(server_frame::Kind::RequestHead(h))) => h,
        other => panic!("expected a request head, got {other:?}"),
    }
}

/// The agent's next request body chunk; panics on anything else.
async fn request_body(a: &mut FakeStream) -> BodyChunk {
    match a.next().await {
        Ok(Some(server_frame::Kind::RequestBody(b))) => b,
        other => panic!("expected a request body chunk, got {other:?}"),
    }
}

/// A whole 200 with `body` inside its head.
async fn answer_whole(a: &FakeStream, call_id: u64, body: &[u8]) {
    a.send(agent_frame::Kind::ResponseHead(ResponseHead {
        call_id,
        status: 200,
        end_of_stream: true,
        body: body.to_vec().into(),
        ..Default::default()
    }))
    .await;
}

/// An unlabelled metric of the server's registry.
fn metric(s: &TunnelServerHandle, name: &str) -> f64 {
    let text = prometheus::TextEncoder::new()
        .encode_to_string(&s.registry.gather())
        .unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("no {name} in the metrics"))
}

#[tokio::test]
async fn calls_on_one_carrier_are_answered_one_after_another() {
    let s = server().await;
    let agent = channel(s.agent_addr).await;
    let disp = channel(s.forward_addr).await;
    let mut a = open(&agent, "good-token").await.unwrap();
    let mut c = carrier(&disp).await;
    for i in 0..3 {
        c.head(&format!("/get/{i}"), true).await;
        let h = request_head(&mut a).await;
        assert_eq!(h.path_and_query, format!("/get/{i}"));
        answer_whole(&a, h.call_id, format!("get {i}").as_bytes()).await;
        assert_eq!(c.answer().await, Ok((200, format!("get {i}").into_bytes())));
    }
    // A call with a body: its chunks reach the agent, then the next call's head does.
    c.head("/post", false).await;
    c.body(b"one,", false).await;
    c.body(b"two", true).await;
    let h = request_head(&mut a).await;
    assert_eq!(h.path_and_query, "/post");
    let mut got = Vec::new();
    loop {
        let b = request_body(&mut a).await;
        assert_eq!(b.call_id, h.call_id);
        got.extend_from_slice(&b.data);
        if b.end {
            break;
        }
    }
    assert_eq!(got, b"one,two");
    answer_whole(&a, h.call_id, b"posted").await;
    assert_eq!(c.answer().await, Ok((200, b"posted".to_vec())));
    c.head("/after", true).await;
    let h = request_head(&mut a).await;
    assert_eq!(h.path_and_query, "/after");
    answer_whole(&a, h.call_id, b"after").await;
    assert_eq!(c.answer().await, Ok((200, b"after".to_vec())));

    assert_eq!(metric(&s, "relay_tunnel_forward_carriers"), 1.0);
    assert_eq!(metric(&s, "relay_tunnel_calls_received_total"), 5.0);
    // The dispatcher retires the carrier between calls: it ends cleanly.
    drop(c.tx);
    assert!(matches!(c.resp.message().await, Ok(None)));
    let deadline = tokio::time::Instant::now() + WAIT;
    while metric(&s, "relay_tunnel_forward_carriers") != 0.0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the carrier task ends"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Waits (bounded) until `n` calls of `acme` wait in the server's queue.
async fn until_queued(s: &TunnelServerHandle, n: u32) {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let queued = s
            .hub()
            .load()
            .iter()
            .find(|t| &*t.tunnel_id == "acme")
            .map_or(0, |t| t.queued);
        if queued == n {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{n} queued calls within 10 s"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// An agent that announced `inline-body` gets a whole small body inside the request head
/// (one frame); a body of several frames still goes frame by frame.
#[tokio::test]
async fn a_small_whole_body_goes_inside_the_head_to_an_agent_that_reads_it() {
    let s = server().await;
    let agent = channel(s.agent_addr).await;
    let disp = channel(s.forward_addr).await;
    let mut a = open_with(&agent, "good-token", Some("fleet, inline-body"))
        .await
        .unwrap();
    common::until_idle(&s, "acme", 1).await;
    // The one stream is busy, so the next call's head and body have both come in by the
    // time it frees.
    let mut first = carrier(&disp).await;
    first.head("/first", true).await;
    let h = request_head(&mut a).await;
    let mut c = carrier(&disp).await;
    assert_eq!(
        c.features, "inline-body",
        "the server says it reads bodies in heads"
    );
    c.head("/upload", false).await;
    c.body(b"small payload", true).await;
    until_queued(&s, 1).await;
    answer_whole(&a, h.call_id, b"one").await;
    assert_eq!(first.answer().await, Ok((200, b"one".to_vec())));

    let h = request_head(&mut a).await;
    assert_eq!(h.path_and_query, "/upload");
    assert!(h.end_of_stream, "the whole body is in the head: {h:?}");
    assert_eq!(&h.body[..], b"small payload");
    answer_whole(&a, h.call_id, b"two").await;
    assert_eq!(c.answer().await, Ok((200, b"two".to_vec())));

    c.head("/parts", false).await;
    c.body(b"part one", false).await;
    c.body(b"part two", true).await;
    let h = request_head(&mut a).await;
    assert_eq!(h.path_and_query, "/parts");
    assert!(!h.end_of_stream && h.body.is_empty(), "{h:?}");
    let one = request_body(&mut a).await;
    assert_eq!((&one.data[..], one.end), (&b"part one"[..], false));
    let two = request_body(&mut a).await;
    assert_eq!((&two.data[..], two.end), (&b"part two"[..], true));
    answer_whole(&a, h.call_id, b"three").await;
    assert_eq!(c.answer().await, Ok((200, b"three".to_vec())));

    // A body the dispatcher put inside the head reaches this agent as it came.
    c.head_with_body("/inline", b"in the head", true).await;
    let h = request_head(&mut a).await;
    assert_eq!(h.path_and_query, "/inline");
    assert!(h.end_of_stream, "{h:?}");
    assert_eq!(&h.body[..], b"in the head");
    answer_whole(&a, h.call_id, b"four").await;
    assert_eq!(c.answer().await, Ok((200, b"four".to_vec())));
}

/// A body inside the dispatcher's call head reaches an agent that did not announce
/// `inline-body` as a body frame of its own; a head whose body is not marked whole is a
/// bad request that no agent sees.
#[tokio::test]
async fn a_body_inside_a_call_head_reaches_an_older_agent_as_its_own_frame() {
    let s = server().await;
    let agent = channel(s.agent_addr).await;
    let disp = channel(s.forward_addr).await;
    let mut a = open(&agent, "good-token").await.unwrap();
    common::until_idle(&s, "acme", 1).await;

    let mut bad = carrier(&disp).await;
    bad.head_with_body("/half", b"half", false).await;
    let answer = bad.answer().await;
    assert!(
        answer.as_ref().is_err_and(|e| e.contains("whole body")),
        "{answer:?}"
    );

    let mut c = carrier(&disp).await;
    c.head_with_body("/upload", b"inline payload", true).await;
    let h = request_head(&mut a).await;
    assert_eq!(
        h.path_and_query, "/upload",
        "the bad call never reached the agent"
    );
    assert!(!h.end_of_stream && h.body.is_empty(), "{h:?}");
    let chunk = request_body(&mut a).await;
    assert_eq!(chunk.call_id, h.call_id);
    assert_eq!((&chunk.data[..], chunk.end), (&b"inline payload"[..], true));
    answer_whole(&a, h.call_id, b"ok").await;
    assert_eq!(c.answer().await, Ok((200, b"ok".to_vec())));
}

#[tokio::test]
async fn a_call_answered_before_its_body_ended_has_the_rest_read_and_the_carrier_goes_on() {
    let s = server().await;
    let agent = channel(s.agent_addr).await;
    let disp = channel(s.forward_addr).await;
    let mut a = open(&agent, "good-token").await.unwrap();
    let mut c = carrier(&disp).await;
    c.head("/upload", false).await;
    c.body(b"first part", false).await;
    let h = request_head(&mut a).await;
    // The agent answers (say, 413) without waiting for the rest of the body.
    a.send(agent_frame::Kind::ResponseHead(ResponseHead {
        call_id: h.call_id,
        status: 413,
        end_of_stream: true,
        ..Default::default()
    }))
    .await;
    assert_eq!(c.answer().await, Ok((413, vec![])));
    // The dispatcher sends the body to its end, then the next call.
    c.body(b"second part", false).await;
    c.body(b"last part", true).await;
    c.head("/next", true).await;
    // The agent may have seen the first chunk; nothing of the old body after the answer
    // reaches it, and the next call does.
    let next = loop {
        match a.next().await {
            Ok(Some(server_frame::Kind::RequestBody(b))) => {
                assert_eq!(b.call_id, h.call_id);
                assert_eq!(
                    &b.data[..],
                    b"first part",
                    "only the part before the answer"
                );
            }
            Ok(Some(server_frame::Kind::RequestHead(next))) => break next,
            other => panic!("expected the next head, got {other:?}"),
        }
    };
    assert_eq!(next.path_and_query, "/next");
    answer_whole(&a, next.call_id, b"next").await;
    assert_eq!(c.answer().await, Ok((200, b"next".to_vec())));
}

/// The caller went away: the dispatcher closes the carrier's request half, mid-body or
/// after the whole request. Either way the agent gets a `Cancel` (never a body end: a
/// truncated upload must not look whole), and the carrier ends after the call.
#[tokio::test]
async fn closing_a_carrier_mid_call_cancels_the_call_at_the_agent() {
    let s = server().await;
    let agent = channel(s.agent_addr).await;
    let disp = channel(s.forward_addr).await;
    let mut a = open(&agent, "good-token").await.unwrap();
    for mid_body in [true, false] {
        let mut c = carrier(&disp).await;
        if mid_body {
            c.head("/upload", false).await;
            c.body(b"part", false).await;
        } else {
            c.head("/slow", true).await;
        }
        let h = request_head(&mut a).await;
        if mid_body {
            let b = request_body(&mut a).await;
            assert!(!b.end);
        }
        drop(c.tx);
        match a.next().await {
            Ok(Some(server_frame::Kind::Cancel(cancel))) => assert_eq!(cancel.call_id, h.call_id),
            other => panic!("expected a cancel (mid body: {mid_body}), got {other:?}"),
        }
        a.send(agent_frame::Kind::CallError(CallError {
            call_id: h.call_id,
            kind: CallErrorKind::Cancelled as i32,
            message: "cancelled".into(),
        }))
        .await;
        // The call's end, then the carrier's.
        let mut ended = false;
        for _ in 0..4 {
            match tokio::time::timeout(WAIT, c.resp.message()).await.unwrap() {
                Ok(Some(_)) => {}
                Ok(None) => {
                    ended = true;
                    break;
                }
                Err(status) => panic!("the carrier broke: {status:?}"),
            }
        }
        assert!(ended, "the carrier ends after the cancelled call");
    }
    // The agent stream serves the next call.
    let mut c = carrier(&disp).await;
    c.head("/next", true).await;
    let h = request_head(&mut a).await;
    answer_whole(&a, h.call_id, b"next").await;
    assert_eq!(c.answer().await, Ok((200, b"next".to_vec())));
}

#[tokio::test]
async fn a_frame_other_than_a_head_between_calls_ends_the_carrier_invalid_argument() {
    let s = server().await;
    let disp = channel(s.forward_addr).await;
    let mut c = carrier(&disp).await;
    c.body(b"no head", true).await;
    let status = c.resp.message().await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert_eq!(metric(&s, "relay_tunnel_calls_received_total"), 1.0);
}

#[tokio::test]
async fn a_stopping_server_ends_idle_carriers_cleanly() {
    let s = server().await;
    let agent = channel(s.agent_addr).await;
    let disp = channel(s.forward_addr).await;
    let mut a = open(&agent, "good-token").await.unwrap();
    let mut c = carrier(&disp).await;
    c.head("/one", true).await;
    let h = request_head(&mut a).await;
    answer_whole(&a, h.call_id, b"one").await;
    assert_eq!(c.answer().await, Ok((200, b"one".to_vec())));
    let stopped = tokio::spawn(s.shutdown());
    // Between calls: an OK end, which tells the dispatcher that no call of its was taken.
    let end = tokio::time::timeout(WAIT, c.resp.message()).await.unwrap();
    assert!(matches!(end, Ok(None)), "{end:?}");
    tokio::time::timeout(WAIT, stopped)
        .await
        .expect("the server stops with a carrier open")
        .unwrap();
}
