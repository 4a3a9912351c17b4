//! Retention: pruning old terminal jobs (with their attempt and webhook rows), clearing
//! old result texts, the archive hook, the streamed export, and the ledger's size.
//!
//! **Invariant (never pruned):** a job that is not terminal (`accepted`, `running`), a job
//! with no `recorded_at_ms`, and a job whose webhook is registered but not delivered. Every
//! statement here spells that rule through [`ELIGIBLE`]; a unit test keeps its list of
//! non-terminal states equal to the core's.
//!
//! Each batch is one short transaction of at most `limit` jobs, oldest first, so writers
//! wait at most one batch; the caller pauses between batches. A batch deletes the job's
//! attempt rows, webhook attempts, webhook and job row together, after handing the job
//! records to the archive (which must be durable before it returns): a job is never gone
//! from the ledger without being in the archive first.
//!
//! Several pruners: on PostgreSQL [`Ledger::try_prune_lock`] takes a session advisory lock,
//! so one prunes at a time (the others skip their turn); on SQLite every batch runs under
//! the database's write lock (`BEGIN IMMEDIATE`), so two pruners never select, archive or
//! delete the same job: they only share the work.

use std::pin::Pin;

use futures_util::{Stream, StreamExt};
use serde::Serialize;
use sqlx::{AssertSqlSafe, Row};

use super::{Backend, Ledger, job_from_row};
use crate::batch::{Dialect, json_array};
use crate::error::db;
use crate::{JobRecord, StoreError};

/// A job may go (`$1`: the cutoff, `recorded_at_ms < $1`): ended for good (not `accepted`,
/// `running`, nor `unknown`, whose real outcome may still arrive), recorded before the
/// cutoff, and no webhook of it waits for delivery (one delivered, or given up after its
/// attempts, waits no more).
macro_rules! eligible {
    () => {
        "state NOT IN ('accepted', 'running', 'unknown') AND recorded_at_ms < $1 \
         AND NOT EXISTS (SELECT 1 FROM webhooks w WHERE w.job_id = jobs.job_id \
         AND w.delivered_at_ms IS NULL AND w.given_up_at_ms IS NULL)"
    };
}

/// [`eligible!`] as a constant, for the tests.
#[cfg(test)]
const ELIGIBLE: &str = eligible!();

/// Ended, recorded before `$1`, and held only by a webhook not yet delivered nor given up.
const COUNT_HELD: &str = "SELECT COUNT(*) FROM jobs \
     WHERE state NOT IN ('accepted', 'running', 'unknown') AND recorded_at_ms < $1 \
     AND EXISTS (SELECT 1 FROM webhooks w WHERE w.job_id = jobs.job_id \
     AND w.delivered_at_ms IS NULL AND w.given_up_at_ms IS NULL)";

const COUNT_JOBS: &str = concat!("SELECT COUNT(*) FROM jobs WHERE ", eligible!());
const COUNT_ATTEMPTS: &str = concat!(
    "SELECT COUNT(*) FROM attempts WHERE job_id IN (SELECT job_id FROM jobs WHERE ",
    eligible!(),
    ")"
);
const COUNT_WEBHOOKS: &str = concat!(
    "SELECT COUNT(*) FROM webhooks WHERE job_id IN (SELECT job_id FROM jobs WHERE ",
    eligible!(),
    ")"
);
const COUNT_WEBHOOK_ATTEMPTS: &str = concat!(
    "SELECT COUNT(*) FROM webhook_attempts WHERE job_id IN (SELECT job_id FROM jobs WHERE ",
    eligible!(),
    ")"
);
/// Texts to clear: eligible at the text cutoff `$1`, kept as rows (recorded at or after
/// the row cutoff `$2`), still holding a result.
const COUNT_TEXTS: &str = concat!(
    "SELECT COUNT(*) FROM jobs WHERE ",
    eligible!(),
    " AND result IS NOT NULL AND recorded_at_ms >= $2"
);

const COUNT_STALE_WORKERS: &str = "SELECT COUNT(*) FROM workers WHERE heartbeat_ms < $1";
const DELETE_STALE_WORKERS: &str = "DELETE FROM workers WHERE heartbeat_ms < $1";

