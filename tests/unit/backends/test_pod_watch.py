"""The shared pod watch, driven through a fake stream at the Kube seam.

The real API server path (including a cut stream) is covered in
tests/cluster/test_provider_cluster.py; here the bookkeeping is pinned down exactly.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from broker.backends.base import PodInfo
from broker.backends.kube import watcher
from broker.backends.kube.backend import pod_info
from broker.backends.kube.watcher import PodWatch
from broker.errors import KubeUnavailable
from tests.support.wait import wait_until

pytestmark = pytest.mark.unit

CUT = object()


class FakeKube:
    def __init__(self) -> None:
        self.events: queue.Queue[Any] = queue.Queue()
        self.streams = 0

    def current_version(self, namespace: str, selector: str) -> str:
        return "1"

    def watch_pods(self, namespace: str, **kw: Any) -> Iterator[tuple[str, dict[str, Any]]]:
        self.streams += 1
        deadline = time.monotonic() + kw["timeout_s"]
        while time.monotonic() < deadline:
            try:
                item = self.events.get(timeout=0.05)
            except queue.Empty:
                continue
            if item is CUT:
                raise KubeUnavailable("stream cut")
            yield item


def pod(name: str, version: int, *, ready: bool) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": "ns", "resourceVersion": str(version)},
        "status": {
            "phase": "Running",
            "podIP": "10.0.0.1",
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


@pytest.fixture
def kube() -> FakeKube:
    return FakeKube()


@pytest.fixture
def watch(kube: FakeKube) -> Iterator[PodWatch]:
    w = PodWatch(kube, "ns", "sel", lambda p: pod_info(p, 8080))  # type: ignore[arg-type]
    wait_until(lambda: w._connected, 5, 0.01, "the watch to connect")
    yield w
    w.close()


def settled(watch: PodWatch, name: str) -> None:
    """Wait until the watch thread has taken in ``name``'s latest event."""

    def taken_in() -> bool:
        with watch._lock:
            return name in watch._latest

    wait_until(taken_in, 10, 0.01, f"the event for {name} to be processed")


def reads_of(store: dict[str, PodInfo | None], calls: list[str]) -> Any:
    def read(name: str) -> PodInfo | None:
        calls.append(name)
        return store.get(name)

    return read


def test_events_reach_the_waiter_without_reads(kube: FakeKube, watch: PodWatch) -> None:
    calls: list[str] = []
    kube.events.put(("ADDED", pod("a", 2, ready=False)))
    settled(watch, "a")
    seen: list[bool] = []

    def follow() -> None:
        for info in watch.follow("a", time.monotonic() + 5, reads_of({}, calls)):
            assert info is not None
            seen.append(info.ready)
            if info.ready:
                return

    t = threading.Thread(target=follow)
    t.start()
    time.sleep(0.2)
    kube.events.put(("MODIFIED", pod("a", 3, ready=True)))
    t.join(5)
    assert seen[-1] is True  # [False, True] unless the thread started late
    assert calls == []


def test_a_cut_stream_makes_waiters_read(kube: FakeKube, watch: PodWatch) -> None:
    calls: list[str] = []
    truth: dict[str, PodInfo | None] = {"b": pod_info(pod("b", 5, ready=True), 8080)}
    kube.events.put(("ADDED", pod("b", 2, ready=False)))
    settled(watch, "b")
    got: list[PodInfo | None] = []

    def follow() -> None:
        for info in watch.follow("b", time.monotonic() + 5, reads_of(truth, calls)):
            got.append(info)
            if info is not None and info.ready:
                return

    t = threading.Thread(target=follow)
    t.start()
    time.sleep(0.2)
    kube.events.put(CUT)  # the Ready event is lost with the stream
    t.join(5)
    assert got[-1] is not None and got[-1].ready
    assert calls == ["b"]
    assert kube.streams >= 2


def test_deleted_event_ends_wait_gone_without_reads(kube: FakeKube, watch: PodWatch) -> None:
    calls: list[str] = []
    kube.events.put(("ADDED", pod("c", 2, ready=True)))
    settled(watch, "c")
    timer = threading.Timer(0.2, kube.events.put, args=(("DELETED", pod("c", 3, ready=True)),))
    timer.start()
    assert watch.wait_gone("c", 5, reads_of({}, calls)) is True
    assert calls == []


def test_old_events_are_forgotten(
    kube: FakeKube, watch: PodWatch, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(watcher, "KEEP_S", 0.2)
    for i in range(5):
        kube.events.put(("ADDED", pod(f"old-{i}", 10 + i, ready=True)))
    settled(watch, "old-4")
    time.sleep(0.5)
    kube.events.put(("ADDED", pod("new", 20, ready=True)))
    settled(watch, "new")
    with watch._lock:
        assert list(watch._latest) == ["new"]


def test_a_stream_line_of_a_pod_nobody_here_wants_is_left_unparsed() -> None:
    from broker.backends.kube.api import _event

    line = json.dumps({"type": "MODIFIED", "object": pod("sm-other", 42, ready=True)})
    compact = line.replace(": ", ":").replace(", ", ",").encode()
    assert _event(compact, lambda name: name == "sm-mine") == {
        "type": "SKIPPED",
        "object": {"metadata": {"resourceVersion": "42"}},
    }
    assert _event(compact, lambda name: name == "sm-other") == json.loads(line)
    assert _event(compact, None) == json.loads(line)


def test_the_watch_keeps_the_pods_this_process_creates_or_waits_for() -> None:
    kube = FakeKube()
    watch = PodWatch(kube, "ns", "sel", lambda obj: pod_info(obj, 8080))  # type: ignore[arg-type]
    try:
        assert not watch._wanted("sm-a")
        watch.expect("sm-a")
        assert watch._wanted("sm-a") and not watch._wanted("sm-b")
        waiter = watch._register("sm-b")
        assert watch._wanted("sm-b") and waiter.count == 1
        watch._unregister("sm-b")
        assert not watch._wanted("sm-b")
    finally:
        watch.close()
