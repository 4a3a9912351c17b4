//! The life of one delivery in a worker, as a pure state machine.
//!
//! Written in the `quinn-proto` style: no IO, no clock reads. Its one door is
//! [`Delivery`]: the driver (the worker's runtime, the core's table tests) asks
//! [`Delivery::poll_action`] for the next step, carries it out, and reports what happened
//! with [`Delivery::handle`] (`now` is an argument); [`Delivery::poll_timeout`] says when
//! to look again. [`Finish`] cannot be made outside this module.
//!
//! Inside, each state is its own (private) type, and its methods are the only events it
//! accepts; each returns the next state or a [`Finish`]. So a state offers only its legal
//! continuations: a job admitted to run has no method that settles it without the start
//! row, a waiting job cannot be acked, a running call cannot be handed back. An event
//! that a state has no method for leaves it as it is.
//!
//! ```text
//! Received ──looked──▶ Waiting ──slot_granted──▶ Admitted ──start_durable──▶ Calling
//!    │                  │  ▲  │       (clock untrusted)  │                     │
//!    │                  │  │  └──▶ ClockWait ──trusted──┘ │                  call_ended
//!    ▼                  ▼  └── latest start: still fits  ▼                     ▼
//!  Settle ◀────────── refused, cancelled ◀──────────── expired, cancelled ── Settle
//!    ├─ Record(Recording) ──durable──▶ Finish::{Ack, DeadLetter, HandBack}
//!    ├─ PublishRetry(Publishing) ──published──▶ Recording; failed ──▶ Recording (dead letter)
//!    └─ Duplicate(Finish::Ack)
//! ```
//!
//! The decisions themselves are [`WorkerPolicy`]'s (`on_receipt`, `on_slot`,
//! `on_call_result`) and [`crate::ack_window::call_timeout`]'s; this module only orders
//! them and carries the facts the ledger records (the check, start and finish instants,
//! the minimum runtime of the last admission decision).
//!
//! The rules for the outside events:
//! - **shutdown**: a job that never started goes back to the broker unrecorded
//!   ([`FinishKind::HandBack`]); a durable write cut short by the shutdown sends nothing
//!   ([`FinishKind::Drop`]: the delivery stays unacked and the closing channel returns it);
//!   a running call is not interrupted here (the driver's grace period bounds it).
//! - **channel lost**: a job that never started is dropped locally ([`FinishKind::Drop`], the
//!   broker redelivers it); a started one goes on, records its outcome, and its ack or
//!   reject is dropped (a delivery tag of a dead channel means nothing on a new one).
//! - **cancel**: a waiting job is recorded `cancelled` without a call; after the start
//!   row it is checked once more ([`Event::StartDurable`]); the running call is
//!   aborted by the driver and ends as [`CallResult::Cancelled`].

// The states move by value, one step at a time, within one task: boxing the larger
// variants would allocate at every step to save a few hundred bytes of stack.
#![allow(clippy::large_enum_variant)]

use crate::ack_window::{self, CallTimeout};
use crate::disposition::{
    CallResult, Disposition, Receipt, ReceiptFacts, Slot, Terminal, WorkerPolicy,
};
use crate::envelope::{Envelope, RejectError};
use crate::outcome::State;
use crate::reason::Reason;
use crate::service_time::Estimate;

/// What is known of the delivery, for the ledger record.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Facts {
    /// The attempt number the delivery carries (0-based).
    pub attempt: u32,
    pub received_at_ms: i64,
    /// The last admission check (at the slot, or at the latest useful start).
    pub checked_at_ms: Option<i64>,
    /// When the model call started; `Some` means a model call was made.
    pub started_at_ms: Option<i64>,
    pub finished_at_ms: Option<i64>,
    /// The minimum useful runtime of the last admission decision (own, learned or floor).
    pub min_runtime_ms: Option<u64>,
    /// Refused for lack of time: the budget that check would have admitted at that instant
    /// ([`WorkerPolicy::min_feasible_budget_ms`]).
    pub min_feasible_budget_ms: Option<u64>,
    /// The delivery's channel is gone: its ack or reject can no longer be sent.
    pub channel_lost: bool,
    /// The broker's consumer timeout, when known ([`crate::ack_window`]).
    pub consumer_timeout_ms: Option<u64>,
}

/// The last step of a delivery with the broker. Only the core's transitions make one
/// (its field is private): a driver reads its [`kind`](Finish::kind) and cannot send a step
/// that the state machine did not choose.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Finish(FinishKind);

impl Finish {
    pub(crate) const ACK: Finish = Finish(FinishKind::Ack);
    pub(crate) const DEAD_LETTER: Finish = Finish(FinishKind::DeadLetter);
    pub(crate) const HAND_BACK: Finish = Finish(FinishKind::HandBack);
    pub(crate) const DROP: Finish = Finish(FinishKind::Drop);

    /// Which step it is.
    pub fn kind(self) -> FinishKind {
        self.0
    }
}

/// The steps a [`Finish`] can be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishKind {
    /// Ack it (coalesced with others: its outcome is durable, or it is a duplicate).
    Ack,
    /// Reject it without requeue, to the dead-letter exchange (outcome durable).
    DeadLetter,
    /// Requeue it: it never started, the next delivery checks it again.
    HandBack,
    /// Send nothing: the channel is gone, or the worker stopped before a durable write;
    /// the broker redelivers it.
    Drop,
}

