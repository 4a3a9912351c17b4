//! A model server that misbehaves, then recovers (issue #32), against a worker with the
//! OpenAI-compatible backend and default settings: the fault-injecting chat-completions
//! server of `common::upstream`, over real HTTP, with real RabbitMQ and the ledger.
//!
//! Phases, as a user saw them: 150 ms calls; 503s and 429s with `Retry-After: 1`; calls
//! accepted and never answered (a stuck GPU); healthy again. The calls cut at their
//! deadline during the hang used to lift the learned p99 above every budget, and nothing
//! ran (so nothing was learned) for up to ten minutes. Now the refusal rests on cut calls
//! only, so jobs run as probes while slots are free, and their completions contradict the
//! cut calls: the jobs sent after the recovery finish.

use crate::common;

use common::upstream::{BUSY, BY_LENGTH, HANGING, HEALTHY, Upstream};
use common::*;
use lastcall_backend::Backend;
use lastcall_openai::{OpenAiBackend, OpenAiConfig};
use lastcall_worker::clock::now_ms;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

/// Submit one job with a 3 s budget every 100 ms for `for_ms`; the ids.
async fn send(
    s: &lastcall_worker::Submitter,
    tag: &str,
    for_ms: u64,
    ids: &mut Vec<String>,
) -> Vec<String> {
    let mut sent = Vec::new();
    let n = for_ms / 100;
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    for i in 0..n {
        tick.tick().await;
        let id = format!("{tag}-{i}");
        s.submit(&job(&id, 3_000), now_ms()).await.unwrap();
        sent.push(id.clone());
        ids.push(id);
    }
    sent
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_hang_and_errors_the_estimate_recovers_and_jobs_run_again() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init(); // TEMP
    let up = Arc::new(Upstream::default());
    let (base, server) = up.start().await;

    let env = Env::sqlite("upstream-faults").await;
    let backend: Arc<dyn Backend> =
        Arc::new(OpenAiBackend::new(OpenAiConfig::new(&base, "m")).unwrap());
    // Default settings but for the 4 slots.
    let cfg = env.worker_config(4, 16);
    cfg.topology.apply(&env.broker).await.unwrap();
    let w = env.start_worker(cfg, backend, system_clock()).await;
    let s = env.submitter(100, true).await;
    let mut all = Vec::new();

    send(&s, "healthy", 4_000, &mut all).await;
    up.set(BUSY);
    send(&s, "failing", 4_000, &mut all).await;
    up.set(HANGING);
    send(&s, "hang", 2_000, &mut all).await;
    up.set(HEALTHY);
    let after = send(&s, "after", 5_000, &mut all).await;
    // The last two seconds of jobs come once the cut calls have ended and been probed.
    let late = send(&s, "late", 2_000, &mut all).await;
    // A retry (the 503s and 429s) that then expired in the work queue while the slots were
    // stuck on hung calls is a dead letter: the dead-letter processor records it, as
    // `lastcall dlq` does in a deployment. Every failing-phase deadline has passed by now.
    env.drain_dead_letters(false).await;

    let recs = env.wait_terminal(&all, Duration::from_secs(60)).await;
    // Every job has exactly one outcome (the ledger holds one row per id, terminal).
    assert_eq!(recs.len(), all.len());
    let on_time = |ids: &[String]| {
        recs.iter()
            .filter(|r| ids.contains(&r.job_id))
            .filter(|r| r.state == "completed")
            .filter(|r| r.finished_at_ms.unwrap_or(i64::MAX) <= r.expires_at_ms.unwrap_or(0))
            .count()
    };
    let cut_during_hang = recs
        .iter()
        .filter(|r| r.state == "deadline_exceeded")
        .count();
    let refused_learned = |ids: &[String]| {
        recs.iter()
            .filter(|r| ids.contains(&r.job_id))
            .filter(|r| {
                r.reason
                    .as_deref()
                    .is_some_and(|x| x.ends_with("below_learned_runtime"))
            })
            .count()
    };
    let probes = lastcall_worker::stats::WorkerStats::get(&w.stats.probes);
    eprintln!(
        "after recovery: {}/{} on time ({} refused by the learned time), last 2 s: {}/{}; \
         cut calls {cut_during_hang}, probes {probes}, upstream requests {} answered {}",
        on_time(&after),
        after.len(),
        refused_learned(&after),
        on_time(&late),
        late.len(),
        up.requests.load(Ordering::SeqCst),
        up.answered.load(Ordering::SeqCst),
    );
    let mut missed = std::collections::BTreeMap::<String, usize>::new();
    for r in recs.iter().filter(|r| after.contains(&r.job_id)) {
        if r.state != "completed"
            || r.finished_at_ms.unwrap_or(i64::MAX) > r.expires_at_ms.unwrap_or(0)
        {
            let why = format!("{} {}", r.state, r.reason.as_deref().unwrap_or("-"));
            *missed.entry(why).or_default() += 1;
        }
    }
    eprintln!("after recovery, not on time: {missed:?}");
    assert!(cut_during_hang > 0, "the hang cut calls at their deadline");
    // No lock-out: once the cut calls have been probed, no job is refused for the
    // learned time; every job of the last two seconds finishes in time. (Before: the
    // cut calls held the p99 above every budget for up to ten minutes.)
    assert_eq!(refused_learned(&late), 0, "{recs:#?}");
    assert_eq!(on_time(&late), late.len());
    // And the jobs sent after the recovery finish, though the slots stayed stuck on the
    // hung calls until their deadlines for the first second of it, and the breaker's
    // backoff had grown: a job that cannot wait for it takes a demand trial, and a
    // trial declared hung does not decide its successor's verdict. (Measured: 49–50 of
    // 50 in 10 runs; 39–46 in some runs without the demand trial and the trial's name.)
    assert!(on_time(&after) * 10 >= after.len() * 8, "{missed:?}");
    w.stop().await;
    server.abort();
    env.cleanup().await;
}

