use super::*;
use proptest::prelude::*;

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// A streamed body passes whole when within its limit, and otherwise ends in an
    /// error (and the flag) no later than the chunk that crosses it.
    #[test]
    fn body_limit_passes_or_stops_at_the_crossing_chunk(
        chunks in prop::collection::vec(prop::collection::vec(any::<u8>(), 0..64), 0..12),
        limit in prop::option::of(0u64..400),
    ) {
        let total: u64 = chunks.iter().map(|c| c.len() as u64).sum();
        let (tx, rx) = mpsc::channel(chunks.len().max(1));
        for c in &chunks {
            tx.try_send(Bytes::from(c.clone())).unwrap();
        }
        drop(tx);
        let sent = Arc::new(SentBody::default());
        let body = LimitedBody { rx, seen: 0, limit, sent: sent.clone(), done: false };
        let got = futures::executor::block_on(body.collect());
        match limit {
            Some(l) if total > l => {
                prop_assert!(got.is_err());
                prop_assert!(sent.limit_hit.load(Ordering::SeqCst));
                prop_assert!(!sent.ended.load(Ordering::SeqCst));
            }
            _ => {
                let bytes = got.map_err(|e| e.to_string()).unwrap().to_bytes();
                prop_assert_eq!(bytes.to_vec(), chunks.concat());
                prop_assert!(!sent.limit_hit.load(Ordering::SeqCst));
                prop_assert!(sent.ended.load(Ordering::SeqCst));
            }
        }
    }
}

#[tokio::test]
async fn target_not_starting_with_slash_is_a_bad_request() {
    let up = Upstream::new("http://127.0.0.1:9", Duration::from_secs(1), None).unwrap();
    for target in ["http://evil.example/x", "x/y", "", "*", "//evil.example/x"] {
        let req = UpstreamRequest {
            method: Method::GET,
            path_and_query: target.into(),
            headers: HeaderMap::new(),
            body: RequestBody::None,
            body_limit: None,
            close_connection: false,
        };
        let err = up
            .send(req, Instant::now() + Duration::from_secs(1))
            .await
            .unwrap_err();
        assert!(
            matches!(err, UpstreamError::BadRequest(_)),
            "{target}: {err}"
        );
    }
}

/// A test origin on a loopback port: it answers every request head it reads with `answer`
/// (and after each answer, with `close_when` set, closes the connection once that is
/// notified), and counts the connections it accepted and those that ended.
struct Origin {
    addr: std::net::SocketAddr,
    accepted: Arc<std::sync::atomic::AtomicUsize>,
    ended: Arc<std::sync::atomic::AtomicUsize>,
    heads: Arc<std::sync::Mutex<Vec<String>>>,
}

async fn origin(answer: &'static str, close_when: Option<Arc<tokio::sync::Notify>>) -> Origin {
    use std::sync::atomic::AtomicUsize;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let accepted = Arc::new(AtomicUsize::new(0));
    let ended = Arc::new(AtomicUsize::new(0));
    let heads = Arc::new(std::sync::Mutex::new(Vec::new()));
    let (a, e, h) = (accepted.clone(), ended.clone(), heads.clone());
    tokio::spawn(async move {
        loop {
            let (mut sock, _) = listener.accept().await.unwrap();
            a.fetch_add(1, Ordering::SeqCst);
            let (e, h, close_when) = (e.clone(), h.clone(), close_when.clone());
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                loop {
                    if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                        let head: Vec<u8> = buf.drain(..end + 4).collect();
                        h.lock()
                            .unwrap()
                            .push(String::from_utf8_lossy(&head).into_owned());
                        if sock.write_all(answer.as_bytes()).await.is_err() {
                            break;
                        }
                        if let Some(close) = &close_when {
                            close.notified().await;
                            break;
                        }
                        continue;
                    }
                    match sock.read(&mut chunk).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    }
                }
                drop(sock);
                e.fetch_add(1, Ordering::SeqCst);
            });
        }
    });
    Origin {
        addr,
        accepted,
        ended,
        heads,
    }
}

