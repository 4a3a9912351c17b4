//! The OpenAI backend against a real llama.cpp server (llama-cpp-python's, SmolLM2-135M).
//!
//! One test with sections, because the server handles one request at a time and starting
//! it costs seconds: the sections share one server and run in order.
//!
//! Setup: `scripts/llama-server.sh start PORT` on a free port, with `--api_key` so that the
//! key path is exercised too. The first run on a machine builds llama.cpp through pip
//! (~4 minutes); later runs reuse the venv and start in a few seconds. The test stops its
//! server when it ends, passed or failed (a drop guard runs `llama-server.sh stop PORT`).
//! If the server cannot be started the test FAILS, it does not skip.

use lastcall_backend::{Backend, BackendError, CallRequest, CancellationToken};
use lastcall_openai::{OpenAiBackend, OpenAiConfig};
use serde_json::{Value, json};
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const API_KEY: &str = "lastcall-test-key";
/// Tokens the abandoned generation asks for. At ~20-25 tokens/s (1 thread, 2-core
/// machine) that is ~40 s of work, far beyond the follow-up bound.
const ABANDONED_MAX_TOKENS: u64 = 1000;

fn script() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../scripts/llama-server.sh")
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .expect("bind an ephemeral port")
        .local_addr()
        .unwrap()
        .port()
}

/// A running server; stopped on drop, also when a section panics.
struct Server {
    port: u16,
    base_url: String,
}

impl Server {
    fn start() -> Self {
        let port = free_port();
        let started = Instant::now();
        let out = Command::new("bash")
            .arg(script())
            .args(["start", &port.to_string()])
            .env("LLAMA_SERVER_ARGS", format!("--api_key {API_KEY}"))
            .stdin(Stdio::null())
            .stderr(Stdio::inherit())
            .output()
            .expect("run scripts/llama-server.sh");
        if !out.status.success() {
            panic!(
                "could not start the llama.cpp server (scripts/llama-server.sh start {port} \
                 exited with {}). Run `scripts/llama-server.sh start 8080` from the repository \
                 root to see why: it needs python3 with venv and pip, a C++ compiler and cmake \
                 the first time (pip builds llama-cpp-python), and PyPI for the installs; then \
                 `scripts/llama-server.sh stop 8080`.",
                out.status
            );
        }
        let base_url = String::from_utf8_lossy(&out.stdout).trim().to_string();
        assert_eq!(base_url, format!("http://127.0.0.1:{port}/v1"));
        eprintln!("server up on port {port} after {:?}", started.elapsed());
        Server { port, base_url }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = Command::new("bash")
            .arg(script())
            .args(["stop", &self.port.to_string()])
            .stdin(Stdio::null())
            .status();
    }
}

fn key_file() -> PathBuf {
    let path =
        std::env::temp_dir().join(format!("lastcall-openai-test-key-{}", std::process::id()));
    std::fs::write(&path, format!("{API_KEY}\n")).unwrap();
    path
}

/// A generation that runs to `ABANDONED_MAX_TOKENS`: the end-of-turn token of SmolLM2
/// (id 2) is banned.
fn long_generation() -> Value {
    json!({
        "messages": [{"role": "user", "content": "Count from 1 to 1000, one number per line."}],
        "max_tokens": ABANDONED_MAX_TOKENS,
        "temperature": 0.0,
        "logit_bias": {"2": -100}
    })
}

/// Sends a tiny request right after an abandoned one and asserts that it was not stuck
/// behind it. The server handles one request at a time: had it kept generating the
/// abandoned completion, this one would wait for the rest of it.
async fn assert_server_stopped(
    backend: &OpenAiBackend,
    label: &str,
    tps: f64,
    abandoned_after: Duration,
) {
    let remaining_work =
        Duration::from_secs_f64(ABANDONED_MAX_TOKENS as f64 / tps).saturating_sub(abandoned_after);
    let t = Instant::now();
    let follow_up = backend
        .call(
            req(
                "follow-up",
                json!({"prompt": "Say yes.", "max_tokens": 4, "temperature": 0.0}),
                Duration::from_secs(120),
            ),
            CancellationToken::new(),
        )
        .await
        .expect("the follow-up completes");
    let took = t.elapsed();
    eprintln!(
        "{label}: abandoned after {abandoned_after:?} with ~{remaining_work:?} of work left; \
         the follow-up took {took:?} ({:?})",
        follow_up.text
    );
    assert!(
        remaining_work > Duration::from_secs(8),
        "the model is too fast for this check to mean anything: raise ABANDONED_MAX_TOKENS"
    );
    assert!(
        took < remaining_work / 3 && took < Duration::from_secs(10),
        "{label}: the follow-up took {took:?}: the server kept generating the abandoned \
         completion (~{remaining_work:?} of work left)"
    );
}

