"""SWE-ReX on Sandman: code written for SWE-ReX (SWE-agent's runtime) runs in Sandman sandboxes.

``SandmanDeployment`` acquires a sandbox with the async client and hands out a
``SandmanRuntime``, which implements SWE-ReX's ``AbstractRuntime`` on execd:

- SWE-ReX sessions are execd named sessions (``rex-<name>``): each its own bash
  with persistent cwd and environment, closed for real by ``close_session``.
- ``run_in_session`` keeps SWE-ReX's bash-action semantics: the syntax is
  checked first (``bash -n``, as SWE-ReX does: ``BashIncorrectSyntaxError``),
  stdout and stderr come interleaved in ``output`` as from its pty, and
  ``check`` is ``raise`` (``NonZeroExitCodeError``), ``silent`` (the code, no
  error) or ``ignore`` (``exit_code`` None). A timeout is
  ``CommandTimeoutError``; execd has already killed the command's processes
  (the session keeps its state), so ``BashInterruptAction`` has nothing left
  to interrupt and answers at once. Interactive actions (a pty program such as
  gdb) are refused: execd sessions have no terminal.
- ``execute`` is a one-shot run (``Sandbox.run``) with ``cwd``, ``env``,
  ``timeout``, ``check`` and ``merge_output_streams``. Unlike
  ``subprocess.run``, ``env`` is added to the sandbox's environment instead of
  replacing it, and execd refuses the reserved names (``LD_*``...).
- ``read_file``/``write_file``/``upload`` use execd's file calls; a missing
  file is ``FileNotFoundError`` as from the local runtime.

Failures of the infrastructure stay Sandman's typed errors (``SandboxLost``, an
``InfrastructureError``), except at ``start``, where SWE-ReX expects
``DeploymentStartupError`` (raised from the Sandman error).
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import re
import shlex
from pathlib import Path
from typing import Any

from swerex.deployment.abstract import AbstractDeployment
from swerex.deployment.hooks.abstract import CombinedDeploymentHook, DeploymentHook
from swerex.exceptions import (
    BashIncorrectSyntaxError,
    CommandTimeoutError,
    DeploymentNotStartedError,
    DeploymentStartupError,
    NonZeroExitCodeError,
    SessionDoesNotExistError,
    SessionExistsError,
    SwerexException,
)
from swerex.runtime.abstract import (
    AbstractRuntime,
    Action,
    BashAction,
    BashInterruptAction,
    BashObservation,
    CloseBashSessionResponse,
    CloseResponse,
    CloseSessionRequest,
    Command,
    CommandResponse,
    CreateBashSessionResponse,
    CreateSessionRequest,
    IsAliveResponse,
    ReadFileRequest,
    ReadFileResponse,
    UploadRequest,
    UploadResponse,
    WriteFileRequest,
    WriteFileResponse,
)

from broker.client import AsyncSandbox, AsyncSandboxClient
from broker.errors import ExecError, SandmanError
from broker.integrations.common import HELD, file_error

__all__ = ["SandmanDeployment", "SandmanRuntime"]

NO_TIMEOUT_S = 7 * 24 * 3600.0  # SWE-ReX's None: execd's maximum
_SAFE_NAME = re.compile(r"[A-Za-z0-9_.-]{1,60}\Z")


def execd_session(name: str) -> str:
    """The execd named session behind a SWE-ReX session name (any string)."""
    if _SAFE_NAME.match(name):
        return f"rex-{name}"
    return "rex-" + hashlib.sha256(name.encode()).hexdigest()[:32]


class SandmanRuntime(AbstractRuntime):
    """SWE-ReX's runtime on one acquired sandbox (module doc for the semantics)."""

    def __init__(self, sandbox: AsyncSandbox, *, logger: logging.Logger | None = None) -> None:
        self.sandbox = sandbox
        self.logger = logger or logging.getLogger("sandman.swerex")
        self._sessions: dict[str, str] = {}

    async def is_alive(self, *, timeout: float | None = None) -> IsAliveResponse:
        if self.sandbox.released:
            return IsAliveResponse(is_alive=False, message="the sandbox was released")
        if await self.sandbox.healthy(timeout or 2.0):
            return IsAliveResponse(is_alive=True)
        message = f"execd of {self.sandbox.id} does not answer"
        return IsAliveResponse(is_alive=False, message=message)

    async def create_session(self, request: CreateSessionRequest) -> CreateBashSessionResponse:
        if request.session in self._sessions:
            raise SessionExistsError(f"session {request.session} already exists")
        name = execd_session(request.session)
        await self.sandbox.open_session(name)
        self._sessions[request.session] = name
        output = ""
        for path in request.startup_source:
            result = await self.sandbox.exec(
                f"source {shlex.quote(path)}", session=name, timeout=request.startup_timeout
            )
            if result.timed_out:
                raise CommandTimeoutError(f"timeout while sourcing {path!r} in {request.session}")
            output += result.stdout + result.stderr
        return CreateBashSessionResponse(output=output)

    def _execd_name(self, session: str) -> str:
        name = self._sessions.get(session)
        if name is None:
            raise SessionDoesNotExistError(f"session {session!r} does not exist")
        return name

    async def run_in_session(self, action: Action) -> BashObservation:
        name = self._execd_name(action.session)
        if isinstance(action, BashInterruptAction):
            return BashObservation(output="", exit_code=0)  # a timeout already killed it
        if action.is_interactive_command or action.is_interactive_quit:
            raise SwerexException("interactive actions need a terminal; execd sessions have none")
        await self._check_syntax(action.command)
        result = await self.sandbox.exec(
            "{\n" + action.command + "\n} 2>&1",  # one interleaved stream, as from a pty
            session=name,
            timeout=action.timeout or NO_TIMEOUT_S,
        )
        if result.timed_out:
            raise CommandTimeoutError(
                f"timeout after {action.timeout} seconds while running command {action.command!r}"
            )
        output = result.stdout + result.stderr
        exit_code = None if action.check == "ignore" else result.exit_code
        if action.check == "raise" and exit_code != 0:
            _raise_nonzero(action, exit_code, output)
        return BashObservation(output=output, exit_code=exit_code)

    async def _check_syntax(self, command: str) -> None:
        checked = await self.sandbox.run(["bash", "-n"], input=command, timeout=60.0)
        if checked.exit_code != 0:
            raise BashIncorrectSyntaxError(
                f"Error (exit code {checked.exit_code}) while checking bash command \n"
                f"{command!r}\n---- Stderr ----\n{checked.stderr}\n---- Stdout ----\n"
                f"{checked.stdout}",
                extra_info={"bash_stdout": checked.stdout, "bash_stderr": checked.stderr},
            )

    async def close_session(self, request: CloseSessionRequest) -> CloseBashSessionResponse:
        name = self._execd_name(request.session)
        del self._sessions[request.session]
        await self.sandbox.close_session(name)
        return CloseBashSessionResponse()

    async def execute(self, command: Command) -> CommandResponse:
        given = command.command
        target: str | list[str]
        if command.shell:
            target = given if isinstance(given, str) else shlex.join(given)
        else:  # subprocess.run: a string without a shell is the program's name
            target = [given] if isinstance(given, str) else list(given)
        if command.merge_output_streams:
            script = target if isinstance(target, str) else shlex.join(target)
            target = "exec 2>&1\n" + (script if command.shell else "exec " + script)
        result = await self.sandbox.run(
            target, cwd=command.cwd, env=command.env, timeout=command.timeout
        )
        if result.timed_out:
            raise CommandTimeoutError(
                f"Timeout ({command.timeout}s) exceeded while running command"
            )
        response = CommandResponse(
            stdout=result.stdout, stderr=result.stderr, exit_code=result.exit_code
        )
        if command.check and result.exit_code != 0:
            message = (
                f"Command {command.command!r} failed with exit code {result.exit_code}. "
                f"Stdout:\n{result.stdout!r}\nStderr:\n{result.stderr!r}"
            )
            raise NonZeroExitCodeError(
                f"{command.error_msg}: {message}" if command.error_msg else message
            )
        return response

    async def read_file(self, request: ReadFileRequest) -> ReadFileResponse:
        try:
            data = await self.sandbox.read_file(request.path)
        except ExecError as exc:
            raise file_error(exc, request.path) from exc
        return ReadFileResponse(
            content=data.decode(request.encoding or "utf-8", request.errors or "strict")
        )

    async def write_file(self, request: WriteFileRequest) -> WriteFileResponse:
        try:
            await self.sandbox.write_file(request.path, request.content)
        except ExecError as exc:
            raise file_error(exc, request.path) from exc
        return WriteFileResponse()

    async def upload(self, request: UploadRequest) -> UploadResponse:
        """A local file, or a directory tree (modes kept), to the sandbox's target path."""
        source = Path(request.source_path)
        if not source.exists():
            raise FileNotFoundError(errno.ENOENT, "no such file to upload", str(source))
        if source.is_file():
            files = [(source, request.target_path)]
        else:
            files = [
                (p, os.path.join(request.target_path, p.relative_to(source).as_posix()))
                for p in sorted(source.rglob("*"))
                if p.is_file()
            ]
        for path, target in files:
            mode = path.stat().st_mode & 0o7777
            await self.sandbox.write_file(target, path.read_bytes(), mode=mode)
        return UploadResponse()

    async def close(self) -> CloseResponse:
        """Close every session this runtime opened (the sandbox itself is the deployment's)."""
        names, self._sessions = list(self._sessions.values()), {}
        for name in names:
            try:
                await self.sandbox.close_session(name)
            except SandmanError as exc:  # closing is best effort: the sandbox may be gone
                self.logger.warning("closing session %s failed: %s", name, exc)
        return CloseResponse()


