//! The learned call times of one worker ([`CallTimes`]): the estimator
//! ([`ServiceTimes`], keyed by kind and serving backend), its fits kept between calls
//! ([`PredictorCache`]), the predicted slowdown of adaptive slots, the cold-start and probe
//! bookkeeping, and the replay of the ledger's recent calls at start. Its own value, shared
//! by the job tasks (every admission gate asks it) and the start-up; it knows the backend
//! (for the routes), the slots (for the slowdown), the clock and the stats, nothing else of
//! the worker.

use crate::clock::Clock;
use crate::slots::Slots;
use crate::stats::WorkerStats;
use lastcall_backend::Backend;
use lastcall_core::request_size::RequestSize;
use lastcall_core::service_time::{
    CallToken, Estimate, EstimateSource, Predictor, PredictorCache, ProbeEnd, ServiceTimeConfig,
    ServiceTimes,
};
use lastcall_store::Ledger;
use std::sync::{Arc, Mutex};

/// The most recent calls a starting worker reads from the ledger ([`CallTimes::learn_from_ledger`]):
/// eight full estimator windows, enough for the kinds a worker serves at once.
const LEDGER_CALLS: u32 = 1_024;

/// How long a starting worker waits for the ledger's recent calls before it goes on
/// without them.
const LEDGER_READ_LIMIT: std::time::Duration = std::time::Duration::from_secs(5);

/// Observes one call of `backend` read from the ledger as if it had just ended here (at
/// its recorded time, never later than `now_ms`), under
/// [`RecordedCall::replayed`](lastcall_store::RecordedCall::replayed).
fn replay(
    service: &mut ServiceTimes,
    backend: &str,
    counted: bool,
    c: &lastcall_store::RecordedCall,
    now_ms: i64,
) {
    let key = key_of(&c.kind, backend);
    let at = c.recorded_at_ms.min(now_ms);
    let (size, used) = c.replayed(counted);
    service.observe_counted(&key, c.latency_ms, c.cut, size, used, at);
}

/// The estimator key of `kind`'s calls served by `backend`.
fn key_of(kind: &str, backend: &str) -> String {
    format!("{kind}|{backend}")
}

/// What one worker learned of its calls' times (see the module doc).
pub(crate) struct CallTimes {
    /// Learned model call durations per `kind|backend` ([`ServiceTimes`]): the admission
    /// rule's minimum useful runtime when a job sets none, and the expected wait; also the
    /// calls in flight (cold start) and the probes ([`Probe`]).
    service: Arc<Mutex<ServiceTimes>>,
    /// The estimator's fit per key ([`PredictorCache`]), kept while no call was recorded
    /// since, for at most 100 ms: a job asks for its learned time at each gate, and a fit
    /// sorts and fits the key's window (uncached, most of a job's CPU).
    fits: Mutex<PredictorCache>,
    backend: Arc<dyn Backend>,
    slots: Arc<Slots>,
    clock: Arc<dyn Clock>,
    stats: Arc<WorkerStats>,
}

impl CallTimes {
    pub(crate) fn new(
        config: ServiceTimeConfig,
        backend: Arc<dyn Backend>,
        slots: Arc<Slots>,
        clock: Arc<dyn Clock>,
        stats: Arc<WorkerStats>,
    ) -> Self {
        Self {
            service: Arc::new(Mutex::new(ServiceTimes::new(config))),
            fits: Mutex::default(),
            backend,
            slots,
            clock,
            stats,
        }
    }

    /// The learned p99 of `kind`'s completed calls on `backend` (cut calls left out).
    pub(crate) fn completed_p99(&self, kind: &str, backend: &str, now_ms: i64) -> Option<u64> {
        let key = key_of(kind, backend);
        let service = self.service.lock().unwrap_or_else(|e| e.into_inner());
        service
            .completed_estimate(&key, now_ms)
            .map(|e| e.quantile_ms)
    }

    /// What is learned about the calls of `kind` on `backend` (the estimator is keyed by
    /// kind and serving backend, so two backends of a route never share call times) at
    /// `now_ms`: for a request of `size` when known (the request-aware estimate), else for
    /// the kind; with adaptive slots, × the predicted slowdown at the current limit
    /// ([`Slots::inflation`]), so every admission gate judges a call at the concurrency it
    /// will run at.
    pub(crate) fn learned(
        &self,
        kind: &str,
        backend: &str,
        size: Option<RequestSize>,
        now_ms: i64,
    ) -> Option<Estimate> {
        let e = self.learned_alone(kind, backend, size, now_ms)?;
        Some(e.inflated(self.slots.inflation()))
    }

