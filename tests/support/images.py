"""The task images tests run local sandboxes on, and how a test session gets them.

The local backend runs sandboxes on images from the local store only (an unknown image is
ImageNotFound), so every test that makes a real local sandbox names one of these. They
are the project's own images, built by deploy/images/build.sh (debootstrap: minutes the
first time, cached in SANDMAN_CACHE_DIR/images) and imported into the store once per
session by ``ensure_local_images`` (a no-op when the store already holds this build).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from broker.images.store import ImageStore

TASK_IMAGE = "localhost/sandman-task-base:v1"  # Debian bookworm with bash, python3, git
SWE_IMAGE = "localhost/sandman-swe-task:v1"  # TASK_IMAGE plus the SWE demo task at /repo

REPO = Path(__file__).resolve().parents[2]


def ensure_local_images(cache_dir: Path) -> ImageStore:
    """Build the image tarballs if missing, and import any the store lacks."""
    index = cache_dir / "images" / "index.tsv"
    if not index.exists():
        subprocess.run([str(REPO / "deploy/images/build.sh")], check=True)
    store = ImageStore.at_cache(cache_dir)
    stamp = store.root / "imported-index.tsv"
    wanted = index.read_text()
    if stamp.exists() and stamp.read_text() == wanted and _all_resolve(store):
        return store
    for line in wanted.splitlines():
        _ref, _, tarball = line.partition("\t")
        store.import_archive(Path(tarball))
    stamp.write_text(wanted)
    return store


def _all_resolve(store: ImageStore) -> bool:
    try:
        for ref in (TASK_IMAGE, SWE_IMAGE):
            store.resolve(ref)
    except LookupError:
        return False
    return True
