"""Thin tasks: primitive ids in, a ``broker.acquire.service`` call, nothing else.

Idempotence, and so ``acks_late``: an acquire is keyed by its request id (the provider's
admission is idempotent and tokens are derived), a release settles whatever state it
finds, a refill skips rows that already moved on, a hand-out refuses a claimed row. A
message redelivered after a worker died therefore converges on the same sandbox.

The same idempotence makes retrying safe: those tasks (and ``acquire_next``, whose
outcomes go to mailboxes) retry a ``TemporaryError``
(PostgreSQL or Redis briefly away, the API server throttling) with exponential backoff.
The acquire task does not: its outcome, error included, goes to the trainer's mailbox,
and the trainer, who owns the deadline, decides.
"""

from __future__ import annotations

from typing import Any

from celery.signals import worker_ready

from broker.acquire.snapshots import snapshot_and_deliver
from broker.errors import TemporaryError
from broker.names import Task
from workers.app import app
from workers.runtime import broker, root

RETRY: dict[str, Any] = {
    "autoretry_for": (TemporaryError,),
    "retry_backoff": 1,
    "retry_backoff_max": 60,
    "retry_jitter": True,
    "max_retries": 8,
}


@app.task(name=Task.ACQUIRE, acks_late=True, reject_on_worker_lost=True)
def acquire(message: dict[str, Any]) -> dict[str, Any]:
    return broker().acquire_and_deliver(message)


@app.task(name=Task.ACQUIRE_NEXT, acks_late=True, reject_on_worker_lost=True, **RETRY)
def acquire_next(job_hint: str = "") -> dict[str, Any]:
    """One acquire is pending: the fair queue picks which (``job_hint`` is for logs).
    It retries when Redis was away: a spare "pending" message is harmless (its pop finds
    nothing), a lost one would leave a request without a message to serve it."""
    return broker().acquire_next()


@app.task(name=Task.SNAPSHOT, acks_late=True, reject_on_worker_lost=True)
def snapshot(message: dict[str, Any]) -> dict[str, Any]:
    return snapshot_and_deliver(broker(), message)


@app.task(name=Task.RELEASE, acks_late=True, reject_on_worker_lost=True, **RETRY)
def release(sandbox_id: str, reason: str = "released") -> str:
    return broker().release(sandbox_id, reason)


@app.task(name=Task.CLAIMED, acks_late=True, **RETRY)
def claimed(
    sandbox_id: str,
    request_id: str,
    owner: str | None,
    latency_s: float | None,
    enqueued_at: float | None = None,
) -> None:
    import datetime as dt

    when = dt.datetime.fromtimestamp(enqueued_at, dt.UTC) if enqueued_at else None
    broker().claimed(sandbox_id, request_id, owner, latency_s, when)


@app.task(name=Task.HEARTBEAT, ignore_result=True)
def heartbeat(sandbox_id: str, owner: str | None = None) -> str:
    return broker().heartbeat(sandbox_id, owner)


@app.task(name=Task.POOL_REFILL, acks_late=True, reject_on_worker_lost=True, **RETRY)
def pool_refill(sandbox_id: str) -> str:
    return broker().refill(sandbox_id)


@app.task(name=Task.POOL_UPKEEP, acks_late=True)
def pool_upkeep() -> dict[str, Any]:
    service = broker()
    return {
        "fair_jobs": service.sync_fair(),
        "pools": service.pools.upkeep_all(),
        "prepull": service.prepull.reconcile(),
    }


@app.task(name=Task.GC, acks_late=True)
def gc() -> dict[str, object]:
    return root().gc.run_and_publish(actor=root().actor, by="beat").report.to_dict()


@worker_ready.connect
def _build_services_early(**_: Any) -> None:
    """Build engine, Redis pool and backend before the first task, not during it, and
    give the fair scheduler today's weights."""
    broker().sync_fair()
