"""One job's broken pool does not starve the others: a pool-upkeep beat whose first job
names an image no registry has (a typo, a deleted tag) still refills every job after it.

Real PostgreSQL and Redis; the pod backend is the fake at its seam, its store missing the
broken image. Before, ``upkeep_all`` let the first job's ``ImageNotFound`` end the whole
pass: every pool sorted after it stayed empty for as long as the bad config stayed.
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from broker.acquire.service import Broker
from broker.ledger import store
from broker.ledger.db import make_session_factory
from broker.names import Task
from broker.ownership.provider import Provider
from broker.pools.store import pool_key
from broker.settings import Settings
from tests.support.fakes import FakeBackend

pytestmark = pytest.mark.integration
GOOD, BROKEN = "localhost/task:1", "localhost/no-such-image:1"
CPU_M, MEMORY_B = 100, 64 << 20


@pytest.fixture
def broker(
    database_url: str, redis_url: str, db_engine: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Broker, list[tuple[str, list[Any]]]]]:
    url = redis_url.rsplit("/", 1)[0] + "/13"
    client = redis.Redis.from_url(url)
    client.flushdb()
    settings = dataclasses.replace(
        Settings(state_dir=tmp_path_factory.mktemp("isolation"), database_url=database_url),
        redis_url=url,
        installation_id=f"iso-{secrets.token_hex(3)}",
    )
    backend = FakeBackend()
    backend.missing_images.add(BROKEN)
    sessions = make_session_factory(db_engine)
    provider = Provider(settings, sessions, backend, probe=lambda address, token: True)
    enqueued: list[tuple[str, list[Any]]] = []
    svc = Broker(
        settings,
        sessions,
        backend,
        client,
        provider=provider,
        enqueue=lambda task, args, queue: enqueued.append((task, args)),
        actor="isolation",
    )
    yield svc, enqueued
    client.flushdb()
    client.close()


def _pool(image: str, size: int) -> list[dict[str, Any]]:
    return [{"image": image, "cpu_m": CPU_M, "memory_b": MEMORY_B, "size": size}]


def test_a_job_whose_pool_image_is_missing_does_not_stop_the_others(
    broker: tuple[Broker, list[tuple[str, list[Any]]]],
) -> None:
    svc, enqueued = broker
    tag = secrets.token_hex(3)
    # "a-" sorts before "z-": the pass meets the broken job first
    broken, good = f"a-broken-{tag}", f"z-good-{tag}"
    with svc.sessions.begin() as session:
        store.ensure_job(session, broken, warm_pools=_pool(BROKEN, 2))
        store.ensure_job(session, good, warm_pools=_pool(GOOD, 2))
    try:
        report = svc.pools.upkeep_all()
        assert report[broken] == {"error": "image_not_found"}
        assert report[good]["refill"] == 2
        for task, args in enqueued:
            assert task == Task.POOL_REFILL
            assert svc.refill(args[0]) == "published"
        assert svc.warm.size(good, pool_key(GOOD, None, None, CPU_M, MEMORY_B)) == 2
    finally:
        with svc.sessions.begin() as session:  # no later test's workers may refill these
            for job in (broken, good):
                store.ensure_job(session, job, warm_pools=[])
