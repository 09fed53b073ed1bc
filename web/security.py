"""Who may do what: admin and viewer credentials, sessions, CSRF, and the request guard.

Credentials (compared in constant time, never logged):
  admin   SANDMAN_ADMIN_TOKEN or SANDMAN_ADMIN_PASSWORD; when neither is set, a random
          token generated once into ``state_dir/secrets/web-admin.token`` (0600).
  viewer  ``settings.viewer_token`` when that field exists, else the token in
          ``state_dir/secrets/web-viewer.token`` if that file exists (``sandman web token
          --role viewer`` creates it). Viewers read everything and change nothing.

Browsers log in with a form and get a signed session cookie (HttpOnly, SameSite=Lax,
Secure when ``web_cookie_secure``). The session remembers a fingerprint of the
credential it was granted by, so rotating a token logs out every session made with it.
Every state-changing request made with a cookie must carry the session's CSRF token
(form field ``csrf_token`` or header ``X-CSRF-Token``); API clients that send
``Authorization: Bearer <token>`` are not exposed to CSRF and skip that check.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flask import Flask, abort, g, jsonify, redirect, request, session, url_for

from broker.settings import Settings

ROLES = ("admin", "viewer")
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
PUBLIC_ENDPOINTS = frozenset({"auth.login", "auth.logout", "static", "auth.healthz", "api.openapi"})
_NAME_RE = re.compile(r"[^A-Za-z0-9._@-]+")


def _secret_file(settings: Settings, name: str, *, create: bool) -> str:
    """Read (or create, 0600, race-safe) a random secret under ``state_dir/secrets``."""
    path = Path(settings.state_dir) / "secrets" / name
    if not path.exists():
        if not create:
            return ""
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            return path.read_text().strip()
        with os.fdopen(fd, "w") as fh:
            fh.write(secrets.token_urlsafe(32))
    return path.read_text().strip()


def admin_token_path(settings: Settings) -> Path:
    return Path(settings.state_dir) / "secrets" / "web-admin.token"


def viewer_token_path(settings: Settings) -> Path:
    return Path(settings.state_dir) / "secrets" / "web-viewer.token"


def session_key(settings: Settings) -> bytes:
    """Cookie signing key: derived from SANDMAN_SECRET_KEY (its own domain), else a file."""
    if settings.secret_key:
        return hmac.new(settings.secret_key.encode(), b"sandman-web-session", "sha256").digest()
    return _secret_file(settings, "web-session.key", create=True).encode()


@dataclass(frozen=True)
class Credential:
    role: str
    kind: str  # admin_token | admin_password | viewer_token
    value: str = ""

    def __repr__(self) -> str:  # never print the value
        return f"Credential({self.role}, {self.kind})"


def credentials(settings: Settings) -> list[Credential]:
    creds = []
    if settings.admin_token:
        creds.append(Credential("admin", "admin_token", settings.admin_token))
    if settings.admin_password:
        creds.append(Credential("admin", "admin_password", settings.admin_password))
    if not creds:
        creds.append(
            Credential(
                "admin", "admin_token", _secret_file(settings, "web-admin.token", create=True)
            )
        )
    viewer = str(getattr(settings, "viewer_token", "") or "") or _secret_file(
        settings, "web-viewer.token", create=False
    )
    if viewer:
        creds.append(Credential("viewer", "viewer_token", viewer))
    return creds


def match(creds: list[Credential], offered: str) -> Credential | None:
    """Constant-time check against every credential (no early exit on a match)."""
    found = None
    offered_b = offered.encode()
    for cred in creds:
        if hmac.compare_digest(offered_b, cred.value.encode()) and cred.value:
            found = found or cred
    return found


def fingerprint(key: bytes, cred: Credential) -> str:
    return hmac.new(key, f"{cred.kind}:{cred.value}".encode(), hashlib.sha256).hexdigest()[:32]


def clean_name(raw: str, default: str) -> str:
    name = _NAME_RE.sub("", raw or "")[:40]
    return name or default


def csrf_token() -> str:
    token = session.get("csrf")
    if not token:
        token = secrets.token_urlsafe(24)
        session["csrf"] = token
    return str(token)


def login(cred: Credential, key: bytes, name: str) -> None:
    session.clear()
    session.permanent = True
    session["role"] = cred.role
    session["cred"] = cred.kind
    session["fp"] = fingerprint(key, cred)
    session["name"] = clean_name(name, cred.role)
    session["csrf"] = secrets.token_urlsafe(24)


@dataclass(frozen=True)
class Principal:
    role: str
    actor: str  # what the audit trail records: "admin:alice", "viewer:api"
    via: str  # session | bearer

    @property
    def is_admin(self) -> bool:
        return self.role == "admin"


def _from_session(creds: list[Credential], key: bytes) -> Principal | None:
    kind, fp = session.get("cred"), session.get("fp")
    if not kind or not fp:
        return None
    for cred in creds:
        if cred.kind == kind and hmac.compare_digest(str(fp), fingerprint(key, cred)):
            return Principal(cred.role, f"{cred.role}:{session.get('name', cred.role)}", "session")
    return None


def _from_bearer(creds: list[Credential]) -> Principal | None:
    header = request.headers.get("Authorization", "")
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        return None
    cred = match(creds, value.strip())
    return Principal(cred.role, f"{cred.role}:api", "bearer") if cred else None


def _wants_json() -> bool:
    return request.path.startswith("/api/") or request.path == "/metrics"


def _deny(status: int, message: str) -> Any:
    codes = {401: "unauthorized", 403: "forbidden", 404: "not_found"}
    if _wants_json():
        return jsonify({"error": {"code": codes[status], "message": message}}), status
    if status == 401:
        return redirect(url_for("auth.login", next=request.full_path.rstrip("?")))
    abort(status, message)
    return None


def _nul_in_path() -> bool:
    """PostgreSQL text cannot hold NUL, so no row has one in its id: answer 404 up front
    (query parameters are handled in ``web.params``)."""
    values = [str(v) for v in (request.view_args or {}).values()]
    return "\x00" in request.path or any("\x00" in v for v in values)


def check_csrf() -> bool:
    expected = session.get("csrf")
    offered = request.form.get("csrf_token") or request.headers.get("X-CSRF-Token") or ""
    return bool(expected) and hmac.compare_digest(str(expected).encode(), offered.encode())


def _same_origin() -> bool:
    origin = request.headers.get("Origin")
    if not origin or origin == "null":
        return origin is None
    return origin.rstrip("/") == request.host_url.rstrip("/")


def init_app(app: Flask, settings: Settings) -> None:
    key = app.config["SECRET_KEY"]

    @app.before_request
    def _guard() -> Any:
        g.principal = None
        if _nul_in_path():
            return _deny(404, "not found")
        creds = credentials(settings)
        principal = _from_bearer(creds) or _from_session(creds, key)
        g.principal = principal
        cookie_auth = principal is None or principal.via == "session"
        unsafe = request.method not in SAFE_METHODS
        if unsafe and cookie_auth and not (check_csrf() and _same_origin()):
            return _deny(403, "CSRF check failed: reload the page and try again")
        if request.endpoint in PUBLIC_ENDPOINTS:
            return None
        if principal is None:
            return _deny(401, "log in first")
        if request.method not in SAFE_METHODS and not principal.is_admin:
            return _deny(403, "the viewer role is read-only")
        return None

    @app.after_request
    def _headers(response: Any) -> Any:
        response.headers.setdefault("X-Content-Type-Options", "nosniff")
        response.headers.setdefault("X-Frame-Options", "DENY")
        response.headers.setdefault("Referrer-Policy", "same-origin")
        response.headers.setdefault(
            "Content-Security-Policy",
            "default-src 'self'; img-src 'self' data:; style-src 'self'; "
            "script-src 'self'; frame-ancestors 'none'; form-action 'self'",
        )
        if request.endpoint != "static":
            response.headers.setdefault("Cache-Control", "no-store")
        return response

    @app.context_processor
    def _inject() -> dict[str, Any]:
        return {"principal": g.get("principal"), "csrf_token": csrf_token}
