"""Fair share of the create rate through REAL Celery workers, Redis, PostgreSQL and local
sandboxes: trainers enqueue through the client's own path, workers pace creates at a low
rate, and every claim is checked by the ORDER of the creates in the ledger
(``creating_at``: when each create got its pacer token), never by wall-clock bounds.

The gate is 1 here (``SANDMAN_FAIR_GATE``): a request is popped only once the one before
it has its token's start reserved, so the ledger's create order is the scheduler's order.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from sqlalchemy import select

from broker.acquire import quotas, weights
from broker.acquire.fairshare import PROC
from broker.client import core
from broker.client.sync import SandboxClient
from broker.errors import AcquireTimeout
from broker.ledger.db import make_engine, make_session_factory
from broker.ledger.models import Sandbox
from broker.names import Queue
from broker.wire import fairq, mailbox
from tests.integration.workers.conftest import OwnBroker
from tests.support.images import TASK_IMAGE
from tests.support.wait import wait_until

pytestmark = pytest.mark.integration
SHAPE = {"image": TASK_IMAGE, "cpu": "100m", "memory": "64Mi", "timeout": 600}
SLOW = {"SANDMAN_CREATE_RATE": "3", "SANDMAN_CREATE_BURST": "1", "SANDMAN_FAIR_GATE": "1"}
QUEUES = f"{Queue.ACQUIRE},{Queue.RELEASE},{Queue.POOL}"


@pytest.fixture
def parts(own_broker: OwnBroker) -> Iterator[tuple[Any, SandboxClient, redis.Redis]]:
    engine = make_engine(own_broker.database_url, pool_size=2, max_overflow=0)
    client = SandboxClient(own_broker.redis_url, owner="fair-test")
    raw = redis.Redis.from_url(own_broker.redis_url)
    yield make_session_factory(engine), client, raw
    raw.close()
    client.close()
    engine.dispose()


def enqueue(client: SandboxClient, job: str, n: int, **extra: Any) -> list[dict[str, Any]]:
    """n acquires of ``job`` sent the way acquire_many sends them (one batch)."""
    requests = core.group_requests(n, client.owner, job=job, **{**SHAPE, **extra})
    client.enqueuer.send_all(core.acquire_message(r) for r in requests)
    return requests


def creates(sessions: Any) -> list[tuple[str, str, str | None]]:
    """(job, role, request id) of every create so far, in the order they got their token."""
    with sessions() as session:
        rows = session.execute(
            select(Sandbox.job, Sandbox.role, Sandbox.request_id, Sandbox.creating_at)
            .where(Sandbox.creating_at.is_not(None))
            .order_by(Sandbox.creating_at, Sandbox.id)
        ).all()
    return [(job, str(role), rid) for job, role, rid, _ in rows]


def give_up(raw: redis.Redis, requests: list[dict[str, Any]]) -> None:
    """What a trainer that stops waiting does: cancel each request's mailbox."""
    for request in requests:
        mailbox.cancel(raw, request["request_id"])


def test_a_burst_of_one_job_does_not_delay_another_beyond_its_share(
    own_broker: OwnBroker, parts: tuple[Any, SandboxClient, redis.Redis]
) -> None:
    sessions, client, raw = parts
    burst, small = own_broker.job("burst"), own_broker.job("small")
    own_broker.start_worker("w", QUEUES, threads=8, env=SLOW)
    a = enqueue(client, burst, 40)
    wait_until(lambda: len(creates(sessions)) >= 4, timeout=120, interval=0.1, what="A creating")
    before = len(creates(sessions))
    b = enqueue(client, small, 3)
    b_ids = {r["request_id"] for r in b}

    def b_created() -> list[int] | None:
        order = creates(sessions)
        at = [i for i, (_, _, rid) in enumerate(order) if rid in b_ids]
        return at if len(at) == 3 else None

    positions = wait_until(b_created, timeout=180, interval=0.2, what="B's creates")
    give_up(raw, a)
    # Equal weights alternate: B's k-th create is within 2k (+1 in flight) of its arrival;
    # first come first served would have put all of A's remaining burst first.
    after = [p - before for p in positions]
    assert after == sorted(after)
    for k, p in enumerate(after, start=1):
        assert p <= 2 * k, (after, before)
    assert before + 2 * 3 < len(a)  # A still had a backlog when B was served


