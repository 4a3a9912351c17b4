//! [`Ledger`]: the one handle to the outcome store, over SQLite or PostgreSQL.
//!
//! Every statement is written once, in SQL both backends understand (`$n` placeholders,
//! `INSERT … ON CONFLICT … DO UPDATE … WHERE`, `RETURNING`, correlated `COUNT(*)`
//! subqueries), and run on the backend's own pool type; the small `write_tx!`/`on_pool!`
//! macros expand each body once per backend. The batched forms (rows as one JSON
//! parameter) are generated from those statements per dialect by `batch.rs`, the only
//! place that spells a dialect's JSON functions.
//!
//! **Invariant (write-once):** a terminal outcome is written by
//! `INSERT … ON CONFLICT (job_id) DO UPDATE … WHERE jobs.state IN ('accepted', 'running')
//! OR (jobs.state = 'unknown' AND excluded.state <> 'unknown')`.
//! Under concurrency the conflicting row is locked (PostgreSQL) or the database is
//! write-locked (SQLite), so exactly one writer sees one affected row; everyone else sees
//! zero and gets `false`.
//!
//! **`unknown` yields to the truth:** `unknown` (set only by [`Ledger::mark_unknown`]:
//! nothing was recorded by deadline + grace) is a terminal state that says "we do not
//! know", not an outcome. It is the only terminal state that a later real outcome (any
//! other terminal state) replaces; that write is the job's one recorded outcome, so it
//! returns `true` (the worker or dead-letter processor counts it once). Any other terminal
//! state is never overwritten, and `unknown` over `unknown` changes nothing. The job keeps
//! `reconciled_at_ms` (set by `mark_unknown`, in no upsert's column list), so a late truth
//! is `reconciled_at_ms IS NOT NULL AND state <> 'unknown'` ([`Ledger::late_outcomes`]).
//!
//! **Invariant (counters):** a job's attempt count and model-call count are never stored:
//! every read counts its `attempts` rows (`attempts_job_id` index), so no write can lose a
//! count and the group commit on the single writer does no counting.

use std::str::FromStr;
use std::sync::OnceLock;
use std::time::Duration;

use lastcall_core::State;
use lastcall_core::request_size::RequestSize;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};
use sqlx::{AssertSqlSafe, ColumnIndex, Decode, PgPool, Row, SqlitePool, Type};

use crate::batch::{Dialect, JsonRows, insert_from_json, json_array};
use crate::error::db;
use crate::migrate;
use crate::{
    AcceptedJob, AttemptRow, AttemptStart, CancelOutcome, JobRecord, ListFilter, OutcomeRecord,
    ReceiptInfo, StoreError, WebhookAttempt,
};

/// How long a caller waits for a pooled connection before `Unavailable`: short, so an
/// outage surfaces quickly; the worker retries with its own backoff.
const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(3);
/// How long SQLite waits for another process's write lock before `SQLITE_BUSY`.
const SQLITE_BUSY_TIMEOUT: Duration = Duration::from_secs(5);
/// SQLite read connections (WAL lets readers run beside the single writer).
const SQLITE_READERS: u32 = 4;
/// PostgreSQL connections; the server does group commit, so a few help throughput.
const PG_MAX_CONNECTIONS: u32 = 8;

/// The SQL spelling of "not terminal", as it appears in the statements below; a test keeps
/// it in sync with `State::is_terminal`.
#[cfg(test)]
const NON_TERMINAL_SQL: &str = "('accepted', 'running')";

/// A webhook claim with no attempt for this long is stale: its claimer stopped
/// mid-delivery, and another `serve` (or the same one, restarted) may claim it again
/// ([`Ledger::claim_webhook`]). Far longer than any pause between two attempts (at most
/// 30 s of backoff plus one attempt's timeout).
pub const WEBHOOK_CLAIM_STALE_MS: i64 = 10 * 60 * 1000;

/// A job's model calls: its attempt rows that called the model (never stored; see the
/// counters invariant). A macro so that statements stay `&'static str`.
macro_rules! backend_calls {
    () => {
        "(SELECT COUNT(*) FROM attempts a WHERE a.job_id = jobs.job_id AND a.model_called)"
    };
}

/// The summed duration (finish − start) of a job's calls that failed and were retried:
/// its attempt rows that called the model, decided `retry` and have both times; NULL when
/// there is none. (The job's recorded call is the last one; its time is `latency_ms`.)
macro_rules! retried_calls_ms {
    () => {
        "(SELECT SUM(a.finished_at_ms - a.started_at_ms) FROM attempts a \
         WHERE a.job_id = jobs.job_id AND a.model_called AND a.decision = 'retry' \
         AND a.started_at_ms IS NOT NULL AND a.finished_at_ms IS NOT NULL)"
    };
}

/// A job's model time: its recorded call's `latency_ms` plus its retried calls
/// ([`retried_calls_ms!`]).
macro_rules! model_ms {
    () => {
        concat!(
            "CAST(COALESCE(jobs.latency_ms, 0) + COALESCE(",
            retried_calls_ms!(),
            ", 0) AS BIGINT)"
        )
    };
}

/// The part of [`model_ms!`] no one could use: the retried calls, and the recorded call
/// unless the job completed.
macro_rules! wasted_model_ms {
    () => {
        concat!(
            "CAST(COALESCE(",
            retried_calls_ms!(),
            ", 0) + CASE WHEN jobs.state = 'completed' THEN 0 \
             ELSE COALESCE(jobs.latency_ms, 0) END AS BIGINT)"
        )
    };
}

/// Column list of [`JobRecord`], in a macro so that statements stay `&'static str`.
macro_rules! job_columns {
    () => {
        concat!(
            "job_id, kind, state, reason, \
             (SELECT COUNT(*) FROM attempts a WHERE a.job_id = jobs.job_id) AS attempts, ",
            backend_calls!(),
            " AS backend_calls, created_at_ms, expires_at_ms, accepted_at_ms, received_at_ms, \
             checked_at_ms, started_at_ms, finished_at_ms, recorded_at_ms, reconciled_at_ms, \
             worker, result, error, trace_id, prompt_tokens, completion_tokens, latency_ms, \
             cancel_requested, cancel_confirmed, backend, model, min_runtime_ms, tenant, priority, \
             request_tokens, request_max_tokens, min_feasible_budget_ms, ",
            model_ms!(),
            " AS model_ms, ",
            wasted_model_ms!(),
            " AS wasted_model_ms"
        )
    };
}

/// Column list of [`AttemptRow`].
macro_rules! attempt_columns {
    () => {
        "attempt_key, job_id, attempt, worker, redelivered, received_at_ms, checked_at_ms, \
         started_at_ms, finished_at_ms, acked_at_ms, decision, state, reason, model_called"
    };
}

const INSERT_ACCEPTED: &str = "INSERT INTO jobs \
     (job_id, kind, state, created_at_ms, expires_at_ms, accepted_at_ms, trace_id, payload_hash, \
      tenant, priority) \
     VALUES ($1, $2, 'accepted', $3, $4, $5, $6, $7, $8, $9) \
     ON CONFLICT (job_id) DO NOTHING";

/// How a write that finds the job's row keeps its tenant and tier: a row that names a
/// tenant other than `default` (a tier other than `standard`) keeps it; only the defaults
/// give way. Every writer reads both from the same signed envelope, so they agree; a
/// writer that could not parse it (a dead letter) writes the defaults, which never
/// replace what the ingress's claim recorded. A macro so that statements stay `&'static str`.
macro_rules! keep_tenant {
    ($new:literal) => {
        concat!(
            "tenant = CASE WHEN jobs.tenant = 'default' THEN ",
            $new,
            ".tenant ELSE jobs.tenant END, \
             priority = CASE WHEN jobs.priority = 'standard' THEN ",
            $new,
            ".priority ELSE jobs.priority END"
        )
    };
}

/// The worker may have written the row before the producer's inventory write landed:
/// fill in what only the producer knows, once.
const BACKFILL_ACCEPTED: &str = "UPDATE jobs SET accepted_at_ms = $2, \
     trace_id = COALESCE(trace_id, $3), payload_hash = COALESCE(payload_hash, $4), \
     created_at_ms = COALESCE(created_at_ms, $5), expires_at_ms = COALESCE(expires_at_ms, $6), \
     tenant = CASE WHEN tenant = 'default' THEN $7 ELSE tenant END, \
     priority = CASE WHEN priority = 'standard' THEN $8 ELSE priority END \
     WHERE job_id = $1 AND accepted_at_ms IS NULL";

const UPSERT_JOB_RUNNING: &str = concat!(
    "INSERT INTO jobs \
     (job_id, kind, state, created_at_ms, expires_at_ms, received_at_ms, checked_at_ms, \
      started_at_ms, worker, tenant, priority) \
     VALUES ($1, $2, 'running', $3, $4, $5, $6, $7, $8, $9, $10) \
     ON CONFLICT (job_id) DO UPDATE SET state = 'running', ",
    keep_tenant!("excluded"),
    ", \
     kind = CASE WHEN jobs.kind = '' THEN excluded.kind ELSE jobs.kind END, \
     created_at_ms = COALESCE(jobs.created_at_ms, excluded.created_at_ms), \
     expires_at_ms = COALESCE(jobs.expires_at_ms, excluded.expires_at_ms), \
     received_at_ms = excluded.received_at_ms, checked_at_ms = excluded.checked_at_ms, \
     started_at_ms = excluded.started_at_ms, worker = excluded.worker \
     WHERE jobs.state IN ('accepted', 'running')"
);

const UPSERT_ATTEMPT_START: &str = "INSERT INTO attempts \
     (attempt_key, job_id, attempt, worker, redelivered, received_at_ms, checked_at_ms, \
      started_at_ms, state, model_called) \
     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, 'running', TRUE) \
     ON CONFLICT (attempt_key) DO UPDATE SET \
     received_at_ms = excluded.received_at_ms, checked_at_ms = excluded.checked_at_ms, \
     started_at_ms = excluded.started_at_ms, state = 'running', model_called = TRUE";

