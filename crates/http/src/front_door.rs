//! The OpenAI-compatible front door: `POST /v1/chat/completions` and `GET /v1/models`.
//!
//! A chat request becomes a job with a deadline, goes through the broker to the workers
//! under every rule of lastcall (the last admission check, the ledger, one outcome), and
//! its outcome comes back in OpenAI's format:
//! - `model` names a job kind through `serve --model NAME=KIND` (any model maps to kind
//!   `chat` when none is given); an unknown model is a `404 model_not_found`;
//! - the deadline: `X-Lastcall-Deadline-Ms` (a budget) or `X-Lastcall-Expires-At-Ms`
//!   (absolute), else the client's own timeout that the official SDKs send with every
//!   request (`X-Stainless-Read-Timeout` from Python, `X-Stainless-Timeout` from Node, in
//!   seconds), else `serve --default-deadline-ms`;
//! - `Idempotency-Key` becomes the job id, so a client's retry never queues a second job;
//! - the request is held for its outcome until the deadline + 5 s, at most
//!   [`FrontDoor::max_hold_ms`] (`serve --max-hold-ms`): then `504 hold_exceeded`, and the
//!   job goes on;
//! - the answer: `completed` → a `chat.completion` with `usage`; the expired states and
//!   `deadline_exceeded` → `504` (`type` `deadline_expired` / `deadline_exceeded`, `code` the
//!   lastcall reason) with `x-should-retry: false` (a retry inside the same timeout cannot
//!   cure a deadline); shed → `429` with `Retry-After`, `x-should-retry` true only when it
//!   still fits the budget; `failed` → `502`; `rejected` → `400`; `cancelled` → `409` (with
//!   `x-should-retry: false`). Headers `x-lastcall-job-id` and `x-lastcall-state` name the job and its outcome;
//! - a client that disconnects before the answer cancels its job (never started if it had
//!   not, aborted if it had): the handler is dropped, and its guard runs
//!   `lastcall_producer::cancel`.
//!
//! - `"stream": true` answers with server-sent events (`front_door_stream.rs`).
//! - the tenant: a token of the tokens file stamps its own tenant, and may
//!   submit only the kinds its entry allows; the operator's token may name one in
//!   `X-Lastcall-Tenant` (else `default`). `X-Lastcall-Priority` sets the tier. The OpenAI
//!   `user` field stays in the payload for the model, and is never taken as a tenant. The
//!   tenant's quotas apply as on `POST /v1/jobs` (`429` `over_quota`, `Retry-After`).

use crate::AppState;
use crate::auth::Caller;
use crate::error::{ApiError, MIN_BUDGET_HEADER};
use crate::jobs::{read_job, submit_error};
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use lastcall_producer::{DeadlineSpec, NewJob, Submission, SubmitError};
use lastcall_store::JobRecord;
use serde_json::{Value, json};
use std::sync::Arc;
use std::time::Duration;

/// What `serve` was told about the front door.
#[derive(Debug, Clone)]
pub struct FrontDoor {
    /// `model` name → job kind; empty: every model maps to [`FrontDoor::DEFAULT_KIND`].
    pub models: Vec<(String, String)>,
    /// The budget of a request that states none (no header, no SDK timeout).
    pub default_deadline_ms: u64,
    /// The longest a request is held waiting for its outcome (`serve --max-hold-ms`), however
    /// far its deadline: past it the answer is `504 hold_exceeded` and the job goes on.
    pub max_hold_ms: u64,
}

impl Default for FrontDoor {
    fn default() -> Self {
        Self {
            models: Vec::new(),
            default_deadline_ms: 60_000,
            max_hold_ms: Self::MAX_HOLD_MS,
        }
    }
}

impl FrontDoor {
    /// The longest hold by default: 15 minutes (the OpenAI SDKs' own default timeout is
    /// 10 minutes), not the 24 h horizon a deadline may reach.
    pub const MAX_HOLD_MS: u64 = 900_000;

    /// The kind every model maps to when no `--model` mapping is given.
    pub const DEFAULT_KIND: &'static str = "chat";

