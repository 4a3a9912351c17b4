//! Tenancy as a boundary at the door (issue #48), through the real `lastcall serve` with a
//! tokens file, a real worker (the sim backend), RabbitMQ and the ledger:
//! - a job another tenant's producer published straight to the broker is never the answer
//!   to a chat request that names its id as `Idempotency-Key`: the key names a job in the
//!   caller's own namespace, which runs and answers with its own result;
//! - a request body that does not arrive within the body-read timeout (10 s by default)
//!   is answered `408 body_read_timeout` and its connection closed.

use crate::common;

use common::serve::Serve;
use common::*;
use lastcall_worker::clock::now_ms;
use serde_json::json;
use std::io::{Read, Write};
use std::time::{Duration, Instant};

const OPERATOR: &str = "operator-token-door-tenancy-48";
const TEAM_A: &str = "team-a-token-door-tenancy-0048";

/// `lastcall serve` with the defaults and a tokens file giving `TEAM_A` tenant `team-a`;
/// its base URL once it is ready.
async fn serve(env: &Env) -> (Serve, String) {
    let file = std::env::temp_dir().join(format!("{}-tokens.toml", env.prefix));
    std::fs::write(
        &file,
        format!(
            "[[token]]\nsha256 = \"{}\"\ntenant = \"team-a\"\n",
            lastcall_http::tokens::hash_token(TEAM_A)
        ),
    )
    .unwrap();
    let file = file.to_str().unwrap();
    let serve = Serve::start(env, OPERATOR, &["--tokens-file", file]).await;
    let base = serve.base.clone();
    (serve, base)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idempotency_key_never_answers_with_another_tenants_job() {
    let env = Env::sqlite("door-tenancy-key").await;
    let w = env
        .start_worker(env.worker_config(2, 4), sim(50), system_clock())
        .await;
    // team-b's producer publishes straight to the broker (no ledger claim: the worker's
    // row has no payload hash), and the worker completes it.
    let s = env.submitter(100, false).await;
    let mut job = job("victim-b-1", 60_000);
    job.kind = "chat".into();
    let e = s
        .envelope(&job, now_ms())
        .unwrap()
        .with_tenant(lastcall_core::Tenant::parse("team-b").unwrap());
    s.submit_envelope(&e, None, now_ms()).await.unwrap();
    let victim = &env
        .wait_terminal(&["victim-b-1".into()], Duration::from_secs(20))
        .await[0];
    assert_eq!(
        (victim.state.as_str(), victim.tenant.as_str()),
        ("completed", "team-b")
    );

    let (_serve, base) = serve(&env).await;
    let body = json!({"model": "any", "messages": [{"role": "user", "content": "hello"}]});
    let (code, resp) = tokio::task::spawn_blocking(move || {
        common::http::curl(&[
            "-X",
            "POST",
            &format!("{base}/v1/chat/completions"),
            "-H",
            &format!("Authorization: Bearer {TEAM_A}"),
            "-H",
            "Content-Type: application/json",
            "-H",
            "Idempotency-Key: victim-b-1",
            "-H",
            "X-Lastcall-Deadline-Ms: 20000",
            "--data",
            &body.to_string(),
        ])
    })
    .await
    .unwrap();
    assert_eq!(code, 200, "{resp}");
    let v: serde_json::Value = serde_json::from_str(&resp).unwrap();
    let text = v["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(
        text.starts_with("sim output for team-a:victim-b-1 "),
        "team-a's own job answers, never team-b's: {text}"
    );
    let own = env.ledger.get("team-a:victim-b-1").await.unwrap().unwrap();
    assert_eq!(
        (own.tenant.as_str(), own.result.as_deref()),
        ("team-a", Some(text))
    );
    w.stop().await;
    env.cleanup().await;
}

/// Send `POST /v1/jobs` headers announcing a 1,000-byte body, then one byte a second;
/// return what the server answered (empty: nothing within 20 s) and when.
fn slow_body(base: &str, token: &str) -> (String, Duration) {
    let addr = base.trim_start_matches("http://");
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    write!(
        s,
        "POST /v1/jobs HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {token}\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
    )
    .unwrap();
    // The read timeout paces the sender: one byte per second, as the client of the issue.
    s.set_read_timeout(Some(Duration::from_secs(1))).unwrap();
    let started = Instant::now();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while started.elapsed() < Duration::from_secs(20) {
        let _ = s.write_all(b" ");
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                got.extend_from_slice(&buf[..n]);
                if got.windows(4).any(|w| w == b"\r\n\r\n") {
                    break;
                }
            }
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(_) => break,
        }
    }
    (
        String::from_utf8_lossy(&got).into_owned(),
        started.elapsed(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_sent_slowly_is_cut_at_the_read_timeout() {
    let env = Env::sqlite("door-tenancy-body").await;
    let (_serve, base) = serve(&env).await;
    for token in [TEAM_A, OPERATOR] {
        let base = base.clone();
        let (resp, after) = tokio::task::spawn_blocking(move || slow_body(&base, token))
            .await
            .unwrap();
        assert!(
            resp.starts_with("HTTP/1.1 408"),
            "still open after {after:?}: {resp:?}"
        );
        assert!(
            resp.contains("body_read_timeout")
                || resp.to_ascii_lowercase().contains("connection: close"),
            "{resp}"
        );
        assert!(
            after >= Duration::from_millis(9_500) && after < Duration::from_secs(15),
            "the default is 10 s: answered after {after:?}"
        );
    }
    env.cleanup().await;
}