def _raise_nonzero(action: BashAction, exit_code: int | None, output: str) -> None:
    message = (
        f"Command {action.command!r} failed with exit code {exit_code}. "
        f"Here is the output:\n{output!r}"
    )
    raise NonZeroExitCodeError(f"{action.error_msg}: {message}" if action.error_msg else message)


class SandmanDeployment(AbstractDeployment):
    """Acquire a Sandman sandbox on ``start``, release it on ``stop``.

    ``image`` and ``job`` (and any other acquire argument: cpu, memory, timeout...)
    go to ``AsyncSandboxClient.open``; ``redis_url`` and ``client_options`` to the
    client.
    """

    def __init__(
        self,
        *,
        image: str,
        job: str,
        redis_url: str,
        client_options: dict[str, Any] | None = None,
        logger: logging.Logger | None = None,
        **acquire: Any,
    ) -> None:
        self.logger = logger or logging.getLogger("sandman.swerex")
        self._acquire = {"image": image, "job": job, **acquire}
        self._redis_url = redis_url
        self._client_options = client_options or {}
        self._hooks = CombinedDeploymentHook()
        self._client: AsyncSandboxClient | None = None
        self._sandbox: AsyncSandbox | None = None
        self._runtime: SandmanRuntime | None = None

    def add_hook(self, hook: DeploymentHook) -> None:
        self._hooks.add_hook(hook)

    def __del__(self) -> None:
        """SWE-ReX's finaliser stops a forgotten deployment on some event loop (it may make
        one); a stopped deployment has nothing to stop, so it is skipped then."""
        if getattr(self, "_client", None) is not None or getattr(self, "_sandbox", None):
            super().__del__()  # type: ignore[no-untyped-call]

    @property
    def sandbox(self) -> AsyncSandbox | None:
        return self._sandbox

    async def is_alive(self, *, timeout: float | None = None) -> IsAliveResponse:
        if self._runtime is None:
            return IsAliveResponse(is_alive=False, message="the deployment was not started")
        return await self._runtime.is_alive(timeout=timeout)

    async def start(self) -> None:
        self._hooks.on_custom_step("Acquiring a Sandman sandbox")
        self._client = AsyncSandboxClient(self._redis_url, **self._client_options)
        try:
            self._sandbox = await self._client.open(**self._acquire)
        except SandmanError as exc:
            await self.stop()
            raise DeploymentStartupError(f"no Sandman sandbox: {exc}") from exc
        HELD.add(self._sandbox.id, self._client)  # released at exit if stop() never runs
        self._runtime = SandmanRuntime(self._sandbox, logger=self.logger)

    async def stop(self) -> None:
        """Idempotent: close the sessions, release the sandbox, close the client."""
        runtime, sandbox, client = self._runtime, self._sandbox, self._client
        self._runtime = self._sandbox = self._client = None
        try:
            if runtime is not None:
                await runtime.close()
        finally:
            try:
                if sandbox is not None:
                    HELD.discard(sandbox.id)
                    await sandbox.release()
            finally:
                if client is not None:
                    await client.aclose()

    @property
    def runtime(self) -> SandmanRuntime:
        if self._runtime is None:
            raise DeploymentNotStartedError()  # type: ignore[no-untyped-call]
        return self._runtime
