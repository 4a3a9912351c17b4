//! OpenAI-compatible batches: `POST /v1/batches`, `GET /v1/batches/{id}`, `GET /v1/batches`,
//! `POST /v1/batches/{id}/cancel`, and the publisher that turns a batch's lines into jobs.
//!
//! - Each line of the input file is a job whose deadline is the batch's `created_at +
//!   completion_window` (any window: `30m`, `2h`, `24h`, `7d`, see
//!   `lastcall_core::batch::parse_window`), tier `batch`, the batch's tenant, and the job id
//!   `<batch id>-<line number>` (in the tenant's namespace for a tenant's token), so a line
//!   published twice is one job.
//! - [`Pump`] publishes the lines a page at a time through the same steps as
//!   `POST /v1/jobs` (envelope, tenant and tier, the tenant's quotas, claim, publish with
//!   confirm, `accepted`), and persists the batch's cursor after each page: a restarted
//!   `serve` goes on from there. A line is published once its deadline lies within the
//!   submitter's horizon (a `7d` batch waits until its window's end is that near). A line
//!   refused for a passing reason (a quota, shedding, the broker) is tried again later; a
//!   malformed one goes to the error file with its line number, and the rest run.
//! - The status and `request_counts` are computed on each read from the ledger's outcomes of
//!   the batch's jobs (`lastcall_core::batch::view`); the output and error files
//!   (`file-<batch id>-output`, `file-<batch id>-errors`) likewise, once the batch has ended.
//! - Cancel: the lines not yet published never are; each published one is cancelled as
//!   `DELETE /v1/jobs/{id}` does (never started: `cancelled`; running: its worker aborts).
//!
//! A token sees and cancels only its tenant's batches (another's is `404`, as a missing one).

use crate::AppState;
use crate::auth::Caller;
use crate::error::ApiError;
use crate::files::{Pages, READ_PAGE, ledger_error, not_found, owner, sees, visible_file};
use crate::front_door::from_api_error;
use crate::params::{PathParam, QueryParams};
use axum::body::Body;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use lastcall_core::batch::{BatchFacts, BatchStatus, BatchView, WindowError, parse_window, view};
use lastcall_core::{Priority, State as JobState};
use lastcall_producer::{DeadlineSpec, NewJob, Submission, SubmitError};
use lastcall_store::{BatchRow, FileRow, JobRecord, LineError};
use serde_json::{Map, Value, json};
use std::sync::Arc;
use std::time::Duration;

/// The one endpoint a batch's lines may call.
pub const ENDPOINT: &str = "/v1/chat/completions";
/// Lines published per batch per round of the publisher.
const PUBLISH_PAGE: i64 = 100;
/// How often the publisher looks for work when not woken.
const PUMP_TICK: Duration = Duration::from_millis(500);

/// Wakes the publisher when a batch is created or cancelled.
#[derive(Debug, Default)]
pub struct Pump {
    wake: tokio::sync::Notify,
}

impl Pump {
    pub fn wake(&self) {
        self.wake.notify_one();
    }
}

/// Run the publisher until `stop`: every tick (or when woken), a page of each batch with
/// work.
pub fn spawn_pump(
    state: Arc<AppState>,
    stop: tokio_util::sync::CancellationToken,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            if let Err(e) = pump_round(&state).await {
                tracing::warn!(error = %e, "publishing batch lines");
            }
            tokio::select! {
                () = stop.cancelled() => return,
                () = state.batch_pump.wake.notified() => {}
                () = tokio::time::sleep(PUMP_TICK) => {}
            }
        }
    })
}

async fn pump_round(state: &Arc<AppState>) -> Result<(), lastcall_store::StoreError> {
    let now = state.clock.now_ms();
    for b in state.ledger.batches_to_pump(now).await? {
        if b.cancelled_at_ms.is_some() {
            cancel_page(state, &b).await?;
        } else if b.expires_at_ms - now <= state.horizon_ms {
            publish_page(state, &b).await?;
        }
    }
    Ok(())
}

