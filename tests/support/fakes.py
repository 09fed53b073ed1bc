"""An in-memory Backend for unit tests of the ownership protocol (a fake at the seam).

Faults are queued per operation: ``backend.faults["create"].append("5xx-after-store")``.
"""

from __future__ import annotations

import datetime as dt
from collections import defaultdict
from collections.abc import Iterator

from broker.backends.base import PodInfo, PodSpec, PrePullInfo, PrePullSpec
from broker.errors import (
    ImageNotFound,
    KubeConflict,
    KubeThrottled,
    KubeUnavailable,
    OwnershipError,
)


class FakeBackend:
    name = "fake"

    def __init__(self) -> None:
        self.pods: dict[tuple[str, str], PodInfo] = {}
        self.faults: dict[str, list[str]] = defaultdict(list)
        self.calls: list[str] = []
        self.guards: set[tuple[str, str]] = set()
        self.owners: set[tuple[str, str]] = set()
        self.become_ready = True
        self.deny_guard_install = False
        self.missing_images: set[str] = set()
        self.prepulled: dict[str, PrePullInfo] = {}

    def _fault(self, op: str) -> str | None:
        return self.faults[op].pop(0) if self.faults[op] else None

    def ensure_job_owner(self, namespace: str, job: str) -> None:
        self.owners.add((namespace, job))

    def ensure_egress_guard(self, namespace: str, job: str, allow: list[str]) -> None:
        if not self.deny_guard_install:
            self.guards.add((namespace, job))

    def has_egress_guard(self, namespace: str, job: str) -> bool:
        return (namespace, job) in self.guards

    def resolve_image(self, image: str, digest: str | None) -> str | None:
        if image in self.missing_images or digest in self.missing_images:
            raise ImageNotFound(f"image {image} is not in the fake store")
        return digest

    def pull_record(self, info: PodInfo) -> PodInfo:
        return info

    def ensure_prepull(self, namespace: str, want: PrePullSpec) -> str:
        name = f"prepull-{want.job}-{want.image}"
        self.prepulled[name] = PrePullInfo(name, want.job, want.image, desired=1, ready=1)
        return name

    def prepulls(self, namespace: str) -> list[PrePullInfo]:
        return sorted(self.prepulled.values(), key=lambda p: p.name)

    def remove_prepull(self, namespace: str, info: PrePullInfo) -> None:
        self.prepulled.pop(info.name, None)

    def add_pod(
        self, namespace: str, name: str, labels: dict[str, str], ready: bool = True
    ) -> None:
        self.pods[(namespace, name)] = PodInfo(
            name=name,
            namespace=namespace,
            labels=labels,
            phase="Running",
            ready=ready,
            ip="10.0.0.1",
            address="10.0.0.1:8080",
            created_at=dt.datetime.now(dt.UTC),
        )

    def create(self, spec: PodSpec) -> PodInfo:
        self.calls.append(f"create {spec.name}")
        fault = self._fault("create")
        if fault == "reset-before-store":
            raise KubeUnavailable("connection reset")
        if fault == "429":
            raise KubeThrottled("slow down", retry_after=1.5)
        if (spec.namespace, spec.name) in self.pods:
            raise KubeConflict("exists", status=409)
        self.add_pod(spec.namespace, spec.name, spec.labels(), ready=self.become_ready)
        if fault == "5xx-after-store":
            raise KubeUnavailable("HTTP 500", status=500)
        return self.pods[(spec.namespace, spec.name)]

    def get(self, namespace: str, name: str) -> PodInfo | None:
        self.calls.append(f"get {name}")
        if self._fault("get") == "unavailable":
            raise KubeUnavailable("read failed")
        return self.pods.get((namespace, name))

    def delete(self, namespace: str, name: str, nonce: str) -> bool:
        self.calls.append(f"delete {name}")
        if self._fault("delete") == "unavailable":
            raise KubeUnavailable("delete failed", status=503)
        pod = self.pods.get((namespace, name))
        if pod is None:
            return True
        if pod.nonce != nonce:
            raise OwnershipError("nonce mismatch")
        del self.pods[(namespace, name)]
        return True

    def list_installation(self, namespace: str, installation: str) -> list[PodInfo]:
        return [p for p in self.pods.values() if p.installation == installation]

    def wait_gone(self, namespace: str, name: str, timeout_s: float) -> bool:
        return self.get(namespace, name) is None

    def list_all_labelled(self, namespace: str) -> list[PodInfo]:
        return [p for p in self.pods.values() if p.nonce]

    def watch_ready(self, namespace: str, names: set[str], timeout_s: float) -> Iterator[PodInfo]:
        for name in names:
            pod = self.pods.get((namespace, name))
            if pod is None:
                yield PodInfo(
                    name=name,
                    namespace=namespace,
                    labels={},
                    phase="Failed",
                    ready=False,
                    reason="Deleted",
                )
            else:
                yield pod
