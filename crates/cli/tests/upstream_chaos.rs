//! The chaos suite's upstream rows (issue #32): one fault of the model server at a time,
//! against a worker with the OpenAI-compatible backend and default settings, with the
//! suite's accounting (RELIABILITY.md). The server is the tests' own fault-injecting one
//! (`common::upstream`), over real HTTP, with real RabbitMQ and the SQLite ledger.
//!
//! Each scenario: 2 s healthy, 3 s of the fault, 4 s healthy again; a job every 100 ms with
//! a 2 s budget, its id in its prompt so the server can tell which job each call is for.
//! - **lost** (must be 0): jobs without a terminal outcome 30 s after the last deadline
//!   (retries that expired in the queue are recorded by the dead-letter processor, run as
//!   `lastcall dlq` is);
//! - **dup. outcomes** (must be 0): jobs whose terminal state a monitor, reading the
//!   ledger every 100 ms, saw change;
//! - **calls after deadline** (must be 0): requests that reached the server after their
//!   job's `expires_at_ms`, counted at the server;
//! - **wasted time**: model time (`latency_ms`) of the calls that did not complete ÷ all;
//! - **recovery**: from the fault's end to the first on-time completion of a job sent after
//!   it.

use crate::common;

use common::upstream::{
    FAILING, HANGING, HEALTHY, LIMITED, MALFORMED, RESET, SLOW_FIRST_BYTE, SLOW_STREAM, Upstream,
    openai,
};
use common::*;
use lastcall_worker::clock::now_ms;
use serde_json::json;
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

const BUDGET_MS: u64 = 2_000;

/// Submit one job every 100 ms for `for_ms`, its id as its prompt.
async fn send(
    s: &lastcall_worker::Submitter,
    tag: &str,
    for_ms: u64,
    ids: &mut Vec<String>,
) -> Vec<String> {
    let mut sent = Vec::new();
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    for i in 0..for_ms / 100 {
        tick.tick().await;
        let id = format!("{tag}-{i}");
        let payload = json!({"messages": [{"role": "user", "content": id}]});
        s.submit(&job_with(&id, BUDGET_MS, payload), now_ms())
            .await
            .unwrap();
        sent.push(id.clone());
        ids.push(id);
    }
    sent
}

