-- lastcall ledger, version 5: which backend and model ran a job, and the minimum useful
-- runtime its admission decision used (the job's own, the learned call time, or the
-- configured floor), so `jobs show` can say why a job with budget left was not started.

ALTER TABLE jobs ADD COLUMN backend TEXT;
ALTER TABLE jobs ADD COLUMN model TEXT;
ALTER TABLE jobs ADD COLUMN min_runtime_ms BIGINT;
