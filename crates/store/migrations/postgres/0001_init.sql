-- lastcall ledger, version 1 (PostgreSQL). Times are epoch milliseconds.

CREATE TABLE jobs (
    job_id            TEXT    NOT NULL PRIMARY KEY,
    kind              TEXT    NOT NULL,
    state             TEXT    NOT NULL,
    reason            TEXT,
    attempts          BIGINT  NOT NULL DEFAULT 0,
    backend_calls     BIGINT  NOT NULL DEFAULT 0,
    created_at_ms     BIGINT,
    expires_at_ms     BIGINT,
    accepted_at_ms    BIGINT,
    received_at_ms    BIGINT,
    checked_at_ms     BIGINT,
    started_at_ms     BIGINT,
    finished_at_ms    BIGINT,
    recorded_at_ms    BIGINT,
    worker            TEXT,
    result            TEXT,
    error             TEXT,
    trace_id          TEXT,
    payload_hash      TEXT,
    prompt_tokens     BIGINT,
    completion_tokens BIGINT,
    latency_ms        BIGINT,
    cancel_requested  BOOLEAN NOT NULL DEFAULT FALSE,
    cancel_confirmed  BOOLEAN
);

CREATE INDEX jobs_state ON jobs (state);
CREATE INDEX jobs_recorded_at ON jobs (recorded_at_ms);

CREATE TABLE attempts (
    attempt_key    TEXT    NOT NULL PRIMARY KEY,
    job_id         TEXT    NOT NULL,
    attempt        BIGINT  NOT NULL,
    worker         TEXT    NOT NULL,
    redelivered    BOOLEAN NOT NULL DEFAULT FALSE,
    received_at_ms BIGINT,
    checked_at_ms  BIGINT,
    started_at_ms  BIGINT,
    finished_at_ms BIGINT,
    acked_at_ms    BIGINT,
    decision       TEXT,
    state          TEXT,
    reason         TEXT,
    model_called   BOOLEAN NOT NULL DEFAULT FALSE
);

CREATE INDEX attempts_job_id ON attempts (job_id);
