//! The dashboard's numbers, aggregated in SQL: `GET /v1/dashboard` is polled
//! every 5 s, so it must not read every job row of its window (result text included): it
//! reads only counts: terminal outcomes per (state, minute), the two dwell histograms and
//! the dead letters per reason, each a `GROUP BY` whose rows are bounded by a `LIMIT`
//! (states × minutes, histogram buckets, reasons), never a job's row or its text.
//!
//! Per tenant: [`Ledger::tenant_counts`] groups a window's outcomes by
//! (tenant, state, reason) with their model time and tokens; the dashboard, `serve`'s
//! `/metrics` and their tests fold the groups with `lastcall_core::report::tenant_accounts`
//! (the busiest tenants, the rest as `other`).

use lastcall_core::alerts::{KindOutcomes, OpenBreaker};
use lastcall_core::headline::{ArrivalGroup, DwellGroup, HEADLINE_SLICES, Headline, headline};
use lastcall_core::live::{FLEET_MAX_WORKERS, Lease, WorkerLive};
use lastcall_core::report::{TenantAccount, TenantSample, tenant_accounts};
use sqlx::Row;

use super::{Backend, Ledger};
use crate::StoreError;
use crate::error::db;

/// Upper bounds (ms) of the dashboard's dwell histograms (the worker's
/// `lastcall_*_dwell_seconds` buckets); a dwell `d` falls in the first bucket with
/// `d <= bound` (negative ones in the first), past the last in an overflow bucket.
/// [`DWELL_BUCKET_SQL`] spells the same bounds.
pub const DWELL_BUCKETS_MS: &[u64] = &[
    5, 10, 25, 50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 30_000, 60_000,
];

/// The bucket index of the dwell `d` (a column expression), as [`DWELL_BUCKETS_MS`].
macro_rules! dwell_bucket {
    ($d:literal) => {
        concat!(
            "CAST(CASE WHEN ",
            $d,
            " <= 5 THEN 0 WHEN ",
            $d,
            " <= 10 THEN 1 WHEN ",
            $d,
            " <= 25 THEN 2 WHEN ",
            $d,
            " <= 50 THEN 3 WHEN ",
            $d,
            " <= 100 THEN 4 WHEN ",
            $d,
            " <= 250 THEN 5 WHEN ",
            $d,
            " <= 500 THEN 6 WHEN ",
            $d,
            " <= 1000 THEN 7 WHEN ",
            $d,
            " <= 2500 THEN 8 WHEN ",
            $d,
            " <= 5000 THEN 9 WHEN ",
            $d,
            " <= 10000 THEN 10 WHEN ",
            $d,
            " <= 30000 THEN 11 WHEN ",
            $d,
            " <= 60000 THEN 12 ELSE 13 END AS BIGINT)"
        )
    };
}

/// The bucket expression for a queue dwell (shown for the bounds test).
pub const DWELL_BUCKET_SQL: &str = dwell_bucket!("d");

/// The rows of a window that count: terminal states recorded at or after `$1`.
macro_rules! window {
    () => {
        "FROM jobs WHERE recorded_at_ms >= $1 AND state IN ('completed', 'failed', \
         'expired_not_started', 'expired_before_receive', 'deadline_exceeded', 'rejected', \
         'unknown', 'cancelled')"
    };
}

/// At most this many rows per statement (the per-minute one has at most 10 states × 1,441
/// minutes of a 24 h window; the others a handful).
pub const DASHBOARD_MAX_ROWS: i64 = 20_000;

