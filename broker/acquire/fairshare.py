"""Weighted fair queuing of acquires between jobs and tenants, in one Lua call on Redis.

Trainers push requests into per-job, per-priority lists (``broker.wire.fairq``) and send
Celery messages that only say "one acquire is pending". A worker holding such a message
calls ``FairQueue.pop``, which picks, atomically, the request that is fair to serve next
across every backlogged job, so it does not matter which worker serves which message.

The scheduler is start-time fair queuing with a virtual clock, two levels deep:

* **Flows** are tenants (a job of no tenant is a flow of its own). Each backlogged flow
  has a start tag S and is ordered by its finish tag S + 1/w (w: the tenant's weight, or
  the lone job's). Serving a flow moves its tag on by 1/w; the global virtual time V is
  the largest start tag served. A flow that becomes backlogged starts at max(V, its last
  finish): an idle tenant banks no credit, and a busy one keeps what it earned.
* **Jobs within a flow** are ordered the same way on the flow's own virtual time, by job
  weight, after **priority**: a tenant's grading acquires are served before its rollout
  acquires. Priority reorders a tenant's own line; the tenant's share stays its weight.

So a job's share while everybody is backlogged is ``w_tenant / sum(w_tenants) * w_job /
sum(w_jobs of its tenant)``: a tenant's weight is split among its active jobs by their
weights. Why not a weight per job alone: a team could then take more of the cluster just
by running more jobs; here a team's share is its own, and how it splits it is its business.

Tags are computed when a job or flow reaches the head, with the weights of that moment, so
a weight changed at run time applies from each flow's next turn (no queued tag to redo).

**Pacing.** Fair order only matters if the pacer's tokens follow it. A popped request
competes for its create slot and token (``broker.pacing``) with the others popped before
it, so at most ``gate`` popped requests may be waiting for a token at once (the gate, a
sorted set with leases); a worker leaves the gate as soon as its token's start is
reserved (at most the pacer's horizon ahead: one interval, ``pacing.reserve_horizon``),
or while its job waits at its live cap. The short horizon is what lets the request
served next have the next token: only the tokens reserved within it go first. A job whose
own create bucket (``Job.create_rate``) would make it wait past the horizon is skipped,
so a throttled job never holds the gate.

**Crash safety.** A popped request stays in a processing set with a lease (Redis time),
renewed by its live worker (``renew``, from the worker's renewal thread) and removed when
its outcome was delivered (``done``). A SIGKILLed worker's request is pushed back to the
head of its list by the next pop after the lease ran out; the lease is shorter than the
Celery message's redelivery, so the redelivered "pending" message finds it. Every pop also
reports how many it re-queued, and the caller sends that many "pending" messages, so a
request never outlives all the messages that could serve it.

**Cancellation.** A trainer gives up by setting its request's cancel flag
(``broker.wire.mailbox``); the pop drops a queued request whose flag is set, uncharged.

Keys are built inside the script from the prefix (one Redis, as everything here uses).
"""

from __future__ import annotations

import json
import math
import threading
from dataclasses import dataclass
from typing import Any

from broker import names
from broker.pacing import PREFIX as PACE_PREFIX
from broker.pacing import RESERVE_HORIZON_S
from broker.wire import fairq

P = fairq.PREFIX
TOP = f"{P}:top"  # backlogged flows by finish tag
TAGS = f"{P}:tag"  # virtual times and tags
PROC = f"{P}:proc"  # popped request id -> lease expiry (Redis time)
HELD = f"{P}:held"  # popped request id -> "<priority><job>", to re-queue it
GATE = f"{P}:gate"  # popped, not yet holding a pacer token -> lease expiry
WAKE = f"{P}:wake"  # one entry per place freed in the gate: a gated worker BLPOPs it
WAKE_MAX = 16
SERVED = f"{P}:served"  # job -> requests served (counter)
LOG = f"{P}:log"  # the last LOG_MAX jobs served, newest first
STATS = f"{P}:stats"
LOG_MAX = 10_000
SCAN = 16  # flows, and jobs per flow, looked at for one that its own bucket lets go

_COMMON = """
local P = ARGV[1]
local TOP, TAG, CONF, BODY = P..':top', P..':tag', P..':conf', P..':body'
local PROC, HELD, GATE = P..':proc', P..':held', P..':gate'
local PRIOS = {'0', '1'}
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local function fmt(x) return string.format('%.17g', x) end
local function num(h, f, d)
  local v = redis.call('HGET', h, f)
  if v then return tonumber(v) end
  return d
end
"""

