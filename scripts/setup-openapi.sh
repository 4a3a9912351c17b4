#!/usr/bin/env bash
# Install the OpenAPI tools the HTTP tests use, into a private venv at
# ${LASTCALL_CACHE:-$HOME/.cache/lastcall}/openapi-venv, created once and reused:
# - `openapi-spec-validator` (PyPI): crates/http/tests/api.rs
#   (openapi_document_passes_openapi_spec_validator) validates the document;
# - `schemathesis` (PyPI), pinned: crates/http/tests/contract.rs runs it against the
#   served `/openapi.json` of a real `lastcall serve` app, so the API and its document
#   cannot drift apart.
# scripts/test.sh runs this before the tests, so no test installs anything.
#
# stdout: nothing. stderr: what it does (pip's own progress while installing).
# Idempotent: a second run only checks the imports (and schemathesis's pinned version).
set -euo pipefail

cache="${LASTCALL_CACHE:-$HOME/.cache/lastcall}"
venv="$cache/openapi-venv"
python="${PYTHON:-python3}"
# Pinned: the contract test passes its CLI flags (--checks, --max-examples, --seed, …) as
# this version spells them. Works with Python 3.11 (Debian 12's python3).
schemathesis_version="4.32.5"
# PyPI packages and the modules they provide.
packages=(openapi-spec-validator "schemathesis==$schemathesis_version")
modules="openapi_spec_validator, schemathesis"

log() { printf 'setup-openapi: %s\n' "$*" >&2; }

installed() {
    [[ -x "$venv/bin/python" ]] && [[ -x "$venv/bin/schemathesis" ]] &&
        "$venv/bin/python" -c "
import sys, importlib.metadata
import $modules
sys.exit(importlib.metadata.version('schemathesis') != '$schemathesis_version')
" >/dev/null 2>&1
}

if installed; then
    log "already installed in $venv (openapi-spec-validator, schemathesis $schemathesis_version)"
    exit 0
fi
mkdir -p "$cache"
if [[ ! -x "$venv/bin/python" ]]; then
    log "creating venv at $venv"
    "$python" -m venv "$venv" >&2
fi
log "installing ${packages[*]} from PyPI into $venv"
"$venv/bin/python" -m pip install --progress-bar on "${packages[@]}" >&2
installed || {
    log "error: $modules (schemathesis $schemathesis_version) still cannot be imported from $venv"
    exit 1
}
log "installed"