/// The write-once terminal outcome. One affected row means this call wrote it: over a
/// non-terminal row, or a real outcome over `unknown` (see the module doc); it never names
/// `reconciled_at_ms`, so a replaced `unknown` keeps it.
const UPSERT_JOB_TERMINAL: &str = concat!(
    "INSERT INTO jobs \
     (job_id, kind, state, reason, created_at_ms, expires_at_ms, received_at_ms, checked_at_ms, \
      started_at_ms, finished_at_ms, recorded_at_ms, worker, result, error, prompt_tokens, \
      completion_tokens, latency_ms, cancel_requested, cancel_confirmed, backend, model, \
      min_runtime_ms, tenant, priority, request_tokens, request_max_tokens, \
      min_feasible_budget_ms) \
     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, $18, $19, \
      $20, $21, $22, $23, $24, $25, $26, $27) \
     ON CONFLICT (job_id) DO UPDATE SET ",
    keep_tenant!("excluded"),
    ", \
     kind = CASE WHEN jobs.kind = '' THEN excluded.kind ELSE jobs.kind END, \
     state = excluded.state, reason = excluded.reason, \
     created_at_ms = COALESCE(excluded.created_at_ms, jobs.created_at_ms), \
     expires_at_ms = COALESCE(excluded.expires_at_ms, jobs.expires_at_ms), \
     received_at_ms = excluded.received_at_ms, checked_at_ms = excluded.checked_at_ms, \
     started_at_ms = excluded.started_at_ms, finished_at_ms = excluded.finished_at_ms, \
     recorded_at_ms = excluded.recorded_at_ms, worker = excluded.worker, \
     result = excluded.result, error = excluded.error, \
     prompt_tokens = excluded.prompt_tokens, completion_tokens = excluded.completion_tokens, \
     latency_ms = excluded.latency_ms, cancel_requested = excluded.cancel_requested, \
     cancel_confirmed = excluded.cancel_confirmed, backend = excluded.backend, \
     model = excluded.model, min_runtime_ms = excluded.min_runtime_ms, \
     request_tokens = excluded.request_tokens, request_max_tokens = excluded.request_max_tokens, \
     min_feasible_budget_ms = excluded.min_feasible_budget_ms \
     WHERE jobs.state IN ('accepted', 'running') \
     OR (jobs.state = 'unknown' AND excluded.state <> 'unknown')"
);

/// A non-terminal decision (e.g. a retry): moves the live state, never a terminal one.
const UPSERT_JOB_LIVE: &str = concat!(
    "INSERT INTO jobs \
     (job_id, kind, state, created_at_ms, expires_at_ms, worker, tenant, priority) \
     VALUES ($1, $2, $3, $4, $5, $6, $7, $8) \
     ON CONFLICT (job_id) DO UPDATE SET state = excluded.state, ",
    keep_tenant!("excluded"),
    " WHERE jobs.state IN ('accepted', 'running')"
);

/// An attempt row keeps its first receipt/check/start times (set by `record_start`, or by
/// the first write of a replayed outcome); the decision fields take the latest write, and
/// `model_called` is the outcome's word: a start row whose call was refused at the final
/// re-check must not count as a model call.
const UPSERT_ATTEMPT_OUTCOME: &str = "INSERT INTO attempts \
     (attempt_key, job_id, attempt, worker, redelivered, received_at_ms, checked_at_ms, \
      started_at_ms, finished_at_ms, decision, state, reason, model_called) \
     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13) \
     ON CONFLICT (attempt_key) DO UPDATE SET \
     received_at_ms = COALESCE(attempts.received_at_ms, excluded.received_at_ms), \
     checked_at_ms = COALESCE(attempts.checked_at_ms, excluded.checked_at_ms), \
     started_at_ms = COALESCE(attempts.started_at_ms, excluded.started_at_ms), \
     finished_at_ms = COALESCE(excluded.finished_at_ms, attempts.finished_at_ms), \
     decision = excluded.decision, state = excluded.state, reason = excluded.reason, \
     model_called = excluded.model_called";

/// What a failed start/outcome write was doing, for its error message.
const WRITE_CONTEXT: &str = "writing starts and outcomes";

/// Splits a batch, in order, into runs in which no job id and no attempt key repeats.
fn runs(writes: &[LedgerWrite]) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::new();
    let mut from = 0;
    let mut ids = std::collections::HashSet::new();
    let mut keys = std::collections::HashSet::new();
    for (i, w) in writes.iter().enumerate() {
        let (id, key) = w.ids();
        if ids.contains(id) || (!key.is_empty() && keys.contains(key)) {
            out.push(from..i);
            from = i;
            ids.clear();
            keys.clear();
        }
        ids.insert(id);
        if !key.is_empty() {
            keys.insert(key);
        }
    }
    out.push(from..writes.len());
    out
}

/// The statements of one group-commit run, in execution order; each takes its rows as one
/// JSON parameter ([`batch`](crate::batch)). Job rows first (they lock the jobs, as in the
/// single writes), the ack marks last.
const RUN_STATEMENTS: usize = 6;

fn run_statements(d: Dialect) -> &'static [String; RUN_STATEMENTS] {
    static SQLITE: OnceLock<[String; RUN_STATEMENTS]> = OnceLock::new();
    static POSTGRES: OnceLock<[String; RUN_STATEMENTS]> = OnceLock::new();
    let cell = match d {
        Dialect::Sqlite => &SQLITE,
        Dialect::Postgres => &POSTGRES,
    };
    cell.get_or_init(|| {
        [
            insert_from_json(UPSERT_JOB_RUNNING, d),
            format!(
                "{} RETURNING job_id",
                insert_from_json(UPSERT_JOB_TERMINAL, d)
            ),
            insert_from_json(UPSERT_JOB_LIVE, d),
            insert_from_json(UPSERT_ATTEMPT_START, d),
            insert_from_json(UPSERT_ATTEMPT_OUTCOME, d),
            // Rows `[attempt_key, acked_at_ms]`.
            format!(
                "UPDATE attempts SET acked_at_ms = {} FROM {} WHERE attempt_key = {}",
                d.element(1, "acked_at_ms"),
                d.rows_source(),
                d.element(0, "attempt_key")
            ),
        ]
    })
}

/// SQLite: [`run_statements`] as one multi-statement query (one round trip to the
/// connection thread; its anonymous placeholders bind in order across the statements).
fn sqlite_run_query() -> &'static str {
    static SQL: OnceLock<String> = OnceLock::new();
    SQL.get_or_init(|| run_statements(Dialect::Sqlite).join(";\n"))
}

/// The JSON parameters of [`run_statements`], in order, each with its row count.
fn run_params(
    starts: &[&AttemptStart],
    terminals: &[(usize, &OutcomeRecord)],
    lives: &[&OutcomeRecord],
    outcomes: &[&OutcomeRecord],
    acked: &[(String, i64)],
) -> [(String, usize); RUN_STATEMENTS] {
    // Values in the order of each statement's `$1…$k`.
    let mut job_running = JsonRows::default();
    let mut attempt_start = JsonRows::default();
    for st in starts {
        job_running.row(|r| {
            r.v(&st.job_id)
                .v(&st.kind)
                .v(&st.created_at_ms)
                .v(&st.expires_at_ms)
                .v(&st.received_at_ms)
                .v(&st.checked_at_ms)
                .v(&st.started_at_ms)
                .v(&st.worker)
                .v(st.tenant.as_str())
                .v(st.priority.as_str());
        });
        attempt_start.row(|r| {
            r.v(&st.attempt_key)
                .v(&st.job_id)
                .v(&st.attempt)
                .v(&st.worker)
                .v(&st.redelivered)
                .v(&st.received_at_ms)
                .v(&st.checked_at_ms)
                .v(&st.started_at_ms);
        });
    }
    let mut job_terminal = JsonRows::default();
    for (_, rec) in terminals {
        job_terminal.row(|r| {
            r.v(&rec.job_id)
                .v(&rec.kind)
                .v(&rec.state.as_str())
                .v(&reason_text(rec))
                .v(&rec.created_at_ms)
                .v(&rec.expires_at_ms)
                .v(&rec.received_at_ms)
                .v(&rec.checked_at_ms)
                .v(&rec.started_at_ms)
                .v(&rec.finished_at_ms)
                .v(&rec.recorded_at_ms)
                .v(&non_empty(&rec.worker))
                .v(&rec.result)
                .v(&rec.error)
                .v(&rec.prompt_tokens)
                .v(&rec.completion_tokens)
                .v(&rec.latency_ms)
                .v(&rec.cancel_requested)
                .v(&rec.cancel_confirmed)
                .v(&rec.backend)
                .v(&rec.model)
                .v(&rec.min_runtime_ms)
                .v(rec.tenant.as_str())
                .v(rec.priority.as_str())
                .v(&request_tokens(rec))
                .v(&request_max_tokens(rec))
                .v(&rec.min_feasible_budget_ms);
        });
    }
    let mut job_live = JsonRows::default();
    for rec in lives {
        job_live.row(|r| {
            r.v(&rec.job_id)
                .v(&rec.kind)
                .v(&rec.state.as_str())
                .v(&rec.created_at_ms)
                .v(&rec.expires_at_ms)
                .v(&non_empty(&rec.worker))
                .v(rec.tenant.as_str())
                .v(rec.priority.as_str());
        });
    }
    let mut attempt_outcome = JsonRows::default();
    for rec in outcomes {
        attempt_outcome.row(|r| {
            r.v(&rec.attempt_key)
                .v(&rec.job_id)
                .v(&rec.attempt)
                .v(&rec.worker)
                .v(&rec.redelivered)
                .v(&rec.received_at_ms)
                .v(&rec.checked_at_ms)
                .v(&rec.started_at_ms)
                .v(&rec.finished_at_ms)
                .v(&rec.decision.as_str())
                .v(&rec.state.as_str())
                .v(&reason_text(rec))
                .v(&rec.model_called);
        });
    }
    let mut marks = JsonRows::default();
    for (key, at) in acked {
        marks.row(|r| {
            r.v(key).v(at);
        });
    }
    let rows = |j: JsonRows| {
        let n = j.len();
        (j.finish(), n)
    };
    [
        rows(job_running),
        rows(job_terminal),
        rows(job_live),
        rows(attempt_start),
        rows(attempt_outcome),
        rows(marks),
    ]
}

