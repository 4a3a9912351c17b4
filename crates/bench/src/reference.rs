//! The reference policies `bench goodput` compares lastcall's with: the deadline checks
//! of the usual task queues, as implementations of the core's [`Dispatch`] trait, so that
//! no production decision has a branch for them.
//!
//! - [`ReceiptOnly`]: check at receipt only, as Celery does with `expires`; a job that
//!   waited for a slot past its deadline still runs, and its call runs to the end (no
//!   deadline timeout: [`UNBOUNDED_BUDGET_MS`]).
//! - [`Naive`]: no deadline check at all: every valid job runs to the end.

use lastcall_core::disposition::{Dispatch, Receipt, Slot, UNBOUNDED_BUDGET_MS};
use lastcall_core::{Envelope, ReceiptFacts, Stage, WorkerPolicy};

/// Check at receipt only (Celery's `expires`): no expected-wait prediction, no last check.
#[derive(Debug, Clone, Copy)]
pub struct ReceiptOnly;

impl Dispatch for ReceiptOnly {
    fn name(&self) -> &'static str {
        "receipt-only"
    }

    fn on_receipt(
        &self,
        policy: &WorkerPolicy,
        env: &Envelope,
        facts: ReceiptFacts,
        now_ms: i64,
    ) -> Receipt {
        match policy.check(env, facts.learned_runtime_ms, Stage::Receipt, now_ms) {
            Err(reason) => Receipt::Settle(policy.expired(reason)),
            Ok(_) => Receipt::WaitForSlot,
        }
    }

    fn on_slot(&self, _: &WorkerPolicy, _: &Envelope, _: Option<u64>, _: i64) -> Slot {
        Slot::Run {
            budget_ms: UNBOUNDED_BUDGET_MS,
        }
    }

    fn watches_latest_start(&self) -> bool {
        false
    }
}

/// No deadline check: every valid job waits for a slot and runs to the end.
#[derive(Debug, Clone, Copy)]
pub struct Naive;

impl Dispatch for Naive {
    fn name(&self) -> &'static str {
        "naive"
    }

    fn on_receipt(&self, _: &WorkerPolicy, _: &Envelope, _: ReceiptFacts, _: i64) -> Receipt {
        Receipt::WaitForSlot
    }

    fn on_slot(&self, _: &WorkerPolicy, _: &Envelope, _: Option<u64>, _: i64) -> Slot {
        Slot::Run {
            budget_ms: UNBOUNDED_BUDGET_MS,
        }
    }

    fn watches_latest_start(&self) -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lastcall_core::disposition::{DeadlineChecks, Disposition};
    use lastcall_core::{Deadline, JobId, Kind};
    use std::sync::Arc;

    fn env(expires_at_ms: i64) -> Envelope {
        Envelope::new(
            JobId::parse("ref-1").unwrap(),
            Kind::parse("summarize").unwrap(),
            Deadline::new(0, expires_at_ms),
            None,
            None,
            serde_json::Map::new(),
        )
    }

    fn with(dispatch: Arc<dyn Dispatch>) -> WorkerPolicy {
        WorkerPolicy {
            dispatch,
            admission: lastcall_core::AdmissionPolicy {
                clock_uncertainty_ms: 100,
                default_min_runtime_ms: 0,
            },
            ..WorkerPolicy::default()
        }
    }

    #[test]
    fn reference_policies_skip_their_checks() {
        let (naive, receipt_only) = (with(Arc::new(Naive)), with(Arc::new(ReceiptOnly)));
        let deadline = with(Arc::new(DeadlineChecks));
        let expired = Ok(env(1_000));
        let facts = ReceiptFacts {
            expected_wait_ms: 60_000,
            ..ReceiptFacts::default()
        };
        // Naive: an expired job waits for a slot; receipt-only refuses it at receipt.
        assert_eq!(
            naive.on_receipt(&expired, facts, 5_000),
            Receipt::WaitForSlot
        );
        assert!(matches!(
            receipt_only.on_receipt(&expired, facts, 5_000),
            Receipt::Settle(Disposition::RecordThenAck(_))
        ));
        // Neither predicts the wait, which lastcall's check does.
        let fresh = Ok(env(10_000));
        assert_eq!(
            receipt_only.on_receipt(&fresh, facts, 1_000),
            Receipt::WaitForSlot
        );
        assert!(matches!(
            deadline.on_receipt(&fresh, facts, 1_000),
            Receipt::Settle(Disposition::RecordThenAck(_))
        ));
        // Both skip the last check and never watch the wait.
        for p in [&naive, &receipt_only] {
            assert_eq!(
                p.on_slot(&env(1_000), None, 5_000),
                Slot::Run {
                    budget_ms: UNBOUNDED_BUDGET_MS
                }
            );
            assert!(!p.watches_latest_start());
            // Poison and duplicates are not deadline checks: every policy keeps them.
            let dup = ReceiptFacts {
                already_recorded: true,
                ..ReceiptFacts::default()
            };
            assert_eq!(
                p.on_receipt(&fresh, dup, 1_000),
                Receipt::Settle(Disposition::AckDuplicate)
            );
        }
        assert!(deadline.watches_latest_start());
        assert!(matches!(
            deadline.on_slot(&env(1_000), None, 5_000),
            Slot::Settle(_)
        ));
    }
}
