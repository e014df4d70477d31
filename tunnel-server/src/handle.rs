//! One agent stream as the rest of the server sees it: [`StreamHandle`], shared by the hub
//! (which hands it out), the call on it and the stream's reader. It owns the stream's
//! state ([`State`]: open, retiring, closed) and the slot of the call it carries, and every
//! transition between them is a method here. It decides no policy: the reader
//! (`crate::stream`) and the hub (`crate::hub`) call these transitions.

use crate::outbox::{Outbox, TrySendError};
use crate::outcome::Outcome;
use parking_lot::Mutex;
use relay_proto::{ForwardResponse, ServerFrame};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use tokio::sync::Notify;
use tokio::sync::{mpsc, oneshot};
use tonic::Status;

/// A frame queued for the agent. Boxed: a stream's queue ([`crate::outbox`]) keeps the
/// slots it has grown to, and at 16 bytes a slot instead of a whole `ServerFrame` (144) an
/// idle stream's few slots stay small.
pub type OutFrame = Result<Box<ServerFrame>, Status>;

/// Where a stream stands.
#[derive(Debug)]
enum State {
    /// Takes calls when idle.
    Open,
    /// The agent sent `GoingAway`: the hub hands it no new call; the call on it (or one
    /// that crossed the `GoingAway` on the wire) finishes, then the stream is closed.
    Retiring,
    /// Closed by the server (retired, shut down, revoked, given up on) or ended by its
    /// reader: no call can begin on it. The RPC ends with `status` (OK when `None`).
    Closed { status: Option<Status> },
}

#[derive(Debug)]
struct Inner {
    state: State,
    /// The call on the stream, if any.
    call: Option<CallSlot>,
    /// Closed because the agent's connection stopped answering (`crate::liveness`).
    silent: bool,
    /// The call on the stream went to the agent whole in its head (no body frames follow):
    /// the agent reads whatever else comes on the stream at once.
    whole_request: bool,
    /// The reader waits for the caller to take a frame of the answer: the agent's frames
    /// on this stream wait on this server, not on the path.
    reader_waits: bool,
}

/// What an agent announced it understands, from its `relay-agent-features` metadata (a
/// comma-separated list; names this server does not know are ignored).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AgentFeatures {
    /// `fleet`: `Fleet` frames.
    pub fleet: bool,
    /// `inline-body`: a whole small request body inside `RequestHead.body`.
    pub inline_body: bool,
}

impl AgentFeatures {
    pub fn parse(list: &str) -> Self {
        let mut features = AgentFeatures::default();
        for name in relay_proto::features(list) {
            match name {
                relay_proto::FEATURE_FLEET => features.fleet = true,
                relay_proto::FEATURE_INLINE_BODY => features.inline_body = true,
                _ => {}
            }
        }
        features
    }
}

pub struct StreamHandle {
    pub id: u64,
    pub tunnel_id: Arc<str>,
    /// SHA-256 of the token that opened the stream: a reloaded token store that no longer
    /// holds it closes the stream (see `Hub::revoke`).
    pub token_hash: [u8; 32],
    /// The agent asked for fleet news (`relay-agent-features: fleet`); older agents
    /// would take an unknown frame for a broken stream.
    pub wants_fleet: bool,
    /// The agent reads a small request body inside the request head
    /// (`relay-agent-features: inline-body`); older agents would drop it.
    pub inline_body: bool,
    /// Body credit on this stream (`ServerHello.response_credit`), when the agent asked.
    pub credit: Option<StreamCredit>,
    out: Outbox<OutFrame>,
    /// Shared with the outbound half, which reads the closing status once `closed` fires.
    inner: Arc<Mutex<Inner>>,
    /// Set on the move to `Closed` (except a reader ending on a protocol error, whose
    /// status is queued on `out`), with `closed_wake` waking the reader and any sender
    /// waiting for room. The outbound half is ended with it (`Outbox::cut`, see
    /// [`StreamHandle::fire_closed`]). A flag and a `Notify` inside the handle rather than a
    /// cancellation token: a token is an allocation of its own per stream, and its waiter
    /// future is larger than a `Notify`'s.
    closed: AtomicBool,
    closed_wake: Notify,
}

