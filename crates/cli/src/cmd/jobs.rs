//! `lastcall jobs show|list`.

use crate::cli::JobsCommand;
use crate::config::Settings;
use crate::table;
use anyhow::{Result, bail};
use lastcall_core::State;
use lastcall_store::{JobRecord, ListFilter};
use std::process::ExitCode;

pub async fn run(s: &Settings, c: JobsCommand) -> Result<ExitCode> {
    // Whether a SQLite ledger file exists before opening it (opening creates it).
    let new_file = sqlite_path(&s.store_url).is_some_and(|p| !p.exists());
    let ledger = super::open_ledger(&s.store_url).await?;
    match c {
        JobsCommand::Show {
            job_id,
            json,
            attempts,
        } => {
            let Some(rec) = ledger.get(&job_id).await? else {
                bail!(
                    "no job `{job_id}` in the ledger at {}",
                    lastcall_broker::redact(&s.store_url)
                );
            };
            let rows = if attempts {
                ledger.attempts(&job_id).await?
            } else {
                Vec::new()
            };
            if json {
                let mut v = serde_json::to_value(&rec)?;
                if attempts {
                    v["attempt_rows"] = serde_json::to_value(&rows)?;
                }
                println!("{}", serde_json::to_string_pretty(&v)?);
            } else {
                let v = serde_json::to_value(&rec)?;
                for (k, val) in v.as_object().expect("record is an object") {
                    if !val.is_null() {
                        let text = val
                            .as_str()
                            .map(str::to_owned)
                            .unwrap_or_else(|| val.to_string());
                        // Epoch milliseconds, and the same instant for a person.
                        match val.as_i64().filter(|_| k.ends_with("_at_ms")) {
                            Some(ms) => println!("{k:>18}: {text}  ({})", utc(ms)),
                            None => println!("{k:>18}: {text}"),
                        }
                    }
                }
                if let (Some(c), Some(e)) = (rec.created_at_ms, rec.expires_at_ms) {
                    println!("{:>18}: {} ms after created_at", "deadline", e - c);
                }
                if attempts {
                    println!();
                    let r: Vec<Vec<String>> = rows
                        .iter()
                        .map(|a| {
                            vec![
                                a.attempt.to_string(),
                                a.worker.clone(),
                                a.redelivered.to_string(),
                                a.decision.clone().unwrap_or_default(),
                                a.model_called.to_string(),
                                a.state.clone().unwrap_or_default(),
                            ]
                        })
                        .collect();
                    print!(
                        "{}",
                        table::render(
                            &[
                                "attempt",
                                "worker",
                                "redelivered",
                                "decision",
                                "model_called",
                                "state"
                            ],
                            &r
                        )
                    );
                }
            }
        }
        JobsCommand::List {
            state,
            kind,
            tenant,
            limit,
            json,
        } => {
            if let Some(st) = &state {
                st.parse::<State>()?;
            }
            let recs = ledger
                .list(&ListFilter {
                    state: state.clone(),
                    kind: kind.clone(),
                    tenant: tenant.as_ref().map(|t| t.as_str().to_owned()),
                    limit: Some(limit),
                })
                .await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&recs)?);
            } else if recs.is_empty() {
                let total: i64 = ledger.counts_by_state().await?.iter().map(|(_, n)| n).sum();
                let url = lastcall_broker::redact(&s.store_url);
                if total == 0 {
                    let new = if new_file {
                        " (it did not exist: a new, empty one was created)"
                    } else {
                        ""
                    };
                    println!(
                        "no jobs: the ledger at {url} is empty{new}; set --store-url or LASTCALL_STORE_URL to read another"
                    );
                } else {
                    println!(
                        "no job matches{}{} in the ledger at {url} ({total} job(s) in all)",
                        state.map(|v| format!(" state={v}")).unwrap_or_default(),
                        kind.map(|v| format!(" kind={v}")).unwrap_or_default()
                    );
                }
            } else {
                print!("{}", render(&recs));
            }
        }
    }
    ledger.close().await;
    Ok(ExitCode::SUCCESS)
}

/// The outcome table used by `jobs list` and `demo`.
pub fn render(recs: &[JobRecord]) -> String {
    let rows: Vec<Vec<String>> = recs
        .iter()
        .map(|r| {
            let waited = match (r.received_at_ms, r.checked_at_ms) {
                (Some(a), Some(b)) => format!("{}", b - a),
                _ => "-".into(),
            };
            let deadline = match (r.created_at_ms, r.expires_at_ms) {
                (Some(c), Some(e)) => format!("{}", e - c),
                _ => "-".into(),
            };
            vec![
                r.job_id.clone(),
                r.kind.clone(),
                deadline,
                r.state.clone(),
                r.reason.clone().unwrap_or_default(),
                r.backend_calls.to_string(),
                waited,
                table::clip(r.result.as_deref().or(r.error.as_deref()).unwrap_or(""), 60),
            ]
        })
        .collect();
    table::render(
        &[
            "job_id",
            "kind",
            "deadline_ms",
            "state",
            "reason",
            "model_calls",
            "waited_ms",
            "result / error",
        ],
        &rows,
    )
}

/// The file of a `sqlite://PATH` / `sqlite:PATH` ledger URL (not `:memory:`).
pub(super) fn sqlite_path(url: &str) -> Option<std::path::PathBuf> {
    let rest = url
        .strip_prefix("sqlite://")
        .or_else(|| url.strip_prefix("sqlite:"))?;
    let path = rest.split('?').next().unwrap_or(rest);
    (!path.is_empty() && !path.contains(":memory:")).then(|| path.into())
}

/// Epoch milliseconds as a UTC time, e.g. `2026-08-05 14:02:07.250 UTC`.
pub fn utc(ms: i64) -> String {
    let (days, ms_of_day) = (ms.div_euclid(86_400_000), ms.rem_euclid(86_400_000));
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let (h, m, sec, milli) = (
        ms_of_day / 3_600_000,
        ms_of_day / 60_000 % 60,
        ms_of_day / 1_000 % 60,
        ms_of_day % 1_000,
    );
    format!("{year:04}-{month:02}-{day:02} {h:02}:{m:02}:{sec:02}.{milli:03} UTC")
}

#[cfg(test)]
mod tests {
    #[test]
    fn utc_times() {
        assert_eq!(super::utc(0), "1970-01-01 00:00:00.000 UTC");
        assert_eq!(super::utc(951_782_400_000), "2000-02-29 00:00:00.000 UTC");
        assert_eq!(super::utc(1_786_000_000_123), "2026-08-06 07:06:40.123 UTC");
        assert_eq!(super::utc(-1), "1969-12-31 23:59:59.999 UTC");
        assert_eq!(
            super::sqlite_path("sqlite:///tmp/x.db?mode=rwc").as_deref(),
            Some(std::path::Path::new("/tmp/x.db"))
        );
        assert_eq!(super::sqlite_path("sqlite::memory:"), None);
        assert_eq!(super::sqlite_path("postgres://u@h/db"), None);
    }
}
