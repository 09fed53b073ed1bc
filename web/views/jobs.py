"""Jobs and pools: pacing, caps, pool sizes, idle timeouts, and what each job uses now."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from flask import Blueprint, render_template
from sqlalchemy import select

from broker.acquire import quotas
from broker.errors import SandmanError
from broker.ledger.models import Job
from broker.pools.store import PoolConfig, parse_pools
from web import stats
from web.views import root

bp = Blueprint("jobs", __name__, url_prefix="/jobs")


@dataclass
class PoolRow:
    config: PoolConfig | None
    raw: dict[str, Any]
    warm_now: int | None
    error: str | None = None


@dataclass
class JobRow:
    job: Job
    live: dict[str, int] = field(default_factory=dict)
    pools: list[PoolRow] = field(default_factory=list)

    @property
    def live_total(self) -> int:
        return sum(self.live.values())

    def to_dict(self) -> dict[str, Any]:
        j = self.job
        return {
            "name": j.name,
            "tenant": j.tenant,
            "create_rate": j.create_rate,
            "create_burst": j.create_burst,
            "max_live": j.max_live,
            "max_concurrent_creates": j.max_concurrent_creates,
            "readiness_budget_s": j.readiness_budget_s,
            "idle_timeout_s": j.idle_timeout_s,
            "lease_s": j.lease_s,
            "egress": j.egress,
            "reuse": j.reuse,
            "max_reuses": j.max_reuses,
            "live": self.live,
            "live_total": self.live_total,
            "pools": [
                {
                    "key": p.config.key if p.config else None,
                    "image": p.raw.get("image"),
                    "size": p.config.size if p.config else None,
                    "idle_timeout_s": p.config.idle_timeout_s if p.config else None,
                    "cpu_m": p.config.cpu_m if p.config else None,
                    "memory_b": p.config.memory_b if p.config else None,
                    "warm_now": p.warm_now,
                    "error": p.error,
                }
                for p in self.pools
            ],
        }


def job_rows() -> list[JobRow]:
    parts = root()
    warm = parts.warm()
    with parts.sessions() as session:
        jobs = list(session.scalars(select(Job).order_by(Job.name)))
        counts = stats.live_counts(session)
        session.expunge_all()
    rows = {j.name: JobRow(job=j) for j in jobs}
    for job, state, n in counts:
        if job in rows:
            rows[job].live[state] = n
    for row in rows.values():
        for raw in row.job.warm_pools or []:
            try:
                cfg = parse_pools([raw], root().settings.idle_timeout_s)[0]
            except (SandmanError, ValueError, TypeError) as exc:
                row.pools.append(PoolRow(None, dict(raw), None, str(exc)))
                continue
            size = None
            if warm is not None:
                try:
                    size = warm.size(row.job.name, cfg.key)
                except Exception:
                    size = None
            row.pools.append(PoolRow(cfg, dict(raw), size))
    return list(rows.values())


def global_pacing() -> dict[str, Any]:
    s = root().settings
    pacer = stats.pacer_state(root().redis(), s.create_rate, s.create_burst)
    return {
        "create_rate": s.create_rate,
        "create_burst": s.create_burst,
        "max_concurrent_creates": s.max_concurrent_creates,
        "readiness_budget_s": s.readiness_budget_s,
        "lease_s": s.lease_s,
        "idle_timeout_s": s.idle_timeout_s,
        "gc_interval_s": s.gc_interval_s,
        "tokens": pacer["tokens"],
        "in_flight": pacer["in_flight"],
    }


@bp.route("")
def index() -> Any:
    return render_template(
        "jobs.html",
        jobs=job_rows(),
        tenants=quotas.listing(root().sessions),
        pacing=global_pacing(),
        redis_error=root().redis_error,
    )
