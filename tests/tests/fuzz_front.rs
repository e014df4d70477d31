//! Bounded fuzzing of the dispatcher's request handling through the real front, with the
//! whole relay behind it (agent and upstream echo): arbitrary methods, paths, headers and
//! bodies (proptest, 256 cases), and a committed corpus of tricky raw requests as table
//! tests. Every request gets an HTTP answer in bounded time: a relayed answer (the
//! upstream's echo) or a JSON error from the relay; the process keeps serving.

use bytes::Bytes;
use http::Method;
use proptest::prelude::*;
use proptest::test_runner::{Config as RunnerConfig, TestRunner};
use relay_tests::client::Caller;
use relay_tests::stack::{Stack, CALLER_KEY};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Asserts the answer is relayed (echo headers) or a relay JSON error.
fn check(status: u16, headers: &http::HeaderMap, body: &[u8], what: &str) {
    if headers.contains_key("x-echo-method") {
        assert_eq!(status, 200, "{what}");
        return;
    }
    let json: serde_json::Value = serde_json::from_slice(body).unwrap_or_else(|_| {
        panic!(
            "{what}: neither relayed nor a JSON error: {status} {:?}",
            String::from_utf8_lossy(body)
        )
    });
    assert!(status >= 400, "{what}: {status} {json}");
    assert!(json["error"].is_string(), "{what}: {json}");
    assert!(!json.to_string().contains(CALLER_KEY), "{what}: key echoed");
}

#[derive(Debug, Clone)]
struct Req {
    method: String,
    tunnel: String,
    suffix: String,
    headers: Vec<(String, String)>,
    key: Option<String>,
    body: Vec<u8>,
}

fn req() -> impl Strategy<Value = Req> {
    let method = prop_oneof![
        Just("GET".to_string()),
        Just("POST".to_string()),
        Just("PUT".to_string()),
        Just("DELETE".to_string()),
        Just("HEAD".to_string()),
        Just("OPTIONS".to_string()),
        Just("PATCH".to_string()),
        "[A-Z]{1,12}",
    ];
    let tunnel = prop_oneof![
        6 => Just("demo".to_string()),
        1 => "[A-Za-z0-9._-]{1,20}",
        1 => "[a-z%.]{0,6}",
        1 => Just("x".repeat(200)),
    ];
    let suffix = prop_oneof![
        Just(String::new()),
        "(/[A-Za-z0-9._~%+-]{0,12}){0,4}",
        "/[ -~&&[^ #]]{0,40}",
        "\\?[A-Za-z0-9=&%._-]{0,30}",
    ];
    let header = ("x-[a-z0-9-]{1,16}", "[ -~]{0,64}");
    let key = prop_oneof![
        8 => Just(Some(CALLER_KEY.to_string())),
        1 => Just(None),
        1 => "[ -~]{0,20}".prop_map(Some),
    ];
    (
        method,
        tunnel,
        suffix,
        proptest::collection::vec(header, 0..6),
        key,
        proptest::collection::vec(any::<u8>(), 0..3000),
    )
        .prop_map(|(method, tunnel, suffix, headers, key, body)| Req {
            method,
            tunnel,
            suffix,
            headers,
            key,
            body,
        })
}

#[test]
fn arbitrary_requests_get_a_relayed_answer_or_a_json_error() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let stack = rt.block_on(async {
        let s = Stack::builder().servers(1).start().await.unwrap();
        s.wait_routable(Duration::from_secs(20)).await.unwrap();
        s
    });
    let anonymous = Caller::new(stack.http, None);
    let mut runner = TestRunner::new(RunnerConfig {
        cases: 256,
        ..RunnerConfig::default()
    });
    runner
        .run(&req(), |r| {
            let Ok(method) = Method::from_bytes(r.method.as_bytes()) else {
                return Ok(());
            };
            if method == Method::CONNECT {
                return Ok(());
            }
            let uri = format!("http://{}/relay/{}/echo{}", stack.http, r.tunnel, r.suffix);
            let mut b = http::Request::builder().method(method).uri(&uri);
            for (n, v) in &r.headers {
                b = b.header(n.as_str(), v.as_str());
            }
            if let Some(k) = &r.key {
                b = b.header("authorization", format!("Bearer {k}"));
            }
            let Ok(request) = b.body(http_body_util::Full::new(Bytes::from(r.body.clone()))) else {
                return Ok(());
            };
            let answer = rt
                .block_on(async {
                    tokio::time::timeout(Duration::from_secs(15), anonymous.call(request)).await
                })
                .unwrap_or_else(|_| panic!("no answer within 15 s: {r:?}"))
                .unwrap_or_else(|e| panic!("no HTTP answer: {e:#}: {r:?}"));
            let head = r.method == "HEAD";
            if !head {
                check(
                    answer.status.as_u16(),
                    &answer.headers,
                    &answer.body,
                    &format!("{r:?}"),
                );
            }
            Ok(())
        })
        .unwrap();
    rt.block_on(async {
        let a = stack.caller().get("/relay/demo/hello").await.unwrap();
        assert_eq!(a.status, 200, "still serving after the fuzz run");
        stack.shutdown().await;
    });
}

