"""What a trainer client is apart from its transport, shared by ``sync`` and ``aio``.

Whose leases it holds, how often it renews them, how large its pools are and the one
Celery producer it publishes through: both transports start here, so their options and
defaults cannot drift apart again (they once did: see ``broker.client.core``).
"""

from __future__ import annotations

from typing import Any, TypedDict

import httpx

from broker.client import core
from broker.client.enqueue import Enqueuer
from broker.errors import SandboxLost
from broker.wire.execd import Endpoint
from broker.wire.types import Lease

SANDBOX_KEEPALIVE = 8  # idle connections kept per sandbox by a per-sandbox pool


class ClientOptions(TypedDict, total=False):
    """The keyword options of both clients: ``SandboxClient(url, owner=..., ...)``."""

    owner: str | None
    heartbeat_s: float | None
    max_connections: int


class ClientBase:
    """Options and producer of a client; the transport adds its Redis and HTTP clients."""

    def __init__(
        self,
        redis_url: str,
        *,
        owner: str | None = None,
        heartbeat_s: float | None = None,
        max_connections: int = 512,
    ) -> None:
        self.redis_url = redis_url
        self.owner = owner or core.default_owner()
        self.heartbeat_s = heartbeat_s
        self.max_connections = max_connections
        self.enqueuer = Enqueuer(redis_url)

    def redis_options(self) -> dict[str, Any]:
        """Keyword arguments of the transport's ``Redis.from_url``."""
        return {"max_connections": self.max_connections, **core.REDIS_OPTIONS}

    def http_options(self) -> dict[str, Any]:
        """Keyword arguments of the transport's httpx client: every execd connection may
        be kept alive, so a burst of calls does not reconnect."""
        n = self.max_connections
        limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
        return {"limits": limits, "timeout": core.HTTP_TIMEOUT_S}

    def sandbox_http_options(self) -> dict[str, Any]:
        """The same for a pool that serves one sandbox (the async client's): as many
        calls at once as the client allows, a few connections kept alive for the next."""
        limits = httpx.Limits(
            max_connections=self.max_connections, max_keepalive_connections=SANDBOX_KEEPALIVE
        )
        return {"limits": limits, "timeout": core.HTTP_TIMEOUT_S}


class SandboxBase:
    """One acquired sandbox apart from its transport: the lease, its execd endpoint, and
    whether it was released, after which every execd call is refused (``SandboxLost``)."""

    def __init__(self, lease: Lease, *, acquire_s: float) -> None:
        self.lease = lease
        self.id = lease.sandbox_id
        self.acquire_s = acquire_s
        self.released = False
        # The acquire arguments it was opened with: its forks are acquired alike.
        self.spec: dict[str, Any] = {}
        self._execd = Endpoint(lease.address, lease.token, who=f"execd of {self.id}")

    def _check_held(self) -> None:
        if self.released:
            raise SandboxLost(f"sandbox {self.id} was already released")

    def _first_release(self) -> bool:
        """True once: the release is queued a single time however often it is called."""
        first, self.released = not self.released, True
        return first
