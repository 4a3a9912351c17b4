//! `lastcall report`: outcome and failure statistics over a time window. The aggregation
//! is `lastcall_core::report::build`; this module reads the ledger and formats.

use crate::cli::{ReportArgs, ReportFormat};
use crate::config::Settings;
use crate::table;
use anyhow::Result;
use lastcall_clock::Clock;
use lastcall_core::headline::Figures;
use lastcall_core::report::{self, Count, Report, ReportRow};
use std::process::ExitCode;

/// Parse a window length like `24h`, `90m`, `3600s`, `500ms` or `7d` into ms.
pub fn parse_window(s: &str) -> Result<i64> {
    crate::cli::duration_ms(s).map_err(|e| anyhow::anyhow!("--since {e}"))
}

pub async fn run(s: &Settings, a: ReportArgs, clock: &dyn Clock) -> Result<ExitCode> {
    let window = parse_window(&a.since)?;
    let until = clock.now_ms();
    let since = until.saturating_sub(window);
    let ledger = super::open_ledger_to_read(&s.store_url).await?;
    let recs = ledger.records_since(since).await?;
    // The headline: the dashboard's own computation (`Ledger::headline`).
    let headline = ledger
        .headline(since, until, a.tenant.as_ref().map(|t| t.as_str()))
        .await?;
    ledger.close().await;
    let rows: Vec<ReportRow> = recs
        .into_iter()
        .filter(|r| a.tenant.as_ref().is_none_or(|t| t.as_str() == r.tenant))
        .map(|r| ReportRow {
            state: r.state,
            kind: r.kind,
            reason: r.reason,
            error: r.error,
            created_at_ms: r.created_at_ms,
            recorded_at_ms: r.recorded_at_ms,
            reconciled_at_ms: r.reconciled_at_ms,
            tenant: r.tenant,
            model_ms: r.model_ms,
            wasted_model_ms: r.wasted_model_ms,
            prompt_tokens: r.prompt_tokens,
            completion_tokens: r.completion_tokens,
        })
        .collect();
    let rep = report::build(&rows, since, until);
    match a.format {
        ReportFormat::Json => {
            let mut v = serde_json::to_value(&rep)?;
            if let Some(o) = v.as_object_mut() {
                o.insert("headline".into(), serde_json::to_value(&headline)?);
            }
            println!("{}", serde_json::to_string_pretty(&v)?)
        }
        ReportFormat::Csv => print!("{}{}", csv(&rep), headline_csv(&headline.total)),
        ReportFormat::Table => print!(
            "{}{}",
            headline_text(&headline.total, &a.since),
            text(&rep, &a.since)
        ),
    }
    Ok(ExitCode::SUCCESS)
}

/// The headline's rows: `headline,<figure>,n` (an empty count when there is none).
pub fn headline_csv(h: &Figures) -> String {
    let opt = |v: Option<String>| v.unwrap_or_default();
    let rows = [
        ("arrivals", Some(h.arrivals.to_string())),
        ("on_time", Some(h.on_time.to_string())),
        ("on_time_pct", h.on_time_pct.map(|p| format!("{p:.1}"))),
        ("refused", Some(h.refused.to_string())),
        ("pending", Some(h.pending.to_string())),
        ("wasted_model_ms", Some(h.wasted_model_ms.to_string())),
        (
            if h.queue_dwell_p99_over {
                "queue_dwell_p99_over_ms"
            } else {
                "queue_dwell_p99_le_ms"
            },
            h.queue_dwell_p99_ms.map(|v| v.to_string()),
        ),
    ];
    rows.iter()
        .map(|(k, v)| format!("headline,{k},{},,,,\n", opt(v.clone())))
        .collect()
}

