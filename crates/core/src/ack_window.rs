//! The broker's consumer timeout (RabbitMQ `consumer_timeout`, 30 min by default): a
//! delivery left unacked for longer makes the broker close the whole channel
//! (`PRECONDITION_FAILED - delivery acknowledgement timed out`), which drops every other
//! delivery of that channel too. When the worker knows the value, its own timeout must
//! fire first: each model call is capped so that the call, its durable outcome and the
//! ack fit in the delivery's ack window, `received_at + consumer_timeout − margin`.
//!
//! A call cut at that cap ends `failed` with reason [`REASON`] (not `deadline_exceeded`:
//! the job's deadline had not passed, the broker's ack window had), and is dead-lettered
//! like any non-retryable failure. A job whose ack window has closed, or has less than the
//! minimum useful runtime left, when its slot comes ([`CallTimeout::AckWindowClosed`]) is
//! not started: the worker hands it back to the broker, which redelivers it with a fresh
//! window, and the admission rule applies again.

/// The reason recorded for a call cut at (or refused by) the ack window.
pub const REASON: &str = "consumer_timeout";

/// What the cap leaves for the ack and the durable write after the call, and for the
/// broker's delivery clock running ahead of our receipt: a tenth of the consumer timeout,
/// at least 1 s and at most 60 s.
pub fn margin_ms(consumer_timeout_ms: u64) -> u64 {
    (consumer_timeout_ms / 10).clamp(1_000, 60_000)
}

/// The model call's timeout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallTimeout {
    /// Call with this timeout; `capped` when the ack window, not the job's budget, set it.
    Run { timeout_ms: u64, capped: bool },
    /// The delivery's ack window has closed, or holds less than the minimum useful
    /// runtime: do not call.
    AckWindowClosed,
}

/// The timeout of a call that starts at `now_ms` with the admission budget `budget_ms`,
/// for a delivery received at `received_at_ms`; `consumer_timeout_ms` is `None` when the
/// broker's value is unknown (or the timeout is off): then the budget alone decides.
pub fn call_timeout(
    budget_ms: u64,
    received_at_ms: i64,
    now_ms: i64,
    consumer_timeout_ms: Option<u64>,
    min_runtime_ms: u64,
) -> CallTimeout {
    let Some(ct) = consumer_timeout_ms.filter(|&ct| ct > 0) else {
        return CallTimeout::Run {
            timeout_ms: budget_ms,
            capped: false,
        };
    };
    let closes_at = received_at_ms.saturating_add((ct - ct.min(margin_ms(ct))) as i64);
    let window = closes_at.saturating_sub(now_ms);
    if window <= 0 || (window as u64) < min_runtime_ms {
        return CallTimeout::AckWindowClosed;
    }
    let window = window as u64;
    if window < budget_ms {
        CallTimeout::Run {
            timeout_ms: window,
            capped: true,
        }
    } else {
        CallTimeout::Run {
            timeout_ms: budget_ms,
            capped: false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn examples() {
        // 5 s consumer timeout, 1 s margin: a call that starts 500 ms after receipt gets
        // 3.5 s, whatever its 60 s budget.
        assert_eq!(
            call_timeout(60_000, 1_000, 1_500, Some(5_000), 0),
            CallTimeout::Run {
                timeout_ms: 3_500,
                capped: true
            }
        );
        assert_eq!(
            call_timeout(2_000, 1_000, 1_500, Some(5_000), 0),
            CallTimeout::Run {
                timeout_ms: 2_000,
                capped: false
            }
        );
        assert_eq!(
            call_timeout(60_000, 1_000, 5_000, Some(5_000), 0),
            CallTimeout::AckWindowClosed
        );
        // 500 ms left, but a useful call needs 1 s.
        assert_eq!(
            call_timeout(60_000, 1_000, 4_500, Some(5_000), 1_000),
            CallTimeout::AckWindowClosed
        );
        // Unknown or off: the budget alone.
        for ct in [None, Some(0)] {
            assert_eq!(
                call_timeout(60_000, 0, 10_000_000, ct, 1_000),
                CallTimeout::Run {
                    timeout_ms: 60_000,
                    capped: false
                }
            );
        }
        assert_eq!(margin_ms(1_800_000), 60_000);
        assert_eq!(margin_ms(5_000), 1_000);
    }

    proptest! {
        /// The call never outlives its budget nor, when the consumer timeout is known, the
        /// delivery's ack window (received + timeout − margin); it is capped exactly when
        /// the window is the shorter, and refused exactly when the window has closed or
        /// holds less than the minimum runtime.
        #[test]
        fn the_call_ends_inside_the_ack_window_and_the_budget(
            budget in 0u64..10_000_000,
            received in 0i64..1_000_000_000,
            age in -1_000i64..10_000_000,
            ct in proptest::option::of(0u64..10_000_000),
            min_runtime in 0u64..100_000,
        ) {
            let now = received + age;
            match call_timeout(budget, received, now, ct, min_runtime) {
                CallTimeout::Run { timeout_ms, capped } => {
                    prop_assert!(timeout_ms <= budget);
                    prop_assert_eq!(capped, timeout_ms < budget);
                    if let Some(ct) = ct.filter(|&c| c > 0) {
                        let closes = received + (ct - ct.min(margin_ms(ct))) as i64;
                        prop_assert!(now < closes);
                        prop_assert!(closes - now >= min_runtime as i64);
                        prop_assert!(now + timeout_ms as i64 <= closes);
                        if capped {
                            prop_assert_eq!(now + timeout_ms as i64, closes);
                        }
                    } else {
                        prop_assert_eq!(timeout_ms, budget);
                    }
                }
                CallTimeout::AckWindowClosed => {
                    let ct = ct.unwrap();
                    prop_assert!(ct > 0);
                    let closes = received + (ct - ct.min(margin_ms(ct))) as i64;
                    prop_assert!(now >= closes || closes - now < min_runtime as i64);
                }
            }
        }
    }
}