const MARK_UNKNOWN: &str = "UPDATE jobs SET state = 'unknown', \
     reason = 'no_outcome_after_deadline', recorded_at_ms = $1, reconciled_at_ms = $1 \
     WHERE state IN ('accepted', 'running') AND expires_at_ms < $2 \
     RETURNING job_id";

const UPSERT_HEARTBEAT_LIVE: &str = "INSERT INTO workers (name, heartbeat_ms, live) VALUES ($1, $2, $3) \
     ON CONFLICT (name) DO UPDATE SET heartbeat_ms = excluded.heartbeat_ms, live = excluded.live";
const UPSERT_HEARTBEAT: &str = "INSERT INTO workers (name, heartbeat_ms) VALUES ($1, $2) \
     ON CONFLICT (name) DO UPDATE SET heartbeat_ms = excluded.heartbeat_ms";

const UPSERT_BREAKER: &str = "INSERT INTO breakers \
     (worker, kind, backend, open_until_ms, recorded_at_ms) VALUES ($1, $2, $3, $4, $5) \
     ON CONFLICT (worker, kind) DO UPDATE SET backend = excluded.backend, \
     open_until_ms = excluded.open_until_ms, recorded_at_ms = excluded.recorded_at_ms";
const DELETE_BREAKER: &str = "DELETE FROM breakers WHERE worker = $1 AND backend = $2";
/// The live workers (fresh lease), and those of them with the kind's breaker open now.
const SELECT_UPSTREAM_OPEN: &str = "SELECT \
     (SELECT COUNT(*) FROM workers WHERE heartbeat_ms >= $3), \
     COUNT(DISTINCT b.worker), MIN(b.open_until_ms) FROM breakers b \
     JOIN workers w ON w.name = b.worker \
     WHERE b.kind = $1 AND b.open_until_ms > $2 AND w.heartbeat_ms >= $3";

/// A `running` attempt of the job under another worker whose lease is fresh.
const SELECT_LIVE_ATTEMPT: &str = "SELECT a.worker FROM attempts a \
     JOIN workers w ON w.name = a.worker \
     WHERE a.job_id = $1 AND a.state = 'running' AND a.worker <> $2 AND w.heartbeat_ms >= $3 \
     LIMIT 1";

const SELECT_PAYLOAD_HASH: &str = "SELECT payload_hash FROM jobs WHERE job_id = $1";
const SELECT_JOB: &str = concat!("SELECT ", job_columns!(), " FROM jobs WHERE job_id = $1");
const SELECT_ATTEMPTS: &str = concat!(
    "SELECT ",
    attempt_columns!(),
    " FROM attempts WHERE job_id = $1 \
     ORDER BY attempt, COALESCE(received_at_ms, started_at_ms, finished_at_ms, 0), attempt_key"
);
const SELECT_COUNTS: &str = "SELECT state, COUNT(*) AS n FROM jobs GROUP BY state";
/// Late truths (the `jobs_reconciled` partial index covers it).
const SELECT_LATE_OUTCOMES: &str = "SELECT COUNT(*) FROM jobs \
     WHERE reconciled_at_ms IS NOT NULL AND state <> 'unknown'";
/// The newest model calls of one backend whose duration is known: completed ones, and
/// ones cut at the deadline (a lower bound, as the worker counts them); newest first.
/// With the request's size, the worker's (`request_*`) and the server's (`prompt_tokens`).
const SELECT_RECENT_CALLS: &str = "SELECT kind, latency_ms, recorded_at_ms, state, prompt_tokens, \
     request_tokens, request_max_tokens FROM jobs \
     WHERE recorded_at_ms >= $1 AND backend = $2 AND latency_ms IS NOT NULL \
     AND (state = 'completed' OR (state = 'deadline_exceeded' AND reason = 'cancelled_at_deadline')) \
     ORDER BY recorded_at_ms DESC LIMIT $3";
/// The newest completed calls of one kind, with their sizes (as above); newest first.
const SELECT_RECENT_COMPLETED_OF_KIND: &str = "SELECT kind, latency_ms, recorded_at_ms, state, \
     prompt_tokens, request_tokens, request_max_tokens FROM jobs \
     WHERE recorded_at_ms >= $1 AND kind = $2 AND state = 'completed' AND latency_ms IS NOT NULL \
     ORDER BY recorded_at_ms DESC LIMIT $3";
const SELECT_SINCE: &str = concat!(
    "SELECT ",
    job_columns!(),
    " FROM jobs WHERE recorded_at_ms >= $1 ORDER BY recorded_at_ms, job_id"
);

/// The outcome ledger. Cheap to clone (the pools are shared).
#[derive(Clone, Debug)]
pub struct Ledger {
    backend: Backend,
}

#[derive(Clone, Debug)]
enum Backend {
    /// SQLite allows one writer at a time; funnelling writes through a one-connection pool
    /// queues them in-process (fair, no busy-wait sleeps) instead of in SQLite's busy
    /// handler, which then only arbitrates between processes. Reads use their own pool.
    Sqlite {
        writer: SqlitePool,
        reader: SqlitePool,
    },
    Postgres(PgPool),
}

/// Runs `$body` inside a write transaction: SQLite's single writer with `BEGIN IMMEDIATE`
/// (the write lock is taken up front, so a transaction never fails half-way on lock
/// upgrade), or a PostgreSQL pooled connection. An early `?` drops the transaction, which
/// rolls it back.
///
/// A SQLite writer whose transaction failed is closed, not returned to the pool: after a
/// failed `COMMIT` (`SQLITE_FULL` on a full disk) SQLite may already have rolled back,
/// sqlx's queued rollback then fails, and the connection stays at transaction depth 1 —
/// every later `BEGIN` failed with "begin_with at non-zero transaction depth" even after
/// space was freed (`tests/sqlite_full.rs`). The pool opens a fresh writer instead.
macro_rules! write_tx {
    ($self:ident, $ctx:literal, |$tx:ident| $body:block) => {
        match &$self.backend {
            Backend::Sqlite { writer, .. } => {
                let mut conn = writer.acquire().await.map_err(db($ctx))?;
                let result: Result<_, StoreError> = async {
                    let mut $tx = sqlx::Connection::begin_with(&mut *conn, "BEGIN IMMEDIATE")
                        .await
                        .map_err(db($ctx))?;
                    let out = $body;
                    $tx.commit().await.map_err(db($ctx))?;
                    Ok(out)
                }
                .await;
                if result.is_err() {
                    conn.close_on_drop();
                }
                result?
            }
            Backend::Postgres(pool) => {
                let mut $tx = pool.begin().await.map_err(db($ctx))?;
                let out = $body;
                $tx.commit().await.map_err(db($ctx))?;
                out
            }
        }
    };
}

/// Runs `$body` with `$pool` bound to the backend's read or write pool.
macro_rules! on_pool {
    ($self:ident, read, |$pool:ident| $body:expr) => {
        match &$self.backend {
            Backend::Sqlite { reader: $pool, .. } => $body,
            Backend::Postgres($pool) => $body,
        }
    };
    ($self:ident, write, |$pool:ident| $body:expr) => {
        match &$self.backend {
            Backend::Sqlite { writer: $pool, .. } => $body,
            Backend::Postgres($pool) => $body,
        }
    };
}

/// One write of a [group commit](Ledger::write_batch).
#[derive(Debug, Clone, PartialEq)]
pub enum LedgerWrite {
    /// As [`Ledger::record_start`].
    Start(AttemptStart),
    /// As [`Ledger::record_outcome`].
    Outcome(Box<OutcomeRecord>),
    /// As [`Ledger::record_terminal`]: a terminal outcome of a job that may have no
    /// attempt (an empty `attempt_key` writes no attempt row).
    Terminal(Box<OutcomeRecord>),
}

impl LedgerWrite {
    /// An outcome write (boxed: an outcome record is several times larger than a start).
    pub fn outcome(rec: OutcomeRecord) -> Self {
        LedgerWrite::Outcome(Box::new(rec))
    }

    /// A terminal outcome write ([`LedgerWrite::Terminal`]).
    pub fn terminal(rec: OutcomeRecord) -> Self {
        LedgerWrite::Terminal(Box::new(rec))
    }

    /// The job and attempt key the write touches.
    fn ids(&self) -> (&str, &str) {
        match self {
            LedgerWrite::Start(s) => (&s.job_id, &s.attempt_key),
            LedgerWrite::Outcome(r) | LedgerWrite::Terminal(r) => (&r.job_id, &r.attempt_key),
        }
    }

    /// The check [`Ledger::write_batch`] runs before its transaction: a non-empty
    /// `attempt_key` for a start or an outcome, a terminal state for a
    /// [`Terminal`](LedgerWrite::Terminal) (state, reason and decision are typed, so
    /// always valid). Callers that batch writes from many tasks run it first, so one bad
    /// item cannot fail the others' commit.
    pub fn validate(&self) -> Result<(), StoreError> {
        match self {
            LedgerWrite::Start(s) if s.attempt_key.is_empty() => Err(StoreError::Fatal(format!(
                "attempt start for job `{}` has an empty attempt_key",
                s.job_id
            ))),
            LedgerWrite::Start(_) => Ok(()),
            LedgerWrite::Outcome(rec) => Self::validate_outcome(rec),
            LedgerWrite::Terminal(rec) => Self::validate_terminal(rec),
        }
    }

    fn validate_terminal(rec: &OutcomeRecord) -> Result<(), StoreError> {
        if !rec.state.is_terminal() {
            return Err(StoreError::Fatal(format!(
                "record_terminal needs a terminal state, got `{}`",
                rec.state
            )));
        }
        Ok(())
    }

    fn validate_outcome(rec: &OutcomeRecord) -> Result<(), StoreError> {
        if rec.attempt_key.is_empty() {
            return Err(StoreError::Fatal(format!(
                "outcome for job `{}` has an empty attempt_key",
                rec.job_id
            )));
        }
        Ok(())
    }
}

