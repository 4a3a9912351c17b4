//! Kill the worker process (SIGKILL) after the outcome is stored but before the ack: the
//! job is redelivered, and the ledger still holds exactly one outcome with one model call.
//! Also: SIGTERM drains gracefully and hands waiting work back.

use crate::common;

use common::*;
use lastcall_broker::topology::queue_depth;
use lastcall_worker::clock::now_ms;
use serde_json::json;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// `lastcall worker` on the sim (one slot, 50 ms calls) logging its calls to `call_log`,
/// with `extra` flags; stdout discarded.
fn worker_command(env: &Env, extra: &[&str], call_log: &std::path::Path) -> Command {
    let mut cmd = env.command();
    cmd.args([
        "worker",
        "--backend",
        "sim",
        "--slots",
        "1",
        "--sim-latency-ms",
        "50",
        "--retry-delays-ms",
        "1000,5000",
    ])
    .arg("--sim-call-log")
    .arg(call_log)
    .args(extra)
    .stdout(Stdio::null());
    cmd
}

fn worker(env: &Env, extra: &[&str], call_log: &std::path::Path) -> Child {
    worker_command(env, extra, call_log)
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn the lastcall binary")
}

fn wait_exit(child: &mut Child, timeout: Duration) -> std::process::ExitStatus {
    let until = Instant::now() + timeout;
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return s;
        }
        assert!(Instant::now() < until, "process did not exit in time");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_between_store_and_ack_keeps_one_outcome_and_one_call() {
    let env = Env::sqlite("sigkill").await;
    let log = env.dir.join("calls.log");
    let first_log = env.dir.join("first.log");
    let mut first = worker_command(&env, &["--fault", "pause-after-store"], &log)
        .stderr(std::fs::File::create(&first_log).unwrap())
        .spawn()
        .expect("spawn the lastcall binary");
    env.submitter(0, true)
        .await
        .submit(&job("k1", 60_000), now_ms())
        .await
        .unwrap();
    let recs = env
        .wait_terminal(&["k1".into()], Duration::from_secs(20))
        .await;
    assert_eq!(recs[0].state, "completed");
    // The outcome is durable and the worker is paused before its ack (it says so, and the
    // broker still holds the delivery unacked): kill it hard.
    let until = Instant::now() + Duration::from_secs(30);
    while !std::fs::read_to_string(&first_log)
        .unwrap_or_default()
        .contains("fault: paused after store")
    {
        assert!(
            Instant::now() < until,
            "the worker never reached its pause after the store: {}",
            std::fs::read_to_string(&first_log).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let work = vec![env.topo.names.work_queue.clone()];
    let held = rabbitmqctl::counts_of(&work)[0];
    assert_eq!(
        held.map(|c| (c.ready, c.unacked)),
        Some((0, 1)),
        "the paused worker holds the delivery unacked"
    );
    assert!(
        first.try_wait().unwrap().is_none(),
        "the worker must still be paused before the ack"
    );
    first.kill().unwrap(); // SIGKILL
    wait_exit(&mut first, Duration::from_secs(5));
    // The unacked delivery goes back to the queue.
    let until = Instant::now() + Duration::from_secs(5);
    while env.ready(&env.topo.names.work_queue).await != 1 {
        assert!(
            Instant::now() < until,
            "the job was not returned to the queue"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // A fresh worker gets the redelivery and acks it without running it again.
    // Its info log says when it settled the duplicate (no ledger write marks that).
    let second_log = env.dir.join("second.log");
    let mut second = worker_command(&env, &["--verbose"], &log)
        .stderr(std::fs::File::create(&second_log).unwrap())
        .spawn()
        .expect("spawn the lastcall binary");
    let until = Instant::now() + Duration::from_secs(20);
    while !std::fs::read_to_string(&second_log)
        .unwrap_or_default()
        .contains("redelivery of a job with a recorded outcome")
    {
        assert!(
            Instant::now() < until,
            "the redelivery was not settled as a duplicate: {}",
            std::fs::read_to_string(&second_log).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    nix_term(&second);
    let status = wait_exit(&mut second, Duration::from_secs(15));
    assert!(status.success(), "graceful shutdown exits 0: {status:?}");
    // Had the second worker not acked, closing its channel would have requeued the job.
    // Once the broker holds nothing unacked and no consumer on the queue, the delivery was
    // either acked or is back in the queue: only then is an empty queue proof.
    let settled = rabbitmqctl::wait_queues(
        &work,
        "the work queue without a consumer or an unacked delivery",
        Duration::from_secs(60),
        |c| c.unacked == 0 && c.consumers == 0,
    )
    .await;
    assert_eq!(settled[0].ready, 0, "the redelivery was acked");
    let rec = env.ledger.get("k1").await.unwrap().unwrap();
    assert_eq!(rec.state, "completed");
    assert_eq!(rec.backend_calls, 1);
    assert_eq!(calls_in(&log, "k1"), 1, "the model was called exactly once");
    env.cleanup().await;
}

/// SIGTERM: stop consuming, let the running call finish within the grace period, hand
/// the waiting jobs back to the broker, exit 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_running_work_and_hands_back_waiting_work() {
    let env = Env::sqlite("sigterm").await;
    let log = env.dir.join("calls.log");
    let mut w = worker(&env, &["--prefetch", "3"], &log);
    // Submit only once the worker consumes: otherwise all three jobs arrive at once and
    // any of them may take the slot first.
    let until = Instant::now() + Duration::from_secs(20);
    while queue_depth(&env.broker, &env.topo.names.work_queue)
        .await
        .unwrap()
        .is_none_or(|(_, consumers)| consumers == 0)
    {
        assert!(Instant::now() < until, "the worker did not start consuming");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let s = env.submitter(0, true).await;
    s.submit(
        &job_with("run", 60_000, json!({"sim_latency_ms": 6_000})),
        now_ms(),
    )
    .await
    .unwrap();
    let until = Instant::now() + Duration::from_secs(20);
    while calls_in(&log, "run") == 0 {
        assert!(Instant::now() < until, "the first call did not start");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The slot is busy for 6 s: these two are delivered and wait locally for it.
    s.submit(&job("wait-1", 60_000), now_ms()).await.unwrap();
    s.submit(&job("wait-2", 60_000), now_ms()).await.unwrap();
    // Both are delivered to the worker (polled: the broker delivers asynchronously).
    env.wait_ready(&env.topo.names.work_queue, 0).await;
    assert_eq!(calls_in(&log, "wait-1") + calls_in(&log, "wait-2"), 0);
    // The call must still be running when the signal arrives, or this proves nothing.
    assert_eq!(
        env.ledger.get("run").await.unwrap().unwrap().state,
        "running",
        "the first call is still running at SIGTERM (machine too slow for this check)"
    );
    nix_term(&w);
    let status = wait_exit(&mut w, Duration::from_secs(15));
    assert!(status.success(), "{status:?}");
    assert_eq!(
        env.ledger.get("run").await.unwrap().unwrap().state,
        "completed",
        "the running call finished"
    );
    // The broker applies the requeue and the channel close asynchronously: poll briefly.
    let until = Instant::now() + Duration::from_secs(5);
    let mut ready = 0;
    while Instant::now() < until {
        ready = env.ready(&env.topo.names.work_queue).await;
        if ready == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for id in ["wait-1", "wait-2"] {
        let st = env.ledger.get(id).await.unwrap().unwrap().state;
        assert_eq!(st, "accepted", "{id} was neither run nor settled");
    }
    assert_eq!(ready, 2, "the waiting jobs went back to the broker");
    assert_eq!(calls_in(&log, "wait-1") + calls_in(&log, "wait-2"), 0);
    env.cleanup().await;
}

fn nix_term(child: &Child) {
    let ok = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(ok.success());
}
