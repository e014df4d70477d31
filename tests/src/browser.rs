//! Headless Chromium for the status page tests: the DOM a browser builds from a page
//! (`--dump-dom`), screenshots, and reading a table's cells back out of that DOM.
//!
//! Chromium is Debian's `chromium` (`scripts/test` installs it). A test that needs it and
//! cannot find it fails saying so; it never skips.

use std::path::{Path, PathBuf};
use std::time::Duration;

/// Longest one Chromium run may take.
const RUN_LIMIT: Duration = Duration::from_secs(60);

/// The Chromium binary: `$RELAY_CHROMIUM`, else `chromium` on `PATH` or in `/usr/bin`.
/// Panics with what to install when there is none.
pub fn chromium() -> PathBuf {
    if let Some(p) = std::env::var_os("RELAY_CHROMIUM") {
        return PathBuf::from(p);
    }
    let on_path = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .unwrap_or_default();
    for dir in on_path
        .iter()
        .map(PathBuf::as_path)
        .chain([Path::new("/usr/bin")])
    {
        let candidate = dir.join("chromium");
        if candidate.is_file() {
            return candidate;
        }
    }
    panic!(
        "the status page tests render pages in headless Chromium and found none: install \
         Debian's `chromium` package (scripts/test does), or set RELAY_CHROMIUM to its path"
    );
}

/// Runs headless Chromium with a fresh profile and `args`, returning its stdout.
async fn run(args: &[String]) -> anyhow::Result<String> {
    let profile = tempfile_dir()?;
    let mut cmd = tokio::process::Command::new(chromium());
    cmd.args([
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
    ])
    .arg(format!("--user-data-dir={}", profile.display()))
    .args(args)
    .stdin(std::process::Stdio::null())
    .stdout(std::process::Stdio::piped())
    .stderr(std::process::Stdio::piped())
    .kill_on_drop(true);
    let out = tokio::time::timeout(RUN_LIMIT, cmd.output()).await;
    let _ = std::fs::remove_dir_all(&profile);
    let out =
        out.map_err(|_| anyhow::anyhow!("chromium did not finish within {RUN_LIMIT:?}"))??;
    if !out.status.success() {
        anyhow::bail!(
            "chromium exited with {}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// A fresh directory for one Chromium profile.
fn tempfile_dir() -> anyhow::Result<PathBuf> {
    let dir = std::env::temp_dir().join(format!(
        "relay-chromium-{}-{}",
        std::process::id(),
        rand::random::<u64>()
    ));
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

/// The DOM Chromium built from `url`, serialized (scripts ran, the page's refresh timer
/// had not fired yet).
pub async fn dump_dom(url: &str) -> anyhow::Result<String> {
    run(&["--dump-dom".to_string(), url.to_string()]).await
}

/// The DOM of `url` after `ms` of the page's own (virtual) time: its timers fire, so a
/// refreshing page has refreshed by then.
pub async fn dump_dom_after(url: &str, ms: u64) -> anyhow::Result<String> {
    run(&[
        format!("--virtual-time-budget={ms}"),
        "--dump-dom".to_string(),
        url.to_string(),
    ])
    .await
}

/// A PNG of `url` at `width` x `height` written to `path`.
pub async fn screenshot(url: &str, path: &Path, width: u32, height: u32) -> anyhow::Result<()> {
    run(&[
        format!("--screenshot={}", path.display()),
        format!("--window-size={width},{height}"),
        "--hide-scrollbars".to_string(),
        url.to_string(),
    ])
    .await?;
    anyhow::ensure!(path.is_file(), "chromium wrote no {}", path.display());
    Ok(())
}

/// The body rows of the `<table id="{id}">` in a serialized DOM, each as its cells' text
/// (tags dropped, entities decoded); `None` when the DOM has no such table.
pub fn table_rows(dom: &str, id: &str) -> Option<Vec<Vec<String>>> {
    let start = dom.find(&format!("<table id=\"{id}\""))?;
    let rest = &dom[start..];
    let end = rest.find("</table>")?;
    let body = &rest[..end];
    let body = &body[body.find("<tbody>")?..];
    Some(
        body.split("<tr>")
            .skip(1)
            .map(|row| {
                row.split("<td")
                    .skip(1)
                    .map(|cell| {
                        let cell = &cell[cell.find('>').map_or(0, |i| i + 1)..];
                        let cell = cell.split("</td>").next().unwrap_or("");
                        decode(&strip_tags(cell))
                    })
                    .collect()
            })
            .collect(),
    )
}

fn strip_tags(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut in_tag = false;
    for c in s.chars() {
        match c {
            '<' => in_tag = true,
            '>' if in_tag => in_tag = false,
            c if !in_tag => out.push(c),
            _ => {}
        }
    }
    out
}

/// Decodes the entities a browser writes when it serializes text.
fn decode(s: &str) -> String {
    s.replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&quot;", "\"")
        .replace("&nbsp;", "\u{a0}")
        .replace("&amp;", "&")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_rows_reads_cells_as_text() {
        let dom = "<p>x</p><table id=\"t\"><thead><tr><th>a</th></tr></thead><tbody>\
                   <tr><td>&lt;img&gt;</td><td><span class=\"ok\">covered</span></td></tr>\
                   <tr><td>b &amp; c</td><td>2</td></tr></tbody></table>";
        assert_eq!(
            table_rows(dom, "t").unwrap(),
            vec![vec!["<img>", "covered"], vec!["b & c", "2"]]
        );
        assert_eq!(table_rows(dom, "other"), None);
    }
}
