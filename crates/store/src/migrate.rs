//! Embedded, versioned migrations with a `schema_migrations` table.
//!
//! Each migration has one SQL file per backend (`migrations/{sqlite,postgres}/NNNN_*.sql`),
//! embedded with `include_str!`. Applying is idempotent: versions already listed in
//! `schema_migrations` are skipped. The whole run is one transaction that first takes the
//! database's writer lock (SQLite `BEGIN IMMEDIATE`, PostgreSQL advisory lock), so two
//! processes starting at once do not race.
//!
//! On PostgreSQL, the indexes that a migration adds to a table that already exists (and may
//! hold millions of rows) are not built inside that transaction: a plain `CREATE INDEX`
//! blocks every writer of the table for as long as the build takes. They are listed in
//! [`ONLINE_INDEXES`] and built after the commit with `CREATE INDEX CONCURRENTLY`, one
//! process at a time (a session advisory lock), and an invalid index that an interrupted
//! build left behind is dropped and built again. Until it exists the ledger works, only
//! slower on the queries it serves.

use sqlx::{AssertSqlSafe, PgPool, Row, SqlitePool};

use crate::StoreError;
use crate::error::db;

/// One schema version.
pub(crate) struct Migration {
    pub version: i64,
    pub name: &'static str,
    pub sqlite: &'static str,
    pub postgres: &'static str,
}

/// All migrations, in version order.
pub(crate) const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        name: "init",
        sqlite: include_str!("../migrations/sqlite/0001_init.sql"),
        postgres: include_str!("../migrations/postgres/0001_init.sql"),
    },
    Migration {
        version: 2,
        name: "counters_on_read",
        sqlite: include_str!("../migrations/sqlite/0002_counters_on_read.sql"),
        postgres: include_str!("../migrations/postgres/0002_counters_on_read.sql"),
    },
    Migration {
        version: 3,
        name: "reconciled_at",
        sqlite: include_str!("../migrations/sqlite/0003_reconciled_at.sql"),
        postgres: include_str!("../migrations/postgres/0003_reconciled_at.sql"),
    },
    Migration {
        version: 4,
        name: "worker_leases",
        sqlite: include_str!("../migrations/sqlite/0004_worker_leases.sql"),
        postgres: include_str!("../migrations/postgres/0004_worker_leases.sql"),
    },
    Migration {
        version: 5,
        name: "backend_model",
        sqlite: include_str!("../migrations/sqlite/0005_backend_model.sql"),
        postgres: include_str!("../migrations/postgres/0005_backend_model.sql"),
    },
    Migration {
        version: 6,
        name: "webhooks",
        sqlite: include_str!("../migrations/sqlite/0006_webhooks.sql"),
        postgres: include_str!("../migrations/postgres/0006_webhooks.sql"),
    },
    Migration {
        version: 7,
        name: "retention",
        sqlite: include_str!("../migrations/sqlite/0007_retention.sql"),
        postgres: include_str!("../migrations/postgres/0007_retention.sql"),
    },
    Migration {
        version: 8,
        name: "tenants",
        sqlite: include_str!("../migrations/sqlite/0008_tenants.sql"),
        postgres: include_str!("../migrations/postgres/0008_tenants.sql"),
    },
    Migration {
        version: 9,
        name: "breakers",
        sqlite: include_str!("../migrations/sqlite/0009_breakers.sql"),
        postgres: include_str!("../migrations/postgres/0009_breakers.sql"),
    },
    Migration {
        version: 10,
        name: "webhook_given_up",
        sqlite: include_str!("../migrations/sqlite/0010_webhook_given_up.sql"),
        postgres: include_str!("../migrations/postgres/0010_webhook_given_up.sql"),
    },
    Migration {
        version: 11,
        name: "webhook_claimed_at",
        sqlite: include_str!("../migrations/sqlite/0011_webhook_claimed_at.sql"),
        postgres: include_str!("../migrations/postgres/0011_webhook_claimed_at.sql"),
    },
    Migration {
        version: 12,
        name: "request_size",
        sqlite: include_str!("../migrations/sqlite/0012_request_size.sql"),
        postgres: include_str!("../migrations/postgres/0012_request_size.sql"),
    },
    Migration {
        version: 13,
        name: "worker_live",
        sqlite: include_str!("../migrations/sqlite/0013_worker_live.sql"),
        postgres: include_str!("../migrations/postgres/0013_worker_live.sql"),
    },
    Migration {
        version: 14,
        name: "batches",
        sqlite: include_str!("../migrations/sqlite/0014_batches.sql"),
        postgres: include_str!("../migrations/postgres/0014_batches.sql"),
    },
    Migration {
        version: 15,
        name: "min_feasible_budget",
        sqlite: include_str!("../migrations/sqlite/0015_min_feasible_budget.sql"),
        postgres: include_str!("../migrations/postgres/0015_min_feasible_budget.sql"),
    },
];

