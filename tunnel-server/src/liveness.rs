//! Liveness of agent connections, across load balancers.
//!
//! HTTP/2 PINGs (`[agent_h2] keepalive_*`) prove a TCP connection alive, but behind an L7
//! load balancer the connection this server holds ends at the balancer, which answers the
//! PINGs itself: an agent whose own path to the balancer went silent still looks alive
//! here, and the calls it had taken would hang until their deadlines. So an agent names the
//! connection each stream is on (`relay-agent-conn` metadata, [`relay_proto::AGENT_CONN`]),
//! and this server proves each named connection alive end to end, at a cost per
//! connection and not per stream:
//!
//! - every `liveness_interval`, each connection gets one `Ping` on one of its streams that
//!   is *clear* (the agent answers every ping with a `Pong`). Every interval, not only when
//!   the agent was silent: the pings are also how the agent knows this server is alive
//!   (`relay_agent::liveness`), and the agent may be sending (a long download, say) while
//!   this server has nothing to send it. Clear ([`StreamHandle::is_probe_clear`]): nothing but the path can hold the
//!   ping or its answer back. An idle stream is; so is a busy one whose call went to the
//!   agent whole in its head (the agent reads such a stream freely, where a streaming
//!   upload can make it stop reading) while this server's reader is not waiting for the
//!   caller to take the answer (then the agent's frames wait here). Under load, with every
//!   stream busy, the calls' own streams carry the pings;
//! - any frame from any stream of the connection is proof of life;
//! - a ping that goes `liveness_timeout` without any frame from the connection while the
//!   stream it went on is still clear closes every stream of the connection: the calls on
//!   them end at once as `stream_lost`, and the tunnel id moves to the agent's other
//!   streams or servers. A ping whose stream stopped being clear meanwhile proves nothing
//!   either way: another is sent.
//!
//! A connection with no clear stream is not pinged (HTTP/2 PINGs, where no balancer is in
//! between, are what is left to go on). The rules are the pure
//! [`judge`]; [`run`] applies them, and the stream readers ([`crate::stream`]) report
//! frames ([`AgentConn::seen`]) and the streams joining and leaving.
//!
//! This module must not end calls itself: closing a stream hands its call to the reader.

use crate::handle::StreamHandle;
use dashmap::DashMap;
use parking_lot::Mutex;
use relay_proto::{server_frame, Ping, ServerFrame};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::time::{Instant, MissedTickBehavior};
use tokio_util::sync::CancellationToken;
use tracing::info;

/// Liveness pings carry sequence numbers with the top bit set, apart from the stream
/// readers' own heartbeat pings.
const SEQ_BASE: u64 = 1 << 63;

/// `[liveness]`: how often a silent agent connection is pinged, and how long the ping may
/// go unanswered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Settings {
    pub interval: Duration,
    pub timeout: Duration,
}

/// A connection's key: the token's digest (a connection name never reaches across
/// tokens) and the name the agent gave it.
type Key = ([u8; 32], Box<str>);

/// The named agent connections holding streams here.
pub struct Conns {
    settings: Settings,
    map: DashMap<Key, Arc<AgentConn>>,
    epoch: Instant,
    next_seq: AtomicU64,
    /// `relay_tunnel_silent_connections_total`.
    closed: prometheus::IntCounter,
}

/// One named agent connection: its streams here and when it was last heard.
pub struct AgentConn {
    key: Key,
    epoch: Instant,
    /// Milliseconds since `epoch` of the last frame from any of its streams.
    last_seen_ms: AtomicU64,
    state: Mutex<ConnState>,
}

#[derive(Default)]
struct ConnState {
    streams: Vec<Arc<StreamHandle>>,
    probe: Option<Probe>,
    /// Milliseconds since the epoch when the last ping went out.
    pinged_ms: Option<u64>,
}

/// An unanswered liveness ping.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Probe {
    /// The stream it went on.
    pub stream: u64,
    /// Milliseconds since the epoch when it was sent.
    pub sent_ms: u64,
}

/// What to do about one connection now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Nothing: heard recently, or the ping has time left.
    Wait,
    /// Heard since the ping (or the ping proves nothing): forget it.
    Clear,
    /// Send a ping on an idle stream.
    Ping,
    /// Silent past the timeout with the pinged stream clear: close the connection's streams.
    Silent,
}

