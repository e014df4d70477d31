//! Accept filters and request safety: the customer's `[[allow]]` rules, the checks that
//! keep the cloud side from steering the agent anywhere but its configured origin, and
//! the per-call size limits. `Policy::prepare` turns a wire `RequestHead` into the parts of
//! an upstream request, or into a `Rejection` that names the reason.
//!
//! The cloud side is treated as hostile: a head may come from a compromised tunnel server.
//! Order of the checks (the first that fails decides):
//! 1. `limits.max_header_bytes` on the head as it came off the wire;
//! 2. CR, LF or NUL anywhere in the method, target, header names or values (`injection`);
//! 3. `CONNECT` and `TRACE` in any letter case, whatever the rules say (`forbidden_method`);
//! 4. the target is origin-form: starts with one `/` (absolute-URI, authority-form,
//!    asterisk-form and `//host` targets are refused: `target`);
//! 5. the path has no dot segments (also percent-encoded, with `;params`, or hidden behind
//!    `%2F` / `\`), no empty segment in the middle, no `%00`, no broken escape, no escape
//!    left after decoding once (`%252e`: a server that decodes twice would see `.`), no
//!    control character once decoded, only valid UTF-8 once decoded (no overlong form
//!    such as `%c0%ae`) and none of the characters that fold into '.', '/' or '\'
//!    (`unsafe_path`);
//! 6. no header that asks the upstream to use another host, path or method
//!    (`X-Forwarded-Host`, `X-Original-URL`, `X-HTTP-Method-Override`, ..., also spelled
//!    with `_` for `-`: `override_header`);
//! 7. exactly one valid `Content-Length` or one `Transfer-Encoding: chunked`, never both,
//!    and no `Connection` naming `Content-Length` (`smuggling`), and a declared length
//!    within `limits.max_body_bytes` (`body_size`);
//! 8. the hop-by-hop headers and every header named in `Connection` are removed, then the
//!    client-identity family ([`SPOOFING_FAMILY`]: every `x-forwarded-*`, every
//!    `*-client-ip`, `forwarded`, vendor names such as `cf-connecting-ip`; their `_`
//!    spellings always) except those the rule being tried lists in `pass_headers`: rules
//!    match only headers the upstream will receive. The allowing rule's `set_headers` are
//!    written last;
//! 9. the `[[allow]]` rules (`path`, `method`, `header`, `query`, a body on GET, HEAD
//!    or OPTIONS only where the rule lists the method in `body_methods`: `body`, and a
//!    non-ASCII path only where the rule sets `utf8_paths`: `unsafe_path`): default deny.
//!
//! The method is read in upper case (`get` is GET), matched and sent that way, so the
//! method a rule allows is the method the upstream runs. Query parameter names are
//! compared exactly (after percent-decoding) unless the rule sets `query_ignore_case`.
//!
//! The `Host` header the cloud side sends is never used: the upstream client always sets it
//! to the configured origin. Rules match the path exactly as it is sent upstream, segment
//! by segment after percent-decoding. Refusal messages name the rule and the header or
//! query *name* that failed, never a value.
//!
//! `;` in a path: servers disagree on it (Tomcat and other servlet containers drop
//! `;params` from each segment before routing, most others keep it as part of the name),
//! so `/files/secret.txt;.json` is `secret.txt` to one upstream and a `.json` file to
//! another. The agent matches it literally per segment, but a wildcard (`*`, `*.json`,
//! `**`) never matches a segment holding a `;`: such a path is allowed only by a rule whose
//! pattern spells that segment out, `;` included. Refusing it outright would break servers
//! that use matrix parameters on purpose; matching it by wildcard lets a rule written for
//! one meaning allow the other.
//!
//! A request body on GET, HEAD or OPTIONS is refused unless the matching rule allows it:
//! many servers ignore such a body and would read it as the next request on a kept-alive
//! connection. When one is allowed, `Prepared::close_connection` asks the upstream client
//! to close the connection after the call, so nothing left on it can answer another call.
//!
//! Pure: no I/O, no clock, no metrics. `call.rs` counts and logs what this module decides.

use http::header::{HeaderMap, HeaderName, HeaderValue};
use http::uri::PathAndQuery;
use http::Method;
use relay_common::config::ConfigError;
use relay_common::glob::matches as glob;
use relay_proto::RequestHead;
use serde::Deserialize;
use std::borrow::Cow;
use std::collections::BTreeMap;

