"""A token-less connection flood against live sandboxes' execd (issue 20): bounded, loopback.

What a hostile neighbour (or a buggy client) on the host can do to an execd without its
token: hold sockets open. Half of the connections stay idle after connecting; the other
half are slow-loris ones, sending a request head one byte a second and never finishing
it. Every connection the server cuts (its gate: a total head deadline and a pen of
pending connections whose oldest is cut first, execd/gate.py) is replaced at once, so
the pressure stays at ``conns`` open sockets for the whole ``seconds``.

Bounded in every way the workplace asks: only 127.0.0.1, at most ``conns`` sockets at
once, at most ``conns * MAX_ROUNDS`` connects in all, stopped after ``seconds``.
"""

from __future__ import annotations

import contextlib
import json
import selectors
import socket
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

HEAD = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "
# Connects per socket slot, at most: bounds the whole flood. A full pen evicts at about
# 1,000 connects a second on this VM (2 cores), so 15 s need ~50 rounds of 300.
MAX_ROUNDS = 100
TICK_S = 0.25


def live_execd_ports(local_pods: Path) -> list[int]:
    """The loopback ports of the sandboxes whose record says they started (a pid)."""
    ports = []
    for path in sorted(local_pods.glob("*.json")):
        with contextlib.suppress(OSError, ValueError, AttributeError, TypeError):
            meta = json.loads(path.read_text())
            if meta.get("pid") and meta.get("port"):
                ports.append(int(meta["port"]))
    return ports


class _Conn:
    __slots__ = ("sent", "slow", "sock")

    def __init__(self, sock: socket.socket, slow: bool) -> None:
        self.sock, self.slow, self.sent = sock, slow, 0


def flood(targets: Callable[[], list[int]], seconds: float, conns: int = 300) -> Counter[str]:
    """Hold ``conns`` token-less connections (half idle, half slow-loris) spread over the
    ports ``targets()`` names (asked again every second: sandboxes come and go) for
    ``seconds``; counts of what happened (opened, cut by the server, ...)."""
    stats: Counter[str] = Counter()
    ports = targets()
    sel = selectors.DefaultSelector()
    live: dict[int, _Conn] = {}
    budget = conns * MAX_ROUNDS
    end = time.monotonic() + seconds
    next_byte = time.monotonic()
    i = 0
    try:
        while time.monotonic() < end:
            while ports and len(live) < conns and budget > 0:
                budget -= 1
                port, slow = ports[i % len(ports)], i % 2 == 1
                i += 1
                try:
                    sock = socket.create_connection(("127.0.0.1", port), timeout=0.5)
                except OSError:  # its sandbox is gone: aim at the others until the refresh
                    stats["connect_failed"] += 1
                    ports = [p for p in ports if p != port]
                    continue
                sock.setblocking(False)
                live[sock.fileno()] = _Conn(sock, slow)
                sel.register(sock, selectors.EVENT_READ)
                stats["opened"] += 1
            for key, _ in sel.select(timeout=TICK_S):
                conn = live.pop(key.fd)
                sel.unregister(conn.sock)
                try:
                    stats["answered" if conn.sock.recv(4096) else "cut"] += 1
                except OSError:
                    stats["reset"] += 1
                conn.sock.close()
            if time.monotonic() >= next_byte:  # once a second: slow-loris bytes, new targets
                next_byte += 1.0
                ports = targets()
                for conn in list(live.values()):
                    if conn.slow:
                        chunk = HEAD[conn.sent : conn.sent + 1] or b"a"
                        with contextlib.suppress(OSError):
                            conn.sock.send(chunk)
                            conn.sent += 1
    finally:
        stats["held_at_end"] = len(live)
        stats["budget_left"] = budget
        for conn in live.values():
            conn.sock.close()
        sel.close()
    return stats