/// The liveness rules for one connection (see the module docs). `probe_idle`: the stream
/// the outstanding ping went on is still on the connection and clear; `pinged_ms`: when
/// the last ping went out.
pub fn judge(
    probe: Option<Probe>,
    probe_idle: bool,
    pinged_ms: Option<u64>,
    last_seen_ms: u64,
    now_ms: u64,
    s: Settings,
) -> Verdict {
    let (interval, timeout) = (s.interval.as_millis() as u64, s.timeout.as_millis() as u64);
    match probe {
        // Heard since the ping, and the next one is due: send it now.
        Some(p) if last_seen_ms >= p.sent_ms => Verdict::Clear,
        Some(p) if now_ms.saturating_sub(p.sent_ms) < timeout => Verdict::Wait,
        Some(_) if probe_idle => Verdict::Silent,
        Some(_) => Verdict::Clear,
        None if pinged_ms.is_none_or(|at| now_ms.saturating_sub(at) >= interval) => Verdict::Ping,
        None => Verdict::Wait,
    }
}

impl Conns {
    pub fn new(settings: Settings, closed: prometheus::IntCounter) -> Self {
        Conns {
            settings,
            map: DashMap::new(),
            epoch: Instant::now(),
            next_seq: AtomicU64::new(SEQ_BASE),
            closed,
        }
    }

    pub fn settings(&self) -> Settings {
        self.settings
    }

    /// Adds `stream` to the connection `name` of the token `token_hash`; `None` when the
    /// name is not a valid one ([`relay_proto::MAX_AGENT_CONN`] printable bytes at most).
    pub fn join(
        &self,
        token_hash: [u8; 32],
        name: &str,
        stream: Arc<StreamHandle>,
    ) -> Option<Arc<AgentConn>> {
        let valid = !name.is_empty()
            && name.len() <= relay_proto::MAX_AGENT_CONN
            && name.bytes().all(|b| b.is_ascii_graphic());
        if !valid {
            return None;
        }
        let key: Key = (token_hash, name.into());
        let conn = self
            .map
            .entry(key.clone())
            .or_insert_with(|| {
                Arc::new(AgentConn {
                    key,
                    epoch: self.epoch,
                    last_seen_ms: AtomicU64::new(self.now_ms()),
                    state: Mutex::default(),
                })
            })
            .clone();
        conn.state.lock().streams.push(stream);
        conn.seen();
        Some(conn)
    }

    /// Takes `stream` off its connection; the connection goes with its last stream.
    pub fn leave(&self, conn: &AgentConn, stream: &StreamHandle) {
        let empty = {
            let mut st = conn.state.lock();
            st.streams.retain(|s| s.id != stream.id);
            st.streams.is_empty()
        };
        if empty {
            self.map
                .remove_if(&conn.key, |_, c| c.state.lock().streams.is_empty());
        }
    }

    fn now_ms(&self) -> u64 {
        Instant::now()
            .saturating_duration_since(self.epoch)
            .as_millis() as u64
    }

    /// Connections known now.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether no connection is known.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// One round of the rules over every connection.
    pub fn check(&self) {
        let now_ms = self.now_ms();
        let conns: Vec<Arc<AgentConn>> = self.map.iter().map(|e| e.value().clone()).collect();
        for conn in conns {
            let last_seen = conn.last_seen_ms.load(Ordering::Relaxed);
            let silent = {
                let mut st = conn.state.lock();
                let probe_idle = st.probe.is_some_and(|p| {
                    st.streams
                        .iter()
                        .any(|s| s.id == p.stream && s.is_probe_clear())
                });
                match judge(
                    st.probe,
                    probe_idle,
                    st.pinged_ms,
                    last_seen,
                    now_ms,
                    self.settings,
                ) {
                    Verdict::Wait => None,
                    Verdict::Clear => {
                        st.probe = None;
                        None
                    }
                    Verdict::Ping => {
                        // An idle stream first; else a busy one that is clear.
                        let idle = st
                            .streams
                            .iter()
                            .find(|s| s.is_idle() && s.is_probe_clear())
                            .or_else(|| st.streams.iter().find(|s| s.is_probe_clear()));
                        if let Some(s) = idle {
                            let seq = self.next_seq.fetch_add(1, Ordering::Relaxed);
                            if s.try_send(ServerFrame::of(server_frame::Kind::Ping(Ping { seq }))) {
                                st.probe = Some(Probe {
                                    stream: s.id,
                                    sent_ms: now_ms,
                                });
                                st.pinged_ms = Some(now_ms);
                            }
                        }
                        None
                    }
                    Verdict::Silent => Some(std::mem::take(&mut st.streams)),
                }
            };
            if let Some(streams) = silent {
                self.map.remove_if(&conn.key, |_, c| Arc::ptr_eq(c, &conn));
                self.closed.inc();
                info!(
                    streams = streams.len(),
                    silence_ms = now_ms.saturating_sub(last_seen),
                    "closing the streams of an agent connection that stopped answering"
                );
                for s in streams {
                    s.close_silent();
                }
            }
        }
    }
}

