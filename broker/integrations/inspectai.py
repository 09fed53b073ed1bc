"""Inspect (``inspect-ai``) on Sandman: the sandbox provider ``sandman``.

Registered through Inspect's ``inspect_ai`` entry point (pyproject.toml), so any task can say::

    sandbox=("sandman", SandmanSandboxConfig(image="sandman/test-task:1", job="eval-1"))

(or ``sandbox="sandman"`` with ``SANDMAN_INSPECT_IMAGE`` / ``SANDMAN_INSPECT_JOB`` set).

Lifecycle: ``task_init`` opens one async client per Redis URL and event loop (counted, so
concurrent tasks share it), ``sample_init`` acquires one sandbox, ``sample_cleanup``
releases it always (shielded from cancellation, so an interrupted sample does not strand
it), ``task_cleanup`` closes the client. A process that exits without the cleanups
releases what it still holds at exit (``common.HELD``); a SIGKILLed one stops renewing
its leases and the GC reclaims them.

Calls map onto execd one-shot runs and file calls:

- ``exec`` is ``/v1/run`` with an argv (never a shell wrapper), ``input`` as stdin (text or
  bytes; over one request body it is staged in a file and redirected by execd's own
  bash), ``cwd`` (relative: to the sandbox's workdir), ``env`` applied by execd's spawn,
  ``user`` switched by execd (``SandboxUserUnsupportedError`` where execd cannot: not
  root, or capabilities dropped), ``timeout`` (``TimeoutError`` once execd has killed the
  whole tree; a command timeout is never retried, so ``timeout_retry`` is ignored), and
  Inspect's output limit per stream (``OutputLimitExceededError``, carrying what execd kept).
- ``read_file``/``write_file`` resolve relative paths against the workdir and raise the
  errors Inspect documents (``FileNotFoundError``, ``IsADirectoryError``,
  ``PermissionError``, ``UnicodeDecodeError``, ``OutputLimitExceededError``).
- Infrastructure failures (``broker.errors.InfrastructureError``: an acquire timeout, a
  lost sandbox, Redis down; and execd refusing our token or our HTTP call timing out)
  are raised as ``SandmanInfrastructureError``, a ``RuntimeError`` that Inspect does NOT
  turn into a tool error the model sees (it would for ``TimeoutError``,
  ``PermissionError`` or ``SandboxUnavailableError``): the sample errors, and
  ``retry_on_error`` retries it instead of scoring it.
"""

from __future__ import annotations

import asyncio
import errno
import os
import posixpath
import secrets
import shlex
from collections.abc import AsyncIterator, Coroutine
from contextlib import asynccontextmanager
from typing import Any, Literal, TypeVar, overload

import anyio
from inspect_ai.util import (
    ExecResult,
    OutputLimitExceededError,
    SandboxConnection,
    SandboxEnvironment,
    SandboxEnvironmentConfigType,
    SandboxEnvironmentLimits,
    SandboxUserUnsupportedError,
    sandboxenv,
)
from inspect_ai.util._sandbox.events import SandboxTimeoutError
from pydantic import BaseModel, ConfigDict
from typing_extensions import override

from broker.client import AsyncSandbox, AsyncSandboxClient
from broker.errors import ExecError, ExecUserError, SandmanError
from broker.integrations.common import HELD, INFRASTRUCTURE, file_error, write_large
from broker.settings import Settings
from broker.wire.services import known_redis_url

__all__ = ["SandmanInfrastructureError", "SandmanSandboxConfig", "SandmanSandboxEnvironment"]

STDIN_INLINE_MAX = 32 * 1024 * 1024  # larger stdin is staged in a file (one body is bounded)
T = TypeVar("T")


class SandmanInfrastructureError(RuntimeError):
    """Sandman could not serve the call: the sample is an error (retried), never a score."""


