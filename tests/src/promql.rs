//! The names a PromQL query refers to: each vector selector (metric name and label
//! matchers) and the labels of its grouping and matching clauses (`by`, `without`, `on`,
//! `ignoring`, `group_left`, `group_right`). `tests/tests/deploy.rs` checks them against
//! what the relay's processes export.
//!
//! This is not a PromQL parser and does not judge syntax: Prometheus does that (promtool
//! for the rule files, the query API for the dashboard's queries). It only classifies the
//! identifiers of a query it assumes valid, which needs a tokenizer, not a grammar (a full
//! parser crate would cost the workspace a parser generator at build time for this one
//! check). Grafana variables (`$__rate_interval`, `${x}`) are skipped like literals.

use std::fmt;

/// One label matcher of a selector: `label op "value"`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Matcher {
    pub label: String,
    /// `=`, `!=`, `=~` or `!~`.
    pub op: String,
    pub value: String,
}

/// One vector selector: `metric{matchers}` (the metric may be missing: `{__name__=...}`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Selector {
    pub metric: Option<String>,
    pub matchers: Vec<Matcher>,
}

impl fmt::Display for Selector {
    /// The selector as PromQL, e.g. for `count(...)` through the query API.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(m) = &self.metric {
            f.write_str(m)?;
        }
        if !self.matchers.is_empty() || self.metric.is_none() {
            f.write_str("{")?;
            for (i, m) in self.matchers.iter().enumerate() {
                if i > 0 {
                    f.write_str(", ")?;
                }
                write!(f, "{}{}{:?}", m.label, m.op, m.value)?;
            }
            f.write_str("}")?;
        }
        Ok(())
    }
}

/// What one query names.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Names {
    pub selectors: Vec<Selector>,
    /// Labels named in `by (...)`, `without (...)`, `on (...)`, `ignoring (...)`,
    /// `group_left (...)` and `group_right (...)`.
    pub grouping: Vec<String>,
}

const GROUPING: [&str; 6] = [
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
];
/// Identifiers that are neither metrics nor functions.
const KEYWORDS: [&str; 10] = [
    "and", "or", "unless", "bool", "offset", "atan2", "inf", "nan", "start", "end",
];

#[derive(Clone, Debug, PartialEq)]
enum Tok {
    Ident(String),
    Str(String),
    Punct(char),
    /// `=`, `!=`, `=~`, `!~` and other operators.
    Op(String),
    /// Numbers, durations, ranges, Grafana variables: nothing to name.
    Literal,
}

fn tokens(q: &str) -> Result<Vec<Tok>, String> {
    let chars: Vec<char> = q.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c.is_whitespace() {
            i += 1;
        } else if c == '#' {
            while i < chars.len() && chars[i] != '\n' {
                i += 1;
            }
        } else if c == '"' || c == '\'' || c == '`' {
            let mut s = String::new();
            i += 1;
            loop {
                let Some(&d) = chars.get(i) else {
                    return Err(format!("unterminated string in {q:?}"));
                };
                i += 1;
                if d == c {
                    break;
                }
                if d == '\\' && c != '`' {
                    let Some(&e) = chars.get(i) else {
                        return Err(format!("unterminated string in {q:?}"));
                    };
                    i += 1;
                    s.push(match e {
                        'n' => '\n',
                        't' => '\t',
                        other => other,
                    });
                } else {
                    s.push(d);
                }
            }
            out.push(Tok::Str(s));
        } else if c == '[' {
            // A range or subquery: durations and variables only.
            while i < chars.len() && chars[i] != ']' {
                i += 1;
            }
            i += 1;
            out.push(Tok::Literal);
        } else if c == '$' {
            i += 1;
            if chars.get(i) == Some(&'{') {
                while i < chars.len() && chars[i] != '}' {
                    i += 1;
                }
                i += 1;
            } else {
                while i < chars.len() && (chars[i].is_alphanumeric() || chars[i] == '_') {
                    i += 1;
                }
            }
            out.push(Tok::Literal);
        } else if c.is_ascii_digit()
            || (c == '.' && chars.get(i + 1).is_some_and(|d| d.is_ascii_digit()))
        {
            while i < chars.len()
                && (chars[i].is_ascii_alphanumeric()
                    || chars[i] == '.'
                    || ((chars[i] == '+' || chars[i] == '-') && matches!(chars[i - 1], 'e' | 'E')))
            {
                i += 1;
            }
            out.push(Tok::Literal);
        } else if c.is_ascii_alphabetic() || c == '_' || c == ':' {
            let start = i;
            while i < chars.len()
                && (chars[i].is_ascii_alphanumeric() || chars[i] == '_' || chars[i] == ':')
            {
                i += 1;
            }
            out.push(Tok::Ident(chars[start..i].iter().collect()));
        } else if matches!(c, '(' | ')' | '{' | '}' | ',') {
            out.push(Tok::Punct(c));
            i += 1;
        } else {
            let two: String = chars[i..(i + 2).min(chars.len())].iter().collect();
            if matches!(two.as_str(), "=~" | "!~" | "!=" | "==" | ">=" | "<=") {
                out.push(Tok::Op(two));
                i += 2;
            } else {
                out.push(Tok::Op(c.to_string()));
                i += 1;
            }
        }
    }
    Ok(out)
}

