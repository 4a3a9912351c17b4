//! The one error type of the HTTP API. Every error is a JSON body
//! `{"error": code, "field": name-or-null, "message": text}` ([`ErrorBody`], the document's
//! `Error`); internals are logged, never sent.

use crate::openapi::{ErrorBody, ShedEstimate};
use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

/// The header of a shed job's answer that names the smallest budget the door would admit
/// now, as the body's `min_feasible_budget_ms`.
pub const MIN_BUDGET_HEADER: &str = "x-lastcall-min-budget-ms";

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// 400: a field is missing, of the wrong type or out of range.
    #[error("{message}")]
    BadField {
        field: String,
        code: String,
        message: String,
    },
    /// 401: no or a wrong token (Bearer, or the password of Basic credentials).
    #[error(
        "missing or invalid credentials: send `Authorization: Bearer <token>`, or Basic credentials whose password is the token"
    )]
    Unauthorized,
    /// 403: a credential that may not do this (Basic credentials on a write), or a write
    /// from another origin (`code` says which).
    #[error("{message}")]
    Forbidden { code: &'static str, message: String },
    /// 403: a field the caller's token may not set that way (another tenant than the
    /// token's, a kind the token may not submit).
    #[error("{message}")]
    NotAllowed {
        field: &'static str,
        code: &'static str,
        message: String,
    },
    /// 429: over a quota of the job's tenant (`serve --tokens-file`); nothing was
    /// published or recorded. Answered with `Retry-After`; `field` names the quota.
    #[error("{0}")]
    OverQuota(crate::tokens::QuotaRefusal),
    /// 415: a body that is not declared `application/json`.
    #[error(
        "the `Content-Type` header must be `application/json`{}",
        match .0 { Some(t) => format!(", not `{t}`"), None => " (it is missing)".into() }
    )]
    UnsupportedMediaType(Option<String>),
    /// 404.
    #[error("no job `{0}`")]
    NotFound(String),
    /// 409: the job id was accepted before with a different payload.
    #[error(
        "job `{0}` was already accepted with a different payload; use a new job id for new work"
    )]
    Conflict(String),
    /// 409: a cancellation of a job that has already ended; nothing changed.
    #[error("job `{job_id}` already ended ({state}); nothing was changed")]
    AlreadyTerminal { job_id: String, state: String },
    /// 413: the body exceeds the limit.
    #[error("the request body exceeds {limit} bytes")]
    TooLarge { limit: usize },
    /// 422: a well-formed deadline that cannot be taken at this moment: already passed (after
    /// the clock margin), or an absolute `expires_at_ms` farther ahead than the horizon.
    /// Nothing was published.
    #[error("{message}")]
    Expired {
        field: String,
        code: &'static str,
        message: String,
    },
    /// 429: shedding at the door — the estimated wait in the queue (ready ÷ recent ack
    /// rate) plus the job's minimum runtime exceeds its budget; nothing was published or
    /// recorded. Answered with `Retry-After`, the numbers as `estimate`, and the smallest
    /// budget admitted now as `min_feasible_budget_ms` and [`MIN_BUDGET_HEADER`].
    #[error("{message}")]
    WouldExpireInQueue {
        message: String,
        retry_after_s: u64,
        estimate: ShedEstimate,
    },
    /// 503: the model server of the job's kind is down for every live worker (their
    /// circuit breakers, from the ledger); nothing was published or recorded. Answered with
    /// `Retry-After`: the seconds until the breakers' next trial.
    #[error("{message}")]
    UpstreamUnavailable { message: String, retry_after_s: u64 },
    /// 503: the broker did not confirm (timeout, nack, connection); the job is not accepted.
    #[error("{0}")]
    Unavailable(String),
    /// 503: the ledger did not answer or refused the write; nothing was published. The
    /// database's error is logged, never sent.
    #[error(
        "not accepted: the ledger is unavailable, nothing was published or recorded for this job id; retry later with the same job_id"
    )]
    LedgerUnavailable,
    /// 503: every permit to wait for an outcome is taken ([`crate::AppState::waiting`]);
    /// answered with `Retry-After: 1`.
    #[error(
        "too many requests wait for an outcome on this server at once (serve --max-waiting); retry shortly, or read the job without waiting"
    )]
    TooManyWaiting,
    /// 429: the caller's tenant already holds as many of a shared resource as its
    /// tokens-file entry allows (`field`: `max_waiting`, `max_streams`, `max_requests`);
    /// answered with `Retry-After: 1`. Nothing was published or recorded.
    #[error(
        "tenant `{tenant}` already holds {limit} {what} at once, its limit (`{field}` in the tokens file); retry when one ends"
    )]
    TenantLimit {
        tenant: String,
        field: &'static str,
        what: &'static str,
        limit: usize,
    },
    /// 408: the request body did not arrive within the body-read timeout
    /// (`serve --body-read-timeout-ms`); the connection is closed.
    #[error(
        "the request body did not arrive within {0} ms (serve --body-read-timeout-ms); send it at once"
    )]
    BodyTimeout(u64),
    /// 503: `serve` is listening but still waiting for its broker or ledger
    /// (`crate::starting`); answered with `Retry-After: 1`.
    #[error("{0}")]
    Starting(String),
    /// 500: logged in full, answered without detail.
    #[error("internal error")]
    Internal(String),
    /// Any other refusal by the HTTP layer itself (a method the route does not have, a
    /// rejection of axum's own): its status, a code, and the reason.
    #[error("{message}")]
    Http {
        status: StatusCode,
        code: &'static str,
        message: String,
    },
}

