//! The live dashboard: a page (`assets/dashboard.html`, no CDN; its first state rendered
//! by the server) and the JSON it polls, `GET /v1/dashboard`: the headline (on
//! time ÷ arrivals, refused without a call, wasted model time, p99 queue dwell, each with
//! its trend; `Ledger::headline`, the same as `lastcall report`'s), where work waits right
//! now (the workers publish their live numbers through their lease), the workers, alerts,
//! outcomes per minute, dwell histograms, dead letters by reason, and per tenant (the busiest ten, the
//! rest as `other`): on time, refused, the other outcomes by reason, model time (wasted)
//! and tokens.

use crate::AppState;
use crate::error::ApiError;
use crate::metrics::sample_value;
use crate::params::QueryParams;
use axum::Json;
use axum::extract::State;
use axum::response::Html;
use lastcall_core::State as JobState;
use lastcall_core::alerts::{ALERT_WINDOW_MS, AlertInput, alerts};
use lastcall_core::live::{FLEET_WINDOW_MS, fleet};
use lastcall_core::report::{TenantSample, tenant_accounts};
use lastcall_store::{DashboardCounts, JobRecord, PRUNABLE_COUNT_LIMIT};
use serde_json::{Map, Value, json};
use std::collections::BTreeMap;
use std::sync::Arc;

/// Upper bounds (ms) of the dashboard's dwell histograms, the same as the worker's
/// `lastcall_*_dwell_seconds` buckets (`crates/http/tests/metrics.rs` checks).
pub const DWELL_BUCKETS_MS: &[u64] = lastcall_store::DWELL_BUCKETS_MS;

/// The page, behind the same auth as the API: a browser answers the `Basic` challenge of
/// the `401` (any user name, the token as password) and the page's same-origin polls of the
/// JSON carry the cached credentials. Its first state is rendered here: the
/// headline and live tiles carry their numbers in the HTML, and the whole snapshot is
/// embedded for the script's first render, so the first paint shows numbers, not dashes.
#[utoipa::path(
    get,
    path = "/",
    operation_id = "dashboardPage",
    summary = "The live dashboard page (its first state rendered by the server; its same-origin requests carry the browser's cached Basic credentials)",
    description = "",
    params(crate::openapi::DashboardParams),
    responses(
        (status = 200, description = "HTML", body = String, content_type = "text/html"),
        (status = 400, description = "`minutes` is not an integer from 1 to 1440, or is given more than once; `field` names it", body = crate::openapi::ErrorBody),
        (status = 401, response = crate::openapi::Unauthorized),
    ),
)]
pub async fn page(
    State(state): State<Arc<AppState>>,
    q: QueryParams,
) -> Result<Html<String>, ApiError> {
    let minutes = q.integer("minutes", 1..=1440)?.unwrap_or(15);
    // A ledger that cannot be read still gets the page: its script reports the error.
    let snap = snapshot(&state, minutes).await.ok();
    Ok(Html(render_page(snap.as_ref())))
}

const PAGE: &str = include_str!("../assets/dashboard.html");

/// The page with its first state: each `{{name}}` placeholder replaced by its text (see
/// [`first_paint`]), and the snapshot as JSON in `<script id="initial">`.
pub fn render_page(snap: Option<&Value>) -> String {
    let mut html = PAGE.to_owned();
    for (name, text) in first_paint(snap) {
        html = html.replace(&format!("{{{{{name}}}}}"), &escape_html(&text));
    }
    // JSON inside a script element: no `<` may end it early.
    let json = snap
        .map(|v| v.to_string())
        .unwrap_or_else(|| "null".into())
        .replace('<', "\\u003c")
        .replace('>', "\\u003e")
        .replace('&', "\\u0026");
    html.replace("/*INITIAL*/null", &json)
}

