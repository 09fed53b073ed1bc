"""Idle reclaim: a held sandbox nobody uses for its job's ``idle_timeout_s`` goes back.

Who knows what. Only execd knows when a sandbox was last used (its last authenticated
call that did something, and whether a command runs now: ``execd/activity.py``); only
the broker knows when it was handed out and to which job's timeout it is held. Polling
every held sandbox every tick would cost N requests a second at N held sandboxes, so
the broker keeps, per held sandbox, the EARLIEST moment it could have been idle that
long, in one Redis sorted set (``names.IDLE_DEADLINES_KEY``), and asks execd only when
that moment passes:

- at hand-out (cold acquire or warm claim) the deadline is hand-out + timeout;
- when it passes, one ``POST /v1/reclaim`` asks execd to reclaim atomically (no call
  running, idle for the timeout, counting no earlier than the hand-out). Either it did,
  or it answers how long it has been idle, and the deadline moves to exactly
  last activity + timeout (a command still running: now + timeout, the earliest the
  sandbox could be idle that long once it ends). So a sandbox in use costs one request
  per timeout, an idle one is reclaimed within one sweep of its deadline.

A reclaim revokes at once and deletes through the normal path: execd already refuses
every call (410, ``SandboxReclaimed`` in the client); ``sandman:reclaimed:<id>`` is set
so the client still says ``SandboxReclaimed`` once the pod is gone; the ledger row goes
``ready -> releasing`` with reason ``idle`` (audit views and the admin UI show it); then
the ``sandman.release`` task deletes it like any release.

Crash safety. A sweep claims its due entries by pushing their score ``CLAIM_LEASE_S``
ahead in the same Lua call that reads them, so two workers never check one sandbox and
a worker killed mid-way leaves entries that come due again. Every step is idempotent
(execd answers "reclaimed" again; a ``releasing`` row of a reclaimed sandbox gets its
release re-enqueued), and the GC finishes a ``releasing`` row whatever happens. Entries
lost altogether (Redis flushed, a worker killed between hand-out and registration, a
timeout set on a job that already holds sandboxes) are put back by ``reconcile``, which
one worker runs every ``RECONCILE_S``.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from broker import names
from broker.errors import SandmanError
from broker.ledger import store
from broker.ledger.models import Job, Sandbox, utcnow
from broker.ledger.states import State
from broker.names import Task
from broker.ownership.provider import Provider
from broker.pools.upkeep import Enqueue
from broker.wire.execd import Endpoint, reclaim_call, shared_http

log = logging.getLogger(__name__)

CLAIM_LEASE_S = 30.0  # a claimed entry comes due again after this if its worker died
RETRY_S = 5.0  # execd did not answer: ask again this much later (the GC judges a lost pod)
RECLAIMED_TTL_S = 86400  # how long the client can still learn why its sandbox went
RECONCILE_S = 30.0
MIN_RECHECK_S = 0.1  # never reschedule into the past (clocks of two hosts may differ)
BATCH = 512  # entries one sweep claims at most; the next sweep takes the rest
ACTOR = "idle-reclaim"

# Pop the due entries and push each CLAIM_LEASE_S ahead, atomically: the claim.
_CLAIM = """
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, ARGV[2])
local later = tonumber(ARGV[1]) + tonumber(ARGV[3])
for _, id in ipairs(due) do redis.call('ZADD', KEYS[1], later, id) end
return due
"""
# Add, or move earlier (never later): what a registration or the reconcile may do.
_EARLIER = """
for i = 1, #ARGV, 2 do
  local cur = redis.call('ZSCORE', KEYS[1], ARGV[i + 1])
  if not cur or tonumber(cur) > tonumber(ARGV[i]) then
    redis.call('ZADD', KEYS[1], ARGV[i], ARGV[i + 1])
  end
end
return 0
"""


@dataclass
class Verdict:
    """What one due entry came to: reclaimed, checked again at ``next_at``, or dropped."""

    sandbox_id: str
    reclaimed: bool = False
    next_at: float | None = None  # None and not reclaimed: no longer held, dropped
    idle_s: float | None = None


@dataclass
class SweepReport:
    """What one sweep did: how many entries were due and what became of each."""

    due: int = 0
    reclaimed: list[str] = field(default_factory=list)
    rescheduled: int = 0
    dropped: int = 0
    errors: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, outcome: str, sandbox_id: str) -> None:
        """Counted from the sweep's pool threads, hence the lock."""
        with self._lock:
            if outcome == "reclaimed":
                self.reclaimed.append(sandbox_id)
            else:
                setattr(self, outcome, getattr(self, outcome) + 1)