async fn scenario(name: &str, fault: u8) {
    let up = Arc::new(Upstream::default());
    let (base, server) = up.start().await;
    let env = Env::sqlite(&format!("upstream-chaos-{name}")).await;
    let backend = openai(&base);
    // The worker's defaults: 2 slots, prefetch 4.
    let cfg = env.worker_config(2, 4);
    cfg.topology.apply(&env.broker).await.unwrap();
    let w = env.start_worker(cfg, backend, system_clock()).await;
    let s = env.submitter(100, true).await;

    // The monitor: every terminal state seen, per job; a change is a duplicate outcome.
    let seen: Arc<Mutex<HashMap<String, String>>> = Arc::default();
    let changed: Arc<Mutex<Vec<String>>> = Arc::default();
    let ids: Arc<Mutex<Vec<String>>> = Arc::default();
    let stop = CancellationToken::new();
    let monitor = {
        let (seen, changed, ids, stop) = (seen.clone(), changed.clone(), ids.clone(), stop.clone());
        let ledger = env.ledger.clone();
        tokio::spawn(async move {
            while !stop.is_cancelled() {
                let now: Vec<String> = ids.lock().unwrap().clone();
                for id in now {
                    let Ok(Some(r)) = ledger.get(&id).await else {
                        continue;
                    };
                    let terminal =
                        (r.state.parse::<lastcall_core::State>()).is_ok_and(|s| s.is_terminal());
                    if !terminal {
                        continue;
                    }
                    let mut seen = seen.lock().unwrap();
                    match seen.get(&id) {
                        Some(before) if *before != r.state => {
                            changed.lock().unwrap().push(id.clone());
                        }
                        Some(_) => {}
                        None => {
                            seen.insert(id.clone(), r.state.clone());
                        }
                    }
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    };

    let mut all = Vec::new();
    let track = |all: &Vec<String>| *ids.lock().unwrap() = all.clone();
    send(&s, "before", 2_000, &mut all).await;
    track(&all);
    up.set(fault);
    send(&s, "fault", 3_000, &mut all).await;
    track(&all);
    up.set(HEALTHY);
    let fault_end_ms = now_ms();
    let after = send(&s, "after", 4_000, &mut all).await;
    track(&all);
    // Once every deadline has passed, retries that expired in the queue are dead letters.
    let last_deadline = now_ms() + BUDGET_MS as i64;
    tokio::time::sleep(Duration::from_millis(BUDGET_MS + 100)).await;
    assert!(now_ms() > last_deadline);
    env.drain_dead_letters(false).await;
    let recs = env.wait_terminal(&all, Duration::from_secs(30)).await;
    stop.cancel();
    monitor.await.unwrap();
    // The final states against the first ones the monitor saw.
    for r in &recs {
        if seen
            .lock()
            .unwrap()
            .get(&r.job_id)
            .is_some_and(|s| *s != r.state)
        {
            changed.lock().unwrap().push(r.job_id.clone());
        }
    }

    let by_id: HashMap<&str, &lastcall_store::JobRecord> =
        recs.iter().map(|r| (r.job_id.as_str(), r)).collect();
    let lost = all.len() - recs.len();
    let dup_outcomes = changed.lock().unwrap().len();
    let calls = up.seen.lock().unwrap().clone();
    let after_deadline: Vec<(String, i64, i64)> = (calls.iter())
        .filter_map(|(id, at)| {
            let exp = by_id.get(id.as_str())?.expires_at_ms?;
            (*at > exp).then(|| (id.clone(), *at, exp))
        })
        .collect();
    let mut outcomes: BTreeMap<String, usize> = BTreeMap::new();
    for r in &recs {
        let key = match &r.reason {
            Some(reason) if r.state != "completed" => format!("{} ({reason})", r.state),
            _ => r.state.clone(),
        };
        *outcomes.entry(key).or_default() += 1;
    }
    let on_time = |r: &&lastcall_store::JobRecord| {
        r.state == "completed"
            && r.finished_at_ms.unwrap_or(i64::MAX) <= r.expires_at_ms.unwrap_or(0)
    };
    let model_ms: i64 = recs.iter().map(|r| r.latency_ms.unwrap_or(0).max(0)).sum();
    let wasted_ms: i64 = (recs.iter())
        .filter(|r| r.state != "completed")
        .map(|r| r.latency_ms.unwrap_or(0).max(0))
        .sum();
    let recovery = (recs.iter())
        .filter(|r| after.contains(&r.job_id))
        .filter(on_time)
        .filter_map(|r| r.finished_at_ms)
        .min()
        .map(|f| f - fault_end_ms);
    let on_time_after = recs
        .iter()
        .filter(|r| after.contains(&r.job_id))
        .filter(on_time)
        .count();
    println!(
        "| {name} | {} | {} | {} | {lost} | {dup_outcomes} | {} ({} calls) | {:.1}% | {}/{} | {} |",
        all.len(),
        outcomes
            .iter()
            .map(|(k, v)| format!("{k} {v}"))
            .collect::<Vec<_>>()
            .join(", "),
        recs.iter().filter(on_time).count(),
        after_deadline.len(),
        calls.len(),
        100.0 * wasted_ms as f64 / model_ms.max(1) as f64,
        on_time_after,
        after.len(),
        recovery.map_or("none".into(), |ms| format!("{:.1} s", ms as f64 / 1000.0)),
    );
    assert_eq!(lost, 0, "jobs without an outcome");
    assert_eq!(
        dup_outcomes,
        0,
        "outcomes changed: {:?}",
        changed.lock().unwrap()
    );
    assert!(
        after_deadline.is_empty(),
        "calls reached the server after their deadline: {after_deadline:?}"
    );
    assert!(
        recovery.is_some(),
        "no job sent after the fault finished in time: {outcomes:?}"
    );
    w.stop().await;
    server.abort();
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_503() {
    scenario("503", FAILING).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_429_retry_after() {
    scenario("429_retry_after", LIMITED).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_hang() {
    scenario("hang", HANGING).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_reset() {
    scenario("reset", RESET).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_slow_first_byte() {
    scenario("slow_first_byte", SLOW_FIRST_BYTE).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_slow_stream() {
    scenario("slow_stream", SLOW_STREAM).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_malformed_json() {
    scenario("malformed_json", MALFORMED).await;
}
