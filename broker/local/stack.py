"""Run the whole system on one machine: services, migrations, workers, beat, web UI.

Workers and beat are separate ``celery`` processes (``broker`` never imports ``workers``)
started as children with the service URLs in their environment. The stack supervises
them: a child that exits (a crash, a kill) is restarted after an exponential backoff and
the reason (exit code or signal) is logged; the stack itself stops only on Ctrl-C or
SIGTERM, or when one child crash-loops (``CrashLoop``: too many restarts in a window),
and it says which. A stop drains this installation's local sandboxes
(``broker.local.reclaim``), and a start reclaims what a stack that could not stop left.
Children get PR_SET_PDEATHSIG, so a SIGKILLed stack leaves no worker serving behind it.
A small JSON file records the running stack so ``sandman demo`` can reuse a stack someone
already started instead of starting a second one. Logs go to ``state_dir/logs``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from broker.errors import ServiceUnavailable
from broker.ledger.migrate import upgrade
from broker.local import reclaim
from broker.local.private import PRIVATE_UMASK, private_dir
from broker.local.procs import pid_alive
from broker.local.services import ensure_services
from broker.names import Queue
from broker.settings import Settings

REPO_ROOT = Path(__file__).resolve().parents[2]

# (name, queues, threads): acquires block on the pacer and on readiness, so they get a
# large thread pool of their own; releases, hand-outs and pool upkeep never wait behind them.
WORKERS = (("acquire", Queue.ACQUIRE.value, 48), ("control", f"{Queue.RELEASE},{Queue.POOL}", 16))


# Sets PR_SET_PDEATHSIG (SIGKILL) and execs the real argv: the signal survives exec, so a
# child dies with the stack even when the stack is SIGKILLed and cannot stop it. The
# parent check closes the race of a stack that died before the prctl ran.
_PDEATHSIG_SHIM = (
    "import ctypes,os,sys;ctypes.CDLL(None).prctl(1,9,0,0,0);"
    "os.getppid()==int(sys.argv[1]) or os._exit(1);"
    "os.execv(sys.argv[2],sys.argv[2:])"
)


def with_parent_death(argv: list[str]) -> list[str]:
    """``argv`` run so that it is SIGKILLed when this process dies. The kernel ties the
    signal to the forking THREAD, so only a child forked by the main thread (which lives
    as long as the process) gets it."""
    if threading.current_thread() is not threading.main_thread():
        return argv
    return [sys.executable, "-S", "-c", _PDEATHSIG_SHIM, str(os.getpid()), *argv]


def describe_exit(returncode: int) -> str:
    """'exit code 3' or 'killed by SIGKILL': what an operator reads in the log."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


