"""Audit: search the append-only event log by sandbox, pod, nonce, job, actor and time."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Any

from flask import Blueprint, abort, render_template, request, url_for
from sqlalchemy import Select, select

from broker.ledger.models import Event
from web import params

bp = Blueprint("audit", __name__, url_prefix="/audit")
PAGE = 100
KINDS = ("transition", "api", "gc", "pool", "reuse", "admin")


BadSearch = params.ParamError


def parse_time(raw: str | None) -> dt.datetime | None:
    """ISO 8601 or the browser's ``datetime-local``; naive times are UTC."""
    if not raw:
        return None
    try:
        value = dt.datetime.fromisoformat(raw.strip().replace("Z", "+00:00"))
    except ValueError as exc:
        raise BadSearch(f"not a time: {raw!r}") from exc
    return value if value.tzinfo else value.replace(tzinfo=dt.UTC)


# The exact-match filters: query parameter -> (event column, longest value it can hold).
MATCHES: dict[str, tuple[Any, int]] = {
    "sandbox": (Event.sandbox_id, 32),
    "pod": (Event.pod_name, 253),
    "nonce": (Event.nonce, 64),
    "job": (Event.job, 63),
    "actor": (Event.actor, 128),
}


@dataclass
class Search:
    """One audit search; ``match`` holds every exact-match filter ("" for none)."""

    match: dict[str, str] = field(default_factory=lambda: dict.fromkeys(MATCHES, ""))
    kind: str = ""
    since: dt.datetime | None = None
    until: dt.datetime | None = None
    before: int | None = None
    limit: int = PAGE

    @classmethod
    def from_args(cls, args: Any) -> Search:
        return cls(
            match={name: params.text(args, name, n) for name, (_, n) in MATCHES.items()},
            kind=params.choice(args, "kind", ("", *KINDS), ""),
            since=parse_time(params.timestamp(args, "since")),
            until=parse_time(params.timestamp(args, "until")),
            before=params.integer(args, "before", 1, params.MAX_BIGINT),
            limit=params.integer(args, "limit", 1, 500, PAGE) or PAGE,
        )

    def statement(self) -> Select[Event]:
        stmt = select(Event)
        for name, (col, _) in MATCHES.items():
            if self.match[name]:
                stmt = stmt.where(col == self.match[name])
        if self.kind:
            stmt = stmt.where(Event.kind == self.kind)
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
    from web.views import root

    try:
        # HTML forms send empty fields: for the page, empty means "no filter".
        search = Search.from_args({k: v for k, v in request.args.items() if v})
    except BadSearch as exc:
        abort(400, str(exc))
    with root().sessions() as session:
        events, next_before = run(session, search)
    args: dict[str, Any] = {k: v for k, v in request.args.items() if k != "before" and v}
    older = url_for("audit.index", **args, before=next_before) if next_before else None
    return render_template(
        "audit.html",
        events=events,
        s=search,
        kinds=KINDS,
        older=older,
        raw=request.args,
    )
