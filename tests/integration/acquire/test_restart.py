"""Broker restarts and crashed trainers on the local backend (real PostgreSQL, Redis,
bubblewrap and execd): pods are found again from another process, and the GC reclaims
what a trainer stopped heartbeating for. Also: a redelivered acquire is the same sandbox.
"""

from __future__ import annotations

import datetime as dt
import secrets
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis

from broker.acquire.service import Broker
from broker.backends.local import LocalBackend, _proc_start
from broker.ledger import store
from broker.ledger.models import Sandbox, utcnow
from broker.ledger.states import State
from broker.ownership.gc import run_gc
from broker.settings import Settings
from broker.wire.request import AcquireRequest
from tests.support.images import TASK_IMAGE

pytestmark = pytest.mark.integration


def _settings(database_url: str, redis_url: str, state: Path, key: str) -> Settings:
    return Settings(
        state_dir=state,
        database_url=database_url,
        redis_url=redis_url.rsplit("/", 1)[0] + "/14",
        secret_key=key,
        installation_id="t-restart",
    )


def _broker(settings: Settings, sessions: Any) -> Broker:
    client = redis.Redis.from_url(settings.redis_url)
    return Broker(settings, sessions, LocalBackend(settings), client, enqueue=lambda *a: None)


def _request(job: str) -> AcquireRequest:
    return AcquireRequest.parse(
        {
            "request_id": f"r-{uuid.uuid4().hex}",
            "job": job,
            "image": TASK_IMAGE,
            "cpu_m": 200,
            "memory_b": 128 << 20,
            "enqueued_at": time.time(),
            "deadline": time.time() + 30,
        }
    )


def test_redelivered_acquire_and_gc_after_restart(
    database_url: str, redis_url: str, sessions: Any, tmp_path: Path
) -> None:
    settings = _settings(database_url, redis_url, tmp_path / "state", secrets.token_hex(16))
    with sessions.begin() as session:
        store.ensure_job(session, "restart", lease_s=60.0)
    first = _broker(settings, sessions)
    request = _request("restart")
    lease = first.acquire(request)
    again = first.acquire(request)  # the same message delivered twice (acks_late)
    assert again.sandbox_id == lease.sandbox_id and again.token == lease.token
    meta = LocalBackend(settings)._load(lease.pod_name)
    assert meta is not None
    pids = [int(meta["pid"]), int(meta["child_pid"])]

    # The worker "restarts": a new process-level broker and backend, same state dir.
    second = _broker(settings, sessions)
    assert [
        p.name for p in second.provider.backend.list_installation(settings.namespace, "t-restart")
    ] == [lease.pod_name]
    # The trainer crashed: no heartbeat, its lease runs out.
    with sessions.begin() as session:
        row = session.get(Sandbox, lease.sandbox_id)
        assert row is not None
        row.lease_expires_at = utcnow() - dt.timedelta(seconds=1)
    report = run_gc(second.provider)
    assert not report.errors, report
    with sessions() as session:
        row = session.get(Sandbox, lease.sandbox_id)
        assert row is not None and row.state == State.DELETED
    time.sleep(0.2)
    assert all(_proc_start(p) is None for p in pids)
    assert second.provider.backend.list_all_labelled(settings.namespace) == []
