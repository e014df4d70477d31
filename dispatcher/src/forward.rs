//! Forwarding one call to a tunnel server, retrying on another server while that is safe.
//!
//! It owns the per-server hops (the connections to each `forward_url`, see `pool`, on
//! which calls travel on reused carriers, `Forward.Carry`, see `carrier`, or as one
//! `Forward.Call` each to a server that does not know carriers; or the in-process tunnel
//! server of the co-located mode, see `colocated`) and the attempt logic up to the response head.
//! Both gRPC forms frame a call alike, so everything below holds for either; a carrier the
//! server ended before it took the call is one more "never reached an agent". It must not
//! parse HTTP or choose error bodies: it hands back a `ResponseHead` plus the response
//! stream, or a [`Failure`].
//!
//! Retry rules (servers in the order the router picked, at most `max_attempts`, all within
//! the call's deadline, and only while the request body sent so far can be replayed: the
//! replay limit covers what a queued call can have sent, see `replay`):
//! - the call never reached an agent (the server could not be reached, refused the RPC,
//!   ended the carrier before taking the call, or answered UNKNOWN_TUNNEL / DRAINING):
//!   retried on the next server;
//! - NO_CAPACITY (never reached an agent either): fed back to the router as saturation, and
//!   under the `available` policy retried on the next server if that one reported idle
//!   streams; under `sticky` it goes back to the caller (the seed behaviour);
//! - the server queued the call (`Queued`) and died before it reserved a stream and we sent
//!   `Forward.Proceed` (the queue handshake, see `CallHead.queue_handshake`): no agent saw
//!   it, so it is retried on the next server like any call that never reached an agent.
//!   The go-ahead is a unary RPC rather than a frame on the call's request stream, so that
//!   the request stream still ends with the body (a bodiless call half-closes with its
//!   head, as without the handshake) and only calls that queued pay for it;
//! - the call may have started (the stream or the server died before the response head):
//!   retried only for idempotent methods (GET, HEAD, OPTIONS, PUT, DELETE) when
//!   `[routing] retry_idempotent = true`; otherwise the caller gets a 502 `stream_lost`
//!   that says the call may have reached the agent;
//! - anything the agent answered is final.
//!
//! Once a response head is in hand the call is never retried: the head goes to the caller.
//!
//! In the co-located mode the tunnel server in this process comes first among the servers
//! the router picked for a call (it holds streams of the tunnel id, or the router would not
//! have picked it): the call then skips a network hop. The others follow in the router's
//! order, for retries.
//!
//! Each failure's half of the decision is made once, where the failure is known, as a
//! [`Retry`] (`error.rs`); [`RetryRules::allows`] adds the configured half.

use crate::carrier;
use crate::colocated::{Local, LocalServer, ResponseFrames};
use crate::config::RoutingPolicy;
use crate::error::{ErrorCode, Failure, Retry};
use crate::metrics::Metrics;
use crate::pool::{ConnId, Remote, RemoteParts};
use crate::registry::Routes;
use crate::replay::RequestBody;
use crate::routing::{Pick, Target};
use futures::StreamExt;
use parking_lot::Mutex;
use relay_common::grpc::GrpcClient;
use relay_common::h2::H2Limits;
use relay_common::tls::TlsClient;
use relay_proto::forward_request::Kind as ReqKind;
use relay_proto::forward_response::Kind as RespKind;
use relay_proto::{CallHead, ForwardRequest, ForwardResponse, RequestHead, ResponseHead};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;
use tracing::{debug, info};

/// The configured half of the retry decision; the failure's half is its [`Retry`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryRules {
    pub policy: RoutingPolicy,
    /// `[routing] retry_idempotent`.
    pub retry_idempotent: bool,
}

