//! The replay report: one self-contained HTML file (inline CSS and SVG, no
//! scripts, nothing fetched) with the charts an operator reads first —
//! latency with and without the chain, time inside each filter, cache hit
//! rate over time, the metering sample's estimate against the truth, auth
//! outcomes — then the text summary and the requests.

use std::fmt::Write as _;

use crate::replay::{Replay, percentile};

const WIDTH: f64 = 640.0;
const HEIGHT: f64 = 280.0;
/// Plot area margins: left, right, top, bottom.
const MARGIN: (f64, f64, f64, f64) = (64.0, 16.0, 16.0, 44.0);
const COLORS: [&str; 6] = [
    "#2563eb", "#f97316", "#16a34a", "#9333ea", "#dc2626", "#0891b2",
];
/// Requests listed in the report's table at most.
const TABLE_ROWS: usize = 500;

/// The report for `replay`; `title` heads the page.
pub fn html(replay: &Replay, title: &str) -> String {
    let mut out = String::new();
    let _ = write!(
        out,
        "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
         <title>{t}</title><style>{STYLE}</style></head><body>\n<h1>{t}</h1>\n",
        t = escape(title)
    );
    out.push_str("<div class=\"grid\">\n");
    figure(
        &mut out,
        "latency",
        "Latency, with and without the chain",
        latency_chart(replay),
    );
    figure(
        &mut out,
        "wasm",
        "Time inside each filter per request",
        wasm_chart(replay),
    );
    figure(
        &mut out,
        "cache",
        "Cache hit rate over time",
        cache_chart(replay),
    );
    figure(
        &mut out,
        "metering",
        "Metering: sample estimate vs ground truth",
        metering_chart(replay),
    );
    figure(&mut out, "auth", "Auth outcomes", auth_chart(replay));
    out.push_str("</div>\n<h2>Summary</h2>\n<pre id=\"summary\">");
    out.push_str(&escape(&replay.summary()));
    out.push_str("</pre>\n");
    requests_table(&mut out, replay);
    out.push_str("</body></html>\n");
    out
}

const STYLE: &str = "body{font:14px/1.4 system-ui,sans-serif;margin:24px;color:#111}\
h1{font-size:22px}h2{font-size:17px;margin-top:28px}\
.grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(660px,1fr));gap:16px}\
figure{margin:0;border:1px solid #ddd;border-radius:6px;padding:8px 12px}\
figcaption{font-weight:600;margin-bottom:4px}.empty{color:#777;font-style:italic}\
pre{background:#f6f6f6;padding:12px;overflow-x:auto}\
table{border-collapse:collapse;font-size:12px}td,th{border:1px solid #ddd;padding:2px 6px;text-align:left}\
th{background:#f0f0f0}.legend span{margin-right:14px}\
svg text{font:11px system-ui,sans-serif;fill:#333}";

