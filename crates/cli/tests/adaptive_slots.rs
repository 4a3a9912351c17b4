//! `--slots auto` against a batching model server (issue #31 item 3): the fault server of
//! `common::upstream` in its [`BATCHING`] phase (call time grows with the prompt and with
//! the calls in flight; throughput rises up to 4 calls at once, then is flat), over real
//! HTTP, with real RabbitMQ and the ledger, the worker's default adaptive settings.
//!
//! The limit must move above its start and stay within [1, max]; the jobs must finish on
//! time, and no call may reach the server after its job's deadline.

mod common;

use common::upstream::{BATCHING, Upstream};
use common::*;
use lastcall_core::concurrency::LimitConfig;
use lastcall_worker::clock::now_ms;
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_slots_raise_the_limit_against_a_batching_server_and_no_call_is_late() {
    let up = Arc::new(Upstream::default());
    up.set(BATCHING);
    let (base, server) = up.start().await;

    let env = Env::sqlite("adaptive-slots").await;
    let max = 16;
    // The CLI's `--slots auto`: the most is --max-slots, the prefetch 2 × that.
    let mut cfg = env.worker_config(max, 2 * max as u16);
    cfg.auto_slots = Some(LimitConfig::new(max));
    cfg.topology.apply(&env.broker).await.unwrap();
    let w = env
        .start_worker(cfg, upstream::openai(&base), system_clock())
        .await;
    let s = env.submitter(100, true).await;

    // A short prompt takes ~70 ms alone: 4 at once complete ~43 calls/s, 1 at a time
    // ~14/s. Send ~40/s for 12 s (3× what one slot can do), with 1.5 s budgets.
    let prompt = "summarize the incident for the on-call engineer now";
    let mut ids = Vec::new();
    let mut highest = 0;
    let mut tick = tokio::time::interval(Duration::from_millis(25));
    let t0 = Instant::now();
    let mut i = 0;
    while t0.elapsed() < Duration::from_secs(12) {
        tick.tick().await;
        let id = format!("auto-{i}");
        i += 1;
        let payload = serde_json::json!({
            "messages": [
                {"role": "user", "content": id},
                {"role": "user", "content": prompt},
            ],
            "max_tokens": 16,
        });
        s.submit(&job_with(&id, 1_500, payload), now_ms())
            .await
            .unwrap();
        ids.push(id);
        if let Some((_, limit)) = w.stats.metrics.slots() {
            assert!(
                (1..=max).contains(&limit),
                "the limit stays in [1, max]: {limit}"
            );
            highest = highest.max(limit);
        }
    }
    let recs = env.wait_terminal(&ids, Duration::from_secs(30)).await;
    let by_id: HashMap<&str, &lastcall_store::JobRecord> =
        recs.iter().map(|r| (r.job_id.as_str(), r)).collect();
    let calls = up.seen.lock().unwrap().clone();
    let late: Vec<_> = (calls.iter())
        .filter(|(id, at)| {
            by_id
                .get(id.as_str())
                .and_then(|r| r.expires_at_ms)
                .is_some_and(|exp| *at > exp)
        })
        .collect();
    let on_time = (recs.iter())
        .filter(|r| r.state == "completed")
        .filter(|r| r.finished_at_ms.unwrap_or(i64::MAX) <= r.expires_at_ms.unwrap_or(0))
        .count();
    let cut = (recs.iter())
        .filter(|r| r.state == "deadline_exceeded")
        .count();
    let text = w.stats.metrics.slots();
    eprintln!(
        "sent {}; on time {on_time}; cut {cut}; upstream calls {}; highest limit {highest}; now {text:?}",
        ids.len(),
        up.answered.load(Ordering::SeqCst),
    );
    assert!(highest > 2, "the limit rose above its start (2): {highest}");
    assert!(
        late.is_empty(),
        "calls at the server after the deadline: {late:?}"
    );
    // One slot completes ~14 calls/s; the adaptive limit must do clearly better.
    assert!(
        on_time as f64 > 1.5 * 14.0 * 12.0,
        "on time {on_time} of {}",
        ids.len()
    );
    assert!(cut * 20 <= on_time, "cut {cut} vs on time {on_time}");
    w.stop().await;
    server.abort();
    env.cleanup().await;
}
