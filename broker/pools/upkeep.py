"""Pool upkeep: keep every job's warm pools at size, trim them, expire idle members.

Run by the ``pool_upkeep`` beat task and after each warm hand-out (a paced replacement,
counts only). A pass costs the same at pool size 10 and 10,000: it decides from per-pool
counts and reads only the members it acts on (see ``_upkeep``).
Upkeep only writes intent rows and enqueues work: refills go to the ``pool`` queue (the
paced create lives with the acquire service), deletes to the ``release`` queue, so a
pass never waits on Kubernetes. One runner per job at a time (a Redis lock), because two
passes counting the same in-flight rows would overfill the pool.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, or_, select
from sqlalchemy.orm import Session, sessionmaker

from broker import names
from broker.errors import AtCapacity, QuotaExceeded, SandmanError
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

log = logging.getLogger(__name__)


REFILL_BATCH = 500  # refill intents per pool and pass; far above any pacer's 5 s worth
EXPIRE_BATCH = 1_000  # idle members released per pool and pass (the next beat does more)
REPAIR_EVERY_S = 60  # a pool's O(pool) repair runs at most this often
REPAIR_BATCH = 1_000  # republish decisions per pipelined round trip


def _since() -> Any:
    """When a member last served (or became ready): its idle clock and the trim's order."""
    return func.coalesce(Sandbox.last_used_at, Sandbox.ready_at)


def _members(job_name: str, key: str) -> tuple[Any, ...]:
    """The ledger's warm members of one pool: ready, in the pool, never handed out."""
    return (
        Sandbox.job == job_name,
        Sandbox.pool_key == key,
        Sandbox.state == State.READY,
        Sandbox.acquired_at.is_(None),
    )


