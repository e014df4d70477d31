//! Matching a call against one compiled rule (`Rule::check`): path, method, headers,
//! query, body and UTF-8 path, in that order; path patterns by a small NFA over segment
//! positions.

use super::*;

impl Rule {
    /// `Err((stage, refusal))`: 0 path, 1 method, 2 header, 3 query, 4 body, 5 UTF-8 path.
    pub(super) fn check(
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

/// Which segment positions a pattern prefix reaches.
pub(super) type Reach = smallvec::SmallVec<[bool; 32]>;

/// `Seg` patterns against decoded segments: a small NFA over segment positions, so
/// several `**` cost O(patterns x segments), never backtracking.
pub(super) fn match_path(pattern: &[Seg], segments: &[Cow<'_, [u8]>]) -> bool {
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

pub(super) fn segment_matches(seg: &Seg, s: &[u8]) -> bool {
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
