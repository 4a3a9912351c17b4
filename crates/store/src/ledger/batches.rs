//! Files and batches of the OpenAI-compatible Batch API (tables `files`, `file_lines`,
//! `batches`, `batch_line_errors`).
//!
//! A file is written a page of lines at a time and read the same way, so neither an
//! upload nor a download holds a whole file. A batch's progress is its `cursor` (lines
//! handled from the first), advanced only by compare-and-set after a page was published:
//! a `serve` that stops between the publish and the write publishes that page again, and
//! the jobs' ids (the batch's `job_prefix` and the line number) make that a duplicate.
//! The batch's jobs are rows of `jobs` like any other; their outcomes are read by id.

use sqlx::{AssertSqlSafe, Row};

use super::{Backend, Ledger, job_from_row};
use crate::batch::json_array;
use crate::error::db;
use crate::{JobRecord, StoreError};

/// A stored file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileRow {
    pub file_id: String,
    pub tenant: String,
    pub purpose: String,
    pub filename: String,
    pub bytes: i64,
    pub line_count: i64,
    pub created_at_ms: i64,
}

/// A batch as stored; its status is computed from its jobs' outcomes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchRow {
    pub batch_id: String,
    pub tenant: String,
    pub input_file_id: String,
    pub endpoint: String,
    pub completion_window: String,
    /// The request's `metadata`, as JSON text.
    pub metadata: Option<String>,
    /// The kinds the creating token may submit, as a JSON array (`None`: every kind).
    pub allowed_kinds: Option<String>,
    /// A line's job id is this and its line number ([`BatchRow::job_id`]).
    pub job_prefix: String,
    pub created_at_ms: i64,
    pub expires_at_ms: i64,
    pub total: i64,
    pub cursor: i64,
    pub cancelled_at_ms: Option<i64>,
    pub cancel_cursor: i64,
}

impl BatchRow {
    /// The job id of line `line_no` (1-based), zero-padded so ids sort as lines do.
    pub fn job_id(&self, line_no: i64) -> String {
        format!("{}{line_no:06}", self.job_prefix)
    }
}

/// A line that did not become a job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LineError {
    pub line_no: i64,
    pub custom_id: Option<String>,
    pub code: String,
    pub message: String,
}

const FILE_COLUMNS: &str = "file_id, tenant, purpose, filename, bytes, line_count, created_at_ms";
const BATCH_COLUMNS: &str = "batch_id, tenant, input_file_id, endpoint, completion_window, \
     metadata, allowed_kinds, job_prefix, created_at_ms, expires_at_ms, total, cursor, \
     cancelled_at_ms, cancel_cursor";

fn file_from_row<R>(r: &R) -> Result<FileRow, sqlx::Error>
where
    R: Row,
    usize: sqlx::ColumnIndex<R>,
    for<'a> String: sqlx::Decode<'a, R::Database> + sqlx::Type<R::Database>,
    for<'a> i64: sqlx::Decode<'a, R::Database> + sqlx::Type<R::Database>,
{
    Ok(FileRow {
        file_id: r.try_get(0)?,
        tenant: r.try_get(1)?,
        purpose: r.try_get(2)?,
        filename: r.try_get(3)?,
        bytes: r.try_get(4)?,
        line_count: r.try_get(5)?,
        created_at_ms: r.try_get(6)?,
    })
}

fn batch_from_row<R>(r: &R) -> Result<BatchRow, sqlx::Error>
where
    R: Row,
    usize: sqlx::ColumnIndex<R>,
    for<'a> String: sqlx::Decode<'a, R::Database> + sqlx::Type<R::Database>,
    for<'a> Option<String>: sqlx::Decode<'a, R::Database> + sqlx::Type<R::Database>,
    for<'a> i64: sqlx::Decode<'a, R::Database> + sqlx::Type<R::Database>,
    for<'a> Option<i64>: sqlx::Decode<'a, R::Database> + sqlx::Type<R::Database>,
{
    Ok(BatchRow {
        batch_id: r.try_get(0)?,
        tenant: r.try_get(1)?,
        input_file_id: r.try_get(2)?,
        endpoint: r.try_get(3)?,
        completion_window: r.try_get(4)?,
        metadata: r.try_get(5)?,
        allowed_kinds: r.try_get(6)?,
        job_prefix: r.try_get(7)?,
        created_at_ms: r.try_get(8)?,
        expires_at_ms: r.try_get(9)?,
        total: r.try_get(10)?,
        cursor: r.try_get(11)?,
        cancelled_at_ms: r.try_get(12)?,
        cancel_cursor: r.try_get(13)?,
    })
}