/// Cancel the next page of a cancelled batch's published lines.
async fn cancel_page(state: &AppState, b: &BatchRow) -> Result<(), lastcall_store::StoreError> {
    let to = (b.cancel_cursor + PUBLISH_PAGE).min(b.cursor);
    for line in b.cancel_cursor + 1..=to {
        let id = b.job_id(line);
        let now = state.clock.now_ms();
        lastcall_producer::cancel::cancel(&state.ledger, &state.events, &state.control, &id, now)
            .await?;
    }
    state.ledger.advance_cancel_cursor(&b.batch_id, to).await
}

/// What became of one line.
enum Published {
    /// A job (published now, or before: the same id).
    Job,
    /// Malformed: to the error file.
    Malformed(LineError),
    /// Refused for now (a quota, shedding, the broker, the ledger): try again later.
    Later(String),
}

/// Publish the next page of a batch's lines, then move its cursor past those handled.
async fn publish_page(state: &AppState, b: &BatchRow) -> Result<(), lastcall_store::StoreError> {
    let lines = state
        .ledger
        .file_lines(&b.input_file_id, b.cursor + 1, PUBLISH_PAGE)
        .await?;
    let mut handled = b.cursor;
    for (line_no, text) in &lines {
        if *line_no != handled + 1 {
            break; // the input file was deleted meanwhile: nothing more to read
        }
        match publish_line(state, b, *line_no, text).await {
            Published::Job => {}
            Published::Malformed(e) => state.ledger.record_line_error(&b.batch_id, &e).await?,
            Published::Later(why) => {
                tracing::debug!(batch_id = %b.batch_id, line = line_no, why, "batch line deferred");
                break;
            }
        }
        handled = *line_no;
    }
    if handled > b.cursor {
        state
            .ledger
            .advance_batch_cursor(&b.batch_id, b.cursor, handled)
            .await?;
    }
    Ok(())
}

/// A line of the input file, read.
struct Line {
    custom_id: Option<String>,
    model: String,
    payload: Map<String, Value>,
}

/// Read one input line: `{custom_id, method: POST, url, body: {model, messages, …}}`.
fn parse_line(text: &str, endpoint: &str) -> Result<Line, (Option<String>, String, String)> {
    let bad = |cid: &Option<String>, code: &str, m: String| Err((cid.clone(), code.into(), m));
    let v: Value = match serde_json::from_str(text) {
        Ok(v) => v,
        Err(e) => return bad(&None, "invalid_json_line", format!("not valid JSON: {e}")),
    };
    let Value::Object(mut o) = v else {
        return bad(&None, "invalid_json_line", "not a JSON object".into());
    };
    let custom_id = match o.remove("custom_id") {
        Some(Value::String(s)) if !s.is_empty() => Some(s),
        _ => {
            return bad(
                &None,
                "missing_custom_id",
                "`custom_id` is required (a string)".into(),
            );
        }
    };
    match o.get("method").and_then(Value::as_str) {
        Some("POST") => {}
        _ => {
            return bad(
                &custom_id,
                "invalid_method",
                "`method` must be `POST`".into(),
            );
        }
    }
    match o.get("url").and_then(Value::as_str) {
        Some(u) if u == endpoint => {}
        _ => {
            return bad(
                &custom_id,
                "invalid_url",
                format!("`url` must be the batch's endpoint, `{endpoint}`"),
            );
        }
    }
    let Some(Value::Object(mut body)) = o.remove("body") else {
        return bad(
            &custom_id,
            "invalid_body",
            "`body` must be a JSON object".into(),
        );
    };
    let model = match body.remove("model") {
        Some(Value::String(m)) => m,
        _ => {
            return bad(
                &custom_id,
                "invalid_body",
                "`body.model` is required (a string)".into(),
            );
        }
    };
    if body.get("stream").and_then(Value::as_bool) == Some(true) {
        return bad(
            &custom_id,
            "invalid_body",
            "`body.stream` cannot be true in a batch".into(),
        );
    }
    body.remove("stream");
    body.remove("stream_options");
    if body
        .get("messages")
        .and_then(Value::as_array)
        .is_none_or(Vec::is_empty)
    {
        return bad(
            &custom_id,
            "invalid_body",
            "`body.messages` is required: a non-empty array".into(),
        );
    }
    Ok(Line {
        custom_id,
        model,
        payload: body,
    })
}