/// A chart's SVG, or why there is none.
enum Chart {
    Svg(String),
    Empty(&'static str),
}

fn figure(out: &mut String, id: &str, caption: &str, chart: Chart) {
    let _ = write!(
        out,
        "<figure id=\"{id}\"><figcaption>{}</figcaption>",
        escape(caption)
    );
    match chart {
        Chart::Svg(svg) => out.push_str(&svg),
        Chart::Empty(why) => {
            let _ = write!(out, "<p class=\"empty\">{}</p>", escape(why));
        }
    }
    out.push_str("</figure>\n");
}

/// Cumulative distributions of the latency through the chain and without it.
fn latency_chart(replay: &Replay) -> Chart {
    let (chain, baseline) = replay.latencies();
    if chain.is_empty() {
        return Chart::Empty("no request got a response");
    }
    let mut series = vec![("with the chain", cdf(&chain))];
    if !baseline.is_empty() {
        series.push(("without (direct to the upstream)", cdf(&baseline)));
    }
    let x_max = series
        .iter()
        .flat_map(|(_, points)| points.iter().map(|p| p.0))
        .fold(0.0, f64::max);
    Chart::Svg(line_chart(
        &series,
        x_max,
        1.0,
        "latency, ms",
        "fraction of requests ≤",
    ))
}

fn cdf(values: &[f64]) -> Vec<(f64, f64)> {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let n = sorted.len() as f64;
    sorted
        .iter()
        .enumerate()
        .map(|(i, v)| (*v, (i + 1) as f64 / n))
        .collect()
}

/// p50 and p99 of the time inside each filter.
fn wasm_chart(replay: &Replay) -> Chart {
    let times = replay.wasm_times();
    if times.is_empty() {
        return Chart::Empty("no filter times were recorded");
    }
    let groups: Vec<(String, Vec<f64>)> = times
        .iter()
        .map(|(filter, t)| {
            (
                filter.clone(),
                vec![percentile(t, 50.0), percentile(t, 99.0)],
            )
        })
        .collect();
    Chart::Svg(bar_chart(&groups, &["p50", "p99"], "µs per request"))
}

/// Hits over lookups (HIT + MISS) in up to 20 time buckets of the replay.
fn cache_chart(replay: &Replay) -> Chart {
    let lookups: Vec<(f64, bool)> = replay
        .requests
        .iter()
        .filter_map(|r| match r.cache.as_deref() {
            Some("HIT") => Some((r.sent_ms, true)),
            Some("MISS") => Some((r.sent_ms, false)),
            _ => None,
        })
        .collect();
    if lookups.is_empty() {
        return Chart::Empty("no cache lookups (no x-cache: HIT or MISS)");
    }
    let end = lookups.iter().map(|l| l.0).fold(0.0, f64::max).max(1.0);
    // About five lookups a bucket at least, so one request is no swing of 100%.
    let buckets = (lookups.len() / 5).clamp(1, 20);
    let width = end / buckets as f64;
    let mut counts = vec![(0usize, 0usize); buckets];
    for (at, hit) in &lookups {
        let i = ((at / width) as usize).min(buckets - 1);
        counts[i].0 += usize::from(*hit);
        counts[i].1 += 1;
    }
    let points: Vec<(f64, f64)> = counts
        .iter()
        .enumerate()
        .filter(|(_, (_, n))| *n > 0)
        .map(|(i, (hits, n))| ((i as f64 + 0.5) * width / 1000.0, *hits as f64 / *n as f64))
        .collect();
    Chart::Svg(line_chart(
        &[("hit rate", points)],
        end / 1000.0,
        1.0,
        "time into the replay, s",
        "hits / lookups",
    ))
}

/// Per tenant: tokens metered (truth) next to the sample's estimate.
fn metering_chart(replay: &Replay) -> Chart {
    let usage = replay.usage_comparison();
    if usage.is_empty() {
        return Chart::Empty("no usage was metered");
    }
    if replay.sample.is_empty() {
        return Chart::Empty(
            "no sample was captured (replay with --capture on the metering sink's cluster)",
        );
    }
    let groups: Vec<(String, Vec<f64>)> = usage
        .iter()
        .map(|u| {
            (
                u.tenant.clone(),
                vec![u.truth_tokens as f64, u.estimate_tokens],
            )
        })
        .collect();
    Chart::Svg(bar_chart(
        &groups,
        &["truth (every request)", "estimate (sample × weight)"],
        "input + output tokens",
    ))
}

fn auth_chart(replay: &Replay) -> Chart {
    let counts = replay.counts(|r| r.auth.clone());
    let groups: Vec<(String, Vec<f64>)> = counts
        .into_iter()
        .map(|(label, n)| (label, vec![n as f64]))
        .collect();
    if groups.is_empty() {
        return Chart::Empty("no requests");
    }
    Chart::Svg(bar_chart(&groups, &["requests"], "requests"))
}

fn requests_table(out: &mut String, replay: &Replay) {
    out.push_str(
        "<h2>Requests</h2><table id=\"requests\"><tr><th>#</th><th>request id</th>\
         <th>path</th><th>status</th><th>ms</th><th>without</th><th>auth</th><th>cache</th>\
         <th>observers</th><th>tokens in/out</th><th>wasm µs</th></tr>\n",
    );
    for r in replay.requests.iter().take(TABLE_ROWS) {
        let tokens = r
            .usage
            .as_ref()
            .map(|u| format!("{}/{}", u["input_tokens"], u["output_tokens"]))
            .unwrap_or_default();
        let wasm: f64 = r.wasm.iter().map(|w| w.us).sum();
        let _ = writeln!(
            out,
            "<tr><td>{}</td><td>{}</td><td>{} {}</td><td>{}</td><td>{:.2}</td><td>{}</td>\
             <td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{:.1}</td></tr>",
            r.seq,
            escape(&r.request_id),
            escape(&r.method),
            escape(&r.path),
            r.status,
            r.latency_ms,
            r.baseline_ms.map(|b| format!("{b:.2}")).unwrap_or_default(),
            escape(&r.auth),
            escape(r.cache.as_deref().unwrap_or("")),
            escape(&r.decision.as_ref().map(|d| d.join(",")).unwrap_or_default()),
            escape(&tokens),
            wasm
        );
    }
    out.push_str("</table>\n");
    if replay.requests.len() > TABLE_ROWS {
        let _ = writeln!(
            out,
            "<p>{} more in the JSON Lines output.</p>",
            replay.requests.len() - TABLE_ROWS
        );
    }
}

// ---- SVG ----

fn plot_area() -> (f64, f64, f64, f64) {
    let (l, r, t, b) = MARGIN;
    (l, WIDTH - r, t, HEIGHT - b)
}

/// A "nice" axis maximum and tick step covering `max`.
fn nice_scale(max: f64) -> (f64, f64) {
    let max = if max > 0.0 && max.is_finite() {
        max
    } else {
        1.0
    };
    let raw = max / 5.0;
    let magnitude = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 2.5, 5.0, 10.0]
        .iter()
        .map(|m| m * magnitude)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * magnitude);
    ((max / step).ceil() * step, step)
}