/// One `[[allow]]` rule: a call is allowed when its method, path, required headers and
/// required query parameters all match one rule.
#[derive(Clone, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct AllowRule {
    /// Optional label used in log lines and refusal messages (default `allow[i]`).
    #[serde(default)]
    pub name: Option<String>,
    /// Methods this rule allows, e.g. `["GET", "HEAD"]`; `"*"` allows any method but
    /// CONNECT and TRACE, which are always refused. Compared case-insensitively. Required,
    /// non-empty.
    pub methods: Vec<String>,
    /// Path pattern: starts with `/`; `*` as a whole segment matches exactly one non-empty
    /// segment, `*` inside a segment matches any characters within it (`*.json`), `**` as
    /// a whole segment matches any number of segments, including none (`/api/**` matches
    /// `/api`, `/api/` and everything below). Everything else is literal and
    /// case-sensitive. The query string is not part of the path.
    pub path: String,
    /// Required headers: name (case-insensitive) -> value pattern (exact, `*` matches any
    /// characters). Every occurrence of the header must match, and at least one must exist.
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
    /// Required query parameters: name -> value pattern, matched after percent-decoding
    /// (`+` is a space). Every occurrence must match, and at least one must exist.
    #[serde(default)]
    pub query: BTreeMap<String, String>,
    /// Query parameter names are compared ignoring ASCII letter case (`REF=x` is checked
    /// against the pattern for `ref`), for upstreams that read names that way (ASP.NET,
    /// many PHP and Java frameworks). Default false: names are compared exactly, byte for
    /// byte after percent-decoding, so `REF` is a parameter the rule does not look at.
    #[serde(default)]
    pub query_ignore_case: bool,
    /// Client-identity headers (the family [`is_spoofing`] names: `X-Forwarded-*`,
    /// `*-Client-IP`, `Forwarded`, `X-Real-IP`, `CF-Connecting-IP`, ...) this rule lets
    /// reach the upstream as the caller sent them, by their `-` spelling, e.g.
    /// `["x-forwarded-for"]`. Default: none, every one is stripped. A `_` spelling
    /// (`X_Forwarded_For`) is stripped even when listed.
    #[serde(default)]
    pub pass_headers: Vec<String>,
    /// Client-identity headers the agent writes itself on the calls this rule allows,
    /// replacing whatever the caller sent: name -> value. `$tunnel_peer` in a value stands
    /// for the IP address of the connection the call came in on (the tunnel server's, or
    /// the load balancer's in front of it), e.g. `{ "x-forwarded-for" = "$tunnel_peer" }`.
    /// Default: none.
    #[serde(default)]
    pub set_headers: BTreeMap<String, String>,
    /// Methods among GET, HEAD and OPTIONS on which this rule allows a request body.
    /// Default: none (such a body is refused with reason `body`). Other methods may always
    /// carry a body. The upstream connection that carried such a body is closed after the
    /// call.
    #[serde(default)]
    pub body_methods: Vec<String>,
    /// Let paths holding non-ASCII characters (valid UTF-8, percent-encoded or not) match
    /// this rule. Default false: such a path is refused (`unsafe_path`). Bytes that are
    /// not valid UTF-8 (overlong forms such as `%c0%ae` included) and characters that
    /// fold into '.', '/' or '\' are refused either way.
    #[serde(default)]
    pub utf8_paths: bool,
}

/// What a rule needs to know about a call beyond its method, path, headers and query.
#[derive(Clone, Copy, Debug)]
struct Shape {
    /// A body on GET, HEAD or OPTIONS.
    body_on_bodiless: bool,
    /// The decoded path holds non-ASCII characters.
    non_ascii: bool,
}

/// The per-call size limits the policy enforces itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SizeLimits {
    /// Bound on method + target + every header (name + value + 4) of one request head.
    pub max_header_bytes: usize,
    /// Bound on a request body; `None` for no bound.
    pub max_body_bytes: Option<u64>,
}

/// Why a call was refused: the `reason` label of `relay_agent_filter_refusals_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Reason {
    /// No rule's path pattern matches.
    Path,
    /// A rule's path matches, but not with this method.
    Method,
    /// Path and method match, a required header does not.
    Header,
    /// Path, method and headers match, a required query parameter does not.
    Query,
    /// Not an origin-form target (absolute-URI, authority-form, `*`, `//...`).
    Target,
    /// Dot segments, empty segments, `%00` or broken percent-encoding in the path.
    UnsafePath,
    /// CR, LF or NUL in the method, target or a header.
    Injection,
    /// A header asking the upstream for another host, path or method.
    OverrideHeader,
    /// Duplicate or conflicting Content-Length / Transfer-Encoding.
    Smuggling,
    /// The request head exceeds `limits.max_header_bytes`.
    HeaderSize,
    /// The request body exceeds `limits.max_body_bytes`.
    BodySize,
    /// The agent already carries `coverage.max_inflight` calls.
    Concurrency,
    /// CONNECT or TRACE: refused whatever the rules say.
    ForbiddenMethod,
    /// A body on GET, HEAD or OPTIONS that no rule's `body_methods` allows.
    Body,
}

impl Reason {
    pub const ALL: [Reason; 14] = [
        Reason::Path,
        Reason::Method,
        Reason::Header,
        Reason::Query,
        Reason::Target,
        Reason::UnsafePath,
        Reason::Injection,
        Reason::OverrideHeader,
        Reason::Smuggling,
        Reason::HeaderSize,
        Reason::BodySize,
        Reason::Concurrency,
        Reason::ForbiddenMethod,
        Reason::Body,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Path => "path",
            Reason::Method => "method",
            Reason::Header => "header",
            Reason::Query => "query",
            Reason::Target => "target",
            Reason::UnsafePath => "unsafe_path",
            Reason::Injection => "injection",
            Reason::OverrideHeader => "override_header",
            Reason::Smuggling => "smuggling",
            Reason::HeaderSize => "header_size",
            Reason::BodySize => "body_size",
            Reason::Concurrency => "concurrency",
            Reason::ForbiddenMethod => "forbidden_method",
            Reason::Body => "body",
        }
    }
}

/// A call the agent will not make.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Rejection {
    /// Refused by policy (`CallErrorKind::Refused`, HTTP 403 at the dispatcher).
    Refused { reason: Reason, message: String },
    /// Not a valid HTTP request (`CallErrorKind::BadRequest`, HTTP 400).
    BadRequest(String),
}

impl Rejection {
    fn refused(reason: Reason, message: impl Into<String>) -> Self {
        Rejection::Refused {
            reason,
            message: message.into(),
        }
    }

    /// The refusal reason, if this is a refusal.
    pub fn reason(&self) -> Option<Reason> {
        match self {
            Rejection::Refused { reason, .. } => Some(*reason),
            Rejection::BadRequest(_) => None,
        }
    }

    /// The message sent back in the CallError.
    pub fn message(&self) -> &str {
        match self {
            Rejection::Refused { message, .. } => message,
            Rejection::BadRequest(m) => m,
        }
    }
}

