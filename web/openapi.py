"""The hand-written OpenAPI 3.1 description of the JSON API (validated in tests).

Kept next to the serializers it describes (``web.serialize``); a field added there must be
added here, or the conformance test fails.
"""

from __future__ import annotations

from typing import Any

from broker import __version__, names
from broker.names import LeakKind


def _n(kind: str, **extra: Any) -> dict[str, Any]:
    """A nullable scalar."""
    return {"type": [kind, "null"], **extra}


_S, _I, _F, _B = "string", "integer", "number", "boolean"
_TIME = {"type": "string", "format": "date-time"}
_NTIME = {"type": ["string", "null"], "format": "date-time"}
_COUNTS = {"type": "object", "additionalProperties": {"type": "integer"}}
STATES = ["requested", "creating", "ready", "releasing", "deleted", "failed", "abandoned"]


def _obj(props: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": props,
        "required": list(props) if required is None else required,
    }


def _closed(props: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    """A request body whose unknown keys the server refuses (400), so the schema says so."""
    return {**_obj(props, required), "additionalProperties": False}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


SANDBOX = _obj(
    {
        "id": {"type": _S}, "job": {"type": _S}, "installation": {"type": _S},
        "request_id": _n(_S), "nonce": {"type": _S}, "pod_name": {"type": _S},
        "namespace": {"type": _S}, "backend": {"type": _S}, "image": {"type": _S},
        "image_digest": _n(_S), "image_resolved": _n(_S), "image_pulled": _n(_B),
        "base_commit": _n(_S), "cpu_m": {"type": _I},
        "memory_b": {"type": _I}, "role": {"type": _S, "enum": ["rollout", "grading"]},
        "state": {"type": _S, "enum": STATES}, "pool_key": _n(_S), "owner": _n(_S),
        "pod_ip": _n(_S), "node_name": _n(_S), "address": _n(_S),
        "reuse_count": {"type": _I}, "create_attempts": {"type": _I},
        "delete_attempts": {"type": _I}, "lease_expires_at": _NTIME, "requested_at": _TIME,
        "creating_at": _NTIME, "ready_at": _NTIME, "acquired_at": _NTIME,
        "last_used_at": _NTIME, "releasing_at": _NTIME, "deleted_at": _NTIME,
        "failed_at": _NTIME, "abandoned_at": _NTIME, "enqueued_at": _NTIME,
        "acquire_latency_s": _n(_F), "create_to_ready_s": _n(_F), "image_pull_s": _n(_F),
        "start_s": _n(_F), "last_error": _n(_S), "egress_denied": {"type": _B},
        "egress_enforced": _n(_B), "readiness_simulated": {"type": _B}, "tenant": _n(_S),
    }
)  # fmt: skip
EVENT = _obj(
    {
        "id": {"type": _I}, "at": _TIME, "sandbox_id": _n(_S), "job": _n(_S),
        "pod_name": _n(_S), "nonce": _n(_S), "kind": {"type": _S}, "action": {"type": _S},
        "from_state": _n(_S), "to_state": _n(_S), "outcome": _n(_S), "actor": {"type": _S},
        "detail": {"type": "object"},
    }
)  # fmt: skip
LEAK = _obj(
    {
        "id": {"type": _I}, "kind": {"type": _S}, "namespace": _n(_S), "pod_name": _n(_S),
        "sandbox_id": _n(_S), "nonce": _n(_S), "job": _n(_S), "detected_at": _TIME,
        "resolved_at": _NTIME, "resolution": _n(_S), "resolved_by": _n(_S),
        "detail": {"type": "object"},
    }
)  # fmt: skip
POD = {
    **_obj(
        {
            "name": {"type": _S}, "namespace": {"type": _S},
            "labels": {"type": "object", "additionalProperties": {"type": "string"}},
            "phase": {"type": _S}, "ready": {"type": _B}, "ip": _n(_S), "node": _n(_S),
            "address": _n(_S), "deleting": {"type": _B}, "created_at": _NTIME,
            "reason": _n(_S),
        }
    ),
    "type": ["object", "null"],
}  # fmt: skip
OVERVIEW = _obj(
    {
        "live_total": {"type": _I}, "live_by_state": _COUNTS,
        "live_by_job": {"type": "object", "additionalProperties": _COUNTS},
        "creates_per_s_1m": {"type": _F}, "creates_per_s_10m": {"type": _F},
        "queue_depth": {"type": "object", "additionalProperties": _n(_I)},
        "warm_hits_1h": {"type": _I}, "acquires_1h": {"type": _I},
        "warm_hit_rate": _n(_F), "leaks_open": _COUNTS, "leaks_open_total": {"type": _I},
    }
)  # fmt: skip
TENANT_NAME = names.TENANT_NAME_PATTERN
TENANT = _obj(
    {
        "name": {"type": _S}, "max_live": _n(_I), "creates_per_minute": _n(_I),
        "snapshot_bytes": _n(_I), "jobs": {"type": "array", "items": {"type": _S}},
        "live": {"type": _I}, "creates_last_minute": {"type": _I},
        "snapshot_bytes_held": {"type": _I},
    }
)  # fmt: skip
_QUOTA = {
    "type": ["integer", "null"],
    "minimum": 0,
    "maximum": names.TENANT_MAX_QUOTA,
    "description": "null: no limit",
}
_QUOTA_BYTES = {**_QUOTA, "maximum": names.TENANT_MAX_QUOTA_BYTES}
_QUOTAS = {"max_live": _QUOTA, "creates_per_minute": _QUOTA, "snapshot_bytes": _QUOTA_BYTES}
POOL = _obj(
    {
        "key": _n(_S), "image": _n(_S), "size": _n(_I), "idle_timeout_s": _n(_F),
        "cpu_m": _n(_I), "memory_b": _n(_I), "warm_now": _n(_I), "error": _n(_S),
    }
)  # fmt: skip
JOB = _obj(
    {
        "name": {"type": _S}, "tenant": _n(_S), "create_rate": _n(_F), "create_burst": _n(_I),
        "max_live": _n(_I), "max_concurrent_creates": _n(_I),
        "readiness_budget_s": {"type": _F}, "idle_timeout_s": _n(_F),
        "lease_s": {"type": _F}, "egress": {"type": _S}, "reuse": {"type": _B},
        "max_reuses": {"type": _I}, "live": _COUNTS, "live_total": {"type": _I},
        "pools": {"type": "array", "items": _ref("Pool")},
    }
)  # fmt: skip
PACING = _obj(
    {
        "create_rate": {"type": _F}, "create_burst": {"type": _I},
        "max_concurrent_creates": {"type": _I}, "readiness_budget_s": {"type": _F},
        "lease_s": {"type": _F}, "idle_timeout_s": {"type": _F}, "gc_interval_s": {"type": _F},
        "tokens": _n(_F), "in_flight": _n(_F),
    }
)  # fmt: skip
ERROR = _obj({"error": _obj({"code": {"type": _S}, "message": {"type": _S}})})


def _json(schema: dict[str, Any], description: str = "OK") -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


_ERRORS = {
    "400": _json(_ref("Error"), "Bad request"),
    "401": _json(_ref("Error"), "Not logged in"),
    "414": {"description": "URI too long (refused by the HTTP server before the app)"},
}


def _admin_post(
    summary: str,
    body: dict[str, Any],
    ok: dict[str, Any],
    ok_status: str,
    params: list[dict[str, Any]] | None = None,
    *,
    conflict: str | None = None,
) -> dict[str, Any]:
    """An admin-only POST with a JSON body (viewer or failed CSRF: 403; unknown name: 404;
    ``conflict``: what a 409 means, when the operation has one)."""
    extra = {"409": _json(_ref("Error"), conflict)} if conflict else {}
    return {
        "summary": summary,
        "parameters": params or [],
        "requestBody": {"required": True, "content": {"application/json": {"schema": body}}},
        "responses": {
            ok_status: ok,
            **_ERRORS,
            "403": _json(_ref("Error"), "Viewer role or failed CSRF check"),
            "404": _json(_ref("Error"), "No such tenant or job"),
            **extra,
        },
    }


def _param(name: str, schema: dict[str, Any], where: str = "query", **kw: Any) -> dict[str, Any]:
    return {"name": name, "in": where, "schema": schema, **kw}


def _get(
    summary: str,
    ok: dict[str, Any],
    params: list[dict[str, Any]] | None = None,
    *,
    errors: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "get": {
            "summary": summary,
            "parameters": params or [],
            "responses": {"200": _json(ok), **_ERRORS, **(errors or {})},
        }
    }


def spec() -> dict[str, Any]:
    text = {"type": "string", "maxLength": 253}
    paths = {
        "/api/overview": _get(
            "Live counts, create rate, queues, warm hit rate, open leaks", _ref("Overview")
        ),
        "/api/sandboxes": _get(
            "Sandboxes, filtered, sorted, keyset-paginated",
            _obj(
                {
                    "items": {"type": "array", "items": _ref("Sandbox")},
                    "total": {"type": _I},
                    "total_capped": {"type": _B},
                    "next_cursor": _n(_S),
                    "prev_cursor": _n(_S),
                }
            ),
            [
                _param("state", {"type": _S, "enum": ["", "live", *STATES]}),
                _param("job", {"type": _S, "maxLength": 63}),
                _param("role", {"type": _S, "enum": ["", "rollout", "grading"]}),
                _param("q", text, description="exact id, pod name, nonce or request id"),
                _param(
                    "sort", {"type": _S, "enum": ["requested_at", "job", "state", "pod_name", "id"]}
                ),
                _param("order", {"type": _S, "enum": ["asc", "desc"]}),
                _param(
                    "cursor",
                    {"type": _S, "maxLength": 512},
                    description="opaque, from next_cursor/prev_cursor; "
                    "an unreadable one restarts at the first page",
                ),
                _param("limit", {"type": _I, "minimum": 1, "maximum": 200}),
            ],
        ),
        "/api/sandboxes/{sandbox_id}": _get(
            "One sandbox: ledger row, live pod read-back, event history",
            _obj(
                {
                    "sandbox": _ref("Sandbox"),
                    "pod": _ref("Pod"),
                    "pod_status": {"type": _S},
                    "events": {"type": "array", "items": _ref("Event")},
                    "events_truncated": {"type": _B},
                    "leaks": {"type": "array", "items": _ref("Leak")},
                }
            ),
            [_param("sandbox_id", {"type": _S}, "path", required=True)],
            errors={"404": _json(_ref("Error"), "No such sandbox")},
        ),
        "/api/leaks": _get(
            "Leaks, newest first",
            _obj({"items": {"type": "array", "items": _ref("Leak")}, "next_before": _n(_I)}),
            [
                _param("status", {"type": _S, "enum": ["open", "resolved", "all"]}),
                _param("kind", {"type": _S, "enum": ["", *(k.value for k in LeakKind)]}),
                _param("before", {"type": _I, "minimum": 1, "maximum": 2**63 - 1}),
            ],
        ),
        "/api/leaks/{leak_id}/{action}": {
            "post": {
                "summary": "Delete, adopt or dismiss a leak (admin; nonce-checked; audited)",
                "parameters": [
                    _param("leak_id", {"type": _I}, "path", required=True),
                    _param(
                        "action",
                        {"type": _S, "enum": ["delete", "adopt", "dismiss"]},
                        "path",
                        required=True,
                    ),
                ],
                "requestBody": {
                    "required": False,
                    "content": {
                        "application/json": {
                            "schema": {
                                "type": "object",
                                "properties": {
                                    "confirm_nonce": {
                                        "type": _S,
                                        "description": "the nonce you reviewed",
                                    }
                                },
                            }
                        }
                    },
                },
                "responses": {
                    "200": _json(_obj({"ok": {"type": _B}, "message": {"type": _S}})),
                    **_ERRORS,
                    "403": _json(_ref("Error"), "Viewer role or failed CSRF check"),
                    "404": _json(_ref("Error"), "No such leak or action"),
                    "409": _json(_ref("Error"), "Refused: not safe or not possible now"),
                },
            }
        },
        "/api/tenants": {
            **_get(
                "Tenants: quotas, jobs, current use",
                _obj({"tenants": {"type": "array", "items": _ref("Tenant")}}),
            ),
            "post": _admin_post(
                "Create a tenant (admin; audited)",
                _closed(
                    {
                        "name": {"type": _S, "pattern": TENANT_NAME},
                        **_QUOTAS,
                    },
                    ["name"],
                ),
                _json(_ref("Tenant"), "Created"),
                "201",
                conflict="A tenant of that name exists (change it with POST /api/tenants/{name})",
            ),
        },
        "/api/tenants/{name}": {
            "post": _admin_post(
                "Change a tenant's quotas: the keys given, null for no limit (admin; audited)",
                {
                    **_closed(_QUOTAS, []),
                    "minProperties": 1,
                },
                _json(_ref("Tenant")),
                "200",
                [_param("name", {"type": _S}, "path", required=True)],
            )
        },
        "/api/jobs/{job}/tenant": {
            "post": _admin_post(
                "Move a job to a tenant, or to none with null (admin; audited)",
                _closed({"tenant": {"type": [_S, "null"], "pattern": TENANT_NAME}}, ["tenant"]),
                _json(_obj({"ok": {"type": _B}})),
                "200",
                [_param("job", {"type": _S}, "path", required=True)],
            )
        },
        "/api/jobs": _get(
            "Jobs: pacing, caps, pools and current usage",
            _obj({"pacing": _ref("Pacing"), "jobs": {"type": "array", "items": _ref("Job")}}),
        ),
        "/api/events": _get(
            "Search the audit log, newest first",
            _obj({"items": {"type": "array", "items": _ref("Event")}, "next_before": _n(_I)}),
            [
                _param("sandbox", {"type": _S, "maxLength": 32}),
                _param("pod", text),
                _param("nonce", {"type": _S, "maxLength": 64}),
                _param("job", {"type": _S, "maxLength": 63}),
                _param(
                    "kind",
                    {"type": _S, "enum": ["", "transition", "api", "gc", "pool", "reuse", "admin"]},
                ),
                _param("actor", {"type": _S, "maxLength": 128}),
                _param("since", {"type": _S, "format": "date-time", "maxLength": 64}),
                _param("until", {"type": _S, "format": "date-time", "maxLength": 64}),
                _param("before", {"type": _I, "minimum": 1, "maximum": 2**63 - 1}),
                _param("limit", {"type": _I, "minimum": 1, "maximum": 500}),
            ],
        ),
    }
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "Sandman broker admin API",
            "version": __version__,
            "description": "What the broker is doing to the cluster, and leak actions. "
            "Prometheus metrics are at /metrics (text format).",
        },
        "servers": [{"url": "/"}],
        "security": [{"bearerAuth": []}, {"cookieAuth": []}],
        "paths": paths,
        "components": {
            "securitySchemes": {
                "bearerAuth": {"type": "http", "scheme": "bearer"},
                "cookieAuth": {"type": "apiKey", "in": "cookie", "name": "sandman_session"},
            },
            "schemas": {
                "Sandbox": SANDBOX,
                "Event": EVENT,
                "Leak": LEAK,
                "Pod": POD,
                "Overview": OVERVIEW,
                "Job": JOB,
                "Tenant": TENANT,
                "Pool": POOL,
                "Pacing": PACING,
                "Error": ERROR,
            },
        },
    }
