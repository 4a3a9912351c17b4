//! The goodput line chart, drawn with `plotters` on its SVG backend only: text goes out as
//! SVG `<text>` elements (the viewer picks the font), so no font file is read and no
//! font crate is built.

use anyhow::{Result, anyhow};
use plotters::element::DashedPathElement;
use plotters::prelude::*;

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

const COLORS: [RGBColor; 6] = [
    RGBColor(0x1b, 0x78, 0x37),
    RGBColor(0xd9, 0x5f, 0x02),
    RGBColor(0x75, 0x70, 0xb3),
    RGBColor(0xe7, 0x29, 0x8a),
    RGBColor(0x66, 0xa6, 0x1e),
    RGBColor(0x44, 0x44, 0x44),
];

/// Render `c` as a standalone SVG document, 900 × 480, the legend in the upper right.
pub fn line_chart(c: &Chart) -> Result<String> {
    let n = c
        .series
        .iter()
        .map(|(_, v)| v.len())
        .max()
        .unwrap_or(0)
        .max(2);
    let x_max = (n - 1) as f64;
    let y_max_data = c
        .series
        .iter()
        .flat_map(|(_, v)| v.iter().copied())
        .chain(c.reference.as_ref().map(|r| r.1))
        .fold(1.0_f64, f64::max);
    let y_max = nice_ceiling(y_max_data * 1.1);
    let mut out = String::new();
    // plotters' errors borrow nothing but are generic over the backend's error: one line.
    let fail = |e: &dyn std::fmt::Display| anyhow!("drawing the chart: {e}");
    {
        let root = SVGBackend::with_string(&mut out, (900, 480)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| fail(&e))?;
        let mut chart = ChartBuilder::on(&root)
            .caption(&c.title, ("sans-serif", 15))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(56)
            .build_cartesian_2d(0.0..x_max, 0.0..y_max)
            .map_err(|e| fail(&e))?;
        chart
            .configure_mesh()
            .x_desc(&c.x_label)
            .y_desc(&c.y_label)
            .x_labels(n.min(11))
            .y_labels(6)
            .x_label_formatter(&|x| trim(*x))
            .y_label_formatter(&|y| trim(*y))
            .light_line_style(WHITE)
            .draw()
            .map_err(|e| fail(&e))?;
        if let Some((label, v)) = &c.reference {
            chart
                .draw_series(DashedLineSeries::new(
                    [(0.0, *v), (x_max, *v)],
                    6,
                    4,
                    BLACK.stroke_width(1),
                ))
                .map_err(|e| fail(&e))?
                .label(format!("{label} ({})", trim(*v)))
                .legend(|(x, y)| {
                    DashedPathElement::new([(x, y), (x + 20, y)], 6, 4, BLACK.stroke_width(1))
                });
        }
        for (k, (label, values)) in c.series.iter().enumerate() {
            let color = COLORS[k % COLORS.len()];
            chart
                .draw_series(LineSeries::new(
                    values.iter().enumerate().map(|(i, v)| (i as f64, *v)),
                    color.stroke_width(2),
                ))
                .map_err(|e| fail(&e))?
                .label(label)
                .legend(move |(x, y)| {
                    PathElement::new([(x, y), (x + 20, y)], color.stroke_width(2))
                });
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()
            .map_err(|e| fail(&e))?;
        root.present().map_err(|e| fail(&e))?;
    }
    Ok(out)
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
    fn every_series_and_the_reference_are_in_the_legend() {
        let doc = line_chart(&Chart {
            title: "a < b".into(),
            x_label: "seconds".into(),
            y_label: "jobs / s".into(),
            series: vec![
                ("one at 5×".into(), vec![1.0, 3.0, 2.0]),
                ("two".into(), vec![0.0, 1.0]),
            ],
            reference: Some(("cap".into(), 2.5)),
        })
        .unwrap();
        assert!(doc.starts_with("<svg"), "{doc}");
        assert!(doc.trim_end().ends_with("</svg>"), "{doc}");
        // Each label is a text element of its own, escaped.
        let texts = texts(&doc);
        for text in [
            "a &lt; b",
            "one at 5×",
            "two",
            "cap (2.5)",
            "seconds",
            "jobs / s",
        ] {
            assert!(texts.contains(&text), "`{text}` missing: {texts:?}");
        }
        // The two series' lines, in their colours.
        assert!(doc.contains("stroke=\"#1B7837\""), "{doc}");
        assert!(doc.contains("stroke=\"#D95F02\""), "{doc}");
        assert_eq!(nice_ceiling(22.0), 50.0);
        assert_eq!(nice_ceiling(20.0), 20.0);
    }

    /// The contents of the document's `<text>` elements, trimmed.
    fn texts(doc: &str) -> Vec<&str> {
        doc.split("<text")
            .skip(1)
            .filter_map(|t| Some(t.split_once('>')?.1.split_once("</text>")?.0.trim()))
            .collect()
    }
}
