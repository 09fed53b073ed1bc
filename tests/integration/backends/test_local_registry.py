"""The local backend runs images a registry serves (issue #15 items 2-4): admission
resolves the tag to the registry's digest and records it, the first create pulls the
image into the store (recorded as a pull, with its time), the next one does not, and
a tag the registry lacks is ImageNotFound before any row or process."""

from __future__ import annotations

import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select

from broker.backends.local import LocalBackend
from broker.errors import ImageNotFound
from broker.ledger import store
from broker.ledger.models import Sandbox
from broker.ownership.provider import Provider
from broker.settings import Settings
from broker.wire.request import AcquireRequest
from tests.support.images import TASK_IMAGE, ensure_local_images
from tests.support.registry import LoopbackRegistry, loopback_registry

pytestmark = pytest.mark.integration
JOB = "registry-job"


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LoopbackRegistry, str]]:
    """The task base image pushed under a fresh name (so no store holds it yet)."""
    settings = Settings()
    ensure_local_images(settings.cache_dir)
    tarball = next(
        Path(line.split("\t")[1])
        for line in (settings.cache_dir / "images/index.tsv").read_text().splitlines()
        if line.startswith(TASK_IMAGE + "\t")
    )
    with loopback_registry(tmp_path_factory.mktemp("registry")) as running:
        name = f"sandman-regtest-{secrets.token_hex(3)}:v1"
        running.push(tarball, name)
        yield running, f"localhost/{name}"


@pytest.fixture
def provider(
    registry: tuple[LoopbackRegistry, str], tmp_path: Path, sessions: Any
) -> Iterator[Provider]:
    if shutil.which("bwrap") is None:
        pytest.fail("bubblewrap is required: apt-get install -y bubblewrap")
    running, _ = registry
    # A private cache: the store starts without the image, and the pull leaves nothing.
    settings = Settings(
        state_dir=tmp_path / "state", cache_dir=tmp_path / "cache", registries=running.setting()
    )
    with sessions.begin() as session:
        store.ensure_job(session, JOB, warm_pools=[])
    backend = LocalBackend(settings)
    yield Provider(settings, sessions, backend)
    backend.registry.close()


def _acquire(provider: Provider, image: str) -> tuple[str, str]:
    sid, token = provider.intent(AcquireRequest.new(job=JOB, image=image))
    lease = provider.create(sid, token)
    return sid, lease.address


def test_first_create_pulls_by_digest_and_the_next_one_does_not(
    registry: tuple[LoopbackRegistry, str], provider: Provider, sessions: Any
) -> None:
    _, image = registry
    first, address = _acquire(provider, image)
    second, _ = _acquire(provider, image)
    try:
        with sessions() as session:
            one, two = session.get(Sandbox, first), session.get(Sandbox, second)
            assert one is not None and two is not None
            digest = provider.backend.registry.resolve(image)  # type: ignore[attr-defined]
            assert one.image_resolved == digest == two.image_resolved
            assert one.image_pulled is True and (one.image_pull_s or 0) > 0
            assert two.image_pulled is False
        assert httpx.get(f"http://{address}/healthz", timeout=10).status_code == 200
    finally:
        provider.release(first, actor="test", reason="done")
        provider.release(second, actor="test", reason="done")


def test_a_tag_the_registry_lacks_is_image_not_found_before_any_row(
    registry: tuple[LoopbackRegistry, str], provider: Provider, sessions: Any
) -> None:
    _, image = registry
    request = AcquireRequest.new(job=JOB, image=image.replace(":v1", ":missing"))
    with pytest.raises(ImageNotFound):
        provider.intent(request)
    with sessions() as session:
        count = session.scalar(select(func.count()).where(Sandbox.request_id == request.request_id))
    assert count == 0
