"""The Celery app: Redis transport, JSON only, three queues, and the beat schedule.

Configuration is built lazily from ``Settings.from_env()`` the first time Celery needs
it (``add_defaults`` with a callable), so importing this module reads no environment;
the worker or beat process is the entry point that does.

JSON only: a pickled message is code execution for anyone who can write to Redis.
"""

from __future__ import annotations

import math
from typing import Any

from celery import Celery
from kombu.entity import Queue as KombuQueue

from broker.errors import ConfigError
from broker.names import TASK_QUEUE, Queue, Task
from broker.settings import Settings
from broker.wire.services import known_urls


def transport_options(settings: Settings) -> dict[str, Any]:
    """Redelivery within an acquire's budget: a message that no live worker renewed for
    ``settings.redelivery_s`` goes back to its queue (``workers.leases`` renews what a
    live worker holds, however long the task runs). The restore sweep runs every fifth
    of that, on every call (kombu's default throttle would make it 10x slower), and a
    sweep's mutex left by a killed worker expires as fast."""
    redelivery = settings.redelivery_s
    return {
        "visibility_timeout": redelivery,
        "unacked_restore_interval": max(1.0, redelivery / 5),
        "unacked_restore_throttle": 1,
        "unacked_mutex_expire": math.ceil(redelivery),
    }


def celery_config(settings: Settings) -> dict[str, Any]:
    """Celery settings for ``settings``; shared by workers and beat.

    Starts nothing: the entry point (``sandman up``, ``sandman worker``) ensured the
    services and passed their URLs; a worker started by hand finds the embedded Redis in
    the URLs file ``sandman services up`` wrote."""
    redis_url = known_urls(settings).redis_url
    if not redis_url:
        raise ConfigError("no Redis URL: set SANDMAN_REDIS_URL or run `sandman services up` first")
    return {
        "broker_url": redis_url,
        "result_backend": None,
        "task_ignore_result": True,
        "task_serializer": "json",
        "result_serializer": "json",
        "accept_content": ["json"],
        "event_serializer": "json",
        "task_queues": [KombuQueue(q.value) for q in Queue],
        "task_default_queue": Queue.ACQUIRE.value,
        "task_routes": {task.value: {"queue": queue.value} for task, queue in TASK_QUEUE.items()},
        # Channels that outlive a lost connection (a Redis restart): workers/transport.py
        "broker_transport": "workers.transport:Transport",
        "broker_transport_options": transport_options(settings),
        "broker_connection_retry_on_startup": True,
        "worker_prefetch_multiplier": 1,
        "worker_hijack_root_logger": False,
        "task_acks_on_failure_or_timeout": True,
        "beat_schedule": {
            "gc": {"task": Task.GC, "schedule": settings.gc_interval_s},
            "pool-upkeep": {"task": Task.POOL_UPKEEP, "schedule": 5.0},
        },
        "timezone": "UTC",
    }


app = Celery("sandman", include=["workers.tasks", "workers.leases", "workers.idle"])
app.add_defaults(lambda: celery_config(Settings.from_env()))