/// The selectors and grouping labels of `query` (see the module docs).
pub fn names(query: &str) -> Result<Names, String> {
    let toks = tokens(query)?;
    let mut names = Names::default();
    let mut i = 0;
    while i < toks.len() {
        match &toks[i] {
            Tok::Ident(id) if GROUPING.contains(&id.as_str()) => {
                i += 1;
                if toks.get(i) == Some(&Tok::Punct('(')) {
                    i += 1;
                    loop {
                        match toks.get(i) {
                            Some(Tok::Ident(l)) => names.grouping.push(l.clone()),
                            Some(Tok::Punct(',')) => {}
                            Some(Tok::Punct(')')) => break,
                            other => {
                                return Err(format!(
                                    "unexpected {other:?} in the label list after {id} in {query:?}"
                                ))
                            }
                        }
                        i += 1;
                    }
                    i += 1;
                }
            }
            Tok::Ident(id) if KEYWORDS.contains(&id.as_str()) => i += 1,
            Tok::Ident(_)
                if toks.get(i + 1) == Some(&Tok::Punct('('))
                    || matches!(toks.get(i + 1), Some(Tok::Ident(k)) if k == "by" || k == "without") =>
            {
                // A function, or an aggregation (`sum (...)`, `sum by (...) (...)`).
                i += 1;
            }
            Tok::Ident(id) => {
                let metric = id.clone();
                i += 1;
                let mut matchers = Vec::new();
                if toks.get(i) == Some(&Tok::Punct('{')) {
                    i = matchers_at(&toks, i, query, &mut matchers)?;
                }
                names.selectors.push(Selector {
                    metric: Some(metric),
                    matchers,
                });
            }
            Tok::Punct('{') => {
                let mut matchers = Vec::new();
                i = matchers_at(&toks, i, query, &mut matchers)?;
                names.selectors.push(Selector {
                    metric: None,
                    matchers,
                });
            }
            _ => i += 1,
        }
    }
    Ok(names)
}

