//! The `--html` report: one self-contained page (no script, no external resource) with
//! the summary and charts drawn as inline SVG: streams per server by state, calls in flight
//! and queued, latency over time, calls per second and errors, and coverage actions as
//! markers on the timeline. Faults are dashed vertical lines on every chart.
//!
//! This module only renders a [`Report`] to a string.

use super::report::{summary, Report};
use std::fmt::Write as _;

const W: f64 = 1200.0;
const PAD_L: f64 = 64.0;
const PAD_R: f64 = 16.0;
const PAD_T: f64 = 34.0;
const PAD_B: f64 = 30.0;

struct Series {
    name: String,
    color: &'static str,
    /// (t, y) points; for an area, the top edge.
    points: Vec<(f64, f64)>,
    /// Bottom edge of a stacked area (None: a line).
    base: Option<Vec<(f64, f64)>>,
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// A "nice" step for about `n` ticks over `0..max`.
fn step(max: f64, n: f64) -> f64 {
    let raw = (max / n).max(1e-9);
    let mag = 10f64.powf(raw.log10().floor());
    let f = raw / mag;
    let nice = if f <= 1.0 {
        1.0
    } else if f <= 2.0 {
        2.0
    } else if f <= 5.0 {
        5.0
    } else {
        10.0
    };
    nice * mag
}

fn fmt_num(v: f64) -> String {
    if v >= 100.0 || v == v.trunc() {
        format!("{v:.0}")
    } else if v >= 1.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

struct Frame {
    h: f64,
    x_max: f64,
    y_max: f64,
}

impl Frame {
    fn x(&self, t: f64) -> f64 {
        PAD_L + (t / self.x_max) * (W - PAD_L - PAD_R)
    }
    fn y(&self, v: f64) -> f64 {
        self.h - PAD_B - (v / self.y_max) * (self.h - PAD_T - PAD_B)
    }
}

fn axes(o: &mut String, f: &Frame, title: &str, unit: &str) {
    let _ = write!(
        o,
        r##"<text x="{PAD_L}" y="18" class="title">{}</text>"##,
        esc(title)
    );
    let ys = step(f.y_max, 4.0);
    let mut v = 0.0;
    while v <= f.y_max + 1e-9 {
        let y = f.y(v);
        let _ = write!(
            o,
            r##"<line x1="{PAD_L}" x2="{}" y1="{y:.1}" y2="{y:.1}" class="grid"/><text x="{}" y="{:.1}" class="tick" text-anchor="end">{}</text>"##,
            W - PAD_R,
            PAD_L - 6.0,
            y + 4.0,
            fmt_num(v)
        );
        v += ys;
    }
    let xs = step(f.x_max, 12.0);
    let mut t = 0.0;
    while t <= f.x_max + 1e-9 {
        let x = f.x(t);
        let _ = write!(
            o,
            r##"<text x="{x:.1}" y="{:.1}" class="tick" text-anchor="middle">{}s</text>"##,
            f.h - PAD_B + 16.0,
            fmt_num(t)
        );
        t += xs;
    }
    let _ = write!(
        o,
        r##"<text x="14" y="{:.1}" class="tick" transform="rotate(-90 14 {:.1})" text-anchor="middle">{}</text>"##,
        f.h / 2.0,
        f.h / 2.0,
        esc(unit)
    );
    let _ = write!(
        o,
        r##"<line x1="{PAD_L}" x2="{PAD_L}" y1="{PAD_T}" y2="{:.1}" class="axis"/><line x1="{PAD_L}" x2="{}" y1="{:.1}" y2="{:.1}" class="axis"/>"##,
        f.h - PAD_B,
        W - PAD_R,
        f.h - PAD_B,
        f.h - PAD_B
    );
}

fn events(o: &mut String, f: &Frame, ev: &[(f64, String)]) {
    for (t, what) in ev {
        let x = f.x(*t);
        let _ = write!(
            o,
            r##"<line x1="{x:.1}" x2="{x:.1}" y1="{PAD_T}" y2="{:.1}" class="event"><title>{:.1} s {}</title></line><text x="{:.1}" y="{:.1}" class="evtext">{}</text>"##,
            f.h - PAD_B,
            t,
            esc(what),
            x + 3.0,
            PAD_T + 10.0,
            esc(what)
        );
    }
}

fn legend(o: &mut String, series: &[(&str, &str)]) {
    let mut x = W - PAD_R;
    for (name, color) in series.iter().rev() {
        let w = 14.0 + 7.0 * name.len() as f64;
        x -= w + 12.0;
        let _ = write!(
            o,
            r##"<rect x="{x:.1}" y="8" width="10" height="10" fill="{color}"/><text x="{:.1}" y="17" class="tick">{}</text>"##,
            x + 14.0,
            esc(name)
        );
    }
}

fn path(f: &Frame, pts: &[(f64, f64)]) -> String {
    let mut d = String::new();
    for (i, (t, v)) in pts.iter().enumerate() {
        let _ = write!(
            d,
            "{}{:.1},{:.1} ",
            if i == 0 { "M" } else { "L" },
            f.x(*t),
            f.y(*v)
        );
    }
    d
}

fn chart(
    title: &str,
    unit: &str,
    h: f64,
    x_max: f64,
    series: &[Series],
    ev: &[(f64, String)],
) -> String {
    let y_top = series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.1))
        .fold(0.0, f64::max);
    let y_max = if y_top <= 0.0 {
        1.0
    } else {
        let s = step(y_top * 1.1, 4.0);
        (y_top * 1.1 / s).ceil() * s
    };
    let f = Frame { h, x_max, y_max };
    let mut o = format!(
        r##"<svg viewBox="0 0 {W} {h}" width="{W}" height="{h}" role="img" aria-label="{}">"##,
        esc(title)
    );
    axes(&mut o, &f, title, unit);
    for s in series {
        match &s.base {
            Some(base) => {
                let mut d = path(&f, &s.points);
                for (t, v) in base.iter().rev() {
                    let _ = write!(d, "L{:.1},{:.1} ", f.x(*t), f.y(*v));
                }
                let _ = write!(
                    o,
                    r##"<path d="{d}Z" fill="{}" fill-opacity="0.85" stroke="none"><title>{}</title></path>"##,
                    s.color,
                    esc(&s.name)
                );
            }
            None => {
                let _ = write!(
                    o,
                    r##"<path d="{}" fill="none" stroke="{}" stroke-width="2"><title>{}</title></path>"##,
                    path(&f, &s.points),
                    s.color,
                    esc(&s.name)
                );
            }
        }
    }
    events(&mut o, &f, ev);
    let names: Vec<(&str, &str)> = series.iter().map(|s| (s.name.as_str(), s.color)).collect();
    legend(&mut o, &names);
    o.push_str("</svg>");
    o
}

