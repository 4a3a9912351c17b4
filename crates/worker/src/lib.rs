//! The lastcall worker runtime and the publisher library API.
//!
//! # Layout
//! - [`clock`]: the one clock abstraction, with the kernel's sync state.
//! - [`submit`]: validate, stamp and publish jobs with confirm; record `accepted`.
//! - [`runtime`]: [`Worker::build`] then [`Worker::run`]: the connections (one
//!   generation each), reconnection, graceful shutdown.
//! - `generation`: one connection's consumer, ack batch, flusher and retry relay; the
//!   receive loop (bounded buffer, one task per delivery).
//! - `job`: the driver of one delivery through the core's state machine
//!   (`lastcall_core::delivery`): receipt, slot and clock wait, model call, settlement.
//! - `settle`: the one settlement door — group commit of starts and outcomes, coalesced
//!   acks over `lastcall_core::ack_plan`, acked-at marks.
//! - `lease`: the holds that keep a redelivered job from running twice (in-process and
//!   across workers, with the worker lease).
//! - `ctx`: the worker's shared state; `sidecars`: the lease, readiness and cancel tasks.
//! - `hooks`: test-only hooks behind the `test-hooks` feature.
//! - [`slots`]: model slots, granted to waiting jobs earliest deadline first (or FIFO).
//! - [`relay`]: republishes due retries with the remaining budget as their TTL.
//! - [`stats`]: live counters and gauges the CLI and metrics read.
//! - [`stream`]: a streaming call's token deltas to the job's `reply_to`.
//! - [`store_retry`]: retrying ledger writes with backoff while pausing intake.

pub mod cancel;
pub mod clock;
mod ctx;
pub mod dlq;
pub mod events;
mod generation;
mod hooks;
mod job;
mod lease;
pub mod relay;
pub mod runtime;
mod settle;
pub mod shed;
mod sidecars;
pub mod slots;
pub mod stats;
pub mod store_retry;
pub mod stream;
pub mod submit;

pub use clock::{Clock, ClockSyncMode, SyncState, SystemClock};
#[cfg(feature = "test-hooks")]
pub use hooks::Fault;
pub use runtime::{DispatchPolicy, Worker, WorkerConfig};
pub use slots::BufferOrder;
pub use stats::WorkerStats;
pub use submit::{DeadlineSpec, NewJob, SubmitError, Submitted, Submitter};
