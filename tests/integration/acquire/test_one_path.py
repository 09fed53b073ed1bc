"""One acquire crosses each layer once: its ledger row is read once and locked once per
committed step, counted on the real PostgreSQL with a SQLAlchemy event listener.

The numbers are the contract of ``docs/performance.md`` ("SQL statements per create":
7 with a live cap, 4 without): a change that reads the row twice again, locks it after a
hand-out, or goes back to a statement per row and per event, fails here.
"""

from __future__ import annotations

import dataclasses
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from sqlalchemy import event, select

from broker.acquire.service import Broker
from broker.backends.local import LocalBackend
from broker.ledger import store
from broker.ledger.models import Sandbox
from broker.ledger.states import State
from broker.pools.store import pool_key
from broker.settings import Settings
from broker.wire.request import AcquireRequest
from tests.support.images import TASK_IMAGE

pytestmark = pytest.mark.integration
IMAGE = TASK_IMAGE
MAX_STATEMENTS_PER_CREATE = 7  # the job has a live cap: its lock and count are 2


class Statements:
    """Every SQL statement the engine sends while ``recording`` (BEGIN/COMMIT excluded:
    they are not statements of the driver's cursor)."""

    def __init__(self) -> None:
        self.seen: list[str] = []
        self.recording = False

    def __call__(self, conn: Any, cursor: Any, sql: str, *args: Any) -> None:
        if self.recording:
            self.seen.append(" ".join(sql.split()))

    def reads_by_request(self) -> list[str]:
        return [s for s in self.seen if "FROM sandboxes" in s and "request_id =" in s]

    def row_locks(self) -> list[str]:
        return [s for s in self.seen if "FROM sandboxes" in s and "FOR UPDATE" in s]


@pytest.fixture
def counted(db_engine: Any) -> Iterator[Statements]:
    statements = Statements()
    event.listen(db_engine, "before_cursor_execute", statements)
    yield statements
    event.remove(db_engine, "before_cursor_execute", statements)


@pytest.fixture
def broker(database_url: str, redis_url: str, sessions: Any, tmp_path: Path) -> Iterator[Broker]:
    url = redis_url.rsplit("/", 1)[0] + "/12"
    client = redis.Redis.from_url(url)
    client.flushdb()
    inst = f"path-{secrets.token_hex(3)}"
    settings = Settings(state_dir=tmp_path, database_url=database_url, redis_url=url)
    settings = dataclasses.replace(settings, installation_id=inst, create_rate=100.0)
    svc = Broker(settings, sessions, LocalBackend(settings), client, actor="path")
    with sessions.begin() as session:
        store.ensure_job(session, "one-path", max_live=5, lease_s=60.0)
    yield svc
    with sessions() as session:
        ids = list(session.scalars(select(Sandbox.id).where(Sandbox.job == "one-path")))
    for sandbox_id in ids:
        svc.provider.release(sandbox_id, reason="test-teardown")
    client.close()


def _request(**over: Any) -> AcquireRequest:
    return AcquireRequest.new(image=IMAGE, job="one-path", cpu="200m", memory="128Mi", **over)


def test_a_cold_acquire_reads_its_row_once(broker: Broker, counted: Statements) -> None:
    request = _request(timeout=30)
    with broker.sessions() as session:  # warm the per-process job cache, as a worker has
        broker.provider.job(session, request.job)
    counted.recording = True
    lease = broker.acquire(request)
    counted.recording = False
    assert lease.address and not lease.warm
    # admission: the one idempotency read, the cap under its advisory lock, the intent
    assert len(counted.reads_by_request()) == 1
    assert sum("pg_advisory_xact_lock" in s for s in counted.seen) == 1
    # the row is locked once per committed step (creating, ready), never in between
    assert len(counted.row_locks()) == 2
    assert len(counted.seen) <= MAX_STATEMENTS_PER_CREATE, "\n".join(counted.seen)


def test_an_uncapped_cold_acquire_is_one_statement_per_ledger_step(
    broker: Broker, counted: Statements, sessions: Any
) -> None:
    """No live cap or tenant: the intent is also the idempotency read; then creating, the
    API audit row and ready: four statements, the row locked by two of them."""
    with sessions.begin() as session:
        store.ensure_job(session, "one-path", max_live=None)
    request = _request(timeout=30)
    with broker.sessions() as session:
        broker.provider.job(session, request.job)
    counted.recording = True
    lease = broker.acquire(request)
    counted.recording = False
    assert lease.address and not lease.warm
    assert len(counted.seen) == 4, "\n".join(counted.seen)
    assert len(counted.reads_by_request()) == 1
    assert len(counted.row_locks()) == 2
    assert not any("pg_advisory_xact_lock" in s for s in counted.seen)


def test_a_redelivered_acquire_converges_without_a_second_intent(
    broker: Broker, counted: Statements
) -> None:
    request = _request(timeout=30)
    first = broker.acquire(request)
    counted.recording = True
    again = broker.acquire(request)
    counted.recording = False
    assert again.sandbox_id == first.sandbox_id
    assert len(counted.reads_by_request()) == 1
    assert not any(s.startswith("INSERT INTO sandboxes") for s in counted.seen)


def test_a_warm_hand_out_locks_its_row_once(
    broker: Broker, counted: Statements, sessions: Any
) -> None:
    with sessions.begin() as session:
        store.ensure_job(
            session,
            "one-path",
            warm_pools=[{"image": IMAGE, "cpu_m": 200, "memory_b": 128 << 20, "size": 1}],
        )
    intents = broker.pools.upkeep_job("one-path")
    assert intents["refill"] == 1
    with sessions() as session:
        warm_id = session.scalars(
            select(Sandbox.id).where(Sandbox.job == "one-path", Sandbox.pool_key.isnot(None))
        ).one()
    assert broker.refill(warm_id) == "published"
    request = _request(timeout=30)
    key = pool_key(IMAGE, None, None, request.cpu_m, request.memory_b)
    claimed = broker.warm.claim(request.job, key, request.request_id)
    assert claimed is not None and claimed.sandbox_id == warm_id and claimed.warm
    with sessions.begin() as session:  # stop the pool: upkeep after the hand-out refills nothing
        store.ensure_job(session, "one-path", warm_pools=[])
    enqueued_at = request.enqueued_utc
    time.sleep(0.01)
    counted.recording = True
    broker.claimed(warm_id, request.request_id, "trainer", None, enqueued_at)
    counted.recording = False
    assert len(counted.row_locks()) == 1
    with sessions() as session:
        row = session.get(Sandbox, warm_id)
        assert row is not None and row.state == State.READY and row.owner == "trainer"
        assert row.request_id == request.request_id and row.pool_key is None
        assert row.enqueued_at == enqueued_at and (row.acquire_latency_s or 0) > 0


def test_visible_cpus_reach_the_sandbox_commands(broker: Broker) -> None:
    """A request's visible_cpus is delivered: the local sandbox's execd pins itself, so a
    command in it sees that many CPUs (nproc reads the affinity)."""
    from broker.grading.direct import DirectSandbox

    lease = broker.acquire(_request(timeout=30, visible_cpus=1))
    with DirectSandbox(lease.address, lease.token, sandbox_id=lease.sandbox_id) as sb:
        assert sb.exec("nproc").stdout.strip() == "1"
        assert "SANDMAN_EXECD_VISIBLE_CPUS=1" in sb.exec("env").stdout
