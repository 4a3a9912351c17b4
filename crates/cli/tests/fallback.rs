//! Fallback routes (issue #32 item 4): a kind routed to an ordered list of backends, against
//! a worker with two OpenAI-compatible backends — two fault-injecting chat-completions
//! servers of `common::upstream`, over real HTTP — with real RabbitMQ and the ledger.
//!
//! - The first backend fails (503) until its breaker opens: the jobs of the kind complete
//!   on the second (the failed ones on their retry), the ledger says the second served
//!   them, and the first sees no call while its breaker is open.
//! - The first backend is slow (its learned call time longer than the jobs' budgets), the
//!   second fast: once the first's time is learned, the jobs go to the second without a
//!   call to the first.
//! - A job waiting in the buffer for the one slot, past its latest useful start on the
//!   slow first backend, is not ended: it goes to the fast second when the slot frees.

use crate::common;

use common::upstream::{FAILING, Upstream, openai, submit_all, until};
use common::*;
use lastcall_backend::route::{Route, RouteTable, RoutedBackend};
use lastcall_core::breaker::{BreakerPolicy, BreakerState};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

/// The jobs' kind (`common::job`'s) routed to `first`, then `second`.
fn router(first: &str, second: &str) -> RoutedBackend {
    let table = RouteTable {
        default: None,
        routes: vec![Route {
            kind: "incident.summary".into(),
            backend: ["first", "second"].into_iter().collect(),
            model: None,
            max_tokens: None,
        }],
    };
    RoutedBackend::new(
        table,
        [
            ("first".to_string(), openai(first)),
            ("second".to_string(), openai(second)),
        ],
    )
    .unwrap()
}

