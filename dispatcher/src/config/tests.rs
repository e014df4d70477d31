use super::*;
use relay_common::{KeyDigest, Secret};
use std::path::Path;

#[test]
fn parses_a_full_file_with_durations() {
    let cfg: Config = relay_common::config::parse(
        r#"
        listen = "127.0.0.1:1"
        call_timeout = "5s"
        max_call_timeout = "1m"
        [[callers]]
        name = "ci"
        key = "k"
        tunnels = ["*"]
        [tls]
        insecure = true
        [registry_tls]
        insecure = true
        [forward_tls]
        insecure = true
        "#,
        Path::new("d.toml"),
    )
    .unwrap();
    assert_eq!(cfg.call_timeout, Duration::from_secs(5));
    assert_eq!(cfg.max_call_timeout, Duration::from_secs(60));
    assert_eq!(cfg.registry_listen, Config::default().registry_listen);
    assert_eq!(format!("{:?}", cfg.callers[0].key), "Some(***)");
    cfg.validate().unwrap();
}

#[test]
fn caller_and_server_keys_are_kept_as_digests_given_in_clear_or_as_sha256() {
    let parse = |callers: &str| {
        relay_common::config::parse::<Config>(
            &format!(
                "{callers}\n[tls]\ninsecure = true\n[registry_tls]\ninsecure = true\n\
                 [forward_tls]\ninsecure = true\n"
            ),
            Path::new("d.toml"),
        )
    };
    let digest = relay_common::secret::sha256_hex(b"k2");
    let cfg = parse(&format!(
        "[[callers]]\nname = \"a\"\nkey = \"k1\"\ntunnels = [\"*\"]\n\
         [[callers]]\nname = \"b\"\nkey_sha256 = \"{digest}\"\ntunnels = [\"*\"]\n\
         [registry]\nserver_key_sha256 = \"{digest}\"\n"
    ))
    .unwrap();
    cfg.validate().unwrap();
    assert!(cfg.callers[0].digest().unwrap().matches(b"k1"));
    assert!(cfg.callers[1].digest().unwrap().matches(b"k2"));
    assert!(!cfg.callers[1].digest().unwrap().matches(digest.as_bytes()));
    assert!(cfg.registry.server_key_digest().unwrap().matches(b"k2"));

    let both = parse(&format!(
        "[[callers]]\nname = \"a\"\nkey = \"k1\"\nkey_sha256 = \"{digest}\"\ntunnels = [\"*\"]\n"
    ))
    .unwrap();
    let err = both.validate().unwrap_err().to_string();
    assert!(err.contains("callers[0].key"), "{err}");
    let neither = parse("[[callers]]\nname = \"a\"\ntunnels = [\"*\"]\n").unwrap();
    let err = neither.validate().unwrap_err().to_string();
    assert!(err.contains("exactly one of key and key_sha256"), "{err}");
    for bad in [
        "[[callers]]\nname = \"a\"\nkey = \"\"\ntunnels = [\"*\"]\n",
        "[[callers]]\nname = \"a\"\nkey_sha256 = \"abc\"\ntunnels = [\"*\"]\n",
    ] {
        let err = parse(bad).unwrap_err().to_string();
        assert!(err.contains("key"), "{err}");
    }
}

#[test]
fn unknown_key_and_bad_values_are_named() {
    let err =
        relay_common::config::parse::<Config>("listn = \"x\"", Path::new("d.toml")).unwrap_err();
    assert!(err.to_string().contains("listn"), "{err}");
    let cfg = Config {
        max_call_timeout: Duration::from_secs(1),
        ..Config::default()
    }
    .insecure();
    assert!(cfg
        .validate()
        .unwrap_err()
        .to_string()
        .contains("max_call_timeout"));
    let cfg = Config::default().insecure();
    assert!(cfg.validate().unwrap_err().to_string().contains("callers"));
}

#[test]
fn peer_limits_parse_with_their_defaults_and_are_checked() {
    let cfg: Config = relay_common::config::parse(
        r#"
        body_idle_timeout = "2s"
        max_response_headers = 100
        [[callers]]
        name = "shared"
        key = "k"
        tunnels = ["*"]
        max_concurrent_calls_per_tunnel = 8
        "#,
        Path::new("d.toml"),
    )
    .unwrap();
    assert_eq!(cfg.body_idle_timeout, Duration::from_secs(2));
    assert_eq!(cfg.max_response_headers, 100);
    assert_eq!(cfg.max_response_header_bytes, 64 * 1024);
    assert_eq!(cfg.callers[0].max_concurrent_calls_per_tunnel, Some(8));
    let d = Config::default();
    assert_eq!(
        (d.max_response_headers, d.body_idle_timeout),
        (256, Duration::from_secs(60))
    );
    let bad = |f: &dyn Fn(&mut Config)| {
        let mut c = cfg.clone().insecure();
        f(&mut c);
        c.validate().unwrap_err().to_string()
    };
    assert!(bad(&|c| c.max_response_headers = 0).contains("max_response_headers"));
    assert!(bad(&|c| c.max_response_header_bytes = 10).contains("max_response_header_bytes"));
    assert!(bad(&|c| c.body_idle_timeout = Duration::ZERO).contains("body_idle_timeout"));
    assert!(bad(&|c| c.carrier_idle_timeout = Duration::from_millis(1))
        .contains("carrier_idle_timeout"));
    let e = bad(&|c| c.callers[0].max_concurrent_calls_per_tunnel = Some(0));
    assert!(
        e.contains("callers[0].max_concurrent_calls_per_tunnel"),
        "{e}"
    );
}