/// The body credit both ways on a stream that uses it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamCredit {
    /// Request-body bytes a call may have sent the agent beyond its `Credit` frames.
    pub request: u32,
    /// Response-body bytes the agent may have sent beyond this server's `Credit` frames.
    pub response: u32,
}

/// Where the agent's frames for the call on a stream go.
#[derive(Debug)]
pub struct CallSlot {
    pub call_id: u64,
    /// The call's trace id, for the stream's log lines about the call.
    pub trace_id: relay_common::trace::TraceId,
    /// The dispatcher's response stream for this call.
    pub to_caller: mpsc::Sender<Result<ForwardResponse, Status>>,
    /// The call's task: hears how the call ended on this stream.
    pub done: oneshot::Sender<Outcome>,
    /// The agent's response head went through.
    pub head_seen: bool,
    /// Body credit on a stream that uses it (`ServerHello.response_credit`).
    pub credit: Option<CallCredit>,
}

/// A call's body credit, both ways (see `ServerHello.response_credit` in `tunnel.proto`).
#[derive(Debug)]
pub struct CallCredit {
    /// Request-body bytes the server may still send the agent; the call's task takes from
    /// it before each body frame, the agent's `Credit` frames give back. Closed when the call
    /// leaves the stream, so a task waiting on it stops.
    pub request: Arc<tokio::sync::Semaphore>,
    /// The agent's request-body credit: the most `request` may hold.
    pub request_limit: u32,
    /// Response-body bytes the agent sent that this server has not given back.
    pub response_unacked: u32,
    /// Of those, bytes passed on to the caller and not yet given back.
    pub response_passed: u32,
}

impl CallCredit {
    pub fn new(request_limit: u32) -> Self {
        CallCredit {
            request: Arc::new(tokio::sync::Semaphore::new(request_limit as usize)),
            request_limit,
            response_unacked: 0,
            response_passed: 0,
        }
    }

    /// The agent gave back `bytes` of request credit; more than it could owe is capped.
    pub fn give_back_request(&self, bytes: u32) {
        let room = (self.request_limit as usize).saturating_sub(self.request.available_permits());
        let add = (bytes as usize).min(room);
        if add > 0 {
            self.request.add_permits(add);
        }
    }
}

/// What the reader needs to end a stream: the call on it and whether it was revoked or
/// its agent's connection went silent.
pub struct Ending {
    pub call: Option<CallSlot>,
    pub revoked: bool,
    pub silent: bool,
}

impl StreamHandle {
    pub fn new(
        id: u64,
        tunnel_id: Arc<str>,
        token_hash: [u8; 32],
        features: AgentFeatures,
        out: Outbox<OutFrame>,
    ) -> Self {
        StreamHandle {
            id,
            tunnel_id,
            token_hash,
            wants_fleet: features.fleet,
            inline_body: features.inline_body,
            credit: None,
            out,
            inner: Arc::new(Mutex::new(Inner {
                state: State::Open,
                call: None,
                silent: false,
                whole_request: false,
                reader_waits: false,
            })),
            closed: AtomicBool::new(false),
            closed_wake: Notify::new(),
        }
    }

    /// The stream uses body credit (`ServerHello.response_credit`).
    pub fn with_credit(mut self, credit: Option<StreamCredit>) -> Self {
        self.credit = credit;
        self
    }

    /// Open and its agent still listening: the hub may hand it a call.
    pub fn is_usable(&self) -> bool {
        matches!(self.inner.lock().state, State::Open) && !self.out.is_closed()
    }

    /// No call on the stream now.
    pub fn is_idle(&self) -> bool {
        self.inner.lock().call.is_none()
    }