impl RetryRules {
    /// Whether a call whose attempt failed with `retry` goes to `next`, the next server
    /// the router picked (if any; the attempt count and body replay are checked by the
    /// caller).
    pub fn allows(&self, retry: Retry, method: &str, next: Option<&Target>) -> bool {
        match retry {
            Retry::Safe => true,
            Retry::NoCapacity => {
                self.policy == RoutingPolicy::Available && next.is_some_and(|n| n.idle > 0)
            }
            Retry::MaybeStarted => self.retry_idempotent && idempotent(method),
            Retry::Never => false,
        }
    }
}

/// Where one forward attempt stands in the queue handshake.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    /// The server may hand the call to an agent without telling us first.
    Sent,
    /// The server said `Queued` and we have not sent `Proceed`: no agent has the call.
    Queued,
    /// We sent `Proceed`: the call may have reached the agent.
    Proceeded,
}

/// Methods that may be retried after they may have reached an agent, when configured.
pub fn idempotent(method: &str) -> bool {
    matches!(method, "GET" | "HEAD" | "OPTIONS" | "PUT" | "DELETE")
}

/// The connections to each tunnel server `forward_url` (`pool`), over TLS (`https://`
/// URLs, with the `[forward_tls]` client config) or plain h2c (`http://`, only with
/// `[forward_tls] insecure = true`), with their idle carriers (`carrier`).
#[derive(Clone)]
pub struct Channels {
    inner: Arc<Mutex<HashMap<String, Arc<Remote>>>>,
    client: GrpcClient,
    /// Streams per connection: `[forward_h2] max_concurrent_streams`.
    per_connection: usize,
    /// The co-located tunnel server, reached without gRPC.
    local: Option<Local>,
    /// `carrier_idle_timeout`.
    carrier_idle_timeout: Duration,
    /// Largest gRPC message sent to or accepted from a tunnel server.
    max_frame_bytes: usize,
    /// `relay_dispatcher_forward_connections`.
    connections: prometheus::IntGauge,
    /// `relay_dispatcher_forward_servers_down`.
    down: prometheus::IntGauge,
}

/// How one attempt reaches its tunnel server.
pub enum Hop {
    Remote(Arc<Remote>),
    Local(Arc<dyn LocalServer>),
}

impl Default for Channels {
    fn default() -> Self {
        Channels::new(None, H2Limits::FORWARD)
    }
}

/// How long dialing a tunnel server may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

impl Channels {
    /// `tls`: the client config for tunnel servers; `None` dials plain h2c. `h2`: the
    /// connections' HTTP/2 limits (`[forward_h2]`); the stream window bounds what one call
    /// buffers while its caller reads slowly, `max_concurrent_streams` how many streams go
    /// on one connection.
    pub fn new(tls: Option<TlsClient>, h2: H2Limits) -> Self {
        Channels {
            inner: Arc::default(),
            client: GrpcClient::new(h2, CONNECT_TIMEOUT, tls).keepalive_while_idle(),
            per_connection: h2.max_concurrent_streams as usize,
            local: None,
            carrier_idle_timeout: carrier::IDLE_FOR,
            max_frame_bytes: relay_proto::DEFAULT_MAX_FRAME_BYTES,
            connections: prometheus::IntGauge::new(
                "relay_dispatcher_forward_connections",
                "HTTP/2 connections open to tunnel servers",
            )
            .expect("a valid metric"),
            down: prometheus::IntGauge::new(
                "relay_dispatcher_forward_servers_down",
                "Tunnel servers whose path is dead",
            )
            .expect("a valid metric"),
        }
    }

    /// Carriers unused for `idle` are closed.
    pub fn with_carrier_idle_timeout(mut self, idle: Duration) -> Self {
        self.carrier_idle_timeout = idle;
        self
    }

    /// The largest gRPC message sent to or accepted from a tunnel server.
    pub fn with_max_frame_bytes(mut self, max: usize) -> Self {
        self.max_frame_bytes = max;
        self
    }

