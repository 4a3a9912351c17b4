-- lastcall ledger, version 6: webhooks. A job submitted over HTTP with a `callback_url`
-- gets a row here before it is published; the `serve` process that first sees its outcome
-- event claims it (`claimed_by`) and POSTs the event there, recording every attempt.

CREATE TABLE webhooks (
    job_id          TEXT    NOT NULL PRIMARY KEY,
    url             TEXT    NOT NULL,
    registered_at_ms BIGINT NOT NULL,
    claimed_by      TEXT,
    delivered_at_ms BIGINT
);

CREATE TABLE webhook_attempts (
    job_id  TEXT    NOT NULL,
    attempt BIGINT  NOT NULL,
    at_ms   BIGINT  NOT NULL,
    status  BIGINT,
    error   TEXT,
    PRIMARY KEY (job_id, attempt)
);