/// Outcomes per (state, minute index = `recorded_at_ms` div 60,000, Euclidean), newest first.
const SELECT_PER_MINUTE: &str = concat!(
    "SELECT state, m, COUNT(*) FROM (SELECT state, \
     (recorded_at_ms - ((recorded_at_ms % 60000) + 60000) % 60000) / 60000 AS m ",
    window!(),
    ") AS t GROUP BY state, m ORDER BY m DESC, state LIMIT $2"
);
/// Queue dwell (received − created) of jobs a worker received (not the dead-letter
/// processor's records), per bucket.
const SELECT_QUEUE_DWELL: &str = concat!(
    "SELECT b, COUNT(*) FROM (SELECT ",
    dwell_bucket!("(received_at_ms - created_at_ms)"),
    " AS b ",
    window!(),
    " AND created_at_ms IS NOT NULL AND received_at_ms IS NOT NULL \
     AND SUBSTR(COALESCE(worker, ''), 1, 4) <> 'dlq:') AS t GROUP BY b ORDER BY b LIMIT $2"
);
/// Consumer dwell (checked − received), per bucket.
const SELECT_CONSUMER_DWELL: &str = concat!(
    "SELECT b, COUNT(*) FROM (SELECT ",
    dwell_bucket!("(checked_at_ms - received_at_ms)"),
    " AS b ",
    window!(),
    " AND received_at_ms IS NOT NULL AND checked_at_ms IS NOT NULL) AS t \
     GROUP BY b ORDER BY b LIMIT $2"
);
/// The dead-letter processor's records per reason (`none` without one).
const SELECT_DEAD_LETTERS: &str = concat!(
    "SELECT r, COUNT(*) FROM (SELECT COALESCE(reason, 'none') AS r ",
    window!(),
    " AND SUBSTR(COALESCE(worker, ''), 1, 4) = 'dlq:') AS t GROUP BY r ORDER BY r LIMIT $2"
);

/// Outcomes per (tenant, state, reason) with the summed model time and tokens of their
/// recorded calls (`CAST`: PostgreSQL's `SUM` of a `bigint` is a `numeric`). The largest
/// groups first, so that a window of more groups than the `LIMIT` keeps the busiest
/// tenants' and drops the smallest groups (which only `other` would have summed).
const SELECT_TENANTS: &str = concat!(
    "SELECT tenant, state, reason, COUNT(*), CAST(SUM(m) AS BIGINT), CAST(SUM(w) AS BIGINT), \
     CAST(SUM(COALESCE(prompt_tokens, 0)) AS BIGINT), \
     CAST(SUM(COALESCE(completion_tokens, 0)) AS BIGINT) \
     FROM (SELECT tenant, state, reason, prompt_tokens, completion_tokens, ",
    model_ms!(),
    " AS m, ",
    wasted_model_ms!(),
    " AS w ",
    window!(),
    ") t GROUP BY tenant, state, reason ORDER BY COUNT(*) DESC, tenant, state, reason LIMIT $2"
);

/// Every statement [`Ledger::dashboard_counts`] runs (none reads `result`, `error` or a
/// payload; the tests check); the last one is [`Ledger::tenant_counts`]'s.
pub const DASHBOARD_STATEMENTS: [&str; 5] = [
    SELECT_PER_MINUTE,
    SELECT_QUEUE_DWELL,
    SELECT_CONSUMER_DWELL,
    SELECT_DEAD_LETTERS,
    SELECT_TENANTS,
];

/// How many tenants the dashboard shows one by one (the rest: `other`).
pub const DASHBOARD_TENANTS: usize = 10;

/// The dashboard's numbers for the window `recorded_at_ms >= since_ms`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DashboardCounts {
    /// (state, minute index, outcomes), terminal states only.
    pub per_minute: Vec<(String, i64, u64)>,
    /// Jobs per bucket of [`DWELL_BUCKETS_MS`] (+ overflow).
    pub queue_dwell: Vec<u64>,
    pub consumer_dwell: Vec<u64>,
    /// (reason, dead letters).
    pub dead_letters: Vec<(String, u64)>,
    /// Per tenant: the [`DASHBOARD_TENANTS`] busiest, then `other`.
    pub tenants: Vec<TenantAccount>,
    /// Rows the statements returned (each at most [`DASHBOARD_MAX_ROWS`]).
    pub rows_read: usize,
}

