//! The ledger of lastcall: SQLite (embedded default) and PostgreSQL through sqlx.
//!
//! **Invariant:** one terminal outcome per `job_id`, written once. A second terminal write
//! for the same job never overwrites the first; it reports `false` instead. The one
//! exception is `unknown`, reconciliation's "no outcome after deadline + grace": it is the
//! only terminal state that a later *real* outcome (any terminal state but `unknown`)
//! replaces, once; that write reports `true`. The job keeps `reconciled_at_ms` (when it
//! was marked `unknown`), so such late truths are counted ([`Ledger::late_outcomes`]).
//! **Invariant:** the worker acks a delivery only after `record_outcome` returned `Ok`.
//!
//! Tables (see `migrations/`):
//! - `jobs`: one row per job id: the inventory (`accepted`), the live state (`running`) and
//!   the terminal outcome with its timings and result/error; `reconciled_at_ms` once
//!   reconciliation marked it `unknown` (kept if the real outcome arrives later).
//! - `attempts`: one row per delivery that reached a decision (trace rows): received,
//!   checked, started, finished and acked times, the broker's redelivered flag, the decision
//!   and whether the model was called.
//! - `workers`: the workers' leases; `webhooks`, `webhook_attempts`: callback URLs and
//!   their delivery attempts.
//!
//! Retention (`ledger/retention.rs`) deletes a terminal job with all its rows, or clears
//! only its `result` text; nothing else ever deletes a job row.
//!
//! # Layout
//! - [`Ledger`] (`ledger.rs`): connect, migrate, and every read and write of the ledger.
//! - `ledger/retention.rs`: pruning (old terminal jobs and their rows, old result texts;
//!   never a non-terminal job or one whose webhook waits), the prune lock, the streamed
//!   export and the ledger's size.
//! - `ledger/copy.rs`: copying every table to another database (`ledger copy`) and the
//!   per-table count and checksum that check it.
//! - `batch.rs`: the set-based statements of a group commit (rows as one JSON parameter).
//! - `migrate.rs`: embedded, versioned migrations (`migrations/{sqlite,postgres}/`) and the
//!   `schema_migrations` table.
//! - `error.rs`: which database errors are worth retrying ([`StoreError::Unavailable`]).
//! - this file: the data types that cross the crate boundary.

mod batch;
mod error;
mod ledger;
mod migrate;

pub use ledger::batches::{BatchRow, FileRow, LineError};
pub use ledger::copy::{COPY_TABLES, CopyCounts, TableDigest, copy_columns};
pub use ledger::dashboard::{
    DASHBOARD_MAX_ROWS, DASHBOARD_STATEMENTS, DASHBOARD_TENANTS, DWELL_BUCKET_SQL,
    DWELL_BUCKETS_MS, DashboardCounts, HEADLINE_STATEMENTS,
};
pub use ledger::retention::{
    ArchiveFn, JobStream, LedgerSize, PRUNABLE_COUNT_LIMIT, PRUNE_DUTY, PruneCounts, PruneLock,
    prune_pause,
};
pub use ledger::{Ledger, LedgerWrite, WEBHOOK_CLAIM_STALE_MS};

use lastcall_core::request_size::RequestSize;
use lastcall_core::{Decision, Priority, Reason, State, Tenant};
use serde::Serialize;

/// Errors of the store. `Unavailable` is worth retrying (connection refused, pool timeout,
/// database locked); `Fatal` is not (bad URL, schema mismatch).
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("store unavailable: {0}")]
    Unavailable(String),
    #[error("store error: {0}")]
    Fatal(String),
}

impl StoreError {
    pub fn is_retryable(&self) -> bool {
        matches!(self, StoreError::Unavailable(_))
    }
}

/// The producer's inventory entry, written after the broker confirmed the publish.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AcceptedJob {
    pub job_id: String,
    pub kind: String,
    pub created_at_ms: i64,
    pub expires_at_ms: i64,
    pub accepted_at_ms: i64,
    pub trace_id: Option<String>,
    /// The request's idempotency fingerprint (`lastcall_producer::request_fingerprint`:
    /// SHA-256 over scope, kind, minimum runtime and payload) to detect id reuse with a
    /// different request at the ingress (`409`).
    pub payload_hash: String,
    /// Whose job it is (the envelope's `tenant`, [`Tenant::DEFAULT`] when it names none).
    pub tenant: Tenant,
    /// Its priority tier (the envelope's `priority`, `standard` when it names none).
    pub priority: Priority,
}

