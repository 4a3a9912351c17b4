//! The wait for a model slot in the bounded local buffer (priority tiers, fair share among
//! tenants, then `--buffer-order` within a tenant: [`crate::slots`]), and for a trusted
//! clock: the IO of [`Action::AwaitSlot`](lastcall_core::delivery::Action::AwaitSlot) and
//! [`Action::AwaitClock`](lastcall_core::delivery::Action::AwaitClock).
//!
//! A job that can no longer finish in time leaves the buffer as soon as that is known,
//! not when it reaches a slot: the core settles it at its latest useful start
//! ([`Delivery::poll_timeout`]), which frees its prefetch place for a job that can still
//! make it.

use super::Job;
use crate::ctx::Calls;
use crate::slots::SlotPermit;
use crate::stats::WorkerStats;
use lastcall_core::breaker::Permit;
use lastcall_core::delivery::{Action, ClockState, Delivery, Event};
use std::time::Duration;

/// One wait for a slot, then the gates of the job's backend (breaker, rate limit) and the
/// core's last admission check. The delivery leaves [`Action::AwaitSlot`] unless a gate
/// makes the job wait without its slot: the driver then comes back here (a slot again,
/// and the gates again).
pub(crate) async fn for_slot(ctx: &Calls<'_>, job: &mut Job, d: &mut Delivery) {
    let Some(permit) = buffered(ctx, job, d).await else {
        return;
    };
    crate::hooks::hold_before_admission(ctx.cfg).await;
    // Fail closed while the clock's sync state forbids admission.
    let clock = if ctx.cfg.clock_sync.admits(ctx.clock.as_ref()) {
        ClockState::Trusted
    } else {
        ClockState::Untrusted
    };
    let now = ctx.clock.now_ms();
    let Some(kind) = d.env().map(|e| e.kind().as_str().to_owned()) else {
        return;
    };
    // On a fallback route: the backend of the route that can take the job now (or the
    // one to wait for); the gates below run on it.
    if let Some(env) = d.env() {
        job.choose_backend(ctx, env, now);
    }
    // The model server's circuit breaker: no call to a server known to be down.
    let Some(permit) = breaker(ctx, job, d, &kind, permit, now).await else {
        return;
    };
    // The backend's rate limits: no call without a permit.
    let Some(permit) = rate_limit(ctx, job, d, &kind, permit, now).await else {
        return;
    };
    // A job kept waiting for a probe is judged by the estimate again now that it holds a
    // slot: it runs as a probe, or the estimate refuses it.
    job.probe_candidate = false;
    let learned = job.learned(ctx, &kind, now);
    // This job holds a free slot: if the estimate alone refuses it, it may probe.
    let learned = match d.env() {
        Some(env) => job.maybe_probe(ctx, env, learned, true, now),
        None => learned,
    };
    let received_at_ms = d.facts().map_or(now, |f| f.received_at_ms);
    d.handle(&ctx.cfg.policy, Event::SlotGranted { clock, learned }, now);
    if clock == ClockState::Trusted {
        tracing::Span::current().record("checked_at_ms", now);
        (ctx.stats.metrics.consumer_dwell).observe_ms(now - received_at_ms);
    }
    match d.poll_action() {
        Action::WriteStart => {
            let budget_ms = d.budget_ms().unwrap_or(0);
            (ctx.stats.metrics.remaining_budget).observe_ms(budget_ms as i64);
            job.permit = Some(permit);
        }
        // The broker's ack window (its consumer timeout, when known) closed while the job
        // waited: not started, handed back; the redelivery has a fresh window.
        Action::Finish(_) => {
            job.rate = None;
            tracing::info!(job_id = %job.id, "the broker's ack window (consumer_timeout) closed while the job waited for a slot: handing it back for redelivery");
        }
        // Refused by the last check, or waiting for the clock without its slot.
        _ => job.rate = None,
    }
}

