//! The end of a delivery: the model call's aftermath, a retry's publish, the durable
//! outcome, and the one way out through the settlement door.

use super::Job;
use super::call::{Call, call_backend, jitter};
use super::record::outcome_row;
use crate::ctx::{CancelGuard, Ctx};
use crate::slots::SlotPermit;
use crate::stats::WorkerStats;
use lastcall_broker::PublishProps;
use lastcall_core::CallResult;
use lastcall_core::breaker::Verdict;
use lastcall_core::delivery::{
    Calling, Finish, FinishKind, PublishFailed, Publishing, Recording, Settle,
};
use lastcall_core::service_time::ProbeEnd;
use lastcall_store::LedgerWrite;
use std::sync::atomic::Ordering;

/// Call the model with the budget the core gave, then settle what it decides.
pub(crate) async fn call_and_settle(
    ctx: &Ctx,
    mut job: Job,
    c: Calling,
    mut permit: SlotPermit,
    cancel: &CancelGuard,
) {
    WorkerStats::inc(&ctx.stats.backend_calls);
    WorkerStats::add(&ctx.stats.running, 1);
    // `reply_to` is not signed: deltas go only to a direct reply-to address, never to a
    // queue the name happens to match (the work queue, through the default exchange).
    let stream = match job.msg.reply_to.as_deref() {
        Some(to) if lastcall_core::delta::is_direct_reply_to(to) => Some(
            crate::stream::CallStream::new(&ctx.deltas, to, &job.id, job.msg.attempt),
        ),
        Some(to) => {
            tracing::warn!(
                job_id = %job.id.escape_debug(),
                reply_to = %to.escape_debug(),
                "`reply_to` is not a direct reply-to address: no token deltas are sent"
            );
            None
        }
        None => None,
    };
    // What the kind's completed calls take, before this one: a call cut at the deadline
    // far past it is a hung server for the circuit breaker.
    let kind = c.env().kind().as_str().to_owned();
    let backend = job.backend.clone();
    if backend != ctx.breaker_key(&kind) {
        WorkerStats::inc(&ctx.stats.fallback_calls);
    }
    let p99_before = ctx.completed_p99(&kind, &backend, ctx.clock.now_ms());
    // The permit taken at the slot is spent by this call; its headers reach the limiter.
    let rate = job.rate.take();
    let limits = ctx.limits.sink(&backend, ctx.clock.clone());
    {
        // The running call, for the adaptive limit's check before a step up.
        let now = ctx.clock.now_ms();
        let admitted_ms = job.learned(ctx, &kind, now).map_or(0, |e| e.quantile_ms);
        permit.started(admitted_ms, c.env().deadline().expires_at_ms(), now);
    }
    let mut call = call_backend(
        ctx,
        &backend,
        c.env(),
        job.msg.attempt,
        c.budget_ms(),
        &cancel.token,
        stream.as_ref(),
        Some(limits),
    )
    .await;
    if let Some(rate) = rate {
        let used = (call.output.as_ref().and_then(|o| o.usage))
            .map(|u| u.prompt_tokens + u.completion_tokens);
        rate.spent(used, ctx.clock.now_ms());
    }
    if let Some(s) = &stream {
        s.end();
    }
    WorkerStats::add(&ctx.stats.running, -1);
    (ctx.stats.metrics.model_call).observe_ms(call.latency_ms);
    if call.result.teaches_call_time().is_some() {
        // The adaptive limit learns from a useful call's time (a failed one says nothing
        // about it), against the learned time of its request alone, before the estimator
        // takes the call in.
        let now = ctx.clock.now_ms();
        let alone = match job.probe {
            Some(_) => None,
            None => ctx.learned_alone(&kind, &backend, job.size, now),
        };
        permit.ended(
            call.latency_ms.max(0) as u64,
            alone.map_or(0, |e| e.mean_ms),
            now,
        );
    }
    drop(permit);
    let c_budget_ms = c.budget_ms();
    let c = if job.lost.is_cancelled() {
        c.channel_lost()
    } else {
        c
    };
    let now = ctx.clock.now_ms();
    let learned = job.learned(ctx, &kind, now).map(|e| e.quantile_ms);
    let ended = c.call_ended(&ctx.cfg.policy, call.result.clone(), learned, now, jitter());
    call.result = ended.result;
    let verdict = Verdict::of(ctx.breakers.policy(), &call.result, c_budget_ms, p99_before);
    match job.trial.take() {
        Some(trial) => trial.ended(verdict, now),
        None => ctx.breakers.ended(&backend, verdict, now),
    }
    if ended.note.is_some() {
        call.error = ended.note;
    }
    if let Some(cut) = call.result.teaches_call_time() {
        ctx.observe_call(&kind, &backend, call.latency_ms, cut, job.size, now);
    }
    if let Some(probe) = job.probe.take() {
        probe.end(match &call.result {
            CallResult::Completed => ProbeEnd::Completed {
                budget_ms: c_budget_ms,
            },
            CallResult::DeadlineExceeded | CallResult::Failed { .. } => ProbeEnd::Wasted {
                duration_ms: call.latency_ms.max(0) as u64,
            },
            _ => ProbeEnd::Released,
        });
    }
    if let Some(u) = call.output.as_ref().and_then(|o| o.usage) {
        let m = &ctx.stats.metrics;
        m.prompt_tokens
            .fetch_add(u.prompt_tokens, Ordering::Relaxed);
        m.completion_tokens
            .fetch_add(u.completion_tokens, Ordering::Relaxed);
    }
    settle(ctx, job, ended.settle, Some(call)).await;
}

