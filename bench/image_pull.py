"""Cold creates on the real node with the image already there versus pulled, and with
pre-pull versus without, through the local cluster's loopback registry (issue #15).

    .venv/bin/python bench/image_pull.py [--trials 5] [--burst 20] [--big-mb 320]

The Kubernetes backend alone (no queue, no ledger): ``create`` of a pod pinned by digest
to the first Ready with execd answering, on the real node (containerd + runc), then
delete. Images are pushed under fresh names each run, so no earlier run's pull helps.

1. Present vs pulled, per image: before every "pulled" trial the image is removed from
   the node (``crictl rmi``), before every "present" trial it is left there. Images: the
   SWE task image (~215 MB, ~75 MB compressed) and a big one (the task base plus an
   incompressible ``--big-mb`` layer, >= 500 MB unpacked). Trials alternate.
2. Burst: ``--burst`` concurrent creates of an image no node holds, without pre-pull
   (every create waits for the one pull containerd shares) and after pre-pull (a
   DaemonSet holds the image; the burst starts once it is Ready).

Printed next to the paper's 4.1 s (image on the node) and 17.4 s (pulled) medians.
Loopback registry: a pull here costs decompression and unpacking, not a WAN; the ratio
is the honest comparison, the absolute pull times are a floor. Writes
bench/out/image_pull.json. A benchmark, not a test: nothing here asserts.
"""

from __future__ import annotations

import argparse
import os
import secrets
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import kubeconfig_path, save, summary  # noqa: E402
from broker.backends.base import PodSpec, PrePullSpec  # noqa: E402
from broker.backends.kube.backend import KubeBackend  # noqa: E402
from broker.images import refs  # noqa: E402
from broker.settings import Settings  # noqa: E402
from broker.wire.execd import execd_answers  # noqa: E402

NAMESPACE = "sandman-bench-images"
REAL = {"sandman.io/node-kind": "real"}
LIB = REPO / "deploy/localcluster/lib.sh"
KEEP = ("localhost/sandman-pause:",)  # never removed (the runtime needs it to pull)


def cluster_vars() -> dict[str, str]:
    out = subprocess.run(
        ["bash", "-c", f'source "{LIB}"; echo "$CRICTL_BIN $CTRD_SOCK $CRANE_BIN $STATE"'],
        check=True, capture_output=True, text=True,
    ).stdout.split()  # fmt: skip
    return {
        "crictl": f"{out[0]}/crictl",
        "sock": out[1],
        "crane": f"{out[2]}/crane",
        "state": out[3],
    }


