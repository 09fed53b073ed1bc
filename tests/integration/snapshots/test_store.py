"""Both blob stores keep one contract: content-addressed, verified, streamed, atomic.

Every test runs on the filesystem store and on the S3 store against a real S3 server on
loopback (versitygw), each on a fresh prefix, built by the same factory the worker, the
GC and the audit use (``open_store``). The GC's sweep runs on the real ledger.
"""

from __future__ import annotations

import hashlib
import secrets
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from broker.errors import ConfigError, ServiceUnavailable, SnapshotCorrupt, SnapshotFailed
from broker.settings import Settings
from broker.snapshots.collect import collect
from broker.snapshots.s3store import PART, S3BlobStore
from broker.snapshots.store import PIECE, BlobStore, FsBlobStore, open_store
from tests.support.blobstores import STORES, backdate, store_fields
from tests.support.registry import _free_port
from tests.support.s3server import S3Server

pytestmark = pytest.mark.integration

MiB = 1 << 20


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture(params=STORES)
def settings(request: pytest.FixtureRequest, tmp_path: Path) -> Settings:
    return Settings(state_dir=tmp_path, **store_fields(request, f"t-{secrets.token_hex(4)}"))


@pytest.fixture
def store(settings: Settings) -> BlobStore:
    return open_store(settings)


@pytest.fixture
def server(store: BlobStore, request: pytest.FixtureRequest) -> S3Server | None:
    return request.getfixturevalue("s3_server") if isinstance(store, S3BlobStore) else None


