"""Programmatic Alembic, so `sandman db upgrade` works from an installed wheel too."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config

_MIGRATIONS = Path(__file__).resolve().parents[2] / "migrations"


def alembic_config(database_url: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(_MIGRATIONS))
    cfg.attributes["database_url"] = database_url
    return cfg


def upgrade(database_url: str, revision: str = "head") -> None:
    command.upgrade(alembic_config(database_url), revision)


def check(database_url: str) -> None:
    """Raise when autogenerate would produce a new migration (models drifted)."""
    command.check(alembic_config(database_url))