def push(cv: dict[str, str], tarball: Path, name: str, hostport: str) -> str:
    out = subprocess.run(
        [cv["crane"], "push", "--insecure", str(tarball), f"{hostport}/{name}"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    return out.rsplit("@", 1)[1]


def remove_from_node(cv: dict[str, str], image: str) -> None:
    """Take every image but pause off the real node, content and unpacked layers
    included, so the next create pulls all its layers: task images share their base
    layer with each other and with the broker image (imported by test_deploy, which
    re-imports it when it is missing), so removing only the measured image would leave
    most of its bytes. ``--sync`` waits for containerd's garbage collection."""
    crictl = [cv["crictl"], "--runtime-endpoint", f"unix://{cv['sock']}"]
    # A deleted pod's container lives on until the kubelet has stopped it, and then as an
    # exited container until its GC a minute later; either holds the image's unpacked
    # layers, and containerd does not fetch a layer whose snapshot exists. Wait until the
    # real node runs no container, removing exited ones and stopped pod sandboxes.
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        left = subprocess.run(
            [*crictl, "ps", "-a", "-q"], capture_output=True, text=True, check=False
        ).stdout.split()
        for kind, listing in (("rm", ["ps", "-a", "-q", "--state", "exited"]),
                              ("rmp", ["pods", "-q", "--state", "notready"])):  # fmt: skip
            ids = subprocess.run(
                [*crictl, *listing], capture_output=True, text=True, check=False
            ).stdout.split()
            if ids:
                subprocess.run([*crictl, kind, *ids], capture_output=True, check=False)
        if not left:
            break
        time.sleep(0.5)
    ctr = ["ctr", "--address", cv["sock"], "-n", "k8s.io"]
    listing = subprocess.run(
        [*ctr, "images", "ls"], check=True, capture_output=True, text=True
    ).stdout.splitlines()[1:]
    rows = [line.split() for line in listing if line.strip()]
    keep = {row[2] for row in rows if row[0].startswith(KEEP)}
    doomed = [row[0] for row in rows if row[2] not in keep]
    if doomed:
        subprocess.run([*ctr, "images", "rm", "--sync", *doomed], check=True, capture_output=True)


def big_image(base_layer: Path, workdir: Path, mb: int, ref: str) -> Path:
    blob_root = workdir / "big"
    (blob_root / "opt").mkdir(parents=True)
    with (blob_root / "opt" / "incompressible.bin").open("wb") as out:
        for _ in range(mb):
            out.write(os.urandom(1 << 20))
    layer = workdir / "big.tar"
    subprocess.run(["tar", "-C", str(blob_root), "-cf", str(layer), "opt"], check=True)
    archive = workdir / "big.image.tar"
    subprocess.run(
        [sys.executable, str(REPO / "deploy/images/pack_image.py"), "--out", str(archive),
         "--tag", ref, "--layer", str(base_layer), "--layer", str(layer),
         "--env", "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],
        check=True, capture_output=True,
    )  # fmt: skip
    return archive


def pod(image: str) -> PodSpec:
    name = f"bench-pull-{secrets.token_hex(4)}"
    return PodSpec(
        name=name, namespace=NAMESPACE, installation="bench-images", job="bench-pull",
        sandbox_id=name, nonce=secrets.token_hex(16), role="rollout", image=image,
        cpu_m=100, memory_b=128 << 20, token=secrets.token_hex(16), node_selector=dict(REAL),
    )  # fmt: skip


def cold_create(backend: KubeBackend, image: str) -> tuple[float, bool | None, float | None]:
    """(seconds create -> Ready + execd answering, pulled?, pull seconds)."""
    spec = pod(image)
    t0 = time.perf_counter()
    backend.create(spec)
    try:
        deadline = t0 + 600
        while time.perf_counter() < deadline:
            info = next(
                (i for i in backend.watch_ready(NAMESPACE, {spec.name}, 5) if i.ready), None
            )
            if info and info.address and execd_answers(info.address, spec.token):
                seconds = time.perf_counter() - t0
                record = backend.pull_record(info)
                return seconds, record.pulled, record.image_pull_s
        raise RuntimeError(f"{spec.name} not ready in 600 s")
    finally:
        backend.delete(NAMESPACE, spec.name, spec.nonce)
        backend.wait_gone(NAMESPACE, spec.name, 60)


def present_vs_pulled(
    backend: KubeBackend, cv: dict[str, str], image: str, trials: int
) -> dict[str, Any]:
    present, pulled, pull_s = [], [], []
    cold_create(backend, image)  # the image on the node once, for the first "present"
    for _ in range(trials):
        seconds, was_pulled, _ = cold_create(backend, image)
        if was_pulled is False:
            present.append(seconds)
        remove_from_node(cv, image)
        seconds, was_pulled, ps = cold_create(backend, image)
        if was_pulled:
            pulled.append(seconds)
            pull_s.append(ps or 0.0)
    doc = {"present": summary(present), "pulled": summary(pulled), "pull_s": summary(pull_s)}
    doc["ratio_p50"] = doc["pulled"]["p50"] / doc["present"]["p50"] if present else None
    return doc


def burst(backend: KubeBackend, image: str, n: int) -> list[float]:
    out: list[float] = []
    lock = threading.Lock()

    def one() -> None:
        seconds, _, _ = cold_create(backend, image)
        with lock:
            out.append(seconds)

    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--burst", type=int, default=20)
    ap.add_argument("--big-mb", type=int, default=320)
    args = ap.parse_args()
    kubeconfig = kubeconfig_path()
    cv = cluster_vars()
    registry = (Path(kubeconfig).parent / "registries").read_text().strip()
    hostport = registry.split("://", 1)[1]
    settings = Settings(
        backend="kubernetes", kubeconfig=kubeconfig, namespace=NAMESPACE,
        installation_id="bench-images", registries=registry,
    )  # fmt: skip
    backend = KubeBackend.from_settings(settings)
    backend.ensure_namespace(NAMESPACE, create=True)
    index = Settings().cache_dir / "images/index.tsv"
    tarballs = dict(line.split("\t") for line in index.read_text().splitlines())
    tag = secrets.token_hex(3)
    doc: dict[str, Any] = {"trials": args.trials, "burst": args.burst, "paper": [4.1, 17.4]}
    with tempfile.TemporaryDirectory(dir=Settings().cache_dir) as tmp:
        base_layer = next((Settings().cache_dir / "images").glob("rootfs-*.layer.tar"))
        big = big_image(base_layer, Path(tmp), args.big_mb, f"localhost/bench-big-{tag}:v1")
        images = {
            "swe": (Path(tarballs["localhost/sandman-swe-task:v1"]), f"bench-swe-{tag}:v1"),
            "big": (big, f"bench-big-{tag}:v1"),
        }
        pinned = {}
        for key, (tarball, name) in images.items():
            digest = push(cv, tarball, name, hostport)
            pinned[key] = refs.pinned(f"localhost/{name}", digest)
            print(f"pushed {key}: {pinned[key]}", flush=True)
        for key in ("swe", "big"):
            doc[key] = present_vs_pulled(backend, cv, pinned[key], args.trials)
            d = doc[key]
            print(
                f"{key}: present p50 {d['present']['p50']:.2f}s p90 {d['present']['p90']:.2f}s | "
                f"pulled p50 {d['pulled']['p50']:.2f}s p90 {d['pulled']['p90']:.2f}s "
                f"(pull alone p50 {d['pull_s']['p50']:.2f}s) | ratio {d['ratio_p50']:.2f}x "
                f"(paper 17.4/4.1 = {17.4 / 4.1:.2f}x)",
                flush=True,
            )
        image = pinned["swe"]
        remove_from_node(cv, image)
        cold = burst(backend, image, args.burst)
        remove_from_node(cv, image)
        name = backend.ensure_prepull(NAMESPACE, PrePullSpec("bench-pull", image, dict(REAL)))
        t0 = time.perf_counter()
        while not any(
            p.name == name and p.desired and p.ready == p.desired
            for p in backend.prepulls(NAMESPACE)
        ):
            time.sleep(0.5)
        prepull_s = time.perf_counter() - t0
        warm = burst(backend, image, args.burst)
        for info in backend.prepulls(NAMESPACE):
            backend.remove_prepull(NAMESPACE, info)
        doc["burst"] = {
            "without_prepull": summary(cold),
            "after_prepull": summary(warm),
            "prepull_ready_s": prepull_s,
        }
        b = doc["burst"]
        print(
            f"burst of {args.burst}: without pre-pull p50 {b['without_prepull']['p50']:.2f}s "
            f"p90 {b['without_prepull']['p90']:.2f}s | after pre-pull "
            f"p50 {b['after_prepull']['p50']:.2f}s p90 {b['after_prepull']['p90']:.2f}s "
            f"(pre-pull took {prepull_s:.1f}s) | ratio "
            f"{b['without_prepull']['p50'] / b['after_prepull']['p50']:.2f}x",
            flush=True,
        )
    for key in ("swe", "big"):
        remove_from_node(cv, pinned[key])
    backend.close()
    save("image_pull", doc)


if __name__ == "__main__":
    main()
