//! Live counters and gauges of a worker, and their Prometheus exposition. The CLI reads
//! the counters (progress, summaries); [`WorkerCollector`] and [`DlqCollector`] encode
//! them with `prometheus-client` into the process's registry (`lastcall-http`'s
//! `MetricsSource`), with the crate's histograms and label families. No job ids here:
//! only bounded, aggregate numbers.

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock};

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
    /// Jobs run as probes: the learned call time refused them while a slot was free.
    pub probes: AtomicU64,
    /// Model calls that went to a later backend of their kind's fallback route (the first
    /// could not take them: breaker, rate limit, or learned call time).
    pub fallback_calls: AtomicU64,
    /// Terminal outcomes recorded by this worker, by state.
    pub completed: AtomicU64,
    pub failed: AtomicU64,
    pub expired_not_started: AtomicU64,
    pub deadline_exceeded: AtomicU64,
    pub rejected: AtomicU64,
    /// Redeliveries acked without running because the outcome already existed.
    pub duplicates: AtomicU64,
    /// Jobs handed back unrecorded at receipt for another worker: refused only for this
    /// worker's backlog while a peer had room.
    pub passed_on: AtomicU64,
    /// The fleet's leases with their live numbers, read at this worker's last lease
    /// renewal (every 2 s): where a job this worker cannot start in time may go
    /// ([`lastcall_core::live::peer_wait_ms`]).
    pub peers: Mutex<Vec<lastcall_core::live::Lease>>,
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
    /// Jobs ended without a call because their backend's next rate-limit permit came
    /// after their latest useful start (`admission:rate_limited`).
    pub rate_limited: AtomicU64,
    /// Jobs waiting (without a slot) for a rate-limit permit (gauge).
    pub rate_limit_waiting: AtomicI64,
    /// Job tasks that panicked (a bug: their deliveries stay unacked and are redelivered).
    pub task_panics: AtomicU64,
    /// Histograms, labelled outcomes and slot gauges for `/metrics`.
    pub metrics: WorkerMetrics,
    /// The circuit breaker of each model server (backend, or route), mirrored at every
    /// change for `/metrics` and `/readyz`.
    pub breakers: Mutex<BTreeMap<String, BreakerView>>,
}

/// A model server's circuit breaker as `/metrics` and `/readyz` show it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BreakerView {
    pub state: lastcall_core::breaker::BreakerState,
    /// Times it opened.
    pub opens: u64,
}

impl WorkerStats {
    pub fn get(c: &AtomicU64) -> u64 {
        c.load(Ordering::Relaxed)
    }

    pub(crate) fn inc(c: &AtomicU64) {
        c.fetch_add(1, Ordering::Relaxed);
    }

