//! Security review, round two (issue #34), the HTTP side, with a real client (reqwest) on a
//! real socket, a real RabbitMQ and a real ledger.

mod common;

use common::*;
use serde_json::{Value, json};
use std::net::SocketAddr;

fn job(id: &str) -> Value {
    json!({
        "job_id": id,
        "kind": "incident.summary",
        "deadline_ms": 60_000,
        "payload": {"messages": [{"role": "user", "content": "summarize"}]},
    })
}

/// A served router and the way to stop it.
struct Served {
    addr: SocketAddr,
    stop: tokio_util::sync::CancellationToken,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
}

impl Served {
    async fn start(router: axum::Router) -> Self {
        let stop = tokio_util::sync::CancellationToken::new();
        let server =
            lastcall_http::listen("127.0.0.1:0".parse().unwrap(), router, stop.clone(), None)
                .await
                .unwrap();
        Self {
            addr: server.addr,
            stop,
            task: server.task,
        }
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    async fn stop(self) {
        self.stop.cancel();
        self.task.await.unwrap().unwrap();
    }
}

async fn answer(r: reqwest::RequestBuilder) -> (u16, Value) {
    let r = r.send().await.unwrap();
    let status = r.status().as_u16();
    let text = r.text().await.unwrap();
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

fn basic(password: &str) -> String {
    // Spelled out with coreutils' base64, so the test does not share the server's decoder.
    let out = std::process::Command::new("sh")
        .args(["-c", &format!("printf 'user:{password}' | base64 -w 0")])
        .output()
        .unwrap();
    format!("Basic {}", String::from_utf8(out.stdout).unwrap().trim())
}

/// A form or `text/plain` POST is what another site's page can send without a CORS
/// preflight: both JSON routes refuse any body not declared `application/json` with `415`
/// naming the header, and take it with parameters.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_not_declared_json_is_415_naming_the_header() {
    let env = Env::new("sec-ctype").await;
    let srv = Served::start(env.app().await).await;
    let http = reqwest::Client::new();
    let body = serde_json::to_vec(&job("ctype-1")).unwrap();
    for ctype in [
        Some("text/plain"),
        Some("application/x-www-form-urlencoded"),
        Some("multipart/form-data; boundary=x"),
        Some("application/jsonx"),
        None,
    ] {
        let mut r = http
            .post(srv.url("/v1/jobs"))
            .bearer_auth(TOKEN)
            .body(body.clone());
        if let Some(c) = ctype {
            r = r.header("content-type", c);
        }
        let (s, v) = answer(r).await;
        assert_eq!(s, 415, "{ctype:?}: {v}");
        assert_eq!(v["error"], "unsupported_media_type", "{v}");
        assert_eq!(v["field"], "Content-Type", "{v}");
        assert!(
            v["message"].as_str().unwrap().contains("application/json"),
            "{v}"
        );
    }
    assert!(
        env.ledger.get("ctype-1").await.unwrap().is_none(),
        "nothing recorded"
    );
    let chat = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
    let (s, v) = answer(
        http.post(srv.url("/v1/chat/completions"))
            .bearer_auth(TOKEN)
            .header("content-type", "text/plain")
            .body(serde_json::to_vec(&chat).unwrap()),
    )
    .await;
    assert_eq!(s, 415, "{v}");
    assert_eq!(v["error"]["code"], "unsupported_media_type", "{v}");
    assert_eq!(v["error"]["param"], "Content-Type", "{v}");
    let (s, v) = answer(
        http.post(srv.url("/v1/jobs"))
            .bearer_auth(TOKEN)
            .header("content-type", "Application/JSON; charset=utf-8")
            .body(body),
    )
    .await;
    assert_eq!(s, 202, "{v}");
    srv.stop().await;
    env.cleanup().await;
}

/// A write from another origin is refused before anything happens, whatever credentials it
/// carries; the same request from this server's own origin, or from a client that sends no
/// `Origin` (curl, SDKs), is taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cross_origin_writes_are_403() {
    let env = Env::new("sec-origin").await;
    let srv = Served::start(env.app().await).await;
    let http = reqwest::Client::new();
    let post = |id: &str| {
        http.post(srv.url("/v1/jobs"))
            .bearer_auth(TOKEN)
            .header("content-type", "application/json")
            .body(serde_json::to_vec(&job(id)).unwrap())
    };
    for (name, value) in [
        ("origin", "http://evil.example"),
        ("origin", "null"),
        (
            "origin",
            &format!("http://127.0.0.1:{}", srv.addr.port() + 1),
        ),
        ("sec-fetch-site", "cross-site"),
        ("sec-fetch-site", "same-site"),
    ] {
        let (s, v) = answer(post("origin-x").header(name, value)).await;
        assert_eq!(s, 403, "{name}: {value}: {v}");
        assert_eq!(v["error"], "cross_origin", "{v}");
    }
    let (s, v) = answer(
        http.delete(srv.url("/v1/jobs/origin-x"))
            .bearer_auth(TOKEN)
            .header("origin", "http://evil.example"),
    )
    .await;
    assert_eq!(s, 403, "{v}");
    assert!(env.ledger.get("origin-x").await.unwrap().is_none());
    let (s, v) = answer(
        post("origin-same")
            .header("origin", format!("http://{}", srv.addr))
            .header("sec-fetch-site", "same-origin"),
    )
    .await;
    assert_eq!(s, 202, "from this server's own origin: {v}");
    let (s, v) = answer(post("origin-none")).await;
    assert_eq!(s, 202, "no Origin (curl, an SDK): {v}");
    // Reads are not writes: a page of another origin cannot read the answer anyway (no
    // CORS headers), and a link to the dashboard from elsewhere still opens it.
    let (s, _) = answer(
        http.get(srv.url("/v1/jobs/origin-same"))
            .bearer_auth(TOKEN)
            .header("sec-fetch-site", "cross-site"),
    )
    .await;
    assert_eq!(s, 200);
    srv.stop().await;
    env.cleanup().await;
}