class SandmanSandboxConfig(BaseModel):
    """The ``config`` of ``sandbox=("sandman", config)``: what ``acquire`` gets.

    ``redis_url`` defaults to the broker's settings (``SANDMAN_REDIS_URL`` or the embedded
    Redis ``sandman up`` recorded); ``acquire`` holds any further acquire argument
    (``timeout``, ``env``, ``image_digest``...).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    image: str
    job: str
    cpu: float | str = 1.0
    memory: str = "1Gi"
    workdir: str | None = None
    redis_url: str | None = None
    acquire: dict[str, Any] = {}

    def __hash__(self) -> int:
        """Inspect keys its sandbox cache by config; ``acquire`` is a dict, so hash the JSON."""
        return hash(self.model_dump_json())


def _config(config: SandboxEnvironmentConfigType | None) -> SandmanSandboxConfig:
    if isinstance(config, SandmanSandboxConfig):
        return config
    if isinstance(config, dict):
        return SandmanSandboxConfig(**config)
    if config is None:
        image, job = os.environ.get("SANDMAN_INSPECT_IMAGE"), os.environ.get("SANDMAN_INSPECT_JOB")
        if image and job:
            return SandmanSandboxConfig(image=image, job=job)
    raise ValueError(
        "the sandman sandbox needs a SandmanSandboxConfig (image, job...) or "
        "SANDMAN_INSPECT_IMAGE and SANDMAN_INSPECT_JOB"
    )


def _infrastructure(exc: Exception) -> SandmanInfrastructureError:
    return SandmanInfrastructureError(f"Sandman infrastructure: {type(exc).__name__}: {exc}")


async def _guarded(call: Coroutine[Any, Any, T]) -> T:
    try:
        return await call
    except INFRASTRUCTURE as exc:
        raise _infrastructure(exc) from exc


class _Clients:
    """One AsyncSandboxClient per (Redis URL, event loop), counted by task_init/cleanup.

    The client's Redis and HTTP pools belong to the loop they were made on, so a client is
    never shared across loops; tasks running at once on one loop share one client.
    """

    def __init__(self) -> None:
        self._clients: dict[tuple[str, int], tuple[AsyncSandboxClient, int]] = {}

    @staticmethod
    def _key(url: str) -> tuple[str, int]:
        return url, id(asyncio.get_running_loop())

    def get(self, url: str) -> AsyncSandboxClient:
        key = self._key(url)
        if key not in self._clients:
            self._clients[key] = (AsyncSandboxClient(url), 0)
        return self._clients[key][0]

    def retain(self, url: str) -> None:
        client = self.get(url)
        key = self._key(url)
        self._clients[key] = (client, self._clients[key][1] + 1)

    async def release(self, url: str) -> None:
        key = self._key(url)
        if key not in self._clients:
            return
        client, users = self._clients[key]
        if users > 1:
            self._clients[key] = (client, users - 1)
            return
        del self._clients[key]
        await client.aclose()


CLIENTS = _Clients()


def _redis_url(config: SandmanSandboxConfig) -> str:
    return config.redis_url or known_redis_url(Settings.from_env())


@sandboxenv(name="sandman")
class SandmanSandboxEnvironment(SandboxEnvironment):
    """One Sandman sandbox as an Inspect sandbox environment (module doc)."""

    def __init__(self, sandbox: AsyncSandbox, workdir: str) -> None:
        super().__init__()
        self.sandbox = sandbox
        self.workdir = workdir

    # -- lifecycle ------------------------------------------------------------------

    @classmethod
    def config_deserialize(cls, config: dict[str, Any]) -> BaseModel:
        return SandmanSandboxConfig(**config)

    @classmethod
    async def task_init(cls, task_name: str, config: SandboxEnvironmentConfigType | None) -> None:
        CLIENTS.retain(_redis_url(_config(config)))

    @classmethod
    async def sample_init(
        cls, task_name: str, config: SandboxEnvironmentConfigType | None, metadata: dict[str, str]
    ) -> dict[str, SandboxEnvironment]:
        conf = _config(config)
        client = CLIENTS.get(_redis_url(conf))
        acquire: dict[str, Any] = {"cpu": conf.cpu, "memory": conf.memory, **conf.acquire}
        if conf.workdir is not None:
            acquire["workdir"] = conf.workdir
        sandbox = await _guarded(client.open(image=conf.image, job=conf.job, **acquire))
        HELD.add(sandbox.id, client)
        try:  # the directory execd resolved relative paths against
            pwd = await _guarded(sandbox.run(["pwd"], timeout=60))
            if pwd.exit_code != 0:
                raise SandmanInfrastructureError(f"pwd failed in {sandbox.id}: {pwd.stderr}")
        except BaseException:
            with anyio.CancelScope(shield=True):
                await _release(sandbox)
            raise
        return {"default": cls(sandbox, pwd.stdout.strip() or "/")}

    @classmethod
    async def sample_cleanup(
        cls,
        task_name: str,
        config: SandboxEnvironmentConfigType | None,
        environments: dict[str, SandboxEnvironment],
        interrupted: bool,
    ) -> None:
        with anyio.CancelScope(shield=True):  # an interrupted sample still releases
            for environment in environments.values():
                if isinstance(environment, SandmanSandboxEnvironment):
                    await _release(environment.sandbox)

    @classmethod
    async def task_cleanup(
        cls, task_name: str, config: SandboxEnvironmentConfigType | None, cleanup: bool
    ) -> None:
        await CLIENTS.release(_redis_url(_config(config)))

    # -- calls ----------------------------------------------------------------------

    def _path(self, path: str) -> str:
        return path if path.startswith("/") else posixpath.join(self.workdir, path)

    @override
    async def exec(
        self,
        cmd: list[str],
        input: str | bytes | None = None,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        user: str | None = None,
        timeout: int | None = None,
        timeout_retry: bool = True,
        concurrency: bool = True,
    ) -> ExecResult[str]:
        limit = SandboxEnvironmentLimits.MAX_EXEC_OUTPUT_SIZE
        options: dict[str, Any] = {
            "cwd": cwd,
            "env": env,
            "user": user,
            "timeout": timeout,
            "max_output_bytes": limit,
        }
        try:
            async with self._stdin(cmd, input) as (target, stdin):
                result = await _guarded(self.sandbox.run(target, input=stdin, **options))
        except ExecUserError as exc:
            if exc.error_code == "unknown_user":  # as `docker exec -u` answers
                return ExecResult(
                    False, 126, "", f"unable to find user {user}: no matching entries"
                )
            raise SandboxUserUnsupportedError(f"cannot run as {user!r} here: {exc}") from exc
        except ExecError as exc:
            if exc.error_code == "bad_cwd":
                return ExecResult(False, 126, "", f"cannot enter {cwd}: no such directory")
            raise
        if result.timed_out:
            raise SandboxTimeoutError(
                f"Command timed out after {timeout} seconds", truncated_output=result.stdout
            )
        if result.truncated:
            raise OutputLimitExceededError(
                SandboxEnvironmentLimits.MAX_EXEC_OUTPUT_SIZE_STR,
                truncated_output=result.stdout,
            )
        code = result.exit_code if result.exit_code is not None else 1
        if code == 126 and "permission denied" in result.stderr.lower():
            raise PermissionError(errno.EACCES, result.stderr.strip(), cmd[0])
        return ExecResult(code == 0, code, result.stdout, result.stderr)

    @asynccontextmanager
    async def _stdin(
        self, cmd: list[str], stdin: str | bytes | None
    ) -> AsyncIterator[tuple[str | list[str], str | bytes | None]]:
        """The run target and its inline stdin; a large stdin goes through a staged file
        that execd's own bash (found by execd at start, not on the image's PATH) redirects."""
        raw = stdin.encode() if isinstance(stdin, str) else stdin
        if raw is None or len(raw) <= STDIN_INLINE_MAX:
            yield cmd, stdin
            return
        staged = f"/tmp/.sandman-stdin-{secrets.token_hex(8)}"  # noqa: S108 (the sandbox's /tmp)
        await _guarded(write_large(self.sandbox, staged, raw, mode=0o644))
        try:
            yield f"exec {shlex.join(cmd)} < {staged}", None
        finally:
            with anyio.CancelScope(shield=True):
                await _guarded(self.sandbox.run(["rm", "-f", "--", staged], timeout=60))

    async def write_file(self, file: str, contents: str | bytes) -> None:
        data = contents.encode("utf-8") if isinstance(contents, str) else contents
        await _guarded(write_large(self.sandbox, self._path(file), data))

    @overload
    async def read_file(self, file: str, text: Literal[True] = True) -> str: ...

    @overload
    async def read_file(self, file: str, text: Literal[False]) -> bytes: ...

    async def read_file(self, file: str, text: bool = True) -> str | bytes:
        try:
            data = await _guarded(self.sandbox.read_file(self._path(file)))
        except ExecError as exc:
            raise file_error(exc, file) from exc
        if len(data) > SandboxEnvironmentLimits.MAX_READ_FILE_SIZE:
            raise OutputLimitExceededError(
                SandboxEnvironmentLimits.MAX_READ_FILE_SIZE_STR, truncated_output=None
            )
        return data.decode("utf-8") if text else data

    async def connection(self, *, user: str | None = None) -> SandboxConnection:
        """How to reach this sandbox's execd (the token is the trainer's, never printed)."""
        if self.sandbox.released:
            raise ConnectionError(f"sandbox {self.sandbox.id} was released")
        body = '{"command": "id", "timeout": 30}'
        command = (
            f'curl -s -H "Authorization: Bearer $SANDMAN_EXECD_TOKEN" '
            f"http://{self.sandbox.lease.address}/v1/exec -d '{body}'"
        )
        return SandboxConnection(
            type="sandman", command=command, container=self.sandbox.lease.pod_name
        )

    def default_polling_interval(self) -> float:
        return 0.2


async def _release(sandbox: AsyncSandbox) -> None:
    HELD.discard(sandbox.id)
    try:
        await sandbox.release()
    except SandmanError as exc:  # queued at exit then; the lease runs out otherwise
        HELD.add(sandbox.id, sandbox.client)
        raise _infrastructure(exc) from exc
