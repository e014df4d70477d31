//! Actor tests under paused time with a fake connector: streams "land" on named servers
//! without sockets, and the tests assert on the opens and retires the actor asked for.

use super::*;
use crate::coverage::plan::CoverageConfig;
use std::sync::Mutex;

type Place = Box<dyn Fn(StreamId) -> String + Send + Sync>;

#[derive(Default)]
struct NetState {
    opened: Vec<StreamId>,
    live: HashMap<StreamId, oneshot::Sender<()>>,
    retired: Vec<StreamId>,
    fail_with: Option<OpenError>,
    /// Each landed stream's way to report, for events a test plays as the server.
    events: HashMap<StreamId, mpsc::UnboundedSender<(StreamId, StreamEvent)>>,
}

#[derive(Clone)]
struct FakeNet {
    state: Arc<Mutex<NetState>>,
    place: Arc<Place>,
}

impl FakeNet {
    fn new(place: impl Fn(StreamId) -> String + Send + Sync + 'static) -> Self {
        FakeNet {
            state: Arc::default(),
            place: Arc::new(Box::new(place)),
        }
    }
    fn opened(&self) -> usize {
        self.state.lock().unwrap().opened.len()
    }
    fn live(&self) -> Vec<StreamId> {
        let mut v: Vec<_> = self.state.lock().unwrap().live.keys().copied().collect();
        v.sort();
        v
    }
    fn retired(&self) -> Vec<StreamId> {
        self.state.lock().unwrap().retired.clone()
    }
    fn kill(&self, id: StreamId) {
        let tx = self
            .state
            .lock()
            .unwrap()
            .live
            .remove(&id)
            .expect("live stream");
        let _ = tx.send(());
    }
    fn fail_with(&self, e: Option<OpenError>) {
        self.state.lock().unwrap().fail_with = e;
    }
    /// Reports `ev` as stream `id` would (a frame the server sent on it).
    fn emit(&self, id: StreamId, ev: StreamEvent) {
        let tx = self.state.lock().unwrap().events[&id].clone();
        let _ = tx.send((id, ev));
    }
}

impl Connector for FakeNet {
    fn open(&self, mut link: StreamLink) -> BoxFuture<'static, ()> {
        let net = self.clone();
        Box::pin(async move {
            let id = link.id;
            let (fail, kill_rx) = {
                let mut st = net.state.lock().unwrap();
                st.opened.push(id);
                match st.fail_with.clone() {
                    Some(e) => (Some(e), None),
                    None => {
                        let (tx, rx) = oneshot::channel();
                        st.live.insert(id, tx);
                        st.events.insert(id, link.events_sender());
                        (None, Some(rx))
                    }
                }
            };
            if let Some(e) = fail {
                link.emit(StreamEvent::OpenFailed(e));
                return;
            }
            link.emit(StreamEvent::Landed(Landing {
                server_id: (net.place)(id),
                instance_id: "1".into(),
                direct_url: String::new(),
                zone: "z1".into(),
                server_stream_id: id,
                heartbeat: Duration::from_secs(10),
                tunnel_id: "demo".into(),
            }));
            let Some(kill_rx) = kill_rx else { return };
            tokio::select! {
                _ = &mut link.retire => {
                    // GoingAway sent; the fake server closes the idle stream at once.
                    let mut st = net.state.lock().unwrap();
                    st.retired.push(id);
                    st.live.remove(&id);
                    drop(st);
                    link.emit(StreamEvent::Closed(CloseReason::ServerClosed));
                }
                _ = kill_rx => link.emit(StreamEvent::Closed(CloseReason::Lost)),
            }
        })
    }
}

/// The real planner, plus stream ids the test wants closed on the next tick; it records
/// each plan's cause and the queued calls its snapshot counted (all servers).
struct Scripted {
    inner: Planner,
    close_next: Arc<Mutex<Vec<StreamId>>>,
    seen: Arc<Mutex<Vec<(Cause, u32)>>>,
}

impl PlanStep for Scripted {
    fn plan(&mut self, snap: &Snapshot) -> Plan {
        let queued = snap.servers.iter().map(|s| s.queued).sum();
        self.seen.lock().unwrap().push((snap.cause, queued));
        let mut plan = self.inner.plan(snap);
        plan.close.append(&mut self.close_next.lock().unwrap());
        plan
    }
}

fn fixed(n: u32) -> CoverageConfig {
    CoverageConfig {
        enabled: false,
        fixed_streams: n,
        ..CoverageConfig::default()
    }
}

