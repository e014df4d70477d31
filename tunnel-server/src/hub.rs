//! The hub: every tunnel id's streams on this server. It is the shell around one
//! [`Slots`] state machine per tunnel id (the idle stack, the queue, the leases; the rules
//! are in `crate::slots`): it holds them in a `DashMap`, feeds them the facts they need
//! (the time, whether a stream can take a call) and carries out their decisions: wakes a
//! waiting call with its stream through a oneshot, closes streams, sends drain, fleet and
//! pressure frames, and keeps the per tunnel id gauges and the queue-wait histogram.
//!
//! A taken stream is a [`Lease`]: dropping it gives the stream back to the tunnel it came
//! from, so a stream goes back exactly once, however its call ended.
//!
//! Locking: the tunnel map is a `DashMap`; each tunnel's slots sit behind a short sync
//! `Mutex`, never held across `.await`. Lock order is map shard, then slots, then a
//! stream's own state: adding the first stream and removing the last one both hold the
//! shard so a tunnel entry is never orphaned.
//!
//! RTT: the hub keeps one smoothed round-trip time per tunnel id, fed by the stream readers
//! from the heartbeat ping -> pong round trip of idle streams (see [`Rtt`]). Measuring on the
//! server rather than in the agent is a deliberate choice: it is the same round trip the
//! agent would time, it needs no new agent frame, and the figure lives where the load report
//! is built, so the dispatcher gets it without a second source of truth.

use crate::handle::StreamHandle;
use crate::metrics::ServerMetrics;
use crate::slots::{Placed, Slots, Take, WaiterId};
use dashmap::DashMap;
use parking_lot::Mutex;
use relay_proto::{server_frame, Drain, Fleet, FleetMember, Pressure, ServerFrame, TunnelLoad};
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use tokio::sync::{oneshot, Notify};
use tokio::time::Instant;

pub use crate::slots::AddError;

/// How often a standing pressure hint is sent again while calls wait.
pub const PRESSURE_REFRESH: std::time::Duration = std::time::Duration::from_secs(1);

/// One tunnel id's streams here.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct TunnelStatus {
    pub tunnel_id: String,
    /// Every stream of the tunnel id here, retiring ones included.
    pub streams: u32,
    /// Streams that can take a call now.
    pub idle: u32,
    /// Streams carrying a call (or reserved by a queued one).
    pub busy: u32,
    /// Calls waiting for a stream (the queue depth).
    pub queued: u32,
    /// Smoothed ping round trip to the agent's streams, microseconds (0: no sample yet).
    pub rtt_us: u32,
}

pub struct Hub {
    /// Random per process start: this life of the server id (`ServerHello.instance_id`).
    pub instance_id: String,
    tunnels: DashMap<String, Arc<Tunnel>>,
    /// The fleet as each dispatcher last told it (by dispatcher URL), and the union
    /// passed on to agents.
    fleet: Mutex<FleetViews>,
    /// Wakes the reporters when a tunnel id gets its first stream or loses its last.
    pub changed: Notify,
    /// Wakes [`Hub::settled`] when a tunnel id loses its last stream or a call ends.
    settle: Notify,
    /// Counts calls that had to wait in a queue: the pressure hints and the load reports
    /// go out at once when it moves, not at their next period.
    pub queued_calls: tokio::sync::watch::Sender<u64>,
    /// The tunnel ids the pressure round visits: each that had a call queued since its
    /// pressure last settled (none waiting, the agent told none). The round walked every
    /// tunnel id ten times a second, a twentieth of the process running ten servers with
    /// 3,000 tunnel ids each (`Tunnel::pressured` says whether one is listed).
    pressured: Mutex<Vec<Arc<Tunnel>>>,
    draining: AtomicBool,
    next_stream_id: AtomicU64,
    next_call_id: AtomicU64,
    pub limits: Limits,
    pub metrics: ServerMetrics,
}

