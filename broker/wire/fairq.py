"""The fair acquire queue as both sides speak it: its Redis keys and the trainer's push.

Why a queue of our own in front of Celery: the Celery queue is one FIFO, so a job that
queued 10,000 acquires delayed every acquire queued after them, whatever the per-job
pacing said. Now a trainer writes each acquire request into its job's list (one per
priority) and sends a Celery message that only means "one acquire is pending"; the worker
that takes any such message asks the scheduler (``broker.acquire.fairshare``) which
request is fair to serve next. The push is defined here, where the trainer client may
import it; the scheduler builds on these keys.

Priority comes from the request's role: grading acquires (``Role.GRADING``) are served
before the rollout acquires of the same tenant. It moves a request ahead in its tenant's
line only; it never gives a tenant more than its share.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from broker import names
from broker.wire.roles import Role

PREFIX = names.FAIR_PREFIX
BODIES = f"{PREFIX}:body"  # request id -> the request (the queue message of old)
ARRIVALS = f"{PREFIX}:arrivals"  # "<priority><job>" lists that got a request since the last pop
CONF = f"{PREFIX}:conf"  # weights, job -> tenant, per-job pacing (broker.acquire.fairshare)

# Lower is served first within a tenant. One character: it prefixes the job in ARRIVALS.
PRIORITY: dict[str, str] = {Role.GRADING.value: "0", Role.ROLLOUT.value: "1"}
PRIORITIES = tuple(sorted(PRIORITY.values()))


def priority_of(request: Mapping[str, Any]) -> str:
    """The priority of a wire request (an unknown role is a rollout: the worker refuses it)."""
    return PRIORITY.get(str(request.get("role")), PRIORITY[Role.ROLLOUT.value])


def queue_key(priority: str, job: str) -> str:
    """The list of queued request ids of ``job`` at ``priority``."""
    return f"{PREFIX}:q:{priority}:{job}"


# KEYS: the job's list, bodies, arrivals. ARGV: request id, body, arrival member.
PUSH_LUA = """
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
redis.call('RPUSH', KEYS[1], ARGV[1])
redis.call('SADD', KEYS[3], ARGV[3])
return 1
"""


def push_call(request: Mapping[str, Any]) -> tuple[list[str], list[Any]]:
    """KEYS and ARGV of one push: body first, then the id, then the arrival mark, in one
    atomic script, so the scheduler never sees an id without its request."""
    priority, job = priority_of(request), str(request["job"])
    keys = [queue_key(priority, job), BODIES, ARRIVALS]
    return keys, [str(request["request_id"]), json.dumps(dict(request)), priority + job]


def push_all(redis: Any, requests: list[Mapping[str, Any]]) -> None:
    """Push many requests in one pipelined round trip (a burst of a thousand acquires)."""
    script = redis.register_script(PUSH_LUA)
    pipe = redis.pipeline(transaction=False)
    for request in requests:
        keys, args = push_call(request)
        script(keys=keys, args=args, client=pipe)
    pipe.execute()


def withdraw_all(redis: Any, requests: list[Mapping[str, Any]]) -> None:
    """Undo pushes whose "pending" messages could not be sent (best effort)."""
    pipe = redis.pipeline(transaction=False)
    for request in requests:
        rid = str(request["request_id"])
        pipe.lrem(queue_key(priority_of(request), str(request["job"])), 0, rid)
        pipe.hdel(BODIES, rid)
    pipe.execute()
