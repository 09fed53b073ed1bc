"""The trainer-facing grading API: ``grade(task, patch)``, sync and asyncio.

    from broker.client.sync import SandboxClient
    from broker.grading import GradingClient, load_task

    grader = GradingClient(SandboxClient(redis_url), job="rl-1")
    task = load_task("tasks/statlib.json")
    with client.acquire(image=task.image, job="rl-1", workdir=task.repo_path) as rollout:
        ...  # the agent works
        result = grader.grade_rollout(rollout, task)   # extract, then grade elsewhere
    reward = result.reward  # 1.0, 0.0, or None for infra_error (mask the sample)

    result = await grader.agrade(task, patch_bytes)   # from asyncio code

The grading sandbox is always a new acquire with role "grading"; the rollout sandbox is
only read (patch extraction), never graded in place. The async variants run the
blocking client in a worker thread, so many gradings can be awaited concurrently.
"""

from __future__ import annotations

import asyncio
import dataclasses
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TypedDict, Unpack

from broker.client.sync import SandboxClient
from broker.grading.grade import GradeConfig, Grader
from broker.grading.patch import ExtractedPatch, extract_patch
from broker.grading.results import GradeResult
from broker.grading.seam import Acquire, GradingSandbox, SandboxRequest
from broker.grading.spec import TaskSpec, load_task

TaskLike = TaskSpec | str | Path
PatchLike = bytes | str | ExtractedPatch | None


# A SandboxRequest field is the client's acquire keyword of the same name, but for these.
_CLIENT_WORD = {"memory_b": "memory", "timeout_s": "timeout"}


def broker_acquire(client: SandboxClient, job: str) -> Acquire:
    """Grading sandboxes from the broker (pools, pacing and checked reuse per the job)."""

    def acquire(request: SandboxRequest) -> AbstractContextManager[GradingSandbox]:
        fields = dataclasses.asdict(request)
        return client.acquire(job=job, **{_CLIENT_WORD.get(k, k): v for k, v in fields.items()})

    return acquire


def _task(task: TaskLike) -> TaskSpec:
    return task if isinstance(task, TaskSpec) else load_task(task)


class GradingClient:
    def __init__(
        self,
        client: SandboxClient | None = None,
        *,
        job: str = "",
        config: GradeConfig | None = None,
        acquire: Acquire | None = None,
    ) -> None:
        if acquire is None:
            if client is None or not job:
                raise ValueError("give a SandboxClient and a job, or an acquire function")
            acquire = broker_acquire(client, job)
        self.grader = Grader(acquire, config)

    def grade(self, task: TaskLike, patch: PatchLike) -> GradeResult:
        return self.grader.grade(_task(task), patch)

    async def agrade(self, task: TaskLike, patch: PatchLike) -> GradeResult:
        return await asyncio.to_thread(self.grade, task, patch)

    def extract(self, rollout: GradingSandbox, task: TaskLike) -> ExtractedPatch:
        return extract_patch(rollout, _task(task))

    def grade_rollout(self, rollout: GradingSandbox, task: TaskLike) -> GradeResult:
        spec = _task(task)
        return self.grade(spec, extract_patch(rollout, spec))

    async def agrade_rollout(self, rollout: GradingSandbox, task: TaskLike) -> GradeResult:
        return await asyncio.to_thread(self.grade_rollout, rollout, task)


class GradeOptions(TypedDict, total=False):
    """The keywords of ``grade``/``agrade``: those of a ``GradingClient``."""

    client: SandboxClient | None
    job: str
    config: GradeConfig | None
    acquire: Acquire | None


def grade(task: TaskLike, patch: PatchLike, **options: Unpack[GradeOptions]) -> GradeResult:
    """One-shot ``grade(task, patch)`` (build a GradingClient to grade many)."""
    return GradingClient(**options).grade(task, patch)


async def agrade(task: TaskLike, patch: PatchLike, **options: Unpack[GradeOptions]) -> GradeResult:
    return await GradingClient(**options).agrade(task, patch)
