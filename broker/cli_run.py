"""Commands that run the system (up, demo, worker, beat, web). Registered by broker.cli."""

from __future__ import annotations

import click


def register(group: click.Group) -> None:
    """Attach this module's commands to the ``sandman`` group."""
