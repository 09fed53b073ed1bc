"""Warm pools: never-used sandboxes per (image digest, base commit, resources), per job.

Why the lease lives in Redis: a warm hit must not wait on Kubernetes or even on the
ledger. Each warm sandbox is published as its full lease (address and token included)
in a Redis hash, with its id queued in a sorted set scored by publish time; a claim is one
atomic Lua call (pop the oldest id, take its lease, mark it claimed), so one warm sandbox
never goes to two trainers. Every operation here is O(1) or O(log pool): nothing scans
the pool (a list's LREM did, on every publish and withdraw), so a claim, a publish and a
withdraw cost the same at pool size 10 and 10,000.
The ledger catches up right after (``Provider.hand_out`` in a worker), and that hand-out
enqueues a paced replacement. Upkeep (beat) refills to size, trims, and deletes warm
sandboxes idle past the pool's ``idle_timeout_s`` (default 300 s, the paper's setting).
"""

from __future__ import annotations

import enum
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from broker import names
from broker.errors import InvalidRequest
from broker.wire.request import AcquireRequest
from broker.wire.types import Lease
from broker.wire.validation import parse_cpu, parse_memory, validate_image
from broker.wire.warm import CLAIM_LUA, claim_call, claimed_lease, pool_key, pool_keys

__all__ = ["PREFIX", "PoolConfig", "Republished", "WarmStore", "parse_pools", "pool_key"]

PREFIX = names.WARM_PREFIX
# The fields a pool member's request copies from its pool's config.
_MEMBER_FIELDS = ("image", "image_digest", "base_commit", "cpu_m", "memory_b")

# The upkeep's two decisions about a published member are atomic against the claim: a
# claim landing between "is it claimed?" and "is it published?" used to make upkeep
# re-publish a sandbox a trainer had just taken, and a second trainer then claimed the
# same sandbox (two rollouts in one workspace, #20 item 13); or upkeep released, as
# idle, a member claimed a moment before. KEYS: id queue, lease hash, claimed key.
# REPUBLISH ARGV: id, lease, score. Answers 0 claimed, 1 re-published, 2 already
# published (queued with its lease: a lease without its id is re-queued).
REPUBLISH_LUA = """
if redis.call('EXISTS', KEYS[3]) == 1 then return 0 end
if redis.call('ZSCORE', KEYS[1], ARGV[1]) and redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1 then
  return 2
end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
redis.call('ZADD', KEYS[1], ARGV[3], ARGV[1])
return 1
"""
# RETIRE ARGV: id. Takes an unclaimed member out of circulation; 0 if it is claimed.
RETIRE_LUA = """
if redis.call('EXISTS', KEYS[3]) == 1 then return 0 end
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[1], ARGV[1])
return 1
"""


class Republished(enum.IntEnum):
    """What ``WarmStore.republish`` found: the answers of ``REPUBLISH_LUA``."""

    CLAIMED = 0
    REPUBLISHED = 1
    PUBLISHED = 2


@dataclass(frozen=True)
class PoolConfig:
    """One entry of ``Job.warm_pools``."""

    image: str
    image_digest: str | None
    base_commit: str | None
    cpu_m: int
    memory_b: int
    size: int
    idle_timeout_s: float

    @property
    def key(self) -> str:
        return pool_key(self.image, self.image_digest, self.base_commit, self.cpu_m, self.memory_b)

    def member_request(self, job: str) -> AcquireRequest:
        """The request that creates one new member: the pool's image and resources as they
        are, its key (so the pod joins this pool) and a fresh ``warm-`` request id (each
        refill is its own create, never deduplicated against another)."""
        same = {name: getattr(self, name) for name in _MEMBER_FIELDS}
        return AcquireRequest(
            job=job, pool_key=self.key, request_id=f"warm-{uuid.uuid4().hex}", **same
        )

    @classmethod
    def parse(cls, raw: dict[str, Any], default_idle_s: float = 300.0) -> PoolConfig:
        if not isinstance(raw, dict) or "image" not in raw:
            raise InvalidRequest(f"warm pool entry needs at least an image: {raw!r}")
        validate_image(raw["image"])
        size = int(raw.get("size", 1))
        if not 0 <= size <= 10_000:
            raise InvalidRequest(f"warm pool size {size} outside 0..10000")
        idle = float(raw.get("idle_timeout_s", default_idle_s))
        if idle <= 0:
            raise InvalidRequest("warm pool idle_timeout_s must be > 0")
        cpu = raw.get("cpu_m")
        mem = raw.get("memory_b")
        return cls(
            image=raw["image"],
            image_digest=raw.get("image_digest"),
            base_commit=raw.get("base_commit"),
            cpu_m=int(cpu) if cpu is not None else parse_cpu(raw.get("cpu", 1)),
            memory_b=int(mem) if mem is not None else parse_memory(raw.get("memory", "1Gi")),
            size=size,
            idle_timeout_s=idle,
        )


