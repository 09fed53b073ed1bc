"""Alembic environment: the schema is broker.ledger's models; the URL comes from the caller."""

from __future__ import annotations

from alembic import context
from sqlalchemy import engine_from_config, pool

from broker.ledger import models  # noqa: F401  (registers every table on Base.metadata)
from broker.ledger.base import Base
from broker.settings import Settings

config = context.config
target_metadata = Base.metadata


def _url() -> str:
    url = config.attributes.get("database_url") or config.get_main_option("sqlalchemy.url")
    if url:
        return str(url)
    settings = Settings.from_env()
    if not settings.database_url:
        raise RuntimeError("no database URL: run `sandman db upgrade` or set SANDMAN_DATABASE_URL")
    return settings.database_url


def run_migrations_offline() -> None:
    context.configure(
        url=_url(), target_metadata=target_metadata, literal_binds=True, compare_type=True
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connectable = config.attributes.get("connection")
    if connectable is not None:
        context.configure(
            connection=connectable, target_metadata=target_metadata, compare_type=True
        )
        with context.begin_transaction():
            context.run_migrations()
        return
    engine = engine_from_config(
        {"sqlalchemy.url": _url()}, prefix="sqlalchemy.", poolclass=pool.NullPool
    )
    with engine.connect() as connection:
        context.configure(connection=connection, target_metadata=target_metadata, compare_type=True)
        with context.begin_transaction():
            context.run_migrations()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
