import pytest
from sqlalchemy import create_engine, inspect

from broker.ledger.migrate import alembic_config, check, upgrade

pytestmark = pytest.mark.integration


def test_migrated_schema_has_ledger_tables(database_url):
    engine = create_engine(database_url)
    try:
        tables = set(inspect(engine).get_table_names())
    finally:
        engine.dispose()
    assert {"jobs", "sandboxes", "events", "leaks", "alembic_version"} <= tables


def test_models_match_migrations(database_url):
    check(database_url)  # raises on drift


def test_downgrade_then_upgrade_round_trips(database_url):
    from alembic import command

    cfg = alembic_config(database_url)
    command.downgrade(cfg, "base")
    engine = create_engine(database_url)
    try:
        assert "sandboxes" not in inspect(engine).get_table_names()
    finally:
        engine.dispose()
    upgrade(database_url)
    check(database_url)