/// An allowed request, ready for the upstream client (which strips hop-by-hop headers and
/// sets `Host`).
#[derive(Debug)]
pub struct Prepared {
    pub method: Method,
    pub path_and_query: PathAndQuery,
    /// The caller's headers, without `Host` and `Transfer-Encoding`.
    pub headers: HeaderMap,
    /// The declared body length, if any.
    pub content_length: Option<u64>,
    /// Label of the rule that allowed the call.
    pub rule: String,
    /// The call carries a body on GET, HEAD or OPTIONS (allowed by the rule's
    /// `body_methods`): the upstream connection must not be reused after it.
    pub close_connection: bool,
}

/// Headers that ask an upstream (or a framework or proxy in front of it) to act on
/// another host, URL or method than the request's own: refused outright.
const OVERRIDE_HEADERS: [&str; 10] = [
    "x-forwarded-host",
    "x-forwarded-server",
    "x-original-host",
    "x-host",
    "x-http-host-override",
    "x-original-url",
    "x-rewrite-url",
    "x-http-method-override",
    "x-http-method",
    "x-method-override",
];

/// The client-identity family, one rule list: headers that tell an upstream who the client
/// is, where it connected from, how it connected or which proxy to use. Frameworks trust
/// several of them (scheme, port and prefix for the URLs they build) and IP allow-lists
/// trust the address ones. Each entry is a pattern (`*` matches any run of characters)
/// over the lowercase name with `_` read as `-`. Stripped before the upstream unless the
/// allowing rule lists a name in `pass_headers` or sets it in `set_headers`; the `_`
/// spelling of any of them is always stripped (CGI-style upstreams turn both spellings into
/// the same `HTTP_*` variable). `Proxy` is httpoxy: CGI turns it into `HTTP_PROXY`, which
/// many HTTP clients take as their proxy. (`X-Forwarded-Host` and `X-Forwarded-Server`
/// match too, but are refused before stripping: see [`OVERRIDE_HEADERS`].)
pub const SPOOFING_FAMILY: [&str; 20] = [
    "forwarded",
    "x-forwarded",
    "x-forwarded-*",
    "client-ip",
    "*-client-ip",
    "x-real-ip",
    "cf-connecting-ip",
    "cf-connecting-ipv6",
    "cf-pseudo-ipv4",
    "x-original-forwarded-for",
    "x-originating-ip",
    "x-remote-ip",
    "x-remote-addr",
    "x-proxyuser-ip",
    "x-envoy-external-address",
    "x-azure-clientip",
    "x-azure-socketip",
    "x-arr-clientip",
    "x-original-uri",
    "proxy",
];

/// Whether a lowercase header name, `_` read as `-`, is of the client-identity family.
pub fn is_spoofing(dashed: &str) -> bool {
    SPOOFING_FAMILY
        .iter()
        .any(|p| relay_common::glob::matches_str(p, dashed))
}

/// The variable of a `set_headers` value: the IP address of the call's tunnel connection.
pub const TUNNEL_PEER: &str = "$tunnel_peer";

/// Methods whose requests carry no body on their own; one is refused unless a rule's
/// `body_methods` allows it. (TRACE is refused always.)
const BODILESS: [&str; 3] = ["GET", "HEAD", "OPTIONS"];

/// Methods refused whatever the rules say: CONNECT would make the upstream (or a proxy
/// before it) open a tunnel elsewhere, TRACE echoes the request's headers back.
const FORBIDDEN_METHODS: [&str; 2] = ["CONNECT", "TRACE"];

/// `name` with `_` read as `-` (header names are lowercase already).
fn dashed(name: &str) -> std::borrow::Cow<'_, str> {
    if name.contains('_') {
        std::borrow::Cow::Owned(name.replace('_', "-"))
    } else {
        std::borrow::Cow::Borrowed(name)
    }
}

/// Whether the lowercase header `name` is of the client-identity family (see
/// [`SPOOFING_FAMILY`]), and if so whether it is spelled with an underscore.
fn spoofing(name: &str) -> Option<bool> {
    is_spoofing(&dashed(name)).then(|| name.contains('_'))
}

/// The compiled `[[allow]]` rules plus the size limits. Built once at start.
#[derive(Clone, Debug)]
pub struct Policy {
    rules: Vec<Rule>,
    limits: SizeLimits,
}

#[derive(Clone, Debug)]
struct Rule {
    label: String,
    /// Uppercase method names; `None` means any.
    methods: Option<Vec<String>>,
    path: Vec<Seg>,
    headers: Vec<(HeaderName, Vec<u8>)>,
    query: Vec<(Vec<u8>, Vec<u8>)>,
    /// Query names are compared ignoring ASCII case.
    query_ignore_case: bool,
    /// Client-identity headers (lowercase, `-` spelling) this rule passes.
    pass: Vec<String>,
    /// Client-identity headers this rule writes itself.
    set: Vec<(HeaderName, SetValue)>,
    /// Paths with non-ASCII (valid UTF-8) characters may match.
    utf8_paths: bool,
    /// Uppercase bodiless methods on which a body is allowed.
    body_methods: Vec<String>,
}

/// A `set_headers` value: literal text around the `$tunnel_peer` variable.
#[derive(Clone, Debug, PartialEq, Eq)]
struct SetValue(Vec<Piece>);

#[derive(Clone, Debug, PartialEq, Eq)]
enum Piece {
    Text(String),
    TunnelPeer,
}

impl SetValue {
    /// Parses a value; every `$` must start `$tunnel_peer`.
    fn parse(value: &str) -> Result<SetValue, String> {
        let mut pieces = Vec::new();
        let mut rest = value;
        while let Some(at) = rest.find('$') {
            if !rest[at..].starts_with(TUNNEL_PEER) {
                return Err(format!(
                    "{value:?}: the only variable is {TUNNEL_PEER} (the IP address of the call's tunnel connection)"
                ));
            }
            if at > 0 {
                pieces.push(Piece::Text(rest[..at].to_string()));
            }
            pieces.push(Piece::TunnelPeer);
            rest = &rest[at + TUNNEL_PEER.len()..];
        }
        if !rest.is_empty() {
            pieces.push(Piece::Text(rest.to_string()));
        }
        let value = SetValue(pieces);
        // Checked with the longest address the variable can stand for.
        let sample = std::net::IpAddr::from([0xffff_u16; 8]);
        if value.render(Some(sample)).is_none() {
            return Err(format!("{:?} is not a valid header value", value.text()));
        }
        Ok(value)
    }