/// Written right before a model call starts (state `running`, one attempt row with
/// `model_called = true`). Makes crash loops countable: see `ReceiptInfo::prior_starts`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AttemptStart {
    /// Unique per delivery: `{worker}:{connection nonce}:{delivery tag}`.
    pub attempt_key: String,
    pub job_id: String,
    pub kind: String,
    pub attempt: u32,
    pub created_at_ms: i64,
    pub expires_at_ms: i64,
    pub worker: String,
    pub redelivered: bool,
    pub received_at_ms: i64,
    pub checked_at_ms: i64,
    pub started_at_ms: i64,
    /// The envelope's tenant and tier (see [`AcceptedJob::tenant`]).
    pub tenant: Tenant,
    pub priority: Priority,
}

/// One delivery's decision, and the terminal outcome when `state` is terminal.
///
/// The write side is typed: `state`, `reason` and `decision` become their ledger texts
/// (`State::as_str`, `Reason`'s `Display`, `Decision::as_str`) only where the store binds
/// them. The read side ([`JobRecord`], [`AttemptRow`]) keeps them as text: a database can
/// hold values written by other versions.
#[derive(Debug, Clone, PartialEq)]
pub struct OutcomeRecord {
    pub attempt_key: String,
    pub job_id: String,
    pub kind: String,
    /// Terminal states are written once; a non-terminal one (`running`) records only the
    /// attempt (a published retry, a hand-back).
    pub state: State,
    pub reason: Option<Reason>,
    /// What was done with the delivery (the attempt row's `decision`).
    pub decision: Decision,
    pub attempt: u32,
    pub created_at_ms: Option<i64>,
    pub expires_at_ms: Option<i64>,
    pub received_at_ms: Option<i64>,
    pub checked_at_ms: Option<i64>,
    pub started_at_ms: Option<i64>,
    pub finished_at_ms: Option<i64>,
    pub recorded_at_ms: i64,
    pub worker: String,
    pub redelivered: bool,
    /// Whether this delivery made a model call (then an `AttemptStart` was written first).
    pub model_called: bool,
    pub result: Option<String>,
    pub error: Option<String>,
    /// The model server's token counts (its `usage`), when it reported them.
    pub prompt_tokens: Option<i64>,
    pub completion_tokens: Option<i64>,
    /// The payload's approximate size ([`RequestSize::of_payload`]; `request_tokens` and
    /// `request_max_tokens`), whatever the backend's own measure: the door's measure, and
    /// with `prompt_tokens` what a starting worker replays the call under
    /// ([`RecordedCall::size`]). `None` when the payload is not a chat request (or the
    /// writer never read it: a dead letter).
    pub request_size: Option<RequestSize>,
    pub latency_ms: Option<i64>,
    pub cancel_requested: bool,
    pub cancel_confirmed: Option<bool>,
    /// The backend that ran (or would have run) the job.
    pub backend: Option<String>,
    /// The model that answered, as the backend reported it.
    pub model: Option<String>,
    /// The minimum useful runtime the admission decision used (own, learned or floor).
    pub min_runtime_ms: Option<i64>,
    /// A refusal for lack of time: the budget the check that refused would have admitted
    /// at that instant (`lastcall_core::disposition::WorkerPolicy::min_feasible_budget_ms`).
    pub min_feasible_budget_ms: Option<i64>,
    /// The envelope's tenant and tier; [`Tenant::DEFAULT`] and `standard` when the
    /// envelope names none or could not be parsed. A row never trades a tenant other than
    /// `default` (or a tier other than `standard`) for another one: the first writer that
    /// knew it (the ingress's claim, stamped from the caller's token) wins.
    pub tenant: Tenant,
    pub priority: Priority,
}

