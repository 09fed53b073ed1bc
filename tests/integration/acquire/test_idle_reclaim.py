"""Idle reclaim of held sandboxes (broker/acquire/idle.py) with REAL Celery workers, Redis,
PostgreSQL and local sandboxes running the real execd.

No test bounds how fast a reclaim comes (bench/idle_reclaim.py measures that); each one
waits for it with tests/support/wait.py and checks what must hold: it came, not before
the timeout counted from the last activity, with its reason in the ledger, and the
trainer's next call says ``SandboxReclaimed``. A command is held on a file the test
creates, never on a sleep, so a loaded machine cannot make a check pass by accident.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis as redis_lib
from sqlalchemy import select, text

from broker.client import AsyncSandboxClient, SandboxClient
from broker.errors import SandboxLost, SandboxReclaimed
from broker.ledger import store
from broker.ledger.models import Event, Sandbox
from broker.ledger.states import State
from broker.names import IDLE_DEADLINES_KEY, Queue, Task, reclaimed_key
from broker.pools.store import WarmStore
from broker.settings import Settings
from broker.wire.execd import Endpoint, control_call, reclaim_call, shared_http
from broker.wire.warm import pool_key
from tests.support import factories
from tests.support.images import TASK_IMAGE
from tests.support.wait import wait_until

pytestmark = pytest.mark.integration
IMAGE = TASK_IMAGE
TIMEOUT_S = 1.0
NEVER_S = 3600.0


@pytest.fixture
def client(stack: Settings) -> Iterator[SandboxClient]:
    c = SandboxClient(stack.redis_url, owner="pytest-idle")
    yield c
    c.close()


@pytest.fixture
def redis(stack: Settings) -> Iterator[redis_lib.Redis]:
    r = redis_lib.Redis.from_url(stack.redis_url)
    yield r
    r.close()


def _reclaim_event(sessions: Any, sandbox_id: str) -> Event | None:
    """The ledger's record of an idle reclaim: ready -> releasing, reason ``idle``."""
    with sessions() as session:
        for event in session.scalars(
            select(Event).where(
                Event.sandbox_id == sandbox_id,
                Event.kind == "transition",
                Event.to_state == State.RELEASING.value,
            )
        ):
            if (event.detail or {}).get("reason") == "idle":
                session.expunge(event)
                return event
    return None


def _row(sessions: Any, sandbox_id: str) -> Sandbox:
    with sessions() as session:
        row = session.get(Sandbox, sandbox_id)
        assert row is not None
        session.expunge(row)
        return row


def _deleted(sessions: Any, sandbox_id: str) -> bool:
    return _row(sessions, sandbox_id).state == State.DELETED


def test_an_idle_sandbox_is_reclaimed_and_its_next_call_says_so(
    client: SandboxClient, sessions: Any
) -> None:
    job = factories.job(sessions, "idle-sync", idle_timeout_s=TIMEOUT_S)
    sb = client.open(image=IMAGE, job=job, timeout=60)
    event = wait_until(lambda: _reclaim_event(sessions, sb.id), what="the idle reclaim")
    assert event.actor == "idle-reclaim" and event.detail["idle_s"] >= TIMEOUT_S
    row = _row(sessions, sb.id)
    assert row.acquired_at is not None
    assert (event.at - row.acquired_at).total_seconds() >= TIMEOUT_S
    with pytest.raises(SandboxReclaimed):
        sb.exec("true")  # execd refuses (410), or its pod is gone already: the same error
    wait_until(lambda: _deleted(sessions, sb.id), what="the reclaimed sandbox deleted")
    with sessions() as session:  # what an auditor reads (migration 0002's view)
        audited = session.execute(
            text(
                "SELECT release_reason, release_requested_by FROM audit.sandboxes"
                " WHERE sandbox_id = :id"
            ),
            {"id": sb.id},
        ).one()
    assert tuple(audited) == ("idle", "idle-reclaim")
    with pytest.raises(SandboxReclaimed, match="reclaimed after"):
        sb.exec("true")  # no execd any more: the broker's marker says why
    with pytest.raises(SandboxReclaimed):
        list(sb.run_stream("echo never"))
    sb.release()  # still fine: a release of a deleted sandbox settles nothing


