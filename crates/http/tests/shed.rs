//! Shedding at the door, against the real RabbitMQ and its management API: a deep queue
//! with a measured ack rate answers `429 would_expire_in_queue` with `Retry-After` and
//! publishes nothing; the same ingress admits again once the queue drained; without a
//! shedder (`--no-shed`) it admits; without an ack rate (no consumer yet) or without the
//! management API it admits (fail open). The live door (`Shedder::with_live_depth`, as
//! `serve` builds it) counts the queue itself: it leaves out its own jobs that can no longer
//! finish and sheds behind a backlog as soon as it has measured the pace.

mod common;

use axum::Router;
use axum::body::Body;
use axum::http::{Request, StatusCode};
use common::*;
use lastcall_broker::management::{Management, QueueStats};
use lastcall_http::metrics::sample_value;
use lastcall_producer::shed::Shedder;
use lastcall_producer::{DeadlineSpec, NewJob};
use serde_json::{Value, json};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tower::ServiceExt;

const MANAGEMENT: &str = "http://127.0.0.1:15672";

fn payload() -> Value {
    json!({"messages": [{"role": "user", "content": "summarize"}]})
}

fn body(id: &str, deadline_ms: u64) -> Value {
    json!({"job_id": id, "kind": "incident.summary", "deadline_ms": deadline_ms, "payload": payload()})
}

/// The router of an ingress that sheds (or not) on this environment's work queue.
async fn ingress(env: &Env, shed_via: Option<&str>) -> Router {
    let mut state = env.state_with(Duration::from_secs(5)).await;
    let shedder = shed_via.map(|url| {
        Arc::new(Shedder::new(
            Management::from_amqp_url(AMQP, url),
            env.topo.names.work_queue.clone(),
        ))
    });
    state.submitter = state.submitter.with_shedder(shedder);
    lastcall_http::app(Arc::new(state))
}

/// POST a job; the status, the `Retry-After` header and the JSON body.
async fn post_job(app: &Router, body: &Value) -> (StatusCode, Option<String>, Value) {
    let req = Request::builder()
        .method("POST")
        .uri("/v1/jobs")
        .header("authorization", format!("Bearer {TOKEN}"))
        .header("content-type", "application/json")
        .body(Body::from(serde_json::to_vec(body).unwrap()))
        .unwrap();
    let resp = app.clone().oneshot(req).await.unwrap();
    let status = resp.status();
    let retry_after = resp
        .headers()
        .get("retry-after")
        .map(|v| v.to_str().unwrap().to_owned());
    let bytes = axum::body::to_bytes(resp.into_body(), usize::MAX)
        .await
        .unwrap();
    (
        status,
        retry_after,
        serde_json::from_slice(&bytes).unwrap_or(Value::Null),
    )
}

