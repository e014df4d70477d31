//! The one wildcard pattern of the relay: `*` matches any run of bytes (none included),
//! everything else is literal. Caller tunnel patterns (`acme-*`), `forward_hosts` name
//! patterns and the agent's path and header rules all match through [`matches`].
//!
//! Linear time: a two-pointer match that backtracks only to the last `*`, so a pattern
//! from config can never make a peer's input expensive.

/// Whether `pattern` matches all of `s`.
pub fn matches(pattern: &[u8], s: &[u8]) -> bool {
    let (mut pi, mut si) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while si < s.len() {
        if pi < pattern.len() && pattern[pi] == b'*' {
            star = Some((pi, si));
            pi += 1;
        } else if pi < pattern.len() && pattern[pi] == s[si] {
            pi += 1;
            si += 1;
        } else if let Some((sp, ss)) = star {
            pi = sp + 1;
            si = ss + 1;
            star = Some((sp, ss + 1));
        } else {
            return false;
        }
    }
    pattern[pi..].iter().all(|b| *b == b'*')
}

/// [`matches`] on text.
pub fn matches_str(pattern: &str, s: &str) -> bool {
    matches(pattern.as_bytes(), s.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn star_matches_any_run_and_everything_else_is_literal() {
        let cases = [
            ("demo", "demo", true),
            ("demo", "demo-2", false),
            ("acme-*", "acme-scm", true),
            ("acme-*", "acme-", true),
            ("acme-*", "acm", false),
            ("acme-*", "xacme-scm", false),
            ("*-scm", "acme-scm", true),
            ("*-scm", "acme-scm2", false),
            ("a*b*c", "aXbYc", true),
            ("a*b*c", "abc", true),
            ("a*b*c", "acb", false),
            ("a*a", "a", false),
            ("*", "", true),
            ("*", "anything", true),
            ("2*", "2.1", true),
            ("main", "main2", false),
            ("*.json", "a.json", true),
            ("*.json", "a.jsonx", false),
        ];
        for (pattern, s, want) in cases {
            assert_eq!(matches_str(pattern, s), want, "{pattern} vs {s}");
        }
    }

    #[test]
    fn pathological_input_takes_linear_time() {
        // Would take ages with naive backtracking.
        let p = "*a*a*a*a*a*a*a*a*b".as_bytes();
        let s = vec![b'a'; 10_000];
        assert!(!matches(p, &s));
    }
}
