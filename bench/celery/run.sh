#!/usr/bin/env bash
# Celery through lastcall's goodput overload scenario (see README.md).
# Usage: bench/celery/run.sh [goodput.py options], e.g. --service lognormal:200,0.6 --overload 2,5,10
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="${LASTCALL_CACHE:-$HOME/.cache/lastcall}/venv-celery"
# (Re)install when the venv is missing or requirements.txt changed since the last install.
if ! cmp -s "$here/requirements.txt" "$venv/requirements.txt"; then
    echo "setting up $venv" >&2
    python3 -m venv "$venv"
    "$venv/bin/pip" install --progress-bar on -r "$here/requirements.txt" >&2
    cp "$here/requirements.txt" "$venv/requirements.txt"
fi
cd "$here"
export PYTHONDONTWRITEBYTECODE=1  # no __pycache__ in the work tree
exec "$venv/bin/python" goodput.py "$@"