fn number(v: f64) -> String {
    if v == 0.0 {
        "0".into()
    } else if v.abs() >= 10.0 {
        format!("{:.0}", v)
    } else if v.abs() >= 1.0 {
        format!("{:.1}", v)
    } else {
        format!("{:.2}", v)
    }
}

fn axes(svg: &mut String, x: Option<(f64, f64)>, y: (f64, f64), x_label: &str, y_label: &str) {
    let (left, right, top, bottom) = plot_area();
    let (y_max, y_step) = y;
    let mut v = 0.0;
    while v <= y_max + y_step / 2.0 {
        let py = bottom - v / y_max * (bottom - top);
        let _ = write!(
            svg,
            "<line x1=\"{left}\" x2=\"{right}\" y1=\"{py:.1}\" y2=\"{py:.1}\" stroke=\"#e5e5e5\"/>\
             <text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"end\">{}</text>",
            left - 6.0,
            py + 4.0,
            number(v)
        );
        v += y_step;
    }
    if let Some((x_max, x_step)) = x {
        let mut v = 0.0;
        while v <= x_max + x_step / 2.0 {
            let px = left + v / x_max * (right - left);
            let _ = write!(
                svg,
                "<text x=\"{px:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{}</text>",
                bottom + 16.0,
                number(v)
            );
            v += x_step;
        }
    }
    let _ = write!(
        svg,
        "<line x1=\"{left}\" x2=\"{right}\" y1=\"{bottom}\" y2=\"{bottom}\" stroke=\"#333\"/>\
         <line x1=\"{left}\" x2=\"{left}\" y1=\"{top}\" y2=\"{bottom}\" stroke=\"#333\"/>\
         <text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{}</text>\
         <text transform=\"translate(14 {:.1}) rotate(-90)\" text-anchor=\"middle\">{}</text>",
        (left + right) / 2.0,
        HEIGHT - 8.0,
        escape(x_label),
        (top + bottom) / 2.0,
        escape(y_label)
    );
}

fn svg_open() -> String {
    format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{WIDTH}\" height=\"{HEIGHT}\" \
         viewBox=\"0 0 {WIDTH} {HEIGHT}\" role=\"img\">"
    )
}

