"""Operator actions on leaks: delete, adopt, dismiss. Every one is nonce-checked and audited.

What is safe, and why:
- A leak backed by a ledger row (stuck create, abandoned, idle, pod lost, late pod) is
  deleted through the Provider (``release`` / ``delete_confirmed``): the same
  nonce-checked, confirmed path the GC uses, so a pod replaced under the same name is
  never removed, and a failed delete stays pending for the GC to retry.
- An unowned pod (our installation label, no ledger row with its nonce) is touched only
  after the operator confirmed a page that showed its labels. The form echoes the nonce
  they saw; the action re-reads the pod and refuses if the nonce changed or a ledger row
  appeared meanwhile.
- Adopting an unowned pod writes a ledger row carrying the pod's own nonce and name, so
  from then on the GC manages it like any other: a ready pod gets a lease of the job's
  ``lease_s`` (held by the adopting operator) and is reclaimed when it expires; a pod
  that is not ready is recorded as abandoned and released on the next GC pass.
- Foreign pods (another installation's label) are never deleted or adopted: dismiss only.
Every action appends an ``Event(kind="admin", actor=<operator>)`` in the same transaction
that resolves the leak.
"""

from __future__ import annotations

import datetime as dt
import re
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from broker.backends.base import LABEL_JOB, LABEL_ROLE, LABEL_SANDBOX, Backend, PodInfo
from broker.errors import OwnershipError, SandmanError
from broker.ledger import store
from broker.ledger.models import Job, Leak, Sandbox, new_id, utcnow
from broker.ledger.states import Role, State
from broker.ownership.provider import Provider
from broker.settings import Settings


class Parts(Protocol):
    """What leak actions need from the composition root (``broker.acquire.root.Root``):
    settings, the ledger, the pods to read, and the Provider every delete goes through."""

    settings: Settings

    @property
    def sessions(self) -> sessionmaker[Session]: ...

    def backend(self) -> Backend | None: ...

    @property
    def backend_error(self) -> str | None: ...

    def provider(self, actor: str | None = None) -> Provider: ...


ACTIONS = ("delete", "adopt", "dismiss")
_HEX32 = re.compile(r"^[0-9a-f]{32}$")


class ActionRefused(OwnershipError):
    """The action is not safe or not possible now; the message says why."""


@dataclass
class LeakView:
    leak: Leak
    row: Sandbox | None
    pod: PodInfo | None
    pod_state: str  # present | absent | unavailable | n/a
    allowed: dict[str, str] = field(default_factory=dict)  # action -> why it is allowed
    refused: dict[str, str] = field(default_factory=dict)  # action -> why not

    @property
    def ledger_backed(self) -> bool:
        return self.row is not None


def load(parts: Parts, leak_id: int) -> LeakView:
    if not 0 < leak_id < 2**63:
        raise LookupError(f"no leak {leak_id}")
    with parts.sessions() as session:
        leak = session.get(Leak, leak_id)
        if leak is None:
            raise LookupError(f"no leak {leak_id}")
        row = None
        if leak.sandbox_id:
            row = session.get(Sandbox, leak.sandbox_id)
        elif leak.nonce:
            row = session.scalars(select(Sandbox).where(Sandbox.nonce == leak.nonce)).first()
        session.expunge_all()
    pod, pod_state = None, "n/a"
    if leak.pod_name and leak.namespace:
        backend = parts.backend()
        if backend is None:
            pod_state = "unavailable"
        else:
            try:
                pod = backend.get(leak.namespace, leak.pod_name)
                pod_state = "present" if pod else "absent"
            except (SandmanError, OSError):
                pod_state = "unavailable"
    view = LeakView(leak=leak, row=row, pod=pod, pod_state=pod_state)
    _judge(parts, view)
    return view