/// Ask the job's model server's breaker whether its call may go out now. A half-open
/// breaker's one trial goes to this job (`job.trial`), and so does an open one's demand
/// trial when the job cannot wait for its cool-down's end; an open one keeps the job waiting,
/// without its slot, while its budget still allows a call after the breaker's next
/// trial, and ends it without a call (`admission:upstream_unavailable`) otherwise.
/// `Some`: the call may go out, with the slot.
async fn breaker(
    ctx: &Calls<'_>,
    job: &mut Job,
    d: &mut Delivery,
    kind: &str,
    permit: SlotPermit,
    now: i64,
) -> Option<SlotPermit> {
    if job.trial.is_some() {
        return Some(permit);
    }
    let key = job.backend.clone();
    let key = key.as_str();
    // A trial running past the hang limit of the kind's completed calls has failed.
    let trial_limit = ctx.trial_limit_ms(kind, key, now);
    // The door refuses a kind whose breakers are open on every live worker; a kind on a
    // fallback route is not recorded there (another backend of its route may take it).
    let for_door = (ctx.route(kind).len() == 1).then_some(kind);
    let policy = &ctx.cfg.policy;
    let ask = |latest| ctx.breakers.permit(key, for_door, trial_limit, latest, now);
    // Only when the breaker keeps the job waiting (not on the hot path of a closed one) is
    // its latest start asked for: a job that cannot wait for the cool-down's end may take
    // a demand trial.
    let (learned, answer) = match ask(None) {
        (Permit::Wait { .. }, _) => {
            let learned = job.learned(ctx, kind, now);
            (learned, ask(d.latest_start_ms(policy, learned)))
        }
        answer => (None, answer),
    };
    let next_call_at_ms = match answer {
        (Permit::Call, _) => return Some(permit),
        (Permit::Trial, trial) => {
            job.trial = trial;
            return Some(permit);
        }
        (Permit::Wait { next_call_at_ms }, _) => next_call_at_ms,
    };
    drop(permit);
    d.handle(
        policy,
        Event::BreakerOpen {
            next_call_at_ms,
            learned,
        },
        now,
    );
    if d.poll_action() != Action::AwaitSlot {
        tracing::info!(job_id = %job.id, backend = key, next_call_at_ms, "the model server's circuit breaker is open past this job's latest useful start: ending it without a call");
        return None;
    }
    // Hold the job (without a slot) until about the breaker's next trial or a change of
    // the breaker.
    let changed = ctx.breakers.changed.notified();
    hold_without_slot(ctx, job, d, next_call_at_ms + 1, changed).await;
    None
}

/// Take the job's rate-limit permit for its backend while it holds a slot
/// ([`crate::limits`]). When the permit is not there yet, the slot goes back at once (so
/// a job of another backend, or one whose permit is there, can run meanwhile) and the job
/// waits for the permit if it comes no later than its latest useful start; else it ends
/// now, without a call (`admission:rate_limited`). The last admission check runs after
/// this, at the slot. `Some`: the permit is taken, the slot kept.
async fn rate_limit(
    ctx: &Calls<'_>,
    job: &mut Job,
    d: &mut Delivery,
    kind: &str,
    permit: SlotPermit,
    now: i64,
) -> Option<SlotPermit> {
    if job.rate.is_some() {
        return Some(permit);
    }
    let key = job.backend.clone();
    let key = key.as_str();
    let tokens = lastcall_core::rate_limit::reserved_tokens(job.size);
    let permit_at = match ctx.limits.try_take(key, tokens, now) {
        Ok(taken) => {
            job.rate = Some(taken);
            return Some(permit);
        }
        Err(permit_at) => permit_at,
    };
    drop(permit);
    // A half-open trial this job got goes to the next job.
    job.trial = None;
    let policy = &ctx.cfg.policy;
    let learned = job.learned(ctx, kind, now);
    let permit_at_ms = permit_at;
    d.handle(
        policy,
        Event::NoRatePermit {
            permit_at_ms,
            learned,
        },
        now,
    );
    if d.poll_action() != Action::AwaitSlot {
        tracing::info!(job_id = %job.id, backend = key, permit_at_ms, tokens, "the backend's next rate-limit permit comes after this job's latest useful start: ending it without a call");
        ctx.limits.refused();
        return None;
    }
    // Hold the job (without a slot) until about the permit's instant or a permit given
    // back.
    let changed = ctx.limits.changed.notified();
    WorkerStats::add(&ctx.stats.rate_limit_waiting, 1);
    hold_without_slot(ctx, job, d, permit_at.unwrap_or(now), changed).await;
    WorkerStats::add(&ctx.stats.rate_limit_waiting, -1);
    None
}

/// Hold a job that a gate (the breaker, the rate limit) keeps waiting without its slot:
/// until `until_ms`, a change of that gate (`changed`), a cancellation, a shutdown or the
/// loss of the channel. The last three are reported to the delivery; after the first two
/// the driver asks for a slot again.
async fn hold_without_slot(
    ctx: &Calls<'_>,
    job: &Job,
    d: &mut Delivery,
    until_ms: i64,
    changed: tokio::sync::futures::Notified<'_>,
) {
    let cancel = job
        .cancel
        .as_ref()
        .map(|c| c.token.clone())
        .unwrap_or_default();
    WorkerStats::add(&ctx.stats.waiting, 1);
    let event = tokio::select! {
        _ = ctx.clock.sleep_until(until_ms) => None,
        _ = changed => None,
        _ = ctx.shutdown.cancelled() => Some(Event::Shutdown),
        _ = job.lost.cancelled() => Some(Event::ChannelLost),
        _ = cancel.cancelled() => Some(Event::Cancel),
    };
    WorkerStats::add(&ctx.stats.waiting, -1);
    if let Some(event) = event {
        d.handle(&ctx.cfg.policy, event, ctx.clock.now_ms());
    }
}

