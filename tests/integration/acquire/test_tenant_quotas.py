"""Tenant quotas at the one admission step, through REAL Celery workers, Redis, PostgreSQL
and local sandboxes: a refusal is a typed ``QuotaExceeded`` (with ``retry_after_s``)
answered at once with no row and no pod, quotas change at run time and are audited, and
concurrent acquires from several jobs never put a tenant over its live quota.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import func, select

from bench.common import run_threads
from broker.acquire import quotas
from broker.client.sync import SandboxClient
from broker.errors import QuotaExceeded
from broker.ledger import store
from broker.ledger.models import Event, Sandbox
from broker.ledger.states import CAPPED_STATES
from broker.settings import Settings
from tests.support.images import TASK_IMAGE

pytestmark = pytest.mark.integration
SHAPE = {"image": TASK_IMAGE, "cpu": "100m", "memory": "128Mi", "timeout": 60}


@pytest.fixture
def client(stack: Settings) -> Iterator[SandboxClient]:
    c = SandboxClient(stack.redis_url, owner="quota-test")
    yield c
    c.close()


def _tenant(sessions: Any, jobs: int, **limits: int | None) -> tuple[str, list[str]]:
    """A fresh tenant with ``limits`` and ``jobs`` fresh jobs in it."""
    name = f"team-{secrets.token_hex(3)}"
    quotas.create(sessions, name, dict(limits), actor="admin:test")
    names = []
    for i in range(jobs):
        job = f"{name}-j{i}"
        with sessions.begin() as session:
            store.ensure_job(session, job)
        quotas.assign_job(sessions, job, name, actor="admin:test")
        names.append(job)
    return name, names


def _rows(sessions: Any, tenant: str, *, live: bool = False) -> int:
    where = [Sandbox.tenant == tenant]
    if live:
        where.append(Sandbox.state.in_([s.value for s in CAPPED_STATES]))
    with sessions() as session:
        return int(session.scalar(select(func.count()).select_from(Sandbox).where(*where)) or 0)


def test_live_quota_refuses_at_once_without_a_row_and_changes_at_run_time(
    stack: Settings, client: SandboxClient, sessions: Any
) -> None:
    tenant, (a, b) = _tenant(sessions, 2, max_live=2)
    with client.acquire(job=a, **SHAPE), client.acquire(job=b, **SHAPE):
        with pytest.raises(QuotaExceeded) as refused:
            client.open(job=a, **SHAPE)
        exc = refused.value
        assert (exc.tenant, exc.quota) == (tenant, "max_live")
        assert exc.retry_after_s is not None and exc.retry_after_s > 0
        assert _rows(sessions, tenant) == 2  # the refused acquire wrote nothing

        quotas.update(sessions, tenant, {"max_live": 3}, actor="admin:test")
        with client.acquire(job=b, **SHAPE) as third:
            assert third.exec("echo ok").stdout == "ok\n"
    with sessions() as session:
        changes = [
            (e.action, e.actor, e.detail.get("before"), e.detail.get("after"))
            for e in session.scalars(
                select(Event)
                .where(Event.kind == "admin", Event.detail["tenant"].as_string() == tenant)
                .order_by(Event.id)
            )
        ]
    assert changes[0] == (
        "tenant-create",
        "admin:test",
        None,
        {"max_live": 2, "creates_per_minute": None, "snapshot_bytes": None},
    )
    assert [c[0] for c in changes[1:3]] == ["job-tenant", "job-tenant"]
    assert changes[-1] == (
        "tenant-set",
        "admin:test",
        {"max_live": 2, "creates_per_minute": None, "snapshot_bytes": None},
        {"max_live": 3, "creates_per_minute": None, "snapshot_bytes": None},
    )


def test_creates_per_minute_refuses_with_the_wait_until_a_create_leaves_the_minute(
    stack: Settings, client: SandboxClient, sessions: Any
) -> None:
    # A quota of 1: the refusal needs only ONE acquire inside the minute, so a slow,
    # loaded machine cannot let the window slide past the first create.
    tenant, (job,) = _tenant(sessions, 1, creates_per_minute=1)
    with client.acquire(job=job, **SHAPE):
        pass
    with pytest.raises(QuotaExceeded) as refused:
        client.open(job=job, **SHAPE)
    exc = refused.value
    assert (exc.tenant, exc.quota) == (tenant, "creates_per_minute")
    assert exc.retry_after_s is not None and 0 < exc.retry_after_s <= 60
    assert _rows(sessions, tenant) == 1
    quotas.update(sessions, tenant, {"creates_per_minute": None}, actor="admin:test")
    with client.acquire(job=job, **SHAPE):
        assert _rows(sessions, tenant) == 2


def test_concurrent_acquires_of_several_jobs_never_exceed_the_tenant_live_quota(
    stack: Settings, sessions: Any
) -> None:
    cap, attempts = 3, 10
    tenant, jobs = _tenant(sessions, 3, max_live=cap)
    everyone_tried = threading.Barrier(attempts, timeout=180)
    peak: list[int] = []

    def attempt(i: int) -> str:
        c = SandboxClient(stack.redis_url, owner=f"quota-{i}")
        try:
            try:
                sandbox = c.open(job=jobs[i % len(jobs)], **SHAPE)
            except QuotaExceeded:
                everyone_tried.wait()
                return "refused"
            try:
                everyone_tried.wait()  # hold until every acquire has had its answer
                peak.append(_rows(sessions, tenant, live=True))
            finally:
                sandbox.release()
            return "held"
        finally:
            c.close()

    counter = iter(range(attempts))
    lock = threading.Lock()

    def one() -> str:
        with lock:
            i = next(counter)
        return attempt(i)

    outcomes = sorted(run_threads(attempts, 1, one))
    assert outcomes == ["held"] * cap + ["refused"] * (attempts - cap)
    assert peak and max(peak) <= cap
    # and over the whole run, never more than `cap` rows overlapped in the ledger
    with sessions() as session:
        spans = session.execute(
            select(Sandbox.requested_at, Sandbox.deleted_at).where(Sandbox.tenant == tenant)
        ).all()
    assert len(spans) == cap
    moments = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans if end])
    running = 0
    for _, step in moments:
        running += step
        assert running <= cap
