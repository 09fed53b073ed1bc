"""``sandman up`` as a supervisor: a killed child comes back, a stop leaves nothing running.

Each test runs the real command (``sandman up --no-web``) in a subprocess it owns, on this
session's PostgreSQL and Redis, with local bubblewrap sandboxes under a private state dir,
and judges the outcome by the processes the kernel shows and the rows the ledger holds.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from sqlalchemy import create_engine, select
from sqlalchemy.orm import sessionmaker

from broker.backends.local import _proc_start
from broker.cli.run import parse_warm
from broker.client.sync import SandboxClient
from broker.ledger import store
from broker.ledger.models import Sandbox
from broker.ledger.states import LIVE_STATES
from broker.local.reclaim import descendants, marked_processes
from tests.support.images import SWE_IMAGE, TASK_IMAGE
from tests.support.wait import wait_until

pytestmark = pytest.mark.integration
IMAGE = TASK_IMAGE
REPO = Path(__file__).resolve().parents[3]
SANDMAN = str(Path(sys.executable).parent / "sandman")


@dataclass
class Up:
    """One ``sandman up`` subprocess and what it serves."""

    state: Path
    env: dict[str, str]
    installation: str
    redis_url: str
    proc: subprocess.Popen[bytes] | None = None

    @property
    def log(self) -> Path:
        return self.state / "up.log"

    def start(self) -> None:
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                [SANDMAN, "up", "--no-web"], env=self.env, stdout=log, stderr=log, cwd=REPO
            )
        wait_until(self.children, timeout=120, what=f"stack ready:\n{self.tail()}")

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""

    def children(self) -> dict[str, int]:
        """The children the running stack recorded (empty until it is ready).

        Only a marker written by THIS stack counts: a SIGKILLed stack's marker stays on
        disk, and reading it as "ready" let the test run ahead of the new stack's drain."""
        assert self.proc is not None
        if self.proc.poll() is not None:
            pytest.fail(f"stack exited ({self.proc.returncode}):\n{self.tail()}")
        try:
            data = json.loads((self.state / "run" / "stack.json").read_text())
        except (OSError, ValueError):
            return {}
        if data.get("pid") != self.proc.pid:
            return {}
        return {k: int(v) for k, v in data["children"].items()}

    def kill_everything(self) -> None:
        """Teardown: whatever a failed test left (stack, workers, sandboxes), including
        workers orphaned to init, found by the state dir in their environment."""
        pids = marked_processes(self.state) + _with_state_env(self.state)
        if self.proc is not None:
            pids += [self.proc.pid, *descendants(self.proc.pid)]
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait()


def _with_state_env(state: Path) -> list[int]:
    mark = b"SANDMAN_STATE_DIR=" + os.fsencode(str(state)) + b"\0"
    out = []
    for entry in os.listdir("/proc"):
        with contextlib.suppress(OSError):
            if entry.isdigit() and mark in Path(f"/proc/{entry}/environ").read_bytes():
                out.append(int(entry))
    return [pid for pid in out if pid != os.getpid()]


@pytest.fixture
def up(database_url: str, redis_url: str, tmp_path: Path) -> Iterator[Up]:
    url = redis_url.rsplit("/", 1)[0] + "/12"
    redis.Redis.from_url(url).flushdb()
    installation = f"t-{secrets.token_hex(3)}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SANDMAN_")}
    env.update(
        SANDMAN_STATE_DIR=str(tmp_path / "state"),
        SANDMAN_DATABASE_URL=database_url,
        SANDMAN_REDIS_URL=url,
        SANDMAN_SECRET_KEY=secrets.token_hex(16),
        SANDMAN_INSTALLATION_ID=installation,
        SANDMAN_CREATE_RATE="100",
        SANDMAN_CREATE_BURST="100",
        SANDMAN_BACKEND="local",
        PYTHONPATH=str(REPO),
    )
    (tmp_path / "state").mkdir()
    stack = Up(tmp_path / "state", env, installation, url)
    yield stack
    stack.kill_everything()


@pytest.fixture
def sessions(database_url: str) -> Iterator[Any]:
    engine = create_engine(database_url)
    yield sessionmaker(engine)
    engine.dispose()


def _live_rows(sessions: Any, installation: str) -> list[str]:
    with sessions() as session:
        return list(
            session.scalars(
                select(Sandbox.id).where(
                    Sandbox.installation == installation,
                    Sandbox.state.in_([str(s) for s in LIVE_STATES]),
                )
            )
        )


def _running(pids: dict[int, str | None]) -> list[int]:
    """Which of these (pid -> kernel start time) still run as the same process."""
    return [pid for pid, start in pids.items() if start and _proc_start(pid) == start]


def _snapshot(state: Path) -> dict[int, str | None]:
    return {pid: _proc_start(pid) for pid in marked_processes(state)}