/// Poll the management API until `ok` holds for the work queue (it samples every 5 s).
async fn wait_for_stats(
    env: &Env,
    what: &str,
    timeout: Duration,
    ok: impl Fn(&QueueStats) -> bool,
) -> QueueStats {
    let m = Management::from_amqp_url(AMQP, MANAGEMENT);
    let until = Instant::now() + timeout;
    let mut last = None;
    loop {
        if let Ok(Some(s)) = m.queue_stats(&env.topo.names.work_queue).await {
            if ok(&s) {
                return s;
            }
            last = Some(s);
        }
        assert!(
            Instant::now() < until,
            "the management API never reported {what}: last {last:?}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

async fn fill(env: &Env, n: usize) -> Vec<String> {
    let submitter = env.submitter(Duration::from_secs(5)).await;
    let mut ids = Vec::with_capacity(n);
    for i in 0..n {
        let id = format!("fill-{i}");
        submitter
            .submit(
                &NewJob {
                    job_id: Some(id.clone()),
                    kind: "incident.summary".into(),
                    payload: payload().as_object().cloned().unwrap(),
                    deadline: DeadlineSpec::RelativeMs(120_000),
                    min_runtime_ms: None,
                    trace_id: None,
                },
                now_ms(),
            )
            .await
            .unwrap();
        ids.push(id);
    }
    ids
}

fn now_ms() -> i64 {
    lastcall_clock::now_ms()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ingress_sheds_with_429_while_the_queue_is_deep_and_admits_again_once_it_drained() {
    let env = Env::new("shed").await;
    let shedding = ingress(&env, Some(MANAGEMENT)).await;
    let plain = ingress(&env, None).await; // what `serve --no-shed` builds

    // A backlog and no consumer yet: no ack rate, so no estimate, so no shedding.
    const N: usize = 400;
    fill(&env, N).await;
    // One more through HTTP (idempotency keys are scoped to the caller: a re-POST is a
    // duplicate of the caller's own job).
    let queued = "queued-by-http";
    let (status, _, resp) = post_job(&plain, &body(queued, 120_000)).await;
    assert_eq!(status, StatusCode::ACCEPTED, "{resp}");
    let s = wait_for_stats(&env, "the backlog", Duration::from_secs(15), |s| {
        s.ready > N as u64
    })
    .await;
    assert_eq!(s.consumers, 0);
    let (status, _, resp) = post_job(&shedding, &body("no-consumer-yet", 1_000)).await;
    assert_eq!(
        status,
        StatusCode::ACCEPTED,
        "no ack rate: admitted: {resp}"
    );

    // A consumer drains ~20 jobs/s (one ack every 50 ms; no worker is needed, only an ack
    // rate). Once the broker has sampled its acks, a 1 s budget behind the backlog is shed
    // (the backlog lasts ~20 s; more than 100 ready is at least 5 s of queue, also one 5 s
    // sample later).
    let consumer = env.paced_consumer(Duration::from_millis(50)).await;
    let s = wait_for_stats(&env, "an ack rate", Duration::from_secs(20), |s| {
        s.ack_rate_per_s.is_some_and(|r| r > 0.0) && s.ready > 100
    })
    .await;
    let started = Instant::now();
    let (status, retry_after, resp) = post_job(&shedding, &body("shed-1", 1_000)).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "{resp} at {s:?}");
    assert_eq!(resp["error"], "would_expire_in_queue", "{resp}");
    let message = resp["message"].as_str().unwrap();
    for part in ["queue wait", " ready at ", "/s", "budget"] {
        assert!(
            message.contains(part),
            "the message names the {part}: {message}"
        );
    }
    let est = &resp["estimate"];
    assert!(est["ready"].as_u64().unwrap() > 0, "{resp}");
    assert!(est["ack_rate_per_s"].as_f64().unwrap() > 0.0, "{resp}");
    assert!(est["queue_wait_ms"].as_u64().unwrap() > 1_000, "{resp}");
    let retry_after: u64 = retry_after.expect("Retry-After").parse().unwrap();
    assert!(retry_after >= 1, "{retry_after}");
    assert_eq!(est["retry_after_s"].as_u64(), Some(retry_after));
    // Never published, never recorded.
    assert!(env.ledger.get("shed-1").await.unwrap().is_none());
    let mut shed = 1;

    // The same budget without shedding is accepted; an id that is already queued is
    // answered as the duplicate it is, not shed.
    let (status, _, resp) = post_job(&plain, &body("admitted-anyway", 1_000)).await;
    assert_eq!(status, StatusCode::ACCEPTED, "no shedder: admitted: {resp}");
    let (status, _, resp) = post_job(&shedding, &body(queued, 120_000)).await;
    assert!(
        status == StatusCode::ACCEPTED || status == StatusCode::OK,
        "a known id is not shed: {status} {resp}"
    );
    assert_eq!(resp["duplicate"], true, "{resp}");

    // As the queue drains, the same request is admitted again.
    let until = Instant::now() + Duration::from_secs(45);
    let mut n = 0;
    let admitted_id = loop {
        n += 1;
        let id = format!("retry-{n}");
        let (status, retry_after, resp) = post_job(&shedding, &body(&id, 1_000)).await;
        match status {
            StatusCode::ACCEPTED => break id,
            StatusCode::TOO_MANY_REQUESTS => {
                assert!(retry_after.is_some(), "{resp}");
                assert!(env.ledger.get(&id).await.unwrap().is_none());
                shed += 1;
            }
            other => panic!("{other}: {resp}"),
        }
        assert!(
            Instant::now() < until,
            "still shed {:?} after the first 429: {resp}",
            started.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    assert!(env.ledger.get(&admitted_id).await.unwrap().is_some());
    eprintln!(
        "first 429: {est} (Retry-After {retry_after} s); admitted again after {:?} and {shed} sheds",
        started.elapsed()
    );

    // Shed jobs are counted.
    let (status, text) = call(&shedding, "GET", "/metrics", Some(TOKEN), None).await;
    assert_eq!(status, StatusCode::OK);
    let text = text.as_str().unwrap();
    assert_eq!(
        sample_value(text, "lastcall_http_shed_total"),
        Some(shed as f64),
        "{text}"
    );
    assert_eq!(
        sample_value(
            text,
            r#"lastcall_http_responses_total{route="/v1/jobs",status="429"}"#
        ),
        Some(shed as f64)
    );

    // Every shed id stayed out of the ledger and out of the queue: once the consumer has
    // taken a marker queued behind every shed attempt, none of them was delivered. (Not the
    // admitted job itself: the door admits on the broker's sampled ack rate, which can run
    // ahead of the consumer's pace on a busy machine, and then that job's 1 s TTL may end
    // in the queue. The marker has two minutes.)
    let (status, _, resp) = post_job(&plain, &body("marker", 120_000)).await;
    assert_eq!(status, StatusCode::ACCEPTED, "{resp}");
    let until = Instant::now() + Duration::from_secs(60);
    while !consumer.has_seen("marker") {
        assert!(
            Instant::now() < until,
            "the consumer never reached the marker"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let delivered = consumer.stop().await;
    let shed_ids: Vec<String> = std::iter::once("shed-1".to_owned())
        .chain((1..n).map(|i| format!("retry-{i}")))
        .collect();
    for id in &shed_ids {
        assert!(env.ledger.get(id).await.unwrap().is_none(), "{id} recorded");
        assert!(!delivered.contains(id), "{id} was published");
    }
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_management_api_admits() {
    let env = Env::new("shed-fail-open").await;
    // Nothing listens on port 9 of the loopback: the estimate fails, the job is admitted.
    let app = ingress(&env, Some("http://127.0.0.1:9")).await;
    for i in 0..3 {
        let (status, _, resp) = post_job(&app, &body(&format!("open-{i}"), 1_000)).await;
        assert_eq!(status, StatusCode::ACCEPTED, "{resp}");
    }
    let shedder = Shedder::new(
        Management::from_amqp_url(AMQP, "http://127.0.0.1:9"),
        env.topo.names.work_queue.clone(),
    );
    assert!(shedder.reading().await.is_none());
    // A reachable API reads the queue (3 published jobs, once sampled).
    let shedder = Shedder::new(
        Management::from_amqp_url(AMQP, MANAGEMENT),
        env.topo.names.work_queue.clone(),
    );
    assert!(shedder.reading().await.is_some());
    env.cleanup().await;
}

/// An ingress whose door counts the queue live (as `serve` builds it), with the management
/// API at `management` (its sampled ack rate stands in until the door has a pace), and its
/// shedder.
async fn live_ingress(env: &Env, management: &str) -> (Router, Arc<Shedder>) {
    let mut state = env.state_with(Duration::from_secs(5)).await;
    let publisher = lastcall_broker::Publisher::new(&env.broker, Duration::from_secs(5))
        .await
        .unwrap();
    let shedder = Arc::new(
        Shedder::new(
            Management::from_amqp_url(AMQP, management),
            env.topo.names.work_queue.clone(),
        )
        .with_live_depth(publisher),
    );
    state.submitter = state.submitter.with_shedder(Some(shedder.clone()));
    (lastcall_http::app(Arc::new(state)), shedder)
}

/// Poll the live door's view until `ok` holds.
async fn wait_for_ahead(
    shedder: &Shedder,
    what: &str,
    timeout: Duration,
    ok: impl Fn(&lastcall_producer::shed::Ahead) -> bool,
) -> lastcall_producer::shed::Ahead {
    let until = Instant::now() + timeout;
    let mut last = None;
    loop {
        if let Some(a) = shedder.ahead(now_ms()).await {
            if ok(&a) {
                return a;
            }
            last = Some(a);
        }
        assert!(Instant::now() < until, "never {what}: last {last:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_live_door_does_not_count_its_jobs_that_can_no_longer_finish() {
    let env = Env::new("shed-live-doomed").await;
    let (app, shedder) = live_ingress(&env, MANAGEMENT).await;
    // 60 jobs with a 10 s budget that each need 9.5 s (+ the 100 ms clock margin): 400 ms
    // after its submission a job can no longer finish, though the broker keeps it for 10 s.
    for i in 0..60 {
        let mut b = body(&format!("doomed-{i}"), 10_000);
        b["min_runtime_ms"] = json!(9_500);
        let (status, _, resp) = post_job(&app, &b).await;
        assert_eq!(status, StatusCode::ACCEPTED, "{resp}");
    }
    let a = wait_for_ahead(&shedder, "all 60 doomed", Duration::from_secs(8), |a| {
        a.doomed == 60
    })
    .await;
    assert_eq!(a.counted, 0, "the queue holds 60, none a wait: {a:?}");
    // The broker still holds them all: the live count is its own, not a sample.
    let ready = lastcall_broker::topology::queue_depth(&env.broker, &env.topo.names.work_queue)
        .await
        .unwrap()
        .unwrap()
        .0;
    assert_eq!(ready, 60);
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_live_door_measures_the_pace_and_sheds_behind_a_backlog() {
    let env = Env::new("shed-live-pace").await;
    // No management API (nothing listens on port 9): the only pace the door can have is
    // the one it measures. With the real API, its sampled ack rate stood in until the door
    // had its own, and RabbitMQ 3.10 reports an ack rate of 0.0 for the first seconds of
    // acks (20 acks/s on a new queue: 0.0 from 1.3 s to 5.9 s, then 19.6): CI read that.
    let (app, shedder) = live_ingress(&env, "http://127.0.0.1:9").await;
    // 120 jobs that can wait ten minutes, through the door (nothing ahead: all admitted;
    // none doomed even if a starved consumer takes one a second).
    for i in 0..120 {
        let (status, _, resp) = post_job(&app, &body(&format!("long-{i}"), 600_000)).await;
        assert_eq!(status, StatusCode::ACCEPTED, "{resp}");
    }
    // A consumer takes one every 50 ms (~20/s): the door measures that pace from its own
    // counts, long before the management API has sampled an ack rate.
    let consumer = env.paced_consumer(Duration::from_millis(50)).await;
    let a = wait_for_ahead(&shedder, "a pace", Duration::from_secs(15), |a| {
        a.rate_per_s.is_some() && a.counted > 40
    })
    .await;
    let rate = a.rate_per_s.unwrap();
    // About 20/s; far less when the consumer is starved of CPU beside other tests (1.5/s
    // measured): a pace was measured from the door's own counts, and it is not the
    // arrivals' (120 at once).
    assert!(rate > 0.5 && rate < 40.0, "about 20/s: {a:?}");
    assert_eq!(a.doomed, 0, "every job can finish: {a:?}");
    // 40+ jobs ahead at ≤ 40/s is over 1 s of queue: a 1 s budget is shed.
    let (status, retry_after, resp) = post_job(&app, &body("live-shed", 1_000)).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "{resp} at {a:?}");
    assert_eq!(resp["error"], "would_expire_in_queue", "{resp}");
    assert!(retry_after.is_some());
    let est = &resp["estimate"];
    assert!(est["ready"].as_u64().unwrap() > 20, "{resp}");
    assert!(est["queue_wait_ms"].as_u64().unwrap() > 1_000, "{resp}");
    assert!(env.ledger.get("live-shed").await.unwrap().is_none());
    // A budget that fits the queue is admitted.
    let (status, _, resp) = post_job(&app, &body("live-fits", 600_000)).await;
    assert_eq!(status, StatusCode::ACCEPTED, "{resp}");
    consumer.stop().await;
    env.cleanup().await;
}

/// A live count that failed is not tried again at every request: while the broker does not
/// answer, each request would pay a read of up to `Shedder::TIMEOUT`. The failure is
/// remembered for `Shedder::RETRY_FAILED_AFTER`, then the count is read again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_live_door_remembers_a_failed_count_before_reading_again() {
    let env = Env::new("shed-live-retry").await;
    // A queue that does not exist yet (the count fails), and no management API (port 9)
    // to stand in: nothing ahead is known.
    let queue = format!("{}.dead.expired", env.prefix);
    let publisher = lastcall_broker::Publisher::new(&env.broker, Duration::from_secs(5))
        .await
        .unwrap();
    let shedder = Shedder::new(
        Management::from_amqp_url(AMQP, "http://127.0.0.1:9"),
        queue.clone(),
    )
    .with_live_depth(publisher);
    assert!(shedder.ahead(now_ms()).await.is_none());
    // The queue appears; within the retry interval the door does not look again.
    env.topo
        .declare_plain_queue(&env.broker, &queue)
        .await
        .unwrap();
    let t0 = Instant::now();
    assert!(
        shedder.ahead(now_ms()).await.is_none(),
        "read again at once after a failure"
    );
    // After the interval it counts the (empty) queue.
    let a = wait_for_ahead(&shedder, "a live count", Duration::from_secs(15), |_| true).await;
    assert_eq!(a.counted, 0, "{a:?}");
    assert!(
        t0.elapsed() >= Shedder::RETRY_FAILED_AFTER - Duration::from_secs(1),
        "counted again only after the retry interval: {:?}",
        t0.elapsed()
    );
    env.cleanup().await;
}