fn settings() -> ActorSettings {
    ActorSettings {
        tick: Duration::from_secs(1),
        backoff_initial: Duration::from_millis(200),
        backoff_max: Duration::from_secs(4),
        max_streams: 2048,
        drain_grace: Duration::from_secs(10),
        grace: Duration::from_secs(30),
        reconnect_for: Duration::from_secs(300),
    }
}

struct Harness {
    net: FakeNet,
    handle: CoverageHandle,
    close_next: Arc<Mutex<Vec<StreamId>>>,
    seen: Arc<Mutex<Vec<(Cause, u32)>>>,
    registry: prometheus::Registry,
}

impl Harness {
    /// The plans since the last call: (cause, queued calls counted).
    fn plans(&self) -> Vec<(Cause, u32)> {
        std::mem::take(&mut *self.seen.lock().unwrap())
    }
}

fn start(cfg: CoverageConfig, net: FakeNet) -> Harness {
    let registry = prometheus::Registry::new();
    let metrics = AgentMetrics::register(&registry).unwrap();
    let close_next = Arc::new(Mutex::new(Vec::new()));
    let seen = Arc::new(Mutex::new(Vec::new()));
    let planner = Scripted {
        inner: Planner::new(cfg),
        close_next: close_next.clone(),
        seen: seen.clone(),
    };
    let (actor, view) = CoverageActor::new(
        Box::new(planner),
        Arc::new(net.clone()),
        metrics,
        settings(),
    );
    Harness {
        net,
        handle: CoverageHandle::spawn(actor, view),
        close_next,
        seen,
        registry,
    }
}

async fn ticks(n: u32) {
    tokio::time::sleep(Duration::from_secs(u64::from(n)) + Duration::from_millis(10)).await;
}

fn gauge(registry: &prometheus::Registry, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    registry
        .gather()
        .iter()
        .filter(|f| f.name() == name)
        .flat_map(|f| f.get_metric().to_vec())
        .find_map(|m| {
            let ok = labels.iter().all(|(k, v)| {
                m.get_label()
                    .iter()
                    .any(|l| l.name() == *k && l.value() == *v)
            });
            ok.then(|| m.get_gauge().get_value())
        })
}

/// The published view (what /systemcheck and /readyz read) shows the first stream as soon
/// as it lands, not a tick later: a call may already have been served on it.
#[tokio::test(start_paused = true)]
async fn the_first_stream_to_land_is_published_at_once() {
    let h = start(fixed(2), FakeNet::new(|_| "s1".into()));
    tokio::time::sleep(Duration::from_millis(10)).await;
    let view = h.handle.view().borrow().clone();
    assert!(view.live >= 1, "{view:?}");
    assert_eq!(view.servers.len(), 1, "{view:?}");
}

#[tokio::test(start_paused = true)]
async fn a_pressure_hint_counts_until_it_is_no_longer_refreshed() {
    let h = start(fixed(2), FakeNet::new(|_| "s1".into()));
    ticks(1).await;
    let id = h.net.live()[0];
    h.net.emit(id, StreamEvent::Pressure(500));
    ticks(1).await;
    assert_eq!(h.handle.view().borrow().servers[0].busy, 500);
    // The server repeats a standing hint every second; this one is not repeated.
    ticks(3).await;
    assert_eq!(
        h.handle.view().borrow().servers[0].busy,
        0,
        "a hint of a server that stopped refreshing it expires"
    );
    // Refreshed hints keep counting.
    for _ in 0..4 {
        h.net.emit(id, StreamEvent::Pressure(7));
        ticks(1).await;
    }
    assert_eq!(h.handle.view().borrow().servers[0].busy, 7);
}

/// Calls that start and end between two ticks still count at the next one: the server's
/// busy figure is the most calls in flight at once since the last tick.
#[tokio::test(start_paused = true)]
async fn calls_between_ticks_count_as_the_most_in_flight_at_once() {
    let h = start(fixed(4), FakeNet::new(|_| "s1".into()));
    ticks(1).await;
    let live = h.net.live();
    assert_eq!(live.len(), 4);
    for id in &live[..3] {
        h.net.emit(*id, StreamEvent::CallStarted);
    }
    for id in &live[..3] {
        h.net.emit(*id, StreamEvent::CallEnded(None));
    }
    h.net.emit(live[0], StreamEvent::CallStarted);
    h.net.emit(live[0], StreamEvent::CallEnded(None));
    ticks(1).await;
    assert_eq!(h.handle.view().borrow().servers[0].busy, 3);
    ticks(1).await;
    assert_eq!(
        h.handle.view().borrow().servers[0].busy,
        0,
        "the next tick starts from the calls in flight then"
    );
    // A stream that goes away mid-call takes its call out of the count.
    h.net.emit(live[1], StreamEvent::CallStarted);
    h.net.kill(live[1]);
    ticks(2).await;
    assert_eq!(h.handle.view().borrow().servers[0].busy, 0);
}