/// A call holding a stream ([`Hub::call_in_flight`]): counted in
/// `relay_tunnel_calls_in_flight` until dropped, and its end wakes [`Hub::settled`].
pub struct InFlight(Arc<Hub>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.metrics.in_flight.dec();
        self.0.settle.notify_waiters();
    }
}

#[derive(Clone, Debug)]
pub struct Limits {
    pub max_queue_per_tunnel: usize,
    pub max_streams_per_token: usize,
    /// `max_response_headers`: headers an agent's response head may carry.
    pub max_response_headers: usize,
    /// `max_response_header_bytes`: bytes an agent's response head may carry.
    pub max_response_header_bytes: usize,
}

/// One tunnel id's streams here.
pub struct Tunnel {
    pub id: String,
    slots: Mutex<TunnelSlots>,
    rtt: Mutex<Rtt>,
    /// Its `relay_tunnel_calls_queued` series, looked up once: the pressure round sets it
    /// for every tunnel id ten times a second (a label lookup each was a tenth of a
    /// server's CPU with thousands of tunnel ids).
    queued_gauge: prometheus::IntGauge,
    /// Listed in `Hub::pressured`; changed only with `slots` locked.
    pressured: AtomicBool,
}

type Stream = Arc<StreamHandle>;
type TunnelSlots = Slots<Stream, oneshot::Sender<Stream>, Instant>;

impl Tunnel {
    fn new(id: &str, queued: &prometheus::IntGaugeVec) -> Self {
        Tunnel {
            id: id.to_string(),
            slots: Mutex::default(),
            rtt: Mutex::default(),
            queued_gauge: queued.with_label_values(&[id]),
            pressured: AtomicBool::new(false),
        }
    }

    /// Gives a leased stream back.
    fn release(&self, stream: Stream) {
        let mut s = self.slots.lock();
        let usable = stream.is_usable();
        let placed = s.release(stream, usable);
        carry_out(&mut s, placed);
    }
}

/// Carries out where the slots placed a stream. A waiter that is gone (its call ended
/// as the stream came) gives it straight back, to the next waiter or the stack.
fn carry_out(s: &mut TunnelSlots, mut placed: Placed<Stream, oneshot::Sender<Stream>>) {
    loop {
        match placed {
            Placed::Idle => return,
            Placed::Close(h) => return h.close(),
            Placed::Waiter(w, h) => match w.send(h) {
                Ok(()) => return,
                Err(h) => {
                    let usable = h.is_usable();
                    placed = s.release(h, usable);
                }
            },
        }
    }
}

/// A stream taken from the hub for one call (or reserved by a queued one). Dropping it
/// gives the stream back: to the oldest waiting call, on the idle stack, or closed when it
/// can take no call any more.
pub struct Lease {
    tunnel: Arc<Tunnel>,
    stream: Stream,
}

impl Lease {
    pub fn stream(&self) -> &Stream {
        &self.stream
    }
}

impl std::ops::Deref for Lease {
    type Target = StreamHandle;

    fn deref(&self) -> &StreamHandle {
        &self.stream
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.tunnel.release(self.stream.clone());
    }
}

/// Smoothed round-trip time (EWMA) of one tunnel id's streams on this server.
pub use relay_common::rtt::Rtt;

#[derive(Default)]
struct FleetViews {
    by_dispatcher: std::collections::HashMap<String, Vec<FleetMember>>,
    merged: Vec<FleetMember>,
}

#[derive(Debug, PartialEq, Eq)]
pub enum AcquireError {
    UnknownTunnel,
    /// No stream freed before the deadline, or the queue was full.
    NoCapacity(&'static str),
    /// The caller went away while waiting.
    Cancelled,
}

impl Hub {
    pub fn new(limits: Limits, metrics: ServerMetrics) -> Self {
        Hub {
            instance_id: format!("{:016x}", rand::random::<u64>()),
            tunnels: DashMap::new(),
            fleet: Mutex::default(),
            changed: Notify::new(),
            settle: Notify::new(),
            queued_calls: tokio::sync::watch::Sender::new(0),
            pressured: Mutex::default(),
            draining: AtomicBool::new(false),
            next_stream_id: AtomicU64::new(1),
            next_call_id: AtomicU64::new(1),
            limits,
            metrics,
        }
    }