impl ApiError {
    /// `415` unless `headers` declare a JSON body (`application/json`, parameters such as
    /// `; charset=utf-8` allowed). A form or `text/plain` body is what another site's page
    /// can send without a CORS preflight; JSON it cannot.
    pub fn require_json(headers: &axum::http::HeaderMap) -> Result<(), ApiError> {
        let value = headers.get(axum::http::header::CONTENT_TYPE);
        let essence = value.and_then(|v| v.to_str().ok()).map(|v| {
            v.split(';')
                .next()
                .unwrap_or("")
                .trim()
                .to_ascii_lowercase()
        });
        match essence.as_deref() {
            Some("application/json") => Ok(()),
            _ => Err(ApiError::UnsupportedMediaType(value.map(|v| {
                crate::params::shorten(&String::from_utf8_lossy(v.as_bytes()))
            }))),
        }
    }

    pub fn bad(field: &str, code: &str, message: impl Into<String>) -> Self {
        ApiError::BadField {
            field: field.to_owned(),
            code: code.to_owned(),
            message: message.into(),
        }
    }

    /// Any HTTP-level refusal as the JSON error: the code follows the status.
    pub fn http(status: StatusCode, message: impl Into<String>) -> Self {
        let code = match status {
            StatusCode::BAD_REQUEST => "bad_request",
            StatusCode::NOT_FOUND => "not_found",
            StatusCode::METHOD_NOT_ALLOWED => "method_not_allowed",
            StatusCode::PAYLOAD_TOO_LARGE => "body_too_large",
            StatusCode::UNSUPPORTED_MEDIA_TYPE => "unsupported_media_type",
            StatusCode::UNPROCESSABLE_ENTITY => "unprocessable",
            s if s.is_server_error() => "internal",
            _ => "http_error",
        };
        ApiError::Http {
            status,
            code,
            message: message.into(),
        }
    }

    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::BadField { .. } => StatusCode::BAD_REQUEST,
            ApiError::Unauthorized => StatusCode::UNAUTHORIZED,
            ApiError::Forbidden { .. } | ApiError::NotAllowed { .. } => StatusCode::FORBIDDEN,
            ApiError::UnsupportedMediaType(_) => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            ApiError::NotFound(_) => StatusCode::NOT_FOUND,
            ApiError::Conflict(_) | ApiError::AlreadyTerminal { .. } => StatusCode::CONFLICT,
            ApiError::TooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::Expired { .. } => StatusCode::UNPROCESSABLE_ENTITY,
            ApiError::WouldExpireInQueue { .. }
            | ApiError::OverQuota(_)
            | ApiError::TenantLimit { .. } => StatusCode::TOO_MANY_REQUESTS,
            ApiError::BodyTimeout(_) => StatusCode::REQUEST_TIMEOUT,
            ApiError::Unavailable(_)
            | ApiError::UpstreamUnavailable { .. }
            | ApiError::LedgerUnavailable
            | ApiError::TooManyWaiting
            | ApiError::Starting(_) => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
            ApiError::Http { status, .. } => *status,
        }
    }

    pub(crate) fn code(&self) -> &str {
        match self {
            ApiError::BadField { code, .. } => code,
            ApiError::Unauthorized => "unauthorized",
            ApiError::Forbidden { code, .. } | ApiError::NotAllowed { code, .. } => code,
            ApiError::OverQuota(_) => "over_quota",
            ApiError::UnsupportedMediaType(_) => "unsupported_media_type",
            ApiError::NotFound(_) => "not_found",
            ApiError::Conflict(_) => "job_id_conflict",
            ApiError::AlreadyTerminal { .. } => "already_terminal",
            ApiError::TooLarge { .. } => "body_too_large",
            ApiError::Expired { code, .. } => code,
            ApiError::WouldExpireInQueue { .. } => "would_expire_in_queue",
            ApiError::Unavailable(_) => "broker_unavailable",
            ApiError::UpstreamUnavailable { .. } => "upstream_unavailable",
            ApiError::LedgerUnavailable => "ledger_unavailable",
            ApiError::TooManyWaiting => "too_many_waiting",
            ApiError::TenantLimit { .. } => "tenant_limit",
            ApiError::BodyTimeout(_) => "body_read_timeout",
            ApiError::Starting(_) => "starting",
            ApiError::Internal(_) => "internal",
            ApiError::Http { code, .. } => code,
        }
    }

    /// Shed at the door: the smallest budget it would admit now
    /// (`lastcall_producer::shed::ShedEstimate::min_feasible_budget_ms`).
    pub(crate) fn min_feasible_budget_ms(&self) -> Option<u64> {
        match self {
            ApiError::WouldExpireInQueue { estimate, .. } => Some(estimate.min_feasible_budget_ms),
            _ => None,
        }
    }

    pub(crate) fn field(&self) -> Option<&str> {
        match self {
            ApiError::BadField { field, .. } | ApiError::Expired { field, .. } => Some(field),
            ApiError::NotAllowed { field, .. } => Some(field),
            ApiError::OverQuota(r) => Some(r.quota),
            ApiError::TenantLimit { field, .. } => Some(field),
            ApiError::BodyTimeout(_) => Some("body"),
            ApiError::Conflict(_) => Some("job_id"),
            ApiError::UnsupportedMediaType(_) => Some("Content-Type"),
            _ => None,
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        if let ApiError::Internal(detail) = &self {
            tracing::error!(error = %detail, "internal error answering an HTTP request");
        }
        let status = self.status();
        let body = ErrorBody {
            error: self.code().to_owned(),
            field: self.field().map(str::to_owned),
            message: self.to_string(),
            estimate: match &self {
                ApiError::WouldExpireInQueue { estimate, .. } => Some(estimate.clone()),
                _ => None,
            },
            state: match &self {
                ApiError::AlreadyTerminal { state, .. } => Some(state.clone()),
                _ => None,
            },
            min_feasible_budget_ms: self.min_feasible_budget_ms(),
        };
        let mut resp = (status, Json(body)).into_response();
        let retry_after = match &self {
            ApiError::WouldExpireInQueue { retry_after_s, .. } => Some(*retry_after_s),
            ApiError::OverQuota(r) => Some(r.retry_after_s),
            ApiError::UpstreamUnavailable { retry_after_s, .. } => Some(*retry_after_s),
            _ => None,
        };
        if let Some(retry_after_s) = retry_after {
            resp.headers_mut().insert(
                axum::http::header::RETRY_AFTER,
                axum::http::HeaderValue::from(retry_after_s),
            );
        }
        if let Some(ms) = self.min_feasible_budget_ms() {
            resp.headers_mut()
                .insert(MIN_BUDGET_HEADER, axum::http::HeaderValue::from(ms));
        }
        if let ApiError::BodyTimeout(_) = &self {
            resp.headers_mut().insert(
                axum::http::header::CONNECTION,
                axum::http::HeaderValue::from_static("close"),
            );
        }
        if let ApiError::Starting(_) | ApiError::TooManyWaiting | ApiError::TenantLimit { .. } =
            &self
        {
            resp.headers_mut().insert(
                axum::http::header::RETRY_AFTER,
                axum::http::HeaderValue::from(1u64),
            );
        }
        if status == StatusCode::UNAUTHORIZED {
            // Basic first: a browser answers it with a login prompt (the password is the
            // token); API clients use the Bearer scheme.
            for challenge in [
                r#"Basic realm="lastcall", charset="UTF-8""#,
                r#"Bearer realm="lastcall""#,
            ] {
                resp.headers_mut().append(
                    axum::http::header::WWW_AUTHENTICATE,
                    axum::http::HeaderValue::from_static(challenge),
                );
            }
        }
        resp
    }
}
