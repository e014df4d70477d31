//! The pure core of one tunnel id's streams on this server: who is idle, who waits, who
//! holds a stream. [`Slots`] is a state machine; every method takes the facts it needs
//! (`now`, whether a stream can take a call) as arguments and returns a decision for the
//! shell (`crate::hub`) to carry out: hand a stream to a waiter, close a stream, tell the
//! agent about pressure.
//!
//! It must not read the clock, lock, spawn, await, log or touch metrics: that is the hub's
//! job. Streams (`S`) and waiters (`W`) are opaque values it moves around (the hub uses
//! `Arc<StreamHandle>` and a oneshot sender; the tests plain numbers), and time (`T`) is
//! anything ordered that a [`Duration`] can be added to.
//!
//! # The rules
//!
//! - A stream counts toward the cap from [`Slots::add`], but takes calls only once the
//!   agent confirms it ([`Slots::confirm`]).
//! - **Newest idle stream first**: idle streams form a LIFO stack, so the oldest stay
//!   unused and the agent can retire them.
//! - **Oldest waiter first**: with no idle stream a call joins a bounded FIFO queue; a
//!   stream that frees (or is confirmed) goes to the oldest waiter before the stack.
//! - **A taken stream is a lease**: from [`Slots::take`] or a hand-off to a waiter until
//!   [`Slots::release`], whether or not a call ran on it. A queued call that reserved a
//!   stream and then gave up (the queue handshake's reservation) releases it like any
//!   other: it goes to the next waiter or back on the stack, so nothing is lost. A waiter
//!   that leaves ([`Slots::leave`]) before it is served takes nothing with it.
//! - **Retire**: an idle stream the agent retires leaves the stack at once and is closed;
//!   a busy one is closed when it is released, never handed on. Streams that cannot take a
//!   call (retiring, closing, dead) are never handed out and are dropped from the stack
//!   when met.
//! - **Drain**: a draining tunnel takes no new stream but keeps serving calls on the ones
//!   it holds.
//! - When the last stream goes, every waiter is turned away (the tunnel id left).
//! - **Pressure**: the queue length is told to the agent when it changes, and again every
//!   `refresh` while calls wait.

use std::collections::VecDeque;
use std::ops::Add;
use std::time::Duration;

/// Names one waiter in the queue (for [`Slots::leave`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WaiterId(u64);

/// One tunnel id's streams and queue.
#[derive(Debug)]
pub struct Slots<S, W, T> {
    /// Every stream, in arrival order.
    streams: Vec<S>,
    /// Streams added but not yet confirmed by their agent.
    unconfirmed: Vec<S>,
    /// Idle streams, LIFO: the newest is last.
    idle: Vec<S>,
    /// Calls waiting for a stream, oldest first.
    waiters: VecDeque<(WaiterId, W)>,
    /// Streams taken (leased) and not yet released.
    busy: usize,
    next_waiter: u64,
    draining: bool,
    /// The queue length last told to the agent, and when.
    told: Option<(u32, T)>,
}

/// Why [`Slots::add`] refused a stream.
#[derive(Debug, PartialEq, Eq)]
pub enum AddError {
    /// The tunnel id holds `max_streams_per_token` streams here already.
    Exhausted,
    Draining,
}

/// What [`Slots::take`] decided.
#[derive(Debug, PartialEq, Eq)]
pub enum Take<S> {
    /// The newest idle stream, now leased to the caller.
    Stream(S),
    /// No idle stream: the caller waits in the queue as this waiter.
    Queued(WaiterId),
    /// No stream of the tunnel id at all.
    Unknown,
    /// No idle stream and the queue is full.
    QueueFull,
}

/// Where a stream went, for the shell to carry out.
#[derive(Debug, PartialEq, Eq)]
pub enum Placed<S, W> {
    /// On top of the idle stack.
    Idle,
    /// Leased to the oldest waiter: hand it over. If the waiter is gone, release the
    /// stream again.
    Waiter(W, S),
    /// It cannot take calls any more: close it.
    Close(S),
}

/// What [`Slots::remove`] did.
#[derive(Debug)]
pub struct Removed<W> {
    /// The stream was registered here.
    pub known: bool,
    /// It was the last one: the tunnel id has left this server.
    pub last: bool,
    /// Waiters turned away because the last stream went.
    pub turned_away: VecDeque<(WaiterId, W)>,
}

impl<S, W, T> Default for Slots<S, W, T> {
    fn default() -> Self {
        Slots {
            streams: Vec::new(),
            unconfirmed: Vec::new(),
            idle: Vec::new(),
            waiters: VecDeque::new(),
            busy: 0,
            next_waiter: 0,
            draining: false,
            told: None,
        }
    }
}

impl<S: PartialEq + Clone, W, T: Copy + PartialOrd + Add<Duration, Output = T>> Slots<S, W, T> {
    /// Registers a new stream, unconfirmed. Returns true when it is the tunnel id's first.
    pub fn add(&mut self, stream: S, cap: usize) -> Result<bool, AddError> {
        if self.draining {
            return Err(AddError::Draining);
        }
        if self.streams.len() >= cap {
            return Err(AddError::Exhausted);
        }
        let first = self.streams.is_empty();
        self.unconfirmed.push(stream.clone());
        self.streams.push(stream);
        Ok(first)
    }

