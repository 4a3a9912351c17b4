//! Copying a whole ledger to another database (`lastcall ledger copy`, SQLite →
//! PostgreSQL) and checking the copy.
//!
//! Every table of the schema (`migrations/`) but `schema_migrations` (which the
//! destination's own migrations write on connect) is read in primary-key order in batches
//! (keyset pagination: `WHERE key > last ORDER BY key LIMIT n`, through the key's index)
//! and written with `INSERT … ON CONFLICT DO NOTHING`, its rows as one JSON parameter
//! (`batch.rs`). Running it again inserts nothing new: an interrupted copy is resumed by
//! running it again. [`Ledger::table_digest`] gives a table's row count and a checksum
//! that does not depend on the backend's row order or collation, computed here in Rust
//! from each row's canonical text, so the two sides can be compared.

use futures_util::TryStreamExt;
use serde::Serialize;
use sqlx::{AssertSqlSafe, ColumnIndex, Decode, Row, Type};

use super::{Backend, Ledger};
use crate::StoreError;
use crate::batch::{Dialect, JsonRows, insert_from_json};
use crate::error::db;

/// A column's type, as both backends store it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ty {
    Text,
    Int,
    Bool,
}

/// One table of the ledger: its name, primary key (one or two leading columns) and
/// columns in a fixed order.
struct Table {
    name: &'static str,
    /// How many of the first `columns` form the primary key.
    key: usize,
    columns: &'static [(&'static str, Ty)],
}

use Ty::{Bool, Int, Text};

const TABLES: [Table; 10] = [
    Table {
        name: "jobs",
        key: 1,
        columns: &[
            ("job_id", Text),
            ("kind", Text),
            ("state", Text),
            ("reason", Text),
            ("created_at_ms", Int),
            ("expires_at_ms", Int),
            ("accepted_at_ms", Int),
            ("received_at_ms", Int),
            ("checked_at_ms", Int),
            ("started_at_ms", Int),
            ("finished_at_ms", Int),
            ("recorded_at_ms", Int),
            ("reconciled_at_ms", Int),
            ("worker", Text),
            ("result", Text),
            ("error", Text),
            ("trace_id", Text),
            ("payload_hash", Text),
            ("prompt_tokens", Int),
            ("completion_tokens", Int),
            ("latency_ms", Int),
            ("cancel_requested", Bool),
            ("cancel_confirmed", Bool),
            ("backend", Text),
            ("model", Text),
            ("min_runtime_ms", Int),
            ("tenant", Text),
            ("priority", Text),
            ("request_tokens", Int),
            ("request_max_tokens", Int),
            ("min_feasible_budget_ms", Int),
        ],
    },
    Table {
        name: "attempts",
        key: 1,
        columns: &[
            ("attempt_key", Text),
            ("job_id", Text),
            ("attempt", Int),
            ("worker", Text),
            ("redelivered", Bool),
            ("received_at_ms", Int),
            ("checked_at_ms", Int),
            ("started_at_ms", Int),
            ("finished_at_ms", Int),
            ("acked_at_ms", Int),
            ("decision", Text),
            ("state", Text),
            ("reason", Text),
            ("model_called", Bool),
        ],
    },
    Table {
        name: "webhooks",
        key: 1,
        columns: &[
            ("job_id", Text),
            ("url", Text),
            ("registered_at_ms", Int),
            ("claimed_by", Text),
            ("delivered_at_ms", Int),
            ("given_up_at_ms", Int),
            ("claimed_at_ms", Int),
        ],
    },
    Table {
        name: "webhook_attempts",
        key: 2,
        columns: &[
            ("job_id", Text),
            ("attempt", Int),
            ("at_ms", Int),
            ("status", Int),
            ("error", Text),
        ],
    },
    Table {
        name: "workers",
        key: 1,
        columns: &[("name", Text), ("heartbeat_ms", Int), ("live", Text)],
    },
    // The workers' open breakers (migration 9): live state like the leases, copied so
    // that the copy holds every table; a row counts only while its trial time is ahead
    // and its worker's lease fresh.
    Table {
        name: "breakers",
        key: 2,
        columns: &[
            ("worker", Text),
            ("kind", Text),
            ("backend", Text),
            ("open_until_ms", Int),
            ("recorded_at_ms", Int),
        ],
    },
    // Files and batches (migration 14).
    Table {
        name: "files",
        key: 1,
        columns: &[
            ("file_id", Text),
            ("tenant", Text),
            ("purpose", Text),
            ("filename", Text),
            ("bytes", Int),
            ("line_count", Int),
            ("created_at_ms", Int),
            ("complete", Bool),
        ],
    },
    Table {
        name: "file_lines",
        key: 2,
        columns: &[("file_id", Text), ("line_no", Int), ("content", Text)],
    },
    Table {
        name: "batches",
        key: 1,
        columns: &[
            ("batch_id", Text),
            ("tenant", Text),
            ("input_file_id", Text),
            ("endpoint", Text),
            ("completion_window", Text),
            ("metadata", Text),
            ("allowed_kinds", Text),
            ("job_prefix", Text),
            ("created_at_ms", Int),
            ("expires_at_ms", Int),
            ("total", Int),
            ("cursor", Int),
            ("cancelled_at_ms", Int),
            ("cancel_cursor", Int),
        ],
    },
    Table {
        name: "batch_line_errors",
        key: 2,
        columns: &[
            ("batch_id", Text),
            ("line_no", Int),
            ("custom_id", Text),
            ("code", Text),
            ("message", Text),
        ],
    },
];

