"""OpenEnv on Sandman: each OpenEnv rollout gets its own Sandman sandbox.

OpenEnv's trainer-side harness API (``openenv.core.harness``) drives an episode
against a ``ResourceSession`` that a ``ResourceSessionFactory`` creates per
rollout: ``initial_messages``, ``list_tools``, ``call_tool``, ``verify`` (the
reward, computed by the environment) and ``close``. Its own loops use them:
``MCPHarnessAdapter.run_white_box`` (the multi-turn tool loop),
``CollectRunner.run`` (dataset collection) and ``build_harness_rollout_func``
(TRL's ``rollout_func``).

``SandmanSessionFactory.create`` acquires one sandbox and writes the task's
files; ``SandmanSession`` gives the model four tools on it (``bash`` in the
sandbox's persistent shell, ``read_file``, ``write_file``, ``submit``), and
``verify`` runs the task's ``check`` command inside the sandbox: reward 1.0 when
it exits 0, else 0.0. ``close`` releases the sandbox; it is idempotent, and
every OpenEnv loop calls it in a ``finally`` (exceptions, Ctrl-C included). A
failed ``create`` releases what it acquired before raising.

What the agent did wrong (a failing command, a missing file) is a tool result
it can read. What the infrastructure did wrong (``broker.errors.
InfrastructureError``: the sandbox or its daemon lost, no capacity, the broker
unreachable) is raised out of ``create``/``call_tool``/``verify`` unchanged.
OpenEnv has no dedicated error type for this: an exception out of the session
IS its masking signal. ``CollectRunner`` counts the episode in ``num_failed``
and writes no record; ``build_harness_rollout_func`` closes the session and
re-raises, so the trainer's step is retried instead of training on it. A reward
is never invented: a lost sandbox never becomes reward 0.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from openenv.core.env_server.mcp_types import Tool
from openenv.core.harness import (
    Message,
    ResourceSession,
    ResourceSessionFactory,
    ToolResult,
    VerifyResult,
)

from broker.client import Sandbox, SandboxClient
from broker.errors import ExecAuthError, ExecError

__all__ = ["TOOLS", "SandboxTask", "SandmanSession", "SandmanSessionFactory"]

# execd's refusals that are the agent's doing (bad path, not a file, no match...).
_AGENT_STATUSES = frozenset({400, 403, 404, 409, 422})


@dataclass(frozen=True)
class SandboxTask:
    """One task: the prompt, the files laid out before the episode, the reward check.

    ``check`` is a shell command run in the sandbox after the episode (its own
    one-shot process, ``check_timeout`` seconds): reward 1.0 iff it exits 0.
    """

    prompt: str
    check: str
    files: Mapping[str, str | bytes] = field(default_factory=dict)
    system: str | None = None
    check_timeout: float = 300.0

    @classmethod
    def of(cls, task: Any) -> SandboxTask:
        """A ``SandboxTask`` as given, or one built from a mapping with its field names
        (OpenEnv passes whatever the caller's task list holds)."""
        if isinstance(task, cls):
            return task
        if isinstance(task, Mapping):
            return cls(**task)
        raise TypeError(f"a Sandman task is a SandboxTask or a mapping, not {task!r}")


def _tool(name: str, description: str, properties: dict[str, Any]) -> Tool:
    schema = {"type": "object", "properties": properties, "required": sorted(properties)}
    return Tool(name=name, description=description, input_schema=schema)


_STR = {"type": "string"}
TOOLS = (
    _tool(
        "bash",
        "Run a command in the sandbox's persistent bash (cwd and exports persist).",
        {"command": _STR},
    ),
    _tool("read_file", "Read a text file of the sandbox (absolute path).", {"path": _STR}),
    _tool(
        "write_file",
        "Write a text file in the sandbox (absolute path; parents are created).",
        {"path": _STR, "content": _STR},
    ),
    _tool("submit", "End the episode; the work is then checked.", {}),
)


class SandmanSession(ResourceSession):
    """One rollout on one acquired sandbox (module doc for the contract)."""

    def __init__(
        self,
        sandbox: Sandbox,
        task: SandboxTask,
        *,
        command_timeout: float = 300.0,
        episode_id: str | None = None,
    ) -> None:
        self.sandbox = sandbox
        self.task = task
        self.command_timeout = command_timeout
        self.episode_id = episode_id

    def initial_messages(self) -> list[Message]:
        system = [{"role": "system", "content": self.task.system}] if self.task.system else []
        return [*system, {"role": "user", "content": self.task.prompt}]

    def list_tools(self) -> list[Tool]:
        return list(TOOLS)

    def call_tool(self, name: str, arguments: dict[str, Any]) -> ToolResult:
        """Run one tool. An unknown tool is ``KeyError`` and a missing argument
        ``ValueError`` (OpenEnv's own conventions); infrastructure errors propagate."""
        if name == "submit":
            return ToolResult(data="submitted", done=True)
        if name == "bash":
            result = self.sandbox.exec(_arg(arguments, "command"), timeout=self.command_timeout)
            output = result.stdout + result.stderr
            if result.timed_out:
                output += f"\n[timed out after {self.command_timeout} s]"
            return ToolResult(
                data={"exit_code": result.exit_code, "output": output},
                metadata={"exit_code": result.exit_code, "timed_out": result.timed_out},
            )
        if name == "read_file":
            path = _arg(arguments, "path")
            try:
                data = self.sandbox.read_file(path)
            except ExecError as exc:
                return _refusal(exc)
            return ToolResult(data=data.decode("utf-8", "replace"))
        if name == "write_file":
            path, content = _arg(arguments, "path"), _arg(arguments, "content")
            try:
                size = self.sandbox.write_file(path, content)
            except ExecError as exc:
                return _refusal(exc)
            return ToolResult(data=f"wrote {size} bytes to {path}")
        raise KeyError(f"Unknown tool: {name}")

    def verify(self, transcript: list[Message], final_state: Any | None = None) -> VerifyResult:
        """The task's ``check`` in the sandbox: the reward is the environment's, never
        synthesised; a sandbox that cannot run it raises (the episode is masked)."""
        result = self.sandbox.run(self.task.check, timeout=self.task.check_timeout)
        reward = 1.0 if result.exit_code == 0 else 0.0
        return VerifyResult(
            env_reward=reward,
            done=True,
            metrics={"check_exit_code": result.exit_code, "check_timed_out": result.timed_out},
            artifacts={"sandbox_id": self.sandbox.id, "check_output": result.stdout[-4000:]},
        )

    def close(self) -> None:
        """Release the sandbox (idempotent: the release is queued once)."""
        self.sandbox.release()

    def __enter__(self) -> SandmanSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SandmanSessionFactory(ResourceSessionFactory[SandmanSession]):
    """Acquire a sandbox per rollout. ``image``, ``job`` and any other acquire argument
    (cpu, memory, timeout...) go to ``SandboxClient.open``; the client is the caller's
    (one per process) and is not closed here."""

    def __init__(
        self,
        client: SandboxClient,
        *,
        image: str,
        job: str,
        command_timeout: float = 300.0,
        **acquire: Any,
    ) -> None:
        self.client = client
        self.command_timeout = command_timeout
        self._acquire = {"image": image, "job": job, **acquire}

    def create(
        self, task: Any, seed: int | None = None, episode_id: str | None = None
    ) -> SandmanSession:
        spec = SandboxTask.of(task)
        sandbox = self.client.open(**self._acquire)
        try:
            for path, content in spec.files.items():
                sandbox.write_file(path, content)
        except BaseException:
            sandbox.release()
            raise
        return SandmanSession(
            sandbox, spec, command_timeout=self.command_timeout, episode_id=episode_id
        )


def _arg(arguments: dict[str, Any], name: str) -> str:
    value = arguments.get(name)
    if not isinstance(value, str):
        raise ValueError(f"argument {name!r} must be a string, got {value!r}")
    return value


def _refusal(exc: ExecError) -> ToolResult:
    """execd refused the agent's request: a result the agent reads. Any other refusal
    (a bad token, execd busy) is not the agent's doing and propagates."""
    if isinstance(exc, ExecAuthError) or exc.status not in _AGENT_STATUSES:
        raise exc
    message = f"error: {exc}"
    return ToolResult(
        data=message, error=json.dumps({"code": exc.error_code, "status": exc.status})
    )