/// Sends raw bytes and reads the answer until the connection closes or a full head and
/// `content-length` body arrived; returns (status, headers, body).
async fn raw(addr: std::net::SocketAddr, request: &[u8]) -> (u16, http::HeaderMap, Vec<u8>) {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(request).await.unwrap();
    let answer = async {
        let mut buf = Vec::new();
        loop {
            let mut chunk = [0u8; 4096];
            let n = s.read(&mut chunk).await.unwrap_or(0);
            buf.extend_from_slice(&chunk[..n]);
            if let Some((status, map, at)) = parse_head(&buf) {
                let len: usize = map
                    .get("content-length")
                    .and_then(|v| v.to_str().ok()?.parse().ok())
                    .unwrap_or(0);
                if buf.len() >= at + len || n == 0 {
                    let body = buf[at..].to_vec();
                    return (status, map, body);
                }
            }
            assert!(
                n > 0,
                "connection closed without an answer to {:?}",
                String::from_utf8_lossy(request)
            );
        }
    };
    tokio::time::timeout(Duration::from_secs(10), answer)
        .await
        .unwrap_or_else(|_| {
            panic!(
                "no answer in time to {:?}",
                String::from_utf8_lossy(request)
            )
        })
}

/// A complete response head: status, headers and where the body starts.
fn parse_head(buf: &[u8]) -> Option<(u16, http::HeaderMap, usize)> {
    let end = buf.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head = std::str::from_utf8(&buf[..end]).ok()?;
    let mut lines = head.split("\r\n");
    let status = lines.next()?.split(' ').nth(1)?.parse().ok()?;
    let mut map = http::HeaderMap::new();
    for line in lines {
        let (n, v) = line.split_once(':')?;
        if let (Ok(n), Ok(v)) = (
            http::HeaderName::from_bytes(n.trim().as_bytes()),
            http::HeaderValue::from_str(v.trim()),
        ) {
            map.append(n, v);
        }
    }
    Some((status, map, end + 4))
}