/// The tables [`Ledger::copy_table_to`] copies, in the order it copies them.
pub const COPY_TABLES: [&str; 10] = [
    TABLES[0].name,
    TABLES[1].name,
    TABLES[2].name,
    TABLES[3].name,
    TABLES[4].name,
    TABLES[5].name,
    TABLES[6].name,
    TABLES[7].name,
    TABLES[8].name,
    TABLES[9].name,
];

/// The columns of a copied table (to compare with the schema in tests).
pub fn copy_columns(table: &str) -> Option<Vec<&'static str>> {
    table_spec(table)
        .ok()
        .map(|t| t.columns.iter().map(|(c, _)| *c).collect())
}

fn table_spec(name: &str) -> Result<&'static Table, StoreError> {
    TABLES.iter().find(|t| t.name == name).ok_or_else(|| {
        StoreError::Fatal(format!(
            "no ledger table `{name}`; the tables are {}",
            COPY_TABLES.join(", ")
        ))
    })
}

/// One value of a row.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(untagged)]
enum Val {
    Null,
    Text(String),
    Int(i64),
    Bool(bool),
}

fn read_row<R>(table: &Table, row: &R) -> Result<Vec<Val>, sqlx::Error>
where
    R: Row,
    usize: ColumnIndex<R>,
    for<'r> String: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> i64: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> bool: Decode<'r, R::Database> + Type<R::Database>,
{
    table
        .columns
        .iter()
        .enumerate()
        .map(|(i, (_, ty))| {
            Ok(match ty {
                Text => row.try_get::<Option<String>, _>(i)?.map(Val::Text),
                Int => row.try_get::<Option<i64>, _>(i)?.map(Val::Int),
                Bool => row.try_get::<Option<bool>, _>(i)?.map(Val::Bool),
            }
            .unwrap_or(Val::Null))
        })
        .collect()
}

/// What copying one table did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct CopyCounts {
    /// Rows read from the source.
    pub read: u64,
    /// Rows the destination did not have yet (the rest were skipped: already copied).
    pub inserted: u64,
}

/// A table's row count and checksum ([`Ledger::table_digest`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TableDigest {
    pub rows: u64,
    /// 32 hex digits: the wrapping sum and the XOR of the 64-bit FNV-1a hashes of every
    /// row's canonical text (a JSON array of its values in column order), so the order in
    /// which a backend returns its rows does not matter.
    pub checksum: String,
}

fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// The statements of one table's copy, per dialect of the side that runs them.
fn select_first(t: &Table) -> String {
    format!(
        "SELECT {} FROM {} ORDER BY {} LIMIT $1",
        cols(t),
        t.name,
        key_cols(t)
    )
}

fn select_after(t: &Table) -> String {
    let first = t.columns[0].0;
    let cond = if t.key == 1 {
        format!("{first} > $1")
    } else {
        let second = t.columns[1].0;
        format!("({first} > $1 OR ({first} = $1 AND {second} > $2))")
    };
    let limit = if t.key == 1 { "$2" } else { "$3" };
    format!(
        "SELECT {} FROM {} WHERE {cond} ORDER BY {} LIMIT {limit}",
        cols(t),
        t.name,
        key_cols(t)
    )
}

fn cols(t: &Table) -> String {
    t.columns
        .iter()
        .map(|(c, _)| *c)
        .collect::<Vec<_>>()
        .join(", ")
}

fn key_cols(t: &Table) -> String {
    t.columns[..t.key]
        .iter()
        .map(|(c, _)| *c)
        .collect::<Vec<_>>()
        .join(", ")
}

fn insert(t: &Table, d: Dialect) -> String {
    let placeholders: Vec<String> = (1..=t.columns.len()).map(|i| format!("${i}")).collect();
    let one_row = format!(
        "INSERT INTO {} ({}) VALUES ({}) ON CONFLICT DO NOTHING",
        t.name,
        cols(t),
        placeholders.join(", ")
    );
    insert_from_json(&one_row, d)
}

impl Ledger {
    /// Reads one batch of `table` after the key `after` (`None`: from the start).
    async fn read_batch(
        &self,
        t: &'static Table,
        after: Option<&[Val]>,
        limit: u32,
    ) -> Result<Vec<Vec<Val>>, StoreError> {
        let sql = match after {
            None => select_first(t),
            Some(_) => select_after(t),
        };
        let limit = i64::from(limit);
        on_pool!(self, read, |pool| {
            let mut q = sqlx::query(AssertSqlSafe(sql.as_str()));
            for v in after.unwrap_or_default() {
                q = match v {
                    Val::Text(s) => q.bind(s.clone()),
                    Val::Int(i) => q.bind(*i),
                    Val::Bool(b) => q.bind(*b),
                    Val::Null => q.bind(None::<String>),
                };
            }
            q.bind(limit)
                .fetch_all(pool)
                .await
                .and_then(|rows| rows.iter().map(|r| read_row(t, r)).collect())
                .map_err(db("reading rows to copy"))
        })
    }

    /// Copies every row of `table` that `to` does not have yet, in batches of `batch` rows
    /// in primary-key order; `progress` gets the rows read so far after each batch.
    pub async fn copy_table_to(
        &self,
        to: &Ledger,
        table: &str,
        batch: u32,
        progress: &mut (dyn FnMut(u64) + Send),
    ) -> Result<CopyCounts, StoreError> {
        let t = table_spec(table)?;
        let insert = insert(t, to.dialect());
        let mut counts = CopyCounts::default();
        let mut last: Option<Vec<Val>> = None;
        loop {
            let rows = self.read_batch(t, last.as_deref(), batch.max(1)).await?;
            let Some(tail) = rows.last() else { break };
            last = Some(tail[..t.key].to_vec());
            let mut json = JsonRows::default();
            for row in &rows {
                json.row(|r| {
                    for v in row {
                        r.v(v);
                    }
                });
            }
            let json = json.finish();
            let inserted = on_pool!(to, write, |pool| {
                sqlx::query(AssertSqlSafe(insert.as_str()))
                    .bind(json)
                    .execute(pool)
                    .await
                    .map_err(db("writing copied rows"))?
                    .rows_affected()
            });
            counts.read += rows.len() as u64;
            counts.inserted += inserted;
            progress(counts.read);
            if rows.len() < batch.max(1) as usize {
                break;
            }
        }
        Ok(counts)
    }

