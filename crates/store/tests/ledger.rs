//! The ledger's test suite, run against real databases: every case runs once on SQLite (a
//! fresh file per test) and once on PostgreSQL (a fresh database per test, created through
//! `LASTCALL_TEST_PG_URL`, default `postgres://postgres@127.0.0.1:5432/test`).
//!
//! If PostgreSQL is unreachable the `postgres` variants fail; they never skip.

use std::hash::{BuildHasher, Hasher};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use lastcall_core::envelope::RejectReason;
use lastcall_core::request_size::RequestSize;
use lastcall_core::{Decision, Priority, Reason, RefusalCause, Stage, State, Tenant};
use lastcall_store::{
    AcceptedJob, AttemptStart, JobRecord, Ledger, LedgerWrite, ListFilter, OutcomeRecord,
    ReceiptInfo, StoreError,
};
use sqlx::{AssertSqlSafe, Connection, Row};

const DEFAULT_PG_ADMIN_URL: &str = "postgres://postgres@127.0.0.1:5432/test";
/// The newest schema version this build migrates to.
const LATEST_VERSION: i64 = 15;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Backend {
    Sqlite,
    Postgres,
}

/// A fresh database and a ledger connected to it; the database is removed on drop (best
/// effort, also when the test panicked).
struct TestDb {
    backend: Backend,
    url: String,
    ledger: Ledger,
    cleanup: Cleanup,
}

enum Cleanup {
    /// The temporary directory holding the SQLite file and its WAL.
    Dir(PathBuf),
    /// The PostgreSQL database to drop through the admin URL.
    PgDatabase { admin_url: String, name: String },
}

fn unique_suffix() -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut h = std::hash::RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos(),
    );
    format!("{:016x}", h.finish())
}

fn pg_admin_url() -> String {
    std::env::var("LASTCALL_TEST_PG_URL").unwrap_or_else(|_| DEFAULT_PG_ADMIN_URL.to_owned())
}

/// The admin URL with its database name replaced by `name` (query string kept).
fn with_database(admin_url: &str, name: &str) -> String {
    let (base, query) = match admin_url.split_once('?') {
        Some((b, q)) => (b, Some(q)),
        None => (admin_url, None),
    };
    let authority_end = base.find("://").map_or(0, |i| i + 3);
    let base = match base[authority_end..].find('/') {
        Some(i) => &base[..authority_end + i],
        None => base,
    };
    match query {
        Some(q) => format!("{base}/{name}?{q}"),
        None => format!("{base}/{name}"),
    }
}

impl TestDb {
    async fn new(backend: Backend) -> TestDb {
        match backend {
            Backend::Sqlite => {
                let dir = std::env::temp_dir().join(format!("lastcall-store-{}", unique_suffix()));
                std::fs::create_dir_all(&dir).unwrap();
                let url = format!("sqlite://{}", dir.join("ledger.db").display());
                let ledger = Ledger::connect(&url).await.expect("connect sqlite");
                TestDb {
                    backend,
                    url,
                    ledger,
                    cleanup: Cleanup::Dir(dir),
                }
            }
            Backend::Postgres => {
                let admin_url = pg_admin_url();
                let name = format!("lastcall_t_{}", unique_suffix());
                let mut admin = sqlx::PgConnection::connect(&admin_url)
                    .await
                    .unwrap_or_else(|e| {
                        panic!("PostgreSQL is required for this test ({admin_url}): {e}")
                    });
                sqlx::query(AssertSqlSafe(format!("CREATE DATABASE {name}")))
                    .execute(&mut admin)
                    .await
                    .expect("create test database");
                admin.close().await.ok();
                let url = with_database(&admin_url, &name);
                let cleanup = Cleanup::PgDatabase { admin_url, name };
                let ledger = Ledger::connect(&url).await.expect("connect postgres");
                TestDb {
                    backend,
                    url,
                    ledger,
                    cleanup,
                }
            }
        }
    }

    /// One integer from a raw query, outside the ledger (to look at the schema itself).
    async fn scalar(&self, sql: &'static str) -> i64 {
        match self.backend {
            Backend::Sqlite => {
                let mut conn = sqlx::SqliteConnection::connect(&self.url).await.unwrap();
                let row = sqlx::query(sql).fetch_one(&mut conn).await.unwrap();
                row.try_get(0).unwrap()
            }
            Backend::Postgres => {
                let mut conn = sqlx::PgConnection::connect(&self.url).await.unwrap();
                let row = sqlx::query(sql).fetch_one(&mut conn).await.unwrap();
                row.try_get(0).unwrap()
            }
        }
    }

    /// Raw SQL (several statements allowed), outside the ledger.
    async fn exec(&self, sql: &str) {
        let sql = AssertSqlSafe(sql.to_owned());
        match self.backend {
            Backend::Sqlite => {
                let mut conn = sqlx::SqliteConnection::connect(&self.url).await.unwrap();
                sqlx::raw_sql(sql).execute(&mut conn).await.unwrap();
            }
            Backend::Postgres => {
                let mut conn = sqlx::PgConnection::connect(&self.url).await.unwrap();
                sqlx::raw_sql(sql).execute(&mut conn).await.unwrap();
            }
        }
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        match &self.cleanup {
            Cleanup::Dir(dir) => {
                let _ = std::fs::remove_dir_all(dir);
            }
            Cleanup::PgDatabase { admin_url, name } => {
                let (admin_url, name) = (admin_url.clone(), name.clone());
                // Drop may run inside the test's runtime: use a thread with its own.
                let _ = std::thread::spawn(move || {
                    let rt = tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                        .unwrap();
                    rt.block_on(async {
                        if let Ok(mut admin) = sqlx::PgConnection::connect(&admin_url).await {
                            let sql = format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)");
                            let _ = sqlx::query(AssertSqlSafe(sql)).execute(&mut admin).await;
                            let _ = admin.close().await;
                        }
                    });
                })
                .join();
            }
        }
    }
}

/// Generates `mod $case { sqlite(); postgres(); }` running `$case(&TestDb)` on each backend.
macro_rules! both_backends {
    ($($case:ident),* $(,)?) => {
        $(
            mod $case {
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn sqlite() {
                    let db = super::TestDb::new(super::Backend::Sqlite).await;
                    super::$case(&db).await;
                    db.ledger.close().await;
                }

                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn postgres() {
                    let db = super::TestDb::new(super::Backend::Postgres).await;
                    super::$case(&db).await;
                    db.ledger.close().await;
                }
            }
        )*
    };
}

both_backends!(
    mark_acked_many_sets_every_ack_in_one_write,
    ack_marks_ride_along_with_a_group_commit,
    migrations_are_idempotent,
    a_version_1_ledger_upgrades_and_counts_its_attempts,
    a_version_2_ledger_upgrades_to_version_3_in_place,
    accepted_then_outcome,
    terminal_outcome_is_written_once,
    start_then_outcome_counts_one_call,
    redelivery_after_a_stored_outcome,
    prior_starts_count_every_started_call,
    non_terminal_outcome_moves_the_live_state_only,
    record_terminal_without_accepted_row,
    worker_before_producer_backfills_the_inventory,
    list_filters_by_state_and_kind,
    counts_by_state_in_state_order,
    mark_unknown_only_after_deadline_plus_grace,
    records_since_filters_by_recorded_time,
    concurrent_terminal_writes_have_one_winner,
    invalid_input_is_fatal,
    group_commit_writes_many_in_one_batch,
    group_commit_with_an_invalid_item_writes_nothing,
    group_commit_takes_terminal_outcomes_without_an_attempt,
    group_commit_of_a_large_batch_uses_several_statements,
    receipt_info_many_matches_receipt_info,
    ingress_claims_an_id_once_then_stamps_or_releases_it,
    a_late_outcome_replaces_unknown_once,
    a_slow_workers_completion_replaces_unknown_through_a_group_commit,
    unknown_over_unknown_changes_nothing,
    concurrent_late_outcomes_have_one_winner,
    late_outcomes_count_only_replaced_unknowns,
    a_running_attempt_is_live_while_its_worker_renews_its_lease,
    the_outcome_names_its_backend_model_and_min_runtime,
    a_refusal_keeps_the_budget_that_would_have_been_admitted,
    cancel_ends_a_waiting_job_and_flags_a_running_one,
    a_webhook_is_claimed_once_and_its_attempts_recorded,
    the_sweep_finds_the_webhooks_that_no_one_delivers,
    recent_calls_are_the_durations_a_starting_worker_learns_from,
    recent_calls_carry_the_request_size_the_worker_measured,
    the_doors_call_time_comes_from_measured_calls_only,
    dashboard_counts_equal_the_records_and_read_no_text,
    every_row_keeps_the_tenant_and_tier_its_first_writer_knew,
    tenant_counts_equal_the_records,
    the_door_sees_a_kind_down_while_every_live_worker_has_its_breaker_open,
);

// ---------------------------------------------------------------------------------------
// Builders

fn accepted(job_id: &str, kind: &str, accepted_at_ms: i64, expires_at_ms: i64) -> AcceptedJob {
    AcceptedJob {
        job_id: job_id.to_owned(),
        kind: kind.to_owned(),
        created_at_ms: accepted_at_ms - 5,
        expires_at_ms,
        accepted_at_ms,
        trace_id: Some(format!("trace-{job_id}")),
        payload_hash: format!("hash-{job_id}"),
        tenant: Tenant::default_tenant(),
        priority: Priority::Standard,
    }
}

fn start(job_id: &str, attempt_key: &str, attempt: u32, at_ms: i64) -> AttemptStart {
    AttemptStart {
        attempt_key: attempt_key.to_owned(),
        job_id: job_id.to_owned(),
        kind: "chat".to_owned(),
        attempt,
        created_at_ms: 1_000,
        expires_at_ms: 60_000,
        worker: "w1".to_owned(),
        redelivered: attempt > 1,
        received_at_ms: at_ms,
        checked_at_ms: at_ms + 1,
        started_at_ms: at_ms + 2,
        tenant: Tenant::default_tenant(),
        priority: Priority::Standard,
    }
}

fn outcome(job_id: &str, attempt_key: &str, state: State, recorded_at_ms: i64) -> OutcomeRecord {
    OutcomeRecord {
        attempt_key: attempt_key.to_owned(),
        attempt: 1,
        created_at_ms: Some(1_000),
        expires_at_ms: Some(60_000),
        received_at_ms: Some(recorded_at_ms - 30),
        checked_at_ms: Some(recorded_at_ms - 29),
        finished_at_ms: Some(recorded_at_ms - 1),
        worker: "w1".to_owned(),
        ..OutcomeRecord::new(job_id, "chat", state, Decision::Ack, recorded_at_ms)
    }
}

fn completed(job_id: &str, attempt_key: &str, recorded_at_ms: i64, text: &str) -> OutcomeRecord {
    OutcomeRecord {
        started_at_ms: Some(recorded_at_ms - 20),
        model_called: true,
        result: Some(text.to_owned()),
        prompt_tokens: Some(12),
        completion_tokens: Some(34),
        latency_ms: Some(19),
        ..outcome(job_id, attempt_key, State::Completed, recorded_at_ms)
    }
}

async fn must_get(ledger: &Ledger, job_id: &str) -> JobRecord {
    ledger
        .get(job_id)
        .await
        .unwrap()
        .unwrap_or_else(|| panic!("job {job_id} not found"))
}

// ---------------------------------------------------------------------------------------
// Cases (each runs on both backends)

async fn migrations_are_idempotent(db: &TestDb) {
    assert!(
        db.ledger
            .record_accepted(&accepted("j1", "chat", 10, 1_000))
            .await
            .unwrap()
    );
    // A second and third process connecting to the same database: nothing re-applied,
    // nothing lost.
    for _ in 0..2 {
        let again = Ledger::connect(&db.url).await.expect("reconnect");
        assert_eq!(
            again.backend_name(),
            match db.backend {
                Backend::Sqlite => "sqlite",
                Backend::Postgres => "postgres",
            }
        );
        assert_eq!(must_get(&again, "j1").await.state, "accepted");
        again.close().await;
    }
    assert_eq!(
        db.scalar("SELECT COUNT(*) FROM schema_migrations").await,
        LATEST_VERSION
    );
    assert_eq!(
        db.scalar("SELECT MAX(version) FROM schema_migrations")
            .await,
        LATEST_VERSION
    );
    // `applied_at_ms` is the database's clock in ms since the epoch (not seconds, not 0).
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64;
    let applied = db
        .scalar("SELECT MIN(applied_at_ms) FROM schema_migrations")
        .await;
    assert!((now - applied).abs() < 600_000, "{applied} vs {now}");
}

/// A ledger written by a version-1 binary (stored, here stale, counters) is upgraded in
/// place: its rows survive, and the counts come from the attempt rows.
async fn a_version_1_ledger_upgrades_and_counts_its_attempts(db: &TestDb) {
    let v1 = match db.backend {
        Backend::Sqlite => include_str!("../migrations/sqlite/0001_init.sql"),
        Backend::Postgres => include_str!("../migrations/postgres/0001_init.sql"),
    };
    db.exec("DROP TABLE jobs; DROP TABLE attempts; DROP TABLE IF EXISTS workers; DROP TABLE IF EXISTS webhooks; DROP TABLE IF EXISTS webhook_attempts; DROP TABLE IF EXISTS breakers; DROP TABLE IF EXISTS batch_line_errors; DROP TABLE IF EXISTS batches; DROP TABLE IF EXISTS file_lines; DROP TABLE IF EXISTS files; DELETE FROM schema_migrations")
        .await;
    db.exec(v1).await;
    db.exec(
        "INSERT INTO schema_migrations (version, name, applied_at_ms) VALUES (1, 'init', 0); \
         INSERT INTO jobs (job_id, kind, state, attempts, backend_calls) \
         VALUES ('old', 'chat', 'running', 7, 7); \
         INSERT INTO attempts (attempt_key, job_id, attempt, worker, model_called) \
         VALUES ('old:1', 'old', 1, 'w', TRUE), ('old:2', 'old', 2, 'w', FALSE)",
    )
    .await;
    let upgraded = Ledger::connect(&db.url).await.expect("upgrade");
    let job = must_get(&upgraded, "old").await;
    assert_eq!(
        (job.state.as_str(), job.attempts, job.backend_calls),
        ("running", 2, 1)
    );
    assert_eq!(upgraded.receipt_info("old").await.unwrap().prior_starts, 1);
    upgraded.close().await;
    assert_eq!(
        db.scalar("SELECT MAX(version) FROM schema_migrations")
            .await,
        LATEST_VERSION
    );
}

/// A ledger written by a version-2 binary (no `reconciled_at_ms`) is upgraded to version 3
/// in place: its rows survive, an `unknown` it holds gets its reconciliation time from its
/// `recorded_at_ms` (only reconciliation ever wrote `unknown`), and a late outcome then
/// replaces it and is counted.
async fn a_version_2_ledger_upgrades_to_version_3_in_place(db: &TestDb) {
    let (v1, v2) = match db.backend {
        Backend::Sqlite => (
            include_str!("../migrations/sqlite/0001_init.sql"),
            include_str!("../migrations/sqlite/0002_counters_on_read.sql"),
        ),
        Backend::Postgres => (
            include_str!("../migrations/postgres/0001_init.sql"),
            include_str!("../migrations/postgres/0002_counters_on_read.sql"),
        ),
    };
    db.exec("DROP TABLE jobs; DROP TABLE attempts; DROP TABLE IF EXISTS workers; DROP TABLE IF EXISTS webhooks; DROP TABLE IF EXISTS webhook_attempts; DROP TABLE IF EXISTS breakers; DROP TABLE IF EXISTS batch_line_errors; DROP TABLE IF EXISTS batches; DROP TABLE IF EXISTS file_lines; DROP TABLE IF EXISTS files; DELETE FROM schema_migrations")
        .await;
    db.exec(v1).await;
    db.exec(v2).await;
    db.exec(
        "INSERT INTO schema_migrations (version, name, applied_at_ms) VALUES \
         (1, 'init', 0), (2, 'counters_on_read', 0); \
         INSERT INTO jobs (job_id, kind, state, reason, expires_at_ms, recorded_at_ms) VALUES \
         ('lost', 'chat', 'unknown', 'no_outcome_after_deadline', 100, 1500), \
         ('done', 'chat', 'completed', NULL, 100, 90), \
         ('live', 'chat', 'running', NULL, 60000, NULL); \
         INSERT INTO attempts (attempt_key, job_id, attempt, worker, model_called) \
         VALUES ('live:1', 'live', 1, 'w', TRUE)",
    )
    .await;
    let upgraded = Ledger::connect(&db.url).await.expect("upgrade");
    assert_eq!(
        db.scalar("SELECT MAX(version) FROM schema_migrations")
            .await,
        LATEST_VERSION
    );
    let lost = must_get(&upgraded, "lost").await;
    assert_eq!(
        (
            lost.state.as_str(),
            lost.recorded_at_ms,
            lost.reconciled_at_ms
        ),
        ("unknown", Some(1_500), Some(1_500))
    );
    assert_eq!(must_get(&upgraded, "done").await.reconciled_at_ms, None);
    let live = must_get(&upgraded, "live").await;
    assert_eq!(
        (
            live.state.as_str(),
            live.backend_calls,
            live.reconciled_at_ms
        ),
        ("running", 1, None)
    );
    assert_eq!(upgraded.late_outcomes().await.unwrap(), 0);
    // The upgraded ledger follows the new rule.
    assert!(
        upgraded
            .record_terminal(&OutcomeRecord {
                reason: Some(Reason::BrokerTtlExpired),
                ..outcome("lost", "", State::ExpiredBeforeReceive, 2_000)
            })
            .await
            .unwrap()
    );
    let lost = must_get(&upgraded, "lost").await;
    assert_eq!(
        (lost.state.as_str(), lost.reconciled_at_ms),
        ("expired_before_receive", Some(1_500))
    );
    assert_eq!(upgraded.late_outcomes().await.unwrap(), 1);
    upgraded.close().await;
    // Connecting again applies nothing.
    let again = Ledger::connect(&db.url).await.expect("reconnect");
    assert_eq!(again.late_outcomes().await.unwrap(), 1);
    again.close().await;
    assert_eq!(
        db.scalar("SELECT COUNT(*) FROM schema_migrations").await,
        LATEST_VERSION
    );
}

