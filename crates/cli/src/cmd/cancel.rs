//! `lastcall cancel <id>`.

use crate::cli::CancelArgs;
use crate::config::Settings;
use anyhow::Result;
use lastcall_broker::{EventSink, Names};
use lastcall_clock::Clock;
use lastcall_store::CancelOutcome;
use std::process::ExitCode;
use std::time::Duration;

/// Exit status when the job had already ended.
pub const EXIT_ALREADY_ENDED: u8 = 3;

pub async fn run(s: &Settings, a: CancelArgs, clock: &dyn Clock) -> Result<ExitCode> {
    let ledger = super::open_ledger(&s.store_url).await?;
    // The broadcasts are best-effort; the ledger write alone cancels a job not started yet
    // and flags a running one for its next delivery.
    let broker = super::connect_best_effort(
        s,
        "a running call cannot be told to stop, the ledger is updated anyway",
    )
    .await;
    let names = Names::new(&s.prefix);
    let (events, control) = match &broker {
        Some(b) => (
            EventSink::spawn(b, &names.events_exchange),
            EventSink::spawn(b, &names.control_exchange),
        ),
        None => (EventSink::disabled(), EventSink::disabled()),
    };
    let out =
        lastcall_producer::cancel::cancel(&ledger, &events, &control, &a.job_id, clock.now_ms())
            .await;
    for sink in [&events, &control] {
        sink.close(Duration::from_secs(5)).await;
    }
    if let Some(b) = broker {
        b.close().await;
    }
    ledger.close().await;
    let id = &a.job_id;
    Ok(match out? {
        CancelOutcome::Cancelled => {
            println!("{id}: cancelled before it started (no model call)");
            ExitCode::SUCCESS
        }
        CancelOutcome::Requested => {
            println!(
                "{id}: running; its worker is asked to abort the call (`lastcall jobs show {id}` shows the outcome)"
            );
            ExitCode::SUCCESS
        }
        CancelOutcome::AlreadyTerminal(state) => {
            println!("{id}: already ended ({state}); nothing changed");
            ExitCode::from(EXIT_ALREADY_ENDED)
        }
        CancelOutcome::NotFound => {
            anyhow::bail!(
                "no job `{id}` in the ledger ({})",
                lastcall_broker::redact(&s.store_url)
            )
        }
    })
}