    /// How many rows `table` holds (exact).
    pub async fn table_rows(&self, table: &str) -> Result<u64, StoreError> {
        let t = table_spec(table)?;
        let sql = format!("SELECT COUNT(*) FROM {}", t.name);
        let n: i64 = on_pool!(self, read, |pool| {
            sqlx::query(AssertSqlSafe(sql.as_str()))
                .fetch_one(pool)
                .await
                .and_then(|r| r.try_get(0))
                .map_err(db("counting rows"))?
        });
        Ok(u64::try_from(n).unwrap_or(0))
    }

    /// `table`'s row count and checksum ([`TableDigest`]), read as one stream.
    pub async fn table_digest(&self, table: &str) -> Result<TableDigest, StoreError> {
        let t = table_spec(table)?;
        let sql = format!("SELECT {} FROM {}", cols(t), t.name);
        let (mut rows, mut sum, mut xor) = (0u64, 0u64, 0u64);
        let mut fold = |vals: Vec<Val>| -> Result<(), sqlx::Error> {
            let text = serde_json::to_vec(&vals).map_err(|e| sqlx::Error::Decode(Box::new(e)))?;
            let h = fnv1a(&text);
            rows += 1;
            sum = sum.wrapping_add(h);
            xor ^= h;
            Ok(())
        };
        match &self.backend {
            Backend::Sqlite { reader, .. } => {
                let mut s = sqlx::query(AssertSqlSafe(sql.as_str())).fetch(reader);
                while let Some(r) = s.try_next().await.map_err(db("checksumming a table"))? {
                    fold(read_row(t, &r).map_err(db("checksumming a table"))?)
                        .map_err(db("checksumming a table"))?;
                }
            }
            Backend::Postgres(pool) => {
                let mut s = sqlx::query(AssertSqlSafe(sql.as_str())).fetch(pool);
                while let Some(r) = s.try_next().await.map_err(db("checksumming a table"))? {
                    fold(read_row(t, &r).map_err(db("checksumming a table"))?)
                        .map_err(db("checksumming a table"))?;
                }
            }
        }
        Ok(TableDigest {
            rows,
            checksum: format!("{sum:016x}{xor:016x}"),
        })
    }

    /// The schema versions applied to this database, ascending.
    pub async fn schema_versions(&self) -> Result<Vec<i64>, StoreError> {
        on_pool!(self, read, |pool| {
            sqlx::query("SELECT version FROM schema_migrations ORDER BY version")
                .fetch_all(pool)
                .await
                .and_then(|rows| rows.iter().map(|r| r.try_get(0)).collect())
                .map_err(db("reading schema_migrations"))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statements_follow_the_keys() {
        let wa = table_spec("webhook_attempts").unwrap();
        assert_eq!(
            select_after(wa),
            "SELECT job_id, attempt, at_ms, status, error FROM webhook_attempts \
             WHERE (job_id > $1 OR (job_id = $1 AND attempt > $2)) \
             ORDER BY job_id, attempt LIMIT $3"
        );
        let pg = insert(wa, Dialect::Postgres);
        assert!(pg.contains("(value ->> 3)::bigint"), "{pg}");
        assert!(pg.ends_with("ON CONFLICT DO NOTHING"), "{pg}");
        let jobs = insert(table_spec("jobs").unwrap(), Dialect::Postgres);
        assert!(jobs.contains("(value ->> 21)::boolean"), "{jobs}");
        assert!(table_spec("nope").is_err());
    }

    #[test]
    fn the_checksum_text_is_the_same_on_both_sides() {
        let row = vec![
            Val::Text("a".into()),
            Val::Null,
            Val::Int(5),
            Val::Bool(true),
        ];
        assert_eq!(serde_json::to_string(&row).unwrap(), r#"["a",null,5,true]"#);
    }
}
