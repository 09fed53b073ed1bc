"""The worker side of ``sandman.snapshot``: run the op, answer in the request's mailbox.

Ops: ``capture`` (optionally releasing the sandbox after: pause), ``restore`` (a failed
restore releases the sandbox it went into: a half-restored sandbox is never handed on),
``describe``. A capture whose trainer gave up before the answer is removed again, so a
redelivered or late capture never leaves a snapshot nobody knows of.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from broker.acquire.service import error_payload, typed_errors
from broker.errors import InvalidRequest, SandmanError
from broker.wire import mailbox

if TYPE_CHECKING:
    from broker.acquire.service import Broker

log = logging.getLogger(__name__)


def snapshot_and_deliver(broker: Broker, message: Mapping[str, Any]) -> dict[str, Any]:
    rid = str(message.get("request_id") or "")
    op = message.get("op")
    payload: dict[str, Any]
    try:
        with typed_errors():
            payload = _run(broker, op, message)
    except Exception as exc:
        if not isinstance(exc, SandmanError):
            log.exception("snapshot %s %s failed unexpectedly", op, rid)
        if op == "restore" and message.get("sandbox_id") and not _foreign(exc):
            broker.release(str(message["sandbox_id"]), "restore-failed")
        payload = error_payload(exc, rid)
    delivered = mailbox.deliver(broker.redis, rid, payload)
    if not delivered and op == "capture" and "snapshot" in payload:
        broker.snapshots.remove(payload["snapshot"]["id"])  # nobody will ever learn of it
    return {k: v for k, v in payload.items() if k != "restored"}


def _foreign(exc: BaseException) -> bool:
    """A refusal to touch another trainer's sandbox releases nothing either."""
    return isinstance(exc, InvalidRequest) and "held by another trainer" in str(exc)


def _run(broker: Broker, op: Any, message: Mapping[str, Any]) -> dict[str, Any]:
    service = broker.snapshots
    if op == "describe":
        return {"snapshot": service.describe(str(message["snapshot_id"]))}
    sandbox_id = str(message.get("sandbox_id") or "")
    if not sandbox_id:
        raise InvalidRequest("sandbox_id is required", field="sandbox_id")
    owner = message.get("owner")
    if op == "capture":
        snap = service.capture(
            sandbox_id, paths=message.get("paths"), ttl_s=message.get("ttl_s"), owner=owner
        )
        if message.get("release"):
            broker.release(sandbox_id, "paused")
        return {"snapshot": snap}
    if op == "restore":
        done = service.restore(sandbox_id, str(message["snapshot_id"]), owner=owner)
        return {"snapshot": done["snapshot"], "written": done["written"]}
    raise InvalidRequest(f"unknown snapshot op {op!r}", field="op")
