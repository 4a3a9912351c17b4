//! `/metrics` after a scripted run against the real broker and ledger: the counts match
//! the ledger, and the number of series does not grow with the number of jobs.

mod common;

use common::*;
use lastcall_clock::now_ms;
use lastcall_http::MetricsSource;
use lastcall_http::metrics::sample_value;
use lastcall_producer::{DeadlineSpec, NewJob};
use lastcall_worker::stats::{DlqCollector, WorkerCollector};
use serde_json::json;
use std::collections::BTreeMap;
use std::time::Duration;

pub fn new_job(id: &str, kind: &str, budget_ms: u64) -> NewJob {
    NewJob {
        job_id: Some(id.into()),
        kind: kind.into(),
        payload: json!({"messages": [{"role": "user", "content": "x"}]})
            .as_object()
            .cloned()
            .unwrap(),
        deadline: DeadlineSpec::RelativeMs(budget_ms),
        min_runtime_ms: None,
        trace_id: None,
    }
}

/// Sum of a family's samples by one label.
fn sum_by(text: &str, family: &str, label: &str) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    for line in text
        .lines()
        .filter(|l| l.starts_with(&format!("{family}{{")))
    {
        let (series, value) = line.rsplit_once(' ').unwrap();
        let key = format!("{label}=\"");
        let Some(start) = series.find(&key) else {
            continue;
        };
        let rest = &series[start + key.len()..];
        let v = rest[..rest.find('"').unwrap()].to_owned();
        *out.entry(v).or_default() += value.parse::<f64>().unwrap();
    }
    out
}

