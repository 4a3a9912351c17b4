//! How long a job just received is expected to wait for a model slot.
//!
//! Under overload the broker hands a worker the *oldest* surviving jobs, so many arrive
//! with a budget that is enough now but not after waiting behind the jobs already buffered
//! for a slot. Admitting such a job into the local buffer only delays its refusal to the
//! last admission check, and it holds a prefetch place meanwhile that a job with time to
//! spare could use. The worker therefore asks at receipt whether the job would still pass
//! the admission check at `now + expected wait` ([`crate::WorkerPolicy::on_receipt`]).
//!
//! The estimate is the mean, not a bound: with `ahead` jobs queued for `slots` slots of
//! which `free` are free, the job needs `ahead − free + 1` slot releases; running calls
//! release at `slots / mean_call_ms` per ms, and the first release comes on average half
//! a call after now. It never delays a job: the last admission check right before the
//! call still decides on the clock, and a wrong estimate only changes *when* a doomed job
//! is refused, or refuses a job that was within one mean call of making it.

/// Expected wait for a slot in ms; `0` when a slot is free for this job or nothing is
/// known yet about call durations (`mean_call_ms == 0`).
pub fn expected_wait_ms(ahead: usize, free: usize, slots: usize, mean_call_ms: u64) -> u64 {
    let slots = slots.max(1) as u64;
    if mean_call_ms == 0 || ahead < free {
        return 0;
    }
    let releases = (ahead - free) as u64 + 1;
    (releases.saturating_mul(mean_call_ms) / slots).saturating_sub(mean_call_ms / 2)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn worked_cases() {
        // 4 slots × 200 ms, all busy.
        assert_eq!(expected_wait_ms(0, 0, 4, 200), 0); // next release: on average 50 − 100 < 0
        assert_eq!(expected_wait_ms(3, 0, 4, 200), 100); // 4th release ≈ 200 − 100
        assert_eq!(expected_wait_ms(7, 0, 4, 200), 300);
        // A free slot for this job: no wait whatever the queue says.
        assert_eq!(expected_wait_ms(1, 2, 4, 200), 0);
        // Nothing known about calls yet.
        assert_eq!(expected_wait_ms(100, 0, 4, 0), 0);
        // One slot: every job ahead costs a whole call.
        assert_eq!(expected_wait_ms(2, 0, 1, 100), 250);
    }

    proptest! {
        #[test]
        fn monotone_in_the_queue_ahead(ahead in 0usize..10_000, free in 0usize..64, slots in 1usize..64, mean in 0u64..100_000) {
            prop_assert!(expected_wait_ms(ahead, free, slots, mean) <= expected_wait_ms(ahead + 1, free, slots, mean));
        }

        #[test]
        fn never_more_than_the_releases_needed(ahead in 0usize..10_000, free in 0usize..64, slots in 1usize..64, mean in 0u64..100_000) {
            let w = expected_wait_ms(ahead, free, slots, mean);
            let releases = (ahead.saturating_sub(free) + 1) as u64;
            prop_assert!(w <= releases * mean / slots as u64);
            if ahead < free {
                prop_assert_eq!(w, 0);
            }
        }
    }
}