    /// Parse `--model NAME=KIND` entries.
    pub fn parse_models(entries: &[String]) -> Result<Vec<(String, String)>, String> {
        entries
            .iter()
            .map(|e| match e.split_once('=') {
                Some((name, kind)) if !name.is_empty() && !kind.is_empty() => {
                    lastcall_core::Kind::parse(kind)
                        .map_err(|err| format!("--model `{e}`: the kind {}", err.0))?;
                    Ok((name.to_owned(), kind.to_owned()))
                }
                _ => Err(format!(
                    "--model `{e}` must be NAME=KIND, e.g. smollm2=chat"
                )),
            })
            .collect()
    }

    pub(crate) fn kind_for(&self, model: &str) -> Option<String> {
        if self.models.is_empty() {
            return Some(Self::DEFAULT_KIND.to_owned());
        }
        self.models
            .iter()
            .find(|(name, _)| name == model)
            .map(|(_, kind)| kind.clone())
    }
}

/// An error in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.
pub(crate) fn oa_error(
    status: StatusCode,
    kind: &str,
    code: Option<&str>,
    param: Option<&str>,
    message: impl Into<String>,
) -> Response {
    oa_error_with_budget(status, kind, code, param, message, None)
}

/// [`oa_error`] with, beside `code`, the budget that would have been admitted
/// (`min_feasible_budget_ms`, also as the [`MIN_BUDGET_HEADER`]) when there is one.
pub(crate) fn oa_error_with_budget(
    status: StatusCode,
    kind: &str,
    code: Option<&str>,
    param: Option<&str>,
    message: impl Into<String>,
    min_feasible_budget_ms: Option<u64>,
) -> Response {
    let mut error = json!({
        "message": message.into(),
        "type": kind,
        "param": param,
        "code": code,
    });
    if let Some(ms) = min_feasible_budget_ms {
        error["min_feasible_budget_ms"] = json!(ms);
    }
    let mut r = (status, Json(json!({ "error": error }))).into_response();
    if let Some(ms) = min_feasible_budget_ms {
        r.headers_mut()
            .insert(MIN_BUDGET_HEADER, HeaderValue::from(ms));
    }
    r
}

/// A lastcall refusal (validation, shedding, the broker) in OpenAI's shape.
pub(crate) fn from_api_error(e: ApiError) -> Response {
    let status = e.status();
    let kind = match status {
        StatusCode::TOO_MANY_REQUESTS => "rate_limit_exceeded",
        s if s.is_server_error() => "server_error",
        _ => "invalid_request_error",
    };
    let retry_after = match &e {
        ApiError::WouldExpireInQueue { retry_after_s, .. } => Some(*retry_after_s),
        ApiError::OverQuota(r) => Some(r.retry_after_s),
        ApiError::UpstreamUnavailable { retry_after_s, .. } => Some(*retry_after_s),
        ApiError::TooManyWaiting | ApiError::TenantLimit { .. } => Some(1),
        _ => None,
    };
    let mut r = oa_error_with_budget(
        status,
        kind,
        Some(e.code()),
        e.field(),
        e.to_string(),
        e.min_feasible_budget_ms(),
    );
    if let Some(s) = retry_after {
        r.headers_mut()
            .insert(axum::http::header::RETRY_AFTER, HeaderValue::from(s));
    }
    r
}

/// `GET /v1/models`: the routed models (or the one default).
#[utoipa::path(
    get,
    path = "/v1/models",
    operation_id = "listModels",
    summary = "The models the front door maps (OpenAI format)",
    description = "",
    responses(
        (status = 200, description = "`{object: list, data: [{id, object: model, …}]}`", body = inline(crate::openapi::ModelList)),
        (status = 401, response = crate::openapi::Unauthorized),
    ),
)]
pub async fn models(State(state): State<Arc<AppState>>) -> Response {
    let names: Vec<String> = if state.front_door.models.is_empty() {
        vec![FrontDoor::DEFAULT_KIND.to_owned()]
    } else {
        state
            .front_door
            .models
            .iter()
            .map(|(n, _)| n.clone())
            .collect()
    };
    let data: Vec<Value> = names
        .iter()
        .map(|n| json!({"id": n, "object": "model", "created": 0, "owned_by": "lastcall"}))
        .collect();
    Json(json!({"object": "list", "data": data})).into_response()
}

