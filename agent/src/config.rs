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
    /// an open's turn. The ceiling of the open window (`crate::stream::window`), which
    /// narrows while hellos time out.
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
mod tests;