    /// A ping on this stream now would reach the agent and its answer would come back
    /// without waiting on anything but the path (`crate::liveness`): the stream is open and
    /// idle, or its call went to the agent whole (the agent reads the stream freely) and
    /// the reader is not waiting on the caller.
    pub fn is_probe_clear(&self) -> bool {
        let inner = self.inner.lock();
        matches!(inner.state, State::Open)
            && !self.out.is_closed()
            && (inner.call.is_none() || (inner.whole_request && !inner.reader_waits))
    }

    /// The call on the stream went to the agent whole in its head.
    pub fn request_sent_whole(&self) {
        let mut inner = self.inner.lock();
        if inner.call.is_some() {
            inner.whole_request = true;
        }
    }

    /// The credit of call `call_id`, if it is the call on the stream and the stream uses
    /// credit.
    pub fn call_credit<T>(&self, call_id: u64, f: impl FnOnce(&mut CallCredit) -> T) -> Option<T> {
        let mut inner = self.inner.lock();
        inner
            .call
            .as_mut()
            .filter(|c| c.call_id == call_id)
            .and_then(|c| c.credit.as_mut())
            .map(f)
    }

    /// The reader waits for (`true`), or got past (`false`), the caller taking a frame.
    pub fn reader_waits(&self, waits: bool) {
        self.inner.lock().reader_waits = waits;
    }

    /// Ends the stream: the outbound half finishes with OK and the reader stops.
    pub fn close(&self) {
        self.close_with(None);
    }

    /// Ends the stream as the server's crash would (`TunnelServerHandle::abort`): the agent
    /// sees UNAVAILABLE, as it would from a load balancer whose connection to the server
    /// broke, and counts the server lost, not closed.
    pub fn fail(&self) {
        self.close_with(Some(Status::unavailable("tunnel server stopped")));
    }

    /// Ends the stream because its token was removed from the store: the agent sees
    /// UNAUTHENTICATED "token revoked".
    pub fn revoke(&self) {
        self.close_with(Some(Status::unauthenticated("token revoked")));
    }

    /// Ends the stream because its agent's connection stopped answering liveness pings
    /// (`crate::liveness`): the call on it ends as lost at once.
    pub fn close_silent(&self) {
        self.inner.lock().silent = true;
        self.close_with(None);
    }

    fn close_with(&self, why: Option<Status>) {
        {
            let mut inner = self.inner.lock();
            match &mut inner.state {
                State::Closed { status } => {
                    if status.is_none() {
                        *status = why;
                    }
                }
                state => *state = State::Closed { status: why },
            }
        }
        self.fire_closed();
    }

    /// Wakes the reader and ends the outbound half (which then reads the closing status).
    fn fire_closed(&self) {
        self.out.cut();
        self.closed.store(true, Ordering::Release);
        self.closed_wake.notify_waiters();
    }

    fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// The agent sent `GoingAway`. True when no call is on the stream.
    pub fn going_away(&self) -> bool {
        let mut inner = self.inner.lock();
        if matches!(inner.state, State::Open) {
            inner.state = State::Retiring;
        }
        inner.call.is_none()
    }

    /// Puts a call on the stream (leased from the hub). Hands the slot back when the
    /// stream was closed meanwhile: no agent saw the call, so it may take another stream.
    /// A retiring stream still takes it: the agent serves a call that crossed its
    /// `GoingAway`.
    pub fn begin_call(&self, slot: CallSlot) -> Result<(), CallSlot> {
        let mut inner = self.inner.lock();
        if matches!(inner.state, State::Closed { .. }) || inner.call.is_some() {
            return Err(slot);
        }
        inner.call = Some(slot);
        inner.whole_request = false;
        inner.reader_waits = false;
        Ok(())
    }