impl Ledger {
    /// Start a file: its row, not yet complete (invisible to reads until
    /// [`Ledger::finish_file`]).
    pub async fn create_file(&self, f: &FileRow) -> Result<(), StoreError> {
        const SQL: &str = "INSERT INTO files (file_id, tenant, purpose, filename, bytes, \
             line_count, created_at_ms, complete) VALUES ($1, $2, $3, $4, $5, $6, $7, FALSE)";
        on_pool!(self, write, |pool| {
            sqlx::query(SQL)
                .bind(&f.file_id)
                .bind(&f.tenant)
                .bind(&f.purpose)
                .bind(&f.filename)
                .bind(f.bytes)
                .bind(f.line_count)
                .bind(f.created_at_ms)
                .execute(pool)
                .await
                .map(|_| ())
                .map_err(db("creating a file"))
        })
    }

    /// Append `lines`, numbered from `first_line_no`, to a file being written (one
    /// transaction; the lines as one JSON parameter).
    pub async fn append_file_lines(
        &self,
        file_id: &str,
        first_line_no: i64,
        lines: &[String],
    ) -> Result<(), StoreError> {
        if lines.is_empty() {
            return Ok(());
        }
        let json = json_array(lines);
        match &self.backend {
            Backend::Sqlite { writer, .. } => {
                const SQL: &str = "INSERT INTO file_lines (file_id, line_no, content) \
                     SELECT $1, $2 + CAST(key AS INTEGER), value FROM json_each($3)";
                sqlx::query(SQL)
                    .bind(file_id)
                    .bind(first_line_no)
                    .bind(json)
                    .execute(writer)
                    .await
                    .map_err(db("writing a file's lines"))?;
            }
            Backend::Postgres(pool) => {
                const SQL: &str = "INSERT INTO file_lines (file_id, line_no, content) \
                     SELECT $1, $2 + (t.ord - 1), t.value \
                     FROM jsonb_array_elements_text($3::jsonb) WITH ORDINALITY AS t(value, ord)";
                sqlx::query(SQL)
                    .bind(file_id)
                    .bind(first_line_no)
                    .bind(json)
                    .execute(pool)
                    .await
                    .map_err(db("writing a file's lines"))?;
            }
        }
        Ok(())
    }

    /// Mark a file complete with its size and line count: from now on it can be read.
    pub async fn finish_file(
        &self,
        file_id: &str,
        bytes: i64,
        line_count: i64,
    ) -> Result<(), StoreError> {
        const SQL: &str =
            "UPDATE files SET bytes = $2, line_count = $3, complete = TRUE WHERE file_id = $1";
        on_pool!(self, write, |pool| {
            sqlx::query(SQL)
                .bind(file_id)
                .bind(bytes)
                .bind(line_count)
                .execute(pool)
                .await
                .map(|_| ())
                .map_err(db("finishing a file"))
        })
    }

    /// A complete file.
    pub async fn get_file(&self, file_id: &str) -> Result<Option<FileRow>, StoreError> {
        let sql = format!("SELECT {FILE_COLUMNS} FROM files WHERE file_id = $1 AND complete");
        on_pool!(self, read, |pool| {
            sqlx::query(AssertSqlSafe(sql))
                .bind(file_id)
                .fetch_optional(pool)
                .await
                .and_then(|r| r.as_ref().map(file_from_row).transpose())
                .map_err(db("reading a file"))
        })
    }

    /// Delete a file and its lines (complete or not). `Ok(true)` if it existed.
    pub async fn delete_file(&self, file_id: &str) -> Result<bool, StoreError> {
        Ok(write_tx!(self, "deleting a file", |tx| {
            sqlx::query("DELETE FROM file_lines WHERE file_id = $1")
                .bind(file_id)
                .execute(&mut *tx)
                .await
                .map_err(db("deleting a file's lines"))?;
            sqlx::query("DELETE FROM files WHERE file_id = $1")
                .bind(file_id)
                .execute(&mut *tx)
                .await
                .map_err(db("deleting a file"))?
                .rows_affected()
                > 0
        }))
    }

