//! `POST /v1/jobs`, `GET /v1/jobs/{id}`, `GET /v1/jobs?state=…&kind=…`.

use crate::AppState;
use crate::auth::Caller;
use crate::error::ApiError;
use crate::openapi::{Accepted, CancelRequested, JobList, Running, ShedEstimate};
use crate::params::{PathParam, QueryParams, shorten};
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use lastcall_broker::PublishError;
use lastcall_core::request_size::forwarded_tokens;
use lastcall_core::{Priority, RejectReason, State as JobState};
use lastcall_producer::{DeadlineSpec, NewJob, Submission, SubmitError};
use lastcall_store::{CancelOutcome, JobRecord, ListFilter};
use serde_json::{Map, Value};
use std::sync::Arc;

/// `POST /v1/jobs`: validate, stamp the tenant (the caller's token's, or the body's),
/// check the kind the token may submit and the tenant's quotas (`429 over_quota` with
/// `Retry-After`), stamp the deadline, shed a job the queue wait would make
/// expire (`429 would_expire_in_queue` with `Retry-After`, when the submitter sheds), claim
/// the id, publish with confirm, stamp `accepted` (or release the claim and answer 503).
#[utoipa::path(
    post,
    path = "/v1/jobs",
    operation_id = "submitJob",
    summary = "Validate, stamp the deadline, claim the job id, publish with confirm, record accepted",
    description = "",
    request_body(content = crate::openapi::NewJob, content_type = "application/json"),
    responses(
        (status = 200, description = "The job id already has an outcome (with the same payload, or recorded by a worker): nothing is published; the answer carries `duplicate: true` and the terminal state", body = crate::openapi::Accepted),
        (status = 202, description = "Claimed in the ledger, published, confirmed by the broker and recorded as accepted. The same job id with the same payload again (also concurrently) is answered `duplicate: true` with the ledger's state and is not published twice", body = crate::openapi::Accepted, headers(("Location" = String))),
        (status = 400, description = "The body breaks the document: not JSON, not an object, a field missing, of the wrong type or outside its bounds (`deadline_ms` above the horizon, `min_runtime_ms` above the horizon, a `job_id` or `kind` outside its pattern), or both or neither of `deadline_ms` and `expires_at_ms`. `error` is the reason (`missing_field`, `invalid_field`, `invalid_json`, `not_an_object`, `deadline_beyond_horizon`), `field` names the field", body = crate::openapi::ErrorBody),
        (status = 401, response = crate::openapi::Unauthorized),
        (status = 403, response = crate::openapi::Forbidden),
        (status = 408, response = crate::openapi::SlowBody),
        (status = 409, description = "The job id was accepted before (or is being accepted concurrently) with a different payload. A token of the tokens file names its jobs in its tenant's namespace (`<tenant>:<job_id>`), so another tenant's job is never a conflict", body = crate::openapi::ErrorBody),
        (status = 413, response = crate::openapi::TooLarge),
        (status = 415, response = crate::openapi::NotJson),
        (status = 422, description = "The deadline is well-formed but the clock refuses it, nothing was published: it has already passed or lies within the clock margin (`already_expired`; also a `deadline_ms` shorter than the margin), or an `expires_at_ms` lies farther ahead than the horizon (`deadline_beyond_horizon`). `field` names the deadline field the request sent; or a `callback_url` this server does not allow (`callback_not_allowed`, `field` is `callback_url`)", body = crate::openapi::ErrorBody),
        (status = 429, description = "With a token of the tokens file, its tenant holds as many requests in flight as its `max_requests` (`tenant_limit`, `Retry-After: 1`); or over a quota of the job's tenant (`over_quota`, `field` names the quota: `jobs_per_second` or `tokens_per_minute`, the tokens estimated as the characters of the payload's JSON — everything forwarded to the model — ÷ 4, at least the prompt's chars ÷ 4 + 4 per message), nothing published or recorded, `Retry-After` in whole seconds; or shed at the door, nothing published or recorded: the job's call time (its `min_runtime_ms`, else the one the workers learned for its kind) plus the clock margin exceeds the budget it has left, so it cannot finish even if started now (any tier); or, by tier, the estimated wait (`critical`: none, the workers serve it first; `standard`: its queue's; `batch`: its lane's plus the work queue's `standard` backlog, served before it) in the work queue (the messages ready that a worker will still reach in time ÷ the pace the workers take them at, from live counts of the queue, with RabbitMQ's management API standing in until a pace is measured) plus the job's call time (its `min_runtime_ms`, else the one the workers learned for its kind) and the clock margin exceeds the budget it has left, so it would expire before a worker could start it. `error` is `would_expire_in_queue`; `message` and `estimate` name the numbers, and `min_feasible_budget_ms` (also the `X-Lastcall-Min-Budget-Ms` header) the smallest budget the door would admit now. Retry after `Retry-After` seconds (when the queue, draining at that rate, would leave room for the same budget) or at once with `deadline_ms` at least `min_feasible_budget_ms`. Never answered when the queue has nothing ready, when there is no pace and no recent ack rate (no consumer, idle queue), when neither the broker's count nor the management API answers (fail open), or with `serve --no-shed`", body = crate::openapi::ErrorBody, headers(("Retry-After" = inline(crate::openapi::RetryAfter), description = "Seconds until the queue, draining at its recent pace, would leave room for the same budget (1–3600)"), ("X-Lastcall-Min-Budget-Ms" = inline(crate::openapi::MinBudget), description = "With `would_expire_in_queue`: the smallest budget, in ms, the door would admit now (as the body's `min_feasible_budget_ms`)"))),
        (status = 503, description = "Not accepted, nothing recorded for the job id: the model server of the job's kind is down for every live worker (`upstream_unavailable`: their circuit breakers are open; nothing published; `Retry-After`: seconds until the breakers' next trial call, at least 1), the broker did not confirm in time (the message may still reach the queue: retry with the same job_id), refused it (nack), the ledger is unavailable, or a concurrent request with the same job id is still being published", body = crate::openapi::ErrorBody, headers(("Retry-After" = inline(crate::openapi::RetryAfter), description = "With `upstream_unavailable`: seconds until the workers' circuit breakers let a trial call through (1–3600)"))),
    ),
)]
pub async fn create(
    State(state): State<Arc<AppState>>,
    Extension(caller): Extension<Caller>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    ApiError::require_json(&headers)?;
    let bytes = read_body(&state, &headers, body).await?;
    let (mut job, callback, tags) = parse_request_with_callback(&bytes)?;
    let tenant = caller.job_tenant(tags.tenant.as_deref(), "tenant")?;
    caller.check_kind(&job.kind)?;
    let priority = caller.job_priority(tags.priority, "priority")?;
    job.job_id = Some(caller.new_job_id(job.job_id.as_deref(), "job_id")?);
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
    let env = tagged(env, tenant, priority);
    let job_id = env.job_id().to_string();
    // The tenant's quotas, before anything is claimed or published: everything the
    // payload forwards to the model counts.
    let tokens = forwarded_tokens(&env.payload);
    state.admit_quota(env.tenant(), tokens)?;

    // Claim the id in the ledger, publish with confirm, stamp or release the claim: the
    // same id again (even concurrently, even from another `serve`) is published at most
    // once; the same payload is answered idempotently, a different one is a conflict.
    // The webhook is registered by the claimant only, between its claim and its publish:
    // no outcome comes first, and a refused request (409, a duplicate, 429, 503) never
    // changes the callback of the job that holds the id.
    let register = async || match &callback {
        Some(url) => {
            state
                .ledger
                .register_webhook(&job_id, url.as_str(), now)
                .await
        }
        None => Ok(()),
    };
    // The idempotency scope (part of the fingerprint with the kind, the payload and the
    // minimum runtime): the token's tenant and this route.
    let scope = format!("{}|jobs", caller.scope(&state.token, env.tenant()));
    let submitted = state
        .submitter
        .submit_once_scoped(&env, now, state.claim_wait, &scope, register)
        .await;
    if let (Err(SubmitError::Publish(_)), Some(url)) = (&submitted, &callback) {
        // The claim was released: so is the webhook, unless a worker holds the job.
        if let Err(e) = state.ledger.unregister_webhook(&job_id, url.as_str()).await {
            tracing::warn!(job_id = %job_id, error = %e, "cannot remove the webhook of a job not accepted");
        }
    }
    match submitted {
        Ok(Submission::Published(s)) => {
            state.http_stats.accepted_for(env.tenant());
            Ok(accepted(Accepted {
                created_at_ms: Some(s.created_at_ms),
                expires_at_ms: Some(s.expires_at_ms),
                ttl_ms: Some(s.ttl_ms),
                ..Accepted::new(s.job_id, "accepted")
            }))
        }
        Ok(Submission::Duplicate(rec)) => {
            let body = Accepted {
                expires_at_ms: rec.expires_at_ms,
                duplicate: Some(true),
                ..Accepted::new(job_id, rec.state.clone())
            };
            // A job that already has its outcome is not "accepted" again: 200 with the
            // outcome, nothing published.
            let finished = rec
                .state
                .parse::<lastcall_core::State>()
                .is_ok_and(|s| s.is_terminal());
            Ok(if finished {
                (StatusCode::OK, Json(body)).into_response()
            } else {
                accepted(body)
            })
        }
        Err(SubmitError::Ledger(e)) => {
            // Published and confirmed: the job will run. Say so rather than invite a retry.
            tracing::error!(job_id = %job_id, error = %e, "published, but recording `accepted` failed");
            Ok(accepted(Accepted {
                expires_at_ms: Some(env.deadline().expires_at_ms()),
                ledger_recorded: Some(false),
                warning: Some("published and confirmed, but the ledger write failed; reconciliation cannot see this job".into()),
                ..Accepted::new(job_id, "accepted")
            }))
        }
        Err(e) => {
            if matches!(
                e,
                SubmitError::WouldExpireInQueue(_) | SubmitError::UpstreamUnavailable { .. }
            ) {
                state.http_stats.shed.inc();
            }
            Err(submit_error(e, spec))
        }
    }
}

