"""Error payloads on the wire: a worker-side typed error becomes the same type in the trainer.

Workers answer an acquire with ``{"error": {"code": ..., "message": ...}}``; the ``code`` is
the class attribute of the error in ``broker.errors``, so the trainer re-raises exactly the
class the worker raised (and an unknown code from a newer worker is still an
InfrastructureError, never a silent success).
"""

from __future__ import annotations

from typing import Any

from broker import errors
from broker.errors import SandmanError


def _error_classes() -> dict[str, type[SandmanError]]:
    out: dict[str, type[SandmanError]] = {}
    stack: list[type[SandmanError]] = [SandmanError]
    while stack:
        cls = stack.pop()
        out.setdefault(cls.code, cls)
        stack.extend(cls.__subclasses__())
    return out


# The details an error carries across the wire, and the type each must have: a value of
# another type (a newer or broken worker) is dropped, never trusted.
WIRE_DETAILS: dict[str, type | tuple[type, ...]] = {
    "field": str,
    "retry_after": (int, float),
    "tenant": str,
    "quota": str,
}


def payload_details(exc: SandmanError) -> dict[str, Any]:
    """The wire details ``exc`` has set (class defaults of None are not sent)."""
    return {
        name: getattr(exc, name) for name in WIRE_DETAILS if getattr(exc, name, None) is not None
    }


def raise_payload_error(payload: dict[str, Any]) -> None:
    """Re-raise a worker-side error as the same typed exception in the trainer, with the
    details its class declares (``InvalidRequest.field``, ``retry_after``...)."""
    error = payload.get("error") or {}
    cls = _error_classes().get(str(error.get("code")), errors.InfrastructureError)
    message = str(error.get("message") or error.get("code"))
    details = {
        name: error[name]
        for name, kind in WIRE_DETAILS.items()
        if hasattr(cls, name)
        and isinstance(error.get(name), kind)
        and not isinstance(error.get(name), bool)
    }
    raise cls(message, **details)
