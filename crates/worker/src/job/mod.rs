//! The driver of one delivery: one loop that asks the core's state machine
//! ([`lastcall_core::delivery::Delivery`]) for its next [`Action`], carries it out, and
//! reports what happened (ledger answers, slots, the clock, the call's end, shutdown, a
//! lost channel, a cancellation) as [`Event`]s. The decisions are the core's; this module
//! only does the IO. A state added to the core that asks for an existing action needs no
//! change here.
//!
//! The actions' IO:
//! - `look_up`: the receipt (the holds of `crate::lease`, then the ledger lookup);
//! - `write_start`: the durable `running` row;
//! - [`wait`]: the wait for a slot (its order, latest useful start, breaker, rate limit,
//!   cancel) and for the clock;
//! - [`call`]: the model call; [`settle`]: publish a retry, record, finish with the broker;
//! - [`record`]: the ledger rows.

mod call;
mod record;
mod settle;
mod wait;

use crate::ctx::{Calls, Ctx};
use crate::held::{CancelGuard, InFlight};
use crate::lease::{self, Interrupted};
use crate::settle::{Durable, Receipt, Ticket};
use crate::slots::SlotPermit;
use lastcall_backend::CancellationToken;
use lastcall_core::delivery::{Action, Decision, Delivery, Event};
use lastcall_core::fallback::{self, Candidate};
use lastcall_core::request_size::RequestSize;
use lastcall_core::service_time::Estimate;
use lastcall_core::{Envelope, JobId, ReceiptFacts, job_id_for};
use lastcall_store::LedgerWrite;
use std::sync::Arc;
use tracing::Instrument;

/// A delivery's properties; its `Settler` went into its [`Ticket`].
pub(crate) struct Msg {
    pub(crate) body: Vec<u8>,
    pub(crate) redelivered: bool,
    pub(crate) message_id: Option<String>,
    pub(crate) attempt: u32,
    pub(crate) signature: Option<String>,
    pub(crate) timestamp_s: Option<u64>,
    pub(crate) reply_to: Option<String>,
    /// This worker's receipt number of the delivery ([`crate::slots::Slots::receipt`]):
    /// its place in the buffer's FIFO order.
    pub(crate) receipt: u64,
}

/// What the driver holds of one delivery besides the state machine.
pub(crate) struct Job {
    msg: Msg,
    /// The delivery's place in its channel's ack bookkeeping; consumed by its settlement.
    ticket: Ticket,
    /// Fires when the delivery's channel (generation) is lost.
    lost: CancellationToken,
    id: String,
    /// Model calls of earlier deliveries of this job (the ledger's count at receipt).
    prior_starts: u32,
    /// Set when the job runs as a probe: the learned estimate refused it while a slot was
    /// free ([`crate::times::Probe`]); its checks then use the floor, not the estimate.
    probe: Option<crate::times::Probe>,
    /// Set while the job waits for a slot to try a probe: at receipt the learned estimate
    /// alone refused it, no slot was free, and a probe may question that refusal
    /// ([`crate::times::CallTimes::may_probe`]). Its checks use the floor until its slot.
    probe_candidate: bool,
    /// The request's size as the kind's backend measures it
    /// ([`lastcall_backend::Backend::request_size`]: the model's tokenizer where it has
    /// one), for the request-aware call-time estimate.
    size: Option<RequestSize>,
    /// The request's size by the documented approximation ([`RequestSize::of_payload`]),
    /// the one the ledger records (`request_tokens`): the measure the door has too.
    payload_size: Option<RequestSize>,
    /// Set when this job's call is its model server's half-open breaker trial.
    trial: Option<crate::breakers::Trial>,
    /// The rate-limit permit this job took for its call; given back if dropped unused.
    rate: Option<crate::limits::Taken>,
    /// The backend this job's call goes to: its route's first, or the one
    /// [`Job::choose_backend`] chose on a fallback route. Its breaker, limiter and learned
    /// call times are the ones that apply, and the ledger's `backend` names it.
    backend: String,
    /// The mean learned call time at receipt: the job's work in the buffer's order.
    work_ms: u64,
    /// Its cancellation watch, from its first wait for a slot to its end.
    cancel: Option<CancelGuard>,
    /// The model slot it holds, from the slot to the end of its call.
    permit: Option<SlotPermit>,
    /// Its claim on the job's call in this process (a redelivery waits for it), from the
    /// start write to its end.
    running: Option<InFlight>,
    /// What its model call produced, for the outcome row.
    call: Option<call::Call>,
    /// The settlement door's proof that the delivery's outcome is durable (written, or
    /// found recorded at receipt): what its ack needs.
    durable: Option<Durable>,
}

