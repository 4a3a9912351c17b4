#!/usr/bin/env bash
# What the worker's window (prefetch) costs on a RabbitMQ cluster: starts a private 3-node
# cluster on free ports (its own node names, data, cookie; management on each node), runs
# `lastcall-bench goodput` against it with quorum queues once per window, alternating the
# windows run after run, and samples the management API every second meanwhile: the run's
# unacked and ready deliveries per queue, the queue leader, and each node's memory.
# The bench's worker and producer connect to node a (first in the URL list); node a is
# made to lead 40 idle quorum queues, so that with `queue_leader_locator = balanced` the
# run's queues are led by node b or c: the worker consumes through a node that does not
# lead its queues. The nodes are stopped and their data removed on exit, whatever happens;
# the shared broker (5672) is not touched.
#
#   scripts/cluster-bench.sh [--runs N] [--windows "default 4"] [--out DIR] [-- GOODPUT ARGS…]
#   scripts/cluster-bench.sh --kill-worker [--runs N] [--windows "default 4"] [--out DIR]
#   scripts/cluster-bench.sh --kill-leader [--runs N] [--windows "default 4"] [--out DIR]
#
# --runs: runs per window (default 2); --windows: `default` is the worker's default window,
# a number is `--prefetch N` (default "default 4"); --out: where each run's output
# (`run-K-WINDOW.txt`) and samples (`run-K-WINDOW.samples.jsonl`) go (default a new
# directory under /tmp, kept). GOODPUT ARGS default to the tenant-isolation shape:
# --policy deadline --service fixed:200 --slots 2 --deadline-ms 3000 --duration-s 20
# --tenants flood:10,light-5:0.1. LASTCALL_BENCH names the binary (default
# target/debug/lastcall-bench, or target/release/lastcall-bench when that exists).
# --kill-worker runs real processes instead (`lastcall serve`, two `lastcall worker`s with
# the sim backend, 2 slots, 200 ms calls, quorum queues, one SQLite ledger): worker w1 on
# node a, w2 on node b; 600 jobs with 90 s budgets are posted, w1 is killed (kill -9) with
# its window full, and the ledger says how many jobs ended how, how many calls started
# after their deadline or twice, and when w2 received w1's returned deliveries.
# --kill-leader is the same run with the work queue's leader node killed (kill -9 of its
# VM) instead of w1; the node is started again after the run.
# LASTCALL_BIN names `lastcall` (default target/debug/lastcall).
set -euo pipefail
cd "$(dirname "$0")/.."

usage() { sed -n '2,31p' "$0" | sed 's/^# \{0,1\}//'; }

runs=2
windows="default 4"
out=""
mode=goodput
goodput=(--policy deadline --service fixed:200 --slots 2 --deadline-ms 3000 --duration-s 20
  --tenants flood:10,light-5:0.1)
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --runs) runs="$2"; shift 2 ;;
    --windows) windows="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --kill-worker) mode=kill; shift ;;
    --kill-leader) mode=kill-leader; shift ;;
    --) shift; goodput=("$@"); break ;;
    *) echo "cluster-bench: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
  esac
done

bench="${LASTCALL_BENCH:-}"
if [ -z "$bench" ]; then
  bench=target/debug/lastcall-bench
  [ -x target/release/lastcall-bench ] && bench=target/release/lastcall-bench
fi
[ -x "$bench" ] || { echo "cluster-bench: no $bench (cargo build -p lastcall-bench)" >&2; exit 2; }
RABBIT_BIN=/usr/lib/rabbitmq/bin
[ -x "$RABBIT_BIN/rabbitmq-server" ] || { echo "cluster-bench: RabbitMQ is not installed" >&2; exit 2; }

top="$(mktemp -d /tmp/lastcall-cluster-bench.XXXXXX)"
[ -n "$out" ] || out="$(mktemp -d /tmp/lastcall-cluster-bench-out.XXXXXX)"
mkdir -p "$out"
NODES=(a b c)
declare -A AMQP DIST NPORT MGMT NAME
sampler=""
procs=()

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# rabbitmq-server / rabbitmqctl of node $1 with its own cookie (HOME), name and files;
node_env() {
  local n="$1" dir="$top/$1"
  shift
  env HOME="$dir" RABBITMQ_NODENAME="${NAME[$n]}" \
    RABBITMQ_CONF_ENV_FILE="$dir/rabbitmq-env.conf" RABBITMQ_PID_FILE="$dir/pid" \
    RABBITMQ_NODE_PORT="${AMQP[$n]}" RABBITMQ_DIST_PORT="${DIST[$n]}" \
    RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS="-kernel inet_dist_use_interface {127,0,0,1}" \
    RABBITMQ_MNESIA_BASE="$dir/mnesia" RABBITMQ_LOG_BASE="$dir/log" \
    RABBITMQ_CONFIG_FILE="$dir/rabbitmq.conf" \
    RABBITMQ_ADVANCED_CONFIG_FILE="$dir/advanced.config" \
    RABBITMQ_ENABLED_PLUGINS_FILE="$dir/enabled_plugins" "$@"
}
ctl() { local n="$1"; shift; node_env "$n" timeout 120 "$RABBIT_BIN/rabbitmqctl" -n "${NAME[$n]}" "$@"; }