async fn accepted_then_outcome(db: &TestDb) {
    let l = &db.ledger;
    let job = accepted("j1", "chat", 100, 10_000);
    assert!(l.record_accepted(&job).await.unwrap());
    assert!(!l.record_accepted(&job).await.unwrap(), "second insert");
    assert_eq!(
        l.payload_hash("j1").await.unwrap().as_deref(),
        Some("hash-j1")
    );
    assert_eq!(l.payload_hash("nope").await.unwrap(), None);
    assert_eq!(l.get("nope").await.unwrap(), None);
    assert_eq!(
        l.receipt_info("nope").await.unwrap(),
        ReceiptInfo::default()
    );

    let before = must_get(l, "j1").await;
    assert_eq!(before.state, "accepted");
    assert_eq!(before.kind, "chat");
    assert_eq!(before.accepted_at_ms, Some(100));
    assert_eq!(before.created_at_ms, Some(95));
    assert_eq!(before.expires_at_ms, Some(10_000));
    assert_eq!(before.trace_id.as_deref(), Some("trace-j1"));
    assert_eq!(before.recorded_at_ms, None);
    assert_eq!((before.attempts, before.backend_calls), (0, 0));
    assert!(!l.receipt_info("j1").await.unwrap().already_recorded);

    let rec = OutcomeRecord {
        cancel_confirmed: Some(false),
        ..completed("j1", "w1:c1:1", 500, "hello")
    };
    assert!(l.record_outcome(&rec).await.unwrap());

    let after = must_get(l, "j1").await;
    assert_eq!(after.state, "completed");
    assert_eq!(after.result.as_deref(), Some("hello"));
    assert_eq!(after.recorded_at_ms, Some(500));
    assert_eq!(after.finished_at_ms, Some(499));
    assert_eq!(after.started_at_ms, Some(480));
    assert_eq!(after.worker.as_deref(), Some("w1"));
    assert_eq!(after.prompt_tokens, Some(12));
    assert_eq!(after.completion_tokens, Some(34));
    assert_eq!(after.latency_ms, Some(19));
    assert!(!after.cancel_requested);
    assert_eq!(after.cancel_confirmed, Some(false));
    assert_eq!((after.attempts, after.backend_calls), (1, 1));
    // What only the producer knew is kept.
    assert_eq!(after.accepted_at_ms, Some(100));
    assert_eq!(after.trace_id.as_deref(), Some("trace-j1"));
    assert_eq!(
        l.payload_hash("j1").await.unwrap().as_deref(),
        Some("hash-j1")
    );
    assert_eq!(
        l.receipt_info("j1").await.unwrap(),
        ReceiptInfo {
            already_recorded: true,
            prior_starts: 1,
            cancel_requested: false
        }
    );
    assert!(!l.record_accepted(&job).await.unwrap());
    assert_eq!(must_get(l, "j1").await.state, "completed");
}

async fn terminal_outcome_is_written_once(db: &TestDb) {
    let l = &db.ledger;
    l.record_accepted(&accepted("j1", "chat", 100, 10_000))
        .await
        .unwrap();
    assert!(
        l.record_outcome(&completed("j1", "a1", 500, "first"))
            .await
            .unwrap()
    );
    let first = must_get(l, "j1").await;

    let second = OutcomeRecord {
        reason: Some(Reason::Backend("backend_error".into())),
        error: Some("boom".to_owned()),
        ..outcome("j1", "a2", State::Failed, 900)
    };
    assert!(!l.record_outcome(&second).await.unwrap());
    // Same attempt key replayed: still not a second write.
    assert!(
        !l.record_outcome(&completed("j1", "a1", 950, "replayed"))
            .await
            .unwrap()
    );
    let third = OutcomeRecord {
        reason: Some(Reason::Backend("expired".into())),
        ..outcome("j1", "", State::ExpiredBeforeReceive, 1_000)
    };
    assert!(!l.record_terminal(&third).await.unwrap());
    assert!(l.mark_unknown(i64::MAX, 0).await.unwrap().is_empty());

    let now = must_get(l, "j1").await;
    assert_eq!(now.state, "completed");
    assert_eq!(now.reason, None);
    assert_eq!(now.result.as_deref(), Some("first"));
    assert_eq!(now.error, None);
    assert_eq!(now.recorded_at_ms, Some(500));
    assert_eq!(now.finished_at_ms, first.finished_at_ms);
    // The later deliveries are still traced and counted.
    assert_eq!(now.attempts, 2);
    let rows = l.attempts("j1").await.unwrap();
    assert_eq!(rows.len(), 2);
    assert_eq!(rows[1].attempt_key, "a2");
    assert_eq!(rows[1].state.as_deref(), Some("failed"));
}

async fn start_then_outcome_counts_one_call(db: &TestDb) {
    let l = &db.ledger;
    l.record_accepted(&accepted("j1", "chat", 100, 60_000))
        .await
        .unwrap();
    l.record_start(&start("j1", "w1:c1:7", 1, 200))
        .await
        .unwrap();

    let running = must_get(l, "j1").await;
    assert_eq!(running.state, "running");
    assert_eq!(running.started_at_ms, Some(202));
    assert_eq!((running.attempts, running.backend_calls), (1, 1));
    assert_eq!(
        l.receipt_info("j1").await.unwrap(),
        ReceiptInfo {
            already_recorded: false,
            prior_starts: 1,
            cancel_requested: false
        }
    );

    let rec = OutcomeRecord {
        received_at_ms: Some(200),
        checked_at_ms: Some(201),
        started_at_ms: Some(202),
        ..completed("j1", "w1:c1:7", 400, "ok")
    };
    assert!(l.record_outcome(&rec).await.unwrap());
    let done = must_get(l, "j1").await;
    assert_eq!(done.state, "completed");
    assert_eq!((done.attempts, done.backend_calls), (1, 1));

    l.mark_acked("w1:c1:7", 401).await.unwrap();
    // Unknown keys are fine: best effort.
    l.mark_acked("nope", 401).await.unwrap();
    let rows = l.attempts("j1").await.unwrap();
    assert_eq!(rows.len(), 1);
    let row = &rows[0];
    assert_eq!(row.attempt_key, "w1:c1:7");
    assert_eq!(row.job_id, "j1");
    assert_eq!(row.attempt, 1);
    assert_eq!(row.worker, "w1");
    assert!(!row.redelivered);
    assert!(row.model_called);
    assert_eq!(row.received_at_ms, Some(200));
    assert_eq!(row.checked_at_ms, Some(201));
    assert_eq!(row.started_at_ms, Some(202));
    assert_eq!(row.finished_at_ms, Some(399));
    assert_eq!(row.acked_at_ms, Some(401));
    assert_eq!(row.decision.as_deref(), Some("ack"));
    assert_eq!(row.state.as_deref(), Some("completed"));
}

async fn redelivery_after_a_stored_outcome(db: &TestDb) {
    let l = &db.ledger;
    l.record_accepted(&accepted("j1", "chat", 100, 60_000))
        .await
        .unwrap();
    l.record_start(&start("j1", "w1:c1:1", 1, 200))
        .await
        .unwrap();
    assert!(
        l.record_outcome(&completed("j1", "w1:c1:1", 400, "ok"))
            .await
            .unwrap()
    );
    // The ack was lost (connection closed): the broker redelivers to another worker.
    let info = l.receipt_info("j1").await.unwrap();
    assert!(info.already_recorded);
    assert_eq!(info.prior_starts, 1);
    let dup = OutcomeRecord {
        decision: Decision::Ack,
        redelivered: true,
        attempt: 2,
        worker: "w2".to_owned(),
        ..outcome("j1", "w2:c9:1", State::Completed, 600)
    };
    assert!(!l.record_outcome(&dup).await.unwrap());
    let job = must_get(l, "j1").await;
    assert_eq!(job.state, "completed");
    assert_eq!(job.worker.as_deref(), Some("w1"));
    assert_eq!(job.recorded_at_ms, Some(400));
    assert_eq!((job.attempts, job.backend_calls), (2, 1));
    let rows = l.attempts("j1").await.unwrap();
    assert_eq!(rows[1].decision.as_deref(), Some("ack"));
    assert!(rows[1].redelivered);
    assert!(!rows[1].model_called);
}

async fn prior_starts_count_every_started_call(db: &TestDb) {
    let l = &db.ledger;
    l.record_accepted(&accepted("j1", "chat", 100, 60_000))
        .await
        .unwrap();
    // Two deliveries that started a model call and then crashed before any outcome.
    l.record_start(&start("j1", "w1:c1:1", 1, 200))
        .await
        .unwrap();
    l.record_start(&start("j1", "w2:c2:1", 2, 300))
        .await
        .unwrap();
    // record_start replayed for the same delivery does not count twice.
    l.record_start(&start("j1", "w2:c2:1", 2, 300))
        .await
        .unwrap();
    let info = l.receipt_info("j1").await.unwrap();
    assert_eq!(
        info,
        ReceiptInfo {
            already_recorded: false,
            prior_starts: 2,
            cancel_requested: false
        }
    );
    let job = must_get(l, "j1").await;
    assert_eq!((job.attempts, job.backend_calls), (2, 2));
    assert_eq!(job.state, "running");

    // The third delivery gives up without calling the model.
    let rec = OutcomeRecord {
        reason: Some(Reason::Backend("crash_loop".into())),
        attempt: 3,
        decision: Decision::DeadLetter,
        ..outcome("j1", "w1:c3:1", State::Failed, 500)
    };
    assert!(l.record_outcome(&rec).await.unwrap());
    let job = must_get(l, "j1").await;
    assert_eq!(job.state, "failed");
    assert_eq!(job.reason.as_deref(), Some("crash_loop"));
    assert_eq!((job.attempts, job.backend_calls), (3, 2));
    assert_eq!(l.receipt_info("j1").await.unwrap().prior_starts, 2);

    // A late record_start never moves a terminal job back to running.
    l.record_start(&start("j1", "w3:c4:1", 4, 700))
        .await
        .unwrap();
    let job = must_get(l, "j1").await;
    assert_eq!(job.state, "failed");
    assert_eq!(job.started_at_ms, None);
    assert_eq!((job.attempts, job.backend_calls), (4, 3));

    let keys: Vec<_> = l
        .attempts("j1")
        .await
        .unwrap()
        .into_iter()
        .map(|a| (a.attempt, a.attempt_key))
        .collect();
    assert_eq!(
        keys,
        vec![
            (1, "w1:c1:1".to_owned()),
            (2, "w2:c2:1".to_owned()),
            (3, "w1:c3:1".to_owned()),
            (4, "w3:c4:1".to_owned()),
        ]
    );
}

async fn non_terminal_outcome_moves_the_live_state_only(db: &TestDb) {
    let l = &db.ledger;
    l.record_accepted(&accepted("j1", "chat", 100, 60_000))
        .await
        .unwrap();
    l.record_start(&start("j1", "a1", 1, 200)).await.unwrap();
    // A retryable failure: back to the queue, the job is `accepted` again.
    let retry = OutcomeRecord {
        decision: Decision::Retry,
        reason: Some(Reason::Backend("backend_unavailable".into())),
        model_called: true,
        ..outcome("j1", "a1", State::Accepted, 300)
    };
    assert!(!l.record_outcome(&retry).await.unwrap());
    let job = must_get(l, "j1").await;
    assert_eq!(job.state, "accepted");
    assert_eq!(job.recorded_at_ms, None);
    assert_eq!((job.attempts, job.backend_calls), (1, 1));
    assert!(!l.receipt_info("j1").await.unwrap().already_recorded);
    let rows = l.attempts("j1").await.unwrap();
    assert_eq!(rows[0].decision.as_deref(), Some("retry"));
    assert_eq!(rows[0].started_at_ms, Some(202), "kept from record_start");

    assert!(
        l.record_outcome(&completed("j1", "a2", 900, "ok"))
            .await
            .unwrap()
    );
    // A non-terminal write after the terminal one changes nothing.
    assert!(
        !l.record_outcome(&outcome("j1", "a3", State::Running, 950))
            .await
            .unwrap()
    );
    let job = must_get(l, "j1").await;
    assert_eq!(job.state, "completed");
    // Issue #33: the failed call counts as model time, and as wasted (it did not complete);
    // the recorded call's `latency_ms` is the last one's.
    assert_eq!(job.latency_ms, Some(19));
    assert_eq!(
        (job.model_ms, job.wasted_model_ms),
        ((299 - 202) + (899 - 880), 299 - 202)
    );
}

async fn record_terminal_without_accepted_row(db: &TestDb) {
    let l = &db.ledger;
    let rec = OutcomeRecord {
        reason: Some(Reason::Backend("expired".into())),
        decision: Decision::Ack,
        worker: String::new(),
        ..outcome("j1", "", State::ExpiredBeforeReceive, 700)
    };
    assert!(l.record_terminal(&rec).await.unwrap());
    assert!(!l.record_terminal(&rec).await.unwrap());
    let job = must_get(l, "j1").await;
    assert_eq!(job.state, "expired_before_receive");
    assert_eq!(job.reason.as_deref(), Some("expired"));
    assert_eq!(job.worker, None);
    assert_eq!(job.accepted_at_ms, None);
    assert_eq!((job.attempts, job.backend_calls), (0, 0));
    assert!(l.attempts("j1").await.unwrap().is_empty());
    assert!(l.receipt_info("j1").await.unwrap().already_recorded);

    // A rejected body, traced with its delivery.
    let rejected = OutcomeRecord {
        kind: String::new(),
        reason: Some(Reason::Rejected(RejectReason::InvalidJson)),
        decision: Decision::DeadLetter,
        ..outcome("synthetic-1", "w1:c1:5", State::Rejected, 800)
    };
    assert!(l.record_terminal(&rejected).await.unwrap());
    let job = must_get(l, "synthetic-1").await;
    assert_eq!(job.state, "rejected");
    assert_eq!(job.kind, "");
    assert_eq!(job.attempts, 1);
}

async fn worker_before_producer_backfills_the_inventory(db: &TestDb) {
    let l = &db.ledger;
    // The worker finished before the producer's inventory write landed.
    l.record_start(&start("j1", "a1", 1, 200)).await.unwrap();
    assert!(
        l.record_outcome(&completed("j1", "a1", 400, "ok"))
            .await
            .unwrap()
    );
    assert_eq!(l.payload_hash("j1").await.unwrap(), None);
    assert!(
        !l.record_accepted(&accepted("j1", "chat", 150, 60_000))
            .await
            .unwrap()
    );
    let job = must_get(l, "j1").await;
    assert_eq!(job.state, "completed");
    assert_eq!(job.accepted_at_ms, Some(150));
    assert_eq!(job.trace_id.as_deref(), Some("trace-j1"));
    assert_eq!(
        l.payload_hash("j1").await.unwrap().as_deref(),
        Some("hash-j1")
    );
    // Only once: a second producer write (id reuse) changes nothing.
    let reuse = AcceptedJob {
        payload_hash: "other".to_owned(),
        ..accepted("j1", "chat", 999, 60_000)
    };
    assert!(!l.record_accepted(&reuse).await.unwrap());
    assert_eq!(must_get(l, "j1").await.accepted_at_ms, Some(150));
    assert_eq!(
        l.payload_hash("j1").await.unwrap().as_deref(),
        Some("hash-j1")
    );
}

async fn list_filters_by_state_and_kind(db: &TestDb) {
    let l = &db.ledger;
    for (id, kind, at) in [
        ("a", "chat", 10),
        ("b", "embed", 20),
        ("c", "chat", 30),
        ("d", "chat", 40),
    ] {
        l.record_accepted(&accepted(id, kind, at, 60_000))
            .await
            .unwrap();
    }
    // d completes first (recorded 50), b later (recorded 60).
    l.record_outcome(&completed("d", "kd", 50, "x"))
        .await
        .unwrap();
    l.record_outcome(&OutcomeRecord {
        kind: "embed".to_owned(),
        ..completed("b", "kb", 60, "y")
    })
    .await
    .unwrap();

    let ids = |jobs: Vec<JobRecord>| jobs.into_iter().map(|j| j.job_id).collect::<Vec<_>>();
    let all = l.list(&ListFilter::default()).await.unwrap();
    assert_eq!(ids(all), ["a", "c", "d", "b"]);
    let chat = ListFilter {
        kind: Some("chat".to_owned()),
        ..ListFilter::default()
    };
    assert_eq!(ids(l.list(&chat).await.unwrap()), ["a", "c", "d"]);
    let completed = ListFilter {
        state: Some("completed".to_owned()),
        ..ListFilter::default()
    };
    assert_eq!(ids(l.list(&completed).await.unwrap()), ["d", "b"]);
    let both = ListFilter {
        state: Some("completed".to_owned()),
        kind: Some("embed".to_owned()),
        limit: None,
        tenant: None,
    };
    assert_eq!(ids(l.list(&both).await.unwrap()), ["b"]);
    let limited = ListFilter {
        state: Some("accepted".to_owned()),
        limit: Some(1),
        ..ListFilter::default()
    };
    assert_eq!(ids(l.list(&limited).await.unwrap()), ["a"]);
    let only_limit = ListFilter {
        limit: Some(2),
        ..ListFilter::default()
    };
    assert_eq!(ids(l.list(&only_limit).await.unwrap()), ["a", "c"]);
    let zero = ListFilter {
        limit: Some(-1),
        ..ListFilter::default()
    };
    assert!(l.list(&zero).await.unwrap().is_empty());
    let none = ListFilter {
        state: Some("unknown".to_owned()),
        ..ListFilter::default()
    };
    assert!(l.list(&none).await.unwrap().is_empty());
}

async fn counts_by_state_in_state_order(db: &TestDb) {
    let l = &db.ledger;
    assert!(l.counts_by_state().await.unwrap().is_empty());
    for id in ["a", "b", "c", "d", "e"] {
        l.record_accepted(&accepted(id, "chat", 10, 60_000))
            .await
            .unwrap();
    }
    l.record_start(&start("a", "ka", 1, 20)).await.unwrap();
    l.record_outcome(&completed("b", "kb", 30, "x"))
        .await
        .unwrap();
    l.record_outcome(&completed("c", "kc", 30, "x"))
        .await
        .unwrap();
    l.record_outcome(&outcome("d", "kd", State::Failed, 30))
        .await
        .unwrap();
    l.record_terminal(&outcome("z", "", State::Rejected, 30))
        .await
        .unwrap();
    let counts = l.counts_by_state().await.unwrap();
    let expected: Vec<(String, i64)> = [
        ("accepted", 1),
        ("running", 1),
        ("completed", 2),
        ("failed", 1),
        ("rejected", 1),
    ]
    .into_iter()
    .map(|(s, n)| (s.to_owned(), n))
    .collect();
    assert_eq!(counts, expected);
}