/// Batches whose window ended before `$1` (their jobs' deadlines all passed by then).
const COUNT_OLD_BATCHES: &str = "SELECT COUNT(*) FROM batches WHERE expires_at_ms < $1";
const SELECT_OLD_BATCHES: &str =
    "SELECT batch_id FROM batches WHERE expires_at_ms < $1 ORDER BY expires_at_ms LIMIT $2";
/// Files created before `$1` that no batch reads (a batch's input stays while it does).
macro_rules! old_files {
    () => {
        "FROM files f WHERE f.created_at_ms < $1 AND NOT EXISTS \
         (SELECT 1 FROM batches b WHERE b.input_file_id = f.file_id)"
    };
}
const COUNT_OLD_FILES: &str = concat!("SELECT COUNT(*) ", old_files!());
const SELECT_OLD_FILES: &str = concat!(
    "SELECT f.file_id ",
    old_files!(),
    " ORDER BY f.created_at_ms LIMIT $2"
);
/// At most `$2` lines of file `$1`.
const DELETE_FILE_LINES_PAGE: &str = "DELETE FROM file_lines WHERE file_id = $1 AND line_no IN \
     (SELECT line_no FROM file_lines WHERE file_id = $1 ORDER BY line_no LIMIT $2)";

/// The oldest `$2` eligible jobs (through the `jobs_recorded_at` index).
const SELECT_BATCH: &str = concat!(
    "SELECT job_id FROM jobs WHERE ",
    eligible!(),
    " ORDER BY recorded_at_ms, job_id LIMIT $2"
);

/// The `recorded_at_ms` of the oldest eligible job (through the `jobs_recorded_at` index:
/// it stops at the first one; when pruning keeps up, none is before the cutoff).
const SELECT_OLDEST_PRUNABLE: &str = concat!(
    "SELECT recorded_at_ms FROM jobs WHERE ",
    eligible!(),
    " ORDER BY recorded_at_ms LIMIT 1"
);

/// The eligible jobs, counted up to `$2` (so a ledger far behind costs `$2` index entries
/// per read, not all of them).
const COUNT_PRUNABLE_BOUNDED: &str = concat!(
    "SELECT COUNT(*) FROM (SELECT 1 FROM jobs WHERE ",
    eligible!(),
    " LIMIT $2) AS t"
);

/// How many prunable rows [`Ledger::prunable_rows`] counts at most for the dashboard's
/// alert (`ledger prune --dry-run` counts them all).
pub const PRUNABLE_COUNT_LIMIT: u32 = 1_000;

/// Clears the result of the oldest `$3` eligible jobs that still hold one (through the
/// `jobs_text_recorded` partial index).
const CLEAR_TEXTS: &str = concat!(
    "UPDATE jobs SET result = NULL WHERE job_id IN (SELECT job_id FROM jobs WHERE ",
    eligible!(),
    " AND result IS NOT NULL AND recorded_at_ms >= $2 ORDER BY recorded_at_ms LIMIT $3)"
);

/// Terminal jobs recorded in `[$1, $2)`, oldest first (the export).
const SELECT_RANGE: &str = concat!(
    "SELECT ",
    job_columns!(),
    " FROM jobs WHERE recorded_at_ms >= $1 AND recorded_at_ms < $2 \
     AND state NOT IN ('accepted', 'running') ORDER BY recorded_at_ms, job_id"
);

/// The share of the time a pruner may spend in its batches: pruning may cost the writers
/// at most 5% of their throughput, and a batch holds the write lock.
pub const PRUNE_DUTY: f64 = 0.05;

/// The pause after a prune batch that took `batch`: at least `min` (`batch_pause_ms`), and
/// long enough that batches take at most [`PRUNE_DUTY`] of the time.
pub fn prune_pause(min: std::time::Duration, batch: std::time::Duration) -> std::time::Duration {
    min.max(batch.mul_f64((1.0 - PRUNE_DUTY) / PRUNE_DUTY))
}

/// Arbitrary but fixed key of the PostgreSQL advisory lock one pruner holds.
const PG_PRUNE_LOCK_KEY: i64 = 0x6c63_5f70_7275_6e65; // "lc_prune"

