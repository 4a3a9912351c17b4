//! Overload behaviour of the worker against the real broker and ledger: the refusal at
//! receipt when the expected wait for a slot leaves too little budget, and group commit
//! (many deliveries finishing together: every one recorded once, then acked).

use crate::common;

use common::*;
use lastcall_store::ListFilter;
use lastcall_worker::clock::now_ms;
use std::time::Duration;

/// One slot, 400 ms calls, FIFO. B runs, C and D wait; E arrives with 1,400 ms of budget
/// (1,300 after the clock margin). Its expected wait is three slot releases ≈ 3 × 400 − 200
/// = 1,000 ms, so with the refusal on it is refused at once (reason
/// `receipt:expected_wait_exceeds_budget`); with it off it waits and is refused at the last
/// admission check instead. Never a model call. (FIFO, so that two jobs are ahead of E:
/// the learned p99 may then be anywhere between 300 ms and 1.3 s — a slow warm-up call on a
/// busy machine — and the reason is still the wait. Under EDF E would be ahead of C and D,
/// and the window between the two reasons would be only half a call wide.)
async fn run_wait_scenario(refuse: bool) -> lastcall_store::JobRecord {
    let env = Env::sqlite(if refuse { "wait-on" } else { "wait-off" }).await;
    let (w, sim, s) = two_waiting_behind_one_slot(&env, |cfg| {
        cfg.policy.refuse_on_expected_wait = refuse;
    })
    .await;
    s.submit(&job("e", 1_400), now_ms()).await.unwrap();
    let ids: Vec<String> = ["b", "c", "d", "e"].map(String::from).to_vec();
    let recs = env.wait_terminal(&ids, Duration::from_secs(15)).await;
    for r in &recs[..3] {
        assert_eq!(r.state, "completed", "{r:?}");
    }
    let e = recs[3].clone();
    assert_eq!(sim.calls_for("e"), 0, "no model call for E");
    w.stop().await;
    env.cleanup().await;
    e
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_whose_expected_wait_exceeds_its_budget_is_refused_at_receipt() {
    let e = run_wait_scenario(true).await;
    assert_eq!(e.state, "expired_not_started");
    assert_eq!(
        e.reason.as_deref(),
        Some("receipt:expected_wait_exceeds_budget")
    );
    assert_eq!(e.backend_calls, 0);
    assert_eq!(
        e.checked_at_ms, None,
        "never reached the last admission check"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_wait_refusal_the_same_job_waits_and_is_refused_at_admission() {
    let e = run_wait_scenario(false).await;
    assert_eq!(e.state, "expired_not_started");
    assert!(
        e.reason.as_deref().unwrap().starts_with("admission:"),
        "{e:?}"
    );
    assert_eq!(e.backend_calls, 0);
    assert!(e.checked_at_ms.is_some());
}

/// 300 zero-latency jobs through 16 slots with prefetch 64: many finish together and
/// share transactions. Every job ends in exactly one outcome, with one model call, and
/// the queue is empty (every delivery was acked after its write).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn group_commit_records_every_job_once_before_acking() {
    for postgres in [false, true] {
        let env = if postgres {
            Env::postgres("group-pg").await
        } else {
            Env::sqlite("group").await
        };
        let sim = sim(0);
        let w = env
            .start_worker(env.worker_config(16, 64), sim.clone(), system_clock())
            .await;
        let s = env.submitter(100, true).await;
        let ids: Vec<String> = (0..300).map(|i| format!("g{i}")).collect();
        for id in &ids {
            s.submit(&job(id, 60_000), now_ms()).await.unwrap();
        }
        let recs = env.wait_terminal(&ids, Duration::from_secs(60)).await;
        assert!(
            recs.iter()
                .all(|r| r.state == "completed" && r.backend_calls == 1)
        );
        assert_eq!(sim.calls(), 300);
        let all = env.ledger.list(&ListFilter::default()).await.unwrap();
        assert_eq!(all.len(), 300);
        w.stop().await;
        assert_eq!(env.ready(&env.topo.names.work_queue).await, 0);
        env.cleanup().await;
    }
}

/// Coalesced acks never wait behind a long call: with A (the lowest delivery tag) still
/// running, the jobs after it finish and are acked individually; A is acked when it ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finished_deliveries_above_a_running_one_are_acked_without_waiting() {
    let env = Env::sqlite("ack-gap").await;
    let sim = sim(0);
    let w = env
        .start_worker(env.worker_config(4, 8), sim.clone(), system_clock())
        .await;
    let s = env.submitter(100, true).await;
    s.submit(
        &job_with("long", 30_000, serde_json::json!({"sim_latency_ms": 4_000})),
        now_ms(),
    )
    .await
    .unwrap();
    let ids: Vec<String> = (0..5).map(|i| format!("quick{i}")).collect();
    for id in &ids {
        s.submit(&job(id, 30_000), now_ms()).await.unwrap();
    }
    env.wait_terminal(&ids, Duration::from_secs(10)).await;
    let t0 = std::time::Instant::now();
    while w.stats.settled.load(std::sync::atomic::Ordering::Relaxed) < 5 {
        assert!(
            t0.elapsed() < Duration::from_secs(3),
            "the quick jobs' acks waited behind the running one"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        env.ledger.get("long").await.unwrap().unwrap().state,
        "running",
        "the long call is still running while the others are acked"
    );
    env.wait_terminal(&["long".into()], Duration::from_secs(10))
        .await;
    w.stop().await;
    assert_eq!(ready_after_stop(&env).await, 0);
    env.cleanup().await;
}

/// Messages left in the work queue (ready) after the worker stopped: unacked ones return.
async fn ready_after_stop(env: &Env) -> u32 {
    env.ready(&env.topo.names.work_queue).await
}

/// Default settings, no hint anywhere: the worker learns that calls take ~1 s from the
/// calls it makes, and then refuses a job whose remaining budget is shorter — recorded
/// `expired_not_started` with a reason and a note naming the learned estimate, with no
/// model call, instead of starting it and cancelling it at the deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_with_default_settings_learns_the_call_time_and_refuses_what_cannot_finish() {
    let env = Env::sqlite("learned").await;
    let sim = sim(1_000);
    let cfg = env.worker_config(3, 16);
    assert_eq!(
        cfg.policy.admission.default_min_runtime_ms, 0,
        "no minimum runtime configured"
    );
    let w = env.start_worker(cfg, sim.clone(), system_clock()).await;
    let s = env.submitter(100, true).await;
    let warm: Vec<String> = (0..3).map(|i| format!("warm-{i}")).collect();
    for id in &warm {
        s.submit(&job(id, 30_000), now_ms()).await.unwrap();
    }
    for r in env.wait_terminal(&warm, Duration::from_secs(20)).await {
        assert_eq!(r.state, "completed", "{r:?}");
    }
    let r = short_job_is_refused_by_the_learned_time(&env, &s, &sim).await;
    let note = r.error.clone().unwrap_or_default();
    assert!(
        note.contains("learned call duration") && note.contains("p99"),
        "{note}"
    );
    // The record says which backend the job was for and the minimum runtime it was held to.
    assert_eq!(r.backend.as_deref(), Some("sim"));
    assert!(
        r.min_runtime_ms.is_some_and(|m| m >= 900),
        "the learned ~1 s call time: {r:?}"
    );
    // A job with room for the call still runs.
    s.submit(&job("roomy", 10_000), now_ms()).await.unwrap();
    let r = env
        .wait_terminal(&["roomy".into()], Duration::from_secs(10))
        .await
        .remove(0);
    assert_eq!(r.state, "completed", "{r:?}");
    assert_eq!(r.backend.as_deref(), Some("sim"));
    w.stop().await;
    env.cleanup().await;
}

/// Submit "short": 700 ms of budget (600 after the clock margin) for a call learned to take
/// ~1 s. It must be refused at receipt by the learned time, without a model call.
async fn short_job_is_refused_by_the_learned_time(
    env: &Env,
    s: &lastcall_producer::Submitter,
    sim: &lastcall_backend::sim::SimBackend,
) -> lastcall_store::JobRecord {
    // A prompt at least as large as the calls learned so far ("summarize" measures 7 of
    // the worker's approximate tokens, this one 10): calls of larger requests would justify
    // no refusal of a smaller one, which is probed instead.
    let payload =
        serde_json::json!({"messages": [{"role": "user", "content": "summarize the incident"}]});
    s.submit(&job_with("short", 700, payload), now_ms())
        .await
        .unwrap();
    let r = env
        .wait_terminal(&["short".into()], Duration::from_secs(10))
        .await
        .remove(0);
    assert_eq!(r.state, "expired_not_started", "{r:?}");
    assert_eq!(
        r.reason.as_deref(),
        Some("receipt:below_learned_runtime"),
        "{r:?}"
    );
    assert_eq!(r.backend_calls, 0);
    assert_eq!(sim.calls_for("short"), 0, "never started");
    // The worker's measure of the request is recorded with the refusal too.
    assert_eq!((r.request_tokens, r.request_max_tokens), (Some(10), None));
    r
}

/// A worker that starts — after a restart, or joining a pool — learns the call time from
/// the ledger's recent calls, not only from its own: its very first job without room for
/// the learned ~1 s call is refused without a model call. A worker that started from
/// nothing (the floor, 0 ms) would have started it and cut it at the deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_worker_starts_with_the_call_time_the_ledger_holds() {
    let env = Env::postgres("relearn").await;
    let s = env.submitter(100, true).await;
    let first = env
        .start_worker(env.worker_config(3, 16), sim(1_000), system_clock())
        .await;
    let warm: Vec<String> = (0..3).map(|i| format!("warm-{i}")).collect();
    for id in &warm {
        s.submit(&job(id, 30_000), now_ms()).await.unwrap();
    }
    for r in env.wait_terminal(&warm, Duration::from_secs(20)).await {
        assert_eq!(r.state, "completed", "{r:?}");
        // Recorded with the worker's own measure of the request ("summarize": 9 characters
        // ÷ 4, rounded up, + 4 for the message), which the next worker replays the call
        // under; the sim backend's own count (`prompt_tokens`) is another measure.
        assert_eq!(
            (r.request_tokens, r.request_max_tokens),
            (Some(7), None),
            "{r:?}"
        );
    }
    first.stop().await;
    // A new worker: a fresh estimator in a fresh process state, the same ledger.
    let sim = sim(1_000);
    let second = env
        .start_worker(env.worker_config(3, 16), sim.clone(), system_clock())
        .await;
    let r = short_job_is_refused_by_the_learned_time(&env, &s, &sim).await;
    assert!(
        r.min_runtime_ms.is_some_and(|m| m >= 900),
        "held to the ~1 s the first worker's calls took: {r:?}"
    );
    second.stop().await;
    env.cleanup().await;
}