/// `POST /v1/chat/completions`.
#[utoipa::path(
    post,
    path = "/v1/chat/completions",
    operation_id = "chatCompletions",
    summary = "OpenAI-compatible chat completion, run as a job with a deadline",
    description = "The OpenAI chat request becomes a job: `model` maps to a job kind (`serve --model NAME=KIND`; without any mapping every model is kind `chat`), the deadline comes from `X-Lastcall-Deadline-Ms` or `X-Lastcall-Expires-At-Ms`, else the SDK's own timeout (`X-Stainless-Read-Timeout` / `X-Stainless-Timeout`, seconds), else `serve --default-deadline-ms`; `Idempotency-Key` becomes the job id. The request waits for the outcome. With `stream: true` the answer is server-sent events in OpenAI's `chat.completion.chunk` format (a chunk with `delta.role`, content deltas as the model generates them, a final chunk with `finish_reason`, a `usage` chunk when `stream_options.include_usage`, then `data: [DONE]`); the streamed text equals the ledger's result. An outcome that is not `completed` before the first byte gets the same status as without streaming; after it, the stream ends with an event `data: {\"error\": {…}}` and no `[DONE]`. A client that disconnects before the end cancels its job.",
    params(
        ("X-Lastcall-Deadline-Ms" = Option<i64>, Header, nullable = false, minimum = 1),
        ("X-Lastcall-Expires-At-Ms" = Option<i64>, Header, nullable = false),
        ("X-Stainless-Read-Timeout" = Option<f64>, Header, nullable = false),
        ("Idempotency-Key" = Option<String>, Header, nullable = false, description = "Becomes the job id; a token of the tokens file's in its tenant's namespace (`<tenant>:<key>`), so another tenant's job is never the answer"),
        ("X-Lastcall-Tenant" = Option<String>, Header, nullable = false, pattern = "^[A-Za-z0-9._:-]{1,64}$", description = "The job's tenant (`default` when absent). A token of the tokens file acts for its own tenant: leave it out or name the same one (another is `403 tenant_mismatch`, in lastcall's error shape like every `403`). The body's `user` is never the tenant"),
        ("X-Lastcall-Priority" = Option<crate::openapi::PriorityTier>, Header, nullable = false, description = "The job's priority tier: `critical`, `standard` (when absent) or `batch`. A token of the tokens file may name at most its `max_priority` (above: `403 priority_not_allowed`)"),
    ),
    request_body(content = inline(crate::openapi::ChatCompletionRequest), content_type = "application/json"),
    responses(
        (status = 200, description = "Completed: a `chat.completion` with `usage`; headers `x-lastcall-job-id`, `x-lastcall-state`. With `stream: true`: `text/event-stream` of `chat.completion.chunk` events ending in `data: [DONE]` (header `x-lastcall-job-id`)", content(
            (inline(crate::openapi::ChatCompletion) = "application/json"),
            (String = "text/event-stream"),
        )),
        (status = 400, description = "Not an OpenAI chat request, a malformed deadline, `X-Lastcall-Tenant` or `X-Lastcall-Priority` header (`param` names it), `stream` not a boolean, or the job was `rejected`", body = crate::openapi::OpenAiError),
        (status = 401, response = crate::openapi::Unauthorized),
        (status = 403, description = "Sent from another origin (`cross_origin`), or with Basic credentials, which are for reads only (`basic_credentials_read_only`); or, with a token of the tokens file, `X-Lastcall-Tenant` names another tenant (`tenant_mismatch`) or the model's kind is not one the token may submit (`kind_not_allowed`), or `X-Lastcall-Priority` names a tier above the token's `max_priority` (`priority_not_allowed`); every `403` is in lastcall's error shape, `field` naming the header or `kind`", body = crate::openapi::ErrorBody),
        (status = 404, description = "Unknown `model` (`model_not_found`)", body = crate::openapi::OpenAiError),
        (status = 408, description = "The body did not all arrive within `serve --body-read-timeout-ms` (10 s by default): `body_read_timeout`, the connection is closed", body = crate::openapi::OpenAiError),
        (status = 409, description = "The job was cancelled (`x-should-retry: false`)", body = crate::openapi::OpenAiError),
        (status = 413, description = "The body is larger than this server's limit (`serve --max-body-bytes`, 1 MiB by default), or the job as published would be too large (`body_too_large`)", body = crate::openapi::OpenAiError),
        (status = 415, description = "The `Content-Type` header is not `application/json` (`unsupported_media_type`, `param` `Content-Type`)", body = crate::openapi::OpenAiError),
        (status = 422, description = "The deadline is already over or beyond the horizon", body = crate::openapi::OpenAiError),
        (status = 429, description = "With a token of the tokens file, its tenant holds its cap of requests in flight, waits or streams (`tenant_limit`, `param` names `max_requests`, `max_waiting` or `max_streams`; `Retry-After: 1`; in lastcall's error shape when refused before the route, for `max_requests`); over a quota of the tenant (`over_quota`, `param` names it; `Retry-After`; everything forwarded to the model counts), or shed at the door: the queue wait would make it expire (`Retry-After`; `x-should-retry` true only if that still fits the budget; `error.min_feasible_budget_ms` and the `X-Lastcall-Min-Budget-Ms` header: the smallest budget the door would admit now, to resend with in `X-Lastcall-Deadline-Ms`)", body = crate::openapi::OpenAiError, headers(("X-Lastcall-Min-Budget-Ms" = inline(crate::openapi::MinBudget), description = "With `would_expire_in_queue`: the smallest budget, in ms, the door would admit now"))),
        (status = 502, description = "The model call failed", body = crate::openapi::OpenAiError),
        (status = 503, description = "Not accepted: the model server of the kind is down for every live worker (`upstream_unavailable`, their circuit breakers open; `Retry-After` until their next trial), the broker did not confirm, or as many requests as this server lets wait at once already wait (`too_many_waiting`, `serve --max-waiting`; `Retry-After`)", body = crate::openapi::OpenAiError),
        (status = 504, description = "Expired before or during its run (`deadline_expired` / `deadline_exceeded`, `x-should-retry: false`; refused by a worker for lack of time: `error.min_feasible_budget_ms` and `X-Lastcall-Min-Budget-Ms`, the budget its check would have admitted), no outcome after the deadline, or none within this server's longest hold (`hold_exceeded`, `serve --max-hold-ms`: the job goes on)", body = crate::openapi::OpenAiError),
    ),
)]
pub async fn chat_completions(
    State(state): State<Arc<AppState>>,
    Extension(caller): Extension<Caller>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    if let Err(e) = ApiError::require_json(&headers) {
        return from_api_error(e);
    }
    // The same limit as `POST /v1/jobs` (`serve --max-body-bytes`), not axum's 2 MB.
    let body = match crate::jobs::read_body(&state, &headers, body).await {
        Ok(b) => b,
        Err(e) => return from_api_error(e),
    };
    match run(&state, &caller, &headers, &body).await {
        Ok(r) | Err(r) => r,
    }
}