fn escape_html(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// The texts of the server-rendered tiles, by placeholder name. The page's script formats
/// the same fields the same way (`fmt*` in `assets/dashboard.html`).
pub fn first_paint(snap: Option<&Value>) -> Vec<(String, String)> {
    let dash = || "–".to_owned();
    let h = snap.and_then(|s| s.get("headline"));
    let num = |v: Option<&Value>| v.and_then(Value::as_u64);
    let field = |k: &str| num(h.and_then(|h| h.get(k)));
    let mut out = vec![
        (
            "h-on_time".into(),
            h.and_then(|h| h.get("on_time_pct"))
                .and_then(Value::as_f64)
                .map_or_else(dash, fmt_pct),
        ),
        (
            "h-refused".into(),
            field("refused").map_or_else(dash, |n| n.to_string()),
        ),
        (
            "h-wasted".into(),
            field("wasted_model_ms").map_or_else(dash, fmt_secs),
        ),
        (
            "h-dwell".into(),
            match (
                field("queue_dwell_p99_ms"),
                h.and_then(|h| h.get("queue_dwell_p99_over")),
            ) {
                (Some(ms), Some(Value::Bool(true))) => format!("> {}", fmt_ms(ms)),
                (Some(ms), _) => format!("≤ {}", fmt_ms(ms)),
                (None, _) => dash(),
            },
        ),
        (
            "h-arrivals".into(),
            match (field("on_time"), field("arrivals"), field("pending")) {
                (Some(o), Some(a), Some(p)) => format!("{o} of {a} arrivals ({p} not ended)"),
                _ => String::new(),
            },
        ),
    ];
    let w = snap.and_then(|s| s.get("waiting"));
    for k in [
        "broker_ready",
        "broker_unacked",
        "waiting_for_slot",
        "running",
        "concurrency_limit",
    ] {
        let v = w.and_then(|w| w.get(k));
        let text = match v {
            Some(Value::Null) => "n/a".to_owned(),
            Some(v) => v.to_string(),
            None => dash(),
        };
        out.push((format!("wait-{k}"), text));
    }
    out
}

/// `87.5%`.
pub fn fmt_pct(p: f64) -> String {
    format!("{p:.1}%")
}

/// Model time: `12.3 s`.
pub fn fmt_secs(ms: u64) -> String {
    format!("{:.1} s", ms as f64 / 1000.0)
}

/// A dwell bound: `250 ms`, `2.5 s`.
pub fn fmt_ms(ms: u64) -> String {
    if ms >= 1000 {
        format!("{} s", ms as f64 / 1000.0)
    } else {
        format!("{ms} ms")
    }
}

/// `GET /v1/dashboard?minutes=15` (1–1440, at most once).
#[utoipa::path(
    get,
    path = "/v1/dashboard",
    operation_id = "dashboard",
    summary = "The JSON the dashboard polls",
    description = "",
    params(crate::openapi::DashboardParams),
    responses(
        (status = 200, description = "The headline (on time, refused, wasted model time, p99 queue dwell, with their trend), where work waits (from the workers' leases), the workers, alerts, outcomes, dwell histograms, dead letters", body = Object),
        (status = 400, description = "`minutes` is not an integer from 1 to 1440, or is given more than once; `field` names it", body = crate::openapi::ErrorBody),
        (status = 401, response = crate::openapi::Unauthorized),
        (status = 500, response = crate::openapi::LedgerError),
    ),
)]
pub async fn data(
    State(state): State<Arc<AppState>>,
    q: QueryParams,
) -> Result<Json<Value>, ApiError> {
    let minutes = q.integer("minutes", 1..=1440)?.unwrap_or(15);
    Ok(Json(snapshot(&state, minutes).await?))
}

fn internal(e: impl std::fmt::Display) -> ApiError {
    ApiError::Internal(e.to_string())
}

