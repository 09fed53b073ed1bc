"""Reading the ``admin`` events a test's changes wrote, one way."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select

from broker.ledger.models import Event


def weight_changes(sessions: Any, tenant: str, job: str) -> list[tuple[str, Any, Any]]:
    """(action, weight before, weight after) of every weight change of ``tenant`` or
    ``job``, oldest first (quota changes without a weight are left out)."""
    with sessions() as session:
        events = session.scalars(
            select(Event)
            .where(Event.kind == "admin", Event.action.in_(["tenant-set", "job-weight"]))
            .where((Event.detail["tenant"].as_string() == tenant) | (Event.job == job))
            .order_by(Event.id)
        )
        return [
            (e.action, e.detail["before"]["weight"], e.detail["after"]["weight"])
            for e in events
            if "weight" in (e.detail.get("after") or {})
        ]
