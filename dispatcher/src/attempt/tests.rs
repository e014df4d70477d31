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
        max_attempts: 3,
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

fn servers(ids: &[(&str, u32)]) -> Vec<Target> {
    ids.iter()
        .map(|(id, idle)| Target {
            server_id: (*id).into(),
            forward_url: format!("http://{id}:1").into(),
            idle: *idle,
        })
        .collect()
}

fn rules(policy: RoutingPolicy, max_attempts: usize) -> RetryRules {
    RetryRules {
        policy,
        retry_idempotent: false,
        max_attempts,
    }
}

fn id(next: Next<'_>) -> String {
    match next {
        Next::First(t) | Next::Retry(t) => t.server_id.to_string(),
        Next::Stop(stop) => format!("{stop:?}"),
    }
}

/// A case of [`attempts_table_of_servers_tried`]: what, the rules, the co-located
/// server's place, every attempt's failure, the servers tried and the stop.
type Case = (
    &'static str,
    RetryRules,
    Option<usize>,
    Retry,
    &'static [&'static str],
);

/// The servers a call tries, attempt by attempt, when every attempt fails with the same
/// [`Retry`] and the body stays replayable.
#[test]
fn attempts_table_of_servers_tried() {
    use RoutingPolicy::{Available, Sticky};
    let three = servers(&[("a", 1), ("b", 1), ("c", 0)]);
    let cases: [Case; 8] = [
        (
            "safe: every server",
            rules(Sticky, 3),
            None,
            Retry::Safe,
            &["a", "b", "c", "Exhausted"],
        ),
        (
            "max_attempts caps",
            rules(Sticky, 2),
            None,
            Retry::Safe,
            &["a", "b", "Exhausted"],
        ),
        (
            "one attempt",
            rules(Available, 1),
            None,
            Retry::Safe,
            &["a", "Exhausted"],
        ),
        (
            "final after the first",
            rules(Available, 3),
            None,
            Retry::Never,
            &["a", "Final"],
        ),
        (
            "POST that may have started",
            rules(Available, 3),
            None,
            Retry::MaybeStarted,
            &["a", "Final"],
        ),
        // NO_CAPACITY goes on only onto a server with idle streams (c has none).
        (
            "no capacity, available",
            rules(Available, 3),
            None,
            Retry::NoCapacity,
            &["a", "b", "Final"],
        ),
        (
            "no capacity, sticky",
            rules(Sticky, 3),
            None,
            Retry::NoCapacity,
            &["a", "Final"],
        ),
        // The co-located server first, then the router's order.
        (
            "co-located first",
            rules(Sticky, 3),
            Some(2),
            Retry::Safe,
            &["c", "a", "b", "Exhausted"],
        ),
    ];
    for (what, rules, local, retry, want) in cases {
        let mut attempts = Attempts::new(&three, local, rules, "POST");
        let mut got = Vec::new();
        loop {
            let next = attempts.next(true);
            let stop = matches!(next, Next::Stop(_));
            got.push(id(next));
            if stop {
                break;
            }
            attempts.failed(retry);
        }
        assert_eq!(got, want, "{what}");
    }
}

#[test]
fn attempts_number_from_0_and_stop_when_the_body_is_past_replay() {
    let two = servers(&[("a", 1), ("b", 1)]);
    let mut attempts = Attempts::new(&two, None, rules(RoutingPolicy::Sticky, 3), "POST");
    assert_eq!(
        id(attempts.next(false)),
        "a",
        "the first attempt needs no replay"
    );
    assert_eq!(attempts.current(), 0);
    assert!(attempts.failed(Retry::Safe));
    assert_eq!(attempts.next(false), Next::Stop(Stop::NotReplayable));
    assert!(matches!(attempts.next(true), Next::Retry(t) if &*t.server_id == "b"));
    assert_eq!(attempts.current(), 1);

    let none: [Target; 0] = [];
    let mut attempts = Attempts::new(&none, None, rules(RoutingPolicy::Sticky, 3), "GET");
    assert_eq!(attempts.next(true), Next::Stop(Stop::Exhausted));
}

#[test]
fn the_head_deadline_is_what_is_left_and_never_0() {
    let now = Instant::now();
    let ms = std::time::Duration::from_millis;
    assert_eq!(deadline_ms(now + ms(1500), now), 1500);
    assert_eq!(deadline_ms(now, now), 1);
    assert_eq!(deadline_ms(now, now + ms(10)), 1);
}

