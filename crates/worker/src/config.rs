//! The worker's settings ([`WorkerConfig`]): a leaf of the crate, so that the modules that
//! read the settings (the shared context, the hooks, the runtime) do not import the
//! runtime that builds the worker from them.

use crate::clock::ClockSyncMode;
use crate::slots::BufferOrder;
use lastcall_broker::Topology;
use lastcall_core::WorkerPolicy;
use lastcall_core::service_time::ServiceTimeConfig;
use std::time::Duration;

pub use lastcall_core::disposition::{DeadlineChecks, Dispatch};

/// Everything a worker needs besides its adapters.
#[derive(Debug, Clone)]
pub struct WorkerConfig {
    pub topology: Topology,
    /// Worker name recorded in the ledger.
    pub name: String,
    /// Model slots: concurrent model calls (with `auto_slots`, the most).
    pub slots: usize,
    /// `--slots auto`: the number of calls in flight adapts in `[1, max]` to the model
    /// server ([`lastcall_core::concurrency`]); `None`: exactly `slots`.
    pub auto_slots: Option<lastcall_core::concurrency::LimitConfig>,
    /// Unacked deliveries the broker may push to this worker from each queue it consumes
    /// (the work queue and each lane): [`default_prefetch`] unless set.
    pub prefetch: u16,
    /// Cap on the bytes of bodies held locally; prefetch only bounds the count.
    pub max_buffer_bytes: usize,
    /// Every decision about a delivery (including which deadline checks run:
    /// [`WorkerPolicy::dispatch`], a benchmark reference knob).
    pub policy: WorkerPolicy,
    pub clock_sync: ClockSyncMode,
    /// How long shutdown waits for in-flight work before handing it back.
    pub shutdown_grace: Duration,
    /// How long to wait for a backend to confirm a cancellation at the deadline.
    pub cancel_grace: Duration,
    /// Test only (feature `test-hooks`): a fault to inject ([`crate::hooks`]).
    #[cfg(feature = "test-hooks")]
    pub fault: Option<Fault>,
    /// Test only (feature `test-hooks`): a deliberate local wait between getting a slot
    /// and the admission check (work delivered in time that waits past its deadline).
    #[cfg(feature = "test-hooks")]
    pub hold_before_admission: Duration,
    /// Which waiting job gets a free model slot ([`crate::slots`]): the order within one
    /// tenant's jobs of one priority tier.
    pub buffer_order: BufferOrder,
    /// The tenants' weights in the fair share of model time (absent: 1).
    pub tenant_weights: Vec<(String, u32)>,
    /// When set, a valid envelope whose `x-lastcall-signature` is missing or wrong is
    /// `rejected`/`bad_signature` (never run), so a producer cannot extend its deadline.
    pub signing_key: Option<lastcall_core::SigningKey>,
    /// The broker's consumer timeout (RabbitMQ `consumer_timeout`), when known: each model
    /// call is capped to end inside the delivery's ack window
    /// ([`lastcall_core::ack_window`]). `None`: unknown, the job's budget alone decides and a
    /// broker that closes the channel is survived like any lost channel.
    pub consumer_timeout: Option<Duration>,
    /// The circuit breaker of each model server ([`lastcall_core::breaker`]).
    pub breaker: lastcall_core::breaker::BreakerPolicy,
    /// Configured requests and tokens per minute by backend name (the route's backend
    /// when kinds are routed; [`lastcall_core::rate_limit`]). A backend not named here is
    /// limited only by what its servers' `x-ratelimit-*` headers say.
    pub rate_limits: std::collections::BTreeMap<String, lastcall_core::rate_limit::Limits>,
    /// The models a payload's `model` may name (`--allow-model`); any other is removed
    /// before the call, so the route's or the backend's own model serves: a producer does
    /// not pick what runs on the operator's key ([`lastcall_core::model_choice`]).
    pub allowed_models: lastcall_core::model_choice::AllowedModels,
    /// The learned call time's settings ([`lastcall_core::service_time`]); the default is
    /// what `lastcall worker` runs with (the benchmark turns request-awareness off for its
    /// reference run).
    pub service_time: ServiceTimeConfig,
}

impl WorkerConfig {
    pub fn new(prefix: &str, slots: usize) -> Self {
        Self {
            topology: Topology::new(prefix),
            name: default_worker_name(),
            slots,
            auto_slots: None,
            prefetch: default_prefetch(slots),
            max_buffer_bytes: 64 * 1024 * 1024,
            policy: WorkerPolicy::default(),
            clock_sync: ClockSyncMode::Ignore,
            shutdown_grace: Duration::from_secs(10),
            cancel_grace: Duration::from_millis(500),
            #[cfg(feature = "test-hooks")]
            fault: None,
            #[cfg(feature = "test-hooks")]
            hold_before_admission: Duration::ZERO,
            buffer_order: BufferOrder::default(),
            tenant_weights: Vec::new(),
            signing_key: None,
            consumer_timeout: None,
            breaker: Default::default(),
            rate_limits: Default::default(),
            allowed_models: Default::default(),
            service_time: ServiceTimeConfig::default(),
        }
    }
}

/// `host:pid`.
pub fn default_worker_name() -> String {
    let host = std::fs::read_to_string("/etc/hostname")
        .map(|s| s.trim().to_owned())
        .unwrap_or_else(|_| "host".into());
    format!("{host}:{}", std::process::id())
}

/// Fault injection for crash tests.
#[cfg(feature = "test-hooks")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Stop forever right after an outcome is stored, before the ack, logging
    /// `fault: paused after store`, so a test can SIGKILL the process at exactly that point.
    PauseAfterStore,
}

/// The default window of unacked deliveries per queue: 32 per model slot, at least 128.
///
/// Large on purpose, for tenant isolation: a delivery stays unacked while its job waits
/// for a slot, so a small window filled by one tenant's jobs that can still finish stops
/// the queue, and every other tenant's job in it waits behind that backlog in the
/// broker. At receipt a job is refused when its expected wait under the fair share
/// exceeds its budget, so a tenant's waiting jobs are about slots × budget ÷ call time;
/// with a window larger than that, the surplus is delivered and refused at once and the
/// queue drains as fast as it fills (`tests/isolation.rs`).
///
/// The bound: isolation holds while slots × budget ÷ call time stays below the window.
/// Memory: at most this many deliveries per queue (8 queues), never more than
/// `max_buffer_bytes` of bodies. The price: under overload a worker holds what it can
/// finish, not only what it can start soon, so between workers of unequal speed the
/// slower keeps its share of the arrivals.
pub fn default_prefetch(slots: usize) -> u16 {
    (slots.saturating_mul(32)).clamp(128, u16::MAX as usize) as u16
}