/// Basic credentials, which a browser attaches by itself, are for the dashboard's reads:
/// a write with them is `403`, the same token as `Bearer` is taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn basic_credentials_are_for_reads_only() {
    let env = Env::new("sec-basic").await;
    let srv = Served::start(env.app().await).await;
    let http = reqwest::Client::new();
    let (s, v) = answer(
        http.post(srv.url("/v1/jobs"))
            .header("authorization", basic(TOKEN))
            .header("content-type", "application/json")
            .body(serde_json::to_vec(&job("basic-1")).unwrap()),
    )
    .await;
    assert_eq!(s, 403, "{v}");
    assert_eq!(v["error"], "basic_credentials_read_only", "{v}");
    assert!(v["message"].as_str().unwrap().contains("Bearer"), "{v}");
    let (s, v) = answer(
        http.delete(srv.url("/v1/jobs/basic-1"))
            .header("authorization", basic(TOKEN)),
    )
    .await;
    assert_eq!(s, 403, "{v}");
    assert!(env.ledger.get("basic-1").await.unwrap().is_none());
    for path in ["/v1/jobs", "/v1/dashboard", "/"] {
        let (s, v) = answer(
            http.get(srv.url(path))
                .header("authorization", basic(TOKEN)),
        )
        .await;
        assert_eq!(s, 200, "GET {path} with Basic: {v}");
    }
    // A wrong password is still a 401, not a hint that Basic is the wrong scheme.
    let (s, _) = answer(
        http.post(srv.url("/v1/jobs"))
            .header("authorization", basic("not-the-token-at-all"))
            .header("content-type", "application/json")
            .body(serde_json::to_vec(&job("basic-2")).unwrap()),
    )
    .await;
    assert_eq!(s, 401);
    srv.stop().await;
    env.cleanup().await;
}

// ---------------------------------------------------------------------------------------
// Webhooks

