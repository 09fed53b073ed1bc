"""Engine and session factory. The caller opens the transaction (``with session.begin():``)."""

from __future__ import annotations

from sqlalchemy import Engine, create_engine
from sqlalchemy.orm import Session, sessionmaker


def make_engine(url: str, *, pool_size: int = 10, max_overflow: int = 20) -> Engine:
    """An engine with pre-ping, so a PostgreSQL restart costs one retry, not a dead worker.

    ``hide_parameters``: a failed statement's text would otherwise carry its bound values
    (a sandbox's nonce and token hash) into every log line and error message quoting it."""
    return create_engine(
        url,
        pool_size=pool_size,
        max_overflow=max_overflow,
        pool_pre_ping=True,
        pool_recycle=1800,
        future=True,
        hide_parameters=True,
    )


def make_session_factory(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)
