"""Strangers cannot stall execd: a token-less flood or a slow-loris head never starves the trainer.

Every test runs a real daemon on 127.0.0.1 and stays bounded in connections (a few
hundred) and in time (a loop of fixed length, never a wall-clock assertion).
"""

import contextlib
import socket
import threading

import httpx
import pytest

from broker.wire.execd import Endpoint, exec_call
from tests.support.execd_daemon import Daemon

pytestmark = pytest.mark.integration
IDLE = 300
LORIS = 10


def _closed_by_server(sock: socket.socket, drip: bytes, rounds: int, every_s: float) -> bool:
    """Send ``drip`` every ``every_s`` for up to ``rounds`` rounds; True once the server hung up."""
    sock.settimeout(every_s)
    for _ in range(rounds):
        try:
            if sock.recv(1024) == b"":
                return True
        except TimeoutError:
            pass
        except OSError:  # reset by the peer: closed too
            return True
        try:
            sock.sendall(drip)
        except OSError:
            return True
    return False


def test_trainer_is_served_through_a_tokenless_flood(tmp_path):
    d = Daemon(tmp_path)  # the flags a sandbox is started with
    strangers: list[socket.socket] = []
    stop = threading.Event()

    def drip() -> None:  # slow-loris heads: a byte a second, at most a minute
        for _ in range(60):
            if stop.wait(1.0):
                return
            for s in strangers[IDLE:]:
                with contextlib.suppress(OSError):
                    s.sendall(b"X")

    dripper = threading.Thread(target=drip, daemon=True)
    try:
        for _ in range(IDLE):
            strangers.append(socket.create_connection(("127.0.0.1", d.port), timeout=10))
        for _ in range(LORIS):
            s = socket.create_connection(("127.0.0.1", d.port), timeout=10)
            s.sendall(b"POST /v1/exec HTTP/1.1\r\nX-Slow: ")
            strangers.append(s)
        dripper.start()
        endpoint = Endpoint(f"127.0.0.1:{d.port}", d.token)
        for i in range(3):  # a fresh connection each time: the trainer's worst case
            with httpx.Client() as http:
                reply = endpoint.send(http, exec_call(f"echo served {i}"))
            assert reply["stdout"] == f"served {i}\n"
    finally:
        stop.set()
        if dripper.is_alive():
            dripper.join()
        for s in strangers:
            s.close()
        d.stop()


@pytest.mark.parametrize(
    "args",
    [
        ["--head-timeout", "1"],
        # the deadline is never longer than the per-read request timeout, and it is a
        # TOTAL: a byte every 0.5 s no longer keeps a 2 s timeout from firing
        ["--request-timeout", "2"],
    ],
)
def test_slow_loris_head_is_cut_after_the_total_deadline(tmp_path, args):
    d = Daemon(tmp_path, args=args)
    try:
        with socket.create_connection(("127.0.0.1", d.port), timeout=10) as s:
            s.sendall(b"POST /v1/exec HTTP/1.1\r\n")
            # 40 rounds of 0.5 s: far past the deadline, each round a fresh header byte
            assert _closed_by_server(s, b"X", rounds=40, every_s=0.5)
        # the daemon still serves the token holder afterwards
        c = d.client()
        assert c.exec("echo ok")["stdout"] == "ok\n"
    finally:
        d.stop()


def test_token_holder_keeps_its_connection_past_the_head_deadline(tmp_path):
    d = Daemon(tmp_path, args=["--head-timeout", "0.5"])
    try:
        c = d.client()
        assert c.exec("sleep 1; echo 1")["stdout"] == "1\n"
        sock = c.conn.sock
        assert c.exec("sleep 1; echo 2")["stdout"] == "2\n"
        assert c.conn.sock is sock  # same keep-alive connection: it left the gate
    finally:
        d.stop()


def test_a_stranger_gets_one_answer_then_the_door_closes(daemon):
    with socket.create_connection(("127.0.0.1", daemon.port), timeout=10) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        data = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    assert data.startswith(b"HTTP/1.1 200 ") and b"Connection: close" in data
