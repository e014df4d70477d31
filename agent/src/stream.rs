//! One tunnel stream: dial (`Tunnel.Connect` with the bearer token on a cached per-endpoint
//! channel), wait for the `ServerHello`, then serve calls one at a time while answering
//! pings, honouring Cancel and Drain, watching the heartbeat, and retiring with the
//! GoingAway handshake when the actor says so.
//!
//! The stream task reports to the sizing actor through `StreamLink` events and never
//! decides sizing itself. It never panics on peer input: a frame that breaks the protocol
//! closes this stream only, with a log line. The call itself (upstream request, response
//! frames, terminal frame) is `call.rs`.
//!
//! Heartbeat: the silence rule (no frame for three `heartbeat_ms` periods) applies while
//! the stream is idle. The server pings idle streams; a busy stream is bounded by its
//! call's deadline and by HTTP/2 keepalive on the connection instead, so a long download
//! is not cut for lack of pings.
//!
//! This file holds the stream task (`run_stream`: open, hello, landing, close) and the
//! open itself; `dial` holds the endpoints and their connections, `session` the landed
//! stream serving calls.

use crate::call::{call_error, run_call, CallContext, FrameTx};
use crate::coverage::{CloseReason, Connector, Landing, StreamEvent, StreamLink};
use crate::error::OpenError;
use crate::metrics::{AgentMetrics, CallOutcome, OpenResult};
use crate::upstream::RequestBody;
use bytes::Bytes;
use futures::future::BoxFuture;
use parking_lot::Mutex;
use relay_common::config::ConfigError;
use relay_common::grpc::{GrpcClient, PeerAddr};
use relay_common::hosts::{Host, HostRule};
use relay_common::Secret;
use relay_proto::agent_frame::Kind as Out;
use relay_proto::server_frame::Kind as In;
use relay_proto::tunnel_client::TunnelClient;
use relay_proto::{
    AgentFrame, CallErrorKind, GoingAway, Pong, RequestHead, ServerFrame, ServerHello,
};
use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::time::{Instant, Sleep};
use tonic::metadata::{Ascii, MetadataValue};
use tonic::transport::{Channel, Endpoint};
use tonic::Streaming;
use tracing::{debug, info, warn, Instrument};

mod dial;
mod session;
mod window;

pub(crate) use dial::Picked;
use dial::*;
pub use dial::{ChannelId, ConnSlot, Dialer};
use session::*;
pub use window::{OpenTurn, OpenWindow};

/// Frames buffered towards tonic per stream; beyond this HTTP/2 flow control pushes back.
const OUTBOUND_FRAMES: usize = 4;
/// Request body chunks buffered towards the upstream per call.
const BODY_CHUNKS: usize = 4;
/// How long a retired, idle stream waits for the server to close it before closing itself.
const RETIRE_LINGER: Duration = Duration::from_secs(10);

/// What this agent lists in `relay_proto::AGENT_FEATURES` (`relay_proto::FEATURE_FLEET`,
/// `relay_proto::FEATURE_INLINE_BODY`).
const FEATURES: &str = "fleet,inline-body";

/// Everything a stream task needs, shared by all of them.
pub struct StreamContext {
    pub dialer: Dialer,
    /// Upstream client, accept policy, limits and deadlines for the calls.
    pub calls: Arc<CallContext>,
    pub metrics: AgentMetrics,
    /// Bound on dial + hello.
    pub connect_timeout: Duration,
    /// Places to open a stream (`max_opening`, adapted: [`window`]): an open holds one
    /// from dial to hello.
    pub opens: Arc<OpenWindow>,
    /// The paths to servers that prove them alive (`crate::liveness`).
    pub paths: crate::liveness::Paths,
}

/// The real `Connector`: each open is a stream task running `run_stream`.
#[derive(Clone)]
pub struct TunnelConnector(pub Arc<StreamContext>);

impl Connector for TunnelConnector {
    fn open(&self, link: StreamLink) -> BoxFuture<'static, ()> {
        Box::pin(run_stream(self.0.clone(), link))
    }
}

