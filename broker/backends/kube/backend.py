"""Kubernetes implementation of the Backend seam.

Deletes carry a UID precondition taken from a nonce-checked read, so the broker can only
ever delete the exact pod object it proved to be its own. Readiness and delete
confirmation come from one shared watch per process (``broker.backends.kube.watcher``), not
per-pod polling or per-pod watches.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

from broker.backends.base import (
    LABEL_INSTALLATION,
    LABEL_NONCE,
    PodInfo,
    PodSpec,
    PrePullInfo,
    PrePullSpec,
)
from broker.backends.kube import podspec
from broker.backends.kube.api import Kube, load_api_client
from broker.backends.kube.pulls import pull_from_events
from broker.backends.kube.watcher import PodWatch
from broker.errors import (
    KubeConflict,
    KubeError,
    KubeNotFound,
    NamespaceUnavailable,
    OwnershipError,
)
from broker.images import refs
from broker.images.registry import RegistryClient
from broker.names import LABEL_PREPULL, LABEL_PREPULL_JOB
from broker.settings import Settings

log = logging.getLogger(__name__)


def _parse_time(value: str | None) -> dt.datetime | None:
    if not value:
        return None
    return dt.datetime.fromisoformat(value.replace("Z", "+00:00"))


def _seconds(a: dt.datetime | None, b: dt.datetime | None) -> float | None:
    return (b - a).total_seconds() if a and b else None


def pod_info(pod: dict[str, Any], port: int) -> PodInfo:
    """Read a pod dict into the fields the ownership protocol needs."""
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    conditions = {c.get("type"): c for c in status.get("conditions") or []}
    ready = (conditions.get("Ready") or {}).get("status") == "True"
    reason: str | None = status.get("reason")
    detail: str | None = status.get("message")
    started: dt.datetime | None = None
    for cs in status.get("containerStatuses") or []:
        state = cs.get("state") or {}
        waiting, terminated = state.get("waiting"), state.get("terminated")
        if waiting and waiting.get("reason") not in (None, "ContainerCreating"):
            reason, detail = waiting.get("reason"), waiting.get("message")
        if terminated:
            reason = terminated.get("reason") or "Terminated"
        if state.get("running"):
            started = _parse_time(state["running"].get("startedAt"))
    sandbox_ready = _parse_time(
        (conditions.get("PodReadyToStartContainers") or {}).get("lastTransitionTime")
    )
    ready_at = _parse_time((conditions.get("Ready") or {}).get("lastTransitionTime"))
    ip = status.get("podIP")
    return PodInfo(
        name=meta.get("name", ""),
        namespace=meta.get("namespace", ""),
        labels=dict(meta.get("labels") or {}),
        phase=status.get("phase") or "Pending",
        ready=ready,
        ip=ip,
        node=(pod.get("spec") or {}).get("nodeName"),
        deleting=bool(meta.get("deletionTimestamp")),
        created_at=_parse_time(meta.get("creationTimestamp")),
        address=f"{ip}:{port}" if ip else None,
        # 1 s resolution timestamps: pull+create from sandbox-ready to container start.
        image_pull_s=_seconds(sandbox_ready, started),
        start_s=_seconds(started, ready_at) if ready else None,
        reason=reason,
        detail=detail,
    )


GUARD_TTL_S = 5.0
FORBIDDEN = (401, 403)
MANIFESTS = "the deploy manifests (kubectl apply -k deploy/k8s/overlays/<env>)"


class KubeBackend:
    """Pods in one namespace of a real cluster."""

    name = "kubernetes"

    def __init__(
        self,
        kube: Kube,
        *,
        installation: str,
        execd_port: int = 8080,
        registry: RegistryClient | None = None,
    ) -> None:
        self.kube = kube
        self.registry = registry or RegistryClient({})
        self.installation = installation
        self.port = execd_port
        self._owners: dict[tuple[str, str], str] = {}
        self._execd: dict[str, tuple[str, list[str]]] = {}
        self._ingress: set[str] = set()  # namespaces whose ingress guard was seen or made
        self._watches: dict[str, PodWatch] = {}
        self._guards: dict[tuple[str, str], float] = {}  # verified until (monotonic)
        self._watch_lock = threading.Lock()

    @classmethod
    def from_settings(cls, settings: Settings) -> KubeBackend:
        kube = Kube(load_api_client(settings.kubeconfig))
        return cls(
            kube,
            installation=settings.installation_id,
            execd_port=settings.execd_port,
            registry=RegistryClient.from_setting(settings.registries),
        )

    # -- objects that must exist before pods ------------------------------------------

    def ensure_namespace(self, namespace: str, *, create: bool) -> None:
        """Make sure pods can be made in ``namespace``, creating it only when ``create``.

        Workers may create it (a fresh cluster then needs no ``kubectl create ns``); the
        admin UI is read-only and only checks. Either way a missing namespace or a refused
        permission is a NamespaceUnavailable that names both and says what to do, instead
        of surfacing later as a bare 404 on the first ConfigMap of the first create.
        """
        with self._in_namespace(namespace, "get serviceaccounts (name: default)"):
            if self.kube.namespace_ready(namespace):
                return
        if not create:
            raise NamespaceUnavailable(
                f"namespace {namespace} does not exist (or has no default ServiceAccount yet) "
                f"and this process does not create it: start the broker's workers, which do, "
                f"or create it with {MANIFESTS}",
                namespace=namespace,
                status=404,
            )
        with self._in_namespace(namespace, "create namespaces (cluster scope)"):
            self.kube.ensure_namespace(namespace)

    @contextlib.contextmanager
    def _in_namespace(self, namespace: str, permission: str) -> Iterator[None]:
        """Turn a 403 into "grant this", and a 404 whose cause is a missing namespace into
        "the namespace is gone", both naming the namespace; other errors pass unchanged."""
        try:
            yield
        except NamespaceUnavailable:
            raise
        except KubeNotFound as exc:
            if self.kube.namespace_ready(namespace):
                raise
            self._forget(namespace)
            raise NamespaceUnavailable(
                f"namespace {namespace} does not exist ({exc}): the broker's workers create it "
                f"when they start, so restart them, or create it with {MANIFESTS}",
                namespace=namespace,
                status=exc.status,
            ) from exc
        except KubeError as exc:
            if exc.status not in FORBIDDEN:
                raise
            raise NamespaceUnavailable(
                f"the broker's credentials may not {permission} in namespace {namespace} "
                f"(HTTP {exc.status}): grant it in the broker's Role (deploy/k8s/base/rbac.yaml)",
                namespace=namespace,
                missing=permission,
                status=exc.status,
            ) from exc

    def _forget(self, namespace: str) -> None:
        """Drop what was cached about objects in ``namespace`` (it was deleted under us)."""
        self._execd.pop(namespace, None)
        for cache in (self._owners, self._guards):
            for key in [k for k in cache if k[0] == namespace]:
                cache.pop(key, None)

    def _ensure_execd(self, namespace: str) -> tuple[str, list[str]]:
        cached = self._execd.get(namespace)
        if cached:
            return cached
        files = podspec.execd_files()
        if "__main__.py" not in files:
            raise KubeError("execd sources not found next to the broker package")
        name = podspec.execd_configmap_name(files)
        if self.kube.get_object("configmap", namespace, name) is None:
            with contextlib.suppress(KubeConflict):
                self.kube.create_object(
                    "configmap", namespace, podspec.execd_configmap(name, files, self.installation)
                )
        self._execd[namespace] = (name, sorted(files))
        return self._execd[namespace]

    def _ensure_ingress_guard(self, namespace: str) -> None:
        """The installation's ingress policy exists before its first pod (then cached).

        Like the egress guard, the policy object alone proves nothing: an engine must
        enforce it (tests/cluster/test_ingress.py checks that with real pods)."""
        if namespace in self._ingress:
            return
        name = podspec.ingress_policy_name(self.installation)
        if self.kube.get_object("networkpolicy", namespace, name) is None:
            with contextlib.suppress(KubeConflict):
                self.kube.create_object(
                    "networkpolicy", namespace, podspec.ingress_policy(self.installation, self.port)
                )
        self._ingress.add(namespace)

    def ensure_job_owner(self, namespace: str, job: str) -> None:
        with self._in_namespace(namespace, "get/create configmaps"):
            self._owner_uid(namespace, job)

    def _owner_uid(self, namespace: str, job: str) -> str:
        key = (namespace, job)
        if key in self._owners:
            return self._owners[key]
        found = self.kube.get_object("configmap", namespace, podspec.owner_name(job))
        if found is None:
            try:
                found = self.kube.create_object(
                    "configmap", namespace, podspec.owner_configmap(job, self.installation)
                )
            except KubeConflict:
                found = self.kube.get_object("configmap", namespace, podspec.owner_name(job))
        if found is None:
            raise KubeError(f"owner object for job {job} vanished while creating it")
        self._owners[key] = str(found["metadata"]["uid"])
        return self._owners[key]

    def ensure_egress_guard(self, namespace: str, job: str, allow: list[str]) -> None:
        if self._guard_fresh(namespace, job):
            return
        name = podspec.egress_policy_name(job)
        with self._in_namespace(namespace, "get/create networkpolicies"):
            if self.kube.get_object("networkpolicy", namespace, name) is None:
                with contextlib.suppress(KubeConflict):
                    self.kube.create_object(
                        "networkpolicy",
                        namespace,
                        podspec.egress_policy(job, self.installation, allow),
                    )

    def resolve_image(self, image: str, digest: str | None) -> str | None:
        """A HEAD of the manifest at the image's configured registry (cached briefly):
        the digest every pod of this request runs. A host that is not configured cannot be
        checked: the pod is created by tag (or by the request's own digest, trusted)."""
        ref = refs.pinned(image, digest) if digest else image
        if not self.registry.serves(ref):
            return digest
        return self.registry.resolve(ref)

    def ensure_prepull(self, namespace: str, want: PrePullSpec) -> str:
        name = podspec.prepull_name(self.installation, want.job, want.image)
        with self._in_namespace(namespace, "get/create daemonsets"):
            if self.kube.get_object("daemonset", namespace, name) is None:
                body = podspec.prepull_daemonset(
                    installation=self.installation,
                    job=want.job,
                    image=want.image,
                    node_selector=want.node_selector,
                    tolerations=want.tolerations,
                    owner_uid=self._owner_uid(namespace, want.job),
                )
                with contextlib.suppress(KubeConflict):
                    self.kube.create_object("daemonset", namespace, body)
        return name

    def prepulls(self, namespace: str) -> list[PrePullInfo]:
        out = []
        for item in self.kube.list_daemonsets(namespace, f"{LABEL_PREPULL}={self.installation}"):
            meta, status = item.get("metadata") or {}, item.get("status") or {}
            out.append(
                PrePullInfo(
                    name=str(meta.get("name")),
                    job=str((meta.get("labels") or {}).get(LABEL_PREPULL_JOB, "")),
                    image=str((meta.get("annotations") or {}).get("sandman.io/image", "")),
                    desired=int(status.get("desiredNumberScheduled") or 0),
                    ready=int(status.get("numberReady") or 0),
                    uid=meta.get("uid"),
                )
            )
        return sorted(out, key=lambda p: p.name)

    def remove_prepull(self, namespace: str, info: PrePullInfo) -> None:
        with contextlib.suppress(KubeNotFound):
            self.kube.delete_daemonset(namespace, info.name, uid=info.uid)

    def pull_record(self, info: PodInfo) -> PodInfo:
        try:
            events = self.kube.pod_events(info.namespace, info.name)
        except KubeError as exc:  # a record, not a reason to fail a Ready pod
            log.info("events of %s unreadable: %s", info.name, exc)
            return info
        pulled, seconds = pull_from_events(events)
        if pulled is None:
            return info
        return dataclasses.replace(
            info, pulled=pulled, image_pull_s=seconds if pulled else info.image_pull_s
        )

    def has_egress_guard(self, namespace: str, job: str) -> bool:
        """Read back from the API server; a positive answer is trusted for GUARD_TTL_S,
        so a burst of creates costs one read per job, not two per pod."""
        if self._guard_fresh(namespace, job):
            return True
        name = podspec.egress_policy_name(job)
        present = self.kube.get_object("networkpolicy", namespace, name) is not None
        if present:
            self._guards[(namespace, job)] = time.monotonic() + GUARD_TTL_S
        return present

    def _guard_fresh(self, namespace: str, job: str) -> bool:
        return self._guards.get((namespace, job), 0.0) > time.monotonic()

    # -- pods --------------------------------------------------------------------------

    def create(self, spec: PodSpec) -> PodInfo:
        with self._in_namespace(spec.namespace, "get/create networkpolicies"):
            self._ensure_ingress_guard(spec.namespace)
        with self._in_namespace(spec.namespace, "get/create configmaps"):
            execd_name, keys = self._ensure_execd(spec.namespace)
            owner_uid = self._owner_uid(spec.namespace, spec.job)
        body = podspec.pod_manifest(
            spec, execd_configmap=execd_name, execd_keys=keys, port=self.port, owner_uid=owner_uid
        )
        # following before the POST: its events are not missed
        self._watch(spec.namespace).expect(spec.name)
        try:
            with self._in_namespace(spec.namespace, "create secrets"):
                self._ensure_token_secret(spec, owner_uid)
            with self._in_namespace(spec.namespace, "create pods"):
                return pod_info(self.kube.create_pod(spec.namespace, body), self.port)
        except KubeNotFound:
            # The owner object was deleted under us (cache stale): refresh once.
            self._owners.pop((spec.namespace, spec.job), None)
            raise

    def _ensure_token_secret(self, spec: PodSpec, owner_uid: str) -> None:
        """The pod's token Secret, before the pod (kubelet mounts it at start).

        Creation is idempotent like the pod's: a Secret already there from a retry
        of this very create (same nonce) is kept; one left by another pod of the same
        name is refused, never reused.
        """
        try:
            self.kube.create_object("secret", spec.namespace, podspec.token_secret(spec, owner_uid))
        except KubeConflict:
            found = self.kube.get_object(
                "secret", spec.namespace, podspec.token_secret_name(spec.name)
            )
            labels = ((found or {}).get("metadata") or {}).get("labels") or {}
            if labels.get(LABEL_NONCE) != spec.nonce:
                raise

    def _delete_token_secret(self, namespace: str, name: str, nonce: str) -> None:
        """Delete the pod's token Secret if it is this pod's (nonce and installation match)."""
        secret = self.kube.get_object("secret", namespace, podspec.token_secret_name(name))
        if secret is None:
            return
        meta = secret.get("metadata") or {}
        labels = meta.get("labels") or {}
        if labels.get(LABEL_NONCE) != nonce or labels.get(LABEL_INSTALLATION) != self.installation:
            return  # another pod's of the same name: not ours to remove
        with contextlib.suppress(KubeNotFound, KubeConflict):
            self.kube.delete_secret(namespace, podspec.token_secret_name(name), uid=meta.get("uid"))

    def get(self, namespace: str, name: str) -> PodInfo | None:
        pod = self.kube.get_pod(namespace, name)
        return pod_info(pod, self.port) if pod else None

    def delete(self, namespace: str, name: str, nonce: str) -> bool:
        pod = self.kube.get_pod(namespace, name)
        if pod is None:
            self._delete_token_secret(namespace, name, nonce)  # a create that died in between
            return True
        labels = (pod.get("metadata") or {}).get("labels") or {}
        if labels.get(LABEL_NONCE) != nonce or labels.get(LABEL_INSTALLATION) != self.installation:
            raise OwnershipError(f"refusing to delete {name}: nonce/installation mismatch")
        self._watch(namespace).expect(name)  # its deletion is waited for next (wait_gone)
        try:
            self.kube.delete_pod(namespace, name, uid=pod["metadata"].get("uid"))
        except KubeNotFound:
            pass
        except KubeConflict as exc:  # UID precondition failed: a different object now
            raise OwnershipError(f"{name} was replaced; not deleting it") from exc
        self._delete_token_secret(namespace, name, nonce)
        return True

    def list_installation(self, namespace: str, installation: str) -> list[PodInfo]:
        pods, _ = self.kube.list_pods(namespace, f"{LABEL_INSTALLATION}={installation}")
        return [pod_info(p, self.port) for p in pods]

    def list_all_labelled(self, namespace: str) -> list[PodInfo]:
        pods, _ = self.kube.list_pods(namespace, LABEL_NONCE)
        return [pod_info(p, self.port) for p in pods]

    def _watch(self, namespace: str) -> PodWatch:
        with self._watch_lock:
            watch = self._watches.get(namespace)
            if watch is None:
                watch = PodWatch(
                    self.kube,
                    namespace,
                    f"{LABEL_INSTALLATION}={self.installation}",
                    lambda pod: pod_info(pod, self.port),
                )
                self._watches[namespace] = watch
            return watch

    def watch_ready(self, namespace: str, names: set[str], timeout_s: float) -> Iterator[PodInfo]:
        """Current state first, then changes, from the process's shared pod watch."""
        deadline = time.monotonic() + timeout_s
        watch = self._watch(namespace)
        for name in sorted(names):
            for info in watch.follow(name, deadline, lambda n: self.get(namespace, n)):
                yield info if info is not None else _deleted(namespace, name)

    def wait_gone(self, namespace: str, name: str, timeout_s: float) -> bool:
        return self._watch(namespace).wait_gone(name, timeout_s, lambda n: self.get(namespace, n))

    def close(self) -> None:
        with self._watch_lock:
            for watch in self._watches.values():
                watch.close()
            self._watches.clear()
        self.registry.close()


def _deleted(namespace: str, name: str) -> PodInfo:
    return PodInfo(
        name=name, namespace=namespace, labels={}, phase="Failed", ready=False, reason="Deleted"
    )