/// An index that a migration adds, on PostgreSQL, to a table that already existed: built
/// with `CREATE INDEX CONCURRENTLY` after the migration's transaction (see the module doc).
pub(crate) struct OnlineIndex {
    /// The migration that adds it (its SQL file names it in a comment).
    pub version: i64,
    pub name: &'static str,
    /// What follows the index's name in `CREATE INDEX … name`.
    pub definition: &'static str,
}

pub(crate) const ONLINE_INDEXES: &[OnlineIndex] = &[
    OnlineIndex {
        version: 3,
        name: "jobs_reconciled",
        definition: "ON jobs (state, reconciled_at_ms) WHERE reconciled_at_ms IS NOT NULL",
    },
    OnlineIndex {
        version: 7,
        name: "jobs_text_recorded",
        definition: "ON jobs (recorded_at_ms) WHERE result IS NOT NULL",
    },
    OnlineIndex {
        version: 8,
        name: "jobs_tenant_recorded",
        definition: "ON jobs (tenant, recorded_at_ms)",
    },
    OnlineIndex {
        version: 11,
        name: "webhooks_open",
        definition: "ON webhooks (registered_at_ms) \
                     WHERE delivered_at_ms IS NULL AND given_up_at_ms IS NULL",
    },
];

/// Held (as a session lock, `pg_try_advisory_lock`) while building [`ONLINE_INDEXES`].
const PG_INDEX_LOCK_KEY: i64 = PG_LOCK_KEY + 1;

const CREATE_TABLE: &str = "CREATE TABLE IF NOT EXISTS schema_migrations (\
     version BIGINT NOT NULL PRIMARY KEY, \
     name TEXT NOT NULL, \
     applied_at_ms BIGINT NOT NULL)";

/// Arbitrary but fixed key of the PostgreSQL advisory lock held while migrating.
const PG_LOCK_KEY: i64 = 0x6c61_7374_6361_6c6c; // "lastcall"

/// `applied_at_ms` is the database's own clock (an audit note, never compared with the
/// ledger's times), so the store reads no clock: lastcall's clock reads all go through
/// `lastcall_clock`.
const SQLITE_NOW_MS: &str = "CAST(ROUND((julianday('now') - 2440587.5) * 86400000) AS INTEGER)";
const POSTGRES_NOW_MS: &str = "(extract(epoch FROM clock_timestamp()) * 1000)::bigint";

/// Refuses a database that a newer binary already migrated further than we know.
fn check_not_newer(applied: &[i64]) -> Result<(), StoreError> {
    let known = MIGRATIONS.last().map_or(0, |m| m.version);
    match applied.iter().max() {
        Some(&max) if max > known => Err(StoreError::Fatal(format!(
            "database schema version {max} is newer than this binary knows ({known}); upgrade lastcall"
        ))),
        _ => Ok(()),
    }
}

