//! The circuit breakers of the model servers this worker calls, one per backend (per route
//! when kinds are routed to several): the IO shell over [`lastcall_core::breaker`]. It
//! logs every transition, mirrors the states into [`WorkerStats`] for `/metrics` and
//! `/readyz`, and wakes the jobs that wait for a breaker.

use crate::stats::{BreakerView, WorkerStats};
use lastcall_core::breaker::{Breaker, BreakerPolicy, BreakerState, Permit, Transition, Verdict};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use tokio::sync::Notify;

pub(crate) struct Breakers {
    policy: BreakerPolicy,
    map: Mutex<BTreeMap<String, Breaker>>,
    stats: Arc<WorkerStats>,
    /// Fires on every transition: waiting jobs look again.
    pub(crate) changed: Notify,
}

impl Breakers {
    pub(crate) fn new(policy: BreakerPolicy, stats: Arc<WorkerStats>) -> Self {
        Self {
            policy,
            map: Mutex::default(),
            stats,
            changed: Notify::new(),
        }
    }

    pub(crate) fn policy(&self) -> &BreakerPolicy {
        &self.policy
    }

    /// Register `key` (closed) so `/readyz` and `/metrics` show it before its first call.
    pub(crate) fn register(&self, key: &str) {
        let mut map = self.map.lock().expect("breakers");
        let b = map
            .entry(key.to_owned())
            .or_insert_with(|| Breaker::new(&self.policy));
        self.mirror(key, b);
    }

    /// May a call to `key` start at `now_ms`? `trial_limit_ms`: how long a half-open trial
    /// may run before it counts as hung (failed).
    pub(crate) fn permit(
        self: &Arc<Self>,
        key: &str,
        trial_limit_ms: u64,
        now_ms: i64,
    ) -> (Permit, Option<Trial>) {
        let mut map = self.map.lock().expect("breakers");
        let b = map
            .entry(key.to_owned())
            .or_insert_with(|| Breaker::new(&self.policy));
        let (permit, t) = b.permit(&self.policy, trial_limit_ms, now_ms);
        self.transition(key, b, t);
        let trial = (permit == Permit::Trial).then(|| Trial {
            breakers: self.clone(),
            key: key.to_owned(),
            done: false,
        });
        (permit, trial)
    }

    /// When a call to `key` could go out at the earliest, seen at `now_ms` without taking
    /// anything (`now_ms`: closed, or its half-open trial is free): for the choice among a
    /// fallback route's backends ([`lastcall_core::fallback`]).
    pub(crate) fn next_call_at(&self, key: &str, trial_limit_ms: u64, now_ms: i64) -> i64 {
        let map = self.map.lock().expect("breakers");
        map.get(key)
            .map_or(now_ms, |b| b.next_call_at_ms(now_ms, trial_limit_ms))
    }

    /// A call to `key` that was not the trial ended with `verdict`.
    pub(crate) fn ended(&self, key: &str, verdict: Verdict, now_ms: i64) {
        self.report(key, false, verdict, now_ms);
    }

    fn report(&self, key: &str, trial: bool, verdict: Verdict, now_ms: i64) {
        let mut map = self.map.lock().expect("breakers");
        let b = map
            .entry(key.to_owned())
            .or_insert_with(|| Breaker::new(&self.policy));
        let t = b.ended(&self.policy, trial, verdict, now_ms);
        self.transition(key, b, t);
        if trial {
            // A trial that ended without a transition (neutral): the next job may try.
            self.changed.notify_waiters();
        }
    }

    fn transition(&self, key: &str, b: &Breaker, t: Option<Transition>) {
        self.mirror(key, b);
        let Some(t) = t else { return };
        match t.to {
            BreakerState::Open => tracing::warn!(
                backend = key,
                from = t.from.as_str(),
                to = t.to.as_str(),
                open_until_ms = t.open_until_ms,
                opens = b.opens(),
                "circuit breaker open: no calls to this model server until its cool-down ends"
            ),
            _ => tracing::info!(
                backend = key,
                from = t.from.as_str(),
                to = t.to.as_str(),
                "circuit breaker {}",
                t.to.as_str()
            ),
        }
        self.changed.notify_waiters();
    }

    fn mirror(&self, key: &str, b: &Breaker) {
        let mut view = self.stats.breakers.lock().expect("breaker view");
        view.insert(
            key.to_owned(),
            BreakerView {
                state: b.state(),
                opens: b.opens(),
            },
        );
    }
}

/// The one half-open trial call: report its verdict with [`Trial::ended`]; dropped
/// without a verdict (the job ended without the call), the next job may try.
pub(crate) struct Trial {
    breakers: Arc<Breakers>,
    key: String,
    done: bool,
}

impl Trial {
    pub(crate) fn ended(mut self, verdict: Verdict, now_ms: i64) {
        self.done = true;
        self.breakers.report(&self.key, true, verdict, now_ms);
    }
}

impl Drop for Trial {
    fn drop(&mut self) {
        if !self.done {
            let mut map = self.breakers.map.lock().expect("breakers");
            if let Some(b) = map.get_mut(&self.key) {
                b.trial_abandoned();
            }
            drop(map);
            self.breakers.changed.notify_waiters();
        }
    }
}
