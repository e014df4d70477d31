//! Config parsing and validation: defaults, the token file, TLS against tunnel schemes,
//! the example configs, and errors that name their key.

use super::*;
use std::path::Path;

fn valid() -> Config {
    Config {
        token: Secret::new("dev-token"),
        ..Config::default()
    }
    .insecure()
}

#[test]
fn defaults_are_valid_once_a_token_and_the_transport_are_given() {
    valid().validate().unwrap();
    let err = Config::default().validate().unwrap_err().to_string();
    assert!(err.contains("`tunnels[0]`"), "{err}");
    assert!(err.contains("insecure = true"), "{err}");
    let err = Config::default()
        .insecure()
        .validate()
        .unwrap_err()
        .to_string();
    assert!(err.contains("`token`"), "{err}");
}

#[test]
fn token_file_is_read_trimmed_and_excludes_token() {
    let dir = std::env::temp_dir().join(format!("relay-agent-token-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("token");
    std::fs::write(&file, "s3cret-token\n").unwrap();
    let mut c = Config {
        token: Secret::new(""),
        token_file: Some(file.clone()),
        ..valid()
    };
    c.read_token_file().unwrap();
    assert_eq!(c.token.expose(), "s3cret-token");
    c.validate().unwrap();
    assert!(!format!("{c:?}").contains("s3cret"));

    let mut both = Config {
        token_file: Some(file.clone()),
        ..valid()
    };
    let err = both.read_token_file().unwrap_err().to_string();
    assert!(
        err.contains("`token_file`") && err.contains("not both"),
        "{err}"
    );

    std::fs::write(&file, " \n").unwrap();
    let mut empty = Config {
        token: Secret::new(""),
        token_file: Some(file.clone()),
        ..valid()
    };
    let err = empty.read_token_file().unwrap_err().to_string();
    assert!(
        err.contains("`token_file`") && err.contains("holds no token"),
        "{err}"
    );

    let mut missing = Config {
        token: Secret::new(""),
        token_file: Some(dir.join("nope")),
        ..valid()
    };
    let err = missing.read_token_file().unwrap_err().to_string();
    assert!(
        err.contains("`token_file`") && err.contains("cannot read"),
        "{err}"
    );
    let unread = Config {
        token: Secret::new(""),
        token_file: Some(file),
        ..valid()
    };
    let err = unread.validate().unwrap_err().to_string();
    assert!(err.contains("not read"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn tls_section_and_tunnel_schemes_must_agree() {
    let tls = |t: &str| Config {
        tunnels: vec![t.into()],
        tls: DialerTls {
            ca: Some("ca.pem".into()),
            ..Default::default()
        },
        ..valid()
    };
    tls("https://relay.example.com:443").validate().unwrap();
    let err = tls("http://relay.example.com")
        .validate()
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("`tunnels[0]`") && err.contains("plain http"),
        "{err}"
    );
    let err = Config {
        tunnels: vec!["https://relay.example.com".into()],
        ..valid()
    }
    .validate()
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("`tunnels[0]`") && err.contains("insecure"),
        "{err}"
    );
    let err = Config {
        tunnels: vec!["https://relay.example.com".into()],
        tls: DialerTls::default(),
        ..valid()
    }
    .validate()
    .unwrap_err()
    .to_string();
    assert!(err.contains("`tls.ca`"), "{err}");
    let err = Config {
        tls: DialerTls {
            ca: Some("ca.pem".into()),
            cert: Some("c.pem".into()),
            ..Default::default()
        },
        tunnels: vec!["https://relay.example.com".into()],
        ..valid()
    }
    .validate()
    .unwrap_err()
    .to_string();
    assert!(err.contains("`tls.key`"), "{err}");
}

#[test]
fn toml_with_coverage_table_parses() {
    let text = r#"
            tunnels = ["http://lb:8443"]
            token = "t"
            upstream = "http://10.0.0.5:8080"
            connect_timeout = "3s"
            [tls]
            insecure = true
            [upstream_check]
            path = "/health"
            [coverage]
            enabled = false
            fixed_streams = 4
            tick = "500ms"
        "#;
    let c: Config = relay_common::config::parse(text, Path::new("agent.toml")).unwrap();
    c.validate().unwrap();
    assert_eq!(c.tunnels, vec!["http://lb:8443".to_string()]);
    assert_eq!(c.connect_timeout, Duration::from_secs(3));
    assert_eq!(c.upstream_check.path, "/health");
    assert_eq!(c.upstream_check.interval, Duration::from_secs(10));
    assert!(!c.coverage.enabled);
    assert_eq!(c.coverage.tick, Duration::from_millis(500));
}

#[test]
fn allow_rules_and_limits_parse_from_toml() {
    let text = r#"
            token = "t"
            max_call_timeout = "10m"
            [tls]
            insecure = true
            [limits]
            max_header_bytes = 16384
            max_body_bytes = 1048576
            [[allow]]
            name = "scm-read"
            methods = ["GET", "HEAD"]
            path = "/api/v4/**"
            [[allow]]
            methods = ["POST"]
            path = "/api/v4/projects/*/trigger/pipeline"
            headers = { "x-api-version" = "2" }
            query = { ref = "main" }
        "#;
    let c: Config = relay_common::config::parse(text, Path::new("agent.toml")).unwrap();
    c.validate().unwrap();
    assert_eq!(c.allow.len(), 2);
    assert_eq!(c.allow[0].name.as_deref(), Some("scm-read"));
    assert_eq!(c.allow[1].query["ref"], "main");
    assert_eq!(c.limits.max_body_bytes, Some(1 << 20));
    assert_eq!(c.max_call_timeout, Duration::from_secs(600));
    assert_eq!(c.policy().unwrap().rule_count(), 2);

    let err = relay_common::config::parse::<Config>(
        "[[allow]]\nmethods = [\"GET\"]\npath = \"/a\"\nhost = \"x\"",
        Path::new("a.toml"),
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("host"), "{err}");
}

#[test]
fn example_configs_are_valid() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples");
    for file in [
        "local/agent.toml",
        "colocated/agent.toml",
        "filters/agent.toml",
        "tls/agent.toml",
    ] {
        let c: Config = relay_common::config::load(Some(&root.join(file)))
            .unwrap_or_else(|e| panic!("{file}: {e}"));
        c.validate().unwrap_or_else(|e| panic!("{file}: {e}"));
        assert!(!c.allow.is_empty(), "{file} allows something");
    }
}

#[test]
fn example_filters_allow_fetches_and_refuse_pushes() {
    use crate::filter::Reason;
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/filters/agent.toml");
    let c: Config = relay_common::config::load(Some(&path)).unwrap();
    let policy = c.policy().unwrap();
    let check = |method: &str, target: &str, headers: &[(&str, &str)]| {
        let head = relay_proto::RequestHead {
            call_id: 1,
            method: method.into(),
            path_and_query: target.into(),
            headers: headers
                .iter()
                .map(|(n, v)| relay_proto::header(*n, v))
                .collect(),
            deadline_ms: 0,
            end_of_stream: true,
            ..Default::default()
        };
        policy.prepare(&head).map(|_| ()).map_err(|r| r.reason())
    };
    assert_eq!(check("GET", "/api/v4/projects?page=2", &[]), Ok(()));
    assert_eq!(
        check(
            "GET",
            "/team/app.git/info/refs?service=git-upload-pack",
            &[]
        ),
        Ok(())
    );
    assert_eq!(
        check(
            "POST",
            "/team/app.git/git-upload-pack",
            &[("content-type", "application/x-git-upload-pack-request")]
        ),
        Ok(())
    );
    assert_eq!(
        check("DELETE", "/api/v4/projects/1", &[]),
        Err(Some(Reason::Method))
    );
    assert_eq!(
        check(
            "GET",
            "/team/app.git/info/refs?service=git-receive-pack",
            &[]
        ),
        Err(Some(Reason::Query))
    );
    assert_eq!(
        check("POST", "/team/app.git/git-receive-pack", &[]),
        Err(Some(Reason::Path))
    );
    assert_eq!(
        check(
            "POST",
            "/api/v4/projects/1/statuses/abc",
            &[("x-api-version", "3")]
        ),
        Err(Some(Reason::Header))
    );
}

#[test]
fn defaults_deny_every_call() {
    assert!(valid().allow.is_empty());
    assert_eq!(valid().policy().unwrap().rule_count(), 0);
}

#[test]
fn unknown_keys_are_named() {
    let err = relay_common::config::parse::<Config>("tunels = []", Path::new("a.toml"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("tunels"), "{err}");
}

#[test]
fn direct_urls_may_name_the_hosts_of_tunnels_or_of_direct_hosts() {
    use relay_common::hosts::Host;
    let host = |url: &str| Host::of_url(url).unwrap();
    let cfg = Config {
        tunnels: vec![
            "https://relay.example:8443".into(),
            "https://10.0.0.7:8443".into(),
        ],
        ..Config::default()
    };
    let rules = cfg.direct_host_rules().unwrap();
    let allowed = |url: &str| rules.iter().any(|r| r.allows(&host(url)));
    assert!(allowed("https://RELAY.example.:9443"));
    assert!(allowed("https://10.0.0.7:1"));
    assert!(allowed("https://[::ffff:10.0.0.7]:1"));
    assert!(!allowed("https://ts-1.relay.example:8443"));
    assert!(!allowed("https://10.0.0.8:8443"));
    assert!(!allowed("https://127.0.0.1:8443"));
    let cfg = Config {
        direct_hosts: vec!["*.relay.example".into(), "203.0.113.0/24".into()],
        ..cfg
    };
    let rules = cfg.direct_host_rules().unwrap();
    let allowed = |url: &str| rules.iter().any(|r| r.allows(&host(url)));
    assert!(allowed("https://ts-1.relay.example:8443"));
    assert!(allowed("https://203.0.113.9:8443"));
    assert!(!allowed("https://relay.example:8443"));
    assert!(!allowed("https://10.0.0.7:8443"));
}

#[test]
fn bad_values_name_their_key() {
    let cases: Vec<(Config, &str)> = vec![
        (
            Config {
                tunnels: vec![],
                ..valid()
            },
            "`tunnels`",
        ),
        (
            Config {
                tunnels: vec!["127.0.0.1:8441".into()],
                ..valid()
            },
            "`tunnels`",
        ),
        (
            Config {
                upstream: "http://h:1/api".into(),
                ..valid()
            },
            "`upstream`",
        ),
        (
            Config {
                upstream: "https://h:1".into(),
                ..valid()
            },
            "`upstream`",
        ),
        (
            Config {
                max_call_timeout: Duration::from_secs(1),
                ..valid()
            },
            "`max_call_timeout`",
        ),
        (
            Config {
                limits: LimitsConfig {
                    max_header_bytes: 10,
                    ..Default::default()
                },
                ..valid()
            },
            "`limits.max_header_bytes`",
        ),
        (
            Config {
                limits: LimitsConfig {
                    max_headers: 30_000,
                    ..Default::default()
                },
                ..valid()
            },
            "`limits.max_headers`",
        ),
        (
            Config {
                max_frame_bytes: 1000,
                ..valid()
            },
            "`max_frame_bytes`",
        ),
        (
            Config {
                direct_hosts: vec!["private".into()],
                ..valid()
            },
            "`direct_hosts`",
        ),
        (
            Config {
                direct_hosts: vec!["10.0.0.0/33".into()],
                ..valid()
            },
            "`direct_hosts`",
        ),
        (
            Config {
                direct_hosts: vec!["relay example".into()],
                ..valid()
            },
            "`direct_hosts`",
        ),
        (
            Config {
                allow: vec![AllowRule {
                    methods: vec!["GET".into()],
                    path: "no-slash".into(),
                    ..Default::default()
                }],
                ..valid()
            },
            "`allow[0].path`",
        ),
        (
            Config {
                backoff_max: Duration::from_millis(1),
                ..valid()
            },
            "`backoff_max`",
        ),
        (
            Config {
                max_upstream_connections: Some(0),
                ..valid()
            },
            "`max_upstream_connections`",
        ),
        (
            Config {
                max_opening: 0,
                ..valid()
            },
            "`max_opening`",
        ),
        (
            Config {
                tunnel_h2: H2Settings {
                    stream_window_bytes: Some(1),
                    ..Default::default()
                },
                ..valid()
            },
            "`tunnel_h2.stream_window_bytes`",
        ),
        (
            Config {
                upstream_check: UpstreamCheckConfig {
                    path: "health".into(),
                    ..Default::default()
                },
                ..valid()
            },
            "`upstream_check.path`",
        ),
        (
            Config {
                coverage: CoverageConfig {
                    tick: Duration::ZERO,
                    ..Default::default()
                },
                ..valid()
            },
            "`coverage.tick`",
        ),
        (
            Config {
                coverage: CoverageConfig {
                    fill_retry: Duration::ZERO,
                    ..Default::default()
                },
                ..valid()
            },
            "`coverage.fill_retry`",
        ),
        (
            Config {
                coverage: CoverageConfig {
                    reserve: 0,
                    ..Default::default()
                },
                ..valid()
            },
            "`coverage.reserve`",
        ),
        (
            Config {
                coverage: CoverageConfig {
                    idle_elsewhere_factor: 0,
                    ..Default::default()
                },
                ..valid()
            },
            "`coverage.idle_elsewhere_factor`",
        ),
    ];
    for (c, key) in cases {
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains(key), "{err} should name {key}");
    }
}

#[test]
fn token_never_prints() {
    assert!(!format!("{:?}", valid()).contains("dev-token"));
}