/// What one event does at each stage of the queue handshake: the step and, for a failure,
/// its code and [`Retry`].
#[test]
fn handshake_table_of_events() {
    #[derive(Clone, Copy, Debug)]
    enum At {
        Sent,
        Queued,
        Proceeded,
    }
    fn at(stage: At) -> Handshake<'static> {
        let mut h = Handshake::new("ts-1");
        if matches!(stage, At::Queued | At::Proceeded) {
            assert_eq!(h.on(Event::Queued), Step::Queued);
        }
        if matches!(stage, At::Proceeded) {
            assert_eq!(h.on(Event::Reserved(7)), Step::Proceed(7));
        }
        h
    }
    fn summary(step: Step) -> String {
        match step {
            Step::Failed(f, r) => format!("failed {} {r:?}", f.code.as_str()),
            Step::Refused(f, r) => format!("refused {} {r:?}", f.code.as_str()),
            other => format!("{other:?}"),
        }
    }
    let error = || {
        Event::Error(
            Failure::new(ErrorCode::NoCapacity, "no idle tunnel stream"),
            Retry::NoCapacity,
        )
    };
    let cases: Vec<(At, Event, &str)> = vec![
        (At::Sent, Event::Head, "Answered"),
        (At::Proceeded, Event::Head, "Answered"),
        (At::Sent, error(), "refused no_capacity NoCapacity"),
        (At::Sent, Event::Queued, "Queued"),
        (At::Queued, Event::Reserved(3), "Proceed(3)"),
        // Out of order: a protocol break, safe only while queued.
        (At::Sent, Event::Reserved(3), "failed stream_lost Never"),
        (At::Queued, Event::Queued, "failed stream_lost Safe"),
        (At::Proceeded, Event::Queued, "failed stream_lost Never"),
        (At::Sent, Event::Body, "failed stream_lost Never"),
        (At::Queued, Event::Empty, "failed stream_lost Safe"),
        (At::Proceeded, Event::Empty, "failed stream_lost Never"),
        // Lost: safe while queued; otherwise the call may have reached the agent.
        (At::Sent, Event::Ended, "failed stream_lost MaybeStarted"),
        (
            At::Queued,
            Event::Ended,
            "failed tunnel_server_unreachable Safe",
        ),
        (
            At::Proceeded,
            Event::Ended,
            "failed stream_lost MaybeStarted",
        ),
        (
            At::Queued,
            Event::Broke("reset".into()),
            "failed tunnel_server_unreachable Safe",
        ),
        (
            At::Proceeded,
            Event::Broke("reset".into()),
            "failed stream_lost MaybeStarted",
        ),
        // A carrier ended before it took the call: never reached an agent.
        (
            At::Sent,
            Event::NotTaken("ended".into()),
            "failed tunnel_server_unreachable Safe",
        ),
    ];
    for (stage, event, want) in cases {
        let what = format!("{stage:?} {event:?}");
        assert_eq!(summary(at(stage).on(event)), want, "{what}");
    }
}

#[test]
fn failure_messages_name_the_server_and_what_happened() {
    let mut h = Handshake::new("ts-1");
    let Step::Failed(f, _) = h.on(Event::Broke("connection reset".into())) else {
        panic!("a failure")
    };
    assert_eq!(
        f.message,
        "tunnel server ts-1 went away (connection reset) before the response head; the call may have reached the agent, so it was not retried"
    );
    h.on(Event::Queued);
    let (f, retry) = Handshake::new("ts-2").open_failed("refused".into(), Retry::Safe);
    assert_eq!(
        (f.message.as_str(), retry),
        ("tunnel server ts-2: refused", Retry::Safe)
    );
    let (f, retry) = Handshake::new("ts-2").open_failed("reset".into(), Retry::MaybeStarted);
    assert_eq!(
        (f.code, retry),
        (ErrorCode::StreamLost, Retry::MaybeStarted)
    );
    let mut q = Handshake::new("ts-3");
    q.on(Event::Queued);
    let Step::Failed(f, _) = q.on(Event::Ended) else {
        panic!("a failure")
    };
    assert_eq!(
        f.message,
        "tunnel server ts-3 ended the call while the call waited in its queue"
    );
}
