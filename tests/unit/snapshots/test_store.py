"""The filesystem blob store: content-addressed, verified, streamed, atomic."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from broker.errors import SnapshotCorrupt, SnapshotFailed
from broker.snapshots.store import PIECE, FsBlobStore, manifest_blobs

pytestmark = pytest.mark.unit


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_a_blob_is_stored_once_under_its_hash_and_streamed_back(tmp_path: Path) -> None:
    store = FsBlobStore(tmp_path)
    data = b"a" * (PIECE * 2 + 5)
    sha = _sha(data)
    assert not store.has(sha) and not store.touch(sha)
    assert store.put_stream(sha, [data[:10], data[10:]]) == len(data)
    assert store.has(sha) and store.touch(sha) and store.size(sha) == len(data)
    pieces = list(store.chunks(sha))
    assert b"".join(pieces) == data
    assert max(len(p) for p in pieces) <= PIECE  # never the whole file at once
    assert [s for s, _ in store.blobs()] == [sha]
    store.delete_blob(sha)
    assert not store.has(sha)


def test_content_that_does_not_match_its_hash_is_never_stored(tmp_path: Path) -> None:
    store = FsBlobStore(tmp_path)
    with pytest.raises(SnapshotFailed, match="changed during the capture"):
        store.put_stream(_sha(b"listed"), [b"read later"])
    assert list(store.blobs()) == []
    assert list((tmp_path / "tmp").iterdir()) == []  # no temporary file left either


def test_missing_blobs_and_bad_names_are_typed(tmp_path: Path) -> None:
    store = FsBlobStore(tmp_path)
    with pytest.raises(SnapshotCorrupt, match="missing"):
        list(store.chunks(_sha(b"never stored")))
    with pytest.raises(SnapshotCorrupt):
        store.has("../../etc/passwd")
    with pytest.raises(SnapshotCorrupt):
        store.manifest("../x")


def test_manifests_round_trip_and_name_their_blobs(tmp_path: Path) -> None:
    store = FsBlobStore(tmp_path)
    manifest = {
        "entries": [
            {"p": "/w/a", "k": "f", "d": "1" * 64},
            {"p": "/w/l", "k": "l", "d": "a"},
            {"p": "/w/b", "k": "f", "d": "1" * 64},
        ]
    }
    store.put_manifest("abc123", manifest)
    assert store.manifest("abc123") == manifest
    assert store.manifests() == ["abc123"]
    assert manifest_blobs(manifest) == {"1" * 64}
    store.delete_manifest("abc123")
    assert store.manifest("abc123") is None and store.manifests() == []
