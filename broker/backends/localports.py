"""Loopback ports of local sandboxes: one lock file per port, held by a sandbox's name.

A claim is ``O_CREAT | O_EXCL`` of ``.ports/<port>`` (concurrent workers never share a
port) whose content is the sandbox's name, written before that sandbox's record exists.
So a lock always says whose it is: the sandbox's delete releases exactly the lock that
names it (never one another sandbox took since), and a lock whose sandbox has neither a
record nor a running process (its creator died between the claim and the record) is
found stale by the next claim that collides with it, once it is older than any claim's
first steps could take.
"""

from __future__ import annotations

import contextlib
import os
import random
import socket
import time
from collections.abc import Callable
from pathlib import Path

from broker.errors import KubeUnavailable

# Below Linux's default ephemeral range (32768-60999): a port picked there could be taken
# as the source port of any outgoing connection between our pick and execd's bind (one
# sandbox in ~10,000 failed to start that way under the load run).
PORT_RANGE = (20000, 32000)
# A lock this old whose sandbox has no record and no process is a dead claim's: a live
# claim writes its record within milliseconds of taking the lock.
STALE_S = 300.0


def _listener(port: int) -> socket.socket | None:
    """A socket bound to 127.0.0.1:``port`` and listening, or None if the port is taken.

    The backend binds it here, in the host's network namespace, and hands it to execd,
    which runs in the sandbox's own: so the port is never free between a pick and a bind.
    """
    sock = socket.socket()
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as execd's own bind did
        sock.bind(("127.0.0.1", port))
        sock.listen(128)
    except OSError:
        sock.close()
        return None
    return sock


class PortLocks:
    """The ``.ports`` folder of one state dir's local sandboxes."""

    def __init__(self, folder: Path, orphaned: Callable[[str], bool]) -> None:
        """``orphaned(name)``: True when sandbox ``name`` has no record and no process."""
        self.folder = folder
        self.orphaned = orphaned

    def holder(self, port: int) -> str | None:
        try:
            return (self.folder / str(port)).read_text()
        except OSError:
            return None

    def held_by(self, name: str) -> list[int]:
        """Every port whose lock names ``name`` (one, unless a crash left another)."""
        if not self.folder.exists():
            return []
        return sorted(
            int(p.name) for p in self.folder.iterdir() if p.name.isdigit() and self._is(p, name)
        )

    @staticmethod
    def _is(path: Path, name: str) -> bool:
        with contextlib.suppress(OSError):
            return path.read_text() == name
        return False

    def claim(self, name: str) -> tuple[int, socket.socket]:
        """A loopback port no other sandbox holds, locked for ``name``, and the listening
        socket bound to it (the caller passes it on to execd, then closes its copy)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        rng = random.SystemRandom()
        for _ in range(500):
            port = rng.randrange(*PORT_RANGE)
            path = self.folder / str(port)
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
            except FileExistsError:
                self._free_if_stale(path)
                continue
            try:
                os.write(fd, name.encode())
            finally:
                os.close(fd)
            sock = _listener(port)
            if sock is not None:
                return port, sock
            self.release(port, name)
        raise KubeUnavailable("no free loopback port for a local sandbox")

    def release(self, port: int, name: str) -> None:
        """Free ``port`` if ``name`` holds it. Callers serialise per sandbox (the delete
        holds the sandbox's record lock), so no second release of the same name races
        this one into a lock claimed meanwhile by another sandbox."""
        path = self.folder / str(port)
        if self._is(path, name):
            path.unlink(missing_ok=True)

    def _free_if_stale(self, path: Path) -> None:
        try:
            age = time.time() - path.stat().st_mtime
            holder = path.read_text()
        except OSError:
            return
        if age > STALE_S and (not holder or self.orphaned(holder)):
            with contextlib.suppress(OSError):
                if path.read_text() == holder:
                    path.unlink()
