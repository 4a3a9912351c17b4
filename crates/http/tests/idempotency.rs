//! `POST /v1/jobs` with one job id from many clients at once, against the real broker and
//! ledger: the id is claimed in the ledger before publishing, so exactly one request
//! publishes; the others get the idempotent answer (same payload) or 409 (different
//! payload), and every answer agrees with the ledger.

mod common;

use axum::http::StatusCode;
use common::*;
use serde_json::{Value, json};
use std::time::Duration;

fn job(id: &str, content: &str) -> Value {
    json!({
        "job_id": id,
        "kind": "incident.summary",
        "deadline_ms": 60_000,
        "payload": {"messages": [{"role": "user", "content": content}]},
    })
}

/// Fire `bodies` at the router all at once; the answers in the same order.
async fn concurrently(app: &axum::Router, bodies: Vec<Value>) -> Vec<(StatusCode, Value)> {
    let start = std::sync::Arc::new(tokio::sync::Barrier::new(bodies.len()));
    let tasks: Vec<_> = bodies
        .into_iter()
        .map(|b| {
            let app = app.clone();
            let start = start.clone();
            tokio::spawn(async move {
                start.wait().await;
                post(&app, &b).await
            })
        })
        .collect();
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap());
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixteen_concurrent_posts_of_one_new_id_publish_once() {
    let env = Env::new("race").await;
    let app = env.app().await;
    let answers = concurrently(&app, vec![job("race-1", "summarize"); 16]).await;
    let mut fresh = 0;
    for (status, body) in &answers {
        assert_eq!(*status, StatusCode::ACCEPTED, "{body}");
        assert_eq!(body["job_id"], "race-1");
        if body.get("duplicate").is_some() {
            assert_eq!(body["duplicate"], true, "{body}");
            assert_eq!(
                body["state"], "accepted",
                "a duplicate answer after the confirm"
            );
        } else {
            fresh += 1;
        }
    }
    assert_eq!(fresh, 1, "exactly one request published: {answers:?}");
    assert_eq!(
        env.ready(&env.topo.names.work_queue).await,
        1,
        "one message in the work queue"
    );
    let rec = env.ledger.get("race-1").await.unwrap().unwrap();
    assert_eq!(rec.state, "accepted");
    assert!(rec.accepted_at_ms.is_some(), "stamped after the confirm");
    let expires: Vec<&Value> = answers.iter().map(|(_, b)| &b["expires_at_ms"]).collect();
    assert!(
        expires.iter().all(|e| e.as_i64() == rec.expires_at_ms),
        "every answer names the ledger's deadline: {expires:?} vs {:?}",
        rec.expires_at_ms
    );
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_posts_of_one_id_with_two_payloads_publish_one_and_refuse_the_other() {
    let env = Env::new("race2").await;
    let app = env.app().await;
    let bodies: Vec<Value> = (0..16)
        .map(|i| job("race-2", if i % 2 == 0 { "first" } else { "second" }))
        .collect();
    let answers = concurrently(&app, bodies.clone()).await;
    let winner = answers
        .iter()
        .position(|(s, b)| *s == StatusCode::ACCEPTED && b.get("duplicate").is_none())
        .expect("one request published");
    let winning_payload = &bodies[winner]["payload"];
    for ((status, body), sent) in answers.iter().zip(&bodies) {
        if &sent["payload"] == winning_payload {
            assert_eq!(*status, StatusCode::ACCEPTED, "{body}");
        } else {
            assert_eq!(*status, StatusCode::CONFLICT, "{body}");
            assert_eq!(body["error"], "job_id_conflict");
            assert_eq!(body["field"], "job_id");
        }
    }
    let published = answers
        .iter()
        .filter(|(s, b)| *s == StatusCode::ACCEPTED && b.get("duplicate").is_none())
        .count();
    assert_eq!(published, 1, "{answers:?}");
    assert_eq!(env.ready(&env.topo.names.work_queue).await, 1);
    env.cleanup().await;
}

/// A publish the broker refuses releases the claim: the 503 leaves nothing `accepted`,
/// and the same id can be submitted again once the queue has room.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_publish_releases_the_id_for_a_retry() {
    let env = Env::with_topology("release", |t| {
        t.queue_type = lastcall_broker::QueueType::Quorum;
        t.max_length = Some(1);
    })
    .await;
    let app = env.app().await;
    let mut refused = None;
    for i in 0..5 {
        let id = format!("r{i}");
        let (s, b) = post(&app, &job(&id, "x")).await;
        if s == StatusCode::SERVICE_UNAVAILABLE {
            assert!(b["message"].as_str().unwrap().contains("nack"), "{b}");
            assert!(
                b["message"]
                    .as_str()
                    .unwrap()
                    .contains("nothing is recorded"),
                "{b}"
            );
            refused = Some(id);
            break;
        }
        assert_eq!(s, StatusCode::ACCEPTED, "{b}");
    }
    let refused = refused.expect("a full queue refuses a publish within 5 jobs");
    assert!(
        env.ledger.get(&refused).await.unwrap().is_none(),
        "the claim was released"
    );
    // Make room: a consumer takes the queued jobs (a quorum queue may overshoot its
    // length limit by one, so there can be two).
    let mut taken = Vec::new();
    while env.ready(&env.topo.names.work_queue).await > 0 {
        taken.push(env.take_one().await);
    }
    assert!(!taken.is_empty() && !taken.contains(&refused), "{taken:?}");
    let (s, b) = post(&app, &job(&refused, "x")).await;
    assert_eq!(s, StatusCode::ACCEPTED, "{b}");
    assert!(b.get("duplicate").is_none(), "published this time: {b}");
    // It is in the queue now (behind any job the ready count had not shown yet).
    let mut later = Vec::new();
    while later.last() != Some(&refused) {
        later.push(env.take_one().await);
        assert!(later.len() <= 3, "{refused} is not in the queue: {later:?}");
    }
    let rec = env.ledger.get(&refused).await.unwrap().unwrap();
    assert!(rec.accepted_at_ms.is_some());
    env.cleanup().await;
}

