//! [`OpenAiBackend`]: the IO shell. Sends the request, decodes the stream, and races both
//! against the call's timeout and cancellation token.

use crate::classify;
use crate::config::{ConfigError, OpenAiConfig};
use crate::request::{chat_body, engine_priority};
use crate::sse::SseDecoder;
use crate::stream::{Assembly, Step};
use futures_util::StreamExt;
use lastcall_backend::{
    Backend, BackendError, CallFuture, CallOutput, CallRequest, CancellationToken, Deltas,
    LimitSink,
};
use reqwest::header::{ACCEPT, AUTHORIZATION, HeaderName, HeaderValue, RETRY_AFTER};
use std::time::Instant;
use tracing::Instrument;

/// How long to wait for the end of the body after `[DONE]`.
const DRAIN_AFTER_DONE: std::time::Duration = std::time::Duration::from_millis(200);

/// Longest error body read from a failed response.
const MAX_ERROR_BODY: usize = 16 * 1024;

/// A backend for any server that speaks OpenAI's streaming chat-completions API.
///
/// One instance is shared by all of a worker's slots; the HTTP client inside pools
/// connections of calls that finished normally.
///
/// **Invariant**: an abandoned call never leaves its connection open. When the timeout
/// passes or the token fires, the in-flight future is dropped, and with it the request or
/// the response body. hyper closes an HTTP/1 connection whose body was dropped before its
/// end instead of returning it to the pool (it could not be reused anyway), so the server
/// sees the disconnect and can stop generating. The integration test checks this against
/// a real llama.cpp server (`llama-server`) by what the server logged: the abandoned
/// request's task cancelled, and no generation of it that ran to its end
/// (`crates/openai/tests/llama_server.rs`).
pub struct OpenAiBackend {
    cfg: OpenAiConfig,
    client: reqwest::Client,
    /// `{base_url}/chat/completions`, built once.
    url: reqwest::Url,
    /// `Bearer …`, marked sensitive so that hyper never logs it.
    auth: Option<HeaderValue>,
    /// The header that carries the budget left ([`OpenAiConfig::budget_header`]).
    budget_header: Option<HeaderName>,
}

impl std::fmt::Debug for OpenAiBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OpenAiBackend")
            .field("cfg", &self.cfg)
            .finish_non_exhaustive()
    }
}

