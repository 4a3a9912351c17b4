//! Per-backend rate limits (issue #32 item 3), against a worker with the OpenAI-compatible
//! backend and the fault-injecting chat-completions server of `common::upstream` over real
//! HTTP, with real RabbitMQ and the ledger.
//!
//! - Limits learned from the server's `x-ratelimit-*` headers: jobs whose permit comes in
//!   time wait for it and complete, their calls spaced as the headers say; jobs whose
//!   latest useful start comes before the next permit end at once
//!   (`admission:rate_limited`) with no call reaching the server.
//! - Configured limits (`--rate-limit openai:rpm=N,tpm=N`): the burst the limit allows goes
//!   out, the job past it ends `admission:rate_limited`, and a request larger than the
//!   tokens per minute never gets a permit.
//! - A 429 with `Retry-After`: the backend is held that long, so jobs that cannot wait end
//!   at once without a call (`admission:rate_limited`); the refused job is retried no
//!   earlier than it asked and completes inside its budget; one whose budget cannot cover
//!   it ends at once (`retry:rate_limited`).

use crate::common;

use common::upstream::{HEALTHY, LIMITED, Upstream, openai, submit_all, until};
use common::*;
use lastcall_core::rate_limit::Limits;
use lastcall_worker::clock::now_ms;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