/// The broker TTL is the budget left at the publish, not when the request arrived (the
/// ledger claim lies in between); and a job id that already has its outcome is answered
/// `200` with that outcome, never "accepted" again, and nothing is published.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ttl_is_taken_at_the_publish_and_finished_jobs_are_not_accepted_again() {
    use lastcall_clock::now_ms;
    use lastcall_producer::Submission;
    use lastcall_producer::{DeadlineSpec, NewJob};
    let env = Env::new("ttl-at-publish").await;
    let sub = env.submitter(Duration::from_secs(5)).await;
    // The request arrived 5 s before its publish (a slow claim, say); the deadline is
    // absolute, 60 s from now.
    let expires = now_ms() + 60_000;
    let job = NewJob {
        job_id: Some("ttl-1".into()),
        kind: "incident.summary".into(),
        payload: json!({"messages": []}).as_object().cloned().unwrap(),
        deadline: DeadlineSpec::AbsoluteMs(expires),
        min_runtime_ms: None,
        trace_id: None,
    };
    let arrived = now_ms() - 5_000;
    let envelope = sub.envelope(&job, arrived).unwrap();
    let before_publish = now_ms();
    let Submission::Published(s) = sub
        .submit_once(&envelope, arrived, Duration::from_secs(1))
        .await
        .unwrap()
    else {
        panic!("a new id is published");
    };
    let mut work = lastcall_broker::IncomingStream::open(
        &env.broker,
        &env.topo.names.work_queue,
        1,
        "ttl-check",
    )
    .await
    .unwrap();
    let msg = tokio::time::timeout(Duration::from_secs(5), work.next())
        .await
        .expect("the job is in the work queue")
        .unwrap()
        .unwrap();
    let expiration: i64 = msg
        .expiration
        .as_deref()
        .expect("published with an expiration")
        .parse()
        .unwrap();
    // Had the TTL been computed at arrival, it would be ~65 s.
    assert!(
        expiration <= expires - before_publish,
        "expiration {expiration} ms outlives the deadline (at most {} ms were left at the publish)",
        expires - before_publish
    );
    assert_eq!(
        expiration as u64, s.ttl_ms,
        "the answer says what was published"
    );
    msg.settler.ack().await.unwrap();

    // An id gets its outcome: its message is taken off the queue and `completed` is
    // recorded, as a worker would. (`ttl-1` stays `accepted`.)
    let app = env.app().await;
    let (st, b) = post(&app, &job_body("done-1")).await;
    assert_eq!(st, StatusCode::ACCEPTED, "{b}");
    let msg = tokio::time::timeout(Duration::from_secs(5), work.next())
        .await
        .expect("done-1 is in the work queue")
        .unwrap()
        .unwrap();
    assert_eq!(msg.message_id.as_deref(), Some("done-1"));
    msg.settler.ack().await.unwrap();
    work.close().await;
    let wrote = env
        .ledger
        .record_terminal(&lastcall_store::OutcomeRecord::new(
            "done-1",
            "incident.summary",
            lastcall_core::State::Completed,
            lastcall_core::Decision::Ack,
            now_ms(),
        ))
        .await
        .unwrap();
    assert!(wrote, "the outcome is the first");
    assert_eq!(
        env.ledger.get("done-1").await.unwrap().unwrap().state,
        "completed"
    );
    let (st, b) = post(&app, &job_body("done-1")).await;
    assert_eq!(st, StatusCode::OK, "not accepted again: {b}");
    assert_eq!(b["state"], "completed", "{b}");
    assert_eq!(b["duplicate"], true, "{b}");
    assert_eq!(
        env.ready(&env.topo.names.work_queue).await,
        0,
        "nothing published"
    );
    env.cleanup().await;
}

fn job_body(id: &str) -> Value {
    job(id, "x")
}
