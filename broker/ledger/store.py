"""Ledger operations. Callers own the transaction; every transition appends its event in it.

The intent row (``new_intent``) must be COMMITTED before the backend create call: that
commit is what makes every pod we might create provably ours (nonce + deterministic name).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import enum
import hashlib
import hmac
import json
import secrets
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select, text
from sqlalchemy.orm import Session, sessionmaker

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


def intent_values(
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
    image_resolved: str | None = None,
) -> dict[str, Any]:
    """Every column of the intent row (state ``requested``) for ``spec``.

    The request's own fields are copied as they are; the keywords are what only the
    caller knows (where the pod goes, its token, its creating lease). Every field is set
    before the one INSERT (id and nonce may be chosen by the caller, who derives the
    token from them), so an intent costs no follow-up UPDATE."""
    sandbox_id = sandbox_id or new_id()
    return {
        **{name: getattr(spec, name) for name in _FROM_REQUEST},
        "id": sandbox_id,
        "nonce": nonce or new_nonce(),
        "pod_name": pod_name_for(sandbox_id),
        "installation": installation,
        "namespace": namespace,
        "backend": backend,
        "token_hash": token_hash,
        "lease_expires_at": lease_expires_at,
        "egress_denied": egress_denied,
        "image_resolved": image_resolved,
        "tenant": tenant,
        "state": State.REQUESTED,
        "requested_at": utcnow(),
        "enqueued_at": spec.enqueued_utc,
        "reuse_count": 0,
        "create_attempts": 0,
        "delete_attempts": 0,
        "readiness_simulated": False,
    }


def _intent_detail(spec: AcquireRequest) -> dict[str, Any]:
    # ``owner``: the trainer that holds it from here (the audit.holds view reads it)
    return {"request_id": spec.request_id, "image": spec.image, "owner": spec.owner}


def new_intent(
    session: Session, spec: AcquireRequest, *, actor: str = "broker", **where: Any
) -> Sandbox:
    """Add the intent row for ``spec`` (columns: ``intent_values``, keywords ``where``)
    and its event through the ORM; the caller commits. The acquire path writes the same
    row with ``insert_intent``, one statement and no ORM object."""
    row = Sandbox(**intent_values(spec, **where))
    session.add(row)
    session.flush()
    append_event(
        session,
        row,
        kind="transition",
        action="intent",
        to_state=State.REQUESTED,
        actor=actor,
        detail=_intent_detail(spec),
    )
    return row


_INTENT_COLUMNS = (
    *_FROM_REQUEST,
    "id",
    "nonce",
    "pod_name",
    "installation",
    "namespace",
    "backend",
    "token_hash",
    "lease_expires_at",
    "egress_denied",
    "image_resolved",
    "tenant",
    "state",
    "requested_at",
    "enqueued_at",
    "reuse_count",
    "create_attempts",
    "delete_attempts",
    "readiness_simulated",
)
# The intent row and its event in one statement (a data-modifying CTE), no ORM object.
# Built from the constant column names above, never from input: S608 does not apply.
_INSERT_INTENT = text(
    f"""
WITH row AS (
  INSERT INTO sandboxes ({", ".join(_INTENT_COLUMNS)})
  VALUES ({", ".join(":" + c for c in _INTENT_COLUMNS)})
  RETURNING id, job, pod_name, nonce
)
INSERT INTO events (at, sandbox_id, job, pod_name, nonce, kind, action, to_state, actor, detail)
SELECT :requested_at, id, job, pod_name, nonce, 'transition', 'intent', 'requested', :actor,
  CAST(:detail AS JSON)
FROM row
"""  # noqa: S608
)


# ``_INSERT_INTENT`` as a statement of its own that is also the idempotency read: the row
# is inserted unless one with its request id exists, and the row of the request id is
# returned either way (none: a twin delivery committed it after this statement's snapshot).
_INSERT_INTENT_ONCE = text(
    f"""
