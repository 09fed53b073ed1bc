"""Programmatic Alembic, so `sandman db upgrade` works from an installed wheel too.

The script directory is found as the package ``broker.ledger.migrations`` through
importlib.resources, never by walking up from this file: in a wheel it sits inside the
package (setup.py maps the repository's top-level ``migrations/`` there), and an editable
install's finder resolves the same name to the checkout, so both read one location.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

from alembic import command
from alembic.config import Config

from broker.errors import ConfigError

MIGRATIONS_PACKAGE = "broker.ledger.migrations"


def migrations_dir() -> Path:
    """The installed Alembic script directory, as a real path (Alembic reads files by path)."""
    try:
        found = files(MIGRATIONS_PACKAGE)
    except ModuleNotFoundError as exc:
        raise ConfigError(f"{MIGRATIONS_PACKAGE} is not installed: reinstall the package") from exc
    path = Path(str(found))
    if not (path / "env.py").is_file():
        # a zipped install, say: Alembic needs the scripts on disk
        raise ConfigError(f"the migrations are not a directory on disk: {found}")
    return path


def alembic_config(database_url: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(migrations_dir()))
    cfg.attributes["database_url"] = database_url
    return cfg


def upgrade(database_url: str, revision: str = "head") -> None:
    command.upgrade(alembic_config(database_url), revision)


def check(database_url: str) -> None:
    """Raise when autogenerate would produce a new migration (models drifted)."""
    command.check(alembic_config(database_url))
