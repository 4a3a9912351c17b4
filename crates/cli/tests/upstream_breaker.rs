//! The circuit breaker per model server and `Retry-After` (issue #32 items 2 and 3),
//! against a worker with the OpenAI-compatible backend: a fault-injecting chat-completions
//! server of `common::upstream`, over real HTTP, with real
//! RabbitMQ and the ledger.
//!
//! Phases: healthy (150 ms calls); 503s without `Retry-After` → the breaker opens, and
//! while it is open the server sees no call but the trials; jobs whose budget cannot
//! outlast it end at once (`admission:upstream_unavailable`) without a call; healthy →
//! the next trial closes it and the jobs that waited complete; a hang (calls never
//! answered) opens it again. And 429 with `Retry-After`: a retry never comes earlier, and
//! a job whose budget cannot cover it ends at once (`retry:rate_limited`).

use crate::common;

use common::upstream::{FAILING, HANGING, HEALTHY, LIMITED, Upstream, submit_all, until};
use common::*;
use lastcall_backend::Backend;
use lastcall_core::breaker::{BreakerPolicy, BreakerState};
use lastcall_openai::{OpenAiBackend, OpenAiConfig};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

/// The worker's one breaker (its backend) as `/metrics` and `/readyz` see it.
fn breaker(w: &lastcall_worker::stats::WorkerStats) -> (BreakerState, u64) {
    let view = w.breakers.lock().unwrap();
    let v = view.values().next().copied().expect("one backend");
    (v.state, v.opens)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_breaker_opens_on_errors_and_hangs_holds_calls_and_closes_after_recovery() {
    let up = Arc::new(Upstream::default());
    let (base, server) = up.start().await;

    let env = Env::sqlite("upstream-breaker").await;
    let backend: Arc<dyn Backend> =
        Arc::new(OpenAiBackend::new(OpenAiConfig::new(&base, "m")).unwrap());
    let mut cfg = env.worker_config(4, 64);
    cfg.breaker = BreakerPolicy {
        failures_to_open: 3,
        cool_down_ms: 1_500,
        max_cool_down_ms: 3_000,
        ..Default::default()
    };
    cfg.topology.apply(&env.broker).await.unwrap();
    let w = env.start_worker(cfg, backend, system_clock()).await;
    let s = env.submitter(100, true).await;

    // Healthy: the call time is learned, the breaker is closed.
    let healthy = submit_all(&s, "healthy", 12, 5_000).await;
    let recs = env.wait_terminal(&healthy, Duration::from_secs(30)).await;
    assert!(recs.iter().all(|r| r.state == "completed"), "{recs:#?}");
    assert_eq!(breaker(&w.stats), (BreakerState::Closed, 0));

    // 503s: three failures open it.
    up.set(FAILING);
    let failing = submit_all(&s, "failing", 3, 30_000).await;
    until("the breaker opens", Duration::from_secs(10), || {
        breaker(&w.stats).0 == BreakerState::Open
    })
    .await;
    let at_open = up.requests.load(Ordering::SeqCst);
    // Jobs with budget to outlast the breaker wait in the buffer.
    let waiters = submit_all(&s, "waiter", 6, 30_000).await;
    // Wait for a failed trial (a second open): then the breaker is open for 3 s; jobs of
    // 800 ms cannot outlast it and end at once without a call.
    until(
        "a failed trial re-opens it",
        Duration::from_secs(10),
        || breaker(&w.stats) == (BreakerState::Open, 2),
    )
    .await;
    let before_short = up.requests.load(Ordering::SeqCst);
    let short = submit_all(&s, "short", 5, 800).await;
    let recs = env.wait_terminal(&short, Duration::from_secs(10)).await;
    for r in &recs {
        assert_eq!(r.state, "expired_not_started", "{r:#?}");
        assert_eq!(
            r.reason.as_deref(),
            Some("admission:upstream_unavailable"),
            "{r:#?}"
        );
        // Ended at once, well before its deadline, and never started.
        assert!(r.recorded_at_ms.unwrap_or(i64::MAX) < r.expires_at_ms.unwrap_or(0) - 300);
        assert_eq!((r.backend_calls, r.started_at_ms), (0, None), "{r:#?}");
    }
    assert_eq!(
        up.requests.load(Ordering::SeqCst),
        before_short,
        "no call for the short jobs"
    );
    // While it is open, the server sees only the trials: one per re-open, plus one in
    // flight at most.
    let (_, opens) = breaker(&w.stats);
    let while_open = up.requests.load(Ordering::SeqCst) - at_open;
    eprintln!("while open: {while_open} requests, {opens} opens");
    assert!(
        while_open <= opens,
        "{while_open} calls while open, {opens} opens"
    );

    // Healthy again: the next trial closes it; the jobs that waited complete.
    up.set(HEALTHY);
    until("the breaker closes", Duration::from_secs(10), || {
        breaker(&w.stats).0 == BreakerState::Closed
    })
    .await;
    let recs = env.wait_terminal(&waiters, Duration::from_secs(30)).await;
    assert!(recs.iter().all(|r| r.state == "completed"), "{recs:#?}");
    let recs = env.wait_terminal(&failing, Duration::from_secs(30)).await;
    assert_eq!(recs.len(), failing.len());

    // A hang: calls cut at a deadline far past the learned call time open it again.
    let opens_before = breaker(&w.stats).1;
    up.set(HANGING);
    let hung = submit_all(&s, "hung", 4, 2_000).await;
    until("a hang opens the breaker", Duration::from_secs(15), || {
        breaker(&w.stats) == (BreakerState::Open, opens_before + 1)
    })
    .await;
    let recs = env.wait_terminal(&hung, Duration::from_secs(15)).await;
    assert_eq!(recs.len(), hung.len());
    up.set(HEALTHY);
    let after = submit_all(&s, "after", 4, 10_000).await;
    let recs = env.wait_terminal(&after, Duration::from_secs(30)).await;
    assert!(recs.iter().all(|r| r.state == "completed"), "{recs:#?}");
    assert_eq!(breaker(&w.stats).0, BreakerState::Closed);
    w.stop().await;
    server.abort();
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_after_is_honoured_within_the_budget() {
    let up = Arc::new(Upstream::default());
    let (base, server) = up.start().await;

    let env = Env::sqlite("retry-after").await;
    let backend: Arc<dyn Backend> =
        Arc::new(OpenAiBackend::new(OpenAiConfig::new(&base, "m")).unwrap());
    let cfg = env.worker_config(2, 16);
    cfg.topology.apply(&env.broker).await.unwrap();
    let w = env.start_worker(cfg, backend, system_clock()).await;
    let s = env.submitter(100, true).await;

    // 429 with Retry-After: 2. A job with 1.5 s cannot wait 2 s: it ends at once.
    up.set(LIMITED);
    let tight = submit_all(&s, "tight", 1, 1_500).await;
    let recs = env.wait_terminal(&tight, Duration::from_secs(10)).await;
    assert_eq!(recs[0].state, "expired_not_started", "{recs:#?}");
    assert_eq!(recs[0].reason.as_deref(), Some("retry:rate_limited"));
    assert!(recs[0].finished_at_ms.unwrap() < recs[0].expires_at_ms.unwrap() - 500);

    // A job with 20 s: retried, not earlier than 2 s after the 429.
    let n0 = up.requests.load(Ordering::SeqCst);
    let roomy = submit_all(&s, "roomy", 1, 20_000).await;
    until("the first call", Duration::from_secs(10), || {
        up.requests.load(Ordering::SeqCst) > n0
    })
    .await;
    up.set(HEALTHY);
    let recs = env.wait_terminal(&roomy, Duration::from_secs(30)).await;
    assert_eq!(recs[0].state, "completed", "{recs:#?}");
    let arrivals = up.arrivals.lock().unwrap().clone();
    let (first, retry) = (arrivals[n0 as usize], arrivals[n0 as usize + 1]);
    assert!(
        retry - first >= Duration::from_secs(2),
        "the retry came {:?} after the 429's Retry-After: 2",
        retry - first
    );
    // A 429 with Retry-After says the server is up: the breaker stays closed.
    assert_eq!(breaker(&w.stats), (BreakerState::Closed, 0));
    w.stop().await;
    server.abort();
    env.cleanup().await;
}
