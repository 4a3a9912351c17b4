//! The door's tiers and the workers' breakers through the real `lastcall serve`, with real
//! RabbitMQ and the ledger (issues #33 item 3, #32 item 2):
//! - under a flood of `batch` work, a `critical` job is admitted while a `batch` one is
//!   shed (`429 would_expire_in_queue`, nothing published or recorded);
//! - while the worker's breaker for the kind's model server (the fault-injecting server of
//!   `common::upstream`) is open, `POST /v1/jobs` of that kind answers `503
//!   upstream_unavailable` with `Retry-After` and publishes nothing; after the server
//!   recovers and the breaker closes, jobs are admitted again.

use crate::common;

use common::serve::Serve;
use common::upstream::{FAILING, HEALTHY, Upstream};
use common::*;
use lastcall_backend::Backend;
use lastcall_broker::management::Management;
use lastcall_core::Priority;
use lastcall_core::breaker::{BreakerPolicy, BreakerState};
use lastcall_openai::{OpenAiBackend, OpenAiConfig};
use lastcall_worker::clock::now_ms;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

const TOKEN: &str = "door-test-token-0123456789";
const MANAGEMENT: &str = "http://127.0.0.1:15672";

/// curl with the response headers in front of the body; (status, headers and body).
fn curl(args: &[&str]) -> (u16, String) {
    let out = Command::new("curl")
        .args([
            "-s",
            "--max-time",
            "30",
            "-D",
            "-",
            "-o",
            "-",
            "-w",
            "\n%{http_code}",
        ])
        .args(args)
        .output_bounded()
        .expect("curl");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, code) = text.rsplit_once('\n').unwrap_or(("", "0"));
    (code.trim().parse().unwrap_or(0), body.to_owned())
}

/// `POST /v1/jobs` of a job of `job()`'s kind at `priority`.
fn post(base: &str, id: &str, deadline_ms: u64, priority: &str) -> (u16, String) {
    let body = format!(
        r#"{{"job_id":"{id}","kind":"incident.summary","priority":"{priority}","deadline_ms":{deadline_ms},"payload":{{"messages":[{{"role":"user","content":"summarize"}}]}}}}"#
    );
    curl(&[
        "-X",
        "POST",
        &format!("{base}/v1/jobs"),
        "-H",
        &format!("Authorization: Bearer {TOKEN}"),
        "-H",
        "Content-Type: application/json",
        "--data",
        &body,
    ])
}

