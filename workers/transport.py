"""kombu's Redis transport, with channels that keep their connection parameters.

Why: when Redis goes away while acks-late tasks run, Celery's consumer first
``collect()``s its connection (which detaches the transport: ``transport.client = None``)
and then ``close()``s it. The close closes the default channel, whose QoS restores the
unacknowledged messages through a fresh connection pool, built from
``self.connection.client``: now ``None``. The ``AttributeError`` (``'NoneType' object has
no attribute 'hostname'`` in ``_connparams``) is not a connection error, so nothing
catches it and the worker exits with "Unrecoverable error" (issue 20, item 3). The same
happens to a task thread that acknowledges its message after the reconnect: its message
belongs to the old channel.

A channel here computes its connection parameters while the transport is still attached
(when the channel opens) and reuses them afterwards. An old channel can then still reach
Redis: its restore fails with a connection error while Redis is down (which kombu and
Celery do handle), and a late acknowledgement after Redis came back removes the message
from the shared unacked index, as it should, instead of leaving it to be redelivered.
"""

from __future__ import annotations

from typing import Any

from kombu.transport import redis as kombu_redis


class Channel(kombu_redis.Channel):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[no-untyped-call]
        parent = super()._connparams
        self._params = {
            flag: dict(parent(asynchronous=flag))  # type: ignore[no-untyped-call]
            for flag in (False, True)
        }

    def _connparams(self, asynchronous: bool = False) -> dict[str, Any]:
        if self.connection.client is not None:
            return dict(super()._connparams(asynchronous=asynchronous))  # type: ignore[no-untyped-call]
        return dict(self._params[asynchronous])


class Transport(kombu_redis.Transport):
    Channel = Channel