def pool_counts(session: Session, job_name: str, stale: dt.datetime) -> dict[str, tuple[int, int]]:
    """Per pool key of the job: (ready members, creates in flight since ``stale``), in
    one grouped query; no member row is read into Python."""
    pending = Sandbox.state.in_((State.REQUESTED, State.CREATING))
    rows = session.execute(
        select(
            Sandbox.pool_key,
            func.count().filter(Sandbox.state == State.READY),
            func.count().filter(pending, Sandbox.requested_at > stale),
        )
        .where(
            Sandbox.job == job_name,
            Sandbox.pool_key.isnot(None),
            Sandbox.acquired_at.is_(None),
            Sandbox.state.in_((State.REQUESTED, State.CREATING, State.READY)),
        )
        .group_by(Sandbox.pool_key)
    ).all()
    return {str(key): (int(ready), int(inflight)) for key, ready, inflight in rows}


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
        return {job: self._upkeep_isolated(job) for job in sorted(jobs)}

    def _upkeep_isolated(self, job_name: str) -> dict[str, Any]:
        """One job's upkeep, its typed failure kept to itself: a job whose pool names a
        missing image (or whose tenant is over quota) must not stop every job after it
        in the pass from being refilled."""
        try:
            return self.upkeep_job(job_name)
        except SandmanError as exc:
            log.warning("pool upkeep of job %s failed: %s", job_name, exc)
            return {"error": exc.code}

    def upkeep_job(self, job_name: str, *, maintain: bool = True) -> dict[str, int]:
        """Refill to size; with ``maintain`` (the beat) also expire idle members, trim, and
        repair what Redis lost. A hand-out passes ``maintain=False``: its replacement needs
        only the counts. One runner per job at a time."""
        lock = names.pool_upkeep_lock(job_name)
        if not self.warm.redis.set(lock, "1", nx=True, ex=UPKEEP_LOCK_TTL_S):
            return {"skipped": 1}
        try:
            return self._upkeep(job_name, maintain)
        finally:
            self.warm.redis.delete(lock)

    def _upkeep(self, job_name: str, maintain: bool) -> dict[str, int]:
        """Decide from counts (one grouped query), then touch only the members a decision
        names: the expired, the trimmed, the refills. Never a pass over every member,
        which at 5,000 warm pods was 5,000 ledger rows and 5,000 Redis calls per claim."""
        now = utcnow()
        stale = now - dt.timedelta(seconds=self.settings.readiness_budget_s + REFILL_BUDGET_S)
        with self.sessions() as session:
            job = store.get_job(session, job_name)
            configs = {c.key: c for c in parse_pools(job.warm_pools, self.settings.idle_timeout_s)}
            pools = pool_counts(session, job_name, stale)
            default_idle = self.settings.idle_timeout_s
        counts = {"refill": 0, "idle": 0, "trim": 0, "republished": 0}
        for key in sorted(set(configs) | set(pools)):
            cfg = configs.get(key)
            ready, inflight = pools.get(key, (0, 0))
            if maintain:
                idle_s = cfg.idle_timeout_s if cfg else default_idle
                ready -= self._expire(job_name, key, idle_s, now, counts)
                self._repair(job_name, key=key, ready=ready, idle_s=idle_s, now=now, counts=counts)
            size = cfg.size if cfg else 0
            if maintain and ready + inflight > size:
                ready -= self._trim(job_name, key, min(ready, ready + inflight - size), counts)
            if cfg is not None:
                self._refill(job_name, cfg, size - ready - inflight, counts)
        return counts

    def _expire(
        self, job_name: str, key: str, idle_s: float, now: dt.datetime, counts: dict[str, int]
    ) -> int:
        """Release members idle past ``idle_s`` (only those rows are read); how many left
        the pool. A member a trainer claimed meanwhile is kept (``WarmStore.retire`` is
        atomic against the claim) but no longer counts as warm either."""
        cutoff = now - dt.timedelta(seconds=idle_s)
        with self.sessions() as session:
            ids = list(
                session.scalars(
                    select(Sandbox.id)
                    .where(*_members(job_name, key), _since() < cutoff)
                    .order_by(_since())
                    .limit(EXPIRE_BATCH)
                )
            )
        for sandbox_id in ids:
            if self.warm.retire(job_name, key, sandbox_id):
                self._release(sandbox_id, "warm-idle")
                counts["idle"] += 1
        return len(ids)

    def _repair(
        self,
        job_name: str,
        *,
        key: str,
        ready: int,
        idle_s: float,
        now: dt.datetime,
        counts: dict[str, int],
    ) -> None:
        """Republish members Redis lost (a restart without persistence, a claim whose
        hand-out never came). Costs O(pool), so it runs only when Redis queues fewer ids
        than the ledger has ready members, and at most once per ``REPAIR_EVERY_S`` per
        pool (a Redis that lost its data lost that marker too: the repair is immediate).
        Each decision is one atomic call against the claim (``WarmStore.republish``)."""
        if self.warm.queued(job_name, key) >= ready:
            return
        marker = f"{names.pool_upkeep_lock(job_name)}:repair:{key}"
        if not self.warm.redis.set(marker, "1", nx=True, ex=REPAIR_EVERY_S):
            return
        cutoff = now - dt.timedelta(seconds=idle_s)
        with self.sessions() as session:
            rows = session.scalars(
                select(Sandbox)
                .where(*_members(job_name, key), or_(_since().is_(None), _since() >= cutoff))
                .order_by(_since())
            )
            leases = [Lease.from_row(row, self.provider.token_for(row)) for row in rows]
        for start in range(0, len(leases), REPAIR_BATCH):
            outcomes = self.warm.republish_many(job_name, key, leases[start : start + REPAIR_BATCH])
            counts["republished"] += sum(o is Republished.REPUBLISHED for o in outcomes)

    def _trim(self, job_name: str, key: str, excess: int, counts: dict[str, int]) -> int:
        """Withdraw and release the ``excess`` oldest members (only those rows are read)."""
        if excess <= 0:
            return 0
        with self.sessions() as session:
            ids = list(
                session.scalars(
                    select(Sandbox.id)
                    .where(*_members(job_name, key))
                    .order_by(_since().asc().nulls_last())
                    .limit(excess)
                )
            )
        trimmed = 0
        for sandbox_id in ids:
            if self.warm.withdraw(job_name, key, sandbox_id):
                self._release(sandbox_id, "warm-trim")
                trimmed += 1
        counts["trim"] += trimmed
        return trimmed

    def _refill(self, job_name: str, cfg: PoolConfig, missing: int, counts: dict[str, int]) -> None:
        """Intents for up to ``REFILL_BATCH`` missing members (the next beat writes more):
        a pass filling 5,000 at once outlived its lock and a second pass overfilled."""
        for _ in range(max(0, min(missing, REFILL_BATCH))):
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
