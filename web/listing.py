"""The sandboxes list: filters, sorting and keyset pagination that stay fast at any size.

Why keyset and not OFFSET: page 400 of an OFFSET query reads and throws away 20,000 rows;
a keyset page reads only its own rows from an index. Every sortable column is indexed
(``requested_at``, ``job``, ``state`` via ``ix_sandboxes_state_job``, ``pod_name``, ``id``)
and ``id`` (the primary key) breaks ties, so the order is total and a cursor is just the
last row's (value, id). The cursor condition is written as ``col <= v AND (col < v OR
id < :id)`` rather than a row comparison so that PostgreSQL can use the single-column
index for ``col <= v``. Counts are capped (``COUNT_CAP``): an exact count of a large
table costs a full scan and nobody needs to know it is 20,317 rather than "10,000+".
"""

from __future__ import annotations

import base64
import binascii
import datetime as dt
import json
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Select, and_, func, or_, select
from sqlalchemy.orm import Session

from broker.ledger.models import Sandbox
from broker.ledger.states import LIVE_STATES, Role, State
from web import params

COUNT_CAP = 10_000
DEFAULT_LIMIT = 50
MAX_LIMIT = 200
SORTS: dict[str, Any] = {
    "requested_at": Sandbox.requested_at,
    "job": Sandbox.job,
    "state": Sandbox.state,
    "pod_name": Sandbox.pod_name,
    "id": Sandbox.id,
}
STATE_FILTERS = ("live", *(s.value for s in State))


BadQuery = params.ParamError  # a filter or sort the list cannot use (HTTP 400)


@dataclass
class ListQuery:
    state: str = ""
    job: str = ""
    role: str = ""
    q: str = ""
    sort: str = "requested_at"
    order: str = "desc"
    cursor: str = ""
    limit: int = DEFAULT_LIMIT

    @classmethod
    def from_args(cls, args: Any) -> ListQuery:
        query = cls(
            state=params.choice(args, "state", ("", *STATE_FILTERS), ""),
            job=params.text(args, "job", 63),
            role=params.choice(args, "role", ("", *(r.value for r in Role)), ""),
            q=params.text(args, "q", 253),
            sort=params.choice(args, "sort", tuple(SORTS), "requested_at"),
            order=params.choice(args, "order", ("asc", "desc"), "desc"),
            cursor=params.text(args, "cursor", 512),
            limit=params.integer(args, "limit", 1, MAX_LIMIT, DEFAULT_LIMIT) or DEFAULT_LIMIT,
        )
        return query

    def args(self, **changes: Any) -> dict[str, Any]:
        """Query-string arguments for a link to this list with some changes."""
        base = {
            "state": self.state,
            "job": self.job,
            "role": self.role,
            "q": self.q,
            "sort": self.sort,
            "order": self.order,
            "limit": self.limit if self.limit != DEFAULT_LIMIT else "",
        }
        base.update(changes)
        return {k: v for k, v in base.items() if v not in ("", None)}


@dataclass
class Page:
    rows: list[Sandbox]
    total: int
    total_capped: bool
    next_cursor: str | None = None
    prev_cursor: str | None = None
    query: ListQuery = field(default_factory=ListQuery)


def filtered(query: ListQuery) -> Select[Sandbox]:
    stmt = select(Sandbox)
    if query.state == "live":
        stmt = stmt.where(Sandbox.state.in_([s.value for s in LIVE_STATES]))
    elif query.state:
        stmt = stmt.where(Sandbox.state == query.state)
    if query.job:
        stmt = stmt.where(Sandbox.job == query.job)
    if query.role:
        stmt = stmt.where(Sandbox.role == query.role)
    if query.q:  # exact matches on unique, indexed columns: one index probe each
        q = query.q
        stmt = stmt.where(
            or_(
                Sandbox.id == q,
                Sandbox.pod_name == q,
                Sandbox.nonce == q,
                Sandbox.request_id == q,
            )
        )
    return stmt


def _encode(row: Sandbox, sort: str, direction: str) -> str:
    value = getattr(row, sort)
    raw = value.isoformat() if isinstance(value, dt.datetime) else str(value)
    data = json.dumps([raw, row.id, direction]).encode()
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _decode(cursor: str, sort: str) -> tuple[Any, str, str] | None:
    """The cursor's position, or None when it is unreadable (then: the first page).

    A cursor is opaque and only ever comes from this API; one that does not decode (a
    stale link after a sort change, a hand-edited URL) restarts the list rather than
    failing, which is also what keeps any string a valid value for the parameter."""
    try:
        padded = cursor + "=" * (-len(cursor) % 4)
        raw, sid, direction = json.loads(base64.urlsafe_b64decode(padded.encode()))
        value: Any = dt.datetime.fromisoformat(raw) if sort == "requested_at" else str(raw)
        if direction not in ("next", "prev") or not isinstance(sid, str):
            raise ValueError(direction)
        if sort == "state":
            value = State(value)
        if "\x00" in str(raw) or "\x00" in sid:
            raise ValueError("NUL")
    except (ValueError, TypeError, binascii.Error):
        return None
    return value, sid, direction


def statement(query: ListQuery) -> tuple[Select[Sandbox], str]:
    """The page query (one more row than the limit) and its direction."""
    col = SORTS[query.sort]
    stmt = filtered(query)
    direction = "next"
    descending = query.order == "desc"
    position = _decode(query.cursor, query.sort) if query.cursor else None
    if position is None:
        query.cursor = ""
    else:
        value, sid, direction = position
        before = descending == (direction == "next")
        if before:
            stmt = stmt.where(col <= value, or_(col < value, and_(col == value, Sandbox.id < sid)))
        else:
            stmt = stmt.where(col >= value, or_(col > value, and_(col == value, Sandbox.id > sid)))
    ascending = (not descending) == (direction == "next")
    if query.sort == "id":
        order = [Sandbox.id.asc() if ascending else Sandbox.id.desc()]
    else:
        order = [col.asc(), Sandbox.id.asc()] if ascending else [col.desc(), Sandbox.id.desc()]
    return stmt.order_by(*order).limit(query.limit + 1), direction


def count(session: Session, query: ListQuery) -> tuple[int, bool]:
    sub = filtered(query).with_only_columns(Sandbox.id).limit(COUNT_CAP + 1).subquery()
    total = int(session.scalar(select(func.count()).select_from(sub)) or 0)
    return min(total, COUNT_CAP), total > COUNT_CAP


def fetch(session: Session, query: ListQuery) -> Page:
    stmt, direction = statement(query)
    rows = list(session.scalars(stmt))
    extra = len(rows) > query.limit
    rows = rows[: query.limit]
    if direction == "prev":
        rows.reverse()
        has_prev, has_next = extra, True
    else:
        has_next, has_prev = extra, bool(query.cursor)
    total, capped = count(session, query)
    page = Page(rows=rows, total=total, total_capped=capped, query=query)
    if rows and has_next:
        page.next_cursor = _encode(rows[-1], query.sort, "next")
    if rows and has_prev:
        page.prev_cursor = _encode(rows[0], query.sort, "prev")
    return page
