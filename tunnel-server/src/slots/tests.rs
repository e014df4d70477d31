//! The slot rules as scenarios: streams are numbers, waiters are names, time is a
//! `Duration` since the start.

use super::*;
use proptest::prelude::*;
use std::collections::HashSet;

type Core = Slots<u32, &'static str, Duration>;

const CAP: usize = 8;
const QUEUE: usize = 3;

/// A tunnel id's slots and which of its streams can no longer take a call.
#[derive(Default)]
struct Tunnel {
    slots: Core,
    dead: HashSet<u32>,
}

impl Tunnel {
    /// Streams added and confirmed, in this order.
    fn with(streams: &[u32]) -> Self {
        let mut t = Tunnel::default();
        for &s in streams {
            t.slots.add(s, CAP).unwrap();
            assert_eq!(t.slots.confirm(s), Some(Placed::Idle));
        }
        t
    }

    fn take(&mut self, waiter: &'static str) -> Take<u32> {
        let dead = &self.dead;
        self.slots.take(QUEUE, |s| !dead.contains(s), || waiter)
    }

    /// A stream `take` must hand out.
    fn stream(&mut self) -> u32 {
        match self.take("-") {
            Take::Stream(s) => s,
            other => panic!("expected an idle stream, got {other:?}"),
        }
    }

    /// A call that must queue.
    fn queue(&mut self, waiter: &'static str) -> WaiterId {
        match self.take(waiter) {
            Take::Queued(id) => id,
            other => panic!("expected {waiter} to queue, got {other:?}"),
        }
    }

    fn release(&mut self, s: u32) -> Placed<u32, &'static str> {
        let usable = !self.dead.contains(&s);
        self.slots.release(s, usable)
    }
}

fn secs(n: u64) -> Duration {
    Duration::from_secs(n)
}

#[test]
fn a_call_takes_the_newest_idle_stream() {
    let mut t = Tunnel::with(&[1, 2, 3]);
    assert_eq!(t.stream(), 3);
    assert_eq!(t.stream(), 2);
    assert_eq!(t.release(3), Placed::Idle);
    assert_eq!(t.stream(), 3, "the one just released is the newest idle");
    assert_eq!(t.stream(), 1, "the oldest is used last");
    assert_eq!(t.slots.busy(), 3);
}

#[test]
fn a_stream_takes_no_call_before_its_agent_confirms_it() {
    let mut t = Tunnel::default();
    assert_eq!(
        t.slots.add(1, CAP),
        Ok(true),
        "the tunnel id's first stream"
    );
    assert_eq!(t.slots.add(2, CAP), Ok(false));
    let w = t.queue("a");
    assert_eq!(t.slots.confirm(2), Some(Placed::Waiter("a", 2)));
    assert!(!t.slots.leave(w), "served");
    assert_eq!(t.slots.confirm(2), None, "confirmed once");
    assert_eq!(t.slots.confirm(9), None, "not a stream of this tunnel id");
    assert_eq!(t.slots.idle(|_| true), 0, "stream 1 is still unconfirmed");
    assert_eq!(t.slots.confirm(1), Some(Placed::Idle));
    assert_eq!(t.stream(), 1);
}

#[test]
fn the_oldest_waiter_is_served_first() {
    let mut t = Tunnel::with(&[1, 2]);
    let (a, b) = (t.stream(), t.stream());
    t.queue("first");
    t.queue("second");
    t.queue("third");
    assert_eq!(t.slots.queued(), 3);
    assert_eq!(t.release(a), Placed::Waiter("first", a));
    t.slots.add(3, CAP).unwrap();
    assert_eq!(
        t.slots.confirm(3),
        Some(Placed::Waiter("second", 3)),
        "a newly confirmed stream serves the queue too"
    );
    assert_eq!(t.release(b), Placed::Waiter("third", b));
    assert_eq!(t.slots.queued(), 0);
    assert_eq!(t.slots.busy(), 3, "each hand-off is a lease");
}

#[test]
fn a_waiter_that_leaves_takes_nothing_with_it() {
    let mut t = Tunnel::with(&[1]);
    let s = t.stream();
    let first = t.queue("first");
    t.queue("second");
    assert!(t.slots.leave(first), "it was still waiting");
    assert_eq!(t.slots.queued(), 1);
    assert_eq!(t.release(s), Placed::Waiter("second", s));
    assert!(!t.slots.leave(first), "leaving twice changes nothing");
}

#[test]
fn a_reservation_given_back_goes_to_the_next_waiter_then_back_on_top() {
    let mut t = Tunnel::with(&[1, 2]);
    let (s, other) = (t.stream(), t.stream());
    let reserving = t.queue("reserving");
    t.queue("next");
    // The stream goes to `reserving`, which gives up (its dispatcher never said Proceed)
    // after it was served: it must give the stream back, and the next waiter gets it.
    assert_eq!(t.release(s), Placed::Waiter("reserving", s));
    assert!(
        !t.slots.leave(reserving),
        "already served: it holds the stream"
    );
    assert_eq!(t.release(s), Placed::Waiter("next", s));
    // Given back with nobody waiting: on top of the stack, the newest idle again.
    assert_eq!(t.release(other), Placed::Idle);
    assert_eq!(t.release(s), Placed::Idle);
    assert_eq!(t.slots.busy(), 0);
    assert_eq!(t.stream(), s);
    assert_eq!(t.stream(), other);
}