/// What the ledger row of a delivery being recorded says was decided.
pub use crate::reason::Decision;

/// A delivery just received: the driver looks its job up in the ledger (and holds it
/// while a call of the same job still runs here or on another live worker).
#[derive(Debug, Clone)]
struct Received {
    parsed: Result<Envelope, RejectError>,
    facts: Facts,
}

/// Start the life of a delivery.
fn receive(
    parsed: Result<Envelope, RejectError>,
    attempt: u32,
    received_at_ms: i64,
    consumer_timeout_ms: Option<u64>,
) -> Received {
    Received {
        parsed,
        facts: Facts {
            attempt,
            received_at_ms,
            consumer_timeout_ms,
            ..Facts::default()
        },
    }
}

/// After the receipt: wait for a slot, or settle now.
#[derive(Debug, Clone)]
enum Looked {
    AwaitSlot(Waiting),
    Settle(Settle),
}

impl Received {
    /// The ledger answered (`facts`, with the expected wait and the learned runtime):
    /// [`WorkerPolicy::on_receipt`] decides.
    fn looked(mut self, policy: &WorkerPolicy, facts: ReceiptFacts, now_ms: i64) -> Looked {
        if let Ok(env) = &self.parsed {
            self.facts.min_runtime_ms = Some(min_runtime(policy, env, facts.learned_runtime_ms));
        }
        let receipt = policy.on_receipt(&self.parsed, facts, now_ms);
        if let (Receipt::Settle(d), Ok(env)) = (&receipt, &self.parsed) {
            self.facts.min_feasible_budget_ms = min_budget(
                policy,
                env,
                facts.learned_runtime_ms,
                facts.expected_wait_ms,
                d,
            );
        }
        match (receipt, self.parsed) {
            (Receipt::WaitForSlot, Ok(env)) => Looked::AwaitSlot(Waiting {
                env,
                facts: self.facts,
            }),
            (Receipt::Settle(d), parsed) => Looked::Settle(settle(parsed, self.facts, d)),
            // The policy keeps only valid envelopes waiting; an invalid one is rejected.
            (Receipt::WaitForSlot, Err(e)) => {
                let t = Terminal {
                    state: State::Rejected,
                    reason: Some(Reason::Rejected(e.reason)),
                };
                Looked::Settle(settle(
                    Err(e),
                    self.facts,
                    Disposition::RecordThenDeadLetter(t),
                ))
            }
        }
    }

    /// Shutdown while the job is looked up or held: it never started, hand it back.
    fn shutdown(self) -> Finish {
        Finish::HAND_BACK
    }

    /// The channel is gone while the job is looked up or held: drop it locally.
    fn channel_lost(self) -> Finish {
        Finish::DROP
    }
}

/// Waiting for a model slot in the bounded local buffer.
#[derive(Debug, Clone)]
struct Waiting {
    env: Envelope,
    facts: Facts,
}

/// The clock's sync state when a slot is granted (`--clock-sync require` fails closed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClockState {
    Trusted,
    Untrusted,
}

/// After a slot was granted.
#[derive(Debug, Clone)]
enum Admission {
    /// Write the `running` row, then call ([`Admitted`]).
    Start(Admitted),
    /// Refused by the last admission check: settle without a call (release the slot).
    Settle(Settle),
    /// The clock may not be trusted: release the slot and wait for sync.
    ClockWait(ClockWait),
    /// The broker's ack window closed while the job waited: hand it back unrecorded,
    /// its redelivery gets a fresh window (the `Finish` is a hand-back).
    HandBack(Finish),
}

/// After the latest-start timer of a waiting job fired.
#[derive(Debug, Clone)]
enum WaitTick {
    /// Still admissible (the estimate changed): keep waiting.
    Keep(Waiting),
    /// It can no longer finish in time: leave the buffer, settled without a call.
    Settle(Settle),
}

impl Waiting {
    /// When to look again whether the job can still finish in time (its latest useful
    /// start with the `learned` runtime); `None` when the policy does not watch it.
    fn latest_start_ms(&self, policy: &WorkerPolicy, learned_ms: Option<u64>) -> Option<i64> {
        (policy.watches_latest_start()).then(|| policy.latest_start_ms(&self.env, learned_ms))
    }

    /// The latest-start timer fired: the last admission check, counted as one.
    fn latest_start_reached(
        mut self,
        policy: &WorkerPolicy,
        learned_ms: Option<u64>,
        now_ms: i64,
    ) -> WaitTick {
        match policy.on_slot(&self.env, learned_ms, now_ms) {
            Slot::Run { .. } => WaitTick::Keep(self),
            Slot::Settle(d) => {
                self.facts.checked_at_ms = Some(now_ms);
                self.facts.min_feasible_budget_ms =
                    min_budget(policy, &self.env, learned_ms, 0, &d);
                WaitTick::Settle(settle(Ok(self.env), self.facts, d))
            }
        }
    }