    /// The agent confirmed `stream`: it goes to the oldest waiter, or on top of the idle
    /// stack. `None` when it is not an unconfirmed stream of this tunnel id.
    pub fn confirm(&mut self, stream: S) -> Option<Placed<S, W>> {
        let at = self.unconfirmed.iter().position(|s| *s == stream)?;
        self.unconfirmed.swap_remove(at);
        self.busy += 1;
        Some(self.place(stream, true))
    }

    /// A call wants a stream: the newest idle one that can take a call (`usable`), else a
    /// place in the queue (`waiter` makes the waiter), unless it holds `max_queue` already.
    pub fn take(
        &mut self,
        max_queue: usize,
        usable: impl Fn(&S) -> bool,
        waiter: impl FnOnce() -> W,
    ) -> Take<S> {
        while let Some(s) = self.idle.pop() {
            if usable(&s) {
                self.busy += 1;
                return Take::Stream(s);
            }
        }
        if self.streams.is_empty() {
            return Take::Unknown;
        }
        if self.waiters.len() >= max_queue {
            return Take::QueueFull;
        }
        let id = WaiterId(self.next_waiter);
        self.next_waiter += 1;
        self.waiters.push_back((id, waiter()));
        Take::Queued(id)
    }

    /// A waiter gives up. True when it was still waiting (it holds nothing); false when it
    /// was served (or turned away) already: then a stream handed to it must be released.
    pub fn leave(&mut self, id: WaiterId) -> bool {
        match self.waiters.iter().position(|(w, _)| *w == id) {
            Some(at) => {
                self.waiters.remove(at);
                true
            }
            None => false,
        }
    }

    /// A leased stream comes back (its call ended, or its holder gave it up unused):
    /// `usable` says whether it can take another call.
    pub fn release(&mut self, stream: S, usable: bool) -> Placed<S, W> {
        self.place(stream, usable)
    }

    /// Places a leased stream: next waiter, else the stack, or closed.
    fn place(&mut self, stream: S, usable: bool) -> Placed<S, W> {
        if !usable {
            self.busy = self.busy.saturating_sub(1);
            return Placed::Close(stream);
        }
        match self.waiters.pop_front() {
            // The lease passes to the waiter: still busy.
            Some((_, w)) => Placed::Waiter(w, stream),
            None => {
                self.busy = self.busy.saturating_sub(1);
                self.idle.push(stream);
                Placed::Idle
            }
        }
    }

    /// The agent retires `stream`: true when it was idle, so it left the stack and must be
    /// closed now. A busy one is closed when it is released (it is no longer usable then).
    pub fn retire(&mut self, stream: &S) -> bool {
        match self.idle.iter().position(|s| s == stream) {
            Some(at) => {
                self.idle.remove(at);
                true
            }
            None => false,
        }
    }

    /// A stream ended. A leased one stays counted busy until its lease is released.
    pub fn remove(&mut self, stream: &S) -> Removed<W> {
        let before = self.streams.len();
        self.streams.retain(|s| s != stream);
        let known = self.streams.len() != before;
        if known {
            self.idle.retain(|s| s != stream);
            self.unconfirmed.retain(|s| s != stream);
        }
        let last = known && self.streams.is_empty();
        Removed {
            known,
            last,
            turned_away: if last {
                std::mem::take(&mut self.waiters)
            } else {
                VecDeque::new()
            },
        }
    }

    /// Starts draining: no new stream from now on. Returns every stream, to be told.
    pub fn drain(&mut self) -> &[S] {
        self.draining = true;
        &self.streams
    }

    /// Every stream, in arrival order.
    pub fn streams(&self) -> &[S] {
        &self.streams
    }

    pub fn is_empty(&self) -> bool {
        self.streams.is_empty()
    }

    /// Idle streams that can take a call now.
    pub fn idle(&self, usable: impl Fn(&S) -> bool) -> usize {
        self.idle.iter().filter(|s| usable(s)).count()
    }

    /// Leased streams (carrying a call, or reserved by a queued call).
    pub fn busy(&self) -> usize {
        self.busy
    }

    /// Calls waiting for a stream.
    pub fn queued(&self) -> u32 {
        self.waiters.len() as u32
    }

    /// The queue length to tell the agent now, if any: when it changed since last told,
    /// or `refresh` after the last time while calls wait (the agent forgets a hint that
    /// is not refreshed). Call [`Slots::told`] once it went out.
    pub fn pressure(&self, now: T, refresh: Duration) -> Option<u32> {
        let queued = self.queued();
        let (last, at) = match self.told {
            Some((n, at)) => (n, Some(at)),
            None => (0, None),
        };
        let stale = queued > 0 && at.is_none_or(|at| at + refresh <= now);
        (queued != last || stale).then_some(queued)
    }

    /// The agent was told `queued` at `now`.
    pub fn told(&mut self, queued: u32, now: T) {
        self.told = Some((queued, now));
    }

    /// No call waits and the agent was last told none (or nothing): nothing to tell until
    /// a call queues.
    pub fn pressure_settled(&self) -> bool {
        self.queued() == 0 && self.told.is_none_or(|(n, _)| n == 0)
    }
}

#[cfg(test)]
mod tests;
