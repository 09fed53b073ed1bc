"""Shared fixtures: real PostgreSQL and Redis (embedded by default, or SANDMAN_* URLs).

Under CI=true a service that cannot be started FAILS the run; it never skips.
Each test session gets its own freshly migrated database, so the schema under test is
always the one Alembic builds, never ``create_all``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

# Fixtures shared across feature folders (execd daemons, the admin app over a fake backend),
# and the environment scrub that runs before any of them reads SANDMAN_* variables.
pytest_plugins = [
    "tests.support.env",
    "tests.support.execd_daemon",
    "tests.support.web_app",
    "tests.support.s3server",
]

TIERS = ("unit", "integration", "cluster")
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test must declare its tier, so `-m unit` and friends never miss one."""
    missing = [i.nodeid for i in items if not any(i.get_closest_marker(t) for t in TIERS)]
    if missing:
        raise pytest.UsageError("tests without a tier marker: " + ", ".join(missing[:10]))


def unavailable(what: str, error: BaseException | str) -> None:
    """Fail under CI, skip on a developer machine without the service."""
    message = f"{what} unavailable: {error}"
    if IN_CI:
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture(scope="session")
def sandman_settings():  # type: ignore[no-untyped-def]
    from broker.settings import Settings

    return Settings.from_env()


@pytest.fixture(scope="session")
def service_urls(sandman_settings):  # type: ignore[no-untyped-def]
    from broker.local.services import ensure_services

    try:
        return ensure_services(sandman_settings)
    except Exception as exc:
        unavailable("PostgreSQL/Redis", exc)


@pytest.fixture(scope="session")
def database_url(service_urls) -> Iterator[str]:  # type: ignore[no-untyped-def]
    """A fresh database for this test session, migrated to head by Alembic."""
    from broker.ledger.migrate import upgrade
    from tests.support.databases import fresh_database

    with fresh_database(service_urls.database_url) as url:
        upgrade(url)
        yield url


@pytest.fixture(scope="session")
def redis_url(service_urls) -> str:  # type: ignore[no-untyped-def]
    """Redis database 9, flushed at the start of the session."""
    import redis

    url = service_urls.redis_url.rsplit("/", 1)[0] + "/9"
    client = redis.Redis.from_url(url)
    client.flushdb()
    client.close()
    return url


@pytest.fixture(scope="session")
def db_engine(database_url):  # type: ignore[no-untyped-def]
    from broker.ledger.db import make_engine

    engine = make_engine(database_url)
    yield engine
    engine.dispose()


@pytest.fixture
def sessions(db_engine):  # type: ignore[no-untyped-def]
    from broker.ledger.db import make_session_factory

    return make_session_factory(db_engine)


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return Path(__file__).resolve().parent.parent