/// Publish line `line_no` as `POST /v1/jobs` publishes a job.
async fn publish_line(state: &AppState, b: &BatchRow, line_no: i64, text: &str) -> Published {
    let malformed = |custom_id: Option<String>, code: &str, message: String| {
        Published::Malformed(LineError {
            line_no,
            custom_id,
            code: code.into(),
            message,
        })
    };
    let line = match parse_line(text, &b.endpoint) {
        Ok(l) => l,
        Err((cid, code, m)) => return malformed(cid, &code, format!("line {line_no}: {m}")),
    };
    let Some(kind) = state.front_door.kind_for(&line.model) else {
        return malformed(
            line.custom_id,
            "model_not_found",
            format!(
                "line {line_no}: the model `{}` does not exist here",
                crate::params::shorten(&line.model)
            ),
        );
    };
    if let Some(kinds) = &b.allowed_kinds
        && !serde_json::from_str::<Vec<String>>(kinds).is_ok_and(|k| k.contains(&kind))
    {
        return malformed(
            line.custom_id,
            "kind_not_allowed",
            format!("line {line_no}: the batch's token may not submit jobs of kind `{kind}`"),
        );
    }
    let deadline = DeadlineSpec::AbsoluteMs(b.expires_at_ms);
    let job = NewJob {
        job_id: Some(b.job_id(line_no)),
        kind,
        payload: line.payload,
        deadline,
        min_runtime_ms: None,
        trace_id: None,
    };
    let now = state.clock.now_ms();
    let env = match state.submitter.envelope(&job, now) {
        Ok(env) => env,
        Err(SubmitError::Expired { .. }) => {
            return Published::Later("the window is over".into());
        }
        // Just beyond the horizon still (the clock moved on little since the check): later.
        Err(SubmitError::Invalid(r))
            if r.reason == lastcall_core::RejectReason::DeadlineBeyondHorizon =>
        {
            return Published::Later(r.message);
        }
        Err(e) => {
            return malformed(
                line.custom_id,
                "invalid_request",
                format!("line {line_no}: {}", crate::jobs::submit_error(e, deadline)),
            );
        }
    };
    let tenant = match lastcall_core::Tenant::parse(&b.tenant) {
        Ok(t) => t,
        Err(e) => return malformed(line.custom_id, "invalid_tenant", e.0.to_string()),
    };
    let env = crate::jobs::tagged(env, tenant, Some(Priority::Batch));
    let tokens = lastcall_core::request_size::forwarded_tokens(&env.payload);
    if let Err(e) = state.admit_quota(env.tenant(), tokens) {
        return Published::Later(e.to_string());
    }
    let scope = format!("batch|{}", b.batch_id);
    match state
        .submitter
        .submit_once_scoped(&env, now, state.claim_wait, &scope, async || Ok(()))
        .await
    {
        Ok(Submission::Published(_)) => {
            state.http_stats.accepted_for(env.tenant());
            Published::Job
        }
        Ok(Submission::Duplicate(_)) | Err(SubmitError::Ledger(_)) => Published::Job,
        Err(e @ (SubmitError::Invalid(_) | SubmitError::Conflict { .. })) => malformed(
            line.custom_id,
            "invalid_request",
            format!("line {line_no}: {}", crate::jobs::submit_error(e, deadline)),
        ),
        Err(e) => Published::Later(e.to_string()),
    }
}

/// The facts of a batch and its jobs' records, read a page at a time.
struct Reading {
    facts: BatchFacts,
    /// The latest recorded outcome among the batch's jobs.
    last_recorded_ms: Option<i64>,
}

fn is_expiry(state: &str) -> bool {
    matches!(
        state,
        "expired_not_started" | "expired_before_receive" | "deadline_exceeded"
    )
}

