//! A fault-injecting OpenAI-compatible model server of the tests' own, over real HTTP:
//! `POST …/chat/completions` answered as its phase says (issue #32's upstream faults, #31's
//! call times that grow with the prompt and the batch).

use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// 150 ms calls (or [`Upstream::latency_ms`] when set), streamed with usage.
pub const HEALTHY: u8 = 0;
/// 503 without `Retry-After`.
pub const FAILING: u8 = 1;
/// Accepted and never answered (a stuck GPU).
pub const HANGING: u8 = 2;
/// 429 with `Retry-After: 2` (or [`Upstream::retry_after_s`] when set).
pub const LIMITED: u8 = 3;
/// 503 and 429 in turn, both with `Retry-After: 1`.
pub const BUSY: u8 = 4;
/// Healthy, but a call takes 50 ms + 2 ms per prompt word, × (1 + 0.15 per other call in
/// flight): prefill grows with the prompt, and calls slow each other down in a batch.
pub const BY_LENGTH: u8 = 5;
/// The request is read, then the connection is reset (no answer).
pub const RESET: u8 = 6;
/// Healthy, but the answer's first byte comes after 1.5 s.
pub const SLOW_FIRST_BYTE: u8 = 7;
/// Headers at once, then the stream's events 400 ms apart (2 s in all).
pub const SLOW_STREAM: u8 = 8;
/// `200 OK` with a stream whose event is not JSON.
pub const MALFORMED: u8 = 9;
/// A batching server with 4 batch places: a call takes 50 ms + 2 ms per prompt word, ×
/// (1 + 0.15 per other call in the batch), × n ÷ 4 past 4 calls in flight (n, itself
/// included, when it arrives): its throughput rises up to 4 calls at once, then is flat.
pub const BATCHING: u8 = 10;

/// The fault server's state: its phase, and what it saw.
#[derive(Default)]
pub struct Upstream {
    pub phase: AtomicU8,
    pub requests: AtomicU64,
    pub answered: AtomicU64,
    pub in_flight: AtomicU64,
    /// When each request arrived.
    pub arrivals: Mutex<Vec<Instant>>,
    /// Extra header lines (each ending in `\r\n`) sent with every answer, e.g. the
    /// `x-ratelimit-*` headers of a rate-limited server ([`Upstream::set_headers`]).
    pub headers: Mutex<String>,
    /// The `Retry-After` of [`LIMITED`], in seconds; 0: 2.
    pub retry_after_s: AtomicU64,
    /// How long a [`HEALTHY`] call takes, in ms; 0: 150.
    pub latency_ms: AtomicU64,
    /// Each request's first message content (the tests put the job id there) and its
    /// arrival, ms since the epoch: calls that reach the server after their job's
    /// deadline are counted here, at the server.
    pub seen: Mutex<Vec<(String, i64)>>,
    /// Each request's `model`, in arrival order.
    pub models: Mutex<Vec<String>>,
    /// Each request's header lines (lower case) and JSON body, in arrival order.
    pub requests_seen: Mutex<Vec<(String, serde_json::Value)>>,
    /// The `usage` object a healthy answer reports instead of its own (e.g. counts
    /// that overflow when summed).
    pub usage: Mutex<Option<String>>,
}

impl Upstream {
    /// Serve on a free local port; the base URL (`http://127.0.0.1:PORT/v1`) and the task
    /// (abort it to stop).
    pub async fn start(self: &Arc<Self>) -> (String, tokio::task::JoinHandle<()>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}/v1", listener.local_addr().unwrap());
        (base, tokio::spawn(serve(listener, self.clone())))
    }

    pub fn set(&self, phase: u8) {
        self.phase.store(phase, Ordering::SeqCst);
    }

    /// Send these headers (`name: value` pairs) with every answer from now on.
    pub fn set_headers(&self, headers: &[(&str, &str)]) {
        let lines: String = (headers.iter())
            .map(|(n, v)| format!("{n}: {v}\r\n"))
            .collect();
        *self.headers.lock().unwrap() = lines;
    }

    /// OpenAI's request-limit headers: `limit` per minute, `remaining` until `reset`.
    pub fn set_request_limit(&self, limit: u64, remaining: u64, reset: &str) {
        let (limit, remaining) = (limit.to_string(), remaining.to_string());
        self.set_headers(&[
            ("x-ratelimit-limit-requests", &limit),
            ("x-ratelimit-remaining-requests", &remaining),
            ("x-ratelimit-reset-requests", reset),
        ]);
    }
}

