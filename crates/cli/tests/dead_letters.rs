//! `lastcall dlq` as a user runs it: a classic work queue with a length limit drops its
//! head to the DLX (`maxlen`), and the dead-letter processor records `failed`/`maxlen`
//! with the deadline unchanged, then exits when idle.

use crate::common;

use common::*;
use lastcall_worker::clock::now_ms;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dlq_command_records_maxlen_overflow_and_exits_when_idle() {
    let env = Env::with_topology("maxlen", false, |t| {
        t.max_length = Some(1);
    })
    .await;
    let s = env.submitter(0, true).await;
    let first = s.submit(&job("ml-1", 60_000), now_ms()).await.unwrap();
    s.submit(&job("ml-2", 60_000), now_ms()).await.unwrap();
    let until = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while env.ready(&env.topo.names.dead_queue).await != 1 {
        assert!(std::time::Instant::now() < until, "no maxlen dead letter");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let out = env.cli(&[
        "dlq",
        "--idle-exit-ms",
        "800",
        "--retry-delays-ms",
        "1000,5000",
        "--max-length",
        "1",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("dead letters processed: 1 (recorded: 1"),
        "{stdout}"
    );
    let rec = env.ledger.get("ml-1").await.unwrap().unwrap();
    assert_eq!(
        (rec.state.as_str(), rec.reason.as_deref()),
        ("failed", Some("maxlen"))
    );
    assert_eq!(
        rec.expires_at_ms,
        Some(first.expires_at_ms),
        "deadline unchanged"
    );
    assert_eq!(
        env.ledger.get("ml-2").await.unwrap().unwrap().state,
        "accepted"
    );
    assert_eq!(
        env.ready(&env.topo.names.dead_queue).await,
        0,
        "acked after the write"
    );
    assert_eq!(
        env.ready(&env.topo.names.work_queue).await,
        1,
        "never republished to work"
    );
    env.cleanup().await;
}

/// `lastcall dlq --split-by-reason`: format errors, model failures and expiries land in
/// queues of their own (after the ledger write), so operators can watch them apart — the
/// first two are both `rejected` in `x-death`; the ledger's reason splits them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dlq_splits_dead_letters_by_reason() {
    let env = Env::sqlite("split").await;
    let sim = sim(0);
    let w = env
        .start_worker(env.worker_config(1, 2), sim.clone(), system_clock())
        .await;
    let s = env.submitter(0, true).await;
    // A format error, rejected by the worker to the DLX …
    let p = lastcall_broker::Publisher::new(&env.broker, std::time::Duration::from_secs(5))
        .await
        .unwrap();
    let props = lastcall_broker::PublishProps {
        job_id: "garbled".into(),
        ttl_ms: Some(60_000),
        attempt: 0,
        timestamp_s: 0,
        signature: None,
    };
    p.publish(&env.topo.names.jobs_exchange, "k", b"{garbled", &props)
        .await
        .unwrap();
    // … a model failure (a terminal backend error), also rejected by the worker …
    s.submit(
        &job_of_kind("bad-model", "sim.fail-terminal", 60_000),
        now_ms(),
    )
    .await
    .unwrap();
    env.wait_terminal(
        &["garbled".into(), "bad-model".into()],
        std::time::Duration::from_secs(10),
    )
    .await;
    w.stop().await;
    // … and an expiry at the broker (no worker running).
    s.submit(&job("late", 300), now_ms()).await.unwrap();
    // The garbled body, the model failure and now the expiry wait in the dead queue.
    env.wait_ready(&env.topo.names.dead_queue, 3).await;
    let out = env.cli(&[
        "dlq",
        "--split-by-reason",
        "--idle-exit-ms",
        "800",
        "--retry-delays-ms",
        "1000,5000",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let q = |label: &str| lastcall_worker::dlq::reason_queue(&env.prefix, label);
    // Both were `rejected` for the broker; the ledger tells them apart.
    assert_eq!(env.ready(&q("format")).await, 1, "the format error");
    assert_eq!(env.ready(&q("model_failed")).await, 1, "the model failure");
    assert_eq!(env.ready(&q("signature")).await, 0);
    assert_eq!(env.ready(&q("expired")).await, 1, "the expiry");
    assert_eq!(env.ready(&q("maxlen")).await, 0);
    assert_eq!(
        env.ready(&env.topo.names.dead_queue).await,
        0,
        "acked after the write and the copy"
    );
    assert_eq!(
        env.ledger.get("late").await.unwrap().unwrap().state,
        "expired_before_receive"
    );
    assert_eq!(
        env.ledger.get("garbled").await.unwrap().unwrap().state,
        "rejected"
    );
    assert_eq!(sim.calls(), 1, "only the model failure reached the model");
    env.cleanup().await;
}
