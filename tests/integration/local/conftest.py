"""Embedded services of throwaway state dirs, stopped (by their own pid files) at the end."""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from broker.local.services import stop_postgres, stop_redis
from broker.settings import Settings


@pytest.fixture
def state_dirs() -> Iterator[Callable[[], Settings]]:
    """A maker of fresh state dirs (``mktemp -d``: 0700), on ports the state dir chooses."""
    made: list[Settings] = []

    def make() -> Settings:
        settings = Settings(state_dir=Path(tempfile.mkdtemp(prefix="sandman-h1-")))
        made.append(settings)
        return settings

    yield make
    for settings in made:
        stop_redis(settings)
        stop_postgres(settings)