# ARGV: prefix, cancel-flag prefix, pacer prefix, gate size, lease s, horizon s, scan.
# Returns {kind, request id or '', body or '', wait s, swept}.
_POP_LUA = (
    "redis.replicate_commands()\n"
    + _COMMON
    + """
local CANCEL, PACE = ARGV[2], ARGV[3]
local gate_max, lease = tonumber(ARGV[4]), tonumber(ARGV[5])
local horizon, scan = tonumber(ARGV[6]), tonumber(ARGV[7])

local function weight(field)
  local w = num(CONF, field, 1)
  if not w or w <= 0 then return 1 end
  return w
end
local function qkey(p, job) return P..':q:'..p..':'..job end
local function jobs_key(p, flow) return P..':jobs:'..p..':'..flow end
local function flow_of(job)
  local tenant = redis.call('HGET', CONF, 't:'..job)
  if tenant then return 't:'..tenant end
  return 'j:'..job
end
local function backlogged(flow)
  for _, p in ipairs(PRIOS) do
    if redis.call('ZCARD', jobs_key(p, flow)) > 0 then return true end
  end
  return false
end

-- 1. Requests of workers that stopped renewing go back to the head of their list.
local swept = 0
for _, rid in ipairs(redis.call('ZRANGEBYSCORE', PROC, '-inf', now, 'LIMIT', 0, 100)) do
  local where = redis.call('HGET', HELD, rid)
  redis.call('ZREM', PROC, rid)
  redis.call('ZREM', GATE, rid)
  redis.call('HDEL', HELD, rid)
  if where and redis.call('HEXISTS', BODY, rid) == 1 then
    redis.call('LPUSH', qkey(string.sub(where, 1, 1), string.sub(where, 2)), rid)
    redis.call('SADD', P..':arrivals', where)
    swept = swept + 1
  end
end

-- 2. Lists that got requests join the schedule (tagged with today's weights).
local function join(p, job)
  if redis.call('LLEN', qkey(p, job)) == 0 then return end
  local flow = redis.call('HGET', TAG, 'in:'..job)
  local elsewhere = false
  if flow then
    if redis.call('ZSCORE', jobs_key(p, flow), job) then return end
    for _, q in ipairs(PRIOS) do
      if q ~= p and redis.call('ZSCORE', jobs_key(q, flow), job) then elsewhere = true end
    end
  end
  local start
  if elsewhere then
    start = num(TAG, 'js:'..job, 0)
  else
    local target = flow_of(job)
    local last = 0
    if flow == target then last = num(TAG, 'jf:'..job, 0) end
    flow = target
    start = math.max(num(TAG, 'v:'..flow, 0), last)
    redis.call('HSET', TAG, 'in:'..job, flow, 'js:'..job, fmt(start))
  end
  redis.call('ZADD', jobs_key(p, flow), fmt(start + 1 / weight('w:j:'..job)), job)
  if not redis.call('ZSCORE', TOP, flow) then
    local fs = math.max(num(TAG, 'v', 0), num(TAG, 'ff:'..flow, 0))
    redis.call('HSET', TAG, 'fs:'..flow, fmt(fs))
    redis.call('ZADD', TOP, fmt(fs + 1 / weight('w:'..flow)), flow)
  end
end
local arrivals = redis.call('SMEMBERS', P..':arrivals')
redis.call('DEL', P..':arrivals')
for _, m in ipairs(arrivals) do join(string.sub(m, 1, 1), string.sub(m, 2)) end

-- 3. The gate: at most gate_max popped requests wait for a pacer token at once.
redis.call('ZREMRANGEBYSCORE', GATE, '-inf', now)
if redis.call('ZCARD', TOP) == 0 then return {'empty', '', '', '0', swept} end
if redis.call('ZCARD', GATE) >= gate_max then return {'gated', '', '', '0', swept} end

-- Seconds until the job's own create bucket lets a create start (0: it has none).
local function ready_in(job)
  local r = redis.call('HGET', CONF, 'r:'..job)
  if not r then return 0 end
  local interval, burst = string.match(r, '(%S+) (%S+)')
  interval, burst = tonumber(interval), tonumber(burst)
  local tat = tonumber(redis.call('GET', PACE..':bucket:job:'..job) or '0')
  return tat + interval - burst * interval - now
end

-- A job was served at priority p: its tags move on by 1/w in every list it waits in.
local function charge(flow, job)
  local wj = weight('w:j:'..job)
  local js = num(TAG, 'js:'..job, 0)
  local jf = js + 1 / wj
  if js > num(TAG, 'v:'..flow, 0) then redis.call('HSET', TAG, 'v:'..flow, fmt(js)) end
  redis.call('HSET', TAG, 'jf:'..job, fmt(jf), 'js:'..job, fmt(jf))
  for _, q in ipairs(PRIOS) do
    local k = jobs_key(q, flow)
    if redis.call('ZSCORE', k, job) then
      if redis.call('LLEN', qkey(q, job)) > 0 then
        redis.call('ZADD', k, fmt(jf + 1 / wj), job)
      else
        redis.call('ZREM', k, job)
      end
    end
  end
  local wf = weight('w:'..flow)
  local fs = num(TAG, 'fs:'..flow, 0)
  local ff = fs + 1 / wf
  if fs > num(TAG, 'v', 0) then redis.call('HSET', TAG, 'v', fmt(fs)) end
  redis.call('HSET', TAG, 'ff:'..flow, fmt(ff), 'fs:'..flow, fmt(ff))
  if backlogged(flow) then
    redis.call('ZADD', TOP, fmt(ff + 1 / wf), flow)
  else
    redis.call('ZREM', TOP, flow)
  end
end

-- A list that ran dry leaves the schedule (its tags stay, for its next backlog).
local function settle(p, flow, job)
  if redis.call('LLEN', qkey(p, job)) == 0 then
    redis.call('ZREM', jobs_key(p, flow), job)
    if not backlogged(flow) then redis.call('ZREM', TOP, flow) end
  end
end

-- 4. The eligible job of smallest finish tag, its oldest request; cancelled ones dropped.
for _ = 1, 10000 do
  local best = nil
  local soonest = nil
  for _, flow in ipairs(redis.call('ZRANGE', TOP, 0, scan - 1)) do
    for _, p in ipairs(PRIOS) do
      for _, job in ipairs(redis.call('ZRANGE', jobs_key(p, flow), 0, scan - 1)) do
        local wait = ready_in(job)
        if wait <= horizon then
          best = {flow, p, job}
          break
        end
        if not soonest or wait < soonest then soonest = wait end
      end
      if best then break end
    end
    if best then break end
  end
  if not best then
    if redis.call('ZCARD', TOP) == 0 then return {'empty', '', '', '0', swept} end
    return {'wait', '', '', fmt(math.max((soonest or horizon) - horizon, 0.01)), swept}
  end
  local flow, p, job = best[1], best[2], best[3]
  local rid = redis.call('LPOP', qkey(p, job))
  local body = rid and redis.call('HGET', BODY, rid)
  if rid and body and redis.call('EXISTS', CANCEL..rid) == 0 then
    charge(flow, job)
    redis.call('ZADD', PROC, now + lease, rid)
    redis.call('HSET', HELD, rid, p..job)
    redis.call('ZADD', GATE, now + lease, rid)
    redis.call('HINCRBY', P..':served', job, 1)
    redis.call('LPUSH', P..':log', job)
    redis.call('LTRIM', P..':log', 0, tonumber(ARGV[8]) - 1)
    return {'ok', rid, body, '0', swept}
  end
  if rid then
    redis.call('HDEL', BODY, rid)
    redis.call('HINCRBY', P..':stats', 'dropped', 1)
  end
  settle(p, flow, job)
end
return {'wait', '', '', '0.01', swept}
"""
)

