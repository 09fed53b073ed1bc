"""Every adapter's sandboxes are reclaimed on every exit path of the harness process.

- SIGKILL mid-run (nothing in the process runs): its leases stop being renewed and the
  GC pass reclaims the sandbox once the lease has run out (the lease's end is moved
  into the past, as tests/integration/acquire/test_restart.py does, instead of waiting).
- Ctrl-C (SIGINT) mid-run, and an exception: Inspect runs its sample cleanup; for
  mini-swe-agent and SWE-ReX scripts that never call ``cleanup``/``stop`` the exception
  escapes to top level and the adapters' at-exit release
  (``broker.integrations.common.HELD``) queues the release.

Each harness runs in its own Python process through its real package, prints the
sandbox id once it holds one, then runs a command that does not end by itself.
"""

from __future__ import annotations

import datetime as dt
import os
import secrets
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from broker.acquire.root import Root
from broker.ledger import store
from broker.ledger.models import Sandbox, utcnow
from broker.ledger.states import State
from broker.ownership.gc import run_gc
from broker.settings import Settings
from tests.support.images import TASK_IMAGE
from tests.support.wait import wait_until

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[3]
IMAGE = TASK_IMAGE

HARNESSES = {
    "inspect": """
        import sys, tempfile
        from inspect_ai import Task, eval
        from inspect_ai.dataset import Sample
        from inspect_ai.solver import solver
        from inspect_ai.util import sandbox
        from broker.integrations.inspectai import SandmanSandboxConfig, SandmanSandboxEnvironment

        @solver
        def hang():
            async def solve(state, generate):
                held = sandbox().as_type(SandmanSandboxEnvironment).sandbox
                print("SANDBOX", held.id, flush=True)
                if MODE == "raise":
                    raise RuntimeError("the solver crashed")  # a sample error for Inspect
                await sandbox().exec(["sleep", SLEEP])
                return state
            return solve

        config = SandmanSandboxConfig(image=IMAGE, job=JOB, redis_url=URL)
        task = Task(dataset=[Sample(input="x")], solver=[hang()], sandbox=("sandman", config))
        eval(task, model="mockllm/model", log_dir=tempfile.mkdtemp(), display="none")
    """,
    "minisweagent": """
        from broker.integrations.minisweagent import SandmanEnvironment

        env = SandmanEnvironment(image=IMAGE, job=JOB, redis_url=URL, timeout=600)
        print("SANDBOX", env.sandbox.id, flush=True)
        if MODE == "raise":
            raise RuntimeError("the harness crashed")
        env.execute({"command": "sleep " + SLEEP})
    """,
    "swerex": """
        import asyncio
        from swerex.runtime.abstract import BashAction, CreateBashSessionRequest
        from broker.integrations.swerex import SandmanDeployment

        async def main():
            deployment = SandmanDeployment(image=IMAGE, job=JOB, redis_url=URL)
            await deployment.start()
            print("SANDBOX", deployment.sandbox.id, flush=True)
            if MODE == "raise":
                raise RuntimeError("the harness crashed")
            await deployment.runtime.create_session(CreateBashSessionRequest())
            action = BashAction(command="sleep " + SLEEP, timeout=600)
            await deployment.runtime.run_in_session(action)

        asyncio.run(main())
    """,
}


@pytest.fixture
def job(sessions: Any) -> str:
    name = f"kill-{secrets.token_hex(3)}"
    with sessions.begin() as session:
        store.ensure_job(session, name)
    return name


def _start(harness: str, mode: str, stack: Settings, job: str) -> tuple[subprocess.Popen[str], str]:
    """The harness process and the id of the sandbox it holds."""
    prelude = (
        # Ctrl-C as at a terminal: a shell without job control starts background commands
        # (a backgrounded pytest, say) with SIGINT ignored, and Python keeps it ignored.
        "import signal; signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        f"IMAGE, JOB, URL, MODE, SLEEP = "
        f"{IMAGE!r}, {job!r}, {stack.redis_url!r}, {mode!r}, {_sleep(job)!r}\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "MSWEA_SILENT_STARTUP": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-c", prelude + textwrap.dedent(HARNESSES[harness])],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
        cwd=REPO,
    )
    assert proc.stdout is not None
    with proc.stdout:  # harnesses log to stdout too: read up to the marked line only
        line = ""
        for line in proc.stdout:  # blocks until the sandbox is held (or the process ends)
            if line.startswith("SANDBOX "):
                break
    if not line.startswith("SANDBOX "):
        proc.kill()
        proc.wait()
        pytest.fail(f"{harness} exited with {proc.returncode} before holding a sandbox")
    return proc, line.split()[1]


def _state(sessions: Any, sandbox_id: str) -> str | None:
    with sessions() as session:
        row = session.get(Sandbox, sandbox_id)
        return None if row is None else row.state


@pytest.mark.parametrize("harness", sorted(HARNESSES))
def test_sigkill_mid_run_the_gc_reclaims_the_sandbox(
    harness: str, stack: Settings, job: str, sessions: Any
) -> None:
    proc, sandbox_id = _start(harness, "hang", stack, job)
    wait_until(lambda: _running_sleep(job), 60, 0.2, "the command to run")
    assert _state(sessions, sandbox_id) == State.READY
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert _state(sessions, sandbox_id) == State.READY  # nobody released it
    with sessions.begin() as session:  # the lease runs out: no heartbeat renews it
        row = session.get(Sandbox, sandbox_id)
        assert row is not None
        row.lease_expires_at = utcnow() - dt.timedelta(seconds=1)
    root = Root(stack)
    try:
        report = run_gc(root.provider())
        assert not report.errors, report
    finally:
        root.dispose()
    wait_until(
        lambda: _state(sessions, sandbox_id) == State.DELETED, 60, 0.2, "the GC to reclaim it"
    )


@pytest.mark.parametrize("harness", sorted(HARNESSES))
@pytest.mark.parametrize("how", ["raise", "sigint"])
def test_an_exception_or_ctrl_c_releases_the_sandbox(
    harness: str, how: str, stack: Settings, job: str, sessions: Any
) -> None:
    proc, sandbox_id = _start(harness, how, stack, job)
    if how == "sigint":
        wait_until(lambda: _running_sleep(job), 60, 0.2, "the command to run")
        proc.send_signal(signal.SIGINT)
    proc.wait(timeout=120)
    wait_until(lambda: _state(sessions, sandbox_id) == State.DELETED, 60, 0.2, "the release")


def _sleep(job: str) -> str:
    """The harness's long command's argument: 600 s, with digits unique to this test."""
    return f"600.{int(job.rsplit('-', 1)[1], 16)}"


def _running_sleep(job: str) -> bool:
    """The harness is mid-run: its `sleep` runs in the sandbox (a host process here)."""
    wanted = b"sleep\0" + _sleep(job).encode() + b"\0"
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and (entry / "cmdline").read_bytes() == wanted:
                return True
        except OSError:  # the process ended meanwhile
            continue
    return False