/// `env` for `tenant` at `priority`, written into the body only when they say something:
/// a job of tenant `default` at the default tier is the same message an old producer
/// sends.
pub(crate) fn tagged(
    env: lastcall_core::Envelope,
    tenant: lastcall_core::Tenant,
    priority: Option<Priority>,
) -> lastcall_core::Envelope {
    let env = if tenant.as_str() == lastcall_core::Tenant::DEFAULT {
        env
    } else {
        env.with_tenant(tenant)
    };
    match priority {
        Some(p) => env.with_priority(p),
        None => env,
    }
}

/// A request body of at most `serve --max-body-bytes`: `413` as soon as its
/// `Content-Length` says more, or once more arrived; `408 body_read_timeout` when it has
/// not all arrived within `serve --body-read-timeout-ms` (a client sending slowly holds a
/// connection and a task no longer).
pub(crate) async fn read_body(
    state: &AppState,
    headers: &HeaderMap,
    body: Body,
) -> Result<axum::body::Bytes, ApiError> {
    let limit = state.max_body_bytes;
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    if declared.is_some_and(|n| n > limit) {
        return Err(ApiError::TooLarge { limit });
    }
    let timeout = state.body_read_timeout;
    tokio::time::timeout(timeout, axum::body::to_bytes(body, limit))
        .await
        .map_err(|_| ApiError::BodyTimeout(timeout.as_millis() as u64))?
        .map_err(|_| ApiError::TooLarge { limit })
}

