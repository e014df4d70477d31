//! The table's scraped text, line for line, and which series exist as servers come and go.

use super::*;
use prometheus::Registry;
use relay_common::admin::render_metrics as scrape;

fn registered() -> (ServerTable, Registry) {
    let table = ServerTable::new().unwrap();
    let registry = Registry::new();
    registry.register(Box::new(table.clone())).unwrap();
    (table, registry)
}

/// The scraped lines of one metric, without HELP and TYPE.
fn samples(text: &str, name: &str) -> Vec<String> {
    text.lines()
        .filter(|l| l.starts_with(&format!("{name}{{")))
        .map(str::to_owned)
        .collect()
}

/// The text is the one the agent exported when these were prometheus gauge vectors: names,
/// help, type, labels in name order, samples sorted by label values.
#[test]
fn the_scraped_text_is_that_of_the_per_server_gauges() {
    let (table, registry) = registered();
    table.update(|rows| {
        rows.instance("ts-a", 2, 1, Some(State::Growing));
        rows.instance("ts-b", 1, 0, None);
        rows.short("ts-a", Duration::from_millis(3_700));
        rows.short("ts-c", Duration::ZERO);
    });
    // ts-a's next plan gives it no state: the last one stays shown.
    table.update(|rows| {
        rows.instance("ts-a", 3, 0, None);
        rows.instance("ts-b", 1, 0, None);
        rows.short("ts-a", Duration::from_millis(3_700));
        rows.short("ts-c", Duration::ZERO);
    });
    let state_help = "# HELP grpc_tunnel_coverage_state Coverage state of each tunnel server as the last sizing tick judged it (1 = current state)\n\
        # TYPE grpc_tunnel_coverage_state gauge\n";
    let short_help = "# HELP grpc_tunnel_server_short_seconds How long each tunnel server has been short of busy + reserve without a break (0 when covered)\n\
        # TYPE grpc_tunnel_server_short_seconds gauge\n";
    let streams_help = "# HELP grpc_tunnel_server_streams Live tunnel streams of this agent per tunnel server, idle or busy\n\
        # TYPE grpc_tunnel_server_streams gauge\n";
    let expected = [
        state_help,
        "grpc_tunnel_coverage_state{server_id=\"ts-a\",state=\"covered\"} 0\n",
        "grpc_tunnel_coverage_state{server_id=\"ts-a\",state=\"evacuated\"} 0\n",
        "grpc_tunnel_coverage_state{server_id=\"ts-a\",state=\"filling\"} 0\n",
        "grpc_tunnel_coverage_state{server_id=\"ts-a\",state=\"growing\"} 1\n",
        "grpc_tunnel_coverage_state{server_id=\"ts-a\",state=\"overdue\"} 0\n",
        "grpc_tunnel_coverage_state{server_id=\"ts-b\",state=\"covered\"} 0\n",
        "grpc_tunnel_coverage_state{server_id=\"ts-b\",state=\"evacuated\"} 0\n",
        "grpc_tunnel_coverage_state{server_id=\"ts-b\",state=\"filling\"} 0\n",
        "grpc_tunnel_coverage_state{server_id=\"ts-b\",state=\"growing\"} 0\n",
        "grpc_tunnel_coverage_state{server_id=\"ts-b\",state=\"overdue\"} 0\n",
        short_help,
        "grpc_tunnel_server_short_seconds{server_id=\"ts-a\"} 3\n",
        "grpc_tunnel_server_short_seconds{server_id=\"ts-c\"} 0\n",
        streams_help,
        "grpc_tunnel_server_streams{server_id=\"ts-a\",state=\"busy\"} 0\n",
        "grpc_tunnel_server_streams{server_id=\"ts-a\",state=\"idle\"} 3\n",
        "grpc_tunnel_server_streams{server_id=\"ts-b\",state=\"busy\"} 0\n",
        "grpc_tunnel_server_streams{server_id=\"ts-b\",state=\"idle\"} 1\n",
    ]
    .concat();
    assert_eq!(scrape(&registry), expected);

    // ts-a holds no streams any more but is still planned; ts-c is planned no more.
    table.update(|rows| {
        rows.instance("ts-b", 1, 0, None);
        rows.short("ts-a", Duration::from_millis(3_700));
    });
    let expected = [
        state_help,
        "grpc_tunnel_coverage_state{server_id=\"ts-b\",state=\"covered\"} 0\n",
        "grpc_tunnel_coverage_state{server_id=\"ts-b\",state=\"evacuated\"} 0\n",
        "grpc_tunnel_coverage_state{server_id=\"ts-b\",state=\"filling\"} 0\n",
        "grpc_tunnel_coverage_state{server_id=\"ts-b\",state=\"growing\"} 0\n",
        "grpc_tunnel_coverage_state{server_id=\"ts-b\",state=\"overdue\"} 0\n",
        short_help,
        "grpc_tunnel_server_short_seconds{server_id=\"ts-a\"} 3\n",
        streams_help,
        "grpc_tunnel_server_streams{server_id=\"ts-b\",state=\"busy\"} 0\n",
        "grpc_tunnel_server_streams{server_id=\"ts-b\",state=\"idle\"} 1\n",
    ]
    .concat();
    assert_eq!(scrape(&registry), expected);

    table.clear();
    assert_eq!(scrape(&registry), "");
}

