//! Live counters and gauges of a worker. Read by the CLI (progress, summaries) and by the
//! metrics endpoint. No job ids here: only bounded, aggregate numbers.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

/// Counters and gauges of one worker process.
#[derive(Debug, Default)]
pub struct WorkerStats {
    /// Deliveries received from the broker.
    pub received: AtomicU64,
    /// Jobs waiting locally for a model slot (gauge).
    pub waiting: AtomicI64,
    /// Model calls in progress (gauge).
    pub running: AtomicI64,
    /// Bytes of message bodies held locally (gauge).
    pub buffered_bytes: AtomicI64,
    /// Model calls started.
    pub backend_calls: AtomicU64,
    /// Terminal outcomes recorded by this worker, by state.
    pub completed: AtomicU64,
    pub failed: AtomicU64,
    pub expired_not_started: AtomicU64,
    pub deadline_exceeded: AtomicU64,
    pub rejected: AtomicU64,
    /// Redeliveries acked without running because the outcome already existed.
    pub duplicates: AtomicU64,
    /// Retries published.
    pub retries: AtomicU64,
    /// Ledger write attempts that failed and were retried.
    pub store_retries: AtomicU64,
    /// Deliveries settled with the broker (ack or reject).
    pub settled: AtomicU64,
    /// Broker connections lost and re-established by the worker.
    pub reconnects: AtomicU64,
    /// Whether the worker is consuming on a live broker connection now (readiness).
    pub broker_connected: std::sync::atomic::AtomicBool,
    /// Whether the ledger took the last write (false while writes are being retried).
    pub ledger_healthy: std::sync::atomic::AtomicBool,
    /// Whether the retry publisher's connection (its own, apart from the consumer's) is up,
    /// refreshed with the lease every 2 s (`/readyz`: `retry_publisher`).
    pub retry_publisher_connected: std::sync::atomic::AtomicBool,
    /// Job tasks that panicked (a bug: their deliveries stay unacked and are redelivered).
    pub task_panics: AtomicU64,
    /// Histograms, labelled outcomes and slot gauges for `/metrics`.
    pub metrics: WorkerMetrics,
}

impl WorkerStats {
    pub fn get(c: &AtomicU64) -> u64 {
        c.load(Ordering::Relaxed)
    }

    pub(crate) fn inc(c: &AtomicU64) {
        c.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn add(g: &AtomicI64, d: i64) {
        g.fetch_add(d, Ordering::Relaxed);
    }

    pub(crate) fn count_state(&self, state: &str) {
        let c = match state {
            "completed" => &self.completed,
            "failed" => &self.failed,
            "expired_not_started" => &self.expired_not_started,
            "deadline_exceeded" => &self.deadline_exceeded,
            "rejected" => &self.rejected,
            _ => return,
        };
        Self::inc(c);
    }
}

/// Upper bounds (ms) of the dwell histograms (queue dwell, consumer dwell).
pub const DWELL_BUCKETS_MS: &[u64] = &[
    5, 10, 25, 50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 30_000, 60_000,
];
/// Upper bounds (ms) of the model call duration histogram.
pub const CALL_BUCKETS_MS: &[u64] = &[
    10, 50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 30_000, 60_000, 120_000,
];
/// Upper bounds (ms) of the remaining-budget-at-admission histogram.
pub const BUDGET_BUCKETS_MS: &[u64] = &[
    50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 30_000, 60_000, 300_000, 3_600_000,
];

/// A histogram with fixed bucket bounds, in ms. Lock-free; exported in seconds.
#[derive(Debug)]
pub struct Histogram {
    bounds_ms: &'static [u64],
    /// One counter per bound plus the `+Inf` bucket (not cumulative).
    buckets: Vec<AtomicU64>,
    sum_ms: AtomicU64,
    count: AtomicU64,
}

/// A consistent-enough copy of a histogram: cumulative counts per bound, then `+Inf`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HistogramSnapshot {
    pub bounds_ms: &'static [u64],
    pub cumulative: Vec<u64>,
    pub sum_ms: u64,
    pub count: u64,
}