fn accepted(body: Accepted) -> Response {
    let location = format!("/v1/jobs/{}", body.job_id);
    let mut resp = (StatusCode::ACCEPTED, Json(body)).into_response();
    if let Ok(v) = location.parse() {
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
            estimate: ShedEstimate {
                queue_wait_ms: est.queue_wait_ms,
                ready: est.ready,
                doomed: est.doomed,
                ack_rate_per_s: est.ack_rate_per_s,
                min_runtime_ms: est.min_runtime_ms,
                remaining_ms: est.remaining_ms,
                retry_after_s: est.retry_after_s,
                min_feasible_budget_ms: est.min_feasible_budget_ms,
            },
        },
        e @ SubmitError::UpstreamUnavailable { retry_after_s, .. } => {
            ApiError::UpstreamUnavailable {
                message: e.to_string(),
                retry_after_s,
            }
        }
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
        e @ SubmitError::InFlight { .. } => ApiError::Unavailable(e.to_string()),
        SubmitError::Unrecorded(e) => {
            // The database's own words stay in the log: they name hosts, files, users.
            tracing::error!(error = %e, "the ledger refused the claim of a job id: answered 503");
            ApiError::LedgerUnavailable
        }
        SubmitError::Ledger(l) => ApiError::Internal(l.to_string()),
    }
}