# ARGV: prefix, lease s, then request ids. Renews those still held; returns how many.
_RENEW_LUA = (
    _COMMON
    + """
local n = 0
for i = 3, #ARGV do
  n = n + redis.call('ZADD', PROC, 'XX', 'CH', now + tonumber(ARGV[2]), ARGV[i])
  redis.call('ZADD', GATE, 'XX', now + tonumber(ARGV[2]), ARGV[i])
end
return n
"""
)


@dataclass(frozen=True)
class Pop:
    """One pop's outcome: ``ok`` (a request to serve), ``gated`` (enough popped requests
    wait for tokens), ``wait`` (every backlogged job waits for its own bucket) or
    ``empty``; ``swept``: requests of dead workers put back by this pop."""

    kind: str
    request_id: str = ""
    body: dict[str, Any] | None = None
    wait_s: float = 0.0
    swept: int = 0


def default_gate(create_rate: float) -> int:
    """Popped requests that may wait for their token's reservation at once.

    One, up to 25 creates/s: pops then reserve tokens strictly in the scheduler's order
    (with more, the waiters race for the next start and a newcomer can lose that race
    several times running). One is enough to keep the bucket busy: a request leaves the
    gate when its start is reserved, up to the pacer's horizon (one interval) ahead, so
    the next pop and its admission overlap the wait. Above 25/s (an interval under 40 ms, close to
    one admission on a busy host) one more per 25/s, so the gate never caps the rate."""
    return max(1, math.ceil(create_rate / 25))


