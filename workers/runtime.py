"""The worker process's composition root, built once on first use.

Built lazily (not at import) because Celery imports task modules before forking and
before settings are meant to be read; each worker process gets its own engine, Redis
pool and backend. Everything comes from ``broker.acquire.root.Root``: this module only
says "a worker" (pool sizes, may create the sandbox namespace) and how to send a task.
The services were started by the entry point (``sandman up`` / ``sandman worker``).
"""

from __future__ import annotations

import threading
from typing import Any

from broker.acquire.root import WORKER, Root
from broker.acquire.service import Broker
from broker.settings import Settings

_lock = threading.Lock()
_roots: list[Root] = []


def _enqueue(name: str, args: list[Any], queue: str) -> None:
    from workers.app import app

    app.send_task(name, args=args, queue=queue)


def root() -> Root:
    if not _roots:
        with _lock:
            if not _roots:
                _roots.append(Root(Settings.from_env(), WORKER, enqueue=_enqueue, actor="worker"))
    return _roots[0]


def broker() -> Broker:
    return root().broker
