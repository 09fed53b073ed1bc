"""The composition root: the one place that turns Settings into the broker's parts.

Workers, the admin UI, the CLI, the demo and the benches all get their ledger sessions,
Redis, pod backend, Provider, acquire service and GC from a ``Root``; nothing else
constructs a backend or a Provider. Each part is built on first use and cached, because a
worker process builds everything once while a page of the admin UI needs only the ledger.

The root never starts a service. URLs come from the settings or from the file
``sandman services up`` records (``broker.wire.services.known_urls``); entry points that
may start the embedded services (``sandman up``, ``sandman worker``) do so before they
build a root. Two ways to ask for Redis and the backend, because the two kinds of caller
want different failures:

- ``redis()`` / ``backend()`` answer ``None`` (reason in ``redis_error`` / ``backend_error``)
  and retry only after ``RETRY_S``: the admin UI shows "unavailable" and keeps serving
  the ledger, which is most of what an operator needs during an incident.
- ``need_redis()`` / ``need_backend()`` raise the typed error (``ServiceUnavailable``,
  ``NamespaceUnavailable``...): a worker must fail loudly, not run half-wired.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from broker.acquire.service import Broker
from broker.backends.base import Backend
from broker.backends.factory import make_backend
from broker.errors import ServiceUnavailable
from broker.ledger.db import make_engine, make_session_factory
from broker.ownership.operator import GcRunner
from broker.ownership.provider import Provider
from broker.pacing import Pacer
from broker.pools.store import WarmStore
from broker.pools.upkeep import Enqueue
from broker.settings import Settings
from broker.wire.services import known_urls

log = logging.getLogger(__name__)
RETRY_S = 15.0  # after a failure, how long ``redis()``/``backend()`` answer None before retrying


@dataclass(frozen=True)
class Profile:
    """How a kind of process uses the parts: pool sizes, Redis timeouts, and whether it may
    create the sandbox namespace (only processes that create pods may)."""

    db_pool: int
    db_overflow: int
    redis_timeout_s: float
    redis_connect_s: float
    redis_connections: int | None
    ensure_namespace: bool


# Worker threads block on the pacer and on readiness: large pools, patient Redis reads.
WORKER = Profile(20, 60, 30.0, 5.0, 200, ensure_namespace=True)
# The admin UI is read-only on the cluster and must answer quickly when Redis is down.
WEB = Profile(5, 10, 2.0, 2.0, None, ensure_namespace=False)
# One-shot commands (gc, audit, job, demo, benches): a couple of connections.
TOOL = Profile(2, 2, 10.0, 5.0, None, ensure_namespace=True)


class Root:
    """Settings in, the broker's parts out; built lazily, cached, thread-safe."""

    def __init__(
        self,
        settings: Settings,
        profile: Profile = TOOL,
        *,
        database_url: str = "",
        redis_url: str = "",
        backend: Backend | None = None,
        redis: Any | None = None,
        enqueue: Enqueue | None = None,
        actor: str = "broker",
    ) -> None:
        """``database_url``/``redis_url`` override the settings (an entry point that just
        started the services passes theirs); ``backend``/``redis`` inject ready-made parts
        (tests: a fake backend at the seam). ``enqueue`` sends a task by name (workers)."""
        self.settings = settings
        self.profile = profile
        self.actor = actor
        self._database_url = database_url
        self._redis_url = redis_url
        self._enqueue = enqueue
        self._backend = backend
        self._built_backend = False  # an injected backend belongs to the caller
        self._redis = redis
        self._backend_error: str | None = None
        self._redis_error: str | None = None
        self._backend_failed_at = -RETRY_S
        self._redis_failed_at = -RETRY_S
        self._sessions: sessionmaker[Session] | None = None
        self._providers: dict[str, Provider] = {}
        self._broker: Broker | None = None
        self._warm: WarmStore | None = None
        self._lock = threading.RLock()

    # -- ledger -----------------------------------------------------------------------

    @property
    def sessions(self) -> sessionmaker[Session]:
        with self._lock:
            if self._sessions is None:
                url = self._database_url or known_urls(self.settings).database_url
                if not url:
                    raise ServiceUnavailable(
                        "no database URL: set SANDMAN_DATABASE_URL or run `sandman services up`"
                    )
                engine = make_engine(
                    url, pool_size=self.profile.db_pool, max_overflow=self.profile.db_overflow
                )
                self._sessions = make_session_factory(engine)
            return self._sessions

    # -- redis ------------------------------------------------------------------------

    def redis(self) -> Any | None:
        """A Redis client that answered a ping, or None (reason in ``redis_error``)."""
        with self._lock:
            if self._redis is not None:
                return self._redis
            if time.monotonic() - self._redis_failed_at < RETRY_S:
                return None
            try:
                client = self._connect_redis()
                client.ping()
            except Exception as exc:
                unset = isinstance(exc, ServiceUnavailable)
                self._redis_error = str(exc) if unset else type(exc).__name__
                self._redis_failed_at = time.monotonic()
                log.warning("redis unavailable: %s", self._redis_error)
                return None
            self._redis, self._redis_error = client, None
            return client

    def need_redis(self) -> Any:
        """The Redis client, or ServiceUnavailable when no URL is known (no ping: a worker's
        connection pool reconnects by itself when Redis comes back)."""
        with self._lock:
            if self._redis is None:
                self._redis = self._connect_redis()
            return self._redis

    @property
    def redis_error(self) -> str | None:
        return self._redis_error

    def _connect_redis(self) -> Any:
        url = self._redis_url or known_urls(self.settings).redis_url
        if not url:
            raise ServiceUnavailable(
                "no Redis URL: set SANDMAN_REDIS_URL or run `sandman services up`"
            )
        import redis

        return redis.Redis.from_url(
            url,
            max_connections=self.profile.redis_connections,
            socket_timeout=self.profile.redis_timeout_s,
            socket_connect_timeout=self.profile.redis_connect_s,
        )

    # -- pods -------------------------------------------------------------------------

    def backend(self) -> Backend | None:
        """The pod backend, or None (reason in ``backend_error``)."""
        with self._lock:
            if self._backend is None and time.monotonic() - self._backend_failed_at >= RETRY_S:
                try:
                    self.need_backend()
                except Exception as exc:
                    self._backend_error = f"{type(exc).__name__}: {str(exc)[:300]}"
                    self._backend_failed_at = time.monotonic()
                    log.warning("pod backend unavailable: %s", self._backend_error)
            return self._backend

    def need_backend(self) -> Backend:
        """The pod backend; its construction error (e.g. NamespaceUnavailable) otherwise."""
        with self._lock:
            if self._backend is None:
                self._backend = make_backend(
                    self.settings, ensure_namespace=self.profile.ensure_namespace
                )
                self._backend_error, self._built_backend = None, True
            return self._backend

    @property
    def backend_error(self) -> str | None:
        return self._backend_error

    def provider(self, actor: str | None = None) -> Provider:
        """The Provider acting as ``actor`` (default: the root's); every ledger write it
        makes names that actor, so operators' actions are audited as theirs."""
        who = actor or self.actor
        with self._lock:
            if who not in self._providers:
                self._providers[who] = Provider(
                    self.settings, self.sessions, self.need_backend(), actor=who
                )
            return self._providers[who]

    # -- services ---------------------------------------------------------------------

    @property
    def broker(self) -> Broker:
        """The acquire service the worker tasks call (one per process)."""
        with self._lock:
            if self._broker is None:
                provider = self.provider()
                self._broker = Broker(
                    self.settings,
                    self.sessions,
                    provider.backend,
                    self.need_redis(),
                    enqueue=self._enqueue,
                    provider=provider,
                    actor=self.actor,
                )
            return self._broker

    @property
    def pacer(self) -> Pacer:
        """The shared create pacer (the acquire service's own: one per process)."""
        return self.broker.pacer

    def warm(self) -> WarmStore | None:
        """The warm-pool store for readers (the admin UI), or None without Redis."""
        with self._lock:
            if self._broker is not None:
                return self._broker.warm
            redis = self.redis()
            if self._warm is None and redis is not None:
                self._warm = WarmStore(redis)
            return self._warm

    @property
    def gc(self) -> GcRunner:
        """GC passes, with their summary published for the admin UI and /metrics."""
        return GcRunner(self.provider, self.redis)

    def dispose(self) -> None:
        """Close pooled connections and watches (tests, shutdown); parts are rebuilt on use."""
        with self._lock:
            if self._sessions is not None:
                bind = self._sessions.kw.get("bind")
                if bind is not None:
                    bind.dispose()
                self._sessions = None
            self._providers.clear()
            self._broker = self._warm = None
            if self._built_backend and self._backend is not None:
                close = getattr(self._backend, "close", None)  # KubeBackend: its pod watches
                if close is not None:
                    close()
                self._backend = None
            if self._redis is not None and hasattr(self._redis, "close"):
                self._redis.close()
