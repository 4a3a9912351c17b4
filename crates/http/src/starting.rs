//! Listening before the broker and the ledger answer: `lastcall serve` binds its address
//! first, then connects. Until the full router is [installed](Startup::ready):
//! - `/healthz` answers `200 ok` (the process is alive and working towards ready);
//! - `/readyz` answers `503 {"ready": false, "down": […]}` naming what it waits for;
//! - every other request answers `503 {"error": "starting", …}` with `Retry-After`, so a
//!   client or load balancer retries instead of seeing a refused connection.
//!
//! Once installed, every request goes to the full router (the same `/healthz` and
//! `/readyz`, now with their real checks).

use crate::error::ApiError;
use crate::openapi::Readiness;
use axum::Router;
use axum::extract::Request;
use axum::response::{IntoResponse, Response};
use std::sync::{Arc, Mutex, OnceLock};
use tower::ServiceExt;

/// What a starting server waits for, in order.
pub const WAITING: [&str; 2] = ["broker", "ledger"];

/// The router of a server that listens before it can serve: see the module doc.
#[derive(Default)]
pub struct Startup {
    app: OnceLock<Router>,
    /// The dependencies not reached yet (a subset of [`WAITING`], in its order).
    waiting: Mutex<Vec<&'static str>>,
}

impl Startup {
    /// Waiting for the broker, then the ledger.
    pub fn new() -> Arc<Self> {
        Arc::new(Self {
            app: OnceLock::new(),
            waiting: Mutex::new(WAITING.to_vec()),
        })
    }

    /// `what` (one of [`WAITING`]) is reachable now.
    pub fn reached(&self, what: &str) {
        self.waiting
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|w| *w != what);
    }

    /// Serve `app` from now on. A second call is ignored.
    pub fn ready(&self, app: Router) {
        self.reached("broker");
        self.reached("ledger");
        let _ = self.app.set(app);
    }

    pub fn is_ready(&self) -> bool {
        self.app.get().is_some()
    }

    /// The router to serve: the starting answers until [`ready`](Self::ready), then `app`.
    pub fn router(self: &Arc<Self>) -> Router {
        let this = self.clone();
        Router::new().fallback(move |req: Request| {
            let this = this.clone();
            async move { this.answer(req).await }
        })
    }

    async fn answer(&self, req: Request) -> Response {
        if let Some(app) = self.app.get() {
            return match app.clone().oneshot(req).await {
                Ok(resp) => resp,
                Err(never) => match never {},
            };
        }
        let waiting = self
            .waiting
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        match req.uri().path() {
            "/healthz" => "ok".into_response(),
            "/readyz" => {
                let body = Readiness {
                    ready: false,
                    checks: WAITING.iter().map(|w| (*w, !waiting.contains(w))).collect(),
                    down: waiting,
                    backends: Default::default(),
                    degraded: false,
                };
                (
                    axum::http::StatusCode::SERVICE_UNAVAILABLE,
                    axum::Json(body),
                )
                    .into_response()
            }
            _ => ApiError::Starting(format!(
                "the server is starting: waiting for the {} (GET /readyz says when it is ready)",
                waiting.first().copied().unwrap_or("setup to finish")
            ))
            .into_response(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;
    use axum::routing::get;

    async fn call(router: &Router, path: &str) -> (u16, String, Option<String>) {
        let resp = router
            .clone()
            .oneshot(Request::get(path).body(Body::empty()).unwrap())
            .await
            .unwrap();
        let status = resp.status().as_u16();
        let retry = resp
            .headers()
            .get(axum::http::header::RETRY_AFTER)
            .map(|v| v.to_str().unwrap().to_owned());
        let body = axum::body::to_bytes(resp.into_body(), 1 << 16)
            .await
            .unwrap();
        (status, String::from_utf8(body.to_vec()).unwrap(), retry)
    }

    #[tokio::test]
    async fn answers_starting_until_the_app_is_installed_then_hands_every_request_to_it() {
        let s = Startup::new();
        let r = s.router();
        assert_eq!(call(&r, "/healthz").await.0, 200);
        let (code, body, _) = call(&r, "/readyz").await;
        assert_eq!(code, 503);
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["down"], serde_json::json!(["broker", "ledger"]), "{v}");
        assert_eq!(v["checks"]["broker"], false, "{v}");
        let (code, body, retry) = call(&r, "/v1/jobs").await;
        assert_eq!(code, 503);
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["error"], "starting", "{v}");
        assert!(v["message"].as_str().unwrap().contains("broker"), "{v}");
        assert_eq!(retry.as_deref(), Some("1"));

        s.reached("broker");
        let (_, body, _) = call(&r, "/readyz").await;
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["down"], serde_json::json!(["ledger"]), "{v}");
        assert_eq!(v["checks"]["broker"], true, "{v}");
        let (_, body, _) = call(&r, "/v1/jobs").await;
        assert!(body.contains("waiting for the ledger"), "{body}");

        assert!(!s.is_ready());
        s.ready(Router::new().route("/v1/jobs", get(|| async { "the app" })));
        assert!(s.is_ready());
        assert_eq!(call(&r, "/v1/jobs").await.1, "the app");
        assert_eq!(
            call(&r, "/healthz").await.0,
            404,
            "the app's own routes only"
        );
    }
}