/// The `Retry-After` header of a response printed by [`curl`].
fn retry_after(resp: &str) -> Option<u64> {
    resp.lines().find_map(|l| {
        let (name, value) = l.split_once(':')?;
        name.eq_ignore_ascii_case("retry-after")
            .then(|| value.trim().parse().ok())
            .flatten()
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_a_batch_flood_critical_is_admitted_and_batch_is_shed() {
    let env = Env::sqlite("door-tiers").await;
    let s = env.submitter(100, true).await;
    for i in 0..400 {
        let e = s
            .envelope(&job(&format!("flood-{i}"), 120_000), now_ms())
            .unwrap()
            .with_priority(Priority::Batch);
        s.submit_envelope(&e, None, now_ms()).await.unwrap();
    }
    // One slot, 100 ms calls: ~10 acks/s from the batch lane, ~40 s of backlog.
    let worker = env
        .start_worker(env.worker_config(1, 4), sim(100), system_clock())
        .await;
    let lane = env
        .topo
        .names
        .lane_queue(lastcall_core::lane_of("default", Priority::Batch));
    let m = Management::from_amqp_url(AMQP, MANAGEMENT);
    let until = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(Some(st)) = m.queue_stats(&lane).await
            && st.ack_rate_per_s.is_some_and(|r| r > 0.0)
            && st.ready > 150
        {
            break;
        }
        assert!(Instant::now() < until, "no ack rate sampled on {lane}");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }

    // Shedding on, the default.
    let serving = Serve::start(&env, TOKEN, &[]).await;
    let base = serving.base.clone();
    // Batch behind ~15+ s of batch backlog with a 3 s budget: shed, nothing published.
    let (code, resp) = post(&base, "batch-late", 3_000, "batch");
    assert_eq!(code, 429, "{resp}");
    assert!(
        resp.contains(r#""error":"would_expire_in_queue""#),
        "{resp}"
    );
    assert!(retry_after(&resp).is_some_and(|s| s >= 1), "{resp}");
    assert!(env.ledger.get("batch-late").await.unwrap().is_none());
    // Critical with the same budget: the worker serves it first, whatever waits.
    let (code, resp) = post(&base, "critical-now", 3_000, "critical");
    assert_eq!(code, 202, "{resp}");
    // The `default` tenant's standard job: the work queue is empty, the batch lane is no
    // wait for a higher tier.
    let (code, resp) = post(&base, "standard-now", 3_000, "standard");
    assert_eq!(code, 202, "{resp}");
    // It runs before the flood: completed in its budget.
    let recs = env
        .wait_terminal(&["critical-now".to_owned()], Duration::from_secs(10))
        .await;
    assert_eq!(recs[0].state, "completed", "{:#?}", recs[0]);
    drop(serving);
    worker.stop().await;
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn while_the_breaker_is_open_the_door_answers_503_and_publishes_nothing() {
    breaker_at_the_door(Env::sqlite("door-breaker").await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn while_the_breaker_is_open_the_door_answers_503_with_a_postgres_ledger() {
    breaker_at_the_door(Env::postgres("door-breaker-pg").await).await;
}

async fn breaker_at_the_door(env: Env) {
    let up = Arc::new(Upstream::default());
    let (upstream_base, server) = up.start().await;
    let backend: Arc<dyn Backend> =
        Arc::new(OpenAiBackend::new(OpenAiConfig::new(&upstream_base, "m")).unwrap());
    let mut cfg = env.worker_config(2, 16);
    cfg.breaker = BreakerPolicy {
        failures_to_open: 3,
        cool_down_ms: 3_000,
        max_cool_down_ms: 6_000,
        ..Default::default()
    };
    let w = env.start_worker(cfg, backend, system_clock()).await;
    let s = env.submitter(100, true).await;
    // Shedding on, the default.
    let serving = Serve::start(&env, TOKEN, &[]).await;
    let base = serving.base.clone();

    // Healthy: admitted and completed.
    let (code, resp) = post(&base, "healthy", 10_000, "standard");
    assert_eq!(code, 202, "{resp}");
    let recs = env
        .wait_terminal(&["healthy".to_owned()], Duration::from_secs(20))
        .await;
    assert_eq!(recs[0].state, "completed", "{:#?}", recs[0]);

    // 503s: three failures open the breaker; the jobs with budget wait for its trials.
    up.set(FAILING);
    let mut failing = Vec::new();
    for i in 0..4 {
        let id = format!("failing-{i}");
        s.submit(&job(&id, 60_000), now_ms()).await.unwrap();
        failing.push(id);
    }
    let end = Instant::now() + Duration::from_secs(20);
    while w
        .stats
        .breakers
        .lock()
        .unwrap()
        .values()
        .all(|b| b.state != BreakerState::Open)
    {
        assert!(Instant::now() < end, "the breaker never opened");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The door sees it (the worker's ledger write, the door's 1 s cache): 503 with
    // Retry-After, nothing published or recorded. A job posted between a trial time and
    // the failed trial's new record is admitted (it waits in the worker like the others):
    // post until refused.
    let mut refused = Vec::new();
    let mut tries = 0;
    let mut refuse = |priority: &str| {
        let end = Instant::now() + Duration::from_secs(10);
        loop {
            let id = format!("refused-{priority}-{tries}");
            tries += 1;
            let (code, resp) = post(&base, &id, 30_000, priority);
            if code == 503 {
                refused.push(id);
                return resp;
            }
            assert_eq!(code, 202, "{resp}");
            failing.push(id);
            assert!(Instant::now() < end, "never refused: {resp}");
            std::thread::sleep(Duration::from_millis(100));
        }
    };
    let resp = refuse("standard");
    assert!(resp.contains(r#""error":"upstream_unavailable""#), "{resp}");
    let secs = retry_after(&resp).expect("Retry-After");
    assert!(
        (1..=6).contains(&secs),
        "Retry-After {secs} within the cool-down: {resp}"
    );
    // Every tier is refused (the model server is down for every job of the kind).
    let resp = refuse("critical");
    assert!(resp.contains(r#""error":"upstream_unavailable""#), "{resp}");
    // `lastcall submit` too: exit 75, nothing published.
    let end = Instant::now() + Duration::from_secs(10);
    loop {
        let id = format!("cli-{tries}");
        tries += 1;
        let out = env.submit_cli(&id, "30000", &[]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        if out.status.code() == Some(75) {
            assert!(stderr.contains("is unavailable"), "{stderr}");
            refused.push(id);
            break;
        }
        assert!(out.status.success(), "{stderr}");
        failing.push(id);
        assert!(Instant::now() < end, "submit never refused: {stderr}");
    }

    // Recovery: the next trial succeeds, the breaker closes, the door admits again.
    up.set(HEALTHY);
    let end = Instant::now() + Duration::from_secs(30);
    let mut n = 0;
    let admitted = loop {
        let id = format!("after-{n}");
        n += 1;
        let (code, resp) = post(&base, &id, 30_000, "standard");
        if code == 202 {
            break id;
        }
        assert_eq!(code, 503, "{resp}");
        refused.push(id);
        assert!(Instant::now() < end, "never admitted again: {resp}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    failing.push(admitted.clone());
    let recs = env.wait_terminal(&failing, Duration::from_secs(60)).await;
    let done = recs.iter().find(|r| r.job_id == admitted).unwrap();
    assert_eq!(done.state, "completed", "{done:#?}");
    // What the door refused was never published: no worker ever recorded it.
    for id in &refused {
        assert!(env.ledger.get(id).await.unwrap().is_none(), "{id} recorded");
    }
    drop(serving);
    w.stop().await;
    server.abort();
    env.cleanup().await;
}
