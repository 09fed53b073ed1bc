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
  per timeout, an idle one is reclaimed as its deadline passes: each sweep answers the
  earliest deadline left, and the sweeper sleeps until then (at most ``idle_sweep_s``).

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

# Pop the due entries and push each CLAIM_LEASE_S ahead, atomically: the claim. Also
# answers the earliest deadline left, so the sweeper can sleep until exactly then.
_CLAIM = """
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, ARGV[2])
local later = tonumber(ARGV[1]) + tonumber(ARGV[3])
for _, id in ipairs(due) do redis.call('ZADD', KEYS[1], later, id) end
local first = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
return {due, first[2] or false}
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
    next_due_at: float | None = None  # the earliest deadline left (epoch s); None: none

    def sleep_s(self, now: float, at_most_s: float) -> float:
        """How long the sweeper may sleep: until the next deadline, but never more than
        ``at_most_s`` (a hand-out registered meanwhile may come due sooner)."""
        if self.due >= BATCH:
            return 0.0  # a backlog: sweep again at once
        if self.next_due_at is None:
            return at_most_s
        return min(at_most_s, max(self.next_due_at - now, 0.0))


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
        claimed, first = self._claim(
            keys=[names.IDLE_DEADLINES_KEY], args=[now, BATCH, CLAIM_LEASE_S]
        )
        due = [_text(d) for d in claimed]
        report.due = len(due)
        report.next_due_at = float(first) if first else None
        if not due:
            return report
        rows = self._held(due)
        verdicts = list(self._pool.map(lambda sid: self._judge(sid, rows.get(sid), now), due))
        self._apply(verdicts, report)
        rescheduled = [v.next_at for v in verdicts if v.next_at is not None and not v.reclaimed]
        if rescheduled:
            soonest = min(rescheduled)
            if report.next_due_at is None or soonest < report.next_due_at:
                report.next_due_at = soonest
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

    def _apply(self, verdicts: list[Verdict], report: SweepReport) -> None:
        """The verdicts of one sweep, in batches: one Redis pipeline for the markers, one
        transaction for the ledger, one pipeline for the deadlines (per-sandbox round
        trips made a thousand reclaims at once take seconds of CPU)."""
        reclaimed = [v for v in verdicts if v.reclaimed]
        if reclaimed:
            try:
                self._revoke(reclaimed)
                report.reclaimed = [v.sandbox_id for v in reclaimed]
            except Exception:
                # Their entries keep the claimed score: due again in CLAIM_LEASE_S.
                log.exception("idle reclaim of %d sandboxes failed; retried later", len(reclaimed))
                report.errors += len(reclaimed)
                verdicts = [v for v in verdicts if not v.reclaimed]
        pipe = self.redis.pipeline(transaction=False)
        for v in verdicts:
            if v.reclaimed or v.next_at is None:
                pipe.zrem(names.IDLE_DEADLINES_KEY, v.sandbox_id)
                report.dropped += int(not v.reclaimed)
            else:
                pipe.zadd(names.IDLE_DEADLINES_KEY, {v.sandbox_id: v.next_at})
                report.rescheduled += 1
        pipe.execute()

    def _revoke(self, verdicts: list[Verdict]) -> None:
        """execd refuses already; now the client's markers, the ledger, the deletes."""
        pipe = self.redis.pipeline(transaction=False)
        for v in verdicts:
            if v.idle_s is not None:  # a first reclaim (a retried one already did this)
                marker = json.dumps({"idle_s": v.idle_s, "at": utcnow().isoformat()})
                pipe.set(names.reclaimed_key(v.sandbox_id), marker, ex=RECLAIMED_TTL_S)
        pipe.execute()
        idle = {v.sandbox_id: v.idle_s for v in verdicts}
        with self.sessions.begin() as session:
            rows = session.scalars(
                select(Sandbox)
                .where(Sandbox.id.in_(list(idle)), Sandbox.state == State.READY)
                .order_by(Sandbox.id)  # one lock order for every sweep
                .with_for_update()
            ).all()
            for row in rows:
                detail: dict[str, object] = {"reason": names.LeakKind.IDLE.value}
                if idle[row.id] is not None:
                    detail["idle_s"] = round(float(idle[row.id] or 0.0), 3)
                store.transition(session, row, State.RELEASING, actor=ACTOR, detail=detail)
        queue = names.queue_of(Task.RELEASE)
        for sandbox_id in idle:
            self.enqueue(Task.RELEASE, [sandbox_id, names.LeakKind.IDLE.value], queue)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
