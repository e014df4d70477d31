//! The pure core of one call's forward attempts: which tunnel server is tried next, whether
//! a failed attempt lets the call go on, and where one attempt stands in the queue
//! handshake. [`Attempts`] and [`Handshake`] are state machines: each method takes the
//! facts it needs (the frame that came, whether the request body can still be replayed,
//! `now`) and returns a decision for the shell to carry out (`call` drives the attempts,
//! `forward` one attempt's RPC).
//!
//! It must not read the clock, do I/O, log or touch metrics.
//!
//! # The rules
//!
//! Servers are tried in the order the router picked, with the co-located tunnel server (if
//! it is among them) first: the call then skips a network hop. At most `max_attempts`,
//! all within the call's deadline (the shell bounds the whole with it), and a retry only
//! while the request body sent so far can be replayed (the replay limit covers what a
//! queued call can have sent, see `replay`). Each failure's half of the decision is made
//! once, where the failure is known, as a [`Retry`] (`error.rs`); [`RetryRules::allows`]
//! adds the configured half:
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

use crate::config::RoutingPolicy;
use crate::error::{ErrorCode, Failure, Retry};
use crate::routing::Target;
use tokio::time::Instant;

/// The configured half of the retry decision; the failure's half is its [`Retry`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryRules {
    pub policy: RoutingPolicy,
    /// `[routing] retry_idempotent`.
    pub retry_idempotent: bool,
    /// `[routing] max_attempts`: servers one call may try, the first included.
    pub max_attempts: usize,
}

impl RetryRules {
    /// Whether a call whose attempt failed with `retry` goes to `next`, the next server
    /// the router picked (if any; the attempt count and body replay are checked by
    /// [`Attempts`]).
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

/// Methods that may be retried after they may have reached an agent, when configured.
pub fn idempotent(method: &str) -> bool {
    matches!(method, "GET" | "HEAD" | "OPTIONS" | "PUT" | "DELETE")
}

/// The `deadline_ms` of an attempt's request head sent at `now`: what is left of the
/// call's deadline, at least 1 ms (0 would mean "no deadline" on the wire).
pub fn deadline_ms(deadline: Instant, now: Instant) -> u32 {
    let remaining = deadline.saturating_duration_since(now);
    u32::try_from(remaining.as_millis())
        .unwrap_or(u32::MAX)
        .max(1)
}

/// One call's attempts over the servers the router picked.
#[derive(Debug)]
pub struct Attempts<'a> {
    servers: &'a [Target],
    /// The co-located server's place in `servers`: it is tried first.
    local: Option<usize>,
    rules: RetryRules,
    method: &'a str,
    /// Attempts started.
    started: usize,
    /// The last attempt's failure ended the call.
    final_failure: bool,
}

/// What [`Attempts::next`] decided.
#[derive(Debug, PartialEq, Eq)]
pub enum Next<'a> {
    /// The first attempt goes to this server.
    First(&'a Target),
    /// The last attempt failed in a way the rules retry: the next goes to this server.
    Retry(&'a Target),
    /// No more attempts: the call ends with the last failure.
    Stop(Stop),
}

/// Why [`Attempts::next`] stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stop {
    /// Every picked server was tried, or `max_attempts` were made (or none was picked).
    Exhausted,
    /// The last failure may not be retried (see [`RetryRules::allows`]).
    Final,
    /// A retry would be allowed, but the request body went out beyond what can be
    /// replayed.
    NotReplayable,
}

impl<'a> Attempts<'a> {
    /// `servers` in the router's order; `local`: the co-located server's place among them,
    /// if it is there.
    pub fn new(
        servers: &'a [Target],
        local: Option<usize>,
        rules: RetryRules,
        method: &'a str,
    ) -> Self {
        Attempts {
            servers,
            local,
            rules,
            method,
            started: 0,
            final_failure: false,
        }
    }

