//! The documentation stays true to the tree and to the code, with no network:
//!
//! - every relative link in README.md and docs/*.md reaches a file or folder of the
//!   repository, and a `#anchor` a heading of the Markdown file it names (GitHub's anchors:
//!   lower case, punctuation dropped, spaces as `-`, a repeated heading numbered `-1`, `-2`);
//! - every config key the three binaries accept is named in docs/configuration.md.
//!
//! The keys are not copied by hand: the binaries' config types are asked. Every config
//! struct refuses unknown keys (`deny_unknown_fields`), and serde's refusal lists the keys
//! the struct does accept ("unknown field `x`, expected one of `a`, `b`"), renames and
//! aliases included, skipped fields left out. So the test offers each config type a probe
//! key at the top, reads the keys it names, then offers each of those keys a table (and an
//! array of tables) holding the probe: a key whose value is a struct names its own keys,
//! and so on down. A field added to any config struct, in any file, is found.

use serde::de::DeserializeOwned;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .canonicalize()
        .unwrap()
}

/// README.md and every docs/*.md, as (path, text).
fn documents() -> Vec<(PathBuf, String)> {
    let root = repo();
    let mut paths = vec![root.join("README.md")];
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root.join("docs"))
        .expect("a docs folder")
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    docs.sort();
    assert!(!docs.is_empty(), "docs/ holds no Markdown file");
    paths.extend(docs);
    paths
        .into_iter()
        .map(|p| {
            let text = std::fs::read_to_string(&p).unwrap();
            (p, text)
        })
        .collect()
}

/// The lines of a Markdown text outside fenced code blocks, with their line numbers.
fn prose(text: &str) -> Vec<(usize, &str)> {
    let mut fenced = false;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if !fenced {
            out.push((i + 1, line));
        }
    }
    out
}

/// A line with its inline code spans blanked (their text is not Markdown).
fn without_code(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut in_code = false;
    for c in line.chars() {
        if c == '`' {
            in_code = !in_code;
            out.push(' ');
        } else if in_code {
            out.push(' ');
        } else {
            out.push(c);
        }
    }
    out
}

/// The text of inline code spans in a Markdown text (outside fenced blocks too).
fn code_spans(text: &str) -> Vec<String> {
    let mut spans = Vec::new();
    for (_, line) in prose(text) {
        let mut parts = line.split('`');
        parts.next();
        while let (Some(code), Some(_)) = (parts.next(), parts.next()) {
            spans.push(code.to_string());
        }
    }
    spans
}

/// GitHub's anchor for a heading's text.
fn anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || matches!(c, '-' | '_' | ' '))
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// Every anchor a Markdown text's headings give, repeated headings numbered as GitHub does.
fn anchors(text: &str) -> BTreeSet<String> {
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut out = BTreeSet::new();
    for (_, line) in prose(text) {
        let hashes = line.chars().take_while(|&c| c == '#').count();
        if !(1..=6).contains(&hashes) || !line[hashes..].starts_with(' ') {
            continue;
        }
        let base = anchor(&line[hashes..]);
        let n = seen.entry(base.clone()).or_insert(0);
        out.insert(if *n == 0 {
            base.clone()
        } else {
            format!("{base}-{n}")
        });
        *n += 1;
    }
    out
}

/// The targets of a line's inline links and images (`[text](target)`, `![alt](target)`)
/// and of a reference definition (`[name]: target`).
fn link_targets(line: &str) -> Vec<String> {
    let line = without_code(line);
    let mut out = Vec::new();
    let mut rest = line.as_str();
    while let Some(at) = rest.find("](") {
        let after = &rest[at + 2..];
        let mut depth = 0usize;
        let end = after
            .char_indices()
            .find(|&(_, c)| match c {
                '(' => {
                    depth += 1;
                    false
                }
                ')' if depth == 0 => true,
                ')' => {
                    depth -= 1;
                    false
                }
                _ => false,
            })
            .map(|(i, _)| i);
        let Some(end) = end else { break };
        // `(target "title")`: the target is the first word.
        let target = after[..end].split_whitespace().next().unwrap_or("");
        out.push(target.trim_matches(['<', '>']).to_string());
        rest = &after[end..];
    }
    let trimmed = line.trim_start();
    if let Some(close) = trimmed.strip_prefix('[').and_then(|r| r.find("]: ")) {
        let target = trimmed[close + 4..].split_whitespace().next().unwrap_or("");
        out.push(target.to_string());
    }
    out
}

fn is_external(target: &str) -> bool {
    ["http://", "https://", "mailto:", "ftp://"]
        .iter()
        .any(|s| target.starts_with(s))
}