    /// A slot is free. With a trusted clock: the last admission check, then the broker's
    /// ack window.
    fn slot_granted(
        mut self,
        clock: ClockState,
        policy: &WorkerPolicy,
        learned_ms: Option<u64>,
        now_ms: i64,
    ) -> Admission {
        if clock == ClockState::Untrusted {
            return Admission::ClockWait(ClockWait {
                env: self.env,
                facts: self.facts,
            });
        }
        self.facts.checked_at_ms = Some(now_ms);
        let min = min_runtime(policy, &self.env, learned_ms);
        self.facts.min_runtime_ms = Some(min);
        let budget_ms = match policy.on_slot(&self.env, learned_ms, now_ms) {
            Slot::Settle(d) => {
                self.facts.min_feasible_budget_ms =
                    min_budget(policy, &self.env, learned_ms, 0, &d);
                return Admission::Settle(settle(Ok(self.env), self.facts, d));
            }
            Slot::Run { budget_ms } => budget_ms,
        };
        let window = ack_window::call_timeout(
            budget_ms,
            self.facts.received_at_ms,
            now_ms,
            self.facts.consumer_timeout_ms,
            min,
        );
        if window == CallTimeout::AckWindowClosed {
            return Admission::HandBack(Finish::HAND_BACK);
        }
        Admission::Start(Admitted {
            env: self.env,
            facts: self.facts,
            budget_ms,
        })
    }

    /// The model server's circuit breaker is open and no call of this job could start
    /// before its latest useful start ([`crate::breaker`]): it ends without a call,
    /// `expired_not_started` with `admission:upstream_unavailable`, checked at `now_ms`.
    fn upstream_unavailable(mut self, policy: &WorkerPolicy, now_ms: i64) -> Settle {
        self.facts.checked_at_ms = Some(now_ms);
        let d = policy.upstream_unavailable();
        settle(Ok(self.env), self.facts, d)
    }

    /// The backend's next rate-limit permit comes after this job's latest useful start
    /// ([`crate::rate_limit`]): it ends without a call, `expired_not_started` with
    /// `admission:rate_limited`, checked at `now_ms`.
    fn rate_limited(mut self, policy: &WorkerPolicy, now_ms: i64) -> Settle {
        self.facts.checked_at_ms = Some(now_ms);
        let d = policy.rate_limited();
        settle(Ok(self.env), self.facts, d)
    }

    /// Its cancellation was requested while it waited: `cancelled`, no call.
    fn cancel(self) -> Settle {
        settle(Ok(self.env), self.facts, cancelled())
    }

    fn shutdown(self) -> Finish {
        Finish::HAND_BACK
    }

    fn channel_lost(self) -> Finish {
        Finish::DROP
    }
}

/// Holding a job (without a slot) while the clock may not be trusted.
#[derive(Debug, Clone)]
struct ClockWait {
    env: Envelope,
    facts: Facts,
}

/// After a look at a job waiting for clock sync.
#[derive(Debug, Clone)]
enum ClockTick {
    Keep(ClockWait),
    /// It can no longer pass the admission check: settle it without a call.
    Settle(Settle),
}

impl ClockWait {
    /// Look again (periodically) whether the job can still pass the admission check.
    fn tick(mut self, policy: &WorkerPolicy, learned_ms: Option<u64>, now_ms: i64) -> ClockTick {
        match policy.on_slot(&self.env, learned_ms, now_ms) {
            Slot::Run { .. } => ClockTick::Keep(self),
            Slot::Settle(d) => {
                self.facts.min_feasible_budget_ms =
                    min_budget(policy, &self.env, learned_ms, 0, &d);
                ClockTick::Settle(settle(Ok(self.env), self.facts, d))
            }
        }
    }

    /// The clock may be trusted again: wait for a slot again.
    fn trusted(self) -> Waiting {
        Waiting {
            env: self.env,
            facts: self.facts,
        }
    }

    fn shutdown(self) -> Finish {
        Finish::HAND_BACK
    }

    fn channel_lost(self) -> Finish {
        Finish::DROP
    }
}

/// Admitted with a slot: the driver writes the durable `running` row (it makes crash
/// loops countable), then reports [`Admitted::start_durable`].
#[derive(Debug, Clone)]
struct Admitted {
    env: Envelope,
    facts: Facts,
    budget_ms: u64,
}

/// After the `running` row is durable.
#[derive(Debug, Clone)]
enum Started {
    /// Call the model with this budget.
    Call(Calling),
    /// Refused on the re-check after the write (expired meanwhile, or cancelled).
    Settle(Settle),
    /// The write took the rest of the ack window: record the attempt as handed back
    /// unstarted, then hand the job back.
    HandBack(Recording),
}

impl Admitted {
    /// Another delivery of the same job is already running here (a redelivery raced its
    /// first delivery): start over from the receipt, which waits for that call.
    fn already_running_here(self) -> Received {
        Received {
            parsed: Ok(self.env),
            facts: self.facts,
        }
    }