impl OpenAiBackend {
    pub fn new(cfg: OpenAiConfig) -> Result<Self, ConfigError> {
        let raw = cfg.chat_completions_url();
        let url = reqwest::Url::parse(&raw).map_err(|e| ConfigError::BaseUrl {
            url: cfg.base_url.clone(),
            message: e.to_string(),
        })?;
        match url.scheme() {
            // https: rustls is always built in (the platform's roots; SSL_CERT_FILE for a
            // private CA).
            "http" | "https" => {}
            other => {
                return Err(ConfigError::BaseUrl {
                    url: cfg.base_url.clone(),
                    message: format!("unsupported scheme {other}"),
                });
            }
        }
        let auth = match cfg.api_key() {
            Some(key) => {
                let mut v =
                    HeaderValue::from_str(&format!("Bearer {}", key.expose())).map_err(|_| {
                        ConfigError::Client("the API key is not a valid header value".into())
                    })?;
                v.set_sensitive(true);
                Some(v)
            }
            None => None,
        };
        let budget_header = match &cfg.budget_header {
            Some(name) => Some(
                HeaderName::from_bytes(name.trim().as_bytes())
                    .map_err(|_| ConfigError::BudgetHeader { name: name.clone() })?,
            ),
            None => None,
        };
        let client = reqwest::Client::builder()
            .connect_timeout(cfg.connect_timeout)
            .tcp_nodelay(true)
            .user_agent(concat!("lastcall/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| ConfigError::Client(e.to_string()))?;
        Ok(Self {
            cfg,
            client,
            url,
            auth,
            budget_header,
        })
    }

    pub fn config(&self) -> &OpenAiConfig {
        &self.cfg
    }

    /// The streamed chat-completions request for `body`; the budget left at `deadline`
    /// goes in the budget header when one is configured.
    fn post(&self, body: &serde_json::Value, deadline: Instant) -> reqwest::RequestBuilder {
        let mut request = self
            .client
            .post(self.url.clone())
            .header(ACCEPT, "text/event-stream")
            .json(body);
        if let Some(name) = &self.budget_header {
            let left = deadline
                .saturating_duration_since(Instant::now())
                .as_millis();
            request = request.header(name.clone(), left.to_string());
        }
        match &self.auth {
            Some(auth) => request.header(AUTHORIZATION, auth.clone()),
            None => request,
        }
    }

    /// The whole exchange, without the deadline: the caller races it against the timeout
    /// and the token and drops it when either wins.
    /// Each content chunk's text goes to `deltas` (until it says stop) as it arrives.
    async fn exchange(
        &self,
        body: serde_json::Value,
        started: Instant,
        deadline: Instant,
        mut deltas: Option<Deltas>,
        limits: Option<LimitSink>,
    ) -> Result<CallOutput, BackendError> {
        let response = match self.post(&body, deadline).send().await {
            Ok(response) => response,
            // A pooled connection that the server closed after its previous response:
            // llama.cpp's llama-server closes the connection after every streamed response,
            // without `Connection: close`, so hyper may write the next request on it before
            // the close arrives, and gets no byte of an answer. The server never read that
            // request: send it once more (hyper takes a new connection).
            Err(e) if closed_before_response(&e) => self
                .post(&body, deadline)
                .send()
                .await
                .map_err(send_error)?,
            Err(e) => return Err(send_error(e)),
        };
        let status = response.status();
        // What the server says of its rate limits, on successes and refusals alike.
        if let Some(sink) = &limits {
            let headers = response.headers();
            sink.send(crate::ratelimit::from_response(status.as_u16(), |name| {
                headers.get(name).and_then(|v| v.to_str().ok())
            }));
        }
        if !status.is_success() {
            let retry_after = response
                .headers()
                .get(RETRY_AFTER)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string);
            let body = read_capped(response, MAX_ERROR_BODY).await;
            return Err(classify::status_error(
                status.as_u16(),
                retry_after.as_deref(),
                &body,
            ));
        }

        let mut decoder = SseDecoder::new();
        let mut assembly = Assembly::default();
        let mut first_token: Option<Instant> = None;
        let mut stream = response.bytes_stream();
        'read: while let Some(bytes) = stream.next().await {
            let bytes = bytes.map_err(|e| stream_error(&e))?;
            let events = decoder.push(&bytes).map_err(|_| BackendError::Retryable {
                reason: "bad_stream".into(),
                message: "an event-stream line is longer than 4 MiB".into(),
                retry_after: None,
            })?;
            for data in events {
                let before = assembly.text.len();
                match assembly.on_event(&data)? {
                    Step::Content => {
                        first_token.get_or_insert_with(Instant::now);
                        if let Some(d) = &deltas
                            && !d.send(&assembly.text[before..])
                        {
                            deltas = None;
                        }
                    }
                    Step::Quiet => {}
                    Step::Done => break 'read,
                }
            }
        }
        if !assembly.done
            && let Some(data) = decoder.finish()
        {
            assembly.on_event(&data)?;
        }
        if assembly.done {
            // Read the (empty) rest of the body so that the connection goes back to the
            // pool; a server that keeps it open after [DONE] just loses it.
            let _ = tokio::time::timeout(DRAIN_AFTER_DONE, async {
                while let Some(Ok(_)) = stream.next().await {}
            })
            .await;
        }
        drop(stream);
        assembly.finish()?;

        let elapsed = started.elapsed();
        let (usage, estimated) = assembly.usage();
        let tokens_per_second = decode_speed(usage.completion_tokens, first_token, started);
        tracing::info!(
            latency_ms = elapsed.as_millis() as u64,
            ttft_ms = first_token.map(|t| (t - started).as_millis() as u64),
            prompt_tokens = usage.prompt_tokens,
            completion_tokens = usage.completion_tokens,
            usage_estimated = estimated,
            tokens_per_second,
            finish_reason = assembly.finish_reason.as_deref(),
            "model call finished"
        );
        Ok(CallOutput {
            text: assembly.text,
            usage: Some(usage),
            model: assembly.model.or_else(|| {
                body.get("model")
                    .and_then(|m| m.as_str())
                    .map(str::to_string)
            }),
            tokens_per_second,
        })
    }
}

impl Backend for OpenAiBackend {
    fn name(&self) -> &str {
        "openai"
    }

    /// Streams one chat completion. See [`chat_body`] for how the payload becomes the
    /// request, and [`Assembly::usage`](crate::stream::Assembly::usage) for how usage is
    /// estimated when the server reports none (llama-cpp-python's server, for one).
    /// Latency, time to first token and tokens/s are logged with the call's span.
    fn call(&self, req: CallRequest, cancel: CancellationToken) -> CallFuture<'_> {
        self.streamed(req, cancel, None, None)
    }

    /// [`call`](Backend::call), each content chunk's text forwarded as it arrives.
    fn call_streaming(
        &self,
        req: CallRequest,
        cancel: CancellationToken,
        deltas: Deltas,
    ) -> CallFuture<'_> {
        self.streamed(req, cancel, Some(deltas), None)
    }

    /// [`call`](Backend::call) or the streaming one, the response's `x-ratelimit-*`
    /// headers going to `limits` ([`crate::ratelimit`]).
    fn call_with(
        &self,
        req: CallRequest,
        cancel: CancellationToken,
        deltas: Option<Deltas>,
        limits: Option<LimitSink>,
    ) -> CallFuture<'_> {
        self.streamed(req, cancel, deltas, limits)
    }
}

