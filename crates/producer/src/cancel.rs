//! Cancelling a job on request (`DELETE /v1/jobs/{id}`, `lastcall cancel`, or a library
//! caller): the ledger first ([`Ledger::cancel`]), then the broadcasts.
//!
//! A job not started yet is `cancelled` in the ledger at once (no model call; a worker that
//! receives it later finds it recorded and acks it without a call), and its outcome event
//! is published. A running job is flagged in the ledger and a cancellation is broadcast on
//! `{prefix}.control`: the worker that runs it aborts the call through the backend's
//! cancellation and records `cancelled` (with whether the backend confirmed the stop); any
//! later delivery of it (a retry, a redelivery) is recorded `cancelled` without a call. A
//! worker that missed the broadcast finds the ledger's flag within 2 s (it sweeps the flags
//! of the jobs it holds); a call that ended before that keeps its outcome. A terminal job
//! is left as it is.

use lastcall_broker::EventSink;
use lastcall_core::event::ControlMessage;
use lastcall_store::{CancelOutcome, Ledger, StoreError};

/// Cancel `job_id` at `now_ms`. `events` gets the outcome event of a job cancelled before
/// its start; `control` the broadcast to the workers.
pub async fn cancel(
    ledger: &Ledger,
    events: &EventSink,
    control: &EventSink,
    job_id: &str,
    now_ms: i64,
) -> Result<CancelOutcome, StoreError> {
    let out = ledger.cancel(job_id, now_ms).await?;
    match &out {
        CancelOutcome::Cancelled => {
            // A worker may hold it in its buffer already (received before the write).
            control.emit(String::new(), ControlMessage::cancel(job_id).to_json());
            if let Ok(Some(rec)) = ledger.get(job_id).await {
                let e = crate::job_event(&rec, "cancel");
                events.emit(e.routing_key(), e.to_json());
            }
        }
        CancelOutcome::Requested => {
            control.emit(String::new(), ControlMessage::cancel(job_id).to_json());
        }
        CancelOutcome::AlreadyTerminal(_) | CancelOutcome::NotFound => {}
    }
    Ok(out)
}