    /// Checks that a frame for `call_id` belongs to the call on the stream (`check` sees its
    /// slot), and returns where the call's frames go.
    pub fn route(
        &self,
        call_id: u64,
        check: impl FnOnce(&mut CallSlot) -> Result<(), Status>,
    ) -> Result<mpsc::Sender<Result<ForwardResponse, Status>>, Status> {
        let mut inner = self.inner.lock();
        match inner.call.as_mut() {
            Some(slot) if slot.call_id == call_id => {
                check(slot)?;
                Ok(slot.to_caller.clone())
            }
            Some(slot) => Err(Status::invalid_argument(format!(
                "frame for call {call_id} while call {} is on this stream",
                slot.call_id
            ))),
            None => Err(Status::invalid_argument(format!(
                "frame for call {call_id} with no call on this stream"
            ))),
        }
    }

    /// The call on the stream ended: it leaves the stream, and its task hears `outcome`.
    pub fn end_call(&self, outcome: Outcome) {
        let slot = self.inner.lock().call.take();
        if let Some(slot) = slot {
            if let Some(c) = &slot.credit {
                c.request.close();
            }
            let _ = slot.done.send(outcome);
        }
    }

    /// The reader's last word: the stream is closed for good and no call may begin; returns
    /// the call still on it.
    pub fn end(&self) -> Ending {
        let mut inner = self.inner.lock();
        // A closing status is the revocation's UNAUTHENTICATED, or a crash's (`fail`).
        let revoked = matches!(
            &inner.state,
            State::Closed { status: Some(s) } if s.code() == tonic::Code::Unauthenticated
        );
        if !matches!(inner.state, State::Closed { .. }) {
            inner.state = State::Closed { status: None };
        }
        let call = inner.call.take();
        if let Some(c) = call.as_ref().and_then(|c| c.credit.as_ref()) {
            c.request.close();
        }
        Ending {
            call,
            revoked,
            silent: inner.silent,
        }
    }

    /// Ends the outbound half (after [`StreamHandle::end`]).
    pub fn cut(&self) {
        self.fire_closed();
    }

    /// Fires once the stream is closed.
    pub async fn closed(&self) {
        loop {
            let wake = self.closed_wake.notified();
            tokio::pin!(wake);
            // Registered before the check: a close between the two still wakes it.
            wake.as_mut().enable();
            if self.is_closed() {
                return;
            }
            wake.await;
        }
    }

    /// The status the RPC ends with once closed, for the outbound half.
    pub fn end_status(&self) -> EndStatus {
        EndStatus(self.inner.clone())
    }

    /// Queues a frame if there is room; control frames only.
    pub fn try_send(&self, frame: ServerFrame) -> bool {
        self.out.try_send(Ok(Box::new(frame))).is_ok()
    }

    /// Queues a frame the agent must see last (the status a protocol error closes the
    /// stream with, after [`StreamHandle::end`]). The status is also kept as the closing
    /// one: a close that comes before the agent has read it (the call that was on the
    /// stream gives the stream back, which closes it) cuts the queue, and the RPC then
    /// ends with the closing status instead of an OK that would hide the error.
    pub fn try_send_status(&self, status: Status) {
        if let State::Closed {
            status: kept @ None,
        } = &mut self.inner.lock().state
        {
            *kept = Some(status.clone());
        }
        let _ = self.out.try_send(Err(status));
    }

    /// Sends a frame, waiting for room (flow control); `Err` once the stream is closed.
    ///
    /// The frame is queued when this is called if there is room (the usual case, which
    /// takes no wait and no waiter on `closed`); the future then holds no frame. Only a
    /// full queue makes it wait, in a boxed future: a wait for the agent's stream is rare,
    /// and the futures that hold a `send` (the stream's reader, for its whole life) stay
    /// small.
    pub fn send(
        &self,
        frame: ServerFrame,
    ) -> impl std::future::Future<Output = Result<(), ()>> + Send + '_ {
        let queued = if self.is_closed() {
            Err(None)
        } else {
            match self.out.try_send(Ok(Box::new(frame))) {
                Ok(()) => Ok(()),
                Err(TrySendError::Closed(_)) => Err(None),
                Err(TrySendError::Full(frame)) => Err(Some(frame)),
            }
        };
        async move {
            match queued {
                Ok(()) => Ok(()),
                Err(None) => Err(()),
                Err(Some(frame)) => {
                    Box::pin(async move {
                        tokio::select! {
                            r = self.out.send(frame) => r.map_err(|_| ()),
                            _ = self.closed() => Err(()),
                        }
                    })
                    .await
                }
            }
        }
    }
}