fn breaker_of(w: &lastcall_worker::stats::WorkerStats, backend: &str) -> Option<BreakerState> {
    let view = w.breakers.lock().unwrap();
    view.get(backend).map(|v| v.state)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_first_backends_breaker_open_jobs_complete_on_the_second() {
    let (first, second) = (Arc::new(Upstream::default()), Arc::new(Upstream::default()));
    let (first_base, first_server) = first.start().await;
    let (second_base, second_server) = second.start().await;
    first.set(FAILING);

    let env = Env::sqlite("fallback-breaker").await;
    let mut cfg = env.worker_config(2, 32);
    cfg.breaker = BreakerPolicy {
        failures_to_open: 3,
        // Long enough that no trial goes to the first backend during the test.
        cool_down_ms: 60_000,
        max_cool_down_ms: 60_000,
        ..Default::default()
    };
    cfg.topology.apply(&env.broker).await.unwrap();
    let router = Arc::new(router(&first_base, &second_base));
    let w = env.start_worker(cfg, router, system_clock()).await;
    let s = env.submitter(100, true).await;

    // The first three calls fail on the first backend and open its breaker; those jobs
    // are retried (after 1 s) and their retries go to the second.
    let early = submit_all(&s, "early", 3, 30_000).await;
    until(
        "the first backend's breaker opens",
        Duration::from_secs(15),
        || breaker_of(&w.stats, "first") == Some(BreakerState::Open),
    )
    .await;
    let at_open = first.requests.load(Ordering::SeqCst);
    assert_eq!(at_open, 3, "three failures open it");
    let later = submit_all(&s, "later", 8, 10_000).await;

    let all: Vec<String> = early.iter().chain(&later).cloned().collect();
    let recs = env.wait_terminal(&all, Duration::from_secs(30)).await;
    for r in &recs {
        assert_eq!(r.state, "completed", "{r:#?}");
        assert_eq!(r.backend.as_deref(), Some("second"), "{r:#?}");
    }
    assert_eq!(
        first.requests.load(Ordering::SeqCst),
        at_open,
        "no call to the first backend while its breaker is open"
    );
    assert_eq!(second.answered.load(Ordering::SeqCst), all.len() as u64);
    assert_eq!(
        w.stats.fallback_calls.load(Ordering::Relaxed),
        all.len() as u64
    );
    // The failed attempts were the first backend's: each early job made two calls.
    for id in &early {
        let r = recs.iter().find(|r| &r.job_id == id).unwrap();
        assert_eq!(r.backend_calls, 2, "{r:#?}");
    }
    assert_eq!(breaker_of(&w.stats, "second"), Some(BreakerState::Closed));

    w.stop().await;
    first_server.abort();
    second_server.abort();
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn once_the_first_backend_is_learned_too_slow_jobs_go_to_the_second() {
    let (first, second) = (Arc::new(Upstream::default()), Arc::new(Upstream::default()));
    first.latency_ms.store(1_200, Ordering::SeqCst);
    let (first_base, first_server) = first.start().await;
    let (second_base, second_server) = second.start().await;

    let env = Env::sqlite("fallback-slow").await;
    let cfg = env.worker_config(2, 32);
    cfg.topology.apply(&env.broker).await.unwrap();
    let router = Arc::new(router(&first_base, &second_base));
    let w = env.start_worker(cfg, router, system_clock()).await;
    let s = env.submitter(100, true).await;

    // Nothing is learned yet: the first backend serves, and its 1.2 s calls are learned.
    let warm = submit_all(&s, "warm", 3, 20_000).await;
    let recs = env.wait_terminal(&warm, Duration::from_secs(30)).await;
    for r in &recs {
        assert_eq!(r.state, "completed", "{r:#?}");
        assert_eq!(r.backend.as_deref(), Some("first"), "{r:#?}");
    }
    assert_eq!(first.requests.load(Ordering::SeqCst), 3);

    // Budgets of 1 s: the first backend's learned time does not fit, the second's (not
    // learned yet, then 150 ms) does.
    let short = submit_all(&s, "short", 6, 1_000).await;
    let recs = env.wait_terminal(&short, Duration::from_secs(20)).await;
    for r in &recs {
        assert_eq!(r.state, "completed", "{r:#?}");
        assert_eq!(r.backend.as_deref(), Some("second"), "{r:#?}");
    }
    assert_eq!(
        first.requests.load(Ordering::SeqCst),
        3,
        "no call to the first backend after its time was learned"
    );
    assert_eq!(second.answered.load(Ordering::SeqCst), short.len() as u64);
    assert_eq!(
        w.stats.fallback_calls.load(Ordering::Relaxed),
        short.len() as u64
    );

    // A job with room for the first backend still goes to it: the route's order holds.
    let roomy = submit_all(&s, "roomy", 1, 20_000).await;
    let recs = env.wait_terminal(&roomy, Duration::from_secs(30)).await;
    assert_eq!(recs[0].state, "completed", "{:#?}", recs[0]);
    assert_eq!(recs[0].backend.as_deref(), Some("first"), "{:#?}", recs[0]);

    w.stop().await;
    first_server.abort();
    second_server.abort();
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_waiting_past_its_latest_start_on_the_first_backend_goes_to_the_second() {
    let (first, second) = (Arc::new(Upstream::default()), Arc::new(Upstream::default()));
    first.latency_ms.store(1_000, Ordering::SeqCst);
    let (first_base, first_server) = first.start().await;
    let (second_base, second_server) = second.start().await;

    let env = Env::sqlite("fallback-buffer").await;
    let mut cfg = env.worker_config(1, 32);
    // The job must wait in the buffer, not be refused at receipt for its expected wait.
    cfg.policy.refuse_on_expected_wait = false;
    cfg.topology.apply(&env.broker).await.unwrap();
    let router = Arc::new(router(&first_base, &second_base));
    let w = env.start_worker(cfg, router, system_clock()).await;
    let s = env.submitter(100, true).await;

    // The first backend's 1 s calls are learned.
    let warm = submit_all(&s, "warm", 3, 30_000).await;
    let recs = env.wait_terminal(&warm, Duration::from_secs(30)).await;
    assert!(recs.iter().all(|r| r.state == "completed"), "{recs:#?}");

    // A long job holds the one slot on the first backend for 1 s …
    let blocker = submit_all(&s, "blocker", 1, 30_000).await;
    until(
        "the blocker's call reaches the first backend",
        Duration::from_secs(10),
        || first.requests.load(Ordering::SeqCst) == 4,
    )
    .await;
    // … while a job of 1.6 s waits for it: its latest start on the first backend (1.1 s
    // before its deadline) passes about 0.5 s before the slot frees; on the second it has
    // room still.
    let waiter = submit_all(&s, "waiter", 1, 1_600).await;
    let recs = env.wait_terminal(&waiter, Duration::from_secs(10)).await;
    assert_eq!(recs[0].state, "completed", "{:#?}", recs[0]);
    assert_eq!(recs[0].backend.as_deref(), Some("second"), "{:#?}", recs[0]);
    let recs = env.wait_terminal(&blocker, Duration::from_secs(10)).await;
    assert_eq!(recs[0].backend.as_deref(), Some("first"), "{:#?}", recs[0]);
    assert_eq!(first.requests.load(Ordering::SeqCst), 4);

    w.stop().await;
    first_server.abort();
    second_server.abort();
    env.cleanup().await;
}