#[test]
fn front_limits_parse_with_their_defaults_and_bad_values_name_the_key() {
    let cfg: Config = relay_common::config::parse(
        r#"
        [front_limits]
        idle_timeout = "30s"
        proxy_protocol = ["10.0.0.5", "192.168.0.0/16"]
        [[callers]]
        name = "a"
        key = "k"
        tunnels = ["*"]
        "#,
        Path::new("d.toml"),
    )
    .unwrap();
    let l = cfg.front_limits.listener_limits();
    assert_eq!(l.idle_timeout, Duration::from_secs(30));
    assert_eq!(l.first_byte_timeout, Duration::from_secs(10));
    assert_eq!(l.max_connections_per_source, 1024);
    assert_eq!((l.auth_timeout, l.auth_failures), (Duration::ZERO, 0));
    assert!(l.proxy_protocol[1].contains("192.168.7.1".parse().unwrap()));
    assert!(!l.proxy_protocol[0].contains("10.0.0.6".parse().unwrap()));
    let err = relay_common::config::parse::<Config>(
        "[front_limits]\nproxy_protocol = [\"10.0.0.0/40\"]",
        Path::new("d.toml"),
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("proxy_protocol") && err.contains("prefix length"),
        "{err}"
    );
    let mut c = cfg.clone().insecure();
    c.front_limits.first_byte_timeout = Duration::from_millis(5);
    let err = c.validate().unwrap_err().to_string();
    assert!(err.contains("front_limits.first_byte_timeout"), "{err}");
}

#[test]
fn routing_and_registry_sections_parse_and_are_checked() {
    let cfg: Config = relay_common::config::parse(
        r#"
        [[callers]]
        name = "ci"
        key = "k"
        tunnels = ["acme-*", "demo"]
        max_concurrent_calls = 8
        [tls]
        insecure = true
        [registry_tls]
        insecure = true
        [forward_tls]
        insecure = true
        [routing]
        policy = "sticky"
        retry_idempotent = true
        [registry]
        backend = "redis"
        url = "redis://127.0.0.1:6379"
        lease = "5s"
        server_key = "sk"
        allowed_servers = ["ts-1"]
        record_key = "0123456789abcdef0123456789abcdef"
        forward_hosts = ["private", "*.relay.internal", "10.0.0.0/8"]
        "#,
        Path::new("d.toml"),
    )
    .unwrap();
    assert_eq!(cfg.routing.policy, RoutingPolicy::Sticky);
    assert!(cfg.routing.retry_idempotent);
    assert_eq!(cfg.registry.backend, RegistryBackend::Redis);
    assert_eq!(cfg.registry.lease, Duration::from_secs(5));
    assert_eq!(format!("{:?}", cfg.registry.server_key), "Some(***)");
    cfg.validate().unwrap();
    let mut bad = cfg.clone();
    bad.registry.url = None;
    assert!(bad
        .validate()
        .unwrap_err()
        .to_string()
        .contains("registry.url"));
    let mut bad = cfg.clone();
    bad.registry.record_key = None;
    let err = bad.validate().unwrap_err().to_string();
    assert!(
        err.contains("`registry.record_key`") && err.contains("required"),
        "{err}"
    );
    bad.registry.record_key = Some(Secret::new("short"));
    let err = bad.validate().unwrap_err().to_string();
    assert!(
        err.contains("`registry.record_key`") && err.contains("at least 32 bytes"),
        "{err}"
    );
    let mut bad = cfg.clone();
    bad.registry.forward_hosts = vec!["private".into(), "10.0.0.0/40".into()];
    let err = bad.validate().unwrap_err().to_string();
    assert!(err.contains("`registry.forward_hosts[1]`"), "{err}");
    bad.registry.forward_hosts = vec![];
    let err = bad.validate().unwrap_err().to_string();
    assert!(err.contains("`registry.forward_hosts`"), "{err}");
    let mut bad = cfg.clone();
    bad.registry.redis_tls.ca = Some("ca.pem".into());
    let err = bad.validate().unwrap_err().to_string();
    assert!(
        err.contains("`registry.redis_tls`") && err.contains("rediss://"),
        "{err}"
    );
    bad.registry.url = Some(Secret::new("rediss://relay:pw@127.0.0.1:6380"));
    bad.validate().unwrap();
    bad.registry.redis_tls.cert = Some("c.pem".into());
    let err = bad.validate().unwrap_err().to_string();
    assert!(err.contains("`registry.redis_tls.cert`"), "{err}");
    let mut bad = cfg.clone();
    bad.routing.spill_max = 1.0;
    assert!(bad
        .validate()
        .unwrap_err()
        .to_string()
        .contains("spill_max"));
    let err = relay_common::config::parse::<Config>(
        "[routing]\npolicy = \"random\"",
        Path::new("d.toml"),
    )
    .unwrap_err();
    assert!(
        err.to_string().contains("random") || err.to_string().contains("policy"),
        "{err}"
    );
}

