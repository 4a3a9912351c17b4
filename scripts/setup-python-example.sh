#!/usr/bin/env bash
# Install what the Python producer example (examples/python/producer.py) needs, into a
# private venv at ${LASTCALL_CACHE:-$HOME/.cache/lastcall}/python-example-venv, created
# once and reused:
# - `pika` (PyPI), the AMQP client the example publishes with. Everything else the example
#   uses (HMAC signing, the HTTP long-poll) is Python's standard library.
# - `openai` (PyPI, the official SDK, pinned): crates/cli/tests/events.rs points it at
#   `lastcall serve`'s OpenAI-compatible `POST /v1/chat/completions`, and
#   crates/cli/tests/batches.rs at its Files and Batch APIs.
# crates/cli/tests/python_example.rs runs the example with this venv's python against a
# real broker, worker and `lastcall serve`; scripts/test.sh runs this script before the
# tests, so no test installs anything.
#
# stdout: nothing. stderr: what it does (pip's own progress while installing).
# Idempotent: a second run only checks the import.
# The venv's interpreter is then $venv/bin/python (see examples/python/README.md).
set -euo pipefail

cache="${LASTCALL_CACHE:-$HOME/.cache/lastcall}"
venv="$cache/python-example-venv"
python="${PYTHON:-python3}"
# pika's BlockingConnection API (confirm_delivery, basic_publish raising on nack/return)
# has been stable since 1.0; below 2 in case a major version changes it.
requirement="pika>=1.3,<2"
# Pinned: the front-door test relies on the headers this version sends
# (X-Stainless-Read-Timeout) and on its retry rules (x-should-retry).
openai_version="1.109.1"

log() { printf 'setup-python-example: %s\n' "$*" >&2; }

installed() {
    [[ -x "$venv/bin/python" ]] &&
        "$venv/bin/python" -c "
import sys, importlib.metadata
import pika, openai
major = int(importlib.metadata.version('pika').split('.')[0])
sys.exit(major != 1 or importlib.metadata.version('openai') != '$openai_version')
" >/dev/null 2>&1
}

if installed; then
    log "already installed in $venv (pika $("$venv/bin/python" -c 'import pika; print(pika.__version__)'), openai $openai_version)"
    exit 0
fi
mkdir -p "$cache"
if [[ ! -x "$venv/bin/python" ]]; then
    log "creating venv at $venv"
    "$python" -m venv "$venv" >&2
fi
log "installing $requirement and openai==$openai_version from PyPI into $venv"
"$venv/bin/python" -m pip install --progress-bar on "$requirement" "openai==$openai_version" >&2
installed || {
    log "error: pika ($requirement) or openai $openai_version still cannot be imported from $venv"
    exit 1
}
log "installed"
