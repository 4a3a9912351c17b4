-- lastcall ledger, version 8: tenants and priority tiers (issue #33). Each job row says
-- whose it is (`tenant`, from the signed envelope; `default` for a job that names none,
-- and for every row written before this version, whose jobs could name none) and its
-- tier (`priority`: `critical`, `standard` or `batch`). A constant default, so adding the
-- columns rewrites no row. `jobs list --tenant`, `GET /v1/jobs?tenant=`, `report` and the
-- dashboard filter or group by tenant; the index serves one tenant's jobs in recorded order.

ALTER TABLE jobs ADD COLUMN tenant TEXT NOT NULL DEFAULT 'default';
ALTER TABLE jobs ADD COLUMN priority TEXT NOT NULL DEFAULT 'standard';
-- jobs_tenant_recorded ON jobs (tenant, recorded_at_ms)
-- (PostgreSQL builds this index with CREATE INDEX CONCURRENTLY after the migration's
-- transaction commits, so that writers are not blocked while it is built over a table that
-- may already be large: see `ONLINE_INDEXES` in crates/store/src/migrate.rs.)
