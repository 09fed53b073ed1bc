"""The ``sandman`` command. Settings are read here, at the entry point, and passed down.

The CLI lives in ``broker`` but starts workers and the web UI as separate processes
(``celery -A workers.app``, ``gunicorn web.wsgi``), so ``broker`` never imports them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from broker import __version__
from broker.settings import Settings

REPO_ROOT = Path(__file__).resolve().parent.parent


def _settings(ctx: click.Context) -> Settings:
    settings = ctx.obj
    assert isinstance(settings, Settings)
    return settings


@click.group()
@click.version_option(__version__, prog_name="sandman")
@click.pass_context
def main(ctx: click.Context) -> None:
    """Sandman broker: stateful sandboxes for agentic RL on shared Kubernetes."""
    ctx.obj = Settings.from_env()


@main.command("settings")
@click.pass_context
def show_settings(ctx: click.Context) -> None:
    """Print the effective settings (secrets redacted)."""
    click.echo(json.dumps(_settings(ctx).redacted(), indent=2))


@main.group()
def services() -> None:
    """Embedded PostgreSQL and Redis in the state directory."""


@services.command("up")
@click.option("--show-secrets", is_flag=True, help="Print URLs with their passwords.")
@click.pass_context
def services_up(ctx: click.Context, show_secrets: bool) -> None:
    """Start embedded PostgreSQL and Redis (idempotent) and print their URLs as env lines."""
    from broker.localservices import ensure_services
    from broker.settings import redact_url

    urls = ensure_services(_settings(ctx))
    shown = (lambda u: u) if show_secrets else redact_url
    click.echo(f"SANDMAN_DATABASE_URL={shown(urls.database_url)}")
    click.echo(f"SANDMAN_REDIS_URL={shown(urls.redis_url)}")


@services.command("down")
@click.pass_context
def services_down(ctx: click.Context) -> None:
    """Stop the embedded PostgreSQL and Redis."""
    from broker.localservices import stop_postgres, stop_redis

    stop_postgres(_settings(ctx))
    stop_redis(_settings(ctx))


@main.group()
def db() -> None:
    """Database schema (Alembic owns it)."""


def _database_url(settings: Settings) -> str:
    if settings.database_url:
        return settings.database_url
    from broker.localservices import ensure_postgres

    return ensure_postgres(settings)


@db.command("upgrade")
@click.argument("revision", default="head")
@click.pass_context
def db_upgrade(ctx: click.Context, revision: str) -> None:
    """Migrate the database to REVISION (default: head)."""
    from broker.migrate import upgrade

    upgrade(_database_url(_settings(ctx)), revision)
    click.echo(f"database at {revision}")


@db.command("check")
@click.pass_context
def db_check(ctx: click.Context) -> None:
    """Fail when the models and the migrations disagree (alembic check)."""
    from broker.migrate import check

    try:
        check(_database_url(_settings(ctx)))
    except Exception as exc:
        click.echo(f"schema drift: {exc}", err=True)
        sys.exit(1)
    click.echo("models and migrations agree")


def _register_subcommands() -> None:
    from broker import cli_run

    cli_run.register(main)


_register_subcommands()
