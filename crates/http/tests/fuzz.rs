//! Fuzz target (property-based, stable Rust) for the HTTP handlers, through the axum
//! `Router` without a socket (`tower::ServiceExt::oneshot`), with a real RabbitMQ and a
//! real SQLite ledger: arbitrary methods, paths, query strings, headers and bodies —
//! random bytes, random JSON, and valid requests with one field replaced by random JSON.
//! Whatever comes in, the router answers (no panic, no hang), with a 2xx or a 4xx, and
//! every 4xx is a JSON error body whose `error` names the reason (and `message` says it).
//!
//! `LASTCALL_FUZZ_CASES` sets the cases (default 300: the normal suite stays fast), e.g.
//! `LASTCALL_FUZZ_CASES=1000000 cargo test -p lastcall-http --release --test fuzz`.

mod common;

use axum::body::Body;
use axum::http::Request;
use common::*;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use serde_json::{Value, json};
use std::time::Duration;
use tower::ServiceExt;

fn cases() -> u32 {
    std::env::var("LASTCALL_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(300)
}

fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|n| json!(n)),
        any::<u64>().prop_map(|n| json!(n)),
        any::<f64>().prop_map(|f| json!(f)),
        any::<String>().prop_map(Value::String),
        "[a-z_.:-]{0,12}".prop_map(Value::String),
    ];
    leaf.prop_recursive(3, 24, 5, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..5).prop_map(Value::Array),
            proptest::collection::btree_map(field(), inner, 0..5)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

fn field() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("job_id".to_owned()),
        Just("kind".to_owned()),
        Just("deadline_ms".to_owned()),
        Just("expires_at_ms".to_owned()),
        Just("payload".to_owned()),
        Just("min_runtime_ms".to_owned()),
        Just("webhook_url".to_owned()),
        Just("messages".to_owned()),
        Just("model".to_owned()),
        Just("max_tokens".to_owned()),
        Just("stream".to_owned()),
        any::<String>(),
    ]
}

fn valid_job() -> Value {
    json!({
        "kind": "incident.summary",
        "deadline_ms": 60_000,
        "payload": {"messages": [{"role": "user", "content": "summarize"}]},
    })
}

fn body() -> impl Strategy<Value = Option<Vec<u8>>> {
    prop_oneof![
        Just(None),
        proptest::collection::vec(any::<u8>(), 0..256).prop_map(Some),
        json_value().prop_map(|v| Some(serde_json::to_vec(&v).unwrap())),
        (field(), json_value()).prop_map(|(k, v)| {
            let mut j = valid_job();
            j[k] = v;
            Some(serde_json::to_vec(&j).unwrap())
        }),
    ]
}

fn path() -> impl Strategy<Value = String> {
    let base = prop_oneof![
        Just("/v1/jobs".to_owned()),
        "[A-Za-z0-9._:%-]{0,40}".prop_map(|id| format!("/v1/jobs/{id}")),
        Just("/v1/chat/completions".to_owned()),
        Just("/v1/models".to_owned()),
        Just("/v1/dashboard".to_owned()),
        Just("/metrics".to_owned()),
        Just("/healthz".to_owned()),
        Just("/".to_owned()),
        "/[A-Za-z0-9/._-]{0,30}",
    ];
    // Query strings of names the handlers read, and junk (percent-escaped as needed).
    let query = proptest::option::of(proptest::collection::vec(
        (
            prop_oneof![
                Just("minutes"),
                Just("state"),
                Just("kind"),
                Just("limit"),
                Just("wait_ms"),
                Just("since_ms"),
                Just("x"),
            ],
            "[A-Za-z0-9%+._-]{0,12}",
        ),
        0..4,
    ));
    (base, query).prop_map(|(b, q)| match q {
        Some(q) => {
            let q: Vec<String> = q
                .into_iter()
                // Never a long-poll of many seconds: the answer is what is checked.
                .filter(|(k, _)| *k != "wait_ms")
                .map(|(k, v)| format!("{k}={v}"))
                .collect();
            format!("{b}?{}", q.join("&"))
        }
        None => b,
    })
}

