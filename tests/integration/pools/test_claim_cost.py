"""A warm claim, and a pool-upkeep beat, cost the same at pool size 10 and 1,000 (#19 item 4).

Against real Redis and PostgreSQL, with the pod backend a fake at its seam. A claim is the
trainer's atomic claim plus the worker's hand-out and paced replacement; for each, every
Redis command sent (read where redis-py packs it), every SQL statement and the rows it
answered, and every backend call are recorded. They must be identical at both pool sizes,
no Redis command or script may be one that walks a collection, and the backend must not
be asked for anything but the replacement's image digest (no List of pods, no API call:
the replacement itself is only enqueued). The
upkeep this replaced read every member row and made one Redis call per member, per claim
and per beat: 1,000 of each here, against 10.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
import secrets
from collections import Counter
from collections.abc import Iterator
from functools import partial
from typing import Any, ClassVar

import pytest
import redis
from sqlalchemy import event, func, select

from broker.acquire.service import Broker
from broker.ledger import store
from broker.ledger.models import Sandbox
from broker.names import Task
from broker.ownership.provider import Provider
from broker.pools import store as pool_store
from broker.pools.store import pool_key
from broker.settings import Settings
from broker.wire import warm
from tests.support.fakes import FakeBackend

pytestmark = pytest.mark.integration
IMAGE, CPU_M, MEMORY_B = "localhost/task:1", 100, 64 << 20
KEY = pool_key(IMAGE, None, None, CPU_M, MEMORY_B)
SIZES = (10, 1000)
CLAIMS = 3
PINNING = {"resolve_image"}  # the only backend call a replacement's admission makes
# Commands whose cost grows with the collection they read or edit.
WALKS = {"LREM", "LRANGE", "LPOS", "HGETALL", "HKEYS", "HVALS", "SMEMBERS", "KEYS", "SCAN"}
WALKS |= {"HSCAN", "SSCAN", "ZSCAN", "ZRANGE", "ZRANGEBYSCORE", "ZREVRANGE", "SORT"}
SCRIPTS = {
    script: re.findall(r"redis\.call\('(\w+)'", script)
    for script in (warm.CLAIM_LUA, pool_store.REPUBLISH_LUA, pool_store.RETIRE_LUA)
}


class Recording(redis.Connection):
    """A Redis connection that records each command it sends, alone or in a pipeline."""

    sent: ClassVar[list[str]] = []

    @staticmethod
    def record(args: tuple[Any, ...]) -> None:
        name = args[0].decode() if isinstance(args[0], bytes) else str(args[0])
        sha = args[1] if name.upper() in ("EVALSHA", "EVAL") else ""
        Recording.sent.append(f"{name.upper()} {sha}".strip())

    def send_command(self, *args: Any, **kwargs: Any) -> None:
        self.record(args)
        super().send_command(*args, **kwargs)

    def pack_commands(self, commands: Any) -> Any:
        for command in commands:
            self.record(tuple(command))
        return super().pack_commands(commands)


class SeamBackend(FakeBackend):
    """The fake backend, recording every call the claim path makes (lists included)."""

    def __init__(self) -> None:
        super().__init__()
        self.used: list[str] = []

    def __getattribute__(self, name: str) -> Any:
        attr = super().__getattribute__(name)
        if callable(attr) and not name.startswith("_"):
            super().__getattribute__("used").append(name)
        return attr


@dataclasses.dataclass
class Cost:
    redis: Counter[str]
    sql: int
    rows: int
    backend: list[str]
    enqueued: list[str]


@pytest.fixture(scope="module")
def pools(
    database_url: str, redis_url: str, db_engine: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Broker, SeamBackend, dict[int, str]]]:
    """A broker with one job per pool size, each pool filled and published."""
    from broker.ledger.db import make_session_factory

    url = redis_url.rsplit("/", 1)[0] + "/12"
    client = redis.Redis.from_url(url, connection_class=Recording)
    client.flushdb()
    sessions = make_session_factory(db_engine)
    settings = dataclasses.replace(
        Settings(state_dir=tmp_path_factory.mktemp("cost"), database_url=database_url),
        redis_url=url,
        installation_id=f"cost-{secrets.token_hex(3)}",
        create_rate=100_000.0,
        create_burst=100_000,
        max_concurrent_creates=10_000,
    )
    backend = SeamBackend()
    provider = Provider(settings, sessions, backend, probe=lambda address, token: True)
    enqueued: list[tuple[str, list[Any]]] = []
    svc = Broker(
        settings,
        sessions,
        backend,
        client,
        provider=provider,
        enqueue=lambda task, args, queue: enqueued.append((task, args)),
        actor="cost",
    )
    jobs = {size: f"cost-{size}-{secrets.token_hex(3)}" for size in SIZES}
    for size, job in jobs.items():
        pool = {"image": IMAGE, "cpu_m": CPU_M, "memory_b": MEMORY_B, "size": size}
        with sessions.begin() as session:
            store.ensure_job(session, job, lease_s=3600.0, warm_pools=[pool])
        while svc.pools.upkeep_job(job)["refill"]:  # a pass writes a batch of intents
            for task, args in enqueued:
                assert task == Task.POOL_REFILL
                assert svc.refill(args[0]) == "published"
            enqueued.clear()
        assert svc.warm.size(job, KEY) == size
    svc.enqueued = enqueued  # type: ignore[attr-defined]
    yield svc, backend, jobs
    with sessions.begin() as session:  # no later test's workers may refill these pools
        for job in jobs.values():
            store.ensure_job(session, job, warm_pools=[])
    with sessions() as session:
        ids = list(session.scalars(select(Sandbox.id).where(Sandbox.job.in_(jobs.values()))))
    for sandbox_id in ids:
        provider.release(sandbox_id, reason="test-teardown")
    client.flushdb()
    client.close()


def measure(svc: Broker, backend: SeamBackend, engine: Any, action: Any) -> Cost:
    """Run ``action`` and return everything it sent to Redis, PostgreSQL and the backend."""
    statements: list[int] = []

    def counted(conn: Any, cursor: Any, statement: str, *rest: Any) -> None:
        statements.append(max(cursor.rowcount, 0) if statement.lstrip()[:6] == "SELECT" else 0)

    Recording.sent.clear()
    backend.used.clear()
    enqueued: list[tuple[str, list[Any]]] = svc.enqueued  # type: ignore[attr-defined]
    before = len(enqueued)
    event.listen(engine, "after_cursor_execute", counted)
    try:
        action()
    finally:
        event.remove(engine, "after_cursor_execute", counted)
    return Cost(
        redis=Counter(Recording.sent),
        sql=len(statements),
        rows=sum(statements),
        backend=list(backend.used),
        enqueued=[task for task, _ in enqueued[before:]],
    )


def claim_and_hand_out(svc: Broker, job: str) -> None:
    """What one warm claim costs: the trainer's atomic claim, the worker's hand-out (and
    the replacement it enqueues), as ``broker.client`` and ``workers.tasks`` run them."""
    request_id = f"claim-{secrets.token_hex(4)}"
    lease = svc.warm.claim(job, KEY, request_id)
    assert lease is not None, "the pool ran dry"
    svc.claimed(lease.sandbox_id, request_id, "trainer", 0.001)


def no_walks(cost: Cost) -> list[str]:
    """Commands of ``cost`` (a script by the commands it calls) that walk a collection."""
    shas = {hashlib.sha1(s.encode()).hexdigest(): calls for s, calls in SCRIPTS.items()}
    walked = []
    for command in cost.redis:
        name, _, sha = command.partition(" ")
        assert not sha or sha in shas, f"an unknown script ran: {command}"
        walked += [c for c in (shas[sha] if sha else [name]) if c.upper() in WALKS]
    return walked


def test_a_claim_costs_the_same_at_pool_size_10_and_1000(
    pools: tuple[Broker, SeamBackend, dict[int, str]], db_engine: Any
) -> None:
    svc, backend, jobs = pools
    costs = {
        size: [
            measure(svc, backend, db_engine, partial(claim_and_hand_out, svc, jobs[size]))
            for _ in range(CLAIMS)
        ]
        for size in SIZES
    }
    small, large = costs[SIZES[0]][-1], costs[SIZES[1]][-1]
    assert large.redis == small.redis, "Redis commands per claim grow with the pool"
    assert (large.sql, large.rows) == (small.sql, small.rows), "ledger work grows with the pool"
    for cost in costs[SIZES[0]] + costs[SIZES[1]]:
        # The replacement's admission pins its image's digest (a registry HEAD the kube
        # backend caches); nothing else, no List of pods and no API call.
        assert set(cost.backend) <= PINNING, f"a claim called the pod backend: {cost.backend}"
        assert cost.enqueued == [Task.POOL_REFILL], "one paced replacement per hand-out"
        assert no_walks(cost) == []


def test_an_upkeep_beat_costs_the_same_at_pool_size_10_and_1000(
    pools: tuple[Broker, SeamBackend, dict[int, str]], db_engine: Any
) -> None:
    svc, backend, jobs = pools
    enqueued: list[tuple[str, list[Any]]] = svc.enqueued  # type: ignore[attr-defined]
    for job in jobs.values():  # settle: replacements created, nothing left to decide
        svc.pools.upkeep_job(job)
        for task, args in enqueued:
            if task == Task.POOL_REFILL:
                svc.refill(args[0])
        enqueued.clear()
    costs = {
        size: measure(svc, backend, db_engine, partial(svc.pools.upkeep_job, jobs[size]))
        for size in SIZES
    }
    small, large = costs[SIZES[0]], costs[SIZES[1]]
    assert large.redis == small.redis, "Redis commands per beat grow with the pool"
    assert (large.sql, large.rows) == (small.sql, small.rows), "ledger work grows with the pool"
    assert set(large.backend) <= PINNING and no_walks(large) == []


def test_a_beat_republishes_every_member_after_redis_lost_them(
    pools: tuple[Broker, SeamBackend, dict[int, str]], db_engine: Any
) -> None:
    svc, _backend, jobs = pools
    job = jobs[SIZES[0]]
    with svc.sessions() as session:
        members = session.scalar(
            select(func.count()).where(
                Sandbox.job == job,
                Sandbox.pool_key == KEY,
                Sandbox.state == "ready",
                Sandbox.acquired_at.is_(None),
            )
        )
    assert members
    svc.warm.redis.flushdb()  # a Redis restarted without persistence
    assert svc.warm.claim(job, KEY, "too-early") is None
    counts = svc.pools.upkeep_job(job)
    assert counts["republished"] == members and counts["refill"] == 0
    assert svc.warm.claim(job, KEY, "after-repair") is not None
