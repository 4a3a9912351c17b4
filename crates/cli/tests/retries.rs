//! Retries inside the deadline, against the real broker and ledger: fixed-delay retry
//! queues keep their order, a retry that cannot fit is never published, and the maximum
//! number of attempts is honoured without ever changing the deadline.

use crate::common;

use common::*;
use lastcall_broker::{IncomingStream, PublishProps, Publisher};
use lastcall_core::{Envelope, EnvelopeLimits, RetryPolicy};
use lastcall_worker::clock::now_ms;
use std::time::{Duration, Instant};

/// A body put in a retry queue; after its delay the relay sends it back to `lastcall.jobs`.
async fn publish_to_retry_queue(env: &Env, queue: &str, id: &str) {
    let p = Publisher::new(&env.broker, Duration::from_secs(5))
        .await
        .unwrap();
    let now = now_ms();
    let body = serde_json::json!({"schema_version": 1, "job_id": id, "kind": "k",
        "created_at_ms": now, "expires_at_ms": now + 120_000, "payload": {}});
    let props = PublishProps {
        job_id: id.into(),
        ttl_ms: Some(120_000),
        attempt: 1,
        timestamp_s: (now / 1000) as u64,
        signature: None,
    };
    p.publish("", queue, &serde_json::to_vec(&body).unwrap(), &props)
        .await
        .unwrap();
}

/// RabbitMQ only expires messages at the head of a queue, so one queue with per-message
/// delays would hold a 1 s retry behind a 30 s one. With one queue per fixed delay, the
/// 1 s retry is back in the work queue after about 1 s although the 30 s one went first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_30s_retry_does_not_hold_back_a_1s_retry() {
    let env = Env::with_topology("order", false, |t| {
        t.retry_delays_ms = vec![1_000, 30_000];
    })
    .await;
    let mut work = IncomingStream::open(&env.broker, &env.topo.names.work_queue, 10, "watch")
        .await
        .unwrap();
    // The worker's retry relay moves due retries back to the jobs exchange.
    let relay = lastcall_worker::relay::RetryRelay::build(
        env.broker.clone(),
        Publisher::new(&env.broker, Duration::from_secs(5))
            .await
            .unwrap(),
        env.ledger.clone(),
        env.topo.names.clone(),
        system_clock(),
        "test-relay".into(),
        lastcall_core::AdmissionPolicy::default(),
    )
    .await
    .unwrap();
    let relay_stop = tokio_util::sync::CancellationToken::new();
    let relay_task = tokio::spawn(relay.run(relay_stop.clone()));
    let t0 = Instant::now();
    publish_to_retry_queue(&env, &env.topo.names.retry_queue(30_000), "slow").await;
    publish_to_retry_queue(&env, &env.topo.names.retry_queue(1_000), "fast").await;
    let m = tokio::time::timeout(Duration::from_secs(5), work.next())
        .await
        .expect("the 1 s retry must come back although a 30 s retry was queued first")
        .unwrap()
        .unwrap();
    let waited = t0.elapsed();
    let body = Envelope::parse(&m.body, &EnvelopeLimits::default(), now_ms()).unwrap();
    assert_eq!(body.job_id().as_str(), "fast");
    assert!(
        waited >= Duration::from_millis(900) && waited < Duration::from_millis(3_000),
        "came back after {waited:?}"
    );
    // Republished by the relay with the budget remaining now, not the original total:
    // RabbitMQ would have stripped the expiration had the retry been dead-lettered back.
    let ttl: i64 = m
        .expiration
        .as_deref()
        .expect("a relayed retry carries an expiration")
        .parse()
        .unwrap();
    assert!(
        ttl > 0 && ttl <= body.deadline().expires_at_ms() - now_ms() + 50,
        "ttl {ttl} exceeds the remaining budget"
    );
    assert!(ttl < 120_000, "the original total is never granted again");
    assert_eq!(m.attempt, 1, "the attempt header survives the delay");
    m.settler.ack().await.unwrap();
    // The 30 s retry is still waiting in its own queue, and nothing else reached the work
    // queue: once the broker has taken the ack, it holds nothing there, ready or
    // delivered to this consumer.
    rabbitmqctl::wait_queues(
        std::slice::from_ref(&env.topo.names.work_queue),
        "the work queue empty, nothing unacked",
        Duration::from_secs(60),
        |c| c.ready == 0 && c.unacked == 0,
    )
    .await;
    assert_eq!(env.ready(&env.topo.names.retry_queue(30_000)).await, 1);
    work.close().await;
    relay_stop.cancel();
    relay_task.await.unwrap().unwrap();
    env.cleanup().await;
}

