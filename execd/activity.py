"""What the broker's idle reclaim asks: when did a caller last use this sandbox.

Activity is an authenticated request that does something (an exec, a run, a file call,
a session call...), counted from its start to its END: a command that runs for an hour
is an hour of activity, and so is a streamed run until its stream closes. Status reads
do not count (``/healthz``, ``/v1/info``, ``/v1/heartbeat``, and ``/v1/reclaim`` itself):
a trainer that only keeps its lease alive is idle. Processes a command left running in
the background do not count either, or any agent could pin a sandbox forever.

The broker never polls this: it keeps each held sandbox's earliest possible idle
deadline and asks only when one passes (``broker.acquire.idle``). Its question,
``POST /v1/reclaim``, is answered atomically here: under the same lock that every call
takes to begin, the sandbox is either reclaimed (no call running, idle long enough; from
then on every call is refused with 410 ``reclaimed``) or not, with how long it has been
idle, so the broker can push its deadline to exactly ``last activity + timeout``.
"""

from __future__ import annotations

import threading
import time

from . import errors

TYPE_CHECKING = False  # no typing at run time (see execd/__init__.py)
if TYPE_CHECKING:
    from typing import Any, Callable, Dict, Iterable, Iterator, Optional

# Reads that only observe: they never keep a sandbox alive.
STATUS_PATHS = frozenset({"/healthz", "/v1/info", "/v1/heartbeat", "/v1/reclaim"})


class Activity:
    """The last time a call ended (or began), the calls running now, and the verdict."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last = time.monotonic()
        self._running = 0
        self.reclaimed_after: Optional[float] = None  # the idle seconds it was reclaimed at

    def begin(self, path: str) -> bool:
        """A call to ``path`` starts: True when it counts (the caller must ``end`` it).
        Refused once the sandbox is reclaimed, whatever the path (but the broker's own
        ``/v1/reclaim``, which stays idempotent)."""
        with self._lock:
            if self.reclaimed_after is not None and path != "/v1/reclaim":
                raise errors.Gone(
                    "this sandbox was reclaimed after %.0f s idle; acquire another"
                    % self.reclaimed_after
                )
            if path in STATUS_PATHS:
                return False
            self._running += 1
            self._last = time.monotonic()
            return True

    def end(self) -> None:
        with self._lock:
            self._running -= 1
            self._last = time.monotonic()

    def wrap(self, chunks: Iterable[bytes]) -> "Tracked":
        """A streamed reply: the call is running until its stream ends or is closed."""
        return Tracked(chunks, self.end)

    def reclaim(self, timeout_s: float, held_s: float) -> Dict[str, Any]:
        """Reclaim if no call runs and the sandbox was idle ``timeout_s`` (counting no
        earlier than its hand-out, ``held_s`` ago); idempotent once reclaimed."""
        with self._lock:
            idle = min(time.monotonic() - self._last, held_s)
            if self.reclaimed_after is None and self._running == 0 and idle >= timeout_s:
                self.reclaimed_after = idle
            return {
                "reclaimed": self.reclaimed_after is not None,
                "idle_s": round(idle, 3),
                "running": self._running,
            }


class Tracked:
    """An iterator of reply chunks that ends its call exactly once: when it is exhausted,
    fails, or is closed (the server closes a stream whatever happens)."""

    def __init__(self, chunks: Iterable[bytes], end: Callable[[], None]) -> None:
        self._it = iter(chunks)
        self._end: Optional[Callable[[], None]] = end

    def __iter__(self) -> Iterator[bytes]:
        return self

    def __next__(self) -> bytes:
        try:
            return next(self._it)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        end, self._end = self._end, None
        if end is None:
            return
        try:
            close = getattr(self._it, "close", None)
            if close is not None:
                close()
        finally:
            end()
