#!/usr/bin/env bash
# The README's first command: run lastcall end to end on the local defaults.
# Makes sure RabbitMQ is running, builds lastcall, and runs `lastcall demo`.
# Extra arguments go to `lastcall demo` (see `lastcall demo --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/services.sh rabbitmq
cargo build --release --quiet -p lastcall
exec target/release/lastcall demo "$@"
