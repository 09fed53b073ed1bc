"""Inspect's own portable conformance suite against the ``sandman`` provider, on a real stack.

``inspect_ai.util._sandbox.self_check`` is pulled in whole (as its docstring says): each of
its checks runs here against one sandbox acquired through the provider's own lifecycle
(``task_init`` / ``sample_init``, then ``sample_cleanup`` / ``task_cleanup``), and the
sandbox is shown released afterwards. A check this backend cannot satisfy is an xfail
(strict: it must keep failing) with the reason next to its name in ``XFAIL``.
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from typing import Any

import pytest
from inspect_ai.util._sandbox.self_check import *  # noqa: F403

from broker.integrations.inspectai import SandmanSandboxConfig, SandmanSandboxEnvironment
from broker.ledger import store
from broker.ledger.db import make_session_factory
from broker.ledger.models import Sandbox
from broker.ledger.states import State
from broker.settings import Settings
from tests.support.images import TASK_IMAGE
from tests.support.wait import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.anyio]
IMAGE = TASK_IMAGE

# The local backend runs execd under bubblewrap with every capability dropped and the host
# root mounted read-only as the image: execd cannot switch users (so `user=` other than
# its own is SandboxUserUnsupportedError) and nothing can add a user to /etc/passwd.
XFAIL = {
    "test_exec_as_user": (
        "local backend: bubblewrap drops every capability (no CAP_SETUID) and the image "
        "root is read-only, so adduser and a user switch are impossible; execd's user "
        "switch itself is covered by tests/integration/execd"
    ),
}


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def job(db_engine: Any) -> str:
    name = f"inspect-{secrets.token_hex(3)}"
    with make_session_factory(db_engine).begin() as session:
        store.ensure_job(session, name)
    return name


@pytest.fixture(scope="module")
async def provided(
    stack: Settings, job: str, db_engine: Any, anyio_backend: str
) -> AsyncIterator[SandmanSandboxEnvironment]:
    """One sandbox for the module, through the provider's whole lifecycle."""
    config = SandmanSandboxConfig(image=IMAGE, job=job, redis_url=stack.redis_url)
    await SandmanSandboxEnvironment.task_init("self-check", config)
    envs = await SandmanSandboxEnvironment.sample_init("self-check", config, {})
    env = envs["default"]
    assert isinstance(env, SandmanSandboxEnvironment)
    try:
        yield env
    finally:
        await SandmanSandboxEnvironment.sample_cleanup("self-check", config, envs, False)
        await SandmanSandboxEnvironment.task_cleanup("self-check", config, True)
    sessions = make_session_factory(db_engine)

    def released() -> bool:
        with sessions() as session:
            row = session.get(Sandbox, env.sandbox.id)
            return row is not None and row.state == State.DELETED

    wait_until(released, 60, 0.2, "the conformance sandbox to be released")


@pytest.fixture
async def sandbox_env(
    provided: SandmanSandboxEnvironment, request: pytest.FixtureRequest
) -> AsyncIterator[SandmanSandboxEnvironment]:
    reason = XFAIL.get(request.node.originalname)
    if reason is not None:
        request.node.add_marker(pytest.mark.xfail(reason=reason, strict=True))
    yield provided
