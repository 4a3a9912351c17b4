//! `stream: true` on the front door: server-sent events in OpenAI's
//! `chat.completion.chunk` format, fed by the worker's token deltas (direct reply-to,
//! docs/wire-format.md §10) and completed from the ledger.
//!
//! - Nothing is sent before the first delta or the outcome: an outcome that comes first
//!   and is not `completed` gets the non-streaming answer's status and body (`504`
//!   `deadline_expired`, `409` `cancelled`, …); `completed` gets the whole stream.
//! - Then `200 text/event-stream`: a chunk with `delta.role`, a chunk per delta, a final
//!   chunk with `finish_reason` (and one with `usage` when `stream_options.include_usage`),
//!   then `data: [DONE]`.
//! - The ledger's result is the truth: deltas are forwarded only while they arrive in
//!   order ([`StreamText`]); at the outcome, once the call's end marker arrived (or 500 ms
//!   passed), whatever the deltas missed is sent as one more chunk, so the text streamed
//!   always equals the ledger's result.
//! - An outcome that is not `completed` after the first byte, or a result that does not
//!   start with the text already sent (a retry produced other text), ends the stream with
//!   an error event `data: {"error": {"message", "type", "param", "code"}}` (type and
//!   code as the non-streaming answer's) and no `[DONE]`; the official SDKs raise it as
//!   an `APIError`.
//! - A client that disconnects mid-stream drops the body, and with it the guard that
//!   cancels the job (as before the first byte).

use crate::AppState;
use crate::front_door::{CancelOnDrop, answer, error_kind, oa_error};
use crate::jobs::read_job;
use crate::waiters::Waiter;
use axum::body::{Body, Bytes};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use lastcall_broker::ReplyChannel;
use lastcall_core::delta::{Delta, StreamText};
use lastcall_store::JobRecord;
use serde_json::{Value, json};
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

/// How long the outcome waits for the call's end marker (deltas still on their way).
const END_WAIT: Duration = Duration::from_millis(500);
/// An SSE comment after this long without a chunk: keeps proxies open and finds a
/// departed client.
const KEEP_ALIVE: Duration = Duration::from_secs(15);

/// Everything one streaming response owns; dropping it (the client went away) drops the
/// guard, which cancels the job unless the outcome was sent.
pub(crate) struct Streaming {
    pub state: Arc<AppState>,
    pub waiter: Waiter,
    pub guard: CancelOnDrop,
    pub reply: Option<ReplyChannel>,
    pub id: String,
    pub model: String,
    pub created_s: i64,
    pub include_usage: bool,
    /// When the outcome must be in (the deadline + 5 s).
    pub until: Instant,
    pub text: StreamText,
    pending: VecDeque<Bytes>,
    done: bool,
}

enum Step {
    /// Forward this text.
    Text(String),
    /// Nothing to forward (an out-of-order or foreign delta; the reply channel closed).
    Nothing,
    /// Woken, or the time is up (`false`): read the ledger.
    Read(bool),
    KeepAlive,
}

