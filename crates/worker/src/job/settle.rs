//! The end of a delivery: a retry's publish, the durable outcome, and the one way out
//! through the settlement door.

use super::Job;
use super::record::outcome_row;
use crate::ctx::Recording;
use crate::stats::WorkerStats;
use lastcall_broker::PublishProps;
use lastcall_core::delivery::{Action, Delivery, Event, Finish, FinishKind, Retry};
use lastcall_store::LedgerWrite;

/// Publish the retry with confirm: the body byte for byte (the deadline cannot change),
/// the remaining budget as its TTL, on the retry queue of its delay.
pub(crate) async fn publish_retry(ctx: &Recording<'_>, job: &Job, d: &mut Delivery, retry: Retry) {
    let delay = ctx.cfg.policy.retry.queue_delays_ms[retry.queue_index];
    let queue = ctx.cfg.topology.names.retry_queue(delay);
    let props = PublishProps {
        job_id: job.id.clone(),
        ttl_ms: Some(retry.ttl_ms),
        attempt: retry.next_attempt,
        timestamp_s: (ctx.clock.now_ms() / 1000) as u64,
        signature: job.msg.signature.clone(),
    };
    let publisher = ctx.publisher.get();
    let policy = &ctx.cfg.policy;
    // Confirmed, the retry is the broker's; the delivery is acked after its `retrying`
    // row (the proof its ack needs comes from that write).
    let published = ctx
        .door
        .publish(&publisher, "", &queue, &job.msg.body, &props)
        .await;
    match published {
        Ok(_confirmed) => {
            tracing::info!(queue = %queue, delay_ms = retry.delay_ms, next_attempt = retry.next_attempt, "retry published");
            WorkerStats::inc(&ctx.stats.retries);
            d.handle(policy, Event::Published, ctx.clock.now_ms());
        }
        Err(e) => {
            let now = ctx.clock.now_ms();
            if job.lost.is_cancelled() {
                d.handle(policy, Event::ChannelLost, now);
            }
            d.handle(policy, Event::PublishFailed, now);
            if d.poll_action() == Action::Record {
                tracing::error!(error = %e, "retry publish not confirmed; failing the job");
            } else {
                // The connection is gone: this delivery cannot be settled anyway.
                tracing::warn!(error = %e, "retry publish failed with the connection lost; the broker redelivers the job");
            }
        }
    }
}

/// Write the outcome durably (group commit, retried); the core then says how to finish
/// with the broker.
pub(crate) async fn record(ctx: &Recording<'_>, job: &mut Job, d: &mut Delivery) {
    let policy = &ctx.cfg.policy;
    let rec = outcome_row(ctx, job, d, job.call.as_ref());
    let stored = ctx.door.commit(LedgerWrite::outcome(rec.clone())).await;
    let Some((durable, newly)) = stored else {
        // Shutting down before the write succeeded: no ack.
        return d.handle(policy, Event::Shutdown, ctx.clock.now_ms());
    };
    job.durable = Some(durable);
    let terminal = d.terminal();
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
        crate::hooks::pause_after_store(ctx.cfg).await;
        if terminal.is_some() {
            let calls = job.prior_starts + u32::from(rec.model_called);
            crate::events::emit(ctx.events, &rec, calls);
        }
    } else if terminal.is_some() {
        tracing::info!("outcome already recorded earlier; keeping the first");
    }
    let now = ctx.clock.now_ms();
    if job.lost.is_cancelled() {
        d.handle(policy, Event::ChannelLost, now);
    }
    d.handle(policy, Event::Durable, now);
}

/// The delivery's one way out, through the settlement door.
pub(crate) async fn finish(ctx: &Recording<'_>, job: Job, d: &Delivery, f: Finish) {
    if d.is_duplicate() {
        WorkerStats::inc(&ctx.stats.duplicates);
        tracing::info!("redelivery of a job with a recorded outcome: acking without running");
    }
    if d.is_passed_on() {
        WorkerStats::inc(&ctx.stats.passed_on);
        tracing::debug!(
            "this worker's backlog would keep the job past its deadline and a peer has room: handing it back"
        );
    }
    match f.kind() {
        // Acked by the flusher, possibly together with other finished deliveries.
        FinishKind::Ack => match job.durable {
            Some(durable) => ctx.door.ack(job.ticket, durable).await,
            None => {
                // The core acks only after the durable step; without the door's proof of
                // it nothing is sent, and the broker redelivers the job at the channel's
                // close (its ledger rows decide what happens then).
                tracing::error!(job_id = %job.id, "an ack without the durable step's proof; leaving the delivery to the broker");
                debug_assert!(false, "ack without a durable proof");
                drop(job.ticket);
            }
        },
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
