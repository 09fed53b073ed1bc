"""Acquire and release orchestration: what the thin Celery tasks call.

The one path of an acquire, each layer crossed once: the client (which already tried the
warm pool: a hit never reaches this module) -> queue -> task -> ``acquire_and_deliver``,
the broker-side door that parses the message into an ``AcquireRequest`` -> the provider's
one admission step (idempotency by request id, the job's live cap, the committed intent)
-> a concurrency slot and a token from the shared pacer -> the provider's create ->
the trainer's mailbox (``broker.wire.mailbox``). If the trainer gave up meanwhile the
sandbox is released here, never stranded.

Everything is idempotent by request id (the admission is, and tokens are derived), so a
redelivered acquire finds its row and returns the same sandbox. Warm pools are upkept
by ``broker.pools.upkeep``; this module only runs their paced creates (``refill``).

Workers inject ``enqueue`` (send a task by name), so this module never imports workers.
"""

from __future__ import annotations

import datetime as dt
import functools
import logging
import random
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from broker import failpoints
from broker.acquire.cancel import CancelWatcher
from broker.acquire.fairshare import FairQueue, default_gate
from broker.acquire.idle import IdleReclaimer
from broker.backends.base import INBOX, Backend, BlobInbox
from broker.errors import (
    AcquireTimeout,
    AtCapacity,
    CreateFailed,
    InvalidRequest,
    SandmanError,
    ServiceUnavailable,
)
from broker.ledger import store
from broker.ledger.models import Job, Sandbox
from broker.ledger.states import State
from broker.names import Queue, Task
from broker.ownership.provider import Provider
from broker.pacing import Limits, Pacer, reserve_horizon
from broker.pools import reuse
from broker.pools.prepull import PrePull
from broker.pools.store import WarmStore, parse_pools
from broker.pools.upkeep import REFILL_BUDGET_S, Enqueue, PoolUpkeep
from broker.settings import Settings
from broker.snapshots.service import SnapshotService
from broker.snapshots.store import open_store
from broker.wire import mailbox
from broker.wire.errors import payload_details
from broker.wire.request import AcquireRequest
from broker.wire.types import Lease

log = logging.getLogger(__name__)

CAP_POLL_S = 0.1  # how often a queued acquire re-asks for room under its job's live cap
GATE_WAIT_S = 0.25  # longest wait for a freed gate place before asking the fair queue again
THROTTLED_POLL_S = 0.05  # least wait when every backlogged job waits for its own bucket


def error_payload(exc: BaseException, request_id: str = "") -> dict[str, Any]:
    """The trainer's copy of a failure: a typed error's own message, and for anything
    untyped only a generic one. The text of an untyped error (a database error quotes
    its SQL statement) stays in the worker log, which the caller writes."""
    exc = typed(exc)
    if isinstance(exc, SandmanError):
        code, message, kind = exc.code, str(exc)[:2000], type(exc).__name__
    else:
        code, kind = "infrastructure_error", "InfrastructureError"
        message = f"internal broker error for request {request_id or '?'}: see the worker log"
    error: dict[str, Any] = {"code": code, "message": message, "type": kind}
    if isinstance(exc, SandmanError):
        # the trainer's error names the field, the wait, the tenant and quota too
        error.update(payload_details(exc))
    return {"error": error}


def typed(exc: BaseException) -> BaseException:
    """PostgreSQL or Redis unreachable becomes ServiceUnavailable (a TemporaryError, so
    Celery's autoretry applies to it); anything else is returned as it is. The message
    names the service and the driver's error class, never the statement it was running."""
    if _service_down(exc):
        return ServiceUnavailable(f"{_service_name(exc)} unavailable ({_cause_name(exc)})")
    return exc


def _service_name(exc: BaseException) -> str:
    from sqlalchemy.exc import DBAPIError

    return "PostgreSQL" if isinstance(exc, DBAPIError) else "Redis"


def _cause_name(exc: BaseException) -> str:
    orig = getattr(exc, "orig", None)
    return type(orig if orig is not None else exc).__name__


@contextmanager
def typed_errors() -> Iterator[None]:
    try:
        yield
    except Exception as exc:
        mapped = typed(exc)
        if mapped is exc:
            raise
        raise mapped from exc