    /// Up to `limit` lines of a file from line `from` (1-based), in order.
    pub async fn file_lines(
        &self,
        file_id: &str,
        from: i64,
        limit: i64,
    ) -> Result<Vec<(i64, String)>, StoreError> {
        const SQL: &str = "SELECT line_no, content FROM file_lines \
             WHERE file_id = $1 AND line_no >= $2 ORDER BY line_no LIMIT $3";
        on_pool!(self, read, |pool| {
            sqlx::query(SQL)
                .bind(file_id)
                .bind(from)
                .bind(limit)
                .fetch_all(pool)
                .await
                .and_then(|rows| {
                    rows.iter()
                        .map(|r| Ok((r.try_get(0)?, r.try_get(1)?)))
                        .collect::<Result<Vec<_>, sqlx::Error>>()
                })
                .map_err(db("reading a file's lines"))
        })
    }

    /// Record a new batch.
    pub async fn create_batch(&self, b: &BatchRow) -> Result<(), StoreError> {
        let sql = format!(
            "INSERT INTO batches ({BATCH_COLUMNS}) VALUES \
             ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14)"
        );
        on_pool!(self, write, |pool| {
            sqlx::query(AssertSqlSafe(sql))
                .bind(&b.batch_id)
                .bind(&b.tenant)
                .bind(&b.input_file_id)
                .bind(&b.endpoint)
                .bind(&b.completion_window)
                .bind(&b.metadata)
                .bind(&b.allowed_kinds)
                .bind(&b.job_prefix)
                .bind(b.created_at_ms)
                .bind(b.expires_at_ms)
                .bind(b.total)
                .bind(b.cursor)
                .bind(b.cancelled_at_ms)
                .bind(b.cancel_cursor)
                .execute(pool)
                .await
                .map(|_| ())
                .map_err(db("creating a batch"))
        })
    }

    pub async fn get_batch(&self, batch_id: &str) -> Result<Option<BatchRow>, StoreError> {
        let sql = format!("SELECT {BATCH_COLUMNS} FROM batches WHERE batch_id = $1");
        on_pool!(self, read, |pool| {
            sqlx::query(AssertSqlSafe(sql))
                .bind(batch_id)
                .fetch_optional(pool)
                .await
                .and_then(|r| r.as_ref().map(batch_from_row).transpose())
                .map_err(db("reading a batch"))
        })
    }

    /// Batches newest first (`tenant`: only its own), after the batch `after` when given
    /// (the page that follows it), at most `limit`.
    pub async fn list_batches(
        &self,
        tenant: Option<&str>,
        after: Option<&BatchRow>,
        limit: i64,
    ) -> Result<Vec<BatchRow>, StoreError> {
        let mut sql = format!("SELECT {BATCH_COLUMNS} FROM batches WHERE TRUE");
        if tenant.is_some() {
            sql.push_str(" AND tenant = $1");
        } else {
            sql.push_str(" AND $1 IS NULL");
        }
        if after.is_some() {
            sql.push_str(" AND (created_at_ms < $2 OR (created_at_ms = $2 AND batch_id < $3))");
        } else {
            sql.push_str(" AND $2 IS NULL AND $3 IS NULL");
        }
        sql.push_str(" ORDER BY created_at_ms DESC, batch_id DESC LIMIT $4");
        on_pool!(self, read, |pool| {
            sqlx::query(AssertSqlSafe(sql))
                .bind(tenant)
                .bind(after.map(|b| b.created_at_ms))
                .bind(after.map(|b| b.batch_id.as_str()))
                .bind(limit)
                .fetch_all(pool)
                .await
                .and_then(|rows| rows.iter().map(batch_from_row).collect())
                .map_err(db("listing batches"))
        })
    }

    /// Batches with work for the publisher at `now_ms`: lines to publish before the window
    /// ends, or published lines still to cancel.
    pub async fn batches_to_pump(&self, now_ms: i64) -> Result<Vec<BatchRow>, StoreError> {
        let sql = format!(
            "SELECT {BATCH_COLUMNS} FROM batches WHERE \
             (cancelled_at_ms IS NULL AND cursor < total AND expires_at_ms > $1) \
             OR (cancelled_at_ms IS NOT NULL AND cancel_cursor < cursor) \
             ORDER BY created_at_ms, batch_id LIMIT 100"
        );
        on_pool!(self, read, |pool| {
            sqlx::query(AssertSqlSafe(sql))
                .bind(now_ms)
                .fetch_all(pool)
                .await
                .and_then(|rows| rows.iter().map(batch_from_row).collect())
                .map_err(db("reading the batches to publish"))
        })
    }

