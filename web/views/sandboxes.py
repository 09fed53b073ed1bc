"""Sandboxes: the keyset-paginated list, one sandbox's detail, and an audited release."""

from __future__ import annotations

from typing import Any, NamedTuple

from flask import Blueprint, abort, flash, redirect, render_template, request, url_for
from sqlalchemy import select

from broker.errors import SandmanError
from broker.ledger.models import Event, Job, Leak, Sandbox
from broker.ledger.states import State
from broker.ownership import operator
from web import listing
from web.views import actor, live_args, root, wants_fragment

bp = Blueprint("sandboxes", __name__, url_prefix="/sandboxes")
COLUMNS = [
    ("id", "Sandbox", True),
    ("job", "Job", True),
    ("state", "State", True),
    (None, "Role", False),
    ("pod_name", "Pod", True),
    (None, "Node / address", False),
    ("requested_at", "Requested", True),
    (None, "Create→Ready", False),
    (None, "Acquire", False),
    (None, "Lease", False),
]
EVENTS_SHOWN = 500


def job_names(session: Any) -> list[str]:
    return list(session.scalars(select(Job.name).order_by(Job.name)))


@bp.route("")
def index() -> Any:
    try:
        query = listing.ListQuery.from_args(request.args)
    except listing.BadQuery as exc:
        abort(400, str(exc))
    parts = root()
    with parts.sessions() as session:
        try:
            page = listing.fetch(session, query)
        except listing.BadQuery as exc:
            abort(400, str(exc))
        jobs = job_names(session)
    context = {
        "page": page,
        "q": query,
        "jobs": jobs,
        "columns": COLUMNS,
        "states": listing.STATE_FILTERS,
        "live_url": url_for("sandboxes.index", **live_args(request.args)),
    }
    if wants_fragment():
        return render_template("partials/sandboxes_table.html", **context)
    return render_template("sandboxes.html", **context)


def read_pod(row: Sandbox) -> tuple[Any, str]:
    """Live read-back of the pod, or why it is unavailable."""
    backend = root().backend()
    if backend is None:
        return None, f"unavailable: {root().backend_error or 'no backend'}"
    try:
        pod = backend.get(row.namespace, row.pod_name)
    except (SandmanError, OSError) as exc:
        return None, f"unavailable: {type(exc).__name__}"
    if pod is None:
        return None, "absent: no pod with this name exists"
    if pod.nonce != row.nonce:
        return pod, "present, but its nonce differs from the ledger row: NOT this row's pod"
    return pod, "present"


class Detail(NamedTuple):
    """What the ledger says of one sandbox: its row, its newest events (``more_events``
    when some were cut off) and its leaks; the names are the detail template's."""

    row: Sandbox
    events: list[Event]
    leaks: list[Leak]
    more_events: bool


def load(sandbox_id: str) -> Detail:
    with root().sessions() as session:
        row = session.get(Sandbox, sandbox_id)
        if row is None:
            abort(404, f"no sandbox {sandbox_id}")
        events = list(
            session.scalars(
                select(Event)
                .where(Event.sandbox_id == sandbox_id)
                .order_by(Event.at.desc(), Event.id.desc())
                .limit(EVENTS_SHOWN + 1)
            )
        )
        leaks = list(
            session.scalars(
                select(Leak).where(Leak.sandbox_id == sandbox_id).order_by(Leak.id.desc())
            )
        )
        session.expunge_all()
    return Detail(row, events[:EVENTS_SHOWN], leaks, len(events) > EVENTS_SHOWN)


@bp.route("/<sandbox_id>")
def detail(sandbox_id: str) -> Any:
    page = load(sandbox_id)
    pod, pod_status = read_pod(page.row)
    template = "partials/sandbox_live.html" if wants_fragment() else "sandbox.html"
    releasable = page.row.state != State.DELETED
    return render_template(
        template, **page._asdict(), pod=pod, pod_status=pod_status, releasable=releasable
    )


@bp.route("/<sandbox_id>/release", methods=["GET", "POST"])
def release(sandbox_id: str) -> Any:
    row, _, _, _ = load(sandbox_id)
    if request.method == "GET":
        pod, pod_status = read_pod(row)
        return render_template("confirm_release.html", row=row, pod=pod, pod_status=pod_status)
    if request.form.get("confirm_nonce") != row.nonce:
        flash("The sandbox changed since you confirmed; review it again.", "error")
        return redirect(url_for("sandboxes.release", sandbox_id=sandbox_id))
    try:
        operator.release_by_operator(root().provider(actor()), sandbox_id)
    except (SandmanError, RuntimeError, OSError) as exc:
        flash(f"Release failed: {type(exc).__name__}: {exc}", "error")
    else:
        flash(f"Release of {row.pod_name} done (see its history).", "ok")
    return redirect(url_for("sandboxes.detail", sandbox_id=sandbox_id))
