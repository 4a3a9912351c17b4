//! Security review, round two (issue #34), the worker's side: what a client that may
//! publish to the broker (the producer role) can no longer make a worker do.

mod common;

use common::*;
use lastcall_core::event::ControlMessage;
use lastcall_worker::clock::now_ms;
use serde_json::json;
use std::time::{Duration, Instant};

/// Poll the ledger until `id` is `running`; panics after 30 s.
async fn wait_running(env: &Env, id: &str) {
    let until = Instant::now() + Duration::from_secs(30);
    while env.ledger.get(id).await.unwrap().map(|r| r.state) != Some("running".into()) {
        assert!(Instant::now() < until, "{id} never started");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A cancellation broadcast is only a wake-up: a forged one published straight to
/// `{prefix}.control` (the producer role may publish there) does not cancel a running job,
/// while a real one (the ledger's `cancel_requested`, as `DELETE /v1/jobs/{id}` and
/// `lastcall cancel` write it, then the broadcast) still aborts the call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_cancel_broadcast_does_not_cancel_a_running_job() {
    let env = Env::sqlite("forged-cancel").await;
    let w = env
        .start_worker(env.worker_config(2, 4), sim(30_000), system_clock())
        .await;
    let s = env.submitter(100, true).await;
    // The victim runs 3 s; the other one 30 s unless it is cancelled.
    s.submit(
        &job_with(
            "victim",
            60_000,
            json!({"messages": [{"role": "user", "content": "x"}], "sim_latency_ms": 3_000}),
        ),
        now_ms(),
    )
    .await
    .unwrap();
    s.submit(&job("really-cancelled", 60_000), now_ms())
        .await
        .unwrap();
    wait_running(&env, "victim").await;
    wait_running(&env, "really-cancelled").await;

    // One sink for both, so the worker receives the forged broadcast first.
    let control = lastcall_broker::EventSink::spawn(&env.broker, &env.topo.names.control_exchange);
    let events = lastcall_broker::EventSink::spawn(&env.broker, &env.topo.names.events_exchange);
    control.emit(String::new(), ControlMessage::cancel("victim").to_json());
    let asked = lastcall_worker::cancel::cancel(
        &env.ledger,
        &events,
        &control,
        "really-cancelled",
        now_ms(),
    )
    .await
    .unwrap();
    assert_eq!(asked, lastcall_store::CancelOutcome::Requested);
    let real = &env
        .wait_terminal(&["really-cancelled".into()], Duration::from_secs(20))
        .await[0];
    assert_eq!(
        real.state, "cancelled",
        "the real cancel took effect: {real:?}"
    );
    assert_eq!(real.reason.as_deref(), Some("cancel_requested"));

    // The forged broadcast came first and was checked first: the victim ran on.
    let victim = &env
        .wait_terminal(&["victim".into()], Duration::from_secs(30))
        .await[0];
    assert_eq!(
        victim.state, "completed",
        "a forged broadcast must not cancel a job: {victim:?}"
    );
    assert!(!victim.cancel_requested, "{victim:?}");
    control.close(Duration::from_secs(2)).await;
    events.close(Duration::from_secs(2)).await;
    w.stop().await;
    env.cleanup().await;
}