@dataclass
class RestartPolicy:
    """Exponential backoff per child, and the crash loop that ends supervision.

    ``limit`` restarts of one child within ``window_s`` seconds is a crash loop: restarting
    again would only hide a broken configuration. The backoff doubles with each restart
    still inside the window, from ``base_s`` up to ``cap_s``, so a child that crashed once
    an hour ago comes back at once and one that keeps crashing does not spin."""

    limit: int = 5
    window_s: float = 60.0
    base_s: float = 0.5
    cap_s: float = 30.0
    history: dict[str, list[float]] = field(default_factory=dict)

    def record(self, name: str, now: float) -> float | None:
        """Note an exit of ``name`` at ``now``; the delay before its restart, or None when
        this exit makes a crash loop."""
        recent = [t for t in self.history.get(name, []) if now - t < self.window_s]
        recent.append(now)
        self.history[name] = recent
        if len(recent) > self.limit:
            return None
        return float(min(self.cap_s, self.base_s * 2 ** (len(recent) - 1)))


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
    argv: dict[str, list[str]] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    policy: RestartPolicy = field(default_factory=RestartPolicy)
    drain_grace_s: float = 30.0

    @property
    def logs(self) -> Path:
        return Path(self.settings.state_dir) / "logs"

    @property
    def marker(self) -> Path:
        return Path(self.settings.state_dir) / "run" / "stack.json"

    def start(self, *, web: bool = True, echo: bool = True) -> None:
        if running_stack(self.settings):
            raise ServiceUnavailable(
                f"another `sandman up` serves {self.settings.state_dir} (see {self.marker})"
            )
        # A marker left by a stack that was SIGKILLed names dead children: gone before
        # anything starts, so that a marker on disk always means "this stack is ready".
        self.marker.unlink(missing_ok=True)
        urls = ensure_services(self.settings)
        self.database_url, self.redis_url = urls.database_url, urls.redis_url
        upgrade(self.database_url)
        private_dir(self.logs)
        if self.settings.backend == "local":  # what a stack that could not stop left behind
            left = reclaim.drain(self.settings, self.database_url, self.redis_url, below_us=False)
            if echo and (left.released or left.killed or left.failed):
                # Flushed now: an operator (or a test) that sees the stack ready must
                # already see what its start reclaimed.
                print(f"reclaimed from an earlier run: {left.summary()}", flush=True)
        # After the services (they daemonize and must not become our children), before
        # the workers: a killed worker's sandboxes are then reparented to us, not to init.
        reclaim.become_subreaper()
        self.env = child_env(self.settings, self.database_url, self.redis_url)
        for name, queues, threads in WORKERS:
            self._spawn(f"worker-{name}", worker_argv(name, queues, threads))
        schedule = Path(self.settings.state_dir) / "run" / "celerybeat-schedule"
        schedule.parent.mkdir(parents=True, exist_ok=True)
        self._spawn("beat", beat_argv(schedule))
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
            )
        elif web and echo:
            print("web UI: web/wsgi.py not present yet, skipping")
        self.wait_ready()
        self._write_marker()

    def _write_marker(self) -> None:
        self.marker.write_text(
            json.dumps({"pid": os.getpid(), "children": {k: p.pid for k, p in self.procs.items()}})
        )

    def _spawn(self, name: str, argv: list[str]) -> None:
        self.argv[name] = argv
        path = self.logs / f"{name}.log"
        log = os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab")
        path.chmod(0o600)  # a log an older version left 0644
        # Children write meta files, schedules and logs into the state dir: private from birth.
        self.procs[name] = subprocess.Popen(
            with_parent_death(argv),
            env=self.env,
            stdout=log,
            stderr=log,
            stdin=subprocess.DEVNULL,
            cwd=REPO_ROOT,
            umask=PRIVATE_UMASK,
        )
        log.close()

    def supervise(self, stop: threading.Event, echo: Callable[[str], None] = print) -> str:
        """Keep the children running until ``stop`` is set or one crash-loops; the reason.

        A child that exits is logged with its exit code or signal and restarted after the
        policy's backoff. Exited sandboxes reparented to us (a dead worker's, deleted
        later) are reaped here, so none stays a zombie of the stack."""
        due: dict[str, float] = {}
        reaped_at = 0.0
        while not stop.wait(0.2):
            now = time.monotonic()
            for name, proc in list(self.procs.items()):
                if name in due or proc.poll() is None:
                    continue
                delay = self.policy.record(name, now)
                why = describe_exit(proc.returncode)
                if delay is None:
                    return (
                        f"{name} {why}: {self.policy.limit + 1} exits within "
                        f"{self.policy.window_s:.0f}s, a crash loop; stopping"
                    )
                echo(f"{name} (pid {proc.pid}) {why}; restarting in {delay:.1f}s")
                due[name] = now + delay
            for name, at in list(due.items()):
                if now >= at:
                    del due[name]
                    self._spawn(name, self.argv[name])
                    echo(f"{name} restarted: pid {self.procs[name].pid}")
                    self._write_marker()
            if now - reaped_at >= 2.0:  # one /proc scan: not at every tick on a busy laptop
                reaped_at = now
                reclaim.reap_orphans(p.pid for p in self.procs.values())
        return "stop requested"

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

    def stop(self, timeout: float = 20.0, echo: Callable[[str], None] = print) -> None:
        """Workers and beat first (no create or refill may start behind the drain), then
        the drain of this installation's local sandboxes (``broker.local.reclaim``)."""
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
        started = bool(self.procs)
        self.procs.clear()
        if started and self.settings.backend == "local":
            report = reclaim.drain(
                self.settings, self.database_url, self.redis_url, grace_s=self.drain_grace_s
            )
            echo(f"drained: {report.summary()}")
        with contextlib.suppress(OSError):
            data = json.loads(self.marker.read_text())
            if data.get("pid") == os.getpid():
                self.marker.unlink()


def running_stack(settings: Settings) -> bool:
    """True when another ``sandman up`` is serving this state dir (its pid is alive; its
    children may be between a crash and their restart, which the stack supervises)."""
    marker = Path(settings.state_dir) / "run" / "stack.json"
    try:
        pid = int(json.loads(marker.read_text())["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return pid != os.getpid() and pid_alive(pid)
