//! Worker and publisher behaviour against the real broker and ledger: rejections, the
//! deadline during a call, the expired action, refusals before publishing, topology
//! conflicts, the fail-closed clock mode and a store outage.

use crate::common;

use common::*;
use lastcall_broker::topology::QueueType;
use lastcall_broker::{Broker, PublishProps, Publisher, TopologyError};
use lastcall_core::ExpiredAction;
use lastcall_store::ListFilter;
use lastcall_worker::clock::{FixedSyncClock, now_ms};
use lastcall_worker::{ClockSyncMode, SubmitError, SyncState, WorkerStats};
use serde_json::json;
use sqlx::Connection;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

async fn publish_raw(env: &Env, body: &[u8], id: &str) {
    let p = Publisher::new(&env.broker, Duration::from_secs(5))
        .await
        .unwrap();
    let props = PublishProps {
        job_id: id.into(),
        ttl_ms: Some(60_000),
        attempt: 0,
        timestamp_s: 0,
        signature: None,
    };
    p.publish(&env.topo.names.jobs_exchange, "raw", body, &props)
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_envelopes_are_rejected_to_the_dlx_once_and_never_loop() {
    let env = Env::sqlite("invalid").await;
    let sim = sim(0);
    let w = env
        .start_worker(env.worker_config(2, 4), sim.clone(), system_clock())
        .await;
    let now = now_ms();
    publish_raw(&env, b"{not json", "x").await;
    let missing = json!({"schema_version": 1, "job_id": "bad-payload", "kind": "k", "created_at_ms": now, "expires_at_ms": now + 60_000});
    publish_raw(&env, &serde_json::to_vec(&missing).unwrap(), "bad-payload").await;
    let v2 = json!({"schema_version": 2, "job_id": "bad-schema", "kind": "k", "created_at_ms": now, "expires_at_ms": now + 60_000, "payload": {}});
    publish_raw(&env, &serde_json::to_vec(&v2).unwrap(), "bad-schema").await;
    // No job id in the body: the message_id property names it.
    let synthetic = "x".to_string();
    let ids = vec![
        synthetic.clone(),
        "bad-payload".to_string(),
        "bad-schema".to_string(),
    ];
    let recs = env.wait_terminal(&ids, Duration::from_secs(10)).await;
    let by_id = |id: &str| recs.iter().find(|r| r.job_id == id).unwrap().clone();
    assert_eq!(by_id(&synthetic).reason.as_deref(), Some("invalid_json"));
    let p = by_id("bad-payload");
    assert_eq!(
        (p.state.as_str(), p.reason.as_deref()),
        ("rejected", Some("missing_field"))
    );
    assert!(
        p.error.unwrap().contains("payload"),
        "the error names the field"
    );
    assert_eq!(
        by_id("bad-schema").reason.as_deref(),
        Some("unsupported_schema")
    );
    // All three are recorded (above). A message handed back to the queue stays in it,
    // ready or unacked, until it is settled for good: once the broker holds none, a
    // redelivery, if any, has been received and shows in the count.
    rabbitmqctl::wait_queues(
        std::slice::from_ref(&env.topo.names.work_queue),
        "the work queue empty, nothing unacked",
        Duration::from_secs(60),
        |c| c.ready == 0 && c.unacked == 0,
    )
    .await;
    assert_eq!(
        w.stats.received.load(Ordering::Relaxed),
        3,
        "rejected once each, never redelivered"
    );
    w.stop().await;
    assert_eq!(
        env.ready(&env.topo.names.dead_queue).await,
        3,
        "all three went to the DLX"
    );
    // The dead-letter processor keeps the worker's outcome and parks malformed bodies.
    let dlq = env.drain_dead_letters(true).await;
    assert_eq!(dlq.kept_existing.load(Ordering::Relaxed), 3);
    assert_eq!(dlq.parked.load(Ordering::Relaxed), 3);
    assert_eq!(env.ready(&format!("{}.parked", env.prefix)).await, 3);
    assert_eq!(sim.calls(), 0);
    env.cleanup().await;
}

/// The worker's timers run on its own clock (`Clock::sleep_until`), not on tokio's: on a
/// manual clock moved a minute forward, the running call is cut at its deadline and the
/// buffered job leaves at its latest useful start, both at once — the real deadlines are
/// still a minute away, and on tokio's timers neither would end within the 15 s waited.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_workers_deadline_timers_run_on_its_clock() {
    let env = Env::sqlite("manual-clock").await;
    let sim = sim(0);
    let clock = lastcall_worker::clock::ManualClock::new(now_ms());
    let w = env
        .start_worker(env.worker_config(1, 2), sim.clone(), clock.clone())
        .await;
    let s = env.submitter(0, true).await;
    let ids = ["mc-running".to_owned(), "mc-buffered".to_owned()];
    s.submit(
        &job_with(&ids[0], 60_000, json!({"sim_latency_ms": 600_000})),
        now_ms(),
    )
    .await
    .unwrap();
    // The second job only once the first holds the slot (submitted together, they race
    // for it).
    let until = Instant::now() + Duration::from_secs(10);
    while sim.calls_for(&ids[0]) < 1 {
        assert!(Instant::now() < until, "the first job's call started");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    s.submit(&job(&ids[1], 60_000), now_ms()).await.unwrap();
    while w.stats.received.load(Ordering::Relaxed) < 2 {
        assert!(Instant::now() < until, "the second job is buffered");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        env.ledger.get(&ids[1]).await.unwrap().unwrap().state,
        "accepted"
    );
    clock.advance(61_000);
    let recs = env.wait_terminal(&ids, Duration::from_secs(15)).await;
    assert_eq!(recs[0].state, "deadline_exceeded", "{:?}", recs[0]);
    assert!(recs[0].cancel_requested);
    assert_eq!(recs[0].backend_calls, 1);
    assert_eq!(recs[1].state, "expired_not_started", "{:?}", recs[1]);
    assert_eq!(recs[1].backend_calls, 0);
    assert_eq!(sim.calls(), 1, "the buffered job never reached the model");
    w.stop().await;
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_running_at_the_deadline_is_cancelled_as_deadline_exceeded() {
    let env = Env::sqlite("exceeded").await;
    let sim = sim(0);
    let w = env
        .start_worker(env.worker_config(1, 2), sim.clone(), system_clock())
        .await;
    let s = env.submitter(100, true).await;
    s.submit(
        &job_with("slow", 1_000, json!({"sim_latency_ms": 5_000})),
        now_ms(),
    )
    .await
    .unwrap();
    s.submit(
        &job_with("fast", 10_000, json!({"sim_latency_ms": 10})),
        now_ms(),
    )
    .await
    .unwrap();
    let recs = env
        .wait_terminal(&["slow".into(), "fast".into()], Duration::from_secs(10))
        .await;
    let slow = &recs[0];
    assert_eq!(slow.state, "deadline_exceeded");
    assert!(slow.cancel_requested);
    assert_eq!(slow.cancel_confirmed, Some(true));
    assert_eq!(slow.backend_calls, 1);
    assert!(
        slow.finished_at_ms.unwrap() <= slow.expires_at_ms.unwrap() + 200,
        "cancelled at the deadline, not after the 5 s call"
    );
    assert_eq!(recs[1].state, "completed");
    assert!(recs[1].result.as_deref().unwrap().contains("fast"));
    assert_eq!(sim.calls_for("slow"), 1);
    // The acked-at trace writes ride along with later group commits or, with the worker
    // idle as here, are written by the idle writer shortly after: no shutdown needed.
    let t = Instant::now();
    for id in ["slow", "fast"] {
        while env.ledger.attempts(id).await.unwrap()[0]
            .acked_at_ms
            .is_none()
        {
            assert!(
                t.elapsed() < Duration::from_secs(10),
                "{id}: acked_at_ms not written while the worker runs"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    w.stop().await;
    for id in ["slow", "fast"] {
        let rows = env.ledger.attempts(id).await.unwrap();
        assert!(rows[0].acked_at_ms.is_some(), "{id}: {rows:?}");
        assert!(
            rows[0].acked_at_ms >= rows[0].finished_at_ms,
            "acked after the call finished"
        );
    }
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_action_dead_letter_records_then_quarantines() {
    let env = Env::sqlite("quarantine").await;
    let sim = sim(0);
    let mut cfg = env.worker_config(1, 1);
    cfg.policy.expired_action = ExpiredAction::DeadLetter;
    cfg.hold_before_admission = Duration::from_millis(700);
    let w = env.start_worker(cfg, sim.clone(), system_clock()).await;
    env.submitter(0, true)
        .await
        .submit(&job("q1", 500), now_ms())
        .await
        .unwrap();
    let recs = env
        .wait_terminal(&["q1".into()], Duration::from_secs(10))
        .await;
    assert_eq!(recs[0].state, "expired_not_started");
    w.stop().await;
    assert_eq!(env.ready(&env.topo.names.dead_queue).await, 1);
    let dlq = env.drain_dead_letters(false).await;
    assert_eq!(
        dlq.kept_existing.load(Ordering::Relaxed),
        1,
        "the worker's outcome is kept"
    );
    assert_eq!(
        env.ledger.get("q1").await.unwrap().unwrap().state,
        "expired_not_started"
    );
    assert_eq!(sim.calls(), 0);
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_or_short_jobs_are_refused_before_publishing() {
    let env = Env::sqlite("refuse").await;
    let s = env.submitter(100, true).await;
    let err = s.submit(&job("too-late", 50), now_ms()).await.unwrap_err();
    assert!(matches!(err, SubmitError::Expired { .. }), "{err}");
    assert!(err.to_string().contains("publish:deadline_passed"), "{err}");
    let mut short = job("too-short", 1_000);
    short.min_runtime_ms = Some(5_000);
    let err = s.submit(&short, now_ms()).await.unwrap_err();
    assert!(err.to_string().contains("below_min_runtime"), "{err}");
    let mut bad = job("bad id!", 10_000);
    bad.kind = "k".into();
    let err = s.submit(&bad, now_ms()).await.unwrap_err();
    assert!(err.to_string().contains("job_id"), "{err}");
    // No sleep needed: a submit returns only after the broker confirmed its publish, so
    // anything published would already be in the queue.
    assert_eq!(
        env.ready(&env.topo.names.work_queue).await,
        0,
        "nothing was published"
    );
    assert!(
        env.ledger
            .list(&ListFilter::default())
            .await
            .unwrap()
            .is_empty(),
        "nothing was accepted"
    );
    // An accepted job is in the inventory with its deadline and has the remaining budget as TTL.
    let ok = s.submit(&job("fine", 30_000), now_ms()).await.unwrap();
    assert!(ok.ttl_ms <= 30_000 && ok.ttl_ms > 29_000);
    let rec = env.ledger.get("fine").await.unwrap().unwrap();
    assert_eq!(
        (rec.state.as_str(), rec.expires_at_ms),
        ("accepted", Some(ok.expires_at_ms))
    );
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn topology_is_idempotent_and_conflicts_say_what_differs() {
    let env = Env::sqlite("topo").await;
    env.topo.apply(&env.broker).await.unwrap();
    env.topo.apply(&env.broker).await.unwrap();
    let mut quorum = env.topo.clone();
    quorum.queue_type = QueueType::Quorum;
    let err = quorum.apply(&env.broker).await.unwrap_err();
    match &err {
        TopologyError::Conflict { name, detail, .. } => {
            assert_eq!(name, &env.topo.names.work_queue);
            assert!(
                detail.contains("x-queue-type") || detail.contains("inequivalent"),
                "{detail}"
            );
        }
        other => panic!("expected a conflict, got {other}"),
    }
    assert!(
        err.to_string().contains("--queue-type"),
        "the error says what to do: {err}"
    );
    // A quorum topology on its own prefix works and is idempotent too.
    let broker = Broker::connect(AMQP).await.unwrap();
    let mut q = lastcall_broker::Topology::new(&format!("{}-q", env.prefix));
    q.queue_type = QueueType::Quorum;
    q.apply(&broker).await.unwrap();
    q.apply(&broker).await.unwrap();
    q.delete(&broker).await.unwrap();
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_closed_clock_mode_admits_nothing_while_sync_is_unknown() {
    let env = Env::sqlite("clock").await;
    let sim = sim(0);
    let mut cfg = env.worker_config(1, 2);
    cfg.clock_sync = ClockSyncMode::Require;
    let unknown = Arc::new(FixedSyncClock {
        state: SyncState::Unknown,
    });
    let w = env.start_worker(cfg.clone(), sim.clone(), unknown).await;
    env.submitter(0, true)
        .await
        .submit(&job("unsynced", 800), now_ms())
        .await
        .unwrap();
    let recs = env
        .wait_terminal(&["unsynced".into()], Duration::from_secs(10))
        .await;
    assert_eq!(recs[0].state, "expired_not_started");
    assert_eq!(sim.calls(), 0);
    w.stop().await;
    let synced = Arc::new(FixedSyncClock {
        state: SyncState::Synced { max_error_ms: 1 },
    });
    let w = env.start_worker(cfg, sim.clone(), synced).await;
    env.submitter(0, true)
        .await
        .submit(&job("synced", 5_000), now_ms())
        .await
        .unwrap();
    let recs = env
        .wait_terminal(&["synced".into()], Duration::from_secs(10))
        .await;
    assert_eq!(recs[0].state, "completed");
    w.stop().await;
    env.cleanup().await;
}

/// Shutdown while a job waits for clock sync (`--clock-sync require`): the job never
/// started, so it is handed back to the broker unrecorded — no task panics (this state
/// once reached an `unreachable!`), no model call, and the message is in the queue again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_during_the_clock_wait_hands_the_job_back() {
    let env = Env::sqlite("clockstop").await;
    let sim = sim(0);
    let mut cfg = env.worker_config(1, 2);
    cfg.clock_sync = ClockSyncMode::Require;
    let unsynced = Arc::new(FixedSyncClock {
        state: SyncState::Unsynced,
    });
    let w = env.start_worker(cfg, sim.clone(), unsynced).await;
    env.submitter(0, true)
        .await
        .submit(&job("waits-for-clock", 120_000), now_ms())
        .await
        .unwrap();
    // The job is held locally (the clock wait counts as waiting), not settled.
    let until = Instant::now() + Duration::from_secs(10);
    while w.stats.waiting.load(std::sync::atomic::Ordering::Relaxed) < 1 {
        assert!(
            Instant::now() < until,
            "the job never reached the clock wait"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let stats = w.stats.clone();
    w.stop().await;
    assert_eq!(
        WorkerStats::get(&stats.task_panics),
        0,
        "no job task panicked"
    );
    assert_eq!(sim.calls(), 0);
    let rec = env.ledger.get("waits-for-clock").await.unwrap().unwrap();
    assert_eq!(rec.state, "accepted", "handed back unrecorded: {rec:?}");
    let until = Instant::now() + Duration::from_secs(10);
    while env.ready(&env.topo.names.work_queue).await != 1 {
        assert!(Instant::now() < until, "the job is back in the work queue");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    env.cleanup().await;
}

/// The store goes away mid-run (SQLite locked by another connection): nothing is acked
/// without a stored outcome, intake pauses, and after recovery every job is accounted for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_outage_withholds_acks_and_loses_nothing() {
    let env = Env::sqlite("outage").await;
    let sim = sim(0);
    let w = env
        .start_worker(env.worker_config(3, 6), sim.clone(), system_clock())
        .await;
    let s = env.submitter(0, true).await;
    let ids: Vec<String> = (1..=3).map(|i| format!("o-{i}")).collect();
    for id in &ids {
        s.submit(
            &job_with(id, 60_000, json!({"sim_latency_ms": 1_200})),
            now_ms(),
        )
        .await
        .unwrap();
    }
    // Wait until all three calls are running, then lock the database.
    let until = std::time::Instant::now() + Duration::from_secs(10);
    while w.stats.running.load(Ordering::Relaxed) < 3 {
        assert!(std::time::Instant::now() < until, "calls did not start");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut lock = sqlx::SqliteConnection::connect(&env.store_url)
        .await
        .unwrap();
    sqlx::query("BEGIN EXCLUSIVE")
        .execute(&mut lock)
        .await
        .unwrap();
    // Jobs published during the outage (no ledger for the producer: it is locked too).
    let s2 = env.submitter(0, false).await;
    for id in ["o-4", "o-5"] {
        s2.submit(
            &job_with(id, 60_000, json!({"sim_latency_ms": 10})),
            now_ms(),
        )
        .await
        .unwrap();
    }
    // The outage lasts until the 1.2 s calls have ended while the store is locked and the
    // worker has since failed to store their outcomes again and again: an ack without a
    // stored outcome would have been sent by then.
    let until = Instant::now() + Duration::from_secs(60);
    while w.stats.running.load(Ordering::Relaxed) > 0 || sim.calls() < 3 {
        assert!(Instant::now() < until, "the three calls did not end");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let retries_at_end = w.stats.store_retries.load(Ordering::Relaxed);
    while w.stats.store_retries.load(Ordering::Relaxed) < retries_at_end + 3 {
        assert!(
            Instant::now() < until,
            "the worker did not retry the store after the calls ended"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        w.stats.settled.load(Ordering::Relaxed),
        0,
        "no ack without a stored outcome"
    );
    // The broker agrees: all five messages are still in the work queue.
    let work = std::slice::from_ref(&env.topo.names.work_queue);
    let held = rabbitmqctl::counts_of(work)[0].unwrap();
    assert_eq!(held.ready + held.unacked, 5, "nothing acked: {held:?}");
    let received_during_outage = w.stats.received.load(Ordering::Relaxed);
    sqlx::query("ROLLBACK").execute(&mut lock).await.unwrap();
    drop(lock);
    let all: Vec<String> = (1..=5).map(|i| format!("o-{i}")).collect();
    let recs = env.wait_terminal(&all, Duration::from_secs(30)).await;
    assert!(recs.iter().all(|r| r.state == "completed"), "{recs:?}");
    assert!(recs.iter().all(|r| r.backend_calls == 1));
    let until = std::time::Instant::now() + Duration::from_secs(5);
    while w.stats.settled.load(Ordering::Relaxed) < 5 {
        assert!(
            std::time::Instant::now() < until,
            "not all deliveries were acked after recovery"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(received_during_outage <= 5);
    w.stop().await;
    assert_eq!(env.ready(&env.topo.names.work_queue).await, 0);
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_bodies_are_rejected_without_buffering() {
    let env = Env::sqlite("oversize").await;
    let sim = sim(0);
    let mut cfg = env.worker_config(1, 2);
    cfg.policy.limits.max_body_bytes = 1_000;
    let w = env.start_worker(cfg, sim.clone(), system_clock()).await;
    let big = "x".repeat(5_000);
    env.submitter(0, true)
        .await
        .submit(&job_with("big", 30_000, json!({"prompt": big})), now_ms())
        .await
        .unwrap();
    // Too large to parse: the id comes from the message_id property the publisher set.
    let recs = env
        .wait_terminal(&["big".into()], Duration::from_secs(10))
        .await;
    assert_eq!(
        (recs[0].state.as_str(), recs[0].reason.as_deref()),
        ("rejected", Some("message_too_large"))
    );
    w.stop().await;
    assert_eq!(sim.calls(), 0);
    env.cleanup().await;
}
