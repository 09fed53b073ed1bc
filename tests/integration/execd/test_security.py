"""Access control on execd, across sandboxes: one sandbox's token never opens another.

test_http.py already checks that every route refuses a missing or wrong token
on one daemon; here two daemons (two sandboxes) with their own tokens, near-miss tokens,
and many slow clients holding connections while a trainer still gets served.
"""

from __future__ import annotations

import http.client
import socket
import threading

import pytest

from tests.integration.execd.test_http import ROUTES
from tests.support.execd_daemon import Daemon

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    a = Daemon(tmp_path_factory.mktemp("sandbox-a"))
    b = Daemon(tmp_path_factory.mktemp("sandbox-b"))
    yield a, b
    a.stop()
    b.stop()


def _status(port: int, method: str, path: str, token: str | bytes | None) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    headers: dict[str, str | bytes] = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = (
            b"Bearer " + token if isinstance(token, bytes) else f"Bearer {token}"
        )
    try:
        conn.request(method, path, body=b"{}", headers=headers)
        return conn.getresponse().status
    finally:
        conn.close()


def test_a_sandbox_token_does_not_open_another_sandbox(two):
    a, b = two
    for route in ROUTES:
        assert _status(b.port, "POST", route, a.token) == 401, route
        assert _status(a.port, "POST", route, b.token) == 401, route
    # and each token still opens its own sandbox
    assert _status(a.port, "POST", "/v1/heartbeat", a.token) == 200
    assert _status(b.port, "POST", "/v1/heartbeat", b.token) == 200


@pytest.mark.parametrize(
    "mangle",
    [
        lambda t: t[:-1],
        lambda t: t + "0",
        lambda t: t.upper(),
        lambda t: "x" + t,
        lambda t: t[1:],
        lambda t: t[: len(t) // 2],
        lambda t: t + "\x00",
        lambda t: (t.encode() + b"\xff").decode("latin-1"),
    ],
)
def test_near_miss_tokens_are_refused_on_every_route(two, mangle):
    a, _ = two
    token = mangle(a.token)
    for route in [*ROUTES, "/v1/info"]:
        status = _status(a.port, "POST" if route != "/v1/info" else "GET", route, token)
        assert status in (400, 401), (route, status)


def test_invalid_utf8_authorization_header_is_refused(two):
    a, _ = two
    for route in ROUTES:
        assert _status(a.port, "POST", route, a.token.encode() + b"\xff\xfe") in (400, 401)
    assert _status(a.port, "POST", "/v1/heartbeat", a.token) == 200


def test_many_slow_clients_do_not_starve_a_trainer(tmp_path):
    """60 connections that send half a request and stall; a trainer's exec still answers."""
    d = Daemon(tmp_path, args=["--request-timeout", "2", "--idle-timeout", "5"])
    socks: list[socket.socket] = []
    try:
        for _ in range(60):
            s = socket.create_connection(("127.0.0.1", d.port), timeout=10)
            s.sendall(b"POST /v1/exec HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
            socks.append(s)
        c = d.client()
        # answered while every stalled connection still holds its slot (its 2 s request
        # timeout has not cut it off: the client's own timeout would fail this first)
        assert c.exec("echo alive")["stdout"] == "alive\n"
        closed = []

        def drain(s: socket.socket) -> None:
            try:
                closed.append(s.recv(100) is not None)
            except OSError:
                closed.append(True)

        threads = [threading.Thread(target=drain, args=(s,)) for s in socks]
        for t in threads:
            t.start()
        for t in threads:
            t.join(15)
        assert len(closed) == 60  # every stalled request was cut off by the server
    finally:
        for s in socks:
            s.close()
        d.stop()
