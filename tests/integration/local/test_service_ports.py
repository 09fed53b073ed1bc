"""Two installations on one machine: each state dir has its own ports and only ever talks
to its own PostgreSQL and Redis (issue 20, item 9)."""

from __future__ import annotations

import json
import socket
from collections.abc import Callable
from pathlib import Path

import psycopg
import pytest
import redis

from broker.errors import ServiceUnavailable
from broker.local.services import ensure_redis, ensure_services, stop_redis
from broker.settings import Settings
from broker.wire.services import known_urls, read_record, recorded_port, urls_file
from tests.support.wait import wait_until

pytestmark = pytest.mark.integration


def _pg(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://")


def test_two_state_dirs_have_their_own_ports_and_data(
    state_dirs: Callable[[], Settings],
) -> None:
    a, b = state_dirs(), state_dirs()
    urls_a, urls_b = ensure_services(a), ensure_services(b)
    ports = {recorded_port(s, svc) for s in (a, b) for svc in ("postgres", "redis")}
    assert len(ports) == 4 and 0 not in ports  # every server on a port of its own

    for settings, urls in ((a, urls_a), (b, urls_b)):
        name = settings.state_dir.name
        with psycopg.connect(_pg(urls.database_url), autocommit=True) as conn:
            conn.execute("CREATE TABLE whose (name text)")
            conn.execute("INSERT INTO whose VALUES (%s)", (name,))
        with redis.Redis.from_url(urls.redis_url) as client:
            client.set("whose", name)

    for settings in (a, b):
        urls = known_urls(settings)  # what a client of this state dir reads
        with psycopg.connect(_pg(urls.database_url)) as conn:
            rows = conn.execute("SELECT name FROM whose").fetchall()
        assert rows == [(settings.state_dir.name,)]
        with redis.Redis.from_url(urls.redis_url) as client:
            assert client.get("whose") == settings.state_dir.name.encode()


def test_the_recorded_port_is_reused_after_a_restart(state_dirs: Callable[[], Settings]) -> None:
    settings = state_dirs()
    first = ensure_redis(settings)
    port = recorded_port(settings, "redis")
    stop_redis(settings)
    wait_until(lambda: not _listening(port), timeout=20, what="redis stopped")
    assert ensure_redis(settings) == first
    assert recorded_port(settings, "redis") == port


def test_an_explicit_port_still_wins(state_dirs: Callable[[], Settings]) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    settings = state_dirs()
    explicit = Settings(state_dir=settings.state_dir, embedded_redis_port=port)
    assert f"@127.0.0.1:{port}/" in ensure_redis(explicit)
    assert recorded_port(settings, "redis") == port  # the next start without it reuses it


def test_a_state_dir_from_before_ports_were_recorded_keeps_its_running_servers(
    state_dirs: Callable[[], Settings],
) -> None:
    """An older record has no ports; its servers run on what were the fixed defaults."""
    settings = state_dirs()
    with socket.socket() as one, socket.socket() as two:
        one.bind(("127.0.0.1", 0))
        two.bind(("127.0.0.1", 0))
        pg_port, redis_port = one.getsockname()[1], two.getsockname()[1]
    old = Settings(
        state_dir=settings.state_dir, embedded_pg_port=pg_port, embedded_redis_port=redis_port
    )
    before = ensure_services(old)
    record = urls_file(settings)
    record.write_text(json.dumps({k: v for k, v in read_record(settings).items() if k != "ports"}))
    assert ensure_services(settings) == before  # adopted, not a second server on a new port
    assert recorded_port(settings, "postgres") == pg_port
    assert recorded_port(settings, "redis") == redis_port


def test_another_state_dirs_server_on_our_port_is_refused(
    state_dirs: Callable[[], Settings],
) -> None:
    """A server found on the port is proven ours (password, data dir) or the start fails."""
    theirs, ours = state_dirs(), state_dirs()
    urls = ensure_services(theirs)
    taken = {
        "database_url": recorded_port(theirs, "postgres"),
        "redis_url": recorded_port(theirs, "redis"),
    }
    squatted = Settings(
        state_dir=ours.state_dir,
        embedded_pg_port=taken["database_url"],
        embedded_redis_port=taken["redis_url"],
    )
    with pytest.raises(ServiceUnavailable, match="not the PostgreSQL of state dir") as info:
        ensure_services(squatted)
    assert urls.database_url.split("@")[0].split(":")[-1] not in str(info.value)  # no password
    with pytest.raises(ServiceUnavailable, match="not the Redis of state dir"):
        ensure_redis(squatted)
    assert known_urls(ours).database_url == ""  # nothing recorded that points at theirs


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def test_sandman_services_up_in_two_state_dirs_prints_their_own_urls(
    state_dirs: Callable[[], Settings],
) -> None:
    """The CLI path: no port in the environment, each state dir gets and keeps its own."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("SANDMAN_")}
    seen = []
    for settings in (state_dirs(), state_dirs()):
        out = subprocess.run(
            [str(Path(sys.executable).parent / "sandman"), "services", "up"],
            env={**env, "SANDMAN_STATE_DIR": str(settings.state_dir)},
            capture_output=True,
            text=True,
            check=True,
            timeout=180,
        ).stdout
        assert f"127.0.0.1:{recorded_port(settings, 'postgres')}/" in out
        assert f"127.0.0.1:{recorded_port(settings, 'redis')}/" in out
        seen.append(out)
    assert seen[0] != seen[1]