/// The request body of `POST /v1/jobs`, checked field by field so that errors name the
/// field.
pub fn parse_request(body: &[u8]) -> Result<NewJob, ApiError> {
    parse_request_with_callback(body).map(|(job, _, _)| job)
}

/// The optional `tenant` and `priority` of a request body (checked when stamped).
#[derive(Debug, Default)]
pub(crate) struct Tags {
    pub tenant: Option<String>,
    pub priority: Option<Priority>,
}

/// [`parse_request`], the optional `callback_url` (a string of at most 2,048 bytes) and
/// the optional `tenant` and `priority`.
fn parse_request_with_callback(body: &[u8]) -> Result<(NewJob, Option<String>, Tags), ApiError> {
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
    let tenant = opt_string(&mut o, "tenant")?;
    let priority = match opt_string(&mut o, "priority")? {
        Some(p) => Some(p.parse::<Priority>().map_err(|e| {
            ApiError::bad("priority", "invalid_field", format!("`priority` {}", e.0))
        })?),
        None => None,
    };
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
        Tags { tenant, priority },
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

/// An optional non-negative integer. A number with a zero fraction (`40.0`) is the
/// integer it equals, as JSON Schema counts it (the document is OpenAPI 3.1, whose
/// `"type": "integer"` takes `40.0`).
fn opt_u64(o: &mut Map<String, Value>, field: &str) -> Result<Option<u64>, ApiError> {
    match o.remove(field) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => integral(&v).map(Some).ok_or_else(|| {
            ApiError::bad(
                field,
                "invalid_field",
                format!("`{field}` must be a non-negative integer"),
            )
        }),
    }
}

fn integral(v: &Value) -> Option<u64> {
    v.as_u64().or_else(|| {
        let f = v.as_f64()?;
        // `u64::MAX as f64` is 2^64, one above the largest u64.
        (f.fract() == 0.0 && (0.0..u64::MAX as f64).contains(&f)).then_some(f as u64)
    })
}

/// The longest `wait_ms` of a long-poll (a server may set less: `AppState::max_wait_ms`).
pub const MAX_WAIT_MS: i64 = 60_000;

