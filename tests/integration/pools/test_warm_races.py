"""A claim that lands in the middle of an upkeep pass never hands one sandbox to two
trainers, and never lets upkeep delete a sandbox a trainer has just claimed (#20 item 13).

The interleaving is forced, not hoped for: upkeep's Redis client is a proxy that lets a
trainer's claim run right after upkeep's first read about the member. Upkeep written as
"check claimed, then check published, then act" re-published the claimed member, and a
second claim then got the same sandbox; the atomic decisions leave nothing to take.
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from sqlalchemy import select

from broker.acquire.service import Broker
from broker.backends.local import LocalBackend
from broker.ledger import store
from broker.ledger.models import Sandbox
from broker.names import Task
from broker.pools.store import pool_key
from broker.settings import Settings
from broker.wire.warm import CLAIM_LUA, claim_call, claimed_lease
from tests.support.images import TASK_IMAGE

pytestmark = pytest.mark.integration
IMAGE = TASK_IMAGE
CPU_M, MEMORY_B = 200, 128 << 20


class ClaimMidway:
    """Upkeep's Redis, except that the first read it makes runs ``claim`` just after."""

    def __init__(self, real: Any, claim: Callable[[], Any]) -> None:
        self._real, self._claim = real, claim
        self.claimed: Any = None
        self.fired = False

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._real, name)
        if name not in ("exists", "hexists", "hget", "hgetall", "zcard") or self.fired:
            return attr

        def read_then_claim(*args: Any, **kwargs: Any) -> Any:
            answer = attr(*args, **kwargs)
            self.fired = True
            self.claimed = self._claim()
            return answer

        return read_then_claim


@pytest.fixture
def job() -> str:
    return f"warm-races-{secrets.token_hex(4)}"


@pytest.fixture
def broker(
    database_url: str, redis_url: str, sessions: Any, tmp_path: Path, job: str
) -> Iterator[Broker]:
    url = redis_url.rsplit("/", 1)[0] + "/13"
    client = redis.Redis.from_url(url)
    client.flushdb()
    settings = Settings(state_dir=tmp_path, database_url=database_url, redis_url=url)
    settings = dataclasses.replace(
        settings, installation_id=f"races-{secrets.token_hex(3)}", create_rate=100.0
    )
    svc = Broker(settings, sessions, LocalBackend(settings), client, actor="races")
    yield svc
    with sessions() as session:
        ids = list(session.scalars(select(Sandbox.id).where(Sandbox.job == job)))
    for sandbox_id in ids:
        svc.provider.release(sandbox_id, reason="test-teardown")
    client.close()


def _one_published_member(broker: Broker, sessions: Any, job: str, idle_timeout_s: float) -> str:
    pool = {"image": IMAGE, "cpu_m": CPU_M, "memory_b": MEMORY_B, "size": 1}
    with sessions.begin() as session:
        store.ensure_job(
            session, job, max_live=5, lease_s=60.0,
            warm_pools=[{**pool, "idle_timeout_s": idle_timeout_s}],
        )  # fmt: skip
    assert broker.pools.upkeep_job(job)["refill"] == 1
    with sessions() as session:
        member = session.scalars(
            select(Sandbox.id).where(Sandbox.job == job, Sandbox.pool_key.isnot(None))
        ).one()
    assert broker.refill(member) == "published"
    return member


def _claimer(broker: Broker, job: str, trainer: str) -> Callable[[], Any]:
    key = pool_key(IMAGE, None, None, CPU_M, MEMORY_B)
    script = broker.warm.redis.register_script(CLAIM_LUA)

    def claim() -> Any:
        keys, args = claim_call(job, key, trainer)
        return claimed_lease(script(keys=keys, args=args))

    return claim


def _upkeep_with_claim_midway(broker: Broker, job: str, claim: Callable[[], Any]) -> ClaimMidway:
    real = broker.warm.redis
    proxy = ClaimMidway(real, claim)
    broker.warm.redis = proxy
    try:
        broker.pools.upkeep_job(job)
    finally:
        broker.warm.redis = real
    return proxy


def test_a_claim_during_upkeep_is_never_claimed_again(
    broker: Broker, sessions: Any, job: str
) -> None:
    member = _one_published_member(broker, sessions, job, idle_timeout_s=300.0)
    midway = _upkeep_with_claim_midway(broker, job, _claimer(broker, job, "trainer-a"))
    first = midway.claimed if midway.fired else _claimer(broker, job, "trainer-a")()
    assert first is not None and first.sandbox_id == member
    second = _claimer(broker, job, "trainer-b")()
    assert second is None or second.sandbox_id != member, "one sandbox, two trainers"


def test_upkeep_never_deletes_a_member_claimed_during_its_pass(
    broker: Broker, sessions: Any, job: str
) -> None:
    member = _one_published_member(broker, sessions, job, idle_timeout_s=0.001)
    released: list[str] = []
    enqueue = broker.pools.enqueue

    def recording(task: Any, args: list[Any], queue: str) -> None:
        if task == Task.RELEASE:
            released.append(args[0])
        enqueue(task, args, queue)

    broker.pools.enqueue = recording
    try:
        midway = _upkeep_with_claim_midway(broker, job, _claimer(broker, job, "trainer-a"))
    finally:
        broker.pools.enqueue = enqueue
    claimed = midway.claimed if midway.fired else _claimer(broker, job, "trainer-a")()
    got_it = claimed is not None and claimed.sandbox_id == member
    assert got_it != (member in released), "a member is either claimed or deleted as idle"
