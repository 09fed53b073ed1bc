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


def test_a_migrating_user_without_createrole_migrates_once_the_role_exists(service_urls):  # type: ignore[no-untyped-def]
    """An external PostgreSQL's ledger owner is often no superuser: with sandman_auditor
    created beforehand (here: by the session database's migration), 0002 and 0003 still
    run, grant the role this database's views, and leave the role's settings alone."""
    import secrets

    import psycopg
    from sqlalchemy.engine import make_url

    from broker.ledger.auditor import libpq_url

    admin = libpq_url(service_urls.database_url)
    suffix = secrets.token_hex(4)
    user, db, password = f"sandman_mig_{suffix}", f"sandman_mig_{suffix}", secrets.token_hex(16)
    with psycopg.connect(admin, autocommit=True) as conn:
        assert conn.execute("SELECT 1 FROM pg_roles WHERE rolname = 'sandman_auditor'").fetchone()
        conn.execute(f"CREATE ROLE {user} LOGIN NOCREATEROLE PASSWORD '{password}'")
        conn.execute(f'CREATE DATABASE "{db}" OWNER {user}')
    url = (
        make_url(service_urls.database_url)
        .set(username=user, password=password, database=db)
        .render_as_string(hide_password=False)
    )
    try:
        upgrade(url)
        check(url)
        with psycopg.connect(libpq_url(url)) as conn:
            granted = conn.execute(
                "SELECT has_table_privilege('sandman_auditor', 'audit.sandboxes', 'SELECT'),"
                " has_table_privilege('sandman_auditor', 'public.sandboxes', 'SELECT')"
            ).fetchone()
        assert granted == (True, False)
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')
            conn.execute(f"DROP ROLE IF EXISTS {user}")