# The node's VM pid, only if that process is still this node's VM.
vm_pid() {
  local pid
  pid="$(cat "$top/$1/pid" 2>/dev/null)" || return 1
  grep -qa "$top/$1" "/proc/$pid/cmdline" 2>/dev/null && echo "$pid"
}

cleanup() {
  local rc=$?
  [ -n "$sampler" ] && kill "$sampler" 2>/dev/null || true
  for p in "${procs[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  for n in "${NODES[@]}"; do
    [ -n "${NAME[$n]:-}" ] || continue
    ctl "$n" stop "$top/$n/pid" >/dev/null 2>&1 || true
    local pid
    if pid="$(vm_pid "$n")"; then kill -9 "$pid" 2>/dev/null || true; fi
  done
  rm -rf "$top"
  echo "cluster-bench: nodes stopped, $top removed; results in $out" >&2
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

cookie="LASTCALLCLUSTERBENCH$$$(free_port)"
for n in "${NODES[@]}"; do
  AMQP[$n]=$(free_port); DIST[$n]=$(free_port); MGMT[$n]=$(free_port)
  NAME[$n]="lastcall-cb-$$-$n@localhost"
  mkdir -p "$top/$n"
  cat >"$top/$n/rabbitmq.conf" <<EOF
listeners.tcp.default = 127.0.0.1:${AMQP[$n]}
management.tcp.ip = 127.0.0.1
management.tcp.port = ${MGMT[$n]}
collect_statistics_interval = 1000
queue_leader_locator = balanced
EOF
  echo '[rabbitmq_management].' >"$top/$n/enabled_plugins"
  : >"$top/$n/rabbitmq-env.conf"
  printf '%s' "$cookie" >"$top/$n/.erlang.cookie"
  chmod 400 "$top/$n/.erlang.cookie"
  node_env "$n" "$RABBIT_BIN/rabbitmq-server" >"$top/$n/server.out" 2>&1 </dev/null &
done

await_node() {
  local until=$((SECONDS + 180))
  until ctl "$1" await_startup --timeout 10 >/dev/null 2>&1; do
    if [ $SECONDS -gt $until ]; then
      echo "cluster-bench: node $1 did not start:" >&2
      tail -20 "$top/$1/server.out" >&2
      exit 1
    fi
    sleep 1
  done
}
for n in "${NODES[@]}"; do await_node "$n"; done
for n in b c; do
  ctl "$n" stop_app >/dev/null
  ctl "$n" join_cluster "${NAME[a]}" >/dev/null
  ctl "$n" start_app >/dev/null
  await_node "$n"
done
api="http://guest:guest@127.0.0.1:${MGMT[a]}/api"
until curl -sf "$api/nodes?columns=name,running" | jq -e 'map(select(.running)) | length == 3' >/dev/null; do
  sleep 1
done
# Node a leads 40 idle quorum queues (declared through its own API, client-local).
for i in $(seq 40); do
  curl -sf -X PUT "$api/queues/%2f/cluster-bench-ballast-$i" -H 'content-type: application/json' \
    -d '{"durable":true,"arguments":{"x-queue-type":"quorum","x-queue-leader-locator":"client-local"}}' >/dev/null
done
url="amqp://guest:guest@127.0.0.1:${AMQP[a]}/%2f,amqp://guest:guest@127.0.0.1:${AMQP[b]}/%2f,amqp://guest:guest@127.0.0.1:${AMQP[c]}/%2f"
{
  echo "cluster: ${NAME[a]} ${NAME[b]} ${NAME[c]} (RabbitMQ $(ctl a version 2>/dev/null)); bench: $bench"
  echo "the bench connects to node a; 40 idle quorum queues led by node a"
} | tee "$out/cluster.txt"

# One JSON line a second: the time, the run's queues (name, leader, ready, unacked,
# memory) and each node's memory in use and its quorum-queue and binary shares.
sample() {
  while :; do
    jq -cn --argjson t "$(date +%s.%N)" \
      --argjson q "$(curl -sf "$api/queues/%2f?columns=name,type,leader,node,messages_ready,messages_unacknowledged,memory" || echo '[]')" \
      --argjson n "$(curl -sf "$api/nodes?columns=name,mem_used" || echo '[]')" \
      --argjson m "$(for n in "${NODES[@]}"; do curl -sf "$api/nodes/${NAME[$n]}/memory" || echo '{}'; done | jq -cs .)" \
      '{t: $t, queues: [$q[] | select(.name | startswith("lastcall-bench"))], nodes: $n,
        breakdown: [$m[] | .memory | {total: .total.rss?, quorum_queue_procs, binary, connection_other}]}' || true
    sleep 1
  done
}