async fn read_facts(state: &AppState, b: &BatchRow) -> Result<Reading, ApiError> {
    let mut f = BatchFacts {
        total: b.total,
        cursor: b.cursor,
        created_at_ms: b.created_at_ms,
        expires_at_ms: b.expires_at_ms,
        cancelled_at_ms: b.cancelled_at_ms,
        cancel_done: b.cancel_cursor >= b.cursor,
        ..Default::default()
    };
    let mut last = None;
    let mut from = 1;
    while from <= b.cursor {
        let to = (from + READ_PAGE - 1).min(b.cursor);
        let ids: Vec<String> = (from..=to).map(|n| b.job_id(n)).collect();
        for rec in state.ledger.jobs_many(&ids).await.map_err(ledger_error)? {
            let Ok(s) = rec.state.parse::<JobState>() else {
                continue;
            };
            if !s.is_terminal() || rec.state == "unknown" {
                continue;
            }
            match rec.state.as_str() {
                "completed" => f.completed += 1,
                "cancelled" => f.cancelled += 1,
                s if is_expiry(s) => f.expired += 1,
                _ => f.failed += 1,
            }
            last = last.max(rec.recorded_at_ms);
        }
        from = to + 1;
    }
    f.malformed = state
        .ledger
        .line_errors(&b.batch_id, 1, b.cursor)
        .await
        .map_err(ledger_error)?
        .len() as i64;
    Ok(Reading {
        facts: f,
        last_recorded_ms: last,
    })
}

fn output_file_id(batch_id: &str) -> String {
    format!("file-{batch_id}-output")
}

fn error_file_id(batch_id: &str) -> String {
    format!("file-{batch_id}-errors")
}

/// OpenAI's batch object.
fn batch_object(b: &BatchRow, r: &Reading, v: &BatchView) -> Value {
    let s = |ms: i64| ms / 1000;
    let ended_at = r
        .last_recorded_ms
        .unwrap_or(b.created_at_ms)
        .max(b.created_at_ms);
    let terminal = v.status.is_terminal();
    let at = |st: BatchStatus| (v.status == st).then(|| s(ended_at));
    let metadata = b
        .metadata
        .as_deref()
        .and_then(|m| serde_json::from_str::<Value>(m).ok());
    json!({
        "id": b.batch_id,
        "object": "batch",
        "endpoint": b.endpoint,
        "errors": null,
        "input_file_id": b.input_file_id,
        "completion_window": b.completion_window,
        "status": v.status.as_str(),
        "output_file_id": terminal.then(|| output_file_id(&b.batch_id)),
        "error_file_id": terminal.then(|| error_file_id(&b.batch_id)),
        "created_at": s(b.created_at_ms),
        "in_progress_at": s(b.created_at_ms),
        "expires_at": s(b.expires_at_ms),
        "finalizing_at": terminal.then(|| s(ended_at)),
        "completed_at": at(BatchStatus::Completed),
        "failed_at": at(BatchStatus::Failed),
        "expired_at": (v.status == BatchStatus::Expired).then(|| s(b.expires_at_ms)),
        "cancelling_at": b.cancelled_at_ms.map(s),
        "cancelled_at": at(BatchStatus::Cancelled),
        "request_counts": {"total": v.total, "completed": v.completed, "failed": v.failed},
        "metadata": metadata,
    })
}

async fn visible_batch(state: &AppState, caller: &Caller, id: &str) -> Result<BatchRow, ApiError> {
    let b = state.ledger.get_batch(id).await.map_err(ledger_error)?;
    b.filter(|b| sees(caller, &b.tenant))
        .ok_or_else(|| not_found("batch", id))
}

async fn object_of(state: &AppState, b: &BatchRow) -> Result<Value, ApiError> {
    let r = read_facts(state, b).await?;
    let v = view(&r.facts, state.clock.now_ms());
    Ok(batch_object(b, &r, &v))
}