impl Ledger {
    /// The dashboard's aggregates of the window `recorded_at_ms >= since_ms` (see the
    /// module): five `GROUP BY` statements, no job row read.
    pub async fn dashboard_counts(&self, since_ms: i64) -> Result<DashboardCounts, StoreError> {
        let mut rows: Vec<Vec<(String, i64, i64)>> = Vec::with_capacity(4);
        for (i, sql) in DASHBOARD_STATEMENTS[..4].iter().enumerate() {
            let got: Vec<(String, i64, i64)> = on_pool!(self, read, |pool| {
                sqlx::query(*sql)
                    .bind(since_ms)
                    .bind(DASHBOARD_MAX_ROWS)
                    .fetch_all(pool)
                    .await
                    .and_then(|rows| {
                        rows.iter()
                            .map(|r| {
                                Ok(match i {
                                    0 => (r.try_get(0)?, r.try_get(1)?, r.try_get(2)?),
                                    3 => (r.try_get(0)?, 0, r.try_get(1)?),
                                    _ => (String::new(), r.try_get(0)?, r.try_get(1)?),
                                })
                            })
                            .collect()
                    })
                    .map_err(db("reading the dashboard's counts"))?
            });
            rows.push(got);
        }
        let mut out = DashboardCounts {
            rows_read: rows.iter().map(Vec::len).sum(),
            queue_dwell: vec![0; DWELL_BUCKETS_MS.len() + 1],
            consumer_dwell: vec![0; DWELL_BUCKETS_MS.len() + 1],
            ..Default::default()
        };
        let n = |c: i64| c.max(0) as u64;
        out.per_minute = rows[0]
            .iter()
            .map(|(s, m, c)| (s.clone(), *m, n(*c)))
            .collect();
        for (hist, got) in [
            (&mut out.queue_dwell, &rows[1]),
            (&mut out.consumer_dwell, &rows[2]),
        ] {
            for (_, b, c) in got {
                let b = (*b).clamp(0, DWELL_BUCKETS_MS.len() as i64) as usize;
                hist[b] += n(*c);
            }
        }
        out.dead_letters = rows[3].iter().map(|(r, _, c)| (r.clone(), n(*c))).collect();
        let tenants = self.tenant_counts(since_ms).await?;
        out.rows_read += tenants.len();
        out.tenants = tenant_accounts(&tenants, DASHBOARD_TENANTS);
        Ok(out)
    }

    /// The terminal outcomes recorded at or after `since_ms`, one group per (tenant, state,
    /// reason) with the summed model time of all their calls (each attempt's; wasted: the
    /// calls that did not complete) and the tokens of their recorded calls; at most [`DASHBOARD_MAX_ROWS`] groups (the largest), no job row read. Fold
    /// them with `lastcall_core::report::tenant_accounts`.
    pub async fn tenant_counts(&self, since_ms: i64) -> Result<Vec<TenantSample>, StoreError> {
        let n = |c: i64| c.max(0) as u64;
        on_pool!(self, read, |pool| {
            sqlx::query(SELECT_TENANTS)
                .bind(since_ms)
                .bind(DASHBOARD_MAX_ROWS)
                .fetch_all(pool)
                .await
                .and_then(|rows| {
                    rows.iter()
                        .map(|r| {
                            Ok(TenantSample {
                                tenant: r.try_get(0)?,
                                state: r.try_get(1)?,
                                reason: r.try_get(2)?,
                                jobs: n(r.try_get(3)?),
                                model_ms: n(r.try_get(4)?),
                                wasted_model_ms: n(r.try_get(5)?),
                                prompt_tokens: n(r.try_get(6)?),
                                completion_tokens: n(r.try_get(7)?),
                            })
                        })
                        .collect()
                })
                .map_err(db("reading the per-tenant counts"))
        })
    }
}

/// The arrivals of a window (`created_at_ms` in `[$1, $2)`) per (trend slice, state) with
/// their wasted model time; `$3` slices. The `recorded_at_ms` condition only lets the
/// index on it serve (an arrival is recorded after it was created, or not yet; a minute of
/// slack for producers' clocks).
const SELECT_ARRIVALS: &str = concat!(
    "SELECT s, state, COUNT(*), CAST(SUM(w) AS BIGINT) FROM (SELECT \
     ((created_at_ms - $1) * $3) / ($2 - $1) AS s, state, ",
    wasted_model_ms!(),
    " AS w FROM jobs WHERE created_at_ms >= $1 AND created_at_ms < $2 \
     AND (recorded_at_ms >= $1 - 60000 OR recorded_at_ms IS NULL) \
     AND COALESCE($4, tenant) = tenant) t GROUP BY s, state ORDER BY s, state LIMIT $5"
);

