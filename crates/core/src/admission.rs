//! The last admission check before a model call.
//!
//! `remaining = expires_at_ms − now_ms − clock_uncertainty_ms`; the job is refused when
//! `remaining` is not positive or is below the minimum useful runtime.

use crate::deadline::Deadline;

/// Where in a job's life the check ran; stored as part of the refusal reason.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Stage {
    /// At the producer/ingress, before publishing.
    Publish,
    /// When the worker received the delivery.
    Receipt,
    /// Immediately before the model call, after waiting for a slot.
    Admission,
    /// Before publishing a retry.
    Retry,
}

impl Stage {
    pub const fn as_str(self) -> &'static str {
        match self {
            Stage::Publish => "publish",
            Stage::Receipt => "receipt",
            Stage::Admission => "admission",
            Stage::Retry => "retry",
        }
    }
}

/// Why a job was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Refusal {
    /// `remaining` (after the uncertainty margin) was not positive.
    DeadlinePassed,
    /// Some budget was left, but less than the minimum useful runtime.
    BelowMinRuntime,
}

impl Refusal {
    pub const fn as_str(self) -> &'static str {
        match self {
            Refusal::DeadlinePassed => "deadline_passed",
            Refusal::BelowMinRuntime => "below_min_runtime",
        }
    }

    /// The ledger reason for a refusal at `stage`, e.g. `admission:deadline_passed`.
    pub fn reason(self, stage: Stage) -> String {
        format!("{}:{}", stage.as_str(), self.as_str())
    }
}

/// The result of an admission check.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// Start now; `budget_ms` is the local timeout for the call (remaining after margin).
    Admit { budget_ms: u64 },
    /// Do not start; `remaining_ms` is the budget after margin (may be negative).
    Refuse { refusal: Refusal, remaining_ms: i64 },
}

impl Admission {
    pub fn is_admitted(&self) -> bool {
        matches!(self, Admission::Admit { .. })
    }
}

/// The admission rule's settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdmissionPolicy {
    /// Allowance for clock differences between the ingress and this host. This is a rule
    /// to set from measured clock sync, not a measured bound.
    pub clock_uncertainty_ms: u64,
    /// The minimum useful runtime when the envelope does not set one.
    pub default_min_runtime_ms: u64,
}

impl Default for AdmissionPolicy {
    fn default() -> Self {
        Self {
            clock_uncertainty_ms: 100,
            default_min_runtime_ms: 0,
        }
    }
}

impl AdmissionPolicy {
    /// Decide whether work with `deadline` may start at `now_ms`.
    pub fn check(&self, deadline: Deadline, min_runtime_ms: Option<u64>, now_ms: i64) -> Admission {
        let margin = i64::try_from(self.clock_uncertainty_ms).unwrap_or(i64::MAX);
        let remaining = deadline.remaining_ms(now_ms).saturating_sub(margin);
        let min_runtime = min_runtime_ms.unwrap_or(self.default_min_runtime_ms);
        if remaining <= 0 {
            Admission::Refuse {
                refusal: Refusal::DeadlinePassed,
                remaining_ms: remaining,
            }
        } else if (remaining as u64) < min_runtime {
            Admission::Refuse {
                refusal: Refusal::BelowMinRuntime,
                remaining_ms: remaining,
            }
        } else {
            Admission::Admit {
                budget_ms: remaining as u64,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The seed's worked case: worker time 10,000 ms, deadline 10,080 ms.
    #[test]
    fn seed_worked_case() {
        let deadline = Deadline::new(0, 10_080);
        let no_margin = AdmissionPolicy {
            clock_uncertainty_ms: 0,
            default_min_runtime_ms: 0,
        };
        assert_eq!(
            no_margin.check(deadline, None, 10_000),
            Admission::Admit { budget_ms: 80 }
        );
        let margin = AdmissionPolicy {
            clock_uncertainty_ms: 100,
            default_min_runtime_ms: 0,
        };
        assert_eq!(
            margin.check(deadline, None, 10_000),
            Admission::Refuse {
                refusal: Refusal::DeadlinePassed,
                remaining_ms: -20
            }
        );
    }

    #[test]
    fn min_runtime_is_reserved() {
        let p = AdmissionPolicy {
            clock_uncertainty_ms: 0,
            default_min_runtime_ms: 50,
        };
        let d = Deadline::new(0, 1_000);
        assert!(p.check(d, None, 950).is_admitted());
        assert!(matches!(
            p.check(d, None, 951),
            Admission::Refuse {
                refusal: Refusal::BelowMinRuntime,
                ..
            }
        ));
        // The envelope's own value wins over the worker default.
        assert!(!p.check(d, Some(500), 600).is_admitted());
        assert_eq!(
            Refusal::BelowMinRuntime.reason(Stage::Admission),
            "admission:below_min_runtime"
        );
    }

    proptest! {
        #[test]
        fn never_admits_when_too_late(
            expires in 0i64..4_000_000_000_000,
            now in 0i64..4_000_000_000_000,
            unc in 0u64..10_000,
            min_rt in 0u64..100_000,
            default_min in 0u64..100_000,
            envelope_sets_min in any::<bool>(),
        ) {
            let p = AdmissionPolicy { clock_uncertainty_ms: unc, default_min_runtime_ms: default_min };
            let min = if envelope_sets_min { Some(min_rt) } else { None };
            let effective_min = min.unwrap_or(default_min) as i64;
            let d = Deadline::new(0, expires);
            match p.check(d, min, now) {
                Admission::Admit { budget_ms } => {
                    prop_assert!(now + unc as i64 + effective_min <= expires);
                    prop_assert!((now + unc as i64) < expires);
                    // The call's timeout never reaches past the deadline.
                    prop_assert!(now + budget_ms as i64 <= expires);
                }
                Admission::Refuse { .. } => {
                    prop_assert!((now + unc as i64 + effective_min) > expires || (now + unc as i64) >= expires);
                }
            }
        }
    }
}
