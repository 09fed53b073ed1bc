"""The one Celery producer of a trainer process, shared by the sync and async clients.

An acquire is pushed into its job's fair queue (``broker.wire.fairq``) before its Celery
message, which then only says "one acquire is pending": which request a worker serves is
the fair scheduler's choice (``broker.acquire.fairshare``), not the Celery queue's order.

Publishing goes through kombu's blocking producer in both flavours (the async client
calls it in a thread): there is no asyncio kombu, and one producer pool per client keeps
a burst of a thousand acquires to a few pipelined round trips.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

import redis as redis_lib
from celery import Celery

from broker.client.core import Outbound, batches
from broker.errors import ServiceUnavailable
from broker.names import Task
from broker.wire import fairq

BATCH_MAX = 500


class Enqueuer:
    """JSON-only Celery messages to the broker's Redis (never pickle: see ARCHITECTURE)."""

    def __init__(self, redis_url: str) -> None:
        self.redis_url = redis_url
        self._redis: Any = None  # redis_lib.Redis, made on the first acquire
        self.celery = Celery("sandman-client", broker=redis_url, set_as_current=False)
        self.celery.conf.update(
            task_serializer="json",
            accept_content=["json"],
            result_backend=None,
            task_ignore_result=True,
            broker_connection_retry_on_startup=True,
        )

    def _fair(self, name: str, argsets: list[list[Any]]) -> tuple[str, list[list[Any]]]:
        """An acquire goes into its job's fair queue first; its Celery message then only
        says "one acquire is pending" (``broker.wire.fairq``)."""
        if name != Task.ACQUIRE:
            return name, argsets
        requests = [args[0] for args in argsets]
        if self._redis is None:
            self._redis = redis_lib.Redis.from_url(self.redis_url, socket_timeout=30)
        try:
            fairq.push_all(self._redis, requests)
        except redis_lib.RedisError as exc:
            raise ServiceUnavailable(f"cannot enqueue {len(requests)} acquires: {exc}") from exc
        return Task.ACQUIRE_NEXT, [[r["job"]] for r in requests]

    def _unfair(self, name: str, argsets: list[list[Any]]) -> None:
        """The pending messages were not sent: take their requests back (best effort)."""
        if name == Task.ACQUIRE and self._redis is not None:
            with contextlib.suppress(redis_lib.RedisError):
                fairq.withdraw_all(self._redis, [args[0] for args in argsets])

    def send(self, name: str, args: list[Any], queue: str) -> None:
        task, (args,) = self._fair(name, [args])
        try:
            self.celery.send_task(task, args=args, queue=queue)
        except Exception as exc:  # kombu/redis errors: the broker side is unreachable
            self._unfair(name, [args])
            raise ServiceUnavailable(f"cannot enqueue {name}: {exc}") from exc

    def send_many(self, name: str, argsets: list[list[Any]], queue: str) -> None:
        """Enqueue many tasks in pipelined Redis round trips (kombu publish batches).

        A rollout group or a burst of a thousand acquires costs a few round trips instead
        of one per message, so the whole burst is queued well inside a second."""
        task, sent = self._fair(name, argsets)
        try:
            with (
                self.celery.producer_or_acquire() as producer,
                producer.batch(max_size=BATCH_MAX),
            ):
                for args in sent:
                    self.celery.send_task(task, args=args, queue=queue, producer=producer)
        except Exception as exc:
            self._unfair(name, argsets)
            raise ServiceUnavailable(f"cannot enqueue {len(argsets)} x {name}: {exc}") from exc

    def send_all(self, messages: Iterable[Outbound]) -> None:
        """Any mix of messages, one batch per (task, queue)."""
        for (name, queue), argsets in batches(messages).items():
            self.send_many(name, argsets, queue)

    def close(self) -> None:
        self.celery.close()
        if self._redis is not None:
            self._redis.close()