#[test]
fn the_queue_is_bounded() {
    let mut t = Tunnel::with(&[1]);
    t.stream();
    for w in ["a", "b", "c"] {
        t.queue(w);
    }
    assert_eq!(t.take("d"), Take::QueueFull);
    assert_eq!(t.slots.queued(), QUEUE as u32);
}

#[test]
fn a_stream_that_cannot_take_calls_is_never_handed_out() {
    let mut t = Tunnel::with(&[1, 2, 3]);
    t.dead.insert(3);
    assert_eq!(t.slots.idle(|s| !t.dead.contains(s)), 2);
    assert_eq!(t.stream(), 2, "the dead newest stream is skipped");
    let busy = t.stream();
    t.dead.insert(busy);
    t.queue("w");
    assert_eq!(t.release(busy), Placed::Close(busy), "not to the waiter");
    assert_eq!(t.slots.queued(), 1);
}

#[test]
fn an_idle_stream_retires_at_once_and_a_busy_one_when_released() {
    let mut t = Tunnel::with(&[1, 2]);
    let busy = t.stream();
    assert!(t.slots.retire(&1), "idle: off the stack, close it now");
    assert!(!t.slots.retire(&busy), "busy: closes when released");
    t.dead.insert(busy); // GoingAway: the stream takes no new call
    t.queue("w");
    assert_eq!(t.release(busy), Placed::Close(busy));
    assert_eq!(t.slots.busy(), 0);
    assert_eq!(t.slots.idle(|_| true), 0, "nothing left to hand out");
}

#[test]
fn a_draining_tunnel_takes_no_new_stream_but_serves_on() {
    let mut t = Tunnel::with(&[1, 2]);
    let s = t.stream();
    assert_eq!(t.slots.drain(), &[1, 2], "every stream is told");
    assert_eq!(t.slots.add(3, CAP), Err(AddError::Draining));
    assert_eq!(t.stream(), 1, "calls still run on the streams held");
    t.queue("w");
    assert_eq!(t.release(s), Placed::Waiter("w", s));
}

#[test]
fn streams_over_the_cap_are_refused() {
    let mut t = Tunnel::with(&[1, 2]);
    assert_eq!(t.slots.add(3, 2), Err(AddError::Exhausted));
    t.slots.remove(&1);
    assert_eq!(t.slots.add(3, 2), Ok(false));
}

#[test]
fn the_last_stream_leaving_turns_every_waiter_away() {
    let mut t = Tunnel::with(&[1, 2]);
    let (a, b) = (t.stream(), t.stream());
    t.queue("x");
    t.queue("y");
    let r = t.slots.remove(&a);
    assert!(r.known && !r.last && r.turned_away.is_empty());
    assert_eq!(
        t.slots.busy(),
        2,
        "a removed stream stays leased until released"
    );
    t.dead.insert(a);
    assert_eq!(t.release(a), Placed::Close(a));
    let r = t.slots.remove(&b);
    assert!(r.known && r.last);
    let names: Vec<_> = r.turned_away.iter().map(|(_, w)| *w).collect();
    assert_eq!(names, ["x", "y"]);
    assert_eq!(t.take("z"), Take::Unknown);
    assert!(!t.slots.remove(&b).known);
}

#[test]
fn pressure_is_told_when_it_changes_and_refreshed_while_calls_wait() {
    let refresh = secs(1);
    let mut t = Tunnel::with(&[1]);
    assert_eq!(t.slots.pressure(secs(0), refresh), None, "nothing waits");
    t.stream();
    t.queue("a");
    assert_eq!(t.slots.pressure(secs(0), refresh), Some(1));
    t.slots.told(1, secs(0));
    assert_eq!(t.slots.pressure(secs(0), refresh), None, "told already");
    assert_eq!(t.slots.pressure(secs(1), refresh), Some(1), "refreshed");
    t.slots.told(1, secs(1));
    t.queue("b");
    assert_eq!(t.slots.pressure(secs(1), refresh), Some(2), "changed");
    t.slots.told(2, secs(1));
    t.release(1);
    t.release(1);
    assert_eq!(t.slots.queued(), 0);
    assert_eq!(
        t.slots.pressure(secs(1), refresh),
        Some(0),
        "the queue emptied"
    );
    t.slots.told(0, secs(1));
    assert_eq!(
        t.slots.pressure(secs(9), refresh),
        None,
        "no refresh at rest"
    );
}

