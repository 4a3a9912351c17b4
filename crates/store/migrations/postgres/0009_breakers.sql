-- lastcall ledger, version 9: the workers' open circuit breakers, for the door (issue #32).
-- While a worker's breaker for a model server is open it holds one row per kind it sent
-- to that server (`kind`, `backend`), with the instant it next lets a trial call through
-- (`open_until_ms`); the row goes when the breaker closes. `serve` and `submit` answer a
-- new job of the kind `503 upstream_unavailable` while every live worker (a fresh lease
-- in `workers`) has the kind's breaker open. A row whose trial time has passed, or whose
-- worker's lease is stale (it died), counts as closed: nothing needs to clean up after a
-- dead worker for the door to admit again.

CREATE TABLE breakers (
    worker         TEXT   NOT NULL,
    kind           TEXT   NOT NULL,
    backend        TEXT   NOT NULL,
    open_until_ms  BIGINT NOT NULL,
    recorded_at_ms BIGINT NOT NULL,
    PRIMARY KEY (worker, kind)
);
CREATE INDEX breakers_kind ON breakers (kind, open_until_ms);
