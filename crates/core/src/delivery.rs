//! The life of one delivery in a worker, as a pure state machine.
//!
//! Written in the `quinn-proto` style: no IO, no clock reads; the driver (the worker's
//! runtime) feeds in what happened, with `now` as an argument, and gets back the next step
//! to carry out. Each state is its own type, and its methods are the only events it
//! accepts; each returns the next state or a [`Finish`]. So a state offers only its legal
//! continuations: a job admitted to run has no method that settles it without the start
//! row, a waiting job cannot be acked, a running call cannot be handed back, and nothing
//! "cannot happen".
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
//!   row it is checked once more ([`Admitted::start_durable`]); the running call is
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

/// What the ledger row of a [`Recording`] says was decided.
pub use crate::reason::Decision;

/// A delivery just received: the driver looks its job up in the ledger (and holds it
/// while a call of the same job still runs here or on another live worker).
#[derive(Debug, Clone)]
pub struct Received {
    parsed: Result<Envelope, RejectError>,
    facts: Facts,
}

/// Start the life of a delivery.
pub fn receive(
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
pub enum Looked {
    AwaitSlot(Waiting),
    Settle(Settle),
}

impl Received {
    pub fn parsed(&self) -> &Result<Envelope, RejectError> {
        &self.parsed
    }

    pub fn facts(&self) -> &Facts {
        &self.facts
    }

    /// The ledger answered (`facts`, with the expected wait and the learned runtime):
    /// [`WorkerPolicy::on_receipt`] decides.
    pub fn looked(mut self, policy: &WorkerPolicy, facts: ReceiptFacts, now_ms: i64) -> Looked {
        if let Ok(env) = &self.parsed {
            self.facts.min_runtime_ms = Some(min_runtime(policy, env, facts.learned_runtime_ms));
        }
        match (policy.on_receipt(&self.parsed, facts, now_ms), self.parsed) {
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
    pub fn shutdown(self) -> Finish {
        Finish::HAND_BACK
    }

    /// The channel is gone while the job is looked up or held: drop it locally.
    pub fn channel_lost(self) -> Finish {
        Finish::DROP
    }
}

/// Waiting for a model slot in the bounded local buffer.
#[derive(Debug, Clone)]
pub struct Waiting {
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
pub enum Admission {
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
pub enum WaitTick {
    /// Still admissible (the estimate changed): keep waiting.
    Keep(Waiting),
    /// It can no longer finish in time: leave the buffer, settled without a call.
    Settle(Settle),
}

impl Waiting {
    pub fn env(&self) -> &Envelope {
        &self.env
    }

    pub fn facts(&self) -> &Facts {
        &self.facts
    }

    /// When to look again whether the job can still finish in time (its latest useful
    /// start with the `learned` runtime); `None` when the policy does not watch it.
    pub fn latest_start_ms(&self, policy: &WorkerPolicy, learned_ms: Option<u64>) -> Option<i64> {
        (policy.watches_latest_start()).then(|| policy.latest_start_ms(&self.env, learned_ms))
    }

    /// The latest-start timer fired: the last admission check, counted as one.
    pub fn latest_start_reached(
        mut self,
        policy: &WorkerPolicy,
        learned_ms: Option<u64>,
        now_ms: i64,
    ) -> WaitTick {
        match policy.on_slot(&self.env, learned_ms, now_ms) {
            Slot::Run { .. } => WaitTick::Keep(self),
            Slot::Settle(d) => {
                self.facts.checked_at_ms = Some(now_ms);
                WaitTick::Settle(settle(Ok(self.env), self.facts, d))
            }
        }
    }

    /// A slot is free. With a trusted clock: the last admission check, then the broker's
    /// ack window.
    pub fn slot_granted(
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
            Slot::Settle(d) => return Admission::Settle(settle(Ok(self.env), self.facts, d)),
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
    pub fn upstream_unavailable(mut self, policy: &WorkerPolicy, now_ms: i64) -> Settle {
        self.facts.checked_at_ms = Some(now_ms);
        let d = policy.upstream_unavailable();
        settle(Ok(self.env), self.facts, d)
    }

    /// The backend's next rate-limit permit comes after this job's latest useful start
    /// ([`crate::rate_limit`]): it ends without a call, `expired_not_started` with
    /// `admission:rate_limited`, checked at `now_ms`.
    pub fn rate_limited(mut self, policy: &WorkerPolicy, now_ms: i64) -> Settle {
        self.facts.checked_at_ms = Some(now_ms);
        let d = policy.rate_limited();
        settle(Ok(self.env), self.facts, d)
    }

    /// Its cancellation was requested while it waited: `cancelled`, no call.
    pub fn cancel(self) -> Settle {
        settle(Ok(self.env), self.facts, cancelled())
    }

    pub fn shutdown(self) -> Finish {
        Finish::HAND_BACK
    }

    pub fn channel_lost(self) -> Finish {
        Finish::DROP
    }
}

/// Holding a job (without a slot) while the clock may not be trusted.
#[derive(Debug, Clone)]
pub struct ClockWait {
    env: Envelope,
    facts: Facts,
}

/// After a look at a job waiting for clock sync.
#[derive(Debug, Clone)]
pub enum ClockTick {
    Keep(ClockWait),
    /// It can no longer pass the admission check: settle it without a call.
    Settle(Settle),
}

impl ClockWait {
    pub fn env(&self) -> &Envelope {
        &self.env
    }

    /// Look again (periodically) whether the job can still pass the admission check.
    pub fn tick(self, policy: &WorkerPolicy, learned_ms: Option<u64>, now_ms: i64) -> ClockTick {
        match policy.on_slot(&self.env, learned_ms, now_ms) {
            Slot::Run { .. } => ClockTick::Keep(self),
            Slot::Settle(d) => ClockTick::Settle(settle(Ok(self.env), self.facts, d)),
        }
    }

    /// The clock may be trusted again: wait for a slot again.
    pub fn trusted(self) -> Waiting {
        Waiting {
            env: self.env,
            facts: self.facts,
        }
    }

    pub fn shutdown(self) -> Finish {
        Finish::HAND_BACK
    }

    pub fn channel_lost(self) -> Finish {
        Finish::DROP
    }
}

/// Admitted with a slot: the driver writes the durable `running` row (it makes crash
/// loops countable), then reports [`Admitted::start_durable`].
#[derive(Debug, Clone)]
pub struct Admitted {
    env: Envelope,
    facts: Facts,
    budget_ms: u64,
}

/// After the `running` row is durable.
#[derive(Debug, Clone)]
pub enum Started {
    /// Call the model with this budget.
    Call(Calling),
    /// Refused on the re-check after the write (expired meanwhile, or cancelled).
    Settle(Settle),
    /// The write took the rest of the ack window: record the attempt as handed back
    /// unstarted, then hand the job back.
    HandBack(Recording),
}

impl Admitted {
    pub fn env(&self) -> &Envelope {
        &self.env
    }

    pub fn facts(&self) -> &Facts {
        &self.facts
    }

    /// The admission budget of the last check (the call's timeout before the re-check
    /// after the start write and the ack window).
    pub fn budget_ms(&self) -> u64 {
        self.budget_ms
    }

    /// Another delivery of the same job is already running here (a redelivery raced its
    /// first delivery): start over from the receipt, which waits for that call.
    pub fn already_running_here(self) -> Received {
        Received {
            parsed: Ok(self.env),
            facts: self.facts,
        }
    }

    /// The `running` row is durable at `now_ms`: check again (the write took time), cap
    /// the call inside the ack window, and look at a cancellation once more.
    pub fn start_durable(
        self,
        policy: &WorkerPolicy,
        learned_ms: Option<u64>,
        cancel_requested: bool,
        now_ms: i64,
    ) -> Started {
        let budget_ms = match policy.on_slot(&self.env, learned_ms, now_ms) {
            Slot::Run { budget_ms } => budget_ms.min(self.budget_ms),
            Slot::Settle(d) => return Started::Settle(settle(Ok(self.env), self.facts, d)),
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
    pub fn channel_lost(mut self) -> Self {
        self.facts.channel_lost = true;
        self
    }

    /// Shutdown before the start was durable: nothing is sent.
    pub fn shutdown(self) -> Finish {
        Finish::DROP
    }
}

/// The model call runs with [`Calling::budget_ms`] as its timeout.
#[derive(Debug, Clone)]
pub struct Calling {
    env: Envelope,
    facts: Facts,
    budget_ms: u64,
    cut_by_ack_window: bool,
}

/// How a call ended, as the ledger records it.
#[derive(Debug, Clone)]
pub struct CallEnded {
    /// The call's result; a call cut at the ack window is `failed`/`consumer_timeout`.
    pub result: CallResult,
    /// Replaces the call's error text when set (why it was cut).
    pub note: Option<String>,
    pub settle: Settle,
}

impl Calling {
    pub fn env(&self) -> &Envelope {
        &self.env
    }

    pub fn facts(&self) -> &Facts {
        &self.facts
    }

    /// The call's timeout: the admission budget, capped inside the ack window.
    pub fn budget_ms(&self) -> u64 {
        self.budget_ms
    }

    /// The channel was lost during the call: it goes on, its outcome is recorded, its
    /// ack is dropped.
    pub fn channel_lost(mut self) -> Self {
        self.facts.channel_lost = true;
        self
    }

    /// The call ended at `now_ms`: [`WorkerPolicy::on_call_result`] decides.
    pub fn call_ended(
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
pub enum Settle {
    /// Write the outcome durably, then finish.
    Record(Recording),
    /// Publish the retry with confirm first, then record the attempt.
    PublishRetry(Publishing),
    /// A redelivery of a job already recorded: nothing to write.
    Duplicate(Finish),
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
pub struct Publishing {
    parsed: Result<Envelope, RejectError>,
    facts: Facts,
    retry: Retry,
}

/// After a retry publish that was not confirmed.
#[derive(Debug, Clone)]
pub enum PublishFailed {
    /// The job fails: record `failed`/`retry_publish_failed`, dead-letter it.
    Record(Recording),
    /// The channel is gone too: record nothing, the broker's redelivery is the retry
    /// (the `Finish` is a drop).
    Drop(Finish),
}

impl Publishing {
    pub fn retry(&self) -> Retry {
        self.retry
    }

    /// Confirmed: record the attempt (`running`, decision `retry`), then ack.
    pub fn published(self) -> Recording {
        Recording {
            parsed: self.parsed,
            facts: self.facts,
            terminal: None,
            decision: Decision::Retry,
            then: Finish::ACK,
        }
    }

    /// Not confirmed.
    pub fn failed(self) -> PublishFailed {
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

    pub fn channel_lost(mut self) -> Self {
        self.facts.channel_lost = true;
        self
    }
}

/// Writing the delivery's outcome (or its retry attempt) durably; only then is the
/// delivery settled with the broker.
#[derive(Debug, Clone)]
pub struct Recording {
    parsed: Result<Envelope, RejectError>,
    facts: Facts,
    terminal: Option<Terminal>,
    decision: Decision,
    then: Finish,
}

impl Recording {
    pub fn parsed(&self) -> &Result<Envelope, RejectError> {
        &self.parsed
    }

    pub fn facts(&self) -> &Facts {
        &self.facts
    }

    /// The terminal outcome; `None` for a retry's or a hand-back's attempt row.
    pub fn terminal(&self) -> Option<&Terminal> {
        self.terminal.as_ref()
    }

    pub fn decision(&self) -> Decision {
        self.decision
    }

    /// The write committed: settle with the broker (unless the channel is gone).
    pub fn durable(self) -> Finish {
        if self.facts.channel_lost {
            Finish::DROP
        } else {
            self.then
        }
    }

    pub fn channel_lost(mut self) -> Self {
        self.facts.channel_lost = true;
        self
    }

    /// Shutdown before the write committed: nothing is sent (no ack without the write).
    pub fn shutdown(self) -> Finish {
        Finish::DROP
    }
}

fn settle(parsed: Result<Envelope, RejectError>, facts: Facts, d: Disposition) -> Settle {
    let (terminal, decision, then) = match d {
        Disposition::RecordThenAck(t) => (t, Decision::Ack, Finish::ACK),
        Disposition::RecordThenDeadLetter(t) => (t, Decision::DeadLetter, Finish::DEAD_LETTER),
        Disposition::AckDuplicate if facts.channel_lost => return Settle::Duplicate(Finish::DROP),
        Disposition::AckDuplicate => return Settle::Duplicate(Finish::ACK),
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

/// The minimum useful runtime the admission rule applies to `env`: its own, else the
/// learned call time, else the configured floor.
fn min_runtime(policy: &WorkerPolicy, env: &Envelope, learned_ms: Option<u64>) -> u64 {
    policy
        .min_runtime(env, learned_ms)
        .0
        .unwrap_or(policy.admission.default_min_runtime_ms)
}
