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
