//! The lastcall worker runtime.
//!
//! # Layout
//! - [`runtime`]: the worker: bounded local buffer, model slots, the last admission check
//!   right before the model call, store-then-ack, graceful shutdown.
//! - [`slots`]: model slots, granted to waiting jobs earliest deadline first (or FIFO).
//! - [`relay`]: republishes due retries with the remaining budget as their TTL.
//! - [`stats`]: live counters and gauges the CLI and metrics read.
//! - [`stream`]: a streaming call's token deltas to the job's `reply_to`.
//! - [`store_retry`]: retrying ledger writes with backoff while pausing intake.
//! - `committer`: group commit of starts and outcomes (one transaction per batch).
//!
//! The clock (`lastcall-clock`) and the producer API (`lastcall-producer`: submit, shed,
//! cancel) are crates of their own; they are re-exported here ([`clock`], [`submit`],
//! [`shed`], [`cancel`]) so that existing callers keep their paths. New code imports them
//! from their own crates.

mod ack_batch;
mod ack_log;
mod committer;
pub mod dlq;
pub mod events;
pub mod relay;
pub mod runtime;
pub mod slots;
pub mod stats;
pub mod store_retry;
pub mod stream;

pub use lastcall_clock as clock;
pub use lastcall_producer::{cancel, shed, submit};

pub use clock::{Clock, ClockSyncMode, SyncState, SystemClock};
pub use lastcall_producer::{DeadlineSpec, NewJob, SubmitError, Submitted, Submitter};
pub use runtime::{DispatchPolicy, Fault, Worker, WorkerConfig};
pub use slots::BufferOrder;
pub use stats::WorkerStats;
