"""What the views talk to: the ledger (SQLAlchemy), Redis, and the pod backend.

Created lazily and cached per app. A backend or Redis that cannot be reached is reported
as ``None`` plus a reason, so pages degrade to "unavailable" instead of failing: the
ledger alone is enough to see what the broker believes, which is most of what an
operator needs during an incident.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from broker.ledger.db import make_engine, make_session_factory
from broker.settings import Settings

log = logging.getLogger(__name__)
RETRY_S = 15.0  # after a failure, how long pages use "unavailable" before trying again


class Services:
    def __init__(
        self,
        settings: Settings,
        *,
        backend: Any | None = None,
        redis: Any | None = None,
        database_url: str | None = None,
    ) -> None:
        self.settings = settings
        self._database_url = database_url or settings.database_url
        self._backend = backend
        self._backend_error: str | None = None
        self._redis = redis
        self._redis_error: str | None = None
        self._sessions: sessionmaker[Session] | None = None
        self._redis_failed_at = 0.0
        self._backend_failed_at = 0.0
        self._lock = threading.Lock()

    # -- ledger -----------------------------------------------------------------------

    @property
    def sessions(self) -> sessionmaker[Session]:
        with self._lock:
            if self._sessions is None:
                url = self._database_url
                if not url:  # embedded defaults: the same PostgreSQL `sandman up` starts
                    from broker.local.services import ensure_postgres

                    url = ensure_postgres(self.settings)
                self._sessions = make_session_factory(make_engine(url, pool_size=5))
            return self._sessions

    # -- redis ------------------------------------------------------------------------

    def redis(self) -> Any | None:
        """A Redis client, or None when it is not configured or does not answer."""
        with self._lock:
            if self._redis is not None:
                return self._redis
            url = self.settings.redis_url
            if not url:
                self._redis_error = "SANDMAN_REDIS_URL is not set"
                return None
            if time.monotonic() - self._redis_failed_at < RETRY_S:
                return None
            try:
                import redis

                client = redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)
                client.ping()
            except Exception as exc:
                self._redis_error = f"{type(exc).__name__}"
                self._redis_failed_at = time.monotonic()
                log.warning("redis unavailable: %s", type(exc).__name__)
                return None
            self._redis = client
            return client

    @property
    def redis_error(self) -> str | None:
        return self._redis_error

    # -- pods -------------------------------------------------------------------------

    def backend(self) -> Any | None:
        """The pod backend for live read-back, or None (reason in ``backend_error``)."""
        with self._lock:
            retry = time.monotonic() - self._backend_failed_at >= RETRY_S
            if self._backend is None and retry:
                try:
                    self._backend = _make_backend(self.settings)
                    self._backend_error = None
                except Exception as exc:
                    self._backend_error = f"{type(exc).__name__}: {str(exc)[:200]}"
                    self._backend_failed_at = time.monotonic()
                    log.warning("pod backend unavailable: %s", type(exc).__name__)
            return self._backend

    @property
    def backend_error(self) -> str | None:
        return self._backend_error

    def provider(self, actor: str) -> Any:
        """A Provider acting as ``actor``: every ledger write it makes names the operator."""
        from broker.ownership.provider import Provider

        backend = self.backend()
        if backend is None:
            raise RuntimeError(f"pod backend unavailable: {self._backend_error}")
        return Provider(self.settings, self.sessions, backend, actor=actor)

    def dispose(self) -> None:
        """Close pooled connections (tests and shutdown); the app stays usable after."""
        with self._lock:
            if self._sessions is not None:
                bind = self._sessions.kw.get("bind")
                if bind is not None:
                    bind.dispose()
                self._sessions = None
            if self._redis is not None and hasattr(self._redis, "close"):
                self._redis.close()

    def close_request(self) -> None:
        """Nothing per request yet: sessions are opened and closed by each query."""


def _make_backend(settings: Settings) -> Any:
    """Like ``broker.backends.factory.make_backend`` but read-only at start: the UI never
    creates the sandbox namespace (the broker's workers do)."""
    if settings.backend == "kubernetes":
        from broker.backends.kube.backend import KubeBackend

        return KubeBackend.from_settings(settings)
    from broker.backends.local import LocalBackend

    return LocalBackend(settings)