/// `POST /v1/batches`.
#[utoipa::path(
    post,
    path = "/v1/batches",
    operation_id = "createBatch",
    summary = "Create a batch from an uploaded file (OpenAI-compatible)",
    description = "`input_file_id` (a file of purpose `batch`), `endpoint` (`/v1/chat/completions`), `completion_window` (any: `30m`, `2h`, `24h`, `7d`: a positive whole number and `s`, `m`, `h` or `d`), `metadata` (optional, string values). Every line becomes a job, tier `batch`, with the deadline `created_at + completion_window`; lines are published a page at a time (restart-safe) once that deadline lies within the horizon.",
    request_body(content = inline(crate::batch_schemas::BatchCreate), content_type = "application/json"),
    responses(
        (status = 200, description = "The batch object", body = inline(crate::batch_schemas::BatchObject)),
        (status = 400, description = "A field missing or wrong: `param` names it (`completion_window` not a window, `endpoint` not `/v1/chat/completions`, `metadata` not an object of strings, the input file's purpose not `batch`)", body = crate::openapi::OpenAiError),
        (status = 401, response = crate::openapi::Unauthorized),
        (status = 403, response = crate::openapi::Forbidden),
        (status = 404, description = "No such input file, or another tenant's", body = crate::openapi::OpenAiError),
        (status = 422, description = "A `completion_window` longer than the longest, 365 days (`window_too_long`)", body = crate::openapi::OpenAiError),
        (status = 408, description = "The body did not all arrive within `serve --body-read-timeout-ms` (`body_read_timeout`)", body = crate::openapi::OpenAiError),
        (status = 413, description = "The body is larger than `serve --max-body-bytes` (`body_too_large`)", body = crate::openapi::OpenAiError),
        (status = 415, description = "The `Content-Type` header is not `application/json` (`unsupported_media_type`)", body = crate::openapi::OpenAiError),
        (status = 500, response = crate::openapi::OpenAiServerError),
        (status = 503, response = crate::openapi::OpenAiServerError),
    ),
)]
pub async fn create(
    State(state): State<Arc<AppState>>,
    Extension(caller): Extension<Caller>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    match create_batch(&state, &caller, &headers, body).await {
        Ok(v) => Json(v).into_response(),
        Err(e) => from_api_error(e),
    }
}

async fn create_batch(
    state: &AppState,
    caller: &Caller,
    headers: &HeaderMap,
    body: Body,
) -> Result<Value, ApiError> {
    ApiError::require_json(headers)?;
    let bytes = crate::jobs::read_body(state, headers, body).await?;
    let v: Value = serde_json::from_slice(&bytes).map_err(|e| {
        ApiError::bad(
            "body",
            "invalid_json",
            format!("the body is not valid JSON: {e}"),
        )
    })?;
    let Value::Object(o) = v else {
        return Err(ApiError::bad(
            "body",
            "not_an_object",
            "the body must be a JSON object",
        ));
    };
    let text = |field: &str| match o.get(field) {
        Some(Value::String(s)) => Ok(s.clone()),
        _ => Err(ApiError::bad(
            field,
            "missing_field",
            format!("`{field}` is required (a string)"),
        )),
    };
    let input_file_id = text("input_file_id")?;
    let endpoint = text("endpoint")?;
    if endpoint != ENDPOINT {
        return Err(ApiError::bad(
            "endpoint",
            "invalid_field",
            format!("`endpoint` must be `{ENDPOINT}`, the one endpoint batches run here"),
        ));
    }
    let window = text("completion_window")?;
    let window_ms = parse_window(&window).map_err(|e| match e {
        WindowError::Malformed(m) => ApiError::bad("completion_window", "invalid_field", m),
        WindowError::TooLong(message) => ApiError::Expired {
            field: "completion_window".into(),
            code: "window_too_long",
            message,
        },
    })?;
    let metadata = match o.get("metadata") {
        None | Some(Value::Null) => None,
        Some(Value::Object(m)) if m.values().all(Value::is_string) => {
            Some(Value::Object(m.clone()).to_string())
        }
        Some(_) => {
            return Err(ApiError::bad(
                "metadata",
                "invalid_field",
                "`metadata` must be an object of string values",
            ));
        }
    };
    let file: FileRow = visible_file(state, caller, &input_file_id).await?;
    if file.purpose != "batch" {
        return Err(ApiError::bad(
            "input_file_id",
            "invalid_field",
            "the input file's purpose must be `batch`",
        ));
    }
    let now = state.clock.now_ms();
    let batch_id = format!("batch_{}", &lastcall_producer::new_job_id()[4..28]);
    let job_prefix = caller.job_id(&format!("{batch_id}-"));
    let allowed_kinds = match caller {
        Caller::Tenant(e) => e
            .kinds
            .as_ref()
            .map(|k| serde_json::to_string(&k.iter().collect::<Vec<_>>()).unwrap_or_default()),
        Caller::Operator => None,
    };
    let b = BatchRow {
        batch_id,
        tenant: owner(caller),
        input_file_id: file.file_id,
        endpoint,
        completion_window: window,
        metadata,
        allowed_kinds,
        job_prefix,
        created_at_ms: now,
        expires_at_ms: now.saturating_add(window_ms),
        total: file.line_count,
        cursor: 0,
        cancelled_at_ms: None,
        cancel_cursor: 0,
    };
    state.ledger.create_batch(&b).await.map_err(ledger_error)?;
    state.batch_pump.wake();
    object_of(state, &b).await
}