    pub fn next_stream_id(&self) -> u64 {
        self.next_stream_id.fetch_add(1, Ordering::Relaxed)
    }

    pub fn next_call_id(&self) -> u64 {
        self.next_call_id.fetch_add(1, Ordering::Relaxed)
    }

    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }

    /// Registers a new stream. It counts toward `max_streams_per_token` at once but takes
    /// no call until the agent confirms it ([`Hub::confirm`]).
    pub fn add_stream(&self, tunnel_id: &str, handle: Stream) -> Result<(), AddError> {
        if self.is_draining() {
            return Err(AddError::Draining);
        }
        let first = {
            let entry = self
                .tunnels
                .entry(tunnel_id.to_string())
                .or_insert_with(|| Arc::new(Tunnel::new(tunnel_id, &self.metrics.queued)));
            let mut s = entry.slots.lock();
            let first = s.add(handle, self.limits.max_streams_per_token)?;
            self.metrics
                .streams
                .with_label_values(&[tunnel_id])
                .set(s.streams().len() as i64);
            first
        };
        if first {
            self.changed.notify_waiters();
        }
        Ok(())
    }

    /// The agent confirmed the stream (its first frame after the hello): it becomes the
    /// newest idle one, or goes at once to the oldest waiting call. Until then no call is
    /// handed to it, so a stream whose agent gave up waiting for the hello can lose no call.
    pub fn confirm(&self, handle: Stream) {
        let Some(tunnel) = self.tunnel(&handle.tunnel_id) else {
            return;
        };
        if !handle.is_usable() {
            return;
        }
        let mut s = tunnel.slots.lock();
        if let Some(placed) = s.confirm(handle) {
            carry_out(&mut s, placed);
        }
    }

    /// Removes a stream that ended. A call holding it gives it back when it ends.
    pub fn remove_stream(&self, handle: &Stream) {
        let Some(tunnel) = self.tunnel(&handle.tunnel_id) else {
            return;
        };
        let removed = {
            let mut s = tunnel.slots.lock();
            let removed = s.remove(handle);
            if removed.known {
                self.metrics
                    .streams
                    .with_label_values(&[&tunnel.id])
                    .set(s.streams().len() as i64);
            }
            removed
        };
        // Calls waiting here learn at once that the tunnel id left this server (their
        // senders drop with `removed`).
        if removed.last {
            let gone = self
                .tunnels
                .remove_if(&tunnel.id, |_, t| t.slots.lock().is_empty())
                .is_some();
            if gone {
                let _ = self.metrics.streams.remove_label_values(&[&tunnel.id]);
                let _ = self.metrics.queued.remove_label_values(&[&tunnel.id]);
                self.changed.notify_waiters();
                self.settle.notify_waiters();
            }
        }
    }

    fn tunnel(&self, tunnel_id: &str) -> Option<Arc<Tunnel>> {
        self.tunnels.get(tunnel_id).map(|t| t.clone())
    }