fn req(job_id: &str, payload: Value, timeout: Duration) -> CallRequest {
    CallRequest {
        job_id: job_id.into(),
        kind: "test.chat".into(),
        attempt: 0,
        payload: payload.as_object().cloned().unwrap(),
        timeout,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_backend_against_a_real_llama_cpp_server() {
    let server = Server::start();
    let key = key_file();
    let backend = OpenAiBackend::new(
        OpenAiConfig::new(&server.base_url, "smollm2")
            .api_key_from_file(&key)
            .unwrap(),
    )
    .unwrap();
    let _ = std::fs::remove_file(&key);
    assert!(!format!("{backend:?}").contains(API_KEY));

    // 1. A completion that fits its deadline.
    let t = Instant::now();
    let out = backend
        .call(
            req(
                "fits",
                json!({"messages": [{"role": "user", "content": "Say hello in five words."}],
                       "max_tokens": 24, "temperature": 0.0}),
                Duration::from_secs(60),
            ),
            CancellationToken::new(),
        )
        .await
        .expect("a short completion within 60 s");
    let took = t.elapsed();
    let usage = out.usage.expect("usage");
    let tps = out.tokens_per_second.expect("tokens per second");
    eprintln!(
        "fits: {took:?}, {} completion tokens, {tps:.1} tokens/s, text {:?}",
        usage.completion_tokens, out.text
    );
    assert!(!out.text.trim().is_empty());
    assert!(usage.completion_tokens > 0 && usage.completion_tokens <= 24);
    assert!(out.model.is_some());

    // 2. A deadline shorter than the generation: cancelled, and the server stops.
    let timeout = Duration::from_millis(500);
    let t = Instant::now();
    let r = backend
        .call(
            req("abandoned", long_generation(), timeout),
            CancellationToken::new(),
        )
        .await;
    let abandoned_after = t.elapsed();
    assert_eq!(r, Err(BackendError::Cancelled { confirmed: true }));
    assert!(
        abandoned_after < timeout + Duration::from_millis(300),
        "the call outlived its timeout: {abandoned_after:?}"
    );
    assert_server_stopped(&backend, "timeout", tps, abandoned_after).await;

    // 3. The cancellation token, fired before the first token, stops the server too.
    let cancel = CancellationToken::new();
    let c2 = cancel.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(50)).await;
        c2.cancel();
    });
    let t = Instant::now();
    let r = backend
        .call(
            req("cancelled", long_generation(), Duration::from_secs(120)),
            cancel,
        )
        .await;
    let cancelled_after = t.elapsed();
    assert_eq!(r, Err(BackendError::Cancelled { confirmed: true }));
    assert!(
        cancelled_after < Duration::from_millis(400),
        "{cancelled_after:?}"
    );
    assert_server_stopped(&backend, "token", tps, cancelled_after).await;

    // 4. 4xx answers are terminal and carry the server's message.
    let wrong_key = OpenAiBackend::new(OpenAiConfig::new(&server.base_url, "smollm2")).unwrap();
    let e = wrong_key
        .call(
            req(
                "no-key",
                json!({"prompt": "hi", "max_tokens": 2}),
                Duration::from_secs(10),
            ),
            CancellationToken::new(),
        )
        .await
        .unwrap_err();
    eprintln!("without the key: {e}");
    assert!(
        matches!(&e, BackendError::Terminal { reason, message }
        if reason == "http_401" && message.contains("API key")),
        "{e:?}"
    );
    let wrong_path = OpenAiBackend::new(OpenAiConfig::new(
        format!("http://127.0.0.1:{}/v2", server.port),
        "smollm2",
    ))
    .unwrap();
    let e = wrong_path
        .call(
            req("bad-path", json!({"prompt": "hi"}), Duration::from_secs(10)),
            CancellationToken::new(),
        )
        .await
        .unwrap_err();
    assert_eq!(e.reason(), "http_404", "{e:?}");
    assert!(!e.is_retryable());

    // 5. A server that is down: retryable connect_error, fast.
    let down = OpenAiBackend::new(OpenAiConfig::new(
        format!("http://127.0.0.1:{}/v1", free_port()),
        "smollm2",
    ))
    .unwrap();
    let t = Instant::now();
    let e = down
        .call(
            req("down", json!({"prompt": "hi"}), Duration::from_secs(10)),
            CancellationToken::new(),
        )
        .await
        .unwrap_err();
    eprintln!("down: {e} after {:?}", t.elapsed());
    assert!(matches!(&e, BackendError::Retryable { reason, .. } if reason == "connect_error"));
    assert!(t.elapsed() < Duration::from_secs(3));

    drop(server);
}
