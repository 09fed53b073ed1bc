"""The trace format: one acquire per JSONL line, with how long the sandbox was held.

    {"time": 12.5, "job": "rl-1", "image": "python:3.12", "role": "rollout", "duration": 40.2}

``time`` is seconds from the trace start (or any epoch: traces are shifted to start at 0 on
read), ``duration`` is seconds from hand-out to release. Extra keys are kept but ignored.

The broker records its traces in the ledger already: every sandbox row has its request
(``enqueued_at``), hand-out (``acquired_at``) and release (``releasing_at``) times, job,
image and role, so ``sandman trace export`` builds the JSONL from rows and the acquire path
needs no extra write.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from broker.errors import InvalidRequest
from broker.ledger.models import Sandbox


@dataclass(frozen=True)
class TraceEvent:
    """One acquire at ``time`` held for ``duration`` seconds."""

    time: float
    job: str
    image: str
    role: str = "rollout"
    duration: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def parse_line(line: str, lineno: int = 0) -> TraceEvent | None:
    text = line.strip()
    if not text or text.startswith("#"):
        return None
    try:
        raw = json.loads(text)
        event = TraceEvent(
            time=float(raw["time"]),
            job=str(raw.get("job", "")),
            image=str(raw["image"]),
            role=str(raw.get("role", "rollout")),
            duration=float(raw.get("duration", 0.0)),
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise InvalidRequest(f"trace line {lineno}: {exc!s} in {text[:120]!r}") from exc
    if event.duration < 0 or event.time != event.time:
        raise InvalidRequest(f"trace line {lineno}: negative duration or NaN time")
    return event


def read_trace(source: Path | str | IO[str]) -> list[TraceEvent]:
    """Events sorted by time and shifted so the first one is at 0."""
    if isinstance(source, Path | str):
        with Path(source).open(encoding="utf-8") as fh:
            return read_trace(fh)
    events = [e for n, line in enumerate(source, 1) if (e := parse_line(line, n)) is not None]
    events.sort(key=lambda e: e.time)
    if not events:
        return []
    t0 = events[0].time
    return [TraceEvent(e.time - t0, e.job, e.image, e.role, e.duration) for e in events]


def write_trace(events: Iterable[TraceEvent], out: IO[str]) -> int:
    count = 0
    for event in events:
        out.write(json.dumps(event.to_dict(), sort_keys=True) + "\n")
        count += 1
    return count


def rows_to_events(rows: Iterable[Any], now: dt.datetime | None = None) -> Iterator[TraceEvent]:
    """(job, image, role, enqueued_at, requested_at, acquired_at, releasing_at, deleted_at)
    tuples to events: only rows a trainer was handed. Still-held sandboxes end at ``now``."""
    for job, image, role, enqueued, requested, acquired, releasing, deleted in rows:
        if acquired is None:
            continue  # a warm pod never handed out, or a create that failed
        asked = enqueued or requested or acquired
        asked = min(asked, acquired)
        end = releasing or deleted or now
        duration = max(0.0, (end - acquired).total_seconds()) if end else 0.0
        yield TraceEvent(
            time=asked.timestamp(),
            job=str(job),
            image=str(image),
            role=str(getattr(role, "value", role)),
            duration=duration,
        )


def export_ledger(
    session: Session,
    *,
    job: str | None = None,
    since: dt.datetime | None = None,
    until: dt.datetime | None = None,
) -> list[TraceEvent]:
    """The ledger's acquisitions as a trace (absolute epoch times, sorted)."""
    query = select(
        Sandbox.job,
        Sandbox.image,
        Sandbox.role,
        Sandbox.enqueued_at,
        Sandbox.requested_at,
        Sandbox.acquired_at,
        Sandbox.releasing_at,
        Sandbox.deleted_at,
    ).where(Sandbox.acquired_at.isnot(None))
    if job:
        query = query.where(Sandbox.job == job)
    if since:
        query = query.where(Sandbox.acquired_at >= since)
    if until:
        query = query.where(Sandbox.acquired_at < until)
    rows = session.execute(query.order_by(Sandbox.acquired_at)).all()
    events = list(rows_to_events(rows, now=dt.datetime.now(dt.UTC)))
    events.sort(key=lambda e: e.time)
    return events
