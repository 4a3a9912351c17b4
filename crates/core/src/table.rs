//! Plain-text tables for terminal output: the one look of every table the `lastcall` and
//! `lastcall-bench` binaries print (columns padded to their widest cell, a dashed rule).

/// Render rows under a header, columns padded to their widest cell.
pub fn render(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for r in rows {
        for (i, c) in r.iter().enumerate() {
            if i < widths.len() {
                widths[i] = widths[i].max(c.chars().count());
            }
        }
    }
    let line = |cells: Vec<String>| {
        cells
            .iter()
            .enumerate()
            .map(|(i, c)| format!("{c:<w$}", w = widths[i]))
            .collect::<Vec<_>>()
            .join("  ")
            .trim_end()
            .to_owned()
    };
    let mut out = line(header.iter().map(|s| s.to_string()).collect());
    out.push('\n');
    out.push_str(&line(widths.iter().map(|w| "-".repeat(*w)).collect()));
    out.push('\n');
    for r in rows {
        out.push_str(&line(r.clone()));
        out.push('\n');
    }
    out
}

/// Shorten text to `max` characters for a table cell, on one line.
pub fn clip(s: &str, max: usize) -> String {
    let one_line: String = s.split_whitespace().collect::<Vec<_>>().join(" ");
    if one_line.chars().count() <= max {
        one_line
    } else {
        let mut t: String = one_line.chars().take(max.saturating_sub(1)).collect();
        t.push('…');
        t
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn pads_and_clips() {
        let t = super::render(&["a", "bb"], &[vec!["xxx".into(), "y".into()]]);
        assert_eq!(t, "a    bb\n---  --\nxxx  y\n");
        assert_eq!(super::clip("hello\n world", 5), "hell…");
    }
}
