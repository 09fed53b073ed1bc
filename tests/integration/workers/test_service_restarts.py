"""Workers ride out a Redis restart and a PostgreSQL restart and keep serving (issue 20,
item 3): the same worker processes answer acquires afterwards.

The Redis restart happens while an acks-late acquire is in flight (held at its job's live
cap), which is what made the worker exit before: closing the lost connection restored the
unacked message through a transport already detached from its connection
(``AttributeError: 'NoneType' object has no attribute 'hostname'``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

import pytest
import redis

from broker.client.sync import SandboxClient
from broker.errors import SandmanError
from broker.local.services import _port_open as port_open
from broker.local.services import ensure_postgres, ensure_redis, stop_postgres, stop_redis
from broker.names import Queue
from tests.integration.workers.conftest import OwnBroker
from tests.support.images import TASK_IMAGE
from tests.support.wait import wait_until
from workers.transport import Channel

pytestmark = pytest.mark.integration
IMAGE = TASK_IMAGE


def _round_trip(broker: OwnBroker, job: str) -> None:
    """One acquire, one exec, one release, retried only while a service comes back."""

    def attempt() -> bool:
        for name, proc in broker.workers.items():
            if proc.poll() is not None:
                pytest.fail(f"worker {name} died:\n{broker.log(name).read_text()[-3000:]}")
        client = SandboxClient(broker.redis_url, owner="pytest")
        try:
            with client.acquire(image=IMAGE, job=job, timeout=60) as sandbox:
                assert sandbox.exec("echo ok").stdout.strip() == "ok"
            return True
        except SandmanError:
            return False
        finally:
            client.close()

    wait_until(attempt, timeout=240, interval=1.0, what=f"an acquire on {job}")


def test_workers_keep_serving_after_redis_and_postgres_restarts(own_broker: OwnBroker) -> None:
    settings = own_broker.settings
    acquirer = own_broker.start_worker("acquire", Queue.ACQUIRE.value)
    control = own_broker.start_worker("control", f"{Queue.RELEASE},{Queue.POOL}")
    pids = {acquirer.pid, control.pid}
    plain = own_broker.job("plain")
    capped = own_broker.job("capped", max_live=1)
    _round_trip(own_broker, plain)

    # An acquire held in the worker (acks late, unacknowledged) across the restart.
    client = SandboxClient(own_broker.redis_url, owner="pytest")
    holder = client.open(image=IMAGE, job=capped, timeout=60)
    waiter = threading.Thread(
        target=lambda: _ignore(lambda: client.open(image=IMAGE, job=capped, timeout=30)),
        daemon=True,
    )
    waiter.start()
    raw = redis.Redis.from_url(own_broker.redis_url)
    wait_until(lambda: raw.hlen(Channel.unacked_key) >= 1, what="an unacked acquire")
    raw.close()

    stop_redis(settings)
    wait_until(lambda: not port_open(settings.embedded_redis_port), what="Redis down")
    ensure_redis(settings)
    waiter.join(timeout=120)
    _ignore(holder.release)
    client.close()
    _round_trip(own_broker, plain)

    stop_postgres(settings)
    wait_until(lambda: not port_open(settings.embedded_pg_port), what="PostgreSQL down")
    ensure_postgres(settings)
    _round_trip(own_broker, plain)

    assert {acquirer.pid, control.pid} == pids
    assert acquirer.poll() is None, own_broker.log("acquire").read_text()[-3000:]
    assert control.poll() is None, own_broker.log("control").read_text()[-3000:]
    for name in ("acquire", "control"):
        assert "Unrecoverable error" not in own_broker.log(name).read_text()


def _ignore(fn: Callable[[], object]) -> None:
    """The in-flight acquire's own outcome does not matter here, only the worker's."""
    with contextlib.suppress(SandmanError):
        fn()