/// `GET /v1/batches/{id}`.
#[utoipa::path(
    get,
    path = "/v1/batches/{id}",
    operation_id = "getBatch",
    summary = "A batch object, its status computed from its jobs' outcomes (OpenAI-compatible)",
    description = "",
    params(("id" = String, Path)),
    responses(
        (status = 200, description = "The batch object", body = inline(crate::batch_schemas::BatchObject)),
        (status = 401, response = crate::openapi::Unauthorized),
        (status = 404, description = "No such batch, or another tenant's", body = crate::openapi::OpenAiError),
        (status = 500, response = crate::openapi::OpenAiServerError),
        (status = 503, response = crate::openapi::OpenAiServerError),
    ),
)]
pub async fn show(
    State(state): State<Arc<AppState>>,
    Extension(caller): Extension<Caller>,
    PathParam(id): PathParam,
) -> Response {
    let run = async {
        let b = visible_batch(&state, &caller, &id).await?;
        object_of(&state, &b).await
    };
    match run.await {
        Ok(v) => Json(v).into_response(),
        Err(e) => from_api_error(e),
    }
}

/// `GET /v1/batches?after=…&limit=…`.
#[utoipa::path(
    get,
    path = "/v1/batches",
    operation_id = "listBatches",
    summary = "The batches, newest first (OpenAI-compatible, paged)",
    description = "",
    params(
        ("after" = Option<String>, Query, nullable = false, description = "A batch id: the page after it"),
        ("limit" = Option<i64>, Query, nullable = false, minimum = 1, maximum = 100, description = "At most this many (20 by default)"),
    ),
    responses(
        (status = 200, description = "`{object: list, data, first_id, last_id, has_more}`", body = inline(crate::batch_schemas::BatchList)),
        (status = 400, description = "`limit` not an integer from 1 to 100, or a parameter given twice", body = crate::openapi::OpenAiError),
        (status = 401, response = crate::openapi::Unauthorized),
        (status = 404, description = "`after` names no batch the token may see", body = crate::openapi::OpenAiError),
        (status = 500, response = crate::openapi::OpenAiServerError),
        (status = 503, response = crate::openapi::OpenAiServerError),
    ),
)]
pub async fn list(
    State(state): State<Arc<AppState>>,
    Extension(caller): Extension<Caller>,
    q: QueryParams,
) -> Response {
    let run = async {
        let limit = q.integer("limit", 1..=100)?.unwrap_or(20);
        let after = match q.single("after")? {
            Some(id) => Some(visible_batch(&state, &caller, id).await?),
            None => None,
        };
        let mut rows = state
            .ledger
            .list_batches(caller.tenant(), after.as_ref(), limit + 1)
            .await
            .map_err(ledger_error)?;
        let has_more = rows.len() as i64 > limit;
        rows.truncate(limit as usize);
        let mut data = Vec::with_capacity(rows.len());
        for b in &rows {
            data.push(object_of(&state, b).await?);
        }
        Ok::<_, ApiError>(json!({
            "object": "list",
            "data": data,
            "first_id": rows.first().map(|b| &b.batch_id),
            "last_id": rows.last().map(|b| &b.batch_id),
            "has_more": has_more,
        }))
    };
    match run.await {
        Ok(v) => Json(v).into_response(),
        Err(e) => from_api_error(e),
    }
}

