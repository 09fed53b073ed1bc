"""Fair-share weights at run time, the scheduler's copy of them, and each job's share.

The weights live in PostgreSQL (``tenants.weight``, ``jobs.weight``) with the rest of a
tenant's and job's configuration, and every change is an ``admin`` event like a quota
change (``audit.quota_changes`` lists them). The scheduler runs in Redis and reads a
mirror (``broker.acquire.fairshare.conf_fields``): weights, which tenant owns which job,
and each job's own create bucket. The mirror is rewritten whole after every change made
here, by every pool upkeep (beat, every 5 s: a job moved or created by any other path is
seen within that) and when a worker starts, so a Redis restart loses nothing for long.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import asdict, dataclass
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from broker.acquire.fairshare import conf_fields, publish_conf
from broker.acquire.quotas import audit, validate_weight
from broker.ledger import store
from broker.ledger.models import Job, Sandbox, Tenant, utcnow

SHARE_WINDOW = dt.timedelta(minutes=1)


def set_job_weight(
    sessions: sessionmaker[Session],
    job: str,
    weight: Any,
    *,
    actor: str,
    redis: Any | None = None,
) -> None:
    """Change ``job``'s weight (audited); the scheduler sees it at once when ``redis`` is
    given, else at the next upkeep."""
    value = validate_weight(weight)
    with sessions.begin() as session:
        row = store.get_job(session, job)
        if row.weight != value:
            audit(
                session,
                "job-weight",
                row.tenant,
                {"weight": row.weight},
                {"weight": value},
                actor=actor,
                job=job,
            )
            row.weight = value
    if redis is not None:
        sync(sessions, redis)


def sync(sessions: sessionmaker[Session], redis: Any) -> int:
    """Rewrite the scheduler's configuration from the ledger; returns how many jobs."""
    with sessions() as session:
        jobs = [
            (j.name, j.tenant, j.weight, j.create_rate, j.create_burst)
            for j in session.execute(
                select(Job.name, Job.tenant, Job.weight, Job.create_rate, Job.create_burst)
            )
        ]
        tenants = {t.name: t.weight for t in session.execute(select(Tenant.name, Tenant.weight))}
    publish_conf(redis, conf_fields(jobs, tenants))
    return len(jobs)


@dataclass(frozen=True)
class Share:
    """One job's part of the creates of the last minute, and the weights behind it."""

    job: str
    tenant: str | None
    weight: float
    tenant_weight: float | None
    creates: int
    share: float  # of every create of the last minute (0 when there were none)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def shares(session: Session, now: dt.datetime | None = None) -> list[Share]:
    """Every job with its creates (sandboxes that went to the backend) in the last minute
    and their share of all creates then, by job name. Warm refills count: they take the
    same tokens."""
    since = (now or utcnow()) - SHARE_WINDOW
    counts = dict(
        session.execute(
            select(Sandbox.job, func.count())
            .where(Sandbox.creating_at >= since)
            .group_by(Sandbox.job)
        ).all()
    )
    total = sum(counts.values())
    rows = session.execute(
        select(Job.name, Job.tenant, Job.weight, Tenant.weight)
        .outerjoin(Tenant, Tenant.name == Job.tenant)
        .order_by(Job.name)
    ).all()
    return [
        Share(
            name,
            tenant,
            weight,
            tenant_weight,
            int(counts.get(name, 0)),
            (int(counts.get(name, 0)) / total) if total else 0.0,
        )
        for name, tenant, weight, tenant_weight in rows
    ]
