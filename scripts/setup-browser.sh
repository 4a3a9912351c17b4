#!/usr/bin/env bash
# Headless Chromium for the dashboard test (crates/http/tests/dashboard.rs): Debian's
# `chromium` package. Idempotent; needs root (or an existing install).
set -euo pipefail
if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "[browser] installing chromium (apt)" >&2
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium fonts-dejavu-core >/dev/null
else
  echo "[browser] Chromium is missing: install Debian's chromium package (sudo apt-get install chromium)" >&2
  exit 1
fi
