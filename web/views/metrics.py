"""``/metrics`` in the Prometheus text format (0.0.4), computed from the ledger and Redis.

Why not in-process counters: gunicorn runs several workers and the events happen in
Celery workers, not here; the ledger already holds every latency and state, so each
scrape reads it. The histograms cover every row ever recorded (rows are never deleted),
so their buckets only grow, as Prometheus counters must.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from flask import Blueprint, Response

from web import stats
from web.views import root

bp = Blueprint("metrics", __name__)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _esc(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(**labels: str) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_esc(str(v))}"' for k, v in labels.items()) + "}"


def _num(value: float) -> str:
    return repr(float(value)) if not float(value).is_integer() else str(int(value))


class Exposition:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def family(self, name: str, kind: str, help_text: str) -> None:
        self.lines.append(f"# HELP {name} {help_text}")
        self.lines.append(f"# TYPE {name} {kind}")

    def sample(self, name: str, value: float, **labels: str) -> None:
        self.lines.append(f"{name}{_labels(**labels)} {_num(value)}")

    def histogram(
        self,
        name: str,
        help_text: str,
        bounds: Iterable[float],
        cumulative: list[int],
        *,
        total: int,
        total_sum: float,
    ) -> None:
        self.family(name, "histogram", help_text)
        for bound, n in zip([*bounds, float("inf")], cumulative, strict=True):
            le = "+Inf" if bound == float("inf") else _num(bound)
            self.sample(f"{name}_bucket", n, le=le)
        self.sample(f"{name}_sum", total_sum)
        self.sample(f"{name}_count", total)

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def collect() -> str:
    parts = root()
    redis = parts.redis()
    out = Exposition()
    with parts.sessions() as session:
        for column, name, help_text in (
            ("acquire_latency_s", "sandman_acquire_latency_seconds",
             "Acquire latency, queue-inclusive (enqueue to lease), per sandbox."),
            ("create_to_ready_s", "sandman_create_to_ready_seconds",
             "Pod create submitted to Ready plus an authenticated execd answer."),
        ):  # fmt: skip
            buckets = stats.LATENCY_BUCKETS
            cumulative, total, total_sum = stats.histogram(session, column, None, buckets)
            out.histogram(name, help_text, buckets, cumulative, total=total, total_sum=total_sum)
        out.family("sandman_live_pods", "gauge", "Ledger rows that hold or may hold a pod.")
        for job, state, n in stats.live_counts(session):
            out.sample("sandman_live_pods", n, job=job, state=state)
        out.family("sandman_leaks_open", "gauge", "Leaks detected and not yet resolved.")
        for kind, n in sorted(stats.leaks_open(session).items()):
            out.sample("sandman_leaks_open", n, kind=kind)
        ov = stats.overview(session, redis)
        pulls = stats.image_pulls(session)
    out.family("sandman_image_starts_total", "counter", "Sandbox starts per image.")
    for item in pulls:
        out.sample("sandman_image_starts_total", item.starts, image=item.image)
    out.family("sandman_image_pulls_total", "counter", "Starts that had to pull the image.")
    for item in pulls:
        out.sample("sandman_image_pulls_total", item.pulls, image=item.image)
    out.family("sandman_image_pull_seconds_total", "counter", "Seconds spent pulling images.")
    for item in pulls:
        out.sample("sandman_image_pull_seconds_total", item.pull_s_sum, image=item.image)
    out.family("sandman_creates_per_second", "gauge", "Sandbox requests per second, 1 min avg.")
    out.sample("sandman_creates_per_second", ov.creates_per_s_1m)
    out.family("sandman_queue_depth", "gauge", "Messages waiting in each Celery queue.")
    for queue, depth in ov.queue_depth.items():
        if depth is not None:
            out.sample("sandman_queue_depth", depth, queue=queue)
    s = parts.settings
    pacer = stats.pacer_state(redis, s.create_rate, s.create_burst)
    out.family("sandman_pacer_tokens", "gauge", "Create tokens left in the global bucket.")
    if pacer["tokens"] is not None:
        out.sample("sandman_pacer_tokens", pacer["tokens"])
    out.family("sandman_pacer_in_flight", "gauge", "Creates holding a concurrency slot.")
    if pacer["in_flight"] is not None:
        out.sample("sandman_pacer_in_flight", pacer["in_flight"])
    last = stats.gc_last(redis)
    out.family("sandman_gc_pass_duration_seconds", "gauge", "Duration of the last GC pass.")
    if last and isinstance(last.get("duration_s"), int | float):
        out.sample("sandman_gc_pass_duration_seconds", float(last["duration_s"]))
    out.family("sandman_redis_up", "gauge", "1 when Redis answered this scrape.")
    out.sample("sandman_redis_up", 0 if redis is None else 1)
    return out.text()


@bp.route("/metrics")
def metrics() -> Any:
    return Response(collect(), mimetype=None, content_type=CONTENT_TYPE)
