//! How one call of a load ended: ok, or failed for one [`Reason`]. Decides from what the
//! caller saw (status, body, transport error, client deadline), and names the tunnel
//! server an error message blames. Pure: no clock, no I/O.

use bytes::Bytes;
use std::fmt;

/// What a caller expects of a 200 answer: the simulated upstream's answer to its request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Expect {
    /// Any 2xx answer; its body is read to the end and not kept.
    Any,
    /// `GET /bytes/{n}`: `n` bytes of the upstream's pattern.
    Pattern(u64),
    /// Exactly these bytes (the echoed marker of a POST, `/slow`'s `slow\n`).
    Exact(Bytes),
}

impl Expect {
    /// Why `body` is not the expected answer, or `None` when it is.
    pub fn mismatch(&self, body: &[u8]) -> Option<String> {
        match self {
            Expect::Any => None,
            Expect::Pattern(n) => {
                if body.len() as u64 != *n {
                    return Some(format!("expected {n} bytes, got {}", body.len()));
                }
                body.iter()
                    .enumerate()
                    .find(|(i, b)| **b != crate::upstream::pattern_byte(*i as u64))
                    .map(|(i, b)| format!("byte {i} is {b}, not the upstream's pattern"))
            }
            Expect::Exact(want) => (body != want.as_ref()).then(|| {
                format!(
                    "expected {:?}, got {:?}",
                    String::from_utf8_lossy(want),
                    String::from_utf8_lossy(&body[..body.len().min(80)])
                )
            }),
        }
    }
}

/// Why a call failed. Ordered (for stable reports) and printed as the report's key:
/// `502 stream_lost`, `200 bad_body`, `transport closed`, `client_timeout`, `caller left`.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Reason {
    /// An answer other than 200: its status and the dispatcher's JSON `error` code (`-`
    /// when the body carries none); a 503 without `Retry-After` is marked (printed
    /// `503 <code> WITHOUT retry-after`), since the relay always tells callers when to
    /// come back.
    Status {
        status: u16,
        code: String,
        no_retry_after: bool,
    },
    /// 200, but the body is not the upstream's answer to this call.
    BadBody,
    /// The connection to the dispatcher failed: `connect`, `closed` (before the answer
    /// was complete), `body` (the body was cut short), `parse`, `io`, `other`.
    Transport(&'static str),
    /// No whole answer within the client's per-call deadline.
    ClientTimeout,
    /// The caller left before the answer (on purpose: the load's `leave`). Not a failure.
    Left,
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Reason::Status {
                status,
                code,
                no_retry_after,
            } => {
                write!(f, "{status} {code}")?;
                if *no_retry_after {
                    f.write_str(" WITHOUT retry-after")?;
                }
                Ok(())
            }
            Reason::BadBody => f.write_str("200 bad_body"),
            Reason::Transport(kind) => write!(f, "transport {kind}"),
            Reason::ClientTimeout => f.write_str("client_timeout"),
            Reason::Left => f.write_str("caller left"),
        }
    }
}

/// One failed call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Failure {
    pub reason: Reason,
    /// The tunnel server the error message names (`tunnel server <id> ...`), if any.
    pub server: Option<String>,
    /// The error's message (the dispatcher's JSON `message`, the transport error, the
    /// body mismatch), for examples in the report.
    pub detail: String,
}

impl Failure {
    pub fn new(reason: Reason, detail: impl Into<String>) -> Self {
        Failure {
            reason,
            server: None,
            detail: detail.into(),
        }
    }
}

/// Classifies a whole answer: status `status` with body `body`. `servers` are the tunnel
/// server ids the run knows (empty in external mode), to find the one a message names.
/// A 503 is marked when it came without `Retry-After` (`retry_after` false).
pub fn classify(
    status: u16,
    retry_after: bool,
    body: &[u8],
    expect: &Expect,
    servers: &[String],
) -> Result<(), Failure> {
    if status == 200 || (*expect == Expect::Any && (200..300).contains(&status)) {
        return match expect.mismatch(body) {
            None => Ok(()),
            Some(why) => Err(Failure::new(Reason::BadBody, why)),
        };
    }
    let json: serde_json::Value = serde_json::from_slice(body).unwrap_or_default();
    let code = json["error"].as_str().unwrap_or("-").to_string();
    let detail = match json["message"].as_str() {
        Some(m) => m.to_string(),
        None => String::from_utf8_lossy(&body[..body.len().min(200)]).into_owned(),
    };
    Err(Failure {
        reason: Reason::Status {
            status,
            code,
            no_retry_after: status == 503 && !retry_after,
        },
        server: server_of(&detail, servers),
        detail,
    })
}

/// Words that follow "tunnel server " in the dispatcher's messages without being an id
/// ("tunnel server sent an empty frame", "no tunnel server holds streams ...").
const NOT_IDS: &[&str] = &["", "sent", "broke", "error", "holds", "went", "ended"];

/// The tunnel server id a dispatcher error message names: the word after
/// `tunnel server ` (as in `tunnel server ts-1 went away (...)` or
/// `tunnel server ts-1: connection refused`). With `known` ids only one of them counts.
pub fn server_of(message: &str, known: &[String]) -> Option<String> {
    const MARK: &str = "tunnel server ";
    let mut rest = message;
    while let Some(i) = rest.find(MARK) {
        rest = &rest[i + MARK.len()..];
        let word = rest
            .split(|c: char| c == ':' || c == ',' || c.is_whitespace())
            .next()
            .unwrap_or("");
        let is_id = if known.is_empty() {
            !NOT_IDS.contains(&word)
        } else {
            known.iter().any(|k| k == word)
        };
        if is_id {
            return Some(word.to_string());
        }
    }
    None
}