async fn serve(listener: TcpListener, up: Arc<Upstream>) {
    loop {
        let Ok((sock, _)) = listener.accept().await else {
            return;
        };
        let up = up.clone();
        tokio::spawn(async move {
            let _ = answer(sock, &up).await;
        });
    }
}

/// Read one request (headers and a `Content-Length` body), then answer it.
async fn answer(mut sock: TcpStream, up: &Upstream) -> std::io::Result<()> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let (head_len, body_len) = loop {
        let n = sock.read(&mut chunk).await?;
        if n == 0 {
            return Ok(());
        }
        buf.extend_from_slice(&chunk[..n]);
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
            let len: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(0);
            break (end + 4, len);
        }
    };
    while buf.len() < head_len + body_len {
        let n = sock.read(&mut chunk).await?;
        if n == 0 {
            return Ok(());
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    // What this request gets is decided before it is counted: a test that changes the
    // phase once it sees the count must not change this request's answer.
    let phase = up.phase.load(Ordering::SeqCst);
    let headers = up.headers.lock().unwrap().clone();
    let n = up.requests.fetch_add(1, Ordering::SeqCst);
    up.arrivals.lock().unwrap().push(Instant::now());
    let wall_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64;
    up.seen
        .lock()
        .unwrap()
        .push((first_content(&buf[head_len..]), wall_ms));
    up.models.lock().unwrap().push(model_of(&buf[head_len..]));
    up.requests_seen.lock().unwrap().push((
        String::from_utf8_lossy(&buf[..head_len]).to_ascii_lowercase(),
        serde_json::from_slice(&buf[head_len..]).unwrap_or_default(),
    ));
    let error = |status: u16, text: &str, extra: &str| {
        let body = r#"{"error":{"message":"the model is busy"}}"#;
        format!(
            "HTTP/1.1 {status} {text}\r\nContent-Type: application/json\r\n{extra}{headers}Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
    };
    match phase {
        FAILING => {
            let resp = error(503, "Service Unavailable", "");
            sock.write_all(resp.as_bytes()).await?;
        }
        LIMITED => {
            let secs = match up.retry_after_s.load(Ordering::SeqCst) {
                0 => 2,
                s => s,
            };
            let resp = error(
                429,
                "Too Many Requests",
                &format!("Retry-After: {secs}\r\n"),
            );
            sock.write_all(resp.as_bytes()).await?;
        }
        BUSY => {
            let resp = match n % 2 {
                0 => error(503, "Service Unavailable", "Retry-After: 1\r\n"),
                _ => error(429, "Too Many Requests", "Retry-After: 1\r\n"),
            };
            sock.write_all(resp.as_bytes()).await?;
        }
        RESET => {
            // SO_LINGER 0: closing sends a reset, not a clean end. (Deprecated because a
            // non-zero linger blocks the thread on drop; a zero one never waits.)
            #[allow(deprecated)]
            sock.set_linger(Some(Duration::ZERO))?;
            drop(sock);
            return Ok(());
        }
        MALFORMED => {
            let body = "data: {\"id\": \"c\", \"choices\": [\n\ndata: [DONE]\n\n";
            let resp = format!(
                "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n{headers}Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
            sock.write_all(resp.as_bytes()).await?;
        }
        SLOW_STREAM => {
            let head = format!(
                "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n{headers}Connection: close\r\n\r\n"
            );
            sock.write_all(head.as_bytes()).await?;
            for _ in 0..4 {
                tokio::time::sleep(Duration::from_millis(400)).await;
                sock.write_all(format!("data: {CHUNK}\n\n").as_bytes())
                    .await?;
            }
            tokio::time::sleep(Duration::from_millis(400)).await;
            sock.write_all(format!("data: {LAST}\n\ndata: [DONE]\n\n").as_bytes())
                .await?;
            up.answered.fetch_add(1, Ordering::SeqCst);
        }
        HANGING => {
            // Accepted and never answered; the connection stays open until the client
            // gives up (cancellation at the deadline closes it).
            let mut sink = [0u8; 64];
            while sock.read(&mut sink).await? > 0 {}
        }
        phase => {
            // The servers whose call time grows with the prompt count it as a server does
            // (a token a word, and 8 for the chat template); the others report 5.
            let last = if phase == BY_LENGTH || phase == BATCHING {
                let words = prompt_words(&buf[head_len..]);
                LAST.replace(
                    r#""prompt_tokens":5,"completion_tokens":1,"total_tokens":6"#,
                    &format!(
                        r#""prompt_tokens":{},"completion_tokens":1,"total_tokens":{}"#,
                        words + 8,
                        words + 9
                    ),
                )
            } else {
                LAST.to_owned()
            };
            let last = match up.usage.lock().unwrap().as_deref() {
                Some(usage) => last.replace(
                    r#"{"prompt_tokens":5,"completion_tokens":1,"total_tokens":6}"#,
                    usage,
                ),
                None => last,
            };
            let ms = if phase == BY_LENGTH {
                let words = prompt_words(&buf[head_len..]);
                let others = up.in_flight.fetch_add(1, Ordering::SeqCst);
                (50.0 + 2.0 * words as f64) * (1.0 + 0.15 * others as f64)
            } else if phase == BATCHING {
                let words = prompt_words(&buf[head_len..]);
                let n = (up.in_flight.fetch_add(1, Ordering::SeqCst) + 1) as f64;
                let k = 4.0;
                (50.0 + 2.0 * words as f64) * (1.0 + 0.15 * (n.min(k) - 1.0)) * (n / k).max(1.0)
            } else if phase == SLOW_FIRST_BYTE {
                1_500.0
            } else {
                match up.latency_ms.load(Ordering::SeqCst) {
                    0 => 150.0,
                    ms => ms as f64,
                }
            };
            tokio::time::sleep(Duration::from_millis(ms as u64)).await;
            if phase == BY_LENGTH || phase == BATCHING {
                up.in_flight.fetch_sub(1, Ordering::SeqCst);
            }
            let body = format!("data: {CHUNK}\n\ndata: {last}\n\ndata: [DONE]\n\n");
            let resp = format!(
                "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n{headers}Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
            sock.write_all(resp.as_bytes()).await?;
            up.answered.fetch_add(1, Ordering::SeqCst);
        }
    }
    sock.shutdown().await
}

const CHUNK: &str = r#"{"id":"c","object":"chat.completion.chunk","model":"m","choices":[{"index":0,"delta":{"content":"ok"},"finish_reason":null}]}"#;
const LAST: &str = r#"{"id":"c","object":"chat.completion.chunk","model":"m","choices":[{"index":0,"delta":{},"finish_reason":"stop"}],"usage":{"prompt_tokens":5,"completion_tokens":1,"total_tokens":6}}"#;

/// A chat request's first message content.
fn first_content(body: &[u8]) -> String {
    let v: serde_json::Value = serde_json::from_slice(body).unwrap_or_default();
    v["messages"][0]["content"]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

/// A chat request's `model`.
fn model_of(body: &[u8]) -> String {
    let v: serde_json::Value = serde_json::from_slice(body).unwrap_or_default();
    v["model"].as_str().unwrap_or_default().to_owned()
}

/// The words of a chat request's messages.
fn prompt_words(body: &[u8]) -> usize {
    let v: serde_json::Value = serde_json::from_slice(body).unwrap_or_default();
    (v["messages"].as_array().into_iter().flatten())
        .filter_map(|m| m["content"].as_str())
        .map(|c| c.split_whitespace().count())
        .sum()
}

/// Poll `f` until it holds, or fail after `within`.
pub async fn until(what: &str, within: Duration, mut f: impl FnMut() -> bool) {
    let end = Instant::now() + within;
    while !f() {
        assert!(Instant::now() < end, "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Submit `n` jobs `{tag}-{i}` with `budget_ms` each, at once; their ids.
pub async fn submit_all(
    s: &lastcall_worker::Submitter,
    tag: &str,
    n: usize,
    budget_ms: u64,
) -> Vec<String> {
    let mut ids = Vec::new();
    for i in 0..n {
        let id = format!("{tag}-{i}");
        s.submit(
            &super::job(&id, budget_ms),
            lastcall_worker::clock::now_ms(),
        )
        .await
        .unwrap();
        ids.push(id);
    }
    ids
}

/// The OpenAI-compatible backend on a fault server's base URL (model `m`).
pub fn openai(base: &str) -> Arc<dyn lastcall_backend::Backend> {
    Arc::new(
        lastcall_openai::OpenAiBackend::new(lastcall_openai::OpenAiConfig::new(base, "m")).unwrap(),
    )
}