/// Every relative link in README.md and docs/*.md reaches a file or folder, and its
/// `#anchor` a heading of the Markdown file it names.
#[test]
fn every_relative_link_in_the_documentation_resolves() {
    let root = repo();
    let mut links = 0;
    let mut broken = Vec::new();
    for (path, text) in documents() {
        let dir = path.parent().unwrap();
        let shown = path.strip_prefix(&root).unwrap().display().to_string();
        for (n, line) in prose(&text) {
            for target in link_targets(line) {
                if target.is_empty() || is_external(&target) {
                    continue;
                }
                links += 1;
                let (file, fragment) = match target.split_once('#') {
                    Some((file, fragment)) => (file, Some(fragment)),
                    None => (target.as_str(), None),
                };
                let linked = if file.is_empty() {
                    path.clone()
                } else {
                    dir.join(file)
                };
                if !linked.exists() {
                    broken.push(format!("{shown}:{n}: `{target}`: no such file"));
                    continue;
                }
                let inside = linked.canonicalize().is_ok_and(|p| p.starts_with(&root));
                if !inside {
                    broken.push(format!("{shown}:{n}: `{target}`: outside the repository"));
                    continue;
                }
                let Some(fragment) = fragment else { continue };
                if linked.extension().is_none_or(|e| e != "md") {
                    broken.push(format!(
                        "{shown}:{n}: `{target}`: an anchor into a non-Markdown file"
                    ));
                    continue;
                }
                let headings = anchors(&std::fs::read_to_string(&linked).unwrap());
                if !headings.contains(fragment) {
                    broken.push(format!(
                        "{shown}:{n}: `{target}`: no heading with that anchor (there: {})",
                        headings.into_iter().collect::<Vec<_>>().join(", ")
                    ));
                }
            }
        }
    }
    assert!(
        links >= 20,
        "only {links} relative links found: is the parser broken?"
    );
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

/// README is the entry point, not the reference: it stays short.
#[test]
fn readme_stays_an_entry_point() {
    let readme = std::fs::read_to_string(repo().join("README.md")).unwrap();
    let lines = readme.lines().count();
    assert!(
        lines <= 400,
        "README.md has {lines} lines: at most 400 (reference text belongs in docs/)"
    );
}

/// README's code map has a row per workspace crate, and every file it says to start
/// reading exists in that crate.
#[test]
fn the_code_map_names_every_crate_and_files_that_exist() {
    let root = repo();
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let map = &readme[readme.find("## Code map").expect("README has a code map")..];
    let map = &map[..map[3..].find("\n## ").map_or(map.len(), |i| i + 3)];
    let mut crates = BTreeSet::new();
    let mut problems = Vec::new();
    for row in map.lines().filter(|l| l.starts_with("| [`")) {
        let cells: Vec<&str> = row.split(" | ").collect();
        let dir = cells[0]
            .split('`')
            .nth(1)
            .unwrap()
            .trim_end_matches('/')
            .to_string();
        let start = cells.last().unwrap().trim_end_matches(" |");
        for file in start.split('`').skip(1).step_by(2) {
            // `scenarios/*.toml`: the folder must exist and hold such a file.
            let exists = match file.rsplit_once("/*") {
                Some((folder, ext)) => std::fs::read_dir(root.join(&dir).join(folder))
                    .map(|mut d| d.any(|e| e.unwrap().file_name().to_string_lossy().ends_with(ext)))
                    .unwrap_or(false),
                None => root.join(&dir).join(file).is_file(),
            };
            if !exists {
                problems.push(format!("{dir}/{file}"));
            }
        }
        crates.insert(dir);
    }
    let manifest = std::fs::read_to_string(root.join("Cargo.toml")).unwrap();
    let manifest: toml::Value = toml::from_str(&manifest).unwrap();
    let members: BTreeSet<String> = manifest["workspace"]["members"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m.as_str().unwrap().to_string())
        .collect();
    let unmapped: Vec<_> = members.difference(&crates).collect();
    assert!(
        unmapped.is_empty(),
        "workspace crates without a row in README's code map: {unmapped:?}"
    );
    assert!(
        problems.is_empty(),
        "README's code map names files that do not exist (a file moved or split: name \
         where to start reading now): {problems:?}"
    );
}

/// The key no config struct has.
const PROBE: &str = "zz_docs_probe_key";

/// One step into a config document: a key, and whether its value is an array of tables.
#[derive(Clone)]
struct Step {
    key: String,
    array: bool,
}

fn dotted(path: &[Step]) -> String {
    path.iter()
        .map(|s| {
            if s.array {
                format!("{}[]", s.key)
            } else {
                s.key.clone()
            }
        })
        .collect::<Vec<_>>()
        .join(".")
}

/// The keys of the struct at `path` of config type `T`, as its unknown-key error lists
/// them; `None` when the value there is not a struct that refuses unknown keys.
fn keys_at<T: DeserializeOwned>(path: &[Step]) -> Option<Vec<String>> {
    let mut value = toml::Value::Table(toml::map::Map::from_iter([(
        PROBE.to_string(),
        toml::Value::Integer(0),
    )]));
    for step in path.iter().rev() {
        if step.array {
            value = toml::Value::Array(vec![value]);
        }
        value = toml::Value::Table(toml::map::Map::from_iter([(step.key.clone(), value)]));
    }
    let message = match value.try_into::<T>() {
        Ok(_) => return None,
        Err(e) => e.to_string(),
    };
    let at = message.find(&format!("unknown field `{PROBE}`"))?;
    let listed = message[at..].lines().next().unwrap_or("");
    let listed = &listed[format!("unknown field `{PROBE}`").len()..];
    Some(
        listed
            .split('`')
            .skip(1)
            .step_by(2)
            .map(str::to_string)
            .collect(),
    )
}

/// Every key of config type `T` below `path`, as dotted paths, sections included.
fn walk<T: DeserializeOwned>(path: &mut Vec<Step>, out: &mut BTreeSet<String>) {
    let Some(keys) = keys_at::<T>(path) else {
        return;
    };
    for key in keys {
        for array in [false, true] {
            path.push(Step {
                key: key.clone(),
                array,
            });
            let nested = keys_at::<T>(path).is_some();
            if nested {
                walk::<T>(path, out);
            }
            path.pop();
            if nested {
                break;
            }
        }
        path.push(Step { key, array: false });
        out.insert(dotted(path));
        path.pop();
    }
}

fn config_keys<T: DeserializeOwned>() -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    walk::<T>(&mut Vec::new(), &mut out);
    out
}

