"""Pool upkeep: keep every job's warm pools at size, trim them, expire idle members.

Run by the ``pool_upkeep`` beat task and after each warm hand-out (a paced replacement).
Upkeep only writes intent rows and enqueues work: refills go to the ``pool`` queue (the
paced create lives with the acquire service), deletes to the ``release`` queue, so a
pass never waits on Kubernetes. One runner per job at a time (a Redis lock), because two
passes counting the same in-flight rows would overfill the pool.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from broker import names
from broker.errors import AtCapacity, QuotaExceeded
from broker.ledger import store
from broker.ledger.models import Job, Sandbox, utcnow
from broker.ledger.states import State
from broker.names import Task
from broker.ownership.provider import Provider
from broker.pools.store import PoolConfig, Republished, WarmStore, parse_pools
from broker.settings import Settings
from broker.wire.types import Lease

Enqueue = Callable[[str, list[Any], str], None]
REFILL_BUDGET_S = 900.0  # a refill waits this long for a pacer token before giving up
UPKEEP_LOCK_TTL_S = 30


@dataclass(eq=False)
class PoolUpkeep:
    """The server side of warm pools: publish ready members, refill, trim, expire.

    A dataclass: it only holds the parts the composition root hands it."""

    settings: Settings
    sessions: sessionmaker[Session]
    provider: Provider
    warm: WarmStore
    enqueue: Enqueue

    def publish(self, sandbox_id: str, token: str) -> None:
        """Offer a ready, unclaimed pool member for warm claims (its full lease in Redis)."""
        with self.sessions() as session:
            row = session.get(Sandbox, sandbox_id)
            if row is None or row.pool_key is None or row.state != State.READY:
                return
            lease, job, key = Lease.from_row(row, token), row.job, row.pool_key
        self.warm.publish(job, key, lease)

    def upkeep_all(self) -> dict[str, Any]:
        """Every job with pools configured, or with warm members left to drain."""
        with self.sessions() as session:
            jobs = set(session.scalars(select(Job.name).where(Job.warm_pools.isnot(None))))
            jobs |= set(
                session.scalars(
                    select(Sandbox.job)
                    .where(Sandbox.pool_key.isnot(None), Sandbox.state == State.READY)
                    .distinct()
                )
            )
        return {job: self.upkeep_job(job) for job in sorted(jobs)}

    def upkeep_job(self, job_name: str) -> dict[str, int]:
        """Refill to size, trim, expire idle warm sandboxes; one runner per job at a time."""
        lock = names.pool_upkeep_lock(job_name)
        if not self.warm.redis.set(lock, "1", nx=True, ex=UPKEEP_LOCK_TTL_S):
            return {"skipped": 1}
        try:
            return self._upkeep(job_name)
        finally:
            self.warm.redis.delete(lock)

    def _upkeep(self, job_name: str) -> dict[str, int]:
        now = utcnow()
        stale = now - dt.timedelta(seconds=self.settings.readiness_budget_s + REFILL_BUDGET_S)
        with self.sessions() as session:
            job = store.get_job(session, job_name)
            configs = {c.key: c for c in parse_pools(job.warm_pools, self.settings.idle_timeout_s)}
            rows = list(
                session.scalars(
                    select(Sandbox).where(
                        Sandbox.job == job_name,
                        Sandbox.pool_key.isnot(None),
                        Sandbox.acquired_at.is_(None),
                        Sandbox.state.in_((State.REQUESTED, State.CREATING, State.READY)),
                    )
                )
            )
        counts = {"refill": 0, "idle": 0, "trim": 0, "republished": 0}
        for key in set(configs) | {r.pool_key for r in rows if r.pool_key}:
            cfg = configs.get(key)
            mine = [r for r in rows if r.pool_key == key]
            inflight = [r for r in mine if r.state != State.READY and r.requested_at > stale]
            idle_s = cfg.idle_timeout_s if cfg else self.settings.idle_timeout_s
            live = self._expire_or_republish(
                job_name, key=key, mine=mine, idle_s=idle_s, now=now, counts=counts
            )
            size = cfg.size if cfg else 0
            for row in live[: max(0, len(live) + len(inflight) - size)]:
                if self.warm.withdraw(job_name, key, row.id):
                    self._release(row.id, "warm-trim")
                    counts["trim"] += 1
            if cfg is not None:
                self._refill(job_name, cfg, size - len(live) - len(inflight), counts)
        return counts

    def _expire_or_republish(
        self,
        job_name: str,
        *,
        key: str,
        mine: list[Sandbox],
        idle_s: float,
        now: dt.datetime,
        counts: dict[str, int],
    ) -> list[Sandbox]:
        """Release members idle too long, republish any Redis lost; the rest, oldest first.

        A member claimed by a trainer and not yet handed out in the ledger is skipped:
        each decision is one atomic Redis call against the claim (``WarmStore.retire``,
        ``WarmStore.republish``), never a check followed by an act.
        """
        live: list[Sandbox] = []
        ready = (r for r in mine if r.state == State.READY)
        for row in sorted(ready, key=lambda r: r.last_used_at or r.ready_at or now):
            since = row.last_used_at or row.ready_at or now
            if (now - since).total_seconds() > idle_s:
                if self.warm.retire(job_name, key, row.id):
                    self._release(row.id, "warm-idle")
                    counts["idle"] += 1
                continue
            lease = Lease.from_row(row, self.provider.token_for(row))
            outcome = self.warm.republish(job_name, key, lease)
            if outcome is Republished.CLAIMED:
                continue  # being handed out right now
            counts["republished"] += int(outcome is Republished.REPUBLISHED)
            live.append(row)
        return live

    def _refill(self, job_name: str, cfg: PoolConfig, missing: int, counts: dict[str, int]) -> None:
        for _ in range(max(0, missing)):
            request = cfg.member_request(job_name)
            try:
                sandbox_id, _token = self.provider.intent(request)
            except (AtCapacity, QuotaExceeded):  # warm pods count against both too
                counts["at_cap"] = counts.get("at_cap", 0) + 1
                return
            self.enqueue(Task.POOL_REFILL, [sandbox_id], names.queue_of(Task.POOL_REFILL))
            counts["refill"] += 1

    def _release(self, sandbox_id: str, reason: str) -> None:
        self.enqueue(Task.RELEASE, [sandbox_id, reason], names.queue_of(Task.RELEASE))
