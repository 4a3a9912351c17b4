//! The seed's four broker cases (seed 000), against the real RabbitMQ and a real ledger.
//! In every case the model is called zero times for these jobs.

use crate::common;

use common::*;
use lastcall_broker::IncomingStream;
use lastcall_core::{Envelope, EnvelopeLimits};
use lastcall_worker::clock::now_ms;
use std::time::Duration;

fn assert_no_calls(sim: &lastcall_backend::sim::SimBackend, recs: &[lastcall_store::JobRecord]) {
    for r in recs {
        assert_eq!(
            r.backend_calls, 0,
            "{} has model calls in the ledger",
            r.job_id
        );
        assert_eq!(
            sim.calls_for(&r.job_id),
            0,
            "{} reached the backend",
            r.job_id
        );
    }
}

/// A live worker on `sim`, proven live: a control job with a long budget is called and
/// completed. The cases' "no model call" checks run against it, so they cannot pass only
/// because nothing was listening.
async fn live_worker(
    env: &Env,
    sim: &std::sync::Arc<lastcall_backend::sim::SimBackend>,
) -> Running {
    let w = env
        .start_worker(env.worker_config(1, 1), sim.clone(), system_clock())
        .await;
    env.submitter(0, true)
        .await
        .submit(&job("control", 60_000), now_ms())
        .await
        .unwrap();
    let recs = env
        .wait_terminal(&["control".into()], Duration::from_secs(15))
        .await;
    assert_eq!(recs[0].state, "completed", "{:?}", recs[0]);
    assert_eq!(sim.calls_for("control"), 1, "the worker calls the model");
    w
}

/// Case 1: a job with 600 ms TTL left in the queue for over 600 ms is dead-lettered with
/// reason `expired`; its `expiration` property is gone and its body's deadline unchanged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn case1_queue_dwell_past_ttl_is_dead_lettered_as_expired() {
    let env = Env::sqlite("case1").await;
    let sub = env
        .submitter(0, true)
        .await
        .submit(&job("c1", 600), now_ms())
        .await
        .unwrap();
    assert!(
        sub.ttl_ms <= 600 && sub.ttl_ms > 500,
        "published with the remaining budget, got {}",
        sub.ttl_ms
    );
    env.wait_ready(&env.topo.names.dead_queue, 1).await;
    assert_eq!(
        env.ready(&env.topo.names.work_queue).await,
        0,
        "the work queue no longer holds the job"
    );

    let m = env.peek_dead_letter().await;
    assert_eq!(
        m.expiration, None,
        "RabbitMQ strips the expiration when dead-lettering"
    );
    let death = &m.x_death[0];
    assert_eq!(death.reason, "expired");
    assert_eq!(death.queue, env.topo.names.work_queue);
    assert_eq!(
        death.original_expiration.as_deref(),
        Some(sub.ttl_ms.to_string().as_str())
    );
    let body = Envelope::parse(&m.body, &EnvelopeLimits::default(), sub.created_at_ms).unwrap();
    assert_eq!(
        body.deadline().expires_at_ms(),
        sub.expires_at_ms,
        "deadline unchanged"
    );

    // A worker runs from here on: the expired job never reaches it.
    let sim = sim(0);
    let w = live_worker(&env, &sim).await;
    let dlq = env.drain_dead_letters(false).await;
    assert_eq!(dlq.recorded.load(std::sync::atomic::Ordering::Relaxed), 1);
    let recs = env
        .wait_terminal(&["c1".into()], Duration::from_secs(5))
        .await;
    assert_eq!(recs[0].state, "expired_before_receive");
    assert_eq!(recs[0].expires_at_ms, Some(sub.expires_at_ms));
    assert_no_calls(&sim, &recs);
    assert_eq!(
        w.stats.received.load(std::sync::atomic::Ordering::Relaxed),
        1,
        "the worker received only the control job"
    );
    w.stop().await;
    env.cleanup().await;
}

/// Case 2: prefetch 1, three jobs: one is delivered and refused before start after
/// waiting locally; the other two expire at the broker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn case2_prefetch_one_holds_one_and_two_expire_at_the_broker() {
    let env = Env::sqlite("case2").await;
    let sim = sim(0);
    let mut cfg = env.worker_config(1, 1);
    cfg.hold_before_admission = Duration::from_millis(1_050);
    let w = env.start_worker(cfg, sim.clone(), system_clock()).await;
    let s = env.submitter(0, true).await;
    let ids: Vec<String> = (1..=3).map(|i| format!("c2-{i}")).collect();
    for id in &ids {
        s.submit(&job(id, 600), now_ms()).await.unwrap();
    }
    let first = env.wait_terminal(&ids[..1], Duration::from_secs(10)).await;
    assert_eq!(first[0].state, "expired_not_started");
    assert_eq!(
        first[0].reason.as_deref(),
        Some("admission:deadline_passed")
    );
    let received = first[0].received_at_ms.unwrap();
    assert!(
        received < first[0].expires_at_ms.unwrap(),
        "delivered in time"
    );
    assert!(
        first[0].checked_at_ms.unwrap() >= first[0].expires_at_ms.unwrap() - 100,
        "refused at the last check"
    );
    assert_eq!(
        w.stats.received.load(std::sync::atomic::Ordering::Relaxed),
        1,
        "prefetch 1: only one delivery"
    );
    w.stop().await;
    // The other two expired at the broker and were dead-lettered.
    env.wait_ready(&env.topo.names.dead_queue, 2).await;
    env.drain_dead_letters(false).await;
    let recs = env.wait_terminal(&ids, Duration::from_secs(5)).await;
    let states: Vec<&str> = recs.iter().map(|r| r.state.as_str()).collect();
    assert_eq!(
        states,
        [
            "expired_not_started",
            "expired_before_receive",
            "expired_before_receive"
        ]
    );
    assert_no_calls(&sim, &recs);
    assert_eq!(sim.calls(), 0);
    env.cleanup().await;
}