    /// Move a batch's cursor from `from` to `to` unless it was cancelled meanwhile or
    /// another writer moved it. `Ok(true)` if it moved.
    pub async fn advance_batch_cursor(
        &self,
        batch_id: &str,
        from: i64,
        to: i64,
    ) -> Result<bool, StoreError> {
        const SQL: &str = "UPDATE batches SET cursor = $3 \
             WHERE batch_id = $1 AND cursor = $2 AND cancelled_at_ms IS NULL";
        on_pool!(self, write, |pool| {
            sqlx::query(SQL)
                .bind(batch_id)
                .bind(from)
                .bind(to)
                .execute(pool)
                .await
                .map(|d| d.rows_affected() > 0)
                .map_err(db("advancing a batch"))
        })
    }

    /// Record that the published lines before `to` were asked to cancel.
    pub async fn advance_cancel_cursor(&self, batch_id: &str, to: i64) -> Result<(), StoreError> {
        const SQL: &str = "UPDATE batches SET cancel_cursor = $2 \
             WHERE batch_id = $1 AND cancel_cursor < $2";
        on_pool!(self, write, |pool| {
            sqlx::query(SQL)
                .bind(batch_id)
                .bind(to)
                .execute(pool)
                .await
                .map(|_| ())
                .map_err(db("advancing a batch's cancellation"))
        })
    }

    /// Ask for a batch's cancellation (the first time counts). `Ok(true)` if this call
    /// asked for it.
    pub async fn cancel_batch(&self, batch_id: &str, now_ms: i64) -> Result<bool, StoreError> {
        const SQL: &str = "UPDATE batches SET cancelled_at_ms = $2 \
             WHERE batch_id = $1 AND cancelled_at_ms IS NULL";
        on_pool!(self, write, |pool| {
            sqlx::query(SQL)
                .bind(batch_id)
                .bind(now_ms)
                .execute(pool)
                .await
                .map(|d| d.rows_affected() > 0)
                .map_err(db("cancelling a batch"))
        })
    }

    /// Record a malformed line (again: nothing changes).
    pub async fn record_line_error(&self, batch_id: &str, e: &LineError) -> Result<(), StoreError> {
        const SQL: &str = "INSERT INTO batch_line_errors (batch_id, line_no, custom_id, code, \
             message) VALUES ($1, $2, $3, $4, $5) ON CONFLICT (batch_id, line_no) DO NOTHING";
        on_pool!(self, write, |pool| {
            sqlx::query(SQL)
                .bind(batch_id)
                .bind(e.line_no)
                .bind(&e.custom_id)
                .bind(&e.code)
                .bind(&e.message)
                .execute(pool)
                .await
                .map(|_| ())
                .map_err(db("recording a malformed batch line"))
        })
    }

    /// The malformed lines of a batch from line `from` to `to` (inclusive), in order.
    pub async fn line_errors(
        &self,
        batch_id: &str,
        from: i64,
        to: i64,
    ) -> Result<Vec<LineError>, StoreError> {
        const SQL: &str = "SELECT line_no, custom_id, code, message FROM batch_line_errors \
             WHERE batch_id = $1 AND line_no >= $2 AND line_no <= $3 ORDER BY line_no";
        on_pool!(self, read, |pool| {
            sqlx::query(SQL)
                .bind(batch_id)
                .bind(from)
                .bind(to)
                .fetch_all(pool)
                .await
                .and_then(|rows| {
                    rows.iter()
                        .map(|r| {
                            Ok(LineError {
                                line_no: r.try_get(0)?,
                                custom_id: r.try_get(1)?,
                                code: r.try_get(2)?,
                                message: r.try_get(3)?,
                            })
                        })
                        .collect::<Result<Vec<_>, sqlx::Error>>()
                })
                .map_err(db("reading a batch's malformed lines"))
        })
    }

    /// The records of the jobs among `job_ids` that the ledger holds (one read).
    pub async fn jobs_many(&self, job_ids: &[String]) -> Result<Vec<JobRecord>, StoreError> {
        if job_ids.is_empty() {
            return Ok(Vec::new());
        }
        let sql = format!(
            concat!("SELECT ", job_columns!(), " FROM jobs WHERE {}"),
            self.dialect().in_ids("job_id")
        );
        let ids = json_array(job_ids);
        on_pool!(self, read, |pool| {
            sqlx::query(AssertSqlSafe(sql))
                .bind(ids)
                .fetch_all(pool)
                .await
                .and_then(|rows| rows.iter().map(job_from_row).collect())
                .map_err(db("reading a batch's jobs"))
        })
    }
}
