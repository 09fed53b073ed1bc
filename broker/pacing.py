"""Cluster-wide create pacing shared by every worker process, kept in Redis.

Celery's ``rate_limit`` is per worker, so N workers would create N times too fast. Here
every create (on-demand, warm refill, replacement) first takes a concurrency slot and
then a token from the same Redis state, so the API server sees at most
``rate * t + burst`` creates in any window of length t, however many workers run.

The bucket is GCRA ("virtual scheduling") with reservations: one atomic Lua call
checks the global and the per-job bucket, reserves the earliest start time that both
allow, and returns how long the caller must wait. Time comes from Redis ``TIME``, so
worker clocks do not matter. A reservation is never made past the caller's deadline,
and a bursty queue never turns into a burst of creates: waiting happens before the
create, inside the worker, while the rest of the burst stays queued in Redis.

The concurrency cap is a semaphore (a sorted set of holders scored by lease expiry), so
a SIGKILLed worker's slot frees itself when its lease runs out.

The pacer's own waiting (deadlines, sleeps between turns) goes through a ``Clock``, the
real one by default, so unit tests can check every pacing decision with a fake clock and
no real sleeping. The bucket's time stays Redis ``TIME``: that is what keeps several
workers honest, and the integration tests exercise it for real.
"""

from __future__ import annotations

import contextlib
import random
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from broker import names
from broker.errors import AcquireTimeout

PREFIX = names.PACE_PREFIX
# The longest lead of a reservation over its start. Must stay well below burst / rate
# of the global bucket (1 s at the defaults), so a job-throttled reservation never eats
# into the burst other jobs can use now.
RESERVE_HORIZON_S = 0.25
MIN_HORIZON_S = 0.01  # the shortest: the pacer's shortest sleep between two asks


def reserve_horizon(rate: float) -> float:
    """How far ahead of its start a create's token may be reserved at ``rate`` creates/s:
    one interval, between MIN_HORIZON_S and RESERVE_HORIZON_S.

    Every token reserved ahead is one that a request arriving later cannot have: the
    request the fair queue serves next (another job's, say) waits behind all of them, so
    a lead of 0.25 s at 25 creates/s put six of a bursting job's creates before it. One
    interval is all the pipeline needs: the next request is popped and admitted while
    this one sleeps to its start, and one that comes late costs no throughput (its
    start is not lost: the bucket's burst lets the next ones catch up)."""
    return min(RESERVE_HORIZON_S, max(MIN_HORIZON_S, 1.0 / rate))


# KEYS: bucket keys. ARGV: max_wait, then (interval, burst) per key.
# Returns {granted 0|1, wait seconds, reserved start (Redis time)} as strings.
_BUCKET_LUA = """
redis.replicate_commands()
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local max_wait = tonumber(ARGV[1])
local start = now
local tats = {}
for i, key in ipairs(KEYS) do
  local interval = tonumber(ARGV[2 * i])
  local burst = tonumber(ARGV[2 * i + 1])
  local tat = tonumber(redis.call('GET', key) or '0')
  if tat < now then tat = now end
  tats[i] = tat
  local earliest = tat + interval - burst * interval
  if earliest > start then start = earliest end
end
local wait = start - now
if wait > max_wait then
  return {0, tostring(wait), tostring(start)}
end
for i, key in ipairs(KEYS) do
  local interval = tonumber(ARGV[2 * i])
  local tat = tats[i]
  if start > tat then tat = start end
  tat = tat + interval
  local ttl = math.ceil((tat - now + 60) * 1000)
  redis.call('SET', key, string.format('%.6f', tat), 'PX', ttl)
end
return {1, tostring(wait), string.format('%.6f', start)}
"""

# KEYS: semaphore keys. ARGV: member, ttl seconds, then one limit per key.
_SEM_ACQUIRE_LUA = """
redis.replicate_commands()
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
for i, key in ipairs(KEYS) do
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
  if redis.call('ZCARD', key) >= tonumber(ARGV[2 + i]) then
    return 0
  end
end
for i, key in ipairs(KEYS) do
  redis.call('ZADD', key, now + tonumber(ARGV[2]), ARGV[1])
  redis.call('PEXPIRE', key, math.ceil(tonumber(ARGV[2]) * 1000) + 60000)
end
return 1
"""

_TIME_LUA = """
local t = redis.call('TIME')
return tostring(tonumber(t[1]) + tonumber(t[2]) / 1000000)
"""


class Clock(Protocol):
    """Where the pacer reads the time its deadlines are in, and how it waits."""

    def monotonic(self) -> float: ...

    def sleep(self, seconds: float) -> None: ...