class FairQueue:
    """The worker side of the fair queue: pop, leave the gate, finish, renew."""

    def __init__(
        self, redis: Any, *, lease_s: float, gate: int, horizon_s: float = RESERVE_HORIZON_S
    ) -> None:
        self.redis = redis
        self.lease_s = lease_s
        self.gate = gate
        self.horizon_s = horizon_s
        self._pop = redis.register_script(_POP_LUA)
        self._renew = redis.register_script(_RENEW_LUA)
        self._held: set[str] = set()
        self._lock = threading.Lock()

    def pop(self) -> Pop:
        kind, rid, body, wait, swept = self._pop(
            args=[
                P,
                names.CANCEL_PREFIX,
                PACE_PREFIX,
                self.gate,
                self.lease_s,
                self.horizon_s,
                SCAN,
                LOG_MAX,
            ]
        )
        kind = _text(kind)
        if kind != "ok":
            return Pop(kind, wait_s=float(wait), swept=int(swept))
        rid = _text(rid)
        with self._lock:
            self._held.add(rid)
        return Pop("ok", rid, json.loads(body), 0.0, int(swept))

    def ungate(self, request_id: str) -> None:
        """The request's token is reserved (or it waits at its job's cap): next one, pop."""
        pipe = self.redis.pipeline(transaction=True)
        self._leave_gate(pipe, request_id)
        pipe.execute()

    def wait_gate(self, timeout_s: float) -> None:
        """Block until a place in the gate frees (or ``timeout_s``: a place can also free
        by a lease running out, which wakes nobody)."""
        self.redis.blpop([WAKE], timeout=timeout_s)

    def done(self, request_id: str) -> None:
        """The outcome was delivered: forget the request."""
        pipe = self.redis.pipeline(transaction=True)
        pipe.zrem(PROC, request_id)
        self._leave_gate(pipe, request_id)
        pipe.hdel(HELD, request_id)
        pipe.hdel(fairq.BODIES, request_id)
        pipe.execute()
        with self._lock:
            self._held.discard(request_id)

    @staticmethod
    def _leave_gate(pipe: Any, request_id: str) -> None:
        """Leave the gate and wake one gated worker (a few spare wakes are harmless: the
        woken worker pops, finds the gate full, and waits again)."""
        pipe.zrem(GATE, request_id)
        pipe.lpush(WAKE, "1")
        pipe.ltrim(WAKE, 0, WAKE_MAX - 1)

    def renew_held(self) -> int:
        """Move the lease of every request this process serves on; returns how many."""
        with self._lock:
            held = sorted(self._held)
        if not held:
            return 0
        return int(self._renew(args=[P, self.lease_s, *held]))

    def queued(self, job: str) -> int:
        pipe = self.redis.pipeline(transaction=False)
        for priority in fairq.PRIORITIES:
            pipe.llen(fairq.queue_key(priority, job))
        return sum(int(n) for n in pipe.execute())

    def publish_conf(self, fields: dict[str, str]) -> None:
        publish_conf(self.redis, fields)


def publish_conf(redis: Any, fields: dict[str, str]) -> None:
    """Replace the scheduler's view of weights, tenants and per-job pacing at once."""
    pipe = redis.pipeline(transaction=True)
    pipe.delete(fairq.CONF)
    if fields:
        pipe.hset(fairq.CONF, mapping=fields)
    pipe.execute()


def conf_fields(
    jobs: list[tuple[str, str | None, float, float | None, int | None]],
    tenants: dict[str, float],
) -> dict[str, str]:
    """The scheduler's configuration hash: per job (name, tenant, weight, create rate,
    create burst) and per tenant its weight. Defaults (weight 1, no tenant, no per-job
    rate) are left out."""
    out: dict[str, str] = {}
    for name, weight in tenants.items():
        if weight != 1:
            out[f"w:t:{name}"] = repr(float(weight))
    for name, tenant, weight, rate, burst in jobs:
        if tenant:
            out[f"t:{name}"] = tenant
        if weight != 1:
            out[f"w:j:{name}"] = repr(float(weight))
        if rate:
            out[f"r:{name}"] = f"{1.0 / rate!r} {burst or 1}"
    return out


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