async fn run(
    state: &Arc<AppState>,
    caller: &Caller,
    headers: &HeaderMap,
    body: &[u8],
) -> Result<Response, Response> {
    let bad = |param: &str, msg: String| {
        oa_error(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            None,
            Some(param),
            msg,
        )
    };
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| bad("body", format!("the body is not valid JSON: {e}")))?;
    let Value::Object(mut o) = v else {
        return Err(bad("body", "the body must be a JSON object".into()));
    };
    let model = match o.remove("model") {
        Some(Value::String(m)) => m,
        _ => return Err(bad("model", "`model` is required (a string)".into())),
    };
    let Some(kind) = state.front_door.kind_for(&model) else {
        return Err(oa_error(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            Some("model_not_found"),
            Some("model"),
            format!(
                "the model `{}` does not exist here (GET /v1/models lists them)",
                crate::params::shorten(&model)
            ),
        ));
    };
    let stream = match o.remove("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => b,
        Some(_) => return Err(bad("stream", "`stream` must be a boolean".into())),
    };
    let include_usage = o
        .remove("stream_options")
        .and_then(|v| v.get("include_usage").and_then(Value::as_bool))
        == Some(true);
    if o.get("messages")
        .and_then(Value::as_array)
        .is_none_or(Vec::is_empty)
    {
        return Err(bad(
            "messages",
            "`messages` is required: a non-empty array".into(),
        ));
    }
    let deadline =
        deadline_of(headers, state.front_door.default_deadline_ms).map_err(|(h, m)| bad(h, m))?;
    let tenant = caller
        .job_tenant(header(headers, "x-lastcall-tenant"), "X-Lastcall-Tenant")
        .map_err(|e| match e {
            e @ ApiError::NotAllowed { .. } => e.into_response(),
            e => from_api_error(e),
        })?;
    let priority = match header(headers, "x-lastcall-priority") {
        Some(p) => Some(p.parse::<lastcall_core::Priority>().map_err(|e| {
            bad(
                "X-Lastcall-Priority",
                format!("`X-Lastcall-Priority` {}", e.0),
            )
        })?),
        None => None,
    };
    let priority = caller
        .job_priority(priority, "X-Lastcall-Priority")
        .map_err(IntoResponse::into_response)?;
    caller
        .check_kind(&kind)
        .map_err(IntoResponse::into_response)?;
    let job_id = caller
        .new_job_id(header(headers, "idempotency-key"), "Idempotency-Key")
        .map_err(from_api_error)?;
    let job = NewJob {
        job_id: Some(job_id),
        kind,
        payload: o,
        deadline,
        min_runtime_ms: None,
        trace_id: None,
    };
    let now = state.clock.now_ms();
    let env = state
        .submitter
        .envelope(&job, now)
        .map_err(|e| from_api_error(submit_error(e, deadline)))?;
    let env = crate::jobs::tagged(env, tenant, priority);
    let id = env.job_id().to_string();
    // Everything forwarded to the model counts (`tool_calls`, `tools`, …), not only the
    // `content` strings.
    let tokens = lastcall_core::request_size::forwarded_tokens(&env.payload);
    state
        .admit_quota(env.tenant(), tokens)
        .map_err(from_api_error)?;
    let expires_at_ms = env.deadline().expires_at_ms();
    // A permit to wait (bounded: `serve --max-waiting`, and the tenant's `max_waiting`),
    // and for a stream one to stream (`serve --max-streams`, the tenant's `max_streams`),
    // held until the answer or the stream ends (the guard carries them) and taken before
    // any broker channel is opened: a refused request opens none.
    let mut permit = state.wait_permit(caller).map_err(from_api_error)?;
    if stream {
        permit = permit.and(state.stream_permit(caller).map_err(from_api_error)?);
    }
    // A channel of its own whose direct reply-to address the job carries: the worker's
    // token deltas come back on it.
    let reply = if stream {
        let reply = (state.submitter.reply_channel().await)
            .map_err(|e| from_api_error(submit_error(e, deadline)))?;
        state.http_stats.stream_channels_opened.inc();
        Some(reply)
    } else {
        None
    };
    // Subscribed before publishing: the outcome cannot come first.
    let mut waiter = state.waiters.subscribe(&id);
    let mut guard = CancelOnDrop {
        state: state.clone(),
        id: id.clone(),
        armed: false,
        _permit: permit,
    };
    // The idempotency scope: the token's tenant, this route and the model (the payload
    // no longer holds it, and several models may map to one kind). The same key with
    // another model, kind or body is a 409, never the first request's answer.
    let scope = format!("{}|chat|{model}", caller.scope(&state.token, env.tenant()));
    let submitted = match &reply {
        Some(r) => {
            state
                .submitter
                .submit_once_replying(&env, now, state.claim_wait, &scope, r)
                .await
        }
        None => {
            state
                .submitter
                .submit_once_scoped(&env, now, state.claim_wait, &scope, async || Ok(()))
                .await
        }
    };
    match submitted {
        Ok(Submission::Published(_)) => {
            state.http_stats.accepted_for(env.tenant());
            guard.armed = true;
        }
        Ok(Submission::Duplicate(_)) => {} // an earlier request with this key owns the job
        Err(SubmitError::Ledger(_)) => guard.armed = true,
        Err(e) => return Err(shed_or_refuse(e, deadline, expires_at_ms, now)),
    }
    // The workers record an expiry at the deadline; a little after it the outcome is in.
    // Until the outcome is surely in (the workers record an expiry at the deadline), but
    // never longer than this server holds a request (`--max-hold-ms`): a connection, a
    // waiter and a task per request are not held for a 24 h deadline.
    let to_outcome_ms = (expires_at_ms - now).max(0) as u64 + 5_000;
    let hold_ms = to_outcome_ms.min(state.front_door.max_hold_ms);
    let until = tokio::time::Instant::now() + Duration::from_millis(hold_ms);
    if let Some(reply) = reply {
        let s = crate::front_door_stream::Streaming::new(
            state.clone(),
            waiter,
            guard,
            reply,
            id,
            model,
            now / 1000,
            include_usage,
            until,
        );
        return Ok(s.respond().await);
    }
    let read = || async {
        Ok::<_, ApiError>(
            read_job(state, &id)
                .await?
                .filter(|r| crate::jobs::visible(caller, r)),
        )
    };
    let rec = waiter
        .until_terminal(until, read)
        .await
        .map_err(from_api_error)?;
    guard.armed = false;
    let Some(rec) = rec.filter(JobRecord::is_terminal) else {
        if hold_ms < to_outcome_ms {
            return Err(oa_error(
                StatusCode::GATEWAY_TIMEOUT,
                "timeout",
                Some("hold_exceeded"),
                None,
                format!(
                    "job `{id}` has no outcome after this server's longest hold ({hold_ms} ms, serve --max-hold-ms); it goes on until its deadline: `GET /v1/jobs/{id}?wait_ms=N`, or the same Idempotency-Key again, returns its outcome"
                ),
            ));
        }
        return Err(oa_error(
            StatusCode::GATEWAY_TIMEOUT,
            "deadline_expired",
            Some("no_outcome"),
            None,
            format!(
                "job `{id}` has no outcome yet after its deadline; `GET /v1/jobs/{id}` shows it later"
            ),
        ));
    };
    Ok(answer(&rec, &model, now))
}

