"""How an acquire result reaches the trainer that waits for it: one Redis list per request.

The worker pushes the outcome to ``sandman:result:<request_id>``; the client blocks on
BLPOP, so the answer arrives within a Redis round trip of being ready (no result-backend
polling). A trainer that gives up sets ``sandman:cancel:<request_id>`` and then pops the
list once more. The worker delivers with one atomic script that refuses when the cancel
flag is set, so either the trainer sees the lease (and releases it) or the worker sees
the cancel (and releases it): a late answer never strands a sandbox.
"""

from __future__ import annotations

import json
from typing import Any

from broker import names
from broker.names import cancel_key, result_key

__all__ = [
    "CANCEL_LUA",
    "cancel",
    "cancel_call",
    "cancel_key",
    "cancelled",
    "deliver",
    "parse",
    "result_key",
]

RESULT_TTL_S = 3600
DONE_PREFIX = names.ACQUIRED_PREFIX

_DELIVER_LUA = """
if redis.call('EXISTS', KEYS[2]) == 1 then
  return 0
end
redis.call('RPUSH', KEYS[1], ARGV[1])
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[2]))
return 1
"""


# KEYS: result list, cancel flag. ARGV: flag TTL. Set the flag, then take a result that
# slipped in before it (the worker's deliver refuses once the flag is set).
CANCEL_LUA = """
redis.call('SET', KEYS[2], '1', 'EX', tonumber(ARGV[1]))
return redis.call('LPOP', KEYS[1])
"""


def deliver(redis: Any, request_id: str, payload: dict[str, Any]) -> bool:
    """Push the outcome unless the trainer already gave up; False means 'cancelled'."""
    script = redis.register_script(_DELIVER_LUA)
    keys = [names.result_key(request_id), names.cancel_key(request_id)]
    return bool(script(keys=keys, args=[json.dumps(payload), RESULT_TTL_S]))


def cancel_call(request_id: str) -> tuple[list[str], list[Any]]:
    """KEYS and ARGV of ``CANCEL_LUA``: the same give-up from the sync and async clients."""
    return [names.result_key(request_id), names.cancel_key(request_id)], [RESULT_TTL_S]


def cancel(redis: Any, request_id: str) -> dict[str, Any] | None:
    """Mark the request abandoned; return a result that slipped in just before, if any."""
    keys, args = cancel_call(request_id)
    raw = redis.register_script(CANCEL_LUA)(keys=keys, args=args)
    return parse(raw) if raw else None


def cancelled(redis: Any, request_id: str) -> bool:
    return bool(redis.exists(names.cancel_key(request_id)))


def parse(raw: bytes | str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(raw)
    return data
