-- lastcall ledger, version 12: the request's size as the worker measured it from the
-- payload before the call (`lastcall_core::request_size::RequestSize`): `request_tokens`,
-- the approximate prompt tokens (characters ÷ 4 + 4 per message), and `request_max_tokens`,
-- the payload's `max_tokens`. A starting worker replays the ledger's recent calls into its
-- call-time estimator (issue #31) under this size, the unit its live calls are learned in;
-- `prompt_tokens` is the model server's own count (its `usage`), a different measure.
-- Rows recorded before this version, and jobs whose payload is not a chat request, have
-- NULL (a starting worker then falls back to `prompt_tokens`); `request_max_tokens` is
-- also NULL when the payload sets no `max_tokens`.

ALTER TABLE jobs ADD COLUMN request_tokens BIGINT;
ALTER TABLE jobs ADD COLUMN request_max_tokens BIGINT;