/// A refusal before publishing: shedding says whether a retry could still fit the budget.
fn shed_or_refuse(e: SubmitError, spec: DeadlineSpec, expires_at_ms: i64, now: i64) -> Response {
    let fits = match &e {
        SubmitError::WouldExpireInQueue(est) => {
            Some(!est.cannot_finish() && now + (est.retry_after_s as i64) * 1000 < expires_at_ms)
        }
        SubmitError::UpstreamUnavailable { retry_after_s, .. } => {
            Some(now + (*retry_after_s as i64) * 1000 < expires_at_ms)
        }
        _ => None,
    };
    let mut r = from_api_error(submit_error(e, spec));
    if let Some(fits) = fits {
        r.headers_mut().insert(
            "x-should-retry",
            HeaderValue::from_static(if fits { "true" } else { "false" }),
        );
    }
    r
}

/// The OpenAI error `type` of a terminal state other than `completed`.
pub(crate) fn error_kind(state: &str) -> &'static str {
    match state {
        "deadline_exceeded" => "deadline_exceeded",
        "expired_not_started" | "expired_before_receive" => "deadline_expired",
        "rejected" => "invalid_request_error",
        "cancelled" => "cancelled",
        _ => "model_error",
    }
}

/// OpenAI's `usage` of a record. The counts come from an upstream model server: a
/// negative one reads 0, and the total saturates instead of overflowing.
pub(crate) fn usage(rec: &JobRecord) -> Value {
    usage_of(rec.prompt_tokens, rec.completion_tokens)
}

