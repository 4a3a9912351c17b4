//! The model backend interface of lastcall, and the simulated backend.
//!
//! A backend gets one job's input, a local timeout derived from the remaining budget and a
//! cancellation token. It returns the generated output or a classified error. The worker
//! owns the deadline: when it passes, the worker cancels the token and waits a short grace
//! period for the backend to confirm that it stopped ([`BackendError::Cancelled`]).
//!
//! # Layout
//! - this file: [`Backend`], [`CallRequest`], [`CallOutput`], [`BackendError`], [`Deltas`]
//!   (where a streaming call's text goes as it is generated), [`LimitSink`] (where a call's
//!   `x-ratelimit-*` headers go).
//! - [`sim`]: the simulated backend, a load generator that counts every call it receives.

pub mod route;
pub mod sim;

pub use lastcall_core::Priority;
pub use lastcall_core::rate_limit::{self, Observed};
pub use lastcall_core::request_size::RequestSize;
use serde::Serialize;
use serde_json::{Map, Value};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;
pub use tokio_util::sync::CancellationToken;

/// One model call.
#[derive(Debug, Clone)]
pub struct CallRequest {
    pub job_id: String,
    pub kind: String,
    /// 0-based attempt number (`x-lastcall-attempt`).
    pub attempt: u32,
    /// The envelope's payload, e.g. `{"messages": [...]}` for chat kinds.
    pub payload: Map<String, Value>,
    /// The local timeout: the remaining budget at admission. The call must not outlive it.
    pub timeout: Duration,
    /// The job's tier, which a backend may pass on to a server that schedules by it.
    pub priority: lastcall_core::Priority,
}

/// Token accounting reported by a backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct Usage {
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
}

impl Usage {
    /// The most tokens one call is taken to have used, per count: a server that reports
    /// more (a bug, or a hostile server) is taken at this, so sums never overflow.
    pub const MAX_REPORTED_TOKENS: u64 = 100_000_000;

    /// The counts a server reported, each clamped to [`Self::MAX_REPORTED_TOKENS`].
    pub fn reported(prompt_tokens: u64, completion_tokens: u64) -> Self {
        Self {
            prompt_tokens: prompt_tokens.min(Self::MAX_REPORTED_TOKENS),
            completion_tokens: completion_tokens.min(Self::MAX_REPORTED_TOKENS),
        }
    }

    /// Prompt and completion tokens together (saturating).
    pub fn total(&self) -> u64 {
        self.prompt_tokens.saturating_add(self.completion_tokens)
    }
}

/// A finished model call.
#[derive(Debug, Clone, PartialEq, Default, Serialize)]
pub struct CallOutput {
    pub text: String,
    pub usage: Option<Usage>,
    /// The model that served the call, as the backend names it.
    pub model: Option<String>,
    /// Decode speed, where the backend measures it.
    pub tokens_per_second: Option<f64>,
}

/// A failed model call, classified for the retry policy.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum BackendError {
    /// Worth retrying inside the deadline (connection failure, 429, 5xx, backend timeout).
    #[error("retryable backend error ({reason}): {message}")]
    Retryable {
        reason: String,
        message: String,
        /// A server's `Retry-After`, honoured only if it fits inside the deadline.
        retry_after: Option<Duration>,
    },
    /// Retrying cannot help (400, 422, validation).
    #[error("terminal backend error ({reason}): {message}")]
    Terminal { reason: String, message: String },
    /// The call stopped because its cancellation token fired.
    #[error("call cancelled (stop confirmed: {confirmed})")]
    Cancelled {
        /// Whether the backend knows the work stopped (e.g. stream closed, decode loop left).
        confirmed: bool,
    },
}

impl BackendError {
    pub fn is_retryable(&self) -> bool {
        matches!(self, BackendError::Retryable { .. })
    }

    /// The stable reason code stored in the ledger.
    pub fn reason(&self) -> &str {
        match self {
            BackendError::Retryable { reason, .. } | BackendError::Terminal { reason, .. } => {
                reason
            }
            BackendError::Cancelled { .. } => "cancelled",
        }
    }
}

/// The future a backend returns.
pub type CallFuture<'a> =
    Pin<Box<dyn Future<Output = Result<CallOutput, BackendError>> + Send + 'a>>;

/// Where a streaming call's text goes while it is generated: a callback that never
/// blocks (the worker queues each piece for the broker, or drops it). The pieces a
/// completed call sent concatenate to its [`CallOutput::text`]; a backend sends each piece
/// once, in order, and stops sending when [`Deltas::send`] says nobody takes them.
#[derive(Clone)]
pub struct Deltas(Arc<dyn Fn(&str) -> bool + Send + Sync>);

impl Deltas {
    /// `f` takes one piece and answers whether more are wanted.
    pub fn new(f: impl Fn(&str) -> bool + Send + Sync + 'static) -> Self {
        Self(Arc::new(f))
    }

