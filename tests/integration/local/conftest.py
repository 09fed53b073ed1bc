"""Embedded services of throwaway state dirs, stopped (by their own pid files) and removed
at the end."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from broker.local.services import stop_postgres, stop_redis
from broker.settings import Settings
from tests.support.wait import wait_until


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
        wait_until(_gone(settings.state_dir / "redis" / "redis.pid"), 30, what="redis stopped")
        shutil.rmtree(settings.state_dir, ignore_errors=True)


def _gone(path: Path) -> Callable[[], bool]:
    return lambda: not path.exists()
