//! Tenancy as a boundary, the model upstream (issue #48 items 3, 5 and part of 9): the
//! operator picks the upstream model, and a model server's headers are advice, not orders.
//! Against a worker with the OpenAI-compatible backend, the fault-injecting
//! chat-completions server of `common::upstream` over real HTTP, real RabbitMQ and the
//! ledger.
//!
//! - A payload's `model` reaches the server only when `--allow-model` names it; otherwise
//!   the worker's `--model` serves.
//! - A 429 with `Retry-After: 86400` holds the backend for the breaker's longest cool-down,
//!   not a day: jobs submitted right after it wait that long and complete.
//! - A 503 with `Retry-After: 86400` opens the breaker for the longest cool-down, not a
//!   day: the trial goes after it and the jobs that waited complete.
//! - A learned `x-ratelimit-limit-tokens` does not refuse a larger request forever: it goes
//!   as a trial when the bucket is full.
//! - Token counts a server reports are clamped: `u64::MAX` twice neither crashes the worker
//!   (an overflow) nor wraps its counters.

use crate::common;

use common::upstream::{FAILING, HEALTHY, LIMITED, Upstream, openai, submit_all, until};
use common::*;
use lastcall_backend::Usage;
use lastcall_core::breaker::{BreakerPolicy, BreakerState};
use lastcall_core::model_choice::AllowedModels;
use lastcall_worker::clock::now_ms;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// A chat job whose payload asks for `model`; the job id is the message, so the server's
/// `seen` list tells which request was whose.
fn asking_for(id: &str, model: &str) -> lastcall_worker::NewJob {
    job_with(
        id,
        10_000,
        serde_json::json!({
            "messages": [{"role": "user", "content": id}],
            "model": model,
        }),
    )
}