fn rate_limited(w: &lastcall_worker::stats::WorkerStats) -> u64 {
    w.rate_limited.load(Ordering::Relaxed)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limits_learned_from_headers_space_the_calls_and_refuse_what_cannot_wait() {
    let up = Arc::new(Upstream::default());
    let (base, server) = up.start().await;
    let env = Env::sqlite("rate-headers").await;
    let cfg = env.worker_config(2, 16);
    let w = env.start_worker(cfg, openai(&base), system_clock()).await;
    let s = env.submitter(100, true).await;

    // The server allows 60 a minute, has none left now, and resets in 1 s: after each
    // answer the next call waits 1 s (and the bucket refills one a second).
    up.set_request_limit(60, 0, "1s");
    let warm = submit_all(&s, "warm", 1, 10_000).await;
    let recs = env.wait_terminal(&warm, Duration::from_secs(15)).await;
    assert_eq!(recs[0].state, "completed", "{recs:#?}");

    // Three jobs that can wait: each waits for its permit and completes.
    let n0 = up.requests.load(Ordering::SeqCst) as usize;
    let fit = submit_all(&s, "fit", 3, 15_000).await;
    let recs = env.wait_terminal(&fit, Duration::from_secs(30)).await;
    assert!(recs.iter().all(|r| r.state == "completed"), "{recs:#?}");
    let arrivals = up.arrivals.lock().unwrap().clone();
    assert_eq!(arrivals.len(), n0 + 3, "one call per job");
    // Each call waits for the window its predecessor's answer announced (1 s from that
    // answer, so more than 1 s from its arrival); the bucket alone (one a second) keeps
    // the takes 1 s apart, which the server sees within a few ms of transport jitter.
    for pair in arrivals[n0 - 1..].windows(2) {
        assert!(
            pair[1] - pair[0] >= Duration::from_millis(950),
            "a call came {:?} after the previous one; the headers said 1 s",
            pair[1] - pair[0]
        );
    }
    assert_eq!(rate_limited(&w.stats), 0);

    // Now it allows 2 a minute and resets in 30 s: a job with 5 s cannot wait for that.
    up.set_request_limit(2, 0, "30s");
    let teach = submit_all(&s, "teach", 1, 10_000).await;
    let recs = env.wait_terminal(&teach, Duration::from_secs(15)).await;
    assert_eq!(recs[0].state, "completed", "{recs:#?}");
    let n1 = up.requests.load(Ordering::SeqCst);
    let late = submit_all(&s, "late", 3, 5_000).await;
    let recs = env.wait_terminal(&late, Duration::from_secs(15)).await;
    for r in &recs {
        assert_eq!(r.state, "expired_not_started", "{r:#?}");
        assert_eq!(r.reason.as_deref(), Some("admission:rate_limited"));
        assert_eq!(r.backend_calls, 0);
        // Ended at once, not at the deadline.
        assert!(
            r.recorded_at_ms.unwrap() < r.expires_at_ms.unwrap() - 2_000,
            "{r:#?}"
        );
        assert_eq!(r.started_at_ms, None, "{r:#?}");
    }
    assert_eq!(
        up.requests.load(Ordering::SeqCst),
        n1,
        "no call reached the server"
    );
    assert_eq!(rate_limited(&w.stats), 3);
    w.stop().await;
    server.abort();
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn configured_limits_allow_their_burst_and_refuse_the_rest_without_a_call() {
    let up = Arc::new(Upstream::default());
    let (base, server) = up.start().await;
    let env = Env::sqlite("rate-config").await;
    let mut cfg = env.worker_config(2, 16);
    // Two requests a minute (a burst of two, then one every 30 s), 2,000 tokens a minute.
    cfg.rate_limits.insert(
        "openai".into(),
        Limits {
            requests_per_minute: Some(2),
            tokens_per_minute: Some(2_000),
        },
    );
    let w = env.start_worker(cfg, openai(&base), system_clock()).await;
    let s = env.submitter(100, true).await;

    // A request that asks for more tokens than the minute allows never gets a permit.
    let big = serde_json::json!({
        "messages": [{"role": "user", "content": "summarize"}],
        "max_tokens": 5_000,
    });
    s.submit(&job_with("big-0", 20_000, big), now_ms())
        .await
        .unwrap();
    let recs = env
        .wait_terminal(&["big-0".to_owned()], Duration::from_secs(15))
        .await;
    assert_eq!(recs[0].state, "expired_not_started", "{recs:#?}");
    assert_eq!(recs[0].reason.as_deref(), Some("admission:rate_limited"));
    assert_eq!(up.requests.load(Ordering::SeqCst), 0);

    // The burst: two calls go out at once.
    up.set(HEALTHY);
    let burst = submit_all(&s, "burst", 2, 10_000).await;
    let recs = env.wait_terminal(&burst, Duration::from_secs(15)).await;
    assert!(recs.iter().all(|r| r.state == "completed"), "{recs:#?}");
    assert_eq!(up.requests.load(Ordering::SeqCst), 2);

    // The next permit is ~30 s away: a job with 5 s ends at once, without a call.
    let past = submit_all(&s, "past", 2, 5_000).await;
    let recs = env.wait_terminal(&past, Duration::from_secs(15)).await;
    for r in &recs {
        assert_eq!(r.state, "expired_not_started", "{r:#?}");
        assert_eq!(r.reason.as_deref(), Some("admission:rate_limited"));
        assert!(r.recorded_at_ms.unwrap() < r.expires_at_ms.unwrap() - 2_000);
        assert_eq!((r.backend_calls, r.started_at_ms), (0, None), "{r:#?}");
    }
    assert_eq!(
        up.requests.load(Ordering::SeqCst),
        2,
        "no call past the limit"
    );
    assert_eq!(rate_limited(&w.stats), 3);
    w.stop().await;
    server.abort();
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_429_with_retry_after_holds_the_backend_and_is_retried_after_it_or_ends_at_once() {
    let up = Arc::new(Upstream::default());
    let (base, server) = up.start().await;
    let env = Env::sqlite("rate-429").await;
    let cfg = env.worker_config(2, 16);
    let w = env.start_worker(cfg, openai(&base), system_clock()).await;
    let s = env.submitter(100, true).await;

    // 429 with Retry-After: 8. A job with 1.5 s cannot wait 8 s: it ends at once after
    // its one call.
    up.retry_after_s.store(8, Ordering::SeqCst);
    up.set(LIMITED);
    let tight = submit_all(&s, "tight", 1, 1_500).await;
    let recs = env.wait_terminal(&tight, Duration::from_secs(10)).await;
    assert_eq!(recs[0].state, "expired_not_started", "{recs:#?}");
    assert_eq!(recs[0].reason.as_deref(), Some("retry:rate_limited"));
    assert!(recs[0].recorded_at_ms.unwrap() < recs[0].expires_at_ms.unwrap() - 500);
    assert_eq!(up.requests.load(Ordering::SeqCst), 1);

    // The 429 said: no request for 8 s. Jobs with 3 s end at once, without a call.
    let short = submit_all(&s, "short", 2, 3_000).await;
    let recs = env.wait_terminal(&short, Duration::from_secs(10)).await;
    for r in &recs {
        assert_eq!(r.state, "expired_not_started", "{r:#?}");
        assert_eq!(r.reason.as_deref(), Some("admission:rate_limited"));
        assert_eq!((r.backend_calls, r.started_at_ms), (0, None), "{r:#?}");
    }
    assert_eq!(up.requests.load(Ordering::SeqCst), 1, "no call while held");
    assert_eq!(rate_limited(&w.stats), 2);

    // A job with 25 s waits out the hold, is refused again (Retry-After: 2, and the
    // headers: none left for 2 s), retried no earlier than 2 s later, and completes.
    up.retry_after_s.store(2, Ordering::SeqCst);
    up.set_request_limit(600, 0, "2s");
    let n0 = up.requests.load(Ordering::SeqCst);
    let roomy = submit_all(&s, "roomy", 1, 25_000).await;
    until(
        "the roomy job's first call",
        Duration::from_secs(15),
        || up.requests.load(Ordering::SeqCst) > n0,
    )
    .await;
    up.set(HEALTHY);
    up.set_headers(&[]);
    let recs = env.wait_terminal(&roomy, Duration::from_secs(30)).await;
    assert_eq!(recs[0].state, "completed", "{recs:#?}");
    let arrivals = up.arrivals.lock().unwrap().clone();
    let (first, retry) = (arrivals[n0 as usize], arrivals[n0 as usize + 1]);
    assert!(
        retry - first >= Duration::from_secs(2),
        "the retry came {:?} after the 429's Retry-After: 2",
        retry - first
    );
    w.stop().await;
    server.abort();
    env.cleanup().await;
}
