"""The pre-pull reconciler against the real ledger and the fake backend (the seam):
warm-pool and hot images are held once each, by digest, removed when no longer wanted;
simulated (kwok) jobs and unresolvable images hold nothing."""

from __future__ import annotations

import secrets

import pytest

from broker.ledger import store
from broker.pools.prepull import PrePull
from broker.settings import Settings
from tests.support.fakes import FakeBackend

pytestmark = pytest.mark.unit
D = "sha256:" + "5" * 64


class PinningBackend(FakeBackend):
    """Resolves every tag to one digest, as a registry would."""

    def resolve_image(self, image: str, digest: str | None) -> str | None:
        super().resolve_image(image, digest)
        return digest or D


@pytest.fixture
def job(sessions) -> str:
    name = f"pp-{secrets.token_hex(3)}"
    with sessions.begin() as s:
        store.ensure_job(
            s,
            name,
            hot_images=["localhost/hot:1"],
            warm_pools=[{"image": "localhost/pool:1", "size": 2}],
        )
    return name


def _prepull(sessions, backend) -> PrePull:
    return PrePull(Settings(), sessions, backend, None, lambda job: None)  # type: ignore[arg-type,return-value]


def _mine(backend: FakeBackend, job: str) -> list[tuple[str, str]]:
    return sorted((p.job, p.image) for p in backend.prepulls("ns") if p.job == job)


def test_hot_and_pool_images_are_held_once_by_digest_then_released(sessions, job) -> None:
    backend = PinningBackend()
    prepull = _prepull(sessions, backend)
    first = prepull.reconcile()
    assert _mine(backend, job) == [(job, f"localhost/hot@{D}"), (job, f"localhost/pool@{D}")]
    assert first["created"] >= 2
    again = prepull.reconcile()
    assert again["created"] == 0 and again["held"] >= 2
    with sessions.begin() as s:
        store.ensure_job(s, job, hot_images=[])
    after = prepull.reconcile()
    assert _mine(backend, job) == [(job, f"localhost/pool@{D}")]
    assert after["removed"] >= 1


def test_simulated_jobs_and_missing_images_hold_nothing(sessions) -> None:
    kwok, missing = f"kw-{secrets.token_hex(3)}", f"mi-{secrets.token_hex(3)}"
    with sessions.begin() as s:
        store.ensure_job(s, kwok, hot_images=["localhost/x:1"], node_selector={"type": "kwok"})
        store.ensure_job(s, missing, hot_images=["localhost/absent:1"])
    backend = PinningBackend()
    backend.missing_images.add("localhost/absent:1")
    counts = _prepull(sessions, backend).reconcile()
    assert _mine(backend, kwok) == [] and _mine(backend, missing) == []
    assert counts["unresolved"] >= 1