    /// Takes the newest idle stream of the tunnel id, or waits in its queue until one frees,
    /// `deadline` passes, or `cancelled` resolves.
    pub async fn acquire(
        &self,
        tunnel_id: &str,
        deadline: Instant,
        cancelled: impl Future<Output = ()>,
    ) -> Result<Lease, AcquireError> {
        // A draining server keeps serving calls on the streams it still holds: agents
        // move their streams away as soon as they are covered elsewhere (make before
        // break), and the dispatcher sends calls here only when no other server can.
        let Some(tunnel) = self.tunnel(tunnel_id) else {
            return Err(AcquireError::UnknownTunnel);
        };
        let started = Instant::now();
        let mut rx = None;
        // Set under the slots lock when the call queues (`Tunnel::pressured`).
        let mut listed = true;
        let taken = tunnel.slots.lock().take(
            self.limits.max_queue_per_tunnel,
            |h| h.is_usable(),
            || {
                listed = tunnel.pressured.swap(true, Ordering::Relaxed);
                let (tx, r) = oneshot::channel();
                rx = Some(r);
                tx
            },
        );
        let waiter = match taken {
            Take::Stream(stream) => {
                self.metrics.queue_wait.observe(0.0);
                return Ok(Lease { tunnel, stream });
            }
            Take::Unknown => return Err(AcquireError::UnknownTunnel),
            Take::QueueFull => {
                return Err(AcquireError::NoCapacity(
                    "the tunnel id's queue on this server is full",
                ))
            }
            Take::Queued(id) => {
                self.queued_calls.send_modify(|n| *n = n.wrapping_add(1));
                if !listed {
                    self.pressured.lock().push(tunnel.clone());
                }
                id
            }
        };
        let mut waiting = Waiting {
            tunnel,
            id: waiter,
            rx: rx.expect("a queued call has a receiver"),
            served: false,
        };
        let outcome = tokio::select! {
            r = &mut waiting.rx => match r {
                Ok(stream) => {
                    waiting.served = true;
                    Ok(Lease { tunnel: waiting.tunnel.clone(), stream })
                }
                Err(_) => Err(AcquireError::UnknownTunnel),
            },
            _ = tokio::time::sleep_until(deadline) => Err(AcquireError::NoCapacity("no stream of the tunnel id became free before the deadline")),
            _ = cancelled => Err(AcquireError::Cancelled),
        };
        drop(waiting);
        self.metrics
            .queue_wait
            .observe(started.elapsed().as_secs_f64());
        outcome
    }

    /// The agent retires a stream: take it off the idle stack and close it now if it is
    /// idle; a busy one closes when its call gives it back. Returns true when closed now.
    pub fn retire(&self, handle: &Stream) -> bool {
        let Some(tunnel) = self.tunnel(&handle.tunnel_id) else {
            return false;
        };
        let was_idle = tunnel.slots.lock().retire(handle);
        if was_idle {
            handle.close();
        }
        was_idle
    }

    /// Starts draining: no new streams; every stream is told to go away. Calls still run
    /// on the streams the server holds until their agents have moved them.
    pub fn drain(&self, grace_ms: u32) {
        self.draining.store(true, Ordering::SeqCst);
        for t in self.tunnels.iter() {
            let mut s = t.slots.lock();
            for h in s.drain() {
                h.try_send(ServerFrame::of(server_frame::Kind::Drain(Drain {
                    grace_ms,
                })));
            }
        }
        self.changed.notify_waiters();
    }

    /// Closes every stream whose token no longer opens its tunnel id (`still_valid` says
    /// false), ending it with UNAUTHENTICATED "token revoked". A call on such a stream
    /// ends as stream lost. Returns how many streams were closed.
    pub fn revoke(&self, still_valid: impl Fn(&[u8; 32], &str) -> bool) -> usize {
        let mut doomed = Vec::new();
        for t in self.tunnels.iter() {
            let s = t.slots.lock();
            doomed.extend(
                s.streams()
                    .iter()
                    .filter(|h| !still_valid(&h.token_hash, &h.tunnel_id))
                    .cloned(),
            );
        }
        for h in &doomed {
            h.revoke();
        }
        doomed.len()
    }