/// Applies the pending migrations; returns the versions applied now.
macro_rules! run_migrations {
    ($tx:ident, $sql:ident, $now_ms:expr) => {{
        sqlx::query(CREATE_TABLE)
            .execute(&mut *$tx)
            .await
            .map_err(db("creating schema_migrations"))?;
        let applied: Vec<i64> = sqlx::query("SELECT version FROM schema_migrations")
            .fetch_all(&mut *$tx)
            .await
            .map_err(db("reading schema_migrations"))?
            .iter()
            .map(|row| row.try_get::<i64, _>(0))
            .collect::<Result<_, _>>()
            .map_err(db("reading schema_migrations"))?;
        check_not_newer(&applied)?;
        let mut now = Vec::new();
        for m in MIGRATIONS.iter().filter(|m| !applied.contains(&m.version)) {
            sqlx::raw_sql(m.$sql)
                .execute(&mut *$tx)
                .await
                .map_err(|e| {
                    crate::error::classify(&format!("migration {} ({})", m.version, m.name), e)
                })?;
            sqlx::query(AssertSqlSafe(format!(
                "INSERT INTO schema_migrations (version, name, applied_at_ms) VALUES ($1, $2, {})",
                $now_ms
            )))
            .bind(m.version)
            .bind(m.name)
            .execute(&mut *$tx)
            .await
            .map_err(db("recording a migration"))?;
            now.push(m.version);
        }
        $tx.commit().await.map_err(db("committing migrations"))?;
        Ok(now)
    }};
}

pub(crate) async fn migrate_sqlite(pool: &SqlitePool) -> Result<Vec<i64>, StoreError> {
    let mut tx = pool
        .begin_with("BEGIN IMMEDIATE")
        .await
        .map_err(db("starting the migration transaction"))?;
    run_migrations!(tx, sqlite, SQLITE_NOW_MS)
}

pub(crate) async fn migrate_postgres(pool: &PgPool) -> Result<Vec<i64>, StoreError> {
    let mut tx = pool
        .begin()
        .await
        .map_err(db("starting the migration transaction"))?;
    sqlx::query("SELECT pg_advisory_xact_lock($1)")
        .bind(PG_LOCK_KEY)
        .execute(&mut *tx)
        .await
        .map_err(db("taking the migration lock"))?;
    let applied: Result<Vec<i64>, StoreError> = run_migrations!(tx, postgres, POSTGRES_NOW_MS);
    let applied = applied?;
    build_online_indexes(pool).await?;
    Ok(applied)
}

/// Whether each of [`ONLINE_INDEXES`] exists and is valid (`None`: missing).
async fn online_index_states(
    conn: &mut sqlx::PgConnection,
) -> Result<Vec<Option<bool>>, StoreError> {
    let mut states = Vec::with_capacity(ONLINE_INDEXES.len());
    for ix in ONLINE_INDEXES {
        let valid: Option<bool> = sqlx::query_scalar(
            "SELECT indisvalid FROM pg_index WHERE indexrelid = to_regclass($1)",
        )
        .bind(ix.name)
        .fetch_optional(&mut *conn)
        .await
        .map_err(db("reading the ledger's indexes"))?;
        states.push(valid);
    }
    Ok(states)
}

