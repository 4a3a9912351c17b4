//! Tenants at the door (issue #33), against the real RabbitMQ and a real ledger: the
//! tokens file stamps each token's tenant on the envelope and the ledger row, refuses
//! another tenant or a kind the token may not submit, keeps a tenant to its own jobs, and
//! the quotas answer 429 with `Retry-After` with nothing published and nothing recorded;
//! `/metrics` and the dashboard account per tenant, with bounded labels.

mod common;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use common::*;
use lastcall_core::{Decision, Envelope, EnvelopeLimits, Priority, Reason, State, Tenant};
use lastcall_http::tokens::{TokensFile, hash_token};
use lastcall_store::OutcomeRecord;
use serde_json::{Value, json};
use std::sync::Arc;
use std::time::Duration;
use tower::ServiceExt;

const TEAM_A: &str = "token-of-team-a-00000001";
const TEAM_B: &str = "token-of-team-b-00000001";
const TEAM_Q: &str = "token-of-team-q-00000001";
const TEAM_T: &str = "token-of-team-t-00000001";

fn tokens_file() -> TokensFile {
    TokensFile::parse(&format!(
        r#"
[[token]]
sha256 = "{}"
tenant = "team-a"
weight = 3
kinds = ["incident.summary"]
max_priority = "critical"

[[token]]
sha256 = "{}"
tenant = "team-b"

[[token]]
sha256 = "{}"
tenant = "team-q"
jobs_per_second = 1

[[token]]
sha256 = "{}"
tenant = "team-t"
tokens_per_minute = 100
"#,
        hash_token(TEAM_A),
        hash_token(TEAM_B),
        hash_token(TEAM_Q),
        hash_token(TEAM_T),
    ))
    .unwrap()
}

async fn app_with_tokens(env: &Env) -> axum::Router {
    let mut state = env.state_with(Duration::from_secs(5)).await;
    state.tokens = Some(Arc::new(tokens_file()));
    lastcall_http::app(Arc::new(state))
}

fn job(id: &str) -> Value {
    json!({
        "job_id": id,
        "kind": "incident.summary",
        "deadline_ms": 60_000,
        "payload": {"messages": [{"role": "user", "content": "summarize"}]},
    })
}

async fn post_as(app: &axum::Router, token: &str, body: &Value) -> (StatusCode, Value) {
    call(
        app,
        "POST",
        "/v1/jobs",
        Some(token),
        Some(serde_json::to_vec(body).unwrap()),
    )
    .await
}

