"""The local image store: both archive formats, refs to digests, one unpack, removal."""

from __future__ import annotations

import io
import threading
from pathlib import Path

import pytest

from broker.errors import ImageInvalid, ImageNotFound
from broker.images import refs, store
from broker.images.store import ImageStore
from tests.unit.images.layers import docker_archive, layer, oci_archive

pytestmark = pytest.mark.unit


@pytest.fixture
def layers(tmp_path: Path) -> list[Path]:
    return [
        layer(tmp_path / "l1.tar", [("etc", "dir"), ("etc/os", "file", "base")]),
        layer(tmp_path / "l2.tar", [("app", "dir"), ("app/main", "file", "run")], gzip=True),
    ]


def test_refs_normalize_like_docker() -> None:
    assert refs.normalize("python:3.12") == "docker.io/library/python:3.12"
    assert refs.normalize("me/app") == "docker.io/me/app:latest"
    assert refs.normalize("localhost/x:v1") == "localhost/x:v1"
    assert refs.normalize("reg.io:5000/a/b:t") == "reg.io:5000/a/b:t"
    with pytest.raises(ImageInvalid):
        refs.normalize("Bad Image")


def test_docker_archive_import_resolve_unpack_and_remove(
    tmp_path: Path, layers: list[Path]
) -> None:
    images = ImageStore(tmp_path / "store")
    archive = docker_archive(tmp_path / "img.tar", layers, ["localhost/app:1"])
    (first,) = images.import_archive(archive)
    (again,) = images.import_archive(io.BytesIO(archive.read_bytes()))  # as from stdin
    assert first.digest == again.digest, "the same archive is the same digest"
    assert images.resolve("localhost/app:1") == first.digest
    assert images.resolve(first.digest) == first.digest
    assert images.config(first.digest)["Env"] == ["PATH=/usr/bin:/bin", "SANDMAN_T=1"]
    root = images.rootfs(first.digest)
    assert (root / "etc/os").read_text() == "base"
    assert (root / "app/main").read_text() == "run"
    assert [i.unpacked for i in images.images()] == [True]
    assert images.remove("localhost/app:1") == ["localhost/app:1"]
    assert not root.exists()
    assert not list((tmp_path / "store/blobs/sha256").iterdir())
    with pytest.raises(ImageNotFound):
        images.resolve("localhost/app:1")


def test_oci_archive_keeps_its_manifest_digest(tmp_path: Path, layers: list[Path]) -> None:
    images = ImageStore(tmp_path / "store")
    archive, digest = oci_archive(tmp_path / "oci.tar", layers, "localhost/oci:2")
    imported = images.import_archive(archive, ("localhost/alias:1",))
    assert {i.ref: i.digest for i in imported} == {
        "localhost/alias:1": digest,
        "localhost/oci:2": digest,
    }
    assert {i.ref for i in images.images()} == {"localhost/alias:1", "localhost/oci:2"}
    assert (images.rootfs(digest) / "app/main").read_text() == "run"


def test_bad_archives_and_digests_are_refused(tmp_path: Path, layers: list[Path]) -> None:
    images = ImageStore(tmp_path / "store")
    junk = tmp_path / "junk.tar"
    junk.write_bytes(b"junk" * 1000)
    with pytest.raises(ImageInvalid):
        images.import_archive(junk)
    with pytest.raises(ImageInvalid):
        images.put_blob(io.BytesIO(b"abc"), "sha256:" + "0" * 64)
    with pytest.raises(ImageNotFound):
        images.resolve("localhost/missing:1")
    with pytest.raises(ImageNotFound):
        images.remove("localhost/missing:1")


def test_concurrent_first_uses_unpack_once(
    tmp_path: Path, layers: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    images = ImageStore(tmp_path / "store")
    (img,) = images.import_archive(docker_archive(tmp_path / "i.tar", layers, ["localhost/a:1"]))
    calls: list[Path] = []
    real = store.unpack

    def counting(root: Path, paths: list[Path]) -> None:
        calls.append(root)
        real(root, paths)

    monkeypatch.setattr(store, "unpack", counting)
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(images.rootfs(img.digest))) for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    assert len(set(results)) == 1 and len(results) == 4


def test_an_unnamed_image_is_listed_and_removed_by_digest(
    tmp_path: Path, layers: list[Path]
) -> None:
    images = ImageStore(tmp_path / "store")
    (stored,) = images.import_archive(docker_archive(tmp_path / "i.tar", layers, []))
    assert [(i.ref, i.digest) for i in images.images()] == [(stored.digest, stored.digest)]
    assert images.resolve(stored.digest) == stored.digest
    assert images.remove(stored.digest) == [stored.digest]
    assert images.images() == []
    assert not list((tmp_path / "store/blobs/sha256").iterdir())
