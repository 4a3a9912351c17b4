//! The immutable absolute deadline and the budget derived from it.
//!
//! **Invariant:** a [`Deadline`] has no setter. Every TTL, timeout and retry delay is
//! derived from `expires_at_ms` and a `now_ms` value; none of them ever feeds back into it.

/// The business deadline of a job, in ms since the Unix epoch (wall clock of the ingress).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Deadline {
    created_at_ms: i64,
    expires_at_ms: i64,
}

impl Deadline {
    /// Build a deadline. Plausibility (ordering, horizon) is checked by the envelope parser
    /// and by [`Deadline::from_budget`]; this constructor only stores the two instants.
    pub const fn new(created_at_ms: i64, expires_at_ms: i64) -> Self {
        Self {
            created_at_ms,
            expires_at_ms,
        }
    }

    /// Stamp a deadline from a relative budget, as a trusted ingress does.
    pub fn from_budget(now_ms: i64, budget_ms: u64) -> Self {
        let budget = i64::try_from(budget_ms).unwrap_or(i64::MAX);
        Self::new(now_ms, now_ms.saturating_add(budget))
    }

    pub const fn created_at_ms(&self) -> i64 {
        self.created_at_ms
    }

    pub const fn expires_at_ms(&self) -> i64 {
        self.expires_at_ms
    }

    /// Milliseconds left until the deadline (negative once it has passed).
    pub fn remaining_ms(&self, now_ms: i64) -> i64 {
        self.expires_at_ms.saturating_sub(now_ms)
    }

    /// The broker `expiration` for a publish at `now_ms`: the remaining budget, never the
    /// original total. `None` when nothing is left, in which case the job must not be
    /// published at all (RabbitMQ treats `expiration = 0` as "deliver now or drop").
    pub fn broker_ttl_ms(&self, now_ms: i64) -> Option<u64> {
        let remaining = self.remaining_ms(now_ms);
        (remaining > 0).then_some(remaining as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn ttl_is_the_remaining_budget() {
        let d = Deadline::new(1_000, 61_000);
        assert_eq!(d.broker_ttl_ms(1_000), Some(60_000));
        assert_eq!(d.broker_ttl_ms(31_000), Some(30_000));
        assert_eq!(d.broker_ttl_ms(61_000), None);
        assert_eq!(d.broker_ttl_ms(70_000), None);
    }

    proptest! {
        #[test]
        fn ttl_never_exceeds_remaining_budget(created in 0i64..2_000_000_000_000, total in 0i64..86_400_000, elapsed in -1_000i64..100_000_000) {
            let d = Deadline::new(created, created + total);
            let now = created + elapsed;
            match d.broker_ttl_ms(now) {
                Some(ttl) => {
                    prop_assert!(ttl as i64 <= d.expires_at_ms() - now);
                    prop_assert!(ttl > 0);
                    prop_assert!(now + ttl as i64 <= d.expires_at_ms());
                }
                None => prop_assert!(now >= d.expires_at_ms()),
            }
        }

        #[test]
        fn from_budget_is_exact(now in 0i64..2_000_000_000_000, budget in 0u64..86_400_000) {
            let d = Deadline::from_budget(now, budget);
            prop_assert_eq!(d.created_at_ms(), now);
            prop_assert_eq!(d.expires_at_ms() - d.created_at_ms(), budget as i64);
        }
    }
}