impl Histogram {
    pub fn new(bounds_ms: &'static [u64]) -> Self {
        Self {
            bounds_ms,
            buckets: (0..=bounds_ms.len()).map(|_| AtomicU64::new(0)).collect(),
            sum_ms: AtomicU64::new(0),
            count: AtomicU64::new(0),
        }
    }

    /// Record one value; negative values (clock differences) count as 0.
    pub fn observe_ms(&self, ms: i64) {
        let v = ms.max(0) as u64;
        let i = self.bounds_ms.partition_point(|b| *b < v);
        self.buckets[i].fetch_add(1, Ordering::Relaxed);
        self.sum_ms.fetch_add(v, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
    }

    pub fn snapshot(&self) -> HistogramSnapshot {
        let mut acc = 0;
        let cumulative = self
            .buckets
            .iter()
            .map(|b| {
                acc += b.load(Ordering::Relaxed);
                acc
            })
            .collect();
        HistogramSnapshot {
            bounds_ms: self.bounds_ms,
            cumulative,
            sum_ms: self.sum_ms.load(Ordering::Relaxed),
            count: self.count.load(Ordering::Relaxed),
        }
    }
}

/// A bounded label vocabulary: the first `cap` distinct values (or only an allow-list)
/// become labels, anything else is `other`. Producers choose `kind`; this keeps a
/// producer from growing the number of series.
#[derive(Debug)]
pub struct BoundedLabels {
    cap: usize,
    fixed: bool,
    seen: Mutex<Vec<String>>,
}

impl BoundedLabels {
    /// The first `cap` distinct values.
    pub fn first(cap: usize) -> Self {
        Self {
            cap,
            fixed: false,
            seen: Mutex::new(Vec::new()),
        }
    }

    /// Only these values.
    pub fn only(values: &[&str]) -> Self {
        Self {
            cap: values.len(),
            fixed: true,
            seen: Mutex::new(values.iter().map(|v| (*v).to_owned()).collect()),
        }
    }

    /// The label for `value`.
    pub fn label(&self, value: &str) -> String {
        let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        if seen.iter().any(|s| s == value) {
            return value.to_owned();
        }
        if !self.fixed && seen.len() < self.cap {
            seen.push(value.to_owned());
            return value.to_owned();
        }
        "other".to_owned()
    }
}

/// Counters keyed by a fixed tuple of bounded labels.
#[derive(Debug, Default)]
pub struct LabeledCounter {
    map: Mutex<BTreeMap<Vec<String>, u64>>,
}

impl LabeledCounter {
    pub fn inc(&self, labels: Vec<String>) {
        let mut m = self.map.lock().unwrap_or_else(|e| e.into_inner());
        *m.entry(labels).or_default() += 1;
    }

    pub fn snapshot(&self) -> Vec<(Vec<String>, u64)> {
        let m = self.map.lock().unwrap_or_else(|e| e.into_inner());
        m.iter().map(|(k, v)| (k.clone(), *v)).collect()
    }
}

/// What the metrics endpoint adds to the plain counters: histograms, outcomes by
/// (state, kind, reason), and the slot and prefetch configuration. No job ids.
#[derive(Debug)]
pub struct WorkerMetrics {
    /// Publish → receipt (envelope `created_at_ms`, or the AMQP timestamp for retries).
    pub queue_dwell: Histogram,
    /// Receipt → the last admission check (time spent waiting locally).
    pub consumer_dwell: Histogram,
    /// Model call duration.
    pub model_call: Histogram,
    /// Budget left when a job was admitted.
    pub remaining_budget: Histogram,
    /// Prompt and completion tokens reported by the backends.
    pub prompt_tokens: AtomicU64,
    pub completion_tokens: AtomicU64,
    /// Terminal outcomes recorded by this worker: labels `[state, kind, reason]`.
    pub outcomes: LabeledCounter,
    pub kinds: BoundedLabels,
    pub reasons: BoundedLabels,
    /// The learned call duration (the admission quantile) last used, by bounded kind label.
    pub learned_call_ms: Mutex<BTreeMap<String, u64>>,
    slots: OnceLock<Arc<crate::slots::Slots>>,
    prefetch: AtomicU64,
}

impl Default for WorkerMetrics {
    fn default() -> Self {
        Self {
            queue_dwell: Histogram::new(DWELL_BUCKETS_MS),
            consumer_dwell: Histogram::new(DWELL_BUCKETS_MS),
            model_call: Histogram::new(CALL_BUCKETS_MS),
            remaining_budget: Histogram::new(BUDGET_BUCKETS_MS),
            prompt_tokens: AtomicU64::new(0),
            completion_tokens: AtomicU64::new(0),
            outcomes: LabeledCounter::default(),
            kinds: BoundedLabels::first(32),
            reasons: BoundedLabels::first(64),
            learned_call_ms: Mutex::new(BTreeMap::new()),
            slots: OnceLock::new(),
            prefetch: AtomicU64::new(0),
        }
    }
}

impl WorkerMetrics {
    /// Called once by `Worker::build`: the model slots (busy = total − available).
    pub(crate) fn attach(&self, slots: Arc<crate::slots::Slots>, prefetch: u16) {
        let _ = self.slots.set(slots);
        self.prefetch.store(u64::from(prefetch), Ordering::Relaxed);
    }