/// The next envelope in the work queue or a lane (acked), as a worker would parse it.
async fn next_envelope(env: &Env) -> Envelope {
    let mut stream = lastcall_broker::IncomingStream::open_queues(
        &env.broker,
        &env.topo.names.lane_queues(),
        1,
        "tenants-test",
    )
    .await
    .unwrap();
    let msg = tokio::time::timeout(Duration::from_secs(10), stream.next())
        .await
        .expect("a message in the work queue or a lane")
        .unwrap()
        .unwrap();
    msg.settler.ack().await.unwrap();
    stream.close().await;
    Envelope::parse(
        &msg.body,
        &EnvelopeLimits::default(),
        lastcall_clock::now_ms(),
    )
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_token_stamps_its_tenant_and_sees_only_its_jobs() {
    let env = Env::new("tenant-stamp").await;
    let app = app_with_tokens(&env).await;

    // team-a's token: its tenant on the envelope and the ledger row, the body's tier too.
    let mut body = job("a-1");
    body["priority"] = json!("critical");
    let (s, b) = post_as(&app, TEAM_A, &body).await;
    assert_eq!(s, StatusCode::ACCEPTED, "{b}");
    let e = next_envelope(&env).await;
    assert_eq!((e.tenant(), e.priority()), ("team-a", Priority::Critical));
    // Its job ids are its own: `team-a:<id>` (issue #48).
    assert_eq!(b["job_id"], "team-a:a-1", "{b}");
    let rec = env.ledger.get("team-a:a-1").await.unwrap().unwrap();
    assert_eq!(
        (rec.tenant.as_str(), rec.priority.as_str()),
        ("team-a", "critical")
    );
    // Naming its own tenant is the same.
    let mut body = job("a-2");
    body["tenant"] = json!("team-a");
    assert_eq!(post_as(&app, TEAM_A, &body).await.0, StatusCode::ACCEPTED);

    // Another tenant, a kind the token may not submit: 403 naming the field, nothing
    // published, no ledger row.
    let ready = env.ready_all().await;
    let mut body = job("a-3");
    body["tenant"] = json!("team-b");
    let (s, b) = post_as(&app, TEAM_A, &body).await;
    assert_eq!(s, StatusCode::FORBIDDEN, "{b}");
    assert_eq!(
        (b["error"].as_str(), b["field"].as_str()),
        (Some("tenant_mismatch"), Some("tenant"))
    );
    assert!(b["message"].as_str().unwrap().contains("team-a"), "{b}");
    let mut body = job("a-4");
    body["kind"] = json!("code.review");
    let (s, b) = post_as(&app, TEAM_A, &body).await;
    assert_eq!(s, StatusCode::FORBIDDEN, "{b}");
    assert_eq!(
        (b["error"].as_str(), b["field"].as_str()),
        (Some("kind_not_allowed"), Some("kind"))
    );
    assert_eq!(env.ready_all().await, ready);
    for id in ["team-a:a-3", "team-a:a-4", "a-3", "a-4"] {
        assert!(env.ledger.get(id).await.unwrap().is_none(), "{id}");
    }

    // The same job id for another tenant is a conflict, never the first one's answer.
    let mut body = job("b-1");
    body["tenant"] = json!("team-b");
    body["priority"] = json!("batch");
    assert_eq!(post_as(&app, TOKEN, &body).await.0, StatusCode::ACCEPTED);
    assert_eq!(post_as(&app, TOKEN, &body).await.1["duplicate"], true);
    body["tenant"] = json!("team-q");
    let (s, b) = post_as(&app, TOKEN, &body).await;
    assert_eq!(
        (s, b["error"].as_str()),
        (StatusCode::CONFLICT, Some("job_id_conflict")),
        "{b}"
    );
    let mut body = job("b-1");
    body["tenant"] = json!("team-b");
    assert_eq!(post_as(&app, TEAM_A, &body).await.0, StatusCode::FORBIDDEN);

    // Malformed fields: 400 naming them, whoever asks.
    for (field, value) in [
        ("tenant", json!("team a")),
        ("tenant", json!(7)),
        ("priority", json!("urgent")),
    ] {
        let mut body = job("bad");
        body[field] = value;
        let (s, b) = post_as(&app, TOKEN, &body).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{b}");
        assert_eq!(b["field"], field, "{b}");
    }

    // The operator's token: the body's tenant (b-1 above), else `default`.
    assert_eq!(
        post_as(&app, TOKEN, &job("d-1")).await.0,
        StatusCode::ACCEPTED
    );
    let rec = env.ledger.get("b-1").await.unwrap().unwrap();
    assert_eq!(
        (rec.tenant.as_str(), rec.priority.as_str()),
        ("team-b", "batch")
    );
    let rec = env.ledger.get("d-1").await.unwrap().unwrap();
    assert_eq!(
        (rec.tenant.as_str(), rec.priority.as_str()),
        ("default", "standard")
    );

    // Lists and reads: a tenant's token sees its own jobs only.
    let ids = |b: &Value| -> Vec<String> {
        let mut v: Vec<String> = b["jobs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|j| j["job_id"].as_str().unwrap().to_owned())
            .collect();
        v.sort();
        v
    };
    let (s, b) = call(&app, "GET", "/v1/jobs", Some(TEAM_A), None).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(ids(&b), ["team-a:a-1", "team-a:a-2"]);
    let (s, b) = call(&app, "GET", "/v1/jobs?tenant=team-b", Some(TEAM_A), None).await;
    assert_eq!(
        (s, b["field"].as_str()),
        (StatusCode::FORBIDDEN, Some("tenant"))
    );
    let (_, b) = call(&app, "GET", "/v1/jobs?tenant=team-b", Some(TOKEN), None).await;
    assert_eq!(ids(&b), ["b-1"]);
    let (_, b) = call(&app, "GET", "/v1/jobs", Some(TOKEN), None).await;
    assert_eq!(ids(&b), ["b-1", "d-1", "team-a:a-1", "team-a:a-2"]);
    let (s, b) = call(&app, "GET", "/v1/jobs?tenant=a%20b", Some(TOKEN), None).await;
    assert_eq!(
        (s, b["field"].as_str()),
        (StatusCode::BAD_REQUEST, Some("tenant"))
    );
    for uri in ["/v1/jobs/a-1", "/v1/jobs/team-a:a-1"] {
        let (s, b) = call(&app, "GET", uri, Some(TEAM_A), None).await;
        assert_eq!((s, b["tenant"].as_str()), (StatusCode::OK, Some("team-a")));
    }
    assert_eq!(
        call(&app, "GET", "/v1/jobs/b-1", Some(TEAM_A), None)
            .await
            .0,
        StatusCode::NOT_FOUND
    );
    assert_eq!(
        call(&app, "DELETE", "/v1/jobs/b-1", Some(TEAM_A), None)
            .await
            .0,
        StatusCode::NOT_FOUND
    );
    assert_eq!(
        env.ledger.get("b-1").await.unwrap().unwrap().state,
        "accepted",
        "not cancelled"
    );

    // Every tenant's numbers are the operator's to read.
    for uri in ["/", "/v1/dashboard", "/metrics"] {
        let (s, b) = call(&app, "GET", uri, Some(TEAM_A), None).await;
        assert_eq!(
            (s, b["error"].as_str()),
            (StatusCode::FORBIDDEN, Some("operator_only")),
            "{uri}"
        );
        assert_eq!(
            call(&app, "GET", uri, Some(TOKEN), None).await.0,
            StatusCode::OK,
            "{uri}"
        );
    }
    env.cleanup().await;
}

/// One chat request through the front door, its body and extra headers.
fn chat(token: &str, headers: &[(&str, &str)], body: &Value) -> Request<Body> {
    let mut req = Request::builder()
        .method("POST")
        .uri("/v1/chat/completions")
        .header("authorization", format!("Bearer {token}"))
        .header("content-type", "application/json")
        .header("x-lastcall-deadline-ms", "30000");
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    req.body(Body::from(serde_json::to_vec(body).unwrap()))
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_front_door_stamps_the_tokens_tenant_and_never_the_user_field() {
    let env = Env::new("tenant-door").await;
    let app = app_with_tokens(&env).await;
    let body = json!({
        "model": "any",
        "user": "team-a",
        "messages": [{"role": "user", "content": "hello"}],
    });
    // team-b's token, `user` naming team-a: the job is team-b's, the `user` stays payload.
    let pending = tokio::spawn({
        let app = app.clone();
        let req = chat(TEAM_B, &[("x-lastcall-priority", "batch")], &body);
        async move { app.oneshot(req).await.unwrap() }
    });
    let e = next_envelope(&env).await;
    assert_eq!((e.tenant(), e.priority()), ("team-b", Priority::Batch));
    assert_eq!(e.payload["user"], "team-a");
    pending.abort();

    // The operator names a tenant in the header; a tenant token naming another is refused.
    let pending = tokio::spawn({
        let app = app.clone();
        let req = chat(TOKEN, &[("x-lastcall-tenant", "team-q")], &body);
        async move { app.oneshot(req).await.unwrap() }
    });
    assert_eq!(next_envelope(&env).await.tenant(), "team-q");
    pending.abort();
    let ready = env.ready_all().await;
    for (token, headers, code, field) in [
        (
            TEAM_B,
            vec![("x-lastcall-tenant", "team-a")],
            "tenant_mismatch",
            "X-Lastcall-Tenant",
        ),
        // team-a may submit `incident.summary` only; every model maps to `chat` here.
        (TEAM_A, vec![], "kind_not_allowed", "kind"),
    ] {
        let resp = app
            .clone()
            .oneshot(chat(token, &headers, &body))
            .await
            .unwrap();
        assert_eq!(resp.status(), StatusCode::FORBIDDEN);
        let b: Value = serde_json::from_slice(
            &axum::body::to_bytes(resp.into_body(), usize::MAX)
                .await
                .unwrap(),
        )
        .unwrap();
        assert_eq!(
            (b["error"].as_str(), b["field"].as_str()),
            (Some(code), Some(field)),
            "{b}"
        );
    }
    let resp = app
        .clone()
        .oneshot(chat(TOKEN, &[("x-lastcall-priority", "urgent")], &body))
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::BAD_REQUEST);
    assert_eq!(env.ready_all().await, ready, "nothing published");
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_quota_is_429_with_retry_after_and_nothing_published_or_recorded() {
    let env = Env::new("tenant-quota").await;
    let app = app_with_tokens(&env).await;
    let raw = |token: &str, body: &Value| {
        let req = Request::builder()
            .method("POST")
            .uri("/v1/jobs")
            .header("authorization", format!("Bearer {token}"))
            .header("content-type", "application/json")
            .body(Body::from(serde_json::to_vec(body).unwrap()))
            .unwrap();
        let app = app.clone();
        async move {
            let resp = app.oneshot(req).await.unwrap();
            let retry_after = resp
                .headers()
                .get("retry-after")
                .map(|v| v.to_str().unwrap().parse::<u64>().unwrap());
            let status = resp.status();
            let b: Value = serde_json::from_slice(
                &axum::body::to_bytes(resp.into_body(), usize::MAX)
                    .await
                    .unwrap(),
            )
            .unwrap();
            (status, retry_after, b)
        }
    };

    // team-q: 1 job per second (a bucket of one).
    let (s, _, b) = raw(TEAM_Q, &job("q-1")).await;
    assert_eq!(s, StatusCode::ACCEPTED, "{b}");
    let (s, retry, b) = raw(TEAM_Q, &job("q-2")).await;
    assert_eq!(s, StatusCode::TOO_MANY_REQUESTS, "{b}");
    assert_eq!(
        (b["error"].as_str(), b["field"].as_str()),
        (Some("over_quota"), Some("jobs_per_second"))
    );
    assert_eq!(retry, Some(1));
    assert!(
        env.ledger.get("team-q:q-2").await.unwrap().is_none(),
        "no ledger row"
    );
    assert_eq!(env.ready_all().await, 1, "only q-1 was published");
    // The operator submitting for team-q is held to team-q's quota too; another tenant is not.
    let mut body = job("q-3");
    body["tenant"] = json!("team-q");
    assert_eq!(raw(TOKEN, &body).await.0, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(raw(TEAM_B, &job("b-1")).await.0, StatusCode::ACCEPTED);

    // team-t: 100 estimated prompt tokens per minute; a payload of 343 JSON characters
    // (300 of content) ≈ 86 tokens.
    let big = |id: &str| {
        json!({
            "job_id": id,
            "kind": "incident.summary",
            "deadline_ms": 60_000,
            "payload": {"messages": [{"role": "user", "content": "x".repeat(300)}]},
        })
    };
    assert_eq!(raw(TEAM_T, &big("t-1")).await.0, StatusCode::ACCEPTED);
    let (s, retry, b) = raw(TEAM_T, &big("t-2")).await;
    assert_eq!(s, StatusCode::TOO_MANY_REQUESTS, "{b}");
    assert_eq!(b["field"], "tokens_per_minute", "{b}");
    // (86 − 14 left) tokens at 100/60 per second: 44 s, a little less as time passes.
    let retry = retry.unwrap();
    assert!((39..=44).contains(&retry), "Retry-After {retry}");
    assert!(b["message"].as_str().unwrap().contains("about 86"), "{b}");
    assert!(env.ledger.get("team-t:t-2").await.unwrap().is_none());
    // A small job still fits what is left.
    let small = json!({
        "job_id": "t-3", "kind": "incident.summary", "deadline_ms": 60_000,
        "payload": {"messages": [{"role": "user", "content": "hi"}]},
    });
    assert_eq!(raw(TEAM_T, &small).await.0, StatusCode::ACCEPTED);

    // Counted per tenant and quota.
    let (_, metrics) = call(&app, "GET", "/metrics", Some(TOKEN), None).await;
    let text = metrics.as_str().unwrap();
    for (series, n) in [
        (
            "lastcall_http_quota_refused_total{tenant=\"team-q\",quota=\"jobs_per_second\"}",
            2.0,
        ),
        (
            "lastcall_http_quota_refused_total{tenant=\"team-t\",quota=\"tokens_per_minute\"}",
            1.0,
        ),
        (
            "lastcall_http_tenant_accepted_total{tenant=\"team-t\"}",
            2.0,
        ),
        (
            "lastcall_http_tenant_accepted_total{tenant=\"team-b\"}",
            1.0,
        ),
    ] {
        assert_eq!(
            lastcall_http::metrics::sample_value(text, series),
            Some(n),
            "{series}\n{text}"
        );
    }
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_and_the_dashboard_account_per_tenant_with_bounded_labels() {
    let env = Env::new("tenant-metrics").await;
    let app = app_with_tokens(&env).await;
    let now = lastcall_clock::now_ms();
    // 25 tenants; tenant tN has N+1 jobs completed (each a 200 ms call, 10 + 2 tokens) and
    // one cut at its deadline (a 300 ms call, wasted) or refused before the call.
    let mut n = 0;
    for t in 0..25 {
        let tenant = Tenant::parse(&format!("t{t:02}")).unwrap();
        for j in 0..=t {
            n += 1;
            env.ledger
                .record_outcome(&OutcomeRecord {
                    attempt_key: format!("k{n}"),
                    tenant: tenant.clone(),
                    model_called: true,
                    latency_ms: Some(200),
                    prompt_tokens: Some(10),
                    completion_tokens: Some(2),
                    ..OutcomeRecord::new(
                        format!("j{n}"),
                        "chat",
                        State::Completed,
                        Decision::Ack,
                        now - 1_000 - j,
                    )
                })
                .await
                .unwrap();
        }
        n += 1;
        let cut = t % 2 == 0;
        env.ledger
            .record_outcome(&OutcomeRecord {
                attempt_key: format!("k{n}"),
                tenant: tenant.clone(),
                reason: Some(if cut {
                    Reason::CancelledAtDeadline
                } else {
                    Reason::BrokerTtlExpired
                }),
                model_called: cut,
                latency_ms: cut.then_some(300),
                ..OutcomeRecord::new(
                    format!("j{n}"),
                    "chat",
                    if cut {
                        State::DeadlineExceeded
                    } else {
                        State::ExpiredBeforeReceive
                    },
                    Decision::Ack,
                    now - 2_000,
                )
            })
            .await
            .unwrap();
    }
    let (s, metrics) = call(&app, "GET", "/metrics", Some(TOKEN), None).await;
    assert_eq!(s, StatusCode::OK);
    let text = metrics.as_str().unwrap();
    let v = |series: &str| lastcall_http::metrics::sample_value(text, series);
    // The busiest, t24: 25 on time, one cut at the deadline (0.3 s wasted).
    assert_eq!(
        v("lastcall_tenant_on_time_last_hour{tenant=\"t24\"}"),
        Some(25.0)
    );
    assert_eq!(
        v(
            "lastcall_tenant_not_on_time_last_hour{tenant=\"t24\",state=\"deadline_exceeded\",reason=\"cancelled_at_deadline\"}"
        ),
        Some(1.0)
    );
    assert_eq!(
        v("lastcall_tenant_model_seconds_last_hour{tenant=\"t24\",use=\"wasted\"}"),
        Some(0.3)
    );
    assert_eq!(
        v("lastcall_tenant_model_seconds_last_hour{tenant=\"t24\",use=\"useful\"}"),
        Some(5.0)
    );
    assert_eq!(
        v("lastcall_tenant_tokens_last_hour{tenant=\"t24\",type=\"prompt\"}"),
        Some(250.0)
    );
    assert_eq!(
        v(
            "lastcall_tenant_not_on_time_last_hour{tenant=\"t23\",state=\"expired_before_receive\",reason=\"broker_ttl_expired\"}"
        ),
        Some(1.0)
    );
    // Bounded: the 20 busiest (t05…t24) by name, the other five summed: 1+…+5 on time.
    let tenants_named: std::collections::BTreeSet<&str> = text
        .lines()
        .filter(|l| l.starts_with("lastcall_tenant_on_time_last_hour{"))
        .filter_map(|l| l.split('"').nth(1))
        .collect();
    assert_eq!(
        tenants_named.len(),
        lastcall_http::metrics::METRICS_TENANTS + 1,
        "{tenants_named:?}"
    );
    assert!(!tenants_named.contains("t04"));
    assert_eq!(
        v("lastcall_tenant_on_time_last_hour{tenant=\"other\"}"),
        Some(15.0)
    );

    // The dashboard: the ten busiest and `other`.
    let (s, d) = call(&app, "GET", "/v1/dashboard?minutes=5", Some(TOKEN), None).await;
    assert_eq!(s, StatusCode::OK);
    let tenants = d["tenants"].as_array().unwrap();
    assert_eq!(tenants.len(), lastcall_store::DASHBOARD_TENANTS + 1);
    assert_eq!(tenants[0]["tenant"], "t24");
    assert_eq!(tenants[0]["on_time"], 25);
    assert_eq!(tenants[0]["wasted_model_ms"], 300);
    assert_eq!(tenants[0]["refused"], 0);
    assert_eq!(tenants[1]["refused"], 1, "t23's job expired in the broker");
    let other = tenants.last().unwrap();
    assert_eq!(other["tenant"], "other");
    assert_eq!(other["jobs"], (1..=15).sum::<u64>() + 15);
    env.cleanup().await;
}

// Tenancy as a boundary (issue #48): one token file, a tenant per hole.
const A48: &str = "token-of-team-a-00000048";
const B48: &str = "token-of-team-b-00000048";
const Z48: &str = "token-of-team-z-00000048";
const Q48: &str = "token-of-team-q-00000048";
const W48: &str = "token-of-team-w-00000048";
const R48: &str = "token-of-team-r-00000048";
const S48: &str = "token-of-team-s-00000048";

/// The app and its state under a tokens file of plain tenants (`team-a`, `team-b`: every
/// default), a batch-only one (`team-z`), and one per cap: `team-q` (200 tokens per
/// minute), `team-w` (2 waits), `team-r` (1 request in flight), `team-s` (1 stream).
async fn app48(env: &Env) -> (axum::Router, Arc<lastcall_http::AppState>) {
    let entry = |token: &str, tenant: &str, extra: &str| {
        format!(
            "[[token]]\nsha256 = \"{}\"\ntenant = \"{tenant}\"\n{extra}\n",
            hash_token(token)
        )
    };
    let text = [
        entry(A48, "team-a", ""),
        entry(B48, "team-b", ""),
        entry(Z48, "team-z", "max_priority = \"batch\""),
        entry(Q48, "team-q", "tokens_per_minute = 200"),
        entry(W48, "team-w", "max_waiting = 2"),
        entry(R48, "team-r", "max_requests = 1"),
        entry(S48, "team-s", "max_streams = 1"),
    ]
    .concat();
    let mut state = env.state_with(Duration::from_secs(5)).await;
    state.tokens = Some(Arc::new(TokensFile::parse(&text).unwrap()));
    let state = Arc::new(state);
    (lastcall_http::app(state.clone()), state)
}

/// A completed job of `tenant` as a worker records it for a producer that published
/// straight to the broker: no claim, so no payload hash.
async fn completed_by_a_worker(env: &Env, id: &str, tenant: &str, result: &str) {
    env.ledger
        .record_outcome(&OutcomeRecord {
            attempt_key: format!("{id}-0"),
            tenant: Tenant::parse(tenant).unwrap(),
            model_called: true,
            result: Some(result.into()),
            ..OutcomeRecord::new(
                id,
                "chat",
                State::Completed,
                Decision::Ack,
                lastcall_clock::now_ms(),
            )
        })
        .await
        .unwrap();
}

async fn body_json(resp: axum::response::Response) -> Value {
    let bytes = axum::body::to_bytes(resp.into_body(), usize::MAX)
        .await
        .unwrap();
    serde_json::from_slice(&bytes).unwrap_or(Value::Null)
}

/// Holes 1 and 6: another tenant's job id, through the front door's idempotency, a
/// submission, a long-poll, is answered exactly as an unused or missing id is — never
/// with its result, its state or sooner; and a generated id cannot be guessed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_tenants_job_is_never_an_answer_and_cannot_be_probed() {
    let env = Env::new("tenancy-probe").await;
    let (app, _) = app48(&env).await;
    completed_by_a_worker(&env, "victim-b-1", "team-b", "team-b's secret").await;
    completed_by_a_worker(&env, "victim-b-2", "team-b", "team-b's secret").await;

    // A long-poll on another tenant's job waits the whole wait, as one on a missing id:
    // team-b's jobs by their ids, and a job of team-b's that its producer named in
    // team-a's namespace.
    completed_by_a_worker(&env, "team-a:planted", "team-b", "planted").await;
    for id in ["victim-b-1", "planted", "no-such-job-48"] {
        let started = std::time::Instant::now();
        let uri = format!("/v1/jobs/{id}?wait_ms=1000");
        let (s, b) = call(&app, "GET", &uri, Some(A48), None).await;
        assert_eq!(s, StatusCode::NOT_FOUND, "{id}: {b}");
        assert!(
            started.elapsed() >= Duration::from_millis(1_000),
            "{id}: answered after {:?}, before the wait was over",
            started.elapsed()
        );
    }
    // The operator reads it.
    let (s, b) = call(&app, "GET", "/v1/jobs/team-a:planted", Some(TOKEN), None).await;
    assert_eq!((s, b["tenant"].as_str()), (StatusCode::OK, Some("team-b")));

    // team-a's chat with team-b's id as its Idempotency-Key: a new job of team-a's own
    // (published, in team-a's namespace), never team-b's result.
    let body = json!({"model": "any", "messages": [{"role": "user", "content": "hello"}]});
    let pending = tokio::spawn({
        let req = chat(A48, &[("idempotency-key", "victim-b-1")], &body);
        let app = app.clone();
        async move { body_json(app.oneshot(req).await.unwrap()).await }
    });
    let e = next_envelope(&env).await;
    assert_eq!(
        (e.job_id().as_str(), e.tenant()),
        ("team-a:victim-b-1", "team-a")
    );
    assert!(!pending.is_finished(), "{:?}", pending.await);
    pending.abort();
    let rec = env.ledger.get("victim-b-1").await.unwrap().unwrap();
    assert_eq!(
        (rec.tenant.as_str(), rec.state.as_str()),
        ("team-b", "completed")
    );

    // A submission with team-b's id is answered as an unused id's: 202, team-a's own job.
    let unused = post_as(&app, A48, &job("never-used-48")).await;
    let probe = post_as(&app, A48, &job("victim-b-2")).await;
    assert_eq!(unused.0, StatusCode::ACCEPTED, "{}", unused.1);
    assert_eq!(probe.0, StatusCode::ACCEPTED, "{}", probe.1);
    assert_eq!(probe.1["job_id"], "team-a:victim-b-2");
    assert_eq!(probe.1["state"], unused.1["state"]);

    // Generated ids are random: 128 bits, nothing of the time, process or a counter.
    let random = |id: &str, prefix: &str| {
        let hex = id.strip_prefix(prefix).unwrap_or_default();
        hex.len() == 32 && hex.bytes().all(|b| b.is_ascii_hexdigit())
    };
    let mut generated = Vec::new();
    for token in [A48, A48, TOKEN] {
        let mut body = job("x");
        body.as_object_mut().unwrap().remove("job_id");
        let (s, b) = post_as(&app, token, &body).await;
        assert_eq!(s, StatusCode::ACCEPTED, "{b}");
        generated.push(b["job_id"].as_str().unwrap().to_owned());
    }
    assert!(random(&generated[0], "team-a:job-"), "{generated:?}");
    assert!(random(&generated[1], "team-a:job-"), "{generated:?}");
    assert!(random(&generated[2], "job-"), "{generated:?}");
    assert_ne!(generated[0], generated[1]);
    env.cleanup().await;
}

/// Hole 2: a tenant token submits at most its `max_priority` (default `standard`); a
/// higher tier is `403 priority_not_allowed`, nothing published. The operator may submit
/// any tier.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_token_submits_at_most_its_max_priority() {
    let env = Env::new("tenancy-tier").await;
    let (app, _) = app48(&env).await;
    let mut critical = job("crit-1");
    critical["priority"] = json!("critical");
    let (s, b) = post_as(&app, A48, &critical).await;
    assert_eq!(s, StatusCode::FORBIDDEN, "{b}");
    assert_eq!(
        (b["error"].as_str(), b["field"].as_str()),
        (Some("priority_not_allowed"), Some("priority"))
    );
    let body = json!({"model": "any", "messages": [{"role": "user", "content": "hello"}]});
    let resp = app
        .clone()
        .oneshot(chat(A48, &[("x-lastcall-priority", "critical")], &body))
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::FORBIDDEN);
    let b = body_json(resp).await;
    assert_eq!(
        (b["error"].as_str(), b["field"].as_str()),
        (Some("priority_not_allowed"), Some("X-Lastcall-Priority"))
    );
    assert_eq!(env.ready_all().await, 0, "nothing published");
    assert!(env.ledger.get("team-a:crit-1").await.unwrap().is_none());

    // Its own tier and below are taken; the operator may submit any tier.
    for (token, id, tier) in [
        (A48, "std-1", "standard"),
        (A48, "batch-1", "batch"),
        (TOKEN, "crit-op", "critical"),
    ] {
        let mut body = job(id);
        body["priority"] = json!(tier);
        let (s, b) = post_as(&app, token, &body).await;
        assert_eq!(s, StatusCode::ACCEPTED, "{id}: {b}");
    }
    // A batch-only token: `standard` refused, no tier named is `batch`.
    let mut standard = job("z-1");
    standard["priority"] = json!("standard");
    assert_eq!(post_as(&app, Z48, &standard).await.0, StatusCode::FORBIDDEN);
    let (s, b) = post_as(&app, Z48, &job("z-2")).await;
    assert_eq!(s, StatusCode::ACCEPTED, "{b}");
    let rec = env.ledger.get("team-z:z-2").await.unwrap().unwrap();
    assert_eq!(rec.priority, "batch");
    env.cleanup().await;
}

/// Hole 4: a quota counts everything forwarded to the model, not only `content`: 40,000
/// characters of `tool_calls` arguments under 200 tokens per minute are refused (after
/// the one request a full bucket lets through).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quotas_count_everything_forwarded_to_the_model() {
    let env = Env::new("tenancy-quota").await;
    let (app, _) = app48(&env).await;
    let messages = json!([
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function",
            "function": {"name": "f", "arguments": "x".repeat(40_000)}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
    ]);
    let body = |id: &str| {
        json!({"job_id": id, "kind": "chat", "deadline_ms": 60_000,
               "payload": {"messages": messages}})
    };
    let (s, b) = post_as(&app, Q48, &body("q48-1")).await;
    assert_eq!(
        s,
        StatusCode::ACCEPTED,
        "a full bucket lets one through: {b}"
    );
    let (s, b) = post_as(&app, Q48, &body("q48-2")).await;
    assert_eq!(s, StatusCode::TOO_MANY_REQUESTS, "{b}");
    assert_eq!(
        (b["error"].as_str(), b["field"].as_str()),
        (Some("over_quota"), Some("tokens_per_minute"))
    );
    let resp = app
        .clone()
        .oneshot(chat(
            Q48,
            &[],
            &json!({"model": "any", "messages": messages}),
        ))
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(env.ready_all().await, 1, "only the first was published");
    env.cleanup().await;
}

/// Hole 7: a tenant holds at most its `max_waiting` waits, `max_requests` requests in
/// flight and `max_streams` streams (`429 tenant_limit`, `Retry-After`); other tenants are
/// not held up by it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_holds_at_most_its_caps_of_the_shared_resources() {
    let env = Env::new("tenancy-caps").await;
    let (app, state) = app48(&env).await;
    let refused = |b: &Value, field: &str| b["error"] == "tenant_limit" && b["field"] == field;

    // team-w: two long-polls held, the third refused; another tenant waits.
    let polls: Vec<_> = (0..2)
        .map(|i| {
            let app = app.clone();
            tokio::spawn(async move {
                let uri = format!("/v1/jobs/held-{i}?wait_ms=60000");
                call(&app, "GET", &uri, Some(W48), None).await
            })
        })
        .collect();
    let until = std::time::Instant::now() + Duration::from_secs(10);
    while state.waiting.available_permits() != lastcall_http::MAX_WAITING - 2 {
        assert!(
            std::time::Instant::now() < until,
            "the long-polls never waited"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let (s, b) = call(&app, "GET", "/v1/jobs/third?wait_ms=1", Some(W48), None).await;
    assert_eq!(s, StatusCode::TOO_MANY_REQUESTS, "{b}");
    assert!(refused(&b, "max_waiting"), "{b}");
    let (s, _) = call(&app, "GET", "/v1/jobs/third?wait_ms=1", Some(A48), None).await;
    assert_eq!(s, StatusCode::NOT_FOUND, "another tenant still waits");
    for p in polls {
        p.abort();
    }

    // team-r: one request in flight (a body still arriving), the next refused.
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Vec<u8>, std::io::Error>>(1);
    tx.send(Ok(b"{".to_vec())).await.unwrap();
    let slow = tokio::spawn({
        let app = app.clone();
        let req = Request::builder()
            .method("POST")
            .uri("/v1/jobs")
            .header("authorization", format!("Bearer {R48}"))
            .header("content-type", "application/json")
            .body(Body::from_stream(tokio_stream_of(rx)))
            .unwrap();
        async move { app.oneshot(req).await.unwrap().status() }
    });
    // The handler took the first chunk: the request is past the door, holding its permit.
    let until = std::time::Instant::now() + Duration::from_secs(10);
    while tx.capacity() == 0 {
        assert!(std::time::Instant::now() < until, "the body was never read");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let (s, b) = call(&app, "GET", "/v1/jobs/r-1", Some(R48), None).await;
    assert_eq!(
        s,
        StatusCode::TOO_MANY_REQUESTS,
        "a second request in flight: {b}"
    );
    assert!(refused(&b, "max_requests"), "{b}");
    let (s, _) = call(&app, "GET", "/v1/jobs/r-1", Some(A48), None).await;
    assert_eq!(s, StatusCode::NOT_FOUND, "another tenant is served");
    drop(tx);
    slow.abort();

    // team-s: one stream held (published, waiting for its deltas), the second refused
    // before it opens a broker channel or publishes.
    let stream = json!({"model": "any", "stream": true,
                        "messages": [{"role": "user", "content": "hello"}]});
    let first = tokio::spawn({
        let req = chat(S48, &[], &stream);
        let app = app.clone();
        async move { app.oneshot(req).await.unwrap().status() }
    });
    assert_eq!(next_envelope(&env).await.tenant(), "team-s");
    let resp = app.clone().oneshot(chat(S48, &[], &stream)).await.unwrap();
    assert_eq!(resp.status(), StatusCode::TOO_MANY_REQUESTS);
    assert!(resp.headers().contains_key("retry-after"));
    let b = body_json(resp).await;
    assert_eq!(b["error"]["code"], "tenant_limit", "{b}");
    assert_eq!(env.ready_all().await, 0, "the second was not published");
    assert_eq!(
        state.http_stats.stream_channels_opened.get(),
        1,
        "the refused stream opened no broker channel"
    );
    first.abort();
    env.cleanup().await;
}

/// A stream of the chunks sent on `rx`.
fn tokio_stream_of(
    rx: tokio::sync::mpsc::Receiver<Result<Vec<u8>, std::io::Error>>,
) -> impl futures_util::Stream<Item = Result<Vec<u8>, std::io::Error>> {
    futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|c| (c, rx)) })
}
