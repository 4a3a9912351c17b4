//! Why a job ended as it did, and what a delivery's attempt row records: the ledger's
//! `reason` and `decision` columns as types (docs/concepts.md).
//!
//! Every writer builds a [`Reason`] and a [`Decision`]; they become text only where the
//! store binds them (`Display` / [`Decision::as_str`]). The texts are the wire and ledger
//! contract: the table test below pins every one of them byte for byte.

use std::fmt;

use crate::admission::{Refusal, Stage};
use crate::envelope::RejectReason;

/// What a deadline check found wrong, the second half of a `{stage}:{cause}` reason.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RefusalCause {
    /// No budget left after the clock margin (`deadline_passed`).
    DeadlinePassed,
    /// Less budget than the job's own (or the floor's) minimum runtime (`below_min_runtime`).
    BelowMinRuntime,
    /// Less budget than the *learned* call duration of its kind (`below_learned_runtime`).
    BelowLearnedRuntime,
    /// Enough budget now, but not after the expected wait for a slot
    /// (`expected_wait_exceeds_budget`).
    ExpectedWaitExceedsBudget,
    /// The retry's delay would end past the useful start (`would_overshoot`).
    WouldOvershoot,
    /// The model server's circuit breaker is open and the job's budget does not outlast
    /// it: no call to a server known to be down (`upstream_unavailable`).
    UpstreamUnavailable,
    /// A rate limit leaves no call in time (`rate_limited`): at `retry`, the server's
    /// `Retry-After` plus the learned call time does not fit the remaining budget (or is
    /// longer than the longest retry queue), so no retry earlier than the server asked; at
    /// `admission`, the backend's next rate-limit permit ([`crate::rate_limit`]) comes
    /// after the job's latest useful start, so no wait that cannot end in a useful call.
    RateLimited,
}

impl RefusalCause {
    pub const fn as_str(self) -> &'static str {
        match self {
            RefusalCause::DeadlinePassed => "deadline_passed",
            RefusalCause::BelowMinRuntime => "below_min_runtime",
            RefusalCause::BelowLearnedRuntime => "below_learned_runtime",
            RefusalCause::ExpectedWaitExceedsBudget => "expected_wait_exceeds_budget",
            RefusalCause::WouldOvershoot => "would_overshoot",
            RefusalCause::UpstreamUnavailable => "upstream_unavailable",
            RefusalCause::RateLimited => "rate_limited",
        }
    }
}

impl From<Refusal> for RefusalCause {
    fn from(r: Refusal) -> Self {
        match r {
            Refusal::DeadlinePassed => RefusalCause::DeadlinePassed,
            Refusal::BelowMinRuntime => RefusalCause::BelowMinRuntime,
        }
    }
}

/// The `reason` of an outcome a lastcall writer records. (The ledger's own SQL writes two
/// more: `no_outcome_after_deadline` for reconciliation's `unknown` and
/// `cancelled_before_start`; and a database may hold texts of other versions, so the read
/// side keeps reasons as text.)
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Reason {
    /// The envelope was refused (`rejected`): the parser's code, e.g. `invalid_json`,
    /// `bad_signature`.
    Rejected(RejectReason),
    /// A dead letter whose body is not a v1 envelope and whose parser gave no code
    /// (`invalid_envelope`).
    InvalidEnvelope,
    /// A deadline check refused the job: `{stage}:{cause}`, e.g. `admission:deadline_passed`,
    /// `receipt:below_learned_runtime`, `retry:would_overshoot`.
    Refused(Stage, RefusalCause),
    /// Cancelled on request once a worker had it (`cancel_requested`).
    CancelRequested,
    /// Too many model calls started for the job (`poison`).
    Poison,
    /// The call still ran at the deadline and was cut (`cancelled_at_deadline`).
    CancelledAtDeadline,
    /// The call was cut at the broker's consumer timeout, before the deadline
    /// (`consumer_timeout`).
    ConsumerTimeout,
    /// Retryable failures, and no retry left (`retries_exhausted`).
    RetriesExhausted,
    /// The retry's publish was not confirmed (`retry_publish_failed`).
    RetryPublishFailed,
    /// Dead letters: the broker TTL ran out before any worker got it (`broker_ttl_expired`).
    BrokerTtlExpired,
    /// Dead letters: a consumer rejected it and nothing was recorded
    /// (`rejected_without_outcome`).
    RejectedWithoutOutcome,
    /// Dead letters: the queue's length limit pushed it out (`maxlen`).
    MaxLen,
    /// Dead letters: a quorum queue's delivery limit (`delivery_limit`).
    DeliveryLimit,
    /// Dead letters with an `x-death` reason this build does not know:
    /// `dead_lettered:{reason}`, the reason cut to 32 characters ([`Reason::dead_lettered`]).
    DeadLettered(String),
    /// A failed model call: the backend's classified code (e.g. `http_400`, `sim_500`),
    /// as the backend names it.
    Backend(String),
}

