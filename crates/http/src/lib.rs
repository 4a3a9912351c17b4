//! The HTTP surface of lastcall — the only crate that knows axum.
//!
//! # Layout
//! - [`app`]: the router of `lastcall serve`: the job ingress API (`/v1/jobs`), the
//!   dashboard (`/` and `/v1/dashboard`), `/metrics`, `/openapi.json` and `/healthz`.
//!   Tests call it without a socket.
//! - [`metrics_app`]: `/metrics` and `/healthz` alone, for `lastcall worker --metrics-addr`.
//! - `jobs.rs`: the ingress handlers; `error.rs`: the one error type ([`ApiError`]) that
//!   becomes a JSON response naming the field; `params.rs`: query and path parameters read
//!   into that error (never axum's plain-text rejections); [`auth`]: the token as Bearer or
//!   Basic credentials (constant time).
//! - [`OPENAPI`]: the document, served at `/openapi.json` with this server's limits filled
//!   in; `crates/http/tests/contract.rs` runs schemathesis against the served document.
//! - [`metrics`]: `/metrics` from one `prometheus-client` registry per process (bounded
//!   labels), and the readiness checks of `/readyz`.
//! - [`depth`]: broker queue depths (management API, else a passive declare).
//! - [`dashboard`]: the page and its JSON.
//!
//! **Boundary:** handlers only call `lastcall_producer::Submitter` (validate, stamp,
//! publish with confirm, record `accepted`) and read the ledger; they make no decision of
//! their own about deadlines.

pub mod auth;
pub mod dashboard;
pub mod depth;
mod error;
pub mod front_door;
mod front_door_stream;
mod jobs;
pub mod metrics;
mod params;
pub mod tls;
pub mod waiters;
pub mod webhooks;

pub use auth::{Token, TokenError};
pub use error::ApiError;
pub use jobs::parse_request;
pub use metrics::{HttpStats, MetricsSource};

use axum::Router;
use axum::extract::{MatchedPath, Request, State};
use axum::http::header;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use lastcall_broker::Names;
use lastcall_clock::Clock;
use lastcall_producer::Submitter;
use lastcall_store::Ledger;
use std::net::SocketAddr;
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

/// The OpenAPI 3 document of the API (hand-written; validated by the tests). `/openapi.json`
/// serves it with this server's horizon and body limit (see [`AppState::horizon_ms`]).
pub const OPENAPI: &str = include_str!("../assets/openapi.json");

/// Everything the handlers share.
pub struct AppState {
    pub submitter: Submitter,
    pub ledger: Arc<Ledger>,
    pub clock: Arc<dyn Clock>,
    pub token: Token,
    pub names: Names,
    /// Largest accepted request body, in bytes (`413` above it).
    pub max_body_bytes: usize,
    /// The submitter's horizon (`EnvelopeLimits::horizon_ms`): the farthest a deadline may
    /// lie ahead. `/openapi.json` states it as the maximum of `deadline_ms` and
    /// `min_runtime_ms`, so it must be the horizon the submitter was built with. Default
    /// 24 h, as `EnvelopeLimits::default()`.
    pub horizon_ms: i64,
    /// Broker queue depths for `/metrics` and the dashboard.
    pub depth: Option<depth::DepthProbe>,
    /// Worker `/metrics` URLs the dashboard sums for "waiting for a slot" and "running".
    pub worker_metrics: Vec<String>,
    /// What `/metrics` renders besides the HTTP counters.
    pub metrics: MetricsSource,
    pub http_stats: Arc<HttpStats>,
    pub http_client: reqwest::Client,
    /// How long a `POST /v1/jobs` waits for a concurrent request's pending publish of the
    /// same job id before answering 503 (a little above the publisher's confirm timeout).
    pub claim_wait: std::time::Duration,
    /// Long-polls waiting for outcome events (`GET /v1/jobs/{id}?wait_ms=N`); `serve`
    /// feeds it from `{prefix}.events` ([`waiters`]).
    pub waiters: Arc<waiters::Waiters>,
    /// The longest `wait_ms` a long-poll may ask for (`serve --max-wait-ms`, default and
    /// at most 60 s); `/openapi.json` states it.
    pub max_wait_ms: i64,
    /// Where `DELETE /v1/jobs/{id}` announces a job cancelled before its start
    /// (`{prefix}.events`) and asks the workers to stop a running one (`{prefix}.control`).
    /// Disabled by default; `serve` connects both.
    pub events: lastcall_broker::EventSink,
    pub control: lastcall_broker::EventSink,
    /// Which `callback_url`s the ingress takes (`serve --webhook-allow`; none: refused).
    pub webhooks: webhooks::WebhookConfig,
    /// The OpenAI-compatible front door's model map and default deadline.
    pub front_door: front_door::FrontDoor,
    /// The broker's resource alarms from its management API (`serve` without
    /// `--no-management`): `/readyz` reports `broker_alarm` while one is on.
    pub alarms: Option<lastcall_broker::management::AlarmWatch>,
}