impl Ledger {
    /// Opens the ledger and applies the embedded migrations.
    ///
    /// `sqlite://PATH` (created if missing; WAL, `synchronous=FULL`, 5 s busy timeout) or
    /// `postgres://…` / `postgresql://…`. Any other scheme is `Fatal`.
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        let scheme = url.split_once("://").map(|(s, _)| s).or_else(|| {
            // `sqlite:path` and `sqlite::memory:` have no `//`.
            url.starts_with("sqlite:").then_some("sqlite")
        });
        let ledger = match scheme {
            Some("sqlite") => Self::connect_sqlite(url).await?,
            Some("postgres" | "postgresql") => Self::connect_postgres(url).await?,
            other => {
                let what = match other {
                    Some(s) => format!("unsupported database url scheme `{s}`"),
                    None => "database url has no scheme".to_owned(),
                };
                return Err(StoreError::Fatal(format!(
                    "{what}; accepted schemes: sqlite://PATH, postgres://… (or postgresql://…)"
                )));
            }
        };
        let applied = match &ledger.backend {
            Backend::Sqlite { writer, .. } => migrate::migrate_sqlite(writer).await?,
            Backend::Postgres(pool) => migrate::migrate_postgres(pool).await?,
        };
        tracing::info!(
            backend = ledger.backend_name(),
            migrations_applied = ?applied,
            "ledger ready"
        );
        Ok(ledger)
    }

    async fn connect_sqlite(url: &str) -> Result<Self, StoreError> {
        let options = SqliteConnectOptions::from_str(url)
            .map_err(|e| StoreError::Fatal(format!("invalid sqlite url: {e}")))?
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Full)
            .busy_timeout(SQLITE_BUSY_TIMEOUT);
        let in_memory = url.contains(":memory:") || url.contains("mode=memory");
        let writer_options = SqlitePoolOptions::new()
            .max_connections(1)
            .acquire_timeout(ACQUIRE_TIMEOUT)
            .test_before_acquire(false);
        if in_memory {
            // An in-memory database lives as long as its one connection: never recycle it,
            // and read through the same connection.
            let writer = writer_options
                .min_connections(1)
                .idle_timeout(None)
                .max_lifetime(None)
                .connect_with(options)
                .await
                .map_err(db("opening sqlite"))?;
            let reader = writer.clone();
            return Ok(Self {
                backend: Backend::Sqlite { writer, reader },
            });
        }
        let writer = writer_options
            .connect_with(options.clone())
            .await
            .map_err(db("opening sqlite"))?;
        let reader = SqlitePoolOptions::new()
            .max_connections(SQLITE_READERS)
            .acquire_timeout(ACQUIRE_TIMEOUT)
            .test_before_acquire(false)
            .connect_lazy_with(options);
        Ok(Self {
            backend: Backend::Sqlite { writer, reader },
        })
    }

    async fn connect_postgres(url: &str) -> Result<Self, StoreError> {
        let options = PgConnectOptions::from_str(url)
            .map_err(|e| StoreError::Fatal(format!("invalid postgres url: {e}")))?;
        // No ping before each acquire: it would cost a round trip per write. A connection
        // broken by a server restart fails once with `Unavailable` and the caller retries.
        let pool = PgPoolOptions::new()
            .max_connections(PG_MAX_CONNECTIONS)
            .acquire_timeout(ACQUIRE_TIMEOUT)
            .test_before_acquire(false)
            .connect_with(options)
            .await
            .map_err(db("connecting to postgres"))?;
        Ok(Self {
            backend: Backend::Postgres(pool),
        })
    }

    fn dialect(&self) -> Dialect {
        match self.backend {
            Backend::Sqlite { .. } => Dialect::Sqlite,
            Backend::Postgres(_) => Dialect::Postgres,
        }
    }

    /// `"sqlite"` or `"postgres"`.
    pub fn backend_name(&self) -> &'static str {
        match self.backend {
            Backend::Sqlite { .. } => "sqlite",
            Backend::Postgres(_) => "postgres",
        }
    }

    /// Inserts the `accepted` inventory row if the job id is new: `Ok(true)` if inserted,
    /// `Ok(false)` if the id existed in any state. If a worker got there first, the
    /// producer-only fields (`accepted_at_ms`, `trace_id`, `payload_hash`) are filled in.
    pub async fn record_accepted(&self, job: &AcceptedJob) -> Result<bool, StoreError> {
        let inserted = on_pool!(self, write, |pool| {
            let done = sqlx::query(INSERT_ACCEPTED)
                .bind(&job.job_id)
                .bind(&job.kind)
                .bind(job.created_at_ms)
                .bind(job.expires_at_ms)
                .bind(job.accepted_at_ms)
                .bind(&job.trace_id)
                .bind(&job.payload_hash)
                .bind(job.tenant.as_str())
                .bind(job.priority.as_str())
                .execute(pool)
                .await
                .map_err(db("recording an accepted job"))?;
            if done.rows_affected() == 0 {
                sqlx::query(BACKFILL_ACCEPTED)
                    .bind(&job.job_id)
                    .bind(job.accepted_at_ms)
                    .bind(&job.trace_id)
                    .bind(&job.payload_hash)
                    .bind(job.created_at_ms)
                    .bind(job.expires_at_ms)
                    .bind(job.tenant.as_str())
                    .bind(job.priority.as_str())
                    .execute(pool)
                    .await
                    .map_err(db("recording an accepted job"))?;
            }
            done.rows_affected() > 0
        });
        Ok(inserted)
    }

    /// The payload hash stored for an id (for the ingress's `409` check); `None` for an
    /// unknown id or a row written without one.
    pub async fn payload_hash(&self, job_id: &str) -> Result<Option<String>, StoreError> {
        let hash: Option<Option<String>> = on_pool!(self, read, |pool| {
            sqlx::query(SELECT_PAYLOAD_HASH)
                .bind(job_id)
                .fetch_optional(pool)
                .await
                .and_then(|row| row.map(|r| r.try_get(0)).transpose())
                .map_err(db("reading a payload hash"))?
        });
        Ok(hash.flatten())
    }

    /// Renew `worker`'s lease: its attempts that are still `running` count as live while
    /// its heartbeat is fresh ([`live_attempt_elsewhere`](Self::live_attempt_elsewhere)).
    pub async fn heartbeat(&self, worker: &str, now_ms: i64) -> Result<(), StoreError> {
        on_pool!(self, write, |pool| {
            sqlx::query(UPSERT_HEARTBEAT)
                .bind(worker)
                .bind(now_ms)
                .execute(pool)
                .await
                .map(|_| ())
                .map_err(db("renewing a worker lease"))?
        });
        Ok(())
    }

    /// Renew `worker`'s lease as [`heartbeat`](Self::heartbeat), with the live numbers
    /// it publishes (`lastcall_core::live::WorkerLive` as JSON) for `serve`'s dashboard.
    pub async fn heartbeat_live(
        &self,
        worker: &str,
        now_ms: i64,
        live: &str,
    ) -> Result<(), StoreError> {
        on_pool!(self, write, |pool| {
            sqlx::query(UPSERT_HEARTBEAT_LIVE)
                .bind(worker)
                .bind(now_ms)
                .bind(live)
                .execute(pool)
                .await
                .map(|_| ())
                .map_err(db("renewing a worker lease"))?
        });
        Ok(())
    }

    /// `worker`'s circuit breaker for `backend` opened (or opened again) at `now_ms`: it
    /// lets no call of `kinds` through before `open_until_ms`. The door reads it with
    /// [`upstream_open_until`](Self::upstream_open_until).
    pub async fn record_breaker_open(
        &self,
        worker: &str,
        backend: &str,
        kinds: &[String],
        open_until_ms: i64,
        now_ms: i64,
    ) -> Result<(), StoreError> {
        for kind in kinds {
            on_pool!(self, write, |pool| {
                sqlx::query(UPSERT_BREAKER)
                    .bind(worker)
                    .bind(kind)
                    .bind(backend)
                    .bind(open_until_ms)
                    .bind(now_ms)
                    .execute(pool)
                    .await
                    .map(|_| ())
                    .map_err(db("recording an open breaker"))?
            });
        }
        Ok(())
    }

    /// `worker`'s circuit breaker for `backend` closed: its rows go.
    pub async fn clear_breaker(&self, worker: &str, backend: &str) -> Result<(), StoreError> {
        on_pool!(self, write, |pool| {
            sqlx::query(DELETE_BREAKER)
                .bind(worker)
                .bind(backend)
                .execute(pool)
                .await
                .map(|_| ())
                .map_err(db("clearing a breaker"))?
        });
        Ok(())
    }

    /// When every live worker (lease renewed at or after `live_since_ms`) has its breaker
    /// for `kind` open at `now_ms`: the earliest instant one of them lets a trial through.
    /// `None` when no worker is live, or one of them may still call (its breaker closed or
    /// half-open, its row's trial time passed, or it never sent the kind anywhere).
    pub async fn upstream_open_until(
        &self,
        kind: &str,
        now_ms: i64,
        live_since_ms: i64,
    ) -> Result<Option<i64>, StoreError> {
        let (live, open, until): (i64, i64, Option<i64>) = on_pool!(self, read, |pool| {
            sqlx::query(SELECT_UPSTREAM_OPEN)
                .bind(kind)
                .bind(now_ms)
                .bind(live_since_ms)
                .fetch_one(pool)
                .await
                .and_then(|r| Ok((r.try_get(0)?, r.try_get(1)?, r.try_get(2)?)))
                .map_err(db("reading the workers' breakers"))?
        });
        Ok(until.filter(|_| live > 0 && open >= live))
    }

    /// The worker (other than `me`) running a model call of `job_id` now: an attempt row
    /// still `running` whose worker renewed its lease at or after `fresh_since_ms`. `None`:
    /// no live call elsewhere (none started, all settled, or that worker's lease expired —
    /// it died, and its started attempt counts toward the poison bound as before).
    pub async fn live_attempt_elsewhere(
        &self,
        job_id: &str,
        me: &str,
        fresh_since_ms: i64,
    ) -> Result<Option<String>, StoreError> {
        let worker: Option<String> = on_pool!(self, read, |pool| {
            sqlx::query(SELECT_LIVE_ATTEMPT)
                .bind(job_id)
                .bind(me)
                .bind(fresh_since_ms)
                .fetch_optional(pool)
                .await
                .and_then(|row| row.map(|r| r.try_get(0)).transpose())
                .map_err(db("looking for a live attempt"))?
        });
        Ok(worker)
    }

    /// Whether the job already has a terminal outcome, and how many model calls were started
    /// for it so far.
    pub async fn receipt_info(&self, job_id: &str) -> Result<ReceiptInfo, StoreError> {
        let mut found = self.receipt_info_many(&[job_id.to_owned()]).await?;
        Ok(found.remove(job_id).unwrap_or_default())
    }

    /// [`receipt_info`](Self::receipt_info) for many jobs in one read (the ids as one JSON
    /// parameter). Ids without a row are absent from the map.
    pub async fn receipt_info_many(
        &self,
        job_ids: &[String],
    ) -> Result<std::collections::HashMap<String, ReceiptInfo>, StoreError> {
        let mut out = std::collections::HashMap::with_capacity(job_ids.len());
        if job_ids.is_empty() {
            return Ok(out);
        }
        let sql = format!(
            concat!(
                "SELECT job_id, state, ",
                backend_calls!(),
                ", cancel_requested FROM jobs WHERE {}"
            ),
            self.dialect().in_ids("job_id")
        );
        let ids = json_array(job_ids);
        let rows: Vec<(String, String, i64, bool)> = on_pool!(self, read, |pool| {
            sqlx::query(AssertSqlSafe(sql))
                .bind(ids)
                .fetch_all(pool)
                .await
                .and_then(|rows| {
                    rows.iter()
                        .map(|r| Ok((r.try_get(0)?, r.try_get(1)?, r.try_get(2)?, r.try_get(3)?)))
                        .collect::<Result<Vec<_>, sqlx::Error>>()
                })
                .map_err(db("reading receipt info"))?
        });
        for (id, state, calls, cancel) in rows {
            out.insert(id, receipt(&state, calls, cancel));
        }
        Ok(out)
    }

    /// Right before a model call: inserts the attempt row (`model_called`, `started_at_ms`)
    /// and moves the job to `running` unless it is terminal (creating the job row if
    /// missing). One transaction.
    pub async fn record_start(&self, start: &AttemptStart) -> Result<(), StoreError> {
        tracing::debug!(job_id = %start.job_id, attempt_key = %start.attempt_key, "record start");
        self.write_all(&[LedgerWrite::Start(start.clone())], &[])
            .await
            .map(|_| ())
    }

    /// One delivery's decision, in one transaction: upserts the attempt row by
    /// `attempt_key`, and if `rec.state` is terminal writes the job's terminal outcome
    /// unless it already has one (`unknown` does not count as one: a real outcome replaces
    /// it, see the module doc).
    ///
    /// `Ok(true)` if this call wrote the terminal outcome (also a real outcome replacing
    /// `unknown`); `Ok(false)` if one existed (it is kept unchanged) or `rec.state` is not
    /// terminal. An empty `attempt_key` is `Fatal`.
    pub async fn record_outcome(&self, rec: &OutcomeRecord) -> Result<bool, StoreError> {
        LedgerWrite::validate_outcome(rec)?;
        self.write_outcome(rec, LedgerWrite::outcome).await
    }

    /// A terminal outcome for a job that may have no accepted row and no attempt (the
    /// dead-letter processor's `expired_before_receive`, a rejected body). Same write-once
    /// rule as [`record_outcome`](Self::record_outcome); an attempt row is written only when
    /// `rec.attempt_key` is not empty. A non-terminal `rec.state` is `Fatal`.
    pub async fn record_terminal(&self, rec: &OutcomeRecord) -> Result<bool, StoreError> {
        LedgerWrite::validate_terminal(rec)?;
        self.write_outcome(rec, LedgerWrite::terminal).await
    }

    async fn write_outcome(
        &self,
        rec: &OutcomeRecord,
        write: fn(OutcomeRecord) -> LedgerWrite,
    ) -> Result<bool, StoreError> {
        let terminal = rec.state.is_terminal();
        tracing::debug!(job_id = %rec.job_id, state = %rec.state, "record outcome");
        let wrote = self.write_all(&[write(rec.clone())], &[]).await?[0];
        if terminal && !wrote {
            tracing::debug!(job_id = %rec.job_id, "terminal outcome already recorded; kept the first");
        }
        Ok(wrote)
    }

    /// Group commit: many attempt starts and outcomes in **one** transaction, in order,
    /// with the same per-item semantics as [`record_start`](Self::record_start) and
    /// [`record_outcome`](Self::record_outcome). Returns one flag per item (`true`: this
    /// item wrote the job's terminal outcome). All or nothing: on `Err` no item is stored,
    /// and the caller must not ack any of them. Every item is validated before the
    /// transaction opens ([`LedgerWrite::validate`]); one invalid item fails the call.
    pub async fn write_batch(&self, writes: &[LedgerWrite]) -> Result<Vec<bool>, StoreError> {
        self.write_batch_marking_acked(writes, &[]).await
    }

    /// [`write_batch`](Self::write_batch), and in the same transaction the best-effort
    /// `acked_at_ms` marks of earlier attempts ([`mark_acked_many`](Self::mark_acked_many)):
    /// the worker folds them into its group commits instead of committing them separately.
    /// A failed transaction loses the marks with the writes; only the writes matter.
    pub async fn write_batch_marking_acked(
        &self,
        writes: &[LedgerWrite],
        acked: &[(String, i64)],
    ) -> Result<Vec<bool>, StoreError> {
        for w in writes {
            w.validate()?;
        }
        self.write_all(writes, acked).await
    }

    /// The one write path for starts, outcomes and ack marks (single or batched), in one
    /// transaction. An outcome with an empty `attempt_key` writes no attempt row
    /// (`record_terminal`).
    async fn write_all(
        &self,
        writes: &[LedgerWrite],
        acked: &[(String, i64)],
    ) -> Result<Vec<bool>, StoreError> {
        let mut terminal = Vec::with_capacity(writes.len());
        for w in writes {
            terminal.push(match w {
                LedgerWrite::Start(_) => false,
                LedgerWrite::Outcome(rec) | LedgerWrite::Terminal(rec) => rec.state.is_terminal(),
            });
        }
        if writes.is_empty() && acked.is_empty() {
            return Ok(Vec::new());
        }
        tracing::debug!(n = writes.len(), acked = acked.len(), "group commit");
        let dialect = self.dialect();
        let runs = runs(writes);
        let last_run = runs.len() - 1;
        let wrote = write_tx!(self, "writing starts and outcomes", |tx| {
            let mut wrote = vec![false; writes.len()];
            for (r, run) in runs.into_iter().enumerate() {
                // Within a run every job id and attempt key is unique, so each statement
                // touches a row at most once (PostgreSQL requires it). Rows sorted by job
                // id for a stable lock order.
                let mut starts: Vec<&AttemptStart> = Vec::new();
                let mut terminals: Vec<(usize, &OutcomeRecord)> = Vec::new();
                let mut lives: Vec<&OutcomeRecord> = Vec::new();
                for i in run {
                    match &writes[i] {
                        LedgerWrite::Start(st) => starts.push(st),
                        LedgerWrite::Outcome(rec) | LedgerWrite::Terminal(rec) if terminal[i] => {
                            terminals.push((i, rec))
                        }
                        LedgerWrite::Outcome(rec) | LedgerWrite::Terminal(rec) => lives.push(rec),
                    }
                }
                starts.sort_by(|a, b| a.job_id.cmp(&b.job_id));
                terminals.sort_by(|a, b| a.1.job_id.cmp(&b.1.job_id));
                lives.sort_by(|a, b| a.job_id.cmp(&b.job_id));
                let mut outcomes: Vec<&OutcomeRecord> = terminals
                    .iter()
                    .map(|(_, r)| *r)
                    .chain(lives.iter().copied())
                    .filter(|r| !r.attempt_key.is_empty())
                    .collect();
                outcomes.sort_by(|a, b| a.job_id.cmp(&b.job_id));
                // The ack marks, once per batch.
                let acked: &[(String, i64)] = if r == last_run { acked } else { &[] };
                let params = run_params(&starts, &terminals, &lives, &outcomes, acked);
                // The ids the terminal upsert wrote (a job already terminal is skipped).
                let mut written = std::collections::HashSet::with_capacity(terminals.len());
                let rows = match dialect {
                    Dialect::Sqlite => {
                        let mut q = sqlx::query(sqlite_run_query());
                        for (p, _) in params {
                            q = q.bind(p);
                        }
                        q.fetch_all(&mut *tx).await.map_err(db(WRITE_CONTEXT))?
                    }
                    Dialect::Postgres => {
                        // One parameterised statement per message; empty ones are skipped.
                        let mut rows = Vec::new();
                        for (sql, (p, n)) in run_statements(dialect).iter().zip(params) {
                            if n > 0 {
                                let q = sqlx::query(sql.as_str()).bind(p);
                                rows.extend(
                                    q.fetch_all(&mut *tx).await.map_err(db(WRITE_CONTEXT))?,
                                );
                            }
                        }
                        rows
                    }
                };
                for row in rows {
                    written.insert(row.try_get::<String, _>(0).map_err(db(WRITE_CONTEXT))?);
                }
                for (i, rec) in &terminals {
                    wrote[*i] = written.contains(&rec.job_id);
                }
            }
            wrote
        });
        Ok(wrote)
    }

    /// Best effort after the broker ack: sets `acked_at_ms` on the attempt row.
    pub async fn mark_acked(&self, attempt_key: &str, acked_at_ms: i64) -> Result<(), StoreError> {
        self.mark_acked_many(&[(attempt_key.to_owned(), acked_at_ms)])
            .await
    }

    /// [`mark_acked`](Self::mark_acked) for many attempts in one transaction (one commit).
    pub async fn mark_acked_many(&self, acks: &[(String, i64)]) -> Result<(), StoreError> {
        self.write_all(&[], acks).await.map(|_| ())
    }

    /// The job's record, `None` for an unknown id.
    pub async fn get(&self, job_id: &str) -> Result<Option<JobRecord>, StoreError> {
        on_pool!(self, read, |pool| {
            sqlx::query(SELECT_JOB)
                .bind(job_id)
                .fetch_optional(pool)
                .await
                .and_then(|row| row.as_ref().map(job_from_row).transpose())
                .map_err(db("reading a job"))
        })
    }

    /// Jobs matching `filter`, ordered by recorded time (accepted or created time while not
    /// terminal), then job id.
    pub async fn list(&self, filter: &ListFilter) -> Result<Vec<JobRecord>, StoreError> {
        let mut sql = String::from(concat!("SELECT ", job_columns!(), " FROM jobs"));
        let mut n = 0;
        let mut clause = |sql: &mut String, column: &str| {
            n += 1;
            sql.push_str(if n == 1 { " WHERE " } else { " AND " });
            sql.push_str(&format!("{column} = ${n}"));
        };
        if filter.state.is_some() {
            clause(&mut sql, "state");
        }
        if filter.kind.is_some() {
            clause(&mut sql, "kind");
        }
        if filter.tenant.is_some() {
            clause(&mut sql, "tenant");
        }
        sql.push_str(
            " ORDER BY COALESCE(recorded_at_ms, accepted_at_ms, created_at_ms, 0), job_id",
        );
        if filter.limit.is_some() {
            sql.push_str(&format!(" LIMIT ${}", n + 1));
        }
        on_pool!(self, read, |pool| {
            let mut query = sqlx::query(AssertSqlSafe(sql.as_str()));
            if let Some(state) = &filter.state {
                query = query.bind(state);
            }
            if let Some(kind) = &filter.kind {
                query = query.bind(kind);
            }
            if let Some(tenant) = &filter.tenant {
                query = query.bind(tenant);
            }
            if let Some(limit) = filter.limit {
                query = query.bind(limit.max(0));
            }
            query
                .fetch_all(pool)
                .await
                .and_then(|rows| rows.iter().map(job_from_row).collect())
                .map_err(db("listing jobs"))
        })
    }

    /// The job's attempt rows, by attempt number then time.
    pub async fn attempts(&self, job_id: &str) -> Result<Vec<AttemptRow>, StoreError> {
        on_pool!(self, read, |pool| {
            sqlx::query(SELECT_ATTEMPTS)
                .bind(job_id)
                .fetch_all(pool)
                .await
                .and_then(|rows| rows.iter().map(attempt_from_row).collect())
                .map_err(db("reading attempts"))
        })
    }

    /// How many jobs are in each state, in `State::ALL` order (states with no job omitted).
    pub async fn counts_by_state(&self) -> Result<Vec<(String, i64)>, StoreError> {
        let mut counts: Vec<(String, i64)> = on_pool!(self, read, |pool| {
            sqlx::query(SELECT_COUNTS)
                .fetch_all(pool)
                .await
                .and_then(|rows| {
                    rows.iter()
                        .map(|r| Ok((r.try_get(0)?, r.try_get(1)?)))
                        .collect()
                })
                .map_err(db("counting jobs"))?
        });
        counts.sort_by_key(|(state, _)| {
            let rank = State::ALL.iter().position(|s| s.as_str() == state);
            (rank.unwrap_or(usize::MAX), state.clone())
        });
        Ok(counts)
    }

    /// Reconciliation: every non-terminal job whose `expires_at_ms + grace_ms < now_ms` gets
    /// the terminal state `unknown` (reason `no_outcome_after_deadline`, recorded and
    /// reconciled at `now_ms`). Returns the ids marked, sorted. Idempotent. A real outcome
    /// written later replaces `unknown` and keeps `reconciled_at_ms` (a late outcome).
    pub async fn mark_unknown(
        &self,
        now_ms: i64,
        grace_ms: i64,
    ) -> Result<Vec<String>, StoreError> {
        // `expires + grace < now` rewritten as `expires < now - grace` so the arithmetic
        // happens here, saturating, and never overflows inside the database.
        let cutoff = now_ms.saturating_sub(grace_ms);
        let mut ids: Vec<String> = on_pool!(self, write, |pool| {
            sqlx::query(MARK_UNKNOWN)
                .bind(now_ms)
                .bind(cutoff)
                .fetch_all(pool)
                .await
                .and_then(|rows| rows.iter().map(|r| r.try_get(0)).collect())
                .map_err(db("marking jobs unknown"))?
        });
        ids.sort();
        if !ids.is_empty() {
            tracing::info!(
                count = ids.len(),
                "jobs marked unknown after deadline + grace"
            );
        }
        Ok(ids)
    }

    /// Late outcomes (late truths): jobs that reconciliation marked `unknown` and that got
    /// their real outcome afterwards (`reconciled_at_ms` set, state no longer `unknown`).
    pub async fn late_outcomes(&self) -> Result<i64, StoreError> {
        on_pool!(self, read, |pool| {
            sqlx::query(SELECT_LATE_OUTCOMES)
                .fetch_one(pool)
                .await
                .and_then(|row| row.try_get(0))
                .map_err(db("counting late outcomes"))
        })
    }

    /// The newest `limit` model calls made through `backend` (the label the worker records
    /// in `backend`) and recorded since `since_ms` whose duration is known: completed calls
    /// and calls cut at the deadline. Oldest first, so that they can be replayed into an
    /// estimator in the order they happened. A worker learns its call times from them when
    /// it starts (`lastcall_core::service_time`).
    pub async fn recent_calls(
        &self,
        backend: &str,
        since_ms: i64,
        limit: u32,
    ) -> Result<Vec<crate::RecordedCall>, StoreError> {
        self.calls_by(SELECT_RECENT_CALLS, backend, since_ms, limit)
            .await
    }

    /// The newest `limit` *completed* model calls of `kind` recorded since `since_ms`, on
    /// any backend, with their request sizes, as the workers measured them
    /// (`latency_ms`); oldest first. The door (`lastcall_producer`'s shedding) takes its
    /// call time for a new job of the kind from them: only measured calls count, never a
    /// cut one's lower bound, and never a job's own `min_runtime_ms` (the client's number:
    /// one client must not set the call time every other client's jobs are shed by).
    pub async fn recent_completed_calls_of_kind(
        &self,
        kind: &str,
        since_ms: i64,
        limit: u32,
    ) -> Result<Vec<crate::RecordedCall>, StoreError> {
        self.calls_by(SELECT_RECENT_COMPLETED_OF_KIND, kind, since_ms, limit)
            .await
    }

    /// The calls `sql` selects (binds: since, `key`, limit; the columns of
    /// `SELECT_RECENT_CALLS`), oldest first.
    async fn calls_by(
        &self,
        sql: &'static str,
        key: &str,
        since_ms: i64,
        limit: u32,
    ) -> Result<Vec<crate::RecordedCall>, StoreError> {
        let mut calls: Vec<crate::RecordedCall> = on_pool!(self, read, |pool| {
            sqlx::query(sql)
                .bind(since_ms)
                .bind(key)
                .bind(i64::from(limit))
                .fetch_all(pool)
                .await
                .and_then(|rows| {
                    rows.iter()
                        .map(|r| {
                            Ok(crate::RecordedCall {
                                kind: r.try_get(0)?,
                                latency_ms: u64::try_from(r.try_get::<i64, _>(1)?).unwrap_or(0),
                                recorded_at_ms: r.try_get(2)?,
                                cut: r.try_get::<String, _>(3)? == "deadline_exceeded",
                                prompt_tokens: (r.try_get::<Option<i64>, _>(4)?)
                                    .and_then(|t| u64::try_from(t).ok()),
                                size: request_size(
                                    r.try_get::<Option<i64>, _>(5)?,
                                    r.try_get::<Option<i64>, _>(6)?,
                                ),
                            })
                        })
                        .collect()
                })
                .map_err(db("reading the recent model calls"))?
        });
        calls.reverse();
        Ok(calls)
    }

    /// Records with `recorded_at_ms >= since_ms`, by recorded time then job id.
    pub async fn records_since(&self, since_ms: i64) -> Result<Vec<JobRecord>, StoreError> {
        on_pool!(self, read, |pool| {
            sqlx::query(SELECT_SINCE)
                .bind(since_ms)
                .fetch_all(pool)
                .await
                .and_then(|rows| rows.iter().map(job_from_row).collect())
                .map_err(db("reading records"))
        })
    }

    /// Closes the pools, waiting for checked-out connections to come back.
    pub async fn close(&self) {
        match &self.backend {
            Backend::Sqlite { writer, reader } => {
                reader.close().await;
                writer.close().await;
            }
            Backend::Postgres(pool) => pool.close().await,
        }
    }

    /// The ingress claims a job id *before* publishing: inserts the `accepted` row with
    /// `accepted_at_ms` NULL ("publish pending") if the id is new. `Ok(true)`: this caller
    /// owns the claim and must publish, then stamp it with
    /// [`record_accepted`](Self::record_accepted) (which fills `accepted_at_ms` once) or
    /// drop it with [`release_claim`](Self::release_claim). `Ok(false)`: the id exists.
    /// Concurrent claims of one id: exactly one gets `true` (the primary key decides).
    pub async fn claim_accepted(&self, job: &AcceptedJob) -> Result<bool, StoreError> {
        const CLAIM: &str = "INSERT INTO jobs \
             (job_id, kind, state, created_at_ms, expires_at_ms, trace_id, payload_hash, \
              tenant, priority) \
             VALUES ($1, $2, 'accepted', $3, $4, $5, $6, $7, $8) \
             ON CONFLICT (job_id) DO NOTHING";
        on_pool!(self, write, |pool| {
            sqlx::query(CLAIM)
                .bind(&job.job_id)
                .bind(&job.kind)
                .bind(job.created_at_ms)
                .bind(job.expires_at_ms)
                .bind(&job.trace_id)
                .bind(&job.payload_hash)
                .bind(job.tenant.as_str())
                .bind(job.priority.as_str())
                .execute(pool)
                .await
                .map(|done| done.rows_affected() > 0)
                .map_err(db("claiming a job id"))
        })
    }

    /// Drops a claim whose publish failed, only while it is untouched: still `accepted`,
    /// never stamped (`accepted_at_ms` NULL) and with the claimant's payload hash. A row a
    /// worker already moved on (the message did reach the broker) stays. `Ok(true)` if the
    /// claim was removed.
    /// Cancel a job on request: a job not started yet (`accepted`) becomes `cancelled`
    /// (`cancelled_before_start`) now, so no worker runs it (a later delivery finds it
    /// recorded and acks it without a call); a `running` job is flagged (`cancel_requested`)
    /// for the worker running it, which aborts the call and records `cancelled`, and for any
    /// later delivery (a retry, a redelivery), which records `cancelled` without a call. A
    /// terminal job is left as it is.
    pub async fn cancel(&self, job_id: &str, now_ms: i64) -> Result<CancelOutcome, StoreError> {
        const NOT_STARTED: &str = "UPDATE jobs SET state = 'cancelled',              reason = 'cancelled_before_start', recorded_at_ms = $2, cancel_requested = TRUE              WHERE job_id = $1 AND state = 'accepted'";
        const RUNNING: &str =
            "UPDATE jobs SET cancel_requested = TRUE WHERE job_id = $1 AND state = 'running'";
        let cancelled = on_pool!(self, write, |pool| {
            sqlx::query(NOT_STARTED)
                .bind(job_id)
                .bind(now_ms)
                .execute(pool)
                .await
                .map(|done| done.rows_affected() > 0)
                .map_err(db("cancelling a job"))?
        });
        if cancelled {
            return Ok(CancelOutcome::Cancelled);
        }
        let flagged = on_pool!(self, write, |pool| {
            sqlx::query(RUNNING)
                .bind(job_id)
                .execute(pool)
                .await
                .map(|done| done.rows_affected() > 0)
                .map_err(db("requesting a running job's cancellation"))?
        });
        if flagged {
            return Ok(CancelOutcome::Requested);
        }
        Ok(match self.get(job_id).await? {
            Some(rec) => CancelOutcome::AlreadyTerminal(rec.state),
            None => CancelOutcome::NotFound,
        })
    }

    /// Register `url` as the webhook of `job_id`, before the job is published (so no
    /// outcome can come first); the ingress calls it only while it holds the job id's
    /// claim. A registration not yet claimed takes the new URL (a retried submission
    /// whose earlier claim was released); a claimed one is kept.
    pub async fn register_webhook(
        &self,
        job_id: &str,
        url: &str,
        now_ms: i64,
    ) -> Result<(), StoreError> {
        const REGISTER: &str = "INSERT INTO webhooks (job_id, url, registered_at_ms)              VALUES ($1, $2, $3) ON CONFLICT (job_id) DO UPDATE SET url = excluded.url              WHERE webhooks.claimed_by IS NULL";
        on_pool!(self, write, |pool| {
            sqlx::query(REGISTER)
                .bind(job_id)
                .bind(url)
                .bind(now_ms)
                .execute(pool)
                .await
                .map(|_| ())
                .map_err(db("registering a webhook"))
        })
    }

    /// Remove `job_id`'s webhook to `url` when its job was not accepted after all (the
    /// ingress's publish failed and its claim was released): only while no delivery claimed
    /// it and the ledger holds no row for the job (a worker that already has the job keeps
    /// it). `Ok(true)` if it was removed.
    pub async fn unregister_webhook(&self, job_id: &str, url: &str) -> Result<bool, StoreError> {
        const UNREGISTER: &str = "DELETE FROM webhooks WHERE job_id = $1 AND url = $2 \
             AND claimed_by IS NULL AND NOT EXISTS (SELECT 1 FROM jobs WHERE jobs.job_id = $1)";
        on_pool!(self, write, |pool| {
            sqlx::query(UNREGISTER)
                .bind(job_id)
                .bind(url)
                .execute(pool)
                .await
                .map(|done| done.rows_affected() > 0)
                .map_err(db("removing a webhook"))
        })
    }

    /// Claim the webhook of `job_id` for delivery by `me` at `now_ms`: its URL if it has one
    /// still open (neither delivered nor given up) that no one claimed, or whose claim is
    /// stale (no claim nor attempt for [`WEBHOOK_CLAIM_STALE_MS`]: its claimer stopped
    /// mid-delivery); exactly one claimer wins. Else `None`.
    pub async fn claim_webhook(
        &self,
        job_id: &str,
        me: &str,
        now_ms: i64,
    ) -> Result<Option<String>, StoreError> {
        const CLAIM: &str = "UPDATE webhooks SET claimed_by = $2, claimed_at_ms = $3 \
             WHERE job_id = $1 AND delivered_at_ms IS NULL AND given_up_at_ms IS NULL \
             AND (claimed_by IS NULL OR COALESCE(claimed_at_ms, 0) < $4) RETURNING url";
        on_pool!(self, write, |pool| {
            sqlx::query(CLAIM)
                .bind(job_id)
                .bind(me)
                .bind(now_ms)
                .bind(now_ms.saturating_sub(WEBHOOK_CLAIM_STALE_MS))
                .fetch_optional(pool)
                .await
                .and_then(|row| row.map(|r| r.try_get(0)).transpose())
                .map_err(db("claiming a webhook"))
        })
    }

    /// The webhooks that no process is delivering, oldest first, at most `limit`: still
    /// open (neither delivered nor given up), of a job that ended before `ended_before_ms`,
    /// and never claimed or claimed longer than [`WEBHOOK_CLAIM_STALE_MS`] before `now_ms`
    /// with no attempt since. `serve`'s sweep claims and delivers them.
    pub async fn webhooks_to_sweep(
        &self,
        ended_before_ms: i64,
        now_ms: i64,
        limit: i64,
    ) -> Result<Vec<String>, StoreError> {
        const SELECT: &str = "SELECT w.job_id FROM webhooks w JOIN jobs j ON j.job_id = w.job_id \
             WHERE w.delivered_at_ms IS NULL AND w.given_up_at_ms IS NULL \
             AND (w.claimed_by IS NULL OR COALESCE(w.claimed_at_ms, 0) < $2) \
             AND j.state NOT IN ('accepted', 'running') AND j.recorded_at_ms < $1 \
             ORDER BY w.registered_at_ms, w.job_id LIMIT $3";
        on_pool!(self, read, |pool| {
            sqlx::query(SELECT)
                .bind(ended_before_ms)
                .bind(now_ms.saturating_sub(WEBHOOK_CLAIM_STALE_MS))
                .bind(limit)
                .fetch_all(pool)
                .await
                .and_then(|rows| rows.iter().map(|r| r.try_get(0)).collect())
                .map_err(db("reading the webhooks to sweep"))
        })
    }

    /// Record one delivery attempt; a successful one (`error` is `None`) marks the webhook
    /// delivered.
    pub async fn record_webhook_attempt(&self, a: &WebhookAttempt) -> Result<(), StoreError> {
        const ATTEMPT: &str = "INSERT INTO webhook_attempts (job_id, attempt, at_ms, status, error)              VALUES ($1, $2, $3, $4, $5) ON CONFLICT (job_id, attempt) DO NOTHING";
        const DELIVERED: &str = "UPDATE webhooks SET delivered_at_ms = $2 WHERE job_id = $1";
        // Every attempt renews the claim: a delivery still trying is never stale.
        const RENEW: &str = "UPDATE webhooks SET claimed_at_ms = $2 WHERE job_id = $1";
        on_pool!(self, write, |pool| {
            sqlx::query(ATTEMPT)
                .bind(&a.job_id)
                .bind(a.attempt)
                .bind(a.at_ms)
                .bind(a.status)
                .bind(&a.error)
                .execute(pool)
                .await
                .map_err(db("recording a webhook attempt"))?;
            sqlx::query(RENEW)
                .bind(&a.job_id)
                .bind(a.at_ms)
                .execute(pool)
                .await
                .map_err(db("renewing a webhook's claim"))?;
            if a.error.is_none() {
                sqlx::query(DELIVERED)
                    .bind(&a.job_id)
                    .bind(a.at_ms)
                    .execute(pool)
                    .await
                    .map_err(db("marking a webhook delivered"))?;
            }
            Ok(())
        })
    }

    /// Record that delivery of `job_id`'s webhook was given up at `at_ms` (its attempts are
    /// used up, or its receiver's answer cannot change by retrying): it holds its job
    /// against retention no more. A delivered webhook stays delivered (the write names
    /// only an undelivered one); repeating it keeps the first time.
    pub async fn record_webhook_given_up(
        &self,
        job_id: &str,
        at_ms: i64,
    ) -> Result<(), StoreError> {
        const GIVEN_UP: &str = "UPDATE webhooks SET given_up_at_ms = $2 \
             WHERE job_id = $1 AND delivered_at_ms IS NULL AND given_up_at_ms IS NULL";
        on_pool!(self, write, |pool| {
            sqlx::query(GIVEN_UP)
                .bind(job_id)
                .bind(at_ms)
                .execute(pool)
                .await
                .map(|_| ())
                .map_err(db("recording a webhook given up"))
        })
    }

    /// The delivery attempts of `job_id`'s webhook, in order.
    pub async fn webhook_attempts(&self, job_id: &str) -> Result<Vec<WebhookAttempt>, StoreError> {
        const SELECT: &str = "SELECT job_id, attempt, at_ms, status, error FROM webhook_attempts              WHERE job_id = $1 ORDER BY attempt";
        on_pool!(self, read, |pool| {
            sqlx::query(SELECT)
                .bind(job_id)
                .fetch_all(pool)
                .await
                .and_then(|rows| {
                    rows.iter()
                        .map(|r| {
                            Ok(WebhookAttempt {
                                job_id: r.try_get(0)?,
                                attempt: r.try_get(1)?,
                                at_ms: r.try_get(2)?,
                                status: r.try_get(3)?,
                                error: r.try_get(4)?,
                            })
                        })
                        .collect()
                })
                .map_err(db("reading webhook attempts"))
        })
    }

    pub async fn release_claim(
        &self,
        job_id: &str,
        payload_hash: &str,
    ) -> Result<bool, StoreError> {
        const RELEASE: &str = "DELETE FROM jobs WHERE job_id = $1 AND payload_hash = $2 \
             AND state = 'accepted' AND accepted_at_ms IS NULL";
        on_pool!(self, write, |pool| {
            sqlx::query(RELEASE)
                .bind(job_id)
                .bind(payload_hash)
                .execute(pool)
                .await
                .map(|done| done.rows_affected() > 0)
                .map_err(db("releasing a job id claim"))
        })
    }
}

