#!/usr/bin/env bash
# Build the broker image from this repository without Docker or a registry, and
# (with --import) load it into the local cluster's containerd as
# localhost/sandman-broker:dev.
#
#   deploy/broker-image/build.sh            # build (or reuse) the image tarball; print its path
#   deploy/broker-image/build.sh --import   # also import it into the local cluster
#
# Recipe (same layout as the Containerfile next to this script):
#   layer 1  the Debian bookworm root filesystem from deploy/images (debootstrap,
#            python3.11, bash, git, ca-certificates, procps), shared with the task images
#   layer 2  /opt/sandman/venv: a venv made by the image's own python3.11 in a chroot,
#            with the project wheel and its dependencies installed offline
#            (pip install --no-index --find-links); the wheel carries the Alembic scripts
#            as broker/ledger/migrations (where broker/ledger/migrate.py finds them) and
#            execd/ as a package (where broker/backends/kube/podspec.py looks for it);
#            user sandman uid/gid 10001; /var/lib/sandman owned by it.
#
# Caches (outside the repo, keyed by content hashes of their inputs):
#   $CACHE/broker-image/wheelhouse-<deps hash>/   dependency wheels (cp311, manylinux)
#   $CACHE/broker-image/sandman-broker-<hash>.tar the docker-archive image
# A warm run (nothing changed) only hashes the sources: about a second.
# Needs root (chroot); Python on the host only to build the wheel and download wheels.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=../lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh" broker-image
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUT="$CACHE_DIR/broker-image"
TAG="${SANDMAN_BROKER_IMAGE:-localhost/sandman-broker:dev}"
PY="${SANDMAN_BUILD_PYTHON:-$REPO_ROOT/.venv/bin/python}"
PACK="$REPO_ROOT/deploy/images/pack_image.py"
DO_IMPORT=0
[[ "${1:-}" == "--import" ]] && DO_IMPORT=1
mkdir -p "$OUT"
[[ -x "$PY" ]] || PY="$(command -v python3)"
"$PY" -c 'import sys; assert sys.version_info[:2] >= (3, 11)' || die "$PY is older than 3.11"
t_start=$SECONDS

# ---------------- base root filesystem (shared with deploy/images, cached there) --------
base_layer() { ls -t "$CACHE_DIR"/images/rootfs-bookworm-*.layer.tar 2>/dev/null | head -1; }
BASE_LAYER="$(base_layer)"
if [[ -z "$BASE_LAYER" ]]; then
  log "no cached bookworm rootfs; running deploy/images/build.sh"
  "$REPO_ROOT/deploy/images/build.sh" >&2 || die "deploy/images/build.sh failed"
  BASE_LAYER="$(base_layer)"
  [[ -n "$BASE_LAYER" ]] || die "deploy/images/build.sh produced no rootfs layer"
fi

# ---------------- content hash of every input ----------------
# Sources: tracked and untracked (not ignored) files of the packages, plus build files.
mapfile -t SRC < <(cd "$REPO_ROOT" && git ls-files -co --exclude-standard -- \
  broker workers execd web migrations pyproject.toml setup.py README.md \
  | grep -v -E '(__pycache__|\.pyc$)' | sort -u)
DEPS_HASH="$( { echo async-timeout; sed -n '/^dependencies = \[/,/^\]/p' "$REPO_ROOT/pyproject.toml"; echo cp311-manylinux_2_36; } \
  | sha256sum | cut -c1-16)"
SRC_HASH="$( { cd "$REPO_ROOT"; for f in "${SRC[@]}"; do [[ -f "$f" ]] && { echo "== $f"; cat "$f"; }; done
               echo "== build.sh"; cat "$HERE/build.sh"; echo "== pack"; cat "$PACK"
               echo "== base $(basename "$BASE_LAYER") deps $DEPS_HASH tag $TAG"; } | sha256sum | cut -c1-16)"
IMAGE_TAR="$OUT/sandman-broker-$SRC_HASH.tar"
WHEELHOUSE="$OUT/wheelhouse-$DEPS_HASH"

import_image() {
  # shellcheck source=../localcluster/lib.sh
  source "$REPO_ROOT/deploy/localcluster/lib.sh"
  local ctr=(ctr --address "$CTRD_SOCK" -n k8s.io)
  "${ctr[@]}" version >/dev/null 2>&1 || die "local cluster containerd is not running ($CTRD_SOCK): run deploy/localcluster/up.sh"
  local marker="$STATE/run/imported-$(basename "$IMAGE_TAR")"
  if [[ -e "$marker" ]] && "${ctr[@]}" images ls -q | grep -qxF "$TAG"; then
    log "$TAG already imported from $(basename "$IMAGE_TAR")"
    return
  fi
  local t0=$SECONDS
  "${ctr[@]}" images import --no-unpack=false --snapshotter overlayfs "$IMAGE_TAR" >/dev/null
  mkdir -p "$STATE/run" && rm -f "$STATE"/run/imported-sandman-broker-*.tar && touch "$marker"
  log "imported $TAG in $((SECONDS - t0))s"
}

