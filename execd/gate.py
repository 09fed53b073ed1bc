"""The door of the HTTP server: strangers get a short total deadline and a small pen.

Why: a connection that has not shown the token costs a thread and a socket, and
before this gate one shared cap (256) and a per-byte timeout were all that stood
between a token-less flood and the trainer. 300 idle sockets took every slot
and the trainer's next call got a 503; a byte a second kept a slot forever.

So every new connection starts *pending*: it must finish its first request
head within one deadline counted from accept (a socket timeout would restart
on every byte; this one does not), and at most ``cap`` connections may be
pending at once. When the pen is full the OLDEST pending connection is cut,
never the newcomer, so a trainer connecting in the middle of a flood is read
at once instead of refused. A connection whose head carries the token leaves
the pen (``admit``) for the server's own slots, which only token holders can
take. One watchdog thread enforces every deadline by shutting the socket
down, which wakes the handler thread blocked in ``recv`` with an EOF.
"""

from __future__ import annotations

import socket
import threading
import time

from .errors import suppress

TYPE_CHECKING = False  # no typing at run time (see execd/__init__.py)
if TYPE_CHECKING:
    from typing import Any, Dict


class Gate:
    """Pending (not yet authenticated) connections: a deadline each, at most ``cap``."""

    def __init__(self, cap: int, deadline_s: float) -> None:
        if cap < 1 or deadline_s <= 0:
            raise ValueError("the gate needs a cap >= 1 and a positive deadline")
        self.cap = cap
        self.deadline_s = deadline_s
        self._cond = threading.Condition()
        # socket -> deadline; a dict keeps arrival order, so the first is the oldest
        self._pending: Dict[Any, float] = {}
        self.cut = 0  # connections closed by deadline or eviction (for /v1/info and tests)
        threading.Thread(target=self._watch, name="execd-gate", daemon=True).start()

    def enter(self, sock: Any) -> None:
        """A new connection: pen it, cutting the oldest pending one if the pen is full."""
        with self._cond:
            while len(self._pending) >= self.cap:
                self._cut(next(iter(self._pending)))
            self._pending[sock] = time.monotonic() + self.deadline_s
            self._cond.notify()

    def admit(self, sock: Any) -> bool:
        """The head carried the token: no deadline any more. False if it was already cut."""
        with self._cond:
            return self._pending.pop(sock, None) is not None

    def leave(self, sock: Any) -> None:
        """The connection is over (whatever its state)."""
        with self._cond:
            self._pending.pop(sock, None)

    def pending(self) -> int:
        with self._cond:
            return len(self._pending)

    def _cut(self, sock: Any) -> None:
        del self._pending[sock]
        self.cut += 1
        with suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)

    def _watch(self) -> None:
        with self._cond:
            while True:
                now = time.monotonic()
                for sock in [s for s, deadline in self._pending.items() if deadline <= now]:
                    self._cut(sock)
                if self._pending:
                    # the oldest entry has the nearest deadline (all deadlines are equal length)
                    nearest = next(iter(self._pending.values()))
                    self._cond.wait(max(nearest - now, 0.01))
                else:
                    self._cond.wait()
