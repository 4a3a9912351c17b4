#!/usr/bin/env bash
# Put `lastcall` and `lastcall-bench` on the PATH: `cargo install --path crates/cli --locked`
# and `cargo install --path crates/bench --locked`, which build the release binaries
# (reusing target/release when scripts/demo.sh has built them) and copy them to
# ~/.cargo/bin (rustup puts that directory on the PATH). `lastcall bench …` runs the
# `lastcall-bench` in its own directory, so the two go to the same place.
#
# Usage: scripts/install.sh [cargo install options], e.g. --root /usr/local,
#        --features otlp, --no-default-features (no embedded model; much faster to build).
#        --features is for lastcall only (lastcall-bench has no `otlp`); the others go to
#        both.
# Remove them again with `cargo uninstall lastcall; cargo uninstall lastcall-bench`.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v cargo >/dev/null 2>&1; then
  echo "[install] cargo is missing: install rustup (https://rustup.rs)" >&2
  exit 1
fi
echo "[install] cargo install --path crates/cli --locked $* (a first release build compiles candle and takes several minutes)" >&2
cargo install --path crates/cli --locked "$@"
# The same options without --features/-F: lastcall-bench's only feature is `local-model`,
# which --no-default-features turns off for both.
bench_args=()
skip=0
for a in "$@"; do
  if [ "$skip" = 1 ]; then
    skip=0
    continue
  fi
  case "$a" in
  --features | -F) skip=1 ;;
  --features=* | -F*) ;;
  *) bench_args+=("$a") ;;
  esac
done
echo "[install] cargo install --path crates/bench --locked ${bench_args[*]:-}" >&2
cargo install --path crates/bench --locked ${bench_args[@]+"${bench_args[@]}"}

# Where it went, and whether the shell finds it there.
root="${CARGO_INSTALL_ROOT:-${CARGO_HOME:-$HOME/.cargo}}"
args=("$@")
for i in "${!args[@]}"; do
  case "${args[$i]}" in
  --root) root="${args[$((i + 1))]:-$root}" ;;
  --root=*) root="${args[$i]#--root=}" ;;
  esac
done
for name in lastcall lastcall-bench; do
  bin="$root/bin/$name"
  found="$(command -v "$name" || true)"
  if [ "$found" = "$bin" ]; then
    echo "[install] $name is on the PATH: $bin ($("$bin" --version))" >&2
  elif [ -n "$found" ]; then
    echo "[install] installed $bin, but the PATH finds $found first: put $root/bin earlier in PATH" >&2
  else
    echo "[install] installed $bin; add it to the PATH: export PATH=\"$root/bin:\$PATH\"" >&2
  fi
done