impl std::fmt::Debug for AppState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AppState")
            .field("names", &self.names)
            .field("max_body_bytes", &self.max_body_bytes)
            .finish_non_exhaustive()
    }
}

impl AppState {
    /// A state with the defaults for the optional parts.
    pub fn new(
        submitter: Submitter,
        ledger: Arc<Ledger>,
        clock: Arc<dyn Clock>,
        token: Token,
        names: Names,
    ) -> Self {
        let http_stats = Arc::new(HttpStats::default());
        Self {
            submitter,
            metrics: MetricsSource::default()
                .with_ledger(ledger.clone())
                .with_http(&http_stats),
            ledger,
            clock,
            token,
            names,
            max_body_bytes: 1_048_576,
            horizon_ms: lastcall_core::EnvelopeLimits::default().horizon_ms,
            depth: None,
            worker_metrics: Vec::new(),
            http_stats,
            claim_wait: std::time::Duration::from_secs(10),
            waiters: Arc::new(waiters::Waiters::default()),
            max_wait_ms: jobs::MAX_WAIT_MS,
            events: lastcall_broker::EventSink::disabled(),
            control: lastcall_broker::EventSink::disabled(),
            webhooks: webhooks::WebhookConfig::default(),
            front_door: front_door::FrontDoor::default(),
            alarms: None,
            http_client: reqwest::Client::builder()
                .timeout(std::time::Duration::from_secs(2))
                .build()
                .unwrap_or_default(),
        }
    }
}

/// The router of `lastcall serve`. Every route but `/healthz` needs the token (Bearer, or
/// Basic with the token as password, see [`auth`]).
pub fn app(state: Arc<AppState>) -> Router {
    let protected = Router::new()
        .route("/", get(dashboard::page))
        .route("/v1/jobs", get(jobs::list).post(jobs::create))
        .route("/v1/jobs/{id}", get(jobs::show).delete(jobs::cancel))
        .route(
            "/v1/chat/completions",
            axum::routing::post(front_door::chat_completions),
        )
        .route("/v1/models", get(front_door::models))
        .route("/v1/dashboard", get(dashboard::data))
        .route("/metrics", get(metrics_handler))
        .route("/openapi.json", get(openapi_handler))
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            auth::require_token,
        ));
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(serve_readyz))
        .merge(protected)
        .fallback(|| async { ApiError::NotFound("no such route".into()) })
        .layer(middleware::from_fn(json_errors))
        .layer(middleware::from_fn_with_state(
            state.clone(),
            count_responses,
        ))
        .with_state(state)
}

/// `/metrics` and `/healthz` only, without auth: for a worker's `--metrics-addr`, which
/// should listen on a loopback or otherwise private address.
pub fn metrics_app(source: MetricsSource) -> Router {
    Router::new()
        .route(
            "/metrics",
            get(|State(s): State<Arc<MetricsSource>>| async move { exposition(s.render().await) }),
        )
        .route("/healthz", get(healthz))
        .route(
            "/readyz",
            get(|State(s): State<Arc<MetricsSource>>| async move {
                readiness(source_checks(&s).await)
            }),
        )
        .with_state(Arc::new(source))
}

/// `/readyz` of `lastcall serve`: the publisher's broker connection, the broker's resource
/// alarms (when the management API is known), the ledger (a read within 2 s), the
/// outcome-events follower that wakes long-polls and feeds webhooks, and the dead-letter
/// task when it runs.
async fn serve_readyz(State(state): State<Arc<AppState>>) -> Response {
    let mut checks = vec![("broker", state.submitter.broker_ready().await)];
    if let Some(alarms) = &state.alarms {
        checks.push(("broker_alarm", alarms.current().is_empty()));
    }
    if let Some(following) = state.waiters.following() {
        checks.push(("events_follower", following));
    }
    let ledger = tokio::time::timeout(
        std::time::Duration::from_secs(2),
        state.ledger.get("lastcall-readyz-probe"),
    )
    .await;
    checks.push(("ledger", matches!(ledger, Ok(Ok(_)))));
    checks.extend(source_checks(&state.metrics).await);
    readiness(checks)
}

/// Readiness of what a [`MetricsSource`] holds (registered with
/// [`MetricsSource::with_ready`]): the worker's broker connection, ledger and retry
/// publisher, the dead-letter processor's connection.
async fn source_checks(s: &MetricsSource) -> Vec<(&'static str, bool)> {
    s.checks()
}

