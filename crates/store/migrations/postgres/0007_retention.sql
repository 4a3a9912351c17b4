-- lastcall ledger, version 7: retention. `lastcall ledger prune` (and the worker's
-- background pruning) clears the `result` text of terminal jobs older than the text
-- retention, oldest first. This partial index holds only the rows that still have a
-- text, so each pass reads the oldest of them directly instead of walking past every
-- row already cleared. (Deleting whole rows uses `jobs_recorded_at`.)

-- jobs_text_recorded ON jobs (recorded_at_ms) WHERE result IS NOT NULL
-- (PostgreSQL builds this index with CREATE INDEX CONCURRENTLY after the migration's
-- transaction commits, so that writers are not blocked while it is built over a table that
-- may already be large: see `ONLINE_INDEXES` in crates/store/src/migrate.rs.)