/// `POST /v1/batches/{id}/cancel`.
#[utoipa::path(
    post,
    path = "/v1/batches/{id}/cancel",
    operation_id = "cancelBatch",
    summary = "Cancel a batch (OpenAI-compatible)",
    description = "Lines not yet published never run; each published line's job is cancelled as `DELETE /v1/jobs/{id}` does (not started: `cancelled`; running: its worker aborts the call). The batch is `cancelling` until every line has ended, then `cancelled`. Cancelling an ended batch changes nothing.",
    params(("id" = String, Path)),
    responses(
        (status = 200, description = "The batch object", body = inline(crate::batch_schemas::BatchObject)),
        (status = 401, response = crate::openapi::Unauthorized),
        (status = 403, response = crate::openapi::Forbidden),
        (status = 404, description = "No such batch, or another tenant's", body = crate::openapi::OpenAiError),
        (status = 500, response = crate::openapi::OpenAiServerError),
        (status = 503, response = crate::openapi::OpenAiServerError),
    ),
)]
pub async fn cancel(
    State(state): State<Arc<AppState>>,
    Extension(caller): Extension<Caller>,
    PathParam(id): PathParam,
) -> Response {
    let run = async {
        let b = visible_batch(&state, &caller, &id).await?;
        let r = read_facts(&state, &b).await?;
        if !view(&r.facts, state.clock.now_ms()).status.is_terminal() {
            state
                .ledger
                .cancel_batch(&b.batch_id, state.clock.now_ms())
                .await
                .map_err(ledger_error)?;
            state.batch_pump.wake();
        }
        let b = visible_batch(&state, &caller, &id).await?;
        object_of(&state, &b).await
    };
    match run.await {
        Ok(v) => Json(v).into_response(),
        Err(e) => from_api_error(e),
    }
}

/// Which of a batch's result files.
#[derive(Debug, Clone)]
pub(crate) enum ResultFile {
    Output(BatchRow),
    Errors(BatchRow),
}

/// A batch's output or error file named by `id`, if `id` names one the caller may see of
/// an ended batch; `Ok(None)` when `id` is no result file's name.
pub(crate) async fn result_file(
    state: &AppState,
    caller: &Caller,
    id: &str,
) -> Result<Option<(FileRow, ResultFile)>, ApiError> {
    let Some(rest) = id.strip_prefix("file-batch_") else {
        return Ok(None);
    };
    let (batch, output) = if let Some(b) = rest.strip_suffix("-output") {
        (b, true)
    } else if let Some(b) = rest.strip_suffix("-errors") {
        (b, false)
    } else {
        return Ok(None);
    };
    let batch_id = format!("batch_{batch}");
    let b = visible_batch(state, caller, &batch_id)
        .await
        .map_err(|_| not_found("file", id))?;
    let r = read_facts(state, &b).await?;
    if !view(&r.facts, state.clock.now_ms()).status.is_terminal() {
        return Err(not_found("file", id));
    }
    let f = FileRow {
        file_id: id.to_owned(),
        tenant: b.tenant.clone(),
        purpose: "batch_output".into(),
        filename: format!(
            "{batch_id}_{}.jsonl",
            if output { "output" } else { "error" }
        ),
        bytes: 0,
        line_count: 0,
        created_at_ms: r.last_recorded_ms.unwrap_or(b.created_at_ms),
    };
    Ok(Some((
        f,
        if output {
            ResultFile::Output(b)
        } else {
            ResultFile::Errors(b)
        },
    )))
}

impl ResultFile {
    /// The file's lines, a page of input lines at a time.
    pub(crate) fn stream(self, state: Arc<AppState>) -> Pages {
        let (b, output) = match self {
            ResultFile::Output(b) => (b, true),
            ResultFile::Errors(b) => (b, false),
        };
        let b = Arc::new(b);
        Box::pin(futures_util::stream::unfold(Some(1i64), move |from| {
            let (state, b) = (state.clone(), b.clone());
            async move {
                let from = from?;
                if from > b.total {
                    return None;
                }
                match result_page(&state, &b, from, output).await {
                    Ok((text, next)) => Some((Ok(text), Some(next))),
                    Err(e) => Some((Err(std::io::Error::other(e.to_string())), None)),
                }
            }
        }))
    }
}