/// Case 3: prefetch 3, three jobs: all are delivered in time, then all three are refused
/// as `expired_not_started` after waiting.
async fn case3(env: Env) {
    let sim = sim(0);
    let mut cfg = env.worker_config(3, 3);
    cfg.hold_before_admission = Duration::from_millis(1_050);
    let w = env.start_worker(cfg, sim.clone(), system_clock()).await;
    let s = env.submitter(0, true).await;
    let ids: Vec<String> = (1..=3).map(|i| format!("c3-{i}")).collect();
    for id in &ids {
        s.submit(&job(id, 600), now_ms()).await.unwrap();
    }
    let recs = env.wait_terminal(&ids, Duration::from_secs(10)).await;
    for r in &recs {
        assert_eq!(r.state, "expired_not_started", "{r:?}");
        assert!(
            r.received_at_ms.unwrap() < r.expires_at_ms.unwrap(),
            "delivered before the deadline"
        );
        assert!(r.checked_at_ms.unwrap() > r.received_at_ms.unwrap());
    }
    assert_no_calls(&sim, &recs);
    assert_eq!(
        w.stats
            .backend_calls
            .load(std::sync::atomic::Ordering::Relaxed),
        0
    );
    w.stop().await;
    assert_eq!(
        env.ready(&env.topo.names.dead_queue).await,
        0,
        "acked, not dead-lettered (default expired action)"
    );
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn case3_prefetch_three_all_delivered_then_refused_sqlite() {
    case3(Env::sqlite("case3").await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn case3_prefetch_three_all_delivered_then_refused_postgres() {
    case3(Env::postgres("case3pg").await).await;
}

/// Case 4: a job held past its deadline and nacked with requeue ends in the DLX with its
/// deadline unchanged; it is not delivered again from the work queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn case4_requeue_after_expiry_ends_in_the_dlx() {
    let env = Env::sqlite("case4").await;
    let sim = sim(0);
    let sub = env
        .submitter(0, true)
        .await
        .submit(&job("c4", 600), now_ms())
        .await
        .unwrap();
    // A consumer (not lastcall's worker, which never requeues stale work) holds the job.
    let mut raw = IncomingStream::open(&env.broker, &env.topo.names.work_queue, 1, "holder")
        .await
        .unwrap();
    let m = tokio::time::timeout(Duration::from_secs(5), raw.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    // Hold it past its 600 ms deadline (the sleep lets the deadline pass on purpose).
    tokio::time::sleep(Duration::from_millis(800)).await;
    m.settler.requeue().await.unwrap();
    // First the positive event (it reached the dead-letter queue), then the negative one.
    env.wait_ready(&env.topo.names.dead_queue, 1).await;
    let again = tokio::time::timeout(Duration::from_millis(300), raw.next()).await;
    assert!(
        again.is_err(),
        "the stale job must not come back from the work queue"
    );
    raw.close().await;
    assert_eq!(env.ready(&env.topo.names.work_queue).await, 0);
    // A worker runs from here on: the stale job never reaches it.
    let w = live_worker(&env, &sim).await;

    let d = env.peek_dead_letter().await;
    assert_eq!(d.x_death[0].reason, "expired");
    let body = Envelope::parse(&d.body, &EnvelopeLimits::default(), sub.created_at_ms).unwrap();
    assert_eq!(
        body.deadline().expires_at_ms(),
        sub.expires_at_ms,
        "deadline unchanged"
    );

    env.drain_dead_letters(false).await;
    let recs = env
        .wait_terminal(&["c4".into()], Duration::from_secs(5))
        .await;
    assert_eq!(recs[0].state, "expired_before_receive");
    assert_eq!(recs[0].expires_at_ms, Some(sub.expires_at_ms));
    assert_no_calls(&sim, &recs);
    assert_eq!(
        w.stats.received.load(std::sync::atomic::Ordering::Relaxed),
        1,
        "the worker received only the control job"
    );
    w.stop().await;
    env.cleanup().await;
}
