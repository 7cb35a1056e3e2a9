//! A hand-rolled SVG line chart: throughput against block size (log scale),
//! one line per backend.

use crate::units::fmt_size;
use std::fmt::Write as _;

/// One line of the chart.
pub struct Series {
    /// Legend label.
    pub label: String,
    /// `(block size in bytes, GB/s)`, any order.
    pub points: Vec<(usize, f64)>,
}

const COLORS: [&str; 6] = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b"];

fn esc(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

/// Renders the chart as a standalone SVG document.
pub fn svg(title: &str, series: &[Series]) -> String {
    let (w, h) = (720.0f64, 420.0f64);
    let (l, r, t, b) = (70.0, 150.0, 40.0, 50.0);
    let pts = series.iter().flat_map(|s| s.points.iter());
    let xs: Vec<f64> = pts.clone().map(|p| (p.0.max(1) as f64).log2()).collect();
    let (x0, x1) =
        (xs.iter().copied().fold(f64::INFINITY, f64::min), xs.iter().copied().fold(f64::NEG_INFINITY, f64::max));
    let (x0, x1) = if x0.is_finite() && x1 > x0 {
        (x0, x1)
    } else if x0.is_finite() {
        (x0 - 1.0, x0 + 1.0)
    } else {
        (0.0, 1.0)
    };
    let ymax = pts.map(|p| p.1).fold(0.0f64, f64::max);
    let ymax = if ymax > 0.0 { nice_ceiling(ymax) } else { 1.0 };
    let px = |x: f64| l + (x - x0) / (x1 - x0) * (w - l - r);
    let py = |y: f64| h - b - y / ymax * (h - t - b);
    let mut o = String::new();
    let _ = writeln!(
        o,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(o, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        o,
        r#"<text x="{}" y="22" text-anchor="middle" font-size="15">{}</text>"#,
        (w - r + l) / 2.0,
        esc(title)
    );
    // Axes and grid.
    for i in 0..=5 {
        let y = ymax * i as f64 / 5.0;
        let _ = writeln!(
            o,
            r##"<line x1="{l}" y1="{0:.1}" x2="{1:.1}" y2="{0:.1}" stroke="#ddd"/><text x="{2}" y="{3:.1}" text-anchor="end">{y:.2}</text>"##,
            py(y),
            w - r,
            l - 6.0,
            py(y) + 4.0
        );
    }
    let mut xt = x0.ceil() as i64;
    // At most ~8 labelled ticks, so the labels never overlap.
    let step = (((x1 - x0) / 8.0).ceil() as i64).max(1);
    while (xt as f64) <= x1 {
        let x = px(xt as f64);
        let label = if (0..63).contains(&xt) { fmt_size(1usize << xt) } else { format!("2^{xt}") };
        let _ = writeln!(
            o,
            r##"<line x1="{x:.1}" y1="{t}" x2="{x:.1}" y2="{0}" stroke="#eee"/><text x="{x:.1}" y="{1}" text-anchor="middle">{label}</text>"##,
            h - b,
            h - b + 18.0
        );
        xt += step;
    }
    let _ = writeln!(
        o,
        r#"<line x1="{l}" y1="{0}" x2="{1}" y2="{0}" stroke="black"/><line x1="{l}" y1="{t}" x2="{l}" y2="{0}" stroke="black"/>"#,
        h - b,
        w - r
    );
    let _ = writeln!(o, r#"<text x="{}" y="{}" text-anchor="middle">block size</text>"#, (w - r + l) / 2.0, h - 10.0);
    let _ = writeln!(
        o,
        r#"<text transform="translate(18 {}) rotate(-90)" text-anchor="middle">GB/s</text>"#,
        (h - b + t) / 2.0
    );
    for (i, s) in series.iter().enumerate() {
        let c = COLORS[i % COLORS.len()];
        let mut p = s.points.clone();
        p.sort_by_key(|q| q.0);
        let path: Vec<String> =
            p.iter().map(|(x, y)| format!("{:.1},{:.1}", px((*x.max(&1) as f64).log2()), py(*y))).collect();
        let _ = writeln!(o, r#"<polyline fill="none" stroke="{c}" stroke-width="2" points="{}"/>"#, path.join(" "));
        for q in &path {
            let (cx, cy) = q.split_once(',').unwrap_or(("0", "0"));
            let _ = writeln!(o, r#"<circle cx="{cx}" cy="{cy}" r="3" fill="{c}"/>"#);
        }
        let ly = t + 10.0 + 18.0 * i as f64;
        let _ = writeln!(
            o,
            r#"<line x1="{0}" y1="{ly}" x2="{1}" y2="{ly}" stroke="{c}" stroke-width="2"/><text x="{2}" y="{3}">{4}</text>"#,
            w - r + 15.0,
            w - r + 35.0,
            w - r + 40.0,
            ly + 4.0,
            esc(&s.label)
        );
    }
    o.push_str("</svg>\n");
    o
}

fn nice_ceiling(v: f64) -> f64 {
    let p = 10f64.powf(v.log10().floor());
    for m in [1.0, 2.0, 2.5, 5.0, 10.0] {
        if v <= m * p {
            return m * p;
        }
    }
    10.0 * p
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_lines_and_labels() {
        let s = svg("t<1>", &[Series { label: "tcp-sim write".into(), points: vec![(4096, 0.5), (1 << 20, 2.0)] }]);
        assert!(s.starts_with("<svg") && s.trim_end().ends_with("</svg>"));
        assert!(s.contains("polyline") && s.contains("tcp-sim write") && s.contains("t&lt;1&gt;"));
        assert!(s.contains("4KiB") && s.contains("1MiB"));
        // Degenerate inputs still render.
        assert!(svg("empty", &[]).contains("</svg>"));
        assert!(svg("one", &[Series { label: "x".into(), points: vec![(4096, 0.0)] }]).contains("circle"));
    }
}
