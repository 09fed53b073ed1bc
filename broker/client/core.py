"""The trainer client without I/O: every decision both transports must make the same way.

``sync.py`` (threads, redis-py, httpx.Client) and ``aio.py`` (asyncio, redis.asyncio,
httpx.AsyncClient) only move bytes; what they send, when, and what an answer means is
decided here, once, so the two cannot drift again (the async client once renewed leases
every 60 s whatever the lease, and had no output cap, no file mode, no batching):

- building the acquire request and the queue messages (task, args, queue from ``names``);
- the warm-pool claim (keys and script args) and what a claimed lease triggers;
- the wait on the request's mailbox: how long each pop blocks, when to give up, what the
  give-up must release, and decoding the answer into a ``Lease`` or a typed error;
- the heartbeat schedule: a third of the lease, so two renewals can be lost before it
  runs out, all due renewals sent as one batch.

Times are passed in (``now``), never read here, so unit tests drive them directly.
"""

from __future__ import annotations

import datetime as dt
import heapq
import json
import os
import socket
from collections.abc import Iterable
from typing import Any, NamedTuple

from broker.errors import (
    AcquireTimeout,
    InvalidRequest,
    SandboxLost,
    SandboxReclaimed,
    ServiceUnavailable,
)
from broker.names import Task, queue_of, reclaimed_key
from broker.wire import mailbox, warm
from broker.wire.errors import raise_payload_error
from broker.wire.request import request_body
from broker.wire.services import known_redis_url
from broker.wire.snapshots import Snapshot, snapshot_request
from broker.wire.types import Lease

MAX_GROUP = 10_000
POP_WAIT_S = 5.0  # one blocking pop; below the Redis socket timeout of the transports
DEFAULT_HEARTBEAT_S = 60.0  # when a lease carries no expiry
MIN_HEARTBEAT_S = 1.0
WARM_HEALTH_TIMEOUT_S = 1.0
# Health checks in flight at once per async client. The timeout starts when a check gets
# its turn: a thousand started together timed out on the trainer's own busy loop, and each
# timeout released (deleted) a healthy warm pod, so a burst of claims emptied the pool.
WARM_HEALTH_CONCURRENCY = 64
# Blocking pops wait up to POP_WAIT_S: the socket timeout must be longer (redis-py 8
# defaults it to 5 s).
REDIS_OPTIONS: dict[str, Any] = {"socket_timeout": 30, "socket_connect_timeout": 5}
HTTP_TIMEOUT_S = 60.0
POOL_WAIT_S = 60.0  # the async client's wait for a free Redis connection (then an error)

ACQUIRE_DEFAULTS: dict[str, Any] = {
    "cpu": 1,
    "memory": "1Gi",
    "timeout": 300.0,
    "role": "rollout",
    "image_digest": None,
    "base_commit": None,
    "workdir": "/",
    "env": None,
    "visible_cpus": None,
    "egress": None,
}
ACQUIRE_ARGS = frozenset({"image", "job", *ACQUIRE_DEFAULTS})


class Outbound(NamedTuple):
    """One Celery message: task name, positional args, and the queue its workers read."""

    task: str
    args: list[Any]
    queue: str


def message(task: Task, args: list[Any]) -> Outbound:
    return Outbound(task, args, queue_of(task))


def batches(messages: Iterable[Outbound]) -> dict[tuple[str, str], list[list[Any]]]:
    """Group messages by (task, queue): each group is one pipelined publish batch."""
    out: dict[tuple[str, str], list[list[Any]]] = {}
    for m in messages:
        out.setdefault((m.task, m.queue), []).append(m.args)
    return out


def default_owner() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def redis_url_for(settings: Any) -> str:
    """``settings.redis_url``, else the embedded Redis ``sandman up`` left in the state dir.

    Never a service started here: a second, empty Redis would be read by no worker."""
    return known_redis_url(settings)


def not_answering(url: str, exc: BaseException) -> ServiceUnavailable:
    where = url.rsplit("@", 1)[-1]  # never the password
    return ServiceUnavailable(
        f"Redis at {where} does not answer ({exc}): run `sandman up` or set SANDMAN_REDIS_URL"
    )


# -- requests ---------------------------------------------------------------------------


def new_request(owner: str, **kwargs: Any) -> dict[str, Any]:
    """Validate the acquire arguments (unknown ones included) and build the request."""
    unknown = set(kwargs) - ACQUIRE_ARGS
    if unknown:
        raise InvalidRequest(f"unknown acquire arguments: {sorted(unknown)}")
    missing = {"image", "job"} - set(kwargs)
    if missing:
        raise InvalidRequest(f"missing acquire arguments: {sorted(missing)}")
    args = {**ACQUIRE_DEFAULTS, **kwargs}
    return request_body(owner=owner, **args)


