//! Classifying dead letters by their `x-death` history.
//!
//! A dead letter keeps its body byte for byte, so its deadline is the original one; the
//! classification only decides which terminal outcome the dead-letter processor records
//! when the worker has not already recorded one. Stale work is never republished.

use crate::envelope::RejectReason;
use crate::outcome::State;
use crate::reason::Reason;

/// The broker's dead-letter reasons.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeathReason {
    /// The message's TTL ran out in a queue: it never reached a worker in time.
    Expired,
    /// A consumer rejected it without requeue.
    Rejected,
    /// The queue's length limit pushed it out.
    MaxLen,
    /// A quorum queue's delivery limit was exceeded (crash loops).
    DeliveryLimit,
    /// No `x-death` header, or a reason this build does not know.
    Other(String),
}

impl DeathReason {
    pub fn parse(s: &str) -> Self {
        match s {
            "expired" => Self::Expired,
            "rejected" => Self::Rejected,
            "maxlen" => Self::MaxLen,
            "delivery_limit" => Self::DeliveryLimit,
            other => Self::Other(other.to_owned()),
        }
    }

    /// A bounded label for metrics and per-reason queues.
    pub fn label(&self) -> &str {
        match self {
            Self::Expired => "expired",
            Self::Rejected => "rejected",
            Self::MaxLen => "maxlen",
            Self::DeliveryLimit => "delivery_limit",
            Self::Other(_) => "other",
        }
    }
}

/// What the dead-letter processor records (only if no terminal outcome exists yet).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeadLetterOutcome {
    pub state: State,
    pub reason: Reason,
}

/// Decide the outcome for a dead letter whose most recent death is `reason`.
/// `envelope_valid` says whether the body parsed as a v1 envelope; `reject_reason` is the
/// parser's reason code when it did not.
pub fn classify(
    reason: &DeathReason,
    envelope_valid: bool,
    reject_reason: Option<RejectReason>,
) -> DeadLetterOutcome {
    if !envelope_valid {
        return DeadLetterOutcome {
            state: State::Rejected,
            reason: reject_reason.map_or(Reason::InvalidEnvelope, Reason::Rejected),
        };
    }
    let (state, reason) = match reason {
        DeathReason::Expired => (State::ExpiredBeforeReceive, Reason::BrokerTtlExpired),
        DeathReason::Rejected => (State::Failed, Reason::RejectedWithoutOutcome),
        DeathReason::MaxLen => (State::Failed, Reason::MaxLen),
        DeathReason::DeliveryLimit => (State::Failed, Reason::DeliveryLimit),
        DeathReason::Other(r) => (State::Failed, Reason::dead_lettered(r)),
    };
    DeadLetterOutcome { state, reason }
}

/// The classes of dead letters that get a copy queue of their own (`{prefix}.dead.<class>`
/// with `lastcall dlq --split-by-reason`), so operators can watch each apart.
pub const SPLIT_LABELS: [&str; 7] = [
    "expired",
    "format",
    "signature",
    "model_failed",
    "poison",
    "maxlen",
    "other",
];

/// The copy queue class of a dead letter. The broker's `x-death` reason alone cannot say
/// *why* a worker rejected a message (RabbitMQ records only `rejected`), so a rejection is
/// split by what the parser says of the body (`reject`: its reason code, `None` when it
/// parsed) and, for a valid envelope, by the outcome the ledger holds for the job
/// (`recorded`: state and reason): format errors, signature errors and model failures end
/// in different queues.
pub fn split_label(
    death: &DeathReason,
    reject: Option<RejectReason>,
    recorded: Option<(&str, Option<&str>)>,
) -> &'static str {
    match death {
        DeathReason::Expired => "expired",
        DeathReason::MaxLen => "maxlen",
        DeathReason::DeliveryLimit => "poison",
        DeathReason::Rejected | DeathReason::Other(_) => match (reject, recorded) {
            (Some(RejectReason::BadSignature), _) => "signature",
            (Some(_), _) => "format",
            (None, Some((state, reason))) => match (state, reason) {
                ("rejected", Some("bad_signature")) => "signature",
                ("rejected", _) => "format",
                ("failed", Some("poison" | "delivery_limit")) => "poison",
                ("failed", _) => "model_failed",
                ("expired_not_started" | "expired_before_receive" | "deadline_exceeded", _) => {
                    "expired"
                }
                _ => "other",
            },
            (None, None) => "other",
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_reason_maps_to_one_outcome() {
        let c = |r: &str| classify(&DeathReason::parse(r), true, None);
        assert_eq!(c("expired").state, State::ExpiredBeforeReceive);
        assert_eq!(c("rejected").state, State::Failed);
        assert_eq!(c("expired").reason.to_string(), "broker_ttl_expired");
        assert_eq!(c("rejected").reason.to_string(), "rejected_without_outcome");
        assert_eq!(c("maxlen").reason.to_string(), "maxlen");
        assert_eq!(c("delivery_limit").reason.to_string(), "delivery_limit");
        assert_eq!(c("weird").reason.to_string(), "dead_lettered:weird");
        let bad = classify(
            &DeathReason::Expired,
            false,
            Some(RejectReason::InvalidJson),
        );
        assert_eq!(
            (bad.state, bad.reason.to_string().as_str()),
            (State::Rejected, "invalid_json")
        );
        let no_code = classify(&DeathReason::Expired, false, None);
        assert_eq!(no_code.reason.to_string(), "invalid_envelope");
    }

    #[test]
    fn rejections_are_split_by_what_the_ledger_says() {
        use super::{SPLIT_LABELS, split_label};
        let r = DeathReason::Rejected;
        assert_eq!(
            split_label(&r, Some(RejectReason::InvalidJson), None),
            "format"
        );
        assert_eq!(
            split_label(&r, Some(RejectReason::BadSignature), None),
            "signature"
        );
        assert_eq!(
            split_label(&r, None, Some(("rejected", Some("bad_signature")))),
            "signature"
        );
        assert_eq!(
            split_label(&r, None, Some(("failed", Some("http_400")))),
            "model_failed"
        );
        assert_eq!(
            split_label(&r, None, Some(("failed", Some("retries_exhausted")))),
            "model_failed"
        );
        assert_eq!(
            split_label(&r, None, Some(("failed", Some("poison")))),
            "poison"
        );
        assert_eq!(
            split_label(
                &r,
                None,
                Some(("expired_not_started", Some("admission:deadline_passed")))
            ),
            "expired"
        );
        assert_eq!(split_label(&r, None, None), "other");
        assert_eq!(split_label(&DeathReason::Expired, None, None), "expired");
        assert_eq!(
            split_label(&DeathReason::DeliveryLimit, None, None),
            "poison"
        );
        assert_eq!(
            split_label(&DeathReason::MaxLen, Some(RejectReason::InvalidJson), None),
            "maxlen"
        );
        // Every label is one of the declared queues.
        for (d, rej, rec) in [
            (
                DeathReason::Other("x".into()),
                None,
                Some(("completed", None)),
            ),
            (DeathReason::Rejected, None, Some(("unknown", None))),
        ] {
            assert!(SPLIT_LABELS.contains(&split_label(&d, rej, rec)));
        }
    }
}
