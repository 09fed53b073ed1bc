"""Overview: what the broker is doing right now, and the charts people would rather look at."""

from __future__ import annotations

import datetime as dt
from typing import Any

from flask import Blueprint, render_template

from broker.ledger.models import utcnow
from broker.ledger.states import LIVE_STATES, State
from web import charts, stats
from web.views import root, wants_fragment

bp = Blueprint("overview", __name__)
LIVE_ORDER = [s.value for s in State if s in LIVE_STATES]


def chart_set(session: Any) -> dict[str, Any]:
    now = utcnow()
    hour, day = now - dt.timedelta(hours=1), now - dt.timedelta(days=1)
    ready, _, _ = stats.histogram(session, "create_to_ready_s", day, stats.LATENCY_BUCKETS)
    acquire, _, _ = stats.histogram(session, "acquire_latency_s", day, stats.LATENCY_BUCKETS)
    return {
        "live": charts.series("Live sandboxes · last hour", stats.live_series(session, hour, 60)),
        "creates": charts.series(
            "Creates per second · last hour (1 min avg)",
            stats.creates_series(session, hour, 60),
            "/s",
        ),
        "ready": charts.histogram("Create → Ready · last 24 h", stats.LATENCY_BUCKETS, ready, "s"),
        "acquire": charts.histogram(
            "Acquire latency (queue-inclusive) · last 24 h", stats.LATENCY_BUCKETS, acquire, "s"
        ),
        "pod_hours": charts.bars(
            "Pod-hours per job · last 24 h", stats.pod_hours_by_job(session, day), " h"
        ),
    }


@bp.route("/")
def index() -> Any:
    parts = root()
    redis = parts.redis()
    with parts.sessions() as session:
        ov = stats.overview(session, redis)
        context = {
            "ov": ov,
            "charts": chart_set(session),
            "pulls": stats.image_pulls(session, utcnow() - dt.timedelta(days=1)),
            "states": LIVE_ORDER,
            "redis_error": parts.redis_error if redis is None else None,
        }
    if wants_fragment():
        return render_template("partials/overview_live.html", **context)
    return render_template("overview.html", **context)