def _judge(parts: Parts, view: LeakView) -> None:
    leak, ours = view.leak, parts.settings.installation_id
    if leak.resolved_at is not None:
        view.refused = dict.fromkeys(ACTIONS, f"already resolved ({leak.resolution})")
        return
    view.allowed["dismiss"] = "mark it resolved without touching the pod or the ledger"
    if view.pod is not None and view.pod.installation != ours:
        why = "another installation's pod: reported, never touched"
        view.refused.update(delete=why, adopt=why)
        return
    if view.row is not None:
        view.allowed["delete"] = "nonce-checked release through the provider (the GC's path)"
        view.refused["adopt"] = "already owned by a ledger row"
        return
    if view.pod_state == "unavailable":
        why = "the pod cannot be read back now (backend unreachable)"
        view.refused.update(delete=why, adopt=why)
    elif view.pod is None:
        view.refused.update(delete="the pod is gone", adopt="the pod is gone")
    elif not view.pod.nonce:
        view.refused.update(delete="the pod has no nonce label", adopt="the pod has no nonce")
    else:
        view.allowed["delete"] = "delete this pod by its nonce, after you confirm its labels"
        view.allowed["adopt"] = "record it in the ledger with its nonce; the GC then manages it"


def _expected_nonce(view: LeakView) -> str | None:
    return view.row.nonce if view.row is not None else (view.pod.nonce if view.pod else None)


def perform(parts: Parts, leak_id: int, action: str, *, actor: str, confirm_nonce: str) -> str:
    """Run ``action`` on leak ``leak_id`` for ``actor``; returns a message for the operator."""
    if action not in ACTIONS:
        raise ActionRefused(f"unknown action {action!r}")
    view = load(parts, leak_id)
    if action not in view.allowed:
        raise ActionRefused(view.refused.get(action, f"{action} is not allowed here"))
    expected = _expected_nonce(view) or ""
    if action != "dismiss" and (not confirm_nonce or confirm_nonce != expected):
        raise ActionRefused("the pod or row changed since you confirmed: review it again")
    if action == "dismiss":
        return _resolve(parts, view, actor, "dismissed", "dismissed by operator")
    if action == "adopt":
        return _adopt(parts, view, actor)
    if view.row is not None:
        return _delete_ledger_backed(parts, view, actor)
    return _delete_unowned(parts, view, actor)


def _resolve(
    parts: Parts, view: LeakView, actor: str, resolution: str, msg: str, **detail: Any
) -> str:
    with parts.sessions.begin() as session:
        leak = session.get(Leak, view.leak.id, with_for_update=True)
        if leak is None or leak.resolved_at is not None:
            raise ActionRefused("someone else resolved this leak meanwhile")
        leak.resolved_at, leak.resolution, leak.resolved_by = utcnow(), resolution, actor
        if detail.get("sandbox_id"):
            leak.sandbox_id = detail["sandbox_id"]
        store.append_event(
            session,
            store.Subject.of_leak(leak),
            kind="admin",
            action=f"leak-{resolution}",
            outcome=resolution,
            actor=actor,
            detail={"leak_id": leak.id, "leak_kind": leak.kind, **detail},
        )
    return msg


def _audit(
    parts: Parts, view: LeakView, actor: str, action: str, outcome: str, **detail: Any
) -> None:
    with parts.sessions.begin() as session:
        store.append_event(
            session,
            store.Subject.of_leak(view.leak),
            kind="admin",
            action=action,
            outcome=outcome,
            actor=actor,
            detail={"leak_id": view.leak.id, **detail},
        )


def _provider(parts: Parts, actor: str) -> Provider:
    """The Provider acting as the operator; without a backend the action is refused."""
    try:
        return parts.provider(actor)
    except (SandmanError, OSError) as exc:
        raise ActionRefused(f"pod backend unavailable: {type(exc).__name__}: {exc}") from exc


def _delete_ledger_backed(parts: Parts, view: LeakView, actor: str) -> str:
    row = view.row
    assert row is not None
    provider = _provider(parts, actor)
    try:
        if row.state == State.DELETED:
            if view.pod is not None and view.pod.nonce == row.nonce:
                provider.backend.delete(row.namespace, row.pod_name, row.nonce)
        else:
            provider.release(
                row.id, actor=actor, reason=f"admin:{view.leak.kind}", creator_gone=True
            )
    except (SandmanError, OSError) as exc:
        _audit(parts, view, actor, "leak-delete", "error", error=type(exc).__name__)
        raise ActionRefused(f"delete failed ({type(exc).__name__}); it stays open") from exc
    with parts.sessions() as session:
        fresh = session.get(Sandbox, row.id)
        state = fresh.state if fresh else None
    pod = provider.backend.get(row.namespace, row.pod_name)
    if state == State.DELETED and (pod is None or pod.nonce != row.nonce):
        return _resolve(
            parts, view, actor, "deleted", f"pod {row.pod_name} deleted", sandbox_id=row.id
        )
    _audit(parts, view, actor, "leak-delete", "pending", state=str(state))
    return f"delete of {row.pod_name} is pending (row {state}); the GC will retry it"