#[test]
fn every_hop_needs_tls_or_an_explicit_insecure() {
    let base = || {
        let mut c = Config::default().insecure();
        c.callers = vec![CallerConfig::allow_all("ci", "k")];
        c
    };
    base().validate().unwrap();
    let mut c = base();
    c.registry_tls = ListenerTls::default();
    let err = c.validate().unwrap_err().to_string();
    assert!(
        err.contains("`registry_tls`") && err.contains("insecure = true"),
        "{err}"
    );
    let mut c = base();
    c.registry_tls = ListenerTls {
        cert: Some("s.pem".into()),
        key: Some("s.key".into()),
        ..Default::default()
    };
    let err = c.validate().unwrap_err().to_string();
    assert!(err.contains("`registry_tls.client_ca`"), "{err}");
    // Mutual TLS pins the tunnel servers' certificates: by name, or by their server id.
    c.registry_tls.client_ca = Some("ca.pem".into());
    let err = c.validate().unwrap_err().to_string();
    assert!(
        err.contains("`registry_tls.client_names`") && err.contains("registry.server_id_in_cert"),
        "{err}"
    );
    c.registry.server_id_in_cert = true;
    c.validate().unwrap();
    c.registry.server_id_in_cert = false;
    c.registry_tls.client_names = vec!["tunnel-server".into()];
    c.validate().unwrap();
    let mut c = base();
    c.forward_tls = DialerTls {
        ca: Some("ca.pem".into()),
        ..Default::default()
    };
    let err = c.validate().unwrap_err().to_string();
    assert!(err.contains("`forward_tls.cert`"), "{err}");
    let mut c = base();
    c.tls = ListenerTls {
        cert: Some("s.pem".into()),
        key: Some("s.key".into()),
        ..Default::default()
    };
    c.validate().unwrap();
    c.tls.insecure = true;
    let err = c.validate().unwrap_err().to_string();
    assert!(err.contains("`tls.insecure`"), "{err}");
}

#[test]
fn a_registry_off_loopback_needs_a_server_key() {
    let mut c = Config {
        callers: vec![CallerConfig::allow_all("c", "k")],
        registry_listen: "0.0.0.0:8460".parse().unwrap(),
        ..Config::default().insecure()
    };
    let err = c.validate().unwrap_err().to_string();
    assert!(
        err.contains("`registry.server_key`") && err.contains("0.0.0.0:8460"),
        "{err}"
    );
    c.registry_listen = "10.0.0.5:8460".parse().unwrap();
    assert!(c.validate().is_err());
    // On loopback it runs, with a warning.
    c.registry_listen = "127.0.0.1:8460".parse().unwrap();
    c.validate().unwrap();
    assert!(c.registry_key_needed(c.registry_listen).unwrap());
    assert!(c
        .registry_key_needed("[::1]:8460".parse().unwrap())
        .unwrap());
    // A key (in clear or as its SHA-256) is all it takes.
    c.registry_listen = "0.0.0.0:8460".parse().unwrap();
    c.registry.server_key = Some(KeyDigest::of(b"secret"));
    c.validate().unwrap();
    assert!(!c.registry_key_needed(c.registry_listen).unwrap());
}

#[test]
fn callers_name_their_tunnels_explicitly() {
    let err = relay_common::config::parse::<Config>(
        "[[callers]]\nname = \"a\"\nkey = \"k\"\n",
        Path::new("d.toml"),
    )
    .unwrap_err();
    assert!(err.to_string().contains("tunnels"), "{err}");
    let mut c = Config::default().insecure();
    c.callers = vec![CallerConfig {
        tunnels: vec![],
        ..CallerConfig::allow_all("a", "k")
    }];
    let err = c.validate().unwrap_err().to_string();
    assert!(err.contains("`callers[0].tunnels`"), "{err}");
    c.callers[0].tunnels = vec!["acme/x".into()];
    let err = c.validate().unwrap_err().to_string();
    assert!(err.contains("`callers[0].tunnels[0]`"), "{err}");
}

#[test]
fn example_configs_are_valid() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples");
    for (file, tls) in [
        ("local/dispatcher.toml", false),
        ("tls/dispatcher.toml", true),
    ] {
        let c: Config = relay_common::config::load(Some(&root.join(file)))
            .unwrap_or_else(|e| panic!("{file}: {e}"));
        c.validate().unwrap_or_else(|e| panic!("{file}: {e}"));
        let t = c.transport().unwrap();
        assert_eq!(
            (t.front.is_some(), t.registry.is_some(), t.forward.is_some()),
            (tls, tls, tls),
            "{file}"
        );
    }
}
