//! Reading both inputs of the policy: the `[[allow]]` rules compiled once at start
//! (`Rule::compile`, path patterns, `set_headers` values) and a call's target read per
//! call (origin form, path segments decoded once and checked for dot segments and
//! look-alike characters, query pairs, percent-decoding).

use super::*;

/// A `set_headers` value: literal text around the `$tunnel_peer` variable.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct SetValue(Vec<Piece>);

#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Piece {
    Text(String),
    TunnelPeer,
}

impl SetValue {
    /// Parses a value; every `$` must start `$tunnel_peer`.
    pub(super) fn parse(value: &str) -> Result<SetValue, String> {
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
    pub(super) fn render(&self, tunnel_peer: Option<std::net::IpAddr>) -> Option<HeaderValue> {
        let mut out = String::new();
        for piece in &self.0 {
            match piece {
                Piece::Text(t) => out.push_str(t),
                Piece::TunnelPeer => out.push_str(&tunnel_peer?.to_canonical().to_string()),
            }
        }
        HeaderValue::from_str(&out).ok()
    }

    pub(super) fn text(&self) -> String {
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
pub(super) enum Seg {
    /// `**`: any number of segments.
    Deep,
    /// `*`: exactly one non-empty segment.
    One,
    /// Literal text, possibly with `*` wildcards inside one segment.
    Glob(Vec<u8>),
}

impl Rule {
    pub(super) fn compile(i: usize, r: &AllowRule) -> Result<Rule, ConfigError> {
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
}

/// A path pattern split into segments.
pub(super) fn compile_path(p: &str) -> Result<Vec<Seg>, String> {
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
pub(super) fn origin_form(target: &str) -> Result<PathAndQuery, Rejection> {
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
pub(super) fn path_segments(path: &str) -> Result<Vec<Cow<'_, [u8]>>, Rejection> {
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
pub(super) const LOOKALIKES: [char; 8] = [
    '\u{2024}', // one dot leader
    '\u{FE52}', // small full stop
    '\u{FF0E}', // fullwidth full stop
    '\u{2215}', // division slash
    '\u{2044}', // fraction slash
    '\u{FF0F}', // fullwidth solidus
    '\u{2216}', // set minus
    '\u{FF3C}', // fullwidth reverse solidus
];

/// Query pairs, percent-decoded (`+` as space); undecodable pairs are kept raw so they
/// can never satisfy a pattern that expects a decoded value by accident.
pub(super) fn parse_query(q: &str) -> Vec<(Vec<u8>, Vec<u8>)> {
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
pub(super) fn percent_decode(s: &str, plus_is_space: bool) -> Option<Cow<'_, [u8]>> {
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