    /// The `running` row is durable at `now_ms`: check again (the write took time), cap
    /// the call inside the ack window, and look at a cancellation once more.
    fn start_durable(
        self,
        policy: &WorkerPolicy,
        learned_ms: Option<u64>,
        cancel_requested: bool,
        now_ms: i64,
    ) -> Started {
        let budget_ms = match policy.on_slot(&self.env, learned_ms, now_ms) {
            Slot::Run { budget_ms } => budget_ms.min(self.budget_ms),
            Slot::Settle(d) => {
                let mut facts = self.facts;
                facts.min_feasible_budget_ms = min_budget(policy, &self.env, learned_ms, 0, &d);
                return Started::Settle(settle(Ok(self.env), facts, d));
            }
        };
        let (budget_ms, cut_by_ack_window) = match ack_window::call_timeout(
            budget_ms,
            self.facts.received_at_ms,
            now_ms,
            self.facts.consumer_timeout_ms,
            0,
        ) {
            CallTimeout::Run { timeout_ms, capped } => (timeout_ms, capped),
            CallTimeout::AckWindowClosed => {
                return Started::HandBack(Recording {
                    parsed: Ok(self.env),
                    facts: self.facts,
                    terminal: None,
                    decision: Decision::HandedBack,
                    then: Finish::HAND_BACK,
                });
            }
        };
        if cancel_requested {
            return Started::Settle(settle(Ok(self.env), self.facts, cancelled()));
        }
        let mut facts = self.facts;
        facts.started_at_ms = Some(now_ms);
        Started::Call(Calling {
            env: self.env,
            facts,
            budget_ms,
            cut_by_ack_window,
        })
    }

    /// The channel was lost during the write: the call still runs; its ack is dropped.
    fn channel_lost(mut self) -> Self {
        self.facts.channel_lost = true;
        self
    }

    /// Shutdown before the start was durable: nothing is sent.
    fn shutdown(self) -> Finish {
        Finish::DROP
    }
}

/// The model call runs with [`Calling::budget_ms`] as its timeout.
#[derive(Debug, Clone)]
struct Calling {
    env: Envelope,
    facts: Facts,
    budget_ms: u64,
    cut_by_ack_window: bool,
}

/// How a call ended, as the ledger records it.
#[derive(Debug, Clone)]
struct CallEnded {
    /// The call's result; a call cut at the ack window is `failed`/`consumer_timeout`.
    result: CallResult,
    /// Replaces the call's error text when set (why it was cut).
    note: Option<String>,
    settle: Settle,
}

impl Calling {
    /// The channel was lost during the call: it goes on, its outcome is recorded, its
    /// ack is dropped.
    fn channel_lost(mut self) -> Self {
        self.facts.channel_lost = true;
        self
    }

    /// The call ended at `now_ms`: [`WorkerPolicy::on_call_result`] decides.
    fn call_ended(
        mut self,
        policy: &WorkerPolicy,
        mut result: CallResult,
        learned_ms: Option<u64>,
        now_ms: i64,
        jitter: f64,
    ) -> CallEnded {
        self.facts.finished_at_ms = Some(now_ms);
        let mut note = None;
        if self.cut_by_ack_window && result == CallResult::DeadlineExceeded {
            // Cut at the ack window, before the job's deadline: not `deadline_exceeded`.
            result = CallResult::Failed {
                retryable: false,
                reason: Reason::ConsumerTimeout,
                retry_after_ms: None,
            };
            let ct = self.facts.consumer_timeout_ms.unwrap_or(0);
            note = Some(format!(
                "cut after {} ms, before the deadline: the broker's consumer_timeout ({ct} ms, margin {} ms) would have closed the channel before the ack",
                self.budget_ms,
                ack_window::margin_ms(ct)
            ));
        }
        let attempt = self.facts.attempt;
        let d = policy.on_call_result(&self.env, attempt, &result, learned_ms, now_ms, jitter);
        CallEnded {
            result,
            note,
            settle: settle(Ok(self.env), self.facts, d),
        }
    }
}

/// How a delivery is settled once the core has decided.
#[derive(Debug, Clone)]
enum Settle {
    /// Write the outcome durably, then finish.
    Record(Recording),
    /// Publish the retry with confirm first, then record the attempt.
    PublishRetry(Publishing),
    /// A redelivery of a job already recorded: nothing to write.
    Duplicate(Finish),
    /// Handed back unrecorded for another worker ([`Disposition::PassOn`]).
    PassOn(Finish),
}

/// The retry to publish.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retry {
    pub next_attempt: u32,
    pub queue_index: usize,
    pub delay_ms: u64,
    pub ttl_ms: u64,
}

/// Publishing a retry (the original body, byte for byte, with the remaining budget).
#[derive(Debug, Clone)]
struct Publishing {
    parsed: Result<Envelope, RejectError>,
    facts: Facts,
    retry: Retry,
}

/// After a retry publish that was not confirmed.
#[derive(Debug, Clone)]
enum PublishFailed {
    /// The job fails: record `failed`/`retry_publish_failed`, dead-letter it.
    Record(Recording),
    /// The channel is gone too: record nothing, the broker's redelivery is the retry
    /// (the `Finish` is a drop).
    Drop(Finish),
}

impl Publishing {
    /// Confirmed: record the attempt (`running`, decision `retry`), then ack.
    fn published(self) -> Recording {
        Recording {
            parsed: self.parsed,
            facts: self.facts,
            terminal: None,
            decision: Decision::Retry,
            then: Finish::ACK,
        }
    }