#[tokio::test(start_paused = true)]
async fn fixed_pool_opens_exactly_fixed_streams_at_start() {
    let h = start(fixed(4), FakeNet::new(|_| "s1".into()));
    // The first plan runs at once, before any tick period passes.
    tokio::time::sleep(Duration::from_millis(1)).await;
    assert_eq!(h.net.opened(), 4);
    ticks(5).await;
    assert_eq!(h.net.opened(), 4, "a full pool opens nothing more");
    let view = h.handle.view().borrow().clone();
    assert_eq!(view.streams_total, 4);
    assert_eq!(view.opening, 0);
    assert_eq!(view.servers.len(), 1);
    assert_eq!(view.servers[0].server_id, "s1");
    assert_eq!(view.servers[0].streams, 4);
    assert_eq!(
        gauge(
            &h.registry,
            "grpc_tunnel_server_streams",
            &[("server_id", "s1"), ("state", "idle")]
        ),
        Some(4.0)
    );
}

#[tokio::test(start_paused = true)]
async fn a_closed_stream_is_replaced() {
    let h = start(fixed(4), FakeNet::new(|_| "s1".into()));
    ticks(1).await;
    let victim = h.net.live()[1];
    h.net.kill(victim);
    // Replanned soon after the close, well within one tick.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(h.net.opened(), 5);
    assert_eq!(h.net.live().len(), 4);
    assert!(!h.net.live().contains(&victim));
}

#[tokio::test(start_paused = true)]
async fn a_stream_in_plan_close_is_sent_going_away_and_replaced() {
    let h = start(fixed(4), FakeNet::new(|_| "s1".into()));
    ticks(1).await;
    let target = h.net.live()[0];
    h.close_next.lock().unwrap().push(target);
    ticks(2).await;
    assert_eq!(h.net.retired(), vec![target]);
    assert_eq!(h.net.live().len(), 4, "the fixed pool is refilled");
    assert!(!h.net.live().contains(&target));
}

#[tokio::test(start_paused = true)]
async fn failed_opens_back_off_then_recover_after_a_landing() {
    let net = FakeNet::new(|_| "s1".into());
    net.fail_with(Some(OpenError::Unauthenticated("bad token".into())));
    let h = start(fixed(4), net);
    ticks(20).await;
    let attempts = h.net.opened();
    // Without the gate: 4 opens per tick, 84 in 21 plans. With it: one batch per step of
    // 0.2, 0.4, 0.8, 1.6, 3.2, 4, 4 ... seconds (jittered down to half).
    assert!(attempts >= 8, "kept retrying: {attempts}");
    assert!(attempts <= 4 * 12, "backed off: {attempts}");
    h.net.fail_with(None);
    ticks(6).await;
    assert_eq!(h.net.live().len(), 4, "recovered once the server accepts");
    // The gate is cleared: a closed stream is replaced at once again.
    let opened = h.net.opened();
    h.net.kill(h.net.live()[0]);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(h.net.opened(), opened + 1);
}

#[tokio::test(start_paused = true)]
async fn exhausted_servers_are_placement_news_not_a_backoff() {
    let net = FakeNet::new(|_| "s1".into());
    net.fail_with(Some(OpenError::Exhausted("cap".into(), None)));
    let h = start(fixed(4), net);
    ticks(3).await;
    assert!(
        h.net.opened() >= 16,
        "opens again every tick: {}",
        h.net.opened()
    );
}

#[tokio::test(start_paused = true)]
async fn shutdown_retires_every_stream() {
    let h = start(fixed(3), FakeNet::new(|_| "s1".into()));
    ticks(1).await;
    let live = h.net.live();
    assert_eq!(live.len(), 3);
    let net = h.net.clone();
    h.handle.shutdown().await;
    let mut retired = net.retired();
    retired.sort();
    assert_eq!(retired, live);
    assert!(net.live().is_empty());
}