/// `GET /v1/jobs/{id}[?wait_ms=N]`. With `wait_ms` (0 to the server's maximum, 60,000 by
/// default) a long-poll: it answers as
/// soon as the job is terminal, else at N with its current state (`404` if the ledger has
/// no row for the id even then). It is woken by the job's outcome event
/// ([`crate::waiters`]) and reads the ledger once at the start, once per wake, and once
/// more when the time is up.
#[utoipa::path(
    get,
    path = "/v1/jobs/{id}",
    operation_id = "getJob",
    summary = "One job's record; with wait_ms, wait for its outcome (long-poll)",
    description = "Without `wait_ms` the record as the ledger holds it now. With `wait_ms` (0 to this server's maximum, 60000 unless `serve --max-wait-ms` lowers it) a long-poll: the answer comes as soon as the job is terminal (woken by its outcome event on `{prefix}.events`, not by polling the ledger), or after `wait_ms` with the job's current state; `404` only if the ledger has no row for the id even then.",
    params(
        ("id" = String, Path),
        ("wait_ms" = Option<i64>, Query, nullable = false, minimum = 0, maximum = 60000, description = "Wait up to this many ms for the job to reach a terminal state (long-poll). 0 or absent: answer at once."),
    ),
    responses(
        (status = 200, description = "The record", body = crate::openapi::JobRecord),
        (status = 400, description = "The path parameter cannot be decoded (percent-encoding that is not UTF-8; `field` is `id`), or `wait_ms` is not an integer from 0 to this server's maximum or is given twice (`field` is `wait_ms`)", body = crate::openapi::ErrorBody),
        (status = 401, response = crate::openapi::Unauthorized),
        (status = 404, description = "No such job (after waiting, with `wait_ms`). With a token of the tokens file the id is read in its tenant's namespace (`<tenant>:<id>`), and another tenant's job is answered exactly as a missing one, after the whole `wait_ms`", body = crate::openapi::ErrorBody),
        (status = 503, description = "With `wait_ms`: as many requests as this server lets wait at once already wait (`too_many_waiting`, `serve --max-waiting`; `Retry-After`); read without `wait_ms` or retry", body = crate::openapi::ErrorBody),
        (status = 500, response = crate::openapi::LedgerError),
    ),
)]
pub async fn show(
    State(state): State<Arc<AppState>>,
    Extension(caller): Extension<Caller>,
    PathParam(id): PathParam,
    q: QueryParams,
) -> Result<Response, ApiError> {
    let wait_ms = q.integer("wait_ms", 0..=state.max_wait_ms)?.unwrap_or(0);
    let until = tokio::time::Instant::now() + std::time::Duration::from_millis(wait_ms as u64);
    let key = caller.job_id(&id);
    // Another tenant's job reads as none at every read, so a long-poll on it waits the
    // whole `wait_ms` like one on a missing id.
    let read = || async {
        Ok::<_, ApiError>(
            read_job(&state, &key)
                .await?
                .filter(|r| visible(&caller, r)),
        )
    };
    // Registered before the first read: an outcome recorded in between still wakes it.
    let rec = if wait_ms > 0 {
        let _permit = state.wait_permit(&caller)?;
        let mut waiter = state.waiters.subscribe(&key);
        waiter.until_terminal(until, read).await?
    } else {
        read().await?
    };
    match rec {
        Some(rec) => Ok(Json(rec).into_response()),
        None => Err(ApiError::NotFound(id)),
    }
}

/// Whether `caller` may see `rec`: a tenant's token sees only its tenant's jobs (another
/// tenant's job is "no such job", its existence not revealed).
pub(crate) fn visible(caller: &Caller, rec: &JobRecord) -> bool {
    caller.tenant().is_none_or(|t| t == rec.tenant)
}

