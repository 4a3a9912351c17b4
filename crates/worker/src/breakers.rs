//! The circuit breakers of the model servers this worker calls, one per backend (per route
//! when kinds are routed to several): the IO shell over [`lastcall_core::breaker`]. It
//! logs every transition, mirrors the states into [`WorkerStats`] for `/metrics` and
//! `/readyz`, wakes the jobs that wait for a breaker, and hands each opening and closing
//! to [`record`] for the ledger, where the door reads it (`503 upstream_unavailable`).

use crate::stats::{BreakerView, WorkerStats};
use lastcall_core::breaker::{Breaker, BreakerPolicy, BreakerState, Permit, Transition, Verdict};
use lastcall_store::Ledger;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use tokio::sync::{Notify, mpsc};

/// At most this many kinds per breaker are recorded for the door (kinds come from
/// producers: bounded). A kind beyond them is not refused at the door; the worker still
/// holds its jobs while the breaker is open.
const MAX_KINDS: usize = 64;

/// A breaker opened (`open_until_ms`: its next trial, a demand trial's earliest instant)
/// or closed (`None`), for the ledger.
#[derive(Debug)]
pub(crate) struct Change {
    backend: String,
    kinds: Vec<String>,
    open_until_ms: Option<i64>,
    at_ms: i64,
}

pub(crate) struct Breakers {
    policy: BreakerPolicy,
    map: Mutex<BTreeMap<String, Breaker>>,
    /// Per breaker, the kinds this worker asked it to call (bounded: [`MAX_KINDS`]): the
    /// kinds the door refuses while it is open.
    kinds: Mutex<BTreeMap<String, BTreeSet<String>>>,
    stats: Arc<WorkerStats>,
    /// Fires on every transition: waiting jobs look again.
    pub(crate) changed: Notify,
    /// Openings and closings, to [`record`] (one writer, in order; unbounded but one
    /// message per transition, and transitions are at most one per cool-down).
    changes: mpsc::UnboundedSender<Change>,
    /// The receiving end, until [`record`] takes it.
    pending: Mutex<Option<mpsc::UnboundedReceiver<Change>>>,
}

impl Breakers {
    pub(crate) fn new(policy: BreakerPolicy, stats: Arc<WorkerStats>) -> Self {
        let (changes, rx) = mpsc::unbounded_channel();
        Self {
            policy,
            map: Mutex::default(),
            kinds: Mutex::default(),
            stats,
            changed: Notify::new(),
            changes,
            pending: Mutex::new(Some(rx)),
        }
    }

    /// Note that `kind` is called through `key`; while `b` is open, a kind seen for the
    /// first time is recorded for the door at once.
    fn saw(&self, key: &str, kind: &str, b: &Breaker, now_ms: i64) {
        let mut kinds = self.kinds.lock().expect("breaker kinds");
        let set = kinds.entry(key.to_owned()).or_default();
        if set.len() >= MAX_KINDS || !set.insert(kind.to_owned()) {
            return;
        }
        if b.state() == BreakerState::Open {
            let _ = self.changes.send(Change {
                backend: key.to_owned(),
                kinds: vec![kind.to_owned()],
                open_until_ms: Some(b.trial_from_ms(&self.policy)),
                at_ms: now_ms,
            });
        }
    }

