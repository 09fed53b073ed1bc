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


def raise_payload_error(payload: dict[str, Any]) -> None:
    """Re-raise a worker-side error as the same typed exception in the trainer."""
    error = payload.get("error") or {}
    cls = _error_classes().get(str(error.get("code")), errors.InfrastructureError)
    message = str(error.get("message") or error.get("code"))
    field = error.get("field")
    if issubclass(cls, errors.InvalidRequest) and isinstance(field, str):
        raise cls(message, field=field)
    raise cls(message)