/// `sim.fail-retryable` with 800 ms left: the shortest retry queue (1 s) cannot fit, so
/// no retry is published and the job ends `expired_not_started` (`retry:would_overshoot`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_that_cannot_fit_the_budget_is_never_published() {
    let env = Env::sqlite("overshoot").await;
    let sim = sim(0);
    let w = env
        .start_worker(env.worker_config(1, 1), sim.clone(), system_clock())
        .await;
    let sub = env
        .submitter(0, true)
        .await
        .submit(&job_of_kind("o1", "sim.fail-retryable", 800), now_ms())
        .await
        .unwrap();
    let recs = env
        .wait_terminal(&["o1".into()], Duration::from_secs(10))
        .await;
    let r = &recs[0];
    assert_eq!(r.state, "expired_not_started");
    assert_eq!(r.reason.as_deref(), Some("retry:would_overshoot"));
    assert_eq!(r.backend_calls, 1);
    assert_eq!(
        r.expires_at_ms,
        Some(sub.expires_at_ms),
        "deadline unchanged"
    );
    assert_eq!(sim.calls_for("o1"), 1);
    let rows = env.ledger.attempts("o1").await.unwrap();
    assert!(
        rows.iter().any(|a| a.model_called),
        "the failed attempt is recorded: {rows:?}"
    );
    // The outcome is recorded (above). A marker put in the 1 s retry queue now comes back
    // and runs after any retry of `o1` published by mistake before it (the queue expires
    // its head first, the relay and the worker's one slot keep that order): once the
    // marker has completed, such a retry would be back in a queue or at the backend.
    publish_to_retry_queue(&env, &env.topo.names.retry_queue(1_000), "marker").await;
    let marker = env
        .wait_terminal(&["marker".into()], Duration::from_secs(60))
        .await;
    assert_eq!(marker[0].state, "completed", "{:?}", marker[0]);
    assert_eq!(sim.calls_for("marker"), 1);
    for d in &env.topo.retry_delays_ms {
        assert_eq!(env.ready(&env.topo.names.retry_queue(*d)).await, 0);
    }
    assert_eq!(sim.calls_for("o1"), 1, "no retry reached the backend");
    assert_eq!(
        w.stats.retries.load(std::sync::atomic::Ordering::Relaxed),
        0
    );
    w.stop().await;
    env.cleanup().await;
}

