//! `lastcall jobs show|list`.

use crate::cli::JobsCommand;
use crate::config::Settings;
use crate::table;
use anyhow::{Result, bail};
use lastcall_core::State;
use lastcall_store::{JobRecord, ListFilter};
use std::process::ExitCode;

pub async fn run(s: &Settings, c: JobsCommand) -> Result<ExitCode> {
    let ledger = super::open_ledger(&s.store_url).await?;
    match c {
        JobsCommand::Show {
            job_id,
            json,
            attempts,
        } => {
            let Some(rec) = ledger.get(&job_id).await? else {
                bail!("no job `{job_id}` in the ledger at {}", s.store_url);
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
                        println!(
                            "{k:>18}: {}",
                            val.as_str()
                                .map(str::to_owned)
                                .unwrap_or_else(|| val.to_string())
                        );
                    }
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
            limit,
            json,
        } => {
            if let Some(st) = &state {
                st.parse::<State>()?;
            }
            let recs = ledger
                .list(&ListFilter {
                    state,
                    kind,
                    limit: Some(limit),
                })
                .await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&recs)?);
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
            vec![
                r.job_id.clone(),
                r.kind.clone(),
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
            "state",
            "reason",
            "model_calls",
            "waited_ms",
            "result / error",
        ],
        &rows,
    )
}
