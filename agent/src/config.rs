//! The agent's typed configuration (TOML, `deny_unknown_fields`), its documented
//! defaults, and `validate()`, run once at start, whose errors name the key.
//!
//! This module only describes and checks settings; it opens nothing.

use crate::coverage::plan::CoverageConfig;
pub use crate::filter::AllowRule;
use crate::filter::{Policy, SizeLimits};
use http::Uri;
use relay_common::config::ConfigError;
use relay_common::h2::{H2Limits, H2Settings};
use relay_common::hosts::{Host, HostRule};
use relay_common::tls::{ClientCerts, DialerTls};
use relay_common::Secret;
use serde::Deserialize;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

/// The whole agent config.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// Tunnel server endpoints (`http://host:port`). Each new stream dials one at random,
    /// so a single load-balancer address and a list of servers both work.
    pub tunnels: Vec<String>,
    /// Hosts a tunnel server's advertised `direct_url` may name for the agent to dial it
    /// (placement-aware growth, `coverage.direct_growth`): host names or patterns (`*`
    /// matches any run of characters, `"*.relay.example"`), addresses and address ranges
    /// (`"203.0.113.0/24"`). Empty (the default): the hosts of `tunnels`. A direct URL on
    /// any other host is never dialed, so no tunnel server or dispatcher can send the agent
    /// to a host inside its network; each refusal is logged and counted
    /// (`relay_agent_direct_urls_refused_total`).
    pub direct_hosts: Vec<String>,
    /// The agent's secret token, sent as `authorization: Bearer <token>`; never logged.
    pub token: Secret,
    /// A file holding the token (surrounding whitespace ignored), read once at start: keeps
    /// the token out of the config file, the command line and the environment (e.g. a
    /// systemd credential, `--token-file %d/token`). Set either this or `token`.
    pub token_file: Option<PathBuf>,
    /// The origin every call goes to: `http://host:port`, no path or query.
    pub upstream: String,
    /// Where the admin listener (`/metrics`, `/healthz`, `/readyz`, `/systemcheck`) binds.
    pub admin_listen: SocketAddr,
    /// Worker threads of the process's runtime; unset: one per core (or
    /// `TOKIO_WORKER_THREADS`). Fewer than cores suits a machine shared with other busy
    /// processes (see `relay_common::runtime`).
    pub worker_threads: Option<usize>,
    /// The background reachability check of the upstream behind `/systemcheck`.
    pub upstream_check: UpstreamCheckConfig,
    /// Bound on opening one tunnel stream, from dialing to the server's hello.
    #[serde(with = "humantime_serde")]
    pub connect_timeout: Duration,
    /// Stream opens in progress at once (dial to hello); more wait their turn, so a growth
    /// step of hundreds of streams reaches the tunnel servers (or a load balancer) in
    /// waves rather than as one burst of half-open streams. `connect_timeout` counts from
    /// an open's turn.
    pub max_opening: usize,
    /// First delay after a failed stream open (connect error or refused token).
    #[serde(with = "humantime_serde")]
    pub backoff_initial: Duration,
    /// Largest delay between open attempts while opens keep failing.
    #[serde(with = "humantime_serde")]
    pub backoff_max: Duration,
    /// Bound on a call whose RequestHead carries no deadline (`deadline_ms = 0`).
    #[serde(with = "humantime_serde")]
    pub call_timeout: Duration,
    /// Longest deadline the cloud side may ask for; a longer `deadline_ms` is capped to it
    /// (and a call that then times out says so).
    #[serde(with = "humantime_serde")]
    pub max_call_timeout: Duration,
    /// `[limits]`: per-call size bounds.
    pub limits: LimitsConfig,
    /// `[[allow]]`: the accept filters, owned by the customer. A call is made only when
    /// one rule allows it; with no rule every call is refused (default deny).
    pub allow: Vec<AllowRule>,
    /// Cap on concurrent upstream requests; unset means one per stream (the pool caps it).
    pub max_upstream_connections: Option<usize>,
    /// `[coverage]`: the sizing tick's rules and constants.
    pub coverage: CoverageConfig,
    /// `[tls]`: how tunnel streams dial `tunnels`: `https://` URLs verified against `ca`
    /// (with `cert` and `key` when the tunnel servers ask for client certificates), or
    /// `insecure = true` for plain `http://` URLs (h2c; a warning at start).
    pub tls: DialerTls,
    /// How often the `[tls]` files are checked for changes (SIGHUP reloads at once).
    #[serde(with = "humantime_serde")]
    pub reload_interval: Duration,
    /// `[tunnel_h2]`: HTTP/2 limits of the connections to the tunnel servers (see
    /// `relay_common::h2`; defaults `H2Limits::TUNNEL`).
    pub tunnel_h2: H2Settings,
    /// Largest gRPC message sent to or accepted from a tunnel server. A bigger frame from
    /// the server ends that stream (the agent opens another); it is never decoded. Must
    /// hold a 64 KiB body chunk plus its head.
    pub max_frame_bytes: usize,
}

