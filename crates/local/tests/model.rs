//! The local backend with the real model. Needs the model file: run
//! `scripts/setup-model.sh`. Meant for `cargo test --release`: unoptimised candle decodes
//! ~17x slower, which the time bounds here allow for but which makes the run long.

mod common;

use lastcall_backend::{Backend, BackendError, CallRequest, CancellationToken};
use lastcall_local::LocalBackend;
use serde_json::{Value, json};
use std::time::{Duration, Instant};

fn request(payload: Value, timeout: Duration) -> CallRequest {
    CallRequest {
        job_id: "local-test".into(),
        kind: "chat".into(),
        attempt: 0,
        payload: payload.as_object().unwrap().clone(),
        timeout,
        priority: lastcall_backend::Priority::Standard,
    }
}

fn backend() -> LocalBackend {
    let t0 = Instant::now();
    let b = LocalBackend::load(common::model_path()).expect("model loads");
    eprintln!("model loaded in {:?}", t0.elapsed());
    b
}

/// How late a call may return after it should stop: the loop checks before every generated
/// token and between prefill chunks of 4 prompt tokens, so at most ~4 token times, plus
/// slack for a loaded 2-core machine. The token time is the mean of the generation above,
/// measured at another moment of the suite's load: a step while the other tests of a full
/// run compete for the 2 cores took 2–3× that (a cancel returned after 638 ms against a
/// bound of 503 ms at 15.8 tok/s), so the bound allows 8 token times and 500 ms. Without
/// cancellation the call would run 4,000 tokens (minutes): the test still tells a
/// stopped call from one that runs on.
fn stop_bound(tokens_per_second: f64) -> Duration {
    Duration::from_secs_f64(8.0 / tokens_per_second) + Duration::from_millis(500)
}

/// Generation, then the two ways a call is stopped (cancellation, timeout), measured against
/// the decode speed of the same run. One test so that the timings are not skewed by the other
/// tests of this file decoding at the same time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn generates_text_and_stops_at_cancel_and_timeout() {
    let b = backend();

    // Generates text.
    let t0 = Instant::now();
    let payload = json!({"messages": [{"role": "user", "content": "What is the capital of France?"}],
                         "max_tokens": 48});
    let out = b
        .call(
            request(payload.clone(), Duration::from_secs(600)),
            CancellationToken::new(),
        )
        .await
        .expect("generation succeeds");
    let elapsed = t0.elapsed();
    let usage = out.usage.unwrap();
    let tps = out.tokens_per_second.expect("tokens per second");
    eprintln!(
        "generated {} tokens (prompt {}) in {elapsed:?}, decode {tps:.1} tok/s: {:?}",
        usage.completion_tokens, usage.prompt_tokens, out.text
    );
    assert!(!out.text.trim().is_empty(), "empty answer");
    assert!(usage.completion_tokens > 0 && usage.completion_tokens <= 48);
    assert!(usage.prompt_tokens > 10);
    // The worker's measure of the request before the call is the model's own count (the
    // template's tokens included), not the 4-characters-a-token approximation.
    let payload = payload.as_object().unwrap();
    let measured = b.request_size("chat", payload).expect("a chat payload");
    let approx = lastcall_backend::RequestSize::of_payload(payload).unwrap();
    assert_eq!(
        (measured.prompt_tokens, measured.max_tokens),
        (usage.prompt_tokens, Some(48))
    );
    assert_ne!(measured.prompt_tokens, approx.prompt_tokens, "{approx:?}");
    assert!(b.counts_prompt_tokens("chat"));
    assert_eq!(out.model.as_deref(), Some("SmolLM2-135M-Instruct-Q4_1"));
    assert!(
        out.text.contains("Paris"),
        "a 135M model should still know this: {:?}",
        out.text
    );

    // Stops when the cancellation token fires mid-decode.
    let cancel = CancellationToken::new();
    let long =
        json!({"prompt": "Write a long story about a dragon and a knight.", "max_tokens": 4000});
    let fire_after = Duration::from_millis(300);
    let canceller = {
        let cancel = cancel.clone();
        tokio::spawn(async move {
            tokio::time::sleep(fire_after).await;
            cancel.cancel();
            Instant::now()
        })
    };
    let r = b
        .call(request(long.clone(), Duration::from_secs(600)), cancel)
        .await;
    let returned = Instant::now();
    let fired = canceller.await.unwrap();
    let lag = returned.saturating_duration_since(fired);
    eprintln!("cancel: returned {lag:?} after the token fired");
    assert_eq!(r, Err(BackendError::Cancelled { confirmed: true }));
    assert!(
        lag <= stop_bound(tps),
        "stopped {lag:?} after cancel at {tps:.1} tok/s"
    );

    // Stops at the request's timeout without any cancellation.
    let timeout = Duration::from_millis(300);
    let t0 = Instant::now();
    let r = b
        .call(request(long, timeout), CancellationToken::new())
        .await;
    let took = t0.elapsed();
    eprintln!("timeout {timeout:?}: returned after {took:?}");
    assert_eq!(r, Err(BackendError::Cancelled { confirmed: true }));
    assert!(
        took <= timeout + stop_bound(tps),
        "took {took:?} with timeout {timeout:?}"
    );
}

