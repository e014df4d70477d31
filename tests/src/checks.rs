//! Checks that hold for every shape of the relay (three processes, co-located), written
//! once and run by each shape's tests on a started [`Stack`].

use crate::eventually;
use crate::stack::{Stack, TUNNEL_ID};
use crate::upstream::pattern_byte;
use bytes::Bytes;
use http::Method;
use http_body_util::BodyExt;
use std::time::Duration;

const WITHIN: Duration = Duration::from_secs(20);

/// A 1 MiB request body and a 64 MiB streamed response cross the relay byte for byte.
pub async fn large_bodies_pass_byte_for_byte(stack: &Stack) {
    let caller = stack.caller();
    let body: Vec<u8> = (0..1024 * 1024u64).map(pattern_byte).collect();
    let a = caller
        .call(caller.request(
            Method::PUT,
            &format!("/relay/{TUNNEL_ID}/echo"),
            body.clone(),
        ))
        .await
        .unwrap();
    assert_eq!(a.status, 200, "{}", a.text());
    assert_eq!(a.body.len(), body.len());
    assert!(a.body[..] == body[..], "1 MiB body changed in transit");

    const N: u64 = 64 * 1024 * 1024;
    let resp = caller
        .send(caller.request(
            Method::GET,
            &format!("/relay/{TUNNEL_ID}/bytes/{N}"),
            Bytes::new(),
        ))
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let mut body = resp.into_body();
    let mut at = 0u64;
    while let Some(frame) = body.frame().await {
        if let Some(data) = frame.unwrap().data_ref() {
            for (i, b) in data.iter().enumerate() {
                assert_eq!(
                    *b,
                    pattern_byte(at + i as u64),
                    "byte {} differs",
                    at + i as u64
                );
            }
            at += data.len() as u64;
        }
    }
    assert_eq!(at, N);
}

/// On a stack whose agent holds one stream: a caller whose upload breaks off (its chunked
/// body ends without the last chunk) cancels the upstream request, which never sees its
/// body end as if whole (the upstream echoes the body, so a cut body taken as whole would
/// be a served request), and the stream serves the next call.
pub async fn a_caller_whose_upload_breaks_off_cancels_the_upstream(stack: &Stack) {
    type BoxError = Box<dyn std::error::Error + Send + Sync>;
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http();
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<hyper::body::Frame<Bytes>, BoxError>>(4);
    let req = http::Request::builder()
        .method(Method::POST)
        .uri(format!("http://{}/relay/{TUNNEL_ID}/echo", stack.http))
        .header(
            "authorization",
            format!("Bearer {}", crate::stack::CALLER_KEY),
        )
        .body(http_body_util::StreamBody::new(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        ))
        .unwrap();
    let served_before = stack.upstream.served();
    let cancelled_before = stack.upstream.cancelled();
    let pending = tokio::spawn(async move {
        // The answer's head may come (the echo answers as the body arrives); its body
        // is cut when the call is cancelled.
        match client.request(req).await {
            Ok(resp) => resp.into_body().collect().await.is_ok(),
            Err(_) => false,
        }
    });
    tx.send(Ok(hyper::body::Frame::data(Bytes::from(vec![7u8; 1000]))))
        .await
        .unwrap();
    eventually("the upload reached the upstream", WITHIN, || async {
        stack.upstream.in_flight() == 1
    })
    .await;
    tx.send(Err("the caller went away".into())).await.unwrap();
    eventually("the upstream request was dropped", WITHIN, || async {
        stack.upstream.in_flight() == 0 && stack.upstream.cancelled() > cancelled_before
    })
    .await;
    assert_eq!(
        stack.upstream.served(),
        served_before,
        "the cut upload was never answered whole"
    );
    assert!(
        !pending.await.unwrap(),
        "the caller never got a whole answer to a cut upload"
    );
    let a = stack
        .caller()
        .get(&format!("/relay/{TUNNEL_ID}/hello"))
        .await
        .unwrap();
    assert_eq!(a.status, 200, "{}", a.text());
}

/// On a stack whose agent holds one stream: a caller that leaves mid-call cancels the
/// upstream request, and the stream serves the next call.
pub async fn a_caller_leaving_cancels_the_upstream(stack: &Stack) {
    let caller = stack.caller();
    let pending = {
        let caller = caller.clone();
        tokio::spawn(async move { caller.get(&format!("/relay/{TUNNEL_ID}/slow/10000")).await })
    };
    eventually("the call reached the upstream", WITHIN, || async {
        stack.upstream.in_flight() == 1
    })
    .await;
    pending.abort();
    eventually("the upstream request was dropped", WITHIN, || async {
        stack.upstream.in_flight() == 0 && stack.upstream.cancelled() >= 1
    })
    .await;
    let a = caller
        .get(&format!("/relay/{TUNNEL_ID}/hello"))
        .await
        .unwrap();
    assert_eq!(a.status, 200, "{}", a.text());
}
