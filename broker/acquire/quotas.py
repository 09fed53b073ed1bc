"""Tenants and their quotas, changed at run time by operators (``sandman tenant``, the
admin JSON API), each change an ``admin`` event naming who made it.

Why here: the admission step (``Provider.intent``) reads a tenant's quotas fresh at every
acquire, so a change written here applies to the next one; the CLI and the web share
these functions, so a change is validated and audited one way whoever makes it.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from broker import names
from broker.errors import InvalidRequest, TenantExists, UnknownTenant
from broker.ledger import store
from broker.ledger.models import Job, Sandbox, Snapshot, Tenant, utcnow
from broker.ledger.states import CAPPED_STATES
from broker.ownership.provider import QUOTA_WINDOW
from broker.snapshots.service import LIVE_STATES as LIVE_SNAPSHOT_STATES

QUOTAS = ("max_live", "creates_per_minute", "snapshot_bytes")
MAX_QUOTA = {
    "max_live": names.TENANT_MAX_QUOTA,
    "creates_per_minute": names.TENANT_MAX_QUOTA,
    "snapshot_bytes": names.TENANT_MAX_QUOTA_BYTES,
}


@dataclass(frozen=True)
class TenantView:
    """A tenant's quotas, its jobs, and its use of each quota now."""

    name: str
    max_live: int | None
    creates_per_minute: int | None
    snapshot_bytes: int | None = None
    jobs: list[str] = field(default_factory=list)
    live: int = 0
    creates_last_minute: int = 0
    snapshot_bytes_held: int = 0  # listed by its live, unexpired snapshots

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def validate_name(name: str) -> str:
    if not isinstance(name, str) or not re.fullmatch(names.TENANT_NAME_PATTERN, name):
        raise InvalidRequest(
            f"tenant name {name!r} must be 1-63 chars of [A-Za-z0-9.-]", field="name"
        )
    return name


def validate_quotas(quotas: dict[str, Any]) -> dict[str, int | None]:
    """Only known quotas, each a whole number from 0 to its MAX_QUOTA or None (no limit)."""
    out: dict[str, int | None] = {}
    for key, given in quotas.items():
        if key not in QUOTAS:
            raise InvalidRequest(f"unknown quota {key!r}: one of {', '.join(QUOTAS)}", field=key)
        # JSON's 4066.0 is the integer 4066 (as JSON Schema says)
        value = int(given) if isinstance(given, float) and given.is_integer() else given
        ok = value is None or (
            isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_QUOTA[key]
        )
        if not ok:
            raise InvalidRequest(f"{key} must be 0..{MAX_QUOTA[key]} or null (no limit)", field=key)
        out[key] = value
    return out


def _quotas_of(tenant: Tenant) -> dict[str, int | None]:
    return {key: getattr(tenant, key) for key in QUOTAS}


def _audit(
    session: Session,
    action: str,
    tenant: str | None,
    before: dict[str, Any] | None,
    after: dict[str, Any],
    *,
    actor: str,
    job: str | None = None,
) -> None:
    store.append_event(
        session,
        store.Subject(None, job, None, None),
        kind="admin",
        action=action,
        outcome="ok",
        actor=actor,
        detail={"tenant": tenant, "before": before, "after": after},
    )


def create(
    sessions: sessionmaker[Session], name: str, quotas: dict[str, Any], *, actor: str
) -> TenantView:
    """A new tenant with these quotas (the others: no limit)."""
    values = validate_quotas(quotas)
    exists = TenantExists(f"tenant {name} exists: change it with set", field="name")
    try:
        with sessions.begin() as session:
            if session.get(Tenant, validate_name(name)) is not None:
                raise exists
            row = Tenant(name=name, **{k: values.get(k) for k in QUOTAS})
            session.add(row)
            session.flush()  # a concurrent create of the same name fails here
            _audit(session, "tenant-create", name, None, _quotas_of(row), actor=actor)
    except IntegrityError as exc:
        raise exists from exc
    return get(sessions, name)


def update(
    sessions: sessionmaker[Session], name: str, quotas: dict[str, Any], *, actor: str
) -> TenantView:
    """Change the given quotas (None: no limit); the others stay as they are."""
    values = validate_quotas(quotas)
    if not values:
        raise InvalidRequest("name at least one quota to change", field="quota")
    with sessions.begin() as session:
        row = session.get(Tenant, name, with_for_update=True)
        if row is None:
            raise UnknownTenant(f"unknown tenant {name!r}: create it first", field="name")
        before = _quotas_of(row)
        for key, value in values.items():
            setattr(row, key, value)
        row.updated_at = utcnow()
        _audit(session, "tenant-set", name, before, _quotas_of(row), actor=actor)
    return get(sessions, name)


def assign_job(
    sessions: sessionmaker[Session], job: str, tenant: str | None, *, actor: str
) -> None:
    """Move ``job`` to ``tenant`` (None: to no tenant). Sandboxes admitted before keep the
    tenant they were billed to; admissions see the move within the job cache's 2 s."""
    with sessions.begin() as session:
        row = store.get_job(session, job)
        if tenant is not None and session.get(Tenant, tenant) is None:
            raise UnknownTenant(f"unknown tenant {tenant!r}: create it first", field="tenant")
        if row.tenant == tenant:
            return
        before = row.tenant
        row.tenant = tenant
        _audit(
            session,
            "job-tenant",
            tenant,
            {"tenant": before},
            {"tenant": tenant},
            actor=actor,
            job=job,
        )


def get(sessions: sessionmaker[Session], name: str) -> TenantView:
    views = [v for v in listing(sessions, name) if v.name == name]
    if not views:
        raise UnknownTenant(f"unknown tenant {name!r}", field="name")
    return views[0]


def listing(sessions: sessionmaker[Session], name: str | None = None) -> list[TenantView]:
    """Every tenant (or one), sorted by name, with its jobs and current use."""
    with sessions() as session:
        stmt = select(Tenant).order_by(Tenant.name)
        if name is not None:
            stmt = stmt.where(Tenant.name == name)
        tenants = list(session.scalars(stmt))
        names = [t.name for t in tenants]
        jobs: dict[str, list[str]] = {}
        for job, tenant in session.execute(
            select(Job.name, Job.tenant).where(Job.tenant.in_(names)).order_by(Job.name)
        ):
            jobs.setdefault(tenant or "", []).append(job)
        live = dict(
            session.execute(
                select(Sandbox.tenant, func.count())
                .where(
                    Sandbox.tenant.in_(names),
                    Sandbox.state.in_([s.value for s in CAPPED_STATES]),
                )
                .group_by(Sandbox.tenant)
            ).all()
        )
        recent = dict(
            session.execute(
                select(Sandbox.tenant, func.count())
                .where(Sandbox.tenant.in_(names), Sandbox.requested_at >= utcnow() - QUOTA_WINDOW)
                .group_by(Sandbox.tenant)
            ).all()
        )
        held = dict(
            session.execute(
                select(Snapshot.tenant, func.sum(Snapshot.size_b))
                .where(
                    Snapshot.tenant.in_(names),
                    Snapshot.state.in_(LIVE_SNAPSHOT_STATES),
                    Snapshot.expires_at > utcnow(),
                )
                .group_by(Snapshot.tenant)
            ).all()
        )
    return [
        TenantView(
            t.name,
            t.max_live,
            t.creates_per_minute,
            t.snapshot_bytes,
            jobs.get(t.name, []),
            int(live.get(t.name, 0)),
            int(recent.get(t.name, 0)),
            int(held.get(t.name) or 0),
        )
        for t in tenants
    ]
