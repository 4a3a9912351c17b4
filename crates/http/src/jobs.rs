//! `POST /v1/jobs`, `GET /v1/jobs/{id}`, `GET /v1/jobs?state=…&kind=…`.

use crate::AppState;
use crate::error::ApiError;
use crate::params::{PathParam, QueryParams, shorten};
use axum::Json;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use lastcall_broker::PublishError;
use lastcall_core::{RejectReason, State as JobState};
use lastcall_producer::{DeadlineSpec, NewJob, Submission, SubmitError};
use lastcall_store::{CancelOutcome, JobRecord, ListFilter};
use serde_json::{Map, Value, json};
use std::sync::Arc;

/// `POST /v1/jobs`: validate, stamp the deadline, shed a job the queue wait would make
/// expire (`429 would_expire_in_queue` with `Retry-After`, when the submitter sheds), claim
/// the id, publish with confirm, stamp `accepted` (or release the claim and answer 503).
pub async fn create(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let limit = state.max_body_bytes;
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    if declared.is_some_and(|n| n > limit) {
        return Err(ApiError::TooLarge { limit });
    }
    let bytes = axum::body::to_bytes(body, limit)
        .await
        .map_err(|_| ApiError::TooLarge { limit })?;
    let (job, callback) = parse_request_with_callback(&bytes)?;
    let callback = match callback {
        Some(url) => Some(
            state
                .webhooks
                .check(&url)
                .map_err(|message| ApiError::Expired {
                    field: "callback_url".into(),
                    code: "callback_not_allowed",
                    message,
                })?,
        ),
        None => None,
    };
    let spec = job.deadline;
    let now = state.clock.now_ms();
    let env = state
        .submitter
        .envelope(&job, now)
        .map_err(|e| submit_error(e, spec))?;
    let job_id = env.job_id().to_string();
    // The webhook is in the ledger before the job is published: no outcome comes first.
    if let Some(url) = &callback {
        state
            .ledger
            .register_webhook(&job_id, url.as_str(), now)
            .await
            .map_err(|e| {
                ApiError::Unavailable(format!(
                    "not accepted: the ledger cannot record the webhook: {e}"
                ))
            })?;
    }

    // Claim the id in the ledger, publish with confirm, stamp or release the claim: the
    // same id again (even concurrently, even from another `serve`) is published at most
    // once; the same payload is answered idempotently, a different one is a conflict.
    match state
        .submitter
        .submit_once(&env, now, state.claim_wait)
        .await
    {
        Ok(Submission::Published(s)) => Ok(accepted(
            &s.job_id,
            json!({
                "job_id": s.job_id,
                "state": "accepted",
                "created_at_ms": s.created_at_ms,
                "expires_at_ms": s.expires_at_ms,
                "ttl_ms": s.ttl_ms,
            }),
        )),
        Ok(Submission::Duplicate(rec)) => {
            let body = json!({
                "job_id": job_id,
                "state": rec.state,
                "expires_at_ms": rec.expires_at_ms,
                "duplicate": true,
            });
            // A job that already has its outcome is not "accepted" again: 200 with the
            // outcome, nothing published.
            let finished = rec
                .state
                .parse::<lastcall_core::State>()
                .is_ok_and(|s| s.is_terminal());
            Ok(if finished {
                (StatusCode::OK, Json(body)).into_response()
            } else {
                accepted(&job_id, body)
            })
        }
        Err(SubmitError::Ledger(e)) => {
            // Published and confirmed: the job will run. Say so rather than invite a retry.
            tracing::error!(job_id = %job_id, error = %e, "published, but recording `accepted` failed");
            Ok(accepted(
                &job_id,
                json!({
                    "job_id": job_id,
                    "state": "accepted",
                    "expires_at_ms": env.deadline().expires_at_ms(),
                    "ledger_recorded": false,
                    "warning": "published and confirmed, but the ledger write failed; reconciliation cannot see this job",
                }),
            ))
        }
        Err(e) => {
            if matches!(e, SubmitError::WouldExpireInQueue(_)) {
                state.http_stats.shed.inc();
            }
            Err(submit_error(e, spec))
        }
    }
}