/// The queue dwell (received − created) of the window's arrivals that a worker received
/// (not the dead-letter processor), per (trend slice, dwell bucket).
const SELECT_ARRIVAL_DWELL: &str = concat!(
    "SELECT s, b, COUNT(*) FROM (SELECT ((created_at_ms - $1) * $3) / ($2 - $1) AS s, ",
    dwell_bucket!("(received_at_ms - created_at_ms)"),
    " AS b FROM jobs WHERE created_at_ms >= $1 AND created_at_ms < $2 \
     AND (recorded_at_ms >= $1 - 60000 OR recorded_at_ms IS NULL) \
     AND COALESCE($4, tenant) = tenant AND received_at_ms IS NOT NULL \
     AND SUBSTR(COALESCE(worker, ''), 1, 4) <> 'dlq:') t GROUP BY s, b ORDER BY s, b LIMIT $5"
);

/// The statements of [`Ledger::headline`] (none reads a job's text; the tests check).
pub const HEADLINE_STATEMENTS: [&str; 2] = [SELECT_ARRIVALS, SELECT_ARRIVAL_DWELL];

/// The leases renewed at or after `$1`, the most recent first.
const SELECT_LEASES: &str = "SELECT name, heartbeat_ms, live FROM workers WHERE heartbeat_ms >= $1 \
     ORDER BY heartbeat_ms DESC, name LIMIT $2";

impl Ledger {
    /// The headline of the window `[since_ms, until_ms)`, for one tenant or
    /// all: the arrivals grouped by trend slice and state, their queue dwells by slice and
    /// bucket (two bounded `GROUP BY`s), folded by `lastcall_core::headline::headline`.
    /// The dashboard and `lastcall report` both call this.
    pub async fn headline(
        &self,
        since_ms: i64,
        until_ms: i64,
        tenant: Option<&str>,
    ) -> Result<Headline, StoreError> {
        let until_ms = until_ms.max(since_ms + 1);
        let n = |c: i64| c.max(0) as u64;
        let arrivals: Vec<ArrivalGroup> = on_pool!(self, read, |pool| {
            sqlx::query(SELECT_ARRIVALS)
                .bind(since_ms)
                .bind(until_ms)
                .bind(HEADLINE_SLICES)
                .bind(tenant)
                .bind(DASHBOARD_MAX_ROWS)
                .fetch_all(pool)
                .await
                .and_then(|rows| {
                    rows.iter()
                        .map(|r| {
                            Ok(ArrivalGroup {
                                slice: r.try_get(0)?,
                                state: r.try_get(1)?,
                                jobs: n(r.try_get(2)?),
                                wasted_model_ms: n(r.try_get::<Option<i64>, _>(3)?.unwrap_or(0)),
                            })
                        })
                        .collect()
                })
                .map_err(db("reading the headline's arrivals"))?
        });
        let dwell: Vec<DwellGroup> = on_pool!(self, read, |pool| {
            sqlx::query(SELECT_ARRIVAL_DWELL)
                .bind(since_ms)
                .bind(until_ms)
                .bind(HEADLINE_SLICES)
                .bind(tenant)
                .bind(DASHBOARD_MAX_ROWS)
                .fetch_all(pool)
                .await
                .and_then(|rows| {
                    rows.iter()
                        .map(|r| {
                            let b: i64 = r.try_get(1)?;
                            Ok(DwellGroup {
                                slice: r.try_get(0)?,
                                bucket: b.clamp(0, DWELL_BUCKETS_MS.len() as i64) as usize,
                                jobs: n(r.try_get(2)?),
                            })
                        })
                        .collect()
                })
                .map_err(db("reading the headline's queue dwells"))?
        });
        Ok(headline(
            since_ms,
            until_ms,
            HEADLINE_SLICES,
            &arrivals,
            &dwell,
            DWELL_BUCKETS_MS,
        ))
    }