async fn mark_unknown_only_after_deadline_plus_grace(db: &TestDb) {
    let l = &db.ledger;
    l.record_accepted(&accepted("a", "chat", 10, 1_000))
        .await
        .unwrap();
    l.record_accepted(&accepted("b", "chat", 10, 1_000))
        .await
        .unwrap();
    l.record_start(&AttemptStart {
        expires_at_ms: 1_000,
        ..start("b", "kb", 1, 500)
    })
    .await
    .unwrap();
    l.record_accepted(&accepted("c", "chat", 10, 5_000))
        .await
        .unwrap();
    l.record_accepted(&accepted("d", "chat", 10, 100))
        .await
        .unwrap();
    l.record_outcome(&OutcomeRecord {
        expires_at_ms: Some(100),
        ..completed("d", "kd", 90, "x")
    })
    .await
    .unwrap();

    // Deadline passed but not deadline + grace (and `==` is not past).
    assert!(l.mark_unknown(1_500, 1_000).await.unwrap().is_empty());
    assert!(l.mark_unknown(2_000, 1_000).await.unwrap().is_empty());
    assert_eq!(l.mark_unknown(2_001, 1_000).await.unwrap(), ["a", "b"]);
    assert!(l.mark_unknown(2_001, 1_000).await.unwrap().is_empty());
    assert!(l.mark_unknown(3_000, 1_000).await.unwrap().is_empty());

    let a = must_get(l, "a").await;
    assert_eq!(a.state, "unknown");
    assert_eq!(a.reason.as_deref(), Some("no_outcome_after_deadline"));
    assert_eq!(a.recorded_at_ms, Some(2_001));
    assert_eq!(must_get(l, "b").await.state, "unknown");
    assert_eq!(must_get(l, "c").await.state, "accepted");
    assert_eq!(must_get(l, "d").await.state, "completed");
    assert_eq!(a.reconciled_at_ms, Some(2_001));
    assert_eq!(must_get(l, "c").await.reconciled_at_ms, None);
    assert_eq!(must_get(l, "d").await.reconciled_at_ms, None);
    assert!(l.receipt_info("a").await.unwrap().already_recorded);
    // Marking again later moves nothing: not the time, not the reason.
    assert!(
        l.mark_unknown(9_000, 0)
            .await
            .unwrap()
            .contains(&"c".to_owned())
    );
    assert_eq!(must_get(l, "a").await, a);
    assert_eq!(must_get(l, "c").await.reconciled_at_ms, Some(9_000));
    // Huge grace never overflows.
    assert!(l.mark_unknown(i64::MIN, i64::MAX).await.unwrap().is_empty());
}

async fn records_since_filters_by_recorded_time(db: &TestDb) {
    let l = &db.ledger;
    l.record_accepted(&accepted("pending", "chat", 10, 60_000))
        .await
        .unwrap();
    for (id, at) in [("c", 300), ("a", 100), ("b", 200), ("b2", 200)] {
        l.record_outcome(&completed(id, &format!("k{id}"), at, "x"))
            .await
            .unwrap();
    }
    let ids = |jobs: Vec<JobRecord>| jobs.into_iter().map(|j| j.job_id).collect::<Vec<_>>();
    assert_eq!(
        ids(l.records_since(0).await.unwrap()),
        ["a", "b", "b2", "c"]
    );
    assert_eq!(ids(l.records_since(200).await.unwrap()), ["b", "b2", "c"]);
    assert_eq!(ids(l.records_since(201).await.unwrap()), ["c"]);
    assert!(l.records_since(301).await.unwrap().is_empty());
}

async fn concurrent_terminal_writes_have_one_winner(db: &TestDb) {
    let ledger = Arc::new(db.ledger.clone());
    ledger
        .record_accepted(&accepted("j1", "chat", 10, 60_000))
        .await
        .unwrap();
    let mut tasks = Vec::new();
    for i in 0..50u32 {
        let ledger = ledger.clone();
        tasks.push(tokio::spawn(async move {
            let rec = if i % 2 == 0 {
                completed(
                    "j1",
                    &format!("w{i}:c:1"),
                    1_000 + i64::from(i),
                    &format!("r{i}"),
                )
            } else {
                OutcomeRecord {
                    reason: Some(Reason::Backend(format!("r{i}"))),
                    ..outcome(
                        "j1",
                        &format!("w{i}:c:1"),
                        State::Failed,
                        1_000 + i64::from(i),
                    )
                }
            };
            (i, ledger.record_outcome(&rec).await.unwrap())
        }));
    }
    let mut winners = Vec::new();
    for task in tasks {
        let (i, wrote) = task.await.unwrap();
        if wrote {
            winners.push(i);
        }
    }
    assert_eq!(winners.len(), 1, "winners: {winners:?}");
    let i = winners[0];
    let job = must_get(&ledger, "j1").await;
    assert_eq!(job.recorded_at_ms, Some(1_000 + i64::from(i)));
    if i % 2 == 0 {
        assert_eq!(job.state, "completed");
        assert_eq!(job.result, Some(format!("r{i}")));
    } else {
        assert_eq!(job.state, "failed");
        assert_eq!(job.reason, Some(format!("r{i}")));
    }
    assert_eq!(job.attempts, 50);
    assert_eq!(job.backend_calls, 25);
    assert_eq!(ledger.attempts("j1").await.unwrap().len(), 50);
}

async fn invalid_input_is_fatal(db: &TestDb) {
    let l = &db.ledger;
    // (An unknown state, reason or decision cannot be written: they are typed.)
    let no_key = outcome("j1", "", State::Completed, 10);
    let err = l.record_outcome(&no_key).await.unwrap_err();
    assert!(matches!(err, StoreError::Fatal(_)), "{err:?}");
    assert!(err.to_string().contains("attempt_key"), "{err}");
    let live = outcome("j1", "a1", State::Running, 10);
    assert!(matches!(
        l.record_terminal(&live).await,
        Err(StoreError::Fatal(_))
    ));
    assert_eq!(l.get("j1").await.unwrap(), None, "nothing written");
}

async fn group_commit_writes_many_in_one_batch(db: &TestDb) {
    let l = &db.ledger;
    let batch = vec![
        LedgerWrite::Start(start("g1", "w1:c1:1", 1, 200)),
        LedgerWrite::outcome(OutcomeRecord {
            reason: Some(Reason::Refused(
                Stage::Receipt,
                RefusalCause::DeadlinePassed,
            )),
            ..outcome("g2", "w1:c1:2", State::ExpiredNotStarted, 210)
        }),
        LedgerWrite::outcome(completed("g3", "w1:c1:3", 220, "three")),
        // A second delivery of g3 in the same batch: the first outcome stays.
        LedgerWrite::outcome(OutcomeRecord {
            reason: Some(Reason::Backend("boom".into())),
            ..outcome("g3", "w1:c1:4", State::Failed, 230)
        }),
        LedgerWrite::outcome(outcome("g4", "w1:c1:5", State::Running, 240)),
    ];
    let wrote = l.write_batch(&batch).await.unwrap();
    assert_eq!(wrote, vec![false, true, true, false, false]);

    let g1 = must_get(l, "g1").await;
    assert_eq!(g1.state, "running");
    assert_eq!((g1.attempts, g1.backend_calls), (1, 1));
    assert_eq!(must_get(l, "g2").await.state, "expired_not_started");
    let g3 = must_get(l, "g3").await;
    assert_eq!(
        (g3.state.as_str(), g3.result.as_deref()),
        ("completed", Some("three"))
    );
    assert_eq!(g3.attempts, 2, "both deliveries are attempts");
    assert_eq!(must_get(l, "g4").await.state, "running");

    // The start's outcome in a later batch finishes g1 with one call counted.
    let later = [LedgerWrite::outcome(completed("g1", "w1:c1:1", 400, "one"))];
    assert_eq!(l.write_batch(&later).await.unwrap(), vec![true]);
    let g1 = must_get(l, "g1").await;
    assert_eq!((g1.state.as_str(), g1.backend_calls), ("completed", 1));
    assert_eq!(l.write_batch(&[]).await.unwrap(), Vec::<bool>::new());
}

async fn group_commit_of_a_large_batch_uses_several_statements(db: &TestDb) {
    let l = &db.ledger;
    // 300 jobs already terminal (their second outcome must not win), then one batch of
    // 600 starts + 600 outcomes over 900 jobs: more rows than one statement holds.
    let old: Vec<LedgerWrite> = (0..300)
        .map(|i| LedgerWrite::outcome(completed(&format!("old{i}"), &format!("o{i}"), 10, "first")))
        .collect();
    assert!(l.write_batch(&old).await.unwrap().iter().all(|w| *w));
    let mut batch = Vec::new();
    for i in 0..600 {
        batch.push(LedgerWrite::Start(start(
            &format!("new{i}"),
            &format!("n{i}"),
            1,
            100,
        )));
    }
    for i in 0..300 {
        batch.push(LedgerWrite::outcome(OutcomeRecord {
            reason: Some(Reason::Backend("late".into())),
            ..outcome(
                &format!("old{i}"),
                &format!("o{i}-again"),
                State::Failed,
                200,
            )
        }));
        batch.push(LedgerWrite::outcome(completed(
            &format!("fresh{i}"),
            &format!("f{i}"),
            200,
            "ok",
        )));
    }
    let wrote = l.write_batch(&batch).await.unwrap();
    assert_eq!(wrote.len(), 1_200);
    assert!(
        wrote[..600].iter().all(|w| !*w),
        "starts never write a terminal outcome"
    );
    for i in 0..300 {
        assert!(!wrote[600 + 2 * i], "old{i} already had its outcome");
        assert!(wrote[601 + 2 * i], "fresh{i} is written by this batch");
    }
    let old7 = must_get(l, "old7").await;
    assert_eq!(
        (old7.state.as_str(), old7.result.as_deref()),
        ("completed", Some("first"))
    );
    assert_eq!(old7.attempts, 2);
    let new599 = must_get(l, "new599").await;
    assert_eq!(
        (new599.state.as_str(), new599.backend_calls),
        ("running", 1)
    );
    assert_eq!(must_get(l, "fresh299").await.state, "completed");
    let counts = l.counts_by_state().await.unwrap();
    let n = |s: &str| counts.iter().find(|(k, _)| k == s).map_or(0, |(_, n)| *n);
    assert_eq!((n("completed"), n("running")), (600, 600));
}

async fn receipt_info_many_matches_receipt_info(db: &TestDb) {
    let l = &db.ledger;
    l.record_start(&start("r-running", "k1", 1, 100))
        .await
        .unwrap();
    l.record_start(&start("r-done", "k2", 1, 100))
        .await
        .unwrap();
    l.record_outcome(&completed("r-done", "k2", 200, "ok"))
        .await
        .unwrap();
    l.record_accepted(&accepted("r-accepted", "chat", 100, 60_000))
        .await
        .unwrap();
    // 300 more ids than one read chunk, duplicates and a missing one.
    let mut ids: Vec<String> = ["r-running", "r-done", "r-accepted", "r-missing", "r-done"]
        .map(String::from)
        .to_vec();
    ids.extend((0..300).map(|i| format!("r-none-{i}")));
    let many = l.receipt_info_many(&ids).await.unwrap();
    for id in &ids {
        let one = l.receipt_info(id).await.unwrap();
        assert_eq!(many.get(id).copied().unwrap_or_default(), one, "{id}");
    }
    assert!(many["r-done"].already_recorded);
    assert_eq!(many["r-running"].prior_starts, 1);
    assert!(!many.contains_key("r-missing"));
    assert_eq!(many.len(), 3);
}

async fn group_commit_with_an_invalid_item_writes_nothing(db: &TestDb) {
    let l = &db.ledger;
    let bad = outcome("b2", "", State::Completed, 10);
    assert!(LedgerWrite::outcome(bad.clone()).validate().is_err());
    assert!(
        LedgerWrite::Start(start("b1", "", 1, 5))
            .validate()
            .is_err()
    );
    let batch = [
        LedgerWrite::outcome(completed("b1", "k1", 10, "ok")),
        LedgerWrite::outcome(bad),
    ];
    let err = l.write_batch(&batch).await.unwrap_err();
    assert!(matches!(err, StoreError::Fatal(_)), "{err:?}");
    assert!(err.to_string().contains("`b2`"), "{err}");
    assert_eq!(l.get("b1").await.unwrap(), None, "all or nothing");
}

/// The dead-letter processor's writes (no attempt, first outcome wins) go through the same
/// group commit as a worker's: [`LedgerWrite::Terminal`] takes an empty attempt key, and
/// refuses a state that is not terminal before the transaction opens.
async fn group_commit_takes_terminal_outcomes_without_an_attempt(db: &TestDb) {
    let l = &db.ledger;
    let expired = OutcomeRecord {
        decision: Decision::Ack,
        ..outcome("t1", "", State::ExpiredBeforeReceive, 700)
    };
    assert!(LedgerWrite::outcome(expired.clone()).validate().is_err());
    let batch = [
        LedgerWrite::terminal(expired.clone()),
        LedgerWrite::outcome(completed("t2", "w1:c1:1", 710, "ok")),
    ];
    assert_eq!(l.write_batch(&batch).await.unwrap(), vec![true, true]);
    assert_eq!(
        l.write_batch(&[LedgerWrite::terminal(expired)])
            .await
            .unwrap(),
        vec![false],
        "the first outcome stays"
    );
    let job = must_get(l, "t1").await;
    assert_eq!(job.state, "expired_before_receive");
    assert!(l.attempts("t1").await.unwrap().is_empty());
    let live = LedgerWrite::terminal(outcome("t3", "", State::Running, 720));
    let err = l.write_batch(&[live]).await.unwrap_err();
    assert!(matches!(err, StoreError::Fatal(_)), "{err:?}");
    assert_eq!(l.get("t3").await.unwrap(), None);
}

// ---------------------------------------------------------------------------------------
// Backend-specific cases

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_locked_by_another_connection_is_unavailable() {
    let db = TestDb::new(Backend::Sqlite).await;
    let l = &db.ledger;
    l.record_accepted(&accepted("j1", "chat", 10, 60_000))
        .await
        .unwrap();

    let mut other = sqlx::SqliteConnection::connect(&db.url).await.unwrap();
    sqlx::query("BEGIN EXCLUSIVE")
        .execute(&mut other)
        .await
        .unwrap();

    let started = Instant::now();
    let err = l
        .record_outcome(&completed("j1", "a1", 100, "x"))
        .await
        .unwrap_err();
    let waited = started.elapsed();
    assert!(matches!(err, StoreError::Unavailable(_)), "{err:?}");
    assert!(err.is_retryable());
    assert!(waited < Duration::from_secs(10), "waited {waited:?}");
    // Reads still work under WAL while the writer is locked out.
    assert_eq!(must_get(l, "j1").await.state, "accepted");

    sqlx::query("ROLLBACK").execute(&mut other).await.unwrap();
    other.close().await.unwrap();
    assert!(
        l.record_outcome(&completed("j1", "a1", 100, "x"))
            .await
            .unwrap()
    );
    assert_eq!(must_get(l, "j1").await.state, "completed");
    l.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_creates_the_file_and_uses_wal() {
    let db = TestDb::new(Backend::Sqlite).await;
    let Cleanup::Dir(dir) = &db.cleanup else {
        unreachable!()
    };
    assert!(dir.join("ledger.db").exists());
    let mut conn = sqlx::SqliteConnection::connect(&db.url).await.unwrap();
    let mode: String = sqlx::query("PRAGMA journal_mode")
        .fetch_one(&mut conn)
        .await
        .unwrap()
        .try_get(0)
        .unwrap();
    assert_eq!(mode, "wal");
    conn.close().await.unwrap();
    db.ledger.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_unreachable_is_unavailable() {
    let started = Instant::now();
    let err = Ledger::connect("postgres://postgres@127.0.0.1:1/test")
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::Unavailable(_)), "{err:?}");
    assert!(started.elapsed() < Duration::from_secs(10));
}

#[tokio::test]
async fn unknown_url_scheme_is_fatal_and_names_the_accepted_ones() {
    for url in ["mysql://root@localhost/db", "ledger.db", "http://x"] {
        let err = Ledger::connect(url).await.unwrap_err();
        let StoreError::Fatal(message) = &err else {
            panic!("{url}: {err:?}")
        };
        assert!(message.contains("sqlite://"), "{message}");
        assert!(message.contains("postgres://"), "{message}");
        assert!(!message.contains("root@"), "url leaked: {message}");
    }
    let err = Ledger::connect("mysql://root@localhost/db")
        .await
        .unwrap_err();
    assert!(err.to_string().contains("`mysql`"), "{err}");
}

#[test]
fn admin_url_rewriting() {
    assert_eq!(
        with_database("postgres://postgres@127.0.0.1:5432/test", "x"),
        "postgres://postgres@127.0.0.1:5432/x"
    );
    assert_eq!(
        with_database("postgres://u:p@h/test?sslmode=disable", "x"),
        "postgres://u:p@h/x?sslmode=disable"
    );
    assert_eq!(with_database("postgres://h", "x"), "postgres://h/x");
}

async fn mark_acked_many_sets_every_ack_in_one_write(db: &TestDb) {
    let l = &db.ledger;
    // More than one multi-row statement (256 rows each), and a remainder.
    let n = 300i64;
    let writes: Vec<LedgerWrite> = (0..n)
        .map(|i| {
            LedgerWrite::outcome(completed(
                &format!("m{i}"),
                &format!("w:c:{i}"),
                100 + i,
                "ok",
            ))
        })
        .collect();
    assert!(l.write_batch(&writes).await.unwrap().iter().all(|w| *w));
    let mut acks: Vec<(String, i64)> = (0..n).map(|i| (format!("w:c:{i}"), 500 + i)).collect();
    acks.push(("no-such-attempt".into(), 1));
    l.mark_acked_many(&acks).await.unwrap();
    l.mark_acked_many(&[]).await.unwrap();
    for i in 0..n {
        let rows = l.attempts(&format!("m{i}")).await.unwrap();
        assert_eq!(rows[0].acked_at_ms, Some(500 + i), "m{i}");
    }
}

async fn ack_marks_ride_along_with_a_group_commit(db: &TestDb) {
    let l = &db.ledger;
    assert!(
        l.record_outcome(&completed("early", "w:c:1", 100, "ok"))
            .await
            .unwrap()
    );
    // The next batch's writes and the earlier attempt's ack mark: one transaction.
    let wrote = l
        .write_batch_marking_acked(
            &[LedgerWrite::outcome(completed("late", "w:c:2", 200, "ok"))],
            &[("w:c:1".into(), 150)],
        )
        .await
        .unwrap();
    assert_eq!(wrote, vec![true]);
    assert_eq!(l.attempts("early").await.unwrap()[0].acked_at_ms, Some(150));
    assert_eq!(l.attempts("late").await.unwrap()[0].acked_at_ms, None);
    assert_eq!(l.get("late").await.unwrap().unwrap().state, "completed");
    // An invalid write fails the call before anything, the marks included, is written.
    let bad = completed("bad", "", 300, "ok");
    assert!(
        l.write_batch_marking_acked(&[LedgerWrite::outcome(bad)], &[("w:c:2".into(), 250)])
            .await
            .is_err()
    );
    assert_eq!(l.attempts("late").await.unwrap()[0].acked_at_ms, None);
}

