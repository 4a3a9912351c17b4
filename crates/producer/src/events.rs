//! The outcome event of a job as the ledger holds it, for the writers on the producer side
//! (a cancellation before the start, `reconcile` marking jobs in bulk). The worker's own
//! events (`lastcall_worker::events`) are built from the `OutcomeRecord` it just wrote.

use lastcall_core::OutcomeEvent;
use lastcall_core::event::EVENT_VERSION;
use lastcall_store::JobRecord;

/// The event of a job as the ledger holds it now; `recorded_by` names the writer.
pub fn job_event(rec: &JobRecord, recorded_by: &str) -> OutcomeEvent {
    OutcomeEvent {
        v: EVENT_VERSION,
        job_id: rec.job_id.clone(),
        kind: rec.kind.clone(),
        state: rec.state.clone(),
        reason: rec.reason.clone(),
        attempt: u32::try_from(rec.attempts.saturating_sub(1).max(0)).unwrap_or(0),
        model_calls: u32::try_from(rec.backend_calls).unwrap_or(0),
        created_at_ms: rec.created_at_ms,
        expires_at_ms: rec.expires_at_ms,
        finished_at_ms: rec.finished_at_ms,
        recorded_at_ms: rec.recorded_at_ms.unwrap_or_default(),
        recorded_by: recorded_by.to_owned(),
        min_feasible_budget_ms: rec
            .min_feasible_budget_ms
            .and_then(|m| u64::try_from(m).ok()),
    }
}