/// What one prune pass removed (or, as a preview, would remove).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct PruneCounts {
    /// Job rows deleted.
    pub jobs: u64,
    /// Their attempt rows.
    pub attempts: u64,
    /// Their webhook registrations (all delivered).
    pub webhooks: u64,
    /// Their webhook delivery attempts.
    pub webhook_attempts: u64,
    /// Jobs kept whose `result` text was cleared.
    pub texts: u64,
    /// Jobs old enough to go but kept: their webhook is not delivered yet.
    pub held_by_webhooks: u64,
    /// Batches whose completion window ended before the cutoff (with their malformed-line
    /// records).
    pub batches: u64,
    /// Uploaded files created before the cutoff that no kept batch reads (with their lines).
    pub files: u64,
    /// Worker leases not renewed since the row cutoff (workers long gone).
    pub workers: u64,
}

impl PruneCounts {
    /// Adds `other` (a batch) to these totals; `held_by_webhooks` is a state, not a sum:
    /// the latest value is kept.
    pub fn add(&mut self, other: &PruneCounts) {
        self.jobs += other.jobs;
        self.attempts += other.attempts;
        self.webhooks += other.webhooks;
        self.webhook_attempts += other.webhook_attempts;
        self.texts += other.texts;
        self.workers += other.workers;
        self.batches += other.batches;
        self.files += other.files;
    }
}

/// The ledger's approximate size ([`Ledger::size`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct LedgerSize {
    /// Job rows: exact on SQLite, PostgreSQL's planner estimate (`reltuples`).
    pub job_rows: i64,
    /// Bytes the ledger's data takes: SQLite's pages in use, PostgreSQL's tables with
    /// their indexes and TOAST.
    pub bytes: i64,
}

/// The pruner's turn, while held ([`Ledger::try_prune_lock`]). Release it with
/// [`release`](Self::release); dropped, its connection is closed, which releases the lock too.
#[derive(Debug)]
pub struct PruneLock {
    pg: Option<sqlx::pool::PoolConnection<sqlx::Postgres>>,
}

impl PruneLock {
    pub async fn release(mut self) {
        if let Some(mut conn) = self.pg.take() {
            let unlocked = sqlx::query("SELECT pg_advisory_unlock($1)")
                .bind(PG_PRUNE_LOCK_KEY)
                .execute(&mut *conn)
                .await;
            if unlocked.is_err() {
                // Never return a connection to the pool that may still hold the lock.
                conn.close_on_drop();
            }
        }
    }
}

impl Drop for PruneLock {
    fn drop(&mut self) {
        if let Some(conn) = self.pg.as_mut() {
            conn.close_on_drop();
        }
    }
}

/// A stream of job records, as [`Ledger::export`] returns it.
pub type JobStream<'a> = Pin<Box<dyn Stream<Item = Result<JobRecord, StoreError>> + Send + 'a>>;

/// Where a prune batch puts its jobs before deleting them: it must return only once they
/// are durable (written and synced). An error aborts the batch; nothing is deleted.
pub type ArchiveFn<'a> = &'a mut (dyn FnMut(&[JobRecord]) -> std::io::Result<()> + Send);

impl Ledger {
    /// The pruner's turn. PostgreSQL: `Some` if this process took the advisory lock (held
    /// on a connection of its own until released), `None` if another process holds it.
    /// SQLite: always `Some` (each batch takes the database's write lock anyway).
    pub async fn try_prune_lock(&self) -> Result<Option<PruneLock>, StoreError> {
        match &self.backend {
            Backend::Sqlite { .. } => Ok(Some(PruneLock { pg: None })),
            Backend::Postgres(pool) => {
                let mut conn = pool.acquire().await.map_err(db("taking the prune lock"))?;
                let got: bool = sqlx::query("SELECT pg_try_advisory_lock($1)")
                    .bind(PG_PRUNE_LOCK_KEY)
                    .fetch_one(&mut *conn)
                    .await
                    .and_then(|r| r.try_get(0))
                    .map_err(db("taking the prune lock"))?;
                Ok(got.then_some(PruneLock { pg: Some(conn) }))
            }
        }
    }

