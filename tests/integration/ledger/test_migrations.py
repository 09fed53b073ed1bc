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


def test_audit_migration_downgrades_and_upgrades_on_its_own(service_urls):  # type: ignore[no-untyped-def]
    """0002 alone: the audit schema, gc_passes and this database's grants to the auditor
    come and go; the server-wide role stays while another database grants it anything."""
    import psycopg
    from alembic import command

    from broker.ledger.auditor import libpq_url
    from tests.support.databases import fresh_database

    def shape(url: str) -> tuple[bool, bool, bool]:
        with psycopg.connect(libpq_url(url)) as conn:
            schema = conn.execute("SELECT 1 FROM pg_namespace WHERE nspname = 'audit'")
            table = conn.execute("SELECT to_regclass('public.gc_passes')").fetchone()
            acl = conn.execute(
                "SELECT datacl::text FROM pg_database WHERE datname = current_database()"
            ).fetchone()
            return (
                schema.fetchone() is not None,
                table is not None and table[0] is not None,
                acl is not None and "sandman_auditor" in (acl[0] or ""),
            )

    with (
        fresh_database(service_urls.database_url, prefix="sandman_audit_mig") as other,
        fresh_database(service_urls.database_url, prefix="sandman_audit_mig") as url,
    ):
        upgrade(other)  # a second ledger on the server grants the role too
        upgrade(url)
        assert shape(url) == (True, True, True)
        command.downgrade(alembic_config(url), "0001")
        assert shape(url) == (False, False, False)
        with psycopg.connect(libpq_url(url)) as conn:
            role = conn.execute("SELECT 1 FROM pg_roles WHERE rolname = 'sandman_auditor'")
            assert role.fetchone() is not None  # `other` still grants it
        upgrade(url)
        assert shape(url) == (True, True, True)
        check(url)
