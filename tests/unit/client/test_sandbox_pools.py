"""The async client's per-sandbox connection pools: one each, closed with the sandbox."""

import asyncio

import pytest

from broker.client.aio import SandboxPools
from broker.client.base import SANDBOX_KEEPALIVE, ClientBase

pytestmark = pytest.mark.unit


class Held:
    """Stands in for an AsyncSandbox: the pools only key on its identity."""


def test_each_sandbox_gets_its_own_pool_closed_with_it():
    async def scenario() -> None:
        pools = SandboxPools({})
        a, b = Held(), Held()
        http_a, http_b = pools.open(a), pools.open(b)  # type: ignore[arg-type]
        assert http_a is not http_b
        await pools.close(a)  # type: ignore[arg-type]
        assert http_a.is_closed and not http_b.is_closed
        await pools.close(a)  # type: ignore[arg-type]  # twice is harmless
        await pools.close_all()
        assert http_b.is_closed

    asyncio.run(scenario())


def test_pools_share_one_ssl_context():
    async def scenario() -> None:
        pools = SandboxPools({})
        pools.open(Held())  # type: ignore[arg-type]
        first = pools._ssl
        pools.open(Held())  # type: ignore[arg-type]
        assert first is not None and pools._ssl is first
        await pools.close_all()

    asyncio.run(scenario())


def test_a_sandbox_pool_keeps_few_idle_connections():
    base = ClientBase.__new__(ClientBase)
    base.max_connections = 64
    limits = base.sandbox_http_options()["limits"]
    assert (limits.max_connections, limits.max_keepalive_connections) == (64, SANDBOX_KEEPALIVE)