def test_the_async_client_says_reclaimed_too(stack: Settings, sessions: Any) -> None:
    job = factories.job(sessions, "idle-async", idle_timeout_s=TIMEOUT_S)

    async def main() -> None:
        async with AsyncSandboxClient(stack.redis_url, owner="pytest-idle-async") as c:
            sb = await c.open(image=IMAGE, job=job, timeout=60)
            await asyncio.to_thread(
                wait_until, lambda: _reclaim_event(sessions, sb.id), what="the idle reclaim"
            )
            with pytest.raises(SandboxReclaimed):
                await sb.exec("true")
            await asyncio.to_thread(
                wait_until, lambda: _deleted(sessions, sb.id), what="the delete"
            )
            with pytest.raises(SandboxReclaimed):
                await sb.read_file("/etc/hostname")
            with pytest.raises(SandboxReclaimed):
                _ = [item async for item in sb.run_stream("echo never")]
            await sb.release()

    asyncio.run(main())


@pytest.mark.parametrize("how", ["exec", "stream"])
def test_a_running_command_keeps_it_until_it_ends_plus_the_timeout(
    how: str, client: SandboxClient, sessions: Any, redis: redis_lib.Redis
) -> None:
    # Held under a long timeout while the command starts (a loaded machine may take
    # seconds to get there), then the job's timeout is lowered: the reconcile pulls the
    # deadline in and every check from then on finds the command running.
    job = factories.job(sessions, f"idle-busy-{how}", idle_timeout_s=NEVER_S)
    sb = client.open(image=IMAGE, job=job, timeout=60)
    gate = f"/tmp/go-{how}"
    cmd = f"touch /tmp/started; while [ ! -e {gate} ]; do sleep 0.05; done; echo done"
    out: list[str] = []

    def run() -> None:
        if how == "exec":
            out.append(sb.exec(cmd, timeout=3600).stdout)
        else:
            items = list(sb.run_stream(cmd, timeout=3600))
            out.append("".join(getattr(item, "text", "") for item in items))

    worker = threading.Thread(target=run)
    worker.start()
    wait_until(lambda: sb.run("test -e /tmp/started").ok, what="the command to start")
    factories.job(sessions, job, idle_timeout_s=TIMEOUT_S)
    redis.delete(IDLE_DEADLINES_KEY + ":reconcile")  # the next reconcile runs at once
    seen: set[float] = set()

    def checked_while_running() -> bool:
        score = redis.zscore(IDLE_DEADLINES_KEY, sb.id)
        if score is not None and score < time.time() + NEVER_S / 2:
            seen.add(score)
        return len(seen) >= 4  # pulled in, then judged "running" and pushed on, again

    wait_until(checked_while_running, what="idle checks while the command runs")
    assert _row(sessions, sb.id).state == State.READY
    assert _reclaim_event(sessions, sb.id) is None
    released_at = time.time()
    sb.write_file(gate, b"")
    worker.join()
    assert out and "done" in out[0]
    event = wait_until(lambda: _reclaim_event(sessions, sb.id), what="the reclaim after it ended")
    assert event.at.timestamp() >= released_at + TIMEOUT_S
    wait_until(lambda: _deleted(sessions, sb.id), what="the delete")


def test_heartbeats_and_status_reads_do_not_keep_it(stack: Settings, sessions: Any) -> None:
    """Polled ten times a second with an authenticated status read and an execd heartbeat
    (and its lease renewed every second): if either counted, the idle clock would never
    reach the timeout and the wait below would fail."""
    job = factories.job(sessions, "idle-beat", idle_timeout_s=TIMEOUT_S)
    c = SandboxClient(stack.redis_url, owner="pytest-idle-beat", heartbeat_s=1.0)
    try:
        sb = c.open(image=IMAGE, job=job, timeout=60)
        execd = Endpoint(sb.lease.address, sb.lease.token)

        def reclaimed_while_polled() -> Event | None:
            sb.healthy(timeout=2.0)
            with contextlib.suppress(SandboxLost):  # refused (410) once reclaimed
                execd.send(shared_http(), control_call("/v1/heartbeat"))
            return _reclaim_event(sessions, sb.id)

        wait_until(reclaimed_while_polled, interval=0.1, what="the reclaim despite the polling")
        sb.release()
    finally:
        c.close()


