//! The status pages' HTML: one layout (inline CSS, no external assets), tables, and the
//! escaping every peer-supplied string goes through.
//!
//! Text enters a page only as [`Html`]: [`text`] escapes a string, and the few pieces of
//! markup are written here. A page function (one per binary) builds its sections from the
//! same document its JSON endpoint serves; this module knows nothing about tunnels.
//!
//! Without JavaScript a page is static and complete. With it, a small inline script
//! fetches the page again every few seconds and swaps in its `<main>`, so the browser
//! renders nothing the server did not (no client-side templates, no second truth).

use crate::admin::AdminResponse;
use bytes::Bytes;
use http::{Response, StatusCode};
use http_body_util::Full;
use std::fmt::Write;

/// Markup that is safe to put in a page: built by this module or escaped by [`text`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Html(String);

impl Html {
    /// Markup written in this source (never a string from elsewhere).
    pub fn raw(markup: &'static str) -> Self {
        Html(markup.to_string())
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Appends `other`.
    pub fn push(&mut self, other: Html) {
        self.0.push_str(&other.0);
    }

    /// `inner` wrapped in `<tag class="class">`; `tag` and `class` are this source's.
    pub fn wrap(tag: &'static str, class: &'static str, inner: Html) -> Self {
        let mut s = String::with_capacity(inner.0.len() + 32);
        if class.is_empty() {
            let _ = write!(s, "<{tag}>");
        } else {
            let _ = write!(s, "<{tag} class=\"{class}\">");
        }
        s.push_str(&inner.0);
        let _ = write!(s, "</{tag}>");
        Html(s)
    }
}

impl FromIterator<Html> for Html {
    fn from_iter<I: IntoIterator<Item = Html>>(iter: I) -> Self {
        let mut out = Html::default();
        for h in iter {
            out.push(h);
        }
        out
    }
}

/// Escapes `s` for HTML text and quoted attribute values: `& < > " '`.
pub fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// `s` as page text, escaped.
pub fn text(s: impl std::fmt::Display) -> Html {
    Html(escape(&s.to_string()))
}

/// A heading and a paragraph-less block of content.
pub fn section(title: &str, content: Html) -> Html {
    let mut s = Html::wrap("h2", "", text(title));
    s.push(content);
    Html::wrap("section", "", s)
}

/// A paragraph of text; `class` picks its colour (`ok`, `bad`, `warn` or none).
pub fn para(class: &'static str, content: Html) -> Html {
    Html::wrap("p", class, content)
}

/// A table with `id` (for tests and links), a header row and body rows of cells. An
/// empty table shows `empty` instead.
pub fn table(id: &'static str, head: &[&str], rows: Vec<Vec<Html>>, empty: &str) -> Html {
    if rows.is_empty() {
        return para("muted", text(empty));
    }
    let mut s = String::new();
    let _ = write!(s, "<table id=\"{id}\"><thead><tr>");
    for h in head {
        let _ = write!(s, "<th>{}</th>", escape(h));
    }
    s.push_str("</tr></thead><tbody>");
    for row in rows {
        s.push_str("<tr>");
        for cell in row {
            s.push_str("<td>");
            s.push_str(&cell.0);
            s.push_str("</td>");
        }
        s.push_str("</tr>");
    }
    s.push_str("</tbody></table>");
    Html(s)
}

/// A word with a colour class: `good` green, `bad` red, else amber.
pub fn badge(word: &str, good: bool, bad: bool) -> Html {
    let class = if good {
        "ok"
    } else if bad {
        "bad"
    } else {
        "warn"
    };
    Html(format!("<span class=\"{class}\">{}</span>", escape(word)))
}

/// Seconds between refreshes by the page's script.
pub const REFRESH_SECONDS: u32 = 5;

const STYLE: &str = "body{font:14px/1.4 system-ui,sans-serif;margin:0;color:#1c1e21;background:#f5f6f8}\
header{background:#24292f;color:#fff;padding:10px 20px}header h1{font-size:18px;margin:0}\
header p{margin:2px 0 0;color:#c9d1d9;font-size:12px}main{padding:8px 20px 20px}\
section{background:#fff;border:1px solid #d8dee4;border-radius:6px;padding:8px 14px;margin:12px 0}\
h2{font-size:15px;margin:4px 0 8px}table{border-collapse:collapse;width:100%}\
th,td{text-align:left;padding:4px 8px;border-bottom:1px solid #eaeef2;vertical-align:top;overflow-wrap:break-word}\
th{font-weight:600;color:#57606a;font-size:12px;white-space:nowrap}\
.ok{color:#1a7f37;font-weight:600}.bad{color:#cf222e;font-weight:600}.warn{color:#9a6700;font-weight:600}\
.muted{color:#6e7781}ul{margin:4px 0;padding-left:20px}code{font-size:13px}";

/// The page's refresh: fetch the page again, swap in its `<main>`; on any failure keep
/// what is shown and say so in the header.
const SCRIPT: &str = "(function(){var s=document.getElementById('refresh');\
function tick(){fetch(location.href,{cache:'no-store'}).then(function(r){\
if(!r.ok){throw new Error('HTTP '+r.status);}return r.text();}).then(function(t){\
var d=new DOMParser().parseFromString(t,'text/html');var m=d.querySelector('main');\
if(m){document.querySelector('main').replaceWith(m);}\
s.textContent='refreshed '+new Date().toLocaleTimeString();}).catch(function(e){\
s.textContent='refresh failed ('+e.message+'); showing the last answer';});}\
s.textContent='refreshing every REFRESH s';setInterval(tick,REFRESH*1000);})();";

/// A whole page: `title` in the header with `subtitle` under it, then `main`.
pub fn page(title: &str, subtitle: &str, main: Html) -> String {
    let script = SCRIPT.replace("REFRESH", &REFRESH_SECONDS.to_string());
    format!(
        "<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">\
         <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\
         <title>{title}</title><style>{STYLE}</style></head><body>\
         <header><h1>{title}</h1><p>{subtitle} <span id=\"refresh\">static page: reload to refresh</span></p></header>\
         <main>{main}</main><script>{script}</script></body></html>",
        title = escape(title),
        subtitle = escape(subtitle),
        main = main.0,
    )
}

/// A page as an admin answer (200: the page itself says what is wrong).
pub fn response(page: String) -> AdminResponse {
    Response::builder()
        .status(StatusCode::OK)
        .header("content-type", "text/html; charset=utf-8")
        .header("cache-control", "no-store")
        .body(Full::new(Bytes::from(page)))
        .expect("static response")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escape_turns_every_markup_character_into_an_entity() {
        assert_eq!(
            escape(r#"<img src=x onerror="alert('1')">&"#),
            "&lt;img src=x onerror=&quot;alert(&#39;1&#39;)&quot;&gt;&amp;"
        );
        assert_eq!(escape("ts-1"), "ts-1");
        assert_eq!(escape(""), "");
        // Already escaped text is escaped again, not passed through.
        assert_eq!(escape("&lt;"), "&amp;lt;");
        assert_eq!(escape("zoné-1 ✓"), "zoné-1 ✓");
    }

    #[test]
    fn text_and_tables_escape_what_they_are_given() {
        let hostile = "<script>alert(1)</script>";
        let t = table(
            "t",
            &["<th>"],
            vec![vec![text(hostile), text("ok")]],
            "none",
        );
        assert!(!t.as_str().contains("<script>"), "{}", t.as_str());
        assert!(t.as_str().contains("&lt;script&gt;alert(1)&lt;/script&gt;"));
        assert!(t.as_str().contains("<th>&lt;th&gt;</th>"));
        let p = page(hostile, hostile, section(hostile, para("", text(hostile))));
        // The only script element is the page's own.
        assert_eq!(p.matches("<script>").count(), 1, "{p}");
        assert!(!p.contains("alert(1)</script>"));
    }

    #[test]
    fn an_empty_table_says_so() {
        let t = table("t", &["a"], vec![], "no <rows>");
        assert_eq!(t.as_str(), "<p class=\"muted\">no &lt;rows&gt;</p>");
    }

    #[test]
    fn a_page_is_self_contained() {
        let p = page("relay", "sub", Html::raw("<p>x</p>"));
        for external in ["src=", "href=", "@import", "url("] {
            assert!(!p.contains(external), "{external} in {p}");
        }
        assert!(!p.contains("http-equiv"), "no meta refresh");
        assert!(p.contains("<main><p>x</p></main>"));
    }
}
