//! `/metrics`: one `prometheus-client` registry per process, encoded in the Prometheus text
//! format (0.0.4). The worker and the dead-letter processor register their own collectors
//! (`lastcall_worker::stats`), this crate registers the HTTP counters; the broker queue
//! depths and the ledger's counts are read at each scrape. `/readyz` asks the readiness
//! checks registered beside them. **Invariant:** every label value comes from a fixed,
//! bounded vocabulary; no job id is ever a label.

use crate::depth::{DepthProbe, QueueDepth};
use lastcall_store::Ledger;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::prometheus_text::encode;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;
use std::sync::Arc;

/// The labels of `lastcall_http_responses_total`: the router's matched pattern (bounded)
/// and the status code.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResponseLabels {
    pub route: String,
    pub status: u16,
}

/// HTTP responses of the ingress, by route and status (bounded). Clones share the
/// counters.
#[derive(Debug, Clone, Default)]
pub struct HttpStats {
    pub responses: Family<ResponseLabels, Counter>,
    /// Jobs accepted (published, confirmed and recorded).
    pub accepted: Counter,
    /// Jobs shed at the door (`429 would_expire_in_queue`): never published.
    pub shed: Counter,
    /// Ledger reads of `GET /v1/jobs/{id}` (a long-poll reads once, then once per wake).
    pub job_reads: Counter,
}

impl HttpStats {
    fn register(&self, r: &mut Registry) {
        r.register(
            "lastcall_http_accepted",
            "Jobs accepted over HTTP (published with confirm and recorded)",
            self.accepted.clone(),
        );
        r.register(
            "lastcall_http_shed",
            "Jobs refused at the door because the estimated queue wait would make them expire (429, never published)",
            self.shed.clone(),
        );
        r.register(
            "lastcall_http_job_reads",
            "Ledger reads of GET /v1/jobs/{id}; a long-poll reads once, then once per outcome event of its job (never while it waits)",
            self.job_reads.clone(),
        );
        r.register(
            "lastcall_http_responses",
            "HTTP responses by route and status",
            self.responses.clone(),
        );
    }
}

/// A readiness check: `(name, ok)` pairs read at each `/readyz`.
type ReadyCheck = Box<dyn Fn() -> Vec<(&'static str, bool)> + Send + Sync>;
/// The model servers' breaker states (`/readyz`'s `backends`).
type BackendsCheck = Box<dyn Fn() -> std::collections::BTreeMap<String, String> + Send + Sync>;

/// What `/metrics` renders and `/readyz` checks: this process's registry, its readiness
/// checks, and the parts read at each scrape (queue depths, ledger counts). Every part is
/// optional; build it with the `with_*` methods.
#[derive(Default)]
pub struct MetricsSource {
    registry: Registry,
    checks: Vec<ReadyCheck>,
    backends: Vec<BackendsCheck>,
    /// Broker queue depths, read at each scrape.
    pub depth: Option<DepthProbe>,
    /// Jobs by state and late outcomes, counted at each scrape.
    pub ledger: Option<Arc<Ledger>>,
}

impl std::fmt::Debug for MetricsSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MetricsSource")
            .field("registry", &self.registry)
            .field("checks", &self.checks.len())
            .field("depth", &self.depth)
            .finish_non_exhaustive()
    }
}

impl MetricsSource {
    /// A component's metrics (e.g. `lastcall_worker::stats::WorkerCollector`), encoded at
    /// each scrape.
    pub fn with_collector(mut self, c: impl Collector) -> Self {
        self.registry.register_collector(Box::new(c));
        self
    }