    /// `(busy, total)` model slots, when a worker is attached.
    pub fn slots(&self) -> Option<(usize, usize)> {
        self.slots
            .get()
            .map(|s| (s.total().saturating_sub(s.available()), s.total()))
    }

    pub fn prefetch(&self) -> u64 {
        self.prefetch.load(Ordering::Relaxed)
    }

    /// At receipt: queue dwell from the envelope's `created_at_ms` on the first attempt,
    /// from the AMQP `timestamp` (seconds) of the retry publish after that.
    pub(crate) fn observe_receipt(
        &self,
        created_at_ms: Option<i64>,
        attempt: u32,
        timestamp_s: Option<u64>,
        received_at_ms: i64,
    ) {
        let published_ms = match (attempt, created_at_ms, timestamp_s) {
            (0, Some(c), _) => Some(c),
            (_, _, Some(ts)) => Some(ts as i64 * 1000),
            _ => None,
        };
        if let Some(p) = published_ms {
            self.queue_dwell.observe_ms(received_at_ms - p);
        }
    }

    /// The learned call duration of `kind` after a call ended (the gauge).
    pub(crate) fn set_learned(&self, kind: &str, ms: u64) {
        let kind = self.kinds.label(kind);
        let mut m = self
            .learned_call_ms
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        m.insert(kind, ms);
    }

    /// `(kind, learned ms)` pairs for the gauge.
    pub fn learned(&self) -> Vec<(String, u64)> {
        let m = self
            .learned_call_ms
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        m.iter().map(|(k, v)| (k.clone(), *v)).collect()
    }

    pub(crate) fn count_outcome(&self, state: &str, kind: &str, reason: Option<&str>) {
        let kind = if kind == "invalid" {
            kind.to_owned()
        } else {
            self.kinds.label(kind)
        };
        let reason = self.reasons.label(reason.unwrap_or(""));
        self.outcomes.inc(vec![state.to_owned(), kind, reason]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_stay_bounded_whatever_producers_send() {
        let kinds = BoundedLabels::first(3);
        let labels: std::collections::BTreeSet<String> = (0..100)
            .map(|i| kinds.label(&format!("kind-{i}")))
            .collect();
        assert_eq!(labels.len(), 4, "{labels:?}");
        assert!(labels.contains("other"));
        assert_eq!(kinds.label("kind-1"), "kind-1");
        let only = BoundedLabels::only(&["a"]);
        assert_eq!(only.label("a"), "a");
        assert_eq!(only.label("b"), "other");
    }

    #[test]
    fn histogram_buckets_are_cumulative() {
        let h = Histogram::new(&[10, 100]);
        for v in [-5, 10, 11, 100, 5_000] {
            h.observe_ms(v);
        }
        let s = h.snapshot();
        assert_eq!(s.cumulative, vec![2, 4, 5]);
        assert_eq!(s.count, 5);
        assert_eq!(s.sum_ms, 10 + 11 + 100 + 5_000);
    }
}
