"""Both snapshot blob stores for tests, and the writes a test makes behind a store's back
(a corrupted blob, an old one) on either: the filesystem's files or the S3 server's
objects, through that server's own API or, for times S3 cannot set, its backing files."""

from __future__ import annotations

import os
import time
from typing import Any

import pytest

from broker.snapshots.s3store import S3BlobStore
from broker.snapshots.store import BlobStore, FsBlobStore
from tests.support.s3server import S3Server

STORES = ["fs", "s3"]
BUCKET = "snapshots"


def store_fields(request: pytest.FixtureRequest, prefix: str) -> dict[str, str]:
    """The settings selecting the store of ``request.param``: none for the filesystem
    (the default), the session's S3 server under ``prefix`` for S3."""
    if request.param == "fs":
        return {}
    server: S3Server = request.getfixturevalue("s3_server")
    return server.fields(f"s3://{server.bucket(BUCKET)}/{prefix}")


def overwrite_blob(store: BlobStore, sha: str, data: bytes) -> None:
    """Replace a stored blob's bytes without the store's hash check."""
    if isinstance(store, FsBlobStore):
        store._blob(sha).write_bytes(data)
    else:
        assert isinstance(store, S3BlobStore)
        store.client.put_object(Bucket=store.bucket, Key=store._blob(sha), Body=data)


def backdate(store: BlobStore, sha: str, seconds: float, server: S3Server | None) -> None:
    """Make a blob (not its touch marker) look ``seconds`` old. S3 has no call that sets
    LastModified; versitygw's posix backend reports the backing file's mtime, so that."""
    then = time.time() - seconds
    if isinstance(store, FsBlobStore):
        path: Any = store._blob(sha)
    else:
        assert isinstance(store, S3BlobStore) and server is not None
        path = server.root / store.bucket / store._blob(sha)
    os.utime(path, (then, then))
