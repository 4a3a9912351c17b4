//! Every integration test of the `lastcall` binary, in one test binary: one file (module)
//! per area, as before, sharing `common/`. One binary instead of one per file: each linked
//! the whole dependency tree and compiled `common/` again (43 binaries took ~170 s of CPU
//! time in a fresh build; BENCHMARKS.md §11). nextest still runs each test in its own
//! process. Filter by module: `cargo nextest run -p lastcall --features test-hooks -E
//! 'test(/^chaos::/)'` (the suite requires the feature: the binary's test-only flags).

mod common;

mod adaptive_slots;
mod alarm;
mod autoscale;
mod batches;
mod bench;
mod chaos;
mod cli_commands;
mod config_file;
mod consumer_timeout;
mod crash;
mod dead_letters;
mod docs;
mod door;
mod door_tenancy;
mod engine_hints;
mod events;
mod fallback;
mod http_views;
mod image;
mod isolation;
mod least_privilege;
mod ledger;
mod min_budget;
mod openai_pipeline;
mod otlp;
mod overload;
mod pg_outage;
mod pipeline;
mod poison;
mod python_example;
mod quorum;
mod rate_limits;
mod reconcile;
mod reconnect;
mod retries;
mod routing;
mod secrets;
mod security;
mod seed_cases;
mod serve;
mod serve_confirm_timeout;
mod sharing;
mod shed;
mod signing;
mod sqlite_full;
mod tenants;
mod tls;
mod upstream_advice;
mod upstream_breaker;
mod upstream_chaos;
mod upstream_errors;
mod upstream_faults;
