#!/usr/bin/env bash
# The README's second command: run the whole test suite against real services.
# Starts RabbitMQ and PostgreSQL if needed, then runs every test with cargo-nextest.
# Extra arguments go to `cargo nextest run`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/services.sh all
if ! cargo nextest --version >/dev/null 2>&1; then
  echo "[test] installing cargo-nextest" >&2
  cargo install --locked cargo-nextest
fi
cargo nextest run --workspace --no-fail-fast "$@"