fn accepted(job_id: &str, body: Value) -> Response {
    let mut resp = (StatusCode::ACCEPTED, Json(body)).into_response();
    if let Ok(v) = format!("/v1/jobs/{job_id}").parse() {
        resp.headers_mut().insert(header::LOCATION, v);
    }
    resp
}

/// The answer to a refused submission. `spec` is the deadline as the request gave it, so
/// that the error names the field the client sent. A deadline that breaks a fixed rule of
/// the document (`deadline_ms` above the horizon) is a `400`; a well-formed one that the
/// clock refuses (already passed, an `expires_at_ms` farther ahead than the horizon) is a
/// `422`.
pub(crate) fn submit_error(e: SubmitError, spec: DeadlineSpec) -> ApiError {
    let deadline_field = match spec {
        DeadlineSpec::RelativeMs(_) => "deadline_ms",
        DeadlineSpec::AbsoluteMs(_) => "expires_at_ms",
    };
    match e {
        SubmitError::Invalid(r) if r.reason == RejectReason::DeadlineBeyondHorizon => match spec {
            DeadlineSpec::RelativeMs(ms) => ApiError::bad(
                "deadline_ms",
                r.reason.as_str(),
                format!("`deadline_ms` {ms} is too far: the {}", r.message),
            ),
            DeadlineSpec::AbsoluteMs(at) => ApiError::Expired {
                field: "expires_at_ms".into(),
                code: r.reason.as_str(),
                message: format!("`expires_at_ms` {at} is too far ahead: the {}", r.message),
            },
        },
        SubmitError::Invalid(r) if r.reason == RejectReason::MessageTooLarge => ApiError::Http {
            status: StatusCode::PAYLOAD_TOO_LARGE,
            code: "body_too_large",
            message: format!("the job as published would be too large: {}", r.message),
        },
        SubmitError::Invalid(r) => ApiError::bad(
            r.field.unwrap_or("body"),
            r.reason.as_str(),
            r.message.clone(),
        ),
        SubmitError::Expired { .. } => ApiError::Expired {
            field: deadline_field.into(),
            code: "already_expired",
            message: e.to_string(),
        },
        SubmitError::WouldExpireInQueue(est) => ApiError::WouldExpireInQueue {
            message: format!("not accepted: {est}"),
            retry_after_s: est.retry_after_s,
            estimate: json!({
                "queue_wait_ms": est.queue_wait_ms,
                "ready": est.ready,
                "ack_rate_per_s": est.ack_rate_per_s,
                "min_runtime_ms": est.min_runtime_ms,
                "remaining_ms": est.remaining_ms,
                "retry_after_s": est.retry_after_s,
            }),
        },
        SubmitError::Publish(PublishError::ConfirmTimeout(t)) => ApiError::Unavailable(format!(
            "not accepted: the broker did not confirm the publish within {} ms; nothing is recorded for this job id. The message may still reach the queue: retry with the same job_id",
            t.as_millis()
        )),
        SubmitError::Publish(p @ PublishError::BlockedInFlight) => ApiError::Unavailable(format!(
            "not accepted: {p}; nothing is recorded for this job id: retry with the same job_id"
        )),
        SubmitError::Publish(p) => ApiError::Unavailable(format!(
            "not accepted: {p}; nothing is recorded for this job id, retry later"
        )),
        SubmitError::Conflict { job_id } | SubmitError::AlreadyFinished { job_id, .. } => {
            ApiError::Conflict(job_id)
        }
        e @ (SubmitError::InFlight { .. } | SubmitError::Unrecorded(_)) => {
            ApiError::Unavailable(e.to_string())
        }
        SubmitError::Ledger(l) => ApiError::Internal(l.to_string()),
    }
}

/// The request body of `POST /v1/jobs`, checked field by field so that errors name the
/// field.
pub fn parse_request(body: &[u8]) -> Result<NewJob, ApiError> {
    parse_request_with_callback(body).map(|(job, _)| job)
}

