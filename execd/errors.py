"""Typed API errors: every refusal the daemon gives maps to one HTTP status.

Handlers raise these; the server turns them into
``{"error": {"code": ..., "message": ...}}``. Anything else escaping a handler
is a bug and becomes a 500, which is why bad input must always be caught as
one of these first.

    ExecdError (status 500, code "internal")
     +-- BadRequest      400  malformed JSON, missing or wrongly typed field
     +-- Unauthorized    401  missing or wrong bearer token
     +-- NotFound        404  unknown route, missing file
     +-- MethodNotAllowed 405
     +-- Conflict        409  edit refused: no match or several matches
     +-- LengthRequired  411  no Content-Length
     +-- PayloadTooLarge 413  body over --max-body-bytes
     +-- Unprocessable   422  file is not UTF-8 text or cannot round-trip
     +-- TooManyRequests 429  the bound of concurrent runs or named sessions is reached
     +-- Gone            410  the sandbox was reclaimed (idle): every call refused
     +-- Unavailable     503  no slot or no bash
"""

from __future__ import annotations

TYPE_CHECKING = False  # no typing at run time (see execd/__init__.py)
if TYPE_CHECKING:
    from typing import Optional, Type


class suppress:  # noqa: N801 (named as the contextlib function it stands in for)
    """``contextlib.suppress``: ``with suppress(OSError): ...`` ignores those exceptions.

    ``contextlib`` costs every sandbox 0.1 MiB at start for this one helper (nothing
    else execd imports at start needs it)."""

    def __init__(self, *exceptions: Type[BaseException]) -> None:
        self.exceptions = exceptions

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Optional[Type[BaseException]], *_: object) -> bool:
        return kind is not None and issubclass(kind, self.exceptions)


class ExecdError(Exception):
    status = 500
    code = "internal"

    def __init__(self, message: str, code: Optional[str] = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code


class BadRequest(ExecdError):
    status = 400
    code = "bad_request"


class Unauthorized(ExecdError):
    status = 401
    code = "unauthorized"


class Forbidden(ExecdError):
    status = 403
    code = "forbidden"


class NotFound(ExecdError):
    status = 404
    code = "not_found"


class MethodNotAllowed(ExecdError):
    status = 405
    code = "method_not_allowed"


class Conflict(ExecdError):
    status = 409
    code = "conflict"


class LengthRequired(ExecdError):
    status = 411
    code = "length_required"


class PayloadTooLarge(ExecdError):
    status = 413
    code = "payload_too_large"


class HeadersTooLarge(ExecdError):
    status = 431
    code = "headers_too_large"


class Unprocessable(ExecdError):
    status = 422
    code = "unprocessable"


class Unavailable(ExecdError):
    status = 503
    code = "unavailable"


class TooManyRequests(ExecdError):
    """A bound was reached: refused at once rather than queued, so callers never hang."""

    status = 429
    code = "busy"


class Gone(ExecdError):
    """The broker reclaimed this sandbox (idle past its job's timeout): every call from
    now on is refused, so a trainer learns at once instead of running on borrowed time."""

    status = 410
    code = "reclaimed"
