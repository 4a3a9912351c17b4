-- lastcall ledger, version 13: each worker's live numbers in its lease (issue #53). At
-- every renewal a worker writes `live`, JSON (`lastcall_core::live::WorkerLive`): its jobs
-- waiting for a slot, its model calls running, its concurrency limit and its learned call
-- times. `serve`'s dashboard reads the leases instead of scraping each worker's `/metrics`
-- at an address given by hand. NULL: a worker of an earlier version (no numbers).

ALTER TABLE workers ADD COLUMN live TEXT;