    /// Not confirmed.
    fn failed(self) -> PublishFailed {
        if self.facts.channel_lost {
            return PublishFailed::Drop(Finish::DROP);
        }
        let t = Terminal {
            state: State::Failed,
            reason: Some(Reason::RetryPublishFailed),
        };
        PublishFailed::Record(Recording {
            parsed: self.parsed,
            facts: self.facts,
            terminal: Some(t),
            decision: Decision::DeadLetter,
            then: Finish::DEAD_LETTER,
        })
    }

    fn channel_lost(mut self) -> Self {
        self.facts.channel_lost = true;
        self
    }
}

/// Writing the delivery's outcome (or its retry attempt) durably; only then is the
/// delivery settled with the broker.
#[derive(Debug, Clone)]
struct Recording {
    parsed: Result<Envelope, RejectError>,
    facts: Facts,
    terminal: Option<Terminal>,
    decision: Decision,
    then: Finish,
}

impl Recording {
    /// The terminal outcome; `None` for a retry's or a hand-back's attempt row.
    fn terminal(&self) -> Option<&Terminal> {
        self.terminal.as_ref()
    }

    /// The write committed: settle with the broker (unless the channel is gone).
    fn durable(self) -> Finish {
        if self.facts.channel_lost {
            Finish::DROP
        } else {
            self.then
        }
    }

    fn channel_lost(mut self) -> Self {
        self.facts.channel_lost = true;
        self
    }

    /// Shutdown before the write committed: nothing is sent (no ack without the write).
    fn shutdown(self) -> Finish {
        Finish::DROP
    }
}

fn settle(parsed: Result<Envelope, RejectError>, facts: Facts, d: Disposition) -> Settle {
    let (terminal, decision, then) = match d {
        Disposition::RecordThenAck(t) => (t, Decision::Ack, Finish::ACK),
        Disposition::RecordThenDeadLetter(t) => (t, Decision::DeadLetter, Finish::DEAD_LETTER),
        Disposition::AckDuplicate if facts.channel_lost => return Settle::Duplicate(Finish::DROP),
        Disposition::AckDuplicate => return Settle::Duplicate(Finish::ACK),
        Disposition::PassOn => return Settle::PassOn(Finish::HAND_BACK),
        Disposition::Retry {
            next_attempt,
            queue_index,
            delay_ms,
            ttl_ms,
        } => {
            let retry = Retry {
                next_attempt,
                queue_index,
                delay_ms,
                ttl_ms,
            };
            return Settle::PublishRetry(Publishing {
                parsed,
                facts,
                retry,
            });
        }
    };
    Settle::Record(Recording {
        parsed,
        facts,
        terminal: Some(terminal),
        decision,
        then,
    })
}

/// The disposition of a job cancelled on request before its call.
fn cancelled() -> Disposition {
    Disposition::RecordThenAck(Terminal {
        state: State::Cancelled,
        reason: Some(Reason::CancelRequested),
    })
}

/// The budget a refusal for lack of time names ([`WorkerPolicy::min_feasible_budget_ms`],
/// `wait_ms` the expected wait it counted); `None` for any other disposition.
fn min_budget(
    policy: &WorkerPolicy,
    env: &Envelope,
    learned_ms: Option<u64>,
    wait_ms: u64,
    d: &Disposition,
) -> Option<u64> {
    let (Disposition::RecordThenAck(t) | Disposition::RecordThenDeadLetter(t)) = d else {
        return None;
    };
    (t.reason.as_ref().is_some_and(Reason::is_budget_refusal))
        .then(|| policy.min_feasible_budget_ms(env, learned_ms, wait_ms))
}

/// The minimum useful runtime the admission rule applies to `env`: its own, else the
/// learned call time, else the configured floor.
fn min_runtime(policy: &WorkerPolicy, env: &Envelope, learned_ms: Option<u64>) -> u64 {
    policy
        .min_runtime(env, learned_ms)
        .0
        .unwrap_or(policy.admission.default_min_runtime_ms)
}

/// One delivery's state machine behind one door, in the `quinn-proto` style: the driver
/// asks [`Delivery::poll_action`] what to do, carries it out, and reports what happened
/// with [`Delivery::handle`]; [`Delivery::poll_timeout`] says when to look again if
/// nothing else happens. No IO and no clock reads: `now` is an argument.
///
/// It wraps the typed states above (each accepts only its legal events), so an event a
/// state has no use for is ignored here rather than "cannot happen": a cancellation of a
/// job whose call runs (the driver aborts the call, which ends as
/// [`CallResult::Cancelled`]), a timer that fired after the state moved on.
///
/// It also keeps what the ledger row says beside the decision: the learned call time that
/// applied (its refusal note, [`crate::service_time::Estimate::refusal_note`]) and why a
/// call was cut (the ack window's note).
#[derive(Debug, Clone)]
pub struct Delivery {
    phase: Phase,
    /// The learned call time that applies to the job now (the last an event carried).
    learned: Option<Estimate>,
    /// The ledger's error text for this delivery, when the core explains its decision.
    note: Option<String>,
    /// The call's result as recorded (a call cut at the ack window is rewritten).
    call_result: Option<CallResult>,
    duplicate: bool,
    passed_on: bool,
}

#[derive(Debug, Clone)]
enum Phase {
    Received(Received),
    Waiting(Waiting),
    ClockWait(ClockWait),
    Admitted(Admitted),
    Calling(Calling),
    Publishing(Publishing),
    Recording(Recording),
    Done(Finish),
    /// Only while a transition runs (the states move by value).
    Moving,
}