/// A stopped agent holds no streams and plans no more: its per-server series go with it.
#[tokio::test(start_paused = true)]
async fn shutdown_removes_the_per_server_series() {
    let h = start(fixed(3), FakeNet::new(|_| "s1".into()));
    ticks(1).await;
    let idle = |r: &prometheus::Registry| {
        gauge(
            r,
            "grpc_tunnel_server_streams",
            &[("server_id", "s1"), ("state", "idle")],
        )
    };
    assert_eq!(idle(&h.registry), Some(3.0));
    assert_eq!(
        gauge(
            &h.registry,
            "grpc_tunnel_server_short_seconds",
            &[("server_id", "s1")]
        ),
        Some(0.0)
    );
    h.handle.shutdown().await;
    for name in [
        "grpc_tunnel_server_streams",
        "grpc_tunnel_coverage_state",
        "grpc_tunnel_server_short_seconds",
    ] {
        assert_eq!(gauge(&h.registry, name, &[]), None, "{name}");
    }
}

#[tokio::test(start_paused = true)]
async fn dropping_the_handle_stops_everything() {
    let h = start(fixed(3), FakeNet::new(|_| "s1".into()));
    ticks(1).await;
    let net = h.net.clone();
    drop(h);
    ticks(1).await;
    assert!(net.live().is_empty());
    assert_eq!(net.retired().len(), 3);
    assert_eq!(net.opened(), 3, "nothing reopened after the stop");
}

#[tokio::test(start_paused = true)]
async fn series_of_a_server_without_streams_are_removed() {
    let moved = Arc::new(Mutex::new(false));
    let m = moved.clone();
    let h = start(
        fixed(2),
        FakeNet::new(move |_| {
            if *m.lock().unwrap() {
                "s2".into()
            } else {
                "s1".into()
            }
        }),
    );
    ticks(1).await;
    assert_eq!(
        gauge(
            &h.registry,
            "grpc_tunnel_server_streams",
            &[("server_id", "s1"), ("state", "idle")]
        ),
        Some(2.0)
    );
    *moved.lock().unwrap() = true;
    for id in h.net.live() {
        h.net.kill(id);
    }
    ticks(2).await;
    assert_eq!(
        gauge(
            &h.registry,
            "grpc_tunnel_server_streams",
            &[("server_id", "s1"), ("state", "idle")]
        ),
        None
    );
    assert_eq!(
        gauge(
            &h.registry,
            "grpc_tunnel_coverage_state",
            &[("server_id", "s1")]
        ),
        None
    );
    assert_eq!(
        gauge(
            &h.registry,
            "grpc_tunnel_server_streams",
            &[("server_id", "s2"), ("state", "idle")]
        ),
        Some(2.0)
    );
    let view = h.handle.view().borrow().clone();
    assert_eq!(
        view.servers
            .iter()
            .map(|s| s.server_id.as_str())
            .collect::<Vec<_>>(),
        vec!["s2"]
    );
}

/// A server's queued-calls signal starts growth when it arrives, not at the next tick.
#[tokio::test(start_paused = true)]
async fn a_queued_calls_signal_starts_growth_at_once() {
    let h = start(CoverageConfig::default(), FakeNet::new(|_| "s1".into()));
    ticks(1).await;
    let live = h.net.live();
    assert_eq!(live.len(), 2, "at rest: the reserve");
    // Mid-tick: the next tick is 0.7 s away.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let before = h.net.opened();
    for id in &live {
        h.net.emit(*id, StreamEvent::CallStarted);
    }
    h.net.emit(live[0], StreamEvent::Pressure(100));
    tokio::time::sleep(Duration::from_millis(5)).await;
    // 2 in flight + 100 queued + reserve 2 - 2 streams, every open landing on s1.
    assert_eq!(h.net.opened() - before, 102);
    // The same hint again is no news; the tick sees the new streams and does nothing more.
    h.net.emit(live[0], StreamEvent::Pressure(100));
    ticks(1).await;
    assert_eq!(h.net.opened() - before, 102);
    let view = h.handle.view().borrow().clone();
    assert_eq!(view.servers[0].state, "covered", "{view:?}");
}