    /// Hand over one piece (empty pieces are not sent); `false`: stop sending.
    pub fn send(&self, text: &str) -> bool {
        text.is_empty() || (self.0)(text)
    }
}

/// Where a call's rate-limit headers go (`x-ratelimit-*`, parsed): the worker binds one to
/// each call so that what the server says about its limits reaches the limiter of the
/// backend the call went to. Never blocks.
#[derive(Clone)]
pub struct LimitSink(Arc<dyn Fn(Observed) + Send + Sync>);

impl LimitSink {
    pub fn new(f: impl Fn(Observed) + Send + Sync + 'static) -> Self {
        Self(Arc::new(f))
    }

    /// Hand over one response's headers (nothing when they said nothing).
    pub fn send(&self, o: Observed) {
        if !o.is_empty() {
            (self.0)(o)
        }
    }
}

impl std::fmt::Debug for LimitSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LimitSink")
    }
}

impl std::fmt::Debug for Deltas {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Deltas")
    }
}

/// A model backend. Implementations are shared between the worker's slots.
pub trait Backend: Send + Sync {
    /// A short name for logs and metrics (`sim`, `openai`, `local`).
    fn name(&self) -> &str;

    /// The name of the backend that calls of `kind` go to, when this one routes kinds to
    /// several (the worker keeps a circuit breaker per route); `None`: this one.
    fn route_of(&self, kind: &str) -> Option<&str> {
        let _ = kind;
        None
    }

    /// The backends that may serve calls of `kind`, in the order they are tried (a fallback
    /// route; [`call_on`](Self::call_on) calls one of them): this one's name alone unless
    /// this one routes kinds. The first is [`route_of`](Self::route_of)'s answer.
    fn routes_of(&self, kind: &str) -> Vec<&str> {
        vec![self.first_route(kind)]
    }

    /// The first backend calls of `kind` go to: [`route_of`](Self::route_of)'s answer, or
    /// this one (the key of the kind's circuit breaker and of its learned-time gauge).
    fn first_route(&self, kind: &str) -> &str {
        self.route_of(kind).unwrap_or(self.name())
    }

    /// Every name [`route_of`](Self::route_of) can answer, or this one's: the backends whose
    /// calls this one makes (a worker reads their recent call times from the ledger).
    fn serving_names(&self) -> Vec<&str> {
        vec![self.name()]
    }

    /// The size of a job's request, for the call-time estimate of calls of `kind` (the
    /// unit the worker learns them in): by default the payload's approximate size
    /// ([`RequestSize::of_payload`]: 4 characters a token); a backend that holds the
    /// model's tokenizer counts the prompt's tokens with it
    /// ([`counts_prompt_tokens`](Self::counts_prompt_tokens)). Routers answer for the
    /// kind's first backend.
    fn request_size(&self, kind: &str, payload: &Map<String, Value>) -> Option<RequestSize> {
        let _ = kind;
        RequestSize::of_payload(payload)
    }

    /// Whether [`request_size`](Self::request_size) counts the prompt's tokens exactly for
    /// calls of `kind` (the model's tokenizer): the prompt tokens its calls report are
    /// then the same count, and a starting worker replays the ledger's calls under it.
    fn counts_prompt_tokens(&self, kind: &str) -> bool {
        let _ = kind;
        false
    }

    /// Run one call. Must return promptly with [`BackendError::Cancelled`] once `cancel`
    /// fires, and must not run past `req.timeout`.
    fn call(&self, req: CallRequest, cancel: CancellationToken) -> CallFuture<'_>;

    /// [`call`](Self::call), sending the text to `deltas` as it is generated. The default
    /// sends the whole text once the call completed; streaming backends override it.
    fn call_streaming(
        &self,
        req: CallRequest,
        cancel: CancellationToken,
        deltas: Deltas,
    ) -> CallFuture<'_> {
        let call = self.call(req, cancel);
        Box::pin(async move {
            let out = call.await?;
            deltas.send(&out.text);
            Ok(out)
        })
    }

    /// [`call`](Self::call) or [`call_streaming`](Self::call_streaming), with `limits`
    /// receiving the response's rate-limit headers. The default has no headers to give;
    /// HTTP backends (and routers) override it.
    fn call_with(
        &self,
        req: CallRequest,
        cancel: CancellationToken,
        deltas: Option<Deltas>,
        limits: Option<LimitSink>,
    ) -> CallFuture<'_> {
        let _ = limits;
        match deltas {
            Some(d) => self.call_streaming(req, cancel, d),
            None => self.call(req, cancel),
        }
    }

    /// [`call_with`](Self::call_with) on `backend`, one of [`routes_of`](Self::routes_of)
    /// the request's kind (the one the worker chose for this call). The default has one
    /// backend to call: itself; routers override it.
    fn call_on(
        &self,
        backend: &str,
        req: CallRequest,
        cancel: CancellationToken,
        deltas: Option<Deltas>,
        limits: Option<LimitSink>,
    ) -> CallFuture<'_> {
        let _ = backend;
        self.call_with(req, cancel, deltas, limits)
    }
}