/// The headline as the table's first lines.
pub fn headline_text(h: &Figures, since: &str) -> String {
    let pct = h.on_time_pct.map_or("-".to_owned(), |p| format!("{p:.1}%"));
    let dwell = match h.queue_dwell_p99_ms {
        None => "-".to_owned(),
        Some(ms) if h.queue_dwell_p99_over => format!("> {ms} ms"),
        Some(ms) => format!("<= {ms} ms"),
    };
    format!(
        "jobs that arrived in the last {since}: {}\n  on time: {} ({pct}); not ended yet: {}\n  \
         refused without a model call: {}\n  model time wasted: {:.1} s\n  \
         p99 queue dwell: {dwell}\n\n",
        h.arrivals,
        h.on_time,
        h.pending,
        h.refused,
        h.wasted_model_ms as f64 / 1000.0
    )
}

fn csv_field(s: &str) -> String {
    if s.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_owned()
    }
}

/// One row per counted key and per latency state; the late outcomes as
/// `late_outcome,total,N` (always) and one `late_outcome,<state>,n` per real state.
pub fn csv(r: &Report) -> String {
    let mut out = String::from("section,key,count,p50_ms,p90_ms,p99_ms,max_ms\n");
    // Per tenant: `tenant,<name>,jobs`, then one `tenant_<field>,<name>,n` per number and
    // one `tenant_not_on_time,<name>/<state>/<reason>,n` per outcome key.
    for t in &r.by_tenant {
        let name = csv_field(&t.tenant);
        for (field, n) in [
            ("tenant", t.jobs),
            ("tenant_on_time", t.on_time),
            ("tenant_refused", t.refused),
            ("tenant_model_ms", t.model_ms),
            ("tenant_wasted_model_ms", t.wasted_model_ms),
            ("tenant_prompt_tokens", t.prompt_tokens),
            ("tenant_completion_tokens", t.completion_tokens),
        ] {
            out.push_str(&format!("{field},{name},{n},,,,\n"));
        }
        for c in &t.not_on_time {
            out.push_str(&format!(
                "tenant_not_on_time,{},{},,,,\n",
                csv_field(&format!("{}/{}", t.tenant, c.key)),
                c.count
            ));
        }
    }
    let sections: [(&str, &[Count]); 5] = [
        ("state", &r.by_state),
        ("kind", &r.by_kind),
        ("reason", &r.by_reason),
        ("error_class", &r.by_error_class),
        ("error", &r.top_errors),
    ];
    for (name, counts) in sections {
        for c in counts {
            out.push_str(&format!("{name},{},{},,,,\n", csv_field(&c.key), c.count));
        }
    }
    out.push_str(&format!("late_outcome,total,{},,,,\n", r.late_outcomes));
    for c in &r.late_by_state {
        out.push_str(&format!(
            "late_outcome,{},{},,,,\n",
            csv_field(&c.key),
            c.count
        ));
    }
    for l in &r.latency {
        out.push_str(&format!(
            "latency,{},{},{},{},{},{}\n",
            csv_field(&l.state),
            l.count,
            l.p50_ms,
            l.p90_ms,
            l.p99_ms,
            l.max_ms
        ));
    }
    out
}

fn counts_table(title: &str, counts: &[Count]) -> String {
    let rows: Vec<Vec<String>> = counts
        .iter()
        .map(|c| vec![table::clip(&c.key, 100), c.count.to_string()])
        .collect();
    format!("{}\n", table::render(&[title, "jobs"], &rows))
}