    /// A component's readiness checks (e.g. `WorkerStats::readiness`), read at each
    /// `/readyz`.
    pub fn with_ready(
        mut self,
        check: impl Fn() -> Vec<(&'static str, bool)> + Send + Sync + 'static,
    ) -> Self {
        self.checks.push(Box::new(check));
        self
    }

    /// A worker's model servers by circuit breaker state (e.g. `WorkerStats::backends`),
    /// read at each `/readyz` (its `backends` field; degraded, never a failed check).
    pub fn with_backends(
        mut self,
        f: impl Fn() -> std::collections::BTreeMap<String, String> + Send + Sync + 'static,
    ) -> Self {
        self.backends.push(Box::new(f));
        self
    }

    /// Every registered component's model servers by breaker state.
    pub fn backends(&self) -> std::collections::BTreeMap<String, String> {
        self.backends.iter().flat_map(|f| f()).collect()
    }

    /// The HTTP ingress counters.
    pub fn with_http(mut self, http: &HttpStats) -> Self {
        http.register(&mut self.registry);
        self
    }

    pub fn with_ledger(mut self, ledger: Arc<Ledger>) -> Self {
        self.ledger = Some(ledger);
        self
    }

    pub fn with_depth(mut self, depth: DepthProbe) -> Self {
        self.depth = Some(depth);
        self
    }

    /// The readiness checks of every registered component.
    pub fn checks(&self) -> Vec<(&'static str, bool)> {
        self.checks.iter().flat_map(|c| c()).collect()
    }

    /// The whole exposition.
    pub async fn render(&self) -> String {
        self.render_with(self.depth.as_ref()).await
    }

    /// The exposition with the queue depths of `depth` (`serve` shares its probe with the
    /// dashboard).
    pub async fn render_with(&self, depth: Option<&DepthProbe>) -> String {
        let mut scraped = Scraped::default();
        if let Some(p) = depth {
            scraped.depths = Some(p.depths().await);
        }
        if let Some(l) = &self.ledger {
            match l.counts_by_state().await {
                Ok(counts) => scraped.ledger_jobs = Some(counts),
                Err(e) => tracing::warn!(error = %e, "metrics: cannot count ledger states"),
            }
            match l.late_outcomes().await {
                Ok(n) => scraped.late_outcomes = Some(n),
                Err(e) => tracing::warn!(error = %e, "metrics: cannot count late outcomes"),
            }
        }
        let mut now = Registry::default();
        now.register_collector(Box::new(scraped));
        let mut out = String::new();
        // Writing to a String cannot fail; a collector's error would only cut the text.
        if let Err(e) = encode(&mut out, &self.registry).and_then(|()| encode(&mut out, &now)) {
            tracing::warn!(error = %e, "metrics: encoding failed");
        }
        out
    }
}

/// What one scrape read from the broker and the ledger.
#[derive(Debug, Default)]
struct Scraped {
    depths: Option<Vec<QueueDepth>>,
    ledger_jobs: Option<Vec<(String, i64)>>,
    late_outcomes: Option<i64>,
}

impl Collector for Scraped {
    fn encode(&self, mut enc: DescriptorEncoder) -> std::fmt::Result {
        if let Some(depths) = &self.depths {
            let mut family = enc.encode_descriptor(
                "lastcall_broker_queue_messages",
                "Messages in a broker queue: ready (waiting in the broker) or unacked (delivered to a consumer)",
                None,
                MetricType::Gauge,
            )?;
            for d in depths {
                for (state, n) in [("ready", d.ready), ("unacked", d.unacked)] {
                    if let Some(n) = n {
                        let labels = [("queue", d.queue.as_str()), ("state", state)];
                        ConstGauge::new(n as i64).encode(family.encode_family(&labels)?)?;
                    }
                }
            }
            let mut family = enc.encode_descriptor(
                "lastcall_broker_queue_consumers",
                "Consumers of a broker queue",
                None,
                MetricType::Gauge,
            )?;
            for d in depths {
                if let Some(c) = d.consumers {
                    let labels = [("queue", d.queue.as_str())];
                    ConstGauge::new(c as i64).encode(family.encode_family(&labels)?)?;
                }
            }
        }
        if let Some(counts) = &self.ledger_jobs {
            let mut family = enc.encode_descriptor(
                "lastcall_ledger_jobs",
                "Jobs in the ledger by state",
                None,
                MetricType::Gauge,
            )?;
            for s in lastcall_core::State::ALL {
                let n = counts
                    .iter()
                    .find(|(st, _)| st == s.as_str())
                    .map(|(_, n)| *n)
                    .unwrap_or(0);
                ConstGauge::new(n).encode(family.encode_family(&[("state", s.as_str())])?)?;
            }
        }
        if let Some(n) = self.late_outcomes {
            let g = ConstGauge::new(n);
            g.encode(enc.encode_descriptor(
                "lastcall_ledger_late_outcomes",
                "Jobs marked unknown by reconciliation whose real outcome was recorded later",
                None,
                g.metric_type(),
            )?)?;
        }
        Ok(())
    }
}

/// The value of one sample line `name{labels} value` in an exposition (for tests and the
/// dashboard's scrape of worker endpoints). `labels` must match the rendered text exactly.
pub fn sample_value(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| {
        let rest = l.strip_prefix(series)?;
        rest.strip_prefix(' ')?.trim().parse().ok()
    })
}
