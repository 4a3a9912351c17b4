//! `--slots auto` against a batching model server (issue #31 item 3): the fault server of
//! `common::upstream` in its [`BATCHING`] phase (call time grows with the prompt and with
//! the calls in flight; throughput rises up to 4 calls at once, then is flat), over real
//! HTTP, with real RabbitMQ and the ledger, the worker's default adaptive settings.
//!
//! The limit must move above its start and stay within [1, max]; the jobs must finish on
//! time, and no call may reach the server after its job's deadline.

use crate::common;

use common::upstream::{BATCHING, Upstream};
use common::*;
use lastcall_core::concurrency::LimitConfig;
use lastcall_worker::clock::now_ms;
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// What one run gave.
struct Run {
    sent: usize,
    on_time: usize,
    cut: usize,
    late: usize,
    highest: usize,
    model_ms: i64,
    wasted_ms: i64,
}

/// ~40 short jobs/s for `secs` s with 1.5 s budgets against a fresh [`BATCHING`] server,
/// with `slots` fixed or (`None`) the adaptive defaults.
async fn run(tag: &str, slots: Option<usize>, secs: u64) -> Run {
    let up = Arc::new(Upstream::default());
    up.set(BATCHING);
    let (base, server) = up.start().await;

    let env = Env::sqlite(tag).await;
    let max = 16;
    // The worker's default window (lastcall_worker::default_prefetch), as `lastcall worker`
    // runs: it takes what the broker holds and refuses at receipt what cannot finish, so
    // no job expires unrecorded in the broker.
    let cfg = match slots {
        Some(n) => env.worker_config(n, lastcall_worker::default_prefetch(n)),
        None => {
            // The CLI's `--slots auto`: the most is --max-slots, the window counts that many.
            let mut cfg = env.worker_config(max, lastcall_worker::default_prefetch(max));
            cfg.auto_slots = Some(LimitConfig::new(max));
            cfg
        }
    };
    cfg.topology.apply(&env.broker).await.unwrap();
    let w = env
        .start_worker(cfg, upstream::openai(&base), system_clock())
        .await;
    let s = env.submitter(100, true).await;

    // A short prompt takes ~70 ms alone: 4 at once complete ~43 calls/s, 1 at a time
    // ~14/s. Send ~40/s (3× what one slot can do), with 1.5 s budgets.
    let prompt = "summarize the incident for the on-call engineer now";
    let mut ids = Vec::new();
    let mut highest = 0;
    let mut tick = tokio::time::interval(Duration::from_millis(25));
    let t0 = Instant::now();
    let mut i = 0;
    while t0.elapsed() < Duration::from_secs(secs) {
        tick.tick().await;
        let id = format!("{tag}-{i}");
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
    let model_ms: i64 = recs.iter().map(|r| r.latency_ms.unwrap_or(0).max(0)).sum();
    let wasted_ms: i64 = (recs.iter())
        .filter(|r| r.state != "completed")
        .map(|r| r.latency_ms.unwrap_or(0).max(0))
        .sum();
    eprintln!(
        "{tag}: sent {}; on time {on_time}; cut {cut}; upstream calls {}; highest limit {highest}; late {}",
        ids.len(),
        up.answered.load(Ordering::SeqCst),
        late.len(),
    );
    w.stop().await;
    server.abort();
    env.cleanup().await;
    Run {
        sent: ids.len(),
        on_time,
        cut,
        late: late.len(),
        highest,
        model_ms,
        wasted_ms,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_slots_raise_the_limit_against_a_batching_server_and_no_call_is_late() {
    let r = run("adaptive-slots", None, 12).await;
    assert!(
        r.highest > 2,
        "the limit rose above its start (2): {}",
        r.highest
    );
    assert_eq!(r.late, 0, "calls at the server after the deadline");
    // One slot completes ~14 calls/s; the adaptive limit must do clearly better.
    assert!(
        r.on_time as f64 > 1.5 * 14.0 * 12.0,
        "on time {} of {}",
        r.on_time,
        r.sent
    );
    // BENCHMARKS §10 cites 466 of 481 (96.9%) for this test, run alone; beside another
    // test at load 19 it gave 360 (74.8%). 65% leaves room for that and is still above
    // what two fixed slots reach (~55%; one slot ~35%).
    assert!(
        r.on_time * 100 >= r.sent * 65,
        "on time {} of {} (< 65%)",
        r.on_time,
        r.sent
    );
    assert!(
        r.cut * 20 <= r.on_time,
        "cut {} vs on time {}",
        r.cut,
        r.on_time
    );
}

/// The real-time sweep of BENCHMARKS.md §10: fixed 1…6 and auto, one after the other on
/// the same load (slow tier: ~2 minutes). It asserts what §10 cites, with margins for
/// noise: of ~481 jobs, fixed 1 / 2 / 3 slots 175 / 307 / 419 on time (rising; one slot
/// at most half), 4–6 slots all (≥ 85% here: 5 slots gave 91.3% at load 19); auto 98.3%
/// of the best fixed (≥ 90%, the target), 0.0% wasted (≤ 5%), highest limit 5 (≥ 4:
/// throughput rises up to 4 calls), 0 calls after the deadline (exactly).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore]
async fn sweep_fixed_slot_counts_against_auto_on_a_batching_server() {
    let mut rows = Vec::new();
    for slots in [Some(1), Some(2), Some(3), Some(4), Some(5), Some(6), None] {
        let tag = match slots {
            Some(n) => format!("sweep-{n}"),
            None => "sweep-auto".into(),
        };
        rows.push((slots, run(&tag, slots, 12).await));
    }
    let best = (rows.iter())
        .filter(|(s, _)| s.is_some())
        .map(|(_, r)| r.on_time)
        .max()
        .unwrap()
        .max(1);
    eprintln!("| slots | sent | on time | ÷ best fixed | cut | wasted | late | highest limit |");
    eprintln!("|---|---|---|---|---|---|---|---|");
    for (slots, r) in &rows {
        eprintln!(
            "| {} | {} | {} | {:.1}% | {} | {:.1}% | {} | {} |",
            slots.map_or("auto".to_string(), |n| n.to_string()),
            r.sent,
            r.on_time,
            100.0 * r.on_time as f64 / best as f64,
            r.cut,
            100.0 * r.wasted_ms as f64 / r.model_ms.max(1) as f64,
            r.late,
            r.highest,
        );
        assert_eq!(r.late, 0, "calls at the server after the deadline");
    }
    let fixed = |n: usize| &rows[n - 1].1;
    let auto = &rows[6].1;
    let pct = |a: usize, b: usize| 100.0 * a as f64 / b.max(1) as f64;
    assert!(
        fixed(1).on_time < fixed(2).on_time && fixed(2).on_time < fixed(3).on_time,
        "on time rises with the slots up to the server's 4 batch places: {} / {} / {}",
        fixed(1).on_time,
        fixed(2).on_time,
        fixed(3).on_time
    );
    assert!(
        2 * fixed(1).on_time <= fixed(1).sent,
        "one slot is overloaded (§10: 175 of 481): {} of {}",
        fixed(1).on_time,
        fixed(1).sent
    );
    for n in 4..=6 {
        assert!(
            pct(fixed(n).on_time, fixed(n).sent) >= 85.0,
            "{n} slots finish (nearly) all on time (§10: 481 of 481): {} of {}",
            fixed(n).on_time,
            fixed(n).sent
        );
    }
    assert!(
        pct(auto.on_time, best) >= 90.0,
        "auto within 10% of the best fixed count (§10: 98.3%): {} vs {best}",
        auto.on_time
    );
    assert!(
        pct(auto.wasted_ms as usize, auto.model_ms as usize) <= 5.0,
        "auto wastes ≤ 5% of its model time (§10: 0.0%): {} of {} ms",
        auto.wasted_ms,
        auto.model_ms
    );
    assert!(
        auto.highest >= 4,
        "auto's limit reaches the server's 4 batch places (§10: 5): {}",
        auto.highest
    );
}
