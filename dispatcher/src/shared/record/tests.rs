use super::*;
use crate::registry::{LoadFigures, ServerInfo, TunnelFigures};
use relay_common::hosts::in_net;

const KEY: &[u8] = b"0123456789abcdef0123456789abcdef";
const NOW: u64 = 1_700_000_000_000;

fn rules(hosts: &[&str]) -> RecordRules {
    let hosts: Vec<String> = hosts.iter().map(|h| h.to_string()).collect();
    RecordRules::new(KEY, Vec::new(), false, &hosts).unwrap()
}

fn record(id: &str, forward_url: &str) -> ServerRecord {
    ServerRecord {
        info: ServerInfo {
            server_id: id.into(),
            zone: "z".into(),
            forward_url: forward_url.into(),
            instance_id: "i".into(),
            direct_url: String::new(),
        },
        tunnels: vec!["demo".into()],
        load: Some(LoadFigures {
            tunnels: [("demo".to_string(), TunnelFigures::default())].into(),
            calls_in_flight: 0,
            draining: false,
            cpu_permille: 0,
        }),
        dispatcher: "d1".into(),
    }
}

fn reason(r: Result<ServerRecord, Refusal>) -> &'static str {
    match r {
        Ok(_) => "accepted",
        Err(e) => e.reason(),
    }
}

#[test]
fn a_sealed_record_opens_under_its_key_only_and_until_its_expiry() {
    let r = rules(&["private"]);
    let rec = record("ts-1", "http://10.0.0.5:8451");
    let sealed = r.seal("p:server:ts-1", &rec, NOW + 3000);
    assert_eq!(
        r.open("p:server:ts-1", "ts-1", &sealed, NOW),
        Ok(rec.clone())
    );
    // Moved to another server's key (even with the id rewritten by the mover's listing).
    assert_eq!(
        reason(r.open("p:server:ts-2", "ts-2", &sealed, NOW)),
        "bad_seal"
    );
    // Another fleet's prefix.
    assert_eq!(
        reason(r.open("q:server:ts-1", "ts-1", &sealed, NOW)),
        "bad_seal"
    );
    // Replayed after its expiry.
    assert_eq!(
        r.open("p:server:ts-1", "ts-1", &sealed, NOW + 3000),
        Err(Refusal::Expired(0))
    );
    // Another key.
    let other = RecordRules::new(&[7u8; 32], Vec::new(), false, &["private".into()]).unwrap();
    assert_eq!(
        reason(other.open("p:server:ts-1", "ts-1", &sealed, NOW)),
        "bad_seal"
    );
    // Edited: one byte of the body.
    let tampered = sealed.replace("10.0.0.5", "10.0.0.6");
    assert_eq!(
        reason(r.open("p:server:ts-1", "ts-1", &tampered, NOW)),
        "bad_seal"
    );
    // Plain JSON, as a hand-written record.
    let plain = serde_json::to_string(&rec).unwrap();
    assert_eq!(
        reason(r.open("p:server:ts-1", "ts-1", &plain, NOW)),
        "unsealed"
    );
    assert_eq!(
        reason(r.open("p:server:ts-1", "ts-1", "v1.zz.{}", NOW)),
        "bad_seal"
    );
}