#[test]
fn instances_of_one_server_id_add_up_and_show_the_state_of_the_largest() {
    let (table, registry) = registered();
    table.update(|rows| {
        rows.instance("ts-1", 1, 0, Some(State::Covered));
        rows.instance("ts-1", 1, 2, Some(State::Filling));
        rows.instance("ts-1", 0, 1, Some(State::Evacuated));
        rows.short("ts-1", Duration::from_secs(2));
        rows.short("ts-1", Duration::from_millis(5_900));
        rows.short("ts-1", Duration::ZERO);
    });
    let text = scrape(&registry);
    assert_eq!(
        samples(&text, "grpc_tunnel_server_streams"),
        [
            "grpc_tunnel_server_streams{server_id=\"ts-1\",state=\"busy\"} 3",
            "grpc_tunnel_server_streams{server_id=\"ts-1\",state=\"idle\"} 2",
        ]
    );
    let current: Vec<_> = samples(&text, "grpc_tunnel_coverage_state")
        .into_iter()
        .filter(|l| l.ends_with(" 1"))
        .collect();
    assert_eq!(
        current,
        ["grpc_tunnel_coverage_state{server_id=\"ts-1\",state=\"filling\"} 1"]
    );
    assert_eq!(
        samples(&text, "grpc_tunnel_server_short_seconds"),
        ["grpc_tunnel_server_short_seconds{server_id=\"ts-1\"} 5"]
    );
}

/// A server that lost its streams forgets its state: when streams land there again, its
/// state series show 0 until a plan gives it one.
#[test]
fn a_server_whose_streams_return_starts_without_a_state() {
    let (table, registry) = registered();
    table.update(|rows| rows.instance("ts-1", 2, 0, Some(State::Overdue)));
    let ones = |text: &str| {
        samples(text, "grpc_tunnel_coverage_state")
            .into_iter()
            .filter(|l| l.ends_with(" 1"))
            .count()
    };
    assert_eq!(ones(&scrape(&registry)), 1);
    table.update(|_| {});
    assert_eq!(scrape(&registry), "");
    table.update(|rows| rows.instance("ts-1", 1, 0, None));
    let text = scrape(&registry);
    assert_eq!(
        samples(&text, "grpc_tunnel_coverage_state").len(),
        State::ALL.len()
    );
    assert_eq!(ones(&text), 0, "{text}");
}

/// The same figures written again leave the rows as they were: nothing is added twice.
#[test]
fn the_same_plan_written_twice_leaves_the_rows_as_they_were() {
    let (table, _registry) = registered();
    let write = |rows: &mut Rows<'_>| {
        rows.instance("ts-1", 2, 1, Some(State::Covered));
        rows.short("ts-1", Duration::from_secs(1));
        rows.short("ts-2", Duration::ZERO);
    };
    table.update(write);
    let before = table.rows.lock().clone();
    table.update(write);
    assert_eq!(*table.rows.lock(), before);
    assert_eq!(before.len(), 2);
}
