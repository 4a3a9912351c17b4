//! The worker with the OpenAI-compatible backend against a real llama.cpp server
//! (llama.cpp's C++ `llama-server` serving SmolLM2-135M, started by
//! `scripts/llama-server.sh`): outcomes land in the ledger with text, usage and latency; a
//! deadline shorter than the generation gives `deadline_exceeded` and frees the server; a
//! server that is down gives retries inside the budget (one test with sections, sharing one
//! server). And continuous batching is real: a worker with several slots has several
//! generations in the server's slots at once, read from the server's log.

use crate::common;

use common::llama::LlamaServer;
use common::private_rabbit::free_port;
use common::*;
use lastcall_backend::Backend;
use lastcall_openai::{OpenAiBackend, OpenAiConfig};
use lastcall_worker::clock::now_ms;
use serde_json::json;
use std::sync::Arc;
use std::time::{Duration, Instant};

fn backend(base_url: &str) -> Arc<dyn Backend> {
    Arc::new(
        OpenAiBackend::new(OpenAiConfig::new(base_url, "smollm2").with_max_tokens(16)).unwrap(),
    )
}

/// Submit one job and wait (at most `secs`) for its terminal record.
async fn run(
    s: &lastcall_worker::Submitter,
    env: &Env,
    id: &str,
    budget_ms: u64,
    payload: serde_json::Value,
    secs: u64,
) -> lastcall_store::JobRecord {
    s.submit(&job_with(id, budget_ms, payload), now_ms())
        .await
        .unwrap();
    env.wait_terminal(&[id.to_owned()], Duration::from_secs(secs))
        .await
        .remove(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_with_a_real_llama_server() {
    let (_server, base_url) = LlamaServer::start(&[]);

    let env = Env::sqlite("openai").await;
    let mut cfg = env.worker_config(1, 2);
    cfg.policy.retry = lastcall_core::RetryPolicy::new(3, 300, vec![300, 5_000]).unwrap();
    cfg.topology.retry_delays_ms = vec![300, 5_000];
    cfg.topology.apply(&env.broker).await.unwrap();
    let topo = cfg.topology.clone();
    let w = env
        .start_worker(cfg, backend(&base_url), system_clock())
        .await;
    let s = env.submitter(100, true).await;

    // 1. A completion that fits the deadline: completed, text and usage recorded.
    let r = &run(
        &s,
        &env,
        "fits",
        60_000,
        json!({"prompt": "Say hello.", "max_tokens": 8}),
        60,
    )
    .await;
    assert_eq!(r.state, "completed", "{r:?}");
    assert!(
        !r.result.as_deref().unwrap_or("").trim().is_empty(),
        "generated text is stored"
    );
    assert!(
        r.completion_tokens.unwrap_or(0) > 0,
        "usage is stored: {r:?}"
    );
    assert!(r.latency_ms.unwrap_or(0) > 0);
    assert_eq!(r.backend_calls, 1);

    // 2a. Cancelled while it runs (`DELETE /v1/jobs/{id}`, `lastcall cancel`, here the
    //     library call): the worker aborts the request as at the deadline, records
    //     `cancelled` with the server's confirmation, and the server is free right after.
    s.submit(&job_with("cancel-me", 120_000, long_generation()), now_ms())
        .await
        .unwrap();
    let until = Instant::now() + Duration::from_secs(30);
    while env.ledger.get("cancel-me").await.unwrap().map(|r| r.state) != Some("running".into()) {
        assert!(Instant::now() < until, "cancel-me never started");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let events = lastcall_broker::EventSink::spawn(&env.broker, &topo.names.events_exchange);
    let control = lastcall_broker::EventSink::spawn(&env.broker, &topo.names.control_exchange);
    let asked =
        lastcall_worker::cancel::cancel(&env.ledger, &events, &control, "cancel-me", now_ms())
            .await
            .unwrap();
    assert_eq!(asked, lastcall_store::CancelOutcome::Requested);
    let r = &env
        .wait_terminal(&["cancel-me".into()], Duration::from_secs(30))
        .await[0];
    assert_eq!(r.state, "cancelled", "{r:?}");
    assert_eq!(r.reason.as_deref(), Some("cancel_requested"), "{r:?}");
    assert!(r.cancel_requested);
    assert_eq!(
        r.cancel_confirmed,
        Some(true),
        "the server confirmed the stop: {r:?}"
    );
    assert_eq!(r.backend_calls, 1);
    let r = &run(
        &s,
        &env,
        "after-cancel",
        60_000,
        json!({"prompt": "Say hi.", "max_tokens": 4}),
        30,
    )
    .await;
    assert_eq!(
        r.state, "completed",
        "the server is not stuck behind the cancelled request: {r:?}"
    );

    // 2. A deadline shorter than the generation: deadline_exceeded, the request aborted,
    //    and the server free right after (not stuck behind the abandoned generation).
    //    A kind of its own: a request of 1,000 `max_tokens` after completed calls of 4
    //    and 8 is held, before the request-aware fit holds, to their time scaled by its
    //    size (tens of seconds), and refused unstarted with 1.5 s of budget.
    let long = lastcall_producer::NewJob {
        kind: "incident.long".into(),
        ..job_with("too-long", 1_500, long_generation())
    };
    s.submit(&long, now_ms()).await.unwrap();
    let r = &env
        .wait_terminal(&["too-long".into()], Duration::from_secs(30))
        .await[0];
    assert_eq!(r.state, "deadline_exceeded", "{r:?}");
    assert!(r.cancel_requested);
    assert_eq!(r.cancel_confirmed, Some(true));
    let t0 = Instant::now();
    let r = &run(
        &s,
        &env,
        "after",
        60_000,
        json!({"prompt": "Say hi.", "max_tokens": 4}),
        30,
    )
    .await;
    assert_eq!(r.state, "completed", "{r:?}");
    assert!(
        t0.elapsed() < Duration::from_secs(15),
        "the server was stuck behind the abandoned generation: {:?}",
        t0.elapsed()
    );
    w.stop().await;
    topo.delete(&env.broker).await.unwrap();
    env.cleanup().await;

    // 3. A server that is down: retryable errors, retried inside the budget, never past it.
    //    A deployment of its own (its own ledger): a worker on the ledger above would start
    //    from the call times recorded there, and refuse the 2 s job below without a call.
    let env = Env::sqlite("openai-down").await;
    let mut cfg = env.worker_config(1, 2);
    cfg.policy.retry = lastcall_core::RetryPolicy::new(3, 300, vec![300, 5_000]).unwrap();
    cfg.topology.retry_delays_ms = vec![300, 5_000];
    cfg.topology.apply(&env.broker).await.unwrap();
    let topo = cfg.topology.clone();
    let s = env.submitter(100, true).await;
    let down = format!("http://127.0.0.1:{}/v1", free_port());
    let w = env.start_worker(cfg, backend(&down), system_clock()).await;
    s.submit(&job("down-long", 60_000), now_ms()).await.unwrap();
    s.submit(&job("down-short", 2_000), now_ms()).await.unwrap();
    let recs = env
        .wait_terminal(
            &["down-long".into(), "down-short".into()],
            Duration::from_secs(30),
        )
        .await;
    assert_eq!(
        (recs[0].state.as_str(), recs[0].reason.as_deref()),
        ("failed", Some("retries_exhausted")),
        "{:?}",
        recs[0]
    );
    assert_eq!(recs[0].backend_calls, 3, "three attempts");
    let attempts = env.ledger.attempts("down-long").await.unwrap();
    assert_eq!(
        attempts.iter().map(|a| a.attempt).collect::<Vec<_>>(),
        [0, 1, 2]
    );
    // The short one: retries while they fit, then refused before overshooting its deadline.
    let short = &recs[1];
    assert!(
        matches!(
            (short.state.as_str(), short.reason.as_deref()),
            ("expired_not_started", Some("retry:would_overshoot"))
                | ("failed", Some("retries_exhausted"))
        ),
        "{short:?}"
    );
    assert!(
        short.recorded_at_ms.unwrap() <= short.expires_at_ms.unwrap() + 500,
        "no retry past the deadline: {short:?}"
    );
    w.stop().await;
    topo.delete(&env.broker).await.unwrap();
    env.cleanup().await;
}

/// A generation that runs far past any deadline here: 1,000 tokens with the end-of-text
/// tokens of SmolLM2 (`<|endoftext|>` 0, `<|im_end|>` 2) banned, so the model cannot end it
/// early (an unbanned "count to 500" sometimes ended after ~90 tokens, inside 1.5 s).
fn long_generation() -> serde_json::Value {
    json!({
        "prompt": "Count from 1 to 500.",
        "max_tokens": 1000,
        "logit_bias": {"0": -100, "2": -100}
    })
}

/// Slots of the server and of the worker in [`continuous_batching_at_a_real_llama_server`].
const SLOTS: usize = 4;
/// Jobs submitted at once: two rounds of `SLOTS`.
const BATCHED_JOBS: usize = 2 * SLOTS;
/// Tokens each of them generates (the end-of-text tokens banned, so exactly this many):
/// long enough that the generations of one round overlap however slowly the requests reach
/// the server, short enough to run in seconds.
const BATCHED_TOKENS: i64 = 64;

/// Continuous batching is real: a worker with `SLOTS` slots in front of a llama-server with
/// `--parallel SLOTS` gets several generations decoded at once. Read from the server's own
/// log (`| task N | processing task` when a slot takes a request, `| task N | stop
/// processing` when it is free again): at some moment at least two tasks, and never more
/// than `SLOTS`, held a slot. Every job completes once, with all its tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn continuous_batching_at_a_real_llama_server() {
    let slots = SLOTS.to_string();
    let (server, base_url) = LlamaServer::start(&[("LLAMA_SERVER_PARALLEL", slots.as_str())]);
    let env = Env::sqlite("openai-batching").await;
    let cfg = env.worker_config(SLOTS, SLOTS as u16);
    let topo = cfg.topology.clone();
    let backend: Arc<dyn Backend> = Arc::new(
        OpenAiBackend::new(
            OpenAiConfig::new(&base_url, "smollm2").with_max_tokens(BATCHED_TOKENS as u32),
        )
        .unwrap(),
    );
    let w = env.start_worker(cfg, backend, system_clock()).await;
    let s = env.submitter(100, true).await;
    let before = server.log().len();
    let ids: Vec<String> = (0..BATCHED_JOBS).map(|i| format!("batched-{i}")).collect();
    let t0 = Instant::now();
    for (i, id) in ids.iter().enumerate() {
        let payload = json!({
            "prompt": format!("Write a short story about the number {i}."),
            "max_tokens": BATCHED_TOKENS,
            "temperature": 0.0,
            "logit_bias": {"0": -100, "2": -100}
        });
        s.submit(&job_with(id, 120_000, payload), now_ms())
            .await
            .unwrap();
    }
    let recs = env.wait_terminal(&ids, Duration::from_secs(120)).await;
    let took = t0.elapsed();
    for r in &recs {
        assert_eq!(r.state, "completed", "{r:?}");
        assert_eq!(r.backend_calls, 1, "one call, one outcome: {r:?}");
        assert_eq!(r.completion_tokens, Some(BATCHED_TOKENS), "{r:?}");
    }
    let log = server.log();
    let log = &log[before.min(log.len())..];
    let (max_busy, tasks) = busy_slots(log);
    eprintln!(
        "{BATCHED_JOBS} jobs of {BATCHED_TOKENS} tokens through {SLOTS} worker slots in \
         {took:?}; the server's log shows {tasks} tasks, at most {max_busy} in slots at once"
    );
    assert_eq!(
        tasks, BATCHED_JOBS,
        "one server task per job; the server's log:\n{log}"
    );
    assert!(
        (2..=SLOTS).contains(&max_busy),
        "expected 2..={SLOTS} generations in the server's slots at once (continuous \
         batching), saw {max_busy}; the server's log:\n{log}"
    );
    w.stop().await;
    topo.delete(&env.broker).await.unwrap();
    env.cleanup().await;
}

/// From llama-server's log: the largest number of tasks in slots at the same time, and how
/// many tasks were taken. A slot line reads `slot launch_slot_: id  0 | task 7 | processing
/// task` / `slot      release: id  0 | task 7 | stop processing: …`.
fn busy_slots(log: &str) -> (usize, usize) {
    let (mut busy, mut max, mut tasks) = (0usize, 0usize, 0usize);
    for line in log.lines() {
        if line.contains("| processing task") {
            busy += 1;
            tasks += 1;
            max = max.max(busy);
        } else if line.contains("| stop processing") {
            busy = busy.saturating_sub(1);
        }
    }
    (max, tasks)
}
