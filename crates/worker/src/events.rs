//! Outcome events from ledger records: every process that writes a terminal outcome calls
//! [`emit`] right *after* the write succeeded (never before: an event must not announce an
//! outcome the ledger does not hold). Best-effort: see `lastcall_broker::events`.

use lastcall_broker::EventSink;
use lastcall_core::OutcomeEvent;
use lastcall_core::event::EVENT_VERSION;
use lastcall_store::OutcomeRecord;

/// The event of a written outcome; `model_calls` counts every attempt's model call.
pub fn outcome_event(rec: &OutcomeRecord, model_calls: u32) -> OutcomeEvent {
    OutcomeEvent {
        v: EVENT_VERSION,
        job_id: rec.job_id.clone(),
        kind: rec.kind.clone(),
        state: rec.state.as_str().to_owned(),
        reason: rec.reason.as_ref().map(ToString::to_string),
        attempt: rec.attempt,
        model_calls,
        created_at_ms: rec.created_at_ms,
        expires_at_ms: rec.expires_at_ms,
        finished_at_ms: rec.finished_at_ms,
        recorded_at_ms: rec.recorded_at_ms,
        recorded_by: rec.worker.clone(),
        min_feasible_budget_ms: rec
            .min_feasible_budget_ms
            .and_then(|m| u64::try_from(m).ok()),
    }
}

/// Publish the event of `rec` (already durable) through `sink`.
pub fn emit(sink: &EventSink, rec: &OutcomeRecord, model_calls: u32) {
    let e = outcome_event(rec, model_calls);
    sink.emit(e.routing_key(), e.to_json());
}

/// For a recorder that does not know the job's model calls (the dead-letter processor,
/// the relay, reconciliation): the ledger's count, read after the write; then [`emit`].
pub async fn emit_counting(sink: &EventSink, ledger: &lastcall_store::Ledger, rec: &OutcomeRecord) {
    if !sink.is_enabled() {
        return;
    }
    let calls = match ledger.get(&rec.job_id).await {
        Ok(Some(r)) => u32::try_from(r.backend_calls).unwrap_or(0),
        _ => u32::from(rec.model_called),
    };
    emit(sink, rec, calls);
}

/// The event of a job as the ledger holds it now (`lastcall_producer`, which cancels).
pub use lastcall_producer::job_event;
