"""One system campaign's processes: embedded services, workers, beat and trainers, by pid.

Split from bench/harness/syscampaign.py (the faults and invariants) so that each reads on
its own: this module only starts, restarts and stops what a campaign owns, on free ports
in the campaign's state dir, and never touches a process it did not start.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import REPO, free_port
from bench.kwok import KWOK_IMAGE
from broker.local.demo import DEMO_IMAGE

JOB = "syscampaign"
LOCAL_IMAGE = DEMO_IMAGE  # in the local store (make local-images)
FAULT_KINDS = (
    "kill_worker",
    "kill_beat",
    "restart_redis",
    "restart_pg",
    "api_blackout",
    "api_delay",
    "api_reset",
    "kill_trainer",
    "crash_at_failpoint",
    "flood_execd",
)
# The local backend has no API server in between: no proxy faults there.
LOCAL_FAULT_KINDS = tuple(k for k in FAULT_KINDS if not k.startswith("api_"))
# kwok pods run no execd: nothing to flood there.
KUBE_FAULT_KINDS = tuple(k for k in FAULT_KINDS if k != "flood_execd")


def port_open(port: int) -> bool:
    """Something listens on this loopback port (a service is up, or not yet down)."""
    with socket.socket() as s:
        s.settimeout(0.3)
        return s.connect_ex(("127.0.0.1", port)) == 0


@dataclass
class Config:
    """One campaign: where, how long, how many trainers, which faults, which budgets."""

    kubeconfig: str  # empty on the local backend
    state_dir: Path
    backend: str = "kubernetes"  # or "local": bubblewrap sandboxes with a real execd
    duration_s: float = 60.0
    trainers: int = 4
    seed: int = 1
    fault_gap_s: tuple[float, float] = (2.0, 5.0)
    kinds: tuple[str, ...] = FAULT_KINDS
    acquire_timeout_s: float = 20.0
    hang_grace_s: float = 25.0
    lease_s: float = 10.0
    readiness_budget_s: float = 15.0
    create_lease_margin_s: float = 3.0
    gc_interval_s: float = 5.0
    sentinels: int = 4
    # Failpoints the crash_at_failpoint fault cycles through; empty: every point the
    # backend has (bench/harness/sysworld.py).
    failpoints: tuple[str, ...] = ()


class Stack:
    """Services, workers, beat and trainers of one campaign; every process is ours by pid."""

    def __init__(self, cfg: Config) -> None:
        from broker.settings import Settings

        self.cfg = cfg
        self.tag = f"sys{os.getpid()}-{cfg.seed}"
        self.namespace = f"sandman-{self.tag}"
        self.installation = f"sandman-{self.tag}"
        self.settings = Settings(
            state_dir=cfg.state_dir,
            embedded_pg_port=free_port(),
            embedded_redis_port=free_port(),
            backend="local" if cfg.backend == "local" else "kubernetes",
            namespace=self.namespace,
            installation_id=self.installation,
            secret_key=os.urandom(16).hex(),
            readiness_budget_s=cfg.readiness_budget_s,
            create_lease_margin_s=cfg.create_lease_margin_s,
            gc_interval_s=cfg.gc_interval_s,
            create_rate=50.0,
            create_burst=50,
            log_level="INFO",
        )
        self.logs = cfg.state_dir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.log_offset: dict[str, int] = {}
        self.trainers: dict[int, subprocess.Popen[bytes]] = {}
        self.killed_trainers: set[int] = set()
        self.next_trainer = 0
        self.stop_file = cfg.state_dir / "trainers.stop"
        self.image = LOCAL_IMAGE if cfg.backend == "local" else KWOK_IMAGE
        self.database_url = self.redis_url = ""
        self.proxy_kubeconfig = ""

    # services
    def start_services(self) -> None:
        from broker.ledger.migrate import upgrade
        from broker.local.services import ensure_services

        urls = ensure_services(self.settings)
        self.database_url, self.redis_url = urls.database_url, urls.redis_url
        upgrade(self.database_url)

    def restart_redis(self) -> None:
        from broker.local.services import ensure_redis, stop_redis

        stop_redis(self.settings)
        wait_for(lambda: not port_open(self.settings.embedded_redis_port), 20, "redis down")
        time.sleep(random.uniform(0.5, 2.0))
        ensure_redis(self.settings)

    def restart_pg(self) -> None:
        from broker.local.services import ensure_postgres, stop_postgres

        stop_postgres(self.settings)
        time.sleep(random.uniform(0.5, 2.0))
        ensure_postgres(self.settings)

    def stop_services(self) -> None:
        from broker.local.services import stop_postgres, stop_redis

        stop_redis(self.settings)
        stop_postgres(self.settings)

    # processes
    def env(self) -> dict[str, str]:
        from broker.local.stack import child_env

        env = child_env(self.settings, self.database_url, self.redis_url)
        for name in (
            "namespace",
            "installation_id",
            "secret_key",
            "readiness_budget_s",
            "create_lease_margin_s",
            "gc_interval_s",
            "create_rate",
            "create_burst",
            "embedded_pg_port",
            "embedded_redis_port",
        ):
            env[f"SANDMAN_{name.upper()}"] = str(getattr(self.settings, name))
        env["SANDMAN_KUBECONFIG"] = self.proxy_kubeconfig
        return env

    def spawn(self, name: str, extra_env: dict[str, str] | None = None) -> None:
        """Start ``name``; ``extra_env`` adds variables (an armed failpoint)."""
        from broker.local.stack import beat_argv, worker_argv

        if name == "beat":
            argv = beat_argv(self.cfg.state_dir / "celerybeat-schedule")
        elif name == "worker-acquire":
            argv = worker_argv("acquire", "acquire", 16)
        else:
            argv = worker_argv("control", "release,pool", 8)
        path = self.logs / f"{name}.log"
        self.log_offset[name] = path.stat().st_size if path.exists() else 0
        with path.open("ab") as log:
            self.procs[name] = subprocess.Popen(
                argv,
                env={**self.env(), **(extra_env or {})},
                stdout=log,
                stderr=log,
                stdin=subprocess.DEVNULL,
                cwd=REPO,
            )

    def ready(self, name: str) -> bool:
        """Celery printed 'ready.' since the last spawn of ``name``."""
        with (self.logs / f"{name}.log").open("rb") as f:
            f.seek(self.log_offset.get(name, 0))
            return b" ready." in f.read()

    def wait_ready(self, name: str, timeout: float = 300.0) -> None:
        # A loaded 2-core machine can take minutes to import Celery.
        wait_for(lambda: self.ready(name), timeout, f"{name} ready")

    def spawn_trainer(self) -> int:
        i = self.next_trainer
        self.next_trainer += 1
        argv = [
            sys.executable,
            "-m",
            "bench.harness.syscampaign",
            "trainer",
            str(self.cfg.state_dir / f"trainer-{i}.jsonl"),
            self.redis_url,
            str(self.cfg.acquire_timeout_s),
            str(self.cfg.seed * 1000 + i),
            str(self.stop_file),
            self.image,
        ]
        with (self.logs / f"trainer-{i}.log").open("ab") as log:
            self.trainers[i] = subprocess.Popen(
                argv, env=self.env(), stdout=log, stderr=log, stdin=subprocess.DEVNULL, cwd=REPO
            )
        return i

    def kill(self, name: str) -> None:
        proc = self.procs.get(name)
        if proc and proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()

    def stop_all(self) -> None:
        for proc in [*self.procs.values(), *self.trainers.values()]:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in [*self.procs.values(), *self.trainers.values()]:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def wait_for(pred: Callable[[], Any], timeout: float, what: str) -> None:
    """Poll ``pred`` every 0.1 s; ``TimeoutError`` naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.1)
