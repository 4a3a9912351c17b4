//! The wait for a model slot in the bounded local buffer (priority tiers, fair share among
//! tenants, then `--buffer-order` within a tenant: [`crate::slots`]), and for a trusted
//! clock.
//!
//! A job that can no longer finish in time leaves the buffer as soon as that is known,
//! not when it reaches a slot: it is settled at its latest useful start, which frees its
//! prefetch place for a job that can still make it.

use super::Job;
use super::record::learned_note;
use crate::ctx::{CancelGuard, Ctx};
use crate::slots::SlotPermit;
use crate::stats::WorkerStats;
use lastcall_core::breaker::Permit;
use lastcall_core::delivery::{
    Admission, Admitted, ClockState, ClockTick, ClockWait, Finish, Settle, WaitTick, Waiting,
};
use std::time::Duration;

/// How the wait ended.
pub(crate) enum Waited {
    /// Admitted, holding a slot: write the start, then call.
    Admitted(Admitted, SlotPermit),
    Settle(Settle),
    Finish(Finish),
}

/// How one wait for a slot ended, before the admission check.
enum Slotted {
    Slot(Waiting, SlotPermit),
    Settle(Settle),
    Finish(Finish),
}

/// Wait for a slot, then ask the core (the last admission check); wait for the clock when
/// it may not be trusted (without holding a slot), then for a slot again.
pub(crate) async fn for_slot(
    ctx: &Ctx,
    job: &mut Job,
    mut waiting: Waiting,
    mean_ms: u64,
    cancel: &CancelGuard,
) -> Waited {
    loop {
        let (w, mut permit) = match buffered(ctx, job, waiting, mean_ms, cancel).await {
            Slotted::Slot(w, permit) => (w, permit),
            Slotted::Settle(s) => return Waited::Settle(s),
            Slotted::Finish(f) => return Waited::Finish(f),
        };
        crate::hooks::hold_before_admission(&ctx.cfg).await;
        // Fail closed while the clock's sync state forbids admission.
        let clock = if ctx.cfg.clock_sync.admits(ctx.clock.as_ref()) {
            ClockState::Trusted
        } else {
            ClockState::Untrusted
        };
        let now = ctx.clock.now_ms();
        // On a fallback route: the backend of the route that can take the job now (or the
        // one to wait for); the gates below run on it.
        job.choose_backend(ctx, w.env(), now);
        // The model server's circuit breaker: no call to a server known to be down.
        let w = match breaker(ctx, job, w, permit, now) {
            Gate::Go(w, p) => {
                permit = p;
                w
            }
            Gate::Settle(s) => return Waited::Settle(s),
            Gate::Wait(w, next_call_at_ms) => {
                waiting = match until_breaker(ctx, job, w, next_call_at_ms, cancel).await {
                    Ok(w) => w,
                    Err(end) => return end,
                };
                continue;
            }
        };
        // The backend's rate limits: no call without a permit.
        let w = match rate_limit(ctx, job, w, permit, now) {
            Gate::Go(w, p) => {
                permit = p;
                w
            }
            Gate::Settle(s) => return Waited::Settle(s),
            Gate::Wait(w, permit_at_ms) => {
                waiting = match until_permit(ctx, job, w, permit_at_ms, cancel).await {
                    Ok(w) => w,
                    Err(end) => return end,
                };
                continue;
            }
        };
        let learned = job.learned(ctx, w.env().kind().as_str(), now);
        // This job holds a free slot: if the estimate alone refuses it, it may probe.
        let learned = job.maybe_probe(ctx, w.env(), learned, true, now);
        let received_at_ms = w.facts().received_at_ms;
        let admission = w.slot_granted(clock, &ctx.cfg.policy, learned.map(|e| e.quantile_ms), now);
        if clock == ClockState::Trusted {
            tracing::Span::current().record("checked_at_ms", now);
            (ctx.stats.metrics.consumer_dwell).observe_ms(now - received_at_ms);
        }
        match admission {
            Admission::Start(a) => {
                (ctx.stats.metrics.remaining_budget).observe_ms(a.budget_ms() as i64);
                return Waited::Admitted(a, permit);
            }
            Admission::Settle(s) => {
                job.rate = None;
                if let Settle::Record(r) = &s {
                    job.note = learned_note(learned, r.terminal());
                }
                return Waited::Settle(s);
            }
            // The broker's ack window (its consumer timeout, when known) closed while the
            // job waited: not started, handed back; the redelivery has a fresh window.
            Admission::HandBack(f) => {
                job.rate = None;
                tracing::info!(job_id = %job.id, "the broker's ack window (consumer_timeout) closed while the job waited for a slot: handing it back for redelivery");
                return Waited::Finish(f);
            }
            Admission::ClockWait(c) => {
                drop(permit);
                job.rate = None;
                waiting = match for_clock(ctx, job, c).await {
                    Ok(w) => w,
                    Err(end) => return end,
                };
            }
        }
    }
}

