"""The one Celery producer of a trainer process, shared by the sync and async clients.

Publishing goes through kombu's blocking producer in both flavours (the async client
calls it in a thread): there is no asyncio kombu, and one producer pool per client keeps
a burst of a thousand acquires to a few pipelined round trips.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from celery import Celery

from broker.client.core import Outbound, batches
from broker.errors import ServiceUnavailable

BATCH_MAX = 500


class Enqueuer:
    """JSON-only Celery messages to the broker's Redis (never pickle: see ARCHITECTURE)."""

    def __init__(self, redis_url: str) -> None:
        self.celery = Celery("sandman-client", broker=redis_url, set_as_current=False)
        self.celery.conf.update(
            task_serializer="json",
            accept_content=["json"],
            result_backend=None,
            task_ignore_result=True,
            broker_connection_retry_on_startup=True,
        )

    def send(self, name: str, args: list[Any], queue: str) -> None:
        try:
            self.celery.send_task(name, args=args, queue=queue)
        except Exception as exc:  # kombu/redis errors: the broker side is unreachable
            raise ServiceUnavailable(f"cannot enqueue {name}: {exc}") from exc

    def send_many(self, name: str, argsets: list[list[Any]], queue: str) -> None:
        """Enqueue many tasks in pipelined Redis round trips (kombu publish batches).

        A rollout group or a burst of a thousand acquires costs a few round trips instead
        of one per message, so the whole burst is queued well inside a second."""
        try:
            with (
                self.celery.producer_or_acquire() as producer,
                producer.batch(max_size=BATCH_MAX),
            ):
                for args in argsets:
                    self.celery.send_task(name, args=args, queue=queue, producer=producer)
        except Exception as exc:
            raise ServiceUnavailable(f"cannot enqueue {len(argsets)} x {name}: {exc}") from exc

    def send_all(self, messages: Iterable[Outbound]) -> None:
        """Any mix of messages, one batch per (task, queue)."""
        for (name, queue), argsets in batches(messages).items():
            self.send_many(name, argsets, queue)

    def close(self) -> None:
        self.celery.close()
