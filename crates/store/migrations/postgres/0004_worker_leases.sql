-- lastcall ledger, version 4: worker leases. Each worker renews its row every few seconds
-- (`Ledger::heartbeat`); an attempt still `running` under a worker whose heartbeat is fresh
-- is live, so a redelivery of its job (after that worker lost its broker connection) waits
-- for it instead of calling the model a second time. One row per worker, not per job.

CREATE TABLE workers (
    name         TEXT   NOT NULL PRIMARY KEY,
    heartbeat_ms BIGINT NOT NULL
);