fn get(path: &str) -> UpstreamRequest {
    UpstreamRequest {
        method: Method::GET,
        path_and_query: path.into(),
        headers: HeaderMap::new(),
        body: RequestBody::None,
        body_limit: None,
        close_connection: false,
    }
}

fn upstream_to(o: &Origin) -> Upstream {
    Upstream::new(&format!("http://{}", o.addr), Duration::from_secs(5), None).unwrap()
}

fn soon() -> Instant {
    Instant::now() + Duration::from_secs(10)
}

/// Sends `req` and reads the whole body.
async fn exchange(up: &Upstream, req: UpstreamRequest) -> (StatusCode, Vec<u8>) {
    let mut r = up.send(req, soon()).await.expect("answered");
    let mut body = Vec::new();
    while let Some((piece, last)) = r.next_chunk(1 << 16).await.expect("body") {
        body.extend_from_slice(&piece);
        if last {
            break;
        }
    }
    (r.status, body)
}

async fn until(what: &str, cond: impl FnMut() -> bool) {
    relay_common::testing::until(what, Duration::from_secs(10), cond).await;
}

const OK: &str = "HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";

#[tokio::test]
async fn calls_one_after_another_share_one_connection_with_origin_form_targets() {
    let o = origin(OK, None).await;
    let up = upstream_to(&o);
    for i in 0..20 {
        let (status, body) = exchange(&up, get(&format!("/n/{i}?q=1"))).await;
        assert_eq!((status, body.as_slice()), (StatusCode::OK, &b"ok"[..]));
    }
    assert_eq!(o.accepted.load(Ordering::SeqCst), 1);
    assert_eq!(up.inner.pool.idle_len(), 1);
    let heads = o.heads.lock().unwrap().clone();
    assert_eq!(heads.len(), 20);
    assert!(
        heads[7].starts_with("GET /n/7?q=1 HTTP/1.1\r\n"),
        "{}",
        heads[7]
    );
    let host = format!("host: {}\r\n", o.addr);
    assert!(
        heads[7].to_ascii_lowercase().contains(&host),
        "{}",
        heads[7]
    );
}

#[tokio::test]
async fn a_body_not_read_to_its_end_closes_its_connection() {
    // The answer promises 10 bytes and sends 5: the exchange never ends cleanly.
    let o = origin("HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nhello", None).await;
    let up = upstream_to(&o);
    let r = up.send(get("/a"), soon()).await.unwrap();
    assert_eq!(r.status, StatusCode::OK);
    drop(r);
    until("the half-read connection to close", || {
        o.ended.load(Ordering::SeqCst) == 1
    })
    .await;
    let r = up.send(get("/b"), soon()).await.unwrap();
    drop(r);
    assert_eq!(o.accepted.load(Ordering::SeqCst), 2);
    assert_eq!(up.inner.pool.idle_len(), 0);
}