def parse_pools(
    raw: list[dict[str, Any]] | None, default_idle_s: float = 300.0
) -> list[PoolConfig]:
    return [PoolConfig.parse(entry, default_idle_s) for entry in raw or []]


class WarmStore:
    """The Redis side of the pools: published warm leases and the atomic claim."""

    _keys = staticmethod(pool_keys)

    def __init__(self, redis: Any) -> None:
        self.redis = redis
        self._claim = redis.register_script(CLAIM_LUA)
        self._republish = redis.register_script(REPUBLISH_LUA)
        self._retire = redis.register_script(RETIRE_LUA)

    def publish(self, job: str, key: str, lease: Lease) -> None:
        ids, leases = self._keys(job, key)
        pipe = self.redis.pipeline()
        pipe.hset(leases, lease.sandbox_id, json.dumps(lease.to_dict()))
        pipe.zadd(ids, {lease.sandbox_id: time.time()})
        pipe.delete(names.warm_claimed_key(lease.sandbox_id))
        pipe.execute()

    def claim(self, job: str, key: str, claimer: str) -> Lease | None:
        """Atomically take one warm lease (oldest first), or None on a miss."""
        keys, args = claim_call(job, key, claimer)
        return claimed_lease(self._claim(keys=keys, args=args))

    def withdraw(self, job: str, key: str, sandbox_id: str) -> bool:
        """Take a warm lease out of circulation; True only for the one caller that did."""
        ids, leases = self._keys(job, key)
        pipe = self.redis.pipeline()
        pipe.hdel(leases, sandbox_id)
        pipe.zrem(ids, sandbox_id)
        taken, _ = pipe.execute()
        return bool(taken)

    def republish(self, job: str, key: str, lease: Lease) -> Republished:
        """Offer again a member Redis lost, unless a trainer has claimed it meanwhile."""
        return self.republish_many(job, key, [lease])[0]

    def republish_many(self, job: str, key: str, leases: list[Lease]) -> list[Republished]:
        """``republish`` for many members in one pipelined round trip (the upkeep's
        repair pass), each decision still one atomic script call."""
        pipe = self.redis.pipeline(transaction=False)
        now = time.time()
        for lease in leases:
            keys = [*self._keys(job, key), names.warm_claimed_key(lease.sandbox_id)]
            args = [lease.sandbox_id, json.dumps(lease.to_dict()), now]
            self._republish(keys=keys, args=args, client=pipe)
        return [Republished(int(answer)) for answer in pipe.execute()]

    def retire(self, job: str, key: str, sandbox_id: str) -> bool:
        """Withdraw a member to delete it; False when a trainer has claimed it (keep it)."""
        keys = [*self._keys(job, key), names.warm_claimed_key(sandbox_id)]
        return bool(self._retire(keys=keys, args=[sandbox_id]))

    def is_published(self, job: str, key: str, sandbox_id: str) -> bool:
        return bool(self.redis.hexists(self._keys(job, key)[1], sandbox_id))

    def size(self, job: str, key: str) -> int:
        return int(self.redis.hlen(self._keys(job, key)[1]))

    def queued(self, job: str, key: str) -> int:
        """How many ids wait in the pool's queue (O(1)): the upkeep compares it with the
        ledger's count to decide whether a repair pass is worth its O(pool) cost."""
        return int(self.redis.zcard(self._keys(job, key)[0]))
