"""``sandman web``: serve the admin UI with gunicorn; ``sandman web token``: access tokens.

The UI runs as its own process (``gunicorn web.wsgi:app``) so ``broker`` never imports
``web``. Token files live in ``state_dir/secrets`` (0600), next to the broker key; the UI
reads the same paths (see ``web.security``).
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import sys
from pathlib import Path

import click

from broker.cli.common import settings_of
from broker.settings import Settings

TOKEN_FILES = {"admin": "web-admin.token", "viewer": "web-viewer.token"}


def token_file(settings: Settings, role: str, *, create: bool) -> tuple[Path, str]:
    """Read (or create, 0600, race-safe) the token file for ``role``."""
    path = Path(settings.state_dir) / "secrets" / TOKEN_FILES[role]
    if not path.exists() and create:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            pass
        else:
            with os.fdopen(fd, "w") as fh:
                fh.write(secrets.token_urlsafe(32))
    return path, path.read_text().strip() if path.exists() else ""


def gunicorn_argv(bind: str, workers: int) -> list[str]:
    return [
        sys.executable, "-m", "gunicorn",
        "--bind", bind,
        "--workers", str(workers),
        "--threads", "4",
        "--timeout", "60",
        "--limit-request-line", "8190",  # long filter URLs get the app's 400, not a 414
        "--access-logfile", "-",
        "web.wsgi:app",
    ]  # fmt: skip


def register(group: click.Group) -> None:
    """Attach ``sandman web`` to the ``sandman`` group."""

    @group.group("web", invoke_without_command=True)
    @click.option("--host", default=None, help="Bind address (default SANDMAN_WEB_HOST).")
    @click.option("--port", type=int, default=None, help="Port (default SANDMAN_WEB_PORT).")
    @click.option("--workers", "-w", default=2, show_default=True)
    @click.pass_context
    def web(ctx: click.Context, host: str | None, port: int | None, workers: int) -> None:
        """Serve the admin UI and its JSON API with gunicorn (foreground)."""
        if ctx.invoked_subcommand is not None:
            return
        from broker.ledger.migrate import upgrade
        from broker.local.services import ensure_services
        from broker.local.stack import child_env

        settings = settings_of(ctx)
        settings = dataclasses.replace(
            settings, web_host=host or settings.web_host, web_port=port or settings.web_port
        )
        urls = ensure_services(settings)
        upgrade(urls.database_url)
        env = child_env(settings, urls.database_url, urls.redis_url)
        env.update(SANDMAN_WEB_HOST=settings.web_host, SANDMAN_WEB_PORT=str(settings.web_port))
        if not (settings.admin_token or settings.admin_password):
            path, _ = token_file(settings, "admin", create=True)
            click.echo(f"admin token: in {path} (or `sandman web token`)", err=True)
        click.echo(f"admin UI on http://{settings.web_host}:{settings.web_port}/", err=True)
        bind = f"{settings.web_host}:{settings.web_port}"
        os.execve(sys.executable, gunicorn_argv(bind, workers), env)  # noqa: S606

    @web.command("token")
    @click.option("--role", type=click.Choice(["admin", "viewer"]), default="admin")
    @click.pass_context
    def token(ctx: click.Context, role: str) -> None:
        """Print the generated token for ROLE (creating it if needed)."""
        settings = settings_of(ctx)
        if role == "admin" and (settings.admin_token or settings.admin_password):
            click.echo("SANDMAN_ADMIN_TOKEN/PASSWORD is set: use that to log in", err=True)
            sys.exit(1)
        if role == "viewer" and str(getattr(settings, "viewer_token", None) or ""):
            click.echo("SANDMAN_VIEWER_TOKEN is set: use that", err=True)
            sys.exit(1)
        path, value = token_file(settings, role, create=True)
        click.echo(value)
        click.echo(f"({role} token kept in {path})", err=True)