    /// The server of attempt `n`: the router's order, with the co-located server (if
    /// picked) moved to the front.
    fn nth(&self, n: usize) -> Option<&'a Target> {
        let i = match self.local {
            Some(l) if n == 0 => l,
            Some(l) if n <= l => n - 1,
            _ => n,
        };
        self.servers.get(i)
    }

    /// Where the next attempt goes, or why there is none. `replayable`: whether the
    /// request body can still be sent whole to another server.
    pub fn next(&mut self, replayable: bool) -> Next<'a> {
        if self.final_failure {
            return Next::Stop(Stop::Final);
        }
        if self.started >= self.rules.max_attempts {
            return Next::Stop(Stop::Exhausted);
        }
        let Some(target) = self.nth(self.started) else {
            return Next::Stop(Stop::Exhausted);
        };
        if self.started == 0 {
            self.started = 1;
            return Next::First(target);
        }
        if !replayable {
            return Next::Stop(Stop::NotReplayable);
        }
        self.started += 1;
        Next::Retry(target)
    }

    /// The current attempt failed with `retry`: whether the rules let the call go on to
    /// the next server (the attempt count and the body's replay are [`Attempts::next`]'s).
    pub fn failed(&mut self, retry: Retry) -> bool {
        let may = self
            .rules
            .allows(retry, self.method, self.nth(self.started));
        self.final_failure = !may;
        may
    }

    /// The number of the current attempt, from 0 (what the request body hands over on).
    pub fn current(&self) -> u32 {
        self.started.saturating_sub(1) as u32
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

/// What came on an attempt's response stream before its head.
#[derive(Debug)]
pub enum Event {
    /// The server queued the call (`Queued`).
    Queued,
    /// The server reserved a stream for the queued call (`StreamReserved`).
    Reserved(u64),
    /// The response head.
    Head,
    /// The server's `ForwardError`, mapped (`Failure::from_forward_error`).
    Error(Failure, Retry),
    /// A body frame, before any head.
    Body,
    /// A frame with nothing in it.
    Empty,
    /// The RPC ended.
    Ended,
    /// The carrier ended before the call was taken (`carrier::not_taken`), with the
    /// status's message.
    NotTaken(String),
    /// The RPC failed, with the status's message, escaped.
    Broke(String),
}

/// What [`Handshake::on`] decided.
#[derive(Debug, PartialEq, Eq)]
pub enum Step {
    /// The server queued the call (count it); wait for the next frame.
    Queued,
    /// Send `Forward.Proceed` for this reservation; the call may reach the agent from here
    /// on, whatever the RPC's fate.
    Proceed(u64),
    /// The head is in: the call is answered and never retried.
    Answered,
    /// The server answered with an error and ends the RPC: read that end, then fail.
    Refused(Failure, Retry),
    /// The attempt failed.
    Failed(Failure, Retry),
}

/// One attempt's place in the queue handshake: between the server's `Queued` and our
/// `Proceed` no agent can have seen the call, so losing the server then is safe to retry.
#[derive(Debug)]
pub struct Handshake<'a> {
    server_id: &'a str,
    stage: Stage,
}

impl<'a> Handshake<'a> {
    /// An attempt on `server_id` whose request went out.
    pub fn new(server_id: &'a str) -> Self {
        Handshake {
            server_id,
            stage: Stage::Sent,
        }
    }

    /// The server could not be reached (`why`); safe to retry.
    pub fn unreachable(&self, why: impl std::fmt::Display) -> Failure {
        Failure::new(
            ErrorCode::TunnelServerUnreachable,
            format!("tunnel server {}: {why}", self.server_id),
        )
    }

    /// Opening the RPC failed with `retry` (`Retry::of_call_error`); `why`: the status's
    /// message, escaped.
    pub fn open_failed(&self, why: String, retry: Retry) -> (Failure, Retry) {
        match retry {
            Retry::MaybeStarted => self.lost(false, format!("went away ({why})")),
            retry => (self.unreachable(why), retry),
        }
    }

    /// A call lost after it left: safe to retry only while it waited in the server's
    /// queue, otherwise it may have reached the agent.
    fn lost(&self, queued: bool, what: String) -> (Failure, Retry) {
        if queued {
            (
                Failure::new(
                    ErrorCode::TunnelServerUnreachable,
                    format!(
                        "tunnel server {} {what} while the call waited in its queue",
                        self.server_id
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
                        self.server_id
                    ),
                ),
                Retry::MaybeStarted,
            )
        }
    }

    /// What a broken frame allows: safe while queued, final otherwise.
    fn broken(&self, message: &str) -> Step {
        let retry = if self.stage == Stage::Queued {
            Retry::Safe
        } else {
            Retry::Never
        };
        Step::Failed(Failure::new(ErrorCode::StreamLost, message), retry)
    }

    /// The next thing that came on the attempt's response stream.
    pub fn on(&mut self, event: Event) -> Step {
        let queued = self.stage == Stage::Queued;
        match event {
            Event::Head => Step::Answered,
            Event::Error(failure, retry) => Step::Refused(failure, retry),
            Event::Queued if self.stage == Stage::Sent => {
                self.stage = Stage::Queued;
                Step::Queued
            }
            Event::Reserved(reservation) if queued => {
                self.stage = Stage::Proceeded;
                Step::Proceed(reservation)
            }
            Event::Body | Event::Queued | Event::Reserved(_) => {
                self.broken("tunnel server broke the forward protocol before the response head")
            }
            Event::Empty => self.broken("tunnel server sent an empty frame"),
            Event::Ended => {
                let (f, r) = self.lost(queued, "ended the call".into());
                Step::Failed(f, r)
            }
            // A carrier the server ended between calls: it never took this one.
            Event::NotTaken(why) => Step::Failed(self.unreachable(why), Retry::Safe),
            Event::Broke(why) => {
                let (f, r) = self.lost(queued, format!("went away ({why})"));
                Step::Failed(f, r)
            }
        }
    }
}

#[cfg(test)]
mod tests;
