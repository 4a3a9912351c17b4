//! Mapping sqlx errors onto [`StoreError`]: what is worth retrying and what is not.
//!
//! **Boundary:** nothing outside this crate sees a sqlx error; callers only learn whether a
//! retry can help (`Unavailable`) or not (`Fatal`).

use sqlx::error::DatabaseError;
use sqlx::postgres::PgDatabaseError;
use sqlx::sqlite::SqliteError;

use crate::StoreError;

/// Primary SQLite result codes that mean "try again later": BUSY, LOCKED, IOERR, FULL.
/// The extended codes carry the primary code in their low byte.
const SQLITE_RETRYABLE: [i64; 4] = [5, 6, 10, 13];

/// PostgreSQL SQLSTATEs (or classes) that mean the server is going away, not ready yet, out
/// of connections, or that the transaction lost a race and may simply be run again.
fn pg_retryable(sqlstate: &str) -> bool {
    sqlstate.starts_with("08") // connection exception
        || sqlstate.starts_with("53") // insufficient resources (too many connections, disk full)
        || matches!(
            sqlstate,
            "57P01" // admin_shutdown
                | "57P02" // crash_shutdown
                | "57P03" // cannot_connect_now
                | "40001" // serialization_failure
                | "40P01" // deadlock_detected
        )
}

/// Classifies a sqlx error. `context` names the operation for the message.
pub(crate) fn classify(context: &str, err: sqlx::Error) -> StoreError {
    let retryable = match &err {
        sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut | sqlx::Error::Tls(_) => true,
        sqlx::Error::Database(db) => {
            if let Some(e) = db.try_downcast_ref::<SqliteError>() {
                e.code()
                    .and_then(|c| c.parse::<i64>().ok())
                    .is_some_and(|c| SQLITE_RETRYABLE.contains(&(c & 0xff)))
            } else if let Some(e) = db.try_downcast_ref::<PgDatabaseError>() {
                pg_retryable(e.code())
            } else {
                false
            }
        }
        _ => false,
    };
    let message = format!("{context}: {err}");
    if retryable {
        StoreError::Unavailable(message)
    } else {
        StoreError::Fatal(message)
    }
}

/// `.map_err(db("what"))`: shorthand for [`classify`].
pub(crate) fn db(context: &'static str) -> impl Fn(sqlx::Error) -> StoreError {
    move |err| classify(context, err)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pg_codes() {
        for code in [
            "08006", "08001", "57P01", "57P03", "53300", "40001", "40P01",
        ] {
            assert!(pg_retryable(code), "{code}");
        }
        for code in ["23505", "42P01", "3D000", "28P01", "22P02"] {
            assert!(!pg_retryable(code), "{code}");
        }
    }

    #[test]
    fn transport_errors_are_retryable() {
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused");
        assert!(classify("x", sqlx::Error::Io(io)).is_retryable());
        assert!(classify("x", sqlx::Error::PoolTimedOut).is_retryable());
        assert!(!classify("x", sqlx::Error::RowNotFound).is_retryable());
        assert!(!classify("x", sqlx::Error::PoolClosed).is_retryable());
    }
}
