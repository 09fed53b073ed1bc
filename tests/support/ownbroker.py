"""A broker of its own for tests that restart services or kill workers.

Its own embedded PostgreSQL and Redis (free ports, a temporary state dir), so a restart
never disturbs the session's services, and real Celery workers started with the argv of
``sandman up``; each is ours by pid and killed by pid. The backend is the settings':
local by default, Kubernetes for the cluster tests (the workers then reach the pods of
``settings.namespace`` through ``settings.kubeconfig``).
"""

from __future__ import annotations

import contextlib
import secrets
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from bench.common import free_port
from broker.ledger import store
from broker.ledger.db import make_engine, make_session_factory
from broker.ledger.migrate import upgrade
from broker.local.reclaim import kill_all, marked_processes
from broker.local.services import ensure_services, stop_postgres, stop_redis
from broker.local.stack import REPO_ROOT, child_env, worker_argv
from broker.settings import Settings
from tests.support.wait import wait_until

ENV_SETTINGS = ("secret_key", "installation_id", "readiness_budget_s", "namespace", "registries")
SNAPSHOT_STORE_SETTINGS = tuple(
    f"snapshot_{n}" for n in ("store", "s3_endpoint", "s3_region", "s3_access_key", "s3_secret_key")
)


@dataclass
class OwnBroker:
    settings: Settings
    database_url: str
    redis_url: str
    workers: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def env(self) -> dict[str, str]:
        env = child_env(self.settings, self.database_url, self.redis_url)
        for name in ENV_SETTINGS:
            env[f"SANDMAN_{name.upper()}"] = str(getattr(self.settings, name))
        if not self.settings.snapshot_local_copy:  # local restores stream, as on Kubernetes
            env["SANDMAN_SNAPSHOT_LOCAL_COPY"] = "0"
        if self.settings.snapshot_store:  # an S3 snapshot store (tests/support/blobstores.py)
            for name in SNAPSHOT_STORE_SETTINGS:
                env[f"SANDMAN_{name.upper()}"] = str(getattr(self.settings, name))
        return env

    def log(self, name: str) -> Path:
        return self.settings.state_dir / f"{name}.log"

    def start_worker(
        self, name: str, queues: str, threads: int = 8, env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        """A real Celery worker, ready; ``env`` adds variables (an armed failpoint...)."""
        with self.log(name).open("ab") as log:
            proc = subprocess.Popen(
                worker_argv(name, queues, threads),
                env={**self.env(), **(env or {})},
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=REPO_ROOT,
            )
        self.workers[name] = proc

        def ready() -> bool:
            if proc.poll() is not None:
                pytest.fail(f"{name} exited:\n{self.log(name).read_text()[-3000:]}")
            return " ready." in self.log(name).read_text(errors="replace")

        wait_until(ready, timeout=120, interval=0.2, what=f"worker {name} ready")
        return proc

    def job(self, name: str, **config: object) -> str:
        engine = make_engine(self.database_url, pool_size=1, max_overflow=0)
        try:
            with make_session_factory(engine).begin() as session:
                store.ensure_job(session, name, **config)
        finally:
            engine.dispose()
        return name

    def stop(self) -> None:
        for proc in self.workers.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.workers.values():
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        # Every local sandbox of this state dir, found by the kernel's process list: also
        # those of a worker that died before it could record them.
        kill_all(marked_processes(self.settings.state_dir))
        stop_redis(self.settings)
        stop_postgres(self.settings)


def own_settings(state_dir: Path, **overrides: Any) -> Settings:
    """Settings of a broker of its own in ``state_dir``: free ports, a fresh identity."""
    base: dict[str, Any] = {
        "state_dir": state_dir,
        "embedded_pg_port": free_port(),
        "embedded_redis_port": free_port(),
        "secret_key": secrets.token_hex(16),
        "installation_id": f"t-{secrets.token_hex(3)}",
        "readiness_budget_s": 20.0,
    }
    return Settings(**{**base, **overrides})


@contextlib.contextmanager
def running_broker(settings: Settings) -> Iterator[OwnBroker]:
    """Its services up and migrated; everything it started stopped afterwards."""
    urls = ensure_services(settings)
    upgrade(urls.database_url)
    broker = OwnBroker(settings, urls.database_url, urls.redis_url)
    try:
        yield broker
    finally:
        broker.stop()


@pytest.fixture
def own_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OwnBroker]:
    """A local-backend broker of its own, for one test."""
    with running_broker(own_settings(tmp_path_factory.mktemp("own-broker"))) as broker:
        yield broker
