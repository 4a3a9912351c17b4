//! The Prometheus text format, rendered by hand (no metrics crate): worker counters,
//! gauges and histograms, dead letters by reason, broker queue depths, ledger state
//! counts and HTTP responses. **Invariant:** every label value comes from a fixed,
//! bounded vocabulary; no job id is ever a label.

use crate::depth::{DepthProbe, QueueDepth};
use lastcall_store::Ledger;
use lastcall_worker::WorkerStats;
use lastcall_worker::dlq::DlqStats;
use lastcall_worker::stats::{HistogramSnapshot, LabeledCounter};
use std::fmt::Write;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// HTTP responses of the ingress, by route and status class (bounded).
#[derive(Debug, Default)]
pub struct HttpStats {
    /// Labels `[route, status]`; routes are the router's fixed patterns.
    pub responses: LabeledCounter,
    /// Jobs accepted (published, confirmed and recorded).
    pub accepted: AtomicU64,
    /// Jobs shed at the door (`429 would_expire_in_queue`): never published.
    pub shed: AtomicU64,
    /// Ledger reads of `GET /v1/jobs/{id}` (a long-poll reads once, then once per wake).
    pub job_reads: AtomicU64,
}

/// What one `/metrics` scrape renders. Every part is optional.
#[derive(Debug, Clone, Default)]
pub struct MetricsSource {
    pub worker: Option<Arc<WorkerStats>>,
    pub dlq: Option<Arc<DlqStats>>,
    pub depth: Option<DepthProbe>,
    pub ledger: Option<Arc<Ledger>>,
    pub http: Option<Arc<HttpStats>>,
}

impl MetricsSource {
    /// The whole exposition.
    pub async fn render(&self) -> String {
        let mut out = String::new();
        if let Some(w) = &self.worker {
            render_worker(w, &mut out);
        }
        if let Some(d) = &self.dlq {
            family(
                &mut out,
                "lastcall_dead_letters_total",
                "counter",
                "Dead letters processed, by broker reason",
            );
            for (labels, v) in d.by_reason.snapshot() {
                sample(
                    &mut out,
                    "lastcall_dead_letters_total",
                    &[("reason", &labels[0])],
                    v,
                );
            }
            family(
                &mut out,
                "lastcall_dlq_connected",
                "gauge",
                "1 while the dead-letter processor consumes on a live connection",
            );
            sample(
                &mut out,
                "lastcall_dlq_connected",
                &[],
                i64::from(d.connected.load(Ordering::Relaxed)),
            );
            family(
                &mut out,
                "lastcall_dlq_reconnects_total",
                "counter",
                "Broker connections the dead-letter processor lost and re-established",
            );
            sample(
                &mut out,
                "lastcall_dlq_reconnects_total",
                &[],
                d.reconnects.load(Ordering::Relaxed),
            );
        }
        if let Some(p) = &self.depth {
            render_depths(&p.depths().await, &mut out);
        }
        if let Some(l) = &self.ledger {
            match l.counts_by_state().await {
                Ok(counts) => {
                    family(
                        &mut out,
                        "lastcall_ledger_jobs",
                        "gauge",
                        "Jobs in the ledger by state",
                    );
                    for s in lastcall_core::State::ALL {
                        let n = counts
                            .iter()
                            .find(|(st, _)| st == s.as_str())
                            .map(|(_, n)| *n)
                            .unwrap_or(0);
                        sample(
                            &mut out,
                            "lastcall_ledger_jobs",
                            &[("state", s.as_str())],
                            n,
                        );
                    }
                }
                Err(e) => tracing::warn!(error = %e, "metrics: cannot count ledger states"),
            }
            match l.late_outcomes().await {
                Ok(n) => {
                    family(
                        &mut out,
                        "lastcall_ledger_late_outcomes",
                        "gauge",
                        "Jobs marked unknown by reconciliation whose real outcome was recorded later",
                    );
                    sample(&mut out, "lastcall_ledger_late_outcomes", &[], n);
                }
                Err(e) => tracing::warn!(error = %e, "metrics: cannot count late outcomes"),
            }
        }
        if let Some(h) = &self.http {
            family(
                &mut out,
                "lastcall_http_accepted_total",
                "counter",
                "Jobs accepted over HTTP (published with confirm and recorded)",
            );
            sample(
                &mut out,
                "lastcall_http_accepted_total",
                &[],
                h.accepted.load(Ordering::Relaxed),
            );
            family(
                &mut out,
                "lastcall_http_shed_total",
                "counter",
                "Jobs refused at the door because the estimated queue wait would make them expire (429, never published)",
            );
            sample(
                &mut out,
                "lastcall_http_shed_total",
                &[],
                h.shed.load(Ordering::Relaxed),
            );
            family(
                &mut out,
                "lastcall_http_job_reads_total",
                "counter",
                "Ledger reads of GET /v1/jobs/{id}; a long-poll reads once, then once per outcome event of its job (never while it waits)",
            );
            sample(
                &mut out,
                "lastcall_http_job_reads_total",
                &[],
                h.job_reads.load(Ordering::Relaxed),
            );
            family(
                &mut out,
                "lastcall_http_responses_total",
                "counter",
                "HTTP responses by route and status",
            );
            for (labels, v) in h.responses.snapshot() {
                sample(
                    &mut out,
                    "lastcall_http_responses_total",
                    &[("route", &labels[0]), ("status", &labels[1])],
                    v,
                );
            }
        }
        out
    }
}

