"""Snapshot and restore throughput of the two blob stores, filesystem vs S3, in one run.

    .venv/bin/python bench/snapshot_store.py [--trials 7] [--small 32] [--large 2]
        [--large-mb 32] [--tree 1000]

What a capture and a restore do to the store, without the sandbox on either side: a
"snapshot" streams each file into the store (``put_stream``, 1 MiB pieces, hashed on the
way, as the worker does with execd's body), a "restore" streams every blob back out
(``chunks``) and an "unchanged snapshot" finds every file already stored (``touch_all``:
the dedup path of a second snapshot of the same tree). Two sets per trial, new content
each trial (no dedup between trials): "bytes", ``--small`` files of 1 MiB and ``--large``
of ``--large-mb`` MiB (MB/s), and "tree", ``--tree`` files of 4 KiB like a source
repository (files/s: per-file round trips dominate). Each set goes into both stores in
turn: the filesystem store in a temporary directory, and the S3 store on a private
versitygw (posix backend) on loopback with its data on the same disk. Per store and
operation the p50 and p90 of the trials' durations, as throughput (p90 is the slow side);
the ratio is S3's p50 throughput over the filesystem's (the baseline) in the same run.
One run; a benchmark, not a test: nothing asserts. Run one benchmark at a time on a
shared machine.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import secrets
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import save, summary
from broker.settings import Settings
from broker.snapshots.store import BlobStore, open_store
from tests.support.s3server import loopback_s3

MiB = 1 << 20
POOL = os.urandom(64 * MiB)  # random bytes the files are cut from (incompressible)


def files(trial: int, sizes: list[int], kind: str) -> list[tuple[str, int, bytes]]:
    """(sha, size, head) per file: a unique 64-byte head, then pool bytes."""
    out = []
    for i, size in enumerate(sizes):
        head = f"trial {trial} {kind} {i} {secrets.token_hex(16)}".encode().ljust(64)
        digest = hashlib.sha256()
        for piece in pieces(head, size):
            digest.update(piece)
        out.append((digest.hexdigest(), size, head))
    return out


def pieces(head: bytes, size: int) -> Iterator[bytes]:
    yield head
    left, at = size - len(head), 0
    while left > 0:
        n = min(MiB, left, len(POOL) - at)
        yield POOL[at : at + n]
        left, at = left - n, (at + n) % len(POOL)


def timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def trial(store: BlobStore, batch: list[tuple[str, int, bytes]]) -> dict[str, float]:
    """Seconds of a snapshot, an unchanged snapshot and a restore of ``batch``."""

    def snapshot() -> None:
        for sha, size, head in batch:
            assert not store.touch(sha)  # new content: stored, not deduplicated
            store.put_stream(sha, pieces(head, size))

    def unchanged() -> None:  # what a capture does first (SnapshotService._store_blobs)
        assert len(store.touch_all(sha for sha, _, _ in batch)) == len(batch)

    def restore() -> None:
        for sha, size, _ in batch:
            assert sum(len(p) for p in store.chunks(sha)) == size

    took = {"snapshot": timed(snapshot), "unchanged": timed(unchanged), "restore": timed(restore)}
    for sha, _, _ in batch:
        store.delete_blob(sha)
    return took


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=7)
    parser.add_argument("--small", type=int, default=32, help="1 MiB files per snapshot")
    parser.add_argument("--large", type=int, default=2, help="large files per snapshot")
    parser.add_argument("--large-mb", type=int, default=32)
    parser.add_argument("--tree", type=int, default=1000, help="4 KiB files of a source tree")
    args = parser.parse_args()
    sizes = {
        "bytes": [MiB] * args.small + [args.large_mb * MiB] * args.large,
        "tree": [4096] * args.tree,
    }
    runs: dict[str, dict[str, list[dict[str, float]]]] = {k: {} for k in sizes}
    with tempfile.TemporaryDirectory(prefix="bench-snapstore-", dir="/var/tmp") as tmp:
        work = Path(tmp)
        with loopback_s3(work) as server:
            server.bucket("bench")
            stores: dict[str, BlobStore] = {
                "fs": open_store(Settings(state_dir=work / "fs")),
                "s3": open_store(
                    Settings(state_dir=work / "fs", **server.fields("s3://bench/snapshots"))
                ),
            }
            for t in range(args.trials):
                for kind, kind_sizes in sizes.items():
                    batch = files(t, kind_sizes, kind)
                    for name, store in stores.items():  # the same content into each, in turn
                        runs[kind].setdefault(name, []).append(trial(store, batch))
    mb = sum(sizes["bytes"]) / 1e6
    doc: dict[str, Any] = {"args": vars(args), "mb_per_snapshot": mb, "seconds": runs}
    print(f"bytes: {args.small} x 1 MiB + {args.large} x {args.large_mb} MiB = {mb:.0f} MB;")
    print(f"tree: {args.tree} files of 4 KiB; {args.trials} trials, new content in each")
    for kind, op, amount, unit in (
        ("bytes", "snapshot", mb, "MB/s"),
        ("bytes", "restore", mb, "MB/s"),
        ("tree", "snapshot", args.tree, "files/s"),
        ("tree", "unchanged", args.tree, "files/s"),
        ("tree", "restore", args.tree, "files/s"),
    ):
        base = summary([r[op] for r in runs[kind]["fs"]])
        for name, rows in runs[kind].items():
            got = summary([r[op] for r in rows])
            print(
                f"{kind:5} {op:9} {name}  n={got['n']}  p50 {amount / got['p50']:9.1f} {unit}"
                f"  p90 {amount / got['p90']:9.1f} {unit}"
                f"  ratio to fs {base['p50'] / got['p50']:5.2f}"
            )
    save("snapshot_store", doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
