"""Throwaway PostgreSQL databases on the session's real server.

One place that knows how to make and drop a database by name, so the session database
(tests/conftest.py) and tests that need a second, unmigrated one (the wheel test) agree.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg


def _admin_url(base_url: str) -> str:
    """The maintenance database of the server ``base_url`` points at, in libpq form."""
    server = base_url.replace("postgresql+psycopg://", "postgresql://").rsplit("/", 1)[0]
    return server + "/postgres"


@contextmanager
def fresh_database(base_url: str, prefix: str = "sandman_test") -> Iterator[str]:
    """Create an empty database next to ``base_url``'s, yield its URL, drop it afterwards."""
    name = f"{prefix}_{secrets.token_hex(4)}"
    admin = _admin_url(base_url)
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield base_url.rsplit("/", 1)[0] + "/" + name
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
