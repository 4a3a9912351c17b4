//! What the worker does with each delivery, decided purely from values.
//!
//! The runtime asks three questions in a job's life and executes the [`Disposition`] it
//! gets back; it never decides on its own whether a job is still worth running.
//! 1. [`WorkerPolicy::on_receipt`] — the delivery has just arrived.
//! 2. [`WorkerPolicy::on_slot`] — a model slot is free: the last admission check.
//! 3. [`WorkerPolicy::on_call_result`] — the model call has returned or timed out.

use crate::admission::{Admission, AdmissionPolicy, Refusal, Stage};
use crate::envelope::{Envelope, EnvelopeLimits, RejectError};
use crate::outcome::State;
use crate::reason::{Reason, RefusalCause};
use crate::retry::{RetryDecision, RetryPolicy};
use std::fmt;
use std::sync::Arc;

/// What to do with an expired job besides recording it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ExpiredAction {
    /// Record `expired_not_started`, then ack (default).
    #[default]
    Ack,
    /// Record `expired_not_started`, then reject to the DLX for quarantine.
    DeadLetter,
}

/// Which deadline checks a worker runs, and where. Every production worker runs lastcall's
/// own, [`DeadlineChecks`]; the benchmark's references (a receipt-only check as Celery's
/// `expires`, and no check at all) implement this trait in `lastcall-bench`, so that no
/// production decision has a branch for them. The checks every policy keeps (rejection,
/// duplicates, cancellation, poison) run before [`Dispatch::on_receipt`] is asked.
pub trait Dispatch: Send + Sync + fmt::Debug {
    /// Its name in reports (`deadline`, `receipt-only`, `naive`).
    fn name(&self) -> &'static str;
    /// The deadline check when the delivery has just arrived (`env` passed every other
    /// check). [`WorkerPolicy::check`] and [`WorkerPolicy::expired`] are its parts.
    fn on_receipt(
        &self,
        policy: &WorkerPolicy,
        env: &Envelope,
        facts: ReceiptFacts,
        now_ms: i64,
    ) -> Receipt;
    /// The last check when a model slot is free.
    fn on_slot(
        &self,
        policy: &WorkerPolicy,
        env: &Envelope,
        learned_ms: Option<u64>,
        now_ms: i64,
    ) -> Slot;
    /// Whether a job waiting for a slot leaves the buffer at its latest useful start.
    fn watches_latest_start(&self) -> bool;
}

/// lastcall's rule: check at receipt (with the expected wait for a slot) and again
/// immediately before the model call, whose timeout is the budget left; a waiting job
/// leaves the buffer at its latest useful start.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DeadlineChecks;

impl Dispatch for DeadlineChecks {
    fn name(&self) -> &'static str {
        "deadline"
    }

    fn on_receipt(
        &self,
        policy: &WorkerPolicy,
        env: &Envelope,
        facts: ReceiptFacts,
        now_ms: i64,
    ) -> Receipt {
        let learned = facts.learned_runtime_ms;
        let after = |ms: u64| now_ms.saturating_add(i64::try_from(ms).unwrap_or(i64::MAX));
        // Refused here: would the best other worker, with its wait and call time, admit it?
        let peer_admits = facts.peer.is_some_and(|p| {
            (policy.check(env, p.call_ms, Stage::Receipt, after(p.wait_ms))).is_ok()
        });
        match policy.check(env, learned, Stage::Receipt, now_ms) {
            Err(_) if peer_admits => Receipt::Settle(Disposition::PassOn),
            Err(reason) => Receipt::Settle(policy.expired(reason)),
            Ok(_) if facts.expected_wait_ms == 0 || !policy.refuse_on_expected_wait => {
                Receipt::WaitForSlot
            }
            Ok(_) => {
                // Would it still pass the last admission check once a slot is expected?
                let then = after(facts.expected_wait_ms);
                match policy.check(env, learned, Stage::Receipt, then) {
                    Ok(_) => Receipt::WaitForSlot,
                    Err(_) if peer_admits => Receipt::Settle(Disposition::PassOn),
                    Err(_) => Receipt::Settle(policy.expired(Reason::Refused(
                        Stage::Receipt,
                        RefusalCause::ExpectedWaitExceedsBudget,
                    ))),
                }
            }
        }
    }

    fn on_slot(
        &self,
        policy: &WorkerPolicy,
        env: &Envelope,
        learned_ms: Option<u64>,
        now_ms: i64,
    ) -> Slot {
        match policy.check(env, learned_ms, Stage::Admission, now_ms) {
            Err(reason) => Slot::Settle(policy.expired(reason)),
            Ok(budget_ms) => Slot::Run { budget_ms },
        }
    }

    fn watches_latest_start(&self) -> bool {
        true
    }
}