/// The status an agent stream's RPC ends with, read once its outbound half ends: the one
/// a close left (a revocation's UNAUTHENTICATED), or none (OK).
pub struct EndStatus(Arc<Mutex<Inner>>);

impl EndStatus {
    pub fn get(&self) -> Option<Status> {
        match &self.0.lock().state {
            State::Closed { status } => status.clone(),
            _ => None,
        }
    }
}

impl PartialEq for StreamHandle {
    /// One stream is one id.
    fn eq(&self, other: &Self) -> bool {
        self.id == other.id
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn handle() -> (StreamHandle, crate::outbox::OutboxRx<OutFrame>) {
        let (tx, rx) = crate::outbox::outbox(4);
        (
            StreamHandle::new(1, "t".into(), [0; 32], AgentFeatures::default(), tx),
            rx,
        )
    }

    fn slot(call_id: u64) -> (CallSlot, oneshot::Receiver<Outcome>) {
        let (to_caller, _) = mpsc::channel(1);
        let (done, rx) = oneshot::channel();
        let slot = CallSlot {
            call_id,
            trace_id: relay_common::trace::TraceId([1; 16]),
            to_caller,
            done,
            head_seen: false,
            credit: None,
        };
        (slot, rx)
    }

    #[test]
    fn a_retiring_stream_takes_no_new_call_from_the_hub_but_serves_one_that_crossed() {
        let (h, _rx) = handle();
        assert!(h.is_usable());
        assert!(h.going_away(), "idle when it retired");
        assert!(!h.is_usable());
        assert!(
            h.begin_call(slot(1).0).is_ok(),
            "a call that crossed GoingAway runs"
        );
        assert!(!h.going_away(), "busy");
    }

    #[test]
    fn a_protocol_errors_status_survives_a_close_that_cuts_the_queue_before_it_is_read() {
        let (h, _rx) = handle();
        let _ = h.end();
        h.try_send_status(Status::invalid_argument("malformed header"));
        // The call that was on the stream gives it back, which closes it and cuts the
        // queue before the agent read the status: the RPC still ends with it.
        h.close();
        let end = h.end_status().get().expect("the closing status");
        assert_eq!(end.code(), tonic::Code::InvalidArgument);
        assert_eq!(end.message(), "malformed header");
        // A plain close keeps no status: the RPC ends OK.
        let (plain, _rx) = handle();
        plain.close();
        assert!(plain.end_status().get().is_none());
    }

    #[test]
    fn a_closed_stream_hands_a_new_call_back() {
        let (h, _rx) = handle();
        h.close();
        assert!(!h.is_usable());
        assert!(
            h.begin_call(slot(1).0).is_err(),
            "no call begins on a closed stream"
        );
        assert!(h.end().call.is_none());
    }

    #[test]
    fn the_readers_last_word_takes_the_call_still_on_the_stream() {
        let (h, _rx) = handle();
        let (s, mut done) = slot(1);
        h.begin_call(s).unwrap();
        h.close();
        let ending = h.end();
        assert!(!ending.revoked);
        assert_eq!(ending.call.map(|c| c.call_id), Some(1));
        assert!(
            done.try_recv().is_err(),
            "the reader ends the call, not the handle"
        );
        assert!(h.end_status().get().is_none(), "closed with OK");
    }

    #[test]
    fn a_revoked_stream_ends_with_unauthenticated_even_if_closed_after() {
        let (h, _rx) = handle();
        h.revoke();
        h.close();
        assert!(h.end().revoked);
        let status = h.end_status().get().expect("a status");
        assert_eq!(status.code(), tonic::Code::Unauthenticated);
    }
}