/// One stream task, from dial to close. Reports `Landed` then `Closed`, or `OpenFailed`.
///
/// The task lives as long as the stream, so its future is what a stream costs the agent
/// for its whole life. The open (`land`) runs in a box of its own, freed once the stream
/// lands: the RPC's call, the dial and the timers (about 2 KB) would otherwise size the
/// task. And this is an `async` block over the arguments, not an `async fn`, which keeps
/// its arguments twice (and here a third time, in the instrumented block inside it). The
/// task was 3,712 bytes before both, 1,240 after (with the session's own, `Session::run`).
// Not an `async fn`: see above.
#[allow(clippy::manual_async_fn)]
pub fn run_stream(
    ctx: Arc<StreamContext>,
    mut link: StreamLink,
) -> impl Future<Output = ()> + Send + 'static {
    let span = tracing::info_span!("tunnel_stream", stream = link.id);
    async move {
        // The session's future is made in the arm, so that neither the landing nor the
        // session it moved into the future keep a slot beside it.
        let (run, landing, channel_id, endpoint_key, through, _slot) =
            match Box::pin(land(&ctx, &link)).await {
                Some(landed) => {
                    let Landed {
                        session,
                        landing,
                        channel_id,
                        endpoint_key,
                        through,
                        _slot,
                    } = landed;
                    link.emit(StreamEvent::Landed(landing.clone()));
                    (
                        session.run(&mut link),
                        landing,
                        channel_id,
                        endpoint_key,
                        through,
                        _slot,
                    )
                }
                None => return,
            };
        let reason = run.await;
        if matches!(reason, CloseReason::HeartbeatMissed | CloseReason::Silent) {
            ctx.dialer.evict(channel_id);
            if through {
                ctx.dialer.endpoint_failed(&endpoint_key);
            }
        }
        match &reason {
            CloseReason::Malformed(_) => {
                warn!(server_id = %landing.server_id, %reason, "closing tunnel stream")
            }
            CloseReason::ServerClosed | CloseReason::Retired => {
                debug!(server_id = %landing.server_id, %reason, "tunnel stream closed")
            }
            _ => info!(server_id = %landing.server_id, %reason, "tunnel stream closed"),
        }
        link.emit(StreamEvent::Closed(reason));
    }
    .instrument(span)
}

/// A stream that got its hello: the session to run, and what its end needs.
struct Landed<F> {
    session: Session<F>,
    landing: Landing,
    channel_id: dial::ChannelId,
    endpoint_key: String,
    /// Opened through one of `tunnels` (not a server's direct URL).
    through: bool,
    /// The stream's place on its connection, held for its life.
    _slot: dial::ConnSlot,
}