// Defined here so that they see the macros and private items above.
pub(crate) mod batches;
pub(crate) mod copy;
pub(crate) mod dashboard;
pub(crate) mod retention;

fn receipt(state: &str, backend_calls: i64, cancel_requested: bool) -> ReceiptInfo {
    let terminal = state.parse::<State>().is_ok_and(State::is_terminal);
    ReceiptInfo {
        already_recorded: terminal,
        prior_starts: u32::try_from(backend_calls.max(0)).unwrap_or(u32::MAX),
        cancel_requested: cancel_requested && !terminal,
    }
}

/// The ledger text of `rec.reason`: the one place a typed reason becomes text.
fn reason_text(rec: &OutcomeRecord) -> Option<String> {
    rec.reason.as_ref().map(ToString::to_string)
}

/// The stored `request_tokens` of `rec`'s request size.
fn request_tokens(rec: &OutcomeRecord) -> Option<i64> {
    (rec.request_size).map(|s| i64::try_from(s.prompt_tokens).unwrap_or(i64::MAX))
}

/// The stored `request_max_tokens`: NULL also when the payload set no `max_tokens`.
fn request_max_tokens(rec: &OutcomeRecord) -> Option<i64> {
    (rec.request_size)
        .and_then(|s| s.max_tokens)
        .map(|m| i64::try_from(m).unwrap_or(i64::MAX))
}

