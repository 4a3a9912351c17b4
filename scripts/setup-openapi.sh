#!/usr/bin/env bash
# Install the OpenAPI validator the HTTP tests use (crates/http/tests/api.rs:
# openapi_document_passes_openapi_spec_validator): `openapi-spec-validator` from PyPI, into
# a private venv at ${LASTCALL_CACHE:-$HOME/.cache/lastcall}/openapi-venv, created once and
# reused. scripts/test.sh runs this before the tests, so no test installs anything.
#
# stdout: nothing. stderr: what it does (pip's own progress while installing).
# Idempotent: a second run only checks the import.
set -euo pipefail

cache="${LASTCALL_CACHE:-$HOME/.cache/lastcall}"
venv="$cache/openapi-venv"
python="${PYTHON:-python3}"
# PyPI package and the module it provides.
packages=(openapi-spec-validator)
modules="openapi_spec_validator"

log() { printf 'setup-openapi: %s\n' "$*" >&2; }

installed() {
    [[ -x "$venv/bin/python" ]] && "$venv/bin/python" -c "import $modules" >/dev/null 2>&1
}

if installed; then
    log "already installed in $venv"
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
    log "error: $modules still cannot be imported from $venv"
    exit 1
}
log "installed"
