"""The content-addressed blob store of snapshots: files stored once by SHA-256, a manifest
per snapshot, everything streamed.

One seam, ``BlobStore``, two implementations: ``FsBlobStore`` here, the embedded default,
in the state dir's filesystem, and ``S3BlobStore`` (``s3store.py``) for clusters, where
every worker must see the same store; ``open_store`` picks one from the settings and every
user (worker, GC, audit, CLI) goes through it. Both use the same keys
(``blobs/<sha[:2]>/<sha>``, ``manifests/<id>.json``).

Why the filesystem and not PostgreSQL for the default: blobs are written and read as
streams of a megabyte at a time (PostgreSQL's large objects or bytea would put every byte
through the ledger's WAL, vacuum and backups, and the ledger's sessions are short
transactions by design); a blob is immutable and named by its hash, so a rename is all the
atomicity it needs; deleting one is an unlink. On the local backend the sandboxes and the
store then share one disk.

Why ``touch``: a blob found already stored is reused by the new snapshot before its
manifest exists; the sweep deletes only unreferenced blobs older than a grace, and a
touched blob is young again, so a capture reusing it never loses it to the sweep.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from broker.errors import SnapshotCorrupt, SnapshotFailed
from broker.settings import Settings, parse_snapshot_store

PIECE = 1 << 20


class BlobStore(Protocol):
    """What the snapshot service and the GC need of a store."""

    def has(self, sha: str) -> bool: ...

    def touch(self, sha: str) -> bool:
        """Refresh the blob's time (so the sweep spares it); False when it is absent."""
        ...

    def touch_all(self, shas: Iterable[str]) -> set[str]:
        """``touch`` of each: those present (and now young). One call per capture, so a
        remote store can overlap the round trips of a tree of thousands of files."""
        ...

    def put_stream(self, sha: str, pieces: Iterable[bytes]) -> int:
        """Store the pieces as blob ``sha``, verifying the hash; the bytes written."""
        ...

    def chunks(self, sha: str) -> Iterator[bytes]: ...

    def size(self, sha: str) -> int: ...

    def blobs(self) -> Iterator[tuple[str, float]]:
        """Every blob with its modification time (epoch seconds)."""
        ...

    def delete_blob(self, sha: str) -> None: ...

    def put_manifest(self, snapshot_id: str, manifest: dict[str, Any]) -> None: ...

    def manifest(self, snapshot_id: str) -> dict[str, Any] | None: ...

    def manifests(self) -> list[str]: ...

    def delete_manifest(self, snapshot_id: str) -> None: ...

    def last_sweep(self) -> float:
        """When the GC last swept this store (epoch seconds; 0 when never)."""
        ...

    def mark_sweep(self) -> None: ...

    def sweep_tmp(self, older_than_s: float) -> int:
        """Partial writes a crashed writer left behind, older than this; how many went."""
        ...


def check_sha(sha: str) -> str:
    """A blob name is a lowercase SHA-256, never a path."""
    if len(sha) != 64 or any(c not in "0123456789abcdef" for c in sha):
        raise SnapshotCorrupt(f"not a SHA-256: {sha!r}")
    return sha


def check_snapshot_id(snapshot_id: str) -> str:
    if not snapshot_id.isalnum():
        raise SnapshotCorrupt(f"not a snapshot id: {snapshot_id!r}")
    return snapshot_id


def changed_during_capture(got: str, sha: str) -> SnapshotFailed:
    """Content read that does not hash to its listing: never stored, the capture retried."""
    return SnapshotFailed(
        f"content read does not match its listing ({got} != {sha}): the file changed during"
        " the capture"
    )


@runtime_checkable
class LocalBlobs(Protocol):
    """A store whose blobs are files on this host (the filesystem store; not S3): a
    restore on a backend that shares the disk can hand them to execd without streaming."""

    def local_path(self, sha: str) -> Path:
        """The blob's file (SnapshotCorrupt when it is missing). Never written through:
        callers hard-link it into a directory the sandbox sees read-only."""
        ...