/// The open, from the wait for a place in the open window to the hello; `None` when it
/// failed (reported as `OpenFailed`).
async fn land(
    ctx: &Arc<StreamContext>,
    link: &StreamLink,
) -> Option<Landed<impl Future<Output = CallOutcome> + Send + use<>>> {
    // A retire signal during the open is not acted on until the hello: the server may
    // already count this stream as idle and hand it a call, so it retires with the
    // GoingAway handshake like any other (bounded by connect_timeout).
    // Wait for a place in the open window (`max_opening`, narrowed while hellos time out:
    // `window`), so a big growth step goes out in waves.
    let mut turn = ctx.opens.turn().await;
    // Through one of `tunnels` (not a server's direct URL): its health is tracked.
    let through = link.target.is_none();
    let picked = match &link.target {
        Some(url) => ctx.dialer.pick_direct(url).map_err(|refusal| {
            if let DirectRefusal::Host(_) = &refusal {
                ctx.metrics.direct_urls_refused.inc();
            }
            OpenError::Other(refusal.into_message())
        }),
        None => Ok(ctx.dialer.pick()),
    };
    let Picked {
        endpoint,
        channel,
        id: channel_id,
        name: conn_name,
        peer,
        slot,
        landed: conn_landed,
    } = match picked {
        Ok(p) => p,
        Err(e) => {
            drop(turn);
            open_failed(ctx, link, e);
            return None;
        }
    };
    let endpoint_key = endpoint.clone();
    let started = Instant::now();
    // Past the window's timeout the open stops holding its place, and the actor stops
    // crediting it against growth (`window`, `StreamEvent::Stalled`).
    let opened = turn
        .during(
            tokio::time::timeout(
                ctx.connect_timeout,
                open(
                    &ctx.dialer,
                    endpoint,
                    channel,
                    Some(&conn_name),
                    link.steer.as_ref(),
                ),
            ),
            || {
                ctx.metrics.open_stalls.inc();
                link.emit(StreamEvent::Stalled);
            },
        )
        .await;
    // An open that did not reach a server pauses its endpoint; with another endpoint
    // open, that is no reason to hold back every open (`OpenError::Endpoint`).
    let unreached = |e: String| {
        if through && ctx.dialer.endpoint_failed(&endpoint_key) {
            OpenError::Endpoint(e)
        } else {
            OpenError::Other(e)
        }
    };
    let (out, inbound, hello) = match opened {
        Ok(Ok(x)) => {
            ctx.dialer.landed(&conn_landed);
            turn.landed();
            x
        }
        Ok(Err(OpenError::Other(e))) => {
            drop(turn);
            open_failed(ctx, link, unreached(e));
            return None;
        }
        Ok(Err(e)) => {
            drop(turn);
            // A server answered (refused the token, or at its cap): reachable.
            if through {
                ctx.dialer.endpoint_ok(&endpoint_key);
            }
            open_failed(ctx, link, e);
            return None;
        }
        Err(_) => {
            turn.timed_out();
            let e = "timed out waiting for the server hello".to_string();
            if ctx.dialer.landed_since(&conn_landed, started)
                || ctx.paths.heard_since(channel_id.generation, started)
            {
                // Other opens landed on this connection meanwhile, or its streams heard
                // their servers: it is alive, the servers behind it are busy. Keep it and
                // its endpoint; the narrower window is the answer.
                open_failed(ctx, link, OpenError::Busy(e));
                return None;
            }
            // The connection may be dead without knowing it: dial afresh next time.
            ctx.dialer.evict(channel_id);
            open_failed(ctx, link, unreached(e));
            return None;
        }
    };
    if through {
        ctx.dialer.endpoint_ok(&endpoint_key);
    }
    ctx.metrics.stream_opened(OpenResult::Landed);
    let landing = Landing {
        server_id: hello.server_id,
        instance_id: hello.instance_id,
        direct_url: hello.direct_url,
        zone: hello.zone,
        server_stream_id: hello.stream_id,
        heartbeat: Duration::from_millis(u64::from(hello.heartbeat_ms)),
        tunnel_id: hello.tunnel_id,
    };
    // A server that pings this connection for liveness: the stream joins its path.
    let path = (hello.liveness_ms > 0).then(|| {
        ctx.paths.join(
            channel_id.generation,
            &landing.server_id,
            &landing.instance_id,
            Duration::from_millis(u64::from(hello.liveness_ms)),
        )
    });
    debug!(server_id = %landing.server_id, server_stream = landing.server_stream_id, "landed");
    let credit = (hello.response_credit > 0).then_some(Credit {
        response: hello.response_credit,
        request: ctx.dialer.request_credit,
    });
    // The connection the hello came on: its remote address is what `$tunnel_peer` stands
    // for in the calls this stream serves.
    let tunnel_peer = peer.get().map(|a| a.ip());
    let session = Session::new(
        ctx.clone(),
        link,
        out,
        inbound,
        Terms {
            heartbeat: landing.heartbeat,
            path,
            credit,
        },
        run_call,
    )
    .with_tunnel_peer(tunnel_peer);
    Some(Landed {
        session,
        landing,
        channel_id,
        endpoint_key,
        through,
        _slot: slot,
    })
}

