-- lastcall ledger, version 10: a webhook whose delivery was given up (its attempts used
-- up, or an answer that retrying cannot change) records when (`given_up_at_ms`). Until
-- then an undelivered webhook holds its job against retention; after it, nothing will
-- deliver it, and the job goes with the others (issue #35). Rows written before this
-- version have NULL: they keep holding their job, as before (`lastcall ledger prune
-- --dry-run` counts them as held).

ALTER TABLE webhooks ADD COLUMN given_up_at_ms BIGINT;