    /// The header value for a call; `None` when it needs the tunnel peer and that is not
    /// known (the header is then left out rather than half written).
    fn render(&self, tunnel_peer: Option<std::net::IpAddr>) -> Option<HeaderValue> {
        let mut out = String::new();
        for piece in &self.0 {
            match piece {
                Piece::Text(t) => out.push_str(t),
                Piece::TunnelPeer => out.push_str(&tunnel_peer?.to_canonical().to_string()),
            }
        }
        HeaderValue::from_str(&out).ok()
    }

    fn text(&self) -> String {
        self.0
            .iter()
            .map(|p| match p {
                Piece::Text(t) => t.as_str(),
                Piece::TunnelPeer => TUNNEL_PEER,
            })
            .collect()
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Seg {
    /// `**`: any number of segments.
    Deep,
    /// `*`: exactly one non-empty segment.
    One,
    /// Literal text, possibly with `*` wildcards inside one segment.
    Glob(Vec<u8>),
}

impl Policy {
    /// Compiles `rules`; errors name the key (`allow[2].path`).
    pub fn new(rules: &[AllowRule], limits: SizeLimits) -> Result<Policy, ConfigError> {
        let rules = rules
            .iter()
            .enumerate()
            .map(|(i, r)| Rule::compile(i, r))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Policy { rules, limits })
    }

    /// Number of `[[allow]]` rules (0: every call is refused).
    pub fn rule_count(&self) -> usize {
        self.rules.len()
    }

    /// The size limits.
    pub fn limits(&self) -> SizeLimits {
        self.limits
    }

    /// Checks `head` against the limits, the safety rules and the allow rules.
    pub fn prepare(&self, head: &RequestHead) -> Result<Prepared, Rejection> {
        self.prepare_call(head, None)
    }

    /// [`Policy::prepare`] for a call that came in on a tunnel connection to
    /// `tunnel_peer` (the address `$tunnel_peer` stands for in `set_headers`; `None`
    /// leaves headers that need it out).
    pub fn prepare_call(
        &self,
        head: &RequestHead,
        tunnel_peer: Option<std::net::IpAddr>,
    ) -> Result<Prepared, Rejection> {
        // A header record that is not an encoded `Header` (no dispatcher writes one: they
        // come from `relay_proto::wire_headers`) is refused as a bad request before
        // anything else reads the head.
        let header_bytes = relay_proto::head_bytes(&head.headers)
            .map_err(|e| Rejection::BadRequest(format!("the request head has {e}")))?;
        let head_bytes = head.method.len() + head.path_and_query.len() + header_bytes;
        if head_bytes > self.limits.max_header_bytes {
            return Err(Rejection::refused(
                Reason::HeaderSize,
                format!(
                    "request head of {head_bytes} bytes exceeds the agent's limits.max_header_bytes ({})",
                    self.limits.max_header_bytes
                ),
            ));
        }
        let bad = |b: &u8| matches!(b, b'\r' | b'\n' | 0);
        if head.method.bytes().any(|b| bad(&b)) || head.path_and_query.bytes().any(|b| bad(&b)) {
            return Err(Rejection::refused(
                Reason::Injection,
                "CR, LF or NUL in the request line",
            ));
        }
        // Every record parsed above.
        for (name, value) in head
            .headers
            .iter()
            .flat_map(|r| relay_proto::parse_header(r))
        {
            if name.iter().any(bad) || value.iter().any(bad) {
                return Err(Rejection::refused(
                    Reason::Injection,
                    "CR, LF or NUL in a request header",
                ));
            }
        }
        if FORBIDDEN_METHODS
            .iter()
            .any(|m| head.method.eq_ignore_ascii_case(m))
        {
            return Err(Rejection::refused(
                Reason::ForbiddenMethod,
                format!(
                    "method {} is always refused by the agent (CONNECT and TRACE), whatever the [[allow]] rules say",
                    short(&head.method.to_ascii_uppercase())
                ),
            ));
        }
        // One spelling per method, matched and sent: `get` is GET to the rules and to the
        // upstream, so a rule's methods mean what the upstream runs.
        let method =
            Method::from_bytes(head.method.to_ascii_uppercase().as_bytes()).map_err(|_| {
                Rejection::BadRequest(format!("invalid method {:?}", short(&head.method)))
            })?;
        let pq = origin_form(&head.path_and_query)?;
        let segments = path_segments(pq.path())?;
        let mut headers = header_map(head)?;
        // A whole small body may come inside the head (`RequestHead.body`).
        let no_body = head.end_of_stream && head.body.is_empty();
        let content_length = framing(&headers, no_body)?;
        let inline = (!head.body.is_empty()).then_some(head.body.len() as u64);
        if let (Some(declared), Some(n)) = (content_length, inline) {
            if declared != n {
                return Err(Rejection::refused(
                    Reason::Smuggling,
                    format!("content-length {declared} does not match the {n} bytes of the body"),
                ));
            }
        }
        if let (Some(n), Some(max)) = (content_length.or(inline), self.limits.max_body_bytes) {
            if n > max {
                return Err(Rejection::refused(
                    Reason::BodySize,
                    format!("request body of {n} bytes exceeds the agent's limits.max_body_bytes ({max})"),
                ));
            }
        }
        // Strip first, then match: a rule sees only headers the upstream will receive.
        strip_connection_headers(&mut headers)?;
        let bodiless = BODILESS
            .iter()
            .any(|m| method.as_str().eq_ignore_ascii_case(m));
        let body_on_bodiless = bodiless && !no_body && content_length != Some(0);
        let call = Shape {
            body_on_bodiless,
            non_ascii: segments.iter().any(|s| !s.is_ascii()),
        };
        let rule = self.allowed(&method, &pq, &segments, &headers, call)?;
        headers.remove(http::header::HOST);
        // One look at each name the call has (its `_` spellings went before matching).
        let spoofed: Vec<HeaderName> = headers
            .keys()
            .filter(|n| {
                let n = n.as_str();
                is_spoofing(n) && !rule.pass.iter().any(|p| p == n)
            })
            .cloned()
            .collect();
        for name in spoofed {
            headers.remove(name);
        }
        for (name, value) in &rule.set {
            if let Some(v) = value.render(tunnel_peer) {
                headers.insert(name.clone(), v);
            }
        }
        Ok(Prepared {
            method,
            path_and_query: pq,
            headers,
            content_length,
            rule: rule.label.clone(),
            close_connection: body_on_bodiless,
        })
    }

    /// The first rule that allows the call, or the refusal of the rule that came closest.
    fn allowed(
        &self,
        method: &Method,
        pq: &PathAndQuery,
        segments: &[Cow<'_, [u8]>],
        headers: &HeaderMap,
        call: Shape,
    ) -> Result<&Rule, Rejection> {
        let query = pq.query().map(parse_query).unwrap_or_default();
        // (stage reached, refusal) of the closest rule:
        // path < method < header < query < body < UTF-8 path.
        let mut closest: Option<(u8, Rejection)> = None;
        for rule in &self.rules {
            let checked = rule.check(method, pq.path(), segments, headers, &query, call);
            let (stage, refusal) = match checked {
                Ok(()) => return Ok(rule),
                Err(x) => x,
            };
            if closest.as_ref().is_none_or(|(s, _)| stage > *s) {
                closest = Some((stage, refusal));
            }
        }
        Err(match closest {
            Some((_, r)) => r,
            None => Rejection::refused(
                Reason::Path,
                format!(
                    "no accept filter allows {method} {}: the agent has no [[allow]] rules",
                    short(pq.path())
                ),
            ),
        })
    }
}

impl Rule {
    fn compile(i: usize, r: &AllowRule) -> Result<Rule, ConfigError> {
        let key = |k: &str| format!("allow[{i}].{k}");
        let label = match &r.name {
            Some(n) if !n.trim().is_empty() => n.clone(),
            Some(_) => return Err(ConfigError::invalid(key("name"), "must not be empty")),
            None => format!("allow[{i}]"),
        };
        if r.methods.is_empty() {
            return Err(ConfigError::invalid(
                key("methods"),
                "list at least one method, or \"*\" for any",
            ));
        }
        let methods = if r.methods.iter().any(|m| m == "*") {
            None
        } else {
            let mut out = Vec::with_capacity(r.methods.len());
            for m in &r.methods {
                let up = m.to_ascii_uppercase();
                if Method::from_bytes(up.as_bytes()).is_err() {
                    return Err(ConfigError::invalid(
                        key("methods"),
                        format!("{m:?} is not an HTTP method"),
                    ));
                }
                if FORBIDDEN_METHODS.contains(&up.as_str()) {
                    return Err(ConfigError::invalid(
                        key("methods"),
                        format!("{up} is always refused by the agent and cannot be allowed"),
                    ));
                }
                out.push(up);
            }
            Some(out)
        };
        let path = compile_path(&r.path).map_err(|m| ConfigError::invalid(key("path"), m))?;
        let family = |k: &str, name: &str| -> Result<String, ConfigError> {
            let lower = name.to_ascii_lowercase();
            if OVERRIDE_HEADERS.contains(&&*dashed(&lower)) {
                return Err(ConfigError::invalid(
                    key(k),
                    format!(
                        "{name:?} asks the upstream for another host, URL or method: the agent refuses it (override_header) and no rule can pass or set it"
                    ),
                ));
            }
            if lower.contains('_') || !is_spoofing(&lower) {
                return Err(ConfigError::invalid(
                    key(k),
                    format!(
                        "{name:?} is not a client-identity header the agent strips; name one by its '-' spelling, of the family {}",
                        SPOOFING_FAMILY.join(", ")
                    ),
                ));
            }
            Ok(lower)
        };
        let mut pass = Vec::with_capacity(r.pass_headers.len());
        for name in &r.pass_headers {
            pass.push(family("pass_headers", name)?);
        }
        let mut set = Vec::with_capacity(r.set_headers.len());
        for (name, value) in &r.set_headers {
            let lower = family("set_headers", name)?;
            if pass.contains(&lower) {
                return Err(ConfigError::invalid(
                    key("set_headers"),
                    format!("{name:?} is also in pass_headers: pass the caller's value or set one, not both"),
                ));
            }
            let value =
                SetValue::parse(value).map_err(|m| ConfigError::invalid(key("set_headers"), m))?;
            let name = HeaderName::from_bytes(lower.as_bytes()).map_err(|_| {
                ConfigError::invalid(key("set_headers"), format!("{name:?} is not a header name"))
            })?;
            set.push((name, value));
        }
        let mut body_methods = Vec::with_capacity(r.body_methods.len());
        for m in &r.body_methods {
            let up = m.to_ascii_uppercase();
            if !BODILESS.contains(&up.as_str()) {
                return Err(ConfigError::invalid(
                    key("body_methods"),
                    format!(
                        "{m:?}: list GET, HEAD or OPTIONS (other methods may always carry a body; TRACE never)"
                    ),
                ));
            }
            if methods.as_ref().is_some_and(|ms| !ms.contains(&up)) {
                return Err(ConfigError::invalid(
                    key("body_methods"),
                    format!("{up} is not among the rule's methods"),
                ));
            }
            body_methods.push(up);
        }
        let mut headers = Vec::with_capacity(r.headers.len());
        for (name, value) in &r.headers {
            let n = HeaderName::from_bytes(name.as_bytes()).map_err(|_| {
                ConfigError::invalid(key("headers"), format!("{name:?} is not a header name"))
            })?;
            if n == http::header::HOST
                || relay_common::hop::is_hop_by_hop(n.as_str())
                || n == http::header::CONTENT_LENGTH
            {
                return Err(ConfigError::invalid(
                    key("headers"),
                    format!("{n} is set or removed by the agent and cannot be required"),
                ));
            }
            match spoofing(n.as_str()) {
                Some(true) => {
                    return Err(ConfigError::invalid(
                        key("headers"),
                        format!("{n} is always stripped by the agent and cannot be required"),
                    ))
                }
                Some(false) if !pass.iter().any(|p| p == n.as_str()) => {
                    return Err(ConfigError::invalid(
                        key("headers"),
                        format!(
                            "{n} is stripped by the agent unless the rule lists it in pass_headers"
                        ),
                    ))
                }
                _ => {}
            }
            if HeaderValue::from_str(value).is_err() {
                return Err(ConfigError::invalid(
                    key("headers"),
                    format!("the pattern for {n} is not a valid header value"),
                ));
            }
            headers.push((n, value.as_bytes().to_vec()));
        }
        let query = r
            .query
            .iter()
            .map(|(k, v)| (k.as_bytes().to_vec(), v.as_bytes().to_vec()))
            .collect();
        Ok(Rule {
            label,
            methods,
            path,
            headers,
            query,
            query_ignore_case: r.query_ignore_case,
            pass,
            set,
            body_methods,
            utf8_paths: r.utf8_paths,
        })
    }

    /// `Err((stage, refusal))`: 0 path, 1 method, 2 header, 3 query, 4 body, 5 UTF-8 path.
    fn check(
        &self,
        method: &Method,
        path: &str,
        segments: &[Cow<'_, [u8]>],
        headers: &HeaderMap,
        query: &[(Vec<u8>, Vec<u8>)],
        call: Shape,
    ) -> Result<(), (u8, Rejection)> {
        if !match_path(&self.path, segments) {
            let hint = if path.contains(';') {
                " (a segment holding ';' is matched only by a rule that spells it out, never by a wildcard)"
            } else {
                ""
            };
            return Err((
                0,
                Rejection::refused(
                    Reason::Path,
                    format!("no accept filter allows the path {}{hint}", short(path)),
                ),
            ));
        }
        if let Some(allowed) = &self.methods {
            if !allowed
                .iter()
                .any(|m| m.eq_ignore_ascii_case(method.as_str()))
            {
                return Err((
                    1,
                    Rejection::refused(
                        Reason::Method,
                        format!(
                            "method {} is not allowed on {} (rule {:?} allows {})",
                            short(method.as_str()),
                            short(path),
                            self.label,
                            allowed.join(", ")
                        ),
                    ),
                ));
            }
        }
        for (name, pattern) in &self.headers {
            let mut values = headers.get_all(name).iter().peekable();
            let ok = values.peek().is_some() && values.all(|v| glob(pattern, v.as_bytes()));
            if !ok {
                return Err((
                    2,
                    Rejection::refused(
                        Reason::Header,
                        format!(
                            "required header {name} is missing or does not match (rule {:?})",
                            self.label
                        ),
                    ),
                ));
            }
        }
        for (name, pattern) in &self.query {
            let same = |k: &[u8]| {
                if self.query_ignore_case {
                    k.eq_ignore_ascii_case(name)
                } else {
                    k == name.as_slice()
                }
            };
            let mut values = query.iter().filter(|(k, _)| same(k)).peekable();
            let ok = values.peek().is_some() && values.all(|(_, v)| glob(pattern, v));
            if !ok {
                return Err((
                    3,
                    Rejection::refused(
                        Reason::Query,
                        format!(
                            "required query parameter {} is missing or does not match (rule {:?})",
                            short(&String::from_utf8_lossy(name)),
                            self.label
                        ),
                    ),
                ));
            }
        }
        if call.body_on_bodiless
            && !self
                .body_methods
                .iter()
                .any(|m| m.eq_ignore_ascii_case(method.as_str()))
        {
            return Err((
                4,
                Rejection::refused(
                    Reason::Body,
                    format!(
                        "a request body on {} is refused (rule {:?} does not list it in body_methods)",
                        short(method.as_str()),
                        self.label
                    ),
                ),
            ));
        }
        if call.non_ascii && !self.utf8_paths {
            return Err((
                5,
                Rejection::refused(
                    Reason::UnsafePath,
                    format!(
                        "unsafe path: non-ASCII characters (rule {:?} does not set utf8_paths)",
                        self.label
                    ),
                ),
            ));
        }
        Ok(())
    }
}

/// A path pattern split into segments.
fn compile_path(p: &str) -> Result<Vec<Seg>, String> {
    let Some(rest) = p.strip_prefix('/') else {
        return Err("must start with '/'".into());
    };
    if p.contains(['?', '#']) {
        return Err("must not contain '?' or '#' (use `query` for query parameters)".into());
    }
    let parts: Vec<&str> = rest.split('/').collect();
    let last = parts.len() - 1;
    let mut segs = Vec::with_capacity(parts.len());
    for (i, part) in parts.iter().enumerate() {
        if part.is_empty() && i != last {
            return Err("must not contain an empty segment ('//')".into());
        }
        segs.push(match *part {
            "**" => Seg::Deep,
            "*" => Seg::One,
            _ if part.contains("**") => {
                return Err("`**` must be a whole segment".into());
            }
            "." | ".." => return Err("must not contain '.' or '..' segments".into()),
            _ => Seg::Glob(
                percent_decode(part, false)
                    .ok_or_else(|| format!("bad percent-encoding in {part:?}"))?
                    .into_owned(),
            ),
        });
    }
    Ok(segs)
}

/// The target as origin-form `PathAndQuery`, or why not.
fn origin_form(target: &str) -> Result<PathAndQuery, Rejection> {
    if !target.starts_with('/') || target.starts_with("//") {
        return Err(Rejection::refused(
            Reason::Target,
            "the request target must be a path starting with a single '/': absolute-URI, \
             authority-form and '//host' targets are refused (the agent only calls its configured origin)",
        ));
    }
    let pq: PathAndQuery = target
        .parse()
        .map_err(|e| Rejection::BadRequest(format!("invalid request target: {e}")))?;
    // A fragment is dropped by the parser; what remains must still be a plain path.
    if !pq.path().starts_with('/') || pq.path().starts_with("//") {
        return Err(Rejection::BadRequest("invalid request target".into()));
    }
    Ok(pq)
}

/// The path's segments, percent-decoded, after the traversal checks.
fn path_segments(path: &str) -> Result<Vec<Cow<'_, [u8]>>, Rejection> {
    let unsafe_path =
        |why: &str| Rejection::refused(Reason::UnsafePath, format!("unsafe path: {why}"));
    let rest = path.strip_prefix('/').unwrap_or(path);
    let mut out = Vec::with_capacity(rest.bytes().filter(|b| *b == b'/').count() + 1);
    let mut parts = rest.split('/').peekable();
    while let Some(part) = parts.next() {
        if part.is_empty() && parts.peek().is_some() {
            return Err(unsafe_path("empty segment ('//')"));
        }
        let decoded =
            percent_decode(part, false).ok_or_else(|| unsafe_path("bad percent-encoding"))?;
        if decoded.contains(&0) {
            return Err(unsafe_path("NUL byte"));
        }
        // Non-ASCII is allowed only as valid UTF-8 (never overlong: `%c0%ae` is '.' to a
        // lenient decoder), and only by a rule with `utf8_paths` (see `Rule::check`).
        match std::str::from_utf8(&decoded) {
            Err(_) => {
                return Err(unsafe_path(
                    "bytes that are not valid UTF-8 (overlong UTF-8 such as %c0%ae included)",
                ))
            }
            Ok(text) if text.chars().any(|c| LOOKALIKES.contains(&c)) => {
                return Err(unsafe_path(
                    "a character that some servers fold into '.', '/' or '\\'",
                ))
            }
            Ok(_) => {}
        }
        if decoded.iter().any(|b| b.is_ascii_control()) {
            return Err(unsafe_path("a control character"));
        }
        if decoded
            .windows(3)
            .any(|w| w[0] == b'%' && w[1].is_ascii_hexdigit() && w[2].is_ascii_hexdigit())
        {
            return Err(unsafe_path(
                "double percent-encoding (%25 followed by an escape, such as %252e)",
            ));
        }
        // Servers differ on `%2F`, `\` and `;params`: refuse a dot segment under any of them.
        let dot = decoded.split(|b| *b == b'/' || *b == b'\\').any(|piece| {
            let name = piece.split(|b| *b == b';').next().unwrap_or(piece);
            name == b"." || name == b".."
        });
        if dot {
            return Err(unsafe_path("'.' or '..' segment"));
        }
        out.push(decoded);
    }
    Ok(out)
}

/// Characters that Unicode compatibility normalization (NFKC) or lenient servers turn into
/// '.', '/' or '\': refused even where a rule allows UTF-8 paths.
const LOOKALIKES: [char; 8] = [
    '\u{2024}', // one dot leader
    '\u{FE52}', // small full stop
    '\u{FF0E}', // fullwidth full stop
    '\u{2215}', // division slash
    '\u{2044}', // fraction slash
    '\u{FF0F}', // fullwidth solidus
    '\u{2216}', // set minus
    '\u{FF3C}', // fullwidth reverse solidus
];

/// The head's headers as a `HeaderMap`, after the override-header check.
fn header_map(head: &RequestHead) -> Result<HeaderMap, Rejection> {
    // Sized once by the count, which `limits.max_headers` bounds before this runs.
    let mut headers = HeaderMap::with_capacity(head.headers.len());
    for record in &head.headers {
        // `prepare` refused a head with a record that does not parse before this runs.
        let (name, value) = relay_proto::parse_header(record)
            .map_err(|e| Rejection::BadRequest(format!("the request head has {e}")))?;
        let name = HeaderName::from_bytes(name).map_err(|_| {
            Rejection::BadRequest(format!(
                "invalid header name {:?}",
                short(&String::from_utf8_lossy(name))
            ))
        })?;
        // The value shares the frame's bytes (checked, not copied).
        let value = HeaderValue::from_maybe_shared(record.slice_ref(value))
            .map_err(|_| Rejection::BadRequest(format!("invalid value for header {name}")))?;
        let overrides = OVERRIDE_HEADERS.contains(&&*dashed(name.as_str()))
            || (name == http::header::FORWARDED
                && value
                    .as_bytes()
                    .to_ascii_lowercase()
                    .windows(5)
                    .any(|w| w == b"host="));
        if overrides {
            return Err(Rejection::refused(
                Reason::OverrideHeader,
                format!("header {name} asks for another host, URL or method and is refused"),
            ));
        }
        headers.append(name, value);
    }
    Ok(headers)
}

/// Removes the hop-by-hop headers, every header `Connection` names, and the `_`
/// spellings of the spoofing headers. A `Connection` naming `Content-Length` would
/// change the body's framing after it was checked: refused as smuggling.
fn strip_connection_headers(headers: &mut HeaderMap) -> Result<(), Rejection> {
    let names_length = headers
        .get_all(http::header::CONNECTION)
        .iter()
        .flat_map(|v| v.as_bytes().split(|b| *b == b','))
        .any(|n| n.trim_ascii().eq_ignore_ascii_case(b"content-length"));
    if names_length {
        return Err(Rejection::refused(
            Reason::Smuggling,
            "connection names content-length",
        ));
    }
    relay_common::hop::strip(headers);
    let underscored: Vec<HeaderName> = headers
        .keys()
        .filter(|n| spoofing(n.as_str()) == Some(true))
        .cloned()
        .collect();
    for n in underscored {
        headers.remove(n);
    }
    Ok(())
}

/// Checks message framing; returns the declared Content-Length.
fn framing(headers: &HeaderMap, no_body: bool) -> Result<Option<u64>, Rejection> {
    let smuggling = |why: String| Rejection::refused(Reason::Smuggling, why);
    let lengths: Vec<&HeaderValue> = headers
        .get_all(http::header::CONTENT_LENGTH)
        .iter()
        .collect();
    let encodings: Vec<&HeaderValue> = headers
        .get_all(http::header::TRANSFER_ENCODING)
        .iter()
        .collect();
    if lengths.len() > 1 {
        return Err(smuggling("duplicate content-length headers".into()));
    }
    let length = match lengths.first() {
        None => None,
        Some(v) => {
            let b = v.as_bytes();
            if b.is_empty() || b.len() > 19 || !b.iter().all(u8::is_ascii_digit) {
                return Err(smuggling(
                    "content-length is not a plain decimal number".into(),
                ));
            }
            let n = std::str::from_utf8(b)
                .ok()
                .and_then(|s| s.parse::<u64>().ok())
                .ok_or_else(|| smuggling("content-length is not a plain decimal number".into()))?;
            Some(n)
        }
    };
    if !encodings.is_empty() {
        if length.is_some() {
            return Err(smuggling(
                "content-length together with transfer-encoding".into(),
            ));
        }
        let chunked_only = encodings.len() == 1
            && encodings[0]
                .to_str()
                .is_ok_and(|s| s.trim().eq_ignore_ascii_case("chunked"));
        if !chunked_only {
            return Err(smuggling(
                "transfer-encoding other than a single 'chunked'".into(),
            ));
        }
    }
    if no_body && length.is_some_and(|n| n > 0) {
        return Err(smuggling(
            "content-length announces a body but the request has none".into(),
        ));
    }
    Ok(length)
}

/// Which segment positions a pattern prefix reaches.
type Reach = smallvec::SmallVec<[bool; 32]>;

/// `Seg` patterns against decoded segments: a small NFA over segment positions, so
/// several `**` cost O(patterns x segments), never backtracking.
fn match_path(pattern: &[Seg], segments: &[Cow<'_, [u8]>]) -> bool {
    let n = segments.len();
    // On the stack for paths of up to 31 segments: this runs per rule for every call.
    let mut reach: Reach = smallvec::smallvec![false; n + 1];
    reach[0] = true;
    for seg in pattern {
        let mut next: Reach = smallvec::smallvec![false; n + 1];
        match seg {
            Seg::Deep => {
                // `**` spans any run of segments, but none holding a ';' (see module docs).
                let mut open = false;
                for j in 0..=n {
                    open |= reach[j];
                    next[j] = open;
                    if j < n && segments[j].contains(&b';') {
                        open = false;
                    }
                }
            }
            _ => {
                for i in 0..n {
                    if reach[i] && segment_matches(seg, &segments[i]) {
                        next[i + 1] = true;
                    }
                }
            }
        }
        if !next.iter().any(|r| *r) {
            return false;
        }
        reach = next;
    }
    reach[n]
}

fn segment_matches(seg: &Seg, s: &[u8]) -> bool {
    // A decoded segment holding a separator ('%2F', '\') is matched only literally or by
    // `**`: a wildcard meant for one segment never spans what a server may split.
    // Nor does a wildcard match a segment holding a ';' (see module docs).
    let has_sep = s.iter().any(|b| matches!(*b, b'/' | b'\\' | b';'));
    match seg {
        Seg::Deep => true,
        Seg::One => !s.is_empty() && !has_sep,
        Seg::Glob(p) if p.contains(&b'*') => !has_sep && glob(p, s),
        Seg::Glob(p) => p.as_slice() == s,
    }
}

/// Query pairs, percent-decoded (`+` as space); undecodable pairs are kept raw so they
/// can never satisfy a pattern that expects a decoded value by accident.
fn parse_query(q: &str) -> Vec<(Vec<u8>, Vec<u8>)> {
    q.split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            let dec = |x: &str| {
                percent_decode(x, true).map_or_else(|| x.as_bytes().to_vec(), Cow::into_owned)
            };
            (dec(k), dec(v))
        })
        .collect()
}

/// Percent-decodes `s`; `None` on a broken escape. Borrows `s` when there is nothing to
/// decode (the usual path segment).
fn percent_decode(s: &str, plus_is_space: bool) -> Option<Cow<'_, [u8]>> {
    let b = s.as_bytes();
    if !b
        .iter()
        .any(|c| *c == b'%' || (plus_is_space && *c == b'+'))
    {
        return Some(Cow::Borrowed(b));
    }
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'%' => {
                let hex = b.get(i + 1..i + 3)?;
                let hi = (hex[0] as char).to_digit(16)?;
                let lo = (hex[1] as char).to_digit(16)?;
                out.push(u8::try_from(hi * 16 + lo).ok()?);
                i += 3;
            }
            b'+' if plus_is_space => {
                out.push(b' ');
                i += 1;
            }
            c => {
                out.push(c);
                i += 1;
            }
        }
    }
    Some(Cow::Owned(out))
}

/// At most 200 characters of `s`, for messages and logs.
pub fn short(s: &str) -> String {
    const MAX: usize = 200;
    if s.len() <= MAX {
        return s.to_string();
    }
    let mut end = MAX;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &s[..end])
}

/// The path of a target without its query, for log lines (the query may hold secrets).
pub fn log_path(target: &str) -> String {
    short(target.split(['?', '#']).next().unwrap_or(""))
}

#[cfg(test)]
mod tests;
