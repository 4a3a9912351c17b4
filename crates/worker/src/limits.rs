//! The rate limits of the model servers this worker calls, one [`RateLimiter`] per backend
//! (per route when kinds are routed to several), shared by all of the worker's slots: the
//! IO shell over [`lastcall_core::rate_limit`]. It holds the configured limits, feeds each
//! call's `x-ratelimit-*` headers in ([`Limiters::sink`]), and wakes the jobs that wait for
//! a permit when a permit is given back.
//!
//! **Invariant**: no call without a permit. A job takes its permit while it holds a slot,
//! just before the last admission check ([`crate::job`]'s `wait.rs`); a permit that is
//! not used (the check refused the job, the start could not be written) is given back
//! ([`Taken`]'s drop).

use crate::stats::WorkerStats;
use lastcall_backend::LimitSink;
use lastcall_core::rate_limit::{Limits, Observed, RateLimiter};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use tokio::sync::Notify;

pub(crate) struct Limiters {
    /// The configured limits by backend name (`--rate-limit`).
    configured: BTreeMap<String, Limits>,
    /// The longest a server's reset or `Retry-After` holds a backend (the breaker's
    /// longest cool-down): headers are advice.
    max_hold_ms: u64,
    /// A limiter per backend that has limits, configured or learned from its headers.
    map: Mutex<BTreeMap<String, RateLimiter>>,
    /// Fires when a permit is given back: waiting jobs look again.
    pub(crate) changed: Notify,
    stats: Arc<WorkerStats>,
}

impl Limiters {
    pub(crate) fn new(
        configured: BTreeMap<String, Limits>,
        max_hold_ms: u64,
        stats: Arc<WorkerStats>,
    ) -> Self {
        Self {
            configured,
            max_hold_ms,
            map: Mutex::default(),
            changed: Notify::new(),
            stats,
        }
    }

    fn with<T>(&self, key: &str, now_ms: i64, f: impl FnOnce(&mut RateLimiter) -> T) -> T {
        let mut map = self.map.lock().unwrap_or_else(|e| e.into_inner());
        let l = map.entry(key.to_owned()).or_insert_with(|| {
            RateLimiter::new(
                self.configured.get(key).copied().unwrap_or_default(),
                self.max_hold_ms,
                now_ms,
            )
        });
        f(l)
    }

    /// Take the permit for one call of `tokens` tokens to `key` if it is there at
    /// `now_ms`; else the instant it comes (`Err(None)`: never, the request is larger
    /// than the configured limit per minute).
    pub(crate) fn try_take(
        self: &Arc<Self>,
        key: &str,
        tokens: u64,
        now_ms: i64,
    ) -> Result<Taken, Option<i64>> {
        self.with(key, now_ms, |l| match l.permit_at(now_ms, tokens) {
            Some(at) if at <= now_ms => {
                l.take(now_ms, tokens);
                Ok(Taken {
                    limiters: self.clone(),
                    key: key.to_owned(),
                    tokens,
                    used: false,
                })
            }
            other => Err(other),
        })
    }

    /// When the permit for one call of `tokens` tokens to `key` comes, seen at `now_ms`
    /// without taking it (`None`: never): for the choice among a fallback route's backends.
    pub(crate) fn permit_at(&self, key: &str, tokens: u64, now_ms: i64) -> Option<i64> {
        self.with(key, now_ms, |l| l.permit_at(now_ms, tokens))
    }

    /// Where the headers of a call to `key` go.
    pub(crate) fn sink(
        self: &Arc<Self>,
        key: &str,
        clock: Arc<dyn crate::clock::Clock>,
    ) -> LimitSink {
        let (limiters, key) = (self.clone(), key.to_owned());
        LimitSink::new(move |o: Observed| {
            let now = clock.now_ms();
            limiters.with(&key, now, |l| l.observe(now, &o));
            tracing::debug!(backend = %key, ?o, "rate-limit headers");
        })
    }

    /// A job refused because its permit would come too late.
    pub(crate) fn refused(&self) {
        WorkerStats::inc(&self.stats.rate_limited);
    }
}

/// A permit taken for one call: given back on drop unless the call went out.
pub(crate) struct Taken {
    limiters: Arc<Limiters>,
    key: String,
    tokens: u64,
    used: bool,
}

impl Taken {
    /// The call went out: the permit is spent. `used_tokens`: the call's reported usage,
    /// which corrects the tokens reserved.
    pub(crate) fn spent(mut self, used_tokens: Option<u64>, now_ms: i64) {
        self.used = true;
        if let Some(used) = used_tokens {
            let reserved = self.tokens;
            (self.limiters).with(&self.key, now_ms, |l| {
                l.settle_tokens(now_ms, reserved, used)
            });
        }
    }
}

impl Drop for Taken {
    fn drop(&mut self) {
        if !self.used {
            // Not called: the permit goes back (the clock is not needed to give back).
            let tokens = self.tokens;
            let mut map = self.limiters.map.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(l) = map.get_mut(&self.key) {
                l.give_back(i64::MIN, tokens);
            }
            drop(map);
            self.limiters.changed.notify_waiters();
        }
    }
}
