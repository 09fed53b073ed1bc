"""Audit: search the append-only event log by sandbox, pod, nonce, job, actor and time."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

from flask import Blueprint, abort, render_template, request, url_for
from sqlalchemy import Select, select

from broker.ledger.models import Event

bp = Blueprint("audit", __name__, url_prefix="/audit")
PAGE = 100
MAX_ID = 2**63  # bigint ids
KINDS = ("transition", "api", "gc", "pool", "reuse", "admin")


class BadSearch(ValueError):
    pass


def parse_time(raw: str | None) -> dt.datetime | None:
    """ISO 8601 or the browser's ``datetime-local``; naive times are UTC."""
    if not raw:
        return None
    try:
        value = dt.datetime.fromisoformat(raw.strip().replace("Z", "+00:00"))
    except ValueError as exc:
        raise BadSearch(f"not a time: {raw!r}") from exc
    return value if value.tzinfo else value.replace(tzinfo=dt.UTC)


@dataclass
class Search:
    sandbox: str = ""
    pod: str = ""
    nonce: str = ""
    job: str = ""
    kind: str = ""
    actor: str = ""
    since: dt.datetime | None = None
    until: dt.datetime | None = None
    before: int | None = None
    limit: int = PAGE

    @classmethod
    def from_args(cls, args: Any) -> Search:
        try:
            before = int(args["before"]) if args.get("before") else None
            limit = max(1, min(int(args.get("limit") or PAGE), 500))
        except ValueError as exc:
            raise BadSearch("before and limit must be integers") from exc
        if before is not None and not 0 < before < MAX_ID:
            raise BadSearch("before is out of range")
        kind = (args.get("kind") or "").strip()
        if kind and kind not in KINDS:
            raise BadSearch(f"kind must be one of {', '.join(KINDS)}")
        return cls(
            sandbox=(args.get("sandbox") or "").strip()[:32],
            pod=(args.get("pod") or "").strip()[:253],
            nonce=(args.get("nonce") or "").strip()[:64],
            job=(args.get("job") or "").strip()[:63],
            kind=kind,
            actor=(args.get("actor") or "").strip()[:128],
            since=parse_time(args.get("since")),
            until=parse_time(args.get("until")),
            before=before,
            limit=limit,
        )

    def statement(self) -> Select[tuple[Event]]:
        stmt = select(Event)
        for col, value in (
            (Event.sandbox_id, self.sandbox),
            (Event.pod_name, self.pod),
            (Event.nonce, self.nonce),
            (Event.job, self.job),
            (Event.kind, self.kind),
            (Event.actor, self.actor),
        ):
            if value:
                stmt = stmt.where(col == value)
        if self.since:
            stmt = stmt.where(Event.at >= self.since)
        if self.until:
            stmt = stmt.where(Event.at < self.until)
        if self.before:
            stmt = stmt.where(Event.id < self.before)
        return stmt.order_by(Event.id.desc()).limit(self.limit + 1)


def run(session: Any, search: Search) -> tuple[list[Event], int | None]:
    events = list(session.scalars(search.statement()))
    more = len(events) > search.limit
    events = events[: search.limit]
    return events, (events[-1].id if more and events else None)


@bp.route("")
def index() -> Any:
    from web.views import services

    try:
        search = Search.from_args(request.args)
    except BadSearch as exc:
        abort(400, str(exc))
    with services().sessions() as session:
        events, next_before = run(session, search)
    args = {k: v for k, v in request.args.items() if k != "before" and v}
    older = url_for("audit.index", **args, before=next_before) if next_before else None
    return render_template(
        "audit.html",
        events=events,
        s=search,
        kinds=KINDS,
        older=older,
        raw=request.args,
    )