WITH row AS (
  INSERT INTO sandboxes ({", ".join(_INTENT_COLUMNS)})
  VALUES ({", ".join(":" + c for c in _INTENT_COLUMNS)})
  ON CONFLICT (request_id) DO NOTHING
  RETURNING id, job, pod_name, nonce
),
event AS (
  INSERT INTO events (at, sandbox_id, job, pod_name, nonce, kind, action, to_state, actor,
    detail)
  SELECT :requested_at, id, job, pod_name, nonce, 'transition', 'intent', 'requested', :actor,
    CAST(:detail AS JSON)
  FROM row
)
SELECT id, nonce FROM row
UNION ALL
SELECT id, nonce FROM sandboxes
WHERE request_id = :request_id AND NOT EXISTS (SELECT 1 FROM row)
"""  # noqa: S608
)


def insert_intent_once(
    sessions: sessionmaker[Session], spec: AcquireRequest, *, actor: str = "broker", **where: Any
) -> Any | None:
    """The intent of ``spec`` unless its request id has a row already, committed in one
    statement (``_INSERT_INTENT_ONCE``): (id, nonce) of the request's row, new or not, or
    None when a concurrent twin committed it unseen (read it again)."""
    return alone(sessions, _INSERT_INTENT_ONCE, _intent_params(spec, actor, where))


def _intent_params(spec: AcquireRequest, actor: str, where: dict[str, Any]) -> dict[str, Any]:
    values = intent_values(spec, **where)
    if set(values) != set(_INTENT_COLUMNS):
        raise AssertionError("intent_values and _INTENT_COLUMNS differ")
    params = {k: (v.value if isinstance(v, enum.Enum) else v) for k, v in values.items()}
    params.update(actor=actor, detail=json.dumps(_intent_detail(spec)))
    return params


def insert_intent(
    session: Session, spec: AcquireRequest, *, actor: str = "broker", **where: Any
) -> str:
    """``new_intent`` in one statement (``_INSERT_INTENT``) and no ORM object: the acquire
    path's intent. Returns the sandbox id; the caller commits."""
    params = _intent_params(spec, actor, where)
    session.execute(_INSERT_INTENT, params)
    return str(params["id"])


# The creating step of a create, one statement: lock the row, move it requested ->
# creating (or count one more attempt of a create already creating), write the transition
# event when there was one, and return what the pod spec needs. No row: the row is in
# another state (or gone), and the caller takes the general path.
_BEGIN_CREATE = text(
    """
WITH prev AS (SELECT id, state FROM sandboxes WHERE id = :id FOR UPDATE),
row AS (
  UPDATE sandboxes AS s SET
    state = 'creating',
    creating_at = CASE WHEN prev.state = 'requested' THEN :now ELSE s.creating_at END,
    create_attempts = s.create_attempts + 1
  FROM prev
  WHERE s.id = prev.id AND prev.state IN ('requested', 'creating')
  RETURNING s.id, s.job, s.pod_name, s.nonce, s.namespace, s.installation, s.role, s.image,
    s.image_resolved, s.cpu_m, s.memory_b, s.egress_denied, prev.state AS prev_state
),
event AS (
  INSERT INTO events (at, sandbox_id, job, pod_name, nonce, kind, action, from_state,
    to_state, outcome, actor, detail)
  SELECT :now, id, job, pod_name, nonce, 'transition', 'creating', 'requested', 'creating',
    'ok', :actor, CAST('{}' AS JSON)
  FROM row WHERE prev_state = 'requested'
)
SELECT * FROM row
"""
)


def alone(sessions: sessionmaker[Session], statement: Any, params: dict[str, Any]) -> Any | None:
    """Run one statement as its own transaction (autocommit) and return its first row.

    A statement that is its whole transaction needs no BEGIN and COMMIT round trips (two
    of the three a one-statement transaction costs). Only for statements that are atomic
    alone: one row lock, or one row and its events written by one data-modifying CTE."""
    with sessions.kw["bind"].connect() as conn:
        result = conn.execution_options(isolation_level="AUTOCOMMIT").execute(statement, params)
        return result.first() if result.returns_rows else None


def begin_create(sessions: sessionmaker[Session], sandbox_id: str, *, actor: str) -> Any | None:
    """The ``requested``/``creating`` -> ``creating`` step, committed, in one statement
    (``_BEGIN_CREATE``); the row's pod-spec columns, or None when the row is in any other
    state (the caller's general path decides what that means)."""
    return alone(sessions, _BEGIN_CREATE, {"id": sandbox_id, "now": utcnow(), "actor": actor})