/// `[upstream_check]`.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct UpstreamCheckConfig {
    /// Path (and query) requested with GET on the upstream; any HTTP answer counts as reachable.
    pub path: String,
    /// How often the check runs.
    #[serde(with = "humantime_serde")]
    pub interval: Duration,
    /// Bound on one check.
    #[serde(with = "humantime_serde")]
    pub timeout: Duration,
}

/// Largest `limits.max_headers` accepted: the protocol's bound on a head's records (a frame
/// with more is refused as it is decoded); a request's headers also become one
/// `HeaderMap`, which holds at most 32768 entries (and panics when sized past 24576).
pub const MAX_HEADERS_BOUND: usize = relay_proto::MAX_HEAD_RECORDS;

/// `[limits]`. The concurrent-call cap is `coverage.max_inflight`.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, default)]
pub struct LimitsConfig {
    /// Bound on one request head as it arrives on the wire: method + target + every
    /// header's name and value (+4 bytes each). A larger head is refused.
    pub max_header_bytes: usize,
    /// Bound on one request body in bytes; unset means no bound. A declared
    /// Content-Length above it is refused before the upstream is contacted; a streamed
    /// body that passes it aborts the upstream request.
    pub max_body_bytes: Option<u64>,
    /// Most headers one request head may carry (a peer-supplied count: checked before
    /// anything is sized by it). A head with more is refused.
    pub max_headers: usize,
}

impl Default for LimitsConfig {
    fn default() -> Self {
        LimitsConfig {
            max_header_bytes: 64 * 1024,
            max_body_bytes: None,
            max_headers: relay_proto::DEFAULT_MAX_HEADERS,
        }
    }
}

impl Default for UpstreamCheckConfig {
    fn default() -> Self {
        UpstreamCheckConfig {
            path: "/".into(),
            interval: Duration::from_secs(10),
            timeout: Duration::from_secs(2),
        }
    }
}

impl Default for Config {
    fn default() -> Self {
        Config {
            tunnels: vec![
                "http://127.0.0.1:8441".into(),
                "http://127.0.0.1:8442".into(),
            ],
            direct_hosts: Vec::new(),
            token: Secret::new(""),
            token_file: None,
            upstream: "http://127.0.0.1:8000".into(),
            admin_listen: SocketAddr::from(([127, 0, 0, 1], 9090)),
            worker_threads: None,
            upstream_check: UpstreamCheckConfig::default(),
            connect_timeout: Duration::from_secs(5),
            max_opening: 64,
            backoff_initial: Duration::from_millis(200),
            backoff_max: Duration::from_secs(30),
            call_timeout: Duration::from_secs(300),
            max_call_timeout: Duration::from_secs(3600),
            limits: LimitsConfig::default(),
            allow: Vec::new(),
            max_upstream_connections: None,
            coverage: CoverageConfig::default(),
            tls: DialerTls::default(),
            reload_interval: Duration::from_secs(5),
            tunnel_h2: H2Settings::default(),
            max_frame_bytes: relay_proto::DEFAULT_MAX_FRAME_BYTES,
        }
    }
}

impl Config {
    /// The tunnel connections' HTTP/2 limits (validated by `validate`).
    pub fn tunnel_h2(&self) -> Result<H2Limits, ConfigError> {
        self.tunnel_h2.resolve(H2Limits::TUNNEL, "tunnel_h2")
    }

