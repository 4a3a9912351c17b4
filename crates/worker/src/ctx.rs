//! The shared state of one running worker: its settings and adapters, and the values its
//! tasks share (the door, the jobs held, the call times, the slots, the breakers, the
//! rate limits), each its own type in its own module. A job's driver (`job/mod.rs`) holds
//! it; its steps take views of the part they use: [`Calls`] (the wait for a slot and the
//! model call) and [`Recording`] (the outcome row, the retry publish, the settlement).

use crate::clock::Clock;
use crate::config::WorkerConfig;
use crate::held::Held;
use crate::settle::Door;
use crate::slots::Slots;
use crate::stats::WorkerStats;
use crate::store_retry::StoreHealth;
use crate::times::CallTimes;
use lastcall_backend::{Backend, CancellationToken};
use lastcall_broker::Publisher;
use lastcall_store::Ledger;
use std::sync::{Arc, RwLock};

/// Shared state of one running worker.
pub(crate) struct Ctx {
    pub(crate) cfg: WorkerConfig,
    pub(crate) ledger: Arc<Ledger>,
    pub(crate) backend: Arc<dyn Backend>,
    pub(crate) clock: Arc<dyn Clock>,
    pub(crate) stats: Arc<WorkerStats>,
    pub(crate) slots: Arc<Slots>,
    /// The retry publisher of the current broker connection (replaced on reconnect).
    pub(crate) publisher: Arc<RetryPublisher>,
    pub(crate) health: StoreHealth,
    /// Fires on shutdown: waiting jobs are handed back, store retries stop.
    pub(crate) shutdown: CancellationToken,
    /// Makes this process's consumer tags and attempt keys unique.
    pub(crate) nonce: String,
    /// The settlement door: group commit of the starts and outcomes that must be durable
    /// before a call or an ack, and every ack, reject and requeue.
    pub(crate) door: Door,
    /// The jobs held (waiting or running) and the calls running in this process.
    pub(crate) held: Arc<Held>,
    /// What this worker learned of its calls' times: every admission gate asks it.
    pub(crate) times: CallTimes,
    /// Outcome events, published after each durable terminal outcome (best-effort).
    pub(crate) events: lastcall_broker::EventSink,
    /// Token deltas of streaming calls, to each job's `reply_to` (best-effort, bounded).
    pub(crate) deltas: lastcall_broker::DeltaSink,
    /// The circuit breaker of each model server (backend, or route).
    pub(crate) breakers: Arc<crate::breakers::Breakers>,
    /// The rate limits of each model server (backend, or route), shared by all slots.
    pub(crate) limits: Arc<crate::limits::Limiters>,
}

/// What waiting for a slot and making the model call use (`job/wait.rs`, `job/call.rs`,
/// and the job's gates: its backend on a fallback route, its learned time, a probe): the
/// backend, the call times, the slots, the breakers, the rate limits, the token stream,
/// the stats, the clock and the shutdown signal. Not the ledger, the settlement door, the
/// retry publisher, the outcome events or the jobs held: a job waiting or calling records
/// nothing and settles nothing.
pub(crate) struct Calls<'a> {
    pub(crate) cfg: &'a WorkerConfig,
    pub(crate) clock: &'a Arc<dyn Clock>,
    pub(crate) stats: &'a Arc<WorkerStats>,
    pub(crate) backend: &'a Arc<dyn Backend>,
    pub(crate) times: &'a CallTimes,
    pub(crate) slots: &'a Arc<Slots>,
    pub(crate) breakers: &'a Arc<crate::breakers::Breakers>,
    pub(crate) limits: &'a Arc<crate::limits::Limiters>,
    pub(crate) deltas: &'a lastcall_broker::DeltaSink,
    pub(crate) shutdown: &'a CancellationToken,
}

