"""The ``sandman`` command. Settings are read here, at the entry point, and passed down.

The CLI lives in ``broker`` but starts workers and the web UI as separate processes
(``celery -A workers.app``, ``gunicorn web.wsgi``), so ``broker`` never imports them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TextIO

import click

from broker import __version__
from broker.cli.common import database_url, settings_of, tool_root
from broker.settings import Settings

REPO_ROOT = Path(__file__).resolve().parents[2]


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
    click.echo(json.dumps(settings_of(ctx).redacted(), indent=2))


@main.group()
def services() -> None:
    """Embedded PostgreSQL and Redis in the state directory."""


@services.command("up")
@click.option("--show-secrets", is_flag=True, help="Print URLs with their passwords.")
@click.pass_context
def services_up(ctx: click.Context, show_secrets: bool) -> None:
    """Start embedded PostgreSQL and Redis (idempotent) and print their URLs as env lines."""
    from broker.local.services import ensure_services
    from broker.settings import redact_url

    urls = ensure_services(settings_of(ctx))
    shown = (lambda u: u) if show_secrets else redact_url
    click.echo(f"SANDMAN_DATABASE_URL={shown(urls.database_url)}")
    click.echo(f"SANDMAN_REDIS_URL={shown(urls.redis_url)}")


@services.command("down")
@click.pass_context
def services_down(ctx: click.Context) -> None:
    """Stop the embedded PostgreSQL and Redis."""
    from broker.local.services import stop_postgres, stop_redis

    stop_postgres(settings_of(ctx))
    stop_redis(settings_of(ctx))


@services.command("serve")
@click.argument("service", type=click.Choice(["postgres", "redis"]))
@click.pass_context
def services_serve(ctx: click.Context, service: str) -> None:
    """Run one service in the foreground (for containers); credentials come from its URL."""
    from broker.local.services import serve_postgres, serve_redis

    (serve_postgres if service == "postgres" else serve_redis)(settings_of(ctx))


@main.group()
def db() -> None:
    """Database schema (Alembic owns it)."""


@db.command("upgrade")
@click.argument("revision", default="head")
@click.pass_context
def db_upgrade(ctx: click.Context, revision: str) -> None:
    """Migrate the database to REVISION (default: head)."""
    from broker.ledger.migrate import upgrade

    upgrade(database_url(settings_of(ctx)), revision)
    click.echo(f"database at {revision}")


@db.command("check")
@click.pass_context
def db_check(ctx: click.Context) -> None:
    """Fail when the models and the migrations disagree (alembic check)."""
    from broker.ledger.migrate import check

    try:
        check(database_url(settings_of(ctx)))
    except Exception as exc:
        click.echo(f"schema drift: {exc}", err=True)
        sys.exit(1)
    click.echo("models and migrations agree")


@db.command("auditor")
@click.option(
    "--password-file",
    type=click.File("r"),
    default=None,
    help="Let sandman_auditor log in with the one line in this file ('-': stdin).",
)
@click.option("--nologin", is_flag=True, help="Take the auditor's login and password away.")
@click.pass_context
def db_auditor(ctx: click.Context, password_file: TextIO | None, nologin: bool) -> None:
    """Turn the read-only sandman_auditor role's login on or off (docs/audit-sql.md)."""
    from broker.errors import InvalidRequest
    from broker.ledger.auditor import auditor_url, read_password, set_login

    if (password_file is None) == (not nologin):
        raise click.UsageError("give exactly one of --password-file and --nologin")
    url = database_url(settings_of(ctx))
    try:
        set_login(url, None if password_file is None else read_password(password_file.read()))
    except InvalidRequest as exc:
        raise click.BadParameter(str(exc), param_hint="--password-file") from exc
    if nologin:
        click.echo("sandman_auditor: login off")
    else:
        click.echo(f"sandman_auditor: login on; connect to {auditor_url(url)}")