    /// [`CallTimes::learned`] without the slowdown of adaptive slots: the adaptive limit's
    /// reference for a call's time.
    pub(crate) fn learned_alone(
        &self,
        kind: &str,
        backend: &str,
        size: Option<RequestSize>,
        now_ms: i64,
    ) -> Option<Estimate> {
        let key = key_of(kind, backend);
        // On a fallback route a backend learns from its own calls only: the others' calls
        // of the kind (the slow first backend's) say nothing about it.
        let fallback = self.backend.routes_of(kind).len() > 1;
        let service = self.service.lock().unwrap_or_else(|e| e.into_inner());
        if fallback {
            return service.own_estimate_for(&key, size, now_ms);
        }
        let mut fits = self.fits.lock().unwrap_or_else(|e| e.into_inner());
        let p = fits.get(&service, &key, now_ms);
        p.estimate(size)
    }

    /// The request-aware estimator of each of `kinds` on its route's first backend (the
    /// one whose call time the lease publishes), for the lease: a peer predicts from it how
    /// long a request would take here. Kinds with no call of their own are left out.
    pub(crate) fn call_models<'k>(
        &self,
        kinds: impl Iterator<Item = &'k String>,
        now_ms: i64,
    ) -> std::collections::BTreeMap<String, Predictor> {
        let service = self.service.lock().unwrap_or_else(|e| e.into_inner());
        let mut fits = self.fits.lock().unwrap_or_else(|e| e.into_inner());
        (kinds)
            .filter_map(|kind| {
                let key = key_of(kind, self.backend.first_route(kind));
                let p = fits.get(&service, &key, now_ms);
                (p.base_source() == Some(EstimateSource::Key)).then(|| (kind.clone(), p))
            })
            .collect()
    }

    /// Learn from the ledger how long this backend's calls took lately (every worker's
    /// calls, the newest [`LEDGER_CALLS`] within the estimator's age limit), so that a
    /// restarted worker, or one joining a pool, starts with what is known instead of the
    /// bare floor. Best effort: without an answer in [`LEDGER_READ_LIMIT`] it learns from its
    /// own calls only. Returns how many calls it learned from.
    pub(crate) async fn learn_from_ledger(&self, ledger: &Ledger) -> usize {
        let cfg = self.service_config();
        let now = self.clock.now_ms();
        let since = now.saturating_sub(cfg.max_age_ms);
        // Each serving backend's calls, keyed by that backend (not by today's route: a
        // call taught only the backend that made it).
        let read = async {
            let mut all = Vec::new();
            for name in self.backend.serving_names() {
                let calls = ledger.recent_calls(name, since, LEDGER_CALLS).await?;
                all.extend(calls.into_iter().map(|c| (name.to_owned(), c)));
            }
            Ok::<_, lastcall_store::StoreError>(all)
        };
        let calls = match tokio::time::timeout(LEDGER_READ_LIMIT, read).await {
            Ok(Ok(calls)) => calls,
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "could not read recent call times from the ledger: learning from this worker's calls only");
                return 0;
            }
            Err(_) => {
                tracing::warn!(
                    "the ledger did not answer within {LEDGER_READ_LIMIT:?} with recent call times: learning from this worker's calls only"
                );
                return 0;
            }
        };
        let mut kinds = std::collections::BTreeSet::new();
        {
            let mut service = self.service.lock().unwrap_or_else(|e| e.into_inner());
            for (backend, c) in &calls {
                let counted = self.backend.counts_prompt_tokens(&c.kind);
                replay(&mut service, backend, counted, c, now);
                kinds.insert(c.kind.as_str());
            }
        }
        for kind in &kinds {
            if let Some(e) = self.learned(kind, self.backend.first_route(kind), None, now) {
                self.stats.metrics.set_learned(kind, e.quantile_ms);
            }
        }
        if !calls.is_empty() {
            tracing::info!(
                calls = calls.len(),
                kinds = kinds.len(),
                backend = self.backend.name(),
                "learned call times from the ledger's recent calls"
            );
        }
        calls.len()
    }

    fn service_config(&self) -> ServiceTimeConfig {
        let service = self.service.lock().unwrap_or_else(|e| e.into_inner());
        service.config()
    }

    /// A call of `kind` on `backend` starts now: while it runs, its elapsed time is a lower
    /// bound on the call time of a kind with too few ended calls (cold start).
    pub(crate) fn call_started(&self, kind: &str, backend: &str) -> CallToken {
        let key = key_of(kind, backend);
        let now = self.clock.now_ms();
        let mut service = self.service.lock().unwrap_or_else(|e| e.into_inner());
        service.call_started(&key, now)
    }

    /// The call of `token` has ended (its duration is observed separately).
    pub(crate) fn call_ended(&self, kind: &str, backend: &str, token: CallToken) {
        let key = key_of(kind, backend);
        let mut service = self.service.lock().unwrap_or_else(|e| e.into_inner());
        service.call_ended(&key, token);
    }

    /// The learned estimate refuses a job of `kind` with `room_ms` for its call and no slot
    /// is free: may the job wait, judged without the estimate, and try a probe at its slot
    /// ([`ServiceTimes::may_probe`], at the same room as [`Self::try_probe`])?
    pub(crate) fn may_probe(
        &self,
        kind: &str,
        backend: &str,
        size: Option<RequestSize>,
        room_ms: u64,
        now_ms: i64,
    ) -> bool {
        let key = key_of(kind, backend);
        let room_ms = self.probe_room(room_ms);
        let service = self.service.lock().unwrap_or_else(|e| e.into_inner());
        service.may_probe(&key, size, room_ms, now_ms)
    }

    /// A probe runs at the current concurrency: what the estimator's calls say is judged
    /// against the room ÷ the adaptive limit's predicted slowdown.
    fn probe_room(&self, room_ms: u64) -> u64 {
        (room_ms as f64 / self.slots.inflation().max(1.0)) as u64
    }

    /// The learned estimate refuses a job of `kind` with `room_ms` for its call although a
    /// slot is free: run it as a probe, without the estimate, if the estimator allows one
    /// now (the refusal rests on cut calls, and the probe pacing).
    pub(crate) fn try_probe(
        &self,
        kind: &str,
        backend: &str,
        size: Option<RequestSize>,
        room_ms: u64,
        now_ms: i64,
    ) -> Option<Probe> {
        let key = key_of(kind, backend);
        let room_ms = self.probe_room(room_ms);
        let granted = {
            let mut service = self.service.lock().unwrap_or_else(|e| e.into_inner());
            service.try_probe(&key, size, room_ms, now_ms)
        };
        granted.then(|| {
            WorkerStats::inc(&self.stats.probes);
            tracing::info!(
                kind,
                backend,
                "the learned call time refuses this job while a slot is free: running it as a probe"
            );
            Probe {
                service: self.service.clone(),
                clock: self.clock.clone(),
                key,
                ended: false,
            }
        })
    }

    /// One call of `kind` on `backend`, a request of `size`, took `ms`: completed, or
    /// `cut` at the deadline (a lower bound); `used`: the prompt tokens it used, as its
    /// server (or the model's tokenizer) counted them, when it said.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn observe_call(
        &self,
        kind: &str,
        backend: &str,
        ms: i64,
        cut: bool,
        size: Option<RequestSize>,
        used: Option<u64>,
        now_ms: i64,
    ) {
        let key = key_of(kind, backend);
        let estimate = {
            let mut service = self.service.lock().unwrap_or_else(|e| e.into_inner());
            service.observe_counted(&key, ms.max(0) as u64, cut, size, used, now_ms);
            service.estimate(&key, now_ms)
        };
        // The gauge is per kind: it shows the route's first backend.
        if let Some(e) = estimate.filter(|_| backend == self.backend.first_route(kind)) {
            self.stats.metrics.set_learned(kind, e.quantile_ms);
        }
    }
}

