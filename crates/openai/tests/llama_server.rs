//! The OpenAI backend against a real llama.cpp server (llama.cpp's C++ `llama-server`,
//! SmolLM2-135M, continuous batching over several slots).
//!
//! One test with sections, because starting the server costs seconds: the sections share
//! one server and run in order.
//!
//! Setup: `scripts/llama-server.sh start PORT` on a free port, with `--api-key` so that the
//! key path is exercised too. The first run on a machine builds llama-server from the
//! llama.cpp sources of the `llama-cpp-python` sdist on PyPI (a few minutes;
//! `scripts/test.sh` does it before the tests); later runs start it in a second or two. The
//! test stops its server when it ends, passed or failed (a drop guard runs
//! `llama-server.sh stop PORT`). If the server cannot be started the test FAILS, it does not
//! skip.
//!
//! Whether the server stopped an abandoned generation is read from the server's log, not
//! from how long the next request took: on a busy machine a tiny completion can take many
//! seconds, and wall time cannot tell that apart from a server that kept generating. See
//! [`assert_server_stopped`]. The only wall-time bounds left are on our own client's
//! latencies, and they are generous.

use lastcall_backend::{Backend, BackendError, CallRequest, CancellationToken};
use lastcall_openai::{OpenAiBackend, OpenAiConfig};
use serde_json::{Value, json};
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const API_KEY: &str = "lastcall-test-key";
/// Tokens the abandoned generation asks for. At the 40-200 tokens/s llama-server decodes
/// SmolLM2-135M on a busy 2-core machine that is 17-90 s of work, far beyond the moment it is
/// abandoned (checked after section 1). It fits a slot's context (4096 tokens by default).
const ABANDONED_MAX_TOKENS: u64 = 3500;
/// The deadline of the call abandoned in section 2.
const ABANDON_DEADLINE: Duration = Duration::from_secs(1);
/// Tokens of the follow-up request sent after each abandoned one.
const FOLLOW_UP_MAX_TOKENS: u64 = 4;
/// How much later than its deadline (or its token) an abandoned call may return. Our side
/// only drops a future, so this is scheduling delay on a loaded machine, with a wide
/// margin; the generation it abandons would need far longer (checked after section 1).
const CLIENT_SLACK: Duration = Duration::from_secs(4);
/// How long to wait for the server's log to show what it did with a request.
const LOG_DEADLINE: Duration = Duration::from_secs(30);

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
    log: ServerLog,
}