const ACTION_COLORS: [(&str, &str); 6] = [
    ("grow", "#d62728"),
    ("fill", "#2ca02c"),
    ("evacuate", "#9467bd"),
    ("recycle", "#8c564b"),
    ("retire", "#7f7f7f"),
    ("return", "#bcbd22"),
];

/// Coverage actions as markers: one row per action kind, a circle per second with
/// actions, its area growing with the count.
fn actions_chart(r: &Report, x_max: f64) -> String {
    let h = 40.0 + 26.0 * ACTION_COLORS.len() as f64 + PAD_B;
    let f = Frame {
        h,
        x_max,
        y_max: 1.0,
    };
    let mut o = format!(
        r##"<svg viewBox="0 0 {W} {h}" width="{W}" height="{h}" role="img" aria-label="coverage actions">"##
    );
    let _ = write!(
        o,
        r##"<text x="{PAD_L}" y="18" class="title">Coverage actions (all agents; circle area ~ streams opened or closed that second)</text>"##
    );
    let max = r
        .timeline
        .iter()
        .flat_map(|p| p.actions.values())
        .copied()
        .max()
        .unwrap_or(1)
        .max(1) as f64;
    for (row, (name, color)) in ACTION_COLORS.iter().enumerate() {
        let y = PAD_T + 14.0 + 26.0 * row as f64;
        let total = r.coverage_actions.get(*name).copied().unwrap_or(0);
        let _ = write!(
            o,
            r##"<line x1="{PAD_L}" x2="{}" y1="{y:.1}" y2="{y:.1}" class="grid"/><text x="{}" y="{:.1}" class="tick">{name} ({total})</text>"##,
            W - PAD_R,
            PAD_L + 4.0,
            y - 6.0
        );
        for p in &r.timeline {
            if let Some(n) = p.actions.get(*name) {
                let rad = 3.0 + 8.0 * (*n as f64 / max).sqrt();
                let _ = write!(
                    o,
                    r##"<circle cx="{:.1}" cy="{y:.1}" r="{rad:.1}" fill="{color}" fill-opacity="0.8"><title>{:.1} s: {name} {n}</title></circle>"##,
                    f.x(p.t),
                    p.t
                );
            }
        }
    }
    let xs = step(x_max, 12.0);
    let mut t = 0.0;
    while t <= x_max + 1e-9 {
        let _ = write!(
            o,
            r##"<text x="{:.1}" y="{:.1}" class="tick" text-anchor="middle">{}s</text>"##,
            f.x(t),
            h - PAD_B + 16.0,
            fmt_num(t)
        );
        t += xs;
    }
    events(&mut o, &f, &r.events);
    o.push_str("</svg>");
    o
}

const SERVER_COLORS: [(&str, &str); 6] = [
    ("#1f77b4", "#aec7e8"),
    ("#ff7f0e", "#ffbb78"),
    ("#2ca02c", "#98df8a"),
    ("#d62728", "#ff9896"),
    ("#9467bd", "#c5b0d5"),
    ("#8c564b", "#c49c94"),
];

