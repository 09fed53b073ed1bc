"""Strict query parameters: what the OpenAPI description promises is what is accepted.

Out-of-range or over-long values are refused with 400 instead of being clamped or cut,
so a client learns about its mistake and a fuzzer (schemathesis) finds no silent
acceptance. Empty strings mean "no filter", as HTML filter forms send them.
"""

from __future__ import annotations

from typing import Any

MAX_BIGINT = 2**63 - 1


class ParamError(ValueError):
    """A query parameter the API cannot use (answered with HTTP 400)."""


def text(args: Any, name: str, max_len: int, default: str = "") -> str:
    value = args.get(name)
    if value is None:
        return default
    if len(value) > max_len:
        raise ParamError(f"{name} is longer than {max_len} characters")
    # No stored id, name or nonce can contain NUL (PostgreSQL text cannot), nor U+FFFD:
    # the substitute makes the filter match nothing instead of failing in the driver.
    return str(value).replace("\x00", "\ufffd").strip()


def timestamp(args: Any, name: str) -> str | None:
    """A date-time parameter: absent is None; present must be non-empty (parsed later)."""
    value = args.get(name)
    if value is None:
        return None
    if not value.strip() or len(value) > 64:
        raise ParamError(f"{name} must be an ISO 8601 date-time")
    return str(value)


def integer(args: Any, name: str, lo: int, hi: int, default: int | None = None) -> int | None:
    raw = args.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError as exc:
        raise ParamError(f"{name} must be an integer") from exc
    if not lo <= value <= hi:
        raise ParamError(f"{name} must be between {lo} and {hi}")
    return value


def choice(args: Any, name: str, allowed: tuple[str, ...], default: str) -> str:
    value = args.get(name)
    if value is None:
        return default
    if value not in allowed:
        raise ParamError(f"{name} must be one of {', '.join(a or '(empty)' for a in allowed)}")
    return str(value)
