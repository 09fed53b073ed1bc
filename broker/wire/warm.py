"""The warm-pool claim as both sides speak it: pool keys, Redis keys and the claim script.

The trainer claims a warm sandbox straight from Redis (no queue, no ledger on the path)
and the workers publish, withdraw and count the same entries, so the key layout, the
atomic claim script and the pool key's hash are defined once, here, where the client
may import them (``broker.pools.store`` builds on this module).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from broker import names
from broker.wire.types import Lease

CLAIM_TTL_S = 3600

# KEYS: id queue (a sorted set scored by publish time), lease hash. ARGV: claimer, claim
# TTL, claimed-key prefix. Pops the oldest id, O(log pool): never a scan, so a claim costs
# the same at pool size 10 and 10,000. Loops only past an id whose lease is gone (an id
# and its lease are written and removed together, so that is a repair, not the rule).
CLAIM_LUA = """
while true do
  local popped = redis.call('ZPOPMIN', KEYS[1])
  if #popped == 0 then return false end
  local id = popped[1]
  local lease = redis.call('HGET', KEYS[2], id)
  if lease then
    redis.call('HDEL', KEYS[2], id)
    redis.call('SET', ARGV[3] .. id, ARGV[1], 'EX', tonumber(ARGV[2]))
    return lease
  end
end
"""


def pool_key(
    image: str, image_digest: str | None, base_commit: str | None, cpu_m: int, memory_b: int
) -> str:
    """Stable key of compatible sandboxes: same bytes, same commit, same resources."""
    raw = "|".join([image_digest or image, base_commit or "", str(cpu_m), str(memory_b)])
    return "p" + hashlib.sha256(raw.encode()).hexdigest()[:24]


def pool_keys(job: str, key: str) -> tuple[str, str]:
    """The Redis queue of warm ids (a sorted set, oldest first) and the hash of their
    leases, for one job's pool. (``:queue:``, not the ``:ids:`` list of earlier versions:
    a client and a broker of different versions miss the pool instead of failing.)"""
    return f"{names.WARM_PREFIX}:queue:{job}:{key}", f"{names.WARM_PREFIX}:leases:{job}:{key}"


def claim_call(job: str, key: str, claimer: str) -> tuple[list[str], list[Any]]:
    """KEYS and ARGV of one claim, identical from the sync and the async Redis client."""
    return list(pool_keys(job, key)), [claimer, CLAIM_TTL_S, names.WARM_CLAIMED_PREFIX]


def claimed_lease(raw: bytes | str | None) -> Lease | None:
    """The claim script's answer: the published lease, or None on a miss."""
    return Lease.from_dict(json.loads(raw)) if raw else None