impl Streaming {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        state: Arc<AppState>,
        waiter: Waiter,
        guard: CancelOnDrop,
        reply: ReplyChannel,
        id: String,
        model: String,
        created_s: i64,
        include_usage: bool,
        until: Instant,
    ) -> Self {
        Self {
            state,
            waiter,
            guard,
            reply: Some(reply),
            id,
            model,
            created_s,
            include_usage,
            until,
            text: StreamText::new(),
            pending: VecDeque::new(),
            done: false,
        }
    }

    /// The next delta, wake or keep-alive.
    async fn step(&mut self, keep_alive: bool) -> Step {
        enum Raw {
            Body(Option<Vec<u8>>),
            Woken(bool),
            KeepAlive,
        }
        let raw = {
            let reply = async {
                match self.reply.as_mut() {
                    Some(r) => r.next().await,
                    None => std::future::pending().await,
                }
            };
            let ka = async {
                if keep_alive {
                    tokio::time::sleep(KEEP_ALIVE).await
                } else {
                    std::future::pending().await
                }
            };
            tokio::select! {
                body = reply => Raw::Body(body),
                woken = self.waiter.wait(self.until) => Raw::Woken(woken),
                () = ka => Raw::KeepAlive,
            }
        };
        match raw {
            Raw::Body(Some(body)) => {
                match Delta::from_json(&body).filter(|d| d.job_id == self.id) {
                    Some(d) => self.text.on_delta(&d).map_or(Step::Nothing, Step::Text),
                    None => Step::Nothing,
                }
            }
            Raw::Body(None) => {
                self.reply = None;
                Step::Nothing
            }
            Raw::Woken(woken) => Step::Read(woken),
            Raw::KeepAlive => Step::KeepAlive,
        }
    }

    /// Before the first byte: the response to send — an error answer (the outcome came
    /// first and is not `completed`), or the stream.
    pub async fn respond(mut self) -> Response {
        loop {
            let rec = match self.step(false).await {
                Step::Text(t) => {
                    self.pending
                        .push_back(self.chunk(json!({"role": "assistant", "content": ""}), None));
                    self.pending.push_back(self.content(&t));
                    break;
                }
                Step::Nothing | Step::KeepAlive => continue,
                Step::Read(woken) => match read_job(&self.state, &self.id).await {
                    Ok(rec) => (rec, woken),
                    Err(e) => return crate::front_door::from_api_error(e),
                },
            };
            match rec {
                (Some(rec), _) if rec.is_terminal() && rec.state != "completed" => {
                    self.guard.armed = false;
                    return answer(&rec, &self.model, self.created_s * 1000);
                }
                (Some(rec), _) if rec.is_terminal() => {
                    self.pending
                        .push_back(self.chunk(json!({"role": "assistant", "content": ""}), None));
                    self.finish(Some(rec)).await;
                    break;
                }
                (_, false) => {
                    self.guard.armed = false;
                    return no_outcome(&self.id);
                }
                _ => continue,
            }
        }
        let id = self.id.clone();
        let mut r = Body::from_stream(futures_util::stream::unfold(self, |mut s| async move {
            s.next_bytes()
                .await
                .map(|b| (Ok::<_, std::convert::Infallible>(b), s))
        }))
        .into_response();
        let h = r.headers_mut();
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/event-stream"),
        );
        h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
        if let Ok(v) = HeaderValue::from_str(&id) {
            h.insert("x-lastcall-job-id", v);
        }
        r
    }

    async fn next_bytes(&mut self) -> Option<Bytes> {
        loop {
            if let Some(b) = self.pending.pop_front() {
                return Some(b);
            }
            if self.done {
                return None;
            }
            match self.step(true).await {
                Step::Text(t) => self.pending.push_back(self.content(&t)),
                Step::Nothing => {}
                Step::KeepAlive => self
                    .pending
                    .push_back(Bytes::from_static(b": keep-alive\n\n")),
                Step::Read(woken) => {
                    let rec = read_job(&self.state, &self.id).await;
                    match rec {
                        Ok(Some(rec)) if rec.is_terminal() => self.finish(Some(rec)).await,
                        Ok(_) if woken => {}
                        Ok(_) => self.finish(None).await,
                        Err(e) => {
                            let ev = error_event("server_error", e.code(), &e.to_string());
                            self.pending.push_back(ev);
                            self.done = true;
                        }
                    }
                }
            }
        }
    }

    /// The outcome is known (`None`: none by the deadline + 5 s): wait briefly for the
    /// deltas still on their way, then the rest of the text and the end, or an error event.
    async fn finish(&mut self, rec: Option<JobRecord>) {
        let end_by = Instant::now() + END_WAIT;
        while self.reply.is_some() && self.text.is_live() && !self.text.sent.is_empty() {
            let body = tokio::select! {
                b = async { self.reply.as_mut()?.next().await } => b,
                () = tokio::time::sleep_until(end_by) => break,
            };
            let Some(body) = body else { break };
            if let Some(d) = Delta::from_json(&body).filter(|d| d.job_id == self.id)
                && let Some(t) = self.text.on_delta(&d)
            {
                self.pending.push_back(self.content(&t));
            }
        }
        self.done = true;
        self.guard.armed = false;
        self.reply = None;
        let Some(rec) = rec else {
            let msg = format!(
                "job `{}` has no outcome yet after its deadline; `GET /v1/jobs/{}` shows it later",
                self.id, self.id
            );
            self.pending
                .push_back(error_event("deadline_expired", "no_outcome", &msg));
            return;
        };
        let reason = rec.reason.as_deref().unwrap_or(&rec.state);
        if rec.state != "completed" {
            let msg = format!(
                "job `{}` ended {} ({reason}) after streaming began: {}",
                rec.job_id,
                rec.state,
                rec.error.as_deref().unwrap_or("")
            );
            self.pending
                .push_back(error_event(error_kind(&rec.state), reason, &msg));
            return;
        }
        let result = rec.result.clone().unwrap_or_default();
        match self.text.finish(&result) {
            Ok(rest) => {
                if !rest.is_empty() {
                    let c = self.content(rest);
                    self.pending.push_back(c);
                }
                let fin = self.chunk(json!({}), Some("stop"));
                self.pending.push_back(fin);
                if self.include_usage {
                    let usage = crate::front_door::usage(&rec);
                    let mut v = self.base();
                    v["choices"] = json!([]);
                    v["usage"] = usage;
                    self.pending.push_back(sse(&v));
                }
                self.pending
                    .push_back(Bytes::from_static(b"data: [DONE]\n\n"));
            }
            Err(_) => {
                let msg = format!(
                    "job `{}` completed, but its result does not continue the text already streamed (the call was retried after streaming began); `GET /v1/jobs/{}` has the result",
                    rec.job_id, rec.job_id
                );
                self.pending
                    .push_back(error_event("server_error", "stream_diverged", &msg));
            }
        }
    }

    fn base(&self) -> Value {
        json!({
            "id": format!("chatcmpl-{}", self.id),
            "object": "chat.completion.chunk",
            "created": self.created_s,
            "model": self.model,
        })
    }

    fn chunk(&self, delta: Value, finish_reason: Option<&str>) -> Bytes {
        let mut v = self.base();
        v["choices"] = json!([{"index": 0, "delta": delta, "finish_reason": finish_reason}]);
        sse(&v)
    }

    fn content(&self, text: &str) -> Bytes {
        self.chunk(json!({"content": text}), None)
    }
}

fn sse(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}

/// OpenAI's in-stream error: `data: {"error": {…}}`.
fn error_event(kind: &str, code: &str, message: &str) -> Bytes {
    sse(&json!({"error": {"message": message, "type": kind, "param": null, "code": code}}))
}

fn no_outcome(id: &str) -> Response {
    oa_error(
        StatusCode::GATEWAY_TIMEOUT,
        "deadline_expired",
        Some("no_outcome"),
        None,
        format!(
            "job `{id}` has no outcome yet after its deadline; `GET /v1/jobs/{id}` shows it later"
        ),
    )
}
