"""Local backend on images vs on the host root: start latency, memory and disk per sandbox.

Run: ``.venv/bin/python bench/local_images.py [--n 30] [--first 5] [--fleet 10] [--copy]
[--egress allow|deny]``
(the image tarballs must be built: ``make local-images``; the bench imports the one
it measures into a private store of its own). Measured in one run, the
backend alone (no broker, no database), create() to the first authenticated-free
``/healthz`` answer, then delete():

* first start of a new digest: the image's root unpacked (its unpacked copy is removed
  before each trial, the blobs stay), then the sandbox started on it;
* per-sandbox start afterwards on the unpacked root (overlay layer, or a copy with
  ``--copy``, which forces the fallback);
* the old host-root start (``LocalBackend(host_root=True)``, the pre-image behaviour),
  trials interleaved with the image ones so drift hits both alike;
* memory (PSS of bwrap, its init and execd, and of its egress uplink, slirp4netns, with
  ``--egress allow``, the default; ``deny`` starts sandboxes without one) and disk (the
  sandbox's own directory: its writable layer and workspace) per sandbox, over a fleet
  of ``--fleet`` live sandboxes.

Prints medians, p90, p99 and ratios; writes bench/out/local_images.json. A benchmark,
not a test: nothing here asserts.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import pct, save, summary  # noqa: E402
from bench.meter import descendants  # noqa: E402
from broker.backends import local as local_mod  # noqa: E402
from broker.backends import localprocs  # noqa: E402
from broker.backends.base import PodSpec  # noqa: E402
from broker.backends.local import LocalBackend  # noqa: E402
from broker.settings import Settings  # noqa: E402

IMAGE = "localhost/sandman-swe-task:v1"


DENIED = False  # --egress deny: sandboxes without an uplink


def spec(image: str) -> PodSpec:
    name = f"bench-{secrets.token_hex(4)}"
    return PodSpec(
        name=name, namespace="bench", installation="bench-images", job="bench",
        sandbox_id=name, nonce="n", role="rollout", image=image, cpu_m=500,
        memory_b=512 << 20, token=secrets.token_hex(16), egress_denied=DENIED,
    )  # fmt: skip


def start(backend: LocalBackend, pod: PodSpec) -> float:
    """Seconds from create() to a ready execd."""
    t0 = time.perf_counter()
    backend.create(pod)
    for info in backend.watch_ready("bench", {pod.name}, 60):
        if not info.ready:
            raise RuntimeError(f"{pod.name} failed: {info}")
    return time.perf_counter() - t0


def pss_b(pid: int) -> int:
    total = 0
    for p in descendants(pid):
        try:
            for line in Path(f"/proc/{p}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            continue
    return total


def sandbox_pss_b(backend: LocalBackend, name: str) -> int:
    """PSS of the sandbox's process tree plus its helpers (the uplink is not a child)."""
    tree = int((backend._load(name) or {})["pid"])
    inside = set(descendants(tree))
    helpers = [p.pid for p in localprocs.scan(backend.mark_root) if p.name == name]
    return pss_b(tree) + sum(pss_b(pid) for pid in helpers if pid not in inside)


def disk_b(path: Path) -> int:
    """Allocated bytes under ``path`` (hard links counted once), not following links."""
    seen, total = set(), 0
    for dirpath, dirnames, filenames in os.walk(path):
        for name in dirnames + filenames:
            st = os.lstat(os.path.join(dirpath, name))
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total