    /// The hosts a `direct_url` may name: `direct_hosts`, or the hosts of `tunnels` when it
    /// is empty. `private` is refused: it would allow every internal address.
    pub fn direct_host_rules(&self) -> Result<Vec<HostRule>, ConfigError> {
        if self.direct_hosts.is_empty() {
            return Ok(self
                .tunnels
                .iter()
                .filter_map(|t| Host::of_url(t))
                .map(|h| h.exact())
                .collect());
        }
        self.direct_hosts
            .iter()
            .map(|h| match HostRule::parse(h) {
                Ok(HostRule::Private) => Err(ConfigError::invalid(
                    "direct_hosts",
                    "\"private\" would let a tunnel server send the agent to any internal address; list the tunnel servers' names, addresses or ranges",
                )),
                Ok(rule) => Ok(rule),
                Err(why) => Err(ConfigError::invalid("direct_hosts", why)),
            })
            .collect()
    }

    /// Plain `http://` tunnels (`[tls] insecure = true`): tests and the local example.
    pub fn insecure(mut self) -> Self {
        self.tls = DialerTls::insecure();
        self
    }

    /// Reads `token_file` into `token` (once, at start, before `validate`). Setting both is
    /// an error naming `token_file`; so is a file that cannot be read or holds no token.
    pub fn read_token_file(&mut self) -> Result<(), ConfigError> {
        let Some(path) = &self.token_file else {
            return Ok(());
        };
        if !self.token.is_empty() {
            return Err(ConfigError::invalid(
                "token_file",
                "set token or token_file, not both",
            ));
        }
        let text = std::fs::read_to_string(path).map_err(|e| {
            ConfigError::invalid("token_file", format!("cannot read {}: {e}", path.display()))
        })?;
        let token = text.trim();
        if token.is_empty() {
            return Err(ConfigError::invalid(
                "token_file",
                format!("{} holds no token", path.display()),
            ));
        }
        self.token = Secret::new(token);
        Ok(())
    }

    /// Checks every key once; the error names the first offending key.
    pub fn validate(&self) -> Result<(), ConfigError> {
        relay_common::runtime::check(self.worker_threads)?;
        if self.tunnels.is_empty() {
            return Err(ConfigError::invalid(
                "tunnels",
                "at least one tunnel endpoint is required",
            ));
        }
        for (i, t) in self.tunnels.iter().enumerate() {
            check_http_url(t, false, true)
                .map_err(|m| ConfigError::invalid("tunnels", format!("{t:?}: {m}")))?;
            self.tls.check_url("tls", &format!("tunnels[{i}]"), t)?;
        }
        self.tls.resolve("tls", ClientCerts::Optional)?;
        self.direct_host_rules()?;
        if self.reload_interval < Duration::from_millis(10) {
            return Err(ConfigError::invalid(
                "reload_interval",
                "must be at least 10ms",
            ));
        }
        if self.token.is_empty() {
            let why = if self.token_file.is_some() {
                "the agent token is required: token_file is set but was not read (Config::read_token_file)"
            } else {
                "the agent token is required (token or token_file; --token, --token-file, RELAY_TOKEN or RELAY_TOKEN_FILE)"
            };
            return Err(ConfigError::invalid("token", why));
        }
        if http::HeaderValue::from_str(&format!("Bearer {}", self.token.expose())).is_err() {
            return Err(ConfigError::invalid("token", "must be printable ASCII"));
        }
        check_http_url(&self.upstream, true, false)
            .map_err(|m| ConfigError::invalid("upstream", m))?;
        if !self.upstream_check.path.starts_with('/')
            || self
                .upstream_check
                .path
                .parse::<http::uri::PathAndQuery>()
                .is_err()
        {
            return Err(ConfigError::invalid(
                "upstream_check.path",
                "must be a path starting with '/'",
            ));
        }
        nonzero(self.upstream_check.interval, "upstream_check.interval")?;
        nonzero(self.upstream_check.timeout, "upstream_check.timeout")?;
        nonzero(self.connect_timeout, "connect_timeout")?;
        if self.max_opening == 0 {
            return Err(ConfigError::invalid("max_opening", "must be at least 1"));
        }
        self.tunnel_h2()?;
        nonzero(self.backoff_initial, "backoff_initial")?;
        nonzero(self.call_timeout, "call_timeout")?;
        if self.backoff_max < self.backoff_initial {
            return Err(ConfigError::invalid(
                "backoff_max",
                "must be at least backoff_initial",
            ));
        }
        if self.max_call_timeout < self.call_timeout {
            return Err(ConfigError::invalid(
                "max_call_timeout",
                "must be at least call_timeout",
            ));
        }
        if self.limits.max_header_bytes < 256 {
            return Err(ConfigError::invalid(
                "limits.max_header_bytes",
                "must be at least 256",
            ));
        }
        if !(1..=MAX_HEADERS_BOUND).contains(&self.limits.max_headers) {
            return Err(ConfigError::invalid(
                "limits.max_headers",
                format!("must be between 1 and {MAX_HEADERS_BOUND}"),
            ));
        }
        relay_proto::check_max_frame_bytes(self.max_frame_bytes)
            .map_err(|m| ConfigError::invalid("max_frame_bytes", m))?;
        self.policy()?;
        if self.max_upstream_connections == Some(0) {
            return Err(ConfigError::invalid(
                "max_upstream_connections",
                "must be at least 1 when set",
            ));
        }
        let c = &self.coverage;
        nonzero(c.tick, "coverage.tick")?;
        nonzero(c.fill_retry, "coverage.fill_retry")?;
        nonzero(c.reconnect, "coverage.reconnect")?;
        if c.max_streams == 0 {
            return Err(ConfigError::invalid(
                "coverage.max_streams",
                "must be at least 1",
            ));
        }
        if !c.enabled && c.fixed_streams == 0 {
            return Err(ConfigError::invalid(
                "coverage.fixed_streams",
                "must be at least 1 when coverage is off",
            ));
        }
        if c.max_inflight == 0 {
            return Err(ConfigError::invalid(
                "coverage.max_inflight",
                "must be at least 1",
            ));
        }
        if c.fixed_streams > c.max_streams {
            return Err(ConfigError::invalid(
                "coverage.fixed_streams",
                "must not exceed coverage.max_streams",
            ));
        }
        if c.enabled && c.reserve == 0 {
            return Err(ConfigError::invalid(
                "coverage.reserve",
                "must be at least 1: with no idle stream held, every first call on a server waits for a stream to open",
            ));
        }
        if c.enabled && c.idle_elsewhere_factor == 0 {
            return Err(ConfigError::invalid(
                "coverage.idle_elsewhere_factor",
                "must be at least 1: 0 would pause growth whenever any other server holds an idle stream",
            ));
        }
        Ok(())
    }
}