impl AgentConn {
    /// A frame came from one of the connection's streams.
    pub fn seen(&self) {
        let now = Instant::now()
            .saturating_duration_since(self.epoch)
            .as_millis() as u64;
        self.last_seen_ms.fetch_max(now, Ordering::Relaxed);
    }
}

/// Applies the rules every quarter of `liveness_interval` until `stop`.
pub async fn run(conns: Arc<Conns>, stop: CancellationToken) {
    let every = (conns.settings.interval / 4).max(Duration::from_millis(10));
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(MissedTickBehavior::Skip);
    loop {
        tokio::select! {
            biased;
            _ = stop.cancelled() => return,
            _ = tick.tick() => conns.check(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Settings = Settings {
        interval: Duration::from_secs(1),
        timeout: Duration::from_millis(1500),
    };
    // (The rules' arithmetic in round numbers; the defaults are 750 ms and 2 s.)

    fn probe(sent_ms: u64) -> Option<Probe> {
        Some(Probe { stream: 1, sent_ms })
    }

    #[test]
    fn a_connection_is_pinged_every_interval_heard_or_not() {
        assert_eq!(judge(None, false, None, 1_000, 1_000, S), Verdict::Ping);
        assert_eq!(
            judge(None, false, Some(1_000), 1_900, 1_999, S),
            Verdict::Wait
        );
        assert_eq!(
            judge(None, false, Some(1_000), 1_900, 2_000, S),
            Verdict::Ping
        );
    }

    #[test]
    fn any_frame_after_the_ping_clears_it() {
        let at = Some(5_000);
        assert_eq!(
            judge(probe(5_000), true, at, 5_000, 9_000, S),
            Verdict::Clear
        );
        assert_eq!(
            judge(probe(5_000), true, at, 5_300, 5_301, S),
            Verdict::Clear
        );
    }

    #[test]
    fn an_unanswered_ping_on_a_clear_stream_is_silence_at_the_timeout() {
        let at = Some(5_000);
        assert_eq!(
            judge(probe(5_000), true, at, 4_000, 6_499, S),
            Verdict::Wait
        );
        assert_eq!(
            judge(probe(5_000), true, at, 4_000, 6_500, S),
            Verdict::Silent
        );
    }

    #[test]
    fn a_ping_whose_stream_stopped_being_clear_proves_nothing() {
        let at = Some(5_000);
        assert_eq!(
            judge(probe(5_000), false, at, 4_000, 6_500, S),
            Verdict::Clear
        );
    }

    /// Checks every 250 ms from 0 with the last frame at `last_frame`: when silence is
    /// found, if it is.
    fn found_after(last_frame: u64) -> Option<u64> {
        let (mut probe_at, mut pinged) = (None, None);
        for now in (0..10_000).step_by(250) {
            match judge(probe_at, true, pinged, last_frame.min(now), now, S) {
                Verdict::Ping => {
                    probe_at = probe(now);
                    pinged = Some(now);
                }
                Verdict::Clear => probe_at = None,
                Verdict::Silent => return Some(now),
                Verdict::Wait => {}
            }
        }
        None
    }

    #[test]
    fn silence_is_found_within_interval_plus_timeout_of_the_last_frame() {
        // Pings at 0, 1 s, 2 s...: the last frame at 1.1 s answers the one at 1 s; the
        // one at 2 s goes unanswered and is found at 3.5 s.
        assert_eq!(found_after(1_100), Some(3_500));
        // A frame at each check (the agent is there): never silent.
        assert_eq!(found_after(u64::MAX), None);
    }
}