/// Carry out the core's settlement: publish a retry first, record, then finish.
pub(crate) async fn settle(ctx: &Ctx, job: Job, s: Settle, call: Option<Call>) {
    match s {
        Settle::Record(r) => record(ctx, job, r, call).await,
        Settle::Duplicate(f) => {
            WorkerStats::inc(&ctx.stats.duplicates);
            tracing::info!("redelivery of a job with a recorded outcome: acking without running");
            finish(ctx, job, f).await;
        }
        Settle::PublishRetry(p) => match publish_retry(ctx, &job, &p).await {
            Ok(()) => record(ctx, job, p.published(), call).await,
            Err(e) => {
                let p = if job.lost.is_cancelled() {
                    p.channel_lost()
                } else {
                    p
                };
                match p.failed() {
                    PublishFailed::Drop(f) => {
                        // The connection is gone: this delivery cannot be settled anyway.
                        tracing::warn!(error = %e, "retry publish failed with the connection lost; the broker redelivers the job");
                        finish(ctx, job, f).await;
                    }
                    PublishFailed::Record(r) => {
                        tracing::error!(error = %e, "retry publish not confirmed; failing the job");
                        record(ctx, job, r, call).await;
                    }
                }
            }
        },
    }
}

/// Publish the retry with confirm: the body byte for byte (the deadline cannot change),
/// the remaining budget as its TTL, on the retry queue of its delay.
async fn publish_retry(ctx: &Ctx, job: &Job, p: &Publishing) -> Result<(), String> {
    let retry = p.retry();
    let delay = ctx.cfg.policy.retry.queue_delays_ms[retry.queue_index];
    let queue = ctx.cfg.topology.names.retry_queue(delay);
    let props = PublishProps {
        job_id: job.id.clone(),
        ttl_ms: Some(retry.ttl_ms),
        attempt: retry.next_attempt,
        timestamp_s: (ctx.clock.now_ms() / 1000) as u64,
        signature: job.msg.signature.clone(),
    };
    let publisher = ctx.publisher();
    publisher
        .publish("", &queue, &job.msg.body, &props)
        .await
        .map_err(|e| e.to_string())?;
    tracing::info!(queue = %queue, delay_ms = retry.delay_ms, next_attempt = retry.next_attempt, "retry published");
    WorkerStats::inc(&ctx.stats.retries);
    Ok(())
}

/// Write the outcome durably (group commit, retried), then finish with the broker.
pub(crate) async fn record(ctx: &Ctx, job: Job, r: Recording, call: Option<Call>) {
    let rec = outcome_row(ctx, &job, &r, call.as_ref());
    let stored = ctx.door.commit(LedgerWrite::outcome(rec.clone())).await;
    let Some(newly) = stored else {
        // Shutting down before the write succeeded: no ack.
        return finish(ctx, job, r.shutdown()).await;
    };
    let terminal = r.terminal();
    if newly {
        if let Some(t) = terminal {
            let reason = t.reason.as_ref().map(ToString::to_string);
            ctx.stats.count_state(t.state.as_str());
            (ctx.stats.metrics).count_outcome(t.state.as_str(), &rec.kind, reason.as_deref());
            tracing::info!(
                state = t.state.as_str(),
                reason = reason.as_deref().unwrap_or(""),
                "outcome recorded"
            );
        }
        crate::hooks::pause_after_store(&ctx.cfg).await;
        if terminal.is_some() {
            let calls = job.prior_starts + u32::from(rec.model_called);
            crate::events::emit(&ctx.events, &rec, calls);
        }
    } else if terminal.is_some() {
        tracing::info!("outcome already recorded earlier; keeping the first");
    }
    let r = if job.lost.is_cancelled() {
        r.channel_lost()
    } else {
        r
    };
    finish(ctx, job, r.durable()).await;
}

/// The delivery's one way out, through the settlement door.
pub(crate) async fn finish(ctx: &Ctx, job: Job, f: Finish) {
    match f.kind() {
        // Acked by the flusher, possibly together with other finished deliveries.
        FinishKind::Ack => ctx.door.ack(job.ticket),
        // The reject is sent before its tag is released: no `multiple` ack overtakes it.
        FinishKind::DeadLetter => ctx.door.dead_letter(job.ticket).await,
        // It never started: back to the broker unrecorded, checked again at its next
        // delivery. On a lost channel the requeue cannot be sent; the broker requeues it.
        FinishKind::HandBack if job.ticket.channel_lost() => {
            tracing::info!(
                "connection lost: dropping a waiting job locally (the broker redelivers it)"
            );
            ctx.door.hand_back(job.ticket).await;
        }
        FinishKind::HandBack => {
            tracing::info!("handing a job that never started back to the broker");
            ctx.door.hand_back(job.ticket).await;
        }
        // Nothing is sent: the ticket stays held (no `multiple` ack covers it) until the
        // channel closes and the broker redelivers it.
        FinishKind::Drop => {
            if job.lost.is_cancelled() {
                tracing::info!(
                    "connection lost: dropping the delivery locally (the broker redelivers it)"
                );
            }
            drop(job.ticket);
        }
    }
}
