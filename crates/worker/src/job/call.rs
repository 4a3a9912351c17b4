//! The model call ([`Action::Call`](lastcall_core::delivery::Action::Call)): the backend
//! with a timeout equal to the budget, the job's cancellation token, and the token-delta
//! stream of a streaming job; then what the call teaches the worker (the adaptive limit,
//! the breaker, the learned call times, a probe's end).

use super::Job;
use crate::ctx::Calls;
use crate::stats::WorkerStats;
use lastcall_backend::{BackendError, CallOutput, CallRequest, CancellationToken};
use lastcall_core::breaker::Verdict;
use lastcall_core::delivery::{Delivery, Event};
use lastcall_core::service_time::ProbeEnd;
use lastcall_core::{CallResult, Envelope, Reason};
use std::future::Future;
use std::time::{Duration, Instant};

/// Call the model with the budget the core gave, report its end, and let the call teach
/// what it measured.
pub(crate) async fn call(ctx: &Calls<'_>, job: &mut Job, d: &mut Delivery, budget_ms: u64) {
    let Some(env) = d.env() else {
        return;
    };
    let mut permit = job.permit.take();
    WorkerStats::inc(&ctx.stats.backend_calls);
    WorkerStats::add(&ctx.stats.running, 1);
    // `reply_to` is not signed: deltas go only to a direct reply-to address, never to a
    // queue the name happens to match (the work queue, through the default exchange).
    let stream = match job.msg.reply_to.as_deref() {
        Some(to) if lastcall_core::delta::is_direct_reply_to(to) => Some(
            crate::stream::CallStream::new(ctx.deltas, to, &job.id, job.msg.attempt),
        ),
        Some(to) => {
            tracing::warn!(
                job_id = %job.id.escape_debug(),
                reply_to = %to.escape_debug(),
                "`reply_to` is not a direct reply-to address: no token deltas are sent"
            );
            None
        }
        None => None,
    };
    // What the kind's completed calls take, before this one: a call cut at the deadline
    // far past it is a hung server for the circuit breaker.
    let kind = env.kind().as_str().to_owned();
    let backend = job.backend.clone();
    if backend != ctx.breaker_key(&kind) {
        WorkerStats::inc(&ctx.stats.fallback_calls);
    }
    let p99_before = ctx.times.completed_p99(&kind, &backend, ctx.clock.now_ms());
    // The permit taken at the slot is spent by this call; its headers reach the limiter.
    let rate = job.rate.take();
    let limits = ctx.limits.sink(&backend, ctx.clock.clone());
    if let Some(permit) = permit.as_mut() {
        // The running call, for the adaptive limit's check before a step up.
        let now = ctx.clock.now_ms();
        let admitted_ms = job.learned(ctx, &kind, now).map_or(0, |e| e.quantile_ms);
        permit.started(admitted_ms, env.deadline().expires_at_ms(), now);
    }
    let cancel = job
        .cancel
        .as_ref()
        .map(|c| c.token.clone())
        .unwrap_or_default();
    let mut call = call_backend(
        ctx,
        &backend,
        env,
        job.msg.attempt,
        budget_ms,
        &cancel,
        stream.as_ref(),
        Some(limits),
    )
    .await;
    if let Some(rate) = rate {
        let used = (call.output.as_ref().and_then(|o| o.usage)).map(|u| u.total());
        rate.spent(used, ctx.clock.now_ms());
    }
    if let Some(s) = &stream {
        s.end();
    }
    WorkerStats::add(&ctx.stats.running, -1);
    (ctx.stats.metrics.model_call).observe_ms(call.latency_ms);
    if let Some(permit) = permit.as_mut()
        && call.result.teaches_call_time().is_some()
    {
        // The adaptive limit learns from a useful call's time (a failed one says nothing
        // about it), against the learned time of its request alone, before the estimator
        // takes the call in.
        let now = ctx.clock.now_ms();
        let alone = match job.probe {
            Some(_) => None,
            None => ctx.times.learned_alone(&kind, &backend, job.size, now),
        };
        permit.ended(
            call.latency_ms.max(0) as u64,
            alone.map_or(0, |e| e.mean_ms),
            now,
        );
    }
    drop(permit);
    let now = ctx.clock.now_ms();
    if job.lost.is_cancelled() {
        d.handle(&ctx.cfg.policy, Event::ChannelLost, now);
    }
    let ended = Event::CallEnded {
        result: call.result.clone(),
        learned: job.learned(ctx, &kind, now),
        jitter: jitter(),
    };
    d.handle(&ctx.cfg.policy, ended, now);
    // The result as the core records it (a call cut at the ack window is its failure).
    if let Some(result) = d.call_result() {
        call.result = result.clone();
    }
    let verdict = Verdict::of(ctx.breakers.policy(), &call.result, budget_ms, p99_before);
    match job.trial.take() {
        Some(trial) => trial.ended(verdict, now),
        None => ctx.breakers.ended(&backend, verdict, now),
    }
    if let Some(note) = d.note() {
        call.error = Some(note.to_owned());
    }
    if let Some(cut) = call.result.teaches_call_time() {
        let used = (call.output.as_ref().and_then(|o| o.usage)).map(|u| u.prompt_tokens);
        (ctx.times).observe_call(&kind, &backend, call.latency_ms, cut, job.size, used, now);
    }
    if let Some(probe) = job.probe.take() {
        probe.end(ProbeEnd::of(
            &call.result,
            budget_ms,
            call.latency_ms.max(0) as u64,
        ));
    }
    if let Some(u) = call.output.as_ref().and_then(|o| o.usage) {
        let m = &ctx.stats.metrics;
        WorkerStats::add_saturating(&m.prompt_tokens, u.prompt_tokens);
        WorkerStats::add_saturating(&m.completion_tokens, u.completion_tokens);
    }
    job.call = Some(call);
}

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
    ctx: &Calls<'_>,
    backend: &str,
    env: &Envelope,
    attempt: u32,
    budget_ms: u64,
    requested: &CancellationToken,
    stream: Option<&crate::stream::CallStream>,
    limits: Option<lastcall_backend::LimitSink>,
) -> Call {
    let cancel = CancellationToken::new();
    let mut payload = env.payload.clone();
    if let Some(asked) = ctx.cfg.allowed_models.screen(&mut payload) {
        tracing::debug!(
            job_id = %env.job_id(),
            model = %asked.to_string().escape_debug(),
            "the payload's model is not on --allow-model: the route's or backend's serves"
        );
    }
    let req = CallRequest {
        job_id: env.job_id().to_string(),
        kind: env.kind().to_string(),
        attempt,
        payload,
        timeout: Duration::from_millis(budget_ms),
        priority: env.priority(),
    };
    let t0 = Instant::now();
    // The call's deadline, on the worker's clock (the one that admitted it).
    let deadline = ctx.clock.sleep_until(ctx.clock.now_ms() + budget_ms as i64);
    let token = ctx.times.call_started(env.kind().as_str(), backend);
    let deltas = stream.map(|s| s.deltas());
    let fut = (ctx.backend).call_on(backend, req, cancel.clone(), deltas, limits);
    tokio::pin!(fut);
    let grace = ctx.cfg.cancel_grace;
    let mut call = tokio::select! {
        r = &mut fut => from_result(r, env.job_id().as_str(), backend),
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
    ctx.times.call_ended(env.kind().as_str(), backend, token);
    // A server's Retry-After is advice: the retry waits no longer than the breaker's
    // longest cool-down (the rate limiter and the breaker hold the backend no longer).
    if let CallResult::Failed {
        retry_after_ms: Some(ra),
        ..
    } = &mut call.result
    {
        let p = ctx.breakers.policy();
        *ra = (*ra).min(p.max_cool_down_ms.max(p.cool_down_ms));
    }
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

fn from_result(r: Result<CallOutput, BackendError>, job_id: &str, backend: &str) -> Call {
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
            // The job's `error` is read by its tenant: the failure's class only. The
            // upstream's own text (internal hosts, URLs, a proxy's page) is for the
            // operator's log, quoted and escaped (`?`).
            let message = match &e {
                BackendError::Retryable { message, .. }
                | BackendError::Terminal { message, .. } => message.as_str(),
                BackendError::Cancelled { .. } => "",
            };
            tracing::warn!(
                job_id,
                backend,
                reason = e.reason(),
                error = ?e.to_string(),
                "model call failed"
            );
            let shown = lastcall_core::redact::backend_failure(e.reason(), message);
            Call::ended(result, Some(shown), None)
        }
    }
}

/// Jitter for the retry backoff: uniform in `[0, 1)`.
pub(crate) fn jitter() -> f64 {
    rand::random::<f64>()
}
