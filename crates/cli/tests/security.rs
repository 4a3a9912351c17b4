//! Security review, round two (issue #34), the worker's side: what a client that may
//! publish to the broker (the producer role) can no longer make a worker do.

use crate::common;

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

/// A cancellation whose broadcast never reached the worker (it was reconnecting, or its
/// follower not yet subscribed) still stops the call: the worker sweeps the ledger's
/// `cancel_requested` flags of the jobs it holds every 2 s. Here the ledger is flagged with
/// no broadcast at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancellation_without_its_broadcast_still_stops_the_running_job() {
    let env = Env::sqlite("cancel-sweep").await;
    let w = env
        .start_worker(env.worker_config(1, 2), sim(60_000), system_clock())
        .await;
    let s = env.submitter(100, true).await;
    s.submit(&job("unheard", 120_000), now_ms()).await.unwrap();
    wait_running(&env, "unheard").await;
    let asked = env.ledger.cancel("unheard", now_ms()).await.unwrap();
    assert_eq!(asked, lastcall_store::CancelOutcome::Requested);
    let rec = &env
        .wait_terminal(&["unheard".into()], Duration::from_secs(20))
        .await[0];
    assert_eq!(rec.state, "cancelled", "{rec:?}");
    assert_eq!(rec.reason.as_deref(), Some("cancel_requested"), "{rec:?}");
    assert_eq!(rec.backend_calls, 1, "{rec:?}");
    w.stop().await;
    env.cleanup().await;
}

/// Publish `env`'s job `id` straight to the work queue with `reply_to` set, as any client
/// with the producer role could (the worker holds no signing key here).
async fn publish_with_reply_to(env: &Env, id: &str, payload: serde_json::Value, reply_to: &str) {
    let s = env.submitter(100, false).await;
    let e = s
        .envelope(&job_with(id, 60_000, payload), now_ms())
        .unwrap();
    let conn = lapin::Connection::connect(AMQP, lapin::ConnectionProperties::default())
        .await
        .unwrap();
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(lapin::options::ConfirmSelectOptions::default())
        .await
        .unwrap();
    let mut headers = lapin::types::FieldTable::default();
    headers.insert(
        "x-lastcall-attempt".into(),
        lapin::types::AMQPValue::LongLongInt(0),
    );
    let props = lapin::BasicProperties::default()
        .with_delivery_mode(2)
        .with_content_type("application/json".into())
        .with_message_id(id.into())
        .with_expiration("60000".into())
        .with_headers(headers)
        .with_reply_to(reply_to.into());
    ch.basic_publish(
        "".into(),
        env.topo.names.work_queue.as_str().into(),
        lapin::options::BasicPublishOptions::default(),
        &e.to_bytes(),
        props,
    )
    .await
    .unwrap()
    .await
    .unwrap();
    let _ = conn.close(200, "bye".into()).await;
}

/// `reply_to` is outside the signed bytes: a job whose `reply_to` names the work queue
/// gets no token deltas published there (only RabbitMQ direct reply-to addresses take
/// them). Before the fix each delta became a message in `{prefix}.work`, which the worker
/// received as an invalid job and recorded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reply_to_naming_the_work_queue_gets_no_deltas() {
    let env = Env::sqlite("reply-to-work").await;
    let w = env
        .start_worker(env.worker_config(2, 4), sim(1), system_clock())
        .await;
    // Seven word-sized pieces, one every second of the 7 s call: a delta sent to the work
    // queue would be received and recorded long before the call ends.
    let payload = json!({"messages": [{"role": "user", "content": "x"}], "sim_latency_ms": 7_000});
    let work = env.topo.names.work_queue.clone();
    publish_with_reply_to(&env, "streamer", payload, &work).await;
    let rec = &env
        .wait_terminal(&["streamer".into()], Duration::from_secs(30))
        .await[0];
    assert_eq!(rec.state, "completed", "{rec:?}");
    let all = env
        .ledger
        .list(&lastcall_store::ListFilter::default())
        .await
        .unwrap();
    let ids: Vec<(&str, &str)> = all
        .iter()
        .map(|r| (r.job_id.as_str(), r.state.as_str()))
        .collect();
    assert_eq!(
        ids,
        [("streamer", "completed")],
        "nothing but the job reached the work queue"
    );
    assert_eq!(env.ready(&work).await, 0, "no delta waits in {work}");
    assert_eq!(env.ready(&env.topo.names.dead_queue).await, 0);
    w.stop().await;
    env.cleanup().await;
}
