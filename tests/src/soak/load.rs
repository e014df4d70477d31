//! The soak's callers: each holds one HTTP/1.1 keep-alive connection to the dispatcher's
//! front and makes one call after another on it, checks every answer against what the
//! simulated upstream sends, and records exactly one outcome per call it started (ok
//! with its latency, or a [`Failure`]). A connection the dispatcher closed while idle is
//! replaced before the next call (that is not a failed call: a client pool does the
//! same); one that failed mid-call is replaced after recording the failure.
//!
//! This module must not decide whether a run passed.

use super::hist::Histogram;
use super::outcome::{classify, transport_kind, Expect, Failure, Reason};
use super::CallMethod;
use bytes::Bytes;
use http::header::{AUTHORIZATION, CONTENT_TYPE, HOST};
use http::{HeaderValue, Method, Request};
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// Distinct examples kept per failure reason.
const EXAMPLES: usize = 3;

/// Where and how the callers call.
#[derive(Debug)]
pub(crate) struct Target {
    pub addr: SocketAddr,
    /// The `Host` header (the dispatcher URL's authority).
    pub host: String,
    pub auth: HeaderValue,
    pub tunnel_id: String,
    /// Tunnel server ids of the run (empty in external mode), to name the server an
    /// error message blames.
    pub servers: Vec<String>,
    /// The client's deadline for one whole call (head and body).
    pub timeout: Duration,
    pub method: CallMethod,
}

/// What one caller asks for.
#[derive(Clone, Copy, Debug)]
pub(crate) enum CallKind {
    /// The run's calls (`--method`): GET `/bytes/{n}` or POST `/echo/soak`.
    Base,
    /// Burst calls: GET `/slow/{ms}`.
    Slow(u64),
}

/// Live counts, read by the progress line.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub sent: AtomicU64,
    pub answered: AtomicU64,
    pub ok: AtomicU64,
    pub failed: AtomicU64,
    pub burst_sent: AtomicU64,
    pub burst_answered: AtomicU64,
    /// Connections opened to the front (one per caller when keep-alive holds).
    pub connects: AtomicU64,
}

impl Counters {
    pub fn get(c: &AtomicU64) -> u64 {
        c.load(Ordering::Relaxed)
    }
}

/// One failure reason's figures.
#[derive(Clone, Debug, Default)]
pub(crate) struct ReasonStat {
    pub count: u64,
    /// Since the load started.
    pub first_at: Duration,
    pub last_at: Duration,
    pub examples: Vec<String>,
}

/// Every failure so far (rare, so behind one short lock).
#[derive(Debug, Default)]
pub(crate) struct Failures {
    pub by_reason: BTreeMap<Reason, ReasonStat>,
    /// Server the message named (or `(none)`) -> reason -> count.
    pub by_server: BTreeMap<String, BTreeMap<String, u64>>,
}

/// The state every caller shares.
#[derive(Debug)]
pub(crate) struct Load {
    pub target: Target,
    pub counters: Counters,
    /// Latency of the calls that answered ok.
    pub latency: Histogram,
    pub failures: Mutex<Failures>,
    /// Base calls to make in all (`None`: until stopped).
    budget: Option<u64>,
    claimed: AtomicU64,
    t0: Instant,
}

impl Load {
    pub fn new(target: Target, budget: Option<u64>, t0: Instant) -> Self {
        Load {
            target,
            counters: Counters::default(),
            latency: Histogram::default(),
            failures: Mutex::default(),
            budget,
            claimed: AtomicU64::new(0),
            t0,
        }
    }

    /// Takes one base call from the budget; false once it is spent.
    fn claim(&self) -> bool {
        match self.budget {
            None => true,
            Some(b) => self.claimed.fetch_add(1, Ordering::Relaxed) < b,
        }
    }

    fn request(&self, kind: CallKind, caller: usize, seq: u64) -> (Request<Full<Bytes>>, Expect) {
        let t = &self.target.tunnel_id;
        let (method, path, body, expect) = match (kind, self.target.method) {
            (CallKind::Base, CallMethod::Get) => {
                // Lengths vary per call so an answer meant for another call shows.
                let n = 16 + (seq.wrapping_mul(7).wrapping_add(caller as u64)) % 128;
                (
                    Method::GET,
                    format!("/relay/{t}/bytes/{n}"),
                    Bytes::new(),
                    Expect::Pattern(n),
                )
            }
            (CallKind::Base, CallMethod::Post) => {
                let marker = Bytes::from(format!("soak {caller} {seq}"));
                (
                    Method::POST,
                    format!("/relay/{t}/echo/soak"),
                    marker.clone(),
                    Expect::Exact(marker),
                )
            }
            (CallKind::Slow(ms), _) => (
                Method::GET,
                format!("/relay/{t}/slow/{ms}"),
                Bytes::new(),
                Expect::Exact(Bytes::from_static(b"slow\n")),
            ),
        };
        let mut b = Request::builder()
            .method(method)
            .uri(path)
            .header(HOST, self.target.host.as_str())
            .header(AUTHORIZATION, self.target.auth.clone());
        if !body.is_empty() {
            b = b.header(CONTENT_TYPE, "application/octet-stream");
        }
        (b.body(Full::new(body)).expect("valid request"), expect)
    }