class IdleReclaimer:
    """Registers held sandboxes and reclaims those idle past their job's timeout."""

    def __init__(
        self,
        sessions: sessionmaker[Session],
        redis: Any,
        provider: Provider,
        enqueue: Enqueue,
        *,
        threads: int = 16,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.sessions = sessions
        self.redis = redis
        self.provider = provider
        self.enqueue = enqueue
        self.clock = clock
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="sandman-idle")
        self._claim = redis.register_script(_CLAIM)
        self._earlier = redis.register_script(_EARLIER)

    # -- registration ---------------------------------------------------------------

    def register(
        self, sandbox_id: str, timeout_s: float | None, since: float | None = None
    ) -> None:
        """A sandbox was handed out (``since``, epoch seconds; now by default) under a job
        whose idle timeout is ``timeout_s`` (None or 0: the job does not reclaim)."""
        if timeout_s:
            at = (since if since is not None else self.clock()) + timeout_s
            self._earlier(keys=[names.IDLE_DEADLINES_KEY], args=[at, sandbox_id])

    def reconcile(self) -> int:
        """Put back the deadline of every held sandbox of a reclaiming job (one worker at
        a time, every RECONCILE_S): what a lost registration or a new timeout missed."""
        lock = names.IDLE_DEADLINES_KEY + ":reconcile"
        if not self.redis.set(lock, "1", nx=True, ex=int(RECONCILE_S)):
            return 0
        with self.sessions() as session:
            held = session.execute(
                select(Sandbox.id, Sandbox.acquired_at, Job.idle_timeout_s)
                .join(Job, Job.name == Sandbox.job)
                .where(
                    Sandbox.installation == self.provider.settings.installation_id,
                    Sandbox.state == State.READY,
                    Sandbox.acquired_at.isnot(None),
                    Job.idle_timeout_s > 0,
                )
            ).all()
        args: list[Any] = []
        for sandbox_id, acquired_at, timeout_s in held:
            if acquired_at is not None and timeout_s:
                args += [acquired_at.timestamp() + timeout_s, sandbox_id]
        for i in range(0, len(args), 2000):
            self._earlier(keys=[names.IDLE_DEADLINES_KEY], args=args[i : i + 2000])
        return len(held)

    # -- the sweep ------------------------------------------------------------------

    def sweep(self) -> SweepReport:
        """Claim the due entries, judge them in parallel, apply the verdicts."""
        report = SweepReport()
        now = self.clock()
        due = [
            _text(d)
            for d in self._claim(keys=[names.IDLE_DEADLINES_KEY], args=[now, BATCH, CLAIM_LEASE_S])
        ]
        report.due = len(due)
        if not due:
            return report
        rows = self._held(due)

        def settle(sid: str) -> None:  # judged and applied in the pool: no serial tail
            self._apply(self._judge(sid, rows.get(sid), now), report)

        list(self._pool.map(settle, due))
        return report

    def _held(self, ids: Iterable[str]) -> dict[str, tuple[Sandbox, float | None]]:
        with self.sessions() as session:
            found = session.execute(
                select(Sandbox, Job.idle_timeout_s)
                .join(Job, Job.name == Sandbox.job)
                .where(Sandbox.id.in_(list(ids)))
            ).all()
            session.expunge_all()
        return {row.id: (row, timeout) for row, timeout in found}

    def _judge(
        self, sandbox_id: str, found: tuple[Sandbox, float | None] | None, now: float
    ) -> Verdict:
        if found is None:
            return Verdict(sandbox_id)
        row, timeout_s = found
        if row.state == State.RELEASING and self.redis.exists(names.reclaimed_key(sandbox_id)):
            return Verdict(sandbox_id, reclaimed=True)  # a sweep died before the release
        if (
            row.state != State.READY
            or row.acquired_at is None
            or row.pool_key is not None
            or not row.address
            or not timeout_s
        ):
            return Verdict(sandbox_id)  # released, back in a pool, or the job stopped reclaiming
        held_s = now - row.acquired_at.timestamp()
        try:
            endpoint = Endpoint(row.address, self.provider.token_for(row), who=f"execd of {row.id}")
            reply = endpoint.send(shared_http(), reclaim_call(timeout_s, held_s))
        except SandmanError as exc:
            log.info("idle check of %s: %s", sandbox_id, exc)
            return Verdict(sandbox_id, next_at=now + min(RETRY_S, timeout_s))
        idle_s = float(reply.get("idle_s") or 0.0)
        if reply.get("reclaimed"):
            return Verdict(sandbox_id, reclaimed=True, idle_s=idle_s)
        if reply.get("running"):
            return Verdict(sandbox_id, next_at=now + timeout_s, idle_s=idle_s)
        wait = max(timeout_s - idle_s, MIN_RECHECK_S)
        return Verdict(sandbox_id, next_at=now + wait, idle_s=idle_s)

    def _apply(self, verdict: Verdict, report: SweepReport) -> None:
        sid = verdict.sandbox_id
        key = names.IDLE_DEADLINES_KEY
        try:
            if verdict.reclaimed:
                self._revoke(sid, verdict.idle_s)
                self.redis.zrem(key, sid)
                report.add("reclaimed", sid)
            elif verdict.next_at is None:
                self.redis.zrem(key, sid)
                report.add("dropped", sid)
            else:
                self.redis.zadd(key, {sid: verdict.next_at})
                report.add("rescheduled", sid)
        except Exception:
            # The entry keeps its claimed score: it comes due again in CLAIM_LEASE_S.
            log.exception("idle reclaim of %s failed; retried later", sid)
            report.add("errors", sid)

    def _revoke(self, sandbox_id: str, idle_s: float | None) -> None:
        """execd refuses already; now the client's marker, the ledger, the delete."""
        if idle_s is not None:  # a first reclaim (a retried one already did this)
            marker = json.dumps({"idle_s": idle_s, "at": utcnow().isoformat()})
            self.redis.set(names.reclaimed_key(sandbox_id), marker, ex=RECLAIMED_TTL_S)
        with self.sessions.begin() as session:
            row = store.lock_row(session, sandbox_id)
            if row is not None and row.state == State.READY:
                detail: dict[str, object] = {"reason": names.LeakKind.IDLE.value}
                if idle_s is not None:
                    detail["idle_s"] = round(idle_s, 3)
                store.transition(session, row, State.RELEASING, actor=ACTOR, detail=detail)
        self.enqueue(
            Task.RELEASE, [sandbox_id, names.LeakKind.IDLE.value], names.queue_of(Task.RELEASE)
        )


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
