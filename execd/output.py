"""Bounded capture of one output stream: a head buffer plus a ring of the tail.

A command may print gigabytes; the daemon must neither exhaust its memory nor
lose the two ends an agent needs (the first lines name the command, the last
lines hold the error). So the first ``cap // 2`` bytes are kept as they come,
the rest flows through a tail buffer trimmed to the last ``cap - cap // 2``
bytes, and the true byte count is kept alongside. Memory stays under ~2 * cap.
"""

from __future__ import annotations

import os

TYPE_CHECKING = False  # no typing at run time (see execd/__init__.py)
if TYPE_CHECKING:
    from typing import Optional

DEFAULT_MAX_OUTPUT = 1024 * 1024


def read_pipe(fd: int) -> Optional[bytes]:
    """One read of a non-blocking pipe: bytes, b"" at EOF (or a dead fd), None if empty now."""
    try:
        return os.read(fd, 65536)
    except BlockingIOError:
        return None
    except OSError:
        return b""


class BoundedCapture:
    __slots__ = ("_head", "_head_cap", "_tail", "_tail_cap", "total")

    def __init__(self, cap: int) -> None:
        self._head_cap = cap // 2
        self._tail_cap = cap - self._head_cap
        self._head = bytearray()
        self._tail = bytearray()
        self.total = 0

    def feed(self, data: bytes) -> None:
        self.total += len(data)
        room = self._head_cap - len(self._head)
        if room > 0:
            self._head += data[:room]
            data = data[room:]
            if not data:
                return
        if self._tail_cap <= 0:
            return
        self._tail += data
        # Trim lazily (amortised O(1) per byte): only when twice the cap.
        if len(self._tail) > 2 * self._tail_cap:
            del self._tail[: len(self._tail) - self._tail_cap]

    @property
    def truncated(self) -> bool:
        return self.total > len(self._head) + min(len(self._tail), self._tail_cap)

    def raw(self) -> bytes:
        """The kept bytes (all of them unless truncated)."""
        tail = bytes(self._tail[-self._tail_cap :]) if self._tail_cap > 0 else b""
        return bytes(self._head) + tail

    def text(self) -> str:
        """The kept bytes decoded leniently, with a marker where bytes were dropped."""
        tail = bytes(self._tail[-self._tail_cap :]) if self._tail_cap > 0 else b""
        if not self.truncated:
            return (bytes(self._head) + tail).decode("utf-8", "replace")
        dropped = self.total - len(self._head) - len(tail)
        marker = "\n[... execd: %d bytes omitted ...]\n" % dropped
        return (
            bytes(self._head).decode("utf-8", "replace") + marker + tail.decode("utf-8", "replace")
        )