impl OpenAiBackend {
    fn streamed(
        &self,
        req: CallRequest,
        cancel: CancellationToken,
        deltas: Option<Deltas>,
        limits: Option<LimitSink>,
    ) -> CallFuture<'_> {
        let span = tracing::info_span!(
            "openai_call",
            job_id = %req.job_id,
            kind = %req.kind,
            attempt = req.attempt,
        );
        Box::pin(
            async move {
                let mut body = chat_body(
                    &req.payload,
                    &self.cfg.model,
                    self.cfg.max_tokens,
                    self.cfg.max_tokens_limit,
                )?;
                if self.cfg.send_priority {
                    body["priority"] = engine_priority(req.priority).into();
                }
                let started = Instant::now();
                let deadline = started + req.timeout;
                let why = tokio::select! {
                    biased;
                    _ = cancel.cancelled() => "cancelled",
                    _ = tokio::time::sleep(req.timeout) => "timeout",
                    result = self.exchange(body, started, deadline, deltas, limits) => {
                        if let Err(e) = &result {
                            // The worker logs the failure (with the job) at `warn`.
                            tracing::debug!(
                                reason = e.reason(),
                                latency_ms = started.elapsed().as_millis() as u64,
                                error = ?e.to_string(),
                                "model call failed"
                            );
                        }
                        return result;
                    }
                };
                // The exchange future is dropped by now: the request or the response stream
                // is gone and its connection closed, so the stop is confirmed on our side.
                tracing::info!(
                    why,
                    after_ms = started.elapsed().as_millis() as u64,
                    "model call abandoned, connection closed"
                );
                Err(BackendError::Cancelled { confirmed: true })
            }
            .instrument(span),
        )
    }
}

/// Completion tokens per second of decoding: from the first content chunk to the end, so
/// that queueing and prompt processing do not count; over the whole call when there was
/// only one token.
fn decode_speed(tokens: u64, first_token: Option<Instant>, started: Instant) -> Option<f64> {
    if tokens == 0 {
        return None;
    }
    let (n, since) = match first_token {
        Some(t) if tokens > 1 => (tokens - 1, t),
        _ => (tokens, started),
    };
    let secs = since.elapsed().as_secs_f64();
    (secs > 0.0).then(|| n as f64 / secs)
}

/// Reads at most `cap` bytes of a body (an error body may be anything).
async fn read_capped(response: reqwest::Response, cap: usize) -> Vec<u8> {
    let mut out = Vec::new();
    let mut stream = response.bytes_stream();
    while let Some(Ok(bytes)) = stream.next().await {
        let room = cap - out.len();
        out.extend_from_slice(&bytes[..bytes.len().min(room)]);
        if out.len() >= cap {
            break;
        }
    }
    out
}

/// hyper's "connection closed before message completed" on sending: the connection (a
/// reused one: a new one would fail to connect instead) ended before any byte of the
/// response head.
fn closed_before_response(e: &reqwest::Error) -> bool {
    e.is_request()
        && !e.is_connect()
        && error_chain(e).contains("connection closed before message completed")
}

/// A failure before the response head: all retryable, the next attempt may find the
/// server up (or another replica behind the same address).
fn send_error(e: reqwest::Error) -> BackendError {
    let reason = if e.is_connect() {
        "connect_error"
    } else if e.is_timeout() {
        "timeout"
    } else {
        "http_error"
    };
    BackendError::Retryable {
        reason: reason.into(),
        message: error_chain(&e),
        retry_after: None,
    }
}

/// The connection broke in the middle of the stream.
fn stream_error(e: &reqwest::Error) -> BackendError {
    BackendError::Retryable {
        reason: "stream_broken".into(),
        message: error_chain(e),
        retry_after: None,
    }
}

/// `reqwest`'s message with its causes ("error sending request: … : connection refused").
fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut msg = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        msg.push_str(": ");
        msg.push_str(&s.to_string());
        source = s.source();
    }
    classify::truncate(&msg, 500)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn https_is_accepted_in_every_build_and_other_schemes_are_refused() {
        // TLS is no longer an opt-in feature: an https base URL builds a client.
        assert!(
            OpenAiBackend::new(OpenAiConfig::new("https://api.example.invalid/v1", "m")).is_ok()
        );
        assert!(OpenAiBackend::new(OpenAiConfig::new("http://127.0.0.1:8000/v1", "m")).is_ok());
        assert!(matches!(
            OpenAiBackend::new(OpenAiConfig::new("ftp://h/v1", "m")),
            Err(ConfigError::BaseUrl { .. })
        ));
        assert!(OpenAiBackend::new(OpenAiConfig::new("not a url", "m")).is_err());
    }

    #[test]
    fn decode_speed_skips_the_first_token() {
        let started = Instant::now() - Duration::from_secs(2);
        let first = Instant::now() - Duration::from_secs(1);
        let tps = decode_speed(11, Some(first), started).unwrap();
        assert!((9.0..=10.5).contains(&tps), "{tps}");
        assert_eq!(decode_speed(0, None, started), None);
    }
}