/// `DELETE /v1/jobs/{id}`: cancel a job (`lastcall_producer::cancel`). `200` with the
/// `cancelled` record when it had not started (no model call); `202` when it is running
/// (its worker is asked to abort the call; the outcome follows, see `?wait_ms`); `409`
/// `already_terminal` naming its state when it had ended (nothing changes); `404` unknown.
#[utoipa::path(
    delete,
    path = "/v1/jobs/{id}",
    operation_id = "cancelJob",
    summary = "Cancel a job",
    description = "A job that has not started ends `cancelled` at once, with no model call (`200`, its record; a worker that receives it later acks it without a call). A running job's worker is asked to abort the call through the backend's cancellation and records `cancelled` (`202`; `GET /v1/jobs/{id}?wait_ms=N` returns the outcome). A job that has already ended is left as it is (`409` `already_terminal`, with its `state`).",
    params(("id" = String, Path)),
    responses(
        (status = 200, description = "Cancelled before it started: the record (state `cancelled`, reason `cancelled_before_start`)", body = crate::openapi::JobRecord),
        (status = 202, description = "The job is running: its worker is asked to abort the call", body = inline(crate::openapi::CancelRequested)),
        (status = 400, description = "The path parameter cannot be decoded (percent-encoding that is not UTF-8); `field` is `id`", body = crate::openapi::ErrorBody),
        (status = 401, response = crate::openapi::Unauthorized),
        (status = 403, response = crate::openapi::Forbidden),
        (status = 404, description = "No such job", body = crate::openapi::ErrorBody),
        (status = 409, description = "The job has already ended (`already_terminal`; `state` names its outcome); nothing changed", body = crate::openapi::ErrorBody),
        (status = 500, response = crate::openapi::LedgerError),
    ),
)]
pub async fn cancel(
    State(state): State<Arc<AppState>>,
    Extension(caller): Extension<Caller>,
    PathParam(id): PathParam,
) -> Result<Response, ApiError> {
    let id = caller.job_id(&id);
    if caller.tenant().is_some()
        && !read_job(&state, &id)
            .await?
            .is_some_and(|r| visible(&caller, &r))
    {
        return Err(ApiError::NotFound(id));
    }
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
            Json(CancelRequested {
                job_id: id,
                state: Running::Running,
                cancel_requested: true,
                message: "the job is running: its worker is asked to abort the call; GET /v1/jobs/{id}?wait_ms=N returns the outcome",
            }),
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

/// `GET /v1/jobs?state=…&kind=…&tenant=…&limit=…` (limit 1–1000, default 100). Each
/// parameter at most once. A tenant's token lists only its tenant's jobs.
#[utoipa::path(
    get,
    path = "/v1/jobs",
    operation_id = "listJobs",
    summary = "List job records",
    description = "",
    params(crate::openapi::ListParams),
    responses(
        (status = 200, description = "Records", body = inline(crate::openapi::JobList)),
        (status = 400, description = "An unknown `state`, a `tenant` outside its pattern, a `limit` that is not an integer from 1 to 1000, or a parameter given more than once; `field` names it", body = crate::openapi::ErrorBody),
        (status = 401, response = crate::openapi::Unauthorized),
        (status = 403, response = crate::openapi::Forbidden),
        (status = 500, response = crate::openapi::LedgerError),
    ),
)]
pub async fn list(
    State(state): State<Arc<AppState>>,
    Extension(caller): Extension<Caller>,
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
    let named = q.single("tenant")?;
    // A tenant's token: its own tenant (another is refused); the operator: any, or all.
    let tenant = match (named, caller.tenant()) {
        (None, None) => None,
        (named, _) => Some(caller.job_tenant(named, "tenant")?.as_str().to_owned()),
    };
    let limit = q.integer("limit", 1..=1000)?.unwrap_or(100);
    let recs = state
        .ledger
        .list(&ListFilter {
            state: job_state,
            kind,
            tenant,
            limit: Some(limit),
        })
        .await
        .map_err(|e| ApiError::Internal(e.to_string()))?;
    Ok(Json(JobList {
        count: recs.len(),
        jobs: recs,
    })
    .into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A job of tenant `default` at the default tier is published as an old producer's:
    /// neither field in the body; anything else is written.
    #[test]
    fn only_a_tenant_or_tier_that_says_something_is_written() {
        let body = br#"{"schema_version":1,"job_id":"j","kind":"k","created_at_ms":0,"expires_at_ms":1000,"payload":{}}"#;
        let env = || {
            lastcall_core::Envelope::parse(body, &lastcall_core::EnvelopeLimits::default(), 0)
                .unwrap()
        };
        let default = lastcall_core::Tenant::default_tenant;
        let plain = tagged(env(), default(), None).to_json();
        assert!(plain.get("tenant").is_none() && plain.get("priority").is_none());
        let team = lastcall_core::Tenant::parse("team-a").unwrap();
        let tagged_env = tagged(env(), team, Some(Priority::Batch));
        assert_eq!(
            (tagged_env.tenant(), tagged_env.priority()),
            ("team-a", Priority::Batch)
        );
        let explicit = tagged(env(), default(), Some(Priority::Standard)).to_json();
        assert_eq!(explicit["priority"], "standard");
        assert!(explicit.get("tenant").is_none());
    }

    /// `40.0` is the integer 40 (JSON Schema's reading, which the 3.1 document follows);
    /// `40.5`, `-1` and `1e20` are no deadline.
    #[test]
    fn a_whole_number_with_a_fraction_part_is_an_integer() {
        let body = |d: &str| format!(r#"{{"kind": "k", "payload": {{}}, "deadline_ms": {d}}}"#);
        let job = parse_request(body("40.0").as_bytes()).unwrap();
        assert!(matches!(job.deadline, DeadlineSpec::RelativeMs(40)));
        for bad in ["40.5", "-1", "-1.0", "1e20", "\"40\""] {
            let e = parse_request(body(bad).as_bytes()).unwrap_err();
            assert_eq!(e.field(), Some("deadline_ms"), "{bad}");
        }
    }
}
