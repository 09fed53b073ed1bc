#!/usr/bin/env bash
# rootfs.sh SUITE PACKAGES MIRROR OUT_LAYER_TAR
# Debootstrap a minimal Debian and pack it as one uncompressed layer tarball.
# build.sh keys the cache on this file's content, so edit it to force a rebuild.
set -euo pipefail
SUITE="$1" PACKAGES="$2" MIRROR="$3" OUT="$4"
w="$(mktemp -d -p "$(dirname "$OUT")")"
trap 'rm -rf "$w"' EXIT
debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$w/rootfs" "$MIRROR" > "$OUT.debootstrap.log" 2>&1 \
  || { tail -20 "$OUT.debootstrap.log" >&2; exit 1; }
r="$w/rootfs"
# slim down: caches, docs, man pages, locales (keep the dpkg database)
rm -rf "$r"/var/cache/apt/* "$r"/var/lib/apt/lists/* "$r"/usr/share/doc/* "$r"/usr/share/man/* \
       "$r"/usr/share/info/* "$r"/var/log/* "$r"/tmp/* "$r"/dev/* "$r"/proc/* "$r"/sys/* 2>/dev/null || true
find "$r/usr/share/locale" -mindepth 1 -maxdepth 1 ! -name 'C*' -exec rm -rf {} + 2>/dev/null || true
echo "sandman-task-base" > "$r/etc/hostname"
tar --numeric-owner --xattrs --sort=name -C "$r" -cf "$OUT.tmp" .
mv "$OUT.tmp" "$OUT"
