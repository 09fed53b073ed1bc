"""Leaks: what broke the ownership invariant, and the operator's delete / adopt / dismiss."""

from __future__ import annotations

from typing import Any, NamedTuple

from flask import Blueprint, abort, flash, redirect, render_template, request, url_for
from sqlalchemy import select

from broker.errors import SandmanError
from broker.ledger.models import Leak
from broker.names import LeakKind
from broker.ownership import leaks as leakops
from web import params, stats
from web.views import actor, live_args, root, wants_fragment

bp = Blueprint("leaks", __name__, url_prefix="/leaks")
PAGE = 100


class LeakFilter(NamedTuple):
    """The leak list's filters, read the same way by the page and the JSON API."""

    status: str
    kind: str
    before: int | None

    @classmethod
    def from_args(cls, args: Any) -> LeakFilter:
        """Raises ``params.ParamError`` (HTTP 400) on a value the list cannot use."""
        return cls(
            params.choice(args, "status", ("open", "resolved", "all"), "open"),
            params.choice(args, "kind", ("", *LeakKind), ""),
            params.integer(args, "before", 1, params.MAX_BIGINT),
        )


def query_leaks(session: Any, status: str, kind: str, before: int | None) -> list[Leak]:
    stmt = select(Leak)
    if status == "open":
        stmt = stmt.where(Leak.resolved_at.is_(None))
    elif status == "resolved":
        stmt = stmt.where(Leak.resolved_at.is_not(None))
    if kind:
        stmt = stmt.where(Leak.kind == kind)
    if before:
        stmt = stmt.where(Leak.id < before)
    return list(session.scalars(stmt.order_by(Leak.id.desc()).limit(PAGE + 1)))


@bp.route("")
def index() -> Any:
    try:
        status, kind, before = LeakFilter.from_args(request.args)
    except params.ParamError as exc:
        abort(400, str(exc))
    parts = root()
    with parts.sessions() as session:
        leaks = query_leaks(session, status, kind, before)
        kinds = {k for (k,) in session.execute(select(Leak.kind).group_by(Leak.kind))}
        open_count = stats.leaks_open(session)
    more = len(leaks) > PAGE
    leaks = leaks[:PAGE]
    context = {
        "leaks": leaks,
        "status": status,
        "kind": kind,
        "kinds": sorted(kinds),
        "open_count": open_count,
        "next_before": leaks[-1].id if more and leaks else None,
        "gc_last": stats.gc_last(parts.redis()),
        "live_url": url_for("leaks.index", **live_args(request.args)),
    }
    if wants_fragment():
        return render_template("partials/leaks_table.html", **context)
    return render_template("leaks.html", **context)


@bp.route("/<int:leak_id>")
def detail(leak_id: int) -> Any:
    try:
        view = leakops.load(root(), leak_id)
    except LookupError:
        abort(404, f"no leak {leak_id}")
    action = request.args.get("action", "")
    return render_template("leak.html", v=view, action=action, nonce=leakops._expected_nonce(view))


@bp.route("/<int:leak_id>/<action>", methods=["POST"])
def act(leak_id: int, action: str) -> Any:
    if action not in leakops.ACTIONS:
        abort(404)
    if action != "dismiss" and request.form.get("confirmed") != "yes":
        flash("Tick the confirmation box first.", "error")
        return redirect(url_for("leaks.detail", leak_id=leak_id, action=action))
    try:
        message = leakops.perform(
            root(),
            leak_id,
            action,
            actor=actor(),
            confirm_nonce=request.form.get("confirm_nonce", ""),
        )
    except LookupError:
        abort(404, f"no leak {leak_id}")
    except (leakops.ActionRefused, RuntimeError) as exc:
        flash(f"{action.capitalize()} refused: {exc}", "error")
        return redirect(url_for("leaks.detail", leak_id=leak_id))
    flash(message, "ok")
    return redirect(url_for("leaks.index"))


def run_gc_pass(who: str, dry_run: bool) -> dict[str, Any]:
    """One GC pass as an operator, audited; its summary is kept for the page and /metrics."""
    return root().gc.run_and_publish(actor=who, dry_run=dry_run, audit=True).summary


@bp.route("/gc", methods=["POST"])
def gc() -> Any:
    dry_run = request.form.get("dry_run") == "yes"
    try:
        s = run_gc_pass(actor(), dry_run)
    except (SandmanError, RuntimeError, OSError) as exc:
        flash(f"GC pass failed: {type(exc).__name__}: {exc}", "error")
    else:
        if s["skipped_locked"]:
            flash("Another GC pass is running; this one was skipped.", "error")
        else:
            flash(
                f"GC pass{' (dry run)' if dry_run else ''}: {s['pods_seen']} pods, "
                f"{s['live_rows']} live rows, {s['actions']} actions, {s['unowned_pods']} unowned, "
                f"{s['errors']} errors in {s['duration_s']:.2f}s",
                "ok",
            )
    return redirect(url_for("leaks.index"))
