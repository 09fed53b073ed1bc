"""`sandman services up` must not say OK while PostgreSQL is half-stopped (issue 20, item 12):
after a smart shutdown with a client still connected, the postmaster still listens but
refuses every new connection."""

from __future__ import annotations

import subprocess
from collections.abc import Callable

import psycopg
import pytest

from broker.errors import ServiceUnavailable
from broker.local.services import _pg_bin, _pg_run_as, ensure_postgres
from broker.settings import Settings
from tests.support.wait import wait_until

pytestmark = pytest.mark.integration


def test_a_smart_shutdown_in_progress_is_not_reported_as_running(
    state_dirs: Callable[[], Settings],
) -> None:
    settings = state_dirs()
    url = ensure_postgres(settings).replace("+psycopg", "")
    data = settings.state_dir / "postgres" / "data"
    with psycopg.connect(url) as held:  # a client that keeps the smart shutdown waiting
        subprocess.run(  # type: ignore[call-overload]
            [str(_pg_bin() / "pg_ctl"), "-D", str(data), "-m", "smart", "--no-wait", "stop"],
            check=True,
            capture_output=True,
            **_pg_run_as(),
        )
        wait_until(lambda: _refuses(url), timeout=30, what="postmaster refusing connections")
        with pytest.raises(ServiceUnavailable, match="shutting down"):
            ensure_postgres(settings)
        held.execute("SELECT 1")  # still served: nothing was restarted under it


def _refuses(url: str) -> bool:
    try:
        psycopg.connect(url).close()
    except psycopg.OperationalError:
        return True
    return False