impl Job {
    /// The learned call time that applies to this job on its backend: none for a probe, or
    /// for a job waiting to try one.
    fn learned(&self, ctx: &Calls<'_>, kind: &str, now_ms: i64) -> Option<Estimate> {
        if self.probe.is_some() || self.probe_candidate {
            return None;
        }
        ctx.times.learned(kind, &self.backend, self.size, now_ms)
    }

    /// On a fallback route (a kind routed to several backends in order), choose the
    /// backend for this job's call now ([`fallback::choose`]): the first whose breaker
    /// and rate-limit permit let the call through and whose learned call time for the kind
    /// fits the job's room; else the one to wait for, or to be refused by. The gates that
    /// follow (breaker, rate limit, admission) run on the chosen backend. A job holding
    /// its backend's half-open trial or rate-limit permit keeps that backend; a kind with
    /// one backend has nothing to choose.
    fn choose_backend(&mut self, ctx: &Calls<'_>, env: &Envelope, now_ms: i64) {
        if self.trial.is_some() || self.rate.is_some() {
            return;
        }
        let kind = env.kind().as_str();
        let route = ctx.route(kind);
        if route.len() < 2 {
            return;
        }
        let policy = &ctx.cfg.policy;
        let tokens = lastcall_core::rate_limit::reserved_tokens(self.size);
        let candidates: Vec<Candidate> = (route.iter())
            .map(|&b| {
                let exempt = self.probe.is_some() || self.probe_candidate;
                let learned = match exempt {
                    true if b == self.backend => None,
                    _ => ctx.times.learned(kind, b, self.size, now_ms),
                };
                let learned_ms = learned.map(|e| e.quantile_ms);
                Candidate {
                    breaker_at_ms: (ctx.breakers).next_call_at(
                        b,
                        ctx.trial_limit_ms(kind, b, now_ms),
                        now_ms,
                    ),
                    permit_at_ms: ctx.limits.permit_at(b, tokens, now_ms),
                    latest_start_ms: (policy.watches_latest_start())
                        .then(|| policy.latest_start_ms(env, learned_ms)),
                }
            })
            .collect();
        let choice = fallback::choose(&candidates, now_ms);
        let chosen = route[choice.backend()];
        if chosen != self.backend {
            tracing::debug!(job_id = %self.id, from = %self.backend, to = chosen, ?choice, "fallback route: the job goes to another backend of its route");
            // A probe (or the wait for one) was of the estimate of the backend left.
            self.probe = None;
            self.probe_candidate = false;
            self.backend = chosen.to_owned();
        }
    }

    /// The learned estimate alone refuses this job now: with a slot free (`slot_free`), run
    /// it as a probe if the estimator allows one; with none free (at receipt, under load),
    /// let it wait judged without the estimate if a probe may question the refusal — the
    /// probe is tried at its slot, and without one the estimate refuses it there. Returns
    /// the estimate that applies.
    fn maybe_probe(
        &mut self,
        ctx: &Calls<'_>,
        env: &Envelope,
        learned: Option<Estimate>,
        slot_free: bool,
        now_ms: i64,
    ) -> Option<Estimate> {
        let policy = &ctx.cfg.policy;
        let room = policy.refused_by_learned(env, learned.map(|e| e.quantile_ms), now_ms);
        let kind = env.kind().as_str();
        if let Some(room) = room.filter(|_| self.probe.is_none() && slot_free) {
            self.probe = ctx
                .times
                .try_probe(kind, &self.backend, self.size, room, now_ms);
        }
        if self.probe.is_some() {
            return None;
        }
        if let Some(room) = room.filter(|_| !slot_free)
            && ctx
                .times
                .may_probe(kind, &self.backend, self.size, room, now_ms)
        {
            self.probe_candidate = true;
            return None;
        }
        if room.is_some() && slot_free && ctx.slots.inflation() > 1.0 {
            // Refused with a slot free: if the learned time alone admits it, the adaptive
            // limit's predicted slowdown did (it then ends the level it cannot fill).
            let alone = ctx
                .times
                .learned_alone(kind, &self.backend, self.size, now_ms);
            if matches!(
                policy.on_slot(env, alone.map(|e| e.quantile_ms), now_ms),
                lastcall_core::disposition::Slot::Run { .. }
            ) {
                ctx.slots.refused_by_inflation(now_ms);
            }
        }
        learned
    }
}

