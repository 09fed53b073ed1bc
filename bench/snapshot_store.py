"""Snapshot and restore throughput of the two blob stores, filesystem vs S3, in one run.

    .venv/bin/python bench/snapshot_store.py [--trials 7] [--small 32] [--large 2] [--large-mb 32]

What a capture and a restore do to the store, without the sandbox on either side: a
"snapshot" streams each file into the store (``put_stream``, 1 MiB pieces, hashed on the
way, as the worker does with execd's body), a "restore" streams every blob back out
(``chunks``) and an "unchanged snapshot" finds every file already stored (``touch``:
the dedup path of a second snapshot of the same tree). Per trial the set is
``--small`` files of 1 MiB and ``--large`` of ``--large-mb`` MiB, new content each trial
(no dedup between trials), stored into both stores in turn: the filesystem store in a
temporary directory, and the S3 store on a private versitygw (posix backend) on loopback
with its data on the same disk. Per store and operation the p50 and p90 of the trials'
durations, as MB/s (files/s for the unchanged snapshot): p90 is the slow side. The ratio
is S3's p50 throughput over the filesystem's (the baseline) from the same run. One run; a
benchmark, not a test: nothing asserts. Run it under ``flock /work/bench.lock`` on a
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


def files(trial: int, small: int, large: int, large_mb: int) -> list[tuple[str, int, bytes]]:
    """(sha, size, head) per file: a unique 64-byte head, then pool bytes."""
    out = []
    for i, size in enumerate([MiB] * small + [large_mb * MiB] * large):
        head = f"trial {trial} file {i} {secrets.token_hex(16)}".encode().ljust(64)
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

    def unchanged() -> None:
        for sha, _, _ in batch:
            assert store.touch(sha)

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
    args = parser.parse_args()
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
            runs: dict[str, list[dict[str, float]]] = {name: [] for name in stores}
            for t in range(args.trials):
                for name, store in stores.items():  # the same content into each, in turn
                    runs[name].append(trial(store, files(t, args.small, args.large, args.large_mb)))
    mb = (args.small + args.large * args.large_mb) * MiB / 1e6
    count = args.small + args.large
    doc: dict[str, Any] = {"args": vars(args), "mb_per_snapshot": mb, "seconds": {}}
    print(f"snapshot of {args.small} x 1 MiB + {args.large} x {args.large_mb} MiB = {mb:.0f} MB")
    for op, amount, unit in (
        ("snapshot", mb, "MB/s"),
        ("restore", mb, "MB/s"),
        ("unchanged", count, "files/s"),
    ):
        base = summary([r[op] for r in runs["fs"]])
        for name in stores:
            got = summary([r[op] for r in runs[name]])
            doc["seconds"].setdefault(name, {})[op] = got
            print(
                f"{op:10} {name}  n={got['n']}  p50 {amount / got['p50']:8.1f} {unit}"
                f"  p90 {amount / got['p90']:8.1f} {unit}"
                f"  ratio to fs {base['p50'] / got['p50']:5.2f}"
            )
    save("snapshot_store", doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