if [[ -s "$IMAGE_TAR" ]]; then
  log "cached: $(basename "$IMAGE_TAR")"
  (( DO_IMPORT )) && import_image
  echo "$IMAGE_TAR"
  exit 0
fi

[[ $(id -u) -eq 0 ]] || die "building needs root (chroot into the base root filesystem)"
W="$(mktemp -d -p "$OUT" build.XXXXXX)"
cleanup() { rm -rf "$W"; }
trap cleanup EXIT

# ---------------- wheels ----------------
# A cached build environment (setuptools, wheel) instead of pip's per-build isolation,
# which would download them again on every build.
BUILDENV="$OUT/buildenv-$(sed -n '/^\[build-system\]/,/^$/p' "$REPO_ROOT/pyproject.toml" | sha256sum | cut -c1-12)"
if [[ ! -x "$BUILDENV/bin/python" ]]; then
  log "creating the wheel build environment"
  rm -rf "$BUILDENV.tmp" && "$PY" -m venv "$BUILDENV.tmp"
  "$BUILDENV.tmp/bin/python" -m pip install -q "setuptools>=69" wheel >&2
  mv "$BUILDENV.tmp" "$BUILDENV"
fi
log "building the project wheel"
"$BUILDENV/bin/python" -m pip wheel "$REPO_ROOT" -w "$W/project" --no-deps --no-build-isolation -q >"$W/wheel.log" 2>&1 \
  || { tail -20 "$W/wheel.log" >&2; die "building the project wheel failed"; }
PROJECT_WHEEL="$(ls "$W"/project/sandman_broker-*.whl)" || die "no project wheel was built"
if [[ ! -f "$WHEELHOUSE/.complete" ]]; then
  log "downloading dependency wheels (cp311, manylinux) into $(basename "$WHEELHOUSE")"
  rm -rf "$WHEELHOUSE.tmp" && mkdir -p "$WHEELHOUSE.tmp"
  # bookworm has glibc 2.36: accept every manylinux tag up to it
  platforms=(--platform manylinux1_x86_64 --platform manylinux2010_x86_64 --platform manylinux2014_x86_64)
  for v in $(seq 5 36); do platforms+=(--platform "manylinux_2_${v}_x86_64"); done
  # Markers are evaluated against the host interpreter, not the target: name the
  # dependencies that only Python < 3.11.3 (bookworm has 3.11.2) needs.
  "$PY" -m pip download "$PROJECT_WHEEL" pip "async-timeout>=4.0.3" -d "$WHEELHOUSE.tmp" -q \
    --only-binary=:all: "${platforms[@]}" --python-version 3.11 \
    --implementation cp --abi cp311 >&2 || die "pip download of the dependencies failed"
  rm -f "$WHEELHOUSE.tmp"/sandman_broker-*.whl
  touch "$WHEELHOUSE.tmp/.complete" && rm -rf "$WHEELHOUSE" && mv "$WHEELHOUSE.tmp" "$WHEELHOUSE"
fi

# ---------------- the image's root, for chroot ----------------
R="$W/root"
mkdir -p "$R"
log "unpacking $(basename "$BASE_LAYER")"
tar -C "$R" -xf "$BASE_LAYER"
mkdir -p "$R/dev" "$R/proc" "$R/tmp" "$R/wheels"
for d in "null c 1 3" "zero c 1 5" "random c 1 8" "urandom c 1 9"; do
  set -- $d; mknod -m 666 "$R/dev/$1" "$2" "$3" "$4"