def _delete_unowned(parts: Parts, view: LeakView, actor: str) -> str:
    pod = view.pod
    assert pod is not None and pod.nonce
    backend = _provider(parts, actor).backend
    with parts.sessions() as session:
        if session.scalars(select(Sandbox.id).where(Sandbox.nonce == pod.nonce)).first():
            raise ActionRefused("a ledger row now owns this pod's nonce: run the GC instead")
    try:
        backend.delete(pod.namespace, pod.name, pod.nonce)
        deadline = time.monotonic() + 20
        while (now := backend.get(pod.namespace, pod.name)) is not None and now.nonce == pod.nonce:
            if time.monotonic() > deadline:
                raise TimeoutError("pod still present after 20 s")
            time.sleep(0.2)
    except (SandmanError, OSError, TimeoutError) as exc:
        _audit(parts, view, actor, "leak-delete", "error", error=type(exc).__name__)
        raise ActionRefused(f"delete failed ({type(exc).__name__}); it stays open") from exc
    return _resolve(
        parts, view, actor, "deleted", f"unowned pod {pod.name} deleted", labels=pod.labels
    )


def _adopt(parts: Parts, view: LeakView, actor: str) -> str:
    pod = view.pod
    assert pod is not None and pod.nonce
    settings = parts.settings
    job_name = pod.labels.get(LABEL_JOB, "")
    now = utcnow()
    try:
        with parts.sessions.begin() as session:
            job = session.get(Job, job_name)
            if job is None:
                raise ActionRefused(
                    f"job {job_name!r} is not in the ledger: create it first, then adopt"
                )
            if session.scalars(select(Sandbox.id).where(Sandbox.nonce == pod.nonce)).first():
                raise ActionRefused("a ledger row already owns this nonce")
            if session.scalars(select(Sandbox.id).where(Sandbox.pod_name == pod.name)).first():
                raise ActionRefused("a ledger row with another nonce uses this pod name")
            label_id = pod.labels.get(LABEL_SANDBOX, "")
            sandbox_id = label_id if _HEX32.match(label_id) else new_id()
            if session.get(Sandbox, sandbox_id) is not None:
                sandbox_id = new_id()
            role = pod.labels.get(LABEL_ROLE, "rollout")
            state = State.READY if pod.ready else State.ABANDONED
            row = Sandbox(
                id=sandbox_id,
                job=job.name,
                installation=settings.installation_id,
                nonce=pod.nonce,
                pod_name=pod.name,
                namespace=pod.namespace,
                backend=getattr(parts.backend(), "name", settings.backend),
                image="(adopted: image unknown)",
                cpu_m=0,
                memory_b=0,
                role=Role(role) if role in {r.value for r in Role} else Role.ROLLOUT,
                state=state,
                owner=actor,
                pod_ip=pod.ip,
                node_name=pod.node,
                address=pod.address,
                requested_at=now,
                creating_at=pod.created_at or now,
                ready_at=now if pod.ready else None,
                acquired_at=now if pod.ready else None,
                abandoned_at=None if pod.ready else now,
                lease_expires_at=now + dt.timedelta(seconds=job.lease_s) if pod.ready else now,
                reuse_count=0,
                create_attempts=0,
                delete_attempts=0,
            )
            session.add(row)
            session.flush()
            store.append_event(
                session,
                row,
                kind="admin",
                action="adopt",
                to_state=state,
                outcome="adopted",
                actor=actor,
                detail={"leak_id": view.leak.id, "labels": pod.labels},
            )
    except IntegrityError as exc:
        raise ActionRefused("someone else recorded this pod meanwhile") from exc
    return _resolve(
        parts,
        view,
        actor,
        "adopted",
        f"pod {pod.name} adopted as sandbox {sandbox_id} ({state})",
        sandbox_id=sandbox_id,
        labels=pod.labels,
    )