fn text(r: &Report, since: &str) -> String {
    let mut out = format!("outcomes recorded in the last {since}: {}\n\n", r.total);
    out += &counts_table("state", &r.by_state);
    out += &counts_table("kind", &r.by_kind);
    out += &counts_table("state/reason", &r.by_reason);
    out += &counts_table("error class", &r.by_error_class);
    out += &counts_table("top error messages", &r.top_errors);
    out += &format!(
        "late outcomes (marked `unknown` by reconcile, real outcome recorded later): {}\n",
        r.late_outcomes
    );
    if !r.late_by_state.is_empty() {
        out += &counts_table("late outcome state", &r.late_by_state);
    } else {
        out += "\n";
    }
    let tenants: Vec<Vec<String>> = r
        .by_tenant
        .iter()
        .map(|t| {
            let pct = |n: u64| {
                if t.jobs == 0 {
                    "-".to_owned()
                } else {
                    format!("{:.0}%", 100.0 * n as f64 / t.jobs as f64)
                }
            };
            vec![
                table::clip(&t.tenant, 40),
                t.jobs.to_string(),
                format!("{} ({})", t.on_time, pct(t.on_time)),
                t.refused.to_string(),
                format!("{:.1}", t.model_ms as f64 / 1000.0),
                format!("{:.1}", t.wasted_model_ms as f64 / 1000.0),
                format!("{} / {}", t.prompt_tokens, t.completion_tokens),
                table::clip(
                    &t.not_on_time
                        .iter()
                        .take(3)
                        .map(|c| format!("{} {}", c.key, c.count))
                        .collect::<Vec<_>>()
                        .join(", "),
                    80,
                ),
            ]
        })
        .collect();
    out += "per tenant (refused: never started; model s: wasted = calls that did not complete)\n";
    out += &table::render(
        &[
            "tenant",
            "jobs",
            "on time",
            "refused",
            "model s",
            "wasted s",
            "tokens in / out",
            "top reasons, not on time",
        ],
        &tenants,
    );
    out += "\n";
    let rows: Vec<Vec<String>> = r
        .latency
        .iter()
        .map(|l| {
            vec![
                l.state.clone(),
                l.count.to_string(),
                l.p50_ms.to_string(),
                l.p90_ms.to_string(),
                l.p99_ms.to_string(),
                l.max_ms.to_string(),
            ]
        })
        .collect();
    out += "created → outcome, ms\n";
    out += &table::render(&["state", "jobs", "p50", "p90", "p99", "max"], &rows);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_parse_with_units_and_errors_name_the_flag() {
        assert_eq!(parse_window("24h").unwrap(), 86_400_000);
        assert_eq!(parse_window("90m").unwrap(), 5_400_000);
        assert_eq!(parse_window("3600s").unwrap(), 3_600_000);
        assert_eq!(parse_window("250ms").unwrap(), 250);
        assert_eq!(parse_window("7d").unwrap(), 604_800_000);
        for bad in ["", "h", "10", "10y", "-5m", "99999999999999999999d"] {
            let e = parse_window(bad).unwrap_err().to_string();
            assert!(e.contains("--since"), "{bad}: {e}");
        }
    }

    #[test]
    fn csv_quotes_and_lists_every_section() {
        let rows = vec![ReportRow {
            state: "failed".into(),
            kind: "k".into(),
            reason: Some("sim_400".into()),
            error: Some("bad, \"very\" bad".into()),
            created_at_ms: Some(0),
            recorded_at_ms: Some(10),
            reconciled_at_ms: Some(5),
            tenant: "team-a".into(),
            model_ms: 4,
            wasted_model_ms: 4,
            ..Default::default()
        }];
        let out = csv(&report::build(&rows, 0, 1));
        assert!(out.starts_with("section,key,count,p50_ms"));
        assert!(out.contains("state,failed,1,,,,\n"));
        assert!(out.contains("reason,failed/sim_400,1,,,,\n"));
        assert!(out.contains("error_class,backend_terminal,1,,,,\n"));
        assert!(out.contains("error,\"bad, \"\"very\"\" bad\",1,,,,\n"));
        assert!(out.contains("latency,failed,1,10,10,10,10\n"));
        assert!(out.contains("late_outcome,total,1,,,,\n"), "{out}");
        assert!(out.contains("late_outcome,failed,1,,,,\n"), "{out}");
        assert!(out.contains("tenant,team-a,1,,,,\n"), "{out}");
        assert!(
            out.contains("tenant_wasted_model_ms,team-a,4,,,,\n"),
            "{out}"
        );
        assert!(
            out.contains("tenant_not_on_time,team-a/failed/sim_400,1,,,,\n"),
            "{out}"
        );
        let text = text(&report::build(&rows, 0, 1), "1h");
        assert!(text.contains("real outcome recorded later): 1\n"), "{text}");
        assert!(text.contains("team-a"), "{text}");
        let none = csv(&report::build(&[], 0, 1));
        assert!(none.contains("late_outcome,total,0,,,,\n"), "{none}");
    }
}