/// Every config key the three binaries accept is named in docs/configuration.md, in a
/// code span (`` `key` ``, `` `[section] key` ``, `` `section.key` ``).
#[test]
fn every_config_key_is_documented() {
    let binaries = [
        ("relay-agent", config_keys::<relay_agent::Config>()),
        (
            "relay-tunnel-server",
            config_keys::<relay_tunnel_server::Config>(),
        ),
        (
            "relay-dispatcher",
            config_keys::<relay_dispatcher::Config>(),
        ),
    ];
    // The walk works: each binary's top level, nested sections and arrays of tables are seen.
    for (binary, want) in [
        ("relay-agent", "coverage.reserve"),
        ("relay-agent", "allow[].utf8_paths"),
        ("relay-agent", "tls.ca"),
        ("relay-agent", "tunnel_h2.max_concurrent_streams"),
        ("relay-tunnel-server", "agent_limits.auth_timeout"),
        ("relay-tunnel-server", "forward_tls.client_names"),
        (
            "relay-dispatcher",
            "callers[].max_concurrent_calls_per_tunnel",
        ),
        ("relay-dispatcher", "registry.redis_tls.ca"),
        ("relay-dispatcher", "routing.load_high_water"),
        ("relay-dispatcher", "front_limits.proxy_protocol"),
    ] {
        let keys = &binaries.iter().find(|(b, _)| *b == binary).unwrap().1;
        assert!(
            keys.contains(want),
            "the key walk missed {binary}'s `{want}`; it found: {keys:?}"
        );
    }

    let doc = std::fs::read_to_string(repo().join("docs/configuration.md")).unwrap();
    let named: BTreeSet<String> = code_spans(&doc)
        .iter()
        .flat_map(|span| {
            span.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .filter(|w| !w.is_empty())
                .map(str::to_string)
                .collect::<Vec<_>>()
        })
        .collect();
    let mut missing = Vec::new();
    for (binary, keys) in &binaries {
        for key in keys {
            let name = key.rsplit('.').next().unwrap().trim_end_matches("[]");
            if !named.contains(name) {
                missing.push(format!("{binary}: `{key}`"));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "config keys docs/configuration.md does not name (add each to its binary's table, \
         with its default and meaning):\n{}",
        missing.join("\n")
    );
}

#[test]
fn anchors_follow_githubs_rules() {
    assert_eq!(
        anchor("Load balancer settings (agents -> tunnel servers)"),
        "load-balancer-settings-agents---tunnel-servers"
    );
    assert_eq!(
        anchor("Support archive: relay-* diag"),
        "support-archive-relay--diag"
    );
    assert_eq!(anchor("HTTP/2 limits"), "http2-limits");
    assert_eq!(
        anchor("`worker_threads` and_more"),
        "worker_threads-and_more"
    );
    let text = "# A\n## Twice\n```\n# not a heading\n```\n### Twice\n";
    assert_eq!(
        anchors(text),
        BTreeSet::from(["a".into(), "twice".into(), "twice-1".into()])
    );
    assert_eq!(
        link_targets("see [x](a.md#b) and ![i](p.png \"t\") but not `[c](d)`"),
        vec!["a.md#b", "p.png"]
    );
}