class FsBlobStore:
    """Blobs and manifests under ``root`` (``<state dir>/snapshots`` by default)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        for sub in ("blobs", "manifests", "tmp"):
            (root / sub).mkdir(parents=True, exist_ok=True)

    def _blob(self, sha: str) -> Path:
        return self.root / "blobs" / sha[:2] / check_sha(sha)

    def _tmp(self) -> Path:
        return self.root / "tmp" / f"{os.getpid()}-{os.urandom(8).hex()}"

    def has(self, sha: str) -> bool:
        return self._blob(sha).is_file()

    def touch(self, sha: str) -> bool:
        try:
            os.utime(self._blob(sha))
        except FileNotFoundError:
            return False
        return True

    def touch_all(self, shas: Iterable[str]) -> set[str]:
        return {sha for sha in shas if self.touch(sha)}

    def put_stream(self, sha: str, pieces: Iterable[bytes]) -> int:
        """Written to a temporary file, hashed as it goes, renamed into place only when
        the hash matches: a reader never sees a partial or wrong blob."""
        tmp = self._tmp()
        digest = hashlib.sha256()
        size = 0
        try:
            with open(tmp, "wb") as f:
                for piece in pieces:
                    digest.update(piece)
                    size += len(piece)
                    f.write(piece)
                f.flush()
                os.fsync(f.fileno())
            if digest.hexdigest() != sha:
                raise changed_during_capture(digest.hexdigest(), sha)
            final = self._blob(sha)
            final.parent.mkdir(exist_ok=True)
            os.replace(tmp, final)
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
        return size

    def chunks(self, sha: str) -> Iterator[bytes]:
        try:
            f = open(self._blob(sha), "rb")  # noqa: SIM115 (closed by the generator)
        except FileNotFoundError:
            raise SnapshotCorrupt(f"blob {sha} is missing from the store") from None
        with f:
            while piece := f.read(PIECE):
                yield piece

    def local_path(self, sha: str) -> Path:
        path = self._blob(sha)
        if not path.is_file():
            raise SnapshotCorrupt(f"blob {sha} is missing from the store")
        return path

    def size(self, sha: str) -> int:
        try:
            return self._blob(sha).stat().st_size
        except FileNotFoundError:
            raise SnapshotCorrupt(f"blob {sha} is missing from the store") from None

    def blobs(self) -> Iterator[tuple[str, float]]:
        for sub in sorted((self.root / "blobs").iterdir()):
            for blob in sorted(sub.iterdir()):
                with contextlib.suppress(FileNotFoundError):
                    yield blob.name, blob.stat().st_mtime

    def delete_blob(self, sha: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._blob(sha).unlink()

    def _manifest(self, snapshot_id: str) -> Path:
        return self.root / "manifests" / f"{check_snapshot_id(snapshot_id)}.json"

    def put_manifest(self, snapshot_id: str, manifest: dict[str, Any]) -> None:
        tmp = self._tmp()
        with open(tmp, "w") as f:
            json.dump(manifest, f, separators=(",", ":"))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self._manifest(snapshot_id))

    def manifest(self, snapshot_id: str) -> dict[str, Any] | None:
        try:
            data: dict[str, Any] = json.loads(self._manifest(snapshot_id).read_text())
        except FileNotFoundError:
            return None
        return data

    def manifests(self) -> list[str]:
        return sorted(p.stem for p in (self.root / "manifests").glob("*.json"))

    def delete_manifest(self, snapshot_id: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._manifest(snapshot_id).unlink()

    def last_sweep(self) -> float:
        try:
            return (self.root / "last-sweep").stat().st_mtime
        except FileNotFoundError:
            return 0.0

    def mark_sweep(self) -> None:
        (self.root / "last-sweep").touch()

    def sweep_tmp(self, older_than_s: float) -> int:
        """Temporary files a crashed writer left behind."""
        removed = 0
        cutoff = time.time() - older_than_s
        for tmp in (self.root / "tmp").iterdir():
            with contextlib.suppress(FileNotFoundError):
                if tmp.stat().st_mtime < cutoff:
                    tmp.unlink()
                    removed += 1
        return removed


def default_store(state_dir: Path) -> FsBlobStore:
    return FsBlobStore(state_dir / "snapshots")


def open_store(settings: Settings) -> BlobStore:
    """The store the settings name (``SANDMAN_SNAPSHOT_STORE``): the state dir's filesystem
    when empty, else the S3 bucket and prefix of ``s3://bucket/prefix``. The one place a
    store is built, so the worker, the GC, the audit and the CLI always agree on it."""
    target = parse_snapshot_store(settings.snapshot_store)
    if target is None:
        return default_store(settings.state_dir)
    from broker.snapshots.s3store import S3BlobStore  # boto3 only where S3 is configured

    return S3BlobStore.from_settings(settings, *target)


def manifest_blobs(manifest: dict[str, Any]) -> set[str]:
    return {e["d"] for e in manifest.get("entries", []) if e.get("k") == "f"}