/// Everything the dashboard shows for a window of `minutes` ending now.
pub async fn snapshot(state: &AppState, minutes: i64) -> Result<Value, ApiError> {
    let now = state.clock.now_ms();
    let since = now - minutes * 60_000;
    // Counts aggregated by the database (bounded rows, no job's text): polled every 5 s.
    let window = state
        .ledger
        .dashboard_counts(since)
        .await
        .map_err(internal)?;
    let counts = state.ledger.counts_by_state().await.map_err(internal)?;
    let headline = state
        .ledger
        .headline(since, now, None)
        .await
        .map_err(internal)?;
    let leases = state
        .ledger
        .worker_leases(now - FLEET_WINDOW_MS)
        .await
        .map_err(internal)?;
    let fleet = fleet(&leases, now);
    let depths = match &state.depth {
        Some(p) => p.depths().await,
        None => Vec::new(),
    };
    let work = depths.iter().find(|d| d.queue == state.names.work_queue);
    let dead = depths.iter().find(|d| d.queue == state.names.dead_queue);
    // The workers' own numbers, from their leases; `--worker-metrics` URLs override.
    let (waiting, running, limit, live_source) = if state.worker_metrics.is_empty() {
        (fleet.waiting, fleet.running, fleet.limit, "leases")
    } else {
        let (w, r, l) = scrape_workers(state).await;
        (w, r, l, "worker_metrics")
    };
    let ledger_count = |s: &str| {
        counts
            .iter()
            .find(|(st, _)| st == s)
            .map(|(_, n)| *n)
            .unwrap_or(0)
    };
    let alert_input = AlertInput {
        dead_queue: dead.map(|d| (d.queue.clone(), d.ready, d.consumers)),
        breakers: state
            .ledger
            .open_breakers(now, lastcall_core::lease::fresh_since(now))
            .await
            .map_err(internal)?,
        over_quota: state
            .http_stats
            .recently_over_quota(std::time::Duration::from_millis(ALERT_WINDOW_MS as u64)),
        kinds: state
            .ledger
            .kind_outcomes(now - ALERT_WINDOW_MS)
            .await
            .map_err(internal)?,
        retention: match state.retention_ms {
            Some(r) => Some((
                r,
                state
                    .ledger
                    .prunable_rows(now.saturating_sub(r), PRUNABLE_COUNT_LIMIT)
                    .await
                    .map_err(internal)?,
            )),
            None => None,
        },
    };
    let mut summary = summarize_counts(&window, since, now);
    summary.insert("headline".into(), json!(headline));
    summary.insert(
        "waiting".into(),
        json!({
            "broker_ready": work.and_then(|d| d.ready),
            "broker_unacked": work.and_then(|d| d.unacked),
            "waiting_for_slot": waiting,
            "running": running,
            "concurrency_limit": limit,
            "running_in_ledger": ledger_count("running"),
            "accepted_in_ledger": ledger_count("accepted"),
            "dead_queue_ready": dead.and_then(|d| d.ready),
            "dead_queue_consumers": dead.and_then(|d| d.consumers),
            "depth_source": work.map(|d| d.source),
            "live_source": live_source,
            "workers_live": fleet.fresh,
            "workers_stale": fleet.stale,
            "workers_scraped": state.worker_metrics.len(),
        }),
    );
    summary.insert("workers".into(), json!(fleet));
    summary.insert("alerts".into(), json!(alerts(&alert_input, now)));
    summary.insert("queues".into(), json!(depths));
    summary.insert(
        "ledger_totals".into(),
        Value::Object(counts.iter().map(|(s, n)| (s.clone(), json!(n))).collect()),
    );
    summary.insert("now_ms".into(), json!(now));
    summary.insert("window_minutes".into(), json!(minutes));
    Ok(Value::Object(summary))
}

/// With `serve --worker-metrics URL` (an override of the leases): sum the waiting and
/// running gauges and the concurrency limits of those endpoints; `None` when none answered.
async fn scrape_workers(state: &AppState) -> (Option<i64>, Option<i64>, Option<i64>) {
    let mut answered = false;
    let (mut waiting, mut running, mut limit) = (0i64, 0i64, 0i64);
    for url in &state.worker_metrics {
        let Ok(resp) = state.http_client.get(url).send().await else {
            continue;
        };
        let Ok(text) = resp.text().await else {
            continue;
        };
        answered = true;
        waiting += sample_value(&text, "lastcall_worker_jobs_waiting").unwrap_or(0.0) as i64;
        running += sample_value(&text, "lastcall_worker_jobs_running").unwrap_or(0.0) as i64;
        limit += sample_value(&text, "lastcall_worker_concurrency_limit").unwrap_or(0.0) as i64;
    }
    if answered {
        (Some(waiting), Some(running), Some(limit))
    } else {
        (None, None, None)
    }
}