/// The call budget of the reference policies, which have no deadline timeout.
pub const UNBOUNDED_BUDGET_MS: u64 = 3_600_000;

/// A terminal outcome chosen by the core, before the runtime adds timings and results.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Terminal {
    pub state: State,
    pub reason: Option<Reason>,
}

impl Terminal {
    fn new(state: State, reason: Reason) -> Self {
        Self {
            state,
            reason: Some(reason),
        }
    }
}

/// How a delivery is settled: every case that ends its life in this worker. Terminal
/// cases always record first and only then settle with the broker; no case requeues.
/// Keeping a job (wait for a slot, run it) is not a `Disposition` but a [`Receipt`] or
/// [`Slot`] decision, so "settle a job that should run" cannot be written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Disposition {
    /// Durably record the outcome, then ack.
    RecordThenAck(Terminal),
    /// Durably record the outcome, then reject without requeue (to the DLX).
    RecordThenDeadLetter(Terminal),
    /// A redelivery of a job whose outcome is already recorded: ack without running it.
    AckDuplicate,
    /// Hand it back unrecorded, for another worker: refused at receipt here, it would be
    /// admitted with the best peer's wait and call time ([`ReceiptFacts::peer`]).
    PassOn,
    /// Publish a retry with confirm, record the attempt, then ack this delivery.
    Retry {
        next_attempt: u32,
        queue_index: usize,
        delay_ms: u64,
        ttl_ms: u64,
    },
}

/// The decision at receipt ([`WorkerPolicy::on_receipt`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Receipt {
    /// Keep the job in the bounded local buffer until a model slot is free.
    WaitForSlot,
    /// Settle it now, without a model call.
    Settle(Disposition),
}

/// The decision when a slot is free: the last admission check ([`WorkerPolicy::on_slot`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Slot {
    /// Start the model call now; `budget_ms` bounds the call's local timeout.
    Run { budget_ms: u64 },
    /// Settle it now, without a model call.
    Settle(Disposition),
}

/// How a model call ended, as the runtime observed it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CallResult {
    Completed,
    /// The call was still running at the deadline and was cancelled.
    DeadlineExceeded,
    /// The call was aborted because its cancellation was requested (`DELETE /v1/jobs/{id}`).
    Cancelled,
    /// The backend reported an error; `retry_after_ms` is a server's `Retry-After`.
    /// `reason` is the backend's code ([`Reason::Backend`]), or [`Reason::ConsumerTimeout`]
    /// for a call cut at the ack window.
    Failed {
        retryable: bool,
        reason: Reason,
        retry_after_ms: Option<u64>,
    },
}

impl CallResult {
    /// Whether this call teaches the call-time estimator, and how: `Some(false)` for a
    /// call that completed (its duration is a sample), `Some(true)` for one cut at the
    /// deadline (its duration is a lower bound: the call would have taken longer), `None`
    /// for a failure or a cancellation, which say nothing about how long a useful call takes.
    /// The adaptive concurrency limit learns from the same calls.
    pub fn teaches_call_time(&self) -> Option<bool> {
        match self {
            CallResult::Completed => Some(false),
            CallResult::DeadlineExceeded => Some(true),
            CallResult::Cancelled | CallResult::Failed { .. } => None,
        }
    }
}

/// What the runtime knows about a delivery besides its body.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ReceiptFacts {
    /// The ledger already holds a terminal outcome for this job id.
    pub already_recorded: bool,
    /// Model calls already started for this job (ledger attempt rows), over all deliveries.
    pub prior_starts: u32,
    /// Its cancellation was requested and it has no outcome yet: record `cancelled`.
    pub cancel_requested: bool,
    /// How long the job is expected to wait for a model slot ([`crate::wait`]); `0` when
    /// a slot is free or nothing is known yet.
    pub expected_wait_ms: u64,
    /// The learned duration of this kind's model calls (a high quantile,
    /// [`crate::service_time`]); `None` while nothing is learned.
    pub learned_runtime_ms: Option<u64>,
    /// When this delivery may be handed back (it never was: not a redelivery), what the
    /// best other worker offers by its fresh lease ([`crate::live::best_peer`]). A job
    /// refused at receipt here — for its expected wait or this worker's learned call
    /// time — that the same check admits with the peer's wait and call time is handed
    /// back ([`Disposition::PassOn`]) instead of recorded; its redelivery decides for good.
    pub peer: Option<PeerOffer>,
}

/// Another worker's expected wait for a slot and learned call time for a job's kind
/// ([`ReceiptFacts::peer`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PeerOffer {
    pub wait_ms: u64,
    /// `None`: that worker has learned nothing of the kind yet.
    pub call_ms: Option<u64>,
}