    /// Add `n` to a counter, stopping at `u64::MAX` (a server-reported count never wraps
    /// it).
    pub(crate) fn add_saturating(c: &AtomicU64, n: u64) {
        let _ = c.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
            Some(v.saturating_add(n))
        });
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

    /// What `/readyz` reports for a worker: its consuming connection, the ledger, and the
    /// retry publisher's own connection.
    /// Each model server's circuit breaker state (`closed`, `half_open`, `open`), for the
    /// `backends` field of `/readyz`: an open breaker is degraded, not a failed check.
    pub fn backends(&self) -> BTreeMap<String, String> {
        let view = self.breakers.lock().expect("breaker view");
        (view.iter())
            .map(|(k, v)| (k.clone(), v.state.as_str().to_owned()))
            .collect()
    }

    /// The live numbers this worker publishes through its lease at each renewal
    /// (`serve`'s dashboard reads them from the ledger).
    pub fn live(&self) -> lastcall_core::live::WorkerLive {
        let learned = self
            .metrics
            .learned_ms
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        lastcall_core::live::WorkerLive {
            waiting: self.waiting.load(Ordering::Relaxed),
            waiting_for_rate_limit: self.rate_limit_waiting.load(Ordering::Relaxed),
            running: self.running.load(Ordering::Relaxed),
            limit: self.metrics.slots().map_or(0, |(_, total)| total as i64),
            learned_call_ms: learned.iter().map(|(k, v)| (k.to_string(), *v)).collect(),
            // The lease adds them ([`crate::times::CallTimes::call_models`]).
            call_models: Default::default(),
        }
    }

    pub fn readiness(&self) -> Vec<(&'static str, bool)> {
        vec![
            ("broker", self.broker_connected.load(Ordering::Relaxed)),
            ("ledger", self.ledger_healthy.load(Ordering::Relaxed)),
            (
                "retry_publisher",
                self.retry_publisher_connected.load(Ordering::Relaxed),
            ),
        ]
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

/// A `prometheus-client` histogram with fixed bounds given in ms, observed in ms and
/// exported in seconds. Clones share the same series.
#[derive(Debug, Clone)]
pub struct Histogram(prometheus_client::metrics::histogram::Histogram);

impl Histogram {
    pub fn new(bounds_ms: &[u64]) -> Self {
        Self(prometheus_client::metrics::histogram::Histogram::new(
            bounds_ms.iter().map(|b| *b as f64 / 1000.0),
        ))
    }

    /// Record one value; negative values (clock differences) count as 0.
    pub fn observe_ms(&self, ms: i64) {
        self.0.observe(ms.max(0) as f64 / 1000.0);
    }
}

/// A label value: shared, so recording a known value allocates nothing.
pub type Label = Arc<str>;

/// A bounded label vocabulary: the first `cap` distinct values (or only an allow-list)
/// become labels, anything else is `other`. Producers choose `kind`; this keeps a
/// producer from growing the number of series.
#[derive(Debug)]
pub struct BoundedLabels {
    cap: usize,
    fixed: bool,
    seen: RwLock<Vec<Label>>,
    other: Label,
}

impl BoundedLabels {
    /// The first `cap` distinct values.
    pub fn first(cap: usize) -> Self {
        Self {
            cap,
            fixed: false,
            seen: RwLock::new(Vec::new()),
            other: Label::from("other"),
        }
    }

    /// Only these values.
    pub fn only(values: &[&str]) -> Self {
        Self {
            cap: values.len(),
            fixed: true,
            seen: RwLock::new(values.iter().map(|v| Label::from(*v)).collect()),
            other: Label::from("other"),
        }
    }

    /// The label for `value` (a value seen before costs a shared read, no allocation).
    pub fn label(&self, value: &str) -> Label {
        fn known(seen: &[Label], value: &str) -> Option<Label> {
            seen.iter().find(|s| &***s == value).cloned()
        }
        if let Some(l) = known(&self.seen.read().unwrap_or_else(|e| e.into_inner()), value) {
            return l;
        }
        if self.fixed {
            return self.other.clone();
        }
        let mut seen = self.seen.write().unwrap_or_else(|e| e.into_inner());
        if let Some(l) = known(&seen, value) {
            return l;
        }
        if seen.len() < self.cap {
            let l = Label::from(value);
            seen.push(l.clone());
            return l;
        }
        self.other.clone()
    }
}

/// Counters keyed by a fixed tuple of bounded labels (the dead-letter processor's
/// `by_reason`; the names of the labels are given when it is encoded).
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

/// The labels of `lastcall_outcomes_total`: `state`, `kind`, `reason`.
pub type OutcomeLabels = [(&'static str, Label); 3];
/// The label of `lastcall_learned_call_seconds`: `kind`.
pub type KindLabel = [(&'static str, Label); 1];

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
    /// Terminal outcomes recorded by this worker, by `[state, kind, reason]`.
    pub outcomes: Family<OutcomeLabels, Counter>,
    pub states: BoundedLabels,
    pub kinds: BoundedLabels,
    pub reasons: BoundedLabels,
    /// The learned call duration (the admission quantile) last used, in seconds, by
    /// bounded kind label.
    pub learned_call: Family<KindLabel, Gauge<f64, AtomicU64>>,
    /// The same learned durations in ms, for the live numbers of the lease
    /// ([`WorkerStats::live`]).
    learned_ms: Mutex<BTreeMap<Label, u64>>,
    /// The kind of an envelope that did not parse (never counted against the cap).
    invalid_kind: Label,
    slots: OnceLock<Arc<crate::slots::Slots>>,
    prefetch: AtomicU64,
}

impl Default for WorkerMetrics {
    fn default() -> Self {
        let states: Vec<&str> = lastcall_core::State::ALL
            .iter()
            .map(|s| s.as_str())
            .collect();
        Self {
            queue_dwell: Histogram::new(DWELL_BUCKETS_MS),
            consumer_dwell: Histogram::new(DWELL_BUCKETS_MS),
            model_call: Histogram::new(CALL_BUCKETS_MS),
            remaining_budget: Histogram::new(BUDGET_BUCKETS_MS),
            prompt_tokens: AtomicU64::new(0),
            completion_tokens: AtomicU64::new(0),
            outcomes: Family::default(),
            states: BoundedLabels::only(&states),
            kinds: BoundedLabels::first(32),
            reasons: BoundedLabels::first(64),
            learned_call: Family::default(),
            learned_ms: Mutex::default(),
            invalid_kind: Label::from("invalid"),
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
        let label = self.kinds.label(kind);
        (self.learned_ms.lock().unwrap_or_else(|e| e.into_inner())).insert(label.clone(), ms);
        let labels = [("kind", label)];
        self.learned_call
            .get_or_create(&labels)
            .set(ms as f64 / 1000.0);
    }

    pub(crate) fn count_outcome(&self, state: &str, kind: &str, reason: Option<&str>) {
        let kind = if kind == "invalid" {
            self.invalid_kind.clone()
        } else {
            self.kinds.label(kind)
        };
        let labels = [
            ("state", self.states.label(state)),
            ("kind", kind),
            ("reason", self.reasons.label(reason.unwrap_or(""))),
        ];
        self.outcomes.get_or_create(&labels).inc();
    }
}

/// One family with one unlabelled sample.
fn one(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    m: &impl EncodeMetric,
) -> std::fmt::Result {
    m.encode(enc.encode_descriptor(name, help, None, m.metric_type())?)
}

/// One family with one sample per `(label value, value)`.
fn labelled<M: EncodeMetric>(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    label: &'static str,
    samples: impl IntoIterator<Item = (String, M)>,
    metric_type: prometheus_client::metrics::MetricType,
) -> std::fmt::Result {
    let mut family = enc.encode_descriptor(name, help, None, metric_type)?;
    for (value, m) in samples {
        m.encode(family.encode_family(&[(label, value.as_str())])?)?;
    }
    Ok(())
}

/// The worker's metrics for one scrape, as a `prometheus-client` collector: register it
/// in the process's registry. Counter names get their `_total` from the encoder.
#[derive(Debug, Clone)]
pub struct WorkerCollector(pub Arc<WorkerStats>);

impl Collector for WorkerCollector {
    fn encode(&self, mut enc: DescriptorEncoder) -> std::fmt::Result {
        let w = &*self.0;
        encode_counters(w, &mut enc)?;
        encode_gauges(w, &mut enc)?;
        encode_breakers(w, &mut enc)?;
        encode_distributions(&w.metrics, &mut enc)
    }
}

/// Each model server's breaker: its state (0 closed, 1 half-open, 2 open) and its opens.
fn encode_breakers(w: &WorkerStats, enc: &mut DescriptorEncoder) -> std::fmt::Result {
    let view: Vec<(String, BreakerView)> = (w.breakers.lock().expect("breaker view").iter())
        .map(|(k, v)| (k.clone(), *v))
        .collect();
    labelled(
        enc,
        "lastcall_worker_breaker_state",
        "Circuit breaker of each model server: 0 closed, 1 half-open, 2 open",
        "backend",
        view.iter()
            .map(|(k, v)| (k.clone(), ConstGauge::new(v.state.gauge()))),
        prometheus_client::metrics::MetricType::Gauge,
    )?;
    labelled(
        enc,
        "lastcall_worker_breaker_opens",
        "Times each model server's circuit breaker opened",
        "backend",
        view.iter()
            .map(|(k, v)| (k.clone(), ConstCounter::new(v.opens))),
        prometheus_client::metrics::MetricType::Counter,
    )
}

/// The worker's plain counters (`lastcall_worker_*_total`).
fn encode_counters(w: &WorkerStats, enc: &mut DescriptorEncoder) -> std::fmt::Result {
    let counters: [(&str, &AtomicU64, &str); 12] = [
        (
            "lastcall_worker_rate_limited",
            &w.rate_limited,
            "Jobs ended without a call: their backend's next rate-limit permit came after their latest useful start",
        ),
        (
            "lastcall_worker_reconnects",
            &w.reconnects,
            "Broker connections lost and re-established",
        ),
        (
            "lastcall_worker_received",
            &w.received,
            "Deliveries received from the broker",
        ),
        (
            "lastcall_worker_backend_calls",
            &w.backend_calls,
            "Model calls started",
        ),
        (
            "lastcall_worker_fallback_calls",
            &w.fallback_calls,
            "Model calls that went to a later backend of their kind's fallback route",
        ),
        (
            "lastcall_worker_probes",
            &w.probes,
            "Jobs run as probes (the learned call time refused them while a slot was free)",
        ),
        (
            "lastcall_worker_retries",
            &w.retries,
            "Retries published to a retry queue",
        ),
        (
            "lastcall_worker_passed_on",
            &w.passed_on,
            "Jobs handed back unrecorded at receipt for another worker (refused only for this worker's backlog while a peer had room)",
        ),
        (
            "lastcall_worker_duplicates",
            &w.duplicates,
            "Redeliveries acked without running (outcome already recorded)",
        ),
        (
            "lastcall_worker_store_retries",
            &w.store_retries,
            "Ledger writes that failed and were retried",
        ),
        (
            "lastcall_worker_settled",
            &w.settled,
            "Deliveries acked or rejected after the durable write",
        ),
        (
            "lastcall_worker_rejected",
            &w.rejected,
            "Invalid envelopes recorded as rejected",
        ),
    ];
    for (name, c, help) in counters {
        one(enc, name, help, &ConstCounter::new(WorkerStats::get(c)))?;
    }
    Ok(())
}

/// The worker's gauges: connection and ledger health, jobs, slots, prefetch, buffer.
fn encode_gauges(w: &WorkerStats, enc: &mut DescriptorEncoder) -> std::fmt::Result {
    let m = &w.metrics;
    let (busy, total) = m.slots().unwrap_or((0, 0));
    let gauges: [(&str, i64, &str); 10] = [
        (
            "lastcall_worker_broker_connected",
            i64::from(w.broker_connected.load(Ordering::Relaxed)),
            "1 while the worker consumes on a live broker connection",
        ),
        (
            "lastcall_worker_ledger_healthy",
            i64::from(w.ledger_healthy.load(Ordering::Relaxed)),
            "1 unless ledger writes are failing (intake paused)",
        ),
        (
            "lastcall_worker_jobs_waiting",
            w.waiting.load(Ordering::Relaxed),
            "Jobs received and waiting locally for a model slot",
        ),
        (
            "lastcall_worker_jobs_waiting_for_rate_limit",
            w.rate_limit_waiting.load(Ordering::Relaxed),
            "Jobs waiting, without a slot, for their backend's next rate-limit permit",
        ),
        (
            "lastcall_worker_jobs_running",
            w.running.load(Ordering::Relaxed),
            "Model calls in progress",
        ),
        (
            "lastcall_worker_slots_busy",
            busy as i64,
            "Model slots held by a job",
        ),
        (
            "lastcall_worker_slots_total",
            total as i64,
            "Model slots now: the fixed count, or the adaptive limit of --slots auto",
        ),
        (
            "lastcall_worker_concurrency_limit",
            total as i64,
            "Model calls this worker may run at once now (--slots N, or the adaptive limit of --slots auto)",
        ),
        (
            "lastcall_worker_prefetch",
            m.prefetch() as i64,
            "Unacked deliveries the broker may push to this worker",
        ),
        (
            "lastcall_worker_buffered_bytes",
            w.buffered_bytes.load(Ordering::Relaxed),
            "Bytes of message bodies held locally",
        ),
    ];
    for (name, v, help) in gauges {
        one(enc, name, help, &ConstGauge::new(v))?;
    }
    Ok(())
}

/// Outcomes by label, learned call durations, token counts and the latency histograms.
fn encode_distributions(m: &WorkerMetrics, enc: &mut DescriptorEncoder) -> std::fmt::Result {
    one(
        enc,
        "lastcall_outcomes",
        "Terminal outcomes recorded by this worker, by state, kind and reason",
        &m.outcomes,
    )?;
    one(
        enc,
        "lastcall_learned_call_seconds",
        "Learned model call duration by kind (the high quantile the admission rule uses as the minimum useful runtime)",
        &m.learned_call,
    )?;
    labelled(
        enc,
        "lastcall_model_tokens",
        "Tokens reported by the model backends, by type",
        "type",
        [
            ("prompt", &m.prompt_tokens),
            ("completion", &m.completion_tokens),
        ]
        .map(|(ty, c)| (ty.to_owned(), ConstCounter::new(c.load(Ordering::Relaxed)))),
        prometheus_client::metrics::MetricType::Counter,
    )?;
    for (name, help, h) in [
        (
            "lastcall_queue_dwell_seconds",
            "Publish to receipt by a worker",
            &m.queue_dwell,
        ),
        (
            "lastcall_consumer_dwell_seconds",
            "Receipt to the last admission check (waiting locally)",
            &m.consumer_dwell,
        ),
        (
            "lastcall_model_call_seconds",
            "Model call duration",
            &m.model_call,
        ),
        (
            "lastcall_remaining_budget_at_admission_seconds",
            "Budget left when a job was admitted",
            &m.remaining_budget,
        ),
    ] {
        one(enc, name, help, &h.0)?;
    }
    Ok(())
}

/// Counters of one dead-letter processor run ([`crate::dlq::DeadLetterProcessor`]).
#[derive(Debug, Default)]
pub struct DlqStats {
    pub processed: AtomicU64,
    pub recorded: AtomicU64,
    pub kept_existing: AtomicU64,
    pub parked: AtomicU64,
    /// Dead letters by their broker reason (`expired`, `rejected`, `maxlen`,
    /// `delivery_limit`, `other`): labels `[reason]`.
    pub by_reason: LabeledCounter,
    /// Whether the processor is consuming now (false while it reconnects).
    pub connected: std::sync::atomic::AtomicBool,
    /// Broker connections lost and re-established.
    pub reconnects: AtomicU64,
}

/// The dead-letter processor's metrics as a `prometheus-client` collector.
#[derive(Debug, Clone)]
pub struct DlqCollector(pub Arc<DlqStats>);

impl DlqCollector {
    /// What `/readyz` reports for the processor: its consuming connection.
    pub fn readiness(&self) -> Vec<(&'static str, bool)> {
        vec![(
            "dead_letter_processor",
            self.0.connected.load(Ordering::Relaxed),
        )]
    }
}

impl Collector for DlqCollector {
    fn encode(&self, mut enc: DescriptorEncoder) -> std::fmt::Result {
        let d = &*self.0;
        labelled(
            &mut enc,
            "lastcall_dead_letters",
            "Dead letters processed, by broker reason",
            "reason",
            d.by_reason.snapshot().into_iter().filter_map(|(mut l, v)| {
                let reason = l.pop()?;
                Some((reason, ConstCounter::new(v)))
            }),
            prometheus_client::metrics::MetricType::Counter,
        )?;
        one(
            &mut enc,
            "lastcall_dlq_connected",
            "1 while the dead-letter processor consumes on a live connection",
            &ConstGauge::new(i64::from(d.connected.load(Ordering::Relaxed))),
        )?;
        one(
            &mut enc,
            "lastcall_dlq_reconnects",
            "Broker connections the dead-letter processor lost and re-established",
            &ConstCounter::new(d.reconnects.load(Ordering::Relaxed)),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::encoding::prometheus_text::encode;
    use prometheus_client::registry::Registry;

    fn exposition(c: impl Collector) -> String {
        let mut r = Registry::default();
        r.register_collector(Box::new(c));
        let mut out = String::new();
        encode(&mut out, &r).unwrap();
        out
    }

    #[test]
    fn labels_stay_bounded_whatever_producers_send() {
        let kinds = BoundedLabels::first(3);
        let labels: std::collections::BTreeSet<Label> = (0..100)
            .map(|i| kinds.label(&format!("kind-{i}")))
            .collect();
        assert_eq!(labels.len(), 4, "{labels:?}");
        assert!(labels.contains("other"));
        assert_eq!(&*kinds.label("kind-1"), "kind-1");
        let only = BoundedLabels::only(&["a"]);
        assert_eq!(&*only.label("a"), "a");
        assert_eq!(&*only.label("b"), "other");
    }

    #[test]
    fn breakers_are_a_gauge_and_a_counter_per_backend_and_readyz_backends() {
        use lastcall_core::breaker::BreakerState;
        let stats = Arc::new(WorkerStats::default());
        let view = |state, opens| BreakerView { state, opens };
        (stats.breakers.lock().unwrap()).insert("openai".into(), view(BreakerState::Open, 3));
        (stats.breakers.lock().unwrap()).insert("sim".into(), view(BreakerState::Closed, 0));
        let text = exposition(WorkerCollector(stats.clone()));
        for line in [
            "# TYPE lastcall_worker_breaker_state gauge",
            "lastcall_worker_breaker_state{backend=\"openai\"} 2",
            "lastcall_worker_breaker_state{backend=\"sim\"} 0",
            "# TYPE lastcall_worker_breaker_opens_total counter",
            "lastcall_worker_breaker_opens_total{backend=\"openai\"} 3",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} in\n{text}");
        }
        let backends = stats.backends();
        assert_eq!(backends["openai"], "open");
        assert_eq!(backends["sim"], "closed");
        // An open breaker is degraded, not a failed readiness check.
        assert!(stats.readiness().iter().all(|(n, _)| *n != "openai"));
    }

    #[test]
    fn histogram_buckets_are_cumulative_in_seconds() {
        let stats = Arc::new(WorkerStats::default());
        for v in [-5, 10, 11, 100, 5_000, 60_001] {
            stats.metrics.model_call.observe_ms(v);
        }
        let text = exposition(WorkerCollector(stats));
        for line in [
            "# TYPE lastcall_model_call_seconds histogram",
            "lastcall_model_call_seconds_bucket{le=\"0.01\"} 2",
            "lastcall_model_call_seconds_bucket{le=\"0.05\"} 3",
            "lastcall_model_call_seconds_bucket{le=\"0.1\"} 4",
            "lastcall_model_call_seconds_bucket{le=\"5\"} 5",
            "lastcall_model_call_seconds_bucket{le=\"60\"} 5",
            "lastcall_model_call_seconds_bucket{le=\"120\"} 6",
            "lastcall_model_call_seconds_bucket{le=\"+Inf\"} 6",
            "lastcall_model_call_seconds_count 6",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} in\n{text}");
        }
        let sum = text
            .lines()
            .find_map(|l| l.strip_prefix("lastcall_model_call_seconds_sum "))
            .unwrap();
        assert!((sum.parse::<f64>().unwrap() - 65.122).abs() < 1e-9, "{sum}");
    }

    #[test]
    fn the_exposition_keeps_the_names_and_bounded_labels() {
        let stats = Arc::new(WorkerStats::default());
        WorkerStats::inc(&stats.received);
        WorkerStats::add(&stats.waiting, 3);
        WorkerStats::inc(&stats.rate_limited);
        WorkerStats::add(&stats.rate_limit_waiting, 2);
        stats.count_state("completed");
        for i in 0..100 {
            let kind = format!("kind-{i}");
            stats.metrics.count_outcome("completed", &kind, None);
            stats.metrics.set_learned(&kind, 1_500);
        }
        stats
            .metrics
            .count_outcome("rejected", "invalid", Some("format"));
        stats.metrics.count_outcome("no-such-state", "kind-0", None);
        (stats.metrics.prompt_tokens).fetch_add(7, Ordering::Relaxed);
        let text = exposition(WorkerCollector(stats));
        for line in [
            "# TYPE lastcall_worker_received_total counter",
            "lastcall_worker_received_total 1",
            "# TYPE lastcall_worker_jobs_waiting gauge",
            "lastcall_worker_jobs_waiting 3",
            "# TYPE lastcall_worker_rate_limited_total counter",
            "lastcall_worker_rate_limited_total 1",
            "# TYPE lastcall_worker_jobs_waiting_for_rate_limit gauge",
            "lastcall_worker_jobs_waiting_for_rate_limit 2",
            "lastcall_outcomes_total{state=\"completed\",kind=\"kind-0\",reason=\"\"} 1",
            "lastcall_outcomes_total{state=\"completed\",kind=\"other\",reason=\"\"} 68",
            "lastcall_outcomes_total{state=\"rejected\",kind=\"invalid\",reason=\"format\"} 1",
            "lastcall_outcomes_total{state=\"other\",kind=\"kind-0\",reason=\"\"} 1",
            "lastcall_learned_call_seconds{kind=\"other\"} 1.5",
            "lastcall_model_tokens_total{type=\"prompt\"} 7",
            "lastcall_model_tokens_total{type=\"completion\"} 0",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} in\n{text}");
        }
        let outcome_series = text
            .lines()
            .filter(|l| l.starts_with("lastcall_outcomes_total{"))
            .count();
        assert_eq!(outcome_series, 32 + 1 + 1 + 1, "{text}");
    }

    #[test]
    fn dead_letters_by_reason_and_the_processor_flags() {
        let d = Arc::new(DlqStats::default());
        d.by_reason.inc(vec!["expired".into()]);
        d.by_reason.inc(vec!["expired".into()]);
        d.connected.store(true, Ordering::Relaxed);
        let c = DlqCollector(d);
        let text = exposition(c.clone());
        for line in [
            "lastcall_dead_letters_total{reason=\"expired\"} 2",
            "lastcall_dlq_connected 1",
            "lastcall_dlq_reconnects_total 0",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} in\n{text}");
        }
        assert_eq!(c.readiness(), vec![("dead_letter_processor", true)]);
    }
}