    /// A dispatcher's view of the fleet. When the union over dispatchers changed, every
    /// agent stream that asked for fleet news gets it.
    pub fn set_fleet(&self, dispatcher: &str, members: Vec<FleetMember>) {
        let frame = {
            let mut f = self.fleet.lock();
            f.by_dispatcher.insert(dispatcher.to_string(), members);
            let mut merged: Vec<FleetMember> = Vec::new();
            for m in f.by_dispatcher.values().flatten() {
                match merged
                    .iter_mut()
                    .find(|o| o.server_id == m.server_id && o.instance_id == m.instance_id)
                {
                    Some(o) => o.draining |= m.draining,
                    None => merged.push(m.clone()),
                }
            }
            merged.sort_by(|a, b| {
                (&a.server_id, &a.instance_id).cmp(&(&b.server_id, &b.instance_id))
            });
            // Agents refuse a frame listing more (the protocol's bound).
            merged.truncate(relay_proto::MAX_FLEET_MEMBERS);
            if merged == f.merged {
                return;
            }
            f.merged = merged.clone();
            ServerFrame::of(server_frame::Kind::Fleet(Fleet { members: merged }))
        };
        for t in self.tunnels.iter() {
            let s = t.slots.lock();
            for h in s.streams().iter().filter(|h| h.wants_fleet) {
                h.try_send(frame.clone());
            }
        }
    }

    /// The fleet frame for a new stream, if any dispatcher told one.
    pub fn fleet_frame(&self) -> Option<ServerFrame> {
        let f = self.fleet.lock();
        (!f.merged.is_empty()).then(|| {
            ServerFrame::of(server_frame::Kind::Fleet(Fleet {
                members: f.merged.clone(),
            }))
        })
    }

    /// Closes every stream (the last step of shutdown).
    pub fn close_all(&self) {
        self.each_stream(StreamHandle::close);
    }

    /// Ends every stream as a crash would (see `StreamHandle::fail`).
    pub fn fail_all(&self) {
        self.each_stream(StreamHandle::fail);
    }

    fn each_stream(&self, f: impl Fn(&StreamHandle)) {
        for t in self.tunnels.iter() {
            let s = t.slots.lock();
            for h in s.streams() {
                f(h);
            }
        }
    }

    /// Streams of the tunnel id that can take a call now (confirmed, idle, usable).
    pub fn idle_streams(&self, tunnel_id: &str) -> usize {
        self.tunnels
            .get(tunnel_id)
            .map_or(0, |t| t.slots.lock().idle(|h| h.is_usable()))
    }

    /// True when no agent stream is left (the end of a drain).
    pub fn is_empty(&self) -> bool {
        self.tunnels.is_empty()
    }

    /// Resolves once no agent stream is left and no call holds a stream: the end of a
    /// drain. Woken by the events that can make it true (a tunnel id's last stream
    /// leaving, a call ending), never by polling.
    pub async fn settled(&self) {
        loop {
            let notified = self.settle.notified();
            tokio::pin!(notified);
            // Registered before the check, so an event between the check and the wait
            // still wakes it.
            notified.as_mut().enable();
            if self.is_empty() && self.metrics.in_flight.get() <= 0 {
                return;
            }
            notified.await;
        }
    }

    /// Counts a call in `relay_tunnel_calls_in_flight` while the returned guard lives.
    pub fn call_in_flight(self: &Arc<Self>) -> InFlight {
        self.metrics.in_flight.inc();
        InFlight(self.clone())
    }

    /// Tunnel ids holding at least one stream here.
    pub fn tunnel_ids(&self) -> Vec<String> {
        self.tunnels.iter().map(|t| t.key().clone()).collect()
    }

    /// What changed against `told` (tunnel ids a dispatcher was told of): the tunnel ids
    /// held here and not in it, and those in it no longer held here. Reads every tunnel id
    /// without copying one that did not change (an announcement round runs after every
    /// change, for each dispatcher).
    pub fn tunnel_changes(
        &self,
        told: &std::collections::HashSet<String>,
    ) -> (Vec<String>, Vec<String>) {
        let up = self
            .tunnels
            .iter()
            .filter(|t| !told.contains(t.key()))
            .map(|t| t.key().clone())
            .collect();
        let down = told
            .iter()
            .filter(|id| !self.tunnels.contains_key(id.as_str()))
            .cloned()
            .collect();
        (up, down)
    }