use lastcall_http::webhooks::{WebhookConfig, Webhooks};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A webhook receiver on a real socket: `/hooks/slow` never answers, every other
/// `/hooks/{name}` answers 200 and is recorded with its body.
struct Receiver {
    base: String,
    got: Arc<Mutex<Vec<(String, Value)>>>,
    stop: tokio_util::sync::CancellationToken,
}

impl Receiver {
    async fn start() -> Self {
        use axum::routing::post;
        let got: Arc<Mutex<Vec<(String, Value)>>> = Arc::default();
        let router = axum::Router::new().route(
            "/hooks/{name}",
            post({
                let got = got.clone();
                async move |axum::extract::Path(name): axum::extract::Path<String>,
                            body: axum::body::Bytes| {
                    if name == "slow" {
                        std::future::pending::<()>().await;
                    }
                    let v = serde_json::from_slice(&body).unwrap_or(Value::Null);
                    got.lock().unwrap().push((name, v));
                    "ok"
                }
            }),
        );
        let stop = tokio_util::sync::CancellationToken::new();
        let server =
            lastcall_http::listen("127.0.0.1:0".parse().unwrap(), router, stop.clone(), None)
                .await
                .unwrap();
        Self {
            base: format!("http://{}/hooks/", server.addr),
            got,
            stop,
        }
    }

    fn url(&self, name: &str) -> String {
        format!("{}{name}", self.base)
    }

    fn bodies(&self, name: &str) -> Vec<Value> {
        let got = self.got.lock().unwrap();
        got.iter()
            .filter(|(n, _)| n == name)
            .map(|(_, v)| v.clone())
            .collect()
    }