impl Reason {
    /// `dead_lettered:{reason}` with the broker's reason cut to 32 characters.
    pub fn dead_lettered(broker_reason: &str) -> Self {
        Reason::DeadLettered(broker_reason.chars().take(32).collect())
    }

    /// Whether the reason is a worker's refusal for lack of time at receipt or at the slot
    /// (the deadline, a minimum runtime, the learned call time, the expected wait): one a
    /// longer budget would have avoided, whose record names the budget that would have
    /// been admitted ([`crate::disposition::WorkerPolicy::min_feasible_budget_ms`]).
    pub fn is_budget_refusal(&self) -> bool {
        matches!(
            self,
            Reason::Refused(
                Stage::Receipt | Stage::Admission,
                RefusalCause::DeadlinePassed
                    | RefusalCause::BelowMinRuntime
                    | RefusalCause::BelowLearnedRuntime
                    | RefusalCause::ExpectedWaitExceedsBudget
            )
        )
    }

    /// Whether the reason is a refusal decided by the learned call duration or the
    /// expected wait for a slot (the ledger note then names the estimate).
    pub fn is_learned_refusal(&self) -> bool {
        matches!(
            self,
            Reason::Refused(
                _,
                RefusalCause::BelowLearnedRuntime | RefusalCause::ExpectedWaitExceedsBudget
            )
        )
    }
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let word = match self {
            Reason::Rejected(r) => r.as_str(),
            Reason::InvalidEnvelope => "invalid_envelope",
            Reason::Refused(stage, cause) => {
                return write!(f, "{}:{}", stage.as_str(), cause.as_str());
            }
            Reason::CancelRequested => "cancel_requested",
            Reason::Poison => "poison",
            Reason::CancelledAtDeadline => "cancelled_at_deadline",
            Reason::ConsumerTimeout => "consumer_timeout",
            Reason::RetriesExhausted => "retries_exhausted",
            Reason::RetryPublishFailed => "retry_publish_failed",
            Reason::BrokerTtlExpired => "broker_ttl_expired",
            Reason::RejectedWithoutOutcome => "rejected_without_outcome",
            Reason::MaxLen => "maxlen",
            Reason::DeliveryLimit => "delivery_limit",
            Reason::DeadLettered(r) => return write!(f, "dead_lettered:{r}"),
            Reason::Backend(code) => code,
        };
        f.write_str(word)
    }
}

/// What a delivery's attempt row says was done with it: the ledger's `decision` column.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Decision {
    Ack,
    DeadLetter,
    /// A retry was published; the attempt is recorded `running`, not terminal.
    Retry,
    /// Handed back unstarted after its `running` row (the ack window closed meanwhile).
    HandedBack,
    /// Recorded by the dead-letter processor (`dead_letter_processed`).
    DeadLetterProcessed,
}

impl Decision {
    /// The ledger's `decision` column.
    pub const fn as_str(self) -> &'static str {
        match self {
            Decision::Ack => "ack",
            Decision::DeadLetter => "dead_letter",
            Decision::Retry => "retry",
            Decision::HandedBack => "handed_back",
            Decision::DeadLetterProcessed => "dead_letter_processed",
        }
    }
}