    /// Counts the open connections in `connections` and the servers down in `down`.
    pub fn with_gauges(
        mut self,
        connections: prometheus::IntGauge,
        down: prometheus::IntGauge,
    ) -> Self {
        self.connections = connections;
        self.down = down;
        self
    }

    /// Calls to `local.forward_url` go to the tunnel server in this process.
    pub fn with_local(mut self, local: Option<Local>) -> Self {
        self.local = local;
        self
    }

    /// Whether `forward_url` is the co-located tunnel server's.
    pub fn is_local(&self, forward_url: &str) -> bool {
        self.local
            .as_ref()
            .is_some_and(|l| l.forward_url == forward_url)
    }

    pub fn get(&self, forward_url: &str) -> Result<Hop, String> {
        if let Some(local) = self.local.as_ref().filter(|l| l.forward_url == forward_url) {
            return Ok(Hop::Local(local.server.clone()));
        }
        let https = forward_url.starts_with("https://");
        match (self.client.is_tls(), https) {
            (true, false) => {
                return Err(format!(
                    "forward_url {forward_url} is plain text but this dispatcher dials tunnel servers over TLS ([forward_tls])"
                ))
            }
            (false, true) => {
                return Err(format!(
                    "forward_url {forward_url} is https:// but [forward_tls] says insecure = true"
                ))
            }
            _ => {}
        }
        let mut map = self.inner.lock();
        if let Some(remote) = map.get(forward_url) {
            return Ok(Hop::Remote(remote.clone()));
        }
        let endpoint = self
            .client
            .endpoint(forward_url)
            .map_err(|e| e.to_string())?;
        let remote = Arc::new(Remote::new(RemoteParts {
            endpoint,
            client: self.client.clone(),
            per_connection: self.per_connection,
            carrier_idle_timeout: self.carrier_idle_timeout,
            max_frame_bytes: self.max_frame_bytes,
            gauge: self.connections.clone(),
            url: forward_url.to_string(),
            down_gauge: self.down.clone(),
        }));
        map.insert(forward_url.to_string(), remote.clone());
        Ok(Hop::Remote(remote))
    }

    /// Drops the connections (and their idle carriers) of a server that left.
    pub fn evict(&self, forward_url: &str) {
        self.inner.lock().remove(forward_url);
    }
}

/// The parts of a caller's request that go into the `RequestHead`.
pub struct CallPlan {
    pub call_id: u64,
    pub tunnel_id: String,
    pub method: String,
    pub path_and_query: String,
    /// Header records (`relay_proto::wire_headers`).
    pub headers: Vec<bytes::Bytes>,
    pub end_of_stream: bool,
    pub deadline: Instant,
}

/// The tunnel server's answer: its response head and the stream carrying the body.
pub struct Answer {
    pub head: ResponseHead,
    pub stream: ResponseFrames,
    pub server_id: Arc<str>,
}

pub struct Forwarder {
    pub channels: Channels,
    pub metrics: Metrics,
    /// For per-call feedback (NO_CAPACITY answers) to the router.
    pub routes: Arc<Routes>,
    pub rules: RetryRules,
    pub max_attempts: usize,
    /// Request body bytes kept for a retry (`replay::replay_limit` of the forward stream
    /// window): enough that a call waiting in a queue stays replayable.
    pub replay_limit: usize,
}

/// A failed call and the server that gave the last answer, if any was tried.
pub type Failed = (Failure, Option<Arc<str>>);