@main.command("gc")
@click.option("--dry-run", is_flag=True, help="Report what would be done; change nothing.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.pass_context
def gc_command(ctx: click.Context, dry_run: bool, as_json: bool) -> None:
    """Run one garbage-collection pass (pods vs ledger; deletes only on a nonce match)."""
    root = tool_root(settings_of(ctx), actor="gc-cli")
    try:
        report = root.gc.run(actor=root.actor, dry_run=dry_run)
    finally:
        root.dispose()
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2, default=str))
    else:
        click.echo(
            f"GC pass{' (dry run)' if dry_run else ''}: {report.pods_seen} pods, "
            f"{report.live_rows} live rows, {len(report.actions)} actions, "
            f"{len(report.unowned_pods)} unowned, {len(report.foreign_pods)} foreign, "
            f"{len(report.errors)} errors, {report.duration_s:.2f}s"
        )
        for action in report.actions:
            click.echo(f"  {action['action']:8} {action['pod']}  ({action['why']})")
        for error in report.errors:
            click.echo(f"  error: {error}", err=True)
    sys.exit(0 if not report.errors else 1)


@main.command("audit")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.pass_context
def audit_command(ctx: click.Context, as_json: bool) -> None:
    """Ownership report; exits 1 when an unowned pod or a dangling row exists."""
    from broker.ownership.audit import format_audit, run_audit

    root = tool_root(settings_of(ctx), actor="audit-cli")
    try:
        report = run_audit(root.provider())
    finally:
        root.dispose()
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2, default=str))
    else:
        click.echo(format_audit(report))
    sys.exit(0 if report.ok else 1)


@main.command("egress-check")
@click.option("--namespace", default=None, help="Default: SANDMAN_NAMESPACE.")
@click.option("--kubeconfig", default=None, help="Default: SANDMAN_KUBECONFIG.")
@click.option("--image", default=None, help="Probe pod image (needs python3).")
@click.option(
    "--node-selector",
    "node_selector",
    multiple=True,
    metavar="KEY=VALUE",
    help="Where the probe pods run (repeatable). Default: sandman.io/node-kind=real.",
)
@click.option(
    "--listen",
    default=None,
    help="Host address pods reach without enforcement (default: the local cluster's 10.244.0.1).",
)
@click.option("--target", default="", help="host:port to try instead of a probe listener.")
@click.option("--timeout", "timeout_s", default=60.0, show_default=True, type=float)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.pass_context
def egress_check(  # noqa: PLR0917 (click passes options positionally)
    ctx: click.Context,
    namespace: str | None,
    kubeconfig: str | None,
    image: str | None,
    node_selector: tuple[str, ...],
    listen: str | None,
    target: str,
    timeout_s: float,
    as_json: bool,
) -> None:
    """Is egress denial enforced? Exit 0 enforced, 1 not enforced, 3 inconclusive."""
    from broker.backends.kube import egress_probe
    from broker.backends.kube.api import Kube, load_api_client

    settings = settings_of(ctx)
    selector: dict[str, str] | None = None
    if node_selector:
        selector = {}
        for item in node_selector:
            key, sep, value = item.partition("=")
            if not sep or not key:
                raise click.BadParameter(f"{item!r} is not KEY=VALUE", param_hint="--node-selector")
            selector[key] = value
    ns = namespace or settings.namespace
    kube = Kube(load_api_client(kubeconfig or settings.kubeconfig, qps_pool=4))
    kube.ensure_namespace(ns)
    result = egress_probe.probe_egress(
        kube,
        ns,
        installation=settings.installation_id,
        image=image or egress_probe.DEFAULT_IMAGE,
        node_selector=selector,
        listen=listen or egress_probe.DEFAULT_LISTEN,
        target=target,
        timeout_s=timeout_s,
    )
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=2))
    else:
        click.echo(egress_probe.format_result(result))
    codes = {
        egress_probe.EgressVerdict.ENFORCED: 0,
        egress_probe.EgressVerdict.NOT_ENFORCED: 1,
        egress_probe.EgressVerdict.INCONCLUSIVE: 3,
    }
    sys.exit(codes[result.verdict])


def _register_subcommands() -> None:
    from broker.cli import grading, images, replay, run, snapshots, tenants, web

    for module in (run, grading, web, replay, images, tenants, snapshots):
        module.register(main)


_register_subcommands()