impl Server {
    fn start() -> Self {
        // scripts/test.sh runs the tests that need llama-server after its build, by name.
        let name = std::thread::current().name().unwrap_or_default().to_owned();
        assert!(
            name.contains("real_llama") || name == "main",
            "the test `{name}` starts llama-server, so its name must contain `real_llama`: \
             scripts/test.sh runs those tests after llama-server is built"
        );
        let port = free_port();
        let started = Instant::now();
        let out = Command::new("bash")
            .arg(script())
            .args(["start", &port.to_string()])
            // The slots' log lines (`processing task`, timings, `stop processing`) and the
            // cancels the checks read are llama-server's default (info) log level.
            .env("LLAMA_SERVER_ARGS", format!("--api-key {API_KEY}"))
            .stdin(Stdio::null())
            .stderr(Stdio::inherit())
            .output()
            .expect("run scripts/llama-server.sh");
        if !out.status.success() {
            panic!(
                "could not start the llama.cpp server (scripts/llama-server.sh start {port} \
                 exited with {}). Run `scripts/llama-server.sh start 8080` from the repository \
                 root to see why: the first time it builds llama-server, which needs python3 \
                 with venv and pip (cmake comes from PyPI), a C++ compiler, and PyPI for the \
                 llama-cpp-python sdist and the model; then `scripts/llama-server.sh stop 8080`.",
                out.status
            );
        }
        let base_url = String::from_utf8_lossy(&out.stdout).trim().to_string();
        let server = Server {
            port,
            base_url,
            log: ServerLog::of_port(port),
        };
        assert_eq!(server.base_url, format!("http://127.0.0.1:{port}/v1"));
        assert!(
            server.log.path.is_file(),
            "scripts/llama-server.sh logs to {} no more: update ServerLog::of_port",
            server.log.path.display()
        );
        eprintln!("server up on port {port} after {:?}", started.elapsed());
        server
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

/// The log `scripts/llama-server.sh` keeps for the server on a port (the server's stdout and
/// stderr, appended in the order they happen).
struct ServerLog {
    path: PathBuf,
}

impl ServerLog {
    /// `${LASTCALL_CACHE:-$HOME/.cache/lastcall}/llama-server-PORT.log`, as in the script.
    fn of_port(port: u16) -> Self {
        let cache = std::env::var_os("LASTCALL_CACHE")
            .filter(|c| !c.is_empty())
            .map(PathBuf::from)
            .unwrap_or_else(|| {
                PathBuf::from(std::env::var_os("HOME").expect("HOME")).join(".cache/lastcall")
            });
        ServerLog {
            path: cache.join(format!("llama-server-{port}.log")),
        }
    }

    /// Where the log ends now: what the server writes from here on is about what follows.
    fn end(&self) -> usize {
        std::fs::metadata(&self.path).map_or(0, |m| m.len() as usize)
    }

    /// The log from `offset` on.
    fn since(&self, offset: usize) -> String {
        let all = std::fs::read(&self.path).unwrap_or_default();
        String::from_utf8_lossy(all.get(offset..).unwrap_or_default()).into_owned()
    }

    /// Polls the log from `offset` until `done` holds for its events; panics after
    /// `LOG_DEADLINE`.
    async fn wait_for(
        &self,
        offset: usize,
        what: &str,
        done: impl Fn(&[LogEvent]) -> bool,
    ) -> (String, Vec<LogEvent>) {
        let deadline = Instant::now() + LOG_DEADLINE;
        loop {
            let text = self.since(offset);
            let events = log_events(&text);
            if done(&events) {
                return (text, events);
            }
            assert!(
                Instant::now() < deadline,
                "the server's log did not show {what} within {LOG_DEADLINE:?}; it has:\n{}",
                tail(&text)
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// What the server's log says about the tasks of its slots. A task is one completion
/// request; its id (`task N`) is in every line about it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LogEvent {
    /// `slot launch_slot_: id  0 | task N | processing task`: a slot took request N.
    Launched(u64),
    /// `srv          stop: cancel task, id_task = N`: the HTTP side saw the client of
    /// request N go away (or stop reading) and asked the slots to drop it.
    Cancelled(u64),
    /// `slot print_timing: id  0 | task N |        eval time = … ms /  K tokens`: the
    /// timings llama-server prints when a generation ends by itself (max_tokens or a stop),
    /// never for one that was cancelled: generation N ran to its end with K tokens.
    Finished { task: u64, tokens: u64 },
    /// `slot      release: id  0 | task N | stop processing: …`: the slot is free again,
    /// whether N ended by itself or was cancelled.
    Released(u64),
}

/// The events in a piece of the log, in order. Matches anywhere in the text rather than
/// line by line: stdout and stderr share the file, and a line from one may be cut by the
/// other.
fn log_events(text: &str) -> Vec<LogEvent> {
    fn number(s: &str) -> Option<u64> {
        let s = s.trim_start();
        let digits = s.len() - s.trim_start_matches(|c: char| c.is_ascii_digit()).len();
        s[..digits].parse().ok()
    }
    /// The task id of the slot line that `at` is in: `| task N |` before it on its line.
    fn task_before(text: &str, at: usize) -> Option<u64> {
        let line = text[..at].rsplit('\n').next().unwrap_or_default();
        let (_, after) = line.rsplit_once("| task ")?;
        number(after)
    }
    let mut found: Vec<(usize, LogEvent)> = Vec::new();
    for (at, _) in text.match_indices("| processing task") {
        if let Some(task) = task_before(text, at) {
            found.push((at, LogEvent::Launched(task)));
        }
    }
    for (at, m) in text.match_indices("cancel task, id_task = ") {
        if let Some(task) = number(&text[at + m.len()..]) {
            found.push((at, LogEvent::Cancelled(task)));
        }
    }
    for (at, _) in text.match_indices("| stop processing") {
        if let Some(task) = task_before(text, at) {
            found.push((at, LogEvent::Released(task)));
        }
    }
    for (at, m) in text.match_indices("eval time =") {
        if text[..at].ends_with("prompt ") {
            continue;
        }
        // `      56.00 ms /     3 tokens (…)`
        let line = text[at + m.len()..].lines().next().unwrap_or_default();
        if let (Some(task), Some((_, after))) = (task_before(text, at), line.split_once('/')) {
            let after = after.trim_start();
            if let Some(tokens) = number(after)
                && after
                    .trim_start_matches(|c: char| c.is_ascii_digit())
                    .trim_start()
                    .starts_with("tokens")
            {
                found.push((at, LogEvent::Finished { task, tokens }));
            }
        }
    }
    found.sort_by_key(|(at, _)| *at);
    found.into_iter().map(|(_, e)| e).collect()
}

/// The end of a log excerpt, for failure messages.
fn tail(text: &str) -> &str {
    let mut start = text.len().saturating_sub(6000);
    while !text.is_char_boundary(start) {
        start += 1;
    }
    &text[start..]
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

/// Checks, from the server's log, that the server stopped the generation of the request
/// abandoned after log offset `since`, and that it is free again.
///
/// A follow-up request is sent now; once it has finished and every task taken since
/// `since` has left its slot, the log from `since` on must show:
/// - exactly one generation that ran to its end, the follow-up's (at most
///   `FOLLOW_UP_MAX_TOKENS` tokens). Had the server kept generating the abandoned
///   completion, its timings would be there too, with `ABANDONED_MAX_TOKENS` tokens;
/// - a cancel for every other task a slot took: the abandoned request, if it reached a
///   slot at all. With `must_reach_server` it must have (the deadline case; a request
///   cancelled within milliseconds on a loaded machine may be gone before a slot takes it).
///
/// The server has several slots, so the follow-up does not wait for the abandoned
/// generation: the check waits for the abandoned task's `stop processing` in the log (at
/// most `LOG_DEADLINE`), which a server that kept generating would print only after its
/// ~`ABANDONED_MAX_TOKENS` tokens, with their timings first. The follow-up's wall time is
/// printed but is not the criterion: its 120 s bound only says that the server answers.
async fn assert_server_stopped(
    backend: &OpenAiBackend,
    log: &ServerLog,
    label: &str,
    since: usize,
    must_reach_server: bool,
) {
    let t = Instant::now();
    let follow_up = backend
        .call(
            req(
                "follow-up",
                json!({"prompt": "Say yes.", "max_tokens": FOLLOW_UP_MAX_TOKENS,
                       "temperature": 0.0}),
                Duration::from_secs(120),
            ),
            CancellationToken::new(),
        )
        .await;
    let took = t.elapsed();
    let follow_up = follow_up.unwrap_or_else(|e| {
        panic!(
            "{label}: the follow-up failed after {took:?}: {e}; the server's log since the \
             abandoned request:\n{}",
            tail(&log.since(since))
        )
    });
    let (text, events) = log
        .wait_for(
            since,
            "the follow-up's generation and every task since released",
            |events| {
                let follow_up_done = events.iter().any(
                    |e| matches!(e, LogEvent::Finished { tokens, .. } if *tokens <= FOLLOW_UP_MAX_TOKENS),
                );
                follow_up_done
                    && events.iter().all(|e| match e {
                        LogEvent::Launched(t) => events.contains(&LogEvent::Released(*t)),
                        _ => true,
                    })
            },
        )
        .await;
    let launched: Vec<u64> = events
        .iter()
        .filter_map(|e| match e {
            LogEvent::Launched(t) => Some(*t),
            _ => None,
        })
        .collect();
    let cancelled: Vec<u64> = events
        .iter()
        .filter_map(|e| match e {
            LogEvent::Cancelled(t) => Some(*t),
            _ => None,
        })
        .collect();
    let finished: Vec<(u64, u64)> = events
        .iter()
        .filter_map(|e| match e {
            LogEvent::Finished { task, tokens } => Some((*task, *tokens)),
            _ => None,
        })
        .collect();
    eprintln!(
        "{label}: server log since the abandoned request: tasks {launched:?} taken by slots, \
         cancels of {cancelled:?}, generations that ran to their end (task, tokens) \
         {finished:?}; the follow-up took {took:?} ({:?})",
        follow_up.text
    );
    assert!(
        finished.len() == 1 && finished[0].1 <= FOLLOW_UP_MAX_TOKENS,
        "{label}: the server ran {} generations to their end ({finished:?}), where only the \
         follow-up's should have: it kept generating the abandoned completion after its \
         client left. The server's log:\n{}",
        finished.len(),
        tail(&text)
    );
    let follow_up_task = finished[0].0;
    let abandoned: Vec<u64> = launched
        .iter()
        .copied()
        .filter(|t| *t != follow_up_task)
        .collect();
    assert!(
        abandoned.len() <= 1 && abandoned.iter().all(|t| cancelled.contains(t)),
        "{label}: expected the abandoned request's task to be cancelled and only the \
         follow-up served to its end; tasks {launched:?}, cancels of {cancelled:?}. The \
         server's log:\n{}",
        tail(&text)
    );
    assert!(
        !must_reach_server || abandoned.len() == 1,
        "{label}: the abandoned request never reached a slot, so this case proved nothing \
         about stopping a generation. The server's log:\n{}",
        tail(&text)
    );
}

fn req(job_id: &str, payload: Value, timeout: Duration) -> CallRequest {
    CallRequest {
        job_id: job_id.into(),
        kind: "test.chat".into(),
        attempt: 0,
        payload: payload.as_object().cloned().unwrap(),
        timeout,
        priority: lastcall_backend::Priority::Standard,
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
    // The server logs the timings of a generation that ran to its end, which the checks
    // below rely on.
    server
        .log
        .wait_for(0, "the timings of the first completion", |events| {
            events
                .iter()
                .any(|e| matches!(e, LogEvent::Finished { tokens, .. } if *tokens <= 24))
        })
        .await;

    // 1b. Calls back to back on one backend. llama-server closes the connection after
    // each streamed response (without `Connection: close`), so the next call may be
    // written on the pooled connection before the close arrives; the backend then sends it
    // again on a new one instead of failing with `http_error`. Without that, some of these
    // failed (as `bench goodput --openai-url` did in its first calls).
    for n in 0..8 {
        backend
            .call(
                req(
                    &format!("back-to-back-{n}"),
                    json!({"prompt": "Say yes.", "max_tokens": 2, "temperature": 0.0}),
                    Duration::from_secs(60),
                ),
                CancellationToken::new(),
            )
            .await
            .unwrap_or_else(|e| panic!("back-to-back call {n}: {e}"));
    }

    // How long the abandoned generation would take to run to its end: far longer than any
    // bound below, or those bounds could not tell "returned at its deadline" from
    // "returned after the generation".
    let full_generation = Duration::from_secs_f64(ABANDONED_MAX_TOKENS as f64 / tps);
    assert!(
        full_generation > 2 * (ABANDON_DEADLINE + CLIENT_SLACK),
        "the model is too fast for these checks to mean anything ({full_generation:?} for \
         {ABANDONED_MAX_TOKENS} tokens): raise ABANDONED_MAX_TOKENS"
    );

    // 2. A deadline shorter than the generation: cancelled, and the server stops.
    let timeout = ABANDON_DEADLINE;
    let since = server.log.end();
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
        abandoned_after >= timeout && abandoned_after < timeout + CLIENT_SLACK,
        "the call did not return at its timeout: {abandoned_after:?} (the whole generation \
         would take ~{full_generation:?})"
    );
    assert_server_stopped(&backend, &server.log, "timeout", since, true).await;

    // 3. The cancellation token, fired before the first token, stops the server too.
    let cancel = CancellationToken::new();
    let c2 = cancel.clone();
    let fire_after = Duration::from_millis(50);
    tokio::spawn(async move {
        tokio::time::sleep(fire_after).await;
        c2.cancel();
    });
    let since = server.log.end();
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
        cancelled_after < fire_after + CLIENT_SLACK,
        "the call did not return when its token fired: {cancelled_after:?} (the whole \
         generation would take ~{full_generation:?})"
    );
    assert_server_stopped(&backend, &server.log, "token", since, false).await;

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
    // llama-server says "Invalid API Key".
    assert!(
        matches!(&e, BackendError::Terminal { reason, message }
        if reason == "http_401" && message.to_lowercase().contains("api key")),
        "{e:?}"
    );
    // With the key: llama-server checks it before it routes, so a keyless request to a
    // wrong path is a 401 too.
    let key = key_file();
    let wrong_path = OpenAiBackend::new(
        OpenAiConfig::new(format!("http://127.0.0.1:{}/v2", server.port), "smollm2")
            .api_key_from_file(&key)
            .unwrap(),
    )
    .unwrap();
    let _ = std::fs::remove_file(&key);
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
    // Refused at once; the bound only has to stay clear of the call's 10 s timeout.
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());

    drop(server);
}
