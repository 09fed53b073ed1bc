#!/usr/bin/env bash
# Build the local images (no registry): pause, task base (Debian bookworm with
# bash, python3, git) and the SWE-style demo task. Results are cached in
#   ${SANDMAN_CACHE_DIR:-~/.cache/sandman}/images/<name>-<hash>.tar
# where <hash> covers every build input; a tarball is rebuilt only when missing.
# An index (ref -> tarball) is written to images/index.tsv for up.sh to import.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=../lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh" images
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
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

hash_inputs() { # [files... | =literal ...] -> 16 hex chars over names, contents and literals
  { for f in "$@"; do
      if [[ "$f" == =* ]]; then echo "== literal ${f#=}"; else echo "== ${f#"$HERE"/}"; cat "$f"; fi
    done; echo "$SUITE $BASE_PACKAGES $IMAGE_TAG"; } | sha256sum | cut -c1-16
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
h="$(hash_inputs "$HERE/rootfs.sh")"
BASE_LAYER="$OUT/rootfs-$SUITE-$h.layer.tar"
if [[ ! -s "$BASE_LAYER" ]]; then
  need debootstrap debootstrap
  log "debootstrap $SUITE from $MIRROR ($h); takes a few minutes"
  t0=$SECONDS
  "$HERE/rootfs.sh" "$SUITE" "$BASE_PACKAGES" "$MIRROR" "$BASE_LAYER"
  log "base rootfs done in $((SECONDS - t0))s"
fi

ENV_PATH="PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
BASE_TAR="$OUT/sandman-task-base-$(hash_inputs "=$(basename "$BASE_LAYER")" "$PACK").tar"
if [[ ! -s "$BASE_TAR" ]]; then
  log "packing sandman-task-base"
  python3 "$PACK" --out "$BASE_TAR" --tag "localhost/sandman-task-base:$IMAGE_TAG" \
    --layer "$BASE_LAYER" --env "$ENV_PATH" --env LANG=C.UTF-8 --cmd '["/bin/bash"]' >/dev/null
fi
index "localhost/sandman-task-base:$IMAGE_TAG" "$BASE_TAR"

# ---------------- SWE-style task ----------------
SWE="$HERE/swe-task"
h="$(hash_inputs "=$(basename "$BASE_TAR")" "$PACK" $(find "$SWE/repo" -type f ! -path '*/__pycache__/*' | sort) \
     "$SWE/task.json" "$SWE/reference.patch")"
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
# prune superseded artefacts (anything not referenced by the new index)
keep="$(cut -f2 "$OUT/index.tsv"; echo "$BASE_LAYER"; echo "$BASE_LAYER.debootstrap.log")"
for f in "$OUT"/sandman-*.tar "$OUT"/rootfs-*.layer.tar "$OUT"/rootfs-*.debootstrap.log "$OUT"/debootstrap-*.log "$OUT"/index.tsv.tmp.*; do
  [[ -e "$f" ]] || continue
  grep -qxF "$f" <<<"$keep" || { log "pruning $(basename "$f")"; rm -f "$f"; }
done
log "images ready:"; cat "$OUT/index.tsv" >&2
