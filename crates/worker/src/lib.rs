//! The lastcall worker runtime.
//!
//! # Layout
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
//! - [`slots`]: model slots, granted to waiting jobs in the buffer's order; a fixed count, or
//!   the adaptive limit of `--slots auto` ([`lastcall_core::concurrency`]).
//! - [`relay`]: republishes due retries with the remaining budget as their TTL.
//! - [`stats`]: live counters and gauges the CLI and metrics read.
//! - [`stream`]: a streaming call's token deltas to the job's `reply_to`.
//! - [`store_retry`]: retrying ledger writes with backoff while pausing intake.
//!
//! The clock (`lastcall-clock`) and the producer API (`lastcall-producer`: submit, shed,
//! cancel) are crates of their own; they are re-exported here ([`clock`], [`submit`],
//! [`shed`], [`cancel`]) so that existing callers keep their paths. New code imports them
//! from their own crates.

mod breakers;
pub mod config;
mod ctx;
pub mod dlq;
pub mod events;
#[cfg(test)]
mod fuzz_headers;
mod generation;
mod held;
mod hooks;
mod job;
mod lease;
mod limits;
pub mod relay;
pub mod runtime;
mod settle;
mod sidecars;
pub mod slots;
pub mod stats;
pub mod store_retry;
pub mod stream;
mod times;

pub use lastcall_clock as clock;
pub use lastcall_producer::{cancel, shed, submit};

pub use clock::{Clock, ClockSyncMode, SyncState, SystemClock};
pub use config::default_prefetch;
#[cfg(feature = "test-hooks")]
pub use hooks::Fault;
pub use lastcall_producer::{DeadlineSpec, NewJob, SubmitError, Submitted, Submitter};
pub use runtime::{Worker, WorkerConfig};
pub use slots::BufferOrder;
pub use stats::WorkerStats;