    /// Hand an opening or a closing of `key` to the ledger writer.
    fn announce(&self, key: &str, b: &Breaker, t: &Transition, now_ms: i64) {
        // The door refuses the kinds until a job could get a call: a demand trial's
        // earliest instant (a job that cannot wait for the whole cool-down takes it).
        let open_until_ms = match t.to {
            BreakerState::Open => Some(b.trial_from_ms(&self.policy)),
            BreakerState::Closed => None,
            // Its row's trial time has passed: the door counts it closed already.
            BreakerState::HalfOpen => return,
        };
        let kinds = self.kinds.lock().expect("breaker kinds");
        let kinds: Vec<String> = kinds
            .get(key)
            .map(|s| s.iter().cloned().collect())
            .unwrap_or_default();
        let _ = self.changes.send(Change {
            backend: key.to_owned(),
            kinds,
            open_until_ms,
            at_ms: now_ms,
        });
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
    /// may run before it counts as hung (failed); `latest_start_ms`: the job's latest
    /// useful start (for a demand trial). `kind`: the job's kind, recorded for the
    /// door with this breaker; `None` for a kind on a fallback route, which the door must
    /// not refuse while another backend of its route may take it.
    pub(crate) fn permit(
        self: &Arc<Self>,
        key: &str,
        kind: Option<&str>,
        trial_limit_ms: u64,
        latest_start_ms: Option<i64>,
        now_ms: i64,
    ) -> (Permit, Option<Trial>) {
        let mut map = self.map.lock().expect("breakers");
        let b = map
            .entry(key.to_owned())
            .or_insert_with(|| Breaker::new(&self.policy));
        let (permit, t) = b.permit(&self.policy, trial_limit_ms, latest_start_ms, now_ms);
        self.transition(key, b, t, now_ms);
        if let Some(kind) = kind {
            self.saw(key, kind, b, now_ms);
        }
        let trial = (permit == Permit::Trial).then(|| Trial {
            breakers: self.clone(),
            key: key.to_owned(),
            started_ms: b.trial_started_ms().unwrap_or(now_ms),
            done: false,
        });
        (permit, trial)
    }

    /// When a call to `key` could go out at the earliest, seen at `now_ms` without taking
    /// anything (`now_ms`: closed, or its half-open trial is free): for the choice among a
    /// fallback route's backends ([`lastcall_core::fallback`]).
    pub(crate) fn next_call_at(&self, key: &str, trial_limit_ms: u64, now_ms: i64) -> i64 {
        let map = self.map.lock().expect("breakers");
        map.get(key).map_or(now_ms, |b| {
            b.next_call_at_ms(&self.policy, now_ms, trial_limit_ms, None)
        })
    }

    /// A call to `key` that was not the trial ended with `verdict`.
    pub(crate) fn ended(&self, key: &str, verdict: Verdict, now_ms: i64) {
        self.report(key, None, verdict, now_ms);
    }

    /// A call to `key` ended; `trial`: the start of the trial it was, if one (it counts as
    /// the trial only while that trial is still the running one).
    fn report(&self, key: &str, trial: Option<i64>, verdict: Verdict, now_ms: i64) {
        let mut map = self.map.lock().expect("breakers");
        let b = map
            .entry(key.to_owned())
            .or_insert_with(|| Breaker::new(&self.policy));
        let trial = trial.is_some_and(|started| b.trial_is_current(started));
        let t = b.ended(&self.policy, trial, verdict, now_ms);
        self.transition(key, b, t, now_ms);
        if trial {
            // A trial that ended without a transition (neutral): the next job may try.
            self.changed.notify_waiters();
        }
    }

    fn transition(&self, key: &str, b: &Breaker, t: Option<Transition>, now_ms: i64) {
        self.mirror(key, b);
        let Some(t) = t else { return };
        self.announce(key, b, &t, now_ms);
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
    /// When it started: its name in the breaker, which may have declared it hung and
    /// started another since.
    started_ms: i64,
    done: bool,
}

impl Trial {
    pub(crate) fn ended(mut self, verdict: Verdict, now_ms: i64) {
        self.done = true;
        (self.breakers).report(&self.key, Some(self.started_ms), verdict, now_ms);
    }
}

impl Drop for Trial {
    fn drop(&mut self) {
        if !self.done {
            let mut map = self.breakers.map.lock().expect("breakers");
            if let Some(b) = map.get_mut(&self.key) {
                b.trial_abandoned(self.started_ms);
            }
            drop(map);
            self.breakers.changed.notify_waiters();
        }
    }
}

/// Write each opening and closing of this worker's breakers to the ledger, in order, for
/// the door: an open breaker's kinds with its next trial time
/// (`Ledger::record_breaker_open`), a closed one's rows removed. Best effort: a failed write
/// is logged and the door goes on as before (a row left behind expires at its trial time,
/// or with the worker's lease). Runs for the worker's whole life.
/// Takes what it uses (the breakers, the ledger, the worker's name), not the worker's
/// whole context.
pub(crate) async fn record(breakers: Arc<Breakers>, ledger: Arc<Ledger>, worker: String) {
    let Some(mut rx) = breakers.pending.lock().expect("breaker changes").take() else {
        return;
    };
    while let Some(c) = rx.recv().await {
        let written = match c.open_until_ms {
            // Open before any kind was called (cannot be: calls open it): nothing to say.
            Some(_) if c.kinds.is_empty() => Ok(()),
            Some(until) => {
                ledger
                    .record_breaker_open(&worker, &c.backend, &c.kinds, until, c.at_ms)
                    .await
            }
            None => ledger.clear_breaker(&worker, &c.backend).await,
        };
        if let Err(e) = written {
            tracing::warn!(backend = %c.backend, error = %e, "cannot record the breaker in the ledger: the door does not see it");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn failure() -> Verdict {
        Verdict::Failure {
            retry_after_ms: None,
        }
    }

    /// An opening names the kinds asked about with the next trial time, a kind first seen
    /// while open is announced at once, a half-open trial says nothing, a closing clears.
    #[test]
    fn openings_and_closings_go_to_the_ledger_writer_with_their_kinds() {
        let policy = BreakerPolicy {
            failures_to_open: 2,
            cool_down_ms: 1_000,
            ..Default::default()
        };
        let b = Arc::new(Breakers::new(policy, Arc::new(WorkerStats::default())));
        let mut rx = b.pending.lock().unwrap().take().unwrap();
        for (kind, at) in [("chat", 0), ("summary", 10)] {
            assert_eq!(
                b.permit("openai", Some(kind), 5_000, None, at).0,
                Permit::Call
            );
            b.ended("openai", failure(), at);
        }
        let c = rx.try_recv().expect("the opening");
        assert_eq!(
            (
                c.backend.as_str(),
                c.kinds.clone(),
                c.open_until_ms,
                c.at_ms
            ),
            (
                "openai",
                vec!["chat".into(), "summary".into()],
                Some(1_010),
                10
            )
        );
        // A new kind asks while open: announced alone, with the same trial time.
        assert!(matches!(
            b.permit("openai", Some("code"), 5_000, None, 20).0,
            Permit::Wait { .. }
        ));
        let c = rx.try_recv().expect("the new kind");
        assert_eq!(
            (c.kinds, c.open_until_ms),
            (vec!["code".into()], Some(1_010))
        );
        // The trial (half-open: nothing to say) succeeds: closed, the rows go.
        let (permit, trial) = b.permit("openai", Some("chat"), 5_000, None, 1_100);
        assert_eq!(permit, Permit::Trial);
        assert!(rx.try_recv().is_err(), "half-open is not announced");
        trial.unwrap().ended(Verdict::Success, 1_200);
        let c = rx.try_recv().expect("the closing");
        assert_eq!((c.backend.as_str(), c.open_until_ms), ("openai", None));
        assert!(rx.try_recv().is_err());
    }

    /// A kind on a fallback route (asked with no kind for the door) is never announced:
    /// the door must not refuse it while another backend of its route may take it.
    #[test]
    fn kinds_of_fallback_routes_are_not_announced_to_the_door() {
        let policy = BreakerPolicy {
            failures_to_open: 1,
            ..Default::default()
        };
        let b = Arc::new(Breakers::new(policy, Arc::new(WorkerStats::default())));
        let mut rx = b.pending.lock().unwrap().take().unwrap();
        assert_eq!(b.permit("vllm", None, 5_000, None, 0).0, Permit::Call);
        b.ended("vllm", failure(), 0);
        let c = rx.try_recv().expect("the opening");
        assert!(c.kinds.is_empty(), "{c:?}");
        assert!(matches!(
            b.permit("vllm", None, 5_000, None, 10).0,
            Permit::Wait { .. }
        ));
        assert!(rx.try_recv().is_err(), "no kind to announce");
    }
}