    /// One round-trip sample (ping -> pong on an idle stream) of the tunnel id.
    pub fn observe_rtt(&self, tunnel_id: &str, sample: std::time::Duration) {
        if let Some(t) = self.tunnels.get(tunnel_id) {
            t.rtt.lock().observe(sample.as_secs_f64() * 1e6);
        }
    }

    /// Per tunnel id figures for the load report: idle counts only streams that can take a
    /// call now (a retiring or closing stream still on the stack is not capacity).
    pub fn load(&self) -> Vec<TunnelLoad> {
        self.tunnels
            .iter()
            .map(|t| {
                let rtt_us = t.rtt.lock().micros();
                let s = t.slots.lock();
                TunnelLoad {
                    tunnel_id: t.id.clone(),
                    idle: s.idle(|h| h.is_usable()) as u32,
                    busy: s.busy() as u32,
                    queued: s.queued(),
                    rtt_us,
                }
            })
            .collect()
    }

    /// Per tunnel id, what the status page and `/debug/tunnels` show: every stream here
    /// (retiring ones too) besides the load report's figures. Sorted by tunnel id.
    pub fn tunnel_status(&self) -> Vec<TunnelStatus> {
        let mut out: Vec<_> = self
            .tunnels
            .iter()
            .map(|t| {
                let rtt_us = t.rtt.lock().micros();
                let s = t.slots.lock();
                TunnelStatus {
                    tunnel_id: t.id.clone(),
                    streams: s.streams().len() as u32,
                    idle: s.idle(|h| h.is_usable()) as u32,
                    busy: s.busy() as u32,
                    queued: s.queued(),
                    rtt_us,
                }
            })
            .collect();
        out.sort_by(|a, b| a.tunnel_id.cmp(&b.tunnel_id));
        out
    }

    /// Tells each tunnel id's agent how many of its calls wait here, when that changed,
    /// and again every [`PRESSURE_REFRESH`] while calls wait (the agent forgets a hint that
    /// is not refreshed).
    ///
    /// It visits the tunnel ids a call queued on since their pressure last settled
    /// (`Hub::pressured`), not every tunnel id: one with no call waiting and none told has
    /// nothing to say, and its gauge was set to 0 when it settled.
    pub fn send_pressure(&self) {
        let now = Instant::now();
        let listed = std::mem::take(&mut *self.pressured.lock());
        let mut kept = Vec::with_capacity(listed.len());
        for t in listed {
            let current = self
                .tunnels
                .get(&t.id)
                .is_some_and(|cur| Arc::ptr_eq(cur.value(), &t));
            let mut s = t.slots.lock();
            t.queued_gauge.set(s.queued() as i64);
            if let Some(queued) = s.pressure(now, PRESSURE_REFRESH) {
                let frame = ServerFrame::of(server_frame::Kind::Pressure(Pressure { queued }));
                // One stream is enough: the agent keys the hint by server id.
                if let Some(h) = s.streams().iter().rev().find(|h| h.is_usable()) {
                    if h.try_send(frame) {
                        s.told(queued, now);
                    }
                }
            }
            // A tunnel id that left the hub has no agent to tell.
            if current && !s.pressure_settled() {
                drop(s);
                kept.push(t);
            } else {
                t.pressured.store(false, Ordering::Relaxed);
            }
        }
        if !kept.is_empty() {
            self.pressured.lock().extend(kept);
        }
    }
}

/// A call waiting in a tunnel's queue. However the wait ends (even by the call being
/// dropped), a call that was not served leaves the queue, and a stream handed to it just
/// as it gave up goes back.
struct Waiting {
    tunnel: Arc<Tunnel>,
    id: WaiterId,
    rx: oneshot::Receiver<Stream>,
    served: bool,
}