fn headers() -> impl Strategy<Value = Vec<(String, String)>> {
    let auth = prop_oneof![
        Just(format!("Bearer {TOKEN}")),
        Just("Bearer wrong".to_owned()),
        "[ -~]{0,40}",
    ];
    let ctype = prop_oneof![
        Just("application/json".to_owned()),
        Just("application/json; charset=utf-8".to_owned()),
        Just("text/plain".to_owned()),
        "[ -~]{0,30}",
    ];
    (
        proptest::option::of(auth),
        proptest::option::of(ctype),
        proptest::collection::vec(
            (
                prop_oneof![
                    Just("idempotency-key".to_owned()),
                    Just("origin".to_owned()),
                    Just("x-request-id".to_owned()),
                    Just("accept".to_owned()),
                    "x-[a-z0-9-]{1,16}",
                ],
                "[ -~]{0,40}",
            ),
            0..3,
        ),
    )
        .prop_map(|(a, c, mut rest)| {
            if let Some(a) = a {
                rest.push(("authorization".into(), a));
            }
            if let Some(c) = c {
                rest.push(("content-type".into(), c));
            }
            rest
        })
}

fn method() -> impl Strategy<Value = &'static str> {
    prop_oneof![
        4 => Just("POST"),
        3 => Just("GET"),
        1 => Just("DELETE"),
        1 => Just("PUT"),
        1 => Just("OPTIONS"),
        1 => Just("HEAD"),
    ]
}

#[test]
fn fuzz_http_handlers() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let env = rt.block_on(Env::new("fuzz-http"));
    let app = rt.block_on(env.app());
    let mut runner = TestRunner::new(Config {
        cases: cases(),
        failure_persistence: None,
        ..Config::default()
    });
    let (answered, ok) = (std::cell::Cell::new(0u64), std::cell::Cell::new(0u64));
    let result = runner.run(
        &(method(), path(), headers(), body()),
        |(method, uri, headers, body)| {
            let mut req = Request::builder().method(method).uri(&uri);
            for (k, v) in &headers {
                req = req.header(k, v);
            }
            let Ok(req) = req.body(Body::from(body.clone().unwrap_or_default())) else {
                // Not a request http can even build (a header value it refuses).
                return Ok(());
            };
            let (status, bytes) = rt.block_on(async {
                let resp = tokio::time::timeout(Duration::from_secs(20), app.clone().oneshot(req))
                    .await
                    .map_err(|_| TestCaseError::fail(format!("{method} {uri}: no answer in 20 s")))?
                    .unwrap();
                let status = resp.status();
                let bytes = axum::body::to_bytes(resp.into_body(), 1 << 20)
                    .await
                    .unwrap();
                Ok::<_, TestCaseError>((status, bytes))
            })?;
            answered.set(answered.get() + 1);
            let what = || {
                format!(
                    "{method} {uri} {headers:?} {:?} -> {status} {}",
                    body.as_deref().map(String::from_utf8_lossy),
                    String::from_utf8_lossy(&bytes)
                )
            };
            prop_assert!(
                status.is_success() || status.is_client_error(),
                "neither 2xx nor 4xx: {}",
                what()
            );
            if status.is_success() {
                ok.set(ok.get() + 1);
            } else if method == "HEAD" {
                // A HEAD answer has no body (axum drops it, as HTTP says).
                prop_assert!(bytes.is_empty(), "{}", what());
            } else {
                let v: Value = serde_json::from_slice(&bytes).map_err(|_| {
                    TestCaseError::fail(format!("a 4xx without a JSON body: {}", what()))
                })?;
                // lastcall's own shape `{error, message, field}`, or on the OpenAI-compatible
                // front door OpenAI's `{error: {code, message, param, type}}`.
                // OpenAI's `code` may be null (a body that is not JSON): then `type` and
                // `param` name the reason and the field.
                let (code, message, field) = match &v["error"] {
                    Value::Object(e) if e["code"].is_null() => {
                        prop_assert!(e["param"].as_str().is_some(), "{}", what());
                        (&e["type"], &e["message"], &e["param"])
                    }
                    Value::Object(e) => (&e["code"], &e["message"], &e["param"]),
                    _ => (&v["error"], &v["message"], &v["field"]),
                };
                prop_assert!(
                    code.as_str().is_some_and(|c| !c.is_empty()),
                    "a 4xx without an error code: {}",
                    what()
                );
                prop_assert!(
                    message.as_str().is_some_and(|m| !m.is_empty()),
                    "a 4xx without a message: {}",
                    what()
                );
                if !field.is_null() {
                    prop_assert!(field.as_str().is_some_and(|f| !f.is_empty()), "{}", what());
                }
            }
            Ok(())
        },
    );
    eprintln!(
        "fuzz_http_handlers: {} requests answered, {} with a 2xx",
        answered.get(),
        ok.get()
    );
    rt.block_on(env.cleanup());
    if let Err(e) = result {
        panic!("{e}");
    }
}