# The ready commit of a create, one statement: lock the row, move it creating -> ready
# with what the node reported, its hand-out stamps unless it is warm, and write the API
# audit row and the transition event. No row: it is not ``creating`` (a release got there
# first), and the caller takes the general path.
_MARK_READY = text(
    """
WITH prev AS (SELECT id, state FROM sandboxes WHERE id = :id FOR UPDATE),
row AS (
  UPDATE sandboxes AS s SET
    state = 'ready', ready_at = :now, pod_ip = :pod_ip, node_name = :node_name,
    address = :address, create_to_ready_s = :create_to_ready_s,
    image_pull_s = :image_pull_s, start_s = :start_s, image_pulled = :image_pulled,
    readiness_simulated = :readiness_simulated,
    acquired_at = CASE WHEN s.pool_key IS NULL THEN :now ELSE s.acquired_at END,
    lease_expires_at = CASE WHEN s.pool_key IS NULL THEN :lease_until ELSE NULL END,
    acquire_latency_s = CASE
      WHEN s.pool_key IS NULL AND s.enqueued_at IS NOT NULL
      THEN EXTRACT(EPOCH FROM (:now - s.enqueued_at))
      ELSE s.acquire_latency_s END
  FROM prev
  WHERE s.id = prev.id AND prev.state = 'creating'
  RETURNING s.id, s.job, s.pod_name, s.nonce, s.address, s.role, s.pool_key,
    s.lease_expires_at, s.acquire_latency_s, s.create_to_ready_s, s.reuse_count
),
audit AS (
  INSERT INTO events (at, sandbox_id, job, pod_name, nonce, kind, action, outcome, actor,
    detail)
  SELECT :audit_at, id, job, pod_name, nonce, 'api', :audit_action, :audit_outcome, :actor,
    CAST(:audit_detail AS JSON)
  FROM row
),
event AS (
  INSERT INTO events (at, sandbox_id, job, pod_name, nonce, kind, action, from_state,
    to_state, outcome, actor, detail)
  SELECT :now, id, job, pod_name, nonce, 'transition', 'ready', 'creating', 'ready', 'ok',
    :actor, CAST('{}' AS JSON)
  FROM row
)
SELECT * FROM row
"""
)


def mark_ready(
    sessions: sessionmaker[Session],
    sandbox_id: str,
    *,
    actor: str,
    lease_s: float,
    observed: dict[str, Any],
    audit: dict[str, Any],
) -> Any | None:
    """The ``creating`` -> ``ready`` step in one statement (see ``_MARK_READY``):
    ``observed`` holds the pod's columns (pod_ip, node_name, address, create_to_ready_s,
    image_pull_s, start_s, image_pulled, readiness_simulated), ``audit`` the one API
    audit row written with it (action, outcome, the rest its detail). The lease row, or
    None when the row is not ``creating``. Committed (``alone``)."""
    now = utcnow()
    detail = {k: v for k, v in audit.items() if k not in ("action", "outcome")}
    params = {
        "id": sandbox_id,
        "now": now,
        "lease_until": now + dt.timedelta(seconds=lease_s),
        "actor": actor,
        "audit_at": now,
        "audit_action": str(audit["action"]),
        "audit_outcome": str(audit["outcome"]),
        "audit_detail": json.dumps(detail),
        **observed,
    }
    return alone(sessions, _MARK_READY, params)


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


# One audit row as its own transaction whose commit does not wait for the WAL flush
# (``audit_only``): set_config(..., true) is local to the statement's transaction.
_INSERT_AUDIT = text(
    """
WITH audit_only AS (SELECT set_config('synchronous_commit', 'off', true))
INSERT INTO events (at, sandbox_id, job, pod_name, nonce, kind, action, outcome, actor, detail)
SELECT :at, :sandbox_id, :job, :pod_name, :nonce, :kind, :action, :outcome, :actor,
  CAST(:detail AS JSON)
FROM audit_only
"""
)


def insert_audit(
    sessions: sessionmaker[Session],
    about: Subject,
    *,
    kind: str,
    action: str,
    outcome: str | None = None,
    actor: str = "broker",
    detail: dict[str, Any] | None = None,
) -> None:
    """An audit-only event (``audit_only``), committed at once in one statement, no ORM
    object: the acquire path's API audit rows."""
    alone(
        sessions,
        _INSERT_AUDIT,
        {
            "at": utcnow(),
            **dataclasses.asdict(about),
            "kind": kind,
            "action": action,
            "outcome": outcome,
            "actor": actor,
            "detail": json.dumps(detail or {}),
        },
    )


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


_STATE_OF = text("SELECT state FROM sandboxes WHERE id = :id")


def state_of(session: Session, sandbox_id: str) -> str | None:
    """The row's state, or None when there is no such row: a poll that loads no row."""
    state = session.execute(_STATE_OF, {"id": sandbox_id}).scalar()
    return None if state is None else str(state)


_BY_REQUEST = text("SELECT id, nonce FROM sandboxes WHERE request_id = :request_id")


def id_by_request(session: Session, request_id: str) -> Any | None:
    """(id, nonce) of the row of ``request_id``, or None: the admission's idempotency
    read, without loading the row."""
    return session.execute(_BY_REQUEST, {"request_id": request_id}).first()


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
