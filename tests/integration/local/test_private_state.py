"""Secrets at rest (issue 20, item 8): the state dir and everything the embedded services
keep in it (passwords, the ledger, Redis's AOF/RDB with every token, logs, pid files) is
reachable by its owner alone, and PostgreSQL run as root still starts in it."""

from __future__ import annotations

import grp
import os
import shutil
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from broker.local.services import PG_SYSTEM_USER, ensure_services, stop_postgres, stop_redis
from broker.settings import Settings
from broker.wire.services import recorded_port
from tests.support.wait import wait_until

pytestmark = pytest.mark.integration


def _loose(state_dir: Path) -> list[str]:
    """Every dir or file under ``state_dir`` that someone other than its owner may use.

    The one allowance: as root, the state dir itself may be traversed (x, never r or w)
    by the group of the PostgreSQL system user, which must walk through it to its data."""
    found = []
    for dirpath, _dirs, files in os.walk(state_dir):
        for path in [Path(dirpath), *(Path(dirpath) / f for f in files)]:
            st = path.lstat()
            if not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
                continue  # the PostgreSQL socket: closed by the 0700 dir it sits in
            extra = stat.S_IMODE(st.st_mode) & 0o077
            pg_traverse = path == state_dir and os.geteuid() == 0 and extra == stat.S_IXGRP
            if pg_traverse and grp.getgrgid(st.st_gid).gr_name == PG_SYSTEM_USER:
                continue
            if extra:
                found.append(f"{path.relative_to(state_dir)} {oct(stat.S_IMODE(st.st_mode))}")
    return found


def test_nothing_in_the_state_dir_is_open_to_others(state_dirs: Callable[[], Settings]) -> None:
    settings = state_dirs()  # mktemp -d: 0700, as the failing run had it
    urls = ensure_services(settings)
    with redis.Redis.from_url(urls.redis_url) as client:
        client.set("token-like", "x")
        client.bgsave()  # a dump.rdb too
        wait_until((settings.state_dir / "redis" / "dump.rdb").exists, what="rdb")
    assert _loose(settings.state_dir) == []


def test_a_restart_tightens_an_older_installation_and_still_starts(
    state_dirs: Callable[[], Settings],
) -> None:
    """Files an older version left 0644 in a 0755 dir are made private on the next start,
    and PostgreSQL (as root: its system user) starts again in the now-0700 state dir."""
    settings = state_dirs()
    ensure_services(settings)
    stop_redis(settings)
    stop_postgres(settings)
    wait_until(lambda: not _listening(recorded_port(settings, "redis")), what="redis down")
    for path in [settings.state_dir, *settings.state_dir.rglob("*")]:
        if path.is_dir() and path.name != "data" and path.parent.name != "data":
            path.chmod(0o755)
        elif path.is_file() and "data" not in path.parts:
            path.chmod(0o644)
    settings.state_dir.chmod(0o700)  # what `chmod 700` on the old state dir would leave
    urls = ensure_services(settings)
    import psycopg

    with psycopg.connect(urls.database_url.replace("+psycopg", "")) as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)
    assert _loose(settings.state_dir) == []


def _listening(port: int) -> bool:
    import socket

    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def test_postgres_stops_after_an_ancestor_lost_its_reach() -> None:
    """pytest makes /tmp/pytest-of-<user> 0700 again at each session's start; a broker
    started below it earlier must still stop (pg_ctl runs as the system user), not leave
    PostgreSQL running."""
    if os.geteuid() != 0:
        pytest.skip("PostgreSQL runs as another user only when we are root")
    parent = Path(tempfile.mkdtemp(prefix="sandman-reach-"))
    settings = Settings(state_dir=parent / "state")
    pid_file = settings.state_dir / "postgres" / "data" / "postmaster.pid"
    try:
        ensure_services(settings)
        assert pid_file.exists()
        parent.chmod(0o700)  # what a later pytest session does to its base directory
        stop_postgres(settings)
        wait_until(lambda: not pid_file.exists(), 60, what="postgres stopped")
    finally:
        parent.chmod(0o711)  # a failed stop above must not leave it running
        stop_redis(settings)
        stop_postgres(settings)
        redis_pid = settings.state_dir / "redis" / "redis.pid"
        wait_until(lambda: not redis_pid.exists(), 30, what="redis stopped")  # it saves first
        shutil.rmtree(parent, ignore_errors=True)
