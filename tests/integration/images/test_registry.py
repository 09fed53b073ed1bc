"""The registry client and ``sandman image pull`` against a real registry on loopback
(issue #15 items 2 and 4): tags resolve to the digest the registry holds, a missing tag
or repository is ImageNotFound, a registry that does not answer is RegistryUnavailable,
and a pull lands every blob checked in the local store."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from broker.errors import ConfigError, ImageNotFound, RegistryUnavailable
from broker.images import refs
from broker.images.registry import RegistryClient
from broker.images.store import ImageStore
from broker.settings import Settings
from tests.support.registry import LoopbackRegistry, loopback_registry, tiny_image

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoopbackRegistry]:
    with loopback_registry(tmp_path_factory.mktemp("registry")) as running:
        yield running


@pytest.fixture
def client(registry: LoopbackRegistry) -> Iterator[RegistryClient]:
    c = RegistryClient.from_setting(registry.setting())
    yield c
    c.close()


def _pushed(registry: LoopbackRegistry, tmp_path: Path, name: str, content: str) -> str:
    return registry.push(tiny_image(tmp_path, f"localhost/{name}", content), name)


def test_a_tag_resolves_to_the_digest_the_registry_holds(
    registry: LoopbackRegistry, client: RegistryClient, tmp_path: Path
) -> None:
    digest = _pushed(registry, tmp_path, "resolve-me:v1", "one")
    assert client.resolve("localhost/resolve-me:v1") == digest
    assert client.resolve(f"localhost/resolve-me@{digest}") == digest
    # The tag moves: a fresh client sees the new digest, the pinned one still resolves.
    moved = _pushed(registry, tmp_path, "resolve-me:v1", "two")
    assert moved != digest
    with RegistryClient.from_setting(registry.setting(), ttl_s=0) as fresh:
        assert fresh.resolve("localhost/resolve-me:v1") == moved
        assert fresh.resolve(f"localhost/resolve-me@{digest}") == digest


def test_missing_tags_repositories_and_digests_are_image_not_found(
    registry: LoopbackRegistry, client: RegistryClient, tmp_path: Path
) -> None:
    _pushed(registry, tmp_path, "present:v1", "x")
    for ref in (
        "localhost/present:no-such-tag",
        "localhost/no-such-repository:v1",
        "localhost/present@sha256:" + "0" * 64,
    ):
        with pytest.raises(ImageNotFound):
            client.resolve(ref)


def test_hosts_that_are_not_configured_are_not_resolved(client: RegistryClient) -> None:
    assert client.resolve("docker.io/library/python:3.12") is None
    assert client.resolve("python:3.12") is None
    assert not client.serves("ghcr.io/x/y:1")


def test_a_silent_registry_is_registry_unavailable_and_typed_temporary(tmp_path: Path) -> None:
    with loopback_registry(tmp_path) as short_lived:
        setting = short_lived.setting()
    with (
        RegistryClient.from_setting(setting, timeout_s=2) as client,
        pytest.raises(RegistryUnavailable) as info,
    ):
        client.resolve("localhost/anything:v1")
    assert info.value.retryable


def test_bad_registry_settings_are_config_errors() -> None:
    for raw in ("localhost", "localhost=ftp://x", "=http://127.0.0.1:1", "a=http://"):
        with pytest.raises(ConfigError):
            Settings(registries=raw)
    assert Settings(registries=" localhost=http://127.0.0.1:5000/ ").registries


def test_pull_stores_a_checked_image_and_fetches_no_blob_twice(
    registry: LoopbackRegistry, client: RegistryClient, tmp_path: Path
) -> None:
    digest = _pushed(registry, tmp_path, "pull-me:v1", "pulled content")
    store = ImageStore(tmp_path / "store")
    item = store.pull(client, "localhost/pull-me:v1")
    assert item.digest == digest and item.ref == refs.normalize("localhost/pull-me:v1")
    assert store.resolve("localhost/pull-me:v1") == digest
    assert (store.rootfs(digest) / "hello.txt").read_text() == "pulled content"
    stamps = {p: p.stat().st_mtime_ns for p in (store.root / "blobs/sha256").iterdir()}
    store.pull(client, "localhost/pull-me:v1")
    after = {p: p.stat().st_mtime_ns for p in (store.root / "blobs/sha256").iterdir()}
    layers = [layer["digest"] for layer in store.manifest(digest)["layers"]]
    for layer in layers:
        path = store.blob_path(layer)
        assert after[path] == stamps[path], "a stored layer is not fetched again"


def test_a_pull_of_an_unconfigured_host_is_refused(client: RegistryClient, tmp_path: Path) -> None:
    with pytest.raises(ImageNotFound, match="SANDMAN_REGISTRIES"):
        ImageStore(tmp_path / "store").pull(client, "ghcr.io/x/y:1")


def test_a_missing_blob_fails_the_pull_and_records_no_ref(
    registry: LoopbackRegistry, client: RegistryClient, tmp_path: Path
) -> None:
    digest = _pushed(registry, tmp_path, "broken:v1", "soon without its layer")
    manifest = client.manifest(f"localhost/broken@{digest}").json()
    registry.delete_blob("broken", manifest["layers"][0]["digest"])
    store = ImageStore(tmp_path / "store")
    with pytest.raises(ImageNotFound):
        store.pull(client, "localhost/broken:v1")
    with pytest.raises(ImageNotFound):
        store.resolve("localhost/broken:v1")


def test_sandman_image_pull_cli(registry: LoopbackRegistry, tmp_path: Path) -> None:
    digest = _pushed(registry, tmp_path, "cli-pull:v1", "cli")
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(tmp_path),
        "SANDMAN_CACHE_DIR": str(tmp_path / "cache"),
        "SANDMAN_STATE_DIR": str(tmp_path / "state"),
        "SANDMAN_REGISTRIES": registry.setting(),
    }
    sandman = str(Path(sys.executable).parent / "sandman")
    out = subprocess.run(
        [sandman, "image", "pull", "--unpack", "localhost/cli-pull:v1"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.split() == [refs.normalize("localhost/cli-pull:v1"), digest]
    listed = json.loads(
        subprocess.run(
            [sandman, "image", "ls", "--json"], env=env, capture_output=True, text=True, check=True
        ).stdout
    )
    assert [(i["digest"], i["unpacked"]) for i in listed] == [(digest, True)]
    missing = subprocess.run(
        [sandman, "image", "pull", "localhost/cli-pull:nope"],
        check=False,
        env=env,
        capture_output=True,
        text=True,
    )
    assert missing.returncode == 1 and "ImageNotFound" in missing.stderr