impl OutcomeRecord {
    /// A record of `state` for `job_id` with no attempt key, timings, result or call facts:
    /// the base of the records written without a delivery's whole story (the dead-letter
    /// processor's, the relay's); fill in the rest with struct update syntax.
    pub fn new(
        job_id: impl Into<String>,
        kind: impl Into<String>,
        state: State,
        decision: Decision,
        recorded_at_ms: i64,
    ) -> Self {
        Self {
            attempt_key: String::new(),
            job_id: job_id.into(),
            kind: kind.into(),
            state,
            reason: None,
            decision,
            attempt: 0,
            created_at_ms: None,
            expires_at_ms: None,
            received_at_ms: None,
            checked_at_ms: None,
            started_at_ms: None,
            finished_at_ms: None,
            recorded_at_ms,
            worker: String::new(),
            redelivered: false,
            model_called: false,
            result: None,
            error: None,
            prompt_tokens: None,
            completion_tokens: None,
            request_size: None,
            latency_ms: None,
            cancel_requested: false,
            cancel_confirmed: None,
            backend: None,
            model: None,
            min_runtime_ms: None,
            min_feasible_budget_ms: None,
            tenant: Tenant::default_tenant(),
            priority: Priority::Standard,
        }
    }
}

/// One model call whose duration the ledger holds ([`Ledger::recent_calls`]): a worker
/// starting up learns its call times from these instead of from nothing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordedCall {
    pub kind: String,
    /// How long the call took (`latency_ms`); for a call cut at the deadline, a lower bound.
    pub latency_ms: u64,
    pub recorded_at_ms: i64,
    /// Cut at the deadline (`deadline_exceeded`): `latency_ms` is a lower bound.
    pub cut: bool,
    /// The payload's approximate size (`request_tokens`, `request_max_tokens`:
    /// [`RequestSize::of_payload`], 4 characters a token): the measure a worker without
    /// the model's tokenizer, and the door, predict from. `None` for a call recorded
    /// before ledger version 12, or whose payload was not a chat request.
    pub size: Option<RequestSize>,
    /// The prompt's tokens as the call counted them (the server's `usage`, or the local
    /// model's tokenizer), when it said: the count the estimator's fit takes, which
    /// refines `size` (`ServiceTimes::observe_counted`).
    pub prompt_tokens: Option<u64>,
}

impl RecordedCall {
    /// The size this call is replayed under, as a live call of its kind is learned
    /// (`ServiceTimes::observe_counted`): its measure before the call and the prompt
    /// tokens it used (a count of 0, a streamed reply without usage, is no count).
    /// - Where the kind's backend counts the prompt's tokens (`counted`: the local model's
    ///   tokenizer), the recorded count is the measure too, with the payload's
    ///   `max_tokens`.
    /// - Elsewhere, and for the door, the payload's approximate size ([`Self::size`]) and
    ///   the server's count. A call recorded without the size (before ledger version 12)
    ///   is known by its count alone, which the estimator's calibration puts in one unit
    ///   with the rest. Without any size, these calls (of a kind mixing short and long
    ///   prompts, mostly the long ones' times at its p99) would hold every request to the
    ///   kind's estimate, and a refusal they justify is never probed: the kind would be
    ///   locked out until they leave the window.
    pub fn replayed(&self, counted: bool) -> (Option<RequestSize>, Option<u64>) {
        let used = self.prompt_tokens.filter(|&t| t > 0);
        if counted {
            let size = used.map(|prompt_tokens| RequestSize {
                prompt_tokens,
                max_tokens: self.size.and_then(|s| s.max_tokens),
            });
            return (size, used);
        }
        (self.size, used)
    }
}

/// What the worker needs to know about a job when a delivery arrives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ReceiptInfo {
    pub already_recorded: bool,
    /// Attempt rows with `model_called = true` for this job, over all deliveries.
    pub prior_starts: u32,
    /// A cancellation was requested while the job ran ([`Ledger::cancel`]), and the job
    /// has no terminal outcome yet: record `cancelled` without a call.
    pub cancel_requested: bool,
}

/// One webhook delivery attempt (`webhook_attempts`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct WebhookAttempt {
    pub job_id: String,
    /// 1-based.
    pub attempt: i64,
    pub at_ms: i64,
    /// The HTTP status, when the receiver answered.
    pub status: Option<i64>,
    /// Why it failed (no answer, a non-2xx status), `None` on success.
    pub error: Option<String>,
}

