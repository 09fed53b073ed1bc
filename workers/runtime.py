"""Per-process broker services for the worker, built once on first use.

Built lazily (not at import) because Celery imports task modules before forking and
before settings are meant to be read; each worker process gets its own engine, Redis
pool and backend.
"""

from __future__ import annotations

import threading
from typing import Any

from broker.acquire.service import Broker

_lock = threading.Lock()
_built: dict[str, Broker] = {}


def _enqueue(name: str, args: list[Any], queue: str) -> None:
    from workers.app import app

    app.send_task(name, args=args, queue=queue)


def broker() -> Broker:
    if "broker" not in _built:
        with _lock:
            if "broker" not in _built:
                _built["broker"] = _build()
    return _built["broker"]


def _build() -> Broker:
    import redis

    from broker.acquire.service import make_backend
    from broker.ledger.db import make_engine, make_session_factory
    from broker.local.services import ensure_services
    from broker.settings import Settings

    settings = Settings.from_env()
    urls = ensure_services(settings)
    sessions = make_session_factory(make_engine(urls.database_url, pool_size=20, max_overflow=60))
    client = redis.Redis.from_url(
        urls.redis_url, max_connections=200, socket_timeout=30, socket_connect_timeout=5
    )
    return Broker(
        settings, sessions, make_backend(settings), client, enqueue=_enqueue, actor="worker"
    )