/// The output (or error) lines of input lines `from`…: the text and the next line.
async fn result_page(
    state: &AppState,
    b: &BatchRow,
    from: i64,
    output: bool,
) -> Result<(String, i64), lastcall_store::StoreError> {
    let lines = state
        .ledger
        .file_lines(&b.input_file_id, from, READ_PAGE)
        .await?;
    let to = (from + READ_PAGE - 1).min(b.total);
    let ids: Vec<String> = (from..=to.min(b.cursor)).map(|n| b.job_id(n)).collect();
    let recs: std::collections::HashMap<String, JobRecord> = state
        .ledger
        .jobs_many(&ids)
        .await?
        .into_iter()
        .map(|r| (r.job_id.clone(), r))
        .collect();
    let errors: std::collections::HashMap<i64, LineError> = state
        .ledger
        .line_errors(&b.batch_id, from, to)
        .await?
        .into_iter()
        .map(|e| (e.line_no, e))
        .collect();
    let mut text = String::new();
    for line_no in from..=to {
        let input = lines
            .iter()
            .find(|(n, _)| *n == line_no)
            .map(|(_, t)| t.as_str());
        let parsed = input.and_then(|t| parse_line(t, &b.endpoint).ok());
        let custom_id = parsed.as_ref().and_then(|l| l.custom_id.clone());
        let model = parsed.as_ref().map_or("", |l| l.model.as_str());
        let id = b.job_id(line_no);
        let entry = if let Some(e) = errors.get(&line_no) {
            (
                false,
                json!({
                    "id": format!("batch_req_{line_no:06}"),
                    "custom_id": e.custom_id,
                    "response": null,
                    "error": {"code": e.code, "message": e.message},
                }),
            )
        } else {
            match recs.get(&id) {
                Some(rec) if rec.state == "completed" => (
                    true,
                    json!({
                        "id": format!("batch_req_{line_no:06}"),
                        "custom_id": custom_id,
                        "response": {
                            "status_code": 200,
                            "request_id": rec.job_id,
                            "body": crate::front_door::completion(rec, model, rec.recorded_at_ms.unwrap_or(b.created_at_ms)),
                        },
                        "error": null,
                    }),
                ),
                Some(rec)
                    if rec.state != "accepted"
                        && rec.state != "running"
                        && rec.state != "unknown" =>
                {
                    let code = if is_expiry(&rec.state) {
                        "batch_expired"
                    } else if rec.state == "cancelled" {
                        "batch_cancelled"
                    } else {
                        rec.reason.as_deref().unwrap_or(&rec.state)
                    };
                    (
                        false,
                        json!({
                            "id": format!("batch_req_{line_no:06}"),
                            "custom_id": custom_id,
                            "response": {
                                "status_code": crate::front_door::answer(rec, model, 0).status().as_u16(),
                                "request_id": rec.job_id,
                                "body": {"error": {"type": crate::front_door::error_kind(&rec.state), "code": rec.reason, "message": rec.error}},
                            },
                            "error": {"code": code, "message": format!("the request ended {}", rec.state)},
                        }),
                    )
                }
                _ => {
                    let (code, why) = if b.cancelled_at_ms.is_some() {
                        (
                            "batch_cancelled",
                            "the batch was cancelled before this request ran",
                        )
                    } else {
                        (
                            "batch_expired",
                            "this request was not run before the batch's window ended",
                        )
                    };
                    (
                        false,
                        json!({
                            "id": format!("batch_req_{line_no:06}"),
                            "custom_id": custom_id,
                            "response": null,
                            "error": {"code": code, "message": why},
                        }),
                    )
                }
            }
        };
        if entry.0 == output {
            text.push_str(&entry.1.to_string());
            text.push('\n');
        }
    }
    Ok((text, to + 1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_are_read_or_named() {
        let ok = r#"{"custom_id":"a","method":"POST","url":"/v1/chat/completions","body":{"model":"m","messages":[{"role":"user","content":"hi"}]}}"#;
        let l = parse_line(ok, ENDPOINT).ok().unwrap();
        assert_eq!((l.custom_id.as_deref(), l.model.as_str()), (Some("a"), "m"));
        assert!(!l.payload.contains_key("model"));
        for (bad, code) in [
            ("not json", "invalid_json_line"),
            (r#"{"method":"POST"}"#, "missing_custom_id"),
            (
                r#"{"custom_id":"a","method":"GET","url":"/v1/chat/completions","body":{}}"#,
                "invalid_method",
            ),
            (
                r#"{"custom_id":"a","method":"POST","url":"/v1/embeddings","body":{}}"#,
                "invalid_url",
            ),
            (
                r#"{"custom_id":"a","method":"POST","url":"/v1/chat/completions","body":{"model":"m","messages":[]}}"#,
                "invalid_body",
            ),
        ] {
            let Err((_, c, _)) = parse_line(bad, ENDPOINT) else {
                panic!("{bad} was taken");
            };
            assert_eq!(c, code, "{bad}");
        }
    }
}