def _pattern(size: int, seed: bytes = b"") -> Iterator[bytes]:
    """``size`` bytes in 1 MiB pieces, made as they are consumed (never whole)."""
    block = hashlib.sha256(seed).digest() * (MiB // 32)
    for start in range(0, size, MiB):
        yield block[: min(MiB, size - start)]


def _pattern_sha(size: int, seed: bytes = b"") -> str:
    digest = hashlib.sha256()
    for piece in _pattern(size, seed):
        digest.update(piece)
    return digest.hexdigest()


def test_the_factory_picks_the_configured_store(settings: Settings, store: BlobStore) -> None:
    expected = FsBlobStore if not settings.snapshot_store else S3BlobStore
    assert type(store) is expected


def test_a_blob_is_stored_once_under_its_hash_and_streamed_back(store: BlobStore) -> None:
    data = b"a" * (PIECE * 2 + 5)
    sha = _sha(data)
    assert not store.has(sha) and not store.touch(sha)
    assert store.put_stream(sha, [data[:10], data[10:]]) == len(data)
    assert store.has(sha) and store.touch(sha) and store.size(sha) == len(data)
    pieces = list(store.chunks(sha))
    assert b"".join(pieces) == data
    assert max(len(p) for p in pieces) <= PIECE  # never the whole file at once
    assert [s for s, _ in store.blobs()] == [sha]
    assert store.put_stream(sha, [data]) == len(data)  # storing it again changes nothing
    assert [s for s, _ in store.blobs()] == [sha]
    store.delete_blob(sha)
    assert not store.has(sha) and list(store.blobs()) == []
    store.delete_blob(sha)  # idempotent


def test_blobs_larger_than_a_part_are_streamed_in_bounded_memory(store: BlobStore) -> None:
    """A 72 MiB blob (nine S3 parts) goes in and comes out with a peak of Python memory
    a fraction of its size: a 2 GiB blob must not need 2 GiB."""
    size = 72 * MiB
    sha = _pattern_sha(size, b"big")
    tracemalloc.start()
    try:
        assert store.put_stream(sha, _pattern(size, b"big")) == size
        _, put_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        digest, got = hashlib.sha256(), 0
        for piece in store.chunks(sha):
            digest.update(piece)
            got += len(piece)
        _, get_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert (digest.hexdigest(), got, store.size(sha)) == (sha, size, size)
    assert put_peak < 3 * PART < size / 2, put_peak
    assert get_peak < 4 * PIECE, get_peak
    assert store.sweep_tmp(0) == 0  # the multipart upload completed, none left open


@pytest.mark.parametrize("size", [100, PART + 3 * MiB])
def test_content_that_does_not_match_its_hash_is_never_stored(store: BlobStore, size: int) -> None:
    """Below a part (one PUT) and above (a multipart upload, aborted)."""
    with pytest.raises(SnapshotFailed, match="changed during the capture"):
        store.put_stream(_sha(b"listed"), _pattern(size, b"read later"))
    assert list(store.blobs()) == []
    assert store.sweep_tmp(0) == 0  # no temporary file or open upload left either


def test_a_stream_that_breaks_stores_nothing(store: BlobStore) -> None:
    def broken() -> Iterator[bytes]:
        yield from _pattern(PART + MiB, b"half")
        raise ConnectionResetError("execd went away")

    with pytest.raises(ConnectionResetError):
        store.put_stream(_pattern_sha(2 * PART, b"half"), broken())
    assert list(store.blobs()) == []
    assert store.sweep_tmp(0) == 0


def test_missing_blobs_and_bad_names_are_typed(store: BlobStore) -> None:
    with pytest.raises(SnapshotCorrupt, match="missing"):
        list(store.chunks(_sha(b"never stored")))
    with pytest.raises(SnapshotCorrupt, match="missing"):
        store.size(_sha(b"never stored"))
    with pytest.raises(SnapshotCorrupt):
        store.has("../../etc/passwd")
    with pytest.raises(SnapshotCorrupt):
        store.manifest("../x")


def test_manifests_round_trip(store: BlobStore) -> None:
    manifest: dict[str, Any] = {"entries": [{"p": "/w/a", "k": "f", "d": "1" * 64}]}
    assert store.manifest("abc123") is None and store.manifests() == []
    store.put_manifest("abc123", manifest)
    store.put_manifest("abc124", {"entries": []})
    assert store.manifest("abc123") == manifest
    assert store.manifests() == ["abc123", "abc124"]
    store.delete_manifest("abc123")
    store.delete_manifest("abc123")  # idempotent
    assert store.manifest("abc123") is None and store.manifests() == ["abc124"]


def test_touch_makes_an_old_blob_young(store: BlobStore, server: S3Server | None) -> None:
    sha = _sha(b"reused")
    store.put_stream(sha, [b"reused"])
    backdate(store, sha, 3600, server)
    [(_, old)] = store.blobs()
    assert old < time.time() - 3000
    assert store.touch(sha)
    [(_, young)] = store.blobs()
    assert young > time.time() - 600


def test_touch_all_touches_what_is_stored_and_names_it(
    store: BlobStore, server: S3Server | None
) -> None:
    stored = [_sha(b"%d" % i) for i in range(40)]
    for i, sha in enumerate(stored):
        store.put_stream(sha, [b"%d" % i])
        backdate(store, sha, 3600, server)
    absent = [_sha(b"absent %d" % i) for i in range(10)]
    assert store.touch_all([*absent, *stored, stored[0]]) == set(stored)
    assert all(t > time.time() - 600 for _, t in store.blobs())
    assert store.touch_all([]) == set()


def test_the_sweep_spares_young_and_touched_blobs_and_deletes_old_ones(
    store: BlobStore, server: S3Server | None, sessions: Any
) -> None:
    """The GC's blob sweep on this store (no snapshot row names these blobs)."""
    old, touched, young = (_sha(w) for w in (b"old", b"touched", b"young"))
    for sha, word in ((old, b"old"), (touched, b"touched"), (young, b"young")):
        store.put_stream(sha, [word])
    backdate(store, old, 3600, server)
    backdate(store, touched, 3600, server)
    assert store.touch(touched)
    done = collect(sessions, store, installation=f"t-{secrets.token_hex(3)}", grace_s=600)
    assert done.swept and (done.blobs, done.blob_bytes) == (1, 3)
    assert sorted(s for s, _ in store.blobs()) == sorted([touched, young])
    assert store.last_sweep() > time.time() - 600


def test_writes_a_dead_writer_left_are_swept(store: BlobStore, server: S3Server | None) -> None:
    sha = _sha(b"never finished")
    if isinstance(store, FsBlobStore):
        (store.root / "tmp" / "123-deadbeef").write_bytes(b"never")
    else:
        assert isinstance(store, S3BlobStore)
        store.client.create_multipart_upload(Bucket=store.bucket, Key=store._blob(sha))
    assert store.sweep_tmp(3600) == 0  # young: a writer may still be at it
    assert store.sweep_tmp(0) == 1
    assert store.sweep_tmp(0) == 0 and list(store.blobs()) == []


# -- S3 only: how the store fails ---------------------------------------------------------


def _s3(s3_server: S3Server, tmp_path: Path, **fields: str) -> BlobStore:
    url = f"s3://{s3_server.bucket('snapshots')}/t-{secrets.token_hex(4)}"
    return open_store(Settings(state_dir=tmp_path, **{**s3_server.fields(url), **fields}))


def test_an_unreachable_store_is_a_temporary_error(s3_server: S3Server, tmp_path: Path) -> None:
    store = _s3(s3_server, tmp_path, snapshot_s3_endpoint=f"http://127.0.0.1:{_free_port()}")
    with pytest.raises(ServiceUnavailable, match="did not answer") as caught:
        store.has(_sha(b"x"))
    assert caught.value.retryable


def test_refused_credentials_are_a_config_error_that_names_no_secret(
    s3_server: S3Server, tmp_path: Path
) -> None:
    wrong = secrets.token_urlsafe(30)
    store = _s3(s3_server, tmp_path, snapshot_s3_secret_key=wrong)
    for call in (lambda: store.has(_sha(b"x")), lambda: store.put_manifest("a1", {})):
        with pytest.raises(ConfigError) as caught:
            call()
        text = str(caught.value)
        assert "SignatureDoesNotMatch" in text or "403" in text, text
        assert wrong not in text and s3_server.secret_key not in text
        assert s3_server.access_key not in text
        assert not caught.value.retryable


def test_a_missing_bucket_is_a_config_error(s3_server: S3Server, tmp_path: Path) -> None:
    settings = Settings(state_dir=tmp_path, **s3_server.fields("s3://no-such-bucket/p"))
    with pytest.raises(ConfigError, match="NoSuchBucket"):
        open_store(settings).put_manifest("a1", {})
