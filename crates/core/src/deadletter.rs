//! Classifying dead letters by their `x-death` history.
//!
//! A dead letter keeps its body byte for byte, so its deadline is the original one; the
//! classification only decides which terminal outcome the dead-letter processor records
//! when the worker has not already recorded one. Stale work is never republished.

use crate::outcome::State;

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
    pub reason: String,
}

/// Decide the outcome for a dead letter whose most recent death is `reason`.
/// `envelope_valid` says whether the body parsed as a v1 envelope; `reject_reason` is the
/// parser's reason code when it did not.
pub fn classify(
    reason: &DeathReason,
    envelope_valid: bool,
    reject_reason: Option<&str>,
) -> DeadLetterOutcome {
    if !envelope_valid {
        return DeadLetterOutcome {
            state: State::Rejected,
            reason: reject_reason.unwrap_or("invalid_envelope").to_owned(),
        };
    }
    let (state, reason) = match reason {
        DeathReason::Expired => (State::ExpiredBeforeReceive, "broker_ttl_expired".to_owned()),
        DeathReason::Rejected => (State::Failed, "rejected_without_outcome".to_owned()),
        DeathReason::MaxLen => (State::Failed, "maxlen".to_owned()),
        DeathReason::DeliveryLimit => (State::Failed, "delivery_limit".to_owned()),
        DeathReason::Other(r) => (
            State::Failed,
            format!("dead_lettered:{}", r.chars().take(32).collect::<String>()),
        ),
    };
    DeadLetterOutcome { state, reason }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_reason_maps_to_one_outcome() {
        let c = |r: &str| classify(&DeathReason::parse(r), true, None);
        assert_eq!(c("expired").state, State::ExpiredBeforeReceive);
        assert_eq!(c("rejected").state, State::Failed);
        assert_eq!(c("maxlen").reason, "maxlen");
        assert_eq!(c("delivery_limit").reason, "delivery_limit");
        assert_eq!(c("weird").reason, "dead_lettered:weird");
        let bad = classify(&DeathReason::Expired, false, Some("invalid_json"));
        assert_eq!(
            (bad.state, bad.reason.as_str()),
            (State::Rejected, "invalid_json")
        );
    }
}