/// One wait in the buffer: until a slot (`Some`), or the latest useful start when the
/// core then settles the job, a cancellation, a shutdown or the loss of the channel.
async fn buffered(ctx: &Calls<'_>, job: &mut Job, d: &mut Delivery) -> Option<SlotPermit> {
    let policy = &ctx.cfg.policy;
    let (kind, ticket) = {
        let env = d.env()?;
        let ticket = super::ticket(env, job.msg.receipt, job.work_ms);
        (env.kind().as_str().to_owned(), ticket)
    };
    let acquire = ctx.slots.acquire(ticket);
    tokio::pin!(acquire);
    let cancel = job
        .cancel
        .as_ref()
        .map(|c| c.token.clone())
        .unwrap_or_default();
    WorkerStats::add(&ctx.stats.waiting, 1);
    let permit = loop {
        let now = ctx.clock.now_ms();
        // On a fallback route the latest useful start is the chosen backend's: when the
        // first backend's has passed, a faster one of the route may still take the job.
        if let Some(env) = d.env() {
            job.choose_backend(ctx, env, now);
        }
        d.handle(policy, Event::Estimate(job.learned(ctx, &kind, now)), now);
        let latest = d.poll_timeout(policy);
        // On the worker's clock: a test's manual clock moved past it fires it at once.
        let until = ctx.clock.sleep_until(latest.unwrap_or(now) + 1);
        let event = tokio::select! {
            p = &mut acquire => break Some(p),
            _ = ctx.shutdown.cancelled() => Event::Shutdown,
            _ = job.lost.cancelled() => Event::ChannelLost,
            _ = cancel.cancelled() => Event::Cancel,
            _ = until, if latest.is_some() => {
                let now = ctx.clock.now_ms();
                if let Some(env) = d.env() {
                    job.choose_backend(ctx, env, now);
                }
                Event::Timeout { learned: job.learned(ctx, &kind, now) }
            }
        };
        let timeout = matches!(event, Event::Timeout { .. });
        let now = ctx.clock.now_ms();
        d.handle(policy, event, now);
        match d.poll_action() {
            // Still admissible (the estimate changed): keep waiting.
            Action::AwaitSlot => {}
            Action::Record if timeout => {
                // This was the job's last admission check: it counts as one, like the
                // check at a slot (the dwell histogram matches the ledger).
                let received_at_ms = d.facts().map_or(now, |f| f.received_at_ms);
                (ctx.stats.metrics.consumer_dwell).observe_ms(now - received_at_ms);
                break None;
            }
            _ => break None,
        }
    };
    WorkerStats::add(&ctx.stats.waiting, -1);
    permit
}

/// Hold the job until the clock may be trusted, without holding a slot meanwhile, and
/// let the core look now and then whether it can still pass the admission check.
pub(crate) async fn for_clock(ctx: &Calls<'_>, job: &Job, d: &mut Delivery) {
    tracing::warn!(state = ?ctx.clock.sync_state(), "clock not known to be synchronised: admission stopped (--clock-sync require)");
    let policy = &ctx.cfg.policy;
    let Some(kind) = d.env().map(|e| e.kind().as_str().to_owned()) else {
        return;
    };
    WorkerStats::add(&ctx.stats.waiting, 1);
    while d.poll_action() == Action::AwaitClock {
        let now = ctx.clock.now_ms();
        let learned = job.learned(ctx, &kind, now);
        d.handle(policy, Event::Timeout { learned }, now);
        if d.poll_action() != Action::AwaitClock {
            break;
        }
        let event = tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(200)) => None,
            _ = ctx.shutdown.cancelled() => Some(Event::Shutdown),
            _ = job.lost.cancelled() => Some(Event::ChannelLost),
        };
        let event = match event {
            Some(e) => e,
            None if ctx.cfg.clock_sync.admits(ctx.clock.as_ref()) => Event::ClockTrusted,
            None => continue,
        };
        d.handle(policy, event, ctx.clock.now_ms());
    }
    WorkerStats::add(&ctx.stats.waiting, -1);
}
