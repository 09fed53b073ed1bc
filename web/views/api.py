"""The JSON API behind the pages; its contract is ``web.openapi`` (served at /api/openapi.json).

Same auth as the pages: a session cookie (CSRF token required on POST) or
``Authorization: Bearer <token>``. Errors are ``{"error": {"code", "message"}}``.
"""

from __future__ import annotations

from typing import Any

from flask import Blueprint, jsonify, request

from broker.acquire import quotas, weights
from broker.errors import InvalidRequest, TenantExists
from broker.ownership import leaks as leakops
from web import listing, params, serialize, stats
from web.openapi import spec
from web.views import actor, audit, jobs, root, sandboxes
from web.views.leaks import LeakFilter, query_leaks

bp = Blueprint("api", __name__, url_prefix="/api")


def error(status: int, code: str, message: str) -> Any:
    return jsonify({"error": {"code": code, "message": message}}), status


@bp.route("/openapi.json")
def openapi() -> Any:
    return jsonify(spec())


@bp.route("/overview")
def overview() -> Any:
    parts = root()
    with parts.sessions() as session:
        return jsonify(stats.overview(session, parts.redis()).to_dict())


@bp.route("/sandboxes")
def sandbox_list() -> Any:
    try:
        query = listing.ListQuery.from_args(request.args)
        with root().sessions() as session:
            page = listing.fetch(session, query)
    except listing.BadQuery as exc:
        return error(400, "bad_request", str(exc))
    return jsonify(
        {
            "items": [serialize.sandbox(r) for r in page.rows],
            "total": page.total,
            "total_capped": page.total_capped,
            "next_cursor": page.next_cursor,
            "prev_cursor": page.prev_cursor,
        }
    )


@bp.route("/sandboxes/<sandbox_id>")
def sandbox_detail(sandbox_id: str) -> Any:
    from broker.ledger.models import Sandbox

    with root().sessions() as session:
        if session.get(Sandbox, sandbox_id) is None:
            return error(404, "not_found", f"no sandbox {sandbox_id}")
    row, events, leaks, more = sandboxes.load(sandbox_id)
    pod, status = sandboxes.read_pod(row)
    return jsonify(
        {
            "sandbox": serialize.sandbox(row),
            "pod": serialize.pod(pod),
            "pod_status": status,
            "events": [serialize.event(e) for e in events],
            "events_truncated": more,
            "leaks": [serialize.leak(x) for x in leaks],
        }
    )


@bp.route("/leaks")
def leak_list() -> Any:
    try:
        status, kind, before = LeakFilter.from_args(request.args)
    except params.ParamError as exc:
        return error(400, "bad_request", str(exc))
    with root().sessions() as session:
        rows = query_leaks(session, status, kind, before)
    more = len(rows) > 100
    rows = rows[:100]
    return jsonify(
        {
            "items": [serialize.leak(r) for r in rows],
            "next_before": rows[-1].id if more and rows else None,
        }
    )


@bp.route("/leaks/<int:leak_id>/<action>", methods=["POST"])
def leak_action(leak_id: int, action: str) -> Any:
    if action not in leakops.ACTIONS:
        return error(404, "not_found", f"unknown action {action}")
    body = request.get_json(silent=True)
    if not isinstance(body, dict):
        body = {}
    nonce = body.get("confirm_nonce", "")
    if not isinstance(nonce, str):
        return error(400, "bad_request", "confirm_nonce must be a string")
    try:
        message = leakops.perform(root(), leak_id, action, actor=actor(), confirm_nonce=nonce)
    except LookupError:
        return error(404, "not_found", f"no leak {leak_id}")
    except (leakops.ActionRefused, RuntimeError) as exc:
        return error(409, "refused", str(exc))
    return jsonify({"ok": True, "message": message})


@bp.route("/jobs")
def job_list() -> Any:
    return jsonify({"pacing": jobs.global_pacing(), "jobs": [r.to_dict() for r in jobs.job_rows()]})


@bp.route("/events")
def event_list() -> Any:
    try:
        search = audit.Search.from_args(request.args)
    except audit.BadSearch as exc:
        return error(400, "bad_request", str(exc))
    with root().sessions() as session:
        events, next_before = audit.run(session, search)
    return jsonify({"items": [serialize.event(e) for e in events], "next_before": next_before})


def _body() -> dict[str, Any]:
    body = request.get_json(silent=True)
    return body if isinstance(body, dict) else {}


def _quota_call(fn: Any, *args: Any, status: int = 200) -> Any:
    """Run a quota change for the logged-in admin (the guard refused anyone else):
    unknown names are 404, bad values 400, and the answer is the tenant as it is now."""
    try:
        view = fn(root().sessions, *args, actor=actor())
        redis = root().redis()
        if redis is not None:  # the fair scheduler hears of a weight or tenant change now
            weights.sync(root().sessions, redis)
    except LookupError as exc:  # UnknownTenant, UnknownJob
        return error(404, "not_found", str(exc))
    except TenantExists as exc:
        return error(409, "conflict", str(exc))
    except InvalidRequest as exc:
        return error(400, "bad_request", str(exc))
    return jsonify(view.to_dict() if view is not None else {"ok": True}), status


@bp.route("/tenants")
def tenant_list() -> Any:
    return jsonify({"tenants": [v.to_dict() for v in quotas.listing(root().sessions)]})


@bp.route("/tenants", methods=["POST"])
def tenant_create() -> Any:
    body = _body()
    name = body.pop("name", "")
    if not isinstance(name, str):
        return error(400, "bad_request", "name must be a string")
    return _quota_call(quotas.create, name, body, status=201)


@bp.route("/tenants/<name>", methods=["POST"])
def tenant_set(name: str) -> Any:
    return _quota_call(quotas.update, name, _body())


@bp.route("/jobs/<job>/weight", methods=["POST"])
def job_weight(job: str) -> Any:
    body = _body()
    if set(body) != {"weight"}:
        return error(400, "bad_request", 'the body is {"weight": <number>}')
    return _quota_call(weights.set_job_weight, job, body["weight"])


@bp.route("/jobs/<job>/tenant", methods=["POST"])
def job_tenant(job: str) -> Any:
    tenant = _body().get("tenant")
    if tenant is not None and not isinstance(tenant, str):
        return error(400, "bad_request", "tenant must be a string or null")
    return _quota_call(quotas.assign_job, job, tenant)