fn open_failed(ctx: &StreamContext, link: &StreamLink, e: OpenError) {
    let result = match e {
        OpenError::Unauthenticated(_) => OpenResult::Unauthenticated,
        OpenError::Exhausted(..) => OpenResult::Exhausted,
        OpenError::Other(_) | OpenError::Endpoint(_) | OpenError::Busy(_) => OpenResult::Error,
    };
    ctx.metrics.stream_opened(result);
    debug!(error = %e, "tunnel stream open failed");
    link.emit(StreamEvent::OpenFailed(e));
}

/// A tunnel server's words (a status message) as they may enter a log line, an error or
/// `relay-agent check`'s table: control characters (newlines, ANSI escapes) escaped and
/// cut to `MAX_PEER_MESSAGE` characters, so a server cannot forge log lines.
pub(crate) fn server_text(message: &str) -> String {
    relay_proto::escape_message(message, relay_proto::MAX_PEER_MESSAGE)
}

fn status_to_open_error(s: &tonic::Status) -> OpenError {
    let message = server_text(s.message());
    match s.code() {
        tonic::Code::Unauthenticated => OpenError::Unauthenticated(message),
        tonic::Code::ResourceExhausted => {
            let md = s.metadata();
            // Names that reach log lines and plans: only printable ones.
            let name = |k: &str| {
                md.get(k)
                    .and_then(|v| v.to_str().ok())
                    .filter(|v| relay_common::server_id::is_valid(v))
                    .map(str::to_string)
            };
            let refused = name("relay-server-id").map(|server_id| crate::error::Refused {
                server_id,
                instance_id: name("relay-instance-id").unwrap_or_default(),
                cap: md
                    .get("relay-max-streams")
                    .and_then(|v| v.to_str().ok())
                    .and_then(|c| c.parse().ok()),
            });
            OpenError::Exhausted(message, refused)
        }
        code => OpenError::Other(format!("{code:?}: {message}")),
    }
}