/// The worker's whole decision policy.
#[derive(Debug, Clone)]
pub struct WorkerPolicy {
    pub admission: AdmissionPolicy,
    pub limits: EnvelopeLimits,
    pub expired_action: ExpiredAction,
    pub retry: RetryPolicy,
    /// Model calls started for one job after which another start is refused as poison
    /// (the worker may have crashed inside each of them).
    pub max_starts: u32,
    /// Refuse at receipt a job that would no longer pass the admission check after its
    /// expected wait for a slot ([`ReceiptFacts::expected_wait_ms`]). On by default.
    pub refuse_on_expected_wait: bool,
    /// Which deadline checks run: [`DeadlineChecks`] (benchmark references aside).
    pub dispatch: Arc<dyn Dispatch>,
}

impl Default for WorkerPolicy {
    fn default() -> Self {
        Self {
            admission: AdmissionPolicy::default(),
            limits: EnvelopeLimits::default(),
            expired_action: ExpiredAction::Ack,
            retry: RetryPolicy::default(),
            max_starts: 5,
            refuse_on_expected_wait: true,
            dispatch: Arc::new(DeadlineChecks),
        }
    }
}

impl WorkerPolicy {
    /// The minimum useful runtime of `env`: its own `min_runtime_ms` wins; else the
    /// learned call duration, never below the configured floor
    /// (`default_min_runtime_ms`); else `None` (the floor applies). The flag says whether
    /// the learned value decided.
    pub fn min_runtime(&self, env: &Envelope, learned_ms: Option<u64>) -> (Option<u64>, bool) {
        match (env.min_runtime_ms, learned_ms) {
            (Some(own), _) => (Some(own), false),
            (None, Some(l)) if l > self.admission.default_min_runtime_ms => (Some(l), true),
            (None, _) => (None, false),
        }
    }

    /// The admission check of `env` at `now_ms` with the learned duration: the call
    /// budget, or the refusal reason for `stage`.
    pub fn check(
        &self,
        env: &Envelope,
        learned_ms: Option<u64>,
        stage: Stage,
        now_ms: i64,
    ) -> Result<u64, Reason> {
        let (min_runtime, learned) = self.min_runtime(env, learned_ms);
        match self.admission.check(env.deadline(), min_runtime, now_ms) {
            Admission::Admit { budget_ms } => Ok(budget_ms),
            Admission::Refuse {
                refusal: Refusal::BelowMinRuntime,
                ..
            } if learned => Err(Reason::Refused(stage, RefusalCause::BelowLearnedRuntime)),
            Admission::Refuse { refusal, .. } => Err(Reason::Refused(stage, refusal.into())),
        }
    }

    /// The smallest budget, from the instant of a refusal for lack of time
    /// ([`Reason::is_budget_refusal`]), with which a job like `env` passes the check that
    /// refused it: the expected wait for a slot (`wait_ms`; 0 at the slot, and at receipt
    /// when the policy does not refuse on it), the clock margin, and the minimum useful
    /// runtime as the check applies it (the job's own, else the learned call time, else the
    /// floor; at least 1 ms, since the budget left after the margin must be positive).
    pub fn min_feasible_budget_ms(
        &self,
        env: &Envelope,
        learned_ms: Option<u64>,
        wait_ms: u64,
    ) -> u64 {
        let (min_runtime, _) = self.min_runtime(env, learned_ms);
        let min_runtime = min_runtime.unwrap_or(self.admission.default_min_runtime_ms);
        let wait_ms = if self.refuse_on_expected_wait {
            wait_ms
        } else {
            0
        };
        wait_ms
            .saturating_add(self.admission.clock_uncertainty_ms)
            .saturating_add(min_runtime.max(1))
    }

    /// When the learned duration alone refuses `env` at `now_ms` (refused with
    /// `learned_ms` for `below_learned_runtime`, admitted without it: the job's own minimum
    /// or the floor), the budget the call would get without it; else `None`. Such a job
    /// may run as a probe while a slot is free
    /// ([`crate::service_time::ServiceTimes::try_probe`]).
    pub fn refused_by_learned(
        &self,
        env: &Envelope,
        learned_ms: Option<u64>,
        now_ms: i64,
    ) -> Option<u64> {
        let stage = Stage::Admission;
        match self.check(env, learned_ms, stage, now_ms) {
            Err(Reason::Refused(_, RefusalCause::BelowLearnedRuntime)) => {
                self.check(env, None, stage, now_ms).ok()
            }
            _ => None,
        }
    }

    /// The latest instant at which `env` still passes the admission check: the deadline
    /// less the clock margin and the minimum useful runtime. A job waiting for a slot past
    /// this instant can be settled at once: it can no longer finish in time.
    pub fn latest_start_ms(&self, env: &Envelope, learned_ms: Option<u64>) -> i64 {
        let (min_runtime, _) = self.min_runtime(env, learned_ms);
        let min_runtime = min_runtime.unwrap_or(self.admission.default_min_runtime_ms);
        env.deadline()
            .expires_at_ms()
            .saturating_sub(i64::try_from(self.admission.clock_uncertainty_ms).unwrap_or(i64::MAX))
            .saturating_sub(i64::try_from(min_runtime.max(1)).unwrap_or(i64::MAX))
    }