def _job(sessions: Any, name: str, **config: Any) -> str:
    with sessions.begin() as session:
        store.ensure_job(session, name, **config)
    return name


def _acquire_exec_release(up: Up, sessions: Any, job: str) -> str:
    client = SandboxClient(up.redis_url, owner="pytest")
    try:
        sandbox = client.open(image=IMAGE, job=job, timeout=120)
        assert sandbox.exec("echo alive").stdout.strip() == "alive"
        sandbox.release()
    finally:
        client.close()

    def closed() -> bool:
        with sessions() as session:
            row = session.get(Sandbox, sandbox.id)
            return row is not None and row.state == "deleted"

    wait_until(closed, timeout=60, what=f"release of {sandbox.id}")
    return sandbox.id


def test_a_killed_worker_is_restarted_and_the_stack_keeps_serving(up: Up, sessions: Any) -> None:
    """Before: the stack noticed the exit and stopped everything ("a child process exited;
    stopping"), so the acquire after the kill had no worker and the stack was gone."""
    up.start()
    job = _job(sessions, "supervised")
    old = up.children()["worker-acquire"]
    os.kill(old, signal.SIGKILL)

    def replaced() -> int:
        pid = up.children().get("worker-acquire", old)
        return pid if pid != old else 0

    new = wait_until(replaced, timeout=60, what=f"a new acquire worker:\n{up.tail()}")
    assert new != old
    wait_until(
        lambda: (up.state / "logs" / "worker-acquire.log").read_text().count(" ready.") >= 2,
        timeout=120,
        what="the new worker ready",
    )
    _acquire_exec_release(up, sessions, job)
    assert up.proc is not None and up.proc.poll() is None
    assert "killed by SIGKILL" in up.tail()


def test_ctrl_c_drains_every_sandbox_and_closes_every_row(up: Up, sessions: Any) -> None:
    """Before: Ctrl-C stopped the workers only; the warm pool's and the leased sandboxes'
    bubblewrap trees stayed alive under init and their rows stayed ready."""
    job = _job(
        sessions,
        "drained",
        warm_pools=[parse_warm(f"{IMAGE}=3,cpu=100m,memory=64Mi,idle=600", 600.0)],
    )
    up.start()
    client = SandboxClient(up.redis_url, owner="pytest")
    try:
        leased = client.open(image=SWE_IMAGE, job=job, timeout=120)  # a cold create
        assert leased.exec("echo held").stdout.strip() == "held"
    finally:
        client.close()

    def pool_and_lease() -> bool:
        with sessions() as session:
            ready = session.scalars(
                select(Sandbox).where(
                    Sandbox.installation == up.installation, Sandbox.state == "ready"
                )
            ).all()
        return len(ready) >= 4

    wait_until(pool_and_lease, timeout=120, what="3 warm + 1 leased sandboxes ready")
    # A worker killed first: its sandboxes now belong to no process of the stack's tree
    # but the stack itself (reparented), which a stop must still find.
    os.kill(up.children()["worker-acquire"], signal.SIGKILL)
    before = _snapshot(up.state)
    assert len(before) >= 4 * 2, before  # bwrap + its namespace init + execd, per sandbox
    assert up.proc is not None
    up.proc.send_signal(signal.SIGINT)
    assert up.proc.wait(timeout=120) == 0, up.tail()

    wait_until(lambda: not _running(before), timeout=30, what="every sandbox process gone")
    assert marked_processes(up.state) == []
    assert _live_rows(sessions, up.installation) == []
    assert "drained:" in up.tail()


def test_a_sigkilled_stack_takes_its_workers_and_the_next_start_reclaims(
    up: Up, sessions: Any
) -> None:
    """Before: a SIGKILLed stack left its workers serving and its sandboxes running, and a
    new start kept the old rows ready and their processes alive forever."""
    job = _job(sessions, "reclaimed")
    up.start()
    workers = {pid: _proc_start(pid) for pid in up.children().values()}
    client = SandboxClient(up.redis_url, owner="pytest")
    try:
        held = client.open(image=IMAGE, job=job, timeout=120)
    finally:
        client.close()
    sandboxes = _snapshot(up.state)
    assert sandboxes
    assert up.proc is not None
    up.proc.kill()
    up.proc.wait()
    wait_until(
        lambda: not _running(workers),
        timeout=30,
        what="the workers die with their stack",
    )
    assert _running(sandboxes)  # nothing could drain them: the next start must
    up.start()
    wait_until(lambda: not _running(sandboxes), timeout=60, what="leftovers reclaimed")
    with sessions() as session:
        row = session.get(Sandbox, held.id)
        assert row is not None and row.state == "deleted"
    assert "reclaimed from an earlier run" in up.tail()
    up.proc.send_signal(signal.SIGTERM)
    assert up.proc.wait(timeout=120) == 0, up.tail()