/// What happened, as the driver reports it to [`Delivery::handle`].
#[derive(Debug, Clone)]
pub enum Event {
    /// The ledger answered the lookup ([`Action::LookUp`]); `learned` is the estimate
    /// whose quantile the admission rule applies (it replaces `facts.learned_runtime_ms`).
    Looked {
        facts: ReceiptFacts,
        learned: Option<Estimate>,
    },
    /// The learned call time that applies to a waiting job now (its backend's, for its
    /// request): [`Delivery::poll_timeout`] follows it.
    Estimate(Option<Estimate>),
    /// A model slot is free for the job ([`Action::AwaitSlot`]), its breaker and rate
    /// limit let the call through: the last admission check.
    SlotGranted {
        clock: ClockState,
        learned: Option<Estimate>,
    },
    /// The instant of [`Delivery::poll_timeout`] came: a waiting job's latest useful
    /// start (it leaves if it can no longer finish in time), or a job waiting for clock
    /// sync looks again whether it still can pass the admission check.
    Timeout { learned: Option<Estimate> },
    /// Its model server's circuit breaker is open until about `next_call_at_ms` (the
    /// driver gave the slot back). The core decides: past the job's latest useful start it
    /// ends without a call (`admission:upstream_unavailable`); else it keeps waiting, and
    /// the driver holds it without a slot until then.
    BreakerOpen {
        next_call_at_ms: i64,
        learned: Option<Estimate>,
    },
    /// Its backend's next rate-limit permit comes at `permit_at_ms` (`None`: no permit can
    /// cover the request; the driver gave the slot back). The core decides: past the job's
    /// latest useful start, or never, it ends without a call (`admission:rate_limited`);
    /// else it keeps waiting, and the driver holds it without a slot until then.
    NoRatePermit {
        permit_at_ms: Option<i64>,
        learned: Option<Estimate>,
    },
    /// The clock may be trusted again ([`Action::AwaitClock`]).
    ClockTrusted,
    /// A redelivery of the same job already runs here: look it up again (which waits).
    AlreadyRunningHere,
    /// The `running` row is durable ([`Action::WriteStart`]).
    StartDurable {
        learned: Option<Estimate>,
        cancel_requested: bool,
    },
    /// The model call ended ([`Action::Call`]); `jitter` in [0, 1) spreads retry delays.
    CallEnded {
        result: CallResult,
        learned: Option<Estimate>,
        jitter: f64,
    },
    /// The retry's publish was confirmed ([`Action::PublishRetry`]).
    Published,
    /// The retry's publish was not confirmed.
    PublishFailed,
    /// The ledger write committed ([`Action::Record`]).
    Durable,
    /// Its cancellation was requested.
    Cancel,
    /// The worker is stopping.
    Shutdown,
    /// The delivery's channel is gone.
    ChannelLost,
}

/// The step the driver carries out next ([`Delivery::poll_action`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Hold the job while a call of it may still run (here or on another live worker),
    /// then look it up in the ledger: [`Event::Looked`].
    LookUp,
    /// Wait in the buffer for a slot ([`Event::SlotGranted`]), until
    /// [`Delivery::poll_timeout`] at the latest ([`Event::Timeout`]).
    AwaitSlot,
    /// Hold the job, without a slot, until the clock may be trusted
    /// ([`Event::ClockTrusted`]), looking again now and then ([`Event::Timeout`]).
    AwaitClock,
    /// Write the durable `running` row: [`Event::StartDurable`].
    WriteStart,
    /// Call the model with this timeout: [`Event::CallEnded`].
    Call { budget_ms: u64 },
    /// Publish the retry with confirm: [`Event::Published`] or [`Event::PublishFailed`].
    PublishRetry(Retry),
    /// Write the outcome ([`Delivery::terminal`], [`Delivery::decision`]) durably:
    /// [`Event::Durable`].
    Record,
    /// Settle with the broker; the delivery is over.
    Finish(Finish),
}

impl Delivery {
    /// Start the life of a delivery just received (`attempt` is the one it carries;
    /// `consumer_timeout_ms` is the broker's, when known).
    pub fn new(
        parsed: Result<Envelope, RejectError>,
        attempt: u32,
        received_at_ms: i64,
        consumer_timeout_ms: Option<u64>,
    ) -> Self {
        Delivery {
            phase: Phase::Received(receive(
                parsed,
                attempt,
                received_at_ms,
                consumer_timeout_ms,
            )),
            learned: None,
            note: None,
            call_result: None,
            duplicate: false,
            passed_on: false,
        }
    }

    /// What to do next. The same until an event moves the delivery on.
    pub fn poll_action(&self) -> Action {
        match &self.phase {
            Phase::Received(_) => Action::LookUp,
            Phase::Waiting(_) => Action::AwaitSlot,
            Phase::ClockWait(_) => Action::AwaitClock,
            Phase::Admitted(_) => Action::WriteStart,
            Phase::Calling(c) => Action::Call {
                budget_ms: c.budget_ms,
            },
            Phase::Publishing(p) => Action::PublishRetry(p.retry),
            Phase::Recording(_) => Action::Record,
            Phase::Done(f) => Action::Finish(*f),
            Phase::Moving => unreachable!("a transition panicked"),
        }
    }

