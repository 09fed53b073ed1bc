"""Numbers the overview, the charts and ``/metrics`` share, computed from the ledger and Redis.

The ledger is the source of truth for what exists and how long things took; Redis holds
what is in flight (queue lengths, pacer state, warm pools). Windowed queries are bounded
by ``requested_at`` (indexed) so their cost follows recent activity, not table size.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import func, select, text
from sqlalchemy.orm import Session

from broker import names
from broker.acquire import weights
from broker.ledger.models import Event, Leak, Sandbox, utcnow
from broker.ledger.states import LIVE_STATES

log = logging.getLogger(__name__)

QUEUES = tuple(q.value for q in names.Queue)
PACER_BUCKET = names.PACE_BUCKET_GLOBAL
PACER_SEM = names.PACE_SEM_GLOBAL
# Where the latest GC pass report is kept (written by the beat GC task and the admin
# "run GC" action).
GC_LAST_KEY = names.GC_LAST_KEY
LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
LIVE_VALUES = [s.value for s in LIVE_STATES]


@dataclass
class Overview:
    live_by_state: dict[str, int] = field(default_factory=dict)
    live_by_job: dict[str, dict[str, int]] = field(default_factory=dict)
    live_total: int = 0
    creates_per_s_1m: float = 0.0
    creates_per_s_10m: float = 0.0
    queue_depth: dict[str, int | None] = field(default_factory=dict)
    warm_hits_1h: int = 0
    acquires_1h: int = 0
    leaks_open: dict[str, int] = field(default_factory=dict)
    redis_error: str | None = None
    # each job's part of the creates of the last minute, with its weights (fair share)
    shares: list[dict[str, Any]] = field(default_factory=list)

    @property
    def warm_hit_rate(self) -> float | None:
        return self.warm_hits_1h / self.acquires_1h if self.acquires_1h else None

    @property
    def leaks_open_total(self) -> int:
        return sum(self.leaks_open.values())

    def to_dict(self) -> dict[str, Any]:
        return {
            "live_total": self.live_total,
            "live_by_state": self.live_by_state,
            "live_by_job": self.live_by_job,
            "creates_per_s_1m": round(self.creates_per_s_1m, 4),
            "creates_per_s_10m": round(self.creates_per_s_10m, 4),
            "queue_depth": self.queue_depth,
            "warm_hits_1h": self.warm_hits_1h,
            "acquires_1h": self.acquires_1h,
            "warm_hit_rate": self.warm_hit_rate,
            "shares": self.shares,
            "leaks_open": self.leaks_open,
            "leaks_open_total": self.leaks_open_total,
        }


def live_counts(session: Session) -> list[tuple[str, str, int]]:
    rows = session.execute(
        select(Sandbox.job, Sandbox.state, func.count())
        .where(Sandbox.state.in_(LIVE_VALUES))
        .group_by(Sandbox.job, Sandbox.state)
    )
    return [(job, str(state), int(n)) for job, state, n in rows]


def leaks_open(session: Session) -> dict[str, int]:
    rows = session.execute(
        select(Leak.kind, func.count()).where(Leak.resolved_at.is_(None)).group_by(Leak.kind)
    )
    return {kind: int(n) for kind, n in rows}


def queue_depth(redis: Any | None) -> dict[str, int | None]:
    if redis is None:
        return dict.fromkeys(QUEUES)
    try:
        pipe = redis.pipeline(transaction=False)
        for name in QUEUES:
            pipe.llen(name)
        return {name: int(n) for name, n in zip(QUEUES, pipe.execute(), strict=True)}
    except Exception as exc:
        log.warning("queue depth unavailable: %s", type(exc).__name__)
        return dict.fromkeys(QUEUES)


def overview(session: Session, redis: Any | None) -> Overview:
    now = utcnow()
    out = Overview()
    for job, state, n in live_counts(session):
        out.live_by_state[state] = out.live_by_state.get(state, 0) + n
        out.live_by_job.setdefault(job, {})[state] = n
        out.live_total += n
    for window, attr in ((60, "creates_per_s_1m"), (600, "creates_per_s_10m")):
        since = now - dt.timedelta(seconds=window)
        created = session.scalar(
            select(func.count()).select_from(Sandbox).where(Sandbox.requested_at >= since)
        )
        setattr(out, attr, (created or 0) / window)
    hour_ago = now - dt.timedelta(hours=1)
    out.warm_hits_1h = int(
        session.scalar(
            select(func.count())
            .select_from(Event)
            .where(Event.at >= hour_ago, Event.kind == "pool", Event.action == "hand-out")
        )
        or 0
    )
    out.acquires_1h = int(
        session.scalar(
            select(func.count())
            .select_from(Sandbox)
            .where(
                Sandbox.requested_at >= now - dt.timedelta(days=1),
                Sandbox.acquired_at >= hour_ago,
            )
        )
        or 0
    )
    out.leaks_open = leaks_open(session)
    out.queue_depth = queue_depth(redis)
    out.shares = [
        share.to_dict()
        for share in weights.shares(session, now)
        if share.creates or share.weight != 1 or share.tenant_weight not in (None, 1)
    ]
    return out


def pacer_state(redis: Any | None, rate: float, burst: int) -> dict[str, float | None]:
    """Tokens left in the global bucket (GCRA: derived from its theoretical arrival time)."""
    if redis is None:
        return {"tokens": None, "in_flight": None}
    try:
        tat_raw = redis.get(PACER_BUCKET)
        secs, micros = redis.time()
        in_flight = redis.zcount(PACER_SEM, secs + micros / 1e6, "+inf")
    except Exception as exc:
        log.warning("pacer state unavailable: %s", type(exc).__name__)
        return {"tokens": None, "in_flight": None}
    now = secs + micros / 1e6
    interval = 1.0 / rate
    tat = float(tat_raw) if tat_raw else now
    tokens = burst if tat <= now else burst - (tat - now) / interval
    return {"tokens": max(0.0, min(float(burst), tokens)), "in_flight": float(in_flight)}


def gc_last(redis: Any | None) -> dict[str, Any] | None:
    if redis is None:
        return None
    try:
        raw = redis.get(GC_LAST_KEY)
        return dict(json.loads(raw)) if raw else None
    except Exception:
        return None


# -- chart series ---------------------------------------------------------------------

_HIST_COLUMNS = {
    "create_to_ready_s": Sandbox.create_to_ready_s,
    "acquire_latency_s": Sandbox.acquire_latency_s,
}


def histogram(
    session: Session, column: str, since: dt.datetime | None, buckets: tuple[float, ...]
) -> tuple[list[int], int, float]:
    """Cumulative counts per upper bound (+Inf last), plus the count and the sum."""
    col = _HIST_COLUMNS[column]
    exprs = [func.count().filter(col <= b) for b in buckets]
    stmt = select(*exprs, func.count(col), func.coalesce(func.sum(col), 0.0)).where(
        col.is_not(None)
    )
    if since is not None:
        stmt = stmt.where(Sandbox.requested_at >= since)
    row = session.execute(stmt).one()
    counts = [int(x) for x in row[: len(buckets)]]
    total, total_sum = int(row[len(buckets)]), float(row[len(buckets) + 1])
    return [*counts, total], total, total_sum


def creates_series(
    session: Session, since: dt.datetime, step_s: int
) -> list[tuple[dt.datetime, float]]:
    """Creates per second, averaged over ``step_s`` buckets."""
    rows = session.execute(
        text(
            "SELECT g.t, count(s.id) FROM generate_series("
            " to_timestamp(floor(extract(epoch FROM :since) / :step) * :step),"
            " now(), make_interval(secs => :step)) AS g(t)"
            " LEFT JOIN sandboxes s ON s.requested_at >= g.t"
            " AND s.requested_at < g.t + make_interval(secs => :step)"
            " AND s.requested_at >= :since - make_interval(secs => :step)"
            " GROUP BY g.t ORDER BY g.t"
        ),
        {"since": since, "step": step_s},
    )
    return [(t, n / step_s) for t, n in rows]


def live_series(session: Session, since: dt.datetime, step_s: int) -> list[tuple[dt.datetime, int]]:
    """Sandboxes holding a pod at each step: created before it, not yet deleted."""
    rows = session.execute(
        text(
            "WITH s AS (SELECT coalesce(creating_at, requested_at) AS a,"
            "  coalesce(deleted_at, CASE WHEN state = 'failed' THEN failed_at END) AS b"
            "  FROM sandboxes WHERE requested_at >= :since - interval '1 day'"
            "  OR state IN ('requested','creating','ready','releasing','abandoned'))"
            " SELECT g.t, count(s.a) FROM (SELECT generate_series(:since, now(),"
            " make_interval(secs => :step)) UNION SELECT now()) AS g(t)"
            " LEFT JOIN s ON s.a <= g.t AND (s.b IS NULL OR s.b > g.t)"
            " GROUP BY g.t ORDER BY g.t"
        ),
        {"since": since, "step": step_s},
    )
    return [(t, int(n)) for t, n in rows]


def pod_hours_by_job(session: Session, since: dt.datetime) -> list[tuple[str, float]]:
    rows = session.execute(
        text(
            "SELECT job, sum(extract(epoch FROM"
            "  least(coalesce(deleted_at, now()), now()) - greatest(creating_at, :since)"
            " )) / 3600.0 AS h FROM sandboxes"
            " WHERE creating_at IS NOT NULL AND (deleted_at IS NULL OR deleted_at > :since)"
            " AND (requested_at >= :since - interval '1 day'"
            "  OR state IN ('creating','ready','releasing','abandoned','failed'))"
            " GROUP BY job ORDER BY h DESC LIMIT 20"
        ),
        {"since": since},
    )
    return [(job, max(0.0, float(h or 0.0))) for job, h in rows]


@dataclass(frozen=True)
class ImagePulls:
    """Per image: how many starts were recorded, how many had to pull, and pull times."""

    image: str
    starts: int
    pulls: int
    pull_s_sum: float
    pull_s_p50: float | None

    @property
    def pull_share(self) -> float:
        return self.pulls / self.starts if self.starts else 0.0


def image_pulls(session: Session, since: dt.datetime | None = None) -> list[ImagePulls]:
    """Starts whose node said whether it pulled (``image_pulled`` set), grouped by image."""
    rows = session.execute(
        text(
            "SELECT image, count(*),"
            " count(*) FILTER (WHERE image_pulled),"
            " coalesce(sum(image_pull_s) FILTER (WHERE image_pulled), 0),"
            " percentile_cont(0.5) WITHIN GROUP (ORDER BY image_pull_s)"
            "  FILTER (WHERE image_pulled)"
            " FROM sandboxes WHERE image_pulled IS NOT NULL"
            " AND (CAST(:since AS timestamptz) IS NULL OR ready_at >= :since)"
            " GROUP BY image ORDER BY image LIMIT 100"
        ),
        {"since": since},
    )
    return [
        ImagePulls(str(image), int(starts), int(pulls), float(total or 0), _float(p50))
        for image, starts, pulls, total, p50 in rows
    ]


def _float(value: Any) -> float | None:
    return None if value is None else float(value)
