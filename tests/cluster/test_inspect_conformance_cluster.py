"""Inspect's own conformance suite against the ``sandman`` provider on the local cluster:
a real pod of the SWE task image on the real node, execd as the container command.

Same module shape as tests/integration/integrations/test_inspect_conformance.py; a check
the pod cannot satisfy is a strict xfail with its reason in ``XFAIL``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from inspect_ai.util._sandbox.self_check import *  # noqa: F403

from broker.integrations.inspectai import SandmanSandboxConfig, SandmanSandboxEnvironment
from tests.cluster.conftest import SWE_TASK_IMAGE
from tests.cluster.test_grading_cluster import JOB, stack  # noqa: F401 (the fixture)

pytestmark = [pytest.mark.cluster, pytest.mark.anyio]
# execd is the pod's container command and runs as root with root's usual capabilities
# (as a Docker container does by default): CAP_DAC_OVERRIDE reads and writes a file
# whatever its mode bits, exactly as `open` as root on the host does.
ROOT_IGNORES_MODES = (
    "execd runs as root in the pod with CAP_DAC_OVERRIDE, which reads and writes a file "
    "whatever its mode bits (as open() as root does); the refusal itself is checked on "
    "the local backend, where execd has no capabilities"
)
XFAIL: dict[str, str] = {
    "test_read_file_not_allowed": ROOT_IGNORES_MODES,
    "test_write_text_file_without_permissions": ROOT_IGNORES_MODES,
    "test_write_binary_file_without_permissions": ROOT_IGNORES_MODES,
}


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
async def provided(
    stack: dict[str, Any],  # noqa: F811
    anyio_backend: str,
) -> AsyncIterator[SandmanSandboxEnvironment]:
    config = SandmanSandboxConfig(
        image=SWE_TASK_IMAGE,
        job=JOB,
        cpu=0.5,
        memory="1Gi",
        redis_url=stack["env"]["SANDMAN_REDIS_URL"],
        acquire={"timeout": 300.0},
    )
    await SandmanSandboxEnvironment.task_init("self-check", config)
    envs = await SandmanSandboxEnvironment.sample_init("self-check", config, {})
    env = envs["default"]
    assert isinstance(env, SandmanSandboxEnvironment)
    try:
        yield env
    finally:
        await SandmanSandboxEnvironment.sample_cleanup("self-check", config, envs, False)
        await SandmanSandboxEnvironment.task_cleanup("self-check", config, True)


@pytest.fixture
async def sandbox_env(
    provided: SandmanSandboxEnvironment, request: pytest.FixtureRequest
) -> AsyncIterator[SandmanSandboxEnvironment]:
    reason = XFAIL.get(request.node.originalname)
    if reason is not None:
        request.node.add_marker(pytest.mark.xfail(reason=reason, strict=True))
    yield provided