/// One delivery, from receipt to its settlement.
pub(crate) async fn handle(
    ctx: Arc<Ctx>,
    msg: Msg,
    ticket: Ticket,
    lost: CancellationToken,
    received_at_ms: i64,
) {
    let parsed = Envelope::parse(&msg.body, &ctx.cfg.policy.limits, received_at_ms);
    let parsed = lastcall_core::signature::require_signature(
        ctx.cfg.signing_key.as_ref(),
        parsed,
        &msg.body,
        msg.signature.as_deref(),
        msg.message_id.as_deref(),
    );
    let signing = ctx.cfg.signing_key.is_some();
    let job_id: JobId = job_id_for(&parsed, msg.message_id.as_deref(), &msg.body, signing);
    let span = tracing::info_span!(
        "job",
        job_id = %job_id,
        attempt = msg.attempt,
        received_at_ms,
        checked_at_ms = tracing::field::Empty,
        expires_at_ms = tracing::field::Empty,
        redelivered = msg.redelivered,
    );
    if let Ok(e) = &parsed {
        span.record("expires_at_ms", e.deadline().expires_at_ms());
    }
    ctx.stats.metrics.observe_receipt(
        parsed.as_ref().ok().map(|e| e.deadline().created_at_ms()),
        msg.attempt,
        msg.timestamp_s,
        received_at_ms,
    );
    let ct = ctx.cfg.consumer_timeout.map(|d| d.as_millis() as u64);
    let payload_size = (parsed.as_ref().ok()).and_then(|e| RequestSize::of_payload(&e.payload));
    let size = (parsed.as_ref().ok())
        .and_then(|e| ctx.backend.request_size(e.kind().as_str(), &e.payload));
    let backend = match &parsed {
        Ok(e) => ctx.backend.first_route(e.kind().as_str()),
        Err(_) => ctx.backend.name(),
    }
    .to_owned();
    let delivery = Delivery::new(parsed, msg.attempt, received_at_ms, ct);
    let job = Job {
        backend,
        msg,
        ticket,
        lost,
        id: job_id.to_string(),
        prior_starts: 0,
        probe: None,
        probe_candidate: false,
        size,
        payload_size,
        trial: None,
        rate: None,
        work_ms: 0,
        cancel: None,
        permit: None,
        running: None,
        call: None,
        durable: None,
    };
    drive(ctx, job, delivery).instrument(span).await;
}

/// Carry out what the state machine asks for, to the delivery's end.
async fn drive(ctx: Arc<Ctx>, mut job: Job, mut d: Delivery) {
    loop {
        match d.poll_action() {
            Action::LookUp => look_up(&ctx, &mut job, &mut d).await,
            Action::AwaitSlot => {
                if job.cancel.is_none() {
                    job.cancel = Some(CancelGuard::register(&ctx.held, &job.id));
                }
                wait::for_slot(&ctx.calls(), &mut job, &mut d).await;
            }
            Action::AwaitClock => wait::for_clock(&ctx.calls(), &job, &mut d).await,
            Action::WriteStart => write_start(&ctx, &mut job, &mut d).await,
            Action::Call { budget_ms } => {
                call::call(&ctx.calls(), &mut job, &mut d, budget_ms).await
            }
            Action::PublishRetry(retry) => {
                settle::publish_retry(&ctx.recording(), &job, &mut d, retry).await
            }
            Action::Record => settle::record(&ctx.recording(), &mut job, &mut d).await,
            Action::Finish(f) => return settle::finish(&ctx.recording(), job, &d, f).await,
        }
    }
}

/// The durable `running` row, then the core's check once more (the write took time).
async fn write_start(ctx: &Arc<Ctx>, job: &mut Job, d: &mut Delivery) {
    // From here the call is this process's: a redelivery of the job waits for it.
    let Some(running) = InFlight::claim(&ctx.held, &job.id) else {
        // Another delivery of the same job got here first (a redelivery raced its first
        // delivery): start over from the receipt, which waits for that call. Its slot and
        // rate-limit permit go back meanwhile.
        job.permit = None;
        job.rate = None;
        return d.handle(
            &ctx.cfg.policy,
            Event::AlreadyRunningHere,
            ctx.clock.now_ms(),
        );
    };
    job.running = Some(running);
    let row = record::start_row(&ctx.cfg.name, job, d);
    if ctx.door.commit(LedgerWrite::Start(row)).await.is_none() {
        return d.handle(&ctx.cfg.policy, Event::Shutdown, ctx.clock.now_ms());
    }
    let now = ctx.clock.now_ms();
    if job.lost.is_cancelled() {
        d.handle(&ctx.cfg.policy, Event::ChannelLost, now);
    }
    let learned = d
        .env()
        .and_then(|e| job.learned(&ctx.calls(), e.kind().as_str(), now));
    let cancel_requested = (job.cancel.as_ref()).is_some_and(|c| c.token.is_cancelled());
    let started = Event::StartDurable {
        learned,
        cancel_requested,
    };
    d.handle(&ctx.cfg.policy, started, now);
    if matches!(d.poll_action(), Action::Call { .. }) {
        return;
    }
    job.permit = None;
    job.rate = None;
    if d.decision() == Some(Decision::HandedBack) {
        tracing::info!(job_id = %job.id, "the broker's ack window (consumer_timeout) closed while the start was written: handing the job back unstarted");
    }
}

