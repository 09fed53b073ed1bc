"""Run the whole system on one machine: services, migrations, workers, beat, web UI.

Workers and beat are separate ``celery`` processes (``broker`` never imports ``workers``)
started as children with the service URLs in their environment; Ctrl-C or SIGTERM stops
them all. A small JSON file records the running stack so ``sandman demo`` can reuse a
stack someone already started instead of starting a second one. Logs go to
``state_dir/logs``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from broker.errors import ServiceUnavailable
from broker.ledger.migrate import upgrade
from broker.local.private import PRIVATE_UMASK, private_dir
from broker.local.services import ensure_services
from broker.names import Queue
from broker.settings import Settings

REPO_ROOT = Path(__file__).resolve().parents[2]

# (name, queues, threads): acquires block on the pacer and on readiness, so they get a
# large thread pool of their own; releases, hand-outs and pool upkeep never wait behind them.
WORKERS = (("acquire", Queue.ACQUIRE.value, 48), ("control", f"{Queue.RELEASE},{Queue.POOL}", 16))


def child_env(settings: Settings, database_url: str, redis_url: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        SANDMAN_DATABASE_URL=database_url,
        SANDMAN_REDIS_URL=redis_url,
        SANDMAN_STATE_DIR=str(settings.state_dir),
        SANDMAN_BACKEND=settings.backend,
        SANDMAN_KUBECONFIG=settings.kubeconfig,
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH", "")])),
    )
    return env


def celery_argv(command: str, *args: str, loglevel: str = "INFO") -> list[str]:
    """``celery -A workers.app COMMAND ARGS --loglevel L`` under this interpreter: the one
    spelling of a Celery child, so workers and beat start the same app the same way."""
    return [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "workers.app",
        command,
        *args,
        "--loglevel",
        loglevel,
    ]


def worker_argv(name: str, queues: str, threads: int, loglevel: str = "INFO") -> list[str]:
    return celery_argv(
        "worker",
        *("-Q", queues, "-P", "threads", "-c", str(threads), "-n", f"{name}-{os.getpid()}@%h"),
        *("--without-gossip", "--without-mingle"),
        loglevel=loglevel,
    )


def beat_argv(schedule: Path, loglevel: str = "INFO") -> list[str]:
    return celery_argv("beat", "-s", str(schedule), loglevel=loglevel)


@dataclass
class Stack:
    """Children of this process; ``stop()`` ends exactly these, by pid."""

    settings: Settings
    database_url: str = ""
    redis_url: str = ""
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def logs(self) -> Path:
        return Path(self.settings.state_dir) / "logs"

    @property
    def marker(self) -> Path:
        return Path(self.settings.state_dir) / "run" / "stack.json"

    def start(self, *, web: bool = True, echo: bool = True) -> None:
        urls = ensure_services(self.settings)
        self.database_url, self.redis_url = urls.database_url, urls.redis_url
        upgrade(self.database_url)
        private_dir(self.logs)
        env = child_env(self.settings, self.database_url, self.redis_url)
        for name, queues, threads in WORKERS:
            self._spawn(f"worker-{name}", worker_argv(name, queues, threads), env)
        schedule = Path(self.settings.state_dir) / "run" / "celerybeat-schedule"
        schedule.parent.mkdir(parents=True, exist_ok=True)
        self._spawn("beat", beat_argv(schedule), env)
        if web and (REPO_ROOT / "web" / "wsgi.py").exists():
            bind = f"{self.settings.web_host}:{self.settings.web_port}"
            self._spawn(
                "web",
                [
                    sys.executable,
                    "-m",
                    "gunicorn",
                    "-b",
                    bind,
                    "-w",
                    "2",
                    "--threads",
                    "4",
                    "--limit-request-line",
                    "8190",
                    "web.wsgi:app",
                ],
                env,
            )
        elif web and echo:
            print("web UI: web/wsgi.py not present yet, skipping")
        self.wait_ready()
        self.marker.write_text(
            json.dumps({"pid": os.getpid(), "children": {k: p.pid for k, p in self.procs.items()}})
        )

    def _spawn(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        path = self.logs / f"{name}.log"
        log = os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab")
        path.chmod(0o600)  # a log an older version left 0644
        # Children write meta files, schedules and logs into the state dir: private from birth.
        self.procs[name] = subprocess.Popen(
            argv,
            env=env,
            stdout=log,
            stderr=log,
            stdin=subprocess.DEVNULL,
            cwd=REPO_ROOT,
            umask=PRIVATE_UMASK,
        )
        log.close()

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Workers are ready when their log says so (Celery prints 'ready.')."""
        deadline = time.monotonic() + timeout
        pending = {n for n in self.procs if n.startswith("worker-")}
        while pending:
            for name in list(pending):
                proc = self.procs[name]
                text = (self.logs / f"{name}.log").read_text(errors="replace")
                if proc.poll() is not None:
                    raise ServiceUnavailable(f"{name} exited ({proc.returncode}):\n{text[-2000:]}")
                if " ready." in text[-20000:]:
                    pending.discard(name)
            if time.monotonic() > deadline:
                raise ServiceUnavailable(f"workers not ready after {timeout}s: {sorted(pending)}")
            time.sleep(0.2)

    def alive(self) -> bool:
        return bool(self.procs) and all(p.poll() is None for p in self.procs.values())

    def stop(self, timeout: float = 20.0) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        self.procs.clear()
        with contextlib.suppress(OSError):
            data = json.loads(self.marker.read_text())
            if data.get("pid") == os.getpid():
                self.marker.unlink()


def running_stack(settings: Settings) -> bool:
    """True when another ``sandman up`` is serving this state dir (its pid is alive)."""
    marker = Path(settings.state_dir) / "run" / "stack.json"
    try:
        data = json.loads(marker.read_text())
        pids = [int(data["pid"]), *map(int, data["children"].values())]
    except (OSError, ValueError, KeyError):
        return False
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
    return True
