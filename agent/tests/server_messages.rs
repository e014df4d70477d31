//! A hostile tunnel server's status messages against the agent's logs, over real sockets.
//! The only test of this binary: it captures the agent's log lines through a subscriber of
//! its own thread, and tracing's per-callsite cache is shared by every thread of a process,
//! so no other test may run beside it.

mod common;

use common::*;

/// A log sink for the test's own thread (the agent runs on it: a current-thread runtime).
#[derive(Clone, Default)]
struct Logs(Arc<Mutex<Vec<u8>>>);

impl Logs {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

impl std::io::Write for Logs {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Logs {
    type Writer = Logs;
    fn make_writer(&'a self) -> Logs {
        self.clone()
    }
}

/// What a hostile tunnel server puts in a status message to forge a log line of the
/// agent's (a newline, then a line in the log's own format) and to drive an operator's
/// terminal (ANSI escapes).
const FORGED: &str =
    "bye\n2030-01-01T00:00:00.000000Z  INFO relay_agent: FORGED all is well\u{1b}[2J\u{1b}]0;title\u{7}";

/// Status messages a tunnel server sends (the end of a stream, the refusal of an open)
/// reach the agent's log lines with their control characters escaped: no forged line, no
/// escape sequence, and the message is still there to read.
#[tokio::test]
async fn status_messages_from_a_tunnel_server_are_escaped_in_the_agents_logs() {
    let logs = Logs::default();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(logs.clone())
        .with_max_level(tracing::Level::DEBUG)
        .with_ansi(false)
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);
    let upstream = hyper_upstream().await;
    let mut tunnel = FakeTunnel::start(10_000, true).await;
    *tunnel.refusal.lock().unwrap() = FORGED.to_string();
    let (_agent, _) = start_agent(config(&tunnel.url, &upstream, 1)).await;
    let conn = tunnel.next_conn().await;
    // Refuse the agent's next opens with the forged message, then end its stream with it.
    tunnel.accept.store(false, Ordering::SeqCst);
    conn.tx
        .send(Err(Status::internal(FORGED)))
        .await
        .expect("stream open");
    let rejections = tunnel.rejections.clone();
    eventually("the agent's open was refused", || {
        !rejections.lock().unwrap().is_empty()
    })
    .await;
    let deadline = Instant::now() + WAIT;
    loop {
        let text = logs.text();
        if text.contains("server error: Internal: bye") && text.contains("token refused") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "both messages did not reach the agent's log:\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let text = logs.text();
    assert!(
        text.contains(
            "bye\\n2030-01-01T00:00:00.000000Z  INFO relay_agent: FORGED all is well\\u{1b}[2J"
        ),
        "the message is kept, escaped:\n{text}"
    );
    for line in text.lines() {
        assert!(
            !line.starts_with("2030-01-01"),
            "a forged line in the agent's log: {line}\n{text}"
        );
    }
    assert!(
        !text.contains('\u{1b}') && !text.contains('\u{7}'),
        "{text}"
    );
}