fn usage_of(prompt: Option<i64>, completion: Option<i64>) -> Value {
    let p = prompt.unwrap_or(0).max(0);
    let c = completion.unwrap_or(0).max(0);
    json!({"prompt_tokens": p, "completion_tokens": c, "total_tokens": p.saturating_add(c)})
}

/// The `chat.completion` object of a completed record.
pub(crate) fn completion(rec: &JobRecord, model: &str, now_ms: i64) -> Value {
    json!({
        "id": format!("chatcmpl-{}", rec.job_id),
        "object": "chat.completion",
        "created": now_ms / 1000,
        "model": model,
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": rec.result.clone().unwrap_or_default()},
            "finish_reason": "stop",
        }],
        "usage": usage(rec),
    })
}

/// The response for a terminal record.
pub(crate) fn answer(rec: &JobRecord, model: &str, now_ms: i64) -> Response {
    let reason = rec.reason.as_deref().unwrap_or(&rec.state);
    let mut r = match rec.state.as_str() {
        "completed" => Json(completion(rec, model, now_ms)).into_response(),
        "expired_not_started" | "expired_before_receive" | "deadline_exceeded" => {
            let kind = error_kind(&rec.state);
            let msg = format!(
                "job `{}` ended {} ({reason}): {}",
                rec.job_id,
                rec.state,
                rec.error.as_deref().unwrap_or("its deadline passed")
            );
            let min_budget = rec
                .min_feasible_budget_ms
                .and_then(|ms| u64::try_from(ms).ok());
            let mut r = oa_error_with_budget(
                StatusCode::GATEWAY_TIMEOUT,
                kind,
                Some(reason),
                None,
                msg,
                min_budget,
            );
            r.headers_mut()
                .insert("x-should-retry", HeaderValue::from_static("false"));
            r
        }
        "rejected" => oa_error(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            Some(reason),
            None,
            rec.error.clone().unwrap_or_else(|| "rejected".into()),
        ),
        "cancelled" => {
            let mut r = oa_error(
                StatusCode::CONFLICT,
                "cancelled",
                Some(reason),
                None,
                format!("job `{}` was cancelled", rec.job_id),
            );
            r.headers_mut()
                .insert("x-should-retry", HeaderValue::from_static("false"));
            r
        }
        _ => oa_error(
            StatusCode::BAD_GATEWAY,
            "model_error",
            Some(reason),
            None,
            format!(
                "job `{}` ended {} ({reason}): {}",
                rec.job_id,
                rec.state,
                rec.error.as_deref().unwrap_or("")
            ),
        ),
    };
    for (name, value) in [
        ("x-lastcall-job-id", &rec.job_id),
        ("x-lastcall-state", &rec.state),
    ] {
        if let Ok(v) = HeaderValue::from_str(value) {
            r.headers_mut().insert(HeaderName::from_static(name), v);
        }
    }
    r
}

