"""Tests see only the SANDMAN_* variables they set, not what a developer shell carries.

A stray ``SANDMAN_BACKEND=kubernetes`` or ``SANDMAN_DATABASE_URL`` in the shell that runs
pytest would silently point the suite at other services. Registered as a plugin in
tests/conftest.py, this removes them before any fixture reads the environment, keeping
only what says where this run's own services and caches live and the test run's own
knobs (CI is not a SANDMAN_ variable and is untouched).
"""

from __future__ import annotations

import os

import pytest

KEPT = frozenset(
    {
        # where this run's own embedded services, state and caches live
        "SANDMAN_STATE_DIR",
        "SANDMAN_CACHE_DIR",
        "SANDMAN_EMBEDDED_PG_PORT",
        "SANDMAN_EMBEDDED_REDIS_PORT",
        # real services to test against instead of the embedded ones (tests/conftest.py); the
        # session only ever creates and drops its own database there
        "SANDMAN_DATABASE_URL",
        "SANDMAN_REDIS_URL",
        # knobs of the test run itself
        "SANDMAN_TEST_KUBECONFIG",
        "SANDMAN_CLUSTER_UP_TIMEOUT",
        "SANDMAN_BROKER_IMAGE_TIMEOUT",
        "SANDMAN_CHROMIUM",
    }
)
PREFIX = "SANDMAN_"


def scrub(environ: dict[str, str] | os._Environ[str]) -> list[str]:
    """Remove every SANDMAN_* variable not in KEPT; return the names removed."""
    stray = sorted(k for k in environ if k.startswith(PREFIX) and k not in KEPT)
    for name in stray:
        del environ[name]
    return stray


def pytest_configure(config: pytest.Config) -> None:
    removed = scrub(os.environ)
    if removed:
        config.stash[_REMOVED] = removed


_REMOVED = pytest.StashKey[list[str]]()


def pytest_report_header(config: pytest.Config) -> str | None:
    removed = config.stash.get(_REMOVED, [])
    return f"ignored from the environment: {', '.join(removed)}" if removed else None