/// Builds the missing or invalid [`ONLINE_INDEXES`] without blocking the ledger's writers.
/// Cheap when every one is there (one catalog read per index). Another process building
/// them is waited for by polling a session lock, never by waiting inside a statement (a
/// concurrent build waits for every older snapshot, so a session waiting for the lock in a
/// statement would deadlock with it).
async fn build_online_indexes(pool: &PgPool) -> Result<(), StoreError> {
    let mut conn = pool
        .acquire()
        .await
        .map_err(db("connecting to build the ledger's indexes"))?;
    if online_index_states(&mut conn)
        .await?
        .iter()
        .all(|v| *v == Some(true))
    {
        return Ok(());
    }
    let mut waiting_logged = false;
    loop {
        let locked: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
            .bind(PG_INDEX_LOCK_KEY)
            .fetch_one(&mut *conn)
            .await
            .map_err(db("taking the index-build lock"))?;
        if locked {
            break;
        }
        if !std::mem::replace(&mut waiting_logged, true) {
            tracing::info!("another process is building the ledger's indexes; waiting for it");
        }
        tokio::time::sleep(std::time::Duration::from_millis(250)).await;
    }
    let built = async {
        let states = online_index_states(&mut conn).await?;
        for (ix, valid) in ONLINE_INDEXES.iter().zip(states) {
            if valid == Some(true) {
                continue;
            }
            let started = std::time::Instant::now();
            tracing::info!(
                index = ix.name,
                migration = ix.version,
                "building a ledger index concurrently (writers are not blocked meanwhile)"
            );
            if valid == Some(false) {
                // Left invalid by a build that was interrupted: it slows writes and
                // serves no query. `IF NOT EXISTS` would keep it.
                sqlx::raw_sql(AssertSqlSafe(format!(
                    "DROP INDEX CONCURRENTLY IF EXISTS {}",
                    ix.name
                )))
                .execute(&mut *conn)
                .await
                .map_err(|e| {
                    crate::error::classify(&format!("dropping the invalid index {}", ix.name), e)
                })?;
            }
            sqlx::raw_sql(AssertSqlSafe(format!(
                "CREATE INDEX CONCURRENTLY IF NOT EXISTS {} {}",
                ix.name, ix.definition
            )))
            .execute(&mut *conn)
            .await
            .map_err(|e| crate::error::classify(&format!("building the index {}", ix.name), e))?;
            tracing::info!(
                index = ix.name,
                elapsed_ms = started.elapsed().as_millis() as u64,
                "ledger index built"
            );
        }
        Ok::<_, StoreError>(())
    }
    .await;
    // A lost connection releases the lock by itself.
    let _ = sqlx::query("SELECT pg_advisory_unlock($1)")
        .bind(PG_INDEX_LOCK_KEY)
        .execute(&mut *conn)
        .await;
    built
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_are_increasing() {
        assert!(MIGRATIONS.windows(2).all(|w| w[0].version < w[1].version));
    }

    /// A `CREATE INDEX` in a PostgreSQL migration's transaction blocks the table's writers
    /// for the whole build: only a table that the same migration creates (empty) may get
    /// one there; an index on an existing table belongs in `ONLINE_INDEXES`.
    #[test]
    fn postgres_migrations_index_only_the_tables_they_create() {
        for m in MIGRATIONS {
            let sql: String = m
                .postgres
                .lines()
                .filter(|l| !l.trim_start().starts_with("--"))
                .collect::<Vec<_>>()
                .join(" ")
                .to_ascii_uppercase();
            for (i, _) in sql.match_indices("CREATE INDEX") {
                let rest = &sql[i..];
                let on = rest.find(" ON ").expect("CREATE INDEX … ON") + 4;
                let table = rest[on..]
                    .split(|c: char| c.is_whitespace() || c == '(')
                    .find(|w| !w.is_empty())
                    .unwrap();
                assert!(
                    sql.contains(&format!("CREATE TABLE {table} "))
                        || sql.contains(&format!("CREATE TABLE {table}("))
                        || sql.contains(&format!("CREATE TABLE IF NOT EXISTS {table} ")),
                    "migration {} builds an index on {table}, which it does not create: \
                     list it in ONLINE_INDEXES",
                    m.version
                );
            }
        }
        for ix in ONLINE_INDEXES {
            let m = MIGRATIONS.iter().find(|m| m.version == ix.version).unwrap();
            assert!(
                m.postgres.contains(&format!("-- {} ON", ix.name)),
                "migration {} names {} in a comment",
                m.version,
                ix.name
            );
        }
    }

    #[test]
    fn newer_schema_is_fatal() {
        assert!(check_not_newer(&[1]).is_ok());
        assert!(check_not_newer(&[]).is_ok());
        let err = check_not_newer(&[1, 99]).unwrap_err();
        assert!(err.to_string().contains("newer"), "{err}");
    }
}