async fn ingress_claims_an_id_once_then_stamps_or_releases_it(db: &TestDb) {
    let l = Arc::new(db.ledger.clone());
    // Concurrent claims of one new id: exactly one owner.
    let mut tasks = Vec::new();
    for _ in 0..16 {
        let l = l.clone();
        tasks.push(tokio::spawn(async move {
            l.claim_accepted(&accepted("race", "chat", 10, 60_000))
                .await
                .unwrap()
        }));
    }
    let mut owners = 0;
    for t in tasks {
        owners += usize::from(t.await.unwrap());
    }
    assert_eq!(owners, 1, "one claim wins");

    // A claim is `accepted` but not stamped until the publish is confirmed.
    assert!(
        l.claim_accepted(&accepted("c1", "chat", 10, 60_000))
            .await
            .unwrap()
    );
    let pending = must_get(&l, "c1").await;
    assert_eq!(
        (pending.state.as_str(), pending.accepted_at_ms),
        ("accepted", None)
    );
    assert_eq!(
        l.payload_hash("c1").await.unwrap().as_deref(),
        Some("hash-c1")
    );
    assert!(
        !l.claim_accepted(&accepted("c1", "chat", 11, 60_000))
            .await
            .unwrap()
    );

    // A failed publish releases it (only with the claimant's payload hash); the id is free.
    assert!(!l.release_claim("c1", "hash-other").await.unwrap());
    assert!(l.get("c1").await.unwrap().is_some());
    assert!(l.release_claim("c1", "hash-c1").await.unwrap());
    assert!(l.get("c1").await.unwrap().is_none());
    assert!(
        l.claim_accepted(&accepted("c1", "chat", 20, 60_000))
            .await
            .unwrap()
    );

    // A confirmed publish stamps it; a stamped claim is never released.
    l.record_accepted(&accepted("c1", "chat", 20, 60_000))
        .await
        .unwrap();
    assert_eq!(must_get(&l, "c1").await.accepted_at_ms, Some(20));
    assert!(!l.release_claim("c1", "hash-c1").await.unwrap());
    assert_eq!(must_get(&l, "c1").await.state, "accepted");

    // A claim a worker already picked up (the message reached the broker although the
    // confirm did not) is not released either.
    assert!(
        l.claim_accepted(&accepted("c2", "chat", 10, 60_000))
            .await
            .unwrap()
    );
    l.record_start(&start("c2", "k2", 1, 30)).await.unwrap();
    assert!(!l.release_claim("c2", "hash-c2").await.unwrap());
    assert_eq!(must_get(&l, "c2").await.state, "running");

    // A claim left behind by a crashed ingress is reconciled like any accepted job.
    assert!(
        l.claim_accepted(&accepted("c3", "chat", 10, 1_000))
            .await
            .unwrap()
    );
    assert!(
        l.mark_unknown(5_000, 100)
            .await
            .unwrap()
            .contains(&"c3".to_owned())
    );
}

/// A job reconciled `unknown` and a (hypothetical) late outcome for it, as the dead-letter
/// processor writes one: no attempt row.
fn expired_late(job_id: &str, recorded_at_ms: i64) -> OutcomeRecord {
    OutcomeRecord {
        reason: Some(Reason::BrokerTtlExpired),
        decision: Decision::DeadLetterProcessed,
        ..outcome(job_id, "", State::ExpiredBeforeReceive, recorded_at_ms)
    }
}

/// `unknown` is the only terminal state a real outcome replaces, once; when it was
/// reconciled is kept, and the job row and its attempt rows agree afterwards.
async fn a_late_outcome_replaces_unknown_once(db: &TestDb) {
    let l = &db.ledger;
    l.record_accepted(&accepted("j1", "chat", 10, 1_000))
        .await
        .unwrap();
    assert_eq!(l.mark_unknown(5_000, 1_000).await.unwrap(), ["j1"]);
    let marked = must_get(l, "j1").await;
    assert_eq!(
        (marked.state.as_str(), marked.reconciled_at_ms),
        ("unknown", Some(5_000))
    );
    assert_eq!(l.late_outcomes().await.unwrap(), 0);

    // The real outcome arrives late: it is the job's one recorded outcome (`true`).
    let late = OutcomeRecord {
        expires_at_ms: Some(1_000),
        ..completed("j1", "w1:c1:1", 6_000, "late truth")
    };
    assert!(l.record_outcome(&late).await.unwrap());
    let job = must_get(l, "j1").await;
    assert_eq!(job.state, "completed");
    assert_eq!(job.reason, None, "the reconciliation's reason is gone");
    assert_eq!(job.result.as_deref(), Some("late truth"));
    assert_eq!(job.recorded_at_ms, Some(6_000));
    assert_eq!(job.reconciled_at_ms, Some(5_000), "kept");
    assert_eq!((job.attempts, job.backend_calls), (1, 1));
    // What only the producer knew is kept too.
    assert_eq!(job.accepted_at_ms, Some(10));
    assert_eq!(job.trace_id.as_deref(), Some("trace-j1"));
    let rows = l.attempts("j1").await.unwrap();
    assert_eq!(rows.len(), 1);
    assert_eq!(
        (rows[0].state.as_deref(), rows[0].model_called),
        (Some(job.state.as_str()), true),
        "attempt row and job row agree"
    );
    assert!(l.receipt_info("j1").await.unwrap().already_recorded);
    assert_eq!(l.late_outcomes().await.unwrap(), 1);

    // A second late outcome does not replace the first real one.
    let second = OutcomeRecord {
        reason: Some(Reason::Backend("backend_error".into())),
        error: Some("boom".into()),
        ..outcome("j1", "w2:c1:1", State::Failed, 7_000)
    };
    assert!(!l.record_outcome(&second).await.unwrap());
    assert!(!l.record_terminal(&expired_late("j1", 7_100)).await.unwrap());
    // Replaying the winning delivery: still not a second write.
    assert!(!l.record_outcome(&late).await.unwrap());
    // Nor does reconciliation mark it again.
    assert!(l.mark_unknown(i64::MAX, 0).await.unwrap().is_empty());
    let now = must_get(l, "j1").await;
    assert_eq!(
        (
            now.state.as_str(),
            now.result.as_deref(),
            now.error.as_deref(),
            now.recorded_at_ms,
            now.reconciled_at_ms
        ),
        (
            "completed",
            Some("late truth"),
            None,
            Some(6_000),
            Some(5_000)
        )
    );
    // The later delivery is still traced as an attempt.
    assert_eq!(now.attempts, 2);
    assert_eq!(l.late_outcomes().await.unwrap(), 1);

    // Every real terminal state replaces `unknown` (here through `record_terminal`, as
    // the dead-letter processor writes), and is counted.
    let real = [
        State::Failed,
        State::ExpiredNotStarted,
        State::ExpiredBeforeReceive,
        State::DeadlineExceeded,
        State::Rejected,
    ];
    for (i, st) in real.into_iter().enumerate() {
        let id = format!("r{i}");
        l.record_accepted(&accepted(&id, "chat", 10, 1_000))
            .await
            .unwrap();
        assert!(l.mark_unknown(5_000, 1_000).await.unwrap().contains(&id));
        assert!(
            l.record_terminal(&outcome(&id, "", st, 8_000))
                .await
                .unwrap(),
            "{st:?} replaces unknown"
        );
        let job = must_get(l, &id).await;
        assert_eq!(
            (job.state.as_str(), job.reconciled_at_ms),
            (st.as_str(), Some(5_000))
        );
    }
    assert_eq!(l.late_outcomes().await.unwrap(), 1 + real.len() as i64);
}

/// The slow worker: its start is recorded, reconciliation gives up on it, then its
/// completion arrives through the group commit (the worker's only write path).
async fn a_slow_workers_completion_replaces_unknown_through_a_group_commit(db: &TestDb) {
    let l = &db.ledger;
    l.record_accepted(&accepted("slow", "chat", 10, 60_000))
        .await
        .unwrap();
    l.record_accepted(&accepted("fresh", "chat", 10, 60_000))
        .await
        .unwrap();
    l.record_accepted(&accepted("done", "chat", 10, 60_000))
        .await
        .unwrap();
    assert_eq!(
        l.write_batch(&[
            LedgerWrite::Start(start("slow", "w1:c1:1", 1, 100)),
            LedgerWrite::outcome(completed("done", "w1:c1:2", 200, "on time")),
        ])
        .await
        .unwrap(),
        [false, true]
    );
    assert_eq!(
        l.mark_unknown(70_000, 1_000).await.unwrap(),
        ["fresh", "slow"]
    );
    assert_eq!(must_get(l, "slow").await.state, "unknown");

    // One batch: the slow completion, the late truth for `fresh`, a second late outcome
    // for `done` (already real), a retry for `slow`'s other delivery (non-terminal).
    let batch = [
        LedgerWrite::outcome(OutcomeRecord {
            decision: Decision::Retry,
            ..outcome("fresh", "w2:c1:9", State::Accepted, 70_100)
        }),
        LedgerWrite::outcome(completed("slow", "w1:c1:1", 70_500, "slow but done")),
        LedgerWrite::outcome(completed("done", "w2:c1:3", 70_500, "again")),
        LedgerWrite::outcome(OutcomeRecord {
            reason: Some(Reason::Refused(
                Stage::Admission,
                RefusalCause::DeadlinePassed,
            )),
            ..outcome("fresh", "w2:c1:4", State::ExpiredNotStarted, 70_600)
        }),
    ];
    assert_eq!(
        l.write_batch(&batch).await.unwrap(),
        [false, true, false, true]
    );

    let slow = must_get(l, "slow").await;
    assert_eq!(
        (
            slow.state.as_str(),
            slow.result.as_deref(),
            slow.reconciled_at_ms,
            slow.recorded_at_ms
        ),
        (
            "completed",
            Some("slow but done"),
            Some(70_000),
            Some(70_500)
        )
    );
    assert_eq!((slow.attempts, slow.backend_calls), (1, 1));
    let rows = l.attempts("slow").await.unwrap();
    assert_eq!(rows[0].state.as_deref(), Some("completed"));
    assert_eq!(rows[0].started_at_ms, Some(102), "kept from the start");
    let fresh = must_get(l, "fresh").await;
    assert_eq!(
        (
            fresh.state.as_str(),
            fresh.reason.as_deref(),
            fresh.reconciled_at_ms
        ),
        (
            "expired_not_started",
            Some("admission:deadline_passed"),
            Some(70_000)
        ),
        "the retry did not move `unknown`; the real outcome did"
    );
    let done = must_get(l, "done").await;
    assert_eq!(
        (done.result.as_deref(), done.reconciled_at_ms),
        (Some("on time"), None)
    );
    assert_eq!(l.late_outcomes().await.unwrap(), 2);
}

/// A second `unknown` changes nothing: not the reason, not the times.
async fn unknown_over_unknown_changes_nothing(db: &TestDb) {
    let l = &db.ledger;
    l.record_accepted(&accepted("u1", "chat", 10, 1_000))
        .await
        .unwrap();
    assert_eq!(l.mark_unknown(3_000, 0).await.unwrap(), ["u1"]);
    let before = must_get(l, "u1").await;
    let again = OutcomeRecord {
        reason: Some(Reason::Backend("someone_else".into())),
        ..outcome("u1", "", State::Unknown, 9_000)
    };
    assert!(!l.record_terminal(&again).await.unwrap());
    assert!(
        !l.write_batch(&[LedgerWrite::outcome(OutcomeRecord {
            attempt_key: "w1:c1:1".into(),
            ..again.clone()
        })])
        .await
        .unwrap()[0]
    );
    assert!(l.mark_unknown(10_000, 0).await.unwrap().is_empty());
    let after = must_get(l, "u1").await;
    assert_eq!(
        JobRecord {
            attempts: before.attempts,
            ..after.clone()
        },
        before
    );
    assert_eq!(
        (
            after.reason.as_deref(),
            after.recorded_at_ms,
            after.reconciled_at_ms
        ),
        (Some("no_outcome_after_deadline"), Some(3_000), Some(3_000))
    );
    assert_eq!(l.late_outcomes().await.unwrap(), 0);
    // An `unknown` written over a live job (not by reconciliation) is an outcome like any
    // other: written once, without a reconciliation time.
    l.record_accepted(&accepted("u2", "chat", 10, 60_000))
        .await
        .unwrap();
    assert!(
        l.record_terminal(&outcome("u2", "", State::Unknown, 500))
            .await
            .unwrap()
    );
    assert!(
        !l.record_terminal(&outcome("u2", "", State::Unknown, 600))
            .await
            .unwrap()
    );
    let u2 = must_get(l, "u2").await;
    assert_eq!(
        (u2.state.as_str(), u2.recorded_at_ms, u2.reconciled_at_ms),
        ("unknown", Some(500), None)
    );
}

/// Many deliveries' late outcomes for one `unknown` job at once: exactly one replaces it.
async fn concurrent_late_outcomes_have_one_winner(db: &TestDb) {
    let ledger = Arc::new(db.ledger.clone());
    ledger
        .record_accepted(&accepted("j1", "chat", 10, 1_000))
        .await
        .unwrap();
    assert_eq!(ledger.mark_unknown(5_000, 0).await.unwrap(), ["j1"]);
    let mut tasks = Vec::new();
    for i in 0..40u32 {
        let ledger = ledger.clone();
        tasks.push(tokio::spawn(async move {
            let at = 6_000 + i64::from(i);
            let rec = match i % 4 {
                0 => completed("j1", &format!("w{i}:c:1"), at, &format!("r{i}")),
                1 => expired_late("j1", at),
                // A concurrent second reconciliation's `unknown` never wins over a truth.
                2 => outcome("j1", &format!("w{i}:c:1"), State::Unknown, at),
                _ => OutcomeRecord {
                    reason: Some(Reason::Backend(format!("r{i}"))),
                    ..outcome("j1", &format!("w{i}:c:1"), State::Failed, at)
                },
            };
            let wrote = if rec.attempt_key.is_empty() {
                ledger.record_terminal(&rec).await.unwrap()
            } else {
                ledger.record_outcome(&rec).await.unwrap()
            };
            (i, wrote)
        }));
    }
    let mut winners = Vec::new();
    for task in tasks {
        let (i, wrote) = task.await.unwrap();
        if wrote {
            winners.push(i);
        }
    }
    assert_eq!(winners.len(), 1, "winners: {winners:?}");
    let i = winners[0];
    assert_ne!(i % 4, 2, "a second `unknown` never wins");
    let job = must_get(&ledger, "j1").await;
    assert_eq!(job.recorded_at_ms, Some(6_000 + i64::from(i)));
    assert_eq!(job.reconciled_at_ms, Some(5_000));
    let want = match i % 4 {
        0 => "completed",
        1 => "expired_before_receive",
        _ => "failed",
    };
    assert_eq!(job.state, want);
    assert_eq!(
        job.attempts, 30,
        "every delivery with an attempt key is traced"
    );
    assert_eq!(ledger.late_outcomes().await.unwrap(), 1);
}

/// The late-outcome count: reconciled, then given a real outcome; not the jobs still
/// `unknown`, not the ones that were never reconciled.
async fn late_outcomes_count_only_replaced_unknowns(db: &TestDb) {
    let l = &db.ledger;
    assert_eq!(l.late_outcomes().await.unwrap(), 0, "empty ledger");
    for id in ["a", "b", "c", "d"] {
        l.record_accepted(&accepted(id, "chat", 10, 1_000))
            .await
            .unwrap();
    }
    l.record_outcome(&completed("a", "ka", 900, "in time"))
        .await
        .unwrap();
    assert_eq!(l.mark_unknown(2_000, 0).await.unwrap(), ["b", "c", "d"]);
    assert_eq!(l.late_outcomes().await.unwrap(), 0, "all still unknown");
    assert!(l.record_terminal(&expired_late("b", 3_000)).await.unwrap());
    assert_eq!(l.late_outcomes().await.unwrap(), 1);
    assert!(
        l.record_outcome(&completed("c", "kc", 3_100, "slow"))
            .await
            .unwrap()
    );
    assert_eq!(l.late_outcomes().await.unwrap(), 2);
    // A second late outcome for a job that already got its truth counts nothing more.
    assert!(!l.record_terminal(&expired_late("c", 3_200)).await.unwrap());
    assert_eq!(l.late_outcomes().await.unwrap(), 2);
    let counts = l.counts_by_state().await.unwrap();
    let n = |s: &str| counts.iter().find(|(k, _)| k == s).map_or(0, |(_, n)| *n);
    assert_eq!(
        (n("completed"), n("expired_before_receive"), n("unknown")),
        (2, 1, 1)
    );
    // The records carry the reconciliation time for the report.
    let recs = l.records_since(0).await.unwrap();
    let late: Vec<(&str, &str)> = recs
        .iter()
        .filter(|r| r.reconciled_at_ms.is_some() && r.state != "unknown")
        .map(|r| (r.job_id.as_str(), r.state.as_str()))
        .collect();
    assert_eq!(late, [("b", "expired_before_receive"), ("c", "completed")]);
    let listed = l
        .list(&ListFilter {
            state: Some("unknown".into()),
            ..ListFilter::default()
        })
        .await
        .unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(
        (listed[0].job_id.as_str(), listed[0].reconciled_at_ms),
        ("d", Some(2_000))
    );
}

/// Worker leases: a `running` attempt counts as live elsewhere only while its worker's
/// heartbeat is fresh, never for the asking worker itself, and no longer once settled.
async fn a_running_attempt_is_live_while_its_worker_renews_its_lease(db: &TestDb) {
    let l = &db.ledger;
    l.record_accepted(&accepted("lease-1", "chat", 100, 60_000))
        .await
        .unwrap();
    // No start yet: nothing is live.
    assert_eq!(
        l.live_attempt_elsewhere("lease-1", "w2", 0).await.unwrap(),
        None
    );
    l.record_start(&start("lease-1", "w1:c1:1", 0, 200))
        .await
        .unwrap();
    // Started, but w1 never renewed a lease (it may have died): not live.
    assert_eq!(
        l.live_attempt_elsewhere("lease-1", "w2", 0).await.unwrap(),
        None
    );
    l.heartbeat("w1", 5_000).await.unwrap();
    assert_eq!(
        l.live_attempt_elsewhere("lease-1", "w2", 4_000)
            .await
            .unwrap(),
        Some("w1".to_owned()),
        "fresh lease, running attempt: live on w1"
    );
    assert_eq!(
        l.live_attempt_elsewhere("lease-1", "w1", 4_000)
            .await
            .unwrap(),
        None,
        "never elsewhere for the worker itself"
    );
    assert_eq!(
        l.live_attempt_elsewhere("lease-1", "w2", 5_001)
            .await
            .unwrap(),
        None,
        "an expired lease: that worker is presumed dead"
    );
    l.heartbeat("w1", 9_000).await.unwrap();
    assert!(
        l.live_attempt_elsewhere("lease-1", "w2", 8_000)
            .await
            .unwrap()
            .is_some()
    );
    // The call settles: no longer live.
    assert!(
        l.record_outcome(&completed("lease-1", "w1:c1:1", 9_100, "ok"))
            .await
            .unwrap()
    );
    assert_eq!(
        l.live_attempt_elsewhere("lease-1", "w2", 8_000)
            .await
            .unwrap(),
        None
    );
}