/// Whether a job holding a slot may call now.
#[allow(clippy::large_enum_variant)] // short-lived, moved once
enum Gate {
    /// Yes (closed, or this job has the half-open trial).
    Go(Waiting, SlotPermit),
    /// Its model server's breaker is open past the job's latest useful start.
    Settle(Settle),
    /// Open (or half-open with the trial running) until about this instant: wait without
    /// the slot.
    Wait(Waiting, i64),
}

/// Ask the job's model server's breaker whether its call may go out now. A half-open
/// breaker's one trial goes to this job (`job.trial`); an open one keeps the job waiting,
/// without its slot, while its budget still allows a call after the breaker's next
/// trial, and ends it without a call (`admission:upstream_unavailable`) otherwise.
fn breaker(ctx: &Ctx, job: &mut Job, w: Waiting, permit: SlotPermit, now: i64) -> Gate {
    if job.trial.is_some() {
        return Gate::Go(w, permit);
    }
    let kind = w.env().kind().as_str();
    let key = job.backend.clone();
    let key = key.as_str();
    // A trial running past the hang limit of the kind's completed calls has failed.
    let trial_limit = ctx.trial_limit_ms(kind, key, now);
    // The door refuses a kind whose breakers are open on every live worker; a kind on a
    // fallback route is not recorded there (another backend of its route may take it).
    let for_door = (ctx.route(kind).len() == 1).then_some(kind);
    match ctx.breakers.permit(key, for_door, trial_limit, now) {
        (Permit::Call, _) => Gate::Go(w, permit),
        (Permit::Trial, trial) => {
            job.trial = trial;
            Gate::Go(w, permit)
        }
        (Permit::Wait { next_call_at_ms }, _) => {
            drop(permit);
            let learned = job.learned(ctx, w.env().kind().as_str(), now);
            let latest = w.latest_start_ms(&ctx.cfg.policy, learned.map(|e| e.quantile_ms));
            if latest.is_some_and(|latest| next_call_at_ms > latest) {
                tracing::info!(job_id = %job.id, backend = key, next_call_at_ms, "the model server's circuit breaker is open past this job's latest useful start: ending it without a call");
                return Gate::Settle(w.upstream_unavailable(&ctx.cfg.policy, now));
            }
            Gate::Wait(w, next_call_at_ms)
        }
    }
}

/// Hold a job (without a slot) while its model server's breaker is open: until about
/// `next_call_at_ms`, a change of the breaker, a cancellation, a shutdown or the loss of
/// the channel. `Ok`: wait for a slot again (and ask the breaker again).
async fn until_breaker(
    ctx: &Ctx,
    job: &Job,
    waiting: Waiting,
    next_call_at_ms: i64,
    cancel: &CancelGuard,
) -> Result<Waiting, Waited> {
    let changed = ctx.breakers.changed.notified();
    WorkerStats::add(&ctx.stats.waiting, 1);
    let end = tokio::select! {
        _ = ctx.clock.sleep_until(next_call_at_ms + 1) => Ok(waiting),
        _ = changed => Ok(waiting),
        _ = ctx.shutdown.cancelled() => Err(Waited::Finish(waiting.shutdown())),
        _ = job.lost.cancelled() => Err(Waited::Finish(waiting.channel_lost())),
        _ = cancel.token.cancelled() => Err(Waited::Settle(waiting.cancel())),
    };
    WorkerStats::add(&ctx.stats.waiting, -1);
    end
}

/// Take the job's rate-limit permit for its backend while it holds a slot
/// ([`crate::limits`]). When the permit is not there yet, the slot goes back at once (so
/// a job of another backend, or one whose permit is there, can run meanwhile) and the job
/// waits for the permit if it comes no later than its latest useful start; else it ends
/// now, without a call (`admission:rate_limited`). The last admission check runs after
/// this, at the slot.
fn rate_limit(ctx: &Ctx, job: &mut Job, w: Waiting, permit: SlotPermit, now: i64) -> Gate {
    if job.rate.is_some() {
        return Gate::Go(w, permit);
    }
    let kind = w.env().kind().as_str();
    let key = job.backend.clone();
    let key = key.as_str();
    let tokens = lastcall_core::rate_limit::reserved_tokens(job.size);
    match ctx.limits.try_take(key, tokens, now) {
        Ok(taken) => {
            job.rate = Some(taken);
            Gate::Go(w, permit)
        }
        Err(permit_at) => {
            drop(permit);
            // A half-open trial this job got goes to the next job.
            job.trial = None;
            let learned = job.learned(ctx, kind, now);
            let latest = w.latest_start_ms(&ctx.cfg.policy, learned.map(|e| e.quantile_ms));
            let too_late = match permit_at {
                None => true,
                Some(at) => latest.is_some_and(|latest| at > latest),
            };
            if too_late {
                tracing::info!(job_id = %job.id, backend = key, permit_at_ms = permit_at, latest_start_ms = latest, tokens, "the backend's next rate-limit permit comes after this job's latest useful start: ending it without a call");
                ctx.limits.refused();
                return Gate::Settle(w.rate_limited(&ctx.cfg.policy, now));
            }
            Gate::Wait(w, permit_at.unwrap_or(now))
        }
    }
}

