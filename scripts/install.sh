#!/usr/bin/env bash
# Put `lastcall` on the PATH: `cargo install --path crates/cli --locked`, which builds the
# release binary (reusing target/release when scripts/demo.sh has built it) and copies it
# to ~/.cargo/bin (rustup puts that directory on the PATH).
#
# Usage: scripts/install.sh [cargo install options], e.g. --root /usr/local,
#        --features otlp, --no-default-features (no embedded model; much faster to build).
# Remove it again with `cargo uninstall lastcall`.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v cargo >/dev/null 2>&1; then
  echo "[install] cargo is missing: install rustup (https://rustup.rs)" >&2
  exit 1
fi
echo "[install] cargo install --path crates/cli --locked $* (a first release build compiles candle and takes several minutes)" >&2
cargo install --path crates/cli --locked "$@"

# Where it went, and whether the shell finds it there.
root="${CARGO_INSTALL_ROOT:-${CARGO_HOME:-$HOME/.cargo}}"
args=("$@")
for i in "${!args[@]}"; do
  case "${args[$i]}" in
  --root) root="${args[$((i + 1))]:-$root}" ;;
  --root=*) root="${args[$i]#--root=}" ;;
  esac
done
bin="$root/bin/lastcall"
found="$(command -v lastcall || true)"
if [ "$found" = "$bin" ]; then
  echo "[install] lastcall is on the PATH: $bin ($("$bin" --version))" >&2
elif [ -n "$found" ]; then
  echo "[install] installed $bin, but the PATH finds $found first: put $root/bin earlier in PATH" >&2
else
  echo "[install] installed $bin; add it to the PATH: export PATH=\"$root/bin:\$PATH\"" >&2
fi
