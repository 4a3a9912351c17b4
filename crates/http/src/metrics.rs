//! `/metrics`: one `prometheus-client` registry per process, encoded in the Prometheus text
//! format (0.0.4). The worker and the dead-letter processor register their own collectors
//! (`lastcall_worker::stats`), this crate registers the HTTP counters; the broker queue
//! depths and the ledger's counts are read at each scrape. `/readyz` asks the readiness
//! checks registered beside them. **Invariant:** every label value comes from a fixed,
//! bounded vocabulary; no job id is ever a label. Tenants are producers' names:
//! the door's counters label the first [`MAX_TENANT_LABELS`] tenants they see and count the
//! rest as `other`; the ledger's per-tenant gauges name the [`METRICS_TENANTS`] busiest of
//! the last hour and sum the rest as `other`.

use crate::depth::{DepthProbe, QueueDepth};
use lastcall_clock::Clock;
use lastcall_core::autoscale::{Demand, Plan, plan};
use lastcall_core::live::{FLEET_WINDOW_MS, fleet};
use lastcall_core::report::{TenantAccount, tenant_accounts};
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

/// The label of a per-tenant counter.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TenantLabels {
    pub tenant: String,
}

/// The labels of `lastcall_http_quota_refused_total`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct QuotaLabels {
    pub tenant: String,
    /// `jobs_per_second` or `tokens_per_minute`.
    pub quota: String,
}

/// How many tenants the door's counters name; later ones are `other`.
pub const MAX_TENANT_LABELS: usize = 32;
/// How many tenants the ledger's per-tenant gauges name (the busiest of the window).
pub const METRICS_TENANTS: usize = 20;
/// The window of the ledger's per-tenant gauges.
pub const TENANT_WINDOW_MS: i64 = 3_600_000;

/// The first [`MAX_TENANT_LABELS`] tenant names seen keep their name as a label.
#[derive(Debug, Default)]
pub struct TenantLabelSet {
    seen: std::sync::Mutex<std::collections::BTreeSet<String>>,
}

impl TenantLabelSet {
    pub fn label(&self, tenant: &str) -> String {
        let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        if seen.contains(tenant) {
            return tenant.to_owned();
        }
        if seen.len() < MAX_TENANT_LABELS {
            seen.insert(tenant.to_owned());
            return tenant.to_owned();
        }
        lastcall_core::report::OTHER_TENANTS.to_owned()
    }
}

/// HTTP responses of the ingress, by route and status (bounded). Clones share the
/// counters.
#[derive(Debug, Clone, Default)]
pub struct HttpStats {
    pub responses: Family<ResponseLabels, Counter>,
    /// Jobs accepted per tenant (bounded labels).
    pub tenant_accepted: Family<TenantLabels, Counter>,
    /// Jobs refused over a tenant's quota (`429 over_quota`, never published).
    pub quota_refused_total: Family<QuotaLabels, Counter>,
    tenant_labels: Arc<TenantLabelSet>,
    /// Jobs accepted (published, confirmed and recorded).
    pub accepted: Counter,
    /// Jobs shed at the door (`429 would_expire_in_queue`, `503 upstream_unavailable`):
    /// never published.
    pub shed: Counter,
    /// Ledger reads of `GET /v1/jobs/{id}` (a long-poll reads once, then once per wake).
    pub job_reads: Counter,
    /// Broker channels opened for streaming chat requests (each taken after the request's
    /// wait and stream permits: a refused stream opens none).
    pub stream_channels_opened: Counter,
    /// When each tenant (bounded labels) was last refused over quota: the latest
    /// [`RECENT_REFUSALS`] instants, for the dashboard's alert.
    recent_quota_refusals: Arc<std::sync::Mutex<RecentRefusals>>,
}

/// How many recent quota refusals are remembered per tenant.
pub const RECENT_REFUSALS: usize = 64;

type RecentRefusals =
    std::collections::BTreeMap<String, std::collections::VecDeque<std::time::Instant>>;

impl HttpStats {
    /// Count a job of `tenant` accepted.
    pub fn accepted_for(&self, tenant: &str) {
        let tenant = self.tenant_labels.label(tenant);
        self.tenant_accepted
            .get_or_create(&TenantLabels { tenant })
            .inc();
    }

