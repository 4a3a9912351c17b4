//! The lastcall worker runtime and the publisher library API.
//!
//! # Layout
//! - [`clock`]: the one clock abstraction, with the kernel's sync state.
//! - [`submit`]: validate, stamp and publish jobs with confirm; record `accepted`.
//! - [`runtime`]: the worker: bounded local buffer, model slots, the last admission check
//!   right before the model call, store-then-ack, graceful shutdown.
//! - [`slots`]: model slots, granted to waiting jobs earliest deadline first (or FIFO).
//! - [`relay`]: republishes due retries with the remaining budget as their TTL.
//! - [`stats`]: live counters and gauges the CLI and metrics read.
//! - [`stream`]: a streaming call's token deltas to the job's `reply_to`.
//! - [`store_retry`]: retrying ledger writes with backoff while pausing intake.
//! - `settle`: the one settlement door — group commit of starts and outcomes, coalesced
//!   acks over `lastcall_core::ack_plan`, acked-at marks.

pub mod cancel;
pub mod clock;
pub mod dlq;
pub mod events;
pub mod relay;
pub mod runtime;
mod settle;
pub mod shed;
pub mod slots;
pub mod stats;
pub mod store_retry;
pub mod stream;
pub mod submit;

pub use clock::{Clock, ClockSyncMode, SyncState, SystemClock};
pub use runtime::{DispatchPolicy, Fault, Worker, WorkerConfig};
pub use slots::BufferOrder;
pub use stats::WorkerStats;
pub use submit::{DeadlineSpec, NewJob, SubmitError, Submitted, Submitter};