impl Config {
    /// The compiled accept policy (`[[allow]]` + `[limits]`); errors name the rule's key.
    pub fn policy(&self) -> Result<Policy, ConfigError> {
        Policy::new(
            &self.allow,
            SizeLimits {
                max_header_bytes: self.limits.max_header_bytes,
                max_body_bytes: self.limits.max_body_bytes,
            },
        )
    }
}

fn nonzero(d: Duration, key: &str) -> Result<(), ConfigError> {
    if d.is_zero() {
        Err(ConfigError::invalid(key, "must be greater than zero"))
    } else {
        Ok(())
    }
}

/// `http://host:port` (port optional; `https://` too when `tls_ok`). `origin_only` also
/// refuses a path or query. The upstream client speaks plain HTTP only, so an `https`
/// upstream is refused with a clear message rather than failing at the first call.
fn check_http_url(s: &str, origin_only: bool, tls_ok: bool) -> Result<Uri, String> {
    let uri: Uri = s.parse().map_err(|e| format!("not a URL: {e}"))?;
    match uri.scheme_str() {
        Some("http") => {}
        Some("https") if tls_ok => {}
        Some("https") => {
            return Err("https upstreams are not supported by this build; use http".into())
        }
        _ if tls_ok => return Err("must start with https:// or http://".into()),
        _ => return Err("must start with http://".into()),
    }
    if uri.authority().is_none_or(|a| a.host().is_empty()) {
        return Err("must name a host".into());
    }
    if origin_only {
        let pq = uri.path_and_query().map(|p| p.as_str()).unwrap_or("");
        if !(pq.is_empty() || pq == "/") {
            return Err("must be scheme://host:port only, without a path or query".into());
        }
    }
    Ok(uri)
}

/// The upstream origin split into the parts requests are built from.
pub(crate) fn upstream_origin(
    s: &str,
) -> Result<(http::uri::Scheme, http::uri::Authority), ConfigError> {
    let uri = check_http_url(s, true, false).map_err(|m| ConfigError::invalid("upstream", m))?;
    let parts = uri.into_parts();
    match (parts.scheme, parts.authority) {
        (Some(s), Some(a)) => Ok((s, a)),
        _ => Err(ConfigError::invalid(
            "upstream",
            "must be scheme://host:port",
        )),
    }
}

#[cfg(test)]
mod tests {
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
}