def test_warm_members_follow_their_pool_and_a_claimed_one_counts_from_its_hand_out(
    client: SandboxClient, sessions: Any, redis: redis_lib.Redis
) -> None:
    cpu_m, mem = 250, 256 << 20
    pool = {"image": IMAGE, "cpu_m": cpu_m, "memory_b": mem, "size": 1, "idle_timeout_s": 600}
    job = factories.job(sessions, "idle-warm", idle_timeout_s=TIMEOUT_S, warm_pools=[pool])
    key = pool_key(IMAGE, None, None, cpu_m, mem)
    warm = WarmStore(redis)
    client.send(Task.POOL_UPKEEP, [], Queue.POOL)
    wait_until(lambda: warm.size(job, key) >= 1, what="the pool filled")
    with sessions() as session:
        (member,) = session.scalars(
            select(Sandbox.id).where(Sandbox.job == job, Sandbox.state == State.READY)
        )
    # A held sandbox of the same job, handed out after the member was ready, is reclaimed:
    # sweeps ran well past the member's own ready + timeout, and the member stayed.
    cold = client.open(image=IMAGE, job=job, cpu="250m", memory=mem, env={"A": "1"}, timeout=60)
    assert not cold.lease.warm
    wait_until(lambda: _reclaim_event(sessions, cold.id), what="the held sandbox reclaimed")
    row = _row(sessions, member)
    assert row.state == State.READY and row.acquired_at is None and row.pool_key == key
    assert _reclaim_event(sessions, member) is None and warm.size(job, key) >= 1
    # Claimed, it is held: reclaimed after the timeout counted from its hand-out, not
    # from the time it was made.
    sb = client.open(image=IMAGE, job=job, cpu="250m", memory=mem, timeout=60)
    assert sb.lease.warm and sb.id == member
    event = wait_until(lambda: _reclaim_event(sessions, sb.id), what="the claimed one reclaimed")
    handed = _row(sessions, sb.id).acquired_at
    assert handed is not None and (event.at - handed).total_seconds() >= TIMEOUT_S
    factories.job(sessions, job, warm_pools=[])
    client.send(Task.POOL_UPKEEP, [], Queue.POOL)


def test_a_sweep_killed_after_execd_reclaimed_is_finished_by_the_next(
    client: SandboxClient, sessions: Any, redis: redis_lib.Redis, stack: Settings
) -> None:
    job = factories.job(sessions, "idle-crash-1", idle_timeout_s=NEVER_S)
    sb = client.open(image=IMAGE, job=job, timeout=60)
    # What a sweep did before its worker was killed: execd reclaimed, nothing else.
    reply = Endpoint(sb.lease.address, sb.lease.token).send(shared_http(), reclaim_call(1e-3, 1e9))
    assert reply["reclaimed"] is True
    assert _row(sessions, sb.id).state == State.READY
    redis.zadd(IDLE_DEADLINES_KEY, {sb.id: 0})  # its claim's lease ran out
    event = wait_until(lambda: _reclaim_event(sessions, sb.id), what="the next sweep")
    assert event.actor == "idle-reclaim"
    wait_until(lambda: _deleted(sessions, sb.id), what="the delete")
    with pytest.raises(SandboxReclaimed):
        sb.exec("true")


def test_a_sweep_killed_before_the_release_is_finished_by_the_next(
    client: SandboxClient, sessions: Any, redis: redis_lib.Redis
) -> None:
    job = factories.job(sessions, "idle-crash-2", idle_timeout_s=NEVER_S)
    sb = client.open(image=IMAGE, job=job, timeout=60)
    Endpoint(sb.lease.address, sb.lease.token).send(shared_http(), reclaim_call(1e-3, 1e9))
    redis.set(reclaimed_key(sb.id), json.dumps({"idle_s": 1.0}))
    with sessions.begin() as session:  # the ledger marked, the release never enqueued
        row = store.lock_row(session, sb.id)
        assert row is not None
        store.transition(
            session, row, State.RELEASING, actor="idle-reclaim", detail={"reason": "idle"}
        )
    redis.zadd(IDLE_DEADLINES_KEY, {sb.id: 0})
    wait_until(lambda: _deleted(sessions, sb.id), what="the release finished")
    assert redis.zscore(IDLE_DEADLINES_KEY, sb.id) is None
    with pytest.raises(SandboxReclaimed):
        sb.exec("true")
