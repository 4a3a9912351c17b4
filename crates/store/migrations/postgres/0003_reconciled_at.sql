-- lastcall ledger, version 3 (PostgreSQL): `unknown` is the only terminal state a later
-- real outcome replaces. `reconciled_at_ms` is when reconciliation marked the job
-- `unknown`; it is kept when the real outcome arrives later, so late truths stay countable
-- (`reconciled_at_ms IS NOT NULL AND state <> 'unknown'`). NULL for every other job.

ALTER TABLE jobs ADD COLUMN reconciled_at_ms BIGINT;

-- Every `unknown` row so far was written by reconciliation, which stamped `recorded_at_ms`
-- with the time it marked the job: that is when it was reconciled.
UPDATE jobs SET reconciled_at_ms = recorded_at_ms WHERE state = 'unknown';

-- Partial and covering: only reconciled jobs (few) are indexed, and the late-outcome count
-- (scraped with /metrics) reads this index alone.
-- jobs_reconciled ON jobs (state, reconciled_at_ms) WHERE reconciled_at_ms IS NOT NULL
-- (PostgreSQL builds this index with CREATE INDEX CONCURRENTLY after the migration's
-- transaction commits, so that writers are not blocked while it is built over a table that
-- may already be large: see `ONLINE_INDEXES` in crates/store/src/migrate.rs.)
