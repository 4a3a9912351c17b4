//! Retries inside the deadline: exponential backoff with jitter, mapped onto fixed-delay
//! retry queues and clipped so that no retry is published that could not start in time.

use crate::admission::AdmissionPolicy;
use crate::deadline::Deadline;

/// Retry settings. Validated by [`RetryPolicy::new`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Total attempts allowed, counting the first one.
    pub max_attempts: u32,
    /// Backoff before the first retry; doubles per attempt.
    pub base_delay_ms: u64,
    /// The fixed delays of the retry queues, ascending (e.g. 1 s, 5 s, 30 s).
    pub queue_delays_ms: Vec<u64>,
}

/// Why a policy could not be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RetryPolicyError {
    #[error("max attempts must be at least 1")]
    NoAttempts,
    #[error("at least one retry queue delay is needed")]
    NoQueues,
    #[error("retry queue delays must be positive and strictly ascending, got {0:?}")]
    NotAscending(Vec<u64>),
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            max_attempts: 3,
            base_delay_ms: 1_000,
            queue_delays_ms: vec![1_000, 5_000, 30_000],
        }
    }
}

/// What to do after a retryable failure of `attempt` (0-based).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RetryDecision {
    /// Publish to the retry queue with this index; `ttl_ms` is the remaining budget now.
    Retry {
        next_attempt: u32,
        queue_index: usize,
        delay_ms: u64,
        ttl_ms: u64,
    },
    /// The backoff plus minimum runtime would overshoot the deadline: the retry is not made.
    WouldOvershoot { delay_ms: u64 },
    /// The server's `Retry-After` cannot be honoured inside the deadline: its wait plus the
    /// minimum runtime overshoots, or no retry queue waits that long (a retry from a
    /// shorter queue would come earlier than the server asked). The retry is not made.
    RateLimited { retry_after_ms: u64 },
    /// All attempts are used up.
    Exhausted,
}

impl RetryPolicy {
    pub fn new(
        max_attempts: u32,
        base_delay_ms: u64,
        queue_delays_ms: Vec<u64>,
    ) -> Result<Self, RetryPolicyError> {
        if max_attempts == 0 {
            return Err(RetryPolicyError::NoAttempts);
        }
        if queue_delays_ms.is_empty() {
            return Err(RetryPolicyError::NoQueues);
        }
        if queue_delays_ms[0] == 0 || queue_delays_ms.windows(2).any(|w| w[0] >= w[1]) {
            return Err(RetryPolicyError::NotAscending(queue_delays_ms));
        }
        Ok(Self {
            max_attempts,
            base_delay_ms,
            queue_delays_ms,
        })
    }

    /// The backoff wanted before retry number `attempt + 1`: `base · 2^attempt`, scaled by
    /// `jitter` in `[0, 1)` to `[0.5, 1.5)` of that value ("equal jitter").
    pub fn backoff_ms(&self, attempt: u32, jitter: f64) -> u64 {
        let exp = self.base_delay_ms.saturating_mul(1u64 << attempt.min(30));
        let j = jitter.clamp(0.0, 0.999_999);
        (exp as f64 * (0.5 + j)) as u64
    }

    /// The retry queue for a wanted backoff: the shortest fixed delay at least as long,
    /// else the longest queue.
    pub fn queue_for(&self, backoff_ms: u64) -> usize {
        self.queue_delays_ms
            .iter()
            .position(|d| *d >= backoff_ms)
            .unwrap_or(self.queue_delays_ms.len() - 1)
    }

    /// Decide the retry after a retryable failure of attempt `attempt` at `now_ms`.
    pub fn decide(
        &self,
        attempt: u32,
        deadline: Deadline,
        min_runtime_ms: Option<u64>,
        admission: &AdmissionPolicy,
        now_ms: i64,
        jitter: f64,
    ) -> RetryDecision {
        self.decide_after(
            attempt,
            deadline,
            min_runtime_ms,
            admission,
            now_ms,
            jitter,
            0,
        )
    }

