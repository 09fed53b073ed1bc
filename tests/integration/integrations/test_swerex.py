"""SWE-ReX's deployment and runtime on a real stack: every method, and the errors its callers catch.

The pinned ``swe-rex`` package's own request and exception types are used throughout,
so a change in its interfaces fails here.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from swerex.exceptions import (
    BashIncorrectSyntaxError,
    CommandTimeoutError,
    DeploymentNotStartedError,
    DeploymentStartupError,
    NonZeroExitCodeError,
    SessionDoesNotExistError,
    SessionExistsError,
)
from swerex.runtime.abstract import (
    BashAction,
    BashInterruptAction,
    CloseBashSessionRequest,
    Command,
    CreateBashSessionRequest,
    ReadFileRequest,
    UploadRequest,
    WriteFileRequest,
)

from broker.integrations.swerex import SandmanDeployment, SandmanRuntime
from broker.ledger import store
from broker.ledger.models import Sandbox
from broker.ledger.states import State
from broker.settings import Settings
from tests.support.images import TASK_IMAGE
from tests.support.wait import wait_until

pytestmark = pytest.mark.integration
IMAGE = TASK_IMAGE


@pytest.fixture
def job(sessions: Any) -> str:
    name = f"swerex-{secrets.token_hex(3)}"
    with sessions.begin() as session:
        store.ensure_job(session, name)
    return name


def deployed(stack: Settings, job: str, body: Callable[[SandmanRuntime], Awaitable[None]]) -> str:
    """Start a deployment, run ``body`` on its runtime, stop it; the sandbox's id."""

    async def main() -> str:
        deployment = SandmanDeployment(image=IMAGE, job=job, redis_url=stack.redis_url, timeout=60)
        with pytest.raises(DeploymentNotStartedError):
            _ = deployment.runtime
        assert not await deployment.is_alive()
        await deployment.start()
        assert deployment.sandbox is not None
        sandbox_id = deployment.sandbox.id
        try:
            assert await deployment.is_alive()
            await body(deployment.runtime)
        finally:
            await deployment.stop()
        assert not await deployment.is_alive()
        await deployment.stop()  # idempotent
        return sandbox_id

    return asyncio.run(main())


def _released(sessions: Any, sandbox_id: str) -> bool:
    with sessions() as session:
        row = session.get(Sandbox, sandbox_id)
        return row is not None and row.state == State.DELETED


def test_sessions_and_bash_actions(stack: Settings, job: str, sessions: Any) -> None:
    async def body(rt: SandmanRuntime) -> None:
        await rt.create_session(CreateBashSessionRequest())
        with pytest.raises(SessionExistsError):
            await rt.create_session(CreateBashSessionRequest())
        obs = await rt.run_in_session(BashAction(command="cd /tmp && export A=1", timeout=30))
        assert obs.exit_code == 0
        obs = await rt.run_in_session(BashAction(command="pwd; echo $A; echo err >&2"))
        assert obs.output == "/tmp\n1\nerr\n"  # stderr interleaved, as from SWE-ReX's pty
        with pytest.raises(NonZeroExitCodeError, match="exit code 3"):
            await rt.run_in_session(BashAction(command="(exit 3)", error_msg="boom"))
        silent = await rt.run_in_session(BashAction(command="(exit 4)", check="silent"))
        assert silent.exit_code == 4
        ignored = await rt.run_in_session(BashAction(command="(exit 5)", check="ignore"))
        assert ignored.exit_code is None
        with pytest.raises(BashIncorrectSyntaxError):
            await rt.run_in_session(BashAction(command="if then fi"))
        with pytest.raises(CommandTimeoutError):
            await rt.run_in_session(BashAction(command="sleep 100", timeout=1))
        interrupted = await rt.run_in_session(BashInterruptAction())
        assert interrupted.exit_code == 0
        assert (await rt.run_in_session(BashAction(command="echo $A"))).output == "1\n"
        heredoc = "cat <<'EOF'\nline $A\nEOF"
        assert (await rt.run_in_session(BashAction(command=heredoc))).output == "line $A\n"
        # A second session is its own bash.
        await rt.create_session(CreateBashSessionRequest(session="other"))
        other = await rt.run_in_session(BashAction(command="echo ${A:-unset}", session="other"))
        assert other.output == "unset\n"
        await rt.close_session(CloseBashSessionRequest(session="other"))
        with pytest.raises(SessionDoesNotExistError):
            await rt.run_in_session(BashAction(command="true", session="other"))
        with pytest.raises(SessionDoesNotExistError):
            await rt.close_session(CloseBashSessionRequest(session="other"))

    sandbox_id = deployed(stack, job, body)
    wait_until(lambda: _released(sessions, sandbox_id), 60, 0.2, "the sandbox to be released")


def test_execute_and_files(stack: Settings, job: str, tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    (tree / "sub").mkdir(parents=True)
    (tree / "top.txt").write_text("top\n")
    (tree / "sub" / "run.sh").write_text("#!/bin/sh\necho ran\n")
    (tree / "sub" / "run.sh").chmod(0o755)

    async def body(rt: SandmanRuntime) -> None:
        r = await rt.execute(Command(command=["printf", "%s", "a b"]))
        assert (r.stdout, r.stderr, r.exit_code) == ("a b", "", 0)
        script = "echo $X; pwd; echo e >&2"
        r = await rt.execute(Command(command=script, shell=True, env={"X": "1"}, cwd="/tmp"))
        assert (r.stdout, r.stderr) == ("1\n/tmp\n", "e\n")
        merged = await rt.execute(
            Command(command="echo o; echo e >&2", shell=True, merge_output_streams=True)
        )
        assert (merged.stdout, merged.stderr) == ("o\ne\n", "")
        assert (await rt.execute(Command(command=["false"]))).exit_code == 1
        with pytest.raises(NonZeroExitCodeError):
            await rt.execute(Command(command=["false"], check=True))
        with pytest.raises(CommandTimeoutError):
            await rt.execute(Command(command=["sleep", "100"], timeout=1))
        await rt.write_file(WriteFileRequest(path="/workspace/new/dir/f.txt", content="héllo\n"))
        read = await rt.read_file(ReadFileRequest(path="/workspace/new/dir/f.txt"))
        assert read.content == "héllo\n"
        with pytest.raises(FileNotFoundError):
            await rt.read_file(ReadFileRequest(path="/workspace/missing.txt"))
        await rt.upload(UploadRequest(source_path=str(tree), target_path="/workspace/up"))
        assert (await rt.execute(Command(command=["/workspace/up/sub/run.sh"]))).stdout == "ran\n"
        top = await rt.read_file(ReadFileRequest(path="/workspace/up/top.txt"))
        assert top.content == "top\n"
        one = UploadRequest(source_path=str(tree / "top.txt"), target_path="/workspace/one")
        await rt.upload(one)
        assert (await rt.read_file(ReadFileRequest(path="/workspace/one"))).content == "top\n"
        with pytest.raises(FileNotFoundError):
            await rt.upload(UploadRequest(source_path=str(tmp_path / "nope"), target_path="/x"))

    deployed(stack, job, body)


def test_a_failed_start_is_a_deployment_startup_error(stack: Settings) -> None:
    async def main() -> None:
        deployment = SandmanDeployment(
            image=IMAGE, job="no-such-job", redis_url=stack.redis_url, timeout=10
        )
        with pytest.raises(DeploymentStartupError):
            await deployment.start()
        assert not await deployment.is_alive()

    asyncio.run(main())
