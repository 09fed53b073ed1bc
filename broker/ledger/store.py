"""Ledger operations. Callers own the transaction; every transition appends its event in it.

The intent row (``new_intent``) must be COMMITTED before the backend create call: that
commit is what makes every pod we might create provably ours (nonce + deterministic name).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import hmac
import secrets
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select, text
from sqlalchemy.orm import Session

from broker.errors import IllegalTransition, InvalidRequest, UnknownJob
from broker.ledger.models import Event, Job, Leak, Sandbox, new_id, utcnow
from broker.ledger.states import CAPPED_STATES, State, can_transition
from broker.wire.request import AcquireRequest

_STAMP = {
    State.CREATING: "creating_at",
    State.READY: "ready_at",
    State.RELEASING: "releasing_at",
    State.DELETED: "deleted_at",
    State.FAILED: "failed_at",
    State.ABANDONED: "abandoned_at",
}


def pod_name_for(sandbox_id: str) -> str:
    """Deterministic per row, so a retried create hits 409 instead of making a twin."""
    return f"sm-{sandbox_id}"


def hash_token(token: str) -> str:
    return "sha256:" + hashlib.sha256(token.encode()).hexdigest()


def token_matches(token: str, token_hash: str | None) -> bool:
    return token_hash is not None and hmac.compare_digest(hash_token(token), token_hash)


def get_job(session: Session, name: str) -> Job:
    job = session.get(Job, name)
    if job is None:
        raise UnknownJob(f"unknown job {name!r}: create it first (sandman job create)")
    return job


def ensure_job(session: Session, name: str, **config: Any) -> Job:
    """Create the job with defaults, or update the given fields of an existing one."""
    if not name or len(name) > 63 or not all(c.isalnum() or c in "-." for c in name):
        raise InvalidRequest(f"job name {name!r} must be 1-63 chars of [A-Za-z0-9.-]")
    job = session.get(Job, name)
    if job is None:
        job = Job(name=name, egress_allow=[], node_selector={}, tolerations=[], warm_pools=[])
        session.add(job)
    for key, value in config.items():
        if not hasattr(Job, key):
            raise InvalidRequest(f"unknown job setting {key!r}")
        setattr(job, key, value)
    session.flush()
    return job


def new_nonce() -> str:
    return secrets.token_hex(16)


# The columns an intent copies from the request as they are: named once, so the row and
# the request cannot drift apart field by field.
_FROM_REQUEST = (
    "owner",
    "job",
    "request_id",
    "image",
    "image_digest",
    "base_commit",
    "cpu_m",
    "memory_b",
    "role",
    "pool_key",
)


def new_intent(
    session: Session,
    spec: AcquireRequest,
    *,
    installation: str,
    namespace: str,
    backend: str = "kubernetes",
    sandbox_id: str | None = None,
    nonce: str | None = None,
    token_hash: str | None = None,
    lease_expires_at: dt.datetime | None = None,
    egress_denied: bool = False,
    tenant: str | None = None,
    actor: str = "broker",
    image_resolved: str | None = None,
) -> Sandbox:
    """Add the intent row (state ``requested``) for ``spec`` with a fresh nonce; the
    caller commits.

    The request's own fields are copied as they are; the keywords are what only the
    caller knows (where the pod goes, its token, its creating lease). Every field is set
    before the one INSERT (id and nonce may be chosen by the caller, who derives the
    token from them), so an intent costs no follow-up UPDATE."""
    sandbox_id = sandbox_id or new_id()
    row = Sandbox(
        **{name: getattr(spec, name) for name in _FROM_REQUEST},
        id=sandbox_id,
        nonce=nonce or new_nonce(),
        pod_name=pod_name_for(sandbox_id),
        installation=installation,
        namespace=namespace,
        backend=backend,
        token_hash=token_hash,
        lease_expires_at=lease_expires_at,
        egress_denied=egress_denied,
        image_resolved=image_resolved,
        tenant=tenant,
        state=State.REQUESTED,
        requested_at=utcnow(),
        enqueued_at=spec.enqueued_utc,
        reuse_count=0,
        create_attempts=0,
        delete_attempts=0,
    )
    session.add(row)
    session.flush()
    append_event(
        session,
        row,
        kind="transition",
        action="intent",
        to_state=State.REQUESTED,
        actor=actor,
        # ``owner``: the trainer that holds it from here (the audit.holds view reads it)
        detail={"request_id": spec.request_id, "image": spec.image, "owner": spec.owner},
    )
    return row


def transition(
    session: Session,
    row: Sandbox,
    target: State,
    *,
    actor: str = "broker",
    error: str | None = None,
    detail: dict[str, Any] | None = None,
) -> None:
    """Move ``row`` to ``target`` or raise IllegalTransition; appends the event row."""
    current = State(row.state)
    if not can_transition(current, target):
        raise IllegalTransition(f"sandbox {row.id}: {current} -> {target} is not allowed")
    row.state = target
    stamp = _STAMP.get(target)
    if stamp:
        setattr(row, stamp, utcnow())
    if error is not None:
        row.last_error = error[:4000]
    append_event(
        session,
        row,
        kind="transition",
        action=str(target),
        from_state=current,
        to_state=target,
        actor=actor,
        outcome="error" if error else "ok",
        detail={**(detail or {}), **({"error": error[:1000]} if error else {})},
    )


@dataclass(frozen=True)
class Subject:
    """What an event is about when no sandbox row is at hand (an API call on a pod spec,
    a leak): the four identity columns an event row copies, in one value so every such
    caller names them once."""

    sandbox_id: str | None
    job: str | None
    pod_name: str | None
    nonce: str | None

    @classmethod
    def of_row(cls, row: Sandbox) -> Subject:
        return cls(row.id, row.job, row.pod_name, row.nonce)

    @classmethod
    def of_leak(cls, leak: Leak) -> Subject:
        return cls(leak.sandbox_id, leak.job, leak.pod_name, leak.nonce)


_NOBODY = Subject(None, None, None, None)


def append_event(
    session: Session,
    about: Sandbox | Subject | None,
    *,
    kind: str,
    action: str,
    from_state: str | None = None,
    to_state: str | None = None,
    outcome: str | None = None,
    actor: str = "broker",
    detail: dict[str, Any] | None = None,
) -> Event:
    """Append one event row about a sandbox row, a ``Subject``, or nothing (a GC pass)."""
    subject = Subject.of_row(about) if isinstance(about, Sandbox) else about or _NOBODY
    event = Event(
        at=utcnow(),
        **dataclasses.asdict(subject),
        kind=kind,
        action=action,
        from_state=str(from_state) if from_state else None,
        to_state=str(to_state) if to_state else None,
        outcome=outcome,
        actor=actor,
        detail=detail or {},
    )
    session.add(event)
    return event


def count_live_locked(session: Session, job: str) -> int:
    """Live rows of ``job``, counted under a per-job transaction-scoped advisory lock.

    The lock is held until the caller's transaction ends, so a count followed by an insert
    is atomic against every other worker doing the same for this job."""
    session.execute(text("SELECT pg_advisory_xact_lock(hashtext(:key))"), {"key": f"live:{job}"})
    return int(
        session.scalar(
            select(func.count())
            .select_from(Sandbox)
            .where(Sandbox.job == job, Sandbox.state.in_([s.value for s in CAPPED_STATES]))
        )
        or 0
    )


def tenant_usage_locked(session: Session, tenant: str, since: dt.datetime) -> tuple[int, int]:
    """``tenant``'s live rows and its intents since ``since``, counted under a per-tenant
    transaction-scoped advisory lock: a count followed by an insert is atomic against
    every worker admitting for any job of the tenant. Taken after the job's lock
    (``count_live_locked``), always in that order, so two admissions never deadlock."""
    session.execute(
        text("SELECT pg_advisory_xact_lock(hashtext(:key))"), {"key": f"tenant:{tenant}"}
    )
    ours = Sandbox.tenant == tenant
    live = session.scalar(
        select(func.count())
        .select_from(Sandbox)
        .where(ours, Sandbox.state.in_([s.value for s in CAPPED_STATES]))
    )
    recent = session.scalar(
        select(func.count()).select_from(Sandbox).where(ours, Sandbox.requested_at >= since)
    )
    return int(live or 0), int(recent or 0)


def lock_tenant_snapshots(session: Session, tenant: str) -> None:
    """A transaction-scoped advisory lock on ``tenant``'s snapshot bytes: a count of its
    live snapshots followed by a ``capturing`` insert is atomic against captures of any
    of its jobs. Taken after the job row's lock, always in that order."""
    session.execute(
        text("SELECT pg_advisory_xact_lock(hashtext(:key))"), {"key": f"snapshots:{tenant}"}
    )


