#!/usr/bin/env bash
# Build the container image `lastcall:dev` (deploy/Containerfile, docs/deploy.md) without an
# image registry: the base is a minimal Debian bookworm made with mmdebstrap from Debian's
# mirror and imported with `podman import`; `lastcall` and `lastcall-bench` are built here in
# release mode without the embedded model. Each step is skipped when its result is there
# and up to date, so a second run takes seconds.
#
#   scripts/image.sh           install what is missing (apt-get, as root or with sudo), build
#   scripts/image.sh --check   only say what is missing, one line each; exit 2 if anything
#
# Environment: LASTCALL_IMAGE (tag, default lastcall:dev), LASTCALL_IMAGE_BASE (default
# localhost/lastcall-base:bookworm), DEBIAN_MIRROR (default http://deb.debian.org/debian),
# CARGO_TARGET_DIR.
set -euo pipefail
cd "$(dirname "$0")/.."

log() { echo "[image] $*" >&2; }
have() { command -v "$1" >/dev/null 2>&1; }

check_only=0
case "${1:-}" in
--check) check_only=1 ;;
"") ;;
*)
  echo "usage: $0 [--check]" >&2
  exit 2
  ;;
esac

tag="${LASTCALL_IMAGE:-lastcall:dev}"
base="${LASTCALL_IMAGE_BASE:-localhost/lastcall-base:bookworm}"
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
target_dir="${CARGO_TARGET_DIR:-target}"

sudo=()
if [ "$(id -u)" != 0 ] && sudo -n true 2>/dev/null; then sudo=(sudo -n); fi
can_apt() { have apt-get && { [ "$(id -u)" = 0 ] || [ ${#sudo[@]} -gt 0 ]; }; }

# The tools: podman (with runc, the runtime tried here), and mmdebstrap for the base.
missing=()
for tool in podman runc mmdebstrap; do
  have "$tool" || missing+=("$tool")
done
if [ ${#missing[@]} -gt 0 ]; then
  if ! can_apt; then
    echo "[image] missing: ${missing[*]} (Debian: sudo apt-get install podman runc mmdebstrap)" >&2
    exit 2
  fi
  if [ "$check_only" = 1 ]; then
    log "will install ${missing[*]} with apt-get"
    exit 0
  fi
  log "installing ${missing[*]} (apt-get)"
  "${sudo[@]}" apt-get update -qq
  "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq podman runc mmdebstrap >&2
fi
# Root podman only: rootless podman (subuid ranges, a user session) was not tried here.
if [ "$(id -u)" != 0 ] && [ ${#sudo[@]} = 0 ]; then
  echo "[image] missing: root or password-less sudo (only root podman was tried; see docs/deploy.md)" >&2
  exit 2
fi
podman=("${sudo[@]}" podman)
if ! err="$("${podman[@]}" info 2>&1 >/dev/null)"; then
  echo "[image] missing: a working podman: \`podman info\` fails: $(tail -n 1 <<<"$err")" >&2
  exit 2
fi
[ "$check_only" = 1 ] && exit 0

# One build at a time (two tests, or a test and .ci/run).
exec 9>"${TMPDIR:-/tmp}/lastcall-image.lock"
flock 9

started=$SECONDS

# 1. The base: Debian bookworm, minbase, plus curl (the health check) and ca-certificates
# (TLS to RabbitMQ, PostgreSQL or a model server); no docs, man pages or locales.
if ! "${podman[@]}" image exists "$base"; then
  log "making the base $base with mmdebstrap from $mirror (about 3 minutes)"
  tmp="$(mktemp -d)"
  trap 'rm -rf "$tmp"' EXIT
  "${sudo[@]}" mmdebstrap --quiet --variant=minbase --include=ca-certificates,curl \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
    --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/locale/*' \
    bookworm "$tmp/base.tar" "$mirror"
  "${podman[@]}" import --quiet "$tmp/base.tar" "$base" >/dev/null
  rm -rf "$tmp"
  trap - EXIT
fi
base_id="$("${podman[@]}" image inspect --format '{{.Id}}' "$base")"

# 2. The binaries: release, without the embedded model (no candle; a worker uses
# `--backend openai` or `sim`). Nothing to do when they are up to date.
log "cargo build --release -p lastcall -p lastcall-bench --no-default-features"
cargo build --release --locked -p lastcall -p lastcall-bench --no-default-features
bin="$target_dir/release"

# 3. The image, unless one was built from these very inputs (a label holds their digest).
ctx="$(mktemp -d)"
trap 'rm -rf "$ctx"' EXIT
cp deploy/Containerfile "$bin/lastcall" "$bin/lastcall-bench" "$ctx/"
# Symbols only: the release profile keeps them; the image need not.
if have strip; then strip --strip-unneeded "$ctx/lastcall" "$ctx/lastcall-bench"; fi
inputs="$(cd "$ctx" && { sha256sum Containerfile lastcall lastcall-bench; echo "$base_id"; } | sha256sum | cut -c1-64)"
built="$("${podman[@]}" image inspect --format '{{index .Labels "org.lastcall.inputs"}}' "$tag" 2>/dev/null || true)"
if [ "$built" = "$inputs" ]; then
  log "$tag is up to date"
else
  log "building $tag"
  old="$("${podman[@]}" image inspect --format '{{.Id}}' "$tag" 2>/dev/null || true)"
  image_started=$SECONDS
  # --format docker: the OCI format drops HEALTHCHECK.
  "${podman[@]}" build --quiet --format docker --build-arg "BASE=$base" \
    --label "org.lastcall.inputs=$inputs" -t "$tag" -f "$ctx/Containerfile" "$ctx" >/dev/null
  log "built $tag in $((SECONDS - image_started)) s"
  # The image this one replaced under the tag, now untagged (unless a container uses it).
  if [ -n "$old" ]; then "${podman[@]}" rmi "$old" >/dev/null 2>&1 || true; fi
fi
size="$("${podman[@]}" image inspect --format '{{.Size}}' "$tag")"
log "$tag: $((size / 1000000)) MB, ready in $((SECONDS - started)) s"
