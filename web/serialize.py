"""Ledger rows as JSON-safe dicts (the shapes the OpenAPI description promises)."""

from __future__ import annotations

import datetime as dt
from typing import Any

from broker.backends.base import PodInfo
from broker.ledger.models import Event, Leak, Sandbox

SANDBOX_FIELDS = (
    "id", "job", "installation", "request_id", "nonce", "pod_name", "namespace", "backend",
    "image", "image_digest", "image_resolved", "image_pulled", "base_commit", "cpu_m",
    "memory_b", "role", "state", "pool_key", "owner", "pod_ip", "node_name", "address",
    "reuse_count", "create_attempts",
    "delete_attempts", "lease_expires_at", "requested_at", "creating_at", "ready_at",
    "acquired_at", "last_used_at", "releasing_at", "deleted_at", "failed_at", "abandoned_at",
    "enqueued_at", "acquire_latency_s", "create_to_ready_s", "image_pull_s", "start_s",
    "last_error", "egress_denied", "egress_enforced", "readiness_simulated", "tenant",
)  # fmt: skip
EVENT_FIELDS = (
    "id", "at", "sandbox_id", "job", "pod_name", "nonce", "kind", "action", "from_state",
    "to_state", "outcome", "actor", "detail",
)  # fmt: skip
LEAK_FIELDS = (
    "id", "kind", "namespace", "pod_name", "sandbox_id", "nonce", "job", "detected_at",
    "resolved_at", "resolution", "resolved_by", "detail",
)  # fmt: skip


def _value(v: Any) -> Any:
    if isinstance(v, dt.datetime):
        return v.isoformat()
    if hasattr(v, "value") and isinstance(getattr(v, "value", None), str):
        return v.value
    return v


def _row(obj: Any, fields: tuple[str, ...]) -> dict[str, Any]:
    return {f: _value(getattr(obj, f)) for f in fields}


def sandbox(row: Sandbox) -> dict[str, Any]:
    return _row(row, SANDBOX_FIELDS)


def event(row: Event) -> dict[str, Any]:
    out = _row(row, EVENT_FIELDS)
    out["detail"] = dict(out["detail"] or {})
    return out


def leak(row: Leak) -> dict[str, Any]:
    out = _row(row, LEAK_FIELDS)
    out["detail"] = dict(out["detail"] or {})
    return out


def pod(info: PodInfo | None) -> dict[str, Any] | None:
    if info is None:
        return None
    return {
        "name": info.name,
        "namespace": info.namespace,
        "labels": dict(info.labels),
        "phase": info.phase,
        "ready": info.ready,
        "ip": info.ip,
        "node": info.node,
        "address": info.address,
        "deleting": info.deleting,
        "created_at": info.created_at.isoformat() if info.created_at else None,
        "reason": info.reason,
    }