    /// Count a job of `tenant` refused over `quota`.
    pub fn quota_refused(&self, tenant: &str, quota: &str) {
        let tenant = self.tenant_labels.label(tenant);
        {
            let mut recent = (self.recent_quota_refusals.lock()).unwrap_or_else(|p| p.into_inner());
            let times = recent.entry(tenant.clone()).or_default();
            if times.len() == RECENT_REFUSALS {
                times.pop_front();
            }
            times.push_back(std::time::Instant::now());
        }
        self.quota_refused_total
            .get_or_create(&QuotaLabels {
                tenant,
                quota: quota.to_owned(),
            })
            .inc();
    }

    /// The tenants refused over quota within `window`, with how many refusals (at most
    /// [`RECENT_REFUSALS`] each), by name.
    pub fn recently_over_quota(&self, window: std::time::Duration) -> Vec<(String, u64)> {
        let recent = (self.recent_quota_refusals.lock()).unwrap_or_else(|p| p.into_inner());
        recent
            .iter()
            .map(|(t, times)| {
                let n = times.iter().filter(|at| at.elapsed() <= window).count();
                (t.clone(), n as u64)
            })
            .filter(|(_, n)| *n > 0)
            .collect()
    }

    fn register(&self, r: &mut Registry) {
        r.register(
            "lastcall_http_tenant_accepted",
            "Jobs accepted over HTTP per tenant (the first 32 tenants seen, the rest as `other`)",
            self.tenant_accepted.clone(),
        );
        r.register(
            "lastcall_http_quota_refused",
            "Jobs refused at the door over a quota of their tenant (429 over_quota, never published), by tenant and quota",
            self.quota_refused_total.clone(),
        );
        r.register(
            "lastcall_http_accepted",
            "Jobs accepted over HTTP (published with confirm and recorded)",
            self.accepted.clone(),
        );
        r.register(
            "lastcall_http_shed",
            "Jobs refused at the door because they would expire before a worker could finish them (429 would_expire_in_queue) or their model server is down for every worker (503 upstream_unavailable); never published",
            self.shed.clone(),
        );
        r.register(
            "lastcall_http_job_reads",
            "Ledger reads of GET /v1/jobs/{id}; a long-poll reads once, then once per outcome event of its job (never while it waits)",
            self.job_reads.clone(),
        );
        r.register(
            "lastcall_http_stream_channels_opened",
            "Broker channels opened for streaming chat requests (one per stream admitted under --max-streams; a refused stream opens none)",
            self.stream_channels_opened.clone(),
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
    /// With the ledger: the per-tenant gauges over the last [`TENANT_WINDOW_MS`] before now.
    clock: Option<Arc<dyn Clock>>,
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

    /// With [`with_ledger`](Self::with_ledger): the per-tenant gauges (the window ends now).
    pub fn with_clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = Some(clock);
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
            if let Some(clock) = &self.clock {
                scraped.autoscale = autoscale_plan(l, clock.now_ms()).await;
                match l.tenant_counts(clock.now_ms() - TENANT_WINDOW_MS).await {
                    Ok(groups) => {
                        scraped.tenants = Some(tenant_accounts(&groups, METRICS_TENANTS));
                    }
                    Err(e) => tracing::warn!(error = %e, "metrics: cannot count per tenant"),
                }
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
    tenants: Option<Vec<TenantAccount>>,
    autoscale: Option<Plan>,
}

/// The window of the autoscaling gauges.
pub const AUTOSCALE_WINDOW_MS: i64 = 60_000;

/// The autoscaling gauges' numbers at `now`: the outcomes of the last
/// [`AUTOSCALE_WINDOW_MS`] and the fleet's fresh leases
/// ([`lastcall_core::autoscale::plan`]).
async fn autoscale_plan(l: &Ledger, now: i64) -> Option<Plan> {
    let samples = match l.tenant_counts(now - AUTOSCALE_WINDOW_MS).await {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!(error = %e, "metrics: cannot count the last minute's outcomes");
            return None;
        }
    };
    let mut d = Demand {
        window_ms: AUTOSCALE_WINDOW_MS as u64,
        ..Demand::default()
    };
    for s in &samples {
        d.outcomes += s.jobs;
        if s.state == lastcall_core::State::Completed.as_str() {
            d.completed += s.jobs;
            d.useful_model_ms += s.model_ms.saturating_sub(s.wasted_model_ms);
        }
    }
    let leases = match l.worker_leases(now - FLEET_WINDOW_MS).await {
        Ok(leases) => leases,
        Err(e) => {
            tracing::warn!(error = %e, "metrics: cannot read the worker leases");
            return None;
        }
    };
    let f = fleet(&leases, now);
    plan(&d, f.limit, f.learned_call_ms.values().max().copied())
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
        if let Some(p) = &self.autoscale {
            let g = ConstGauge::new(p.slots_needed);
            g.encode(enc.encode_descriptor(
                "lastcall_autoscale_slots_needed",
                "Model slots the last minute's arrivals keep busy: arrivals per second × the mean call time (Little's law; the minimum at full use, with no room for bursts)",
                None,
                g.metric_type(),
            )?)?;
            if let Some(n) = p.slots {
                let g = ConstGauge::new(n);
                g.encode(enc.encode_descriptor(
                    "lastcall_autoscale_slots",
                    "Model slots of the fleet: the concurrency limits of the workers with a fresh lease",
                    None,
                    g.metric_type(),
                )?)?;
            }
            if let Some(share) = p.on_time_share {
                let g = ConstGauge::new(share);
                g.encode(enc.encode_descriptor(
                    "lastcall_autoscale_predicted_on_time_share",
                    "The share of arrivals the fleet's slots can serve in the next minute if the last minute's arrivals and call times go on: slots ÷ slots needed, at most 1",
                    None,
                    g.metric_type(),
                )?)?;
            }
        }
        if let Some(tenants) = &self.tenants {
            let mut family = enc.encode_descriptor(
                "lastcall_tenant_on_time_last_hour",
                "Jobs completed before their deadline in the last hour, per tenant (the 20 busiest, the rest as `other`)",
                None,
                MetricType::Gauge,
            )?;
            for t in tenants {
                ConstGauge::new(t.on_time as i64)
                    .encode(family.encode_family(&[("tenant", t.tenant.as_str())])?)?;
            }
            let mut family = enc.encode_descriptor(
                "lastcall_tenant_not_on_time_last_hour",
                "Jobs that ended otherwise in the last hour, per tenant, state and reason (refusals are expired_not_started, expired_before_receive and rejected)",
                None,
                MetricType::Gauge,
            )?;
            for t in tenants {
                for c in &t.not_on_time {
                    let (state, reason) = c.key.split_once('/').unwrap_or((c.key.as_str(), ""));
                    let labels = [
                        ("tenant", t.tenant.as_str()),
                        ("state", state),
                        ("reason", reason),
                    ];
                    ConstGauge::new(c.count as i64).encode(family.encode_family(&labels)?)?;
                }
            }
            let mut family = enc.encode_descriptor(
                "lastcall_tenant_model_seconds_last_hour",
                "Model time of the calls recorded in the last hour, per tenant; `use` is `wasted` for calls that did not complete (cut at the deadline, failed, retried after a failure, cancelled), else `useful`",
                None,
                MetricType::Gauge,
            )?;
            for t in tenants {
                let wasted = t.wasted_model_ms as f64 / 1000.0;
                let useful = t.model_ms.saturating_sub(t.wasted_model_ms) as f64 / 1000.0;
                for (use_, v) in [("useful", useful), ("wasted", wasted)] {
                    let labels = [("tenant", t.tenant.as_str()), ("use", use_)];
                    ConstGauge::new(v).encode(family.encode_family(&labels)?)?;
                }
            }
            let mut family = enc.encode_descriptor(
                "lastcall_tenant_tokens_last_hour",
                "Tokens of the calls recorded in the last hour, per tenant and type (prompt, completion)",
                None,
                MetricType::Gauge,
            )?;
            for t in tenants {
                for (ty, v) in [
                    ("prompt", t.prompt_tokens),
                    ("completion", t.completion_tokens),
                ] {
                    let labels = [("tenant", t.tenant.as_str()), ("type", ty)];
                    ConstGauge::new(v as i64).encode(family.encode_family(&labels)?)?;
                }
            }
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