impl Calls<'_> {
    /// The circuit breaker key of a kind: the first backend its calls go to (the route's
    /// first backend when kinds are routed).
    pub(crate) fn breaker_key<'a>(&'a self, kind: &str) -> &'a str {
        self.backend.first_route(kind)
    }

    /// The backends that may serve `kind`, in the order they are tried (more than one on a
    /// fallback route): the keys of their breakers, limiters and call times.
    pub(crate) fn route(&self, kind: &str) -> Vec<&str> {
        self.backend.routes_of(kind)
    }

    /// How long a half-open trial call of `kind` to `backend` may run before it counts as
    /// hung (failed): the breaker's hang factor × the p99 of the kind's completed calls
    /// there, or the cool-down while none completed.
    pub(crate) fn trial_limit_ms(&self, kind: &str, backend: &str, now_ms: i64) -> u64 {
        let policy = self.breakers.policy();
        (self.times.completed_p99(kind, backend, now_ms)).map_or(policy.cool_down_ms, |p99| {
            p99.max(1).saturating_mul(policy.hang_factor)
        })
    }

    /// The expected wait for a slot of a job received now (`ticket`): the jobs waiting
    /// that the buffer's order serves first ([`crate::slots`]: a higher tier, a tenant with
    /// less model time served, an earlier deadline) are ahead of it, each with the learned
    /// mean duration of its own kind; the ticket's own (`work_ms`) stands in when none
    /// wait. Zero while nothing is learned. (The reference policies ignore it.)
    pub(crate) fn expected_wait_ms(&self, ticket: &lastcall_core::schedule::Ticket) -> u64 {
        let (ahead, work_ms) = self.slots.ahead_of(ticket);
        let mean_ms = match (ahead, work_ms) {
            (0, _) | (_, 0) => ticket.work_ms,
            (n, w) => w / n as u64,
        };
        lastcall_core::wait::expected_wait_ms(
            ahead,
            self.slots.available(),
            self.slots.total(),
            mean_ms,
        )
    }
}

/// What the end of a delivery uses (`job/settle.rs`, and the outcome row of
/// `job/record.rs`): the settlement door, the retry publisher, the outcome events, the
/// stats and the clock. Not the slots, the call times, the breakers or the limits: a
/// delivery that is being recorded and settled no longer decides anything about a call.
pub(crate) struct Recording<'a> {
    pub(crate) cfg: &'a WorkerConfig,
    pub(crate) clock: &'a dyn Clock,
    pub(crate) stats: &'a WorkerStats,
    pub(crate) door: &'a Door,
    pub(crate) publisher: &'a RetryPublisher,
    pub(crate) events: &'a lastcall_broker::EventSink,
    /// The worker's backend name: the outcome row of a delivery that named none.
    pub(crate) backend: &'a str,
}

impl Ctx {
    /// The part of the worker that waiting for a slot and calling the model use.
    pub(crate) fn calls(&self) -> Calls<'_> {
        Calls {
            cfg: &self.cfg,
            clock: &self.clock,
            stats: &self.stats,
            backend: &self.backend,
            times: &self.times,
            slots: &self.slots,
            breakers: &self.breakers,
            limits: &self.limits,
            deltas: &self.deltas,
            shutdown: &self.shutdown,
        }
    }

    /// The part of the worker that recording and settling a delivery uses.
    pub(crate) fn recording(&self) -> Recording<'_> {
        Recording {
            cfg: &self.cfg,
            clock: self.clock.as_ref(),
            stats: &self.stats,
            door: &self.door,
            publisher: &self.publisher,
            events: &self.events,
            backend: self.backend.name(),
        }
    }
}

/// The retry publisher of the current broker connection, replaced on reconnect; shared by
/// the job tasks, the retry relay and the `/readyz` mirror.
pub(crate) struct RetryPublisher(RwLock<Publisher>);

impl RetryPublisher {
    pub(crate) fn new(publisher: Publisher) -> Self {
        Self(RwLock::new(publisher))
    }

    /// The publisher of the current connection.
    pub(crate) fn get(&self) -> Publisher {
        self.0.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The publisher of a new connection.
    pub(crate) fn replace(&self, publisher: Publisher) {
        *self.0.write().unwrap_or_else(|e| e.into_inner()) = publisher;
    }
}
