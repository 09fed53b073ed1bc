"""What every ``sandman`` command shares: the settings read at the entry point, and the
composition root of a one-shot command.

The CLI is an entry point, so it may start the embedded services before it builds a root
(the root itself never starts anything).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from broker.settings import Settings

if TYPE_CHECKING:
    from broker.acquire.root import Root


def settings_of(ctx: click.Context) -> Settings:
    """The Settings ``sandman`` read from the environment (``ctx.obj``)."""
    settings = ctx.obj
    assert isinstance(settings, Settings)
    return settings


def database_url(settings: Settings) -> str:
    """The configured database, else the embedded PostgreSQL (started if it is not)."""
    if settings.database_url:
        return settings.database_url
    from broker.local.services import ensure_postgres

    return ensure_postgres(settings)


def tool_root(settings: Settings, actor: str) -> Root:
    """A root sized for one command, acting as ``actor``; call ``dispose()`` when done."""
    from broker.acquire.root import TOOL, Root

    return Root(settings, TOOL, database_url=database_url(settings), actor=actor)