fn series(text: &str) -> usize {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_match_the_ledger_and_series_stay_bounded() {
    let env = Env::new("metrics").await;
    let sub = env.submitter(Duration::from_secs(5)).await;
    // Two jobs expire in the broker before any worker runs.
    for i in 0..2 {
        sub.submit(
            &new_job(&format!("b{i}"), "incident.summary", 300),
            now_ms(),
        )
        .await
        .unwrap();
    }
    env.wait_ready(&env.topo.names.dead_queue, 2).await;
    let (stop, handle, stats) = env.start_worker(1, 250).await;
    let dlq = env.drain_dead_letters().await;
    // Known outcomes first: one job of each kind with a budget far beyond any wait, so
    // both kinds have a `completed` series whatever the machine's load (under CI load the
    // timed phase below once completed no `code.answer` job, and the second phase then
    // added that series).
    for (i, kind) in ["incident.summary", "code.answer"].iter().enumerate() {
        sub.submit(&new_job(&format!("w{i}"), kind, 600_000), now_ms())
            .await
            .unwrap();
    }
    env.wait_settled(Duration::from_secs(30)).await;
    // One slot, 250 ms per call, 900 ms budgets: at most 4 of these 8 fit (by the clock,
    // not by the machine's speed), so the rest expire waiting.
    for i in 0..8 {
        let kind = if i % 2 == 0 {
            "incident.summary"
        } else {
            "code.answer"
        };
        sub.submit(&new_job(&format!("m{i}"), kind, 900), now_ms())
            .await
            .unwrap();
    }
    env.wait_settled(Duration::from_secs(15)).await;
    let source = MetricsSource::default()
        .with_collector(WorkerCollector(stats.clone()))
        .with_collector(DlqCollector(dlq.clone()))
        .with_ledger(env.ledger.clone());
    let text = source.render().await;
    let ledger: BTreeMap<String, i64> = env
        .ledger
        .counts_by_state()
        .await
        .unwrap()
        .into_iter()
        .collect();
    let outcomes = sum_by(&text, "lastcall_outcomes_total", "state");
    for state in ["completed", "expired_not_started"] {
        assert_eq!(
            outcomes.get(state).copied().unwrap_or(0.0) as i64,
            ledger.get(state).copied().unwrap_or(0),
            "{state}: metrics vs ledger\n{text}"
        );
    }
    assert!(
        ledger.get("completed").copied().unwrap_or(0) >= 1,
        "{ledger:?}"
    );
    assert!(
        ledger.get("expired_not_started").copied().unwrap_or(0) >= 1,
        "{ledger:?}"
    );
    assert_eq!(
        sample_value(&text, "lastcall_dead_letters_total{reason=\"expired\"}").unwrap() as i64,
        ledger["expired_before_receive"],
    );
    // The two `b` jobs expire in the broker by design; on a very busy machine a 900 ms `m`
    // job may also expire there before its delivery. Every other job was received.
    let in_broker = ledger["expired_before_receive"];
    assert!(in_broker >= 2, "{ledger:?}");
    let received = 12 - in_broker;
    let recs = env.ledger.records_since(0).await.unwrap();
    let calls: i64 = recs.iter().map(|r| r.backend_calls).sum();
    assert_eq!(
        sample_value(&text, "lastcall_worker_backend_calls_total").unwrap() as i64,
        calls
    );
    assert_eq!(
        sample_value(&text, "lastcall_model_call_seconds_count").unwrap() as i64,
        calls
    );
    let tokens: i64 = recs.iter().filter_map(|r| r.completion_tokens).sum();
    assert!(tokens > 0, "the sim backend reports usage");
    assert_eq!(
        sample_value(&text, "lastcall_model_tokens_total{type=\"completion\"}").unwrap() as i64,
        tokens,
        "token usage in the metrics matches the ledger"
    );
    let checked = recs.iter().filter(|r| r.checked_at_ms.is_some()).count() as i64;
    assert_eq!(
        sample_value(&text, "lastcall_consumer_dwell_seconds_count").unwrap() as i64,
        checked
    );
    assert_eq!(
        sample_value(&text, "lastcall_queue_dwell_seconds_count").unwrap() as i64,
        received
    );
    assert_eq!(
        sample_value(&text, "lastcall_worker_received_total").unwrap() as i64,
        received
    );
    assert_eq!(
        sample_value(&text, "lastcall_worker_slots_total").unwrap() as i64,
        1
    );
    assert_eq!(
        sample_value(&text, "lastcall_worker_slots_busy").unwrap() as i64,
        0
    );
    assert_eq!(
        sample_value(&text, "lastcall_worker_prefetch").unwrap() as i64,
        4
    );
    for (state, n) in &ledger {
        assert_eq!(
            sample_value(&text, &format!("lastcall_ledger_jobs{{state=\"{state}\"}}")).unwrap()
                as i64,
            *n
        );
    }
    assert!(
        !text.contains("m0") && !text.contains("b0"),
        "no job id in any label"
    );

    // Many more jobs of the same kinds and outcome (`completed`, which both kinds already
    // have): the same number of series.
    let before = series(&text);
    for i in 0..20 {
        let kind = if i % 2 == 0 {
            "incident.summary"
        } else {
            "code.answer"
        };
        // A budget far beyond any wait: every one of these completes.
        sub.submit(&new_job(&format!("n{i}"), kind, 600_000), now_ms())
            .await
            .unwrap();
    }
    env.wait_settled(Duration::from_secs(30)).await;
    let completed_after = env
        .ledger
        .counts_by_state()
        .await
        .unwrap()
        .into_iter()
        .find(|(s, _)| s == "completed")
        .unwrap()
        .1;
    assert_eq!(
        completed_after - ledger["completed"],
        20,
        "every second-phase job completes (the premise of the series check)"
    );
    let text2 = source.render().await;
    assert_eq!(
        series(&text2),
        before,
        "series grew with the number of jobs:\n{text2}"
    );
    assert_eq!(
        sum_by(&text2, "lastcall_outcomes_total", "state")["completed"] as i64,
        env.ledger
            .counts_by_state()
            .await
            .unwrap()
            .into_iter()
            .find(|(s, _)| s == "completed")
            .unwrap()
            .1
    );
    stop.cancel();
    handle.await.unwrap();
    env.cleanup().await;
}

/// The dashboard bins the ledger's dwell times with the worker histograms' bounds.
#[test]
fn the_dashboard_uses_the_workers_dwell_buckets() {
    assert_eq!(
        lastcall_http::dashboard::DWELL_BUCKETS_MS,
        lastcall_worker::stats::DWELL_BUCKETS_MS
    );
}