    /// The leases renewed at or after `since_ms` with the live numbers their workers
    /// published (at most [`FLEET_MAX_WORKERS`], the most recent first). Fold them with
    /// `lastcall_core::live::fleet`.
    pub async fn worker_leases(&self, since_ms: i64) -> Result<Vec<Lease>, StoreError> {
        on_pool!(self, read, |pool| {
            sqlx::query(SELECT_LEASES)
                .bind(since_ms)
                .bind(FLEET_MAX_WORKERS as i64)
                .fetch_all(pool)
                .await
                .and_then(|rows| {
                    rows.iter()
                        .map(|r| {
                            let live: Option<String> = r.try_get(2)?;
                            Ok(Lease {
                                worker: r.try_get(0)?,
                                renewed_at_ms: r.try_get(1)?,
                                live: WorkerLive::from_json(live.as_deref()),
                            })
                        })
                        .collect()
                })
                .map_err(db("reading the worker leases"))
        })
    }
}

/// The breakers held open at `$1` by workers whose lease is fresh (renewed at or after
/// `$2`), one row per (worker, kind).
const SELECT_OPEN_BREAKERS: &str = "SELECT b.worker, b.backend, b.kind, b.open_until_ms \
     FROM breakers b JOIN workers w ON w.name = b.worker \
     WHERE b.open_until_ms > $1 AND w.heartbeat_ms >= $2 \
     ORDER BY b.worker, b.backend, b.kind LIMIT $3";

/// Terminal outcomes recorded at or after `$1` per kind: all, and refused without a call.
const SELECT_KIND_OUTCOMES: &str = concat!(
    "SELECT kind, COUNT(*), CAST(SUM(CASE WHEN state IN ('expired_not_started', \
     'expired_before_receive', 'rejected') THEN 1 ELSE 0 END) AS BIGINT) ",
    window!(),
    " GROUP BY kind ORDER BY COUNT(*) DESC, kind LIMIT $2"
);

/// At most this many rows of the alerts' reads.
pub const ALERT_MAX_ROWS: i64 = 200;

impl Ledger {
    /// The breakers open at `now_ms` of live workers (lease renewed at or after
    /// `live_since_ms`), one per (worker, backend) with its kinds.
    pub async fn open_breakers(
        &self,
        now_ms: i64,
        live_since_ms: i64,
    ) -> Result<Vec<OpenBreaker>, StoreError> {
        let rows: Vec<(String, String, String, i64)> = on_pool!(self, read, |pool| {
            sqlx::query(SELECT_OPEN_BREAKERS)
                .bind(now_ms)
                .bind(live_since_ms)
                .bind(ALERT_MAX_ROWS)
                .fetch_all(pool)
                .await
                .and_then(|rows| {
                    rows.iter()
                        .map(|r| Ok((r.try_get(0)?, r.try_get(1)?, r.try_get(2)?, r.try_get(3)?)))
                        .collect()
                })
                .map_err(db("reading the open breakers"))?
        });
        let mut out: Vec<OpenBreaker> = Vec::new();
        for (worker, backend, kind, until) in rows {
            match out.last_mut() {
                Some(b) if b.worker == worker && b.backend == backend => {
                    b.kinds.push(kind);
                    b.open_until_ms = b.open_until_ms.min(until);
                }
                _ => out.push(OpenBreaker {
                    worker,
                    backend,
                    kinds: vec![kind],
                    open_until_ms: until,
                }),
            }
        }
        Ok(out)
    }

    /// The terminal outcomes recorded at or after `since_ms` per kind (the busiest
    /// [`ALERT_MAX_ROWS`]): all of them, and those refused without a model call.
    pub async fn kind_outcomes(&self, since_ms: i64) -> Result<Vec<KindOutcomes>, StoreError> {
        let n = |c: i64| c.max(0) as u64;
        on_pool!(self, read, |pool| {
            sqlx::query(SELECT_KIND_OUTCOMES)
                .bind(since_ms)
                .bind(ALERT_MAX_ROWS)
                .fetch_all(pool)
                .await
                .and_then(|rows| {
                    rows.iter()
                        .map(|r| {
                            Ok(KindOutcomes {
                                kind: r.try_get(0)?,
                                jobs: n(r.try_get(1)?),
                                refused: n(r.try_get(2)?),
                            })
                        })
                        .collect()
                })
                .map_err(db("reading the outcomes per kind"))
        })
    }
}