def group_requests(n: int, owner: str, **kwargs: Any) -> list[dict[str, Any]]:
    """A rollout group: n independent requests (each its own id and mailbox)."""
    if not 1 <= n <= MAX_GROUP:
        raise InvalidRequest(f"group size {n} outside 1..{MAX_GROUP}")
    return [new_request(owner, **kwargs) for _ in range(n)]


def acquire_message(request: dict[str, Any]) -> Outbound:
    return message(Task.ACQUIRE, [request])


def release_message(sandbox_id: str, reason: str = "released") -> Outbound:
    return message(Task.RELEASE, [sandbox_id, reason])


def heartbeat_messages(sandbox_ids: Iterable[str], owner: str) -> list[Outbound]:
    return [message(Task.HEARTBEAT, [sid, owner]) for sid in sandbox_ids]


def acquire_seconds(request: dict[str, Any], now: float) -> float:
    return now - float(request["enqueued_at"])


# -- warm pools -------------------------------------------------------------------------


def warm_eligible(request: dict[str, Any]) -> bool:
    """Can a warm pod serve this request? Warm pods were started with the defaults: no
    env, the default workdir, no CPU pinning (execd applies all three at its start). A
    request that asks for any of them always creates, or it would silently run without
    them (a grading sandbox without its PYTHONHASHSEED or TZ, a rollout in another cwd)."""
    return (
        request.get("visible_cpus") is None
        and request.get("egress") is None  # warm pods follow the job's policy
        and not request.get("env")
        and request.get("workdir", ACQUIRE_DEFAULTS["workdir"]) == ACQUIRE_DEFAULTS["workdir"]
    )


def warm_claim(request: dict[str, Any]) -> tuple[list[str], list[Any]]:
    """KEYS and ARGV of the atomic claim in the request's warm pool."""
    key = warm.pool_key(
        request["image"],
        request["image_digest"],
        request["base_commit"],
        request["cpu_m"],
        request["memory_b"],
    )
    return warm.claim_call(request["job"], key, request["request_id"])


def warm_outcome(
    lease: Lease, request: dict[str, Any], owner: str, acquire_s: float, healthy: bool
) -> Outbound:
    """A healthy claim is handed out in the ledger; an unhealthy one is released (and the
    caller claims again)."""
    if not healthy:
        return release_message(lease.sandbox_id, "warm-unhealthy")
    return message(
        Task.CLAIMED,
        [lease.sandbox_id, request["request_id"], owner, acquire_s, request["enqueued_at"]],
    )


# -- the mailbox wait -------------------------------------------------------------------


class MailboxWait:
    """One request waiting for its answer: blocking pops until the deadline, then give up."""

    def __init__(self, request: dict[str, Any]) -> None:
        self.request_id: str = request["request_id"]
        self.deadline = float(request["deadline"])
        self.key = mailbox.result_key(self.request_id)

    def next_pop(self, now: float) -> float | None:
        """Seconds the next pop may block, or None once the deadline passed (give up)."""
        remaining = self.deadline - now
        return None if remaining <= 0 else min(remaining, POP_WAIT_S)

    def cancel_call(self) -> tuple[list[str], list[Any]]:
        return mailbox.cancel_call(self.request_id)

    def timed_out(self) -> AcquireTimeout:
        return AcquireTimeout(f"no sandbox for {self.request_id} within the timeout")


def settle(raw: bytes | str) -> Lease:
    """The mailbox answer: the lease, or the worker's error re-raised as its own type."""
    payload = mailbox.parse(raw)
    if "lease" not in payload:
        raise_payload_error(payload)
    return Lease.from_dict(payload["lease"])


def late_releases(raw: bytes | str | None) -> list[Outbound]:
    """A lease that arrived just before the give-up is ours to release, never stranded."""
    if not raw:
        return []
    payload = mailbox.parse(raw)
    if "lease" not in payload:
        return []
    return [release_message(str(payload["lease"]["sandbox_id"]))]


# -- snapshots --------------------------------------------------------------------------