/// [`parse_request`] and the optional `callback_url` (a string of at most 2,048 bytes).
fn parse_request_with_callback(body: &[u8]) -> Result<(NewJob, Option<String>), ApiError> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad("body", "invalid_json", format!("not valid JSON: {e}")))?;
    let Value::Object(mut o) = v else {
        return Err(ApiError::bad(
            "body",
            "not_an_object",
            "the body must be a JSON object",
        ));
    };
    let job_id = opt_string(&mut o, "job_id")?;
    let kind = opt_string(&mut o, "kind")?
        .ok_or_else(|| ApiError::bad("kind", "missing_field", "`kind` is required"))?;
    let payload = match o.remove("payload") {
        Some(Value::Object(p)) => p,
        None => {
            return Err(ApiError::bad(
                "payload",
                "missing_field",
                "`payload` is required (a JSON object)",
            ));
        }
        Some(_) => {
            return Err(ApiError::bad(
                "payload",
                "invalid_field",
                "`payload` must be a JSON object",
            ));
        }
    };
    let deadline_ms = opt_u64(&mut o, "deadline_ms")?;
    let expires_at_ms = opt_u64(&mut o, "expires_at_ms")?;
    let deadline = match (deadline_ms, expires_at_ms) {
        (Some(0), None) => {
            return Err(ApiError::bad(
                "deadline_ms",
                "invalid_field",
                "`deadline_ms` must be positive",
            ));
        }
        (Some(ms), None) => DeadlineSpec::RelativeMs(ms),
        (None, Some(at)) => DeadlineSpec::AbsoluteMs(i64::try_from(at).map_err(|_| {
            ApiError::bad(
                "expires_at_ms",
                "invalid_field",
                "`expires_at_ms` is too large",
            )
        })?),
        (Some(_), Some(_)) => {
            return Err(ApiError::bad(
                "deadline_ms",
                "invalid_field",
                "give either `deadline_ms` (a budget from now) or `expires_at_ms` (absolute), not both",
            ));
        }
        (None, None) => {
            return Err(ApiError::bad(
                "deadline_ms",
                "missing_field",
                "a deadline is required: `deadline_ms` (a budget from now) or `expires_at_ms` (ms since the epoch)",
            ));
        }
    };
    let callback = opt_string(&mut o, "callback_url")?;
    if callback.as_ref().is_some_and(|u| u.len() > 2048) {
        return Err(ApiError::bad(
            "callback_url",
            "invalid_field",
            "`callback_url` is longer than 2048 bytes",
        ));
    }
    Ok((
        NewJob {
            job_id,
            kind,
            payload,
            deadline,
            min_runtime_ms: opt_u64(&mut o, "min_runtime_ms")?,
            trace_id: trace_id(&mut o)?,
        },
        callback,
    ))
}

/// The longest `trace_id`, in characters (bytes: it is ASCII).
const TRACE_ID_MAX: usize = 256;

/// `trace_id`: printable ASCII, at most 256 characters. Trace ids are ASCII in every
/// tracing system (W3C, B3, X-Ray); the envelope's own limit is 256 bytes, which only an
/// ASCII rule lets the OpenAPI document state exactly (`pattern`).
fn trace_id(o: &mut Map<String, Value>) -> Result<Option<String>, ApiError> {
    let t = opt_string(o, "trace_id")?;
    if let Some(t) = &t
        && (t.len() > TRACE_ID_MAX || !t.bytes().all(|b| (0x20..=0x7e).contains(&b)))
    {
        return Err(ApiError::bad(
            "trace_id",
            "invalid_field",
            format!("`trace_id` must be printable ASCII, at most {TRACE_ID_MAX} characters"),
        ));
    }
    Ok(t)
}

fn opt_string(o: &mut Map<String, Value>, field: &str) -> Result<Option<String>, ApiError> {
    match o.remove(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(_) => Err(ApiError::bad(
            field,
            "invalid_field",
            format!("`{field}` must be a string"),
        )),
    }
}

fn opt_u64(o: &mut Map<String, Value>, field: &str) -> Result<Option<u64>, ApiError> {
    match o.remove(field) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v.as_u64().map(Some).ok_or_else(|| {
            ApiError::bad(
                field,
                "invalid_field",
                format!("`{field}` must be a non-negative integer"),
            )
        }),
    }
}

/// The longest `wait_ms` of a long-poll (a server may set less: `AppState::max_wait_ms`).
pub const MAX_WAIT_MS: i64 = 60_000;

