-- lastcall ledger, version 11: when a webhook was claimed for delivery, refreshed by every
-- attempt (`claimed_at_ms`). `serve` sweeps the ledger for the webhooks of ended jobs that
-- no process delivers — never claimed (no `serve` saw the outcome event: it was down or
-- disconnected) or claimed by a process that stopped mid-delivery (no attempt for 10
-- minutes) — and delivers them (issue #35: such a webhook held its job against retention
-- forever). Claims made before this version have NULL: they count as stale.

ALTER TABLE webhooks ADD COLUMN claimed_at_ms BIGINT;

-- The sweep reads only the webhooks still open.
-- webhooks_open ON webhooks (registered_at_ms)
--     WHERE delivered_at_ms IS NULL AND given_up_at_ms IS NULL
-- (PostgreSQL builds this index with CREATE INDEX CONCURRENTLY after the migration's
-- transaction commits, so that writers are not blocked while it is built over a table that
-- may already be large: see `ONLINE_INDEXES` in crates/store/src/migrate.rs.)