    /// The bodies `name` got, once it got one (panics after 20 s).
    async fn wait_for(&self, name: &str) -> Vec<Value> {
        let until = Instant::now() + Duration::from_secs(20);
        loop {
            let b = self.bodies(name);
            if !b.is_empty() {
                return b;
            }
            assert!(Instant::now() < until, "no webhook reached /hooks/{name}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// A job `id` in the ledger, accepted, with a webhook to `url`; `cancel`led (terminal,
/// `cancelled_before_start`) when asked.
async fn ledger_job(env: &Env, id: &str, url: &str, cancel: bool) {
    let now = lastcall_clock::now_ms();
    env.ledger
        .record_accepted(&lastcall_store::AcceptedJob {
            job_id: id.into(),
            kind: "incident.summary".into(),
            created_at_ms: now,
            expires_at_ms: now + 60_000,
            accepted_at_ms: now,
            trace_id: None,
            payload_hash: "h".into(),
            tenant: lastcall_core::Tenant::default_tenant(),
            priority: lastcall_core::Priority::Standard,
        })
        .await
        .unwrap();
    env.ledger.register_webhook(id, url, now).await.unwrap();
    if cancel {
        env.ledger.cancel(id, now).await.unwrap();
    }
}

/// A forged outcome event for `id`: it claims the job completed.
fn forged_event(id: &str) -> Vec<u8> {
    lastcall_core::OutcomeEvent {
        v: lastcall_core::event::EVENT_VERSION,
        job_id: id.into(),
        kind: "forged.kind".into(),
        state: "completed".into(),
        reason: Some("forged".into()),
        attempt: 7,
        model_calls: 7,
        created_at_ms: None,
        expires_at_ms: None,
        finished_at_ms: None,
        recorded_at_ms: 1,
        recorded_by: "attacker".into(),
        min_feasible_budget_ms: None,
    }
    .to_json()
}

fn hooks_config(rx: &Receiver) -> WebhookConfig {
    WebhookConfig {
        allow: WebhookConfig::parse_allow(std::slice::from_ref(&rx.base)).unwrap(),
        attempts: 1,
        timeout: Duration::from_secs(1),
        ..WebhookConfig::default()
    }
}

/// A POST that reuses a job id and is refused (`409` another payload) or answered as a
/// duplicate does not replace the callback URL of the job that holds the id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_post_does_not_replace_the_callback() {
    let env = Env::new("sec-hook-reuse").await;
    let mut state = env.state_with(Duration::from_secs(5)).await;
    state.webhooks.allow =
        WebhookConfig::parse_allow(&["http://127.0.0.1:9/hooks/".into()]).unwrap();
    let app = lastcall_http::app(Arc::new(state));
    let with = |payload: &str, hook: &str| {
        let mut j = job("reuse-1");
        j["payload"] = json!({"messages": [{"role": "user", "content": payload}]});
        j["callback_url"] = json!(format!("http://127.0.0.1:9/hooks/{hook}"));
        j
    };
    let (s, v) = post(&app, &with("a", "owner")).await;
    assert_eq!(s.as_u16(), 202, "{v}");
    let (s, v) = post(&app, &with("b", "thief")).await;
    assert_eq!(s.as_u16(), 409, "another payload: {v}");
    let (s, v) = post(&app, &with("a", "thief")).await;
    assert_eq!(s.as_u16(), 202, "{v}");
    assert_eq!(v["duplicate"], true, "{v}");
    assert_eq!(
        env.ledger
            .claim_webhook("reuse-1", "test", 1)
            .await
            .unwrap(),
        Some("http://127.0.0.1:9/hooks/owner".into()),
        "the job's callback is the one its own request gave"
    );
    env.cleanup().await;
}

/// With every delivery slot busy, a claimed webhook is not dropped: the slot comes first,
/// the claim after it, and the delivery follows once a slot is free.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_webhook_waits_for_a_delivery_slot_instead_of_being_dropped() {
    let env = Env::new("sec-hook-slots").await;
    let rx = Receiver::start().await;
    ledger_job(&env, "slow-1", &rx.url("slow"), true).await;
    ledger_job(&env, "next-1", &rx.url("next"), true).await;
    let hooks = Webhooks::spawn(
        WebhookConfig {
            concurrency: 1,
            ..hooks_config(&rx)
        },
        env.ledger.clone(),
        Arc::new(lastcall_clock::SystemClock::default()),
        "serve-test".into(),
    );
    hooks.on_event(&forged_event("slow-1"));
    hooks.on_event(&forged_event("next-1"));
    // The one slot is held by `slow` until its attempt times out (1 s); then `next` goes.
    let got = rx.wait_for("next").await;
    assert_eq!(got.len(), 1);
    // The attempt is recorded once the receiver's answer is in: poll for it.
    let until = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let attempts = loop {
        let attempts = env.ledger.webhook_attempts("next-1").await.unwrap();
        if !attempts.is_empty() || std::time::Instant::now() > until {
            break attempts;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    };
    assert_eq!(attempts.len(), 1, "{attempts:?}");
    assert_eq!(attempts[0].status, Some(200));
    assert_eq!(
        hooks
            .stats
            .dropped
            .load(std::sync::atomic::Ordering::Relaxed),
        0
    );
    env.cleanup().await;
}

/// An event on `{prefix}.events` only says which job ended: what is POSTed is the
/// ledger's outcome, never the event's body, and a job with no outcome gets nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_webhook_delivers_the_ledgers_outcome_not_the_events_body() {
    let env = Env::new("sec-hook-forged").await;
    let rx = Receiver::start().await;
    ledger_job(&env, "running-1", &rx.url("early"), false).await;
    ledger_job(&env, "ended-1", &rx.url("ended"), true).await;
    let hooks = Webhooks::spawn(
        WebhookConfig {
            concurrency: 1,
            ..hooks_config(&rx)
        },
        env.ledger.clone(),
        Arc::new(lastcall_clock::SystemClock::default()),
        "serve-test".into(),
    );
    // Events are taken in order: once `ended-1` is delivered, `running-1` was handled.
    hooks.on_event(&forged_event("running-1"));
    hooks.on_event(&forged_event("ended-1"));
    let got = rx.wait_for("ended").await;
    assert_eq!(got.len(), 1);
    let body = &got[0];
    assert_eq!(body["job_id"], "ended-1", "{body}");
    assert_eq!(body["state"], "cancelled", "the ledger's state: {body}");
    assert_eq!(body["reason"], "cancelled_before_start", "{body}");
    assert_eq!(body["kind"], "incident.summary", "{body}");
    assert_ne!(body["recorded_by"], "attacker", "{body}");
    assert!(
        rx.bodies("early").is_empty(),
        "a job with no outcome got a webhook"
    );
    assert_eq!(
        env.ledger
            .claim_webhook("running-1", "probe", 1)
            .await
            .unwrap(),
        Some(rx.url("early")),
        "its webhook is still there for its real outcome"
    );
    env.cleanup().await;
}

// ---------------------------------------------------------------------------------------
// Numbers from clients, error hygiene

/// `min_runtime_ms` of 2^64 − 1 is −1 as an i64; it used to pass the horizon check and end
/// as a `422` from the admission rule. It is a `400` naming the field.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_min_runtime_beyond_i64_is_400_naming_the_field() {
    let env = Env::new("sec-minrt").await;
    let app = env.app().await;
    for n in [json!(u64::MAX), json!(1u64 << 63), json!(25 * 3_600_000u64)] {
        let mut j = job("minrt-1");
        j["min_runtime_ms"] = n.clone();
        let (s, v) = post(&app, &j).await;
        assert_eq!(s.as_u16(), 400, "{n}: {v}");
        assert_eq!(v["field"], "min_runtime_ms", "{v}");
    }
    assert!(env.ledger.get("minrt-1").await.unwrap().is_none());
    env.cleanup().await;
}

/// A `503` because the ledger failed says so without the database's own error text
/// (hosts, files, users): that goes to the log only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ledger_failure_is_503_without_the_database_error() {
    let env = Env::new("sec-ledger-down").await;
    let app = env.app().await;
    env.ledger.close().await;
    let (s, v) = post(&app, &job("down-1")).await;
    assert_eq!(s.as_u16(), 503, "{v}");
    assert_eq!(v["error"], "ledger_unavailable", "{v}");
    let message = v["message"].as_str().unwrap().to_ascii_lowercase();
    assert!(message.contains("ledger is unavailable"), "{message}");
    for leak in ["pool", "closed", "sqlite", "sqlx", "database", "connection"] {
        assert!(!message.contains(leak), "`{leak}` in {message}");
    }
    env.cleanup().await;
}