    fn record(&self, took: Duration, result: Result<(), Failure>, burst: bool) {
        match result {
            Ok(()) => {
                self.latency.record(took);
                self.counters.ok.fetch_add(1, Ordering::Relaxed);
            }
            Err(f) => {
                let at = self.t0.elapsed();
                {
                    let mut all = self.failures.lock().unwrap_or_else(|e| e.into_inner());
                    let key = f.reason.to_string();
                    let server = f.server.clone().unwrap_or_else(|| "(none)".into());
                    *all.by_server
                        .entry(server)
                        .or_default()
                        .entry(key)
                        .or_default() += 1;
                    let stat = all.by_reason.entry(f.reason).or_insert_with(|| ReasonStat {
                        first_at: at,
                        ..ReasonStat::default()
                    });
                    stat.count += 1;
                    stat.last_at = at;
                    let mut detail = f.detail;
                    truncate(&mut detail, 300);
                    if stat.examples.len() < EXAMPLES && !stat.examples.contains(&detail) {
                        stat.examples.push(detail);
                    }
                }
                self.counters.failed.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.counters.answered.fetch_add(1, Ordering::Relaxed);
        if burst {
            self.counters.burst_answered.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Cuts `s` to at most `max` bytes, on a character boundary.
pub(crate) fn truncate(s: &mut String, max: usize) {
    let mut i = max.min(s.len());
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    s.truncate(i);
}

/// One caller: calls until `stop` (or, for base calls, until the budget is spent). Every
/// call it starts is recorded before it looks at `stop` again.
pub(crate) async fn caller(
    load: std::sync::Arc<Load>,
    id: usize,
    kind: CallKind,
    stop: CancellationToken,
) {
    let burst = matches!(kind, CallKind::Slow(_));
    let mut conn: Option<Conn> = None;
    let mut seq = 0u64;
    while !stop.is_cancelled() {
        if !burst && !load.claim() {
            break;
        }
        seq += 1;
        let (req, expect) = load.request(kind, id, seq);
        load.counters.sent.fetch_add(1, Ordering::Relaxed);
        if burst {
            load.counters.burst_sent.fetch_add(1, Ordering::Relaxed);
        }
        let started = Instant::now();
        let deadline = load.target.timeout;
        let result = match tokio::time::timeout(deadline, exchange(&load, &mut conn, req)).await {
            Ok(Ok((status, body))) => classify(status, &body, &expect, &load.target.servers),
            Ok(Err(f)) => {
                conn = None;
                Err(f)
            }
            Err(_) => {
                // Whatever state the connection is in, it is not reusable.
                conn = None;
                Err(Failure::new(
                    Reason::ClientTimeout,
                    format!("no whole answer within {deadline:?}"),
                ))
            }
        };
        load.record(started.elapsed(), result, burst);
    }
}

/// One HTTP/1.1 connection; its driver task ends with it.
struct Conn {
    sender: SendRequest<Full<Bytes>>,
    task: tokio::task::JoinHandle<()>,
}

impl Conn {
    async fn open(addr: SocketAddr) -> Result<Conn, Failure> {
        let connect =
            |e: &dyn std::fmt::Display| Failure::new(Reason::Transport("connect"), e.to_string());
        let tcp = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|e| connect(&e))?;
        let _ = tcp.set_nodelay(true);
        let (sender, driver) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
            .await
            .map_err(|e| connect(&e))?;
        let task = tokio::spawn(async move {
            let _ = driver.await;
        });
        Ok(Conn { sender, task })
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Sends `req` on the caller's connection (opening one if needed) and reads the whole
/// answer.
async fn exchange(
    load: &Load,
    conn: &mut Option<Conn>,
    req: Request<Full<Bytes>>,
) -> Result<(u16, Bytes), Failure> {
    if let Some(c) = conn.as_mut() {
        if c.sender.ready().await.is_err() {
            // Closed while idle (the dispatcher may close keep-alive connections).
            *conn = None;
        }
    }
    if conn.is_none() {
        let fresh = Conn::open(load.target.addr).await?;
        load.counters.connects.fetch_add(1, Ordering::Relaxed);
        *conn = Some(fresh);
    }
    let Some(c) = conn.as_mut() else {
        return Err(Failure::new(Reason::Transport("connect"), "no connection"));
    };
    let transport =
        |e: hyper::Error| Failure::new(Reason::Transport(transport_kind(&e)), e.to_string());
    c.sender.ready().await.map_err(transport)?;
    let resp = c.sender.send_request(req).await.map_err(transport)?;
    let status = resp.status().as_u16();
    let body = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| Failure::new(Reason::Transport("body"), e.to_string()))?
        .to_bytes();
    Ok((status, body))
}
