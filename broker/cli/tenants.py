"""``sandman tenant create|set|ls``: teams, their quotas, and which jobs they own.

Every change goes through ``broker.acquire.quotas`` (validated, audited as an ``admin``
event with the actor ``cli:<user>``) and applies to the next acquire.
"""

from __future__ import annotations

import getpass
import json
from collections.abc import Callable
from typing import Any

import click

from broker.cli.common import settings_of, tool_root


def _quota(text: str) -> int | None:
    """A quota on the command line: a whole number, or ``none`` for no limit."""
    if text.strip().lower() == "none":
        return None
    try:
        return int(text)
    except ValueError as exc:
        raise click.BadParameter(f"{text!r} is not a whole number or 'none'") from exc


def actor() -> str:
    return f"cli:{getpass.getuser()}"


def _run(ctx: click.Context, work: Callable[[Any], Any]) -> Any:
    """``work(sessions)`` on a one-shot root; typed refusals become a usage error."""
    from broker.errors import SandmanError

    root = tool_root(settings_of(ctx), actor=actor())
    try:
        return work(root.sessions)
    except SandmanError as exc:
        raise click.ClickException(str(exc)) from exc
    finally:
        root.dispose()


def _given(**given: str | None) -> dict[str, int | None]:
    """The quota options given on the command line (an option left out: unchanged)."""
    return {k: _quota(v) for k, v in given.items() if v is not None}


def register(group: click.Group) -> None:
    @group.group("tenant")
    def tenant() -> None:
        """Tenants (teams): quotas over all their jobs; `sandman job create --tenant`."""

    quota_options = [
        click.option("--max-live", default=None, metavar="N|none", help="Live sandboxes."),
        click.option(
            "--creates-per-minute", default=None, metavar="N|none", help="Intents per minute."
        ),
        click.option(
            "--snapshot-bytes",
            default=None,
            metavar="N|none",
            help="Bytes listed by the live snapshots of all its jobs.",
        ),
    ]

    def with_quotas(fn: Callable[..., Any]) -> Callable[..., Any]:
        for option in reversed(quota_options):
            fn = option(fn)
        return fn

    @tenant.command("create")
    @click.argument("name")
    @with_quotas
    @click.pass_context
    def create(ctx: click.Context, /, name: str, **given: str | None) -> None:
        """Create tenant NAME (a quota not given: no limit)."""
        from broker.acquire import quotas

        quotas_given = _given(**given)
        view = _run(ctx, lambda s: quotas.create(s, name, quotas_given, actor=actor()))
        click.echo(json.dumps(view.to_dict()))

    @tenant.command("set")
    @click.argument("name")
    @with_quotas
    @click.pass_context
    def set_(ctx: click.Context, /, name: str, **given: str | None) -> None:
        """Change the given quotas of tenant NAME ('none': no limit); audited."""
        from broker.acquire import quotas

        quotas_given = _given(**given)
        view = _run(ctx, lambda s: quotas.update(s, name, quotas_given, actor=actor()))
        click.echo(json.dumps(view.to_dict()))

    @tenant.command("ls")
    @click.option("--json", "as_json", is_flag=True, help="One JSON object per tenant.")
    @click.pass_context
    def ls(ctx: click.Context, as_json: bool) -> None:
        """Tenants, their quotas, jobs and current use."""
        from broker.acquire import quotas

        views = _run(ctx, quotas.listing)
        if as_json:
            for view in views:
                click.echo(json.dumps(view.to_dict()))
            return
        click.echo(f"{'tenant':24} {'live':>11} {'creates/min':>13} {'snapshot bytes':>23}  jobs")

        def used(n: int, limit: int | None) -> str:
            return f"{n}/{'-' if limit is None else limit}"

        for v in views:
            click.echo(
                f"{v.name:24} {used(v.live, v.max_live):>11} "
                f"{used(v.creates_last_minute, v.creates_per_minute):>13} "
                f"{used(v.snapshot_bytes_held, v.snapshot_bytes):>23}  {', '.join(v.jobs)}"
            )
