"""The shared pod cache behind KubeBackend.watch_ready (a fix the scale run called for).

A fake Kube at the seam: list_pods/watch_pods/get_pod with scripted events.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

import pytest

from broker.backends.base import LABEL_INSTALLATION
from broker.errors import KubeUnavailable
from broker.kube.backend import KubeBackend

pytestmark = pytest.mark.unit


def pod(name: str, *, ready: bool = False, rv: str = "1") -> dict[str, Any]:
    return {
        "metadata": {
            "name": name,
            "namespace": "ns",
            "resourceVersion": rv,
            "labels": {LABEL_INSTALLATION: "inst"},
        },
        "status": {
            "phase": "Running" if ready else "Pending",
            "podIP": "10.0.0.1" if ready else None,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


class FakeKube:
    def __init__(self, listed: list[dict[str, Any]], fail_list: bool = False) -> None:
        self.listed = listed
        self.fail_list = fail_list
        self.events: queue.Queue[tuple[str, dict[str, Any]]] = queue.Queue()
        self.gets: list[str] = []
        self.lists = 0
        self.watch_selectors: list[str] = []

    def list_pods(self, namespace: str, selector: str) -> tuple[list[dict[str, Any]], str]:
        self.lists += 1
        if self.fail_list:
            raise KubeUnavailable("down")
        return list(self.listed), "1"

    def watch_pods(self, namespace: str, **kw: Any):  # type: ignore[no-untyped-def]
        self.watch_selectors.append(kw.get("label_selector", "") or kw.get("field_selector", ""))
        deadline = time.monotonic() + min(kw.get("timeout_s", 1.0), 1.0)
        while time.monotonic() < deadline:
            try:
                yield self.events.get(timeout=0.05)
            except queue.Empty:
                continue

    def get_pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        self.gets.append(name)
        return next((p for p in self.listed if p["metadata"]["name"] == name), None)


def backend(kube: FakeKube) -> KubeBackend:
    return KubeBackend(kube, installation="inst", execd_port=8080)  # type: ignore[arg-type]


def test_waiter_sees_current_state_then_the_ready_event() -> None:
    kube = FakeKube([pod("a")])
    b = backend(kube)
    got: list[bool] = []

    def wait() -> None:
        for info in b.watch_ready("ns", {"a"}, 5.0):
            got.append(info.ready)
            if info.ready:
                return

    t = threading.Thread(target=wait)
    t.start()
    time.sleep(0.3)
    kube.events.put(("MODIFIED", pod("a", ready=True, rv="2")))
    t.join(5)
    assert got == [False, True]
    assert kube.gets == []  # served from the cache: no per-pod read
    assert kube.watch_selectors[0] == f"{LABEL_INSTALLATION}=inst"


def test_pod_not_yet_in_cache_is_read_back_once_and_deletion_is_reported() -> None:
    kube = FakeKube([])
    b = backend(kube)
    assert b.pod_cache("ns").synced_event.wait(2)
    kube.listed.append(pod("late"))  # created after the list; the watch has not shown it
    seen: list[str] = []

    def wait() -> None:
        for info in b.watch_ready("ns", {"late"}, 5.0):
            seen.append(info.reason or info.phase)
            if info.reason == "Deleted":
                return

    t = threading.Thread(target=wait)
    t.start()
    time.sleep(0.3)
    kube.events.put(("ADDED", pod("late", rv="2")))
    kube.events.put(("DELETED", pod("late", rv="3")))
    t.join(5)
    assert kube.gets == ["late"]
    assert seen[0] == "Pending" and seen[-1] == "Deleted"


def test_unsynced_cache_falls_back_to_a_direct_read() -> None:
    kube = FakeKube([pod("a", ready=True)], fail_list=True)
    b = backend(kube)
    infos = []
    for info in b.watch_ready("ns", {"a"}, 2.5):
        infos.append(info)
        if info.ready:
            break
    assert infos and infos[-1].ready
    assert kube.gets == ["a"]  # the per-pod path