/// The outcome carries which backend and model ran the job and the minimum runtime its
/// admission decision used; a second (duplicate) write does not change them.
async fn the_outcome_names_its_backend_model_and_min_runtime(db: &TestDb) {
    let l = &db.ledger;
    let rec = OutcomeRecord {
        backend: Some("openai".into()),
        model: Some("smollm2".into()),
        min_runtime_ms: Some(212),
        ..completed("bm-1", "w1:c1:1", 5_000, "ok")
    };
    assert!(l.record_terminal(&rec).await.unwrap());
    let job = must_get(l, "bm-1").await;
    assert_eq!(
        (
            job.backend.as_deref(),
            job.model.as_deref(),
            job.min_runtime_ms
        ),
        (Some("openai"), Some("smollm2"), Some(212))
    );
    let other = OutcomeRecord {
        backend: Some("sim".into()),
        ..rec
    };
    assert!(!l.record_terminal(&other).await.unwrap());
    assert_eq!(must_get(l, "bm-1").await.backend.as_deref(), Some("openai"));
}

/// A worker's refusal for lack of time keeps the budget its check would have admitted
/// (version 15), through a single write and a group commit; other outcomes have none.
async fn a_refusal_keeps_the_budget_that_would_have_been_admitted(db: &TestDb) {
    let l = &db.ledger;
    let refused = |id: &str| OutcomeRecord {
        reason: Some(Reason::Refused(
            Stage::Receipt,
            RefusalCause::ExpectedWaitExceedsBudget,
        )),
        min_feasible_budget_ms: Some(4_200),
        ..outcome(id, &format!("w1:{id}:1"), State::ExpiredNotStarted, 5_000)
    };
    assert!(l.record_terminal(&refused("mb-1")).await.unwrap());
    l.write_batch(&[LedgerWrite::outcome(refused("mb-2"))])
        .await
        .unwrap();
    for id in ["mb-1", "mb-2"] {
        assert_eq!(must_get(l, id).await.min_feasible_budget_ms, Some(4_200));
    }
    assert!(
        l.record_terminal(&completed("mb-3", "w1:mb-3:1", 5_000, "ok"))
            .await
            .unwrap()
    );
    assert_eq!(must_get(l, "mb-3").await.min_feasible_budget_ms, None);
}

/// A starting worker reads the call durations of its backend: completed calls and calls
/// cut at the deadline, recorded since the given time, newest `limit`, oldest first.
async fn recent_calls_are_the_durations_a_starting_worker_learns_from(db: &TestDb) {
    let l = &db.ledger;
    let call = |id: &str, state: State, reason: Option<Reason>, backend: &str, at: i64, ms| {
        OutcomeRecord {
            reason,
            backend: Some(backend.into()),
            latency_ms: ms,
            started_at_ms: Some(at - 10),
            model_called: ms.is_some(),
            kind: format!("kind-{id}"),
            ..outcome(id, &format!("w1:{id}:1"), state, at)
        }
    };
    let cut = Some(Reason::CancelledAtDeadline);
    let rows = [
        // Too old for `since`.
        call("old", State::Completed, None, "sim", 4_000, Some(900)),
        call("a", State::Completed, None, "sim", 10_000, Some(200)),
        call(
            "b",
            State::DeadlineExceeded,
            cut.clone(),
            "sim",
            11_000,
            Some(300),
        ),
        call("c", State::Completed, None, "sim", 12_000, Some(210)),
        // Another backend's call, a failed call, a job that ran out of time without a
        // call being cut, and an outcome without a call: none tells how long a call takes.
        call("other", State::Completed, None, "openai", 12_500, Some(5)),
        call("failed", State::Failed, None, "sim", 13_000, Some(7)),
        call(
            "retry",
            State::DeadlineExceeded,
            Some(Reason::RetriesExhausted),
            "sim",
            13_500,
            Some(8),
        ),
        call("none", State::Completed, None, "sim", 14_000, None),
    ];
    for r in &rows {
        assert!(l.record_terminal(r).await.unwrap(), "{}", r.job_id);
    }
    let got = l.recent_calls("sim", 5_000, 100).await.unwrap();
    let seen: Vec<(&str, u64, i64, bool)> = got
        .iter()
        .map(|c| (c.kind.as_str(), c.latency_ms, c.recorded_at_ms, c.cut))
        .collect();
    // The call cut at the deadline says so: its duration is a lower bound.
    assert_eq!(
        seen,
        vec![
            ("kind-a", 200, 10_000, false),
            ("kind-b", 300, 11_000, true),
            ("kind-c", 210, 12_000, false)
        ]
    );
    // The limit keeps the newest, still oldest first.
    let newest: Vec<u64> = (l.recent_calls("sim", 5_000, 2).await.unwrap())
        .iter()
        .map(|c| c.latency_ms)
        .collect();
    assert_eq!(newest, vec![300, 210]);
    assert!(l.recent_calls("vllm", 0, 100).await.unwrap().is_empty());
}

/// The worker's own measure of a request's size (`request_size`: approximate prompt tokens
/// and `max_tokens`) is stored with the outcome, in the job's record and in the recent
/// calls a starting worker replays, beside the server's count (`prompt_tokens`, 12 here);
/// a call recorded without it (by a binary before ledger version 12, or for a payload that
/// is not a chat request) reads `None`, its server's count kept.
async fn recent_calls_carry_the_request_size_the_worker_measured(db: &TestDb) {
    let l = &db.ledger;
    let call = |id: &str, at: i64, size: Option<RequestSize>| OutcomeRecord {
        backend: Some("sim".into()),
        kind: format!("kind-{id}"),
        request_size: size,
        ..completed(id, &format!("w1:{id}:1"), at, "ok")
    };
    let capped = RequestSize {
        prompt_tokens: 613,
        max_tokens: Some(200),
    };
    let uncapped = RequestSize {
        prompt_tokens: 7,
        max_tokens: None,
    };
    // "capped" was accepted first (the outcome updates its row), "uncapped" was not (the
    // outcome inserts it); "unsized" goes through a group commit.
    l.record_accepted(&accepted("capped", "kind-capped", 9_000, 60_000))
        .await
        .unwrap();
    assert!(
        l.record_outcome(&call("capped", 10_000, Some(capped)))
            .await
            .unwrap()
    );
    assert!(
        l.record_terminal(&call("uncapped", 11_000, Some(uncapped)))
            .await
            .unwrap()
    );
    assert_eq!(
        l.write_batch(&[LedgerWrite::outcome(call("unsized", 12_000, None))])
            .await
            .unwrap(),
        vec![true]
    );
    // A row as a version-11 binary wrote it: no request columns named.
    db.exec(
        "INSERT INTO jobs (job_id, kind, state, recorded_at_ms, latency_ms, prompt_tokens, backend) \
         VALUES ('v11', 'kind-v11', 'completed', 13000, 40, 9, 'sim')",
    )
    .await;
    let got: Vec<(String, Option<RequestSize>, Option<u64>)> =
        (l.recent_calls("sim", 5_000, 100).await.unwrap())
            .into_iter()
            .map(|c| (c.kind, c.size, c.prompt_tokens))
            .collect();
    assert_eq!(
        got,
        vec![
            ("kind-capped".to_owned(), Some(capped), Some(12)),
            ("kind-uncapped".to_owned(), Some(uncapped), Some(12)),
            ("kind-unsized".to_owned(), None, Some(12)),
            ("kind-v11".to_owned(), None, Some(9)),
        ]
    );
    let stored = |r: JobRecord| (r.request_tokens, r.request_max_tokens, r.prompt_tokens);
    assert_eq!(
        stored(must_get(l, "capped").await),
        (Some(613), Some(200), Some(12))
    );
    assert_eq!(
        stored(must_get(l, "uncapped").await),
        (Some(7), None, Some(12))
    );
    assert_eq!(stored(must_get(l, "unsized").await), (None, None, Some(12)));
    assert_eq!(stored(must_get(l, "v11").await), (None, None, Some(9)));
    // A second outcome for a job changes nothing, its request size included.
    assert!(
        !l.record_terminal(&call("capped", 14_000, Some(uncapped)))
            .await
            .unwrap()
    );
    assert_eq!(must_get(l, "capped").await.request_tokens, Some(613));
}

/// The door's call time for a kind is what the newest completed calls of it measured
/// (`latency_ms`), never a recorded `min_runtime_ms`: a client that sends its own huge
/// `min_runtime_ms` on a job that completes does not set the call time every later job of
/// the kind is shed by.
async fn the_doors_call_time_comes_from_measured_calls_only(db: &TestDb) {
    let l = &db.ledger;
    // The door's call time for the kind: the longest of the newest 20 completed calls.
    let recent_call_ms = |kind: &'static str, since: i64| async move {
        let calls = l.recent_completed_calls_of_kind(kind, since, 128).await;
        Ok::<_, lastcall_store::StoreError>(
            (calls?.iter().rev().take(20)).map(|c| c.latency_ms).max(),
        )
    };
    assert_eq!(recent_call_ms("chat", 0).await.unwrap(), None);
    let call = |id: &str, at: i64, latency: i64, min_runtime: i64| OutcomeRecord {
        latency_ms: Some(latency),
        min_runtime_ms: Some(min_runtime),
        ..completed(id, &format!("w1:{id}:1"), at, "ok")
    };
    for r in [
        call("old", 1_000, 9_000, 9_000),
        call("m1", 10_000, 300, 310),
        call("m2", 11_000, 250, 310),
        // A client's own min_runtime_ms of 23 h on a call that took 200 ms: the newest.
        call("greedy", 12_000, 200, 23 * 3_600_000),
    ] {
        assert!(l.record_terminal(&r).await.unwrap());
    }
    assert_eq!(recent_call_ms("chat", 5_000).await.unwrap(), Some(300));
    assert_eq!(recent_call_ms("chat", 0).await.unwrap(), Some(9_000));
    assert_eq!(recent_call_ms("other", 0).await.unwrap(), None);
    // The calls its request-aware fit takes: the kind's completed ones, oldest first, the
    // newest `limit` of them, their measured times.
    let cut = OutcomeRecord {
        state: State::DeadlineExceeded,
        reason: Some(lastcall_core::Reason::CancelledAtDeadline),
        result: None,
        ..call("cut", 13_000, 5_000, 0)
    };
    assert!(l.record_terminal(&cut).await.unwrap());
    let calls = l
        .recent_completed_calls_of_kind("chat", 5_000, 10)
        .await
        .unwrap();
    let times: Vec<u64> = calls.iter().map(|c| c.latency_ms).collect();
    assert_eq!(times, [300, 250, 200], "completed only, oldest first");
    assert!(calls.iter().all(|c| c.kind == "chat" && !c.cut));
    let newest = l
        .recent_completed_calls_of_kind("chat", 0, 2)
        .await
        .unwrap();
    assert_eq!(
        newest.iter().map(|c| c.latency_ms).collect::<Vec<_>>(),
        [250, 200]
    );
    assert!(
        l.recent_completed_calls_of_kind("other", 0, 10)
            .await
            .unwrap()
            .is_empty()
    );
}

async fn cancel_ends_a_waiting_job_and_flags_a_running_one(db: &TestDb) {
    use lastcall_store::CancelOutcome;
    let l = &db.ledger;
    // Not started: cancelled now, no model call; a later delivery finds it recorded.
    l.record_accepted(&accepted("w1", "k", 100, 60_000))
        .await
        .unwrap();
    assert_eq!(l.cancel("w1", 200).await.unwrap(), CancelOutcome::Cancelled);
    let rec = must_get(l, "w1").await;
    assert_eq!(
        (rec.state.as_str(), rec.reason.as_deref(), rec.backend_calls),
        ("cancelled", Some("cancelled_before_start"), 0)
    );
    assert!(l.receipt_info("w1").await.unwrap().already_recorded);
    // A worker's outcome cannot replace it.
    assert!(
        !l.record_terminal(&completed("w1", "a:1", 300, "late"))
            .await
            .unwrap()
    );
    // Running: flagged for its worker and any later delivery; the state stays.
    l.record_accepted(&accepted("r1", "k", 100, 60_000))
        .await
        .unwrap();
    l.record_start(&start("r1", "a:2", 0, 150)).await.unwrap();
    assert_eq!(l.cancel("r1", 200).await.unwrap(), CancelOutcome::Requested);
    assert_eq!(must_get(l, "r1").await.state, "running");
    let info = l.receipt_info("r1").await.unwrap();
    assert!(info.cancel_requested && !info.already_recorded, "{info:?}");
    // The worker's `cancelled` outcome ends it; the flag no longer reads as pending.
    assert!(
        l.record_terminal(&outcome("r1", "a:2", State::Cancelled, 400))
            .await
            .unwrap()
    );
    assert!(!l.receipt_info("r1").await.unwrap().cancel_requested);
    // Terminal or unknown ids: nothing changes.
    assert_eq!(
        l.cancel("r1", 500).await.unwrap(),
        CancelOutcome::AlreadyTerminal("cancelled".into())
    );
    assert_eq!(
        l.cancel("nope", 500).await.unwrap(),
        CancelOutcome::NotFound
    );
}

async fn a_webhook_is_claimed_once_and_its_attempts_recorded(db: &TestDb) {
    use lastcall_store::WebhookAttempt;
    let l = &db.ledger;
    assert_eq!(l.claim_webhook("none", "s1", 100).await.unwrap(), None);
    l.register_webhook("h1", "http://a/1", 100).await.unwrap();
    // A retried submission before any claim takes the new URL.
    l.register_webhook("h1", "http://a/2", 110).await.unwrap();
    assert_eq!(
        l.claim_webhook("h1", "s1", 150).await.unwrap().as_deref(),
        Some("http://a/2")
    );
    assert_eq!(
        l.claim_webhook("h1", "s2", 160).await.unwrap(),
        None,
        "one claimer"
    );
    l.register_webhook("h1", "http://a/3", 120).await.unwrap();
    let fail = WebhookAttempt {
        job_id: "h1".into(),
        attempt: 1,
        at_ms: 200,
        status: Some(500),
        error: Some("the receiver answered 500".into()),
    };
    l.record_webhook_attempt(&fail).await.unwrap();
    let ok = WebhookAttempt {
        attempt: 2,
        at_ms: 300,
        status: Some(200),
        error: None,
        ..fail.clone()
    };
    l.record_webhook_attempt(&ok).await.unwrap();
    assert_eq!(l.webhook_attempts("h1").await.unwrap(), vec![fail, ok]);
    // Delivered: no one claims it again, however long after.
    let later = 300 + lastcall_store::WEBHOOK_CLAIM_STALE_MS * 2;
    assert_eq!(l.claim_webhook("h1", "s2", later).await.unwrap(), None);
}

/// The sweep of `serve` (issue #35): the webhooks of ended jobs that no process delivers —
/// never claimed, or claimed with no attempt for `WEBHOOK_CLAIM_STALE_MS` — oldest first;
/// not those delivered, given up, still claimed by a live delivery, of a job not ended, or
/// of a job that ended too recently (its event may still come).
async fn the_sweep_finds_the_webhooks_that_no_one_delivers(db: &TestDb) {
    use lastcall_store::{WEBHOOK_CLAIM_STALE_MS as STALE, WebhookAttempt};
    let l = &db.ledger;
    let now = 10 * STALE;
    let ended = |id: &'static str, at: i64| async move {
        l.record_outcome(&outcome(id, &format!("a-{id}"), State::Failed, at))
            .await
            .unwrap();
    };
    for (i, id) in [
        "missed",
        "running",
        "recent",
        "delivered",
        "given-up",
        "live",
        "stale",
    ]
    .into_iter()
    .enumerate()
    {
        l.register_webhook(id, &format!("http://h/{id}"), 100 + i as i64)
            .await
            .unwrap();
    }
    ended("missed", 1_000).await;
    l.record_start(&start("running", "a-running", 1, 900))
        .await
        .unwrap();
    ended("recent", now - 10).await;
    ended("delivered", 1_000).await;
    ended("given-up", 1_000).await;
    ended("live", 1_000).await;
    ended("stale", 1_000).await;
    let attempt = |id: &str, at_ms, ok: bool| WebhookAttempt {
        job_id: id.into(),
        attempt: 1,
        at_ms,
        status: Some(if ok { 200 } else { 500 }),
        error: (!ok).then(|| "the receiver answered 500".into()),
    };
    l.claim_webhook("delivered", "s1", 2_000).await.unwrap();
    l.record_webhook_attempt(&attempt("delivered", 2_001, true))
        .await
        .unwrap();
    l.claim_webhook("given-up", "s1", 2_000).await.unwrap();
    l.record_webhook_given_up("given-up", 2_002).await.unwrap();
    // Claimed long ago, but its last attempt is recent: a delivery still under way.
    l.claim_webhook("live", "s1", 2_000).await.unwrap();
    l.record_webhook_attempt(&attempt("live", now - 1_000, false))
        .await
        .unwrap();
    // Claimed, then nothing for longer than STALE: its claimer stopped.
    l.claim_webhook("stale", "s1", now - STALE - 1)
        .await
        .unwrap();
    let swept = l.webhooks_to_sweep(now - 60_000, now, 100).await.unwrap();
    assert_eq!(swept, ["missed", "stale"]);
    assert_eq!(
        l.webhooks_to_sweep(now - 60_000, now, 1).await.unwrap(),
        ["missed"],
        "oldest first, at most the limit"
    );
    // Exactly the swept ones can be claimed now; once claimed, they are no longer swept.
    assert_eq!(l.claim_webhook("live", "s2", now).await.unwrap(), None);
    assert_eq!(
        l.claim_webhook("stale", "s2", now)
            .await
            .unwrap()
            .as_deref(),
        Some("http://h/stale")
    );
    assert_eq!(
        l.claim_webhook("missed", "s2", now)
            .await
            .unwrap()
            .as_deref(),
        Some("http://h/missed")
    );
    assert!((l.webhooks_to_sweep(now - 60_000, now, 100).await.unwrap()).is_empty());
}

// ---------------------------------------------------------------------------------------
// Retention, export and copy (`ledger/retention.rs`, `ledger/copy.rs`)

both_backends!(
    prune_deletes_old_terminal_jobs_with_their_rows_and_nothing_else,
    a_dry_run_counts_exactly_what_pruning_removes_and_changes_nothing,
    the_archive_gets_every_pruned_job_and_a_failed_archive_deletes_nothing,
    export_streams_the_window_and_round_trips_the_records,
    the_size_counts_the_job_rows,
    the_prunable_rows_are_what_pruning_would_delete,
    batches_past_their_window_and_files_no_batch_reads_are_pruned,
);

/// Rows cut off before this; texts before [`TEXT_CUT`].
const ROW_CUT: i64 = 10_000;
const TEXT_CUT: i64 = 30_000;

