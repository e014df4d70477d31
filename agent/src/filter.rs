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
//!
//! This file holds the types and `Policy::prepare_call`, which runs the checks in the order
//! above; `parse` compiles the rules and reads the target, `matching` tries one rule on a
//! call, `strip` copies, strips and frames the headers.

use http::header::{HeaderMap, HeaderName, HeaderValue};
use http::uri::PathAndQuery;
use http::Method;
use relay_common::config::ConfigError;
use relay_common::glob::matches as glob;
use relay_proto::RequestHead;
use serde::Deserialize;
use std::borrow::Cow;
use std::collections::BTreeMap;

mod matching;
mod parse;
mod strip;

#[cfg(test)]
use matching::match_path;
use parse::*;
use strip::*;

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
