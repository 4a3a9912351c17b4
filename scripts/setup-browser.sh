#!/usr/bin/env bash
# Headless Chromium for the dashboard test (crates/cli/tests/http_views.rs): Debian's
# `chromium` package. Idempotent; installing needs root or password-less sudo (or an
# existing install).
set -euo pipefail
if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then
  exit 0
fi
sudo=()
if [ "$(id -u)" != 0 ] && sudo -n true 2>/dev/null; then
  sudo=(sudo -n)
fi
if command -v apt-get >/dev/null 2>&1 && { [ "$(id -u)" = 0 ] || [ ${#sudo[@]} -gt 0 ]; }; then
  echo "[browser] installing chromium (apt-get)" >&2
  "${sudo[@]}" apt-get update -qq
  "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y chromium fonts-dejavu-core >&2
else
  echo "[browser] Chromium is missing: install Debian's chromium package (sudo apt-get install chromium)" >&2
  exit 1
fi