/// The request size of the stored `request_tokens` and `request_max_tokens`: none without
/// the prompt tokens (a row recorded before ledger version 12, or a payload that is not a
/// chat request), nor from a negative number (not a size any worker writes).
fn request_size(tokens: Option<i64>, max_tokens: Option<i64>) -> Option<RequestSize> {
    Some(RequestSize {
        prompt_tokens: u64::try_from(tokens?).ok()?,
        max_tokens: max_tokens.map(u64::try_from).transpose().ok()?,
    })
}

/// Empty strings are stored as NULL in optional columns.
fn non_empty(s: &str) -> Option<&str> {
    (!s.is_empty()).then_some(s)
}

fn job_from_row<R>(row: &R) -> Result<JobRecord, sqlx::Error>
where
    R: Row,
    for<'a> &'a str: ColumnIndex<R>,
    for<'r> String: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> i64: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> bool: Decode<'r, R::Database> + Type<R::Database>,
{
    Ok(JobRecord {
        job_id: row.try_get("job_id")?,
        kind: row.try_get("kind")?,
        state: row.try_get("state")?,
        reason: row.try_get("reason")?,
        attempts: row.try_get("attempts")?,
        backend_calls: row.try_get("backend_calls")?,
        created_at_ms: row.try_get("created_at_ms")?,
        expires_at_ms: row.try_get("expires_at_ms")?,
        accepted_at_ms: row.try_get("accepted_at_ms")?,
        received_at_ms: row.try_get("received_at_ms")?,
        checked_at_ms: row.try_get("checked_at_ms")?,
        started_at_ms: row.try_get("started_at_ms")?,
        finished_at_ms: row.try_get("finished_at_ms")?,
        recorded_at_ms: row.try_get("recorded_at_ms")?,
        reconciled_at_ms: row.try_get("reconciled_at_ms")?,
        worker: row.try_get("worker")?,
        result: row.try_get("result")?,
        error: row.try_get("error")?,
        trace_id: row.try_get("trace_id")?,
        prompt_tokens: row.try_get("prompt_tokens")?,
        completion_tokens: row.try_get("completion_tokens")?,
        request_tokens: row.try_get("request_tokens")?,
        request_max_tokens: row.try_get("request_max_tokens")?,
        latency_ms: row.try_get("latency_ms")?,
        model_ms: row.try_get("model_ms")?,
        wasted_model_ms: row.try_get("wasted_model_ms")?,
        cancel_requested: row.try_get("cancel_requested")?,
        cancel_confirmed: row.try_get("cancel_confirmed")?,
        backend: row.try_get("backend")?,
        model: row.try_get("model")?,
        min_runtime_ms: row.try_get("min_runtime_ms")?,
        min_feasible_budget_ms: row.try_get("min_feasible_budget_ms")?,
        tenant: row.try_get("tenant")?,
        priority: row.try_get("priority")?,
    })
}

