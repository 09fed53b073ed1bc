"""One blueprint per area; helpers every view uses."""

from __future__ import annotations

from flask import current_app, g, request

from broker.acquire.root import Services


def services() -> Services:
    svc = current_app.extensions["sandman"]
    assert isinstance(svc, Services)
    return svc


def actor() -> str:
    """Who is acting, as the audit trail records it (``admin:alice``)."""
    principal = g.get("principal")
    return principal.actor if principal is not None else "anonymous"


def wants_fragment() -> bool:
    """A live-refresh request (live.js) wants only the changing part of the page."""
    return bool(request.args.get("fragment"))
