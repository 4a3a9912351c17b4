//! `lastcall reconcile`: accepted inventory vs recorded outcomes.

use crate::cli::ReconcileArgs;
use crate::config::Settings;
use crate::table;
use anyhow::{Result, bail};
use lastcall_clock::Clock;
use lastcall_core::State;
use serde_json::json;
use std::process::ExitCode;

/// Exit code when the ledger holds `unknown` jobs (without `--allow-unknown`).
pub const EXIT_UNKNOWN: u8 = 3;

pub async fn run(s: &Settings, a: ReconcileArgs, clock: &dyn Clock) -> Result<ExitCode> {
    let Ok(grace_ms) = i64::try_from(a.grace_ms) else {
        bail!("--grace-ms is too large: {}", a.grace_ms);
    };
    let ledger = super::open_ledger_to_read(&s.store_url).await?;
    let marked = ledger.mark_unknown(clock.now_ms(), grace_ms).await?;
    publish_events(s, &ledger, &marked).await;
    let counts = ledger.counts_by_state().await?;
    // Jobs marked `unknown` by an earlier run whose real outcome arrived since.
    let late = ledger.late_outcomes().await?;
    ledger.close().await;
    let count = |st: State| {
        counts
            .iter()
            .find(|(name, _)| name == st.as_str())
            .map_or(0, |(_, n)| *n)
    };
    let unknown = count(State::Unknown);
    let pending = count(State::Accepted) + count(State::Running);
    let total: i64 = counts.iter().map(|(_, n)| n).sum();
    if a.json {
        let by_state: serde_json::Map<String, serde_json::Value> = counts
            .iter()
            .map(|(st, n)| (st.clone(), json!(n)))
            .collect();
        let v = json!({
            "marked_unknown": marked,
            "counts": by_state,
            "unknown": unknown,
            "pending": pending,
            "late_outcomes": late,
            "total": total,
            "grace_ms": a.grace_ms,
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        let rows: Vec<Vec<String>> = counts
            .iter()
            .map(|(st, n)| vec![st.clone(), n.to_string()])
            .collect();
        print!("{}", table::render(&["state", "jobs"], &rows));
        println!("total: {total}; still within deadline + grace (accepted/running): {pending}");
        if marked.is_empty() {
            println!("newly marked unknown: none");
        } else {
            println!(
                "newly marked unknown ({}, no outcome {} ms after the deadline):",
                marked.len(),
                a.grace_ms
            );
            for id in &marked {
                println!("  {id}");
            }
        }
        if late > 0 {
            println!(
                "{late} job(s) marked `unknown` earlier got their real outcome later (late outcomes)"
            );
        }
        if unknown > 0 {
            println!(
                "{unknown} job(s) are `unknown`: list them with `lastcall jobs list --state unknown`"
            );
        }
    }
    if unknown > 0 && !a.allow_unknown {
        return Ok(ExitCode::from(EXIT_UNKNOWN));
    }
    Ok(ExitCode::SUCCESS)
}

/// One outcome event per job just marked `unknown` (best-effort: reconciliation works
/// without a broker, and the ledger holds the outcome either way).
async fn publish_events(s: &Settings, ledger: &lastcall_store::Ledger, marked: &[String]) {
    if marked.is_empty() {
        return;
    }
    let Some(broker) =
        super::connect_best_effort(s, "no outcome events for the jobs marked unknown").await
    else {
        return;
    };
    let names = lastcall_broker::Names::new(&s.prefix);
    let sink = lastcall_broker::EventSink::spawn(&broker, &names.events_exchange);
    for id in marked {
        if let Ok(Some(rec)) = ledger.get(id).await {
            let e = lastcall_producer::job_event(&rec, "reconcile");
            sink.emit(e.routing_key(), e.to_json());
        }
    }
    sink.close(std::time::Duration::from_secs(5)).await;
    broker.close().await;
}
