"""Request body parsing and field checks: bad input is always a 400, never a 500."""

from __future__ import annotations

import json
import math

from .errors import BadRequest

TYPE_CHECKING = False  # no typing at run time (see execd/__init__.py)
if TYPE_CHECKING:
    from typing import Any, Dict, Optional, Tuple

    # A parsed JSON object: request bodies and the answers built for them.
    Doc = Dict[str, Any]

_MISSING = object()
MAX_TIMEOUT_S = 7 * 24 * 3600.0  # the longest a command or a run may be given


def parse_json(body: bytes) -> Dict[str, Any]:
    if not body.strip():
        return {}
    try:
        doc = json.loads(body.decode("utf-8"))
    except UnicodeDecodeError:
        raise BadRequest("body is not valid UTF-8", "invalid_json") from None
    except (ValueError, RecursionError) as exc:
        raise BadRequest("body is not valid JSON: %s" % str(exc)[:200], "invalid_json") from None
    if not isinstance(doc, dict):
        raise BadRequest("body must be a JSON object", "invalid_json")
    return doc


BIG_BODY = 1 << 20
_SPACE = b" \t\r\n"


def split_big_string(body: bytes, name: str) -> Optional[Tuple[Dict[str, Any], memoryview]]:
    """Parse a large body without decoding its one huge string field.

    ``json.loads`` would hold the raw body, its decoded text and the field's
    value at once (four times a 100 MiB upload). When ``name`` is a top-level
    key whose value has no escapes, the rest of the document is parsed alone
    and the value is returned as a view into the body. Anything unusual
    returns None, and the caller parses normally.
    """
    if len(body) < BIG_BODY:
        return None
    key = b'"' + name.encode() + b'"'
    at = body.find(key)
    if at < 0 or body.find(key, at + 1) >= 0:
        return None
    i, n = at + len(key), len(body)
    while i < n and body[i] in _SPACE:
        i += 1
    if i >= n or body[i] != ord(":"):
        return None
    i += 1
    while i < n and body[i] in _SPACE:
        i += 1
    if i >= n or body[i] != ord('"'):
        return None
    start = i + 1
    end = body.find(b'"', start)
    if end < 0 or body.find(b"\\", start, end) >= 0:
        return None
    doc = parse_json(body[:start] + body[end:])
    if doc.get(name) != "":  # the key sat somewhere else than the top level
        return None
    return doc, memoryview(body)[start:end]


def _get(doc: Dict[str, Any], name: str, default: Any) -> Any:
    value = doc.get(name, _MISSING)
    if value is _MISSING or value is None:
        if default is _MISSING:
            raise BadRequest("missing field %r" % name, "missing_field")
        return default
    return value


def string(
    doc: Dict[str, Any], name: str, default: Any = _MISSING, nul_ok: bool = True, text: bool = True
) -> Any:
    value = _get(doc, name, default)
    if value is default and default is not _MISSING:
        return value
    if not isinstance(value, str):
        raise BadRequest("field %r must be a string" % name, "invalid_field")
    if text:
        try:  # JSON allows lone surrogates ("\\ud800"); they have no UTF-8 form
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise BadRequest("field %r is not valid Unicode text" % name, "invalid_field") from None
    if not nul_ok and "\0" in value:
        raise BadRequest("field %r must not contain NUL" % name, "invalid_field")
    return value


def integer(
    doc: Dict[str, Any], name: str, default: Any = _MISSING, lo: int = 0, hi: int = 2**62
) -> Any:
    value = _get(doc, name, default)
    if value is default and default is not _MISSING:
        return value
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest("field %r must be an integer" % name, "invalid_field")
    if not lo <= value <= hi:
        raise BadRequest("field %r must be between %d and %d" % (name, lo, hi), "invalid_field")
    return value


def number(doc: Dict[str, Any], name: str, default: float, lo: float, hi: float) -> float:
    value = _get(doc, name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadRequest("field %r must be a number" % name, "invalid_field")
    value = float(value)
    if math.isnan(value) or not lo < value <= hi:
        raise BadRequest("field %r must be > %g and <= %g" % (name, lo, hi), "invalid_field")
    return value


def abs_path(doc: Dict[str, Any], name: str = "path", default: Optional[str] = None) -> str:
    value: str = string(doc, name, default if default is not None else _MISSING, nul_ok=False)
    if not value.startswith("/"):
        raise BadRequest("field %r must be an absolute path" % name, "relative_path")
    return value
