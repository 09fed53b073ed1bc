"""``sandman snapshot ls|rm``: the snapshots of this installation, and removing one.

Removing deletes the manifest and marks the row ``deleted`` at once; the blobs only it
named go with the next GC pass (``sandman gc``), after the grace that protects captures
in progress (``SANDMAN_SNAPSHOT_GRACE_S``).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import click

from broker.cli.common import settings_of, tool_root

if TYPE_CHECKING:
    from broker.acquire.root import Root
    from broker.snapshots.service import SnapshotService


def _service(ctx: click.Context) -> tuple[Root, SnapshotService]:
    """A one-shot root and a snapshot service on it (the caller disposes of the root)."""
    from broker.snapshots.service import SnapshotService
    from broker.snapshots.store import open_store

    settings = settings_of(ctx)
    root = tool_root(settings, actor="cli")
    service = SnapshotService(
        root.sessions,
        open_store(settings),
        root.provider().token_for,
        installation=settings.installation_id,
    )
    return root, service


def register(group: click.Group) -> None:
    @group.group("snapshot")
    def snapshot() -> None:
        """Workspace snapshots (sb.snapshot / fork / pause): list and remove."""

    @snapshot.command("ls")
    @click.option("--job", default=None, help="Only this job's snapshots.")
    @click.option("--all", "every", is_flag=True, help="Deleted ones too.")
    @click.option("--json", "as_json", is_flag=True)
    @click.pass_context
    def ls(ctx: click.Context, job: str | None, every: bool, as_json: bool) -> None:
        """List snapshots, oldest first."""
        root, service = _service(ctx)
        try:
            rows = service.rows(job=job, every=every)
        finally:
            root.dispose()
        if as_json:
            click.echo(json.dumps(rows, indent=2))
            return
        click.echo(f"{'id':32}  {'job':20} {'state':9} {'size':>12} {'stored':>12}  expires")
        for r in rows:
            click.echo(
                f"{r['id']:32}  {r['job']:20} {r['state']:9} {r['size']:>12} "
                f"{r['stored']:>12}  {r['expires']}"
            )

    @snapshot.command("rm")
    @click.argument("snapshot_ids", nargs=-1, required=True)
    @click.pass_context
    def rm(ctx: click.Context, snapshot_ids: tuple[str, ...]) -> None:
        """Remove snapshots (their blobs go with the next GC pass)."""
        root, service = _service(ctx)
        try:
            missing = [s for s in snapshot_ids if not service.remove(s)]
        finally:
            root.dispose()
        if missing:
            raise click.ClickException(f"no such snapshot: {', '.join(missing)}")
        click.echo(f"removed {len(snapshot_ids)}")