    /// What pruning at these cutoffs would remove, changing nothing (`--dry-run`): rows of
    /// terminal jobs recorded before `rows_before_ms` (`None`: rows are kept), and result
    /// texts of the jobs recorded before `texts_before_ms` that stay as rows.
    pub async fn prune_preview(
        &self,
        rows_before_ms: Option<i64>,
        texts_before_ms: Option<i64>,
    ) -> Result<PruneCounts, StoreError> {
        let mut c = PruneCounts::default();
        let count = |sql: &'static str, a: i64, b: Option<i64>| async move {
            let n: i64 = on_pool!(self, read, |pool| {
                let mut q = sqlx::query(sql).bind(a);
                if let Some(b) = b {
                    q = q.bind(b);
                }
                q.fetch_one(pool)
                    .await
                    .and_then(|r| r.try_get(0))
                    .map_err(db("counting what to prune"))?
            });
            Ok::<u64, StoreError>(u64::try_from(n).unwrap_or(0))
        };
        if let Some(cut) = rows_before_ms {
            c.jobs = count(COUNT_JOBS, cut, None).await?;
            c.attempts = count(COUNT_ATTEMPTS, cut, None).await?;
            c.webhooks = count(COUNT_WEBHOOKS, cut, None).await?;
            c.webhook_attempts = count(COUNT_WEBHOOK_ATTEMPTS, cut, None).await?;
            c.held_by_webhooks = count(COUNT_HELD, cut, None).await?;
            c.workers = count(COUNT_STALE_WORKERS, cut, None).await?;
            c.batches = count(COUNT_OLD_BATCHES, cut, None).await?;
            c.files = count(COUNT_OLD_FILES, cut, None).await?;
        }
        if let Some(cut) = texts_before_ms {
            let floor = rows_before_ms.unwrap_or(i64::MIN).min(cut);
            c.texts = count(COUNT_TEXTS, cut, Some(floor)).await?;
            if rows_before_ms.is_none() {
                c.held_by_webhooks = count(COUNT_HELD, cut, None).await?;
            }
        }
        Ok(c)
    }

    /// Deletes the leases of workers that have not renewed theirs since `before_ms` (one
    /// row per worker name ever started: with the default `host:pid` names they pile up).
    /// A lease that old says nothing about a running call any more.
    pub async fn prune_worker_leases(&self, before_ms: i64) -> Result<u64, StoreError> {
        let n = write_tx!(self, "pruning old worker leases", |tx| {
            sqlx::query(DELETE_STALE_WORKERS)
                .bind(before_ms)
                .execute(&mut *tx)
                .await
                .map_err(db("pruning old worker leases"))?
                .rows_affected()
        });
        Ok(n)
    }

    /// The jobs pruning at `before_ms` would delete (the same rule: terminal, not
    /// `unknown`, no webhook waiting): the oldest one's `recorded_at_ms` and how many, counted
    /// up to `limit`. Two index reads, cheap enough for the dashboard's polls: the
    /// `ledger_behind_retention` alert.
    pub async fn prunable_rows(
        &self,
        before_ms: i64,
        limit: u32,
    ) -> Result<lastcall_core::alerts::PrunableRows, StoreError> {
        let oldest: Option<i64> = on_pool!(self, read, |pool| {
            sqlx::query(SELECT_OLDEST_PRUNABLE)
                .bind(before_ms)
                .fetch_optional(pool)
                .await
                .and_then(|r| r.map(|r| r.try_get(0)).transpose())
                .map_err(db("reading the oldest prunable job"))?
        });
        let rows = match oldest {
            None => 0,
            Some(_) => {
                let n: i64 = on_pool!(self, read, |pool| {
                    sqlx::query(COUNT_PRUNABLE_BOUNDED)
                        .bind(before_ms)
                        .bind(i64::from(limit))
                        .fetch_one(pool)
                        .await
                        .and_then(|r| r.try_get(0))
                        .map_err(db("counting the prunable jobs"))?
                });
                u64::try_from(n).unwrap_or(0)
            }
        };
        Ok(lastcall_core::alerts::PrunableRows {
            oldest_recorded_at_ms: oldest,
            rows,
            bounded: rows >= u64::from(limit),
        })
    }

    /// One batch-and-file batch: at most `limit` batches whose completion window ended
    /// before `before_ms` (with their malformed-line records), then at most `limit` files
    /// created before it that no remaining batch reads: hidden first (marked incomplete),
    /// then its lines `limit` at a time, each page its own transaction, its row last.
    /// `batches == 0 && files == 0`: nothing is left at this cutoff.
    pub async fn prune_batches_and_files(
        &self,
        before_ms: i64,
        limit: u32,
    ) -> Result<PruneCounts, StoreError> {
        const CTX: &str = "pruning old batches and files";
        let ids = |sql: &'static str| async move {
            let got: Vec<String> = on_pool!(self, read, |pool| {
                sqlx::query(sql)
                    .bind(before_ms)
                    .bind(i64::from(limit))
                    .fetch_all(pool)
                    .await
                    .and_then(|rows| rows.iter().map(|r| r.try_get(0)).collect())
                    .map_err(db(CTX))?
            });
            Ok::<_, StoreError>(got)
        };
        let mut c = PruneCounts::default();
        for batch_id in ids(SELECT_OLD_BATCHES).await? {
            let gone = write_tx!(self, "pruning old batches and files", |tx| {
                sqlx::query("DELETE FROM batch_line_errors WHERE batch_id = $1")
                    .bind(&batch_id)
                    .execute(&mut *tx)
                    .await
                    .map_err(db(CTX))?;
                sqlx::query("DELETE FROM batches WHERE batch_id = $1 AND expires_at_ms < $2")
                    .bind(&batch_id)
                    .bind(before_ms)
                    .execute(&mut *tx)
                    .await
                    .map_err(db(CTX))?
                    .rows_affected()
            });
            c.batches += gone;
        }
        for file_id in ids(SELECT_OLD_FILES).await? {
            // Hidden first (reads and new batches see only complete files), in one
            // transaction with the check that no batch reads it; then its lines a page at
            // a time; the row last, so a pass cut short leaves a row the next one finds.
            let hidden = write_tx!(self, "pruning old batches and files", |tx| {
                sqlx::query(
                    "UPDATE files SET complete = FALSE WHERE file_id = $1 AND NOT EXISTS \
                     (SELECT 1 FROM batches b WHERE b.input_file_id = $1)",
                )
                .bind(&file_id)
                .execute(&mut *tx)
                .await
                .map_err(db(CTX))?
                .rows_affected()
            });
            if hidden == 0 {
                continue;
            }
            loop {
                let n = write_tx!(self, "pruning old batches and files", |tx| {
                    sqlx::query(DELETE_FILE_LINES_PAGE)
                        .bind(&file_id)
                        .bind(i64::from(limit))
                        .execute(&mut *tx)
                        .await
                        .map_err(db(CTX))?
                        .rows_affected()
                });
                if n < u64::from(limit) {
                    break;
                }
            }
            c.files += write_tx!(self, "pruning old batches and files", |tx| {
                sqlx::query("DELETE FROM files WHERE file_id = $1 AND NOT complete")
                    .bind(&file_id)
                    .execute(&mut *tx)
                    .await
                    .map_err(db(CTX))?
                    .rows_affected()
            });
        }
        Ok(c)
    }

    /// Terminal jobs recorded before `before_ms` that only an undelivered webhook keeps.
    pub async fn held_by_webhooks(&self, before_ms: i64) -> Result<u64, StoreError> {
        let n: i64 = on_pool!(self, read, |pool| {
            sqlx::query(COUNT_HELD)
                .bind(before_ms)
                .fetch_one(pool)
                .await
                .and_then(|r| r.try_get(0))
                .map_err(db("counting jobs held by webhooks"))?
        });
        Ok(u64::try_from(n).unwrap_or(0))
    }

    /// One prune batch, one transaction: the oldest `limit` terminal jobs recorded before
    /// `before_ms` (see the module doc for what is never pruned) go to `archive` (if any),
    /// then are deleted with their attempt rows, webhook and webhook attempts. Returns what
    /// was deleted; `jobs == 0` means nothing is left to prune at this cutoff.
    pub async fn prune_batch(
        &self,
        before_ms: i64,
        limit: u32,
        archive: Option<ArchiveFn<'_>>,
    ) -> Result<PruneCounts, StoreError> {
        const CTX: &str = "pruning the ledger";
        let dialect = self.dialect();
        // PostgreSQL: lock the selected jobs, so a late outcome replacing an `unknown`
        // waits for this batch instead of changing a row already archived.
        let select = match dialect {
            Dialect::Sqlite => SELECT_BATCH.to_owned(),
            Dialect::Postgres => format!("{SELECT_BATCH} FOR UPDATE"),
        };
        let records_sql = format!(
            concat!(
                "SELECT ",
                job_columns!(),
                " FROM jobs WHERE {} ORDER BY recorded_at_ms, job_id"
            ),
            dialect.in_ids("job_id")
        );
        let delete =
            |table: &str| format!("DELETE FROM {table} WHERE {}", dialect.in_ids("job_id"));
        let deletes = [
            delete("attempts"),
            delete("webhook_attempts"),
            delete("webhooks"),
            delete("jobs"),
        ];
        let mut archive = archive;
        let counts = write_tx!(self, "pruning the ledger", |tx| {
            let ids: Vec<String> = sqlx::query(AssertSqlSafe(select.as_str()))
                .bind(before_ms)
                .bind(i64::from(limit))
                .fetch_all(&mut *tx)
                .await
                .and_then(|rows| rows.iter().map(|r| r.try_get(0)).collect())
                .map_err(db(CTX))?;
            let mut c = PruneCounts::default();
            if !ids.is_empty() {
                let ids_json = json_array(&ids);
                if let Some(archive) = archive.as_mut() {
                    let records: Vec<JobRecord> = sqlx::query(AssertSqlSafe(records_sql.as_str()))
                        .bind(&ids_json)
                        .fetch_all(&mut *tx)
                        .await
                        .and_then(|rows| rows.iter().map(job_from_row).collect())
                        .map_err(db(CTX))?;
                    archive(&records).map_err(|e| {
                        StoreError::Fatal(format!("archiving pruned jobs (nothing deleted): {e}"))
                    })?;
                }
                let mut affected = [0u64; 4];
                for (sql, n) in deletes.iter().zip(affected.iter_mut()) {
                    *n = sqlx::query(AssertSqlSafe(sql.as_str()))
                        .bind(&ids_json)
                        .execute(&mut *tx)
                        .await
                        .map_err(db(CTX))?
                        .rows_affected();
                }
                c.attempts = affected[0];
                c.webhook_attempts = affected[1];
                c.webhooks = affected[2];
                c.jobs = affected[3];
            }
            c
        });
        Ok(counts)
    }

    /// One text batch: clears the `result` of at most `limit` terminal jobs recorded in
    /// `[kept_from_ms, before_ms)` (the same rule as [`prune_batch`](Self::prune_batch):
    /// never a non-terminal job, never one whose webhook waits). The rows stay. Returns how
    /// many texts were cleared; `0`: none left at this cutoff.
    pub async fn clear_texts_batch(
        &self,
        before_ms: i64,
        kept_from_ms: i64,
        limit: u32,
    ) -> Result<u64, StoreError> {
        let n = write_tx!(self, "clearing old result texts", |tx| {
            sqlx::query(CLEAR_TEXTS)
                .bind(before_ms)
                .bind(kept_from_ms)
                .bind(i64::from(limit))
                .execute(&mut *tx)
                .await
                .map_err(db("clearing old result texts"))?
                .rows_affected()
        });
        Ok(n)
    }

    /// Terminal jobs recorded in `[since_ms, until_ms)`, oldest first, as a stream: rows are
    /// decoded as they arrive, so any number of them runs in constant memory. (On SQLite
    /// the read holds one snapshot for its whole length.)
    pub fn export(&self, since_ms: i64, until_ms: i64) -> JobStream<'_> {
        match &self.backend {
            Backend::Sqlite { reader, .. } => sqlx::query(SELECT_RANGE)
                .bind(since_ms)
                .bind(until_ms)
                .fetch(reader)
                .map(|r| {
                    r.and_then(|row| job_from_row(&row))
                        .map_err(db("exporting jobs"))
                })
                .boxed(),
            Backend::Postgres(pool) => sqlx::query(SELECT_RANGE)
                .bind(since_ms)
                .bind(until_ms)
                .fetch(pool)
                .map(|r| {
                    r.and_then(|row| job_from_row(&row))
                        .map_err(db("exporting jobs"))
                })
                .boxed(),
        }
    }

    /// The ledger's approximate size: cheap enough to read every minute on a large ledger.
    pub async fn size(&self) -> Result<LedgerSize, StoreError> {
        const SQLITE: &str = "SELECT (SELECT COUNT(*) FROM jobs), \
             (SELECT (p.page_count - f.freelist_count) * s.page_size \
              FROM pragma_page_count() p, pragma_freelist_count() f, pragma_page_size() s)";
        const POSTGRES: &str = "SELECT (SELECT CASE WHEN c.reltuples < 0 THEN (SELECT COUNT(*) FROM jobs) \
               ELSE c.reltuples::bigint END FROM pg_class c WHERE c.oid = 'jobs'::regclass), \
             (pg_total_relation_size('jobs') + pg_total_relation_size('attempts') \
              + pg_total_relation_size('webhooks') + pg_total_relation_size('webhook_attempts') \
              + pg_total_relation_size('workers'))::bigint";
        let sql = match self.dialect() {
            Dialect::Sqlite => SQLITE,
            Dialect::Postgres => POSTGRES,
        };
        on_pool!(self, read, |pool| {
            sqlx::query(sql)
                .fetch_one(pool)
                .await
                .and_then(|r| {
                    Ok(LedgerSize {
                        job_rows: r.try_get(0)?,
                        bytes: r.try_get(1)?,
                    })
                })
                .map_err(db("reading the ledger's size"))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lastcall_core::State;

    #[test]
    fn the_pause_keeps_batches_to_a_twentieth_of_the_time() {
        use std::time::Duration;
        let ms = Duration::from_millis;
        assert_eq!(prune_pause(ms(50), ms(1)), ms(50), "the floor");
        assert_eq!(prune_pause(ms(50), ms(10)), ms(190));
        for b in [0u64, 3, 40, 1_000] {
            let p = prune_pause(ms(50), ms(b));
            assert!(ms(b).as_secs_f64() <= PRUNE_DUTY * (ms(b) + p).as_secs_f64() + 1e-9);
        }
    }

    #[test]
    fn the_pruning_rule_names_every_non_terminal_state() {
        let non_terminal: Vec<String> = State::ALL
            .iter()
            .filter(|s| !s.is_terminal())
            .map(|s| format!("'{}'", s.as_str()))
            .collect();
        // The export takes every ended job; pruning keeps `unknown` too (a late outcome
        // may still replace it).
        let list = format!("state NOT IN ({})", non_terminal.join(", "));
        assert!(SELECT_RANGE.contains(&list), "{SELECT_RANGE}");
        let kept = format!(
            "state NOT IN ({}, '{}')",
            non_terminal.join(", "),
            State::Unknown.as_str()
        );
        for sql in [
            ELIGIBLE,
            COUNT_HELD,
            COUNT_JOBS,
            SELECT_BATCH,
            CLEAR_TEXTS,
            SELECT_OLDEST_PRUNABLE,
            COUNT_PRUNABLE_BOUNDED,
        ] {
            assert!(sql.contains(&kept), "{sql}");
        }
        for sql in [
            SELECT_BATCH,
            CLEAR_TEXTS,
            COUNT_JOBS,
            COUNT_TEXTS,
            SELECT_OLDEST_PRUNABLE,
            COUNT_PRUNABLE_BOUNDED,
        ] {
            assert!(
                sql.contains("w.delivered_at_ms IS NULL AND w.given_up_at_ms IS NULL"),
                "{sql}"
            );
        }
    }
}
