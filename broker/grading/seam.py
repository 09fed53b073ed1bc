"""The one seam grading depends on: a sandbox that runs commands and moves files.

``broker.client.sync.Sandbox`` (a leased pod) and ``broker.grading.direct.DirectSandbox`` (an
execd you started yourself) both satisfy it; unit tests put fakes here and nowhere else.
An ``Acquire`` turns a request into a context manager that releases on exit.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Protocol

from broker.client.sync import ExecResult


class GradingSandbox(Protocol):
    id: str

    def exec(
        self, command: str, *, timeout: float = 60.0, max_output_bytes: int | None = None
    ) -> ExecResult: ...

    def read_file(self, path: str) -> bytes: ...

    def write_file(self, path: str, content: bytes | str, *, mode: int | None = None) -> int: ...


@dataclass(frozen=True)
class SandboxRequest:
    """What grading asks for: always role "grading", never the rollout's sandbox."""

    image: str
    cpu: float
    memory_b: int
    env: dict[str, str] = field(default_factory=dict)
    workdir: str = "/"
    base_commit: str | None = None
    image_digest: str | None = None
    role: str = "grading"
    timeout_s: float = 600.0
    visible_cpus: int | None = None  # delivered: execd pins every command to this many
    # The task's declared egress as the sandbox's own policy ("deny"/"allow"; None: the
    # job's): delivered and guarded by the broker, then checked by the probe.
    egress: str | None = None


Acquire = Callable[[SandboxRequest], AbstractContextManager[GradingSandbox]]
