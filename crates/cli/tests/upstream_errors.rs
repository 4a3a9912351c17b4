//! What a tenant reads of a failed model call (issue #48): the class of the failure
//! ("upstream returned HTTP 502"), never the upstream's own text, which names internal
//! hosts and URLs; the operator's log has that text, escaped (a newline in it cannot
//! start a forged log line). Real binaries: `serve` takes the job over HTTP, a worker
//! with the OpenAI-compatible backend calls a model server of this test's own that
//! answers 502 with such a body, and the tenant reads the job back over HTTP.

use crate::common;

use common::http::{Children, curl, post_job_with};
use common::*;
use std::process::Stdio;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const TOKEN: &str = "upstream-errors-token-0123456789";
/// Where the failing gateway lives, as its error page says.
const INTERNAL: &str = "10.9.8.7:8000/internal-gateway";
/// What follows a newline in the upstream's message: a forged log line if unescaped.
const FORGED: &str = "FORGED-LOG-LINE level=ERROR";

/// A model server that answers every request `502 Bad Gateway` with an OpenAI-style error
/// whose message names an internal URL and carries a newline.
async fn bad_gateway() -> (String, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}/v1", listener.local_addr().unwrap());
    let task = tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = listener.accept().await else {
                return;
            };
            tokio::spawn(async move {
                // The request: headers, then the body by its length.
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                loop {
                    let Ok(n) = s.read(&mut chunk).await else {
                        return;
                    };
                    if n == 0 {
                        return;
                    }
                    buf.extend_from_slice(&chunk[..n]);
                    let text = String::from_utf8_lossy(&buf).to_ascii_lowercase();
                    if let Some(end) = text.find("\r\n\r\n") {
                        let len = text[..end]
                            .lines()
                            .find_map(|l| l.strip_prefix("content-length:"))
                            .and_then(|v| v.trim().parse::<usize>().ok())
                            .unwrap_or(0);
                        if buf.len() >= end + 4 + len {
                            break;
                        }
                    }
                }
                let body = serde_json::json!({"error": {
                    "message": format!("bad gateway: http://{INTERNAL} refused\n{FORGED}")
                }})
                .to_string();
                let answer = format!(
                    "HTTP/1.1 502 Bad Gateway\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = s.write_all(answer.as_bytes()).await;
                let _ = s.shutdown().await;
            });
        }
    });
    (base, task)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_reads_the_class_of_an_upstream_failure_not_its_text() {
    let env = Env::sqlite("uperr").await;
    let (model, server) = bad_gateway().await;
    let port = common::private_rabbit::free_port();
    let base = format!("http://127.0.0.1:{port}");
    let worker_log = env.dir.join("worker.err");
    let serve = env
        .command()
        .args(["serve", "--addr", &format!("127.0.0.1:{port}")])
        .args(["--retry-delays-ms", "1000,5000", "--no-management"])
        .env("LASTCALL_HTTP_TOKEN", TOKEN)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let worker = env
        .command()
        .args(["worker", "--backend", "openai", "--base-url", &model])
        .args(["--max-attempts", "1", "--retry-delays-ms", "1000,5000"])
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&worker_log).unwrap())
        .spawn()
        .unwrap();
    let _children = Children(vec![serve, worker]);
    let until = Instant::now() + Duration::from_secs(30);
    while curl(&[&format!("{base}/readyz")]).0 != 200 {
        assert!(Instant::now() < until, "serve did not come up");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    let (code, resp) = post_job_with(
        &base,
        TOKEN,
        "up-502",
        60_000,
        r#"{"messages":[{"role":"user","content":"hi"}]}"#,
    );
    assert_eq!(code, 202, "{resp}");
    let rec = &env
        .wait_terminal(&["up-502".into()], Duration::from_secs(60))
        .await[0];
    assert_eq!(rec.state, "failed", "{rec:?}");
    assert_eq!(
        rec.error.as_deref(),
        Some("upstream returned HTTP 502"),
        "{rec:?}"
    );

    // What the tenant reads over HTTP: the class, no URL, no server text.
    let auth = format!("Authorization: Bearer {TOKEN}");
    let (code, view) = curl(&[&format!("{base}/v1/jobs/up-502"), "-H", &auth]);
    assert_eq!(code, 200, "{view}");
    assert!(view.contains("upstream returned HTTP 502"), "{view}");
    for leak in ["10.9.8.7", "internal-gateway", "FORGED", "bad gateway"] {
        assert!(!view.contains(leak), "the tenant reads `{leak}`: {view}");
    }

    // The operator's log has the upstream's words, escaped: the newline in them does not
    // start a line of its own.
    let log = std::fs::read_to_string(&worker_log).unwrap();
    assert!(
        log.contains(INTERNAL) && log.contains(FORGED),
        "the worker logs the upstream's text: {log}"
    );
    assert!(
        !log.lines().any(|l| l.starts_with("FORGED")),
        "an upstream newline forged a log line:\n{log}"
    );
    server.abort();
    env.cleanup().await;
}