/// The model the server was asked for by job `id`.
fn model_asked_by(up: &Upstream, id: &str) -> String {
    let seen = up.seen.lock().unwrap();
    let models = up.models.lock().unwrap();
    let i = seen.iter().position(|(c, _)| c == id).expect("a request");
    models[i].clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_payloads_model_reaches_the_upstream_only_when_the_operator_allows_it() {
    let up = Arc::new(Upstream::default());
    let (base, server) = up.start().await;
    let env = Env::sqlite("model-allow").await;
    let s = env.submitter(100, true).await;

    // No allow-list: the tenant's premium model is not what runs on the operator's key.
    let w = (env.start_worker(env.worker_config(2, 16), openai(&base), system_clock())).await;
    s.submit(&asking_for("premium-0", "premium-model-x"), now_ms())
        .await
        .unwrap();
    let recs = env
        .wait_terminal(&["premium-0".to_owned()], Duration::from_secs(15))
        .await;
    assert_eq!(recs[0].state, "completed", "{recs:#?}");
    assert_eq!(
        model_asked_by(&up, "premium-0"),
        "m",
        "the worker's --model"
    );
    w.stop().await;

    // The operator allows it: that model, and no other, is sent.
    let mut cfg = env.worker_config(2, 16);
    cfg.allowed_models = AllowedModels::new(["premium-model-x".to_owned()]).unwrap();
    let w = env.start_worker(cfg, openai(&base), system_clock()).await;
    s.submit(&asking_for("premium-1", "premium-model-x"), now_ms())
        .await
        .unwrap();
    s.submit(&asking_for("other-1", "other-model"), now_ms())
        .await
        .unwrap();
    let ids = ["premium-1".to_owned(), "other-1".to_owned()];
    let recs = env.wait_terminal(&ids, Duration::from_secs(15)).await;
    assert!(recs.iter().all(|r| r.state == "completed"), "{recs:#?}");
    assert_eq!(model_asked_by(&up, "premium-1"), "premium-model-x");
    assert_eq!(model_asked_by(&up, "other-1"), "m");
    w.stop().await;
    server.abort();
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_day_long_retry_after_on_a_429_holds_the_backend_only_for_the_longest_cool_down() {
    let up = Arc::new(Upstream::default());
    let (base, server) = up.start().await;
    let env = Env::sqlite("advice-429").await;
    let mut cfg = env.worker_config(2, 16);
    cfg.breaker.max_cool_down_ms = 2_000;
    let w = env.start_worker(cfg, openai(&base), system_clock()).await;
    let s = env.submitter(100, true).await;

    // One 429 with Retry-After: 86400 (a day).
    up.retry_after_s.store(86_400, Ordering::SeqCst);
    up.set(LIMITED);
    let first = submit_all(&s, "day", 1, 1_000).await;
    env.wait_terminal(&first, Duration::from_secs(10)).await;
    let limited_at = *up.arrivals.lock().unwrap().last().expect("the 429");
    up.set(HEALTHY);

    // Jobs with 20 s budgets: the backend is held 2 s, not a day; they wait and complete.
    let n0 = up.requests.load(Ordering::SeqCst) as usize;
    let after = submit_all(&s, "after", 3, 20_000).await;
    let recs = env.wait_terminal(&after, Duration::from_secs(30)).await;
    for r in &recs {
        assert_eq!(r.state, "completed", "{r:#?}");
        assert_eq!(r.backend_calls, 1, "{r:#?}");
    }
    let arrivals = up.arrivals.lock().unwrap().clone();
    assert_eq!(arrivals.len(), n0 + 3, "one call per job");
    for a in &arrivals[n0..] {
        // Not before the (cut) hold: the 429 was advice, and it was followed.
        assert!(
            *a - limited_at >= Duration::from_millis(1_900),
            "a call {:?} after the 429",
            *a - limited_at
        );
    }
    assert_eq!(w.stats.rate_limited.load(Ordering::Relaxed), 0);
    w.stop().await;
    server.abort();
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_day_long_retry_after_on_a_503_opens_the_breaker_only_for_the_longest_cool_down() {
    let up = Arc::new(Upstream::default());
    let (base, server) = up.start().await;
    let env = Env::sqlite("advice-503").await;
    let mut cfg = env.worker_config(2, 16);
    cfg.breaker = BreakerPolicy {
        failures_to_open: 2,
        cool_down_ms: 500,
        max_cool_down_ms: 2_000,
        ..Default::default()
    };
    // One attempt: the failing jobs end at their first 503.
    let delays = cfg.topology.retry_delays_ms.clone();
    cfg.policy.retry = lastcall_core::retry::RetryPolicy::new(1, delays[0], delays).unwrap();
    let w = env.start_worker(cfg, openai(&base), system_clock()).await;
    let s = env.submitter(100, true).await;

    // 503s with Retry-After: 86400: two open the breaker.
    up.set_headers(&[("Retry-After", "86400")]);
    up.set(FAILING);
    let failing = submit_all(&s, "failing", 2, 5_000).await;
    env.wait_terminal(&failing, Duration::from_secs(10)).await;
    until("the breaker opens", Duration::from_secs(10), || {
        let view = w.stats.breakers.lock().unwrap();
        view.values().any(|v| v.state == BreakerState::Open)
    })
    .await;
    let opened = Instant::now();
    up.set_headers(&[]);
    up.set(HEALTHY);

    // Jobs with 20 s budgets wait out 2 s (not a day): the trial closes it, all complete.
    let after = submit_all(&s, "after", 3, 20_000).await;
    let recs = env.wait_terminal(&after, Duration::from_secs(30)).await;
    for r in &recs {
        assert_eq!(r.state, "completed", "{r:#?}");
    }
    assert!(
        opened.elapsed() < Duration::from_secs(15),
        "held {:?}",
        opened.elapsed()
    );
    let view = w.stats.breakers.lock().unwrap().clone();
    assert!(
        view.values().all(|v| v.state == BreakerState::Closed),
        "{view:?}"
    );
    w.stop().await;
    server.abort();
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_above_a_learned_tokens_limit_goes_as_a_trial_instead_of_never() {
    let up = Arc::new(Upstream::default());
    let (base, server) = up.start().await;
    let env = Env::sqlite("advice-tpm").await;
    let w = (env.start_worker(env.worker_config(2, 16), openai(&base), system_clock())).await;
    let s = env.submitter(100, true).await;

    // The server says: 1,000 tokens a minute, all of them left, reset in 1 s.
    up.set_headers(&[
        ("x-ratelimit-limit-tokens", "1000"),
        ("x-ratelimit-remaining-tokens", "1000"),
        ("x-ratelimit-reset-tokens", "1s"),
    ]);
    let warm = submit_all(&s, "warm", 1, 10_000).await;
    let recs = env.wait_terminal(&warm, Duration::from_secs(15)).await;
    assert_eq!(recs[0].state, "completed", "{recs:#?}");

    // A request of 3,000 tokens: above the learned limit, it goes alone when the bucket
    // is full, rather than never (`admission:rate_limited` at once).
    let big = serde_json::json!({
        "messages": [{"role": "user", "content": "summarize"}],
        "max_tokens": 3_000,
    });
    s.submit(&job_with("big-0", 20_000, big), now_ms())
        .await
        .unwrap();
    let recs = env
        .wait_terminal(&["big-0".to_owned()], Duration::from_secs(30))
        .await;
    assert_eq!(recs[0].state, "completed", "{recs:#?}");
    assert_eq!(w.stats.rate_limited.load(Ordering::Relaxed), 0);
    w.stop().await;
    server.abort();
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn huge_reported_token_counts_are_clamped_and_never_wrap() {
    let up = Arc::new(Upstream::default());
    let (base, server) = up.start().await;
    let env = Env::sqlite("advice-usage").await;
    let w = (env.start_worker(env.worker_config(2, 16), openai(&base), system_clock())).await;
    let s = env.submitter(100, true).await;

    let max = u64::MAX;
    *up.usage.lock().unwrap() = Some(format!(
        r#"{{"prompt_tokens":{max},"completion_tokens":{max},"total_tokens":{max}}}"#
    ));
    let ids = submit_all(&s, "huge", 2, 10_000).await;
    let recs = env.wait_terminal(&ids, Duration::from_secs(15)).await;
    let cap = Usage::MAX_REPORTED_TOKENS;
    for r in &recs {
        assert_eq!(r.state, "completed", "{r:#?}");
        assert_eq!(r.prompt_tokens, Some(cap as i64), "{r:#?}");
        assert_eq!(r.completion_tokens, Some(cap as i64), "{r:#?}");
    }
    let m = &w.stats.metrics;
    assert_eq!(m.prompt_tokens.load(Ordering::Relaxed), 2 * cap);
    assert_eq!(m.completion_tokens.load(Ordering::Relaxed), 2 * cap);
    w.stop().await;
    server.abort();
    env.cleanup().await;
}
