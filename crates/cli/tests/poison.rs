//! A job that crashes the worker process must not loop forever. Classic queues: the
//! ledger counts model-call starts and the worker fails the job as `poison` once
//! `--max-starts` is reached. Quorum queues: the broker's `x-delivery-limit` dead-letters
//! it and the DLQ processor records `failed`/`delivery_limit`. The worker is the real
//! binary, restarted after every crash.

use crate::common;

use common::*;
use lastcall_broker::topology::QueueType;
use lastcall_core::State;
use lastcall_worker::clock::now_ms;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn worker(env: &Env, extra: &[&str], call_log: &std::path::Path) -> Child {
    env.command()
        .args([
            "worker",
            "--backend",
            "sim",
            "--sim-faults",
            "--slots",
            "1",
            "--sim-latency-ms",
            "10",
        ])
        .arg("--retry-delays-ms")
        .arg(
            env.topo
                .retry_delays_ms
                .iter()
                .map(u64::to_string)
                .collect::<Vec<_>>()
                .join(","),
        )
        .arg("--sim-call-log")
        .arg(call_log)
        .args(extra)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn the lastcall binary")
}

fn terminate(child: &mut Child) {
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let until = Instant::now() + Duration::from_secs(15);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > until {
            let _ = child.kill();
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Restart the worker after every crash until `done` holds; returns the number of
/// crashes. Panics after `max_runs` runs: the job must not loop forever.
async fn crash_loop<F, Fut>(
    env: &Env,
    extra: &[&str],
    log: &std::path::Path,
    max_runs: usize,
    done: F,
) -> usize
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let mut crashes = 0;
    for _ in 0..max_runs {
        let mut child = worker(env, extra, log);
        let until = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                assert!(!status.success(), "the worker only stops by crashing here");
                crashes += 1;
                break;
            }
            if done().await {
                terminate(&mut child);
                return crashes;
            }
            assert!(Instant::now() < until, "neither a crash nor an outcome");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // The aborted worker's delivery goes back to the queue (or to the DLX).
        tokio::time::sleep(Duration::from_millis(200)).await;
        if done().await {
            return crashes;
        }
    }
    panic!("the poison job was still looping after {max_runs} worker runs");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn classic_queue_poison_job_is_failed_after_max_starts_and_dead_lettered() {
    let env = Env::sqlite("poison").await;
    let log = env.dir.join("calls.log");
    let sub = env
        .submitter(0, true)
        .await
        .submit(&job_of_kind("crash-1", "sim.crash", 120_000), now_ms())
        .await
        .unwrap();
    let crashes = crash_loop(&env, &["--max-starts", "2"], &log, 6, || async {
        env.ledger
            .get("crash-1")
            .await
            .unwrap()
            .is_some_and(|r| r.state.parse::<State>().unwrap().is_terminal())
    })
    .await;
    assert_eq!(crashes, 2, "two crashing starts, then the bound");
    assert_eq!(calls_in(&log, "crash-1"), 2, "the model was called twice");
    let rec = env.ledger.get("crash-1").await.unwrap().unwrap();
    assert_eq!(
        (rec.state.as_str(), rec.reason.as_deref()),
        ("failed", Some("poison"))
    );
    assert_eq!(rec.backend_calls, 2);
    assert_eq!(rec.expires_at_ms, Some(sub.expires_at_ms));
    let rows = env.ledger.attempts("crash-1").await.unwrap();
    assert!(rows.iter().skip(1).all(|a| a.redelivered), "{rows:?}");
    assert_eq!(env.ready(&env.topo.names.work_queue).await, 0);
    // It went to the dead queue, rejected by the worker.
    let d = env.peek_dead_letter().await;
    assert_eq!(d.x_death[0].reason, "rejected");
    let dlq = env.drain_dead_letters(false).await;
    assert_eq!(
        dlq.kept_existing.load(std::sync::atomic::Ordering::Relaxed),
        1
    );
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quorum_delivery_limit_dead_letters_a_crash_looping_job() {
    let env = Env::with_topology("poisonq", false, |t| {
        t.queue_type = QueueType::Quorum;
        t.delivery_limit = 1;
    })
    .await;
    let log = env.dir.join("calls.log");
    let sub = env
        .submitter(0, true)
        .await
        .submit(&job_of_kind("crash-q", "sim.crash", 120_000), now_ms())
        .await
        .unwrap();
    // --max-starts is high so that only the broker's delivery limit can stop the loop.
    let args = [
        "--queue-type",
        "quorum",
        "--delivery-limit",
        "1",
        "--max-starts",
        "50",
    ];
    let crashes = crash_loop(&env, &args, &log, 6, || async {
        env.ready(&env.topo.names.dead_queue).await == 1
    })
    .await;
    assert!(
        (1..=2).contains(&crashes),
        "the delivery limit stopped the loop, after {crashes} crashes"
    );
    assert_eq!(env.ready(&env.topo.names.work_queue).await, 0);
    let dlq = env.drain_dead_letters(false).await;
    assert_eq!(dlq.recorded.load(std::sync::atomic::Ordering::Relaxed), 1);
    let rec = env.ledger.get("crash-q").await.unwrap().unwrap();
    assert_eq!(
        (rec.state.as_str(), rec.reason.as_deref()),
        ("failed", Some("delivery_limit"))
    );
    assert_eq!(
        rec.expires_at_ms,
        Some(sub.expires_at_ms),
        "deadline unchanged"
    );
    assert_eq!(calls_in(&log, "crash-q"), crashes);
    env.cleanup().await;
}