    /// Whether a job waiting for a slot leaves the buffer at its latest useful start
    /// ([`Self::latest_start_ms`]); the reference policies keep it waiting.
    pub fn watches_latest_start(&self) -> bool {
        self.dispatch.watches_latest_start()
    }

    /// The model server's breaker is open past the job's latest useful start: it ends
    /// without a call (`admission:upstream_unavailable`).
    pub fn upstream_unavailable(&self) -> Disposition {
        self.expired(Reason::Refused(
            Stage::Admission,
            RefusalCause::UpstreamUnavailable,
        ))
    }

    /// The backend's next rate-limit permit comes after the job's latest useful start: it
    /// ends without a call (`admission:rate_limited`).
    pub fn rate_limited(&self) -> Disposition {
        self.expired(Reason::Refused(Stage::Admission, RefusalCause::RateLimited))
    }

    /// Settle an expired job as the policy says (`expired_not_started`, acked or
    /// dead-lettered by [`ExpiredAction`]).
    pub fn expired(&self, reason: Reason) -> Disposition {
        let t = Terminal::new(State::ExpiredNotStarted, reason);
        match self.expired_action {
            ExpiredAction::Ack => Disposition::RecordThenAck(t),
            ExpiredAction::DeadLetter => Disposition::RecordThenDeadLetter(t),
        }
    }

    /// The delivery has just arrived.
    pub fn on_receipt(
        &self,
        parsed: &Result<Envelope, RejectError>,
        facts: ReceiptFacts,
        now_ms: i64,
    ) -> Receipt {
        let env = match parsed {
            Err(e) => {
                return Receipt::Settle(Disposition::RecordThenDeadLetter(Terminal::new(
                    State::Rejected,
                    Reason::Rejected(e.reason),
                )));
            }
            Ok(env) => env,
        };
        if facts.already_recorded {
            return Receipt::Settle(Disposition::AckDuplicate);
        }
        if facts.cancel_requested {
            return Receipt::Settle(Disposition::RecordThenAck(Terminal::new(
                State::Cancelled,
                Reason::CancelRequested,
            )));
        }
        if facts.prior_starts >= self.max_starts {
            return Receipt::Settle(Disposition::RecordThenDeadLetter(Terminal::new(
                State::Failed,
                Reason::Poison,
            )));
        }
        self.dispatch.on_receipt(self, env, facts, now_ms)
    }

    /// A model slot is free: the last admission check, immediately before the call.
    /// `learned_ms` is the learned duration of this kind's calls (`None`: nothing learned).
    /// (The bench's reference policies skip it: their call runs with [`UNBOUNDED_BUDGET_MS`].)
    pub fn on_slot(&self, env: &Envelope, learned_ms: Option<u64>, now_ms: i64) -> Slot {
        self.dispatch.on_slot(self, env, learned_ms, now_ms)
    }

