//! Embedded, versioned migrations with a `schema_migrations` table.
//!
//! Each migration has one SQL file per backend (`migrations/{sqlite,postgres}/NNNN_*.sql`),
//! embedded with `include_str!`. Applying is idempotent: versions already listed in
//! `schema_migrations` are skipped. The whole run is one transaction that first takes the
//! database's writer lock (SQLite `BEGIN IMMEDIATE`, PostgreSQL advisory lock), so two
//! processes starting at once do not race.

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
];

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
    run_migrations!(tx, postgres, POSTGRES_NOW_MS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_are_increasing() {
        assert!(MIGRATIONS.windows(2).all(|w| w[0].version < w[1].version));
    }

    #[test]
    fn newer_schema_is_fatal() {
        assert!(check_not_newer(&[1]).is_ok());
        assert!(check_not_newer(&[]).is_ok());
        let err = check_not_newer(&[1, 99]).unwrap_err();
        assert!(err.to_string().contains("newer"), "{err}");
    }
}