/// A ledger with a job of every kind retention must tell apart.
async fn retention_fixture(l: &Ledger) {
    use lastcall_store::WebhookAttempt;
    // Old and terminal: pruned, with their attempt rows.
    l.record_start(&start("old-done", "a-old-done", 1, 900))
        .await
        .unwrap();
    assert!(
        l.record_outcome(&completed("old-done", "a-old-done", 1_000, "old text"))
            .await
            .unwrap()
    );
    // Old, terminal, webhook delivered: pruned with its webhook rows.
    l.register_webhook("old-fail", "http://hooks/1", 800)
        .await
        .unwrap();
    l.record_outcome(&outcome("old-fail", "a-old-fail", State::Failed, 1_100))
        .await
        .unwrap();
    for (attempt, error) in [(1, Some("the receiver answered 500".to_owned())), (2, None)] {
        l.record_webhook_attempt(&WebhookAttempt {
            job_id: "old-fail".into(),
            attempt,
            at_ms: 1_150 + attempt,
            status: Some(if error.is_some() { 500 } else { 200 }),
            error,
        })
        .await
        .unwrap();
    }
    // Old and terminal, but its webhook is not delivered: held.
    l.register_webhook("old-hook", "http://hooks/2", 800)
        .await
        .unwrap();
    l.record_outcome(&completed("old-hook", "a-old-hook", 1_200, "held text"))
        .await
        .unwrap();
    // Old, terminal, its webhook's delivery given up after failed attempts: pruned.
    l.register_webhook("old-gave-up", "http://hooks/3", 800)
        .await
        .unwrap();
    l.record_outcome(&outcome(
        "old-gave-up",
        "a-old-gave-up",
        State::Failed,
        1_250,
    ))
    .await
    .unwrap();
    l.record_webhook_attempt(&WebhookAttempt {
        job_id: "old-gave-up".into(),
        attempt: 1,
        at_ms: 1_260,
        status: Some(500),
        error: Some("the receiver answered 500".into()),
    })
    .await
    .unwrap();
    l.record_webhook_given_up("old-gave-up", 1_261)
        .await
        .unwrap();
    // `unknown`: its real outcome may still arrive, so never pruned (issue #35).
    l.record_accepted(&accepted("old-unknown", "chat", 500, 800))
        .await
        .unwrap();
    assert_eq!(l.mark_unknown(1_300, 0).await.unwrap(), vec!["old-unknown"]);
    // Old but not terminal: never pruned.
    l.record_accepted(&accepted("old-accepted", "chat", 500, 10_000_000))
        .await
        .unwrap();
    l.record_start(&start("old-running", "a-old-running", 1, 700))
        .await
        .unwrap();
    // Kept as rows; the first loses its text.
    l.record_outcome(&completed("mid-done", "a-mid-done", 20_000, "mid text"))
        .await
        .unwrap();
    l.record_outcome(&completed("new-done", "a-new-done", 50_000, "new text"))
        .await
        .unwrap();
    // A worker gone long ago, and one alive.
    l.heartbeat("gone", 500).await.unwrap();
    l.heartbeat("alive", 50_000).await.unwrap();
}

/// Prunes at `ROW_CUT` in batches of `limit`, then clears texts at `TEXT_CUT`.
async fn prune_all(l: &Ledger, limit: u32) -> lastcall_store::PruneCounts {
    let mut total = lastcall_store::PruneCounts::default();
    loop {
        let c = l.prune_batch(ROW_CUT, limit, None).await.unwrap();
        total.add(&c);
        if c.jobs < u64::from(limit) {
            break;
        }
    }
    loop {
        let n = l.clear_texts_batch(TEXT_CUT, ROW_CUT, limit).await.unwrap();
        total.texts += n;
        if n < u64::from(limit) {
            break;
        }
    }
    total.held_by_webhooks = l.held_by_webhooks(ROW_CUT).await.unwrap();
    total.workers = l.prune_worker_leases(ROW_CUT).await.unwrap();
    total
}

async fn prune_deletes_old_terminal_jobs_with_their_rows_and_nothing_else(db: &TestDb) {
    let l = &db.ledger;
    retention_fixture(l).await;
    let c = prune_all(l, 2).await;
    assert_eq!(
        (c.jobs, c.attempts, c.webhooks, c.webhook_attempts),
        (3, 3, 2, 3),
        "{c:?}"
    );
    assert_eq!((c.texts, c.held_by_webhooks, c.workers), (1, 1, 1), "{c:?}");
    assert_eq!(
        db.scalar("SELECT COUNT(*) FROM workers WHERE name = 'alive'")
            .await,
        1
    );
    for gone in ["old-done", "old-fail", "old-gave-up"] {
        assert!(l.get(gone).await.unwrap().is_none(), "{gone}");
        assert!(l.attempts(gone).await.unwrap().is_empty(), "{gone}");
        assert!(l.webhook_attempts(gone).await.unwrap().is_empty(), "{gone}");
    }
    assert_eq!(
        db.scalar("SELECT COUNT(*) FROM webhooks WHERE job_id = 'old-fail'")
            .await,
        0
    );
    // Never pruned: not terminal, `unknown`, or its webhook waits (text kept too).
    assert_eq!(must_get(l, "old-unknown").await.state, "unknown");
    assert_eq!(must_get(l, "old-accepted").await.state, "accepted");
    assert_eq!(must_get(l, "old-running").await.state, "running");
    assert_eq!(l.attempts("old-running").await.unwrap().len(), 1);
    let held = must_get(l, "old-hook").await;
    assert_eq!(held.result.as_deref(), Some("held text"));
    // Text retention: the row stays, the text goes.
    let mid = must_get(l, "mid-done").await;
    assert_eq!((mid.state.as_str(), mid.result), ("completed", None));
    assert_eq!(
        (mid.prompt_tokens, mid.completion_tokens, mid.attempts),
        (Some(12), Some(34), 1)
    );
    assert_eq!(
        must_get(l, "new-done").await.result.as_deref(),
        Some("new text")
    );
    // Again: nothing left to do.
    let again = prune_all(l, 2).await;
    assert_eq!((again.jobs, again.texts, again.held_by_webhooks), (0, 0, 1));
    // Once the webhook is delivered, the held job goes too.
    l.record_webhook_attempt(&lastcall_store::WebhookAttempt {
        job_id: "old-hook".into(),
        attempt: 1,
        at_ms: 60_000,
        status: Some(200),
        error: None,
    })
    .await
    .unwrap();
    let last = prune_all(l, 2).await;
    assert_eq!((last.jobs, last.webhooks, last.webhook_attempts), (1, 1, 1));
    assert!(l.get("old-hook").await.unwrap().is_none());
}

async fn a_dry_run_counts_exactly_what_pruning_removes_and_changes_nothing(db: &TestDb) {
    let l = &db.ledger;
    retention_fixture(l).await;
    let before = l.counts_by_state().await.unwrap();
    let preview = l
        .prune_preview(Some(ROW_CUT), Some(TEXT_CUT))
        .await
        .unwrap();
    assert_eq!(
        l.counts_by_state().await.unwrap(),
        before,
        "nothing changed"
    );
    assert_eq!(
        must_get(l, "mid-done").await.result.as_deref(),
        Some("mid text")
    );
    assert!(l.get("old-done").await.unwrap().is_some());
    assert_eq!(prune_all(l, 1_000).await, preview);
    // Text retention alone: the texts of every kept terminal job before its cutoff.
    let texts_only = l.prune_preview(None, Some(60_000)).await.unwrap();
    assert_eq!(
        (
            texts_only.jobs,
            texts_only.texts,
            texts_only.held_by_webhooks
        ),
        (0, 1, 1),
        "new-done's text; old-hook is held"
    );
}

async fn the_archive_gets_every_pruned_job_and_a_failed_archive_deletes_nothing(db: &TestDb) {
    let l = &db.ledger;
    retention_fixture(l).await;
    let mut fail =
        |_: &[JobRecord]| -> std::io::Result<()> { Err(std::io::Error::other("disk full")) };
    let e = l
        .prune_batch(ROW_CUT, 100, Some(&mut fail))
        .await
        .unwrap_err();
    assert!(
        e.to_string().contains("disk full") && e.to_string().contains("nothing deleted"),
        "{e}"
    );
    assert!(l.get("old-done").await.unwrap().is_some());
    assert_eq!(l.attempts("old-done").await.unwrap().len(), 1);
    // The archive sees each record as it was, before its deletion.
    let expected = [
        must_get(l, "old-done").await,
        must_get(l, "old-fail").await,
        must_get(l, "old-gave-up").await,
    ];
    let mut archived: Vec<JobRecord> = Vec::new();
    let mut keep = |jobs: &[JobRecord]| -> std::io::Result<()> {
        archived.extend_from_slice(jobs);
        Ok(())
    };
    let c = l.prune_batch(ROW_CUT, 100, Some(&mut keep)).await.unwrap();
    assert_eq!(c.jobs, 3);
    assert_eq!(archived, expected);
}

async fn export_streams_the_window_and_round_trips_the_records(db: &TestDb) {
    use futures_util::TryStreamExt;
    let l = &db.ledger;
    retention_fixture(l).await;
    // Enough rows that a stream is worth having, in one group commit.
    let many: Vec<LedgerWrite> = (0..3_000)
        .map(|i| {
            LedgerWrite::outcome(completed(
                &format!("bulk-{i:05}"),
                &format!("a-bulk-{i:05}"),
                40_000 + i,
                "bulk text",
            ))
        })
        .collect();
    l.write_batch(&many).await.unwrap();
    let mut stream = l.export(1_000, 40_100);
    let mut seen: Vec<serde_json::Value> = Vec::new();
    while let Some(job) = stream.try_next().await.unwrap() {
        // Through the text a file would hold, and back.
        let line = serde_json::to_string(&job).unwrap();
        seen.push(serde_json::from_str(&line).unwrap());
    }
    drop(stream);
    let ids: Vec<&str> = seen.iter().map(|v| v["job_id"].as_str().unwrap()).collect();
    // [1_000, 40_100): terminal jobs only, oldest first; not `old-accepted`/`old-running`.
    let mut expected = vec![
        "old-done",
        "old-fail",
        "old-hook",
        "old-gave-up",
        "old-unknown",
        "mid-done",
    ];
    let bulk: Vec<String> = (0..100).map(|i| format!("bulk-{i:05}")).collect();
    expected.extend(bulk.iter().map(String::as_str));
    assert_eq!(ids, expected);
    for v in &seen {
        let id = v["job_id"].as_str().unwrap();
        let rec = serde_json::to_value(must_get(l, id).await).unwrap();
        assert_eq!(v, &rec, "{id}");
    }
    // A window with nothing in it.
    let none: Vec<JobRecord> = l.export(100_000, 200_000).try_collect().await.unwrap();
    assert!(none.is_empty());
}

async fn the_size_counts_the_job_rows(db: &TestDb) {
    let l = &db.ledger;
    retention_fixture(l).await;
    if db.backend == Backend::Postgres {
        db.exec("ANALYZE jobs").await;
    }
    let size = l.size().await.unwrap();
    assert_eq!(size.job_rows, 9, "{size:?}");
    assert!(size.bytes > 0, "{size:?}");
}

