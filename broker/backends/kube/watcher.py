"""One namespace-wide pod watch per process, shared by every readiness and delete waiter.

Why: a watch (or a poll) per create costs the API server a new stream per pod and the
broker a connection and a thread's worth of parsing; at thousands of creates that was the
bottleneck of the scale run. Here one thread follows every pod carrying this installation's
label, keeps the latest ``PodInfo`` per name, and wakes only the waiter for that name.

It can never stall a waiter: a waiter reads the pod itself (GET) whenever the shared
stream cannot vouch for it (not connected, reconnected since, or no event seen yet), and
every wait is bounded by the caller's deadline. A 410 Gone or any stream error just
means a fresh list-then-watch and a generation bump, which makes waiters re-read.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from broker.backends.base import PodInfo
from broker.backends.kube.api import Kube
from broker.errors import KubeError

log = logging.getLogger(__name__)

WATCH_WINDOW_S = 30.0  # one stream's lifetime; bounds how long close() can take
FIRST_EVENT_WAIT_S = 0.5  # how long a waiter waits for its first event before reading
MAX_TRACKED = 50_000  # names kept at most, whatever their age
KEEP_S = 120.0  # a pod's last event is kept this long


@dataclass
class _Waiter:
    event: threading.Event = field(default_factory=threading.Event)
    count: int = 0


class PodWatch:
    """Follows pods matching ``selector`` in ``namespace``; see the module docstring."""

    def __init__(
        self,
        kube: Kube,
        namespace: str,
        selector: str,
        to_info: Callable[[dict[str, object]], PodInfo],
    ) -> None:
        self.kube = kube
        self.namespace = namespace
        self.selector = selector
        self.to_info = to_info
        self._lock = threading.Lock()
        self._latest: dict[str, PodInfo | None] = {}  # None: seen deleted; oldest first
        self._seen: dict[str, float] = {}  # name -> monotonic time of its last event
        self._waiters: dict[str, _Waiter] = {}
        self._expected: dict[str, float] = {}  # name -> until (monotonic): see ``expect``
        self._generation = 0
        self._connected = False
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"pod-watch-{namespace}", daemon=True
        )
        self._thread.start()

    # -- the stream ---------------------------------------------------------------------

    def _run(self) -> None:
        backoff = 0.2
        while not self._stop.is_set():
            try:
                version = self._list_version()
                self._reconnected()
                backoff = 0.2
                while not self._stop.is_set():
                    version = self._follow(version)
            except KubeError as exc:
                if exc.status != 410:
                    log.info("pod watch on %s restarting: %s", self.namespace, exc)
            except Exception:  # never let the thread die: waiters would fall back forever
                log.exception("pod watch on %s failed; restarting", self.namespace)
            with self._lock:
                self._connected = False
            self._stop.wait(backoff)
            backoff = min(backoff * 2, 5.0)

    def _list_version(self) -> str:
        return self.kube.current_version(self.namespace, self.selector)

    def _reconnected(self) -> None:
        """Events may have been missed: every current waiter re-reads its pod."""
        with self._lock:
            self._generation += 1
            self._connected = True
            self._latest.clear()
            self._seen.clear()
            for waiter in self._waiters.values():
                waiter.event.set()

    def _follow(self, version: str) -> str:
        for kind, obj in self.kube.watch_pods(
            self.namespace,
            label_selector=self.selector,
            resource_version=version,
            timeout_s=WATCH_WINDOW_S,
            wanted=self._wanted,
        ):
            meta = obj.get("metadata") or {}
            assert isinstance(meta, dict)
            version = str(meta.get("resourceVersion") or version)
            if kind in ("BOOKMARK", "SKIPPED"):
                continue
            name = str(meta.get("name") or "")
            info = None if kind == "DELETED" else self.to_info(obj)
            with self._lock:
                self._forget_old()
                self._latest.pop(name, None)  # re-insert: dict order is age order
                self._latest[name] = info
                self._seen[name] = time.monotonic()
                waiter = self._waiters.get(name)
                if waiter is not None:
                    waiter.event.set()
            if self._stop.is_set():
                break
        return version

    def _forget_old(self) -> None:
        """Drop pods nobody waits for and no event touched for KEEP_S (lock held).

        Waiters only need what happened since their create or delete was sent, so memory
        follows the event rate, not the number of pods (12,000 held pods would otherwise
        sit here for hours). A forgotten pod is simply read (GET) if waited on again."""
        now = time.monotonic()
        while self._latest:
            oldest = next(iter(self._latest))
            if now - self._seen.get(oldest, now) < KEEP_S and len(self._latest) < MAX_TRACKED:
                return
            if oldest in self._waiters and len(self._latest) < MAX_TRACKED:
                self._latest[oldest] = self._latest.pop(oldest)  # still wanted: keep it
                self._seen[oldest] = now
                continue
            del self._latest[oldest]
            self._seen.pop(oldest, None)

    def close(self) -> None:
        self._stop.set()

    # -- interest -----------------------------------------------------------------------

    def expect(self, name: str) -> None:
        """This process is about to create or delete pod ``name``: keep its events.

        Every worker process follows every pod of the installation, most of them another
        process's; only the pods a waiter here follows, or is about to (registered before
        the create or delete is sent, so its first events are kept), are parsed. An
        event skipped for any other pod costs a waiter nothing: one it did not see is
        read by GET, as after a reconnect."""
        now = time.monotonic()
        with self._lock:
            if len(self._expected) > MAX_TRACKED // 10:
                self._expected = {n: t for n, t in self._expected.items() if t > now}
            self._expected[name] = now + KEEP_S

    def _wanted(self, name: str) -> bool:
        """Is pod ``name`` one this process waits for, or is about to? (Unlocked dict reads
        from the stream's thread: a stale answer only costs a waiter a GET.)"""
        return name in self._waiters or self._expected.get(name, 0.0) > time.monotonic()

    # -- waiters ------------------------------------------------------------------------

    def _register(self, name: str) -> _Waiter:
        with self._lock:
            waiter = self._waiters.setdefault(name, _Waiter())
            waiter.count += 1
            return waiter

    def _unregister(self, name: str) -> None:
        with self._lock:
            waiter = self._waiters.get(name)
            if waiter is not None:
                waiter.count -= 1
                if waiter.count <= 0:
                    del self._waiters[name]

    def _known(self, name: str, generation: int) -> tuple[bool, PodInfo | None]:
        """(trusted, latest): trusted only if the stream is up and saw this name since
        ``generation`` began."""
        with self._lock:
            trusted = self._connected and self._generation == generation and name in self._latest
            return trusted, self._latest.get(name)

    def follow(
        self, name: str, deadline: float, read: Callable[[str], PodInfo | None]
    ) -> Iterator[PodInfo | None]:
        """Yield the pod's state now (None: it does not exist), then each change, until it
        is gone or ``deadline`` passes."""
        waiter = self._register(name)
        try:
            with self._lock:
                generation = self._generation
            trusted, info = self._known(name, generation)
            if not trusted:
                waiter.event.wait(max(0.0, min(FIRST_EVENT_WAIT_S, deadline - time.monotonic())))
                waiter.event.clear()
                with self._lock:
                    generation = self._generation
                trusted, info = self._known(name, generation)
            if not trusted:
                info = read(name)
            last = info
            yield last
            while last is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not waiter.event.wait(remaining):
                    return
                waiter.event.clear()
                with self._lock:
                    changed = self._generation != generation
                    generation = self._generation
                trusted, info = self._known(name, generation)
                if changed or not trusted:
                    info = read(name)
                if info != last:
                    last = info
                    yield info
        finally:
            self._unregister(name)

    def wait_gone(self, name: str, timeout_s: float, read: Callable[[str], PodInfo | None]) -> bool:
        """True once the pod no longer exists, False if it still does at the timeout."""
        deadline = time.monotonic() + timeout_s
        for info in self.follow(name, deadline, read):
            if info is None:
                return True
        return read(name) is None
