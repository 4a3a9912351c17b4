//! The OpenAI-compatible HTTP backend of lastcall.
//!
//! [`OpenAiBackend`] implements [`lastcall_backend::Backend`] by posting each call to
//! `{base_url}/chat/completions`, the API that vLLM, the llama.cpp servers, Ollama and the
//! hosted APIs share. It always streams, and when the call's deadline passes or its
//! cancellation token fires it drops the response stream, which closes the connection:
//! servers that check for a disconnected client between tokens (vLLM, llama.cpp's
//! `llama-server`, llama-cpp-python's server for streaming requests) then stop generating,
//! so an abandoned job stops costing model time.
//!
//! Errors: connection failures, 408, 429, 5xx and broken streams are retryable (reasons
//! `connect_error`, `http_429`, `http_503`, `stream_truncated`, …, with `Retry-After`
//! seconds kept); other 4xx are terminal (`http_400`, `http_401`, …) with the server's
//! message; a payload without `messages` or `prompt` is terminal `bad_payload`. The
//! timeout or the token give [`Cancelled { confirmed: true }`](lastcall_backend::BackendError::Cancelled).
//!
//! ```no_run
//! # fn main() -> Result<(), lastcall_openai::ConfigError> {
//! use lastcall_openai::{OpenAiBackend, OpenAiConfig};
//! let cfg = OpenAiConfig::new("http://127.0.0.1:8080/v1", "smollm2")
//!     .api_key_from_env("OPENAI_API_KEY")?; // never from a flag
//! let backend = OpenAiBackend::new(cfg)?;
//! # let _ = backend; Ok(()) }
//! ```
//!
//! **Boundary**: this is the only crate that knows HTTP or the chat-completions format.
//!
//! # Layout
//! - [`config`]: [`OpenAiConfig`] and the [`ApiKey`] that is never logged.
//! - [`request`]: job payload → request body (pure).
//! - [`sse`]: server-sent-events decoding (pure).
//! - [`stream`]: stream chunks → output text, usage, finish reason (pure).
//! - [`classify`]: HTTP status, `Retry-After` and error bodies → [`BackendError`] (pure).
//! - [`ratelimit`]: `x-ratelimit-*` response headers → the limits the server states (pure).
//! - `backend`: [`OpenAiBackend`], the IO shell around the above.
//!
//! [`BackendError`]: lastcall_backend::BackendError

mod backend;
pub mod classify;
pub mod config;
pub mod ratelimit;
pub mod request;
pub mod sse;
pub mod stream;

pub use backend::OpenAiBackend;
pub use config::{ApiKey, ConfigError, OpenAiConfig};