/// The whole page.
pub fn render(r: &Report) -> String {
    let x_max = r.timeline.last().map(|p| p.t).unwrap_or(1.0).max(1.0);
    let mut servers: Vec<String> = r
        .timeline
        .iter()
        .flat_map(|p| p.servers.keys().cloned())
        .collect();
    servers.sort();
    servers.dedup();
    let mut body = String::new();

    // Streams per server by state: one small chart per server, busy under idle.
    for (i, sid) in servers.iter().enumerate() {
        let (dark, light) = SERVER_COLORS[i % SERVER_COLORS.len()];
        let get = |p: &super::report::Point| p.servers.get(sid).cloned().unwrap_or_default();
        let busy: Vec<(f64, f64)> = r
            .timeline
            .iter()
            .map(|p| (p.t, get(p).busy as f64))
            .collect();
        let total: Vec<(f64, f64)> = r
            .timeline
            .iter()
            .map(|p| {
                let s = get(p);
                (p.t, (s.busy + s.idle) as f64)
            })
            .collect();
        let zero: Vec<(f64, f64)> = r.timeline.iter().map(|p| (p.t, 0.0)).collect();
        body.push_str(&chart(
            &format!("Streams on {sid} by state"),
            "streams",
            170.0,
            x_max,
            &[
                Series {
                    name: "busy".into(),
                    color: dark,
                    points: busy.clone(),
                    base: Some(zero),
                },
                Series {
                    name: "idle".into(),
                    color: light,
                    points: total,
                    base: Some(busy),
                },
            ],
            &r.events,
        ));
    }

    let mut flow = vec![Series {
        name: "calls in flight (load generator)".into(),
        color: "#1f77b4",
        points: r
            .timeline
            .iter()
            .map(|p| (p.t, p.in_flight as f64))
            .collect(),
        base: None,
    }];
    if r.timeline.iter().any(|p| p.queued.is_some()) {
        flow.push(Series {
            name: "calls queued on tunnel servers".into(),
            color: "#d62728",
            points: r
                .timeline
                .iter()
                .map(|p| (p.t, p.queued.unwrap_or(0.0)))
                .collect(),
            base: None,
        });
    }
    body.push_str(&chart(
        "Calls in flight and queued",
        "calls",
        220.0,
        x_max,
        &flow,
        &r.events,
    ));

    let lat = |f: fn(&super::report::Point) -> Option<f64>| -> Vec<(f64, f64)> {
        r.timeline
            .iter()
            .filter_map(|p| f(p).map(|v| (p.t, v)))
            .collect()
    };
    body.push_str(&chart(
        "Latency of calls started each second",
        "ms",
        220.0,
        x_max,
        &[
            Series {
                name: "p50".into(),
                color: "#2ca02c",
                points: lat(|p| p.latency_p50_ms),
                base: None,
            },
            Series {
                name: "p99".into(),
                color: "#d62728",
                points: lat(|p| p.latency_p99_ms),
                base: None,
            },
        ],
        &r.events,
    ));
    body.push_str(&chart(
        "Calls answered per second and errors",
        "calls/s",
        200.0,
        x_max,
        &[
            Series {
                name: "answered/s".into(),
                color: "#1f77b4",
                points: r.timeline.iter().map(|p| (p.t, p.calls_per_s)).collect(),
                base: None,
            },
            Series {
                name: "errors".into(),
                color: "#d62728",
                points: r.timeline.iter().map(|p| (p.t, p.errors as f64)).collect(),
                base: None,
            },
        ],
        &r.events,
    ));
    body.push_str(&actions_chart(r, x_max));

    format!(
        r##"<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>relay-fleet: {name}</title>
<style>
body {{ font: 14px system-ui, sans-serif; margin: 16px 24px; color: #222; background: #fff; }}
h1 {{ font-size: 20px; margin: 0 0 6px; }}
pre {{ background: #f6f6f6; padding: 10px; font-size: 12px; overflow-x: auto; }}
svg {{ display: block; margin: 10px 0 4px; }}
.title {{ font-size: 13px; font-weight: 600; fill: #222; }}
.tick {{ font-size: 11px; fill: #555; }}
.grid {{ stroke: #e4e4e4; stroke-width: 1; }}
.axis {{ stroke: #888; stroke-width: 1; }}
.event {{ stroke: #444; stroke-width: 1; stroke-dasharray: 4 3; }}
.evtext {{ font-size: 10px; fill: #444; }}
.pass {{ color: #2a7d2a; font-weight: 600; }} .fail {{ color: #b00; font-weight: 600; }}
</style></head><body>
<h1>relay-fleet report: {name}</h1>
<p>{desc} &mdash; result: <span class="{cls}">{result}</span></p>
<pre>{summary}</pre>
{body}
<p>Streams come from the agents' coverage views (summed over agents), queued calls from the
tunnel servers' metrics; dashed lines are faults. Generated by <code>relay-fleet run --html</code>.</p>
</body></html>
"##,
        name = esc(&r.scenario),
        desc = esc(&r.description),
        cls = if r.passed() { "pass" } else { "fail" },
        result = if r.passed() { "PASS" } else { "FAIL" },
        summary = esc(&summary(r)),
    )
}
