#!/usr/bin/env bash
# Build the local images (no registry): pause, task base (Debian bookworm with
# bash, python3, git) and the SWE-style demo task. Results are cached in
#   ${SANDMAN_CACHE_DIR:-~/.cache/sandman}/images/<name>-<hash>.tar
# where <hash> covers every build input; a tarball is rebuilt only when missing.
# An index (ref -> tarball) is written to images/index.tsv for up.sh to import.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CACHE_DIR="${SANDMAN_CACHE_DIR:-$HOME/.cache/sandman}"
OUT="$CACHE_DIR/images"
IMAGE_TAG="${SANDMAN_IMAGE_TAG:-v1}"
SUITE=bookworm
MIRROR="${SANDMAN_DEBIAN_MIRROR:-}"
if [[ -z "$MIRROR" ]]; then
  MIRROR="$(grep -hoE '^(URIs:|deb) +[^ ]+' /etc/apt/sources.list /etc/apt/sources.list.d/* 2>/dev/null \
            | awk '{print $2}' | grep -v security | head -1 || true)"
  MIRROR="${MIRROR:-http://deb.debian.org/debian}"
fi
BASE_PACKAGES="bash,python3,git,ca-certificates,procps"
PACK="$HERE/pack_image.py"
mkdir -p "$OUT"
log() { printf '[%s] images: %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

hash_inputs() { # files... -> 16 hex chars (contents + names)
  { for f in "$@"; do echo "== $f"; cat "$f"; done; echo "$SUITE $BASE_PACKAGES $IMAGE_TAG"; } \
    | sha256sum | cut -c1-16
}

need() { command -v "$1" >/dev/null || { log "installing $2"; apt-get install -y -qq "$2" >/dev/null; }; }

INDEX_TMP="$OUT/index.tsv.tmp.$$"; : > "$INDEX_TMP"
index() { printf '%s\t%s\n' "$1" "$2" >> "$INDEX_TMP"; }

# ---------------- pause ----------------
h="$(hash_inputs "$HERE/pause/pause.c" "$PACK")"
PAUSE_TAR="$OUT/sandman-pause-$h.tar"
if [[ ! -s "$PAUSE_TAR" ]]; then
  log "building pause ($h)"
  w="$(mktemp -d)"; mkdir -p "$w/root"
  gcc -static -Os -s -o "$w/root/pause" "$HERE/pause/pause.c"
  tar --numeric-owner --owner=0 --group=0 --mtime=@0 --sort=name -C "$w/root" -cf "$w/layer.tar" .
  python3 "$PACK" --out "$PAUSE_TAR" --tag "localhost/sandman-pause:1" --tag "localhost/sandman-pause:$h" \
    --layer "$w/layer.tar" --entrypoint '["/pause"]' >/dev/null
  rm -rf "$w"
fi
index "localhost/sandman-pause:1" "$PAUSE_TAR"

# ---------------- base rootfs (debootstrap) ----------------
h="$(hash_inputs "$HERE/build.sh" "$PACK")"
BASE_LAYER="$OUT/rootfs-bookworm-$h.layer.tar"
if [[ ! -s "$BASE_LAYER" ]]; then
  need debootstrap debootstrap
  log "debootstrap $SUITE from $MIRROR ($h); takes a few minutes"
  t0=$SECONDS
  w="$(mktemp -d -p "$OUT")"
  debootstrap --variant=minbase --include="$BASE_PACKAGES" "$SUITE" "$w/rootfs" "$MIRROR" > "$OUT/debootstrap-$h.log" 2>&1 \
    || { tail -20 "$OUT/debootstrap-$h.log"; exit 1; }
  r="$w/rootfs"
  # slim down: caches, docs, man pages, locales (keep the package database)
  rm -rf "$r"/var/cache/apt/* "$r"/var/lib/apt/lists/* "$r"/usr/share/doc/* "$r"/usr/share/man/* \
         "$r"/usr/share/info/* "$r"/var/log/* "$r"/tmp/* "$r"/dev/* "$r"/proc/* "$r"/sys/* 2>/dev/null || true
  find "$r/usr/share/locale" -mindepth 1 -maxdepth 1 ! -name 'C*' -exec rm -rf {} + 2>/dev/null || true
  echo "sandman-task-base" > "$r/etc/hostname"
  tar --numeric-owner --xattrs --sort=name -C "$r" -cf "$BASE_LAYER.tmp" .
  mv "$BASE_LAYER.tmp" "$BASE_LAYER"
  rm -rf "$w"
  log "base rootfs done in $((SECONDS - t0))s"
fi

ENV_PATH="PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
BASE_TAR="$OUT/sandman-task-base-$(basename "$BASE_LAYER" .layer.tar | sed 's/rootfs-bookworm-//').tar"
if [[ ! -s "$BASE_TAR" ]]; then
  log "packing sandman-task-base"
  python3 "$PACK" --out "$BASE_TAR" --tag "localhost/sandman-task-base:$IMAGE_TAG" \
    --layer "$BASE_LAYER" --env "$ENV_PATH" --env LANG=C.UTF-8 --cmd '["/bin/bash"]' >/dev/null
fi
index "localhost/sandman-task-base:$IMAGE_TAG" "$BASE_TAR"

# ---------------- SWE-style task ----------------
SWE="$HERE/swe-task"
h="$(hash_inputs "$BASE_TAR" "$PACK" $(find "$SWE/repo" -type f | sort) "$SWE/task.json")"
SWE_TAR="$OUT/sandman-swe-task-$h.tar"
if [[ ! -s "$SWE_TAR" ]]; then
  log "building sandman-swe-task ($h)"
  w="$(mktemp -d)"; mkdir -p "$w/root"
  cp -a "$SWE/repo" "$w/root/repo"
  find "$w/root/repo" -name __pycache__ -prune -exec rm -rf {} +
  (
    cd "$w/root/repo"
    export GIT_AUTHOR_NAME=sandman GIT_AUTHOR_EMAIL=sandman@localhost \
           GIT_COMMITTER_NAME=sandman GIT_COMMITTER_EMAIL=sandman@localhost \
           GIT_AUTHOR_DATE="2024-01-01T00:00:00Z" GIT_COMMITTER_DATE="2024-01-01T00:00:00Z"
    git init -q -b main . && git add -A && git commit -q -m "statlib: base commit" 
    commit="$(git rev-parse HEAD)"
    want="$(python3 -c 'import json,sys;print(json.load(open(sys.argv[1]))["base_commit"])' "$SWE/task.json")"
    [[ "$commit" == "$want" ]] || { echo "base commit $commit != task.json base_commit $want" >&2; exit 1; }
    git apply --check "$SWE/reference.patch"
  )
  tar --numeric-owner --owner=0 --group=0 --mtime=@1704067200 --sort=name -C "$w/root" -cf "$w/layer.tar" .
  python3 "$PACK" --out "$SWE_TAR" --tag "localhost/sandman-swe-task:$IMAGE_TAG" \
    --layer "$BASE_LAYER" --layer "$w/layer.tar" --env "$ENV_PATH" --env LANG=C.UTF-8 \
    --workdir /repo --cmd '["/bin/bash"]' >/dev/null
  rm -rf "$w"
fi
index "localhost/sandman-swe-task:$IMAGE_TAG" "$SWE_TAR"

mv "$INDEX_TMP" "$OUT/index.tsv"
log "images ready:"; cat "$OUT/index.tsv" >&2
