//! The shape of the code, checked: within each crate, the top-level modules import each
//! other without a cycle (`a` uses `crate::b` and `b` uses `crate::a` somewhere below
//! them), so each module can be read and tested with what it depends on alone. Test code
//! (`tests.rs`, `*_tests.rs` files and what follows `#[cfg(test)]`) and comments do not
//! count.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

const CRATES: [&str; 6] = [
    "agent",
    "dispatcher",
    "tunnel-server",
    "common",
    "proto",
    "tests",
];

/// Every `.rs` file below `dir`.
fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The production text of a source file: up to its first `#[cfg(test)]`, without comments.
fn production_text(src: &str) -> String {
    let end = src.find("#[cfg(test)]").unwrap_or(src.len());
    src[..end]
        .lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The top-level modules a text names as `crate::<module>`.
fn crate_refs(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut rest = text;
    while let Some(i) = rest.find("crate::") {
        let after = &rest[i + "crate::".len()..];
        let name: String = after
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        // `crate::{a, b}` names several: the braces' first level is enough for `use`.
        if name.is_empty() && after.starts_with('{') {
            let inner = &after[1..after.find('}').unwrap_or(after.len())];
            for part in inner.split(',') {
                let m: String = part
                    .trim()
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                if !m.is_empty() {
                    out.insert(m);
                }
            }
        } else if !name.is_empty() {
            out.insert(name);
        }
        rest = after;
    }
    out
}

/// Module -> the other top-level modules it uses, for the crate rooted at `src`.
fn module_graph(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for file in files {
        let rel = file.strip_prefix(src).unwrap();
        let name = rel.file_name().unwrap().to_string_lossy();
        if name == "tests.rs" || name.ends_with("_tests.rs") || rel.starts_with("bin") {
            continue;
        }
        let top = rel
            .components()
            .next()
            .unwrap()
            .as_os_str()
            .to_string_lossy()
            .trim_end_matches(".rs")
            .to_string();
        if top == "lib" || top == "main" {
            continue;
        }
        let text = production_text(&std::fs::read_to_string(&file).unwrap());
        let refs = crate_refs(&text);
        graph
            .entry(top.clone())
            .or_default()
            .extend(refs.into_iter().filter(|m| *m != top));
    }
    graph
}

/// A cycle in `graph`, if there is one (depth-first search, white/grey/black).
fn find_cycle(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        node: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        done: &mut BTreeSet<String>,
        path: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        if let Some(i) = path.iter().position(|n| n == node) {
            let mut cycle = path[i..].to_vec();
            cycle.push(node.to_string());
            return Some(cycle);
        }
        if done.contains(node) {
            return None;
        }
        path.push(node.to_string());
        for next in graph.get(node).into_iter().flatten() {
            if graph.contains_key(next) {
                if let Some(c) = visit(next, graph, done, path) {
                    return Some(c);
                }
            }
        }
        path.pop();
        done.insert(node.to_string());
        None
    }
    let mut done = BTreeSet::new();
    graph
        .keys()
        .find_map(|n| visit(n, graph, &mut done, &mut Vec::new()))
}

#[test]
fn the_modules_of_each_crate_import_each_other_without_a_cycle() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    for krate in CRATES {
        let graph = module_graph(&root.join(krate).join("src"));
        assert!(
            graph.len() > 1 || krate == "proto",
            "{krate}: no modules found"
        );
        if let Some(cycle) = find_cycle(&graph) {
            panic!(
                "{krate}: modules import each other in a cycle: {}",
                cycle.join(" -> ")
            );
        }
    }
}

#[test]
fn a_cycle_is_found_and_named() {
    let graph: BTreeMap<String, BTreeSet<String>> = [
        ("hub", vec!["metrics", "stream"]),
        ("stream", vec!["hub"]),
        ("metrics", vec![]),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.into_iter().map(String::from).collect()))
    .collect();
    assert_eq!(
        find_cycle(&graph),
        Some(vec!["hub".into(), "stream".into(), "hub".into()])
    );
    let text = production_text(
        "use crate::{hub::Hub, metrics};\n// crate::stream in a comment\nfn f() { crate::tokens::x() }\n#[cfg(test)]\nuse crate::stream;",
    );
    assert_eq!(
        crate_refs(&text),
        ["hub", "metrics", "tokens"].map(String::from).into()
    );
}