def split_snapshot(kwargs: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """``open(..., snapshot=id)``: the acquire arguments, and the snapshot to restore."""
    rest = dict(kwargs)
    snap = rest.pop("snapshot", None)
    if isinstance(snap, Snapshot):
        snap = snap.id
    if snap is not None and not isinstance(snap, str):
        raise InvalidRequest("snapshot must be a snapshot id or a Snapshot", field="snapshot")
    return rest, snap


def resume_args(snap: Snapshot, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Acquire arguments for a sandbox to restore ``snap`` into: its image and job unless
    the caller names others. Not its digest: the warm pools are keyed by the requested
    digest, and the worker refuses a sandbox of another digest before restoring anyway."""
    return {"image": snap.image, "job": snap.job, **kwargs, "snapshot": snap.id}


def snapshot_op(
    op: str, timeout: float, owner: str, **fields: Any
) -> tuple[dict[str, Any], Outbound]:
    """A snapshot request (capture, restore, describe) and its queue message; ``owner``
    lets the worker refuse a sandbox another trainer holds."""
    request = snapshot_request(op, timeout=timeout, owner=owner, **fields)
    return request, message(Task.SNAPSHOT, [request])


def settle_snapshot(raw: bytes | str) -> Snapshot:
    """A snapshot op's answer: the snapshot, or the worker's error re-raised as its type."""
    payload = mailbox.parse(raw)
    if "snapshot" not in payload:
        raise_payload_error(payload)
    return Snapshot.from_dict(payload["snapshot"])


# -- idle reclaim -----------------------------------------------------------------------


def lost_key(error: SandboxLost, sandbox_id: str) -> str | None:
    """The Redis key that says whether a lost sandbox was reclaimed (None: execd already
    said so, nothing to look up). Read only after a failure: a healthy call costs nothing."""
    return None if isinstance(error, SandboxReclaimed) else reclaimed_key(sandbox_id)


def lost_error(error: SandboxLost, sandbox_id: str, marker: bytes | str | None) -> SandboxLost:
    """``SandboxReclaimed`` when the broker reclaimed it (``marker`` is the record of it
    ``broker.acquire.idle`` left), else the failure as it was."""
    if not marker:
        return error
    try:
        idle = f" after {float(json.loads(marker)['idle_s']):.0f} s idle"
    except (ValueError, KeyError, TypeError):
        idle = ""
    return SandboxReclaimed(
        f"sandbox {sandbox_id} was reclaimed{idle} (no execd call and no running command "
        "for its job's idle_timeout_s): acquire another"
    )


# -- heartbeats -------------------------------------------------------------------------


def heartbeat_interval(lease: Lease, override: float | None, now: dt.datetime) -> float:
    """A third of the lease: two renewals can be lost before it runs out."""
    interval = override
    if interval is None and lease.lease_expires_at:
        expires = dt.datetime.fromisoformat(lease.lease_expires_at)
        interval = (expires - now).total_seconds() / 3
    return max(MIN_HEARTBEAT_S, interval or DEFAULT_HEARTBEAT_S)


class HeartbeatSchedule:
    """When each held lease is next due; the transports lock (sync) or not (async).

    A heap of (due, id) with lazy removal: adding, renewing and finding the next due
    lease cost O(log held), so a trainer holding thousands of leases (or acquiring a
    thousand at once) does not rescan all of them on every acquire and every wake."""

    IDLE_WAIT_S = 60.0
    MIN_WAIT_S = 0.05

    def __init__(self) -> None:
        self._next: dict[str, tuple[float, float]] = {}  # id -> (due, interval)
        self._heap: list[tuple[float, str]] = []  # may hold stale entries; _next decides

    def add(self, sandbox_id: str, interval_s: float, now: float) -> bool:
        """Schedule a lease; True when it is now the soonest due (the loop must wake)."""
        due = now + interval_s
        soonest = self._soonest()
        self._next[sandbox_id] = (due, interval_s)
        heapq.heappush(self._heap, (due, sandbox_id))
        return soonest is None or due < soonest

    def remove(self, sandbox_id: str) -> None:
        self._next.pop(sandbox_id, None)

    def held(self) -> int:
        return len(self._next)

    def due(self, now: float) -> list[str]:
        """The ids to renew now, each rescheduled one interval later."""
        ids: dict[str, None] = {}  # ordered, and an id pushed twice is renewed once
        while self._heap and self._heap[0][0] <= now:
            at, sid = heapq.heappop(self._heap)
            entry = self._next.get(sid)
            if entry is not None and entry[0] == at:  # else released or rescheduled
                ids[sid] = None
        for sid in ids:
            interval = self._next[sid][1]
            self._next[sid] = (now + interval, interval)
            heapq.heappush(self._heap, (now + interval, sid))
        return list(ids)

    def wait_s(self, now: float) -> float:
        """How long the renewal loop may sleep before something is due."""
        soonest = self._soonest()
        soonest = now + self.IDLE_WAIT_S if soonest is None else soonest
        return max(self.MIN_WAIT_S, min(soonest - now, self.IDLE_WAIT_S))

    def _soonest(self) -> float | None:
        """The next due time, dropping stale heap entries on the way."""
        while self._heap:
            at, sid = self._heap[0]
            entry = self._next.get(sid)
            if entry is not None and entry[0] == at:
                return at
            heapq.heappop(self._heap)
        return None