now_ms() { date +%s%3N; }
# The work queue's field $2 (messages_ready, messages_unacknowledged, consumers, leader).
work_q() { curl -sf "$api/queues/%2f/$1.work" | jq -r ".$2 // 0"; }
consumers_are() { [ "$(work_q "$1" consumers)" = "$2" ]; }
unacked_at_least() { [ "$(work_q "$1" messages_unacknowledged)" -ge "$2" ]; }
all_ended() { # DB PREFIX N: N jobs of PREFIX have an outcome
  [ "$(sqlite3 "$1" "select count(*) from jobs where job_id like '$2-%' and state not in ('accepted', 'running')")" = "$3" ]
}
wait_for() { # SECONDS COMMAND…: poll COMMAND every 0.2 s until it succeeds
  local until=$((SECONDS + $1)); shift
  until "$@"; do
    [ $SECONDS -le $until ] || { echo "cluster-bench: gave up waiting for: $*" >&2; return 1; }
    sleep 0.2
  done
}

# One kill run: window $1 (`default` or N), run number $2.
kill_run() {
  local w="$1" k="$2" lastcall="${LASTCALL_BIN:-target/debug/lastcall}"
  local n=600 p="kill$k" db="$top/kill-$k.db" hp log="$out/kill-$k-$w.txt"
  local url_b="amqp://guest:guest@127.0.0.1:${AMQP[b]}/%2f,amqp://guest:guest@127.0.0.1:${AMQP[a]}/%2f"
  local common=(--store-url "sqlite://$db" --prefix "$p") token=cluster-bench-token-0123456789
  local wargs=(worker "${common[@]}" --queue-type quorum --backend sim --sim-latency-ms 200 --slots 2)
  [ "$w" = default ] || wargs+=(--prefetch "$w")
  hp=$(free_port)
  echo "kill run $k, window $w, $(date -u +%FT%TZ), uptime:$(uptime)" | tee "$log"
  "$lastcall" --amqp-url "$url" topology apply "${common[@]}" --queue-type quorum >>"$log" 2>&1
  LASTCALL_HTTP_TOKEN="$token" "$lastcall" --amqp-url "$url" serve "${common[@]}" --queue-type quorum \
    --addr "127.0.0.1:$hp" --no-shed --management-url "http://127.0.0.1:${MGMT[a]}" >"$out/kill-$k-serve.log" 2>&1 &
  procs+=($!)
  "$lastcall" --amqp-url "$url" "${wargs[@]}" --name w1 >"$out/kill-$k-w1.log" 2>&1 &
  local w1=$!
  procs+=("$w1")
  "$lastcall" --amqp-url "$url_b" "${wargs[@]}" --name w2 >"$out/kill-$k-w2.log" 2>&1 &
  procs+=($!)
  wait_for 120 curl -sf -o /dev/null "http://127.0.0.1:$hp/readyz"
  wait_for 120 consumers_are "$p" 2
  echo "$lastcall --amqp-url <a,b,c> ${wargs[*]} --name w1; w2 the same on <b,a>; work queue led by $(work_q "$p" leader)" | tee -a "$log"
  local t_post
  t_post=$(now_ms)
  seq "$n" | xargs -P 8 -I{} curl -sf -o /dev/null -H "Authorization: Bearer $token" \
    -H 'content-type: application/json' -d "{\"kind\":\"bench.kill\",\"deadline_ms\":90000,\"job_id\":\"$p-{}\",\"payload\":{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}]}}" \
    "http://127.0.0.1:$hp/v1/jobs"
  # Kill w1 once both windows are full (128 for 2 slots by default), as the management
  # API's statistics (every second) see them.
  local t_posted ready unacked t_kill
  t_posted=$(now_ms)
  wait_for 60 unacked_at_least "$p" $((2 * ${w/default/128})) || echo "the windows were not full" | tee -a "$log"
  ready=$(work_q "$p" messages_ready) unacked=$(work_q "$p" messages_unacknowledged)
  local victim=w1 leader
  leader=$(work_q "$p" leader)
  if [ "$mode" = kill-leader ]; then
    for x in "${NODES[@]}"; do [ "${NAME[$x]}" = "$leader" ] && victim="$x"; done
  fi
  t_kill=$(now_ms)
  if [ "$victim" = w1 ]; then
    kill -9 "$w1"
    wait "$w1" 2>/dev/null || true
  else
    kill -9 "$(vm_pid "$victim")"
  fi
  echo "posted $n in $((t_posted - t_post)) ms; killed $victim (the leader was $leader) at $t_kill ms, $((t_kill - t_posted)) ms later: ready $ready, unacked $unacked (both workers)" | tee -a "$log"
  if [ "$victim" = w1 ]; then
    wait_for 30 consumers_are "$p" 1
    echo "the broker dropped w1's consumer after $(($(now_ms) - t_kill)) ms (management API, 1 s statistics)" | tee -a "$log"
  fi
  wait_for 180 all_ended "$db" "$p" "$n" || echo "not all $n jobs ended within 180 s" | tee -a "$log"
  echo "all ended $(($(now_ms) - t_kill)) ms after the kill" | tee -a "$log"
  sqlite3 -header -column "$db" "
    select state, count(*) jobs, sum(started_at_ms > expires_at_ms) started_late,
           max(finished_at_ms - expires_at_ms) latest_finish_vs_deadline_ms
      from jobs where job_id like '$p-%' group by state;
    select count(*) jobs_called_twice from (select job_id from attempts
      where model_called = 1 and job_id like '$p-%' group by job_id having count(*) > 1);
    select worker, count(*) redelivered, min(received_at_ms - $t_kill) first_ms, max(received_at_ms - $t_kill) last_ms,
           sum(model_called) calls
      from attempts where redelivered = 1 and job_id like '$p-%' group by worker;
    select count(*) w1_calls_started_not_finished from attempts
      where worker = 'w1' and started_at_ms is not null and finished_at_ms is null and job_id like '$p-%';" | tee -a "$log"
  for pid in "${procs[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${procs[@]}"; do wait "$pid" 2>/dev/null || true; done
  procs=()
  "$lastcall" --amqp-url "$url" topology delete "${common[@]}" >/dev/null 2>&1 || true
  if [ "$victim" != w1 ]; then
    node_env "$victim" "$RABBIT_BIN/rabbitmq-server" >>"$top/$victim/server.out" 2>&1 </dev/null &
    await_node "$victim"
  fi
}