#[test]
fn sealed_records_are_still_checked_field_by_field() {
    let r = rules(&["private", "*.relay.internal", "203.0.113.0/24"]);
    let open = |rec: &ServerRecord| {
        let key = format!("p:server:{}", rec.info.server_id);
        r.open(&key, &rec.info.server_id, &r.seal(&key, rec, NOW + 1), NOW)
    };
    let cases: &[(&str, &str, &str)] = &[
        ("ts-1", "http://127.0.0.1:1", "accepted"),
        ("ts-1", "http://[::1]:1", "accepted"),
        ("ts-1", "http://[fd12::1]:1", "accepted"),
        ("ts-1", "http://100.64.1.1:1", "accepted"),
        ("ts-1", "http://192.168.1.1:1", "accepted"),
        ("ts-1", "http://ts-1.relay.internal:1", "accepted"),
        ("ts-1", "http://TS-1.Relay.Internal:1", "accepted"),
        ("ts-1", "http://203.0.113.9:1", "accepted"),
        ("ts-1", "http://8.8.8.8:1", "forward_url"),
        ("ts-1", "http://[2001:db8::1]:1", "forward_url"),
        ("ts-1", "http://evil.example:1", "forward_url"),
        (
            "ts-1",
            "http://relay.internal.evil.example:1",
            "forward_url",
        ),
        ("ts-1", "https://127.0.0.1:1", "forward_url"),
        ("ts-1", "ftp://127.0.0.1:1", "forward_url"),
        ("ts-1", "not a url", "forward_url"),
        ("ts 1", "http://127.0.0.1:1", "server_id"),
        ("ts-\n1", "http://127.0.0.1:1", "server_id"),
        ("", "http://127.0.0.1:1", "server_id"),
        ("ts-é", "http://127.0.0.1:1", "server_id"),
    ];
    for (id, url, want) in cases {
        assert_eq!(reason(open(&record(id, url))), *want, "{id:?} {url:?}");
    }
    let mut bad = record("ts-1", "http://127.0.0.1:1");
    bad.tunnels.push("../x".into());
    assert_eq!(reason(open(&bad)), "tunnel_id");
    let mut bad = record("ts-1", "http://127.0.0.1:1");
    bad.load
        .as_mut()
        .unwrap()
        .tunnels
        .insert("a b".into(), TunnelFigures::default());
    assert_eq!(reason(open(&bad)), "tunnel_id");
    let mut big = record("ts-1", "http://127.0.0.1:1");
    big.tunnels = (0..=MAX_TUNNELS_PER_RECORD)
        .map(|i| format!("t{i}"))
        .collect();
    assert_eq!(reason(open(&big)), "too_large");
    let mut bad = record("ts-1", "http://127.0.0.1:1");
    bad.info.zone = "z\u{1b}[31m".into();
    assert_eq!(reason(open(&bad)), "malformed");
    let mut bad = record("ts-1", "http://127.0.0.1:1");
    bad.info.direct_url = "javascript:x".into();
    assert_eq!(reason(open(&bad)), "malformed");
    // The record must name the server it is listed as.
    let rec = record("ts-1", "http://127.0.0.1:1");
    let sealed = r.seal("p:server:ts-2", &rec, NOW + 1);
    assert_eq!(
        reason(r.open("p:server:ts-2", "ts-2", &sealed, NOW)),
        "server_id"
    );
    // allowed_servers applies to shared records too.
    let only = RecordRules::new(KEY, vec!["ts-2".into()], false, &["private".into()]).unwrap();
    let sealed = only.seal("p:server:ts-1", &rec, NOW + 1);
    assert_eq!(
        reason(only.open("p:server:ts-1", "ts-1", &sealed, NOW)),
        "server_id"
    );
    // TLS forward: https only.
    let tls = RecordRules::new(KEY, Vec::new(), true, &["private".into()]).unwrap();
    let rec = record("ts-1", "https://10.1.2.3:8451");
    let sealed = tls.seal("p:server:ts-1", &rec, NOW + 1);
    assert_eq!(
        reason(tls.open("p:server:ts-1", "ts-1", &sealed, NOW)),
        "accepted"
    );
}

#[test]
fn forward_host_rules_parse_or_say_why_not() {
    for ok in [
        "private",
        "10.0.0.0/8",
        "fd00::/8",
        "10.1.2.3",
        "*.relay.internal",
        "ts-1",
    ] {
        HostRule::parse(ok).unwrap_or_else(|e| panic!("{ok}: {e}"));
    }
    for bad in ["", "10.0.0.0/33", "x/8", "a b", "http://x", "fd00::/129"] {
        assert!(HostRule::parse(bad).is_err(), "{bad:?}");
    }
    assert!(in_net(
        "10.9.8.7".parse().unwrap(),
        "10.0.0.0".parse().unwrap(),
        8
    ));
    assert!(!in_net(
        "11.0.0.1".parse().unwrap(),
        "10.0.0.0".parse().unwrap(),
        8
    ));
    assert!(in_net(
        "1.2.3.4".parse().unwrap(),
        "0.0.0.0".parse().unwrap(),
        0
    ));
    assert!(in_net(
        "::ffff:10.0.0.1".parse().unwrap(),
        "10.0.0.0".parse().unwrap(),
        8
    ));
}
