"""Fixtures shared by the integration feature folders.

``stack`` is the whole broker path with REAL Celery workers (a subprocess, not eager
mode), real Redis, real PostgreSQL and local bubblewrap sandboxes running the real
execd. Module-scoped: each test module gets its own workers and Redis database.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from broker.local.reclaim import kill_all, marked_processes
from broker.local.stack import worker_argv
from broker.names import Queue
from broker.settings import Settings
from tests.support.images import ensure_local_images

REPO = Path(__file__).resolve().parents[2]
ALL_QUEUES = f"{Queue.ACQUIRE},{Queue.RELEASE},{Queue.POOL}"  # one worker serves them all


@contextlib.contextmanager
def flushed_db(redis_url: str, db: int) -> Iterator[str]:
    """The URL of Redis database ``db``, empty before and after the caller's use."""
    url = redis_url.rsplit("/", 1)[0] + f"/{db}"
    client = redis.Redis.from_url(url)
    client.flushdb()
    try:
        yield url
    finally:
        client.flushdb()
        client.close()


@pytest.fixture(scope="session", autouse=True)
def local_images() -> None:
    """The project's task images in the local store (the local backend runs nothing else);
    builds them with deploy/images/build.sh on a machine that never did."""
    ensure_local_images(Settings.from_env().cache_dir)


@pytest.fixture(scope="module")
def stack(
    database_url: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Settings]:
    with broker_stack(database_url, redis_url, tmp_path_factory) as settings:
        yield settings


@contextlib.contextmanager
def broker_stack(
    database_url: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory, **extra: str
) -> Iterator[Settings]:
    """Settings and a real worker serving every queue; ``extra`` settings (by field name)
    reach both the returned settings and the worker's environment."""
    url = redis_url.rsplit("/", 1)[0] + "/11"
    redis.Redis.from_url(url).flushdb()
    state = tmp_path_factory.mktemp("broker-state")
    settings = Settings(
        state_dir=state,
        database_url=database_url,
        redis_url=url,
        secret_key=secrets.token_hex(16),
        installation_id=f"t-{secrets.token_hex(3)}",
        create_rate=100.0,
        create_burst=100,
        gc_interval_s=3600.0,
        **extra,  # type: ignore[arg-type]
    )
    env = dict(os.environ)
    env.update(
        {
            f"SANDMAN_{k.upper()}": str(getattr(settings, k))
            for k in (
                "state_dir",
                "database_url",
                "redis_url",
                "secret_key",
                "installation_id",
                "create_rate",
                "create_burst",
                "gc_interval_s",
                *extra,
            )
        }
    )
    env["PYTHONPATH"] = str(REPO)
    log_path = state / "worker.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            worker_argv(f"test-{secrets.token_hex(3)}", ALL_QUEUES, 24),
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
        )
    deadline = time.monotonic() + 60
    while " ready." not in log_path.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail("celery worker did not start:\n" + log_path.read_text()[-3000:])
        time.sleep(0.1)
    try:
        yield settings
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        kill_all(marked_processes(state))  # nothing should be left; whatever is, dies here
