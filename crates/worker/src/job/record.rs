//! The ledger rows of a delivery: its attempt start and its outcome.

use super::Job;
use super::call::Call;
use crate::ctx::Recording;
use lastcall_core::delivery::Delivery;
use lastcall_core::{Envelope, State, Tenant};
use lastcall_store::{AttemptStart, OutcomeRecord};

/// The durable `running` row written before the call (makes crash loops countable).
pub(crate) fn start_row(worker: &str, job: &Job, d: &Delivery) -> AttemptStart {
    let (env, facts) = (d.env().expect("admitted"), d.facts().expect("admitted"));
    let checked_at_ms = facts.checked_at_ms.unwrap_or(facts.received_at_ms);
    AttemptStart {
        attempt_key: job.ticket.attempt_key().to_owned(),
        job_id: job.id.clone(),
        kind: env.kind().to_string(),
        attempt: facts.attempt,
        created_at_ms: env.deadline().created_at_ms(),
        expires_at_ms: env.deadline().expires_at_ms(),
        worker: worker.to_owned(),
        redelivered: job.msg.redelivered,
        received_at_ms: facts.received_at_ms,
        checked_at_ms,
        started_at_ms: checked_at_ms,
        tenant: tenant_of(env),
        priority: env.priority(),
    }
}

/// The outcome row of a delivery being recorded (a terminal outcome, or a retry's or
/// hand-back's attempt).
pub(crate) fn outcome_row(
    ctx: &Recording<'_>,
    job: &Job,
    d: &Delivery,
    call: Option<&Call>,
) -> OutcomeRecord {
    let (facts, terminal) = (d.facts().expect("recording"), d.terminal());
    let parsed = d.parsed().expect("recording");
    let env = parsed.ok();
    let error = match (parsed, call) {
        (Err(e), _) => Some(e.to_string()),
        (_, Some(c)) => c.error.clone(),
        _ => d.note().map(str::to_owned),
    };
    let output = call.and_then(|c| c.output.as_ref());
    let usage = output.and_then(|o| o.usage);
    OutcomeRecord {
        attempt_key: job.ticket.attempt_key().to_owned(),
        job_id: job.id.clone(),
        kind: env.map_or_else(|| "invalid".to_owned(), |e| e.kind().to_string()),
        state: terminal.map_or(State::Running, |t| t.state),
        reason: terminal.and_then(|t| t.reason.clone()),
        decision: d.decision().expect("recording"),
        attempt: facts.attempt,
        created_at_ms: env.map(|e| e.deadline().created_at_ms()),
        expires_at_ms: env.map(|e| e.deadline().expires_at_ms()),
        received_at_ms: Some(facts.received_at_ms),
        checked_at_ms: facts.checked_at_ms,
        started_at_ms: facts.started_at_ms,
        finished_at_ms: facts.finished_at_ms,
        recorded_at_ms: ctx.clock.now_ms(),
        worker: ctx.cfg.name.clone(),
        redelivered: job.msg.redelivered,
        model_called: facts.started_at_ms.is_some(),
        result: output.map(|o| o.text.clone()),
        error,
        // Counts from an upstream server: `as` would turn 2^64 − 1 into −1.
        prompt_tokens: usage.map(|u| i64::try_from(u.prompt_tokens).unwrap_or(i64::MAX)),
        completion_tokens: usage.map(|u| i64::try_from(u.completion_tokens).unwrap_or(i64::MAX)),
        // The payload's size by the documented approximation: the door predicts from it,
        // and a worker starting later replays the call under it (or, where its backend
        // counts the prompt's tokens, under `prompt_tokens`).
        request_size: job.payload_size,
        latency_ms: call.map(|c| c.latency_ms),
        cancel_requested: call.is_some_and(|c| c.cancel_requested),
        cancel_confirmed: call.and_then(|c| c.cancel_confirmed),
        // The backend that served (or would have served) the call: the route's, when
        // kinds are routed; on a fallback route, the one chosen for this call.
        backend: Some(env.map_or(ctx.backend, |_| job.backend.as_str()).to_owned()),
        model: output.and_then(|o| o.model.clone()),
        min_runtime_ms: facts
            .min_runtime_ms
            .map(|m| i64::try_from(m).unwrap_or(i64::MAX)),
        min_feasible_budget_ms: facts
            .min_feasible_budget_ms
            .map(|m| i64::try_from(m).unwrap_or(i64::MAX)),
        tenant: env.map_or_else(Tenant::default_tenant, tenant_of),
        priority: env.map(Envelope::priority).unwrap_or_default(),
    }
}

/// The envelope's tenant (parsed with it, so always valid).
pub(crate) fn tenant_of(env: &Envelope) -> Tenant {
    Tenant::parse(env.tenant()).unwrap_or_else(|_| Tenant::default_tenant())
}
