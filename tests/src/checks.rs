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