/// `sim.fail-retryable` with a long deadline and 3 attempts: exactly 3 model calls, each
/// visible in the ledger, then `failed`/`retries_exhausted`, dead-lettered with the
/// original body and deadline.
async fn max_attempts(postgres: bool) {
    let env = Env::with_topology("maxatt", postgres, |t| {
        t.retry_delays_ms = vec![300, 5_000];
    })
    .await;
    let sim = sim(0);
    let mut cfg = env.worker_config(1, 2);
    // Backoff 100 ms · 2^attempt · [0.5, 1.5) always maps to the 300 ms queue here.
    cfg.policy.retry = RetryPolicy::new(3, 100, vec![300, 5_000]).unwrap();
    let w = env.start_worker(cfg, sim.clone(), system_clock()).await;
    let sub = env
        .submitter(0, true)
        .await
        .submit(&job_of_kind("m1", "sim.fail-retryable", 60_000), now_ms())
        .await
        .unwrap();
    let recs = env
        .wait_terminal(&["m1".into()], Duration::from_secs(15))
        .await;
    let r = &recs[0];
    assert_eq!(
        (r.state.as_str(), r.reason.as_deref()),
        ("failed", Some("retries_exhausted"))
    );
    assert_eq!(r.backend_calls, 3);
    assert_eq!(
        r.expires_at_ms,
        Some(sub.expires_at_ms),
        "deadline unchanged"
    );
    assert_eq!(sim.calls_for("m1"), 3);
    let rows = env.ledger.attempts("m1").await.unwrap();
    let called: Vec<i64> = rows
        .iter()
        .filter(|a| a.model_called)
        .map(|a| a.attempt)
        .collect();
    assert_eq!(
        called,
        [0, 1, 2],
        "every attempt is in the ledger: {rows:?}"
    );
    let decisions: Vec<&str> = rows.iter().filter_map(|a| a.decision.as_deref()).collect();
    assert_eq!(decisions, ["retry", "retry", "dead_letter"], "{rows:?}");
    w.stop().await;

    // The final attempt was dead-lettered byte for byte: same deadline, attempt 2.
    let d = env.peek_dead_letter().await;
    assert_eq!(d.x_death[0].reason, "rejected");
    assert_eq!(d.attempt, 2);
    let body = Envelope::parse(&d.body, &EnvelopeLimits::default(), sub.created_at_ms).unwrap();
    assert_eq!(body.deadline().expires_at_ms(), sub.expires_at_ms);
    let dlq = env.drain_dead_letters(false).await;
    assert_eq!(
        dlq.kept_existing.load(std::sync::atomic::Ordering::Relaxed),
        1,
        "the worker's outcome is kept"
    );
    let after = env.ledger.get("m1").await.unwrap().unwrap();
    assert_eq!(after.reason.as_deref(), Some("retries_exhausted"));
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_attempts_is_honoured_sqlite() {
    max_attempts(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_attempts_is_honoured_postgres() {
    max_attempts(true).await;
}

/// A retry whose deadline passes during its delay is never republished: the relay records
/// `expired_not_started` (`retry:deadline_passed`) and the work queue stays empty.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_that_expires_during_its_delay_is_recorded_not_relayed() {
    let env = Env::with_topology("relaystale", false, |t| {
        t.retry_delays_ms = vec![1_000, 30_000];
    })
    .await;
    let p = Publisher::new(&env.broker, Duration::from_secs(5))
        .await
        .unwrap();
    let now = now_ms();
    let body = serde_json::json!({"schema_version": 1, "job_id": "stale-retry", "kind": "k",
        "created_at_ms": now, "expires_at_ms": now + 400, "payload": {}});
    let props = PublishProps {
        job_id: "stale-retry".into(),
        ttl_ms: Some(60_000),
        attempt: 1,
        timestamp_s: 0,
        signature: None,
    };
    p.publish(
        "",
        &env.topo.names.retry_queue(1_000),
        &serde_json::to_vec(&body).unwrap(),
        &props,
    )
    .await
    .unwrap();
    let sim = sim(0);
    let w = env
        .start_worker(env.worker_config(1, 2), sim.clone(), system_clock())
        .await;
    let recs = env
        .wait_terminal(&["stale-retry".into()], Duration::from_secs(10))
        .await;
    assert_eq!(
        (recs[0].state.as_str(), recs[0].reason.as_deref()),
        ("expired_not_started", Some("retry:deadline_passed"))
    );
    assert_eq!(recs[0].expires_at_ms, Some(now + 400), "deadline unchanged");
    w.stop().await;
    assert_eq!(queued_work(&env).await, 0, "nothing was republished");
    assert_eq!(sim.calls(), 0);
    env.cleanup().await;
}

/// The relay applies the admission rule of every other publish, not just "budget left":
/// a retry whose remaining budget (after the clock margin) is below the job's minimum
/// useful runtime is recorded `expired_not_started` (`retry:below_min_runtime`), never
/// republished.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_refuses_a_retry_below_its_minimum_runtime() {
    let env = Env::with_topology("relaymin", false, |t| {
        t.retry_delays_ms = vec![1_000, 30_000];
    })
    .await;
    let p = Publisher::new(&env.broker, Duration::from_secs(5))
        .await
        .unwrap();
    let now = now_ms();
    // 20 s left after the 1 s delay, but the job needs 30 s to be useful.
    let body = serde_json::json!({"schema_version": 1, "job_id": "short-retry", "kind": "k",
        "created_at_ms": now, "expires_at_ms": now + 21_000, "min_runtime_ms": 30_000,
        "payload": {}});
    let props = PublishProps {
        job_id: "short-retry".into(),
        ttl_ms: Some(21_000),
        attempt: 1,
        timestamp_s: 0,
        signature: None,
    };
    p.publish(
        "",
        &env.topo.names.retry_queue(1_000),
        &serde_json::to_vec(&body).unwrap(),
        &props,
    )
    .await
    .unwrap();
    let sim = sim(0);
    let w = env
        .start_worker(env.worker_config(1, 2), sim.clone(), system_clock())
        .await;
    let recs = env
        .wait_terminal(&["short-retry".into()], Duration::from_secs(10))
        .await;
    assert_eq!(
        (recs[0].state.as_str(), recs[0].reason.as_deref()),
        ("expired_not_started", Some("retry:below_min_runtime")),
        "{:?}",
        recs[0]
    );
    w.stop().await;
    assert_eq!(queued_work(&env).await, 0, "nothing was republished");
    assert_eq!(sim.calls(), 0);
    env.cleanup().await;
}

async fn queued_work(env: &Env) -> u32 {
    env.ready(&env.topo.names.work_queue).await
        + env.ready(&env.topo.names.retry_ready_queue()).await
}