impl fmt::Display for Decision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The ledger texts are a contract (docs, dashboards, other versions reading the same
    /// database): every variant's text, byte for byte.
    #[test]
    fn every_reason_and_decision_keeps_its_ledger_text() {
        use RefusalCause as C;
        let reasons = [
            (Reason::Rejected(RejectReason::InvalidJson), "invalid_json"),
            (
                Reason::Rejected(RejectReason::BadSignature),
                "bad_signature",
            ),
            (Reason::InvalidEnvelope, "invalid_envelope"),
            (
                Reason::Refused(Stage::Admission, C::DeadlinePassed),
                "admission:deadline_passed",
            ),
            (
                Reason::Refused(Stage::Receipt, C::BelowMinRuntime),
                "receipt:below_min_runtime",
            ),
            (
                Reason::Refused(Stage::Admission, C::BelowLearnedRuntime),
                "admission:below_learned_runtime",
            ),
            (
                Reason::Refused(Stage::Receipt, C::ExpectedWaitExceedsBudget),
                "receipt:expected_wait_exceeds_budget",
            ),
            (
                Reason::Refused(Stage::Retry, C::WouldOvershoot),
                "retry:would_overshoot",
            ),
            (
                Reason::Refused(Stage::Admission, C::UpstreamUnavailable),
                "admission:upstream_unavailable",
            ),
            (
                Reason::Refused(Stage::Retry, C::RateLimited),
                "retry:rate_limited",
            ),
            (
                Reason::Refused(Stage::Admission, C::RateLimited),
                "admission:rate_limited",
            ),
            (
                Reason::Refused(Stage::Publish, C::DeadlinePassed),
                "publish:deadline_passed",
            ),
            (Reason::CancelRequested, "cancel_requested"),
            (Reason::Poison, "poison"),
            (Reason::CancelledAtDeadline, "cancelled_at_deadline"),
            (Reason::ConsumerTimeout, "consumer_timeout"),
            (Reason::RetriesExhausted, "retries_exhausted"),
            (Reason::RetryPublishFailed, "retry_publish_failed"),
            (Reason::BrokerTtlExpired, "broker_ttl_expired"),
            (Reason::RejectedWithoutOutcome, "rejected_without_outcome"),
            (Reason::MaxLen, "maxlen"),
            (Reason::DeliveryLimit, "delivery_limit"),
            (Reason::dead_lettered("weird"), "dead_lettered:weird"),
            (Reason::Backend("http_400".into()), "http_400"),
        ];
        for (reason, text) in reasons {
            assert_eq!(reason.to_string(), text, "{reason:?}");
        }
        assert_eq!(
            Reason::dead_lettered(&"x".repeat(40)).to_string(),
            format!("dead_lettered:{}", "x".repeat(32))
        );
        let decisions = [
            (Decision::Ack, "ack"),
            (Decision::DeadLetter, "dead_letter"),
            (Decision::Retry, "retry"),
            (Decision::HandedBack, "handed_back"),
            (Decision::DeadLetterProcessed, "dead_letter_processed"),
        ];
        for (d, text) in decisions {
            assert_eq!(d.as_str(), text);
            assert_eq!(d.to_string(), text);
        }
    }

    #[test]
    fn a_plain_refusal_keeps_the_admission_text() {
        for r in [Refusal::DeadlinePassed, Refusal::BelowMinRuntime] {
            for s in [
                Stage::Publish,
                Stage::Receipt,
                Stage::Admission,
                Stage::Retry,
            ] {
                assert_eq!(Reason::Refused(s, r.into()).to_string(), r.reason(s));
            }
        }
    }

    #[test]
    fn learned_refusals_are_named() {
        assert!(
            Reason::Refused(Stage::Admission, RefusalCause::BelowLearnedRuntime)
                .is_learned_refusal()
        );
        assert!(
            Reason::Refused(Stage::Receipt, RefusalCause::ExpectedWaitExceedsBudget)
                .is_learned_refusal()
        );
        assert!(
            !Reason::Refused(Stage::Receipt, RefusalCause::BelowMinRuntime).is_learned_refusal()
        );
        assert!(!Reason::Poison.is_learned_refusal());
    }
}
