"""A killed worker's acquire is redelivered within the acquire's own budget (issue 20,
item 4): not after kombu's hour-long default visibility timeout."""

from __future__ import annotations

import os
import signal
import threading

import pytest
import redis

from broker.client.sync import SandboxClient
from broker.names import Queue
from tests.integration.workers.conftest import OwnBroker
from tests.support.images import TASK_IMAGE
from tests.support.wait import wait_until
from workers.transport import Channel

pytestmark = pytest.mark.integration
IMAGE = TASK_IMAGE


def test_acquire_held_by_a_killed_worker_completes_for_the_trainer(
    own_broker: OwnBroker,
) -> None:
    first = own_broker.start_worker("acquire-1", Queue.ACQUIRE.value)
    own_broker.start_worker("control", f"{Queue.RELEASE},{Queue.POOL}")
    capped = own_broker.job("capped", max_live=1)
    client = SandboxClient(own_broker.redis_url, owner="pytest")
    holder = client.open(image=IMAGE, job=capped, timeout=60)
    outcome: list[object] = []

    def trainer() -> None:  # its timeout (the budget) is far below kombu's default hour
        try:
            sandbox = client.open(image=IMAGE, job=capped, timeout=120)
            outcome.append(sandbox)
        except Exception as exc:
            outcome.append(exc)

    thread = threading.Thread(target=trainer, daemon=True)
    thread.start()
    raw = redis.Redis.from_url(own_broker.redis_url)
    wait_until(lambda: raw.hlen(Channel.unacked_key) >= 1, what="the acquire held by a worker")
    os.kill(first.pid, signal.SIGKILL)
    first.wait()
    holder.release()
    own_broker.start_worker("acquire-2", Queue.ACQUIRE.value)
    thread.join(timeout=180)
    raw.close()
    assert outcome, "the trainer's acquire did not return"
    sandbox = outcome[0]
    assert not isinstance(sandbox, BaseException), repr(sandbox)
    assert sandbox.exec("echo ok").stdout.strip() == "ok"  # type: ignore[attr-defined]
    sandbox.release()  # type: ignore[attr-defined]
    client.close()