#[tokio::test]
async fn rejects_a_bad_payload_as_terminal() {
    let b = backend();
    let r = b
        .call(
            request(json!({"messages": "hi"}), Duration::from_secs(5)),
            CancellationToken::new(),
        )
        .await;
    assert!(
        matches!(r, Err(BackendError::Terminal { ref reason, .. }) if reason == "invalid_payload"),
        "{r:?}"
    );
}

#[tokio::test]
async fn an_already_cancelled_call_does_not_start() {
    let b = backend();
    let cancel = CancellationToken::new();
    cancel.cancel();
    let t0 = Instant::now();
    let r = b
        .call(
            request(json!({"prompt": "hi"}), Duration::from_secs(5)),
            cancel,
        )
        .await;
    assert_eq!(r, Err(BackendError::Cancelled { confirmed: true }));
    assert!(t0.elapsed() < Duration::from_millis(500));
}

/// A pool of two instances serves two calls at once, and refuses a third instead of
/// queueing it behind the others (queueing after admission would defeat the last check).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pool_gives_each_slot_its_own_instance_and_never_queues() {
    let pool = std::sync::Arc::new(
        lastcall_local::LocalPool::load(common::model_path(), 2).expect("model loads"),
    );
    assert_eq!(pool.size(), 2);
    let long = || {
        request(
            json!({"prompt": "Count from one to fifty.", "max_tokens": 400}),
            Duration::from_secs(600),
        )
    };
    let (c1, c2) = (CancellationToken::new(), CancellationToken::new());
    let (p1, p2) = (pool.clone(), pool.clone());
    let (k1, k2) = (c1.clone(), c2.clone());
    let a = tokio::spawn(async move { p1.call(long(), k1).await });
    let b = tokio::spawn(async move { p2.call(long(), k2).await });
    common::wait_until("both calls hold an instance", || pool.available() == 0).await;
    let third = pool.call(long(), CancellationToken::new()).await;
    assert!(
        matches!(&third, Err(BackendError::Retryable { reason, .. }) if reason == "local_pool_busy"),
        "{third:?}"
    );
    c1.cancel();
    c2.cancel();
    assert!(matches!(
        a.await.unwrap(),
        Err(BackendError::Cancelled { confirmed: true })
    ));
    assert!(matches!(
        b.await.unwrap(),
        Err(BackendError::Cancelled { confirmed: true })
    ));
    // Both instances are free again.
    let again = pool
        .call(
            // A generous timeout: on a loaded machine prefill alone can take seconds.
            request(
                json!({"prompt": "Hi", "max_tokens": 2}),
                Duration::from_secs(600),
            ),
            CancellationToken::new(),
        )
        .await;
    assert!(again.is_ok(), "{again:?}");
}