/// `GET /v1/jobs/{id}[?wait_ms=N]`. With `wait_ms` (0 to the server's maximum, 60,000 by
/// default) a long-poll: it answers as
/// soon as the job is terminal, else at N with its current state (`404` if the ledger has
/// no row for the id even then). It is woken by the job's outcome event
/// ([`crate::waiters`]) and reads the ledger once at the start, once per wake, and once
/// more when the time is up.
pub async fn show(
    State(state): State<Arc<AppState>>,
    PathParam(id): PathParam,
    q: QueryParams,
) -> Result<Response, ApiError> {
    let wait_ms = q.integer("wait_ms", 0..=state.max_wait_ms)?.unwrap_or(0);
    let until = tokio::time::Instant::now() + std::time::Duration::from_millis(wait_ms as u64);
    // Registered before the first read: an outcome recorded in between still wakes it.
    let rec = if wait_ms > 0 {
        let mut waiter = state.waiters.subscribe(&id);
        waiter
            .until_terminal(until, || read_job(&state, &id))
            .await?
    } else {
        read_job(&state, &id).await?
    };
    match rec {
        Some(rec) => Ok(Json(rec).into_response()),
        None => Err(ApiError::NotFound(id)),
    }
}

/// `DELETE /v1/jobs/{id}`: cancel a job (`lastcall_producer::cancel`). `200` with the
/// `cancelled` record when it had not started (no model call); `202` when it is running
/// (its worker is asked to abort the call; the outcome follows, see `?wait_ms`); `409`
/// `already_terminal` naming its state when it had ended (nothing changes); `404` unknown.
pub async fn cancel(
    State(state): State<Arc<AppState>>,
    PathParam(id): PathParam,
) -> Result<Response, ApiError> {
    let now = state.clock.now_ms();
    let out =
        lastcall_producer::cancel::cancel(&state.ledger, &state.events, &state.control, &id, now)
            .await
            .map_err(|e| ApiError::Internal(e.to_string()))?;
    match out {
        CancelOutcome::Cancelled => match read_job(&state, &id).await? {
            Some(rec) => Ok(Json(rec).into_response()),
            None => Err(ApiError::NotFound(id)),
        },
        CancelOutcome::Requested => Ok((
            StatusCode::ACCEPTED,
            Json(json!({
                "job_id": id,
                "state": "running",
                "cancel_requested": true,
                "message": "the job is running: its worker is asked to abort the call; GET /v1/jobs/{id}?wait_ms=N returns the outcome",
            })),
        )
            .into_response()),
        CancelOutcome::AlreadyTerminal(s) => Err(ApiError::AlreadyTerminal { job_id: id, state: s }),
        CancelOutcome::NotFound => Err(ApiError::NotFound(id)),
    }
}

pub(crate) async fn read_job(state: &AppState, id: &str) -> Result<Option<JobRecord>, ApiError> {
    state.http_stats.job_reads.inc();
    state
        .ledger
        .get(id)
        .await
        .map_err(|e| ApiError::Internal(e.to_string()))
}

/// `GET /v1/jobs?state=…&kind=…&limit=…` (limit 1–1000, default 100). Each parameter at
/// most once.
pub async fn list(
    State(state): State<Arc<AppState>>,
    q: QueryParams,
) -> Result<Response, ApiError> {
    let job_state = q.single("state")?.map(str::to_owned);
    if let Some(s) = &job_state
        && s.parse::<JobState>().is_err()
    {
        let names: Vec<&str> = JobState::ALL.iter().map(|s| s.as_str()).collect();
        return Err(ApiError::bad(
            "state",
            "invalid_field",
            format!(
                "unknown state `{}`; one of {}",
                shorten(s),
                names.join(", ")
            ),
        ));
    }
    let kind = q.single("kind")?.map(str::to_owned);
    let limit = q.integer("limit", 1..=1000)?.unwrap_or(100);
    let recs = state
        .ledger
        .list(&ListFilter {
            state: job_state,
            kind,
            limit: Some(limit),
        })
        .await
        .map_err(|e| ApiError::Internal(e.to_string()))?;
    Ok(Json(json!({ "jobs": recs, "count": recs.len() })).into_response())
}