/// [`summarize`] from the ledger's aggregates ([`lastcall_store::Ledger::dashboard_counts`]):
/// what `GET /v1/dashboard` serves. The same numbers as [`summarize`] over the window's
/// records (the tests compare), without reading them.
pub fn summarize_counts(c: &DashboardCounts, since_ms: i64, now_ms: i64) -> Map<String, Value> {
    let mut totals: BTreeMap<&str, u64> = JobState::ALL
        .iter()
        .filter(|s| s.is_terminal())
        .map(|s| (s.as_str(), 0))
        .collect();
    let first_minute = since_ms.div_euclid(60_000);
    let last_minute = now_ms.div_euclid(60_000);
    let mut per_minute: BTreeMap<i64, BTreeMap<&str, u64>> = (first_minute..=last_minute)
        .map(|m| (m, BTreeMap::new()))
        .collect();
    for (state, minute, n) in &c.per_minute {
        let Some((state, total)) = totals.iter_mut().find(|(s, _)| **s == state.as_str()) else {
            continue;
        };
        *total += n;
        *per_minute
            .entry(*minute)
            .or_default()
            .entry(*state)
            .or_default() += n;
    }
    let timeline: Vec<Value> = per_minute
        .iter()
        .map(|(m, c)| json!({ "minute_start_ms": m * 60_000, "counts": c }))
        .collect();
    let dead: BTreeMap<&str, u64> = c
        .dead_letters
        .iter()
        .map(|(r, n)| (r.as_str(), *n))
        .collect();
    let mut out = Map::new();
    out.insert("outcomes".into(), json!(totals));
    out.insert("timeline".into(), json!(timeline));
    out.insert(
        "dwell".into(),
        json!({
            "bounds_ms": DWELL_BUCKETS_MS,
            "queue": c.queue_dwell,
            "consumer": c.consumer_dwell,
        }),
    );
    out.insert("dead_letters".into(), json!(dead));
    out.insert("tenants".into(), json!(c.tenants));
    out
}

/// Outcomes in the window (totals and per minute, by state), dwell histograms from the
/// ledger's timestamps, and dead letters by reason (outcomes the dead-letter processor
/// recorded). Pure: the records and the window are arguments. The reference computation
/// over whole records; `GET /v1/dashboard` serves
/// [`summarize_counts`], which the tests hold equal to it.
pub fn summarize(records: &[JobRecord], since_ms: i64, now_ms: i64) -> Map<String, Value> {
    let terminal: Vec<&'static str> = JobState::ALL
        .iter()
        .filter(|s| s.is_terminal())
        .map(|s| s.as_str())
        .collect();
    let mut totals: BTreeMap<&str, u64> = terminal.iter().map(|s| (*s, 0)).collect();
    let first_minute = since_ms.div_euclid(60_000);
    let last_minute = now_ms.div_euclid(60_000);
    let mut per_minute: BTreeMap<i64, BTreeMap<&str, u64>> = (first_minute..=last_minute)
        .map(|m| (m, BTreeMap::new()))
        .collect();
    let mut queue_dwell = vec![0u64; DWELL_BUCKETS_MS.len() + 1];
    let mut consumer_dwell = vec![0u64; DWELL_BUCKETS_MS.len() + 1];
    let mut dead: BTreeMap<String, u64> = BTreeMap::new();
    let mut tenants = Vec::new();
    for r in records {
        let Some(state) = terminal.iter().find(|s| **s == r.state) else {
            continue;
        };
        tenants.push(TenantSample::of_job(
            &r.tenant,
            &r.state,
            r.reason.as_deref(),
            r.model_ms,
            r.wasted_model_ms,
            r.prompt_tokens,
            r.completion_tokens,
        ));
        *totals.entry(state).or_default() += 1;
        if let Some(at) = r.recorded_at_ms {
            *per_minute
                .entry(at.div_euclid(60_000))
                .or_default()
                .entry(state)
                .or_default() += 1;
        }
        if let (Some(c), Some(rcv)) = (r.created_at_ms, r.received_at_ms)
            && !r.worker.as_deref().unwrap_or("").starts_with("dlq:")
        {
            queue_dwell[bucket(rcv - c)] += 1;
        }
        if let (Some(rcv), Some(chk)) = (r.received_at_ms, r.checked_at_ms) {
            consumer_dwell[bucket(chk - rcv)] += 1;
        }
        if r.worker.as_deref().unwrap_or("").starts_with("dlq:") {
            *dead
                .entry(r.reason.clone().unwrap_or_else(|| "none".into()))
                .or_default() += 1;
        }
    }
    let timeline: Vec<Value> = per_minute
        .iter()
        .map(|(m, c)| json!({ "minute_start_ms": m * 60_000, "counts": c }))
        .collect();
    let mut out = Map::new();
    out.insert("outcomes".into(), json!(totals));
    out.insert("timeline".into(), json!(timeline));
    out.insert(
        "dwell".into(),
        json!({
            "bounds_ms": DWELL_BUCKETS_MS,
            "queue": queue_dwell,
            "consumer": consumer_dwell,
        }),
    );
    out.insert("dead_letters".into(), json!(dead));
    out.insert(
        "tenants".into(),
        json!(tenant_accounts(&tenants, lastcall_store::DASHBOARD_TENANTS)),
    );
    out
}