def nth_intent_since(
    session: Session, tenant: str, since: dt.datetime, n: int
) -> dt.datetime | None:
    """The request time of ``tenant``'s ``n``-th intent (from 0, oldest first) since ``since``."""
    return session.scalar(
        select(Sandbox.requested_at)
        .where(Sandbox.tenant == tenant, Sandbox.requested_at >= since)
        .order_by(Sandbox.requested_at)
        .offset(n)
        .limit(1)
    )


def audit_only(session: Session) -> None:
    """Mark the current transaction as audit-only: its commit need not wait for the WAL
    flush. Safe only for rows no protocol step depends on (the next ordinary commit
    flushes them anyway); it saves one disk sync per create on the acquire path."""
    bind = session.get_bind()
    if bind.dialect.name == "postgresql":
        session.execute(text("SET LOCAL synchronous_commit TO OFF"))


def by_request(session: Session, request_id: str) -> Sandbox | None:
    return session.scalars(select(Sandbox).where(Sandbox.request_id == request_id)).first()


def lock_row(session: Session, sandbox_id: str) -> Sandbox | None:
    """Row lock for the duration of the caller's transaction (one writer per sandbox)."""
    return session.scalars(
        select(Sandbox).where(Sandbox.id == sandbox_id).with_for_update()
    ).first()


def record_leak(session: Session, kind: str, about: Subject | None = None, **fields: Any) -> Leak:
    """Add an open leak; ``about`` fills its identity columns (sandbox, job, pod, nonce)."""
    identity = dataclasses.asdict(about) if about is not None else {}
    detail = fields.pop("detail", {})
    leak = Leak(kind=kind, detected_at=utcnow(), detail=detail, **identity, **fields)
    session.add(leak)
    session.flush()
    return leak
