"""A live worker renews the task messages it holds, so only a dead worker's are redelivered.

kombu's Redis transport keeps every delivered, not yet acknowledged message in a sorted
set scored by delivery time, and any consuming worker puts back on its queue whatever
is older than the visibility timeout, whether the worker holding it is alive or not.
With the hour-long default a killed worker's acquires waited an hour (issue 20, item 4);
a short timeout alone would redeliver every acquire still waiting for readiness on a live
worker. So the timeout is short (``Settings.redelivery_s``) and this thread, in every
worker process, re-scores the messages of the requests the worker is running or has
reserved, a few times per timeout, and the leases of the fair queue's requests it serves
(``broker.acquire.fairshare``). A killed worker stops renewing; its messages come back
within one timeout and a sweep. Should a renewal still be missed (a stalled process), a
duplicate delivery converges on the same sandbox: every task is idempotent
(``workers.tasks``).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import redis
from celery.signals import worker_ready, worker_shutdown
from celery.worker import state

from broker.settings import Settings
from workers.app import app
from workers.transport import Channel

log = logging.getLogger(__name__)


def held_tags() -> list[str]:
    """Delivery tags of the messages this worker process runs or has reserved."""
    requests = [*state.active_requests, *state.reserved_requests]
    return sorted({str(r.message.delivery_tag) for r in requests if not r.acknowledged})


class Renewer:
    """Re-scores this worker's unacknowledged messages every ``every_s`` seconds."""

    def __init__(self, client: Any, every_s: float) -> None:
        self.client = client
        self.every_s = every_s
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="sandman-renew", daemon=True)

    def renew(self, tags: list[str]) -> int:
        """Only tags still in the index (XX): an acknowledged or restored message stays
        gone. Returns how many were renewed."""
        if not tags:
            return 0
        now = time.time()
        return int(
            self.client.zadd(Channel.unacked_index_key, dict.fromkeys(tags, now), xx=True, ch=True)
        )

    def _run(self) -> None:
        while not self.stopped.wait(self.every_s):
            try:
                self.renew(held_tags())
                renew_fair_queue()
            except redis.RedisError as exc:  # Redis away: the next round tries again
                log.info("renewing held task messages failed: %s", exc)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join(timeout=5)
        self.client.close()


def renew_fair_queue() -> None:
    """The fair queue's leases on the requests this process serves, renewed in the same
    round as their messages (their lease is shorter, so they come back first)."""
    from workers.runtime import broker

    broker().fair.renew_held()


_renewers: list[Renewer] = []


def _start_renewing(**_: Any) -> None:
    settings = Settings.from_env()
    client = redis.Redis.from_url(
        str(app.conf.broker_url), socket_timeout=5, socket_connect_timeout=5
    )
    renewer = Renewer(client, every_s=settings.redelivery_s / 3)
    renewer.start()
    _renewers.append(renewer)


def _stop_renewing(**_: Any) -> None:
    while _renewers:
        _renewers.pop().stop()


worker_ready.connect(_start_renewing, weak=False)
worker_shutdown.connect(_stop_renewing, weak=False)