// ---------------------------------------------------------------------------------------
// Idempotency

/// The idempotency fingerprint covers the kind: the same job id and payload under another
/// kind is a `409`, not the first job's answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_job_id_with_another_kind_is_a_conflict() {
    let env = Env::new("sec-idem-kind").await;
    let app = env.app().await;
    let (s, v) = post(&app, &job("idem-1")).await;
    assert_eq!(s.as_u16(), 202, "{v}");
    let (s, v) = post(&app, &job("idem-1")).await;
    assert_eq!((s.as_u16(), &v["duplicate"]), (202, &json!(true)), "{v}");
    let mut other = job("idem-1");
    other["kind"] = json!("other.kind");
    let (s, v) = post(&app, &other).await;
    assert_eq!(s.as_u16(), 409, "another kind: {v}");
    assert_eq!(v["error"], "job_id_conflict", "{v}");
    let mut slower = job("idem-1");
    slower["min_runtime_ms"] = json!(5);
    let (s, v) = post(&app, &slower).await;
    assert_eq!(s.as_u16(), 409, "another minimum runtime: {v}");
    env.cleanup().await;
}

/// The front door's fingerprint covers the model (which the payload no longer holds):
/// the same `Idempotency-Key` for another model, even one mapped to the same kind, is a
/// `409` at once, never the first request's job.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_idempotency_key_for_another_model_is_a_conflict() {
    let env = Env::new("sec-idem-model").await;
    let mut state = env.state_with(std::time::Duration::from_secs(5)).await;
    state.front_door.models = vec![("a".into(), "chat".into()), ("b".into(), "chat".into())];
    let srv = Served::start(lastcall_http::app(Arc::new(state))).await;
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap();
    let ask = |model: &str| {
        http.post(srv.url("/v1/chat/completions"))
            .bearer_auth(TOKEN)
            .header("content-type", "application/json")
            .header("idempotency-key", "idem-chat-1")
            .header("x-lastcall-deadline-ms", "20000")
            .body(
                serde_json::to_vec(
                    &json!({"model": model, "messages": [{"role": "user", "content": "hi"}]}),
                )
                .unwrap(),
            )
    };
    // The first request waits for an outcome no worker will give; it owns the job.
    let first = tokio::spawn(ask("a").send());
    let until = Instant::now() + Duration::from_secs(10);
    while env.ledger.get("idem-chat-1").await.unwrap().is_none() {
        assert!(
            Instant::now() < until,
            "the first request never claimed its key"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let t0 = Instant::now();
    let (s, v) = answer(ask("b")).await;
    assert_eq!(s, 409, "another model, the same key: {v}");
    assert_eq!(v["error"]["code"], "job_id_conflict", "{v}");
    assert!(t0.elapsed() < Duration::from_secs(10), "answered at once");
    first.abort();
    srv.stop().await;
    env.cleanup().await;
}

// ---------------------------------------------------------------------------------------
// Resource limits

/// `/v1/chat/completions` takes at most `--max-body-bytes`, as `POST /v1/jobs` does (it
/// used to take axum's default of 2 MB whatever the server was told).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chat_body_over_the_limit_is_413() {
    let env = Env::new("sec-chat-limit").await;
    let mut state = env.state_with(Duration::from_secs(5)).await;
    state.max_body_bytes = 1_024;
    let srv = Served::start(lastcall_http::app(Arc::new(state))).await;
    let http = reqwest::Client::new();
    let big = format!(
        r#"{{"model": "m", "messages": [{{"role": "user", "content": "{}"}}]"#,
        "x".repeat(4_096)
    );
    let (s, v) = answer(
        http.post(srv.url("/v1/chat/completions"))
            .bearer_auth(TOKEN)
            .header("content-type", "application/json")
            .body(big),
    )
    .await;
    assert_eq!(s, 413, "{v}");
    assert_eq!(v["error"]["code"], "body_too_large", "{v}");
    srv.stop().await;
    env.cleanup().await;
}

