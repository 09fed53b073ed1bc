"""Checked reuse of released sandboxes (grading pods, opt-in per job with ``Job.reuse``).

The paper's lesson: plain reuse was wrong on 64 of 787 gradings (residue from a poisoned
tenant); checked reuse on none. So a released sandbox is reused only when execd's
state-check against the baseline recorded at create says it is clean, or its
differences were restorable and a restore made it clean. Anything else, an execd error
included, deletes the pod. A pod is reused at most ``min(Job.max_reuses,
settings.max_reuses)`` times (8 by default). Every decision is a ``reuse`` event.
"""

from __future__ import annotations

import logging
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from broker.errors import ExecError, InfrastructureError
from broker.ledger import store
from broker.ledger.models import Sandbox, utcnow
from broker.ledger.states import State
from broker.pools.store import pool_key
from broker.wire.execd import Endpoint, control_call, shared_http

log = logging.getLogger(__name__)


def execd_call(address: str, token: str, path: str, *, timeout: float = 30.0) -> dict[str, Any]:
    """One authenticated control call (reset, baseline, state-check, restore).

    Refusals and lost daemons raise the typed tree of ``broker.wire.execd`` (ExecError,
    SandboxLost), like every other execd caller.
    """
    return Endpoint(address, token).send(shared_http(), control_call(path, timeout=timeout))


def record_baseline(address: str, token: str) -> None:
    """At create, for reuse-enabled jobs: the state every later check compares against."""
    execd_call(address, token, "/v1/baseline", timeout=60.0)


def check_clean(address: str, token: str) -> tuple[bool, dict[str, Any]]:
    """Reset the shell, state-check, restore when needed; (clean, what was seen)."""
    seen: dict[str, Any] = {}
    execd_call(address, token, "/v1/reset")
    check = execd_call(address, token, "/v1/state-check", timeout=60.0)
    seen["check"] = _summary(check)
    if check.get("clean"):
        return True, seen
    if check.get("restorable") is False:
        return False, seen
    restored = execd_call(address, token, "/v1/restore", timeout=60.0)
    seen["restore"] = _summary(restored)
    return bool(restored.get("clean")), seen


def _summary(data: dict[str, Any]) -> dict[str, Any]:
    """Keep the event row small: flags and counts, not whole file lists."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, bool | int | float | str) or value is None:
            out[key] = value
        elif isinstance(value, list | dict):
            out[f"{key}_count"] = len(value)
    return out


def try_reuse(
    sessions: sessionmaker[Session],
    sandbox_id: str,
    token: str,
    *,
    max_reuses: int,
    actor: str = "broker",
) -> str | None:
    """Return the pool key the sandbox was recycled into, or None when it must be deleted."""
    with sessions() as session:
        row = session.get(Sandbox, sandbox_id)
        if row is None or row.state != State.READY or not row.address:
            return None
        job = store.get_job(session, row.job)
        if not job.reuse:
            return None
        limit = min(job.max_reuses, max_reuses)
        address, count = row.address, row.reuse_count
    if count >= limit:
        _decide(
            sessions,
            sandbox_id,
            action="reject",
            outcome="reuse-limit",
            detail={"reuse_count": count, "limit": limit},
            actor=actor,
        )
        return None
    try:
        clean, seen = check_clean(address, token)
    except (ExecError, InfrastructureError) as exc:  # refused or lost: never reuse blind
        _decide(
            sessions,
            sandbox_id,
            action="reject",
            outcome="check-error",
            detail={"error": str(exc)[:500]},
            actor=actor,
        )
        return None
    if not clean:
        _decide(sessions, sandbox_id, action="reject", outcome="dirty", detail=seen, actor=actor)
        return None
    with sessions.begin() as session:
        row = store.lock_row(session, sandbox_id)
        if row is None or row.state != State.READY:
            return None  # released or reclaimed meanwhile: nothing to recycle
        key = pool_key(row.image, row.image_digest, row.base_commit, row.cpu_m, row.memory_b)
        row.reuse_count += 1
        row.owner, row.request_id, row.acquired_at = None, None, None
        row.pool_key, row.lease_expires_at, row.last_used_at = key, None, utcnow()
        store.append_event(
            session,
            row,
            kind="reuse",
            action="accept",
            outcome="clean",
            actor=actor,
            detail={**seen, "reuse_count": row.reuse_count},
        )
        return key


def _decide(
    sessions: sessionmaker[Session],
    sandbox_id: str,
    *,
    action: str,
    outcome: str,
    detail: dict[str, Any],
    actor: str,
) -> None:
    with sessions.begin() as session:
        row = session.get(Sandbox, sandbox_id)
        store.append_event(
            session, row, kind="reuse", action=action, outcome=outcome, actor=actor, detail=detail
        )
