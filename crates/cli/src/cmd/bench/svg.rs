//! A small SVG line chart, written by hand: a plotting crate would cost more build time
//! on a 2-core machine than these hundred lines.

use std::fmt::Write;

/// One chart: a line per series over x = 0, 1, 2, …, and an optional dashed reference.
#[derive(Debug, Clone)]
pub struct Chart {
    pub title: String,
    pub x_label: String,
    pub y_label: String,
    pub series: Vec<(String, Vec<f64>)>,
    /// A horizontal reference line (label, y).
    pub reference: Option<(String, f64)>,
}

const COLORS: [&str; 6] = [
    "#1b7837", "#d95f02", "#7570b3", "#e7298a", "#66a61e", "#444444",
];

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// Render `c` as a standalone SVG document.
pub fn line_chart(c: &Chart) -> String {
    let (w, h) = (900.0, 480.0);
    let (left, right, top, bottom) = (70.0, 230.0, 50.0, 60.0);
    let (pw, ph) = (w - left - right, h - top - bottom);
    let n = c
        .series
        .iter()
        .map(|(_, v)| v.len())
        .max()
        .unwrap_or(0)
        .max(2);
    let y_max_data = c
        .series
        .iter()
        .flat_map(|(_, v)| v.iter().copied())
        .chain(c.reference.as_ref().map(|r| r.1))
        .fold(1.0_f64, f64::max);
    let y_max = nice_ceiling(y_max_data * 1.1);
    let x = |i: f64| left + pw * i / (n - 1) as f64;
    let y = |v: f64| top + ph - ph * v / y_max;
    let mut out = String::new();
    let _ = writeln!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(out, r#"<rect width="{w}" height="{h}" fill="white"/>"#);
    let _ = writeln!(
        out,
        r#"<text x="{}" y="24" font-size="14" font-weight="bold">{}</text>"#,
        left,
        esc(&c.title)
    );
    // Grid and y ticks.
    for k in 0..=5 {
        let v = y_max * k as f64 / 5.0;
        let yy = y(v);
        let _ = writeln!(
            out,
            "<line x1=\"{left}\" y1=\"{yy:.1}\" x2=\"{:.1}\" y2=\"{yy:.1}\" stroke=\"#ddd\"/><text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"end\">{}</text>",
            left + pw,
            left - 6.0,
            yy + 4.0,
            trim(v)
        );
    }
    // x ticks: about ten.
    let step = ((n - 1) as f64 / 10.0).ceil().max(1.0) as usize;
    for i in (0..n).step_by(step) {
        let xx = x(i as f64);
        let _ = writeln!(
            out,
            "<line x1=\"{xx:.1}\" y1=\"{:.1}\" x2=\"{xx:.1}\" y2=\"{:.1}\" stroke=\"#999\"/><text x=\"{xx:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{i}</text>",
            top + ph,
            top + ph + 5.0,
            top + ph + 18.0
        );
    }
    let _ = writeln!(
        out,
        "<rect x=\"{left}\" y=\"{top}\" width=\"{pw}\" height=\"{ph}\" fill=\"none\" stroke=\"#333\"/>"
    );
    let _ = writeln!(
        out,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
        left + pw / 2.0,
        h - 15.0,
        esc(&c.x_label)
    );
    let _ = writeln!(
        out,
        r#"<text transform="translate(18 {:.1}) rotate(-90)" text-anchor="middle">{}</text>"#,
        top + ph / 2.0,
        esc(&c.y_label)
    );
    let mut legend_y = top + 10.0;
    let legend_x = left + pw + 15.0;
    if let Some((label, v)) = &c.reference {
        let yy = y(*v);
        let _ = writeln!(
            out,
            "<line x1=\"{left}\" y1=\"{yy:.1}\" x2=\"{:.1}\" y2=\"{yy:.1}\" stroke=\"#000\" stroke-dasharray=\"6 4\"/>",
            left + pw
        );
        let _ = writeln!(
            out,
            "<line x1=\"{legend_x}\" y1=\"{legend_y}\" x2=\"{:.1}\" y2=\"{legend_y}\" stroke=\"#000\" stroke-dasharray=\"6 4\"/><text x=\"{:.1}\" y=\"{:.1}\">{} ({})</text>",
            legend_x + 24.0,
            legend_x + 30.0,
            legend_y + 4.0,
            esc(label),
            trim(*v)
        );
        legend_y += 20.0;
    }
    for (k, (label, values)) in c.series.iter().enumerate() {
        let color = COLORS[k % COLORS.len()];
        let points: Vec<String> = values
            .iter()
            .enumerate()
            .map(|(i, v)| format!("{:.1},{:.1}", x(i as f64), y(*v)))
            .collect();
        let _ = writeln!(
            out,
            "<polyline fill=\"none\" stroke=\"{color}\" stroke-width=\"2\" points=\"{}\"/>",
            points.join(" ")
        );
        let _ = writeln!(
            out,
            "<line x1=\"{legend_x}\" y1=\"{legend_y}\" x2=\"{:.1}\" y2=\"{legend_y}\" stroke=\"{color}\" stroke-width=\"2\"/><text x=\"{:.1}\" y=\"{:.1}\">{}</text>",
            legend_x + 24.0,
            legend_x + 30.0,
            legend_y + 4.0,
            esc(label)
        );
        legend_y += 20.0;
    }
    out.push_str("</svg>\n");
    out
}

/// 1, 2, 5 × 10^k at or above `v`.
fn nice_ceiling(v: f64) -> f64 {
    let p = 10f64.powf(v.max(1e-9).log10().floor());
    for m in [1.0, 2.0, 5.0, 10.0] {
        if m * p >= v {
            return m * p;
        }
    }
    10.0 * p
}

fn trim(v: f64) -> String {
    if (v - v.round()).abs() < 1e-9 {
        format!("{}", v.round() as i64)
    } else {
        format!("{v:.1}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_a_well_formed_document() {
        let doc = line_chart(&Chart {
            title: "a < b".into(),
            x_label: "x".into(),
            y_label: "y".into(),
            series: vec![("one".into(), vec![1.0, 3.0, 2.0])],
            reference: Some(("cap".into(), 2.5)),
        });
        assert!(doc.starts_with("<svg") && doc.ends_with("</svg>\n"));
        assert!(doc.contains("a &lt; b") && doc.contains("<polyline"));
        assert_eq!(nice_ceiling(22.0), 50.0);
        assert_eq!(nice_ceiling(20.0), 20.0);
    }
}