/// Reads `{label op "value", ...}` starting at the `{` at `i`; returns the index after `}`.
fn matchers_at(
    toks: &[Tok],
    mut i: usize,
    query: &str,
    out: &mut Vec<Matcher>,
) -> Result<usize, String> {
    i += 1;
    loop {
        match (toks.get(i), toks.get(i + 1), toks.get(i + 2)) {
            (Some(Tok::Punct('}')), _, _) => return Ok(i + 1),
            (Some(Tok::Punct(',')), _, _) => i += 1,
            (Some(Tok::Ident(label)), Some(Tok::Op(op)), Some(Tok::Str(value)))
                if matches!(op.as_str(), "=" | "!=" | "=~" | "!~") =>
            {
                out.push(Matcher {
                    label: label.clone(),
                    op: op.clone(),
                    value: value.clone(),
                });
                i += 3;
            }
            (Some(Tok::Ident(label)), Some(Tok::Op(op)), Some(Tok::Literal))
                if matches!(op.as_str(), "=" | "!=" | "=~" | "!~") =>
            {
                // A Grafana variable as the value: only the label name can be checked.
                out.push(Matcher {
                    label: label.clone(),
                    op: op.clone(),
                    value: String::new(),
                });
                i += 3;
            }
            other => {
                return Err(format!(
                    "cannot read the label matchers of {query:?} at {other:?}"
                ))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sel(metric: &str, matchers: &[(&str, &str, &str)]) -> Selector {
        Selector {
            metric: Some(metric.into()),
            matchers: matchers
                .iter()
                .map(|(l, o, v)| Matcher {
                    label: l.to_string(),
                    op: o.to_string(),
                    value: v.to_string(),
                })
                .collect(),
        }
    }

    #[test]
    fn selectors_functions_and_grouping_are_told_apart() {
        let n = names(
            r#"histogram_quantile(0.99, sum by (instance, le) (rate(relay_tunnel_queue_wait_seconds_bucket[$__rate_interval])))"#,
        )
        .unwrap();
        assert_eq!(
            n.selectors,
            vec![sel("relay_tunnel_queue_wait_seconds_bucket", &[])]
        );
        assert_eq!(n.grouping, vec!["instance", "le"]);

        let n = names(
            "sum by (outcome) (rate(relay_dispatcher_calls_total{outcome!=\"ok\"}[5m])) / ignoring (outcome) group_left sum(rate(relay_dispatcher_calls_total[5m]))",
        )
        .unwrap();
        assert_eq!(
            n.selectors,
            vec![
                sel("relay_dispatcher_calls_total", &[("outcome", "!=", "ok")]),
                sel("relay_dispatcher_calls_total", &[])
            ]
        );
        assert_eq!(n.grouping, vec!["outcome", "outcome"]);
    }

    #[test]
    fn keywords_numbers_strings_and_recorded_names() {
        let n = names(
            "job:relay_dispatcher_calls:rate5m{outcome=~'no_capacity|stream_lost'} > 1/60 and on (job) x_total offset 5m > bool 1e+3",
        )
        .unwrap();
        assert_eq!(
            n.selectors,
            vec![
                sel(
                    "job:relay_dispatcher_calls:rate5m",
                    &[("outcome", "=~", "no_capacity|stream_lost")]
                ),
                sel("x_total", &[])
            ]
        );
        assert_eq!(n.grouping, vec!["job"]);
        let n = names("relay_tls_certificate_expiry_timestamp_seconds - time() < 14 * 86400 > 0")
            .unwrap();
        assert_eq!(
            n.selectors,
            vec![sel("relay_tls_certificate_expiry_timestamp_seconds", &[])]
        );
        let n =
            names("quantile by (server_id) (0.5, relay_dispatcher_server_rtt_seconds)").unwrap();
        assert_eq!(
            n.selectors,
            vec![sel("relay_dispatcher_server_rtt_seconds", &[])]
        );
        assert_eq!(n.grouping, vec!["server_id"]);
        let n = names("sum without (instance) (rate(m_total[5m]))").unwrap();
        assert_eq!(n.selectors, vec![sel("m_total", &[])]);
        let n = names("topk(5, max by (tunnel_id) (relay_dispatcher_spill_share))").unwrap();
        assert_eq!(n.selectors, vec![sel("relay_dispatcher_spill_share", &[])]);
        assert_eq!(n.grouping, vec!["tunnel_id"]);
    }

    #[test]
    fn a_selector_prints_back_as_promql() {
        let s = sel(
            "m_total",
            &[("outcome", "=", "no_capacity"), ("x", "=~", "a|b")],
        );
        assert_eq!(s.to_string(), r#"m_total{outcome="no_capacity", x=~"a|b"}"#);
    }

    #[test]
    fn broken_matchers_are_an_error_not_a_guess() {
        assert!(names("m{outcome}").is_err());
        assert!(names("m{outcome=\"x").is_err());
    }
}