    /// When to report [`Event::Timeout`] if nothing else happens first: a waiting job's
    /// latest useful start with the learned call time it was last given (`None` when the
    /// policy does not watch it). The event is due once `now` is past this instant.
    pub fn poll_timeout(&self, policy: &WorkerPolicy) -> Option<i64> {
        match &self.phase {
            Phase::Waiting(w) => w.latest_start_ms(policy, self.learned_ms()),
            _ => None,
        }
    }

    /// Report what happened at `now_ms`.
    pub fn handle(&mut self, policy: &WorkerPolicy, event: Event, now_ms: i64) {
        let phase = std::mem::replace(&mut self.phase, Phase::Moving);
        self.phase = self.step(policy, phase, event, now_ms);
    }

    fn learned_ms(&self) -> Option<u64> {
        self.learned.map(|e| e.quantile_ms)
    }

    fn step(&mut self, policy: &WorkerPolicy, phase: Phase, event: Event, now: i64) -> Phase {
        use Event as E;
        match event {
            E::Looked { learned, .. }
            | E::Estimate(learned)
            | E::SlotGranted { learned, .. }
            | E::Timeout { learned }
            | E::BreakerOpen { learned, .. }
            | E::NoRatePermit { learned, .. }
            | E::StartDurable { learned, .. }
            | E::CallEnded { learned, .. } => self.learned = learned,
            _ => {}
        }
        let learned = self.learned_ms();
        match (phase, event) {
            (Phase::Received(r), E::Looked { mut facts, .. }) => {
                facts.learned_runtime_ms = learned;
                match r.looked(policy, facts, now) {
                    Looked::AwaitSlot(w) => Phase::Waiting(w),
                    Looked::Settle(s) => self.settle(s),
                }
            }
            (Phase::Received(r), E::Shutdown) => Phase::Done(r.shutdown()),
            (Phase::Received(r), E::ChannelLost) => Phase::Done(r.channel_lost()),
            (Phase::Waiting(w), E::SlotGranted { clock, .. }) => {
                match w.slot_granted(clock, policy, learned, now) {
                    Admission::Start(a) => Phase::Admitted(a),
                    Admission::Settle(s) => self.settle(s),
                    Admission::ClockWait(c) => Phase::ClockWait(c),
                    Admission::HandBack(f) => Phase::Done(f),
                }
            }
            (Phase::Waiting(w), E::Timeout { .. }) => {
                match w.latest_start_reached(policy, learned, now) {
                    WaitTick::Keep(w) => Phase::Waiting(w),
                    WaitTick::Settle(s) => self.settle(s),
                }
            }
            (
                Phase::Waiting(w),
                E::BreakerOpen {
                    next_call_at_ms, ..
                },
            ) => {
                let latest = w.latest_start_ms(policy, learned);
                if latest.is_some_and(|latest| next_call_at_ms > latest) {
                    let s = w.upstream_unavailable(policy, now);
                    self.settle(s)
                } else {
                    Phase::Waiting(w)
                }
            }
            (Phase::Waiting(w), E::NoRatePermit { permit_at_ms, .. }) => {
                let latest = w.latest_start_ms(policy, learned);
                let too_late = match permit_at_ms {
                    None => true,
                    Some(at) => latest.is_some_and(|latest| at > latest),
                };
                if too_late {
                    let s = w.rate_limited(policy, now);
                    self.settle(s)
                } else {
                    Phase::Waiting(w)
                }
            }
            (Phase::Waiting(w), E::Cancel) => {
                let s = w.cancel();
                self.settle(s)
            }
            (Phase::Waiting(w), E::Shutdown) => Phase::Done(w.shutdown()),
            (Phase::Waiting(w), E::ChannelLost) => Phase::Done(w.channel_lost()),
            (Phase::ClockWait(c), E::Timeout { .. }) => match c.tick(policy, learned, now) {
                ClockTick::Keep(c) => Phase::ClockWait(c),
                ClockTick::Settle(s) => self.settle(s),
            },
            (Phase::ClockWait(c), E::ClockTrusted) => Phase::Waiting(c.trusted()),
            (Phase::ClockWait(c), E::Shutdown) => Phase::Done(c.shutdown()),
            (Phase::ClockWait(c), E::ChannelLost) => Phase::Done(c.channel_lost()),
            (Phase::Admitted(a), E::AlreadyRunningHere) => {
                Phase::Received(a.already_running_here())
            }
            (
                Phase::Admitted(a),
                E::StartDurable {
                    cancel_requested, ..
                },
            ) => match a.start_durable(policy, learned, cancel_requested, now) {
                Started::Call(c) => Phase::Calling(c),
                Started::Settle(s) => self.settle(s),
                Started::HandBack(r) => Phase::Recording(r),
            },
            (Phase::Admitted(a), E::ChannelLost) => Phase::Admitted(a.channel_lost()),
            (Phase::Admitted(a), E::Shutdown) => Phase::Done(a.shutdown()),
            (Phase::Calling(c), E::CallEnded { result, jitter, .. }) => {
                let ended = c.call_ended(policy, result, learned, now, jitter);
                self.note = ended.note;
                self.call_result = Some(ended.result);
                self.settle(ended.settle)
            }
            (Phase::Calling(c), E::ChannelLost) => Phase::Calling(c.channel_lost()),
            (Phase::Publishing(p), E::Published) => Phase::Recording(p.published()),
            (Phase::Publishing(p), E::PublishFailed) => match p.failed() {
                PublishFailed::Record(r) => Phase::Recording(r),
                PublishFailed::Drop(f) => Phase::Done(f),
            },
            (Phase::Publishing(p), E::ChannelLost) => Phase::Publishing(p.channel_lost()),
            (Phase::Recording(r), E::Durable) => Phase::Done(r.durable()),
            (Phase::Recording(r), E::ChannelLost) => Phase::Recording(r.channel_lost()),
            (Phase::Recording(r), E::Shutdown) => Phase::Done(r.shutdown()),
            // Anything else leaves the state as it is (see the type's doc).
            (phase, _) => phase,
        }
    }