fn render_worker(w: &WorkerStats, out: &mut String) {
    let counters: [(&str, &AtomicU64, &str); 8] = [
        (
            "lastcall_worker_reconnects_total",
            &w.reconnects,
            "Broker connections lost and re-established",
        ),
        (
            "lastcall_worker_received_total",
            &w.received,
            "Deliveries received from the broker",
        ),
        (
            "lastcall_worker_backend_calls_total",
            &w.backend_calls,
            "Model calls started",
        ),
        (
            "lastcall_worker_retries_total",
            &w.retries,
            "Retries published to a retry queue",
        ),
        (
            "lastcall_worker_duplicates_total",
            &w.duplicates,
            "Redeliveries acked without running (outcome already recorded)",
        ),
        (
            "lastcall_worker_store_retries_total",
            &w.store_retries,
            "Ledger writes that failed and were retried",
        ),
        (
            "lastcall_worker_settled_total",
            &w.settled,
            "Deliveries acked or rejected after the durable write",
        ),
        (
            "lastcall_worker_rejected_total",
            &w.rejected,
            "Invalid envelopes recorded as rejected",
        ),
    ];
    for (name, c, help) in counters {
        family(out, name, "counter", help);
        sample(out, name, &[], WorkerStats::get(c));
    }
    let m = &w.metrics;
    let (busy, total) = m.slots().unwrap_or((0, 0));
    let gauges: [(&str, i64, &str); 8] = [
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
            "Model slots configured",
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
        family(out, name, "gauge", help);
        sample(out, name, &[], v);
    }
    family(
        out,
        "lastcall_outcomes_total",
        "counter",
        "Terminal outcomes recorded by this worker, by state, kind and reason",
    );
    for (l, v) in m.outcomes.snapshot() {
        sample(
            out,
            "lastcall_outcomes_total",
            &[("state", &l[0]), ("kind", &l[1]), ("reason", &l[2])],
            v,
        );
    }
    family(
        out,
        "lastcall_learned_call_seconds",
        "gauge",
        "Learned model call duration by kind (the high quantile the admission rule uses as the minimum useful runtime)",
    );
    for (kind, ms) in m.learned() {
        sample(
            out,
            "lastcall_learned_call_seconds",
            &[("kind", &kind)],
            ms as f64 / 1000.0,
        );
    }
    family(
        out,
        "lastcall_model_tokens_total",
        "counter",
        "Tokens reported by the model backends, by type",
    );
    for (ty, c) in [
        ("prompt", &m.prompt_tokens),
        ("completion", &m.completion_tokens),
    ] {
        sample(
            out,
            "lastcall_model_tokens_total",
            &[("type", ty)],
            c.load(Ordering::Relaxed),
        );
    }
    histogram(
        out,
        "lastcall_queue_dwell_seconds",
        "Publish to receipt by a worker",
        &m.queue_dwell.snapshot(),
    );
    histogram(
        out,
        "lastcall_consumer_dwell_seconds",
        "Receipt to the last admission check (waiting locally)",
        &m.consumer_dwell.snapshot(),
    );
    histogram(
        out,
        "lastcall_model_call_seconds",
        "Model call duration",
        &m.model_call.snapshot(),
    );
    histogram(
        out,
        "lastcall_remaining_budget_at_admission_seconds",
        "Budget left when a job was admitted",
        &m.remaining_budget.snapshot(),
    );
}

fn render_depths(depths: &[QueueDepth], out: &mut String) {
    family(
        out,
        "lastcall_broker_queue_messages",
        "gauge",
        "Messages in a broker queue: ready (waiting in the broker) or unacked (delivered to a consumer)",
    );
    for d in depths {
        if let Some(r) = d.ready {
            sample(
                out,
                "lastcall_broker_queue_messages",
                &[("queue", &d.queue), ("state", "ready")],
                r,
            );
        }
        if let Some(u) = d.unacked {
            sample(
                out,
                "lastcall_broker_queue_messages",
                &[("queue", &d.queue), ("state", "unacked")],
                u,
            );
        }
    }
    family(
        out,
        "lastcall_broker_queue_consumers",
        "gauge",
        "Consumers of a broker queue",
    );
    for d in depths {
        if let Some(c) = d.consumers {
            sample(
                out,
                "lastcall_broker_queue_consumers",
                &[("queue", &d.queue)],
                c,
            );
        }
    }
}

fn family(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
}

fn sample(out: &mut String, name: &str, labels: &[(&str, &str)], v: impl std::fmt::Display) {
    out.push_str(name);
    if !labels.is_empty() {
        out.push('{');
        for (i, (k, val)) in labels.iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            let _ = write!(out, "{k}=\"{}\"", escape(val));
        }
        out.push('}');
    }
    let _ = writeln!(out, " {v}");
}

fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

fn histogram(out: &mut String, name: &str, help: &str, h: &HistogramSnapshot) {
    family(out, name, "histogram", help);
    let bucket = format!("{name}_bucket");
    for (b, c) in h.bounds_ms.iter().zip(&h.cumulative) {
        let le = format!("{}", *b as f64 / 1000.0);
        sample(out, &bucket, &[("le", &le)], c);
    }
    sample(out, &bucket, &[("le", "+Inf")], h.count);
    sample(out, &format!("{name}_sum"), &[], h.sum_ms as f64 / 1000.0);
    sample(out, &format!("{name}_count"), &[], h.count);
}

/// The value of one sample line `name{labels} value` in an exposition (for tests and the
/// dashboard's scrape of worker endpoints). `labels` must match the rendered text exactly.
pub fn sample_value(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| {
        let rest = l.strip_prefix(series)?;
        rest.strip_prefix(' ')?.trim().parse().ok()
    })
}
