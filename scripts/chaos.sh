#!/usr/bin/env bash
# The fault suite (RELIABILITY.md): run one, several or all scenarios and print one
# accounting row each (attempted/confirmed, outcomes, lost, duplicate outcomes, late
# starts, duplicate calls, recovery). Every scenario runs the real binaries on private
# services of its own (a RabbitMQ node or cluster, a PostgreSQL cluster) and restores what
# it changed; the shared broker and database are not touched.
#
#   scripts/chaos.sh                 # the short tier (the scenarios CI runs)
#   scripts/chaos.sh stop_app proxy  # those scenarios only
#   scripts/chaos.sh --all           # the short tier and the slow one (3-node clusters,
#                                    # the 5-minute soak; scripts/soak.sh runs it longer)
#   scripts/chaos.sh --list          # the scenario names
#
# LASTCALL_CHAOS_ROWS=FILE appends each row to FILE as a Markdown table row.
set -euo pipefail
cd "$(dirname "$0")/.."

declare -A TESTS=(
  [stop_app]=broker_stop_app_then_start_app
  [kill9_node]=broker_node_killed_then_started_again
  [close_all_connections]=broker_closes_all_connections
  [proxy]=proxy_resets_delays_and_blackholes_the_workers_traffic
  [postgres_restart]=postgres_stopped_then_started
  [sigstop]=worker_sigstop_then_sigcont
  [sigkill_loop]=worker_sigkill_loop_three_workers_one_postgres_ledger
  [memory_alarm]=memory_alarm_while_serve_takes_posts
  [cluster_kill_workers_node]=cluster_of_three_the_workers_node_killed
  [cluster_kill_home_node]=cluster_of_three_the_topology_home_node_killed
  [soak]=soak_under_faults
)
SHORT=(stop_app kill9_node close_all_connections proxy postgres_restart sigstop sigkill_loop memory_alarm)
SLOW=(cluster_kill_workers_node cluster_kill_home_node soak)

usage() { sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; }

chosen=()
ignored=default
for arg in "$@"; do
  case "$arg" in
    -h|--help) usage; exit 0 ;;
    --list)
      echo "short tier: ${SHORT[*]}"
      echo "slow tier:  ${SLOW[*]}"
      exit 0 ;;
    --all) chosen+=("${SHORT[@]}" "${SLOW[@]}") ;;
    *)
      if [ -z "${TESTS[$arg]:-}" ]; then
        echo "chaos: unknown scenario '$arg'; the scenarios are: ${SHORT[*]} ${SLOW[*]}" >&2
        exit 2
      fi
      chosen+=("$arg") ;;
  esac
done
[ ${#chosen[@]} -gt 0 ] || chosen=("${SHORT[@]}")

filter=""
for name in "${chosen[@]}"; do
  filter="${filter:+$filter | }test(=chaos::${TESTS[$name]})"
  for slow in "${SLOW[@]}"; do [ "$name" = "$slow" ] && ignored=all; done
done

exec cargo nextest run -p lastcall --features test-hooks --test suite --no-capture \
  --run-ignored "$ignored" -E "$filter"