/// Issue #31's workload: one kind mixing short prompts (70%, ~70 ms alone) and long ones
/// (30%, ~1.25 s alone) on a server whose call time grows with the prompt and the batch;
/// 2.5 s budgets, about 7× overload, default settings (2 slots). With one call time per
/// kind, the kind's p99 is a long call's, and every short job that waited at all was
/// refused `below_learned_runtime`: 17 of 360 on time. The request-aware estimate holds
/// each job to its own predicted time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn short_and_long_prompts_of_one_kind_are_each_held_to_their_own_call_time() {
    let up = Arc::new(Upstream::default());
    up.set(BY_LENGTH);
    let (base, server) = up.start().await;

    let env = Env::sqlite("by-length").await;
    let backend: Arc<dyn Backend> =
        Arc::new(OpenAiBackend::new(OpenAiConfig::new(&base, "m")).unwrap());
    // The worker's defaults: 2 slots, the default window.
    let mut cfg = lastcall_worker::WorkerConfig::new(&env.prefix, 2);
    cfg.topology = env.topo.clone();
    cfg.name = "by-length-worker".into();
    cfg.topology.apply(&env.broker).await.unwrap();
    let w = env.start_worker(cfg, backend, system_clock()).await;
    let s = env.submitter(100, true).await;
    let short = "summarize the incident for the on-call engineer now";
    let long = "log line with a timestamp and a message ".repeat(75); // 600 words
    let mut ids = Vec::new();
    let mut tick = tokio::time::interval(Duration::from_millis(33));
    for i in 0..360 {
        tick.tick().await;
        let is_long = i % 10 >= 7;
        let id = format!("{}-{i}", if is_long { "long" } else { "short" });
        let prompt = if is_long { long.as_str() } else { short };
        let payload = serde_json::json!({"prompt": prompt, "max_tokens": 16});
        s.submit(&job_with(&id, 2_500, payload), now_ms())
            .await
            .unwrap();
        ids.push(id);
    }
    let recs = env.wait_terminal(&ids, Duration::from_secs(60)).await;
    let on_time = |prefix: &str| {
        recs.iter()
            .filter(|r| r.job_id.starts_with(prefix) && r.state == "completed")
            .filter(|r| r.finished_at_ms.unwrap_or(i64::MAX) <= r.expires_at_ms.unwrap_or(0))
            .count()
    };
    let cut = recs
        .iter()
        .filter(|r| r.state == "deadline_exceeded")
        .count();
    eprintln!(
        "on time: {} of 360 ({} short, {} long); cut at the deadline: {cut}; upstream calls {}",
        on_time(""),
        on_time("short"),
        on_time("long"),
        up.answered.load(Ordering::SeqCst),
    );
    // One call time for the kind gave 17 of 360. docs/concepts.md and BENCHMARKS cite 255–256
    // of 360 from this test; ≥ 200 is that figure with a margin for a loaded machine.
    assert!(
        on_time("") >= 200,
        "{} of 360 on time: {recs:#?}",
        on_time("")
    );
    assert_eq!(cut, 0, "no call cut at its deadline: {recs:#?}");
    w.stop().await;
    server.abort();
    env.cleanup().await;
}