/// `200 {"ready": true, …}` when every check passes, else `503` naming what is down.
fn readiness(checks: Vec<(&'static str, bool)>) -> Response {
    let down: Vec<&str> = checks
        .iter()
        .filter(|(_, ok)| !ok)
        .map(|(n, _)| *n)
        .collect();
    let body = serde_json::json!({
        "ready": down.is_empty(),
        "down": down,
        "checks": checks.iter().map(|(n, ok)| (n.to_string(), serde_json::Value::Bool(*ok))).collect::<serde_json::Map<_, _>>(),
    });
    let status = if down.is_empty() {
        axum::http::StatusCode::OK
    } else {
        axum::http::StatusCode::SERVICE_UNAVAILABLE
    };
    (status, axum::Json(body)).into_response()
}

/// Serve `router` on `addr` until `stop` fires. Returns the bound address through
/// `bound` (useful with port 0).
pub async fn serve(
    addr: SocketAddr,
    router: Router,
    stop: CancellationToken,
    bound: Option<tokio::sync::oneshot::Sender<SocketAddr>>,
) -> std::io::Result<()> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let local = listener.local_addr()?;
    tracing::info!(addr = %local, "HTTP listening");
    if let Some(tx) = bound {
        let _ = tx.send(local);
    }
    axum::serve(listener, router)
        .with_graceful_shutdown(async move { stop.cancelled().await })
        .await
}

async fn healthz() -> &'static str {
    "ok\n"
}

async fn openapi_handler(State(state): State<Arc<AppState>>) -> Response {
    match openapi_document(&state) {
        Ok(doc) => ([(header::CONTENT_TYPE, "application/json")], doc).into_response(),
        Err(e) => ApiError::Internal(format!("the OpenAPI document: {e}")).into_response(),
    }
}

/// [`OPENAPI`] with this server's limits: the horizon as the maximum of `deadline_ms` and
/// `min_runtime_ms`, the body limit in the `413` description.
pub fn openapi_document(state: &AppState) -> Result<String, serde_json::Error> {
    let mut doc: serde_json::Value = serde_json::from_str(OPENAPI)?;
    let job = &mut doc["components"]["schemas"]["NewJob"]["properties"];
    for field in ["deadline_ms", "min_runtime_ms"] {
        if job[field].is_object() {
            job[field]["maximum"] = state.horizon_ms.into();
        }
    }
    if let Some(params) = doc["paths"]["/v1/jobs/{id}"]["get"]["parameters"].as_array_mut() {
        for p in params.iter_mut().filter(|p| p["name"] == "wait_ms") {
            p["schema"]["maximum"] = state.max_wait_ms.into();
        }
    }
    let too_large = &mut doc["components"]["responses"]["TooLarge"];
    if too_large.is_object() {
        too_large["description"] = format!(
            "The body is larger than this server's limit of {} bytes (`serve --max-body-bytes`), or the job as published would be",
            state.max_body_bytes
        )
        .into();
    }
    serde_json::to_string_pretty(&doc)
}

/// Every refusal is the documented JSON error: a response of 400 or above that is not
/// JSON already (axum's own rejections, a method the route does not have) gets the
/// `{"error", "field", "message"}` body, its text as the message, its other headers kept
/// (axum adds `Allow` to a `405` outside this layer).
async fn json_errors(req: Request, next: Next) -> Response {
    let method = req.method().clone();
    let path = req.uri().path().to_owned();
    let resp = next.run(req).await;
    let status = resp.status();
    let is_json = resp
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"));
    if status.as_u16() < 400 || is_json {
        return resp;
    }
    let (parts, body) = resp.into_parts();
    let text = axum::body::to_bytes(body, 64 * 1024)
        .await
        .map(|b| String::from_utf8_lossy(&b).trim().to_owned())
        .unwrap_or_default();
    let message = if text.is_empty() {
        match status {
            axum::http::StatusCode::METHOD_NOT_ALLOWED => format!(
                "`{method}` is not an operation of `{}`; the `Allow` header lists the methods it takes",
                params::shorten(&path)
            ),
            s => s.canonical_reason().unwrap_or("refused").to_owned(),
        }
    } else {
        text
    };
    let mut out = ApiError::http(status, message).into_response();
    for (name, value) in &parts.headers {
        if name != header::CONTENT_TYPE && name != header::CONTENT_LENGTH {
            out.headers_mut().append(name.clone(), value.clone());
        }
    }
    out
}

async fn metrics_handler(State(state): State<Arc<AppState>>) -> Response {
    let depth = state.metrics.depth.as_ref().or(state.depth.as_ref());
    exposition(state.metrics.render_with(depth).await)
}

fn exposition(text: String) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            prometheus_client::encoding::prometheus_text::CONTENT_TYPE,
        )],
        text,
    )
        .into_response()
}

/// Count responses by matched route pattern (bounded) and status.
async fn count_responses(State(state): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map(|p| p.as_str().to_owned())
        .unwrap_or_else(|| "unmatched".into());
    let is_post_jobs = route == "/v1/jobs" && req.method() == axum::http::Method::POST;
    let resp = next.run(req).await;
    let status = resp.status();
    if is_post_jobs && status == axum::http::StatusCode::ACCEPTED {
        state.http_stats.accepted.inc();
    }
    let labels = metrics::ResponseLabels {
        route,
        status: status.as_u16(),
    };
    state.http_stats.responses.get_or_create(&labels).inc();
    resp
}
