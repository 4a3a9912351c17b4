//! The model call: the backend with a timeout equal to the budget, the job's cancellation
//! token, and the token-delta stream of a streaming job.

use crate::ctx::Ctx;
use lastcall_backend::{BackendError, CallOutput, CallRequest, CancellationToken};
use lastcall_core::{CallResult, Envelope, Reason};
use std::future::Future;
use std::time::{Duration, Instant};

/// What a model call produced, for the ledger.
pub(crate) struct Call {
    pub(crate) result: CallResult,
    pub(crate) output: Option<CallOutput>,
    pub(crate) error: Option<String>,
    pub(crate) cancel_requested: bool,
    pub(crate) cancel_confirmed: Option<bool>,
    pub(crate) latency_ms: i64,
}

impl Call {
    fn ended(result: CallResult, error: Option<String>, confirmed: Option<bool>) -> Self {
        Self {
            cancel_requested: confirmed.is_some(),
            cancel_confirmed: confirmed,
            result,
            output: None,
            error,
            latency_ms: 0,
        }
    }
}

/// Call `backend` (the one of the kind's route chosen for this call) for `env` with
/// `budget_ms`, the remaining budget, as its timeout; `requested` aborts it.
#[allow(clippy::too_many_arguments)] // one call's parts, each from a different place
pub(crate) async fn call_backend(
    ctx: &Ctx,
    backend: &str,
    env: &Envelope,
    attempt: u32,
    budget_ms: u64,
    requested: &CancellationToken,
    stream: Option<&crate::stream::CallStream>,
    limits: Option<lastcall_backend::LimitSink>,
) -> Call {
    let cancel = CancellationToken::new();
    let req = CallRequest {
        job_id: env.job_id().to_string(),
        kind: env.kind().to_string(),
        attempt,
        payload: env.payload.clone(),
        timeout: Duration::from_millis(budget_ms),
    };
    let t0 = Instant::now();
    // The call's deadline, on the worker's clock (the one that admitted it).
    let deadline = ctx.clock.sleep_until(ctx.clock.now_ms() + budget_ms as i64);
    let token = ctx.call_started(env.kind().as_str(), backend);
    let deltas = stream.map(|s| s.deltas());
    let fut = (ctx.backend).call_on(backend, req, cancel.clone(), deltas, limits);
    tokio::pin!(fut);
    let grace = ctx.cfg.cancel_grace;
    let mut call = tokio::select! {
        r = &mut fut => from_result(r),
        _ = deadline => {
            // Still running at the deadline: request cancellation and wait briefly for
            // the backend to confirm. Work that goes on remotely is not "not started".
            let confirmed = confirm_cancel(&cancel, &mut fut, grace).await;
            Call::ended(
                CallResult::DeadlineExceeded,
                Some(format!("still running at the deadline after {budget_ms} ms; cancellation requested")),
                Some(confirmed),
            )
        }
        _ = requested.cancelled() => {
            // Cancelled on request: abort through the backend's cancellation, as at the
            // deadline, and wait briefly for it to confirm.
            let confirmed = confirm_cancel(&cancel, &mut fut, grace).await;
            let ms = t0.elapsed().as_millis();
            Call::ended(
                CallResult::Cancelled,
                Some(format!("cancelled on request after {ms} ms")),
                Some(confirmed),
            )
        }
    };
    call.latency_ms = t0.elapsed().as_millis() as i64;
    ctx.call_ended(env.kind().as_str(), backend, token);
    call
}

/// Fire the backend's cancellation and wait up to `grace` for it to confirm.
async fn confirm_cancel<F>(cancel: &CancellationToken, fut: &mut F, grace: Duration) -> bool
where
    F: Future<Output = Result<CallOutput, BackendError>> + Unpin,
{
    cancel.cancel();
    match tokio::time::timeout(grace, fut).await {
        Ok(Err(BackendError::Cancelled { confirmed })) => confirmed,
        Ok(_) => true,
        Err(_) => false,
    }
}

fn from_result(r: Result<CallOutput, BackendError>) -> Call {
    match r {
        Ok(out) => Call {
            output: Some(out),
            ..Call::ended(CallResult::Completed, None, None)
        },
        // The backend stopped at its own timeout (derived from the same budget).
        Err(BackendError::Cancelled { confirmed }) => Call::ended(
            CallResult::DeadlineExceeded,
            Some("backend stopped at the deadline".into()),
            Some(confirmed),
        ),
        Err(e) => {
            let retry_after_ms = match &e {
                BackendError::Retryable { retry_after, .. } => {
                    retry_after.map(|d| d.as_millis() as u64)
                }
                _ => None,
            };
            let result = CallResult::Failed {
                retryable: e.is_retryable(),
                reason: Reason::Backend(e.reason().to_owned()),
                retry_after_ms,
            };
            Call::ended(result, Some(e.to_string()), None)
        }
    }
}

/// Jitter for the retry backoff: uniform in `[0, 1)`.
pub(crate) fn jitter() -> f64 {
    rand::random::<f64>()
}