/// What [`Ledger::cancel`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CancelOutcome {
    /// The job had not started: it is `cancelled` now, with no model call.
    Cancelled,
    /// The job is running: its worker is asked to abort the call (the outcome follows).
    Requested,
    /// The job already has this terminal state; nothing changed.
    AlreadyTerminal(String),
    /// The ledger has no such job.
    NotFound,
}

/// A job's record (docs/concepts.md), as `jobs show --json` prints it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct JobRecord {
    pub job_id: String,
    pub kind: String,
    pub state: String,
    pub reason: Option<String>,
    pub attempts: i64,
    pub backend_calls: i64,
    pub created_at_ms: Option<i64>,
    pub expires_at_ms: Option<i64>,
    pub accepted_at_ms: Option<i64>,
    pub received_at_ms: Option<i64>,
    pub checked_at_ms: Option<i64>,
    pub started_at_ms: Option<i64>,
    pub finished_at_ms: Option<i64>,
    pub recorded_at_ms: Option<i64>,
    /// When reconciliation marked the job `unknown` (`None` if it never did). Kept when
    /// the real outcome arrived later and replaced `unknown`: then `state` is that
    /// outcome, `recorded_at_ms` its time, and the job is a *late outcome*.
    pub reconciled_at_ms: Option<i64>,
    pub worker: Option<String>,
    pub result: Option<String>,
    pub error: Option<String>,
    pub trace_id: Option<String>,
    pub prompt_tokens: Option<i64>,
    pub completion_tokens: Option<i64>,
    /// The request's size as the worker measured it from the payload (written since ledger
    /// version 12, `None` before and for a payload that is not a chat request): its
    /// approximate prompt tokens (characters ÷ 4 + 4 per message; not the server's
    /// `prompt_tokens`) and its `max_tokens`, if it set one.
    pub request_tokens: Option<i64>,
    pub request_max_tokens: Option<i64>,
    /// The recorded (last) model call's duration, ms.
    pub latency_ms: Option<i64>,
    /// Model time of every call the job made, ms: `latency_ms` plus its calls that failed
    /// and were retried (their attempts' finish − start); 0 without a call. Computed from
    /// the attempts when read, never stored.
    pub model_ms: i64,
    /// The part of `model_ms` no one could use: every call but the one that completed
    /// (failed and retried, cut at the deadline, cancelled).
    pub wasted_model_ms: i64,
    pub cancel_requested: bool,
    pub cancel_confirmed: Option<bool>,
    /// The backend that ran (or would have run) the job, e.g. `sim`, `openai`, `local`.
    pub backend: Option<String>,
    /// The model that answered, as the backend reported it.
    pub model: Option<String>,
    /// The minimum useful runtime the last admission decision used: the job's own, the
    /// learned call time of its kind, or the configured floor.
    pub min_runtime_ms: Option<i64>,
    /// Refused by a worker for lack of time (`expired_not_started`): the budget the check
    /// that refused it would have admitted at that instant (its expected wait for a slot,
    /// the clock margin and the minimum useful runtime). `None` otherwise.
    pub min_feasible_budget_ms: Option<i64>,
    /// Whose job it is: the envelope's `tenant`, `default` when it names none (and for
    /// every job recorded before tenants existed).
    pub tenant: String,
    /// Its priority tier: `critical`, `standard` (also when it names none) or `batch`.
    pub priority: String,
}

impl JobRecord {
    /// Whether the record holds a terminal outcome.
    pub fn is_terminal(&self) -> bool {
        self.state
            .parse::<lastcall_core::State>()
            .is_ok_and(lastcall_core::State::is_terminal)
    }
}

/// One attempt (trace) row.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AttemptRow {
    pub attempt_key: String,
    pub job_id: String,
    pub attempt: i64,
    pub worker: String,
    pub redelivered: bool,
    pub received_at_ms: Option<i64>,
    pub checked_at_ms: Option<i64>,
    pub started_at_ms: Option<i64>,
    pub finished_at_ms: Option<i64>,
    pub acked_at_ms: Option<i64>,
    pub decision: Option<String>,
    pub state: Option<String>,
    pub reason: Option<String>,
    pub model_called: bool,
}

/// Filter of `list`.
#[derive(Debug, Clone, Default)]
pub struct ListFilter {
    pub state: Option<String>,
    pub kind: Option<String>,
    pub tenant: Option<String>,
    pub limit: Option<i64>,
}