/// A call that takes a stream while calls queue there plans growth too (the server's idle
/// streams ran out), at most once per EVENT_GAP; that call was one of the queued ones, so
/// the hint counts one less until the server sends the next.
#[tokio::test(start_paused = true)]
async fn a_call_taking_a_stream_while_calls_queue_plans_growth_counting_it_out_of_the_queue() {
    let h = start(CoverageConfig::default(), FakeNet::new(|_| "s1".into()));
    ticks(1).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    h.plans();
    h.net.emit(h.net.live()[0], StreamEvent::Pressure(5));
    tokio::time::sleep(Duration::from_millis(1)).await;
    assert_eq!(h.plans(), vec![(Cause::Pressure, 5)]);
    let live = h.net.live();
    // Three of the queued calls take streams: one plan, after EVENT_GAP, counting 2.
    for id in &live[..3] {
        h.net.emit(*id, StreamEvent::CallStarted);
    }
    tokio::time::sleep(Duration::from_millis(1)).await;
    assert_eq!(h.plans(), vec![], "within EVENT_GAP of the last plan");
    tokio::time::sleep(EVENT_GAP).await;
    assert_eq!(h.plans(), vec![(Cause::Pressure, 2)]);
    // The last two: the hint is used up.
    for id in &live[3..5] {
        h.net.emit(*id, StreamEvent::CallStarted);
    }
    tokio::time::sleep(EVENT_GAP * 2).await;
    assert_eq!(h.plans(), vec![(Cause::Pressure, 0)]);
    // A call starting with no queue reported plans nothing before the tick.
    h.net.emit(live[5], StreamEvent::CallStarted);
    tokio::time::sleep(EVENT_GAP * 2).await;
    assert_eq!(h.plans(), vec![]);
    ticks(1).await;
    assert_eq!(h.plans().first().map(|p| p.0), Some(Cause::Tick));
}

/// A running actor under test: dropping it (or `shutdown`) stops the actor and its streams.
pub struct CoverageHandle {
    stop: Option<oneshot::Sender<()>>,
    view: watch::Receiver<CoverageView>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl CoverageHandle {
    /// Spawns `actor` on the current runtime.
    pub fn spawn(actor: CoverageActor, view: watch::Receiver<CoverageView>) -> Self {
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(actor.run(async move {
            let _ = stopped.await;
        }));
        CoverageHandle {
            stop: Some(stop),
            view,
            task: Some(task),
        }
    }

    pub fn view(&self) -> watch::Receiver<CoverageView> {
        self.view.clone()
    }

    /// Retires every stream, waits for calls in flight (bounded) and the actor's end.
    pub async fn shutdown(mut self) {
        self.stop.take();
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

impl Drop for CoverageHandle {
    fn drop(&mut self) {
        // Dropping `stop` resolves the actor's shutdown future; it then drains on its own.
        self.stop.take();
    }
}

/// A server that crashed comes back as a new instance of its server id. Until a stream
/// lands there the new instance is lost since the old one was, so the plan fills it at the
/// reconnect pace (not at `fill_retry`'s once its budget is spent); the old instance's loss
/// is remembered for `reconnect_for` after it left the fleet, then forgotten.
#[tokio::test(start_paused = true)]
async fn a_restarted_servers_new_instance_is_lost_since_its_old_one_was() {
    let registry = prometheus::Registry::new();
    let (mut actor, _view) = CoverageActor::new(
        Box::new(Planner::new(CoverageConfig::default())),
        Arc::new(FakeNet::new(|_| "s1".into())),
        AgentMetrics::register(&registry).unwrap(),
        settings(),
    );
    let member = |server_id: &str, instance_id: &str| relay_proto::FleetMember {
        server_id: server_id.into(),
        instance_id: instance_id.into(),
        zone: "z1".into(),
        draining: false,
        direct_url: String::new(),
    };
    let lost_at = Instant::now();
    actor.lost.insert(("s1".into(), "1".into()), lost_at);
    // s1 restarted as instance 2; s2 was never lost.
    actor.fleet = vec![member("s1", "2"), member("s2", "1")];
    let lost_since = |actor: &CoverageActor, id: &str, instance: &str| {
        actor
            .snapshot(Instant::now(), Cause::Tick)
            .servers
            .iter()
            .find(|v| v.server_id == id && v.instance_id == instance)
            .map(|v| v.lost_since)
    };
    assert_eq!(lost_since(&actor, "s1", "2"), Some(Some(lost_at)));
    assert_eq!(lost_since(&actor, "s2", "1"), Some(None));
    tokio::time::advance(settings().reconnect_for - Duration::from_secs(1)).await;
    actor.forget_departed(Instant::now());
    assert_eq!(lost_since(&actor, "s1", "2"), Some(Some(lost_at)));
    tokio::time::advance(Duration::from_secs(2)).await;
    actor.forget_departed(Instant::now());
    assert_eq!(
        lost_since(&actor, "s1", "2"),
        Some(None),
        "past reconnect_for the old instance's loss is forgotten"
    );
}