/// One slot, held by a 4 s call; then "later" (60 s budget) and "soon" (30 s) arrive in
/// that order and wait. Returns which of them got the slot first.
async fn first_of_two_waiting(order: lastcall_worker::BufferOrder) -> String {
    let env = Env::sqlite(&format!("order-{}", order.as_str())).await;
    let mut cfg = env.worker_config(1, 8);
    cfg.buffer_order = order;
    let w = env.start_worker(cfg, sim(50), system_clock()).await;
    let s = env.submitter(100, true).await;
    s.submit(
        &job_with("hold", 60_000, serde_json::json!({"sim_latency_ms": 4_000})),
        now_ms(),
    )
    .await
    .unwrap();
    // "hold" takes the free slot first (jobs received together race for a free slot).
    let t0 = std::time::Instant::now();
    while env.ledger.get("hold").await.unwrap().map(|r| r.state) != Some("running".into()) {
        assert!(t0.elapsed() < Duration::from_secs(20), "hold never started");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    s.submit(&job("later", 60_000), now_ms()).await.unwrap();
    s.submit(&job("soon", 30_000), now_ms()).await.unwrap();
    // Both must be waiting while "hold" has the slot.
    let t0 = std::time::Instant::now();
    loop {
        let waiting = w.stats.waiting.load(std::sync::atomic::Ordering::Relaxed);
        let hold = env.ledger.get("hold").await.unwrap().map(|r| r.state);
        assert!(
            matches!(hold.as_deref(), None | Some("accepted" | "running")),
            "hold ended before both jobs waited (machine too slow for this check): {hold:?}"
        );
        if waiting >= 2 && hold.as_deref() == Some("running") {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "the two jobs never waited behind a running hold (waiting {waiting}, hold {hold:?})"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let ids: Vec<String> = ["hold", "later", "soon"].map(String::from).to_vec();
    let recs = env.wait_terminal(&ids, Duration::from_secs(30)).await;
    for r in &recs {
        assert_eq!(r.state, "completed", "{r:?}");
    }
    let (later, soon) = (
        recs[1].started_at_ms.unwrap(),
        recs[2].started_at_ms.unwrap(),
    );
    assert_ne!(later, soon, "one after the other on one slot");
    w.stop().await;
    env.cleanup().await;
    if soon < later { "soon" } else { "later" }.to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn by_default_the_waiting_job_with_the_earliest_deadline_gets_the_slot_first() {
    assert_eq!(
        lastcall_worker::WorkerConfig::new("x", 1).buffer_order,
        lastcall_worker::BufferOrder::Edf
    );
    assert_eq!(
        first_of_two_waiting(lastcall_worker::BufferOrder::Edf).await,
        "soon"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_fifo_order_the_job_received_first_gets_the_slot_first() {
    assert_eq!(
        first_of_two_waiting(lastcall_worker::BufferOrder::Fifo).await,
        "later"
    );
}