fn legend(names: &[&str]) -> String {
    let mut out = String::from("<div class=\"legend\">");
    for (i, name) in names.iter().enumerate() {
        let _ = write!(
            out,
            "<span><span style=\"color:{}\">■</span> {}</span>",
            COLORS[i % COLORS.len()],
            escape(name)
        );
    }
    out.push_str("</div>");
    out
}

/// Lines through `(x, y)` points, one per series, on linear axes from 0.
fn line_chart(
    series: &[(&str, Vec<(f64, f64)>)],
    x_max: f64,
    y_max: f64,
    x_label: &str,
    y_label: &str,
) -> String {
    let (left, right, top, bottom) = plot_area();
    let x = nice_scale(x_max);
    let y = nice_scale(y_max);
    let mut svg = svg_open();
    axes(&mut svg, Some(x), y, x_label, y_label);
    for (i, (_, points)) in series.iter().enumerate() {
        let coords: Vec<String> = points
            .iter()
            .map(|(px, py)| {
                format!(
                    "{:.1},{:.1}",
                    left + px / x.0 * (right - left),
                    bottom - py / y.0 * (bottom - top)
                )
            })
            .collect();
        let color = COLORS[i % COLORS.len()];
        let _ = write!(
            svg,
            "<polyline class=\"series\" fill=\"none\" stroke=\"{color}\" stroke-width=\"2\" points=\"{}\"/>",
            coords.join(" ")
        );
        if points.len() <= 40 {
            for c in &coords {
                let (cx, cy) = c.split_once(',').unwrap_or(("0", "0"));
                let _ = write!(
                    svg,
                    "<circle cx=\"{cx}\" cy=\"{cy}\" r=\"3\" fill=\"{color}\"/>"
                );
            }
        }
    }
    svg.push_str("</svg>");
    let names: Vec<&str> = series.iter().map(|(n, _)| *n).collect();
    svg + &legend(&names)
}

/// Grouped vertical bars: one group per label, one bar per series.
fn bar_chart(groups: &[(String, Vec<f64>)], series: &[&str], y_label: &str) -> String {
    let (left, right, top, bottom) = plot_area();
    let y_max = groups
        .iter()
        .flat_map(|(_, values)| values.iter().copied())
        .fold(0.0, f64::max);
    let y = nice_scale(y_max);
    let mut svg = svg_open();
    axes(&mut svg, None, y, "", y_label);
    let group_width = (right - left) / groups.len().max(1) as f64;
    let bar_width = (group_width * 0.8) / series.len().max(1) as f64;
    for (g, (label, values)) in groups.iter().enumerate() {
        let x0 = left + g as f64 * group_width + group_width * 0.1;
        for (s, value) in values.iter().enumerate() {
            let h = value / y.0 * (bottom - top);
            let _ = write!(
                svg,
                "<rect class=\"series\" x=\"{:.1}\" y=\"{:.1}\" width=\"{:.1}\" height=\"{:.1}\" fill=\"{}\">\
                 <title>{}: {}</title></rect>",
                x0 + s as f64 * bar_width,
                bottom - h,
                (bar_width - 2.0).max(1.0),
                h,
                COLORS[s % COLORS.len()],
                escape(label),
                number(*value)
            );
        }
        let _ = write!(
            svg,
            "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{}</text>",
            x0 + group_width * 0.4,
            bottom + 16.0,
            escape(label)
        );
    }
    svg.push_str("</svg>");
    svg + &legend(series)
}

/// Escapes text for HTML content and attribute values.
pub fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scales_are_round_and_cover_the_maximum() {
        assert_eq!(nice_scale(1.0), (1.0, 0.2));
        assert_eq!(nice_scale(7.3), (8.0, 2.0));
        assert_eq!(nice_scale(0.0), (1.0, 0.2));
        let (max, step) = nice_scale(1234.0);
        assert!(max >= 1234.0 && step > 0.0 && (max / step).fract() == 0.0);
    }

    #[test]
    fn text_is_escaped() {
        assert_eq!(
            escape("<a href=\"x\">&'"),
            "&lt;a href=&quot;x&quot;&gt;&amp;&#39;"
        );
    }
}
