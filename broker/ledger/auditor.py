"""The ``sandman_auditor`` role's login: off by default, on with a password an operator gives.

Migration 0002 creates the role NOLOGIN and grants it the ``audit`` schema's views only
(docs/audit-sql.md). Turning its login on is a deliberate operator step, so no
installation exposes a new way in by upgrading. The password is turned into a SCRAM
verifier here, by libpq, and only the verifier is sent: the clear text never reaches
the server, its statement log or ``pg_stat_activity``.
"""

from __future__ import annotations

import psycopg
from psycopg import sql
from sqlalchemy.engine import make_url

from broker.errors import ConfigError, InvalidRequest

AUDITOR_ROLE = "sandman_auditor"


def libpq_url(database_url: str) -> str:
    """``database_url`` (an SQLAlchemy URL) as a libpq URI, password included."""
    return make_url(database_url).set(drivername="postgresql").render_as_string(hide_password=False)


def auditor_url(database_url: str) -> str:
    """Where the auditor connects: the ledger's server and database, as the auditor role,
    without a password (libpq takes it from PGPASSWORD or ~/.pgpass)."""
    url = make_url(database_url).set(drivername="postgresql", username=AUDITOR_ROLE, password=None)
    return url.render_as_string(hide_password=False)


def read_password(text: str) -> str:
    """A password file's content: one line; its line end is not part of the password."""
    password = text.removesuffix("\n").removesuffix("\r")
    if not password or "\n" in password or "\r" in password:
        raise InvalidRequest("the password file must hold one non-empty line")
    return password


def set_login(database_url: str, password: str | None) -> None:
    """Let the auditor log in with ``password``, or (None) take its login and password away.

    The role must exist: it is created by ``sandman db upgrade`` (migration 0002)."""
    with psycopg.connect(libpq_url(database_url), autocommit=True) as conn:
        if (
            conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (AUDITOR_ROLE,)).fetchone()
            is None
        ):
            raise ConfigError(f"no role {AUDITOR_ROLE}: run `sandman db upgrade` first")
        role = sql.Identifier(AUDITOR_ROLE)
        if password is None:
            conn.execute(sql.SQL("ALTER ROLE {} NOLOGIN PASSWORD NULL").format(role))
            return
        verifier = conn.pgconn.encrypt_password(
            password.encode(), AUDITOR_ROLE.encode(), b"scram-sha-256"
        )
        conn.execute(
            sql.SQL("ALTER ROLE {} LOGIN PASSWORD {}").format(role, sql.Literal(verifier.decode()))
        )
