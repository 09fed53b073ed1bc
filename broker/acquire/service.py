"""Acquire and release orchestration: what the thin Celery tasks call.

An acquire is: a warm claim if one fits (no Kubernetes call), otherwise the live-pod cap,
the committed intent, a concurrency slot and a token from the shared pacer, and the
provider's create. The outcome goes to the trainer's mailbox (``broker.wire.mailbox``); if
the trainer gave up meanwhile the sandbox is released here, never stranded.

Everything is idempotent by request id (the provider's intent is, and tokens are derived),
so a redelivered acquire finds its row and returns the same sandbox.

Workers inject ``enqueue`` (send a task by name), so this module never imports workers.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from broker import names
from broker.backends.base import Backend
from broker.errors import (
    AcquireTimeout,
    CreateFailed,
    InvalidRequest,
    SandmanError,
    ServiceUnavailable,
)
from broker.ledger import store
from broker.ledger.models import Job, Sandbox, utcnow
from broker.ledger.states import Role, State
from broker.names import Task
from broker.ownership.provider import AtCapacity, Provider
from broker.pacing import Limits, Pacer
from broker.pools import reuse
from broker.pools.store import WarmStore, parse_pools, pool_key
from broker.settings import Settings
from broker.wire import mailbox
from broker.wire.types import AcquireSpec, Lease

log = logging.getLogger(__name__)

Enqueue = Callable[[str, list[Any], str], None]
REFILL_BUDGET_S = 900.0


def error_payload(exc: BaseException) -> dict[str, Any]:
    if _service_down(exc):  # PostgreSQL or Redis unreachable: say so, not "unexpected"
        exc = ServiceUnavailable(f"{type(exc).__name__}: {str(exc)[:500]}")
    code = exc.code if isinstance(exc, SandmanError) else "infrastructure_error"
    return {"error": {"code": code, "message": str(exc)[:2000], "type": type(exc).__name__}}


def _service_down(exc: BaseException) -> bool:
    import redis as redis_lib
    from sqlalchemy.exc import DBAPIError

    if isinstance(exc, DBAPIError):
        return bool(exc.connection_invalidated) or type(exc).__name__ == "OperationalError"
    return isinstance(exc, redis_lib.ConnectionError | redis_lib.TimeoutError)


@dataclass
class _Watch:
    event: threading.Event
    deadline: float  # monotonic


class CancelWatcher:
    """One thread per process notices trainers that gave up (cancel flag or deadline)."""

    def __init__(self, redis: Any, interval_s: float = 0.1) -> None:
        self.redis = redis
        self.interval_s = interval_s
        self._watches: dict[str, _Watch] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def watch(self, request_id: str, deadline: float) -> threading.Event:
        event = threading.Event()
        with self._lock:
            self._watches[request_id] = _Watch(event, deadline)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="cancel-watch", daemon=True)
                self._thread.start()
        return event

    def unwatch(self, request_id: str) -> None:
        with self._lock:
            self._watches.pop(request_id, None)

    def _run(self) -> None:
        while True:
            time.sleep(self.interval_s)
            with self._lock:
                items = list(self._watches.items())
            if not items:
                continue
            now = time.monotonic()
            try:
                flags = self.redis.mget([mailbox.cancel_key(rid) for rid, _ in items])
            except Exception:  # Redis hiccup: deadlines still apply
                flags = [None] * len(items)
            for (_, watch), flag in zip(items, flags, strict=True):
                if flag or now >= watch.deadline:
                    watch.event.set()


class Broker:
    """The broker services a worker process runs; one instance per process."""

    def __init__(
        self,
        settings: Settings,
        sessions: sessionmaker[Session],
        backend: Backend,
        redis: Any,
        *,
        enqueue: Enqueue | None = None,
        provider: Provider | None = None,
        actor: str = "broker",
    ) -> None:
        self.settings = settings
        self.sessions = sessions
        self.redis = redis
        self.provider = provider or Provider(settings, sessions, backend, actor=actor)
        self.pacer = Pacer(redis, slot_ttl_s=settings.readiness_budget_s + 120)
        self.warm = WarmStore(redis)
        self.watcher = CancelWatcher(redis)
        self.enqueue = enqueue or (lambda name, args, queue: None)
        self.actor = actor

    # -- acquire ----------------------------------------------------------------------

    def acquire_and_deliver(self, request: dict[str, Any]) -> dict[str, Any]:
        """Run one acquire and push its outcome to the trainer's mailbox."""
        rid = str(request["request_id"])
        try:
            lease = self.acquire(request)
            payload: dict[str, Any] = {"lease": lease.to_dict()}
        except Exception as exc:
            if not isinstance(exc, SandmanError):
                log.exception("acquire %s failed unexpectedly", rid)
            payload = error_payload(exc)
            lease = None
        if not mailbox.deliver(self.redis, rid, payload) and lease is not None:
            self.provider.release(lease.sandbox_id, actor=self.actor, reason="caller-gave-up")
            return {"cancelled": True, "sandbox_id": lease.sandbox_id}
        return {k: v for k, v in payload.get("lease", payload).items() if k != "token"}

    def spec_from(self, request: dict[str, Any]) -> AcquireSpec:
        enqueued = request.get("enqueued_at")
        try:
            return AcquireSpec(
                job=str(request["job"]),
                image=str(request["image"]),
                cpu_m=int(request.get("cpu_m", 1000)),
                memory_b=int(request.get("memory_b", 1 << 30)),
                role=Role(request.get("role", Role.ROLLOUT.value)),
                request_id=str(request["request_id"]),
                image_digest=request.get("image_digest"),
                base_commit=request.get("base_commit"),
                workdir=str(request.get("workdir") or "/"),
                env=dict(request.get("env") or {}),
                owner=request.get("owner"),
                enqueued_at=dt.datetime.fromtimestamp(float(enqueued), dt.UTC)
                if enqueued
                else utcnow(),
            )
        except (KeyError, ValueError, TypeError) as exc:
            raise InvalidRequest(f"malformed acquire request: {exc}") from exc

    def acquire(self, request: dict[str, Any]) -> Lease:
        spec = self.spec_from(request)
        rid = spec.request_id or ""
        wall_deadline = float(request.get("deadline") or time.time() + 600)
        deadline = time.monotonic() + (wall_deadline - time.time())
        with self.sessions() as session:
            job = self.provider.job(session, spec.job)
            limits = self.limits(job)
            max_live, reuse_on = job.max_live, job.reuse
            existing = store.by_request(session, rid)
        if existing is None and mailbox.cancelled(self.redis, rid):
            raise AcquireTimeout(f"acquire {rid} was abandoned by its trainer while queued")
        if existing is None:
            key = pool_key(
                spec.image, spec.image_digest, spec.base_commit, spec.cpu_m, spec.memory_b
            )
            warm = self.warm.claim(spec.job, key, rid)
            if warm is not None:
                self.claimed(warm.sandbox_id, rid, spec.owner, None, spec.enqueued_at)
                return warm
        if time.monotonic() >= deadline:
            raise AcquireTimeout(f"acquire {rid} expired in the queue")
        sandbox_id, token = self._intent_under_cap(spec, max_live, deadline)
        give_up = self.watcher.watch(rid, deadline)
        submitted = False
        try:
            with self.pacer.create_slot(limits, deadline=deadline):
                submitted = True
                lease = self.provider.create(
                    sandbox_id, token, give_up=give_up, workdir=spec.workdir, env=spec.env
                )
        except AcquireTimeout:
            if not submitted:  # never sent to the backend: close the intent row
                self.provider.release(sandbox_id, actor=self.actor, reason="paced-out")
            raise
        finally:
            self.watcher.unwatch(rid)
        if reuse_on:
            self._baseline_or_release(lease)
        return lease

    def _baseline_or_release(self, lease: Lease) -> None:
        try:
            reuse.record_baseline(lease.address, lease.token)
        except Exception as exc:
            self.provider.release(lease.sandbox_id, actor=self.actor, reason="baseline-failed")
            raise CreateFailed(f"baseline for checked reuse failed: {exc}") from exc

    def limits(self, job: Job) -> Limits:
        return Limits(
            rate=self.settings.create_rate,
            burst=self.settings.create_burst,
            max_concurrent=self.settings.max_concurrent_creates,
            job=job.name,
            job_rate=job.create_rate,
            job_burst=job.create_burst,
            job_max_concurrent=job.max_concurrent_creates,
        )

    def _intent_under_cap(
        self, spec: AcquireSpec, max_live: int | None, deadline: float
    ) -> tuple[str, str]:
        """The intent, once the job is under its live-pod cap (hard: see Provider.intent);
        waiting happens here, queue-side, before any pacer token or API call."""
        while True:
            try:
                return self.provider.intent(spec)
            except AtCapacity:
                if time.monotonic() >= deadline:
                    raise AcquireTimeout(
                        f"job {spec.job} stayed at its cap of {max_live} live sandboxes"
                    ) from None
                time.sleep(0.1)

    # -- warm hand-out ------------------------------------------------------------------

    def claimed(
        self,
        sandbox_id: str,
        request_id: str,
        owner: str | None,
        latency_s: float | None,
        enqueued_at: dt.datetime | None = None,
    ) -> None:
        """Ledger side of a warm claim (the Redis claim already happened), then replace."""
        try:
            self.provider.hand_out(sandbox_id, request_id=request_id, owner=owner)
        except (CreateFailed, InvalidRequest) as exc:
            log.info("hand-out of %s skipped: %s", sandbox_id, exc)
            return
        with self.sessions.begin() as session:
            row = store.lock_row(session, sandbox_id)
            if row is not None:
                row.enqueued_at = enqueued_at or row.acquired_at
                if latency_s is None and enqueued_at is not None and row.acquired_at:
                    latency_s = (row.acquired_at - enqueued_at).total_seconds()
                row.acquire_latency_s = latency_s
                job = row.job
        self.upkeep_job(job)  # a hand-out triggers a paced replacement

    # -- release, heartbeat -------------------------------------------------------------

    def release(self, sandbox_id: str, reason: str = "released") -> str:
        """Checked reuse when the job allows it and the trainer released; else delete."""
        with self.sessions() as session:
            row = session.get(Sandbox, sandbox_id)
            if row is None:
                return "unknown"
            job, key, state = row.job, row.pool_key, row.state
            token = self.provider.token_for(row)
        if key is not None:
            self.warm.withdraw(job, key, sandbox_id)
        if reason == "released" and state == State.READY:
            new_key = reuse.try_reuse(
                self.sessions,
                sandbox_id,
                token,
                max_reuses=self.settings.max_reuses,
                actor=self.actor,
            )
            if new_key is not None:
                self._publish(sandbox_id, token)
                return "reused"
        self.provider.release(sandbox_id, actor=self.actor, reason=reason)
        return "released"

    def heartbeat(self, sandbox_id: str, owner: str | None = None) -> str:
        return self.provider.heartbeat(sandbox_id, owner).isoformat()

    def _publish(self, sandbox_id: str, token: str) -> None:
        with self.sessions() as session:
            row = session.get(Sandbox, sandbox_id)
            if row is None or row.pool_key is None or row.state != State.READY:
                return
            lease = Lease(
                sandbox_id=row.id,
                pod_name=row.pod_name,
                address=row.address or "",
                token=token,
                job=row.job,
                role=str(row.role),
                warm=True,
                reused=row.reuse_count > 0,
                create_to_ready_s=row.create_to_ready_s,
            )
            job, key = row.job, row.pool_key
        self.warm.publish(job, key, lease)

    # -- pools --------------------------------------------------------------------------

    def refill(self, sandbox_id: str) -> str:
        """Paced create of one warm intent row, then publish it for claims."""
        with self.sessions() as session:
            row = session.get(Sandbox, sandbox_id)
            if row is None or row.state not in (State.REQUESTED, State.CREATING):
                return "skipped"
            job = store.get_job(session, row.job)
            limits, reuse_on = self.limits(job), job.reuse
            token = self.provider.token_for(row)
            wanted = any(c.key == row.pool_key and c.size > 0 for c in parse_pools(job.warm_pools))
        if not wanted:  # the pool shrank or went away while this refill was queued
            self.provider.release(sandbox_id, actor=self.actor, reason="pool-shrunk")
            return "cancelled"
        deadline = time.monotonic() + REFILL_BUDGET_S
        submitted = False
        try:
            with self.pacer.create_slot(limits, deadline=deadline):
                submitted = True
                lease = self.provider.create(sandbox_id, token)
        except AcquireTimeout:
            if not submitted:
                self.provider.release(sandbox_id, actor=self.actor, reason="paced-out")
            raise
        if reuse_on:
            self._baseline_or_release(lease)
        self._publish(sandbox_id, token)
        return "published"

    def upkeep_all(self) -> dict[str, Any]:
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
        if not self.redis.set(lock, "1", nx=True, ex=30):
            return {"skipped": 1}
        try:
            return self._upkeep(job_name)
        finally:
            self.redis.delete(lock)

    def _upkeep(self, job_name: str) -> dict[str, int]:
        now = utcnow()
        stale = now - dt.timedelta(seconds=self.settings.readiness_budget_s + REFILL_BUDGET_S)
        with self.sessions() as session:
            job = store.get_job(session, job_name)
            configs = {c.key: c for c in parse_pools(job.warm_pools, job.idle_timeout_s)}
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
            default_idle = job.idle_timeout_s
        counts = {"refill": 0, "idle": 0, "trim": 0, "republished": 0}
        keys = set(configs) | {r.pool_key for r in rows if r.pool_key}
        for key in keys:
            cfg = configs.get(key)
            size = cfg.size if cfg else 0
            idle_s = cfg.idle_timeout_s if cfg else default_idle
            mine = [r for r in rows if r.pool_key == key]
            inflight = [r for r in mine if r.state != State.READY and r.requested_at > stale]
            live: list[Sandbox] = []
            for row in sorted(
                (r for r in mine if r.state == State.READY),
                key=lambda r: r.last_used_at or r.ready_at or now,
            ):
                if self.warm.is_claimed(row.id):
                    continue  # being handed out right now
                since = row.last_used_at or row.ready_at or now
                if (now - since).total_seconds() > idle_s:
                    self.warm.withdraw(job_name, key, row.id)
                    self.enqueue(Task.RELEASE, [row.id, "warm-idle"], names.queue_of(Task.RELEASE))
                    counts["idle"] += 1
                    continue
                if not self.warm.is_published(job_name, key, row.id):
                    self._publish(row.id, self.provider.token_for(row))
                    counts["republished"] += 1
                live.append(row)
            for row in live[: max(0, len(live) + len(inflight) - size)]:
                if self.warm.withdraw(job_name, key, row.id):
                    self.enqueue(Task.RELEASE, [row.id, "warm-trim"], names.queue_of(Task.RELEASE))
                    counts["trim"] += 1
            if cfg is None:
                continue
            for _ in range(max(0, size - len(live) - len(inflight))):
                spec = AcquireSpec(
                    job=job_name,
                    image=cfg.image,
                    cpu_m=cfg.cpu_m,
                    memory_b=cfg.memory_b,
                    image_digest=cfg.image_digest,
                    base_commit=cfg.base_commit,
                    pool_key=key,
                    request_id=f"warm-{uuid.uuid4().hex}",
                    role=Role.ROLLOUT,
                )
                try:
                    sandbox_id, _token = self.provider.intent(spec)
                except AtCapacity:  # warm pods count against the job's live cap too
                    counts["at_cap"] = counts.get("at_cap", 0) + 1
                    break
                self.enqueue(Task.POOL_REFILL, [sandbox_id], names.queue_of(Task.POOL_REFILL))
                counts["refill"] += 1
        return counts