    fn settle(&mut self, s: Settle) -> Phase {
        match s {
            Settle::Record(r) => {
                if self.call_result.is_none() {
                    let reason = r.terminal().and_then(|t| t.reason.as_ref());
                    self.note = self.learned.and_then(|e| e.refusal_note(reason));
                }
                Phase::Recording(r)
            }
            Settle::PublishRetry(p) => Phase::Publishing(p),
            Settle::PassOn(f) => {
                self.passed_on = true;
                Phase::Done(f)
            }
            Settle::Duplicate(f) => {
                self.duplicate = true;
                Phase::Done(f)
            }
        }
    }

    /// The delivery's envelope as parsed (an invalid one is recorded `rejected`); `None`
    /// once finished (the envelope went with the last step).
    pub fn parsed(&self) -> Option<Result<&Envelope, &RejectError>> {
        let parsed = match &self.phase {
            Phase::Received(r) => &r.parsed,
            Phase::Publishing(p) => &p.parsed,
            Phase::Recording(r) => &r.parsed,
            Phase::Waiting(w) => return Some(Ok(&w.env)),
            Phase::ClockWait(c) => return Some(Ok(&c.env)),
            Phase::Admitted(a) => return Some(Ok(&a.env)),
            Phase::Calling(c) => return Some(Ok(&c.env)),
            Phase::Done(_) | Phase::Moving => return None,
        };
        Some(parsed.as_ref())
    }

    /// Its latest useful start with the `learned` call time, when it waits for a start
    /// and the policy watches that instant: what a gate (the breaker's demand trial) asks
    /// before it decides.
    pub fn latest_start_ms(&self, policy: &WorkerPolicy, learned: Option<Estimate>) -> Option<i64> {
        match &self.phase {
            Phase::Waiting(w) => w.latest_start_ms(policy, learned.map(|e| e.quantile_ms)),
            _ => None,
        }
    }

    /// Its envelope, when it is valid (and the delivery not finished).
    pub fn env(&self) -> Option<&Envelope> {
        self.parsed()?.ok()
    }

    /// What is known of the delivery for the ledger (`None` once finished).
    pub fn facts(&self) -> Option<&Facts> {
        Some(match &self.phase {
            Phase::Received(r) => &r.facts,
            Phase::Waiting(w) => &w.facts,
            Phase::ClockWait(c) => &c.facts,
            Phase::Admitted(a) => &a.facts,
            Phase::Calling(c) => &c.facts,
            Phase::Publishing(p) => &p.facts,
            Phase::Recording(r) => &r.facts,
            Phase::Done(_) | Phase::Moving => return None,
        })
    }

    /// The admission budget of the last check (while admitted or calling: the call's
    /// timeout).
    pub fn budget_ms(&self) -> Option<u64> {
        match &self.phase {
            Phase::Admitted(a) => Some(a.budget_ms),
            Phase::Calling(c) => Some(c.budget_ms),
            _ => None,
        }
    }

    /// While [`Action::Record`]: the terminal outcome (`None` for a retry's or a
    /// hand-back's attempt row).
    pub fn terminal(&self) -> Option<&Terminal> {
        match &self.phase {
            Phase::Recording(r) => r.terminal(),
            _ => None,
        }
    }

    /// While [`Action::Record`]: what the row says was decided.
    pub fn decision(&self) -> Option<Decision> {
        match &self.phase {
            Phase::Recording(r) => Some(r.decision),
            _ => None,
        }
    }

    /// The ledger's error text the core gives the delivery: why the learned call time
    /// refused it, or why its call was cut before the deadline (it replaces the call's
    /// own error text).
    pub fn note(&self) -> Option<&str> {
        self.note.as_deref()
    }

    /// The result of the delivery's call as the ledger records it, once it ended.
    pub fn call_result(&self) -> Option<&CallResult> {
        self.call_result.as_ref()
    }

    /// The learned call time it was last given.
    pub fn learned(&self) -> Option<Estimate> {
        self.learned
    }

    /// It ended as a redelivery of a job whose outcome the ledger already holds.
    pub fn is_duplicate(&self) -> bool {
        self.duplicate
    }

    /// It was handed back unrecorded at receipt, for another worker
    /// ([`crate::Disposition::PassOn`]).
    pub fn is_passed_on(&self) -> bool {
        self.passed_on
    }
}
