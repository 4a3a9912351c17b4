#!/usr/bin/env bash
# The soak under faults (RELIABILITY.md, "The soak"): the fault suite's harness run for
# minutes on private services of its own (a RabbitMQ node and a PostgreSQL cluster on free
# ports; the shared broker on 5672 and database on 5432 are not touched).
#
#   scripts/soak.sh                 # 60 minutes
#   scripts/soak.sh --minutes 15    # 15 minutes (at least 3)
#   scripts/soak.sh --out DIR       # where the results go (default target/soak/UTC-TIME)
#
# Load: about 1.5x what three `lastcall worker --backend sim` can do, through `lastcall
# serve` (POSTs) and a pika producer, all on one PostgreSQL ledger pruned every 30 s
# (retention 2 min of rows, 1 min of result texts). Faults: a broker restart every 10 min,
# a worker SIGKILL (then restart) every 7 min, one PostgreSQL restart; a shorter run
# scales the intervals so that it sees each fault at least once. Every 30 s it samples
# each process's resident memory and open descriptors, the broker's AMQP channels, the
# ledger's rows and bytes and the dispatch p99. Writes samples.csv, summary.md and rss.svg
# into the output directory. Exits non-zero when a job is lost, an outcome is duplicated,
# a model call started after its deadline, resident memory of a lastcall process grew more
# than +10% from minute 10 (runs under 30 min: +20% from a third of the run), or the
# ledger outgrew what retention allows. Needs the python venv of
# scripts/setup-python-example.sh (pika). The test is `soak_under_faults` in
# crates/cli/tests/chaos.rs; the slow tier (`scripts/chaos.sh --all`) runs it for 5 min.
set -euo pipefail
cd "$(dirname "$0")/.."

usage() { sed -n '2,24p' "$0" | sed 's/^# \{0,1\}//'; }

minutes=60
out=""
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --minutes)
      minutes="${2:-}"; shift 2 || { echo "soak: --minutes needs a number" >&2; exit 2; } ;;
    --minutes=*) minutes="${1#*=}"; shift ;;
    --out) out="${2:-}"; shift 2 || { echo "soak: --out needs a directory" >&2; exit 2; } ;;
    --out=*) out="${1#*=}"; shift ;;
    *) echo "soak: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
if ! [[ "$minutes" =~ ^[0-9]+([.][0-9]+)?$ ]] || awk "BEGIN { exit !($minutes < 3) }"; then
  echo "soak: --minutes must be a number of minutes, at least 3 (got '$minutes')" >&2
  exit 2
fi
out="${out:-target/soak/$(date -u +%Y%m%dT%H%M%SZ)}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
scripts/setup-python-example.sh
echo "soak: $minutes min; results in $out" >&2

export LASTCALL_SOAK_MINUTES="$minutes" LASTCALL_SOAK_OUT="$out"
# The soak profile (.config/nextest.toml) lets the test run for hours. The feature set of
# scripts/test.sh, so that the test build is reused.
status=0
cargo nextest run --workspace --features lastcall/otlp,lastcall/test-hooks --test suite --no-capture --profile soak \
  --run-ignored all -E 'test(=chaos::soak_under_faults)' || status=$?
for f in summary.md samples.csv rss.svg; do
  [ -f "$out/$f" ] && echo "soak: $out/$f" >&2
done
exit "$status"