/// The receipt: hold the job while a call of it still runs (here or on another live
/// worker), look it up, and let the core decide.
async fn look_up(ctx: &Ctx, job: &mut Job, d: &mut Delivery) {
    let policy = &ctx.cfg.policy;
    let interrupted = |why: Interrupted| match why {
        Interrupted::Shutdown => Event::Shutdown,
        Interrupted::ChannelLost => Event::ChannelLost,
    };
    let valid = d.env().is_some();
    // A redelivery of a job whose call still runs here (its first delivery's channel was
    // lost): hold it, without a slot, until that call has settled; the ledger then says it
    // is recorded and it is acked as a duplicate — no second model call.
    if valid && let Err(why) = lease::hold_while_running_here(ctx, &job.id, &job.lost).await {
        return d.handle(policy, interrupted(why), ctx.clock.now_ms());
    }
    let Some(receipt) = ctx.door.receipt_info(&job.id).await else {
        return d.handle(policy, Event::Shutdown, ctx.clock.now_ms());
    };
    let info = match held_elsewhere(ctx, job, valid, receipt).await {
        Ok(Some(Receipt { info, recorded })) => {
            job.durable = recorded;
            info
        }
        Ok(None) => return d.handle(policy, Event::Shutdown, ctx.clock.now_ms()),
        Err(why) => return d.handle(policy, interrupted(why), ctx.clock.now_ms()),
    };
    job.prior_starts = info.prior_starts;
    let at = d.facts().map_or(0, |f| f.received_at_ms);
    let calls = ctx.calls();
    let learned = d.env().and_then(|e| {
        job.choose_backend(&calls, e, at);
        let learned = job.learned(&calls, e.kind().as_str(), at);
        job.maybe_probe(&calls, e, learned, ctx.slots.available() > 0, at)
    });
    job.work_ms = learned.map_or(0, |l| l.mean_ms);
    let facts = ReceiptFacts {
        already_recorded: info.already_recorded,
        prior_starts: info.prior_starts,
        cancel_requested: info.cancel_requested,
        expected_wait_ms: d.env().map_or(0, |e| {
            calls.expected_wait_ms(&ticket(e, job.msg.receipt, job.work_ms))
        }),
        learned_runtime_ms: None,
        peer: d
            .env()
            .filter(|_| !job.msg.redelivered)
            .and_then(|e| best_peer(ctx, job, e.kind().as_str(), at)),
    };
    if let Some(Err(e)) = d.parsed() {
        tracing::warn!(reason = e.reason.as_str(), error = %e, "rejecting invalid envelope");
    }
    d.handle(policy, Event::Looked { facts, learned }, at);
}

/// The best other worker for a job of `kind` this worker refuses at receipt, by the
/// leases read at its last renewal: its call time for this request by the model its lease
/// publishes ([`lastcall_core::live::best_peer`]).
fn best_peer(ctx: &Ctx, job: &Job, kind: &str, now_ms: i64) -> Option<lastcall_core::PeerOffer> {
    let peers = ctx.stats.peers.lock().unwrap_or_else(|e| e.into_inner());
    lastcall_core::live::best_peer(&peers, &ctx.cfg.name, kind, job.size, now_ms)
}

/// The job's place in the buffer's order ([`crate::slots`]).
pub(crate) fn ticket(
    env: &Envelope,
    receipt: u64,
    work_ms: u64,
) -> lastcall_core::schedule::Ticket {
    lastcall_core::schedule::Ticket {
        receipt,
        deadline_ms: env.deadline().expires_at_ms(),
        work_ms,
        tenant: env.tenant().to_owned(),
        priority: env.priority(),
    }
}

/// A call of this job may still run on another worker (whose connection was lost, so the
/// broker redelivered the job here): hold it, without a slot, while that worker's lease
/// is fresh and its attempt unsettled; then read the ledger again. `Ok(None)`: shutdown.
async fn held_elsewhere(
    ctx: &Ctx,
    job: &Job,
    valid: bool,
    receipt: Receipt,
) -> Result<Option<Receipt>, Interrupted> {
    let info = &receipt.info;
    if !lastcall_core::lease::may_run_elsewhere(valid, info.prior_starts, info.already_recorded) {
        return Ok(Some(receipt));
    }
    if lease::hold_while_running_elsewhere(ctx, &job.id, &job.lost).await? {
        return Ok(ctx.door.receipt_info(&job.id).await);
    }
    Ok(Some(receipt))
}
