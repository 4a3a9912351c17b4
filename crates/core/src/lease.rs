//! The worker lease: the rule that keeps a redelivered job from running twice while its
//! call still runs on another worker, and lets it run again once that worker is dead.
//!
//! Each worker renews one lease row (`workers`) every [`LEASE_RENEW_MS`]. A redelivery
//! whose job has a `running` attempt under another worker waits (without a slot) while
//! that worker's lease is fresh: renewed at or after [`fresh_since`]`(now)`, that is
//! under [`LEASE_TTL_MS`] old. A worker whose lease is older is presumed dead: its
//! `running` attempts no longer hold anything back.

/// How often a worker renews its lease.
pub const LEASE_RENEW_MS: u64 = 2_000;

/// How old a lease may be before its worker is presumed dead. Several renewals long, so
/// that a worker that misses one or two (a slow ledger write, a GC-free but busy host) is
/// not presumed dead while its call still runs.
pub const LEASE_TTL_MS: i64 = 10_000;

/// The oldest renewal time at `now_ms` of a lease that still holds its worker's jobs.
pub fn fresh_since(now_ms: i64) -> i64 {
    now_ms - LEASE_TTL_MS
}

/// Whether a lease renewed at `renewed_at_ms` still holds its worker's jobs at `now_ms`.
pub fn is_fresh(renewed_at_ms: i64, now_ms: i64) -> bool {
    renewed_at_ms >= fresh_since(now_ms)
}

/// The hold rule: whether a delivery must first wait for another worker's call of the
/// same job (while that worker's lease is fresh) before it may run. Only a valid job with
/// a model call already started (`prior_starts`, the ledger's attempt rows) and no outcome
/// yet can have one running elsewhere; anything else goes straight to the admission rule.
pub fn may_run_elsewhere(valid: bool, prior_starts: u32, already_recorded: bool) -> bool {
    valid && prior_starts > 0 && !already_recorded
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_started_unrecorded_valid_job_is_held() {
        assert!(may_run_elsewhere(true, 1, false));
        assert!(!may_run_elsewhere(true, 0, false), "never started");
        assert!(!may_run_elsewhere(true, 3, true), "its outcome is recorded");
        assert!(!may_run_elsewhere(false, 1, false), "rejected, not run");
    }

    #[test]
    fn a_lease_holds_for_its_ttl_and_survives_missed_renewals() {
        assert!(is_fresh(1_000, 1_000));
        assert!(is_fresh(1_000, 1_000 + LEASE_TTL_MS));
        assert!(!is_fresh(1_000, 1_001 + LEASE_TTL_MS));
        // Two renewals missed in a row still leave the worker alive.
        let renew = LEASE_RENEW_MS as i64;
        assert!(is_fresh(0, 3 * renew));
        assert!(
            LEASE_TTL_MS >= 4 * renew,
            "at least three renewals may be missed"
        );
    }
}