impl Forwarder {
    /// Forwards the call to the picked servers in order, retrying while the rules in the
    /// module docs allow. The caller bounds this with the call's deadline.
    pub async fn forward(
        &self,
        plan: &CallPlan,
        body: &RequestBody,
        pick: &Pick,
    ) -> Result<Answer, Failed> {
        let mut last = Failure::new(
            ErrorCode::TunnelUnavailable,
            "no tunnel server holds streams for this tunnel id",
        );
        let mut last_server = None;
        // The router's order, with the co-located server (if picked) moved to the front.
        let local = match self.channels.local {
            Some(_) => pick
                .servers
                .iter()
                .position(|t| self.channels.is_local(&t.forward_url)),
            None => None,
        };
        let nth = |n: usize| -> Option<&Target> {
            let i = match local {
                Some(l) if n == 0 => l,
                Some(l) if n <= l => n - 1,
                _ => n,
            };
            pick.servers.get(i)
        };
        for attempt in 0..self.max_attempts {
            let Some(target) = nth(attempt) else { break };
            if attempt > 0 {
                if !body.replayable() {
                    debug!(
                        call_id = plan.call_id, tunnel_id = %plan.tunnel_id,
                        "not retrying: request body already sent beyond replay"
                    );
                    break;
                }
                self.metrics.retries.inc();
                info!(call_id = plan.call_id, tunnel_id = %plan.tunnel_id, server_id = %target.server_id, reason = %last.message, "retrying on another tunnel server");
            }
            self.metrics
                .routing_decisions
                .with_label_values(&[&*target.server_id])
                .inc();
            last_server = Some(target.server_id.clone());
            match self.attempt(plan, body, target, attempt as u32).await {
                Ok(answer) => return Ok(answer),
                Err((failure, retry)) => {
                    if retry == Retry::NoCapacity {
                        self.routes
                            .note_no_capacity(&plan.tunnel_id, &target.server_id);
                    }
                    let may = self.rules.allows(retry, &plan.method, nth(attempt + 1));
                    debug!(call_id = plan.call_id, tunnel_id = %plan.tunnel_id, server_id = %target.server_id, code = failure.code.as_str(), ?retry, may, "forward attempt failed");
                    last = failure;
                    if !may {
                        break;
                    }
                }
            }
        }
        Err((last, last_server))
    }

    /// A call whose connection broke leaves that connection behind: the next call to the
    /// server goes on another one, or dials again. A broken connection is not torn down at
    /// once (its other streams are still failing), and a call put on it meanwhile fails
    /// after it left, as `stream_lost`, where a new dial fails before anything left (a
    /// refused connection, safe to retry elsewhere) or reaches the server's new process. So
    /// a caller whose call was lost with its server's connection never loses a second one
    /// there.
    /// A dead path (a dial that failed, a connection silent past its keep-alive) also
    /// marks the server down (`pool`): the next calls go to other servers at once.
    fn forget_broken(&self, hop: &Hop, conn: Option<ConnId>, status: &tonic::Status) {
        let Hop::Remote(remote) = hop else { return };
        if let Some(conn) = conn {
            if Retry::connection_lost(status) {
                remote.forget(conn);
            }
        }
        if let Some(why) = Retry::path_dead(status) {
            remote.mark_down(why);
        }
    }

