//! Reading the logs of the processes a soak started, while they grow: lines, WARN and
//! ERROR counts (the most frequent messages of each), and every line with h2's
//! abuse-guard phrase `reached limit` (`locally-reset streams reached limit`,
//! `remotely-reset pending-accept streams reached limit`: h2 logs them at WARN, then
//! answers with GOAWAY `ENHANCE_YOUR_CALM`, which drops every call on that connection).
//!
//! [`Findings`] is pure (fed line by line); [`LogWatch`] reads what a log file gained
//! since the last look. Understands the binaries' text and JSON formats and HAProxy's
//! `[WARNING]` / `[ALERT]` lines.

use serde::Serialize;
use std::collections::BTreeMap;
use std::io::{Read, Seek, SeekFrom};
use std::path::PathBuf;

/// The phrase of h2's abuse guards.
pub const REACHED_LIMIT: &str = "reached limit";
/// How many `reached limit` lines are kept verbatim.
const KEEP_LINES: usize = 5;
/// How many distinct WARN/ERROR messages are counted apart (the rest under `(other)`).
const MAX_DISTINCT: usize = 200;
/// Longest message kept.
const MAX_MESSAGE: usize = 200;

/// A log line's level, as far as a soak cares.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Level {
    Warn,
    Error,
}

/// What a log held.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Findings {
    pub lines: u64,
    pub warn: u64,
    pub error: u64,
    /// Lines containing `reached limit`.
    pub reached_limit: u64,
    /// The first few of them, as logged (colours stripped).
    pub reached_limit_lines: Vec<String>,
    /// WARN and ERROR lines by message (timestamp dropped, digits as `#`).
    pub messages: BTreeMap<String, u64>,
}

impl Findings {
    pub fn feed(&mut self, raw: &str) {
        let line = strip_ansi(raw);
        let line = line.trim_end();
        if line.is_empty() {
            return;
        }
        self.lines += 1;
        if line.contains(REACHED_LIMIT) {
            self.reached_limit += 1;
            if self.reached_limit_lines.len() < KEEP_LINES {
                self.reached_limit_lines.push(line.to_string());
            }
        }
        let Some(level) = level_of(line) else {
            return;
        };
        match level {
            Level::Warn => self.warn += 1,
            Level::Error => self.error += 1,
        }
        let key = message_key(line);
        if self.messages.contains_key(&key) || self.messages.len() < MAX_DISTINCT {
            *self.messages.entry(key).or_default() += 1;
        } else {
            *self.messages.entry("(other)".into()).or_default() += 1;
        }
    }

    /// The `n` most frequent WARN/ERROR messages, most frequent first.
    pub fn top(&self, n: usize) -> Vec<(String, u64)> {
        let mut v: Vec<(String, u64)> =
            self.messages.iter().map(|(k, c)| (k.clone(), *c)).collect();
        v.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        v.truncate(n);
        v
    }
}

/// Drops ANSI escape sequences (`ESC [ ... letter`).
pub fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            if chars.next() == Some('[') {
                for c in chars.by_ref() {
                    if c.is_ascii_alphabetic() {
                        break;
                    }
                }
            }
            continue;
        }
        out.push(c);
    }
    out
}

/// The level of a WARN or ERROR line: tracing's text format (`<time>  WARN ...`), its
/// JSON format (`"level":"WARN"`) or HAProxy's (`[WARNING]`, `[ALERT]`).
pub fn level_of(line: &str) -> Option<Level> {
    if line.starts_with('{') {
        if line.contains(r#""level":"WARN""#) {
            return Some(Level::Warn);
        }
        if line.contains(r#""level":"ERROR""#) {
            return Some(Level::Error);
        }
        return None;
    }
    line.split_whitespace()
        .take(2)
        .find_map(|w| match w.trim_end_matches(':') {
            "WARN" | "[WARNING]" => Some(Level::Warn),
            "ERROR" | "[ALERT]" => Some(Level::Error),
            _ => None,
        })
}

/// The line without its timestamp, numbers as `#` (so counts group by message, not by
/// call id or port) and whitespace collapsed.
pub fn message_key(line: &str) -> String {
    let mut words = line.split_whitespace().peekable();
    if words
        .peek()
        .is_some_and(|w| w.starts_with(|c: char| c.is_ascii_digit()) && w.contains(':'))
    {
        words.next();
    }
    let mut key = String::new();
    for w in words {
        if !key.is_empty() {
            key.push(' ');
        }
        // A run of digits becomes one `#`, unless it continues a name (`h2`, `tls12`).
        enum In {
            Name,
            Number,
            Other,
        }
        let mut at = In::Other;
        for c in w.chars() {
            if c.is_ascii_digit() {
                match at {
                    In::Name => key.push(c),
                    In::Number => {}
                    In::Other => {
                        key.push('#');
                        at = In::Number;
                    }
                }
            } else {
                key.push(c);
                at = if c.is_ascii_alphabetic() {
                    In::Name
                } else {
                    In::Other
                };
            }
        }
        if key.len() >= MAX_MESSAGE {
            let mut end = MAX_MESSAGE;
            while !key.is_char_boundary(end) {
                end -= 1;
            }
            key.truncate(end);
            break;
        }
    }
    key
}

/// Follows one log file: each [`LogWatch::poll`] feeds the lines appended since the last.
#[derive(Debug)]
pub struct LogWatch {
    path: PathBuf,
    offset: u64,
    partial: Vec<u8>,
    pub findings: Findings,
}

impl LogWatch {
    pub fn new(path: PathBuf) -> Self {
        LogWatch {
            path,
            offset: 0,
            partial: Vec::new(),
            findings: Findings::default(),
        }
    }