/// The dashboard's `ledger_behind_retention` read: the oldest job pruning would delete and
/// how many (bounded), by the pruning rule itself: jobs held by a webhook, `unknown` or not
/// ended never count, however old.
async fn the_prunable_rows_are_what_pruning_would_delete(db: &TestDb) {
    use lastcall_core::alerts::PrunableRows;
    let l = &db.ledger;
    retention_fixture(l).await;
    let rows = |oldest, rows, bounded| PrunableRows {
        oldest_recorded_at_ms: oldest,
        rows,
        bounded,
    };
    // old-done (1,000), old-fail (1,100), old-gave-up (1,250).
    assert_eq!(
        l.prunable_rows(ROW_CUT, 1_000).await.unwrap(),
        rows(Some(1_000), 3, false)
    );
    let preview = l.prune_preview(Some(ROW_CUT), None).await.unwrap();
    assert_eq!(preview.jobs, 3, "the same rule as pruning");
    assert_eq!(
        l.prunable_rows(ROW_CUT, 2).await.unwrap(),
        rows(Some(1_000), 2, true),
        "the count stops at its bound"
    );
    assert_eq!(
        l.prunable_rows(1_050, 1_000).await.unwrap(),
        rows(Some(1_000), 1, false)
    );
    assert_eq!(
        l.prunable_rows(1_000, 1_000).await.unwrap(),
        rows(None, 0, false),
        "strictly before the cutoff, as pruning"
    );
    assert_eq!(
        l.prunable_rows(TEXT_CUT, 1_000).await.unwrap(),
        rows(Some(1_000), 4, false),
        "mid-done too"
    );
    // Pruned: old-hook (1,200, its webhook waits), old-unknown (1,300), old-accepted and
    // old-running stay, older than the cutoff, and none of them counts.
    prune_all(l, 1_000).await;
    assert_eq!(
        l.prunable_rows(ROW_CUT, 1_000).await.unwrap(),
        rows(None, 0, false)
    );
    // Its webhook delivered, old-hook may go: it counts.
    l.record_webhook_attempt(&lastcall_store::WebhookAttempt {
        job_id: "old-hook".into(),
        attempt: 1,
        at_ms: 60_000,
        status: Some(200),
        error: None,
    })
    .await
    .unwrap();
    assert_eq!(
        l.prunable_rows(ROW_CUT, 1_000).await.unwrap(),
        rows(Some(1_200), 1, false)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_one_of_two_pruners_holds_the_lock_on_postgres() {
    let db = TestDb::new(Backend::Postgres).await;
    let other = Ledger::connect(&db.url).await.unwrap();
    // Two processes asking at the same moment, several times each: exactly one turn.
    let asks = (0..4)
        .flat_map(|_| [db.ledger.clone(), other.clone()])
        .map(|l| tokio::spawn(async move { l.try_prune_lock().await.unwrap() }));
    let mut held = Vec::new();
    for ask in asks.collect::<Vec<_>>() {
        if let Some(lock) = ask.await.unwrap() {
            held.push(lock);
        }
    }
    assert_eq!(held.len(), 1, "one pruner at a time");
    held.pop().unwrap().release().await;
    let first = db.ledger.try_prune_lock().await.unwrap().expect("free");
    assert!(
        other.try_prune_lock().await.unwrap().is_none(),
        "held by the first"
    );
    first.release().await;
    let second = other.try_prune_lock().await.unwrap().expect("released");
    // Dropped without a release (a pruner that died): its connection closes, the lock goes.
    drop(second);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(lock) = db.ledger.try_prune_lock().await.unwrap() {
            lock.release().await;
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the dropped lock was never released"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    other.close().await;
    db.ledger.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn copy_from_sqlite_to_a_fresh_postgres_is_equal_and_a_second_copy_is_a_no_op() {
    let src = TestDb::new(Backend::Sqlite).await;
    let dst = TestDb::new(Backend::Postgres).await;
    retention_fixture(&src.ledger).await;
    src.ledger.heartbeat("w1", 5_000).await.unwrap();
    // Two open breakers of w1 (a two-column key), so the copy pages through them.
    let kinds = ["summarize".to_owned(), "translate".to_owned()];
    src.ledger
        .record_breaker_open("w1", "vllm", &kinds, 9_000, 5_000)
        .await
        .unwrap();
    // A text with characters whose byte order and collation order differ, and quotes; and
    // the worker's measure of the request (ledger version 12).
    src.ledger
        .record_outcome(&OutcomeRecord {
            request_size: Some(RequestSize {
                prompt_tokens: 613,
                max_tokens: Some(200),
            }),
            ..completed("Zz-ü", "a-zz", 2_000, "\"ä\"\n\\ 🙂")
        })
        .await
        .unwrap();
    // A file of three lines (a two-column key, paged through), a batch and a malformed line.
    let file = lastcall_store::FileRow {
        file_id: "file-1".into(),
        tenant: "team-a".into(),
        purpose: "batch".into(),
        filename: "in.jsonl".into(),
        bytes: 0,
        line_count: 0,
        created_at_ms: 1_000,
    };
    src.ledger.create_file(&file).await.unwrap();
    let lines = ["{\"a\": \"ü\"}".to_owned(), "{}".into(), "x".into()];
    src.ledger
        .append_file_lines("file-1", 1, &lines[..2])
        .await
        .unwrap();
    src.ledger
        .append_file_lines("file-1", 3, &lines[2..])
        .await
        .unwrap();
    src.ledger.finish_file("file-1", 20, 3).await.unwrap();
    let got = src.ledger.file_lines("file-1", 2, 10).await.unwrap();
    assert_eq!(got, vec![(2, "{}".to_owned()), (3, "x".to_owned())]);
    let batch = lastcall_store::BatchRow {
        batch_id: "batch_1".into(),
        tenant: "team-a".into(),
        input_file_id: "file-1".into(),
        endpoint: "/v1/chat/completions".into(),
        completion_window: "2h".into(),
        metadata: Some("{\"k\":\"v\"}".into()),
        allowed_kinds: None,
        job_prefix: "team-a:batch_1-".into(),
        created_at_ms: 1_000,
        expires_at_ms: 7_201_000,
        total: 3,
        cursor: 0,
        cancelled_at_ms: None,
        cancel_cursor: 0,
    };
    src.ledger.create_batch(&batch).await.unwrap();
    assert!(
        src.ledger
            .advance_batch_cursor("batch_1", 0, 3)
            .await
            .unwrap()
    );
    assert!(
        !src.ledger
            .advance_batch_cursor("batch_1", 0, 2)
            .await
            .unwrap()
    );
    let error = lastcall_store::LineError {
        line_no: 3,
        custom_id: None,
        code: "invalid_json_line".into(),
        message: "line 3: not JSON".into(),
    };
    src.ledger
        .record_line_error("batch_1", &error)
        .await
        .unwrap();
    assert_eq!(
        src.ledger.line_errors("batch_1", 1, 3).await.unwrap(),
        vec![error]
    );
    let mut last_progress = 0;
    for table in lastcall_store::COPY_TABLES {
        let mut progress = |n: u64| last_progress = n;
        let c = src
            .ledger
            .copy_table_to(&dst.ledger, table, 2, &mut progress)
            .await
            .unwrap();
        assert_eq!(c.read, c.inserted, "{table}: a fresh destination");
        assert_eq!(
            c.read,
            src.ledger.table_rows(table).await.unwrap(),
            "{table}"
        );
        assert_eq!(last_progress, c.read, "{table}");
        assert_eq!(
            src.ledger.table_digest(table).await.unwrap(),
            dst.ledger.table_digest(table).await.unwrap(),
            "{table}"
        );
    }
    assert_eq!(
        src.ledger.table_digest("jobs").await.unwrap().rows,
        10,
        "every job"
    );
    // The copy reads as the source does.
    for id in ["old-done", "old-hook", "Zz-ü", "old-running"] {
        assert_eq!(
            must_get(&dst.ledger, id).await,
            must_get(&src.ledger, id).await,
            "{id}"
        );
    }
    let copied = must_get(&dst.ledger, "Zz-ü").await;
    assert_eq!(
        (copied.request_tokens, copied.request_max_tokens),
        (Some(613), Some(200))
    );
    // An interrupted copy: the destination lacks some rows; running it again adds just those.
    dst.exec("DELETE FROM jobs WHERE job_id IN ('old-done', 'new-done', 'Zz-ü')")
        .await;
    let c = src
        .ledger
        .copy_table_to(&dst.ledger, "jobs", 4, &mut |_: u64| {})
        .await
        .unwrap();
    assert_eq!((c.read, c.inserted), (10, 3));
    assert_eq!(
        src.ledger.table_digest("jobs").await.unwrap(),
        dst.ledger.table_digest("jobs").await.unwrap()
    );
    // Again (a resumed copy): nothing new.
    for table in lastcall_store::COPY_TABLES {
        let c = src
            .ledger
            .copy_table_to(&dst.ledger, table, 3, &mut |_: u64| {})
            .await
            .unwrap();
        assert_eq!(c.inserted, 0, "{table}");
    }
    // A difference shows in the checksum, the request size's too.
    dst.exec("UPDATE jobs SET request_max_tokens = NULL WHERE job_id = 'Zz-ü'")
        .await;
    assert_ne!(
        src.ledger.table_digest("jobs").await.unwrap(),
        dst.ledger.table_digest("jobs").await.unwrap()
    );
    dst.exec("UPDATE jobs SET request_max_tokens = 200 WHERE job_id = 'Zz-ü'")
        .await;
    assert_eq!(
        src.ledger.table_digest("jobs").await.unwrap(),
        dst.ledger.table_digest("jobs").await.unwrap()
    );
    dst.exec("UPDATE jobs SET result = 'changed' WHERE job_id = 'new-done'")
        .await;
    assert_ne!(
        src.ledger.table_digest("jobs").await.unwrap(),
        dst.ledger.table_digest("jobs").await.unwrap()
    );
    src.ledger.close().await;
    dst.ledger.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_copy_covers_every_column_of_every_table() {
    let db = TestDb::new(Backend::Sqlite).await;
    let mut conn = sqlx::SqliteConnection::connect(&db.url).await.unwrap();
    let tables: Vec<String> = sqlx::query(
        "SELECT name FROM sqlite_master WHERE type = 'table' \
         AND name NOT IN ('schema_migrations') AND name NOT LIKE 'sqlite_%' ORDER BY name",
    )
    .fetch_all(&mut conn)
    .await
    .unwrap()
    .iter()
    .map(|r| r.get(0))
    .collect();
    let mut copied: Vec<&str> = lastcall_store::COPY_TABLES.to_vec();
    copied.sort();
    assert_eq!(
        tables, copied,
        "a new table must be added to ledger/copy.rs"
    );
    for t in &tables {
        let mut columns: Vec<String> = sqlx::query(AssertSqlSafe(format!(
            "SELECT name FROM pragma_table_info('{t}')"
        )))
        .fetch_all(&mut conn)
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
        columns.sort();
        let mut spec: Vec<String> = lastcall_store::copy_columns(t)
            .unwrap()
            .into_iter()
            .map(str::to_owned)
            .collect();
        spec.sort();
        assert_eq!(
            columns, spec,
            "{t}: a new column must be added to ledger/copy.rs"
        );
    }
    conn.close().await.ok();
    db.ledger.close().await;
}

/// The dashboard's numbers (issue #34): aggregated in SQL, equal to what the old
/// computation over every record of the window (`records_since`, result text included)
/// gave, in a bounded number of rows that hold no job's text.
async fn dashboard_counts_equal_the_records_and_read_no_text(db: &TestDb) {
    use lastcall_store::{DASHBOARD_MAX_ROWS, DASHBOARD_STATEMENTS, DWELL_BUCKETS_MS};
    use std::collections::BTreeMap;
    let l = &db.ledger;
    let big = "x".repeat(64 * 1024);
    let states = [
        State::Completed,
        State::Failed,
        State::ExpiredNotStarted,
        State::ExpiredBeforeReceive,
        State::DeadlineExceeded,
        State::Rejected,
        State::Unknown,
        State::Cancelled,
    ];
    // Dwells on, just past and around every bucket bound, negative ones and an overflow.
    let mut dwells: Vec<i64> = vec![-7, 0, 1, 120_000];
    for b in DWELL_BUCKETS_MS {
        dwells.extend([*b as i64 - 1, *b as i64, *b as i64 + 1]);
    }
    let since = 10 * 60_000 + 123;
    let mut n = 0;
    for (i, d) in dwells.iter().enumerate() {
        for (k, state) in states.iter().enumerate() {
            n += 1;
            // From before the window (excluded) to 3 minutes into it.
            let recorded = since - 90_000 + ((i * 7 + k * 13) as i64 % 5) * 60_000 + k as i64;
            let dlq = (i + k) % 5 == 0;
            let rec = OutcomeRecord {
                created_at_ms: (k % 4 != 0).then_some(recorded - 200_000),
                received_at_ms: (k % 3 != 0).then_some(recorded - 200_000 + d),
                checked_at_ms: Some(recorded - 200_000 + d + d / 2 - 3),
                worker: if dlq { "dlq:test".into() } else { "w1".into() },
                reason: match (dlq, i % 3) {
                    (true, 0) => None,
                    (_, 1) => Some(Reason::BrokerTtlExpired),
                    _ => Some(Reason::RetriesExhausted),
                },
                result: Some(big.clone()),
                ..outcome(&format!("d{n}"), &format!("d{n}-1"), *state, recorded)
            };
            l.record_outcome(&rec).await.unwrap();
        }
    }
    // Jobs that have not ended count in no window.
    for j in 0..5 {
        l.record_accepted(&accepted(
            &format!("live{j}"),
            "chat",
            since + j,
            since + 600_000,
        ))
        .await
        .unwrap();
    }

    // The old computation, over the window's whole records.
    let records = l.records_since(since).await.unwrap();
    let terminal: Vec<&str> = State::ALL
        .iter()
        .filter(|s| s.is_terminal())
        .map(|s| s.as_str())
        .collect();
    let bucket = |ms: i64| DWELL_BUCKETS_MS.partition_point(|b| *b < ms.max(0) as u64);
    let mut per_minute: BTreeMap<(String, i64), u64> = BTreeMap::new();
    let mut queue = vec![0u64; DWELL_BUCKETS_MS.len() + 1];
    let mut consumer = queue.clone();
    let mut dead: BTreeMap<String, u64> = BTreeMap::new();
    for r in &records {
        if !terminal.contains(&r.state.as_str()) {
            continue;
        }
        let at = r.recorded_at_ms.unwrap();
        *per_minute
            .entry((r.state.clone(), at.div_euclid(60_000)))
            .or_default() += 1;
        let by_dlq = r.worker.as_deref().unwrap_or("").starts_with("dlq:");
        if let (Some(c), Some(rcv)) = (r.created_at_ms, r.received_at_ms)
            && !by_dlq
        {
            queue[bucket(rcv - c)] += 1;
        }
        if let (Some(rcv), Some(chk)) = (r.received_at_ms, r.checked_at_ms) {
            consumer[bucket(chk - rcv)] += 1;
        }
        if by_dlq {
            *dead
                .entry(r.reason.clone().unwrap_or_else(|| "none".into()))
                .or_default() += 1;
        }
    }
    assert!(
        records.len() > 200,
        "a window of many jobs: {}",
        records.len()
    );
    assert!(
        queue.iter().filter(|n| **n > 0).count() == queue.len(),
        "{queue:?}"
    );

    let got = l.dashboard_counts(since).await.unwrap();
    let got_per_minute: BTreeMap<(String, i64), u64> = got
        .per_minute
        .iter()
        .map(|(s, m, c)| ((s.clone(), *m), *c))
        .collect();
    assert_eq!(got_per_minute, per_minute);
    assert_eq!(got.queue_dwell, queue);
    assert_eq!(got.consumer_dwell, consumer);
    assert_eq!(
        got.dead_letters.into_iter().collect::<BTreeMap<_, _>>(),
        dead
    );
    // Counts, not rows: far fewer rows than jobs, each statement bounded.
    let tenant_groups: std::collections::BTreeSet<(String, String, Option<String>)> = records
        .iter()
        .filter(|r| terminal.contains(&r.state.as_str()))
        .map(|r| (r.tenant.clone(), r.state.clone(), r.reason.clone()))
        .collect();
    let expected_rows = per_minute.len()
        + queue.iter().filter(|n| **n > 0).count()
        + consumer.iter().filter(|n| **n > 0).count()
        + dead.len()
        + tenant_groups.len();
    assert_eq!(got.rows_read, expected_rows);
    assert!(got.rows_read < records.len() / 2, "{} rows", got.rows_read);
    for sql in DASHBOARD_STATEMENTS {
        let lower = sql.to_lowercase();
        for column in ["result", "error", "payload", "trace_id", "select *"] {
            assert!(!lower.contains(column), "reads `{column}`: {sql}");
        }
        assert!(
            lower.contains("group by") && lower.ends_with("limit $2"),
            "{sql}"
        );
    }
    const { assert!(DASHBOARD_MAX_ROWS <= 20_000) };
}

fn tenant(name: &str) -> Tenant {
    Tenant::parse(name).unwrap()
}

/// Issue #33: the ingress's claim, the worker's start and its outcome all write the
/// envelope's tenant and tier; a writer that could not parse the envelope writes the
/// defaults, which never replace a known tenant; a job written first by a worker gets its
/// tenant from the worker, and the producer's late inventory write keeps it. `list`
/// filters by tenant.
async fn every_row_keeps_the_tenant_and_tier_its_first_writer_knew(db: &TestDb) {
    let l = &db.ledger;
    // Claimed at the door for team-a, critical; started; then an outcome without the
    // envelope (a dead letter that could not be parsed) must not erase either.
    let claim = AcceptedJob {
        tenant: tenant("team-a"),
        priority: Priority::Critical,
        ..accepted("a1", "chat", 10, 60_000)
    };
    assert!(l.claim_accepted(&claim).await.unwrap());
    let rec = must_get(l, "a1").await;
    assert_eq!(
        (rec.tenant.as_str(), rec.priority.as_str()),
        ("team-a", "critical")
    );
    l.record_start(&AttemptStart {
        tenant: tenant("team-a"),
        priority: Priority::Critical,
        ..start("a1", "ka1", 1, 100)
    })
    .await
    .unwrap();
    assert!(
        l.record_outcome(&OutcomeRecord {
            attempt_key: "dlq:a1".into(),
            ..OutcomeRecord::new(
                "a1",
                "chat",
                State::Failed,
                Decision::DeadLetterProcessed,
                200
            )
        })
        .await
        .unwrap()
    );
    let rec = must_get(l, "a1").await;
    assert_eq!(rec.state, "failed");
    assert_eq!(
        (rec.tenant.as_str(), rec.priority.as_str()),
        ("team-a", "critical")
    );

    // The worker first (through a group commit), the producer's inventory write later.
    let done = OutcomeRecord {
        tenant: tenant("team-b"),
        priority: Priority::Batch,
        ..completed("b1", "kb1", 300, "x")
    };
    assert_eq!(
        l.write_batch(&[LedgerWrite::outcome(done)]).await.unwrap(),
        vec![true]
    );
    l.record_accepted(&AcceptedJob {
        tenant: tenant("team-b"),
        priority: Priority::Batch,
        ..accepted("b1", "chat", 20, 60_000)
    })
    .await
    .unwrap();
    let rec = must_get(l, "b1").await;
    assert_eq!(
        (rec.tenant.as_str(), rec.priority.as_str()),
        ("team-b", "batch")
    );
    assert_eq!(rec.accepted_at_ms, Some(20));

    // A row the defaults wrote first takes the tenant a later writer knows.
    l.record_start(&start("c1", "kc1", 1, 400)).await.unwrap();
    assert_eq!(must_get(l, "c1").await.tenant, "default");
    l.record_outcome(&OutcomeRecord {
        tenant: tenant("team-b"),
        ..completed("c1", "kc1", 500, "y")
    })
    .await
    .unwrap();
    assert_eq!(must_get(l, "c1").await.tenant, "team-b");

    // An old producer: no tenant named, `default`/`standard`.
    l.record_accepted(&accepted("d1", "chat", 30, 60_000))
        .await
        .unwrap();
    let rec = must_get(l, "d1").await;
    assert_eq!(
        (rec.tenant.as_str(), rec.priority.as_str()),
        ("default", "standard")
    );

    let ids = |jobs: Vec<JobRecord>| jobs.into_iter().map(|j| j.job_id).collect::<Vec<_>>();
    let of = |t: &str| ListFilter {
        tenant: Some(t.to_owned()),
        ..ListFilter::default()
    };
    assert_eq!(ids(l.list(&of("team-b")).await.unwrap()), ["b1", "c1"]);
    assert_eq!(ids(l.list(&of("team-a")).await.unwrap()), ["a1"]);
    assert_eq!(ids(l.list(&of("default")).await.unwrap()), ["d1"]);
    assert!(l.list(&of("nobody")).await.unwrap().is_empty());
    let json = serde_json::to_value(must_get(l, "b1").await).unwrap();
    assert_eq!(json["tenant"], "team-b");
    assert_eq!(json["priority"], "batch");
}

/// Issue #33: the per-tenant groups of a window equal what the window's records say, and
/// their fold bounds the tenants it names.
async fn tenant_counts_equal_the_records(db: &TestDb) {
    use lastcall_core::report::{OTHER_TENANTS, TenantSample, tenant_accounts};
    let l = &db.ledger;
    let since = 1_000_000;
    let states = [
        (State::Completed, None),
        (State::DeadlineExceeded, Some(Reason::CancelledAtDeadline)),
        (State::ExpiredNotStarted, Some(Reason::BrokerTtlExpired)),
        (State::Failed, Some(Reason::RetriesExhausted)),
    ];
    let mut n = 0;
    for t in 0..7 {
        for (k, (state, reason)) in states.iter().enumerate() {
            // Tenant t has t+1 jobs of each state; some before the window.
            for j in 0..=t {
                n += 1;
                let recorded = since - 5 + ((t + k + j) % 4) as i64 * 3;
                if j % 2 == 1 && *state != State::ExpiredNotStarted {
                    // A call that failed and was retried first: model time, wasted.
                    l.record_outcome(&OutcomeRecord {
                        tenant: tenant(&format!("t{t}")),
                        decision: Decision::Retry,
                        reason: Some(Reason::Backend("backend_unavailable".into())),
                        model_called: true,
                        started_at_ms: Some(recorded - 200 - j as i64),
                        ..outcome(
                            &format!("j{n}"),
                            &format!("r{n}"),
                            State::Accepted,
                            recorded - 100,
                        )
                    })
                    .await
                    .unwrap();
                }
                l.record_outcome(&OutcomeRecord {
                    tenant: tenant(&format!("t{t}")),
                    reason: reason.clone(),
                    model_called: *state != State::ExpiredNotStarted,
                    latency_ms: (*state != State::ExpiredNotStarted).then_some(10 + j as i64),
                    prompt_tokens: Some(3),
                    completion_tokens: (*state == State::Completed).then_some(5),
                    ..outcome(&format!("j{n}"), &format!("k{n}"), *state, recorded)
                })
                .await
                .unwrap();
            }
        }
    }
    let mut expected: Vec<TenantSample> = Vec::new();
    for r in l.records_since(since).await.unwrap() {
        expected.push(TenantSample {
            tenant: r.tenant,
            state: r.state,
            reason: r.reason,
            jobs: 1,
            model_ms: r.model_ms as u64,
            wasted_model_ms: r.wasted_model_ms as u64,
            prompt_tokens: r.prompt_tokens.unwrap_or(0) as u64,
            completion_tokens: r.completion_tokens.unwrap_or(0) as u64,
        });
    }
    assert!(expected.len() > 50, "{}", expected.len());
    let got = l.tenant_counts(since).await.unwrap();
    assert!(got.len() < expected.len(), "groups, not rows");
    assert_eq!(
        tenant_accounts(&got, usize::MAX),
        tenant_accounts(&expected, usize::MAX)
    );
    let top = tenant_accounts(&got, 3);
    assert_eq!(top.len(), 4);
    assert_eq!(top[0].tenant, "t6");
    assert_eq!(top[3].tenant, OTHER_TENANTS);
    let total: u64 = top.iter().map(|a| a.jobs).sum();
    assert_eq!(total, expected.len() as u64);
    let wasted: u64 = top.iter().map(|a| a.wasted_model_ms).sum();
    assert!(wasted > 0 && wasted < top.iter().map(|a| a.model_ms).sum::<u64>());
    // The retried calls are counted: on-time tenants have wasted time too, and more model
    // time than their recorded calls alone.
    let latency: i64 = l
        .records_since(since)
        .await
        .unwrap()
        .iter()
        .filter_map(|r| r.latency_ms)
        .sum();
    assert!(top.iter().map(|a| a.model_ms).sum::<u64>() > latency as u64);
    let t6 = &top[0];
    assert!(t6.wasted_model_ms > 0 && t6.on_time > 0);
    let dash = l.dashboard_counts(since).await.unwrap();
    assert_eq!(
        dash.tenants,
        tenant_accounts(&got, lastcall_store::DASHBOARD_TENANTS)
    );
}

/// The workers' open breakers, as the door reads them: a kind is down only while every live
/// worker (fresh lease) has its breaker for the kind open; a row past its trial time, or of
/// a worker whose lease went stale, counts as closed; a closing removes the rows.
async fn the_door_sees_a_kind_down_while_every_live_worker_has_its_breaker_open(db: &TestDb) {
    let l = &db.ledger;
    let kinds = vec!["chat".to_owned(), "summary".to_owned()];
    let live_since = |now: i64| now - 10_000;
    assert_eq!(
        l.upstream_open_until("chat", 1_000, live_since(1_000))
            .await
            .unwrap(),
        None
    );
    l.heartbeat("w1", 1_000).await.unwrap();
    l.record_breaker_open("w1", "openai", &kinds, 4_000, 1_000)
        .await
        .unwrap();
    assert_eq!(
        l.upstream_open_until("chat", 2_000, live_since(2_000))
            .await
            .unwrap(),
        Some(4_000)
    );
    assert_eq!(
        l.upstream_open_until("code", 2_000, live_since(2_000))
            .await
            .unwrap(),
        None
    );
    // Opened again (a failed trial): the later trial time replaces the row.
    l.record_breaker_open("w1", "openai", &kinds[..1], 9_000, 4_500)
        .await
        .unwrap();
    assert_eq!(
        l.upstream_open_until("chat", 5_000, live_since(5_000))
            .await
            .unwrap(),
        Some(9_000)
    );
    // Past the trial time: closed for the door.
    assert_eq!(
        l.upstream_open_until("chat", 9_000, live_since(9_000))
            .await
            .unwrap(),
        None
    );
    // A second live worker whose breaker is closed can still serve the kind.
    l.heartbeat("w2", 5_000).await.unwrap();
    assert_eq!(
        l.upstream_open_until("chat", 6_000, live_since(6_000))
            .await
            .unwrap(),
        None
    );
    l.record_breaker_open("w2", "openai", &kinds, 7_000, 6_000)
        .await
        .unwrap();
    assert_eq!(
        l.upstream_open_until("chat", 6_500, live_since(6_500))
            .await
            .unwrap(),
        Some(7_000),
        "the earliest trial of the two"
    );
    // w2 closes its breaker: its rows go.
    l.clear_breaker("w2", "openai").await.unwrap();
    assert_eq!(
        l.upstream_open_until("chat", 6_500, live_since(6_500))
            .await
            .unwrap(),
        None
    );
    // w2 dies (its lease goes stale), w1 stays live with its breaker open.
    l.record_breaker_open("w1", "openai", &kinds, 40_000, 20_000)
        .await
        .unwrap();
    l.heartbeat("w1", 20_000).await.unwrap();
    assert_eq!(
        l.upstream_open_until("chat", 20_500, live_since(20_500))
            .await
            .unwrap(),
        Some(40_000)
    );
    // w1 dies too: no live worker, nothing is down for the door.
    assert_eq!(
        l.upstream_open_until("chat", 31_000, live_since(31_000))
            .await
            .unwrap(),
        None
    );
}

/// How many of the indexes that PostgreSQL builds after its migrations (`ONLINE_INDEXES`)
/// exist and are valid (and not unique: the invalid one below was).
const ONLINE_INDEX_NAMES: [&str; 4] = [
    "jobs_reconciled",
    "jobs_text_recorded",
    "jobs_tenant_recorded",
    "webhooks_open",
];

async fn valid_online_indexes(db: &TestDb) -> i64 {
    let mut conn = sqlx::PgConnection::connect(&db.url).await.unwrap();
    let n: i64 = sqlx::query_scalar(
        "SELECT COUNT(*) FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid \
         WHERE c.relname = ANY($1) AND i.indisvalid AND NOT i.indisunique",
    )
    .bind(&ONLINE_INDEX_NAMES[..])
    .fetch_one(&mut conn)
    .await
    .unwrap();
    conn.close().await.ok();
    n
}

/// A PostgreSQL ledger written by a version-6 binary, with rows in it, is upgraded in
/// place, and the indexes that later versions add to its existing tables are built (after
/// the migrations' transaction, concurrently: writers are not blocked meanwhile).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_version_6_postgres_ledger_gets_its_later_indexes_built() {
    let db = TestDb::new(Backend::Postgres).await;
    assert_eq!(valid_online_indexes(&db).await, 4, "a new ledger has them");
    db.exec("DROP TABLE jobs; DROP TABLE attempts; DROP TABLE IF EXISTS workers; DROP TABLE IF EXISTS webhooks; DROP TABLE IF EXISTS webhook_attempts; DROP TABLE IF EXISTS breakers; DROP TABLE IF EXISTS batch_line_errors; DROP TABLE IF EXISTS batches; DROP TABLE IF EXISTS file_lines; DROP TABLE IF EXISTS files; DELETE FROM schema_migrations")
        .await;
    for sql in [
        include_str!("../migrations/postgres/0001_init.sql"),
        include_str!("../migrations/postgres/0002_counters_on_read.sql"),
        include_str!("../migrations/postgres/0003_reconciled_at.sql"),
        include_str!("../migrations/postgres/0004_worker_leases.sql"),
        include_str!("../migrations/postgres/0005_backend_model.sql"),
        include_str!("../migrations/postgres/0006_webhooks.sql"),
    ] {
        db.exec(sql).await;
    }
    // As a version-6 binary left it: version 3's index built in its transaction.
    db.exec(
        "CREATE INDEX jobs_reconciled ON jobs (state, reconciled_at_ms) \
         WHERE reconciled_at_ms IS NOT NULL; \
         INSERT INTO schema_migrations (version, name, applied_at_ms) \
         SELECT v, 'old', 0 FROM generate_series(1, 6) v; \
         INSERT INTO jobs (job_id, kind, state, result, recorded_at_ms) \
         SELECT 'old-' || i, 'chat', 'completed', 'text', i FROM generate_series(1, 20000) i",
    )
    .await;
    assert_eq!(valid_online_indexes(&db).await, 1);
    let upgraded = Ledger::connect(&db.url).await.expect("upgrade");
    assert_eq!(valid_online_indexes(&db).await, 4);
    assert_eq!(must_get(&upgraded, "old-7").await.state, "completed");
    upgraded.close().await;
    assert_eq!(
        db.scalar("SELECT MAX(version) FROM schema_migrations")
            .await,
        LATEST_VERSION
    );
    db.ledger.close().await;
}

/// A concurrent build that is interrupted leaves an invalid index, which `IF NOT EXISTS`
/// alone would keep for ever (it slows every write and serves no query): the next process
/// to open the ledger drops it and builds it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalid_index_left_by_an_interrupted_build_is_built_again() {
    let db = TestDb::new(Backend::Postgres).await;
    // A failed `CREATE UNIQUE INDEX CONCURRENTLY` (duplicate keys) leaves its index
    // behind, invalid, as an interrupted build does.
    db.exec(
        "DROP INDEX jobs_text_recorded; \
         INSERT INTO jobs (job_id, kind, state, result, recorded_at_ms) VALUES \
         ('a', 'chat', 'completed', 'x', 5), ('b', 'chat', 'completed', 'y', 5)",
    )
    .await;
    let mut conn = sqlx::PgConnection::connect(&db.url).await.unwrap();
    let failed = sqlx::raw_sql(
        "CREATE UNIQUE INDEX CONCURRENTLY jobs_text_recorded ON jobs (recorded_at_ms) \
         WHERE result IS NOT NULL",
    )
    .execute(&mut conn)
    .await;
    assert!(failed.is_err(), "the duplicate keys fail the unique build");
    conn.close().await.ok();
    assert_eq!(
        db.scalar(
            "SELECT COUNT(*) FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid \
             WHERE c.relname = 'jobs_text_recorded' AND NOT i.indisvalid"
        )
        .await,
        1,
        "an invalid index is left behind"
    );
    assert_eq!(valid_online_indexes(&db).await, 3);
    let again = Ledger::connect(&db.url).await.expect("reopen");
    assert_eq!(valid_online_indexes(&db).await, 4);
    again.close().await;
    db.ledger.close().await;
}

// ---------------------------------------------------------------------------------------
// The dashboard's headline, leases and alerts (issue #53)

both_backends!(
    the_headline_equals_the_records_and_reads_no_text,
    a_lease_carries_its_workers_live_numbers,
    the_alerts_read_open_breakers_of_live_workers_and_outcomes_per_kind,
);

/// `Ledger::headline` (two `GROUP BY`s) equals the figures computed here from each job's
/// whole record: arrivals in `[since, until)` (ended or not), on time, refused, wasted model
/// time, the nearest-rank p99 queue dwell's bucket, per slice and in total; per tenant too.
async fn the_headline_equals_the_records_and_reads_no_text(db: &TestDb) {
    use lastcall_core::headline::{HEADLINE_SLICES, slice_of};
    use lastcall_store::{DWELL_BUCKETS_MS, HEADLINE_STATEMENTS};
    let l = &db.ledger;
    let (since, until) = (1_000_000i64, 1_000_000 + 15 * 60_000);
    let states = [
        State::Completed,
        State::Completed,
        State::Failed,
        State::ExpiredNotStarted,
        State::ExpiredBeforeReceive,
        State::DeadlineExceeded,
        State::Rejected,
        State::Unknown,
        State::Cancelled,
    ];
    let mut ids = Vec::new();
    for i in 0..150i64 {
        // From 2 minutes before the window to 1 minute after it.
        let created = since - 120_000 + i * 7_919 % (18 * 60_000);
        let state = states[i as usize % states.len()];
        let id = format!("h{i}");
        let dwell = (i * 37) % 3_000 + if i % 17 == 0 { 90_000 } else { 0 };
        let refused = matches!(
            state,
            State::ExpiredNotStarted | State::ExpiredBeforeReceive | State::Rejected
        );
        let rec = OutcomeRecord {
            created_at_ms: Some(created),
            received_at_ms: (state != State::ExpiredBeforeReceive).then_some(created + dwell),
            checked_at_ms: Some(created + dwell + 1),
            latency_ms: (!refused).then_some(100 + i),
            model_called: !refused,
            worker: if i % 11 == 0 {
                "dlq:x".into()
            } else {
                "w1".into()
            },
            tenant: Tenant::parse(["a", "b", "c"][i as usize % 3]).unwrap(),
            result: Some("text".into()),
            ..outcome(&id, &format!("{id}-1"), state, created + dwell + 500)
        };
        l.record_outcome(&rec).await.unwrap();
        ids.push(id);
    }
    // Jobs that have not ended: arrivals, pending.
    for j in 0..6i64 {
        let id = format!("p{j}");
        l.record_accepted(&accepted(&id, "chat", since + 1_000 + j * 100_000, until))
            .await
            .unwrap();
        ids.push(id);
    }

    for tenant in [None, Some("b")] {
        let got = l.headline(since, until, tenant).await.unwrap();
        let mut recs = Vec::new();
        for id in &ids {
            recs.push(must_get(l, id).await);
        }
        let arrivals: Vec<&JobRecord> = recs
            .iter()
            .filter(|r| r.created_at_ms.is_some_and(|c| c >= since && c < until))
            .filter(|r| tenant.is_none_or(|t| r.tenant == t))
            .collect();
        let check = |f: &lastcall_core::headline::Figures, rs: &[&&JobRecord]| {
            let count = |p: &dyn Fn(&str) -> bool| rs.iter().filter(|r| p(&r.state)).count() as u64;
            assert_eq!(f.arrivals, rs.len() as u64);
            assert_eq!(f.on_time, count(&|s| s == "completed"));
            assert_eq!(
                f.refused,
                count(
                    &|s| ["expired_not_started", "expired_before_receive", "rejected"].contains(&s)
                )
            );
            assert_eq!(f.pending, count(&|s| s == "accepted" || s == "running"));
            assert_eq!(
                f.wasted_model_ms,
                rs.iter()
                    .map(|r| r.wasted_model_ms.max(0) as u64)
                    .sum::<u64>()
            );
            let mut dwells: Vec<i64> = rs
                .iter()
                .filter(|r| !r.worker.as_deref().unwrap_or("").starts_with("dlq:"))
                .filter_map(|r| Some(r.received_at_ms? - r.created_at_ms?))
                .collect();
            dwells.sort_unstable();
            let want = lastcall_core::report::percentile(&dwells, 0.99).map(|d| {
                match DWELL_BUCKETS_MS.iter().find(|b| d <= **b as i64) {
                    Some(b) => (*b, false),
                    None => (*DWELL_BUCKETS_MS.last().unwrap(), true),
                }
            });
            assert_eq!(
                f.queue_dwell_p99_ms.map(|ms| (ms, f.queue_dwell_p99_over)),
                want,
                "{dwells:?}"
            );
        };
        let all: Vec<&&JobRecord> = arrivals.iter().collect();
        check(&got.total, &all);
        // The pending jobs are tenant `default`'s.
        assert!(got.total.arrivals > 30, "{got:?}");
        assert_eq!(got.total.pending > 0, tenant.is_none(), "{got:?}");
        assert!(got.total.queue_dwell_p99_over, "an overflow dwell: {got:?}");
        assert_eq!(got.trend.len(), HEADLINE_SLICES as usize);
        for (i, f) in got.trend.iter().enumerate() {
            let rs: Vec<&&JobRecord> = arrivals
                .iter()
                .filter(|r| {
                    slice_of(r.created_at_ms.unwrap(), since, until, HEADLINE_SLICES) == i as i64
                })
                .collect();
            check(f, &rs);
        }
    }
    for sql in HEADLINE_STATEMENTS {
        for col in ["result", "error", "payload"] {
            assert!(!sql.contains(col), "{col} in {sql}");
        }
    }
}

/// A worker's lease carries its live numbers (ledger version 13); a plain renewal keeps
/// them; leases older than the read's bound are not read.
async fn a_lease_carries_its_workers_live_numbers(db: &TestDb) {
    use lastcall_core::live::WorkerLive;
    let l = &db.ledger;
    let live = WorkerLive {
        waiting: 3,
        running: 2,
        limit: 4,
        learned_call_ms: [("chat".to_owned(), 1_500)].into(),
        ..Default::default()
    };
    l.heartbeat_live("w1", 10_000, &live.to_json())
        .await
        .unwrap();
    l.heartbeat("w-old", 1_000).await.unwrap();
    l.heartbeat("w-none", 9_000).await.unwrap();
    let got = l.worker_leases(5_000).await.unwrap();
    assert_eq!(got.len(), 2, "{got:?}");
    assert_eq!(
        (got[0].worker.as_str(), got[0].renewed_at_ms),
        ("w1", 10_000)
    );
    assert_eq!(got[0].live.as_ref(), Some(&live));
    assert_eq!(
        (got[1].worker.as_str(), got[1].live.as_ref()),
        ("w-none", None)
    );
    l.heartbeat("w1", 11_000).await.unwrap();
    let got = l.worker_leases(5_000).await.unwrap();
    assert_eq!(
        (got[0].renewed_at_ms, got[0].live.as_ref()),
        (11_000, Some(&live))
    );
}

/// The alerts' reads: breakers open now under a fresh lease, one per (worker, backend)
/// with its kinds; outcomes per kind with the refusals among them.
async fn the_alerts_read_open_breakers_of_live_workers_and_outcomes_per_kind(db: &TestDb) {
    let l = &db.ledger;
    let now = 100_000;
    l.heartbeat("live", now - 1_000).await.unwrap();
    l.heartbeat("dead", now - 60_000).await.unwrap();
    let kinds = ["chat".to_owned(), "embed".to_owned()];
    l.record_breaker_open("live", "vllm", &kinds, now + 5_000, now)
        .await
        .unwrap();
    l.record_breaker_open("dead", "vllm", &kinds, now + 5_000, now)
        .await
        .unwrap();
    l.record_breaker_open("live", "tgi", &["old".to_owned()], now - 1, now - 10_000)
        .await
        .unwrap();
    let open = l.open_breakers(now, now - 10_000).await.unwrap();
    assert_eq!(open.len(), 1, "{open:?}");
    assert_eq!(
        (open[0].worker.as_str(), open[0].backend.as_str()),
        ("live", "vllm")
    );
    assert_eq!(open[0].kinds, kinds);

    for (i, state) in [State::Rejected, State::ExpiredNotStarted, State::Completed]
        .into_iter()
        .enumerate()
    {
        l.record_outcome(&outcome(&format!("k{i}"), &format!("k{i}-1"), state, now))
            .await
            .unwrap();
    }
    let got = l.kind_outcomes(now - 1_000).await.unwrap();
    assert_eq!(got.len(), 1);
    assert_eq!(
        (got[0].kind.as_str(), got[0].jobs, got[0].refused),
        ("chat", 3, 2)
    );
}

/// A file of `lines` lines created at `created_at_ms`.
async fn old_file(l: &Ledger, file_id: &str, created_at_ms: i64, lines: usize) {
    let file = lastcall_store::FileRow {
        file_id: file_id.into(),
        tenant: "team-a".into(),
        purpose: "batch".into(),
        filename: "in.jsonl".into(),
        bytes: 0,
        line_count: 0,
        created_at_ms,
    };
    l.create_file(&file).await.unwrap();
    let text: Vec<String> = (0..lines).map(|i| format!("{{\"n\": {i}}}")).collect();
    l.append_file_lines(file_id, 1, &text).await.unwrap();
    l.finish_file(file_id, 10, lines as i64).await.unwrap();
}

/// A batch reading `file_id` whose window ends at `expires_at_ms`.
async fn batch_on(l: &Ledger, batch_id: &str, file_id: &str, expires_at_ms: i64) {
    l.create_batch(&lastcall_store::BatchRow {
        batch_id: batch_id.into(),
        tenant: "team-a".into(),
        input_file_id: file_id.into(),
        endpoint: "/v1/chat/completions".into(),
        completion_window: "30m".into(),
        metadata: None,
        allowed_kinds: None,
        job_prefix: format!("team-a:{batch_id}-"),
        created_at_ms: 0,
        expires_at_ms,
        total: 1,
        cursor: 0,
        cancelled_at_ms: None,
        cancel_cursor: 0,
    })
    .await
    .unwrap();
    l.record_line_error(
        batch_id,
        &lastcall_store::LineError {
            line_no: 1,
            custom_id: None,
            code: "invalid_json".into(),
            message: "x".into(),
        },
    )
    .await
    .unwrap();
}

async fn batches_past_their_window_and_files_no_batch_reads_are_pruned(db: &TestDb) {
    let l = &db.ledger;
    // Old and unused: goes, its 7 lines in pages of 3.
    old_file(l, "file-unused", 1_000, 7).await;
    // Old, read by a batch whose window ended before the cut: both go.
    old_file(l, "file-done", 1_000, 2).await;
    batch_on(l, "batch_done", "file-done", ROW_CUT - 1).await;
    // Old, read by a batch whose window is still open at the cut: both stay.
    old_file(l, "file-open", 1_000, 2).await;
    batch_on(l, "batch_open", "file-open", ROW_CUT + 1).await;
    // Created after the cut, unused: stays.
    old_file(l, "file-new", ROW_CUT, 2).await;

    let preview = l.prune_preview(Some(ROW_CUT), None).await.unwrap();
    assert_eq!((preview.batches, preview.files), (1, 1), "{preview:?}");
    let mut total = lastcall_store::PruneCounts::default();
    loop {
        let c = l.prune_batches_and_files(ROW_CUT, 3).await.unwrap();
        total.add(&c);
        if c.batches + c.files == 0 {
            break;
        }
    }
    // The batch first, then the files no batch reads any more, its input among them.
    assert_eq!((total.batches, total.files), (1, 2), "{total:?}");
    for gone in ["file-unused", "file-done"] {
        assert_eq!(l.get_file(gone).await.unwrap(), None, "{gone}");
        assert!(
            l.file_lines(gone, 1, 100).await.unwrap().is_empty(),
            "{gone}"
        );
    }
    for kept in ["file-open", "file-new"] {
        assert!(l.get_file(kept).await.unwrap().is_some(), "{kept}");
        assert_eq!(l.file_lines(kept, 1, 100).await.unwrap().len(), 2, "{kept}");
    }
    assert_eq!(l.get_batch("batch_done").await.unwrap(), None);
    assert!(l.line_errors("batch_done", 0, 10).await.unwrap().is_empty());
    assert!(l.get_batch("batch_open").await.unwrap().is_some());
    assert_eq!(l.line_errors("batch_open", 0, 10).await.unwrap().len(), 1);
    let again = l.prune_preview(Some(ROW_CUT), None).await.unwrap();
    assert_eq!((again.batches, again.files), (0, 0), "{again:?}");
}
