-- lastcall ledger, version 14: files and batches of the OpenAI-compatible Batch API.
-- `files`: one row per uploaded file (`complete` once every line is in); `file_lines`: its
-- lines, one row each, so an upload is written and read a page at a time, never held whole.
-- `batches`: one row per batch; `cursor` counts the lines handled (published as jobs, or
-- malformed) from the first, persisted after each page so a restarted `serve` resumes
-- there; `cancel_cursor` counts the published lines asked to cancel. A line's job id is
-- `job_prefix` and its line number, so the jobs of a batch are found by id.
-- `batch_line_errors`: the malformed lines, for the error file.

CREATE TABLE files (
    file_id        TEXT    NOT NULL PRIMARY KEY,
    tenant         TEXT    NOT NULL,
    purpose        TEXT    NOT NULL,
    filename       TEXT    NOT NULL,
    bytes          INTEGER NOT NULL,
    line_count     INTEGER NOT NULL,
    created_at_ms  INTEGER NOT NULL,
    complete       BOOLEAN NOT NULL DEFAULT FALSE
);

CREATE TABLE file_lines (
    file_id  TEXT    NOT NULL,
    line_no  INTEGER NOT NULL,
    content  TEXT    NOT NULL,
    PRIMARY KEY (file_id, line_no)
);

CREATE TABLE batches (
    batch_id           TEXT    NOT NULL PRIMARY KEY,
    tenant             TEXT    NOT NULL,
    input_file_id      TEXT    NOT NULL,
    endpoint           TEXT    NOT NULL,
    completion_window  TEXT    NOT NULL,
    metadata           TEXT,
    allowed_kinds      TEXT,
    job_prefix         TEXT    NOT NULL,
    created_at_ms      INTEGER NOT NULL,
    expires_at_ms      INTEGER NOT NULL,
    total              INTEGER NOT NULL,
    cursor             INTEGER NOT NULL DEFAULT 0,
    cancelled_at_ms    INTEGER,
    cancel_cursor      INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX batches_tenant_created ON batches (tenant, created_at_ms);

CREATE TABLE batch_line_errors (
    batch_id   TEXT    NOT NULL,
    line_no    INTEGER NOT NULL,
    custom_id  TEXT,
    code       TEXT    NOT NULL,
    message    TEXT    NOT NULL,
    PRIMARY KEY (batch_id, line_no)
);