fn header<'a>(h: &'a HeaderMap, name: &str) -> Option<&'a str> {
    h.get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .filter(|v| !v.is_empty())
}

/// The request's deadline, by precedence; a malformed header is named.
fn deadline_of(h: &HeaderMap, default_ms: u64) -> Result<DeadlineSpec, (&'static str, String)> {
    if let Some(v) = header(h, "x-lastcall-deadline-ms") {
        return match v.parse::<u64>() {
            Ok(ms) if ms > 0 => Ok(DeadlineSpec::RelativeMs(ms)),
            _ => Err((
                "X-Lastcall-Deadline-Ms",
                format!(
                    "`X-Lastcall-Deadline-Ms` must be a positive integer (ms), not `{}`",
                    crate::params::shorten(v)
                ),
            )),
        };
    }
    if let Some(v) = header(h, "x-lastcall-expires-at-ms") {
        return v.parse::<i64>().map(DeadlineSpec::AbsoluteMs).map_err(|_| {
            (
                "X-Lastcall-Expires-At-Ms",
                format!(
                    "`X-Lastcall-Expires-At-Ms` must be ms since the epoch, not `{}`",
                    crate::params::shorten(v)
                ),
            )
        });
    }
    for name in ["x-stainless-read-timeout", "x-stainless-timeout"] {
        if let Some(v) = header(h, name)
            && let Ok(s) = v.parse::<f64>()
            && s.is_finite()
            && s > 0.0
        {
            return Ok(DeadlineSpec::RelativeMs(((s * 1000.0) as u64).max(1)));
        }
    }
    Ok(DeadlineSpec::RelativeMs(default_ms))
}

/// Cancels the job when the request is dropped before its answer (the client went away).
pub(crate) struct CancelOnDrop {
    state: Arc<AppState>,
    id: String,
    pub(crate) armed: bool,
    /// This request's place among those waiting for an outcome ([`AppState::waiting`]).
    _permit: crate::Held,
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let (state, id) = (self.state.clone(), std::mem::take(&mut self.id));
        tracing::info!(job_id = %id, "the client went away before the answer: cancelling its job");
        tokio::spawn(async move {
            let now = state.clock.now_ms();
            if let Err(e) = lastcall_producer::cancel::cancel(
                &state.ledger,
                &state.events,
                &state.control,
                &id,
                now,
            )
            .await
            {
                tracing::warn!(job_id = %id, error = %e, "cancelling the job of a departed client failed");
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Token counts an upstream server reported, however large: no overflow, no negative.
    #[test]
    fn usage_saturates() {
        let u = usage_of(Some(i64::MAX), Some(i64::MAX));
        assert_eq!(u["total_tokens"], i64::MAX);
        let u = usage_of(Some(-1), Some(5));
        assert_eq!(u["prompt_tokens"], 0);
        assert_eq!(u["total_tokens"], 5);
        assert_eq!(usage_of(Some(3), None)["total_tokens"], 3);
    }
}