/// Requests that wait for an outcome (long-polls, chat completions) are bounded: with
/// every permit taken, another is `503 too_many_waiting` with `Retry-After` at once; a
/// plain read still answers; and the permit comes back when the wait ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_requests_are_bounded() {
    let env = Env::new("sec-waiting").await;
    let mut state = env.state_with(Duration::from_secs(5)).await;
    state.waiting = Arc::new(tokio::sync::Semaphore::new(1));
    let state = Arc::new(state);
    let app = lastcall_http::app(state.clone());
    let (s, v) = post(&app, &job("wait-1")).await;
    assert_eq!(s.as_u16(), 202, "{v}");
    let first = tokio::spawn({
        let app = app.clone();
        async move {
            call(
                &app,
                "GET",
                "/v1/jobs/wait-1?wait_ms=60000",
                Some(TOKEN),
                None,
            )
            .await
        }
    });
    let until = Instant::now() + Duration::from_secs(10);
    while state.waiting.available_permits() > 0 {
        assert!(
            Instant::now() < until,
            "the first long-poll never started waiting"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let second = tokio::time::timeout(
        Duration::from_secs(5),
        call(
            &app,
            "GET",
            "/v1/jobs/wait-1?wait_ms=60000",
            Some(TOKEN),
            None,
        ),
    )
    .await
    .expect("refused at once, not held");
    assert_eq!(second.0.as_u16(), 503, "{}", second.1);
    assert_eq!(second.1["error"], "too_many_waiting", "{}", second.1);
    let chat = tokio::time::timeout(
        Duration::from_secs(5),
        call(
            &app,
            "POST",
            "/v1/chat/completions",
            Some(TOKEN),
            Some(br#"{"model": "m", "messages": [{"role": "user", "content": "hi"}]}"#.to_vec()),
        ),
    )
    .await
    .expect("refused at once, not held");
    assert_eq!(chat.0.as_u16(), 503, "{}", chat.1);
    assert_eq!(chat.1["error"]["code"], "too_many_waiting", "{}", chat.1);
    let (s, _) = call(&app, "GET", "/v1/jobs/wait-1", Some(TOKEN), None).await;
    assert_eq!(s.as_u16(), 200, "a read without wait_ms is not bounded");
    first.abort();
    let _ = first.await;
    let until = Instant::now() + Duration::from_secs(10);
    while state.waiting.available_permits() == 0 {
        assert!(Instant::now() < until, "the permit never came back");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    env.cleanup().await;
}

/// `GET /healthz` on a connection of its own; `None` if no answer within `limit`.
async fn health_within(addr: SocketAddr, limit: Duration) -> Option<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    tokio::time::timeout(limit, async {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).await.unwrap();
        out
    })
    .await
    .ok()
}

/// A server holds at most `max_connections` connections: idle sockets beyond it wait to
/// be accepted (they cannot exhaust the process), and the next one is served as soon as
/// one closes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_beyond_the_limit_wait_until_one_closes() {
    let env = Env::new("sec-conns").await;
    let stop = tokio_util::sync::CancellationToken::new();
    let server = lastcall_http::listen_with(
        "127.0.0.1:0".parse().unwrap(),
        env.app().await,
        stop.clone(),
        None,
        lastcall_http::limit::Limits {
            max_connections: 2,
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let addr = server.addr;
    assert!(
        health_within(addr, Duration::from_secs(5))
            .await
            .is_some_and(|r| r.starts_with("HTTP/1.1 200")),
        "served under the limit"
    );
    // Two idle connections hold both places (each served once, so surely accepted).
    let mut idle = Vec::new();
    for _ in 0..2 {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        let mut buf = [0u8; 256];
        let n = s.read(&mut buf).await.unwrap();
        assert!(buf[..n].starts_with(b"HTTP/1.1 200"));
        idle.push(s);
    }
    let waiting = tokio::spawn(health_within(addr, Duration::from_secs(20)));
    // Not answered while both places are held (the accept waits for a permit)...
    assert_eq!(
        health_within(addr, Duration::from_millis(1_500)).await,
        None
    );
    // ...and answered once one idle connection closes.
    drop(idle.pop());
    let answer = waiting.await.unwrap();
    assert!(
        answer
            .as_deref()
            .is_some_and(|r| r.starts_with("HTTP/1.1 200")),
        "{answer:?}"
    );
    drop(idle);
    stop.cancel();
    server.task.await.unwrap().unwrap();
    env.cleanup().await;
}

/// A request's headers must arrive within the header-read timeout (slowloris): a client
/// that sends part of them and stops has its connection closed; a long-poll that waits
/// longer than the timeout for its answer is not affected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_whose_headers_never_finish_is_closed() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let env = Env::new("sec-slowloris").await;
    let stop = tokio_util::sync::CancellationToken::new();
    let server = lastcall_http::listen_with(
        "127.0.0.1:0".parse().unwrap(),
        env.app().await,
        stop.clone(),
        None,
        lastcall_http::limit::Limits {
            header_read_timeout: Duration::from_millis(500),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let mut s = tokio::net::TcpStream::connect(server.addr).await.unwrap();
    s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        .await
        .unwrap();
    let mut buf = Vec::new();
    let closed = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut buf)).await;
    assert!(
        closed.is_ok(),
        "the connection is still open 10 s after its headers stopped"
    );
    // A long-poll of 2 s (four timeouts) still gets its answer.
    let (st, v) = answer(
        reqwest::Client::new()
            .get(format!("http://{}/v1/jobs/none?wait_ms=2000", server.addr))
            .bearer_auth(TOKEN),
    )
    .await;
    assert_eq!(st, 404, "{v}");
    stop.cancel();
    server.task.await.unwrap().unwrap();
    env.cleanup().await;
}

/// A chat request is held for its outcome at most `--max-hold-ms`, however far its
/// deadline (up to the 24 h horizon): then `504 hold_exceeded` naming the job, which goes
/// on (it is not cancelled: the same key, or `GET /v1/jobs/{id}`, gets its outcome).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chat_request_is_held_at_most_the_max_hold() {
    let env = Env::new("sec-hold").await;
    let mut state = env.state_with(Duration::from_secs(5)).await;
    state.front_door.max_hold_ms = 1_000;
    let app = lastcall_http::app(Arc::new(state));
    let req = axum::http::Request::builder()
        .method("POST")
        .uri("/v1/chat/completions")
        .header("authorization", format!("Bearer {TOKEN}"))
        .header("content-type", "application/json")
        .header("idempotency-key", "held-1")
        .header("x-lastcall-deadline-ms", "3600000")
        .body(axum::body::Body::from(
            r#"{"model": "m", "messages": [{"role": "user", "content": "hi"}]}"#,
        ))
        .unwrap();
    // No worker: the outcome would come at the deadline, an hour from now.
    let resp = tokio::time::timeout(Duration::from_secs(15), {
        use tower::ServiceExt;
        app.clone().oneshot(req)
    })
    .await
    .expect("answered at the hold, not at the deadline")
    .unwrap();
    assert_eq!(resp.status().as_u16(), 504);
    let body = axum::body::to_bytes(resp.into_body(), usize::MAX)
        .await
        .unwrap();
    let v: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["error"]["code"], "hold_exceeded", "{v}");
    assert!(
        v["error"]["message"].as_str().unwrap().contains("held-1"),
        "{v}"
    );
    let rec = env.ledger.get("held-1").await.unwrap().unwrap();
    assert_eq!(rec.state, "accepted", "the job goes on: {rec:?}");
    env.cleanup().await;
}