    /// The model call of `attempt` (0-based) has ended. `learned_ms`: the learned call
    /// time of the job's kind; a retry must leave it (or the job's own minimum runtime)
    /// after its delay, and a server's `Retry-After` is honoured or the job ends at once
    /// (`retry:rate_limited`).
    pub fn on_call_result(
        &self,
        env: &Envelope,
        attempt: u32,
        result: &CallResult,
        learned_ms: Option<u64>,
        now_ms: i64,
        jitter: f64,
    ) -> Disposition {
        match result {
            CallResult::Completed => Disposition::RecordThenAck(Terminal {
                state: State::Completed,
                reason: None,
            }),
            CallResult::DeadlineExceeded => Disposition::RecordThenAck(Terminal::new(
                State::DeadlineExceeded,
                Reason::CancelledAtDeadline,
            )),
            CallResult::Cancelled => {
                Disposition::RecordThenAck(Terminal::new(State::Cancelled, Reason::CancelRequested))
            }
            CallResult::Failed {
                retryable: false,
                reason,
                ..
            } => Disposition::RecordThenDeadLetter(Terminal::new(State::Failed, reason.clone())),
            CallResult::Failed {
                retryable: true,
                retry_after_ms,
                ..
            } => {
                let (min_runtime_ms, _) = self.min_runtime(env, learned_ms);
                match self.retry.decide_after(
                    attempt,
                    env.deadline(),
                    min_runtime_ms,
                    &self.admission,
                    now_ms,
                    jitter,
                    retry_after_ms.unwrap_or(0),
                ) {
                    RetryDecision::Retry {
                        next_attempt,
                        queue_index,
                        delay_ms,
                        ttl_ms,
                    } => Disposition::Retry {
                        next_attempt,
                        queue_index,
                        delay_ms,
                        ttl_ms,
                    },
                    RetryDecision::WouldOvershoot { .. } => {
                        self.expired(Reason::Refused(Stage::Retry, RefusalCause::WouldOvershoot))
                    }
                    RetryDecision::RateLimited { .. } => {
                        self.expired(Reason::Refused(Stage::Retry, RefusalCause::RateLimited))
                    }
                    RetryDecision::Exhausted => Disposition::RecordThenDeadLetter(Terminal::new(
                        State::Failed,
                        Reason::RetriesExhausted,
                    )),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::deadline::Deadline;
    use crate::ids::{JobId, Kind};
    use proptest::prelude::*;
    use serde_json::Map;

    #[test]
    fn only_useful_calls_teach_the_call_time_and_a_cut_one_as_a_bound() {
        assert_eq!(CallResult::Completed.teaches_call_time(), Some(false));
        assert_eq!(CallResult::DeadlineExceeded.teaches_call_time(), Some(true));
        assert_eq!(CallResult::Cancelled.teaches_call_time(), None);
        let failed = CallResult::Failed {
            retryable: true,
            reason: Reason::Backend("http_503".into()),
            retry_after_ms: None,
        };
        assert_eq!(failed.teaches_call_time(), None);
    }

    fn env(expires: i64) -> Envelope {
        Envelope::new(
            JobId::parse("j").unwrap(),
            Kind::parse("k").unwrap(),
            Deadline::new(0, expires),
            None,
            None,
            Map::new(),
        )
    }

    fn policy() -> WorkerPolicy {
        WorkerPolicy {
            admission: AdmissionPolicy {
                clock_uncertainty_ms: 100,
                default_min_runtime_ms: 0,
            },
            ..WorkerPolicy::default()
        }
    }

    #[test]
    fn every_worker_runs_the_deadline_checks_by_default() {
        let p = WorkerPolicy::default();
        assert_eq!(p.dispatch.name(), "deadline");
        assert!(p.watches_latest_start());
        // The last check runs at the slot: an expired job is settled, not run.
        assert!(matches!(
            p.on_slot(&env(1_000), None, 5_000),
            Slot::Settle(_)
        ));
    }

    #[test]
    fn receipt_cases() {
        let p = policy();
        let ok = Ok(env(10_000));
        assert_eq!(
            p.on_receipt(&ok, ReceiptFacts::default(), 1_000),
            Receipt::WaitForSlot
        );
        assert_eq!(
            p.on_receipt(
                &ok,
                ReceiptFacts {
                    already_recorded: true,
                    ..ReceiptFacts::default()
                },
                1_000
            ),
            Receipt::Settle(Disposition::AckDuplicate)
        );
        assert_eq!(
            p.on_receipt(&ok, ReceiptFacts::default(), 9_950),
            Receipt::Settle(Disposition::RecordThenAck(Terminal::new(
                State::ExpiredNotStarted,
                Reason::Refused(Stage::Receipt, RefusalCause::DeadlinePassed)
            )))
        );
        assert_eq!(
            p.on_receipt(
                &ok,
                ReceiptFacts {
                    prior_starts: 5,
                    ..ReceiptFacts::default()
                },
                0
            ),
            Receipt::Settle(Disposition::RecordThenDeadLetter(Terminal::new(
                State::Failed,
                Reason::Poison
            )))
        );
        // A cancellation requested while it ran (or waited in a retry queue): recorded
        // `cancelled`, never run again — but a recorded outcome stays a duplicate.
        let cancel = ReceiptFacts {
            cancel_requested: true,
            ..ReceiptFacts::default()
        };
        assert_eq!(
            p.on_receipt(&ok, cancel, 1_000),
            Receipt::Settle(Disposition::RecordThenAck(Terminal::new(
                State::Cancelled,
                Reason::CancelRequested
            )))
        );
        assert_eq!(
            p.on_receipt(
                &ok,
                ReceiptFacts {
                    already_recorded: true,
                    ..cancel
                },
                1_000
            ),
            Receipt::Settle(Disposition::AckDuplicate)
        );
        assert_eq!(
            p.on_call_result(&env(10_000), 0, &CallResult::Cancelled, None, 1_000, 0.0),
            Disposition::RecordThenAck(Terminal::new(State::Cancelled, Reason::CancelRequested))
        );
        let bad = Envelope::parse(b"nope", &EnvelopeLimits::default(), 0);
        assert_eq!(
            p.on_receipt(&bad, ReceiptFacts::default(), 0),
            Receipt::Settle(Disposition::RecordThenDeadLetter(Terminal::new(
                State::Rejected,
                Reason::Rejected(crate::envelope::RejectReason::InvalidJson)
            )))
        );
    }

    #[test]
    fn a_job_refused_here_that_a_peer_would_admit_is_passed_on() {
        let p = policy();
        let ok = Ok(env(10_000));
        let facts = |ms, wait: Option<u64>| ReceiptFacts {
            expected_wait_ms: ms,
            peer: wait.map(|wait_ms| PeerOffer {
                wait_ms,
                call_ms: None,
            }),
            ..ReceiptFacts::default()
        };
        // Admissible until 9,900: 900 ms of wait here refuses it at 9,000, 100 at a peer
        // would not.
        assert_eq!(
            p.on_receipt(&ok, facts(900, Some(100)), 9_000),
            Receipt::Settle(Disposition::PassOn)
        );
        assert_eq!(
            p.on_receipt(&ok, facts(800, Some(0)), 9_000),
            Receipt::WaitForSlot,
            "it can wait here"
        );
        // The peers' wait would refuse it too, or there is none to ask: recorded here.
        for peer in [Some(900), None] {
            assert!(matches!(
                p.on_receipt(&ok, facts(900, peer), 9_000),
                Receipt::Settle(Disposition::RecordThenAck(_))
            ));
        }
        // Its own deadline refuses it: no other worker could start it either.
        assert_eq!(
            p.on_receipt(&ok, facts(5_000, Some(0)), 9_950),
            Receipt::Settle(p.expired(Reason::Refused(
                Stage::Receipt,
                RefusalCause::DeadlinePassed
            )))
        );
        // This worker's learned call time refuses it (a slower worker); a peer's shorter
        // one admits it, a peer as slow does not.
        let slow = |call_ms| ReceiptFacts {
            learned_runtime_ms: Some(2_000),
            peer: Some(PeerOffer {
                wait_ms: 0,
                call_ms,
            }),
            ..ReceiptFacts::default()
        };
        assert_eq!(
            p.on_receipt(&ok, slow(Some(500)), 9_000),
            Receipt::Settle(Disposition::PassOn)
        );
        assert!(matches!(
            p.on_receipt(&ok, slow(Some(2_000)), 9_000),
            Receipt::Settle(Disposition::RecordThenAck(_))
        ));
    }

    fn refused_for_time(d: &Disposition) -> bool {
        matches!(d, Disposition::RecordThenAck(Terminal { reason: Some(r), .. }) if r.is_budget_refusal())
    }

    proptest! {
        /// A job refused for lack of time at receipt or at the slot, sent again with the
        /// budget the refusal names, passes the same check at the same instant with the
        /// same facts; one millisecond less does not.
        #[test]
        fn the_min_feasible_budget_passes_the_check_that_refused(
            budget in -2_000i64..20_000,
            own_min in proptest::option::of(0u64..5_000),
            learned in proptest::option::of(0u64..5_000),
            wait in 0u64..10_000,
            margin in 0u64..500,
            floor in 0u64..2_000,
            refuse_on_wait in any::<bool>(),
        ) {
            let now = 1_000_000;
            let p = WorkerPolicy {
                admission: AdmissionPolicy { clock_uncertainty_ms: margin, default_min_runtime_ms: floor },
                refuse_on_expected_wait: refuse_on_wait,
                ..WorkerPolicy::default()
            };
            let job = |b: i64| Envelope::new(
                JobId::parse("j").unwrap(),
                Kind::parse("k").unwrap(),
                Deadline::new(now - 1_000, now + b),
                own_min,
                None,
                Map::new(),
            );
            let facts = ReceiptFacts { expected_wait_ms: wait, learned_runtime_ms: learned, ..ReceiptFacts::default() };
            if let Receipt::Settle(d) = p.on_receipt(&Ok(job(budget)), facts, now) {
                prop_assert!(refused_for_time(&d), "{d:?}");
                let min = p.min_feasible_budget_ms(&job(budget), learned, wait) as i64;
                prop_assert!(min > budget);
                prop_assert_eq!(p.on_receipt(&Ok(job(min)), facts, now), Receipt::WaitForSlot);
                prop_assert!(matches!(p.on_receipt(&Ok(job(min - 1)), facts, now), Receipt::Settle(_)));
            }
            if let Slot::Settle(d) = p.on_slot(&job(budget), learned, now) {
                prop_assert!(refused_for_time(&d), "{d:?}");
                let min = p.min_feasible_budget_ms(&job(budget), learned, 0) as i64;
                prop_assert!(min > budget);
                let run = matches!(p.on_slot(&job(min), learned, now), Slot::Run { .. });
                prop_assert!(run, "refused at the slot with {}", min);
                prop_assert!(matches!(p.on_slot(&job(min - 1), learned, now), Slot::Settle(_)));
            }
        }
    }

    #[test]
    fn receipt_refuses_when_the_expected_wait_leaves_too_little() {
        let p = policy();
        // Deadline 10,000, margin 100: admissible until 9,900 (min runtime 0).
        let ok = Ok(env(10_000));
        let waiting = |ms| ReceiptFacts {
            expected_wait_ms: ms,
            ..ReceiptFacts::default()
        };
        assert_eq!(p.on_receipt(&ok, waiting(800), 9_000), Receipt::WaitForSlot);
        assert_eq!(
            p.on_receipt(&ok, waiting(900), 9_000),
            Receipt::Settle(Disposition::RecordThenAck(Terminal::new(
                State::ExpiredNotStarted,
                Reason::Refused(Stage::Receipt, RefusalCause::ExpectedWaitExceedsBudget)
            )))
        );
        // Already too late now: the plain receipt reason wins.
        assert_eq!(
            p.on_receipt(&ok, waiting(5_000), 9_950),
            Receipt::Settle(p.expired(Reason::Refused(
                Stage::Receipt,
                RefusalCause::DeadlinePassed
            )))
        );
        // Switched off: only the plain check.
        let off = WorkerPolicy {
            refuse_on_expected_wait: false,
            ..policy()
        };
        assert_eq!(
            off.on_receipt(&ok, waiting(900), 9_000),
            Receipt::WaitForSlot
        );
        // A duplicate stays a duplicate whatever the wait.
        let dup = ReceiptFacts {
            already_recorded: true,
            ..waiting(1_000_000)
        };
        assert_eq!(
            p.on_receipt(&ok, dup, 0),
            Receipt::Settle(Disposition::AckDuplicate)
        );
    }

    #[test]
    fn slot_and_expired_action() {
        let mut p = policy();
        assert_eq!(
            p.on_slot(&env(10_080), None, 10_000),
            Slot::Settle(p.expired(Reason::Refused(
                Stage::Admission,
                RefusalCause::DeadlinePassed
            )))
        );
        assert_eq!(
            p.on_slot(&env(10_200), None, 10_000),
            Slot::Run { budget_ms: 100 }
        );
        p.expired_action = ExpiredAction::DeadLetter;
        assert!(matches!(
            p.on_slot(&env(0), None, 10),
            Slot::Settle(Disposition::RecordThenDeadLetter(_))
        ));
    }

    #[test]
    fn the_learned_runtime_refuses_work_that_cannot_finish() {
        let p = policy(); // margin 100 ms, floor 0
        let e = env(10_000);
        // 300 ms left after the margin, calls learned to take 200 ms: run.
        assert_eq!(
            p.on_slot(&e, Some(200), 9_600),
            Slot::Run { budget_ms: 300 }
        );
        // 150 ms left: the call cannot finish; the reason names the learned estimate.
        assert_eq!(
            p.on_slot(&e, Some(200), 9_750),
            Slot::Settle(p.expired(Reason::Refused(
                Stage::Admission,
                RefusalCause::BelowLearnedRuntime
            )))
        );
        assert_eq!(
            p.on_receipt(
                &Ok(e.clone()),
                ReceiptFacts {
                    learned_runtime_ms: Some(200),
                    ..ReceiptFacts::default()
                },
                9_750
            ),
            Receipt::Settle(p.expired(Reason::Refused(
                Stage::Receipt,
                RefusalCause::BelowLearnedRuntime
            )))
        );
        // Nothing learned yet: the floor (0 here) applies.
        assert_eq!(p.on_slot(&e, None, 9_750), Slot::Run { budget_ms: 150 });
        // The job's own minimum wins over the learned one.
        let mut own = env(10_000);
        own.min_runtime_ms = Some(100);
        assert_eq!(
            p.on_slot(&own, Some(200), 9_750),
            Slot::Run { budget_ms: 150 }
        );
        // A learned time below the configured floor never lowers it.
        let floor = WorkerPolicy {
            admission: AdmissionPolicy {
                clock_uncertainty_ms: 100,
                default_min_runtime_ms: 500,
            },
            ..WorkerPolicy::default()
        };
        assert_eq!(
            floor.on_slot(&e, Some(200), 9_500),
            Slot::Settle(floor.expired(Reason::Refused(
                Stage::Admission,
                RefusalCause::BelowMinRuntime
            )))
        );
        // The last moment a start is still useful.
        assert_eq!(p.latest_start_ms(&e, Some(200)), 9_700);
        assert_eq!(floor.latest_start_ms(&e, Some(200)), 9_400);
        assert_eq!(p.latest_start_ms(&own, Some(5_000)), 9_800);
    }

    #[test]
    fn call_results() {
        let p = policy();
        let e = env(100_000);
        assert!(matches!(
            p.on_call_result(&e, 0, &CallResult::Completed, None, 0, 0.5),
            Disposition::RecordThenAck(Terminal {
                state: State::Completed,
                ..
            })
        ));
        assert!(matches!(
            p.on_call_result(&e, 0, &CallResult::DeadlineExceeded, None, 0, 0.5),
            Disposition::RecordThenAck(Terminal {
                state: State::DeadlineExceeded,
                ..
            })
        ));
        let terminal = CallResult::Failed {
            retryable: false,
            reason: Reason::Backend("http_400".into()),
            retry_after_ms: None,
        };
        assert_eq!(
            p.on_call_result(&e, 0, &terminal, None, 0, 0.5),
            Disposition::RecordThenDeadLetter(Terminal::new(
                State::Failed,
                Reason::Backend("http_400".into())
            ))
        );
        let retryable = CallResult::Failed {
            retryable: true,
            reason: Reason::Backend("http_503".into()),
            retry_after_ms: None,
        };
        assert!(matches!(
            p.on_call_result(&e, 0, &retryable, None, 0, 0.5),
            Disposition::Retry {
                next_attempt: 1,
                ..
            }
        ));
        assert_eq!(
            p.on_call_result(&e, 2, &retryable, None, 0, 0.5),
            Disposition::RecordThenDeadLetter(Terminal::new(
                State::Failed,
                Reason::RetriesExhausted
            ))
        );
        assert_eq!(
            p.on_call_result(&env(1_500), 0, &retryable, None, 1_000, 0.5),
            p.expired(Reason::Refused(Stage::Retry, RefusalCause::WouldOvershoot))
        );
    }

    proptest! {
        /// No path runs or retries a job that the admission rule would refuse, and nothing
        /// returned carries a changed deadline: the envelope is only ever borrowed.
        #[test]
        fn no_transition_runs_stale_work(expires in 0i64..100_000, now in 0i64..100_000, unc in 0u64..1_000, min_rt in 0u64..1_000, learned in 0u64..5_000, attempt in 0u32..4, jitter in 0.0f64..1.0) {
            let p = WorkerPolicy {
                admission: AdmissionPolicy { clock_uncertainty_ms: unc, default_min_runtime_ms: min_rt },
                ..WorkerPolicy::default()
            };
            let e = env(expires);
            let before = e.clone();
            if let Slot::Run { budget_ms } = p.on_slot(&e, None, now) {
                prop_assert!(now + unc as i64 + min_rt as i64 <= expires);
                prop_assert!(now + budget_ms as i64 <= expires);
            }
            // With a learned duration, a call starts only with at least that much left,
            // and never after `latest_start_ms`.
            if let Slot::Run { .. } = p.on_slot(&e, Some(learned), now) {
                prop_assert!(now + unc as i64 + (learned.max(min_rt)) as i64 <= expires);
                prop_assert!(now <= p.latest_start_ms(&e, Some(learned)));
            }
            let facts = ReceiptFacts { learned_runtime_ms: Some(learned), ..ReceiptFacts::default() };
            if p.on_receipt(&Ok(e.clone()), facts, now) == Receipt::WaitForSlot {
                prop_assert!(now + unc as i64 + (learned.max(min_rt)) as i64 <= expires);
            }
            if p.on_receipt(&Ok(e.clone()), ReceiptFacts::default(), now) == Receipt::WaitForSlot {
                prop_assert!(now + unc as i64 + (min_rt as i64) <= expires);
            }
            let r = CallResult::Failed { retryable: true, reason: Reason::Backend("x".into()), retry_after_ms: None };
            if let Disposition::Retry { delay_ms, ttl_ms, .. } = p.on_call_result(&e, attempt, &r, None, now, jitter) {
                prop_assert!(now + delay_ms as i64 + unc as i64 + min_rt as i64 <= expires);
                prop_assert!(ttl_ms as i64 <= expires - now);
            }
            prop_assert_eq!(e, before);
        }

        /// The expected wait only ever refuses earlier, never admits what the plain
        /// receipt check refuses; and a job kept waiting passes the check at now + wait.
        #[test]
        fn expected_wait_only_tightens_receipt(expires in 0i64..100_000, now in 0i64..100_000, unc in 0u64..1_000, min_rt in 0u64..1_000, wait in 0u64..5_000) {
            let p = WorkerPolicy {
                admission: AdmissionPolicy { clock_uncertainty_ms: unc, default_min_runtime_ms: min_rt },
                ..WorkerPolicy::default()
            };
            let e = Ok(env(expires));
            let plain = p.on_receipt(&e, ReceiptFacts::default(), now);
            let facts = ReceiptFacts { expected_wait_ms: wait, ..ReceiptFacts::default() };
            let with_wait = p.on_receipt(&e, facts, now);
            if with_wait == Receipt::WaitForSlot {
                prop_assert_eq!(&plain, &Receipt::WaitForSlot);
                prop_assert!(now + wait as i64 + unc as i64 + min_rt as i64 <= expires);
            }
            if plain != Receipt::WaitForSlot {
                prop_assert_eq!(with_wait, plain);
            }
        }
    }
}