#[tokio::test]
async fn tricky_raw_requests_get_clear_answers() {
    let stack = Stack::builder().servers(1).start().await.unwrap();
    stack.wait_routable(Duration::from_secs(20)).await.unwrap();
    let auth = format!("Authorization: Bearer {CALLER_KEY}\r\n");
    let cases: Vec<(String, u16)> = vec![
        // Absolute-form target pointing elsewhere: the path is ours, never the host.
        (format!("GET http://evil.example/relay/demo/echo HTTP/1.1\r\nHost: x\r\n{auth}\r\n"), 200),
        (format!("GET /relay/ HTTP/1.1\r\nHost: x\r\n{auth}\r\n"), 400),
        (format!("GET /relay//echo HTTP/1.1\r\nHost: x\r\n{auth}\r\n"), 400),
        (format!("GET /relay/%2e%2e/echo HTTP/1.1\r\nHost: x\r\n{auth}\r\n"), 400),
        (format!("GET /relay/{}/echo HTTP/1.1\r\nHost: x\r\n{auth}\r\n", "a".repeat(129)), 400),
        (format!("GET /admin HTTP/1.1\r\nHost: x\r\n{auth}\r\n"), 404),
        ("GET /relay/demo/echo HTTP/1.1\r\nHost: x\r\n\r\n".to_string(), 401),
        ("GET /relay/demo/echo HTTP/1.1\r\nHost: x\r\nAuthorization: Basic Zm9vOmJhcg==\r\n\r\n".to_string(), 401),
        ("GET /relay/demo/echo HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer\r\n\r\n".to_string(), 401),
        (format!("GET /relay/demo/echo HTTP/1.1\r\nHost: x\r\n{auth}{auth}\r\n"), 401),
        (format!("GET /relay/demo/echo HTTP/1.1\r\nHost: x\r\n{auth}x-relay-timeout-ms: -5\r\n\r\n"), 400),
        (format!("GET /relay/nobody/echo HTTP/1.1\r\nHost: x\r\n{auth}\r\n"), 503),
        // Host override attempt: the agent refuses steering headers (403, below).
        (format!("GET /relay/demo/echo HTTP/1.1\r\nHost: x\r\n{auth}X-Forwarded-Host: evil\r\n\r\n"), 403),
        (format!("POST /relay/demo/echo HTTP/1.1\r\nHost: x\r\n{auth}Content-Length: 3\r\nContent-Length: 4\r\n\r\nabcd"), 400),
        // Garbage request line.
        ("\x16\x03\x01\x00\x05hello\r\n\r\n".to_string(), 400),
    ];
    for (request, want) in cases {
        let (status, headers, body) = raw(stack.http, request.as_bytes()).await;
        assert_eq!(
            status,
            want,
            "{request:?}: {:?}",
            String::from_utf8_lossy(&body)
        );
        // hyper answers unparseable requests itself (400, empty); the relay's own errors are JSON.
        if status >= 400 && !body.is_empty() {
            check(status, &headers, &body, &request);
        }
    }
    // The steering header is refused by the agent's security check, naming the reason.
    let (_, _, body) = raw(
        stack.http,
        format!("GET /relay/demo/echo HTTP/1.1\r\nHost: x\r\n{auth}X-Forwarded-Host: evil\r\n\r\n")
            .as_bytes(),
    )
    .await;
    let json: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    assert_eq!(json["error"], "refused", "{json}");
    assert!(
        json["message"]
            .as_str()
            .is_some_and(|m| m.contains("refused (override_header)")),
        "{json}"
    );
    assert_eq!(
        stack
            .caller()
            .get("/relay/demo/hello")
            .await
            .unwrap()
            .status,
        200
    );
    stack.shutdown().await;
}

/// A request framed by both `Content-Length` and `Transfer-Encoding` never reaches the
/// upstream with both: the agent refuses such a request (`smuggling`), and the
/// dispatcher's HTTP/1 front, which reads the body as chunked (RFC 9112 section 6.3),
/// forwards it without the `Content-Length`.
#[tokio::test]
async fn content_length_with_transfer_encoding_never_reaches_the_upstream_with_both() {
    let stack = Stack::builder().servers(1).start().await.unwrap();
    stack.wait_routable(Duration::from_secs(20)).await.unwrap();
    let request = format!(
        "POST /relay/demo/echo HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {CALLER_KEY}\r\n\
         Content-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
    );
    let (status, headers, body) = raw(stack.http, request.as_bytes()).await;
    match status {
        403 => {
            let json: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
            assert!(
                json["message"]
                    .as_str()
                    .is_some_and(|m| m.contains("refused (smuggling)")),
                "{json}"
            );
        }
        200 => {
            let seen: serde_json::Value = headers
                .get("x-echo-headers")
                .and_then(|v| serde_json::from_slice(v.as_bytes()).ok())
                .unwrap_or_else(|| panic!("relayed without the echo of its headers: {headers:?}"));
            let has = |n: &str| seen.get(n).is_some();
            assert!(
                !(has("content-length") && has("transfer-encoding")),
                "the upstream saw both framings: {seen}"
            );
            assert_ne!(
                seen.get("content-length").and_then(|v| v.as_str()),
                Some("4"),
                "the upstream saw the caller's Content-Length: {seen}"
            );
        }
        other => panic!(
            "neither refused nor relayed: {other} {:?}",
            String::from_utf8_lossy(&body)
        ),
    }
    stack.shutdown().await;
}