/// The sweep (issue #35): a webhook whose outcome event no `serve` saw (it was down, or
/// the event was lost) is still delivered, from the ledger; a job that has not ended gets
/// nothing. Once delivered, the sweep no longer finds it, so it is not delivered again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sweep_delivers_a_webhook_whose_event_no_one_saw() {
    let env = Env::new("sec-hook-sweep").await;
    let rx = Receiver::start().await;
    ledger_job(&env, "missed-1", &rx.url("missed"), true).await;
    ledger_job(&env, "waiting-1", &rx.url("waiting"), false).await;
    let hooks = Webhooks::spawn(
        WebhookConfig {
            sweep_every: Duration::from_millis(100),
            settle: Duration::ZERO,
            ..hooks_config(&rx)
        },
        env.ledger.clone(),
        Arc::new(lastcall_clock::SystemClock::default()),
        "serve-test".into(),
    );
    // No event at all: only the sweep can find it.
    let got = rx.wait_for("missed").await;
    assert_eq!(got.len(), 1);
    assert_eq!(got[0]["job_id"], "missed-1", "{}", got[0]);
    assert_eq!(
        got[0]["state"], "cancelled",
        "the ledger's outcome: {}",
        got[0]
    );
    let until = Instant::now() + Duration::from_secs(10);
    while env
        .ledger
        .webhook_attempts("missed-1")
        .await
        .unwrap()
        .is_empty()
    {
        assert!(Instant::now() < until, "the delivery was never recorded");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let now = lastcall_clock::now_ms();
    assert!(
        env.ledger
            .webhooks_to_sweep(now, now, 10)
            .await
            .unwrap()
            .is_empty(),
        "delivered, and the job still running is not swept"
    );
    assert!(
        hooks.stats.swept.load(std::sync::atomic::Ordering::Relaxed) >= 1,
        "it came through the sweep"
    );
    assert!(
        rx.bodies("waiting").is_empty(),
        "a job with no outcome got a webhook"
    );
    env.cleanup().await;
}