    /// [`decide`](Self::decide) with a server's `Retry-After`: the retry waits at least
    /// `min_delay_ms` (the shortest queue that long), and is only made if that wait still
    /// fits inside the deadline. It never comes earlier than `min_delay_ms`: when no queue
    /// waits that long, or the wait plus `min_runtime_ms` overshoots, the decision is
    /// [`RetryDecision::RateLimited`] (when `min_delay_ms` > 0).
    #[allow(clippy::too_many_arguments)]
    pub fn decide_after(
        &self,
        attempt: u32,
        deadline: Deadline,
        min_runtime_ms: Option<u64>,
        admission: &AdmissionPolicy,
        now_ms: i64,
        jitter: f64,
        min_delay_ms: u64,
    ) -> RetryDecision {
        // `attempt` comes from a header any publisher sets: `u32::MAX` must not overflow.
        if attempt.saturating_add(1) >= self.max_attempts {
            return RetryDecision::Exhausted;
        }
        let longest = self.queue_delays_ms[self.queue_delays_ms.len() - 1];
        if min_delay_ms > longest {
            return RetryDecision::RateLimited {
                retry_after_ms: min_delay_ms,
            };
        }
        let queue_index = self.queue_for(self.backoff_ms(attempt, jitter).max(min_delay_ms));
        let delay_ms = self.queue_delays_ms[queue_index];
        let start_at = now_ms.saturating_add(delay_ms as i64);
        if !admission
            .check(deadline, min_runtime_ms, start_at)
            .is_admitted()
        {
            if min_delay_ms > 0 {
                return RetryDecision::RateLimited {
                    retry_after_ms: min_delay_ms,
                };
            }
            return RetryDecision::WouldOvershoot { delay_ms };
        }
        match deadline.broker_ttl_ms(now_ms) {
            Some(ttl_ms) => RetryDecision::Retry {
                next_attempt: attempt + 1,
                queue_index,
                delay_ms,
                ttl_ms,
            },
            None => RetryDecision::WouldOvershoot { delay_ms },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn constructor_validates() {
        assert!(RetryPolicy::new(0, 1, vec![1]).is_err());
        assert!(RetryPolicy::new(1, 1, vec![]).is_err());
        assert!(RetryPolicy::new(1, 1, vec![5, 5]).is_err());
        assert!(RetryPolicy::new(1, 1, vec![0, 5]).is_err());
        assert!(RetryPolicy::new(3, 1, vec![1, 5]).is_ok());
    }

    #[test]
    fn picks_the_queue_and_clips_to_the_deadline() {
        let p = RetryPolicy::default();
        let a = AdmissionPolicy {
            clock_uncertainty_ms: 0,
            default_min_runtime_ms: 100,
        };
        let d = Deadline::new(0, 10_000);
        // backoff 1000 · (0.5+0.5) = 1000 → the 1 s queue; ttl is what remains now.
        assert_eq!(
            p.decide(0, d, None, &a, 2_000, 0.5),
            RetryDecision::Retry {
                next_attempt: 1,
                queue_index: 0,
                delay_ms: 1_000,
                ttl_ms: 8_000
            }
        );
        // 2nd retry wants 2 s → 5 s queue; 5 s + 100 ms min runtime overshoots at t=5 s.
        assert_eq!(
            p.decide(1, d, None, &a, 5_000, 0.5),
            RetryDecision::WouldOvershoot { delay_ms: 5_000 }
        );
        assert_eq!(p.decide(2, d, None, &a, 0, 0.5), RetryDecision::Exhausted);
    }

    #[test]
    fn retry_after_is_honoured_only_inside_the_deadline() {
        let p = RetryPolicy::default();
        let a = AdmissionPolicy {
            clock_uncertainty_ms: 0,
            default_min_runtime_ms: 0,
        };
        let d = Deadline::new(0, 20_000);
        // Backoff alone would pick the 1 s queue; Retry-After 4 s needs the 5 s queue.
        assert!(matches!(
            p.decide_after(0, d, None, &a, 0, 0.5, 4_000),
            RetryDecision::Retry {
                delay_ms: 5_000,
                ..
            }
        ));
        // Retry-After 10 s → the 30 s queue, which overshoots a 20 s deadline: no retry.
        assert_eq!(
            p.decide_after(0, d, None, &a, 0, 0.5, 10_000),
            RetryDecision::RateLimited {
                retry_after_ms: 10_000
            }
        );
        // Retry-After 60 s: no queue waits that long; the 30 s queue would come too early.
        let far = Deadline::new(0, 600_000);
        assert_eq!(
            p.decide_after(0, far, None, &a, 0, 0.5, 60_000),
            RetryDecision::RateLimited {
                retry_after_ms: 60_000
            }
        );
        // Retry-After 4 s → the 5 s queue; with a learned 16 s call it no longer fits 20 s.
        assert_eq!(
            p.decide_after(0, d, Some(16_000), &a, 0, 0.5, 4_000),
            RetryDecision::RateLimited {
                retry_after_ms: 4_000
            }
        );
    }

    proptest! {
        /// Any attempt number a header can carry, up to `u32::MAX`: no overflow, and a
        /// retry only below the limit, numbered one more.
        #[test]
        fn any_attempt_number_is_decided_without_overflow(
            attempt in prop_oneof![Just(u32::MAX), Just(u32::MAX - 1), any::<u32>(), 0u32..10],
            max_attempts in prop_oneof![Just(u32::MAX), 1u32..10],
            jitter in 0.0f64..1.0,
        ) {
            let p = RetryPolicy::new(max_attempts, 500, vec![1_000]).unwrap();
            let a = AdmissionPolicy { clock_uncertainty_ms: 0, default_min_runtime_ms: 0 };
            match p.decide(attempt, Deadline::new(0, 1_000_000), None, &a, 0, jitter) {
                RetryDecision::Retry { next_attempt, .. } => {
                    prop_assert!(attempt < max_attempts - 1);
                    prop_assert_eq!(next_attempt, attempt + 1);
                }
                RetryDecision::Exhausted => prop_assert!(attempt >= max_attempts - 1),
                RetryDecision::WouldOvershoot { .. } | RetryDecision::RateLimited { .. } => {}
            }
        }

        /// With a server's Retry-After: a retry never comes earlier than it asked, and
        /// always leaves the minimum runtime before the deadline; otherwise it is refused
        /// as rate limited.
        #[test]
        fn a_retry_never_comes_before_retry_after(
            attempt in 0u32..5, now in 0i64..100_000, expires in 0i64..200_000,
            min_rt in 0u64..5_000, jitter in 0.0f64..1.0, ra in 1u64..60_000,
        ) {
            let p = RetryPolicy::new(6, 500, vec![1_000, 5_000, 30_000]).unwrap();
            let a = AdmissionPolicy { clock_uncertainty_ms: 0, default_min_runtime_ms: 0 };
            let d = Deadline::new(0, expires);
            match p.decide_after(attempt, d, Some(min_rt), &a, now, jitter, ra) {
                RetryDecision::Retry { delay_ms, .. } => {
                    prop_assert!(delay_ms >= ra);
                    prop_assert!(now + delay_ms as i64 + min_rt as i64 <= expires);
                }
                RetryDecision::RateLimited { retry_after_ms } => {
                    prop_assert_eq!(retry_after_ms, ra);
                    let q = p.queue_delays_ms.iter().find(|q| **q >= ra.max(p.backoff_ms(attempt, jitter)));
                    let fits = q.is_some_and(|q| now + *q as i64 + min_rt.max(1) as i64 <= expires);
                    prop_assert!(!fits || ra > 30_000);
                }
                RetryDecision::WouldOvershoot { .. } => prop_assert!(false, "a Retry-After refusal is named rate_limited"),
                RetryDecision::Exhausted => prop_assert!(attempt + 1 >= 6),
            }
        }

        #[test]
        fn a_retry_always_fits_the_deadline(
            attempt in 0u32..5, now in 0i64..100_000, expires in 0i64..100_000,
            unc in 0u64..500, min_rt in 0u64..5_000, jitter in 0.0f64..1.0,
        ) {
            let p = RetryPolicy::new(6, 500, vec![1_000, 5_000, 30_000]).unwrap();
            let a = AdmissionPolicy { clock_uncertainty_ms: unc, default_min_runtime_ms: min_rt };
            let d = Deadline::new(0, expires);
            if let RetryDecision::Retry { delay_ms, ttl_ms, next_attempt, .. } = p.decide(attempt, d, None, &a, now, jitter) {
                prop_assert!(now + delay_ms as i64 + unc as i64 + min_rt as i64 <= expires);
                prop_assert!(ttl_ms as i64 <= expires - now);
                prop_assert_eq!(next_attempt, attempt + 1);
            }
        }
    }
}
