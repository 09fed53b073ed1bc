"""Jinja filters for dense operator tables: relative times, durations, sizes, badges."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

from flask import Flask, request, url_for

from broker.ledger.models import utcnow

STATE_TONE = {
    "requested": "muted",
    "creating": "info",
    "ready": "ok",
    "releasing": "warn",
    "deleted": "muted",
    "failed": "bad",
    "abandoned": "warn",
}


def ago(value: dt.datetime | None) -> str:
    if value is None:
        return "—"
    secs = (utcnow() - value).total_seconds()
    future = secs < 0
    secs = abs(secs)
    if secs < 60:
        text = f"{secs:.0f}s"
    elif secs < 3600:
        text = f"{secs / 60:.0f}m"
    elif secs < 86400:
        text = f"{secs / 3600:.1f}h"
    else:
        text = f"{secs / 86400:.1f}d"
    return f"in {text}" if future else f"{text} ago"


def when(value: dt.datetime | None) -> str:
    return "—" if value is None else value.astimezone(dt.UTC).strftime("%Y-%m-%d %H:%M:%S")


def seconds(value: float | None) -> str:
    if value is None:
        return "—"
    if value < 1:
        return f"{value * 1000:.0f} ms"
    if value < 120:
        return f"{value:.2f} s"
    return f"{value / 60:.1f} min"


def size(value: int | None) -> str:
    if value is None:
        return "—"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value = value / 1024  # type: ignore[assignment]
    return str(value)


def tone(state: Any) -> str:
    return STATE_TONE.get(str(state), "muted")


def pretty(value: Any) -> str:
    """Compact JSON for detail columns (escaped by Jinja, unlike ``tojson``'s \\u0027)."""
    if not value:
        return ""
    return json.dumps(value, ensure_ascii=False, sort_keys=True, default=str)


def pct(value: float | None) -> str:
    return "—" if value is None else f"{value * 100:.0f}%"


def register(app: Flask) -> None:
    app.jinja_env.filters.update(
        ago=ago, when=when, seconds=seconds, size=size, tone=tone, pct=pct, pretty=pretty
    )

    def page_url(**changes: Any) -> str:
        """This page's URL with some query arguments changed (empty values dropped)."""
        args: dict[str, Any] = {
            k: v for k, v in request.args.items() if k not in ("fragment", "cursor")
        }
        args.update(changes)
        args = {k: v for k, v in args.items() if v not in ("", None)}
        return url_for(request.endpoint or "overview.index", **(request.view_args or {}), **args)

    app.jinja_env.globals.update(page_url=page_url)

    @app.context_processor
    def _refresh() -> dict[str, Any]:
        """Live-refresh period in seconds: ``?refresh=N`` (1-60), default 5."""
        try:
            secs = int(request.args.get("refresh", 5))
        except ValueError:
            secs = 5
        return {"refresh_s": max(1, min(secs, 60))}