def _service_down(exc: BaseException) -> bool:
    import redis as redis_lib
    from sqlalchemy.exc import DBAPIError

    if isinstance(exc, DBAPIError):
        return bool(exc.connection_invalidated) or type(exc).__name__ == "OperationalError"
    return isinstance(exc, redis_lib.ConnectionError | redis_lib.TimeoutError)


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
        # The lease is shorter than a Celery message's redelivery: a dead worker's request
        # is back in its list before its "pending" message comes back.
        self.fair = FairQueue(
            redis,
            lease_s=settings.redelivery_s * 2 / 3,
            gate=settings.fair_gate or default_gate(settings.create_rate),
            horizon_s=reserve_horizon(settings.create_rate),
        )
        self.enqueue: Enqueue = enqueue or (lambda name, args, queue: None)
        self.pools = PoolUpkeep(settings, sessions, self.provider, self.warm, self.enqueue)
        self.prepull = PrePull(settings, sessions, self.provider.backend, self.pacer, self.limits)
        self.actor = actor
        self._snapshots: SnapshotService | None = None
        self.idle = IdleReclaimer(sessions, redis, self.provider, self.enqueue)

    @property
    def snapshots(self) -> SnapshotService:
        """Capture and restore (built on first use: most workers never snapshot)."""
        if self._snapshots is None:
            self._snapshots = SnapshotService(
                self.sessions,
                open_store(self.settings),
                self.provider.token_for,
                installation=self.settings.installation_id,
                default_ttl_s=self.settings.snapshot_ttl_s,
                failpoint=failpoints.armed(self.settings.failpoint),
                inbox_for=self._inbox,
            )
        return self._snapshots

    def sync_fair(self) -> int:
        """The fair scheduler's copy of weights, tenants and per-job rates, from the ledger."""
        from broker.acquire import weights

        with typed_errors():
            return weights.sync(self.sessions, self.redis)

    def _inbox(self, row: Sandbox) -> tuple[Path, str] | None:
        """The sandbox's blob inbox, when its backend has one (the local backend)."""
        backend = self.provider.backend
        if not self.settings.snapshot_local_copy or not isinstance(backend, BlobInbox):
            return None
        host = backend.blob_inbox(row.pod_name)
        return None if host is None else (host, INBOX)

    # -- acquire ----------------------------------------------------------------------

    def acquire_next(self) -> dict[str, Any]:
        """One "acquire pending" message: serve the request the fair queue picks (any
        job's: the scheduler decides, not the message), waiting while the gate is full or
        every backlogged job waits for its own bucket; nothing queued, nothing to do."""
        while True:
            with typed_errors():  # Redis away: ServiceUnavailable, and the task retries
                got = self.fair.pop()
            for _ in range(got.swept):  # a dead worker's request needs a message again
                self.enqueue(Task.ACQUIRE_NEXT, [""], Queue.ACQUIRE.value)
            if got.kind == "empty":
                return {"idle": True}
            if got.kind == "gated":
                with typed_errors():
                    self.fair.wait_gate(GATE_WAIT_S)
                continue
            if got.kind != "ok":  # every backlogged job waits for its own bucket
                time.sleep(max(THROTTLED_POLL_S, got.wait_s) * (0.5 + random.random()))
                continue
            try:
                return self.acquire_and_deliver(
                    got.body or {}, ungate=functools.partial(self.fair.ungate, got.request_id)
                )
            finally:
                self.fair.done(got.request_id)

    def acquire_and_deliver(
        self, message: Mapping[str, Any], ungate: Callable[[], None] | None = None
    ) -> dict[str, Any]:
        """The broker-side door: parse the queue message once, acquire, and push the
        outcome (lease or typed error) to the trainer's mailbox. ``ungate`` is called once
        the create's pacer token is reserved (or while it waits at its job's cap)."""
        rid = str(message.get("request_id")) if isinstance(message, Mapping) else "None"
        lease: Lease | None = None
        try:
            # A request the fair queue handed out (``ungate``) had its cancel flag read by
            # that very pop: no second read before its admission.
            lease = self.acquire(
                AcquireRequest.parse(message), ungate=ungate, popped=ungate is not None
            )
            payload: dict[str, Any] = {"lease": lease.to_dict()}
        except Exception as exc:
            if not isinstance(exc, SandmanError):
                log.exception("acquire %s failed unexpectedly", rid)
            payload = error_payload(exc, rid)
        if not mailbox.deliver(self.redis, rid, payload) and lease is not None:
            self.provider.release(lease.sandbox_id, actor=self.actor, reason="caller-gave-up")
            return {"cancelled": True, "sandbox_id": lease.sandbox_id}
        return {k: v for k, v in payload.get("lease", payload).items() if k != "token"}

    def acquire(
        self,
        request: AcquireRequest,
        ungate: Callable[[], None] | None = None,
        *,
        popped: bool = False,
    ) -> Lease:
        """A cold create for a validated request (the client already missed the pool).
        ``popped``: the request's cancel flag was read as it left the fair queue."""
        rid = request.request_id
        deadline = time.monotonic() + request.seconds_left()
        with self.sessions() as session:
            job = self.provider.job(session, request.job)
        if time.monotonic() >= deadline:
            raise AcquireTimeout(f"acquire {rid} expired in the queue")
        abandoned = False if popped else mailbox.cancelled(self.redis, rid)
        sandbox_id, token = self._admit(request, job.max_live, deadline, abandoned, ungate)
        give_up = self.watcher.watch(rid, deadline)
        try:
            lease = self._create_paced(
                sandbox_id,
                token,
                self.limits(job),
                deadline,
                give_up=give_up,
                workdir=request.workdir,
                env=request.sandbox_env(),
                paced=ungate,
            )
        finally:
            self.watcher.unwatch(rid)
        if job.reuse:
            self._baseline_or_release(lease)
        self.idle.register(lease.sandbox_id, job.idle_timeout_s)
        return lease

    def _admit(
        self,
        request: AcquireRequest,
        max_live: int | None,
        deadline: float,
        abandoned: bool,
        ungate: Callable[[], None] | None = None,
    ) -> tuple[str, str]:
        """The provider's admission, waiting queue-side (before any pacer token or API
        call) while the job is at its hard live cap, out of the fair queue's gate."""
        while True:
            try:
                return self.provider.intent(request, abandoned=abandoned)
            except AtCapacity as exc:
                if ungate is not None:
                    ungate()
                if time.monotonic() >= deadline:
                    raise AcquireTimeout(
                        f"job {request.job} stayed at its cap of {max_live} live sandboxes"
                    ) from exc
                time.sleep(exc.retry_after or CAP_POLL_S)

    def _create_paced(
        self,
        sandbox_id: str,
        token: str,
        limits: Limits,
        deadline: float,
        *,
        give_up: threading.Event | None = None,
        workdir: str = "/",
        env: dict[str, str] | None = None,
        paced: Callable[[], None] | None = None,
    ) -> Lease:
        """The provider's create inside a pacer slot; an intent never sent to the backend
        (paced out) is closed here, one that was is settled by the provider. ``paced``
        is told when the slot is held and the token's start reserved."""
        submitted = False
        try:
            with self.pacer.create_slot(limits, deadline=deadline, on_reserved=paced):
                submitted = True
                return self.provider.create(
                    sandbox_id, token, give_up=give_up, workdir=workdir, env=env
                )
        except AcquireTimeout:
            if not submitted:
                self.provider.release(sandbox_id, actor=self.actor, reason="paced-out")
            raise

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
        with typed_errors():
            try:
                job = self.provider.hand_out(
                    sandbox_id,
                    request_id=request_id,
                    owner=owner,
                    enqueued_at=enqueued_at,
                    latency_s=latency_s,
                )
            except (CreateFailed, InvalidRequest) as exc:
                log.info("hand-out of %s skipped: %s", sandbox_id, exc)
                return
            with self.sessions() as session:
                timeout_s = self.provider.job(session, job).idle_timeout_s
            self.idle.register(sandbox_id, timeout_s)
            self.pools.upkeep_job(job, maintain=False)  # a paced replacement, counts only

    # -- release, heartbeat -------------------------------------------------------------

    def release(self, sandbox_id: str, reason: str = "released") -> str:
        """Checked reuse when the job allows it and the trainer released; else delete."""
        with typed_errors():
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
                    self.pools.publish(sandbox_id, token)
                    return "reused"
            self.provider.release(sandbox_id, actor=self.actor, reason=reason)
            return "released"

    def heartbeat(self, sandbox_id: str, owner: str | None = None) -> str:
        return self.provider.heartbeat(sandbox_id, owner).isoformat()

    # -- pools --------------------------------------------------------------------------

    def refill(self, sandbox_id: str) -> str:
        """Paced create of one warm intent row (written by upkeep), then publish it."""
        with typed_errors():
            with self.sessions() as session:
                row = session.get(Sandbox, sandbox_id)
                if row is None or row.state not in (State.REQUESTED, State.CREATING):
                    return "skipped"
                job = store.get_job(session, row.job)  # fresh: the pool may have shrunk
                token = self.provider.token_for(row)
                configs = parse_pools(job.warm_pools)
                wanted = any(c.key == row.pool_key and c.size > 0 for c in configs)
            if not wanted:  # the pool shrank or went away while this refill was queued
                self.provider.release(sandbox_id, actor=self.actor, reason="pool-shrunk")
                return "cancelled"
            deadline = time.monotonic() + REFILL_BUDGET_S
            lease = self._create_paced(sandbox_id, token, self.limits(job), deadline)
            if job.reuse:
                self._baseline_or_release(lease)
            self.pools.publish(sandbox_id, token)
            return "published"