def fleet(backend: LocalBackend, image: str, size: int) -> dict[str, float]:
    pods = [spec(image) for _ in range(size)]
    try:
        for pod in pods:
            start(backend, pod)
        mem = [sandbox_pss_b(backend, p.name) for p in pods]
        disk = [disk_b(backend.root / p.name) for p in pods]
    finally:
        for pod in pods:
            backend.delete("bench", pod.name, pod.nonce)
    return {"pss_mb_p50": pct(mem, 50) / 1e6, "disk_mb_p50": pct(disk, 50) / 1e6}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=30, help="starts per mode")
    p.add_argument("--first", type=int, default=5, help="first starts of a new digest")
    p.add_argument("--fleet", type=int, default=10, help="live sandboxes for memory/disk")
    p.add_argument("--image", default=IMAGE)
    p.add_argument("--copy", action="store_true", help="force the copy fallback (no overlay)")
    p.add_argument("--egress", choices=("allow", "deny"), default="allow")
    a = p.parse_args()
    global DENIED  # noqa: PLW0603 (one switch for every spec of the run)
    DENIED = a.egress == "deny"
    if a.copy:
        local_mod.overlay_works = lambda _scratch: False  # type: ignore[assignment]
    # A private store (the image imported from the build cache's tarball): the first-start
    # trials delete the unpacked root, which must never pull it from under anyone else.
    work = Path(tempfile.mkdtemp(prefix="sandman-bench-images-"))
    settings = Settings(state_dir=work / "state", cache_dir=work / "cache")
    index = Settings().cache_dir / "images" / "index.tsv"
    tarballs = dict(line.split("\t", 1) for line in index.read_text().splitlines())
    image = LocalBackend(settings)
    host = LocalBackend(settings, host_root=True)
    image.images.import_archive(Path(tarballs[a.image]))
    if DENIED:
        image.ensure_egress_guard("bench", "bench", [])
    digest = image.images.resolve(a.image)
    mode = "copy" if a.copy else ("overlay" if local_mod.overlay_works(image.root) else "copy")
    print(f"image {a.image} {digest[:19]}, layer: {mode}, egress: {a.egress}", flush=True)

    first, unpack_s = [], []
    for _ in range(a.first):
        image.images._drop_rootfs(digest)
        pod = spec(a.image)
        t0 = time.perf_counter()
        image.images.rootfs(digest)
        unpack_s.append(time.perf_counter() - t0)
        first.append(unpack_s[-1] + start(image, pod))
        image.delete("bench", pod.name, pod.nonce)

    on_image, on_host = [], []
    for _ in range(a.n):
        for backend, series in ((image, on_image), (host, on_host)):
            pod = spec(a.image)
            series.append(start(backend, pod))
            backend.delete("bench", pod.name, pod.nonce)

    per_image = fleet(image, a.image, a.fleet)
    per_host = fleet(host, a.image, a.fleet)
    rootfs_mb = disk_b(image.images.rootfs(digest)) / 1e6
    doc = {
        "image": a.image,
        "digest": digest,
        "layer_mode": mode,
        "egress": a.egress,
        "rootfs_mb": rootfs_mb,
        "first_start_s": summary(first),
        "unpack_s": summary(unpack_s),
        "image_start_s": summary(on_image),
        "host_root_start_s": summary(on_host),
        "ratio_image_vs_host_p50": pct(on_image, 50) / pct(on_host, 50),
        "ratio_first_vs_image_p50": pct(first, 50) / pct(on_image, 50),
        "per_sandbox_image": per_image,
        "per_sandbox_host_root": per_host,
    }
    print(f"unpacked root {rootfs_mb:.0f} MB ({mode} layer per sandbox)")
    for label, key in (
        ("first start (unpack+start)", "first_start_s"),
        ("  of which unpack", "unpack_s"),
        ("start on the image", "image_start_s"),
        ("start on the host root", "host_root_start_s"),
    ):
        s = doc[key]
        print(
            f"{label:28s} n={s['n']:3d} p50 {s['p50'] * 1e3:8.1f} ms  p90 {s['p90'] * 1e3:8.1f}"
            f" ms  p99 {s['p99'] * 1e3:8.1f} ms"
        )
    print(
        f"ratio image/host p50 {doc['ratio_image_vs_host_p50']:.2f}x; "
        f"first/image p50 {doc['ratio_first_vs_image_p50']:.2f}x"
    )
    print(
        f"per sandbox (fleet of {a.fleet}): image PSS {per_image['pss_mb_p50']:.1f} MB, disk "
        f"{per_image['disk_mb_p50']:.2f} MB; host root PSS {per_host['pss_mb_p50']:.1f} MB, "
        f"disk {per_host['disk_mb_p50']:.2f} MB"
    )
    save("local_images" + ("_copy" if a.copy else "") + ("_deny" if DENIED else ""), doc)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