/// A probe call (half-open): a job the learned estimate refused while a slot was free,
/// run without the estimate so that a stale estimate (a hang, a transient slowness) can be
/// found out ([`ServiceTimes::try_probe`]). Its end goes back to the estimator; dropped
/// without an end (the job ended before its call), it is released.
pub(crate) struct Probe {
    service: Arc<Mutex<ServiceTimes>>,
    clock: Arc<dyn Clock>,
    key: String,
    ended: bool,
}

impl Probe {
    /// The probe's call ended: `end` says how.
    pub(crate) fn end(mut self, end: ProbeEnd) {
        self.finish(end);
    }

    fn finish(&mut self, end: ProbeEnd) {
        if std::mem::replace(&mut self.ended, true) {
            return;
        }
        let now = self.clock.now_ms();
        let mut service = self.service.lock().unwrap_or_else(|e| e.into_inner());
        service.probe_ended(&self.key, end, now);
    }
}

impl Drop for Probe {
    fn drop(&mut self) {
        self.finish(ProbeEnd::Released);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lastcall_core::service_time::ServiceTimeConfig;
    use lastcall_store::RecordedCall;

    fn sized(prompt_tokens: u64, max_tokens: Option<u64>) -> Option<RequestSize> {
        Some(RequestSize {
            prompt_tokens,
            max_tokens,
        })
    }

    /// A completed call of ~1.25 s read from the ledger, with the worker's measure of its
    /// request (`worker`) and its server's prompt count (`server`).
    fn call(i: u64, worker: Option<RequestSize>, server: Option<u64>) -> RecordedCall {
        RecordedCall {
            kind: "chat".into(),
            latency_ms: 1_250 + i % 7,
            recorded_at_ms: i as i64,
            cut: false,
            size: worker,
            prompt_tokens: server,
        }
    }

    /// Replays 50 such calls into a fresh estimator, as a starting worker does, then asks
    /// whether a job of size `job` with 500 ms for its call, which their ~1.25 s refuse,
    /// may run as a probe: only when every replayed call was of a larger request (the
    /// refusal rests on larger calls alone).
    fn probed_after(
        worker: Option<RequestSize>,
        server: Option<u64>,
        job: Option<RequestSize>,
    ) -> bool {
        let mut st = ServiceTimes::new(ServiceTimeConfig::default());
        for i in 0..50 {
            replay(&mut st, "sim", false, &call(i, worker, server), 100);
        }
        let e = st.estimate_for("chat|sim", job, 100).expect("learned");
        assert!(
            e.quantile_ms > 500,
            "the replayed calls refuse the job: {e:?}"
        );
        st.try_probe("chat|sim", job, 500, 100)
    }

    #[test]
    fn a_replayed_call_is_sized_by_its_measure_and_its_servers_count() {
        let short = sized(10, None);
        // Long prompts, which their server counted at twice the worker's measure: the calls
        // are larger than the short job, which is probed.
        assert!(probed_after(sized(600, None), Some(1_200), short));
        // A job measured at 400 is 800 of the server's tokens: larger than every replayed
        // call (600), so they justify its refusal, which stands. (Measure and count taken
        // as one unit, the calls would be larger than it, and it would be probed.)
        assert!(!probed_after(sized(300, None), Some(600), sized(400, None)));
        // `max_tokens` is replayed too (the server's count has none): calls of the same
        // prompt with a larger cap are larger requests.
        let capped = sized(10, Some(64));
        assert!(probed_after(sized(10, Some(512)), Some(10), capped));
        assert!(!probed_after(sized(10, Some(64)), Some(10), capped));
        // A call recorded without the worker's size (before ledger version 12): the
        // server's count, as before.
        assert!(probed_after(None, Some(600), short));
        assert!(!probed_after(None, Some(8), short));
        // Neither: an unsized call, which justifies refusing any request.
        assert!(!probed_after(None, None, short));
        assert_eq!(
            call(0, capped, Some(600)).replayed(false),
            (capped, Some(600))
        );
        assert_eq!(call(0, None, Some(600)).replayed(false), (None, Some(600)));
        // A backend that counts the prompt's tokens (the local model's tokenizer) measures
        // a request by that count: the recorded count is the measure, with the cap.
        assert_eq!(
            call(0, capped, Some(600)).replayed(true),
            (sized(600, Some(64)), Some(600))
        );
        // A count of 0 (a streamed reply without usage) is no count.
        assert_eq!(call(0, capped, Some(0)).replayed(false), (capped, None));
    }
}
