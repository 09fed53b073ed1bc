"""``sandman image``: the local image store the local backend runs sandboxes on.

docker save IMG | sandman image import -
sandman image import deploy-built.tar --tag localhost/mine:1
SANDMAN_REGISTRIES=localhost=http://127.0.0.1:16500 sandman image pull localhost/mine:1
sandman image ls
sandman image rm localhost/mine:1
"""

from __future__ import annotations

import json

import click

from broker.cli.common import settings_of
from broker.errors import SandmanError
from broker.images.registry import RegistryClient
from broker.images.store import ImageStore, open_source


def _store(ctx: click.Context) -> ImageStore:
    return ImageStore.at_cache(settings_of(ctx).cache_dir)


def register(group: click.Group) -> None:
    @group.group("image")
    def image() -> None:
        """The local image store (SANDMAN_CACHE_DIR/local-images) of the local backend."""

    @image.command("import")
    @click.argument("sources", metavar="FILE...|-", nargs=-1, required=True)
    @click.option("--tag", "tags", multiple=True, help="Also name the image REF (repeatable).")
    @click.option("--unpack", is_flag=True, help="Unpack now instead of at the first sandbox.")
    @click.pass_context
    def import_(
        ctx: click.Context, sources: tuple[str, ...], tags: tuple[str, ...], unpack: bool
    ) -> None:
        """Import docker-archives (docker save) or OCI archives; '-' reads stdin."""
        store = _store(ctx)
        try:
            for source in sources:
                for item in store.import_archive(open_source(source), tags):
                    if unpack:
                        store.rootfs(item.digest)
                    click.echo(f"{item.ref}\t{item.digest}")
        except SandmanError as exc:
            raise click.ClickException(f"{type(exc).__name__}: {exc}") from exc

    @image.command("pull")
    @click.argument("refs", metavar="REF...", nargs=-1, required=True)
    @click.option("--unpack", is_flag=True, help="Unpack now instead of at the first sandbox.")
    @click.pass_context
    def pull(ctx: click.Context, refs: tuple[str, ...], unpack: bool) -> None:
        """Fetch images from their registry (SANDMAN_REGISTRIES) into the store."""
        store = _store(ctx)
        client = RegistryClient.from_setting(settings_of(ctx).registries)
        try:
            for ref in refs:
                item = store.pull(client, ref)
                if unpack:
                    store.rootfs(item.digest)
                click.echo(f"{item.ref}\t{item.digest}")
        except SandmanError as exc:
            raise click.ClickException(f"{type(exc).__name__}: {exc}") from exc
        finally:
            client.close()

    @image.command("ls")
    @click.option("--json", "as_json", is_flag=True, help="Print JSON.")
    @click.pass_context
    def ls(ctx: click.Context, as_json: bool) -> None:
        """List references, their digests, layer size and whether they are unpacked."""
        items = _store(ctx).images()
        if as_json:
            click.echo(json.dumps([item.__dict__ for item in items], indent=2))
            return
        for item in items:
            mark = "unpacked" if item.unpacked else "-"
            click.echo(f"{item.ref}\t{item.digest}\t{item.size_b / 1e6:.1f}MB\t{mark}")

    @image.command("rm")
    @click.argument("ref")
    @click.pass_context
    def rm(ctx: click.Context, ref: str) -> None:
        """Forget REF (a digest forgets all its refs); unreferenced data is deleted."""
        try:
            for name in _store(ctx).remove(ref):
                click.echo(f"removed {name}")
        except SandmanError as exc:
            raise click.ClickException(f"{type(exc).__name__}: {exc}") from exc
