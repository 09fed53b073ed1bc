"""One blueprint per area; helpers every view uses."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flask import current_app, g, request

from broker.acquire.root import Root


def root() -> Root:
    """The app's composition root: every part a view uses (ledger, Redis, pods) is its."""
    parts = current_app.extensions["sandman"]
    assert isinstance(parts, Root)
    return parts


def actor() -> str:
    """Who is acting, as the audit trail records it (``admin:alice``)."""
    principal = g.get("principal")
    return principal.actor if principal is not None else "anonymous"


def live_args(args: Mapping[str, str]) -> dict[str, Any]:
    """This page's query arguments plus ``fragment=1``: the URL live.js refreshes from."""
    return {**args, "fragment": 1}


def wants_fragment() -> bool:
    """A live-refresh request (live.js) wants only the changing part of the page."""
    return bool(request.args.get("fragment"))