/// Opens `Tunnel.Connect` on `channel` with the dialer's token and waits for the hello.
/// Also used by `relay-agent check` (`crate::check`), which then retires the stream at once.
pub(crate) async fn open(
    dialer: &Dialer,
    endpoint: String,
    channel: Channel,
    conn_name: Option<&str>,
    steer: Option<&MetadataValue<Ascii>>,
) -> Result<(FrameTx, Streaming<ServerFrame>, ServerHello), OpenError> {
    let (tx, rx) = relay_common::outbox::outbox(OUTBOUND_FRAMES);
    let tx = Arc::new(tx);
    let mut request = tonic::Request::new(rx);
    request
        .metadata_mut()
        .insert("authorization", dialer.auth.clone());
    // Fleet news: this agent understands `Fleet` frames; and request heads that carry a
    // small body whole (`RequestHead.body`).
    request.metadata_mut().insert(
        relay_proto::AGENT_FEATURES,
        tonic::metadata::MetadataValue::from_static(FEATURES),
    );
    // The connection's name, so a server can prove it alive end to end (`crate::liveness`).
    if let Some(v) = conn_name.and_then(|n| MetadataValue::try_from(n).ok()) {
        request.metadata_mut().insert(relay_proto::AGENT_CONN, v);
    }
    // The server this open is for, for a load balancer that routes by it.
    if let Some(v) = steer {
        request
            .metadata_mut()
            .insert(relay_proto::AGENT_STEER, v.clone());
    }
    // Body credit both ways (`ServerHello.response_credit`), with this request credit.
    request
        .metadata_mut()
        .insert(relay_proto::AGENT_CREDIT, dialer.request_credit.into());
    // A server's frame over the limit ends the stream before it is decoded: a hostile
    // server cannot make the agent allocate for a huge head.
    let response = TunnelClient::new(channel)
        .max_decoding_message_size(dialer.max_frame_bytes)
        .max_encoding_message_size(dialer.max_frame_bytes)
        .connect(request)
        .await
        .map_err(|s| {
            let e = status_to_open_error(&s);
            debug!(%endpoint, error = %e, "connect refused");
            e
        })?;
    let mut inbound = response.into_inner();
    match inbound.message().await {
        Ok(Some(ServerFrame {
            kind: Some(In::Hello(hello)),
        })) => {
            if hello.protocol_version != relay_proto::PROTOCOL_VERSION {
                return Err(OpenError::Other(format!(
                    "server speaks protocol version {}, this agent speaks {}",
                    hello.protocol_version,
                    relay_proto::PROTOCOL_VERSION
                )));
            }
            // The hello's names reach log lines and metric labels: only printable ones.
            let names = [
                ("server_id", &hello.server_id, false),
                ("zone", &hello.zone, true),
                ("instance_id", &hello.instance_id, true),
            ];
            for (field, value, may_be_empty) in names {
                let allowed =
                    relay_common::server_id::is_valid(value) || (may_be_empty && value.is_empty());
                if !allowed {
                    return Err(OpenError::Other(format!(
                        "ServerHello.{field} is not {}",
                        relay_common::server_id::RULE
                    )));
                }
            }
            Ok((tx, inbound, hello))
        }
        Ok(Some(_)) => Err(OpenError::Other(
            "first frame from the server was not a ServerHello".into(),
        )),
        Ok(None) => Err(OpenError::Other(
            "server ended the stream before its hello".into(),
        )),
        Err(s) => Err(status_to_open_error(&s)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dialer(urls: &[&str]) -> Dialer {
        let urls: Vec<String> = urls.iter().map(|u| u.to_string()).collect();
        Dialer::new(
            &urls,
            &Secret::new("t"),
            Duration::from_secs(1),
            relay_common::h2::H2Limits::TUNNEL,
            None,
        )
        .unwrap()
    }

    fn picks(d: &Dialer, n: usize) -> std::collections::BTreeSet<String> {
        (0..n).map(|_| d.pick().endpoint).collect()
    }

    #[tokio::test(start_paused = true)]
    async fn an_unreachable_endpoint_is_left_out_of_opens_for_a_growing_pause() {
        let (a, b) = ("http://127.0.0.1:1/", "http://127.0.0.1:2/");
        let d = dialer(&[a, b]);
        assert_eq!(picks(&d, 50).len(), 2, "both endpoints take opens");
        assert!(d.endpoint_failed(a), "the other endpoint is open");
        assert_eq!(picks(&d, 50), [b.to_string()].into(), "paused 250 ms");
        tokio::time::advance(ENDPOINT_PAUSE_FIRST).await;
        assert!(picks(&d, 50).contains(a), "tried again after its pause");
        assert!(d.endpoint_failed(a));
        tokio::time::advance(ENDPOINT_PAUSE_FIRST).await;
        assert_eq!(
            picks(&d, 50),
            [b.to_string()].into(),
            "a second failure: 500 ms"
        );
        tokio::time::advance(ENDPOINT_PAUSE_FIRST).await;
        d.endpoint_ok(a);
        assert_eq!(picks(&d, 50).len(), 2, "a landing clears the pause");
    }

    #[tokio::test(start_paused = true)]
    async fn with_every_endpoint_paused_the_one_paused_first_ends_first() {
        let (a, b) = ("http://127.0.0.1:1/", "http://127.0.0.1:2/");
        let d = dialer(&[a, b]);
        assert!(d.endpoint_failed(b));
        tokio::time::advance(Duration::from_millis(10)).await;
        assert!(!d.endpoint_failed(a), "no endpoint is open");
        assert_eq!(picks(&d, 20), [b.to_string()].into());
        // One endpoint alone is never paused away.
        let single = dialer(&[a]);
        assert!(!single.endpoint_failed(a));
        assert_eq!(picks(&single, 5), [a.to_string()].into());
    }

    #[test]
    fn the_agent_lists_the_features_it_reads() {
        let listed: Vec<&str> = relay_proto::features(super::FEATURES).collect();
        assert_eq!(
            listed,
            [relay_proto::FEATURE_FLEET, relay_proto::FEATURE_INLINE_BODY]
        );
    }
}