done
cp "$WHEELHOUSE"/*.whl "$PROJECT_WHEEL" "$R/wheels/"
PIPWHL="$(cd "$R/wheels" && ls pip-*.whl | head -1)"
chroot_pip() { # pip run from its wheel by the venv's python, offline, inside the chroot
  env -u PIP_FIND_LINKS -u PIP_CERT chroot "$R" /opt/sandman/venv/bin/python "/wheels/$PIPWHL/pip" \
    install -q --no-index --find-links /wheels --disable-pip-version-check \
    --no-warn-script-location "$@" >&2
}

# ---------------- layer 2: the venv with every dependency (cached by the deps hash) ------
# Sources change often, dependencies rarely: this layer is reused (and shared by
# containerd) across source changes, so a rebuild after an edit takes about a minute.
DEPS_LAYER="$OUT/deps-$(echo "$DEPS_HASH $(basename "$BASE_LAYER") recipe-1" | sha256sum | cut -c1-16).layer.tar"
if [[ ! -s "$DEPS_LAYER" ]]; then
  log "installing the dependencies into /opt/sandman/venv (chroot, offline; slow once)"
  t0=$SECONDS
  chroot "$R" /usr/bin/python3 -m venv --without-pip /opt/sandman/venv
  mapfile -t DEP_WHEELS < <(cd "$R/wheels" && ls *.whl | grep -v -E '^(pip|sandman_broker)-' | sed 's|^|/wheels/|')
  chroot_pip "${DEP_WHEELS[@]}" || die "pip install of the dependencies in the chroot failed"
  echo "sandman:x:10001:" >> "$R/etc/group"
  echo "sandman:x:10001:10001:sandman broker:/home/sandman:/bin/bash" >> "$R/etc/passwd"
  mkdir -p "$R/var/lib/sandman" "$R/home/sandman"
  chown 10001:10001 "$R/var/lib/sandman" "$R/home/sandman"
  tar --numeric-owner --sort=name --mtime=@1704067200 -C "$R" -cf "$DEPS_LAYER.tmp" \
    ./etc/passwd ./etc/group ./opt ./var/lib/sandman ./home/sandman
  mv "$DEPS_LAYER.tmp" "$DEPS_LAYER"
  log "dependencies layer done in $((SECONDS - t0))s"
else
  log "cached: $(basename "$DEPS_LAYER")"
  tar -C "$R" -xf "$DEPS_LAYER"
fi

# ---------------- layer 3: the project (the wheel, migrations included) -----------------
log "installing the project wheel"
touch "$W/marker" && sleep 1
chroot_pip --no-deps "/wheels/$(basename "$PROJECT_WHEEL")" || die "pip install of the project failed"
SITE="$R/opt/sandman/venv/lib/python3.11/site-packages"
[[ -d "$SITE/broker" && -d "$SITE/execd" ]] || die "broker/execd not installed in $SITE"
# smoke test inside the chroot: entry point, migrations and execd where the code looks
chroot "$R" /opt/sandman/venv/bin/python -c '
import broker.ledger.migrate as m, broker.backends.kube.podspec as p
assert (m.migrations_dir() / "env.py").is_file(), m.migrations_dir()
assert p.execd_files(), p.EXECD_DIR
' || die "image layout check failed (the wheel's migrations or execd not where the code looks)"
chroot "$R" /opt/sandman/venv/bin/sandman --version >&2
(cd "$R" && find ./opt -newer "$W/marker" | sort) > "$W/app.list"
tar --numeric-owner --no-recursion --mtime=@1704067200 -C "$R" -cf "$W/layer.tar" -T "$W/app.list"
# the layer itself must carry what the code looks for (the chroot check above cannot tell)
for want in site-packages/broker/ledger/migrations/env.py site-packages/execd/__init__.py site-packages/broker/ledger/migrate.py bin/sandman; do
  grep -q "/$want\$" "$W/app.list" || die "the project layer lacks $want"
done
nvers="$(find "$REPO_ROOT/migrations/versions" -name '*.py' | wc -l)"
[[ "$(grep -c 'site-packages/broker/ledger/migrations/versions/[^/]*\.py$' "$W/app.list")" -eq "$nvers" ]] \
  || die "the project layer lacks some of the $nvers migration versions"

log "packing $TAG"
python3 "$PACK" --out "$IMAGE_TAR.tmp" --tag "$TAG" --tag "localhost/sandman-broker:$SRC_HASH" \
  --layer "$BASE_LAYER" --layer "$DEPS_LAYER" --layer "$W/layer.tar" \
  --env "PATH=/opt/sandman/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" \
  --env LANG=C.UTF-8 --env HOME=/home/sandman --env PYTHONDONTWRITEBYTECODE=1 \
  --env PYTHONUNBUFFERED=1 --env SANDMAN_STATE_DIR=/var/lib/sandman \
  --workdir /home/sandman --cmd '["sandman", "--help"]' \
  --label "org.opencontainers.image.title=sandman-broker" \
  --label "org.opencontainers.image.revision=$SRC_HASH" >/dev/null
mv "$IMAGE_TAR.tmp" "$IMAGE_TAR"
# keep only the newest image tarball and the current wheelhouse
for f in "$OUT"/sandman-broker-*.tar "$OUT"/wheelhouse-* "$OUT"/buildenv-* "$OUT"/deps-*.layer.tar; do
  [[ "$f" == "$IMAGE_TAR" || "$f" == "$WHEELHOUSE" || "$f" == "$BUILDENV" || "$f" == "$DEPS_LAYER" ]] || rm -rf "$f"
done
printf '%s broker-image %ss host=%scpu\n' "$(date -Is)" "$((SECONDS - t_start))" "$(nproc)" \
  >> "$CACHE_DIR/build-timings.log"
log "built $(basename "$IMAGE_TAR") ($(du -m "$IMAGE_TAR" | cut -f1) MiB) in $((SECONDS - t_start))s"
(( DO_IMPORT )) && import_image
echo "$IMAGE_TAR"
