"""Engine and session factory. The caller opens the transaction (``with session.begin():``)."""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.exc import DisconnectionError
from sqlalchemy.orm import Session, sessionmaker

# A pooled connection checked in less than this ago is handed out without a ping.
PING_AFTER_IDLE_S = 1.0
_IDLE_SINCE = "sandman_idle_since"


def make_engine(url: str, *, pool_size: int = 10, max_overflow: int = 20) -> Engine:
    """An engine whose pool pings a connection idle for PING_AFTER_IDLE_S before handing
    it out, so a PostgreSQL restart costs one retry, not a dead worker.

    Not SQLAlchemy's ``pool_pre_ping``, which pings on every checkout: an acquire checks a
    connection out four times within milliseconds, and each ping is a round trip and a
    query on both sides. A restart takes longer than PING_AFTER_IDLE_S, so every
    connection that outlived one is pinged (and replaced) before use.

    ``hide_parameters``: a failed statement's text would otherwise carry its bound values
    (a sandbox's nonce and token hash) into every log line and error message quoting it."""
    engine = create_engine(
        url,
        pool_size=pool_size,
        max_overflow=max_overflow,
        pool_recycle=1800,
        future=True,
        hide_parameters=True,
    )
    dialect = engine.dialect

    def checkin(dbapi_connection: Any, record: Any) -> None:
        record.info[_IDLE_SINCE] = time.monotonic()

    def checkout(dbapi_connection: Any, record: Any, proxy: Any) -> None:
        idle_since = record.info.pop(_IDLE_SINCE, None)
        if idle_since is not None and time.monotonic() - idle_since < PING_AFTER_IDLE_S:
            return
        try:
            dialect.do_ping(dbapi_connection)
        except Exception as exc:  # the pool replaces it and checks out again
            raise DisconnectionError(f"stale pooled connection: {type(exc).__name__}") from exc

    event.listen(engine, "checkin", checkin)
    event.listen(engine, "checkout", checkout)
    return engine


def make_session_factory(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)