class SystemClock:
    """The process's monotonic clock and a real sleep: what production uses."""

    def monotonic(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


SYSTEM_CLOCK = SystemClock()


@dataclass(frozen=True)
class Limits:
    """The pacing that applies to one create: global values plus optional per-job ones."""

    rate: float
    burst: int
    max_concurrent: int
    job: str | None = None
    job_rate: float | None = None
    job_burst: int | None = None
    job_max_concurrent: int | None = None


class Pacer:
    """Token bucket + concurrency semaphore over one Redis connection pool.

    Deadlines passed in are readings of ``clock.monotonic()`` (the system monotonic clock
    unless a test injects another).
    """

    def __init__(
        self, redis: Any, *, slot_ttl_s: float = 180.0, clock: Clock = SYSTEM_CLOCK
    ) -> None:
        self.redis = redis
        self.slot_ttl_s = slot_ttl_s
        self.clock = clock
        self._bucket = redis.register_script(_BUCKET_LUA)
        self._sem = redis.register_script(_SEM_ACQUIRE_LUA)
        self._time = redis.register_script(_TIME_LUA)

    def server_time(self) -> float:
        return float(self._time())

    def reserve(self, limits: Limits, *, max_wait: float) -> float | None:
        """Reserve a create start; return the wait before it, or None past ``max_wait``."""
        got = self.reserve_at(limits, max_wait=max_wait)
        return None if got is None else got[0]

    def reserve_at(self, limits: Limits, *, max_wait: float) -> tuple[float, float] | None:
        """Like ``reserve``, also returning the reserved start in Redis server time."""
        granted, wait, start = self._try(limits, max_wait)
        return (wait, start) if granted else None

    def _try(self, limits: Limits, max_wait: float) -> tuple[bool, float, float]:
        """(granted, wait, start); a refusal still says how long the wait would be."""
        keys = [names.PACE_BUCKET_GLOBAL]
        args: list[Any] = [max_wait, 1.0 / limits.rate, limits.burst]
        if limits.job and limits.job_rate:
            keys.append(f"{PREFIX}:bucket:job:{limits.job}")
            args += [1.0 / limits.job_rate, limits.job_burst or 1]
        granted, wait, start = self._bucket(keys=keys, args=args)
        return bool(int(granted)), float(wait), float(start)

    def take(
        self,
        limits: Limits,
        *,
        deadline: float,
        on_reserved: Callable[[], None] | None = None,
    ) -> float:
        """Block (monotonic ``deadline``) until this caller may start one create; the
        start it reserved (Redis time). ``on_reserved`` is told as soon as its start is
        reserved, before the sleep to it.

        Reservations are made at most ``reserve_horizon(rate)`` ahead (one interval). A
        reservation also moves the global bucket to its start time, so a job throttled by
        its own rate that reserved far ahead would hold every other job back until then,
        and every reservation goes before whatever arrives after it. Instead, a caller
        whose turn is further away sleeps until it is within reach and asks again; a
        caller whose turn is past its deadline is refused at once.
        """
        horizon = reserve_horizon(limits.rate)
        while True:
            remaining = deadline - self.clock.monotonic()
            granted, wait, start = self._try(limits, max(0.0, min(horizon, remaining)))
            if granted:
                if on_reserved is not None:
                    on_reserved()
                if wait > 0:
                    self.clock.sleep(wait)
                return start
            if wait > remaining:
                raise AcquireTimeout("create rate limit: no token before the deadline")
            self.clock.sleep(max(MIN_HORIZON_S, wait - horizon / 2))

    def _sem_keys(self, limits: Limits) -> tuple[list[str], list[int]]:
        keys, caps = [names.PACE_SEM_GLOBAL], [limits.max_concurrent]
        if limits.job and limits.job_max_concurrent:
            keys.append(f"{PREFIX}:sem:job:{limits.job}")
            caps.append(limits.job_max_concurrent)
        return keys, caps

    def try_slot(self, limits: Limits, member: str) -> bool:
        keys, caps = self._sem_keys(limits)
        return bool(self._sem(keys=keys, args=[member, self.slot_ttl_s, *caps]))

    def release_slot(self, limits: Limits, member: str) -> None:
        keys, _ = self._sem_keys(limits)
        pipe = self.redis.pipeline(transaction=False)
        for key in keys:
            pipe.zrem(key, member)
        pipe.execute()

    def in_flight(self) -> int:
        return int(self.redis.zcard(names.PACE_SEM_GLOBAL))

    @contextlib.contextmanager
    def create_slot(
        self,
        limits: Limits,
        *,
        deadline: float,
        on_reserved: Callable[[], None] | None = None,
    ) -> Iterator[None]:
        """Hold a concurrency slot, then a token: the create runs inside the block.
        ``on_reserved``: called once the token's start is reserved (see ``take``), or
        as soon as the caller must wait for a slot (a capped job must not hold back others).

        Slot first, token second: a token taken while still waiting for a slot would let
        creates bunch up behind the semaphore and leave together as a burst.
        """
        member = uuid.uuid4().hex
        while not self.try_slot(limits, member):
            if on_reserved is not None:  # waiting for a slot: let the next caller go first
                on_reserved()
                on_reserved = None
            if self.clock.monotonic() >= deadline:
                raise AcquireTimeout("concurrent-create cap: no slot before the deadline")
            self.clock.sleep(0.02 + random.random() * 0.03)
        try:
            self.take(limits, deadline=deadline, on_reserved=on_reserved)
            yield
        finally:
            self.release_slot(limits, member)