/// One step of a random run.
#[derive(Debug, Clone)]
enum Op {
    Add,
    Confirm(usize),
    Take,
    Leave(usize),
    Release(usize),
    Kill(usize),
    Retire(usize),
    Remove(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        Just(Op::Add),
        (0..16usize).prop_map(Op::Confirm),
        Just(Op::Take),
        Just(Op::Take),
        (0..16usize).prop_map(Op::Leave),
        (0..16usize).prop_map(Op::Release),
        (0..16usize).prop_map(Op::Kill),
        (0..16usize).prop_map(Op::Retire),
        (0..16usize).prop_map(Op::Remove),
    ]
}

/// Carries out a placement in the model: a hand-off is a new lease.
fn settle(
    p: Placed<u32, u64>,
    leased: &mut Vec<u32>,
    waiting: &mut Vec<(WaiterId, u64)>,
    closed: &mut HashSet<u32>,
) -> Result<(), TestCaseError> {
    match p {
        Placed::Idle => {}
        Placed::Waiter(w, s) => {
            waiting.retain(|(_, x)| *x != w);
            prop_assert!(!leased.contains(&s), "stream {} handed out twice", s);
            leased.push(s);
        }
        Placed::Close(s) => {
            closed.insert(s);
        }
    }
    Ok(())
}

proptest! {
    /// Whatever happens, a stream is held by at most one call, nothing leased is idle,
    /// `busy` counts the leases, and every stream given back is either idle, with a
    /// waiter or closed: no stream is lost or handed out twice.
    #[test]
    fn no_stream_is_lost_or_handed_out_twice(ops in proptest::collection::vec(op(), 1..200)) {
        let mut slots: Slots<u32, u64, Duration> = Slots::default();
        let mut next = 0u32;
        let mut added: Vec<u32> = Vec::new();
        let mut dead: HashSet<u32> = HashSet::new();
        let mut removed: HashSet<u32> = HashSet::new();
        // Streams held by a call (leases), and waiters: (waiter, served with).
        let mut leased: Vec<u32> = Vec::new();
        let mut waiting: Vec<(WaiterId, u64)> = Vec::new();
        let mut next_waiter = 0u64;
        let mut closed: HashSet<u32> = HashSet::new();
        for op in ops {
            let pick = |v: &[u32], i: usize| (!v.is_empty()).then(|| v[i % v.len()]);
            match op {
                Op::Add => {
                    next += 1;
                    if slots.add(next, CAP).is_ok() { added.push(next); }
                }
                Op::Confirm(i) => if let Some(s) = pick(&added, i) {
                    if !dead.contains(&s) {
                        if let Some(p) = slots.confirm(s) { settle(p, &mut leased, &mut waiting, &mut closed)?; }
                    }
                },
                Op::Take => {
                    next_waiter += 1;
                    let w = next_waiter;
                    match slots.take(QUEUE, |s| !dead.contains(s), || w) {
                        Take::Stream(s) => {
                            prop_assert!(!dead.contains(&s));
                            prop_assert!(!leased.contains(&s), "stream {} handed out twice", s);
                            leased.push(s);
                        }
                        Take::Queued(id) => waiting.push((id, w)),
                        Take::Unknown | Take::QueueFull => {}
                    }
                }
                Op::Leave(i) => if !waiting.is_empty() {
                    let (id, _) = waiting.remove(i % waiting.len());
                    prop_assert!(slots.leave(id), "a waiter not yet served leaves freely");
                },
                Op::Release(i) => if !leased.is_empty() {
                    let s = leased.remove(i % leased.len());
                    let p = slots.release(s, !dead.contains(&s));
                    settle(p, &mut leased, &mut waiting, &mut closed)?;
                },
                Op::Kill(i) => if let Some(s) = pick(&added, i) { dead.insert(s); },
                Op::Retire(i) => if let Some(s) = pick(&added, i) {
                    dead.insert(s);
                    if slots.retire(&s) { closed.insert(s); }
                },
                Op::Remove(i) => if let Some(s) = pick(&added, i) {
                    dead.insert(s);
                    let r = slots.remove(&s);
                    if r.known { removed.insert(s); }
                    for (id, _) in r.turned_away { waiting.retain(|(w, _)| *w != id); }
                    added.retain(|x| *x != s);
                },
            }
            prop_assert_eq!(slots.busy(), leased.len(), "busy counts the leases");
            prop_assert_eq!(slots.queued() as usize, waiting.len());
            for s in &slots.idle {
                prop_assert!(!leased.contains(s), "stream {} is idle and leased", s);
            }
            let idle: HashSet<_> = slots.idle.iter().collect();
            prop_assert_eq!(idle.len(), slots.idle.len(), "a stream twice on the stack");
            // A live, confirmed stream nobody holds is idle: nothing is lost.
            for s in slots.streams() {
                let confirmed = !slots.unconfirmed.contains(s);
                if confirmed && !dead.contains(s) && !leased.contains(s) {
                    prop_assert!(idle.contains(s), "stream {} was lost", s);
                }
            }
        }
    }
}