impl Drop for Waiting {
    fn drop(&mut self) {
        if self.served || self.tunnel.slots.lock().leave(self.id) {
            return;
        }
        // Served (or turned away) already: the hand-off happened under the slots lock,
        // so a stream sent to this waiter is in the channel now.
        self.rx.close();
        if let Ok(stream) = self.rx.try_recv() {
            self.tunnel.release(stream);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn hub() -> Arc<Hub> {
        let metrics = ServerMetrics::register(&prometheus::Registry::new()).unwrap();
        Arc::new(Hub::new(
            Limits {
                max_queue_per_tunnel: 8,
                max_streams_per_token: 8,
                max_response_headers: 16,
                max_response_header_bytes: 4096,
            },
            metrics,
        ))
    }

    /// The pressure frames waiting in a stream's outbox, in order.
    fn told(rx: &mut crate::outbox::OutboxRx<crate::handle::OutFrame>) -> Vec<u32> {
        use futures::{FutureExt, StreamExt};
        let mut out = Vec::new();
        while let Some(Some(Ok(frame))) = rx.next().now_or_never() {
            if let Some(server_frame::Kind::Pressure(p)) = frame.kind {
                out.push(p.queued);
            }
        }
        out
    }

    #[tokio::test(start_paused = true)]
    async fn the_pressure_round_tells_a_queue_and_its_end_then_leaves_the_tunnel_id_alone() {
        let hub = hub();
        let (tx, mut rx) = crate::outbox::outbox(16);
        let stream = Arc::new(StreamHandle::new(
            1,
            "t".into(),
            [0; 32],
            crate::handle::AgentFeatures::default(),
            tx,
        ));
        hub.add_stream("t", stream.clone()).unwrap();
        hub.confirm(stream);
        // Nothing queued: the round has nothing to visit and tells nothing.
        hub.send_pressure();
        assert!(hub.pressured.lock().is_empty());
        assert_eq!(told(&mut rx), Vec::<u32>::new());
        // The only stream carries a call; a second call queues behind it.
        let far = Instant::now() + Duration::from_secs(3600);
        let lease = hub.acquire("t", far, std::future::pending()).await.unwrap();
        let waiter = tokio::spawn({
            let hub = hub.clone();
            async move { hub.acquire("t", far, std::future::pending()).await.is_ok() }
        });
        tokio::task::yield_now().await;
        hub.send_pressure();
        assert_eq!(told(&mut rx), [1], "the queue is told");
        assert_eq!(hub.pressured.lock().len(), 1);
        // The call ends: the queued one takes the stream; the next round tells 0, and the
        // one after that has nothing left to visit.
        drop(lease);
        assert!(waiter.await.unwrap(), "the queued call got the stream");
        hub.send_pressure();
        assert_eq!(told(&mut rx), [0], "the queue's end is told");
        hub.send_pressure();
        assert!(
            hub.pressured.lock().is_empty(),
            "settled: not visited again"
        );
        assert_eq!(told(&mut rx), Vec::<u32>::new());
        assert_eq!(hub.tunnel("t").unwrap().queued_gauge.get(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_drain_settles_when_the_last_call_ends_and_not_before() {
        let hub = hub();
        // Nothing held: settled at once.
        hub.settled().await;
        let calls = [hub.call_in_flight(), hub.call_in_flight()];
        let settled = tokio::spawn({
            let hub = hub.clone();
            async move { hub.settled().await }
        });
        let [first, second] = calls;
        drop(first);
        // Virtual time: an hour passes at once, and the waiter must still be waiting.
        tokio::time::sleep(Duration::from_secs(3600)).await;
        assert!(!settled.is_finished(), "settled with a call in flight");
        drop(second);
        tokio::time::timeout(Duration::from_secs(1), settled)
            .await
            .expect("settled once the last call ended")
            .unwrap();
        assert_eq!(hub.metrics.in_flight.get(), 0);
    }
}