/// The kind of a transport error from a client (hyper's connection or pooled client):
/// the kind of the first hyper error in its chain, `connect` for a failed connect.
pub fn transport_kind_of(e: &(dyn std::error::Error + 'static)) -> &'static str {
    let mut cur = Some(e);
    while let Some(err) = cur {
        if let Some(h) = err.downcast_ref::<hyper::Error>() {
            return transport_kind(h);
        }
        if let Some(l) = err.downcast_ref::<hyper_util::client::legacy::Error>() {
            if l.is_connect() {
                return "connect";
            }
        }
        cur = err.source();
    }
    "other"
}

/// The kind of a transport error from hyper's client connection.
pub fn transport_kind(e: &hyper::Error) -> &'static str {
    if e.is_incomplete_message() || e.is_closed() {
        "closed"
    } else if e.is_canceled() {
        "canceled"
    } else if e.is_parse() || e.is_parse_status() {
        "parse"
    } else if e.is_timeout() {
        "timeout"
    } else if std::error::Error::source(e).is_some_and(|s| s.is::<std::io::Error>()) {
        "io"
    } else {
        "other"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids() -> Vec<String> {
        vec!["ts-1".into(), "ts-2".into()]
    }

    fn pattern(n: u64) -> Vec<u8> {
        (0..n).map(crate::upstream::pattern_byte).collect()
    }

    #[test]
    fn the_upstreams_answer_is_ok() {
        assert_eq!(
            classify(200, false, &pattern(300), &Expect::Pattern(300), &ids()),
            Ok(())
        );
        let marker = Bytes::from_static(b"soak 3 7");
        assert_eq!(
            classify(200, false, b"soak 3 7", &Expect::Exact(marker), &ids()),
            Ok(())
        );
    }

    #[test]
    fn a_wrong_body_under_200_is_bad_body() {
        let short = classify(200, false, &pattern(299), &Expect::Pattern(300), &ids()).unwrap_err();
        assert_eq!(short.reason, Reason::BadBody);
        assert!(short.detail.contains("expected 300 bytes, got 299"));
        let mut wrong = pattern(300);
        wrong[17] ^= 1;
        let e = classify(200, false, &wrong, &Expect::Pattern(300), &ids()).unwrap_err();
        assert!(e.detail.contains("byte 17"), "{}", e.detail);
        let e = classify(
            200,
            false,
            b"soak 3 8",
            &Expect::Exact(Bytes::from_static(b"soak 3 7")),
            &ids(),
        )
        .unwrap_err();
        assert_eq!(e.reason.to_string(), "200 bad_body");
    }

    #[test]
    fn an_error_answer_is_keyed_by_status_and_code_and_names_its_server() {
        let body = br#"{"error":"stream_lost","message":"tunnel server ts-2 went away (h2 protocol error) before the response head; the call may have reached the agent, so it was not retried","tunnel_id":"demo"}"#;
        let e = classify(502, false, body, &Expect::Pattern(10), &ids()).unwrap_err();
        assert_eq!(e.reason.to_string(), "502 stream_lost");
        assert_eq!(e.server.as_deref(), Some("ts-2"));
        assert!(e.detail.starts_with("tunnel server ts-2 went away"));
    }

    #[test]
    fn an_error_without_json_keeps_its_status_and_a_dash() {
        let e = classify(503, true, b"overloaded", &Expect::Pattern(10), &ids()).unwrap_err();
        assert_eq!(e.reason.to_string(), "503 -");
        let e = classify(503, false, b"overloaded", &Expect::Pattern(10), &ids()).unwrap_err();
        assert_eq!(e.reason.to_string(), "503 - WITHOUT retry-after");
        assert_eq!(e.detail, "overloaded");
        assert_eq!(e.server, None);
    }

    #[test]
    fn server_of_reads_the_dispatchers_messages() {
        let known = ids();
        for (msg, want) in [
            ("tunnel server ts-1: connection refused", Some("ts-1")),
            (
                "tunnel server ts-2 ended the call before the response head",
                Some("ts-2"),
            ),
            (
                "tunnel server ts-1 went away (x) while the call waited in its queue",
                Some("ts-1"),
            ),
            ("tunnel server sent an empty frame", None),
            (
                "tunnel server broke the forward protocol before the response head",
                None,
            ),
            ("tunnel server error: boom", None),
            ("no tunnel server holds streams for this tunnel id", None),
            ("agent: upstream unreachable", None),
        ] {
            assert_eq!(server_of(msg, &known).as_deref(), want, "{msg}");
            // Without known ids the same words are recognised.
            assert_eq!(server_of(msg, &[]).as_deref(), want, "{msg} (no known ids)");
        }
        // Known ids exclude anything else.
        assert_eq!(server_of("tunnel server ts-9: refused", &known), None);
        assert_eq!(
            server_of("tunnel server ts-9: refused", &[]).as_deref(),
            Some("ts-9")
        );
    }

    #[test]
    fn reasons_print_as_report_keys() {
        assert_eq!(Reason::Transport("closed").to_string(), "transport closed");
        assert_eq!(Reason::ClientTimeout.to_string(), "client_timeout");
        assert_eq!(
            Reason::Status {
                status: 504,
                code: "deadline_exceeded".into(),
                no_retry_after: false,
            }
            .to_string(),
            "504 deadline_exceeded"
        );
    }
}
