"""The app factory: one blueprint per area, its parts taken from the composition root.

Why a factory: tests, ``sandman web`` and gunicorn each build their own app from their
own ``Settings``; nothing here reads the environment or connects at import time. Heavy
collaborators (Redis, the pod backend) are created by the root on first use, so the UI
still serves the ledger when Redis or the cluster is unreachable.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from flask import Flask

from broker.acquire.root import WEB, Root
from broker.settings import Settings
from web import security

log = logging.getLogger(__name__)


def create_app(settings: Settings, root: Root | None = None) -> Flask:
    """Build the admin app over ``root`` (default: a read-only one from ``settings``).

    The web builds no backend and starts no service: every part comes from the root,
    which finds the service URLs in the settings or in the file ``sandman services up``
    records, and reports a missing service as unavailable."""
    app = Flask(__name__)
    app.extensions["sandman"] = root if root is not None else Root(settings, WEB, actor="web")
    app.config.update(
        SECRET_KEY=security.session_key(settings),
        SESSION_COOKIE_NAME="sandman_session",
        SESSION_COOKIE_HTTPONLY=True,
        SESSION_COOKIE_SAMESITE="Lax",
        SESSION_COOKIE_SECURE=bool(getattr(settings, "web_cookie_secure", False)),
        PERMANENT_SESSION_LIFETIME=12 * 3600,
        MAX_CONTENT_LENGTH=64 * 1024,
        JSON_SORT_KEYS=False,
    )
    app.config["SANDMAN_INSTALLATION"] = settings.installation_id
    security.init_app(app, settings)
    _error_pages(app)

    from web.views import api, audit, auth, jobs, leaks, metrics, overview, sandboxes

    for module in (auth, overview, sandboxes, leaks, jobs, audit, api, metrics):
        app.register_blueprint(module.bp)

    from web import filters

    filters.register(app)

    return app


def _error_pages(app: Flask) -> None:
    """JSON errors under /api and /metrics, a plain page elsewhere; never a traceback."""
    from flask import render_template, request
    from werkzeug.exceptions import HTTPException, InternalServerError

    @app.errorhandler(HTTPException)
    def _http(exc: HTTPException) -> Any:
        code = exc.code or 500
        if request.path.startswith("/api/") or request.path == "/metrics":
            name = (exc.name or "error").lower().replace(" ", "_")
            response = exc.get_response()  # keeps headers such as Allow on a 405
            response.set_data(
                json.dumps({"error": {"code": name, "message": exc.description or ""}})
            )
            response.mimetype = "application/json"
            return response
        return render_template(
            "error.html", code=code, name=exc.name, message=exc.description
        ), code

    @app.errorhandler(Exception)
    def _crash(exc: Exception) -> Any:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return _http(InternalServerError())
