//! The HTTP ingress against the real RabbitMQ and a real ledger: every error code, auth,
//! the OpenAPI document, and one request over a real socket.

mod common;

use axum::http::StatusCode;
use common::*;
use lastcall_clock::now_ms;
use serde_json::{Value, json};
use std::sync::Arc;
use std::time::Duration;

fn job(id: &str) -> Value {
    json!({
        "job_id": id,
        "kind": "incident.summary",
        "deadline_ms": 60_000,
        "payload": {"messages": [{"role": "user", "content": "summarize"}]},
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auth_is_required_on_every_route_but_health() {
    let env = Env::new("auth").await;
    let app = env.app().await;
    for (method, uri) in [
        ("GET", "/"),
        ("POST", "/v1/jobs"),
        ("GET", "/v1/jobs"),
        ("GET", "/v1/jobs/x"),
        ("GET", "/v1/dashboard"),
        ("GET", "/metrics"),
        ("GET", "/openapi.json"),
    ] {
        let (s, body) = call(&app, method, uri, None, Some(b"{}".to_vec())).await;
        assert_eq!(
            s,
            StatusCode::UNAUTHORIZED,
            "{method} {uri} without a token"
        );
        assert_eq!(body["error"], "unauthorized");
        let (s, _) = call(&app, method, uri, Some("test-token-0123456780"), None).await;
        assert_eq!(
            s,
            StatusCode::UNAUTHORIZED,
            "{method} {uri} with a wrong token"
        );
    }
    assert_eq!(
        call(&app, "GET", "/healthz", None, None).await.0,
        StatusCode::OK
    );
    let (s, page) = call(&app, "GET", "/", Some(TOKEN), None).await;
    assert_eq!(s, StatusCode::OK, "the page with the bearer token");
    assert!(page.as_str().unwrap().contains("<title>lastcall"));
    env.cleanup().await;
}

/// A raw request with an `Authorization` header value (or none).
async fn with_authorization(
    app: &axum::Router,
    uri: &str,
    authorization: Option<String>,
) -> axum::http::Response<axum::body::Body> {
    use tower::ServiceExt;
    let mut req = axum::http::Request::builder().uri(uri);
    if let Some(a) = authorization {
        req = req.header("authorization", a);
    }
    app.clone()
        .oneshot(req.body(axum::body::Body::empty()).unwrap())
        .await
        .unwrap()
}

fn basic(user: &str, password: &str) -> String {
    // Spelled out with the `base64` tool of coreutils, so the test does not share the
    // server's decoder.
    let out = std::process::Command::new("base64")
        .args(["-w", "0"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .and_then(|mut c| {
            use std::io::Write;
            c.stdin
                .take()
                .unwrap()
                .write_all(format!("{user}:{password}").as_bytes())?;
            c.wait_with_output()
        })
        .expect("coreutils base64");
    format!("Basic {}", String::from_utf8(out.stdout).unwrap().trim())
}

/// The dashboard page for browsers: a `401` with a Basic challenge (so the browser asks),
/// then Basic credentials with the token as password (any user name) open it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_page_asks_browsers_for_basic_credentials_with_the_token_as_password() {
    let env = Env::new("basic").await;
    let app = env.app().await;
    let resp = with_authorization(&app, "/", None).await;
    assert_eq!(resp.status(), StatusCode::UNAUTHORIZED);
    let challenges: Vec<&str> = resp
        .headers()
        .get_all("www-authenticate")
        .iter()
        .map(|v| v.to_str().unwrap())
        .collect();
    assert!(
        challenges.contains(&r#"Basic realm="lastcall", charset="UTF-8""#),
        "{challenges:?}"
    );
    assert!(
        challenges.iter().any(|c| c.starts_with("Bearer")),
        "{challenges:?}"
    );

    for user in ["lastcall", "", "anyone"] {
        let resp = with_authorization(&app, "/", Some(basic(user, TOKEN))).await;
        assert_eq!(resp.status(), StatusCode::OK, "user name `{user}`");
        let page = axum::body::to_bytes(resp.into_body(), usize::MAX)
            .await
            .unwrap();
        assert!(String::from_utf8_lossy(&page).contains("<title>lastcall"));
    }
    // The JSON the page polls accepts the same credentials.
    let resp = with_authorization(&app, "/v1/dashboard", Some(basic("lastcall", TOKEN))).await;
    assert_eq!(resp.status(), StatusCode::OK);
    for wrong in [
        basic("lastcall", "test-token-0123456780"),
        basic(TOKEN, ""),
        basic("lastcall", &format!("{TOKEN}x")),
        "Basic not-base64!".to_owned(),
    ] {
        let resp = with_authorization(&app, "/", Some(wrong.clone())).await;
        assert_eq!(resp.status(), StatusCode::UNAUTHORIZED, "{wrong}");
    }
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn post_publishes_with_confirm_records_accepted_and_reads_back() {
    let env = Env::new("post").await;
    let app = env.app().await;
    let before = now_ms();
    let (s, body) = post(&app, &job("h1")).await;
    assert_eq!(s, StatusCode::ACCEPTED, "{body}");
    assert_eq!(body["job_id"], "h1");
    assert_eq!(body["state"], "accepted");
    let exp = body["expires_at_ms"].as_i64().unwrap();
    assert!(exp >= before + 60_000 && exp <= now_ms() + 60_000);
    assert!(body["ttl_ms"].as_u64().unwrap() <= 60_000);
    // In the work queue and in the ledger.
    let ready = lastcall_broker::topology::queue_depth(&env.broker, &env.topo.names.work_queue)
        .await
        .unwrap()
        .unwrap()
        .0;
    assert_eq!(ready, 1);
    let rec = env.ledger.get("h1").await.unwrap().unwrap();
    assert_eq!(rec.state, "accepted");
    assert_eq!(rec.expires_at_ms, Some(exp));

    let (s, got) = call(&app, "GET", "/v1/jobs/h1", Some(TOKEN), None).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(got["state"], "accepted");
    assert_eq!(got["kind"], "incident.summary");

    // Absolute deadline, generated id.
    let at = now_ms() + 30_000;
    let (s, body) = post(
        &app,
        &json!({"kind": "code.answer", "expires_at_ms": at, "payload": {"q": 1}}),
    )
    .await;
    assert_eq!(s, StatusCode::ACCEPTED, "{body}");
    assert_eq!(body["expires_at_ms"], at);
    let generated = body["job_id"].as_str().unwrap().to_owned();
    assert!(generated.starts_with("job-"));

    let (s, list) = call(
        &app,
        "GET",
        "/v1/jobs?state=accepted&kind=code.answer",
        Some(TOKEN),
        None,
    )
    .await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(list["count"], 1);
    assert_eq!(list["jobs"][0]["job_id"], generated.as_str());
    let (_, list) = call(&app, "GET", "/v1/jobs?state=accepted", Some(TOKEN), None).await;
    assert_eq!(list["count"], 2);

    // The same id with the same payload: idempotent, not published twice.
    let (s, again) = post(&app, &job("h1")).await;
    assert_eq!(s, StatusCode::ACCEPTED);
    assert_eq!(again["duplicate"], true);
    let ready = lastcall_broker::topology::queue_depth(&env.broker, &env.topo.names.work_queue)
        .await
        .unwrap()
        .unwrap()
        .0;
    assert_eq!(ready, 2, "h1 once, the generated job once");
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_error_code_names_its_field() {
    let env = Env::new("errors").await;
    let app = env.app().await;
    let bad = |body: Value, field: &'static str| (body, field);
    let cases = [
        bad(json!({"deadline_ms": 1000, "payload": {}}), "kind"),
        bad(
            json!({"kind": "Bad Kind!", "deadline_ms": 1000, "payload": {}}),
            "kind",
        ),
        bad(
            json!({"kind": 7, "deadline_ms": 1000, "payload": {}}),
            "kind",
        ),
        bad(json!({"kind": "k", "deadline_ms": 1000}), "payload"),
        bad(
            json!({"kind": "k", "deadline_ms": 1000, "payload": [1]}),
            "payload",
        ),
        bad(json!({"kind": "k", "payload": {}}), "deadline_ms"),
        bad(
            json!({"kind": "k", "deadline_ms": -5, "payload": {}}),
            "deadline_ms",
        ),
        bad(
            json!({"kind": "k", "deadline_ms": 1000, "expires_at_ms": 5, "payload": {}}),
            "deadline_ms",
        ),
        bad(
            json!({"kind": "k", "deadline_ms": 1000, "payload": {}, "job_id": "no spaces"}),
            "job_id",
        ),
        // Above the horizon (24 h): the error names the field the request sent.
        bad(
            json!({"kind": "k", "deadline_ms": 900_000_000, "payload": {}}),
            "deadline_ms",
        ),
        bad(
            json!({"kind": "k", "deadline_ms": 1000, "payload": {}, "trace_id": "tråce"}),
            "trace_id",
        ),
        bad(
            json!({"kind": "k", "deadline_ms": 1000, "payload": {}, "trace_id": "t".repeat(257)}),
            "trace_id",
        ),
        bad(
            json!({"kind": "k", "deadline_ms": 1000, "payload": {}, "min_runtime_ms": "x"}),
            "min_runtime_ms",
        ),
    ];
    for (body, field) in cases {
        let (s, e) = post(&app, &body).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{body} → {e}");
        assert_eq!(e["field"], field, "{body} → {e}");
        assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()));
    }
    let (s, e) = call(
        &app,
        "POST",
        "/v1/jobs",
        Some(TOKEN),
        Some(b"{not json".to_vec()),
    )
    .await;
    assert_eq!(
        (s, e["error"].as_str()),
        (StatusCode::BAD_REQUEST, Some("invalid_json"))
    );
    let (s, e) = call(&app, "GET", "/v1/jobs?state=nope", Some(TOKEN), None).await;
    assert_eq!(
        (s, e["field"].as_str()),
        (StatusCode::BAD_REQUEST, Some("state"))
    );
    let (s, _) = call(&app, "GET", "/v1/jobs/missing", Some(TOKEN), None).await;
    assert_eq!(s, StatusCode::NOT_FOUND);

    // 413: a body over the limit, with and without a Content-Length that says so.
    let mut state = env.state_with(Duration::from_secs(5)).await;
    state.max_body_bytes = 1024;
    let small = lastcall_http::app(Arc::new(state));
    let mut big = job("big");
    big["payload"]["pad"] = json!("x".repeat(4096));
    let (s, e) = post(&small, &big).await;
    assert_eq!(s, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(e["error"], "body_too_large");

    // 409: the same id with another payload.
    assert_eq!(post(&app, &job("dup")).await.0, StatusCode::ACCEPTED);
    let mut other = job("dup");
    other["payload"] = json!({"messages": [{"role": "user", "content": "something else"}]});
    let (s, e) = post(&app, &other).await;
    assert_eq!(s, StatusCode::CONFLICT, "{e}");
    assert_eq!(e["field"], "job_id");

    // 422: already expired (inside the clock margin), never published.
    let (s, e) = post(
        &app,
        &json!({"job_id": "late", "kind": "k", "expires_at_ms": now_ms() + 50, "payload": {}}),
    )
    .await;
    assert_eq!(s, StatusCode::UNPROCESSABLE_ENTITY, "{e}");
    assert_eq!(e["error"], "already_expired");
    assert_eq!(e["field"], "expires_at_ms");
    assert!(env.ledger.get("late").await.unwrap().is_none());
    // 422 too: a well-formed `expires_at_ms` farther ahead than the horizon, and a
    // `deadline_ms` inside the clock margin (the error names the field sent).
    let (s, e) = post(
        &app,
        &json!({"job_id": "far", "kind": "k", "expires_at_ms": now_ms() + 90_000_000, "payload": {}}),
    )
    .await;
    assert_eq!(s, StatusCode::UNPROCESSABLE_ENTITY, "{e}");
    assert_eq!(
        (e["error"].as_str(), e["field"].as_str()),
        (Some("deadline_beyond_horizon"), Some("expires_at_ms"))
    );
    let (s, e) = post(
        &app,
        &json!({"job_id": "short", "kind": "k", "deadline_ms": 50, "payload": {}}),
    )
    .await;
    assert_eq!(s, StatusCode::UNPROCESSABLE_ENTITY, "{e}");
    assert_eq!(
        (e["error"].as_str(), e["field"].as_str()),
        (Some("already_expired"), Some("deadline_ms"))
    );
    // `null` is an absent optional field.
    let (s, e) = post(
        &app,
        &json!({"job_id": "nulls", "kind": "k", "deadline_ms": 60_000, "expires_at_ms": null, "min_runtime_ms": null, "trace_id": null, "payload": {}}),
    )
    .await;
    assert_eq!(s, StatusCode::ACCEPTED, "{e}");

    env.cleanup().await;
}

/// Every refusal of the HTTP layer itself is the documented JSON error naming the parameter
/// or the reason, never axum's plain-text rejection (found by schemathesis: repeated query
/// parameters, a non-integer window, a method the route does not have).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_rejection_is_the_json_error_naming_the_parameter() {
    use tower::ServiceExt;
    let env = Env::new("rejections").await;
    let app = env.app().await;
    let cases: [(&str, &str, u16, Option<&str>); 11] = [
        ("GET", "/v1/jobs?state=null&state=null", 400, Some("state")),
        (
            "GET",
            "/v1/jobs?state=accepted&state=accepted",
            400,
            Some("state"),
        ),
        ("GET", "/v1/jobs?state=null", 400, Some("state")),
        ("GET", "/v1/jobs?limit=null", 400, Some("limit")),
        ("GET", "/v1/jobs?limit=0", 400, Some("limit")),
        ("GET", "/v1/jobs?kind=a&kind=b", 400, Some("kind")),
        ("GET", "/v1/dashboard?minutes=null", 400, Some("minutes")),
        (
            "GET",
            "/v1/dashboard?minutes=5&minutes=6",
            400,
            Some("minutes"),
        ),
        ("GET", "/v1/dashboard?minutes=1441", 400, Some("minutes")),
        ("GET", "/v1/jobs/%FF", 400, Some("id")),
        ("DELETE", "/v1/jobs", 405, None),
    ];
    for (method, uri, status, field) in cases {
        let req = axum::http::Request::builder()
            .method(method)
            .uri(uri)
            .header("authorization", format!("Bearer {TOKEN}"))
            .body(axum::body::Body::empty())
            .unwrap();
        let resp = app.clone().oneshot(req).await.unwrap();
        assert_eq!(resp.status().as_u16(), status, "{method} {uri}");
        let headers = resp.headers().clone();
        assert_eq!(
            headers["content-type"], "application/json",
            "{method} {uri}"
        );
        let body: Value = serde_json::from_slice(
            &axum::body::to_bytes(resp.into_body(), usize::MAX)
                .await
                .unwrap(),
        )
        .unwrap_or_else(|e| panic!("{method} {uri}: not JSON: {e}"));
        assert_eq!(body["field"].as_str(), field, "{method} {uri}: {body}");
        let message = body["message"].as_str().unwrap_or("");
        assert!(!message.is_empty(), "{method} {uri}: {body}");
        if let Some(f) = field {
            assert!(message.contains(f), "{method} {uri}: {body}");
        }
        if status == 405 {
            assert_eq!(body["error"], "method_not_allowed", "{body}");
            let allow = headers["allow"].to_str().unwrap();
            assert!(allow.contains("GET") && allow.contains("POST"), "{allow}");
            assert!(
                message.contains("DELETE") && message.contains("Allow"),
                "{body}"
            );
        }
    }
    // An unknown parameter is ignored; a valid query still works.
    let (s, _) = call(
        &app,
        "GET",
        "/v1/jobs?state=accepted&limit=5&_=1",
        Some(TOKEN),
        None,
    )
    .await;
    assert_eq!(s, StatusCode::OK);
    let (s, d) = call(&app, "GET", "/v1/dashboard?minutes=60", Some(TOKEN), None).await;
    assert_eq!(
        (s, d["window_minutes"].as_i64()),
        (StatusCode::OK, Some(60))
    );
    env.cleanup().await;
}

/// `GET /v1/dashboard` raises `ledger_behind_retention` when the ledger holds an ended job
/// older than the retention in force plus a day's grace, and not within the grace, nor
/// when the retention is off or unknown.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_alerts_when_the_ledger_is_behind_its_retention() {
    use lastcall_core::{Decision, State};
    use lastcall_store::OutcomeRecord;
    const DAY: i64 = 86_400_000;
    let env = Env::new("retention-alert").await;
    let now = now_ms();
    let record = async |id: &str, age_ms: i64| {
        env.ledger
            .record_outcome(&OutcomeRecord {
                attempt_key: format!("{id}-1"),
                attempt: 1,
                ..OutcomeRecord::new(
                    id,
                    "incident.summary",
                    State::Completed,
                    Decision::Ack,
                    now - age_ms,
                )
            })
            .await
            .unwrap();
    };
    let alerts = async |retention_ms: Option<i64>| {
        let mut state = env.state_with(Duration::from_secs(5)).await;
        state.retention_ms = retention_ms;
        let app = lastcall_http::app(Arc::new(state));
        let (s, d) = call(&app, "GET", "/v1/dashboard", Some(TOKEN), None).await;
        assert_eq!(s, StatusCode::OK, "{d}");
        d["alerts"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|a| a["alert"] == "ledger_behind_retention")
            .cloned()
            .collect::<Vec<Value>>()
    };
    // Past a 1-day retention, within its day of grace: pruning may not have run yet.
    record("recent", DAY + DAY / 2).await;
    assert!(alerts(Some(DAY)).await.is_empty());
    // Past retention and grace.
    record("stale", 3 * DAY).await;
    let a = alerts(Some(DAY)).await;
    assert_eq!(a.len(), 1, "{a:?}");
    let message = a[0]["message"].as_str().unwrap();
    assert!(
        message.contains("holds 2 ended jobs older than its retention of 24 h")
            && message.contains("recorded 3 d ago")
            && message.contains("lastcall ledger prune"),
        "{message}"
    );
    assert_eq!(a[0]["subject"], "ledger");
    // A longer retention, or none known: no alert.
    assert!(alerts(Some(5 * DAY)).await.is_empty());
    assert!(alerts(None).await.is_empty());
    env.cleanup().await;
}

/// 503: the broker did not confirm the publish (a full quorum queue with
/// `reject-publish` nacks it); the job is not recorded as accepted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_refusal_is_503_and_not_accepted() {
    let env = Env::with_topology("nack", |t| {
        t.queue_type = lastcall_broker::QueueType::Quorum;
        t.max_length = Some(1);
    })
    .await;
    let app = env.app().await;
    let mut refused = None;
    for i in 0..5 {
        let id = format!("q{i}");
        let (s, e) = post(&app, &job(&id)).await;
        if s == StatusCode::SERVICE_UNAVAILABLE {
            assert_eq!(e["error"], "broker_unavailable", "{e}");
            assert!(e["message"].as_str().unwrap().contains("nack"), "{e}");
            refused = Some(id);
            break;
        }
        assert_eq!(s, StatusCode::ACCEPTED, "{e}");
    }
    let id = refused.expect("a full queue refuses a publish within 5 jobs");
    assert!(
        env.ledger.get(&id).await.unwrap().is_none(),
        "not recorded as accepted"
    );
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openapi_document_is_valid_and_covers_the_routes() {
    let env = Env::new("openapi").await;
    let app = env.app().await;
    let (s, doc) = call(&app, "GET", "/openapi.json", Some(TOKEN), None).await;
    assert_eq!(s, StatusCode::OK);
    assert!(doc["openapi"].as_str().unwrap().starts_with("3."));
    assert!(doc["info"]["title"].is_string() && doc["info"]["version"].is_string());
    for path in [
        "/v1/jobs",
        "/v1/jobs/{id}",
        "/v1/dashboard",
        "/v1/chat/completions",
        "/v1/models",
        "/v1/files",
        "/v1/files/{id}",
        "/v1/files/{id}/content",
        "/v1/batches",
        "/v1/batches/{id}",
        "/v1/batches/{id}/cancel",
        "/metrics",
        "/openapi.json",
        "/healthz",
        "/readyz",
        "/",
    ] {
        let item = doc["paths"][path]
            .as_object()
            .unwrap_or_else(|| panic!("{path} documented"));
        for (method, op) in item {
            assert!(["get", "post", "delete"].contains(&method.as_str()));
            assert!(
                op["responses"].as_object().is_some_and(|r| !r.is_empty()),
                "{path} {method}"
            );
        }
    }
    let post = &doc["paths"]["/v1/jobs"]["post"]["responses"];
    for code in [
        "200", "202", "400", "401", "409", "413", "422", "429", "503",
    ] {
        assert!(post[code].is_object(), "POST /v1/jobs documents {code}");
    }
    let delete = &doc["paths"]["/v1/jobs/{id}"]["delete"]["responses"];
    for code in ["200", "202", "401", "404", "409"] {
        assert!(
            delete[code].is_object(),
            "DELETE /v1/jobs/{{id}} documents {code}"
        );
    }
    // The served document states this server's horizon as the bound of the relative fields.
    let job = &doc["components"]["schemas"]["NewJob"]["allOf"][0]["properties"];
    assert_eq!(job["deadline_ms"]["maximum"], 86_400_000);
    assert_eq!(job["min_runtime_ms"]["maximum"], 86_400_000);
    let mut state = env.state_with(Duration::from_secs(5)).await;
    state.horizon_ms = 3_600_000;
    state.max_body_bytes = 4096;
    let (_, short) = call(
        &lastcall_http::app(Arc::new(state)),
        "GET",
        "/openapi.json",
        Some(TOKEN),
        None,
    )
    .await;
    let job = &short["components"]["schemas"]["NewJob"]["allOf"][0]["properties"];
    assert_eq!(job["deadline_ms"]["maximum"], 3_600_000);
    assert_eq!(job["min_runtime_ms"]["maximum"], 3_600_000);
    assert!(
        short["components"]["responses"]["TooLarge"]["description"]
            .as_str()
            .unwrap()
            .contains("4096 bytes")
    );
    // Every $ref resolves.
    fn refs(v: &Value, out: &mut Vec<String>) {
        match v {
            Value::Object(o) => {
                if let Some(Value::String(r)) = o.get("$ref") {
                    out.push(r.clone());
                }
                o.values().for_each(|v| refs(v, out));
            }
            Value::Array(a) => a.iter().for_each(|v| refs(v, out)),
            _ => {}
        }
    }
    let mut all = Vec::new();
    refs(&doc, &mut all);
    assert!(!all.is_empty());
    for r in all {
        let ptr = r.strip_prefix('#').expect("local ref");
        assert!(doc.pointer(ptr).is_some(), "{r} resolves");
    }
    env.cleanup().await;
}

/// The document and the router agree: every documented operation is served (no
/// "no such route", no `405`), and a method the document does not list for a path is a
/// `405`. (The router is built from the same `#[utoipa::path]` attributes with
/// `utoipa_axum::routes!`, so no route is served undocumented.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_documented_operation_is_served_and_no_other_method() {
    let env = Env::new("routes").await;
    let app = env.app().await;
    let doc: Value = serde_json::from_str(
        &lastcall_http::openapi::document(86_400_000, 60_000, 1 << 20).unwrap(),
    )
    .unwrap();
    let paths = doc["paths"].as_object().unwrap();
    assert_eq!(paths.len(), 16, "{:?}", paths.keys().collect::<Vec<_>>());
    let mut operations = 0;
    for (path, item) in paths {
        let uri = path.replace("{id}", "no-such-job");
        for method in ["GET", "POST", "DELETE", "PUT", "PATCH"] {
            // POSTs carry an empty object: refused at once (400) before any publish.
            let body = (method == "POST").then(|| b"{}".to_vec());
            let (s, b) = call(&app, method, &uri, Some(TOKEN), body).await;
            if item.get(method.to_lowercase()).is_some() {
                operations += 1;
                assert_ne!(s, StatusCode::METHOD_NOT_ALLOWED, "{method} {path}: {b}");
                assert!(
                    !(s == StatusCode::NOT_FOUND && b["message"] == "no such route"),
                    "{method} {path} is documented but not routed"
                );
            } else {
                assert_eq!(
                    s,
                    StatusCode::METHOD_NOT_ALLOWED,
                    "{method} {path} is served but not documented: {b}"
                );
            }
        }
    }
    assert_eq!(operations, 20);
    env.cleanup().await;
}

/// The OpenAPI document passes `openapi-spec-validator` (PyPI), which
/// `scripts/setup-openapi.sh` installs in a venv under `${LASTCALL_CACHE:-$HOME/.cache/lastcall}`
/// (scripts/test.sh runs it before the tests; the test installs nothing).
#[test]
fn openapi_document_passes_openapi_spec_validator() {
    let cache = std::env::var("LASTCALL_CACHE")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|_| {
            std::path::PathBuf::from(std::env::var("HOME").unwrap()).join(".cache/lastcall")
        });
    let py = cache.join("openapi-venv/bin/python");
    let have = std::process::Command::new(&py)
        .args(["-c", "import openapi_spec_validator"])
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    assert!(
        have,
        "openapi-spec-validator is not installed at {}: run scripts/setup-openapi.sh",
        py.display()
    );
    let file = std::env::temp_dir().join(format!("lastcall-openapi-{}.json", std::process::id()));
    let doc = lastcall_http::openapi::document(86_400_000, 60_000, 1_048_576).unwrap();
    std::fs::write(&file, doc).unwrap();
    let out = std::process::Command::new(&py)
        .args(["-c", "import sys, json; from openapi_spec_validator import validate; validate(json.load(open(sys.argv[1]))); print('valid')"])
        .arg(&file)
        .output()
        .unwrap();
    let _ = std::fs::remove_file(&file);
    assert!(
        out.status.success(),
        "openapi-spec-validator: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serves_over_a_real_socket() {
    let env = Env::new("socket").await;
    let stop = tokio_util::sync::CancellationToken::new();
    let server = lastcall_http::listen(
        "127.0.0.1:0".parse().unwrap(),
        env.app().await,
        stop.clone(),
        None,
    )
    .await
    .unwrap();
    let addr = server.addr;
    let client = reqwest::Client::new();
    let health = client
        .get(format!("http://{addr}/healthz"))
        .send()
        .await
        .unwrap();
    assert_eq!(health.status().as_u16(), 200);
    let resp = client
        .post(format!("http://{addr}/v1/jobs"))
        .header("authorization", format!("Bearer {TOKEN}"))
        .header("content-type", "application/json")
        .body(serde_json::to_vec(&job("sock1")).unwrap())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 202);
    assert_eq!(resp.headers()["location"], "/v1/jobs/sock1");
    let metrics = client
        .get(format!("http://{addr}/metrics"))
        .header("authorization", format!("Bearer {TOKEN}"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains("lastcall_http_accepted_total 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains("lastcall_ledger_jobs{state=\"accepted\"} 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains("lastcall_http_responses_total{route=\"/v1/jobs\",status=\"202\"} 1"),
        "{metrics}"
    );
    stop.cancel();
    server.task.await.unwrap().unwrap();
    env.cleanup().await;
}