if [ "$mode" != goodput ]; then
  k=0
  for r in $(seq "$runs"); do
    for w in $windows; do k=$((k + 1)); kill_run "$w" "$k"; done
  done
  exit 0
fi

k=0
for r in $(seq "$runs"); do
  for w in $windows; do
    k=$((k + 1))
    args=("${goodput[@]}" --queue-type quorum --no-svg --management-url "http://127.0.0.1:${MGMT[a]}")
    [ "$w" = default ] || args+=(--prefetch "$w")
    log="$out/run-$k-$w.txt"
    {
      echo "run $k, window $w, $(date -u +%FT%TZ), uptime:$(uptime)"
      echo "$bench --amqp-url <a,b,c> goodput ${args[*]}"
    } | tee "$log"
    sample >"$out/run-$k-$w.samples.jsonl" 2>/dev/null &
    sampler=$!
    "$bench" --amqp-url "$url" goodput "${args[@]}" 2>&1 | tee -a "$log"
    kill "$sampler" 2>/dev/null || true
    wait "$sampler" 2>/dev/null || true
    sampler=""
    jq -s '{peak_unacked: (map([.queues[].messages_unacknowledged // 0] | add // 0) | max),
            peak_ready: (map([.queues[].messages_ready // 0] | add // 0) | max),
            leaders: (map(.queues[] | select(.name | test("\\.work(\\.lane[0-9]+)?$")) | .leader) | unique),
            peak_queue_memory: (map([.queues[].memory // 0] | add // 0) | max),
            node_mem_used_mb: (map(.nodes | map({(.name): ((.mem_used // 0) / 1048576 | floor)}) | add) | [first, (map(to_entries) | flatten | group_by(.key) | map({(.[0].key): (map(.value) | max)}) | add)] | {first: .[0], peak: .[1]}),
            quorum_procs_mb_peak: (map([.breakdown[].quorum_queue_procs // 0] | add) | max / 1048576)}' \
      "$out/run-$k-$w.samples.jsonl" | tee -a "$log"
  done
done