/// Hold a job (without a slot) until about `permit_at_ms`, when its rate-limit permit
/// comes, or a permit is given back, a cancellation, a shutdown or the loss of the channel.
/// `Ok`: wait for a slot again (and take the permit then).
async fn until_permit(
    ctx: &Ctx,
    job: &Job,
    waiting: Waiting,
    permit_at_ms: i64,
    cancel: &CancelGuard,
) -> Result<Waiting, Waited> {
    let changed = ctx.limits.changed.notified();
    WorkerStats::add(&ctx.stats.waiting, 1);
    WorkerStats::add(&ctx.stats.rate_limit_waiting, 1);
    let end = tokio::select! {
        _ = ctx.clock.sleep_until(permit_at_ms) => Ok(waiting),
        _ = changed => Ok(waiting),
        _ = ctx.shutdown.cancelled() => Err(Waited::Finish(waiting.shutdown())),
        _ = job.lost.cancelled() => Err(Waited::Finish(waiting.channel_lost())),
        _ = cancel.token.cancelled() => Err(Waited::Settle(waiting.cancel())),
    };
    WorkerStats::add(&ctx.stats.rate_limit_waiting, -1);
    WorkerStats::add(&ctx.stats.waiting, -1);
    end
}

/// One wait in the buffer: until a slot, the latest useful start, a cancellation, a
/// shutdown or the loss of the channel.
async fn buffered(
    ctx: &Ctx,
    job: &mut Job,
    mut waiting: Waiting,
    mean_ms: u64,
    cancel: &CancelGuard,
) -> Slotted {
    let policy = &ctx.cfg.policy;
    let kind = waiting.env().kind().as_str().to_owned();
    let acquire = ctx
        .slots
        .acquire(super::ticket(waiting.env(), job.msg.receipt, mean_ms));
    tokio::pin!(acquire);
    WorkerStats::add(&ctx.stats.waiting, 1);
    let end = loop {
        let now = ctx.clock.now_ms();
        // On a fallback route the latest useful start is the chosen backend's: when the
        // first backend's has passed, a faster one of the route may still take the job.
        job.choose_backend(ctx, waiting.env(), now);
        let latest =
            waiting.latest_start_ms(policy, job.learned(ctx, &kind, now).map(|e| e.quantile_ms));
        // On the worker's clock: a test's manual clock moved past it fires it at once.
        let until = ctx.clock.sleep_until(latest.unwrap_or(now) + 1);
        tokio::select! {
            p = &mut acquire => break Slotted::Slot(waiting, p),
            _ = ctx.shutdown.cancelled() => break Slotted::Finish(waiting.shutdown()),
            _ = job.lost.cancelled() => break Slotted::Finish(waiting.channel_lost()),
            _ = cancel.token.cancelled() => break Slotted::Settle(waiting.cancel()),
            _ = until, if latest.is_some() => {
                let now = ctx.clock.now_ms();
                job.choose_backend(ctx, waiting.env(), now);
                let learned = job.learned(ctx, &kind, now);
                match waiting.latest_start_reached(policy, learned.map(|e| e.quantile_ms), now) {
                    // Still admissible (the estimate changed): keep waiting.
                    WaitTick::Keep(w) => waiting = w,
                    WaitTick::Settle(s) => {
                        // This is the job's last admission check: it counts as one, like
                        // the check at a slot (the dwell histogram matches the ledger).
                        if let Settle::Record(r) = &s {
                            let dwell = now - r.facts().received_at_ms;
                            (ctx.stats.metrics.consumer_dwell).observe_ms(dwell);
                            job.note = learned_note(learned, r.terminal());
                        }
                        break Slotted::Settle(s);
                    }
                }
            }
        }
    };
    WorkerStats::add(&ctx.stats.waiting, -1);
    end
}

/// Hold the job until the clock may be trusted, without holding a slot meanwhile.
/// `Ok`: wait for a slot again.
async fn for_clock(ctx: &Ctx, job: &Job, mut c: ClockWait) -> Result<Waiting, Waited> {
    tracing::warn!(state = ?ctx.clock.sync_state(), "clock not known to be synchronised: admission stopped (--clock-sync require)");
    let kind = c.env().kind().as_str().to_owned();
    WorkerStats::add(&ctx.stats.waiting, 1);
    let end = loop {
        let now = ctx.clock.now_ms();
        let learned = job.learned(ctx, &kind, now).map(|e| e.quantile_ms);
        c = match c.tick(&ctx.cfg.policy, learned, now) {
            ClockTick::Keep(c) => c,
            ClockTick::Settle(s) => break Err(Waited::Settle(s)),
        };
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(200)) => {}
            _ = ctx.shutdown.cancelled() => break Err(Waited::Finish(c.shutdown())),
            _ = job.lost.cancelled() => break Err(Waited::Finish(c.channel_lost())),
        }
        if ctx.cfg.clock_sync.admits(ctx.clock.as_ref()) {
            break Ok(c.trusted());
        }
    };
    WorkerStats::add(&ctx.stats.waiting, -1);
    end
}
