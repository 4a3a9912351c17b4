-- lastcall ledger, version 2 (PostgreSQL): a job's attempt and model-call counts are
-- counted from its `attempts` rows when read, never stored (the group commit no longer
-- recounts them).

ALTER TABLE jobs DROP COLUMN attempts;
ALTER TABLE jobs DROP COLUMN backend_calls;
