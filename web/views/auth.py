"""Log in and out. Failed attempts cost a short delay and are logged without the secret."""

from __future__ import annotations

import logging
import time
from typing import Any
from urllib.parse import urlsplit

from flask import Blueprint, current_app, jsonify, redirect, render_template, request, url_for

from web import security
from web.views import root

bp = Blueprint("auth", __name__)
log = logging.getLogger(__name__)


def _safe_next(target: str | None) -> str:
    """Only same-site relative paths: never an open redirect."""
    if not target:
        return url_for("overview.index")
    parts = urlsplit(target)
    if parts.scheme or parts.netloc or not target.startswith("/") or target.startswith("//"):
        return url_for("overview.index")
    return target


@bp.route("/login", methods=["GET", "POST"])
def login() -> Any:
    next_url = _safe_next(request.args.get("next"))
    if request.method == "GET":
        return render_template("login.html", next=next_url, error=None)
    creds = security.credentials(root().settings)
    cred = security.match(creds, request.form.get("secret", ""))
    if cred is None:
        log.warning("failed admin login from %s", request.remote_addr)
        time.sleep(0.3)
        return render_template("login.html", next=next_url, error="Wrong token or password."), 401
    security.login(cred, current_app.config["SECRET_KEY"], request.form.get("name", ""))
    log.info(
        "login: role=%s name=%s",
        cred.role,
        security.clean_name(request.form.get("name", ""), cred.role),
    )
    return redirect(next_url)


@bp.route("/logout", methods=["POST"])
def logout() -> Any:
    from flask import session

    session.clear()
    return redirect(url_for("auth.login"))


@bp.route("/healthz")
def healthz() -> Any:
    return jsonify({"ok": True})