fn bucket(ms: i64) -> usize {
    let v = ms.max(0) as u64;
    DWELL_BUCKETS_MS.partition_point(|b| *b < v)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The first paint: every placeholder filled with the snapshot's numbers in the
    /// script's formats, the snapshot embedded so that no text of it can end the script
    /// element, and dashes (never a placeholder) without a snapshot.
    #[test]
    fn the_page_is_rendered_with_its_first_state() {
        let snap = json!({
            "headline": {
                "arrivals": 40, "on_time": 35, "on_time_pct": 87.5, "pending": 1,
                "refused": 3, "wasted_model_ms": 12_340,
                "queue_dwell_p99_ms": 2_500, "queue_dwell_p99_over": false,
            },
            "waiting": {
                "broker_ready": 4, "broker_unacked": 2, "waiting_for_slot": 1,
                "running": 2, "concurrency_limit": null,
            },
            "tenants": [{"tenant": "</script><b>x"}],
        });
        let html = render_page(Some(&snap));
        assert!(!html.contains("{{"), "every placeholder is filled");
        for (id, text) in [
            ("h-on_time", "87.5%"),
            ("h-refused", "3"),
            ("h-wasted", "12.3 s"),
            ("h-dwell", "≤ 2.5 s"),
            ("h-arrivals", "35 of 40 arrivals (1 not ended)"),
            ("wait-broker_ready", "4"),
            ("wait-concurrency_limit", "n/a"),
        ] {
            assert!(
                html.contains(&format!("id=\"{id}\">{text}<")),
                "{id}: {text}"
            );
        }
        let script = html
            .split("<script id=\"initial\" type=\"application/json\">")
            .nth(1)
            .unwrap();
        let json = script.split("</script>").next().unwrap();
        assert_eq!(serde_json::from_str::<Value>(json).unwrap(), snap);
        assert!(!json.contains('<'));

        let empty = render_page(None);
        assert!(!empty.contains("{{"));
        assert!(empty.contains("id=\"h-on_time\">–<"));
        assert!(empty.contains(">null</script>"));
    }
    use lastcall_core::{Decision, Reason};
    use lastcall_store::{Ledger, OutcomeRecord};

    /// `GET /v1/dashboard` serves `summarize_counts` of the ledger's aggregates: the same
    /// JSON as `summarize` over the window's whole records (the store's tests compare the
    /// counts themselves on SQLite and PostgreSQL).
    #[tokio::test]
    async fn the_counts_give_the_same_json_as_the_records() {
        let dir = std::env::temp_dir().join(format!(
            "lastcall-dashboard-{}-{:?}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let ledger = Ledger::connect(&format!("sqlite://{}", dir.join("l.db").display()))
            .await
            .unwrap();
        let (since, now) = (600_000, 1_000_000);
        for i in 0..60i64 {
            let state = JobState::ALL[2 + (i as usize % 8)];
            let recorded = since - 60_000 + i * 9_000;
            let rec = OutcomeRecord {
                attempt_key: format!("j{i}-1"),
                created_at_ms: Some(recorded - 100 * i),
                received_at_ms: Some(recorded - 7 * i),
                checked_at_ms: Some(recorded - 5 * i),
                worker: if i % 4 == 0 { "dlq:x" } else { "w" }.into(),
                reason: (i % 3 == 0).then_some(Reason::RetriesExhausted),
                result: Some("text".into()),
                tenant: lastcall_core::Tenant::parse(&format!("t{}", i % 13)).unwrap(),
                latency_ms: Some(i * 3),
                prompt_tokens: Some(i),
                ..OutcomeRecord::new(format!("j{i}"), "chat", state, Decision::Ack, recorded)
            };
            ledger.record_outcome(&rec).await.unwrap();
        }
        let records = ledger.records_since(since).await.unwrap();
        let counts = ledger.dashboard_counts(since).await.unwrap();
        assert!(records.len() > 40);
        assert_eq!(counts.tenants.len(), lastcall_store::DASHBOARD_TENANTS + 1);
        assert_eq!(
            summarize_counts(&counts, since, now),
            summarize(&records, since, now)
        );
        ledger.close().await;
        let _ = std::fs::remove_dir_all(dir);
    }
}