    pub fn path(&self) -> &std::path::Path {
        &self.path
    }

    /// Reads what the file gained. A missing file is not an error (not written yet).
    pub fn poll(&mut self) {
        let Ok(mut f) = std::fs::File::open(&self.path) else {
            return;
        };
        let len = f.metadata().map(|m| m.len()).unwrap_or(0);
        if len < self.offset {
            // Truncated or replaced: read it again from the start.
            self.offset = 0;
            self.partial.clear();
        }
        if f.seek(SeekFrom::Start(self.offset)).is_err() {
            return;
        }
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let n = match f.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            self.offset += n as u64;
            let mut chunk = &buf[..n];
            while let Some(i) = chunk.iter().position(|b| *b == b'\n') {
                self.partial.extend_from_slice(&chunk[..i]);
                self.findings.feed(&String::from_utf8_lossy(&self.partial));
                self.partial.clear();
                chunk = &chunk[i + 1..];
            }
            self.partial.extend_from_slice(chunk);
        }
    }

    /// The last look: polls, then counts an unterminated last line too.
    pub fn finish(&mut self) {
        self.poll();
        if !self.partial.is_empty() {
            let line = String::from_utf8_lossy(&self.partial).into_owned();
            self.findings.feed(&line);
            self.partial.clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const H2_WARN: &str = "\u{1b}[2m2025-06-01T10:00:00.123456Z\u{1b}[0m \u{1b}[33m WARN\u{1b}[0m locally-reset streams reached limit (1024)";

    #[test]
    fn an_h2_guard_line_counts_as_reached_limit_and_warn() {
        let mut f = Findings::default();
        f.feed(H2_WARN);
        f.feed("2025-06-01T10:00:00.2Z  INFO relay tunnel server listening addr=127.0.0.1:1");
        f.feed(r#"{"timestamp":"x","level":"WARN","fields":{"message":"recv_reset; remotely-reset pending-accept streams reached limit (20)"}}"#);
        assert_eq!(f.lines, 3);
        assert_eq!(f.reached_limit, 2);
        assert_eq!(f.warn, 2);
        assert_eq!(f.error, 0);
        assert_eq!(
            f.reached_limit_lines[0],
            "2025-06-01T10:00:00.123456Z  WARN locally-reset streams reached limit (1024)"
        );
    }

    #[test]
    fn levels_of_each_format() {
        assert_eq!(
            level_of("2025-06-01T10:00:00Z ERROR call failed"),
            Some(Level::Error)
        );
        assert_eq!(level_of("2025-06-01T10:00:00Z  INFO fine"), None);
        assert_eq!(
            level_of("[WARNING]  (1234) : Server tunnel_servers/ts-1 is DOWN"),
            Some(Level::Warn)
        );
        assert_eq!(
            level_of("[ALERT]    (1234) : backend has no server"),
            Some(Level::Error)
        );
        assert_eq!(level_of("[NOTICE]   (1234) : haproxy started"), None);
        assert_eq!(
            level_of(r#"{"level":"ERROR","fields":{}}"#),
            Some(Level::Error)
        );
        // A message that merely mentions a level is not one.
        assert_eq!(
            level_of("2025-06-01T10:00:00Z  INFO saw WARN upstream"),
            None
        );
    }

    #[test]
    fn messages_group_by_text_without_time_or_numbers() {
        let mut f = Findings::default();
        f.feed("2025-06-01T10:00:00Z  WARN retrying call_id=17");
        f.feed("2025-06-01T10:00:01Z  WARN retrying call_id=18");
        f.feed("2025-06-01T10:00:02Z ERROR gone");
        assert_eq!(
            f.top(5),
            vec![
                ("WARN retrying call_id=#".to_string(), 2),
                ("ERROR gone".to_string(), 1)
            ]
        );
    }

    #[test]
    fn numbers_collapse_but_names_with_digits_stay() {
        assert_eq!(
            message_key("2025-06-01T10:00:00Z  WARN report failed peer=127.0.0.1:4431 server_id=ts-12 error=h2 protocol error"),
            "WARN report failed peer=#.#.#.#:# server_id=ts-# error=h2 protocol error"
        );
    }

    #[test]
    fn distinct_messages_are_bounded() {
        let mut f = Findings::default();
        for i in 0..(MAX_DISTINCT + 50) {
            f.feed(&format!("t1:0 WARN message {}", "x".repeat(i % 300 + 1)));
        }
        assert!(f.messages.len() <= MAX_DISTINCT + 1);
        assert_eq!(f.messages.values().sum::<u64>(), f.warn);
    }

    #[test]
    fn a_watch_reads_only_what_was_appended_and_the_unterminated_tail_at_the_end() {
        use std::io::Write;
        let dir = crate::procs::ScratchDir::new("logscan-test").unwrap();
        let path = dir.path().join("x.log");
        let mut file = std::fs::File::create(&path).unwrap();
        let mut w = LogWatch::new(path);
        w.poll();
        assert_eq!(w.findings.lines, 0);
        write!(file, "t:0  WARN a\nt:0  WARN stream").unwrap();
        w.poll();
        assert_eq!((w.findings.lines, w.findings.warn), (1, 1));
        writeln!(file, "s reached limit (5)").unwrap();
        write!(file, "t:0 ERROR tail").unwrap();
        w.poll();
        assert_eq!((w.findings.lines, w.findings.reached_limit), (2, 1));
        assert_eq!(
            w.findings.reached_limit_lines,
            vec!["t:0  WARN streams reached limit (5)"]
        );
        w.finish();
        assert_eq!((w.findings.lines, w.findings.error), (3, 1));
    }
}
