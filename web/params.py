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
    return str(value).strip()


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