fn attempt_from_row<R>(row: &R) -> Result<AttemptRow, sqlx::Error>
where
    R: Row,
    for<'a> &'a str: ColumnIndex<R>,
    for<'r> String: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> i64: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> bool: Decode<'r, R::Database> + Type<R::Database>,
{
    Ok(AttemptRow {
        attempt_key: row.try_get("attempt_key")?,
        job_id: row.try_get("job_id")?,
        attempt: row.try_get("attempt")?,
        worker: row.try_get("worker")?,
        redelivered: row.try_get("redelivered")?,
        received_at_ms: row.try_get("received_at_ms")?,
        checked_at_ms: row.try_get("checked_at_ms")?,
        started_at_ms: row.try_get("started_at_ms")?,
        finished_at_ms: row.try_get("finished_at_ms")?,
        acked_at_ms: row.try_get("acked_at_ms")?,
        decision: row.try_get("decision")?,
        state: row.try_get("state")?,
        reason: row.try_get("reason")?,
        model_called: row.try_get("model_called")?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn non_terminal_sql_matches_the_core() {
        let non_terminal: Vec<String> = State::ALL
            .iter()
            .filter(|s| !s.is_terminal())
            .map(|s| format!("'{}'", s.as_str()))
            .collect();
        let expected = format!("({})", non_terminal.join(", "));
        assert_eq!(NON_TERMINAL_SQL, expected);
        for sql in [
            UPSERT_JOB_RUNNING,
            UPSERT_JOB_TERMINAL,
            UPSERT_JOB_LIVE,
            MARK_UNKNOWN,
        ] {
            assert!(sql.contains(NON_TERMINAL_SQL), "{sql}");
        }
    }

    #[test]
    fn only_the_terminal_upsert_lets_a_real_outcome_replace_unknown() {
        let unknown = State::Unknown.as_str();
        assert!(State::Unknown.is_terminal());
        let clause = format!("OR (jobs.state = '{unknown}' AND excluded.state <> '{unknown}')");
        assert!(
            UPSERT_JOB_TERMINAL.ends_with(&clause),
            "{UPSERT_JOB_TERMINAL}"
        );
        for d in [Dialect::Sqlite, Dialect::Postgres] {
            let batched = &run_statements(d)[1];
            assert!(
                batched.ends_with(&format!("{clause} RETURNING job_id")),
                "{batched}"
            );
        }
        // A start or a retry never moves an `unknown` job, and no upsert touches when it
        // was reconciled.
        for sql in [UPSERT_JOB_RUNNING, UPSERT_JOB_LIVE] {
            assert!(!sql.contains(unknown), "{sql}");
        }
        for sql in [UPSERT_JOB_RUNNING, UPSERT_JOB_TERMINAL, UPSERT_JOB_LIVE] {
            assert!(!sql.contains("reconciled_at_ms"), "{sql}");
        }
        assert!(MARK_UNKNOWN.contains("reconciled_at_ms = $1"));
    }

    #[test]
    fn every_batched_statement_takes_its_rows_from_one_parameter() {
        // All of a statement's placeholders sit in its VALUES tuple, numbered in order, so
        // the generated INSERT … SELECT reads every value from the row arrays.
        for sql in [
            UPSERT_JOB_RUNNING,
            UPSERT_JOB_TERMINAL,
            UPSERT_JOB_LIVE,
            UPSERT_ATTEMPT_START,
            UPSERT_ATTEMPT_OUTCOME,
        ] {
            let sqlite = insert_from_json(sql, Dialect::Sqlite);
            assert!(!sqlite.contains('$'), "{sqlite}");
            assert_eq!(sqlite.matches('?').count(), 1, "{sqlite}");
            let pg = insert_from_json(sql, Dialect::Postgres);
            assert_eq!(pg.matches('$').count(), 1, "{pg}");
        }
        for d in [Dialect::Sqlite, Dialect::Postgres] {
            for sql in run_statements(d) {
                let params = match d {
                    Dialect::Sqlite => sql.matches('?').count(),
                    Dialect::Postgres => sql.matches("$1").count(),
                };
                assert_eq!(params, 1, "{sql}");
            }
        }
        assert_eq!(sqlite_run_query().matches('?').count(), RUN_STATEMENTS);
        let terminal = &run_statements(Dialect::Postgres)[1];
        assert!(terminal.contains("(value ->> 18)::boolean"), "{terminal}");
        assert!(terminal.ends_with("RETURNING job_id"), "{terminal}");
    }

    #[test]
    fn runs_split_where_a_job_or_attempt_repeats() {
        let start = |job: &str, key: &str| {
            LedgerWrite::Start(AttemptStart {
                attempt_key: key.into(),
                job_id: job.into(),
                kind: "k".into(),
                attempt: 0,
                created_at_ms: 0,
                expires_at_ms: 0,
                worker: "w".into(),
                redelivered: false,
                received_at_ms: 0,
                checked_at_ms: 0,
                started_at_ms: 0,
                tenant: lastcall_core::Tenant::default_tenant(),
                priority: lastcall_core::Priority::Standard,
            })
        };
        let w = [
            start("a", "1"),
            start("b", "2"),
            start("a", "3"),
            start("c", "3"),
            start("d", "4"),
        ];
        assert_eq!(runs(&w), vec![0..2, 2..3, 3..5]);
        assert_eq!(runs(&[]), vec![0..0]);
    }
}