    async fn attempt(
        &self,
        plan: &CallPlan,
        body: &RequestBody,
        route: &Target,
        attempt: u32,
    ) -> Result<Answer, (Failure, Retry)> {
        let unreachable = |why: String| {
            Failure::new(
                ErrorCode::TunnelServerUnreachable,
                format!("tunnel server {}: {why}", route.server_id),
            )
        };
        let hop = self
            .channels
            .get(&route.forward_url)
            .map_err(|e| (unreachable(e.to_string()), Retry::Safe))?;
        let remaining = plan.deadline.saturating_duration_since(Instant::now());
        let head = || {
            ForwardRequest::of(ReqKind::Head(CallHead {
                tunnel_id: plan.tunnel_id.clone(),
                request: Some(RequestHead {
                    call_id: plan.call_id,
                    method: plan.method.clone(),
                    path_and_query: plan.path_and_query.clone(),
                    headers: plan.headers.clone(),
                    // At least 1 ms: 0 would mean "no deadline" on the wire.
                    deadline_ms: u32::try_from(remaining.as_millis())
                        .unwrap_or(u32::MAX)
                        .max(1),
                    end_of_stream: plan.end_of_stream,
                    // A small whole body may be put here by the attempt's stream, for a
                    // server that reads it here (`replay::AttemptStream`).
                    body: Default::default(),
                }),
                queue_handshake: true,
            }))
        };
        let request = body.attempt(attempt, head());
        // A call lost after it left: safe to retry only while it waited in the server's
        // queue (the queue handshake below), otherwise it may have reached the agent.
        let lost = |queued: bool, what: String| {
            if queued {
                (
                    Failure::new(
                        ErrorCode::TunnelServerUnreachable,
                        format!(
                            "tunnel server {} {what} while the call waited in its queue",
                            route.server_id
                        ),
                    ),
                    Retry::Safe,
                )
            } else {
                (
                    Failure::new(
                        ErrorCode::StreamLost,
                        format!(
                            "tunnel server {} {what} before the response head; the call may have reached the agent, so it was not retried",
                            route.server_id
                        ),
                    ),
                    Retry::MaybeStarted,
                )
            }
        };
        let called = match &hop {
            Hop::Remote(remote) => {
                // A server without carriers: this call and the next ones go as
                // `Forward.Call`, the request replayed from its start.
                let replay = || body.replayable().then(|| body.attempt(attempt, head()));
                remote
                    .call(request, replay, &self.metrics.carriers_opened)
                    .await
                    .map(|(frames, conn)| (frames, Some(conn)))
            }
            Hop::Local(server) => {
                // The tunnel server in this process reads a body inside the head.
                let mut request = request;
                request.inline_body();
                server
                    .call(request.boxed())
                    .await
                    .map(|frames| (frames, None))
                    .map_err(|status| (status, None))
            }
        };
        let (mut stream, conn) = match called {
            Ok(called) => called,
            Err((status, conn)) => {
                self.forget_broken(&hop, conn, &status);
                let why =
                    relay_proto::escape_message(status.message(), relay_proto::MAX_PEER_MESSAGE);
                // The co-located server's statuses carry no transport error: its own word.
                return Err(match Retry::of_call_error(&status) {
                    Retry::MaybeStarted => lost(false, format!("went away ({why})")),
                    retry => (unreachable(why), retry),
                });
            }
        };
        // The queue handshake: between the server's `Queued` and our `Proceed` no agent
        // can have seen the call, so losing the server then is safe to retry.
        let mut stage = Stage::Sent;
        loop {
            let kind = match stream.next().await.transpose() {
                Ok(Some(ForwardResponse { kind: Some(kind) })) => kind,
                Ok(Some(ForwardResponse { kind: None })) => {
                    return Err((
                        Failure::new(ErrorCode::StreamLost, "tunnel server sent an empty frame"),
                        if stage == Stage::Queued {
                            Retry::Safe
                        } else {
                            Retry::Never
                        },
                    ))
                }
                Ok(None) => return Err(lost(stage == Stage::Queued, "ended the call".into())),
                // A carrier the server ended between calls: it never took this one.
                Err(status) if carrier::not_taken(&status) => {
                    return Err((unreachable(status.message().to_string()), Retry::Safe))
                }
                Err(status) => {
                    self.forget_broken(&hop, conn, &status);
                    return Err(lost(
                        stage == Stage::Queued,
                        format!(
                            "went away ({})",
                            relay_proto::escape_message(
                                status.message(),
                                relay_proto::MAX_PEER_MESSAGE
                            )
                        ),
                    ));
                }
            };
            match kind {
                RespKind::Head(head) => {
                    // Never retried from here: the frames kept for a retry can go.
                    body.settle();
                    return Ok(Answer {
                        head,
                        stream,
                        server_id: route.server_id.clone(),
                    });
                }
                RespKind::Error(e) => {
                    let (failure, retry) = Failure::from_forward_error(&e);
                    // The server ends the RPC right after its error: read that end rather
                    // than resetting a stream the server is still closing.
                    crate::response::finish_rpc(&mut stream).await;
                    return Err((failure, retry));
                }
                RespKind::Queued(_) if stage == Stage::Sent => {
                    self.metrics.queued.inc();
                    stage = Stage::Queued;
                }
                RespKind::Reserved(r) if stage == Stage::Queued => {
                    // From here on the call may reach the agent, whatever the RPC's fate.
                    stage = Stage::Proceeded;
                    let proceeded = match &hop {
                        Hop::Remote(remote) => {
                            remote.proceed(r.reservation).await.map_err(|(s, _)| s)
                        }
                        Hop::Local(server) => server.proceed(r.reservation),
                    };
                    if let Err(status) = proceeded {
                        // The call's own stream tells how it ended.
                        debug!(call_id = plan.call_id, tunnel_id = %plan.tunnel_id, server_id = %route.server_id, %status, "proceed failed");
                    }
                }
                RespKind::Body(_) | RespKind::Queued(_) | RespKind::Reserved(_) => {
                    return Err((
                        Failure::new(
                            ErrorCode::StreamLost,
                            "tunnel server broke the forward protocol before the response head",
                        ),
                        if stage == Stage::Queued {
                            Retry::Safe
                        } else {
                            Retry::Never
                        },
                    ))
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target(idle: u32) -> Target {
        Target {
            server_id: "s2".into(),
            forward_url: "http://127.0.0.1:1".into(),
            idle,
        }
    }

    /// The retry table: each failure's [`Retry`] against the configuration, the method and
    /// the next server the router picked.
    #[test]
    fn retry_table_of_rules() {
        use RoutingPolicy::{Available, Sticky};
        let rules = |policy, retry_idempotent| RetryRules {
            policy,
            retry_idempotent,
        };
        let (idle, busy) = (target(3), target(0));
        let cases: [(RetryRules, Retry, &str, Option<&Target>, bool); 14] = [
            // Never reached an agent: always to the next server.
            (rules(Sticky, false), Retry::Safe, "POST", Some(&busy), true),
            (rules(Available, false), Retry::Safe, "POST", None, true),
            // NO_CAPACITY: only under `available`, only onto a server with idle streams.
            (
                rules(Available, false),
                Retry::NoCapacity,
                "POST",
                Some(&idle),
                true,
            ),
            (
                rules(Available, false),
                Retry::NoCapacity,
                "POST",
                Some(&busy),
                false,
            ),
            (
                rules(Available, false),
                Retry::NoCapacity,
                "POST",
                None,
                false,
            ),
            (
                rules(Sticky, true),
                Retry::NoCapacity,
                "GET",
                Some(&idle),
                false,
            ),
            // May have started: idempotent methods, when configured.
            (
                rules(Sticky, true),
                Retry::MaybeStarted,
                "GET",
                Some(&idle),
                true,
            ),
            (
                rules(Sticky, true),
                Retry::MaybeStarted,
                "DELETE",
                None,
                true,
            ),
            (
                rules(Sticky, true),
                Retry::MaybeStarted,
                "POST",
                Some(&idle),
                false,
            ),
            (
                rules(Sticky, true),
                Retry::MaybeStarted,
                "PATCH",
                Some(&idle),
                false,
            ),
            (
                rules(Available, false),
                Retry::MaybeStarted,
                "GET",
                Some(&idle),
                false,
            ),
            // Final.
            (
                rules(Available, true),
                Retry::Never,
                "GET",
                Some(&idle),
                false,
            ),
            (rules(Sticky, true), Retry::Never, "PUT", Some(&idle), false),
            (rules(Available, false), Retry::Never, "POST", None, false),
        ];
        for (rules, retry, method, next, want) in cases {
            assert_eq!(
                rules.allows(retry, method, next),
                want,
                "{rules:?} {retry:?} {method} next idle {:?}",
                next.map(|n| n.idle)
            );
        }
    }
}