#[tokio::test]
async fn a_call_asking_to_close_its_connection_is_never_followed_on_it() {
    let o = origin(OK, None).await;
    let up = upstream_to(&o);
    let mut req = get("/x");
    req.close_connection = true;
    assert_eq!(exchange(&up, req).await.0, StatusCode::OK);
    assert!(o.heads.lock().unwrap()[0]
        .to_ascii_lowercase()
        .contains("connection: close\r\n"));
    assert_eq!(exchange(&up, get("/y")).await.0, StatusCode::OK);
    assert_eq!(o.accepted.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn connections_the_origin_closed_while_idle_are_replaced_without_a_failed_call() {
    // The origin closes each connection once it waits in the pool, without saying so (as
    // a server whose keep-alive timeout ran out would): the next call must not fail on it.
    let close = Arc::new(tokio::sync::Notify::new());
    let o = origin(OK, Some(close.clone())).await;
    let up = upstream_to(&o);
    for i in 0..10 {
        assert_eq!(exchange(&up, get("/z")).await.0, StatusCode::OK, "call {i}");
        assert_eq!(up.inner.pool.idle_len(), 1);
        close.notify_one();
        until("the origin to close", || {
            o.ended.load(Ordering::SeqCst) == i + 1
        })
        .await;
    }
    assert_eq!(o.accepted.load(Ordering::SeqCst), 10);
}

#[tokio::test]
async fn a_request_body_still_streaming_when_the_answer_ends_closes_the_connection() {
    // The origin answers on the head, before the body's end: the connection still owes
    // the body and serves no other call.
    let o = origin(OK, None).await;
    let up = upstream_to(&o);
    let (tx, rx) = mpsc::channel(4);
    tx.send(Bytes::from_static(b"part")).await.unwrap();
    let mut req = get("/upload");
    req.method = Method::POST;
    req.body = RequestBody::Streamed(rx);
    let mut r = up.send(req, soon()).await.unwrap();
    while let Some((_, last)) = r.next_chunk(1 << 16).await.unwrap() {
        if last {
            break;
        }
    }
    drop(r);
    assert_eq!(up.inner.pool.idle_len(), 0);
    drop(tx);
    assert_eq!(exchange(&up, get("/next")).await.0, StatusCode::OK);
    assert_eq!(o.accepted.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn the_pool_keeps_at_most_its_cap_and_closes_connections_idle_past_the_timeout() {
    let o = origin(OK, None).await;
    let authority: http::uri::Authority = o.addr.to_string().parse().unwrap();
    let pool = pool::Pool::new(&authority, Duration::from_secs(5), Some(2));
    let up = upstream_to(&o);
    let request = || up.build(get("/p")).unwrap().0;
    // Three exchanges at once: three connections.
    let (a, b, c) = tokio::join!(
        pool.send(request()),
        pool.send(request()),
        pool.send(request())
    );
    for r in [a, b, c] {
        let (response, conn) = r.unwrap();
        let body = response.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(&body[..], b"ok");
        pool.put(conn);
    }
    assert_eq!(o.accepted.load(Ordering::SeqCst), 3);
    assert_eq!(pool.idle_len(), 2, "the third connection is over the cap");
    until("the connection over the cap to close", || {
        o.ended.load(Ordering::SeqCst) == 1
    })
    .await;

    tokio::time::pause();
    tokio::time::advance(pool::IDLE_TIMEOUT + Duration::from_secs(1)).await;
    tokio::time::resume();
    until("idle connections to close", || {
        o.ended.load(Ordering::SeqCst) == 3
    })
    .await;
    assert_eq!(pool.idle_len(), 0);
}

#[tokio::test]
async fn an_origin_nobody_listens_on_is_unreachable_and_named() {
    let closed = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = closed.local_addr().unwrap();
    drop(closed);
    let up = Upstream::new(&format!("http://{addr}"), Duration::from_secs(5), None).unwrap();
    match up.send(get("/"), soon()).await.unwrap_err() {
        UpstreamError::Unreachable(m) => assert!(m.contains(&addr.to_string()), "{m}"),
        other => panic!("{other}"),
    }
}

#[tokio::test]
async fn a_bodiless_answer_dropped_off_the_runtime_still_returns_its_connection() {
    let o = origin("HTTP/1.1 204 No Content\r\n\r\n", None).await;
    let up = upstream_to(&o);
    let r = up.send(get("/t"), soon()).await.unwrap();
    assert!(r.is_empty());
    // Dropped on a thread without a runtime: no task can start there, nothing panics.
    std::thread::spawn(move || drop(r))
        .join()
        .expect("no panic");
    assert_eq!(up.inner.pool.idle_len(), 1);
    let r = up.send(get("/u"), soon()).await.unwrap();
    assert_eq!(r.status, StatusCode::NO_CONTENT);
    drop(r);
    assert_eq!(o.accepted.load(Ordering::SeqCst), 1);
}