def test_weights_one_and_three_give_creates_one_to_three(
    own_broker: OwnBroker, parts: tuple[Any, SandboxClient, redis.Redis]
) -> None:
    sessions, client, raw = parts
    light, heavy = own_broker.job("light"), own_broker.job("heavy")
    weights.set_job_weight(sessions, heavy, 3, actor="admin:test", redis=raw)
    a = enqueue(client, light, 30)
    b = enqueue(client, heavy, 30)
    own_broker.start_worker("w", QUEUES, threads=8, env=SLOW)  # syncs the weights first
    wait_until(lambda: len(creates(sessions)) >= 24, timeout=240, interval=0.2, what="24 creates")
    give_up(raw, a + b)
    first = [job for job, _, _ in creates(sessions)[:24]]
    assert (first.count(heavy), first.count(light)) == (18, 6)
    for k in range(4, 25, 4):  # and so in every prefix, within one create
        assert abs(first[:k].count(heavy) - 3 * k / 4) <= 1, first


def test_grading_before_rollouts_of_the_same_tenant(
    own_broker: OwnBroker, parts: tuple[Any, SandboxClient, redis.Redis]
) -> None:
    sessions, client, raw = parts
    quotas.create(sessions, "team", {}, actor="admin:test")
    rollouts, grading = own_broker.job("rollouts"), own_broker.job("grading")
    for job in (rollouts, grading):
        quotas.assign_job(sessions, job, "team", actor="admin:test")
    r = enqueue(client, rollouts, 12)
    g = enqueue(client, grading, 4, role="grading")
    own_broker.start_worker("w", QUEUES, threads=8, env=SLOW)
    wait_until(lambda: len(creates(sessions)) >= 6, timeout=180, interval=0.2, what="6 creates")
    give_up(raw, r + g)
    roles = [role for _, role, _ in creates(sessions)[:6]]
    assert roles == ["grading"] * 4 + ["rollout"] * 2


def test_a_worker_killed_while_serving_a_request_loses_nothing(
    own_broker: OwnBroker, parts: tuple[Any, SandboxClient, redis.Redis]
) -> None:
    _, client, raw = parts
    capped = own_broker.job("capped", max_live=1)
    first = own_broker.start_worker("w1", Queue.ACQUIRE.value, threads=4)
    own_broker.start_worker("control", f"{Queue.RELEASE},{Queue.POOL}", threads=4)
    holder = client.open(job=capped, **SHAPE)
    wait_until(lambda: raw.zcard(PROC) == 0, interval=0.05, what="the holder's request done")
    outcome: list[object] = []

    def trainer() -> None:
        try:
            outcome.append(client.open(job=capped, **SHAPE))
        except Exception as exc:
            outcome.append(exc)

    thread = threading.Thread(target=trainer, daemon=True)
    thread.start()
    # popped by w1, waiting at the job's cap: in the processing set, out of every list
    wait_until(lambda: raw.zcard(PROC) == 1, interval=0.05, what="the request popped")
    os.kill(first.pid, signal.SIGKILL)
    first.wait()
    assert raw.zcard(PROC) == 1 and raw.hlen(fairq.BODIES) == 1  # not lost with w1
    holder.release()
    own_broker.start_worker("w2", Queue.ACQUIRE.value, threads=4)
    thread.join(timeout=240)
    assert outcome and not isinstance(outcome[0], BaseException), outcome
    sandbox = outcome[0]
    assert sandbox.exec("echo ok").stdout.strip() == "ok"  # type: ignore[attr-defined]
    sandbox.release()  # type: ignore[attr-defined]
    wait_until(
        lambda: raw.zcard(PROC) == 0 and raw.hlen(fairq.BODIES) == 0, what="the request done"
    )


def test_a_queued_request_the_trainer_gave_up_on_is_never_created(
    own_broker: OwnBroker, parts: tuple[Any, SandboxClient, redis.Redis]
) -> None:
    sessions, client, raw = parts
    job = own_broker.job("patient")
    with pytest.raises(AcquireTimeout):  # no worker yet: it waited in the queue, gave up
        client.open(job=job, **{**SHAPE, "timeout": 1})
    kept = enqueue(client, job, 2)
    own_broker.start_worker("w", QUEUES, threads=4)
    wait_until(lambda: len(creates(sessions)) == 2, timeout=120, interval=0.1, what="2 creates")
    assert {rid for _, _, rid in creates(sessions)} == {r["request_id"] for r in kept}
    wait_until(
        lambda: int(raw.hget(f"{fairq.PREFIX}:stats", "dropped") or 0) == 1,
        what="the given-up request dropped",
    )
    wait_until(lambda: raw.hlen(fairq.BODIES) == 0, what="no request left behind")
    with sessions() as session:
        assert len(session.scalars(select(Sandbox).where(Sandbox.job == job)).all()) == 2
